"""Every check that can be made before a model loads, in one pass: each check runs, and every problem found is
reported at once, in one `ConfigError` (exit code 2), before the base model is built, loaded or scored.

What a config alone cannot tell is checked here against what the run will meet: the base model's path and
config, the trainer fields each stage passes to TRL, the device for the precision and memory switches, the PPO
batch arithmetic, vLLM where a backend asks for it (installed, serving the model), the chat template a chat stage
needs, every data file and its rows (with the per-stage decisions: reuse, resume, train), and the metrics the
gates read against the eval tasks. A stage's training data that only its input model can judge (rows longer than
`max_length` in that model's tokens) is checked when the stage starts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig

from pipeline.chain.basemodel import check_model_path
from pipeline.chain.resume import StageDecision, decide
from pipeline.data import chat
from pipeline.errors import ConfigError
from pipeline.evaluation import lmeval as evaluate
from pipeline.generation import engines
from pipeline.stages import trl_args
from pipeline.train import precision
from pipeline.train.distributed import deepspeed_on

log = logging.getLogger("pipeline")
FAILED = object()  # what a check that found a problem returns


def check(cfg: DictConfig, root: Path, tasks_dir: Path) -> list[StageDecision]:
    """Run every check (the eval tasks already written to `tasks_dir`); return the stage decisions, or raise one
    ConfigError naming every problem."""
    problems: list[str] = []

    def attempt(check: Callable, *args: object) -> object:
        try:
            return check(*args)
        except ConfigError as err:
            problems.append(str(err))
            return FAILED

    for one in (trl_args.check, device_settings, ppo_batches, engines.check):
        attempt(one, cfg)
    if attempt(check_model_path, cfg) is not FAILED:  # the chat template is read from that model's tokenizer
        attempt(chat.check_chain, cfg)
    decisions = attempt(decide, cfg, root)
    attempt(gate_metrics, cfg, tasks_dir)
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"{len(problems)} problems: " + "; ".join(f"({i}) {p}" for i, p in enumerate(problems, 1)))
    warn_test_split_gates(cfg, tasks_dir)
    return decisions  # type: ignore[return-value]


def _enabled(cfg: DictConfig) -> list[str]:
    return [name for name in cfg.stages if cfg[name].enabled]


def ppo_runs_here(cfg: DictConfig) -> None:
    """PPO's loop trains two models in one Accelerator: not under accelerate's DeepSpeed (one model per engine).
    Checked first of all, before the process group that DeepSpeed would shape (`run_pipeline`)."""
    if deepspeed_on() and "ppo" in _enabled(cfg):
        raise ConfigError("stage 'ppo' does not run under DeepSpeed (its loop trains a policy and a value model in one "
                          "Accelerator; accelerate's DeepSpeed takes one model per engine): run the chain with "
                          "ppo.enabled=false here, then the same command under recipes/accelerate/ddp.yaml (or "
                          "cpu.yaml), which reuses the finished stages")


def device_settings(cfg: DictConfig) -> None:
    """The precision and each stage's memory switches (Liger kernels, activation offloading) on this device."""
    precision.mixed_precision(cfg.model.precision)
    for name in _enabled(cfg):
        precision.memory_args(cfg[name])


def ppo_batches(cfg: DictConfig) -> None:
    """A PPO update's prompts split evenly into minibatches of whole micro-batches."""
    if "ppo" not in _enabled(cfg):
        return
    ppo = cfg.ppo
    parts = ppo.num_minibatches * max(1, ppo.gradient_accumulation_steps)
    if ppo.rollout_batch_size % parts:
        raise ConfigError(f"ppo.rollout_batch_size={ppo.rollout_batch_size} must be divisible by ppo.num_minibatches "
                          f"x ppo.gradient_accumulation_steps = {ppo.num_minibatches} x "
                          f"{max(1, ppo.gradient_accumulation_steps)} = {parts}")


def gate_metrics(cfg: DictConfig, tasks_dir: Path) -> None:
    """Each gate's metric is one its stage's evaluation produces (the base evaluation's tasks exist too)."""
    evaluate.expected_metrics(evaluate.settings(cfg, None), tasks_dir)  # unknown base-eval tasks fail here
    for name in _enabled(cfg):
        ev, gate = evaluate.settings(cfg, name), cfg[name].gate
        produced = evaluate.expected_metrics(ev, tasks_dir)
        if gate.metric and gate.metric not in produced:
            raise ConfigError(f"gate of stage '{name}' uses metric '{gate.metric}', which its eval does not produce "
                              f"(eval tasks {ev['tasks']} produce: {', '.join(sorted(produced)) or 'nothing'})")


def warn_test_split_gates(cfg: DictConfig, tasks_dir: Path) -> None:
    """Warn about a gate that judges a test split (allowed: test numbers are for the report)."""
    for name in [n for n in _enabled(cfg) if cfg[n].gate.metric]:
        task, ev = cfg[name].gate.metric.partition("/")[0], evaluate.settings(cfg, name)
        if evaluate.metric_splits(ev, tasks_dir).get(task) == "test":
            log.warning("the gate of stage %s judges %s on a test split: test numbers are for the report; gate and "
                        "select on a validation task (e.g. gsm8k_local_val)", name, task)
