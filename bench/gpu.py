"""The GPU kit: SFT and DPO speed and memory of SmolLM2-shaped models through the pipeline's own trainers.

    python -m bench.gpu [--json out.json]   (from the checkout root)

On a CUDA device (under 5 minutes on one H100/H200): randomly initialised SmolLM2-135M- and 360M-shaped
Llamas (their configs: tied embeddings, vocabulary 49152) train SFT with packing (bfd, padding-free) on
random documents at sequence length 2048 and 8192, with dense sdpa and with the varlen attention the stack
offers (flash_attention_2 if flash-attn is installed, else flex_attention); then at 8192 with TRL's
activation offloading on (peak memory, and the loss against offloading off); then a DPO step of the 135M
shape. Without CUDA it runs a one-minute variant (a tiny shape, length 128) so CI keeps it working.

Every run is the pipeline's: `stages.sft.sft_args` / `stages.dpo.dpo_args`, `load_model` (fp32 master weights, bf16
autocast) and `fit` (telemetry). tokens/s counts trained tokens over compute time (step begin to end);
MFU (pipeline.train.flops) takes the attention term at the mean document length, since packed documents do not
attend to each other; peak memory is `torch.cuda.max_memory_allocated`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import tempfile
from pathlib import Path

import datasets
import torch
from omegaconf import OmegaConf
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import DPOTrainer, SFTTrainer

from pipeline.settings import ModelConfig
from pipeline.stages import dpo, sft
from pipeline.stages.dpo import DpoSettings as DpoConfig
from pipeline.stages.sft import SftSettings as TrainConfig
from pipeline.train import trainer as training
from pipeline.train.flops import flops_per_token, peak_flops
from pipeline.train.models import load_model

GPU = torch.cuda.is_available()
COMMON = {"vocab_size": 49152, "tie_word_embeddings": True, "max_position_embeddings": 8192, "rope_theta": 100000.0}
SHAPES = {
    "135M": {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
             "intermediate_size": 1536, **COMMON},
    "360M": {"hidden_size": 960, "num_hidden_layers": 32, "num_attention_heads": 15, "num_key_value_heads": 5,
             "intermediate_size": 2560, **COMMON},
} if GPU else {"tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                        "intermediate_size": 128, "vocab_size": 1024, "tie_word_embeddings": True,
                        "max_position_embeddings": 256}}
LENGTHS = (2048, 8192) if GPU else (128,)
STEPS = 12 if GPU else 3
WORDS = 1000  # the word-level tokenizer's vocabulary (DPO text); SFT rows are token ids over the whole vocabulary


def varlen_attention() -> str:
    """The packed-sequence attention this stack offers: flash_attention_2 with flash-attn, else flex_attention."""
    return "flash_attention_2" if importlib.util.find_spec("flash_attn") else "flex_attention"


def build(shape: dict, out: Path) -> PreTrainedTokenizerFast:
    """A randomly initialised model of `shape` and a word-level tokenizer, saved to `out`."""
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(WORDS)}}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=word_level, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    tok.save_pretrained(out)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**shape)).save_pretrained(out)
    return tok


def documents(length: int, vocab: int, tokens: int) -> datasets.Dataset:
    """Random documents of length/8 to length tokens, `tokens` in all (pre-tokenised rows)."""
    rng, rows, total = random.Random(0), [], 0
    while total < tokens:
        n = rng.randint(length // 8, length)
        rows.append({"input_ids": [rng.randrange(3, vocab) for _ in range(n)]})
        total += n
    return datasets.Dataset.from_list(rows)


def sft_row(path: Path, tok, shape: dict, length: int, attn: str, offload: bool, work: Path) -> dict:
    """One SFT measurement: tokens/s, MFU, peak memory and the last loss."""
    stage = OmegaConf.structured(TrainConfig(
        mixture="random", format="text", packing=True, packing_strategy="bfd", padding_free=True,
        assistant_only_loss=False, gradient_checkpointing=False, activation_offloading=offload, max_steps=STEPS,
        logging_steps=1, save_steps=10_000, max_length=length, per_device_train_batch_size=1, warmup_ratio=0))
    model_cfg = OmegaConf.structured(ModelConfig(name_or_path=str(path), attn_implementation=attn))
    data = documents(length, shape["vocab_size"], length * (STEPS + 2))
    args = sft.sft_args(stage, work / "work", 0, model_cfg.precision)
    if GPU:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    trainer = SFTTrainer(model=load_model(path, model_cfg), args=args, train_dataset=data,
                         processing_class=tok)
    m = training.fit(trainer, tok, work, nonfinite_limit=0)
    tokens_per_s = m["tokens"] / m["compute_s"]
    mean_doc = sum(len(r) for r in data["input_ids"]) / len(data)
    per_token = flops_per_token(sum(p.numel() for p in trainer.model.parameters()), shape["num_hidden_layers"],
                                shape["hidden_size"], mean_doc)
    peak = peak_flops(torch.cuda.get_device_name(0) if GPU else None, "bf16" if args.bf16 else "fp32")
    return {"tokens_per_s": round(tokens_per_s), "mfu": round(tokens_per_s * per_token / peak, 3) if peak else None,
            "peak_memory_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if GPU else None,
            "loss_last": round(m["loss_last"], 4)}


def dpo_row(path: Path, tok, length: int, work: Path) -> dict:
    """Seconds per DPO step (sigmoid loss, reference log-probs on the fly), prompt and answers length/2 words."""
    stage = OmegaConf.structured(DpoConfig(mixture="random", max_steps=STEPS, logging_steps=1, save_steps=10_000,
                                           per_device_train_batch_size=2, max_length=length,
                                           gradient_checkpointing=False, warmup_ratio=0, beta=0.1,
                                           precompute_ref_log_probs=False))
    model_cfg = OmegaConf.structured(ModelConfig(name_or_path=str(path)))
    rng = random.Random(0)

    def text(n: int) -> str:
        return " ".join(f"w{rng.randrange(WORDS)}" for _ in range(n))

    pairs = datasets.Dataset.from_list([{"prompt": text(length // 2), "chosen": text(length // 2),
                                         "rejected": text(length // 2)} for _ in range(2 * STEPS + 4)])
    args = dpo.dpo_args(stage, work / "work", 0, model_cfg.precision)
    trainer = DPOTrainer(model=load_model(path, model_cfg), ref_model=None, args=args, train_dataset=pairs,
                         processing_class=tok)
    m = training.fit(trainer, tok, work, nonfinite_limit=0)
    return {"step_s": round(m["compute_s"] / m["steps"], 3), "loss_last": round(m["loss_last"], 4)}


def attempt(fn, *args) -> dict:
    """Run one measurement; a configuration the stack cannot run becomes a row saying why."""
    try:
        return fn(*args)
    except Exception as err:  # noqa: BLE001 - the kit reports every failure as a row and goes on
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:120]}" if str(err) else type(err).__name__}


def measure(root: Path) -> list[dict]:
    """Every row of the kit's table."""
    rows, varlen = [], varlen_attention()
    for name, shape in SHAPES.items():
        path = root / name
        tok = build(shape, path)
        for length in LENGTHS:
            for attn in ("sdpa", varlen):
                rows.append({"model": name, "run": "sft", "length": length, "attention": attn, "offload": False,
                             **attempt(sft_row, path, tok, shape, length, attn, False, root / f"w{len(rows)}")})
        rows.append({"model": name, "run": "sft", "length": LENGTHS[-1], "attention": varlen, "offload": True,
                     **attempt(sft_row, path, tok, shape, LENGTHS[-1], varlen, True, root / f"w{len(rows)}")})
    first = next(iter(SHAPES))
    rows.append({"model": first, "run": "dpo", "length": LENGTHS[0] // 2, "attention": "sdpa", "offload": False,
                 **attempt(dpo_row, root / first, build(SHAPES[first], root / first), LENGTHS[0] // 2, root / "dpo")})
    return rows


def table(rows: list[dict]) -> str:
    """The rows as a fixed-width text table."""
    cols = ["model", "run", "length", "attention", "offload", "tokens_per_s", "mfu", "peak_memory_gb", "step_s",
            "loss_last", "error"]
    cells = [[str(r.get(c, "")) if r.get(c) is not None else "-" for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def main() -> None:
    """Measure and print the table (and write JSON with --json)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = measure(Path(tmp))
    device = torch.cuda.get_device_name(0) if GPU else "cpu (the one-minute variant)"
    print(f"GPU kit on {device}, torch {torch.__version__}, {STEPS} steps per row")
    print(table(rows))
    if opts.json:
        opts.json.write_text(json.dumps({"device": device, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
