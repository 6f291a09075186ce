"""Actor-critic PPO for causal LMs on accelerate: the math (GAE, whitening, KL estimators, clipped
losses) as pure functions, and one rollout -> update loop (`PPOLoop`).

Per update each process takes its own slice of the prompts, samples responses through the one generator
(`generation.generator.continue_ids`: stop at EOS or `max_new_tokens`), scores them once (`reward_fn`, per
sequence), and builds per-token rewards: `-kl_coef * KL(policy || reference)` on every response token plus the
sequence score on the last one. GAE over the value model's per-token values gives advantages (whitened across
all processes) and returns; then `ppo_epochs` passes over `num_minibatches` minibatches (each split into
`gradient_accumulation_steps` micro-batches) minimise the clipped policy loss plus `vf_coef` x the clipped
value loss, with gradient clipping. Statistics are reduced across processes, so every rank logs the same
numbers. Checkpoints (`work/update-N`) hold policy, value, optimiser, scheduler, the update index, the KL
coefficient and every rank's RNG state; a restarted loop resumes from the last.

Tokens: the old log-probabilities are computed in the same micro-batches, in the same order, as the
first minibatch of the first epoch, so there the probability ratio is exactly 1.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from trl.trainer.utils import disable_dropout_in_model, entropy_from_logits, selective_log_softmax

from pipeline import preempt
from pipeline.distributed import any_rank, main_writes
from pipeline.generation.generator import continue_ids
from pipeline.train.trainer import save_checkpoint

log = logging.getLogger("pipeline")

RewardFn = Callable[[list[dict], list[list[int]]], list[float]]  # (prompt rows, response ids) -> score each


# ----------------------------------------------------------------------------------------------- math

def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum()


def masked_mean(x: torch.Tensor, mask: torch.Tensor, reduce: Callable | None = None) -> torch.Tensor:
    """Mean of `x` where `mask` is 1; `reduce` (a cross-process sum) makes it a global mean."""
    sums = torch.stack([masked_sum(x, mask), mask.sum().to(x.dtype)])
    if reduce is not None:
        sums = reduce(sums)
    return sums[0] / sums[1].clamp(min=1)


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, reduce: Callable | None = None,
           eps: float = 1e-8) -> torch.Tensor:
    """Masked whitening to zero mean and unit (population) variance; masked-out entries become 0."""
    mean = masked_mean(x, mask, reduce)
    var = masked_mean((x - mean) ** 2, mask, reduce)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over per-token `rewards` / `values` ([batch, T]); the value after
    the last valid token is 0. Returns (advantages, returns = advantages + values), zero where masked."""
    rewards, values = rewards * mask, values * mask
    advantages = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[:, 0])
    steps = rewards.shape[1]
    for t in reversed(range(steps)):
        next_value = values[:, t + 1] if t + 1 < steps else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = delta + gamma * lam * last
        advantages[:, t] = last
    advantages = advantages * mask
    return advantages, (advantages + values) * mask


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(policy || reference) estimate from sampled tokens: k1 = log p - log q (unbiased,
    can be negative); k3 = q/p - 1 - log(q/p) (unbiased, >= 0, lower variance)."""
    diff = logp - ref_logp
    if estimator == "k1":
        return diff
    if estimator == "k3":
        return torch.expm1(-diff) + diff
    raise ValueError(f"unknown KL estimator {estimator!r} (k1 | k3)")


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip: float) -> dict[str, torch.Tensor]:
    """PPO's clipped surrogate: loss, the unclipped loss, clip fraction, approx KL (k3) and the ratios."""
    log_ratio = (logp - old_logp) * mask
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip, 1.0 + clip)
    return {
        "loss": masked_mean(torch.maximum(unclipped, clipped), mask),
        "loss_unclipped": masked_mean(unclipped, mask),
        "clipfrac": masked_mean((clipped > unclipped).float(), mask),
        "approx_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, mask),
        "ratio": ratio,
    }


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float) -> dict[str, torch.Tensor]:
    """Clipped value loss: 0.5 * max((v - R)^2, (clip(v, v_old +- clip) - R)^2), masked mean."""
    clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    losses = torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    return {"loss": 0.5 * masked_mean(losses, mask),
            "clipfrac": masked_mean(((values - returns) ** 2 < (clipped - returns) ** 2).float(), mask)}


def adaptive_kl_coef(coef: float, kl: float, target: float, rate: float = 0.5) -> float:
    """Ziegler et al.'s proportional controller: the coefficient grows while KL is above `target` and
    shrinks below it, by at most `rate` x 20% per update."""
    error = float(np.clip(kl / target - 1.0, -0.2, 0.2))
    return coef * (1.0 + rate * error)


def response_mask(responses: torch.Tensor, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask over generated tokens up to and including the first EOS, and whether each response ended."""
    is_eos = responses == eos_id
    ended = is_eos.any(dim=1)
    never = torch.full_like(ended, responses.shape[1], dtype=torch.long)
    first = torch.where(ended, is_eos.float().argmax(dim=1), never)
    positions = torch.arange(responses.shape[1], device=responses.device)
    return (positions[None, :] <= first[:, None]).long(), ended


# ---------------------------------------------------------------------------------------------- value

class ValueModel(torch.nn.Module):
    """Per-token values from an `AutoModelForSequenceClassification` with one label: its score head
    applied to every last hidden state ([batch, T]). `.model` is the classifier (what gets saved)."""

    def __init__(self, classifier: Any):
        super().__init__()
        self.model = classifier

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor) -> torch.Tensor:
        backbone = getattr(self.model, self.model.base_model_prefix)
        hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False).last_hidden_state
        return self.model.score(hidden).squeeze(-1).float()


# ----------------------------------------------------------------------------------------------- loop

class PPOLoop:
    """One PPO run. `policy`, `value_model` are trained; `ref_model` None means the policy with its LoRA
    adapter disabled. `prompts` are rows with `input_ids` (the rendered prompt) plus anything the
    reward function needs. `args` carries the `PpoConfig` fields (and the OptimConfig ones)."""

    def __init__(self, args: Any, accelerator: Any, policy: Any, value_model: Any, ref_model: Any,
                 prompts: list[dict], reward_fn: RewardFn, pad_id: int, eos_id: int, work_dir: Path,
                 seed: int = 0, log_path: Path | None = None):
        from transformers import get_scheduler

        self.args, self.acc = args, accelerator
        self.prompts, self.reward_fn, self.pad_id, self.eos_id = prompts, reward_fn, pad_id, eos_id
        self.work_dir, self.seed, self.log_path = Path(work_dir), seed, log_path
        self.kl_coef = float(args.kl_coef)
        self.update = 0
        self.history: list[dict] = []
        for model in (policy, value_model):
            disable_dropout_in_model(model)
        self.ref = ref_model
        if ref_model is not None:
            ref_model.eval().requires_grad_(False)
            disable_dropout_in_model(ref_model)
        params = [p for m in (policy, value_model) for p in m.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=args.weight_decay, eps=1e-5)
        self.micro_per_minibatch = max(1, args.gradient_accumulation_steps)
        total = args.max_steps * args.ppo_epochs * args.num_minibatches
        kwargs = {"min_lr_rate": args.min_lr_rate} if "min_lr" in args.lr_scheduler_type else {}
        self.scheduler = get_scheduler(args.lr_scheduler_type, self.optimizer,
                                       num_warmup_steps=int(args.warmup_ratio * total), num_training_steps=total,
                                       scheduler_specific_kwargs=kwargs)
        self.policy, self.value, self.optimizer = accelerator.prepare(policy, value_model, self.optimizer)
        # whole micro-batches per minibatch: pipeline.chain.preflight.ppo_batches refuses other sizes before any load
        self.micro = args.rollout_batch_size // (args.num_minibatches * self.micro_per_minibatch)

    # -- helpers ---------------------------------------------------------------------------------
    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        return self.acc.reduce(t.detach().clone(), reduction="sum") if self.acc.num_processes > 1 else t.detach()

    def _batch_prompts(self, update: int) -> list[dict]:
        """This rank's prompts for `update`: a deterministic pass-wise permutation, sliced by rank."""
        per_update = self.args.rollout_batch_size * self.acc.num_processes
        start = update * per_update
        rows = []
        for i in range(start, start + per_update):
            epoch, pos = divmod(i, len(self.prompts))
            order = np.random.default_rng(self.seed + epoch).permutation(len(self.prompts))
            rows.append(self.prompts[int(order[pos])])
        rank = self.acc.process_index
        return rows[rank * self.args.rollout_batch_size:(rank + 1) * self.args.rollout_batch_size]

    def _left_pad(self, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r["input_ids"]):] = torch.tensor(r["input_ids"])
            mask[i, width - len(r["input_ids"]):] = 1
        return ids.to(self.acc.device), mask.to(self.acc.device)

    def _forward(self, model: Any, ids: torch.Tensor, mask: torch.Tensor, prompt_len: int,
                 with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probabilities (at the sampling temperature) of the response tokens, and their entropy."""
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
        logits = logits[:, prompt_len - 1:-1].float() / self.args.temperature
        logp = selective_log_softmax(logits, ids[:, prompt_len:])
        return logp, (entropy_from_logits(logits) if with_entropy else None)

    def _values(self, model: Any, ids: torch.Tensor, mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        return model(ids, mask, positions)[:, prompt_len - 1:-1]

    def _ref_logp(self, ids: torch.Tensor, mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
        if self.ref is not None:
            return self._forward(self.ref, ids, mask, prompt_len)[0]
        with self.acc.unwrap_model(self.policy).disable_adapter():
            return self._forward(self.acc.unwrap_model(self.policy), ids, mask, prompt_len)[0]

    # -- rollout ---------------------------------------------------------------------------------
    @torch.no_grad()
    def rollout(self, rows: list[dict]) -> tuple[dict, dict]:
        args, policy = self.args, self.acc.unwrap_model(self.policy)
        policy.eval()
        started = time.time()
        prompt_ids, prompt_mask = self._left_pad(rows)
        responses = continue_ids(policy, prompt_ids, prompt_mask, args.max_new_tokens, self.pad_id, self.eos_id,
                                 temperature=args.temperature)
        gen_time = time.time() - started
        p = prompt_ids.shape[1]
        if responses.shape[1] == 0:
            responses = torch.full((len(rows), 1), self.pad_id, dtype=torch.long, device=prompt_ids.device)
        rmask, ended = response_mask(responses, self.eos_id)
        responses = torch.where(rmask.bool(), responses, torch.full_like(responses, self.pad_id))
        ids = torch.cat([prompt_ids, responses], dim=1)
        mask = torch.cat([prompt_mask, rmask], dim=1)
        lists = [r[m.bool()].tolist() for r, m in zip(responses, rmask, strict=True)]
        scores = torch.tensor(self.reward_fn(rows, lists), dtype=torch.float32, device=ids.device)
        raw_scores = scores.clone()
        if args.unfinished_penalty is not None:  # None: no special treatment of unfinished responses
            scores = torch.where(ended, scores, torch.full_like(scores, float(args.unfinished_penalty)))
        logp, ref_logp, values, entropy = self._rollout_forward(policy, ids, mask, p)
        rmask_f = rmask.float()
        kl = kl_estimate(logp, ref_logp, args.kl_estimator) * rmask_f
        rewards = -self.kl_coef * kl
        last = rmask.sum(1) - 1
        rewards[torch.arange(len(rows)), last] += scores
        values = values * rmask_f
        advantages, returns = gae(rewards, values, rmask_f, args.gamma, args.lam)
        if args.whiten_advantages:
            advantages = whiten(advantages, rmask_f, reduce=self._sum if self.acc.num_processes > 1 else None)
        batch = {"ids": ids, "mask": mask, "prompt_len": p, "rmask": rmask_f, "logp": logp, "values": values,
                 "advantages": advantages, "returns": returns}
        return batch, self._rollout_stats(scores, raw_scores, kl, rmask_f, entropy, ended, gen_time)

    @torch.no_grad()
    def _rollout_forward(self, policy: Any, ids: torch.Tensor, mask: torch.Tensor,
                         p: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Policy and reference log-probs, values and entropy of the rollout, in the first minibatch's micro-batches."""
        logp, ref_logp, values, entropy = [], [], [], []
        for s in range(0, ids.shape[0], self.micro):  # the same micro-batches as the first minibatch's
            sl = slice(s, s + self.micro)
            lp, ent = self._forward(policy, ids[sl], mask[sl], p, with_entropy=True)
            logp.append(lp)
            entropy.append(ent)
            ref_logp.append(self._ref_logp(ids[sl], mask[sl], p))
            values.append(self._values(self.acc.unwrap_model(self.value), ids[sl], mask[sl], p))
        return tuple(torch.cat(x) for x in (logp, ref_logp, values, entropy))

    def _rollout_stats(self, scores: torch.Tensor, raw_scores: torch.Tensor, kl: torch.Tensor, rmask: torch.Tensor,
                       entropy: torch.Tensor, ended: torch.Tensor, gen_time: float) -> dict:
        """The rollout's statistics over every process."""
        device, many = scores.device, self.acc.num_processes > 1
        all_scores = self.acc.gather(scores) if many else scores
        all_raw = self.acc.gather(raw_scores) if many else raw_scores
        sums = self._sum(torch.stack([kl.sum(), rmask.sum(), (entropy * rmask).sum(), ended.float().sum(),
                                      torch.tensor(float(len(scores)), device=device)]))
        t = self._sum(torch.tensor([gen_time], device=device)) / self.acc.num_processes
        return {"reward_mean": all_scores.mean().item(), "reward_std": all_scores.std(unbiased=False).item(),
                "raw_score_mean": all_raw.mean().item(),
                "kl": (sums[0] / sums[4]).item(), "entropy": (sums[2] / sums[1]).item(),
                "response_length": (sums[1] / sums[4]).item(), "finished_rate": (sums[3] / sums[4]).item(),
                "rollout_tokens": int(sums[1].item()), "rollout_tokens_per_s": (sums[1] / t.clamp(min=1e-9)).item()}

    # -- update ----------------------------------------------------------------------------------
    def train_step(self, batch: dict) -> dict:
        args = self.args
        self.policy.train()
        self.value.train()
        n = batch["ids"].shape[0]
        mb = n // args.num_minibatches
        keys = ("ids", "mask", "rmask", "logp", "values", "advantages", "returns")
        sums: dict[str, float] = {}
        first: dict[str, float] = {}
        gen = torch.Generator().manual_seed(self.seed * 100003 + self.update)
        for epoch in range(args.ppo_epochs):
            order = torch.arange(n) if epoch == 0 else torch.randperm(n, generator=gen)
            for m in range(args.num_minibatches):
                idx = order[m * mb:(m + 1) * mb]
                for k in range(self.micro_per_minibatch):
                    sub = idx[k * self.micro:(k + 1) * self.micro].to(batch["ids"].device)
                    b = {key: batch[key][sub] for key in keys}
                    p = batch["prompt_len"]
                    logp, _ = self._forward(self.policy, b["ids"], b["mask"], p)
                    values = self._values(self.value, b["ids"], b["mask"], p)
                    pg = policy_loss(logp, b["logp"], b["advantages"], b["rmask"], args.clip_range)
                    vf = value_loss(values, b["values"], b["returns"], b["rmask"], args.clip_range_value)
                    loss = (pg["loss"] + args.vf_coef * vf["loss"]) / self.micro_per_minibatch
                    self.acc.backward(loss)
                    if epoch == 0 and m == 0 and k == 0:
                        dev = ((pg["ratio"] - 1).abs() * b["rmask"]).max()
                        first = {"first_ratio_max_dev": dev.item(), "first_pg_loss": pg["loss"].item(),
                                 "first_pg_loss_unclipped": pg["loss_unclipped"].item()}
                    for name, val in (("policy_loss", pg["loss"]), ("clipfrac", pg["clipfrac"]),
                                      ("approx_kl", pg["approx_kl"]), ("value_loss", vf["loss"]),
                                      ("value_clipfrac", vf["clipfrac"])):
                        sums[name] = sums.get(name, 0.0) + val.item()
                    sums["count"] = sums.get("count", 0.0) + 1
                grad_norm = self.acc.clip_grad_norm_([q for g in self.optimizer.param_groups for q in g["params"]],
                                                     args.max_grad_norm)
                sums["grad_norm"] = sums.get("grad_norm", 0.0) + float(grad_norm) * self.micro_per_minibatch
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
        return {**self._update_stats(batch, sums), **self._first_stats(first, batch["ids"].device)}

    def _update_stats(self, batch: dict, sums: dict[str, float]) -> dict:
        """The update's mean losses over every process, the explained variance and the learning rate."""
        count = sums.pop("count")
        local = torch.tensor([sums[k] / count for k in sorted(sums)], device=batch["ids"].device)
        avg = self._sum(local) / self.acc.num_processes
        stats = dict(zip(sorted(sums), avg.tolist(), strict=True))
        # explained variance of the rollout values against the returns (all processes)
        r, v, msk = batch["returns"], batch["values"], batch["rmask"]
        s = self._sum(torch.stack([masked_sum(r, msk), masked_sum(r * r, msk), masked_sum(r - v, msk),
                                   masked_sum((r - v) ** 2, msk), msk.sum()]))
        var_r = s[1] / s[4] - (s[0] / s[4]) ** 2
        var_d = s[3] / s[4] - (s[2] / s[4]) ** 2
        stats["explained_variance"] = (1 - var_d / var_r.clamp(min=1e-8)).item()
        stats["learning_rate"] = self.scheduler.get_last_lr()[0]
        return stats

    def _first_stats(self, first: dict, device: Any) -> dict:
        """The first micro-batch's figures; over several processes: the worst ratio and the mean losses."""
        if self.acc.num_processes == 1:
            return first
        t = torch.tensor([first["first_ratio_max_dev"], first["first_pg_loss"], first["first_pg_loss_unclipped"]],
                         device=device)
        g = self.acc.gather(t[None]).reshape(-1, 3)
        return {"first_ratio_max_dev": g[:, 0].max().item(), "first_pg_loss": g[:, 1].mean().item(),
                "first_pg_loss_unclipped": g[:, 2].mean().item()}

    # -- checkpoints -----------------------------------------------------------------------------
    def _last_checkpoint(self) -> Path | None:
        done = [p for p in self.work_dir.glob("update-*") if (p / "state.pt").is_file()]
        return max(done, key=lambda p: int(p.name.split("-")[1])) if done else None

    def _write_state(self, tmp: Path) -> None:
        """Every rank: its RNG state; the main process: weights, optimiser, scheduler and loop state."""
        acc = self.acc
        tmp.mkdir(parents=True, exist_ok=True)
        name, keys, pos, has_gauss, gauss = np.random.get_state()
        torch.save({"torch": torch.get_rng_state(), "python": random.getstate(),
                    "numpy": [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss]},
                   tmp / f"rng-{acc.process_index}.pt")
        if acc.is_main_process:
            torch.save({"policy": acc.unwrap_model(self.policy).state_dict(),
                        "value": acc.unwrap_model(self.value).state_dict(),
                        "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()},
                       tmp / "weights.pt")
            torch.save({"update": self.update, "kl_coef": self.kl_coef, "history": self.history}, tmp / "state.pt")

    def save(self) -> None:
        """Checkpoint this update to `work/update-N` (atomically) and drop the older ones."""
        out = self.work_dir / f"update-{self.update}"
        save_checkpoint(out, self._write_state, every_rank=True)
        with main_writes() as main:
            if main:
                for old in self.work_dir.glob("update-*"):
                    if old != out:
                        shutil.rmtree(old, ignore_errors=True)

    def load(self, path: Path) -> None:
        weights = torch.load(path / "weights.pt", map_location="cpu", weights_only=True)
        state = torch.load(path / "state.pt", weights_only=True)
        self.acc.unwrap_model(self.policy).load_state_dict(weights["policy"])
        self.acc.unwrap_model(self.value).load_state_dict(weights["value"])
        self.optimizer.load_state_dict(weights["optimizer"])
        self.scheduler.load_state_dict(weights["scheduler"])
        self.update, self.kl_coef, self.history = state["update"], state["kl_coef"], state["history"]
        rng_file = path / f"rng-{self.acc.process_index}.pt"
        if rng_file.is_file():
            rng = torch.load(rng_file, weights_only=True)
            torch.set_rng_state(rng["torch"])
            random.setstate(rng["python"])
            name, keys, pos, has_gauss, gauss = rng["numpy"]
            np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))

    # -- driver ----------------------------------------------------------------------------------
    def train(self, on_update: Callable[[dict], None] | None = None) -> dict:
        args = self.args
        started = time.time()
        resumed = self._last_checkpoint()
        if resumed is not None:
            self.load(resumed)
            log.info("ppo: resuming from %s (update %d)", resumed, self.update)
        else:
            torch.manual_seed(self.seed + self.acc.process_index)
        while self.update < args.max_steps:
            t0 = time.time()
            batch, stats = self.rollout(self._batch_prompts(self.update))
            stats.update(self.train_step(batch))
            if args.kl_target > 0:
                self.kl_coef = adaptive_kl_coef(self.kl_coef, stats["kl"], args.kl_target)
            self.update += 1
            stats = {"update": self.update, "kl_coef": self.kl_coef, **stats, "time_s": round(time.time() - t0, 3)}
            self.history.append(stats)
            if self.log_path is not None:
                with open(self.log_path, "a", encoding="utf-8") as fh:
                    fh.write(json.dumps(stats) + "\n")
            if self.acc.is_main_process and (self.update % max(1, args.logging_steps) == 0 or self.update == 1):
                log.info("ppo update %d/%d: reward %.3f +- %.3f, kl %.4f, entropy %.3f, clipfrac %.3f, "
                         "value loss %.4f, ev %.3f, len %.1f, %.0f tok/s", self.update, args.max_steps,
                         stats["reward_mean"], stats["reward_std"], stats["kl"], stats["entropy"], stats["clipfrac"],
                         stats["value_loss"], stats["explained_variance"], stats["response_length"],
                         stats["rollout_tokens_per_s"])
            if on_update is not None:
                on_update(stats)
            if any_rank(preempt.requested() is not None):  # SIGTERM / SIGUSR1 on any rank: save and stop cleanly
                self.save()
                preempt.check(f"in ppo after update {self.update} (checkpoint in {self.work_dir})")
            if args.save_steps > 0 and self.update % args.save_steps == 0 and self.update < args.max_steps:
                self.save()
        h = self.history
        return {"steps": self.update, "loss_first": h[0]["policy_loss"] if h else None,
                "loss_last": h[-1]["policy_loss"] if h else None,
                "losses": [(s["update"], s["policy_loss"]) for s in h],
                "rewards": [(s["update"], s["reward_mean"]) for s in h],
                "tokens": sum(s["rollout_tokens"] for s in h),
                "rollout_tokens_per_s": round(float(np.mean([s["rollout_tokens_per_s"] for s in h])), 1) if h else None,
                "resumed_from": str(resumed) if resumed else None, "history": h,
                "wall_time_s": round(time.time() - started, 2)}
