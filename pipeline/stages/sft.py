"""SFT and reasoning mid-training: one code path (same trainer, different data and settings)."""

from __future__ import annotations

from pipeline.config import cache_dir
from pipeline.data import load_mixture
from pipeline.stage import StageContext
from pipeline.training import load_tokenizer, train


def run(ctx: StageContext) -> dict:
    """Train the input checkpoint on the stage's mixture; the result lands in `ctx.stage_dir/model`."""
    tok = load_tokenizer(ctx.input_model, ctx.cfg.model, need_template=ctx.stage.format == "chat")
    render = None
    if ctx.stage.format == "text" and tok.chat_template:
        def render(row: dict) -> str:
            return tok.apply_chat_template(row["messages"], tokenize=False, **(row.get("chat_template_kwargs") or {}))
    dataset = load_mixture(ctx.stage.mixture, ctx.cfg, render)
    return train(ctx.stage, ctx.cfg.model, ctx.input_model, tok, dataset, ctx.stage_dir, ctx.cfg.seed,
                 cache_dir(ctx.cfg))
