"""Sequence rewards shared by the PPO and GRPO stages: a verifier or a reward model.

- a verifier (`pipeline.evaluation.verifiers`: the built-in `gsm8k`, also named `verifiable`, or any
  `module:function`): its score of the response against the known `answer`; plus `format_reward` when the
  response has a `#### N` line at all.
- model: the scalar output of a sequence classifier (TRL RewardTrainer checkpoint) on the chat
  prompt + response rendered through the chat template.

`reward_model` names a checkpoint path or an earlier stage of this run (`stages/NN-<name>/model`), e.g. one
trained by the `reward` stage (`pipeline.stages.reward_model`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pipeline.errors import ConfigError
from pipeline.evaluation import verifiers
from pipeline.evaluation.gsm import extract_answer
from pipeline.runfolder import earlier_stage_model
from pipeline.train.models import load_model, load_tokenizer
from pipeline.train.precision import inference_dtype

Chat = list[dict]


def as_chat(prompt: Any) -> Chat:
    """A prompt as a chat: a plain string becomes one user turn."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


def resolve_reward_model(name: str, stage_dir: Path) -> Path:
    """A reward model checkpoint: a path, or the `model/` of an earlier stage of this run named `name`."""
    if not name:
        raise ConfigError("reward: model needs `reward_model` (a checkpoint path or the name of a reward stage)")
    found = earlier_stage_model(stage_dir, name)
    if found is not None:
        return found
    if Path(name).is_dir():
        return Path(name)
    raise ConfigError(f"reward_model '{name}' is neither a checkpoint folder nor a finished earlier stage")


class RewardModel:
    """Scores (prompt chat, response text) pairs with a sequence classifier (one output), batched."""

    def __init__(self, model: Any, tok: Any, batch_size: int = 32):
        self.model, self.tok, self.batch_size = model, tok, batch_size

    @classmethod
    def load(cls, path: Path, model_cfg: Any, device: Any = "cpu", batch_size: int = 32) -> RewardModel:
        """The reward model saved at `path` (a classifier with its tokenizer), on `device`, in eval mode and in
        `model.precision`'s inference dtype."""
        tok = load_tokenizer(path, model_cfg, saved=True)
        model = load_model(path, model_cfg, "classifier", saved=True, dtype=inference_dtype(model_cfg.precision))
        model = model.to(device).eval()
        model.config.pad_token_id = tok.pad_token_id
        return cls(model, tok, batch_size)

    @torch.no_grad()
    def __call__(self, prompts: list[Chat], responses: list[str]) -> list[float]:
        texts = [self.tok.apply_chat_template(as_chat(p) + [{"role": "assistant", "content": r}], tokenize=False)
                 for p, r in zip(prompts, responses, strict=True)]
        side, self.tok.padding_side = self.tok.padding_side, "right"
        out: list[float] = []
        try:
            for s in range(0, len(texts), self.batch_size):
                enc = self.tok(texts[s:s + self.batch_size], return_tensors="pt", padding=True,
                               add_special_tokens=False).to(self.model.device)
                out.extend(self.model(**enc).logits[:, 0].float().tolist())
        finally:
            self.tok.padding_side = side
        return out


def reward_function(stage: Any, stage_dir: Path, model_cfg: Any, device: Any = "cpu"):
    """`fn(prompts, responses, answers) -> scores` for the stage's `reward`: a verifier (`verifiers.load`), or the
    reward model (`model`, loaded with the recipe's `model.*` settings)."""
    if stage.reward != "model":
        verify = verifiers.load(stage.reward, "reward")

        def score(prompts: list[Chat], responses: list[str], answers: list[str]) -> list[float]:
            return [s + (stage.format_reward if extract_answer(r) is not None else 0.0)
                    for s, r in zip(verify(responses, answers), responses, strict=True)]
        return score
    model = RewardModel.load(resolve_reward_model(stage.reward_model, stage_dir), model_cfg, device)

    def score_model(prompts: list[Chat], responses: list[str], answers: list[str] | None = None) -> list[float]:
        return model(prompts, responses)
    return score_model


def load_prompts(stage: Any, cfg: Any, kind: str) -> Any:
    """The RL stage's data or mixture with its prompts as chats; refuses one without `prompt` (and `answer`, which a
    verifier checks against)."""
    from pipeline.data.mixtures import load_mixture, source_name
    from pipeline.settings import data_source

    data = load_mixture(data_source(stage), cfg)
    if "prompt" not in data.column_names or (stage.reward != "model" and "answer" not in data.column_names):
        raise ConfigError(f"{kind} {source_name(data_source(stage))} needs `prompt` and `answer` columns; it has "
                          f"{sorted(data.column_names)}")
    return data.map(lambda r: {"prompt": as_chat(r["prompt"])})
