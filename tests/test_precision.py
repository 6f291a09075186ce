"""Mixed precision on CPU: FP32 master weights under bf16 autocast, the bf16 loss curve against fp32's, and
non-finite steps skipped, counted and, past the stage's limit, stopping the stage.

A micro Llama (2 layers, hidden 32) on word-level text trains through the pipeline's own SFT path
(`stages.sft.train`, or `sft_args` + SFTTrainer + `fit`). Measured on 2 CPU cores: over 20 steps the bf16
losses differ from fp32's by at most 3e-4 (losses ~4); BF16_TOL leaves a margin.
"""

from __future__ import annotations

import random
from pathlib import Path

import datasets
import pytest
import torch
from omegaconf import OmegaConf
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import SFTTrainer

from pipeline.data import tokcache
from pipeline.errors import ConfigError
from pipeline.settings import ModelConfig
from pipeline.stages import sft
from pipeline.stages.sft import SftSettings
from pipeline.train import precision
from pipeline.train import trainer as training
from pipeline.train.models import load_model

BF16_TOL = 5e-3  # absolute, per logged step, bf16 vs fp32 (measured max 3e-4)
WORDS = [f"w{i}" for i in range(60)]


@pytest.fixture(scope="module")
def micro(tmp_path_factory) -> tuple[Path, PreTrainedTokenizerFast, datasets.Dataset]:
    """A micro checkpoint with its tokenizer, and 400 text rows."""
    path = tmp_path_factory.mktemp("micro")
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=word_level, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    tok.save_pretrained(path)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                 tie_word_embeddings=True)).save_pretrained(path)
    rng = random.Random(0)
    rows = [{"text": " ".join(WORDS[(i + j * rng.choice([1, 2])) % 60] for j in range(rng.randint(5, 40)))}
            for i in range(400)]
    return path, tok, datasets.Dataset.from_list(rows)


def _stage(**kw) -> SftSettings:
    return OmegaConf.structured(SftSettings(
        mixture="micro", format="text", packing_strategy="wrapped", assistant_only_loss=False,
        gradient_checkpointing=False, logging_steps=1, max_length=64, per_device_train_batch_size=4,
        learning_rate=3e-3, warmup_ratio=0, save_steps=1000, **kw))


def _model_cfg(path: Path, precision_: str, **kw) -> ModelConfig:
    return OmegaConf.structured(ModelConfig(name_or_path=str(path), precision=precision_, **kw))


def _trainer(micro, tmp_path: Path, stage, model_cfg) -> SFTTrainer:
    path, tok, rows = micro
    data = tokcache.tokenised(rows, stage, tok, tmp_path / "cache", "micro")
    args = sft.sft_args(stage, tmp_path / "work", 0, model_cfg.precision)
    return SFTTrainer(model=load_model(path, model_cfg), args=args, train_dataset=data, processing_class=tok)


def test_bf16_step_keeps_fp32_master_weights_and_adam_states(micro, tmp_path):
    trainer = _trainer(micro, tmp_path, _stage(max_steps=2), _model_cfg(micro[0], "bf16"))
    seen = []
    trainer.model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    trainer.train()
    assert trainer.args.bf16 and seen and set(seen) == {torch.bfloat16}  # the matmuls ran under bf16 autocast
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    states = list(trainer.optimizer.state.values())
    assert states and {s[k].dtype for s in states for k in ("exp_avg", "exp_avg_sq")} == {torch.float32}


def test_bf16_loss_curve_tracks_fp32(micro, tmp_path):
    path, tok, rows = micro
    curves = {}
    for name in ("fp32", "bf16"):
        metrics = sft.train(_stage(max_steps=20), _model_cfg(path, name), path, tok, rows, tmp_path / name, 0,
                            tmp_path / "cache")
        curves[name] = [loss for _, loss in metrics["losses"]]
        assert metrics["nonfinite_steps"] == 0
    assert len(curves["bf16"]) == 20 and curves["fp32"][-1] < curves["fp32"][0] - 0.2  # a curve that moves
    assert curves["bf16"] == pytest.approx(curves["fp32"], abs=BF16_TOL)


def test_medium_matmul_precision_holds_in_training_steps_only_and_tracks_fp32(micro, tmp_path):
    path, tok, rows = micro
    seen, curves = [], {}
    for name in ("highest", "medium"):
        stage = _stage(max_steps=20, matmul_precision=name)
        trainer = _trainer(micro, tmp_path / name, stage, _model_cfg(path, "fp32"))
        trainer.model.model.layers[0].mlp.register_forward_hook(
            lambda m, i, out: seen.append(torch.get_float32_matmul_precision()))
        metrics = training.fit(trainer, tok, tmp_path / name, nonfinite_limit=0, matmul_precision=name)
        curves[name] = [loss for _, loss in metrics["losses"]]
        assert metrics["matmul_precision"] == name and torch.get_float32_matmul_precision() == "highest"
    assert set(seen) == {"highest", "medium"} and seen[-1] == "medium"  # set while the steps ran, restored after
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    assert curves["medium"] == pytest.approx(curves["highest"], abs=BF16_TOL)  # bf16 products, fp32 sums


def _poison_steps(trainer: SFTTrainer, bad: set[int]) -> None:
    """Make the gradient of one weight infinite in the given (1-based) backward passes."""
    calls = []

    def hook(grad: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return grad * float("inf") if len(calls) in bad else grad

    trainer.model.model.embed_tokens.weight.register_hook(hook)


def test_nonfinite_steps_are_skipped_and_counted(micro, tmp_path):
    trainer = _trainer(micro, tmp_path, _stage(max_steps=6), _model_cfg(micro[0], "fp32"))
    _poison_steps(trainer, {3, 4})
    metrics = training.fit(trainer, micro[1], tmp_path, nonfinite_limit=5)
    assert metrics["nonfinite_steps"] == 2 and metrics["steps"] == 6
    # AdamW stepped every parameter only in the 4 clean steps: the skipped ones left weights and moments alone
    assert {int(s["step"]) for s in trainer.optimizer.state.values()} == {4}
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_too_many_nonfinite_steps_stop_the_stage(micro, tmp_path):
    trainer = _trainer(micro, tmp_path, _stage(max_steps=6), _model_cfg(micro[0], "fp32"))
    _poison_steps(trainer, {2, 3})
    with pytest.raises(precision.NonFiniteLimit, match=r"2 optimizer steps had non-finite .*nonfinite_limit=1"):
        training.fit(trainer, micro[1], tmp_path, nonfinite_limit=1)


def test_weights_load_in_fp32_unless_deepspeed_or_asked(micro):
    path = micro[0]
    assert precision.load_dtype(_model_cfg(path, "bf16"), deepspeed=False) == torch.float32
    assert precision.load_dtype(_model_cfg(path, "bf16"), deepspeed=True) == torch.bfloat16
    assert precision.load_dtype(_model_cfg(path, "fp32"), deepspeed=True) == torch.float32
    assert precision.load_dtype(_model_cfg(path, "bf16", load_dtype="bf16"), deepspeed=False) == torch.bfloat16
    assert precision.trainer_flags("bf16") == {"bf16": True, "fp16": False}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusals")
@pytest.mark.parametrize("refused, message", [
    (lambda: precision.trainer_flags("fp16"), "fp16 needs a CUDA GPU"),
    (lambda: precision.memory_args(_stage(use_liger_kernel=True)), "use_liger_kernel=true needs a CUDA GPU"),
    (lambda: precision.memory_args(_stage(activation_offloading=True)), "activation_offloading=true needs a CUDA")])
def test_gpu_only_settings_are_refused_on_cpu(refused, message):
    with pytest.raises(ConfigError, match=message):
        refused()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU's bf16")
@pytest.mark.parametrize("machine, native, setting, warned", [
    ("x86_64", False, "bf16", True), ("x86_64", True, "bf16", False), ("x86_64", False, "fp32", False),
    ("x86_64", False, "auto", False), ("aarch64", False, "bf16", False)])
def test_bf16_on_a_cpu_that_emulates_it_is_a_warning_at_start(machine, native, setting, warned, monkeypatch, caplog):
    from pipeline.chain import preflight

    monkeypatch.setattr(precision.platform, "machine", lambda: machine)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    cfg = OmegaConf.create({"model": {"precision": setting}, "stages": []})
    preflight.device_settings(cfg)
    said = [r.getMessage() for r in caplog.records if "emulates bf16" in r.getMessage()]
    assert said == (["model.precision=bf16 on a CPU without bf16 instructions (avx512_bf16, AMX): torch emulates bf16 "
                     "products, about 15x slower than fp32 here; model.precision=fp32 trains faster on this machine"]
                    if warned else [])
