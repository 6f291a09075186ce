"""Why a preference or RL stage helped or did not: the numbers its record (`stage.json`, metrics `diagnostics`) and
the run's headline carry.

- the input's pass@1 and pass@k on the prompts the stage trained on (DPO: its on-policy samples; GRPO: the groups of
  its first steps, sampled by the input);
- the share of prompts that could teach anything: a usable pair (a right and a wrong answer), or a group whose
  rewards vary (GRPO's advantage is zero otherwise);
- how the training moved: chosen-versus-rejected margins, or mean reward, at its start and end; the KL to the
  reference (DPO: the policy's log-ratio to it on chosen and rejected answers); the answer length.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def pass_rates(groups: Sequence[Sequence[float]], verified: bool = True) -> dict:
    """Over groups of scores of k samples per prompt: the share of prompts whose samples' scores vary and, for a
    verifier's scores (`verified`: 1 or more is right), pass@1 (the share of right samples) and pass@k (the share of
    prompts with a right one among their k)."""
    groups = [list(g) for g in groups if g]
    if not groups:
        return {"prompts": 0}
    out = {"prompts": len(groups), "k": max(len(g) for g in groups),
           "varied": sum(max(g) > min(g) for g in groups) / len(groups)}
    if verified:
        out["pass1"] = sum(s >= 1 for g in groups for s in g) / sum(len(g) for g in groups)
        out["passk"] = sum(any(s >= 1 for s in g) for g in groups) / len(groups)
    return out


class GroupRecorder:
    """Wraps a reward function `fn(prompts, completions, answers) -> scores` of TRL's GRPOTrainer and keeps each call's
    scores by prompt group (TRL scores a generation batch at a time, each prompt's generations together), so
    `pass_rates` can read the start. `bonus`: what the reward adds to a verifier's score (`format_reward`), taken off
    before judging right and wrong; None for a reward that is no verifier (a reward model)."""

    def __init__(self, score: Callable[..., list[float]], bonus: float | None = 0.0) -> None:
        self.score, self.bonus = score, bonus
        self.calls: list[list[list[float]]] = []

    def __call__(self, prompts: list, completions: list, answers: list) -> list[float]:
        scores = self.score(prompts, completions, answers)
        groups: dict[str, list[float]] = {}
        for prompt, value in zip(prompts, scores, strict=True):
            groups.setdefault(repr(prompt), []).append(float(value) - (self.bonus or 0.0))
        self.calls.append(list(groups.values()))
        return scores

    def start(self, share: float = 0.25) -> dict:
        """`pass_rates` of the first `share` of the generation batches scored (at least one): the input model's
        samples, or nearly (this process's share of them)."""
        n = max(1, round(len(self.calls) * share))
        return {**pass_rates([g for call in self.calls[:n] for g in call], self.bonus is not None), "batches": n}


def dpo(on_policy: dict | None, metrics: dict, beta: float) -> dict:
    """A DPO stage's diagnostics from its on-policy sampling stats (`pipeline.rl.onpolicy.build_pairs`) and the
    trainer's first and last logged values (`pipeline.train.trainer.fit`'s metrics): margins, the log-ratio to the
    reference of chosen and rejected answers (DPO's reward / beta), the sampled answers' length."""
    out: dict[str, Any] = {}
    if on_policy:
        prompts, k = on_policy["prompts"], on_policy["samples"] // max(on_policy["prompts"], 1)
        own = on_policy["pairs"] - on_policy.get("reference_pairs", 0)
        out.update(prompts=prompts, k=k, pass1=on_policy["correct_rate"] if prompts else None,
                   passk=1 - on_policy["all_wrong"] / prompts if prompts else None,
                   usable=own / prompts if prompts else None, usable_what="a right and a wrong answer",
                   answer_tokens=on_policy["generated_tokens"] / on_policy["samples"]
                   if on_policy.get("generated_tokens") and on_policy["samples"] else None)
    first, last = metrics.get("first_logged") or {}, metrics.get("last_logged") or {}
    if "rewards/margins" in last:
        out["margin"] = [first["rewards/margins"], last["rewards/margins"]]
    if "rewards/chosen" in last and beta:
        out["log_ratio_chosen"] = last["rewards/chosen"] / beta
        out["log_ratio_rejected"] = last["rewards/rejected"] / beta
    return out


def grpo(groups: dict, metrics: dict) -> dict:
    """A GRPO stage's diagnostics from its recorded reward groups (`GroupRecorder.start`) and the trainer's first and
    last logged values (`fit`'s metrics): mean reward, KL to the reference (logged when beta > 0), completion
    length."""
    first, last = metrics.get("first_logged") or {}, metrics.get("last_logged") or {}
    out: dict[str, Any] = {}
    if groups.get("prompts"):
        out.update(prompts=groups["prompts"], k=groups["k"], pass1=groups.get("pass1"), passk=groups.get("passk"),
                   usable=groups["varied"], usable_what="rewards that vary",
                   measured_on=f"its first {groups['batches']} generation batch(es)")
    for name, key in (("reward", "reward"), ("kl", "kl"), ("answer_length", "completions/mean_length")):
        if key in last:
            out[name] = [first[key], last[key]]
    return out


def ppo(history: Sequence[dict]) -> dict:
    """A PPO stage's diagnostics from its updates' history (`pipeline.rl.actor_critic`): reward (its first: the
    input's pass@1 on those prompts, for a 0/1 verifier), KL and response length at the first and last update."""
    if not history:
        return {}
    first, last = history[0], history[-1]
    return {name: [first[key], last[key]] for name, key in (("reward", "reward_mean"), ("kl", "kl"),
                                                            ("answer_length", "response_length"))
            if key in first and key in last}


def _pair(name: str, values: Any, digits: int = 2) -> str | None:
    if not values:
        return None
    return f"{name} {values[0]:.{digits}f} -> {values[1]:.{digits}f}"


def sentence(stage: str, diag: dict) -> str | None:
    """`dpo: input pass@1 0.40, pass@4 0.65 on 400 training prompts; 45% gave a right and a wrong answer; margin 0.00
    -> 0.11; ...`, or None without diagnostics."""
    if not diag:
        return None
    parts = []
    if diag.get("pass1") is not None and diag.get("passk") is not None:
        where = f" ({diag['measured_on']})" if diag.get("measured_on") else ""
        parts.append(f"input pass@1 {diag['pass1']:.2f}, pass@{diag['k']} {diag['passk']:.2f} on "
                     f"{diag['prompts']} training prompts{where}")
    if diag.get("usable") is not None:
        parts.append(f"{diag['usable']:.0%} gave {diag['usable_what']}")
    parts += [p for p in (_pair("margin", diag.get("margin")), _pair("mean reward", diag.get("reward")),
                          _pair("KL", diag.get("kl"), 4), _pair("answer length", diag.get("answer_length"), 0))
              if p]
    if "log_ratio_chosen" in diag:
        parts.append(f"log-ratio to the reference at the end: chosen {diag['log_ratio_chosen']:+.2f}, rejected "
                     f"{diag['log_ratio_rejected']:+.2f}")
    if diag.get("answer_tokens") is not None:
        parts.append(f"sampled answers {diag['answer_tokens']:.0f} tokens")
    return f"{stage}: " + "; ".join(parts) if parts else None
