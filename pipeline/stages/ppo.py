"""PPO stage: our actor-critic loop (`pipeline.rl.actor_critic.PPOLoop`) from the input checkpoint.

Policy = the input checkpoint (LoRA adapter on it when `lora.r > 0`); reference = a frozen copy (with
LoRA: the adapter-disabled base); value model = a one-output sequence classifier initialised from the
policy (`value_init: policy`) or from the reward model (`value_init: reward_model`). Prompts come
from the mixture (a string prompt becomes one user turn); the reward is a verifier of the response against
`answer` (the built-in `#### N` check, or a function by reference) or a reward model. Where the base model ships
held-out problems, the mean `#### N` reward of greedy answers on them is measured before and after training
(`heldout_reward_*`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeline.errors import ConfigError
from pipeline.rl import diagnostics
from pipeline.settings import StageKind, StageSettings, arg

if TYPE_CHECKING:
    from pipeline.rl.actor_critic import PPOLoop, ValueModel

log = logging.getLogger("pipeline")


@dataclass
class RlSettings(StageSettings):
    """What the RL stages (ppo, grpo) share: the reward and how responses are sampled."""

    reward: str = arg("a verifier of the response against the row's `answer`: verifiable or gsm8k (the built-in `#### "
                      "N` check), or module:function, fn(completions, answers) -> list[float] "
                      "(docs/training.md); model: a reward model", "verifiable")
    reward_model: str = arg("a checkpoint path, or the name of an earlier `reward` stage", "", path="marked")
    format_reward: float = arg("added when the response has a `#### N` line at all", 0.0)
    max_new_tokens: int = arg("most tokens generated per response", 128)
    temperature: float = arg("sampling temperature of the rollouts", 1.0)
    backend: str = arg("hf | vllm: grpo samples with TRL's vLLM integration (colocate mode); ppo samples with "
                       "transformers only", "hf", added=True, choices=("hf", "vllm"))


@dataclass
class PpoSettings(RlSettings):
    """Our actor-critic PPO on accelerate. `max_steps` counts PPO updates; `mixture` gives prompts (+ answers)."""

    value_init: str = arg("policy | reward_model: where the value model starts", "policy",
                          choices=("policy", "reward_model"))
    rollout_batch_size: int = arg("prompts per update and process", 16)
    unfinished_penalty: float = arg("reward for a response that never ends (no EOS within max_new_tokens)", -1.0)
    kl_coef: float = arg("weight of the per-token KL penalty against the reference (initial value when adaptive)", 0.05)
    kl_estimator: str = arg("k1 | k3", "k1", choices=("k1", "k3"))
    kl_target: float = arg("> 0: adaptive KL coefficient (Ziegler et al.) aiming at this KL", 0.0)
    gamma: float = arg("discount factor of GAE", 1.0)
    lam: float = arg("lambda of GAE", 0.95)
    ppo_epochs: int = arg("passes over each rollout batch", 4)
    num_minibatches: int = arg("minibatches per pass (each one optimiser step)", 4)
    clip_range: float = arg("policy ratio clip range", 0.2)
    clip_range_value: float = arg("value clip range around the rollout's values", 0.2)
    vf_coef: float = arg("weight of the value loss", 0.5)
    whiten_advantages: bool = arg("normalise advantages to zero mean and unit variance across processes", True)


class Rl(StageKind):
    """What the RL kinds share: prompts (with answers for a verifier), sampled by the stage itself."""

    generates = True

    def formats(self, stage: Any) -> list[str]:
        return ["prompt-only"] if stage.reward == "model" else ["prompt with answer"]

    def check(self, cfg: Any, name: str) -> None:
        if cfg[name].reward != "model":
            from pipeline.evaluation import verifiers

            verifiers.load(cfg[name].reward, f"{name}.reward")  # imported and its signature read, not called


class Ppo(Rl):
    name, settings, help, order = "ppo", PpoSettings, "actor-critic PPO", 70
    no_deepspeed = ("its loop trains a policy and a value model in one Accelerator; accelerate's DeepSpeed takes one "
                    "model per engine")
    defaults = {"learning_rate": 1e-6, "lr_scheduler_type": "constant", "max_steps": 100}  # noqa: RUF012

    def check(self, cfg: Any, name: str) -> None:
        super().check(cfg, name)
        stage = cfg[name]
        if stage.backend == "vllm":
            raise ConfigError(f"'{name}.backend' is vllm: PPO's rollouts come from the policy being trained in this "
                              "process, and loading its new weights into a vLLM engine before each rollout is not "
                              f"implemented; use {name}.backend=hf, or the grpo stage with grpo.backend=vllm (TRL's "
                              "colocated vLLM)")
        parts = stage.num_minibatches * max(1, stage.gradient_accumulation_steps)
        if stage.rollout_batch_size % parts:
            raise ConfigError(f"{name}.rollout_batch_size={stage.rollout_batch_size} must be divisible by "
                              f"{name}.num_minibatches x {name}.gradient_accumulation_steps = {stage.num_minibatches} "
                              f"x {max(1, stage.gradient_accumulation_steps)} = {parts}")

    def train(self, ctx: Any) -> dict:
        return run(ctx)


KIND = Ppo()
SUMMARY = ("reward_mean", "reward_std", "kl", "entropy", "clipfrac", "approx_kl", "value_loss", "explained_variance",
           "response_length")


def _value_model(ctx: Any, pad_id: int) -> ValueModel:
    import torch

    from pipeline.rl.actor_critic import ValueModel
    from pipeline.rl.rewards import resolve_reward_model
    from pipeline.train.models import load_model
    from pipeline.train.precision import load_dtype

    stage = ctx.stage
    policy_init = stage.value_init == "policy"
    source = ctx.input_model if policy_init else resolve_reward_model(stage.reward_model, ctx.stage_dir)
    classifier = load_model(source, ctx.cfg.model, "classifier", saved=not policy_init,
                            dtype=load_dtype(ctx.cfg.model, deepspeed=False))
    classifier.config.pad_token_id = pad_id
    if policy_init:
        torch.nn.init.zeros_(classifier.score.weight)  # start from V = 0 rather than random values
    return ValueModel(classifier)


def _prompts(ctx: Any, tok: Any) -> list[dict]:
    """The mixture's prompts as rows {prompt, answer, input_ids (the rendered prompt)}."""
    from pipeline.rl.rewards import load_prompts

    rows = []
    for row in load_prompts(ctx.stage, ctx.cfg, "ppo"):
        ids = tok.apply_chat_template(row["prompt"], tokenize=True, add_generation_prompt=True, return_dict=False)
        rows.append({"prompt": row["prompt"], "answer": row.get("answer"), "input_ids": list(ids)})
    return rows


def _models(ctx: Any, tok: Any, device: Any) -> tuple[Any, Any, ValueModel]:
    """Policy (with a LoRA adapter when asked), reference (None with LoRA: the disabled adapter) and value model."""
    from pipeline.train.models import load_model
    from pipeline.train.trainer import lora_config

    policy = load_model(ctx.input_model, ctx.cfg.model).to(device)
    policy.generation_config.pad_token_id = tok.pad_token_id
    ref = None
    if lora_config(ctx.stage) is not None:
        from peft import get_peft_model

        policy = get_peft_model(policy, lora_config(ctx.stage))
    else:
        ref = load_model(ctx.input_model, ctx.cfg.model).to(device)
    return policy, ref, _value_model(ctx, tok.pad_token_id).to(device)


def _save(ctx: Any, loop: PPOLoop, model: Any, tok: Any, history: list[dict]) -> None:
    """The policy as `model/` (atomically), the value model, the update history; the work folder stays until the
    stage's record says trained (the orchestrator removes it then)."""
    from pipeline.distributed import main_writes
    from pipeline.files import write_text
    from pipeline.train.trainer import save_checkpoint

    def write(tmp):
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    save_checkpoint(ctx.model_dir, write)
    with main_writes() as main:
        if main:
            loop.acc.unwrap_model(loop.value).model.save_pretrained(ctx.value_model_dir)
            write_text(ctx.history_file, json.dumps(history, indent=1))


def run(ctx: Any) -> dict:
    """Train the policy with PPO into `ctx.out_dir/model`; return the loop's metrics and the held-out rewards."""
    import torch
    from accelerate import Accelerator

    from pipeline.distributed import main_writes
    from pipeline.logs import figure
    from pipeline.rl.actor_critic import PPOLoop
    from pipeline.rl.heldout import greedy_reward, heldout_rows
    from pipeline.rl.rewards import resolve_reward_model, reward_function
    from pipeline.train.models import load_tokenizer
    from pipeline.train.precision import matmul_precision, mixed_precision

    stage, cfg = ctx.stage, ctx.cfg
    if stage.reward == "model" or stage.value_init == "reward_model":
        resolve_reward_model(stage.reward_model, ctx.stage_dir)  # fail early with a clear message
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=mixed_precision(cfg.model.precision))
    tok = load_tokenizer(ctx.input_model, cfg.model, need_template=True)
    prompts, score = _prompts(ctx, tok), reward_function(stage, ctx.stage_dir, cfg.model, accelerator.device)

    def reward_fn(rows: list[dict], responses: list[list[int]]) -> list[float]:
        texts = tok.batch_decode(responses, skip_special_tokens=True)
        return score([r["prompt"] for r in rows], texts, [r["answer"] for r in rows])

    policy, ref, value = _models(ctx, tok, accelerator.device)
    main, heldout = accelerator.is_main_process, heldout_rows(cfg)
    before = greedy_reward(policy, tok, heldout, stage.max_new_tokens) if main else None
    with main_writes() as is_main:
        if is_main:
            ctx.work_dir.mkdir(parents=True, exist_ok=True)
    loop = PPOLoop(stage, accelerator, policy, value, ref, prompts, reward_fn, tok.pad_token_id, tok.eos_token_id,
                   ctx.work_dir, seed=cfg.seed,
                   log_path=ctx.updates_log(accelerator.process_index))
    with matmul_precision(stage.matmul_precision):  # the loop's rollouts and updates
        metrics = loop.train()
    model = accelerator.unwrap_model(loop.policy)
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    after = greedy_reward(model, tok, heldout, stage.max_new_tokens) if main else None
    _save(ctx, loop, model, tok, metrics.pop("history"))
    last = loop.history[-min(5, len(loop.history)):]
    summary = {k: round(sum(h[k] for h in last) / len(last), 4) for k in SUMMARY} if last else {}
    log.info("ppo: held-out greedy reward %s -> %s; last updates: %s", figure(before), figure(after),
             ", ".join(f"{k} {figure(v)}" for k, v in summary.items()))
    return {**metrics, "heldout_reward_before": before, "heldout_reward_after": after,
            "heldout_prompts": len(heldout), "last_updates": summary, "world_size": accelerator.num_processes,
            "value_model": str(ctx.value_model_dir), "diagnostics": diagnostics.ppo(loop.history)}
