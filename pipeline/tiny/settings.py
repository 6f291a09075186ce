"""The tiny demo's config section (`tiny.*` keys): its synthetic data, tokenizer, model shape and pretraining."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.settings import arg


@dataclass
class TinyConfig:
    """The embedded tiny setup: synthetic GSM8K-style data, a local tokenizer and a tiny model."""

    seed: int = arg("seed of the synthetic data and the model's initialisation", 0)
    sft_examples: int = arg("chat problems in the sft split", 4000)
    midtrain_examples: int = arg("rows in the reasoning and arithmetic splits", 4000)
    general_examples: int = arg("rows in the general text split", 4000)
    pretrain_examples: int = arg("documents in the pretraining split", 6000)
    test_examples: int = arg("held-out test problems (task tiny_gsm: the report)", 200)
    validation_examples: int = arg("held-out validation problems (task tiny_gsm_val: gates and sweep selection)", 500)
    vocab_size: int = arg("BPE vocabulary size (an upper bound)", 1024)
    hidden_size: int = arg("model width", 128)
    num_layers: int = arg("transformer layers", 4)
    num_heads: int = arg("attention heads", 4)
    intermediate_size: int = arg("MLP width", 512)
    max_position_embeddings: int = arg("longest sequence the model takes", 512)
    pretrain_steps: int = arg("pretraining steps of the base model", 300)
    pretrain_batch_size: int = arg("pretraining batch size", 16)
    pretrain_max_length: int = arg("pretraining sequence length", 256)
    pretrain_learning_rate: float = arg("pretraining learning rate", 2e-3)
    matmul_precision: str = arg("the pretraining's fp32 matrix products (highest | high | medium; see a stage's "
                                "matmul_precision)", "highest", added=True,
                                choices=("highest", "high", "medium"))
