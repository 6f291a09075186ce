"""PPO math (GAE, whitening, KL, clipped losses), the loop on a toy task (learning, ratio 1, KL 0, resume,
two processes) and the reward / PPO / GRPO stages through the real CLI.

Run as a script (`accelerate launch tests/test_ppo.py OUT`) it is the two-process toy run.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.rl.actor_critic import (  # noqa: E402
    PPOLoop,
    ValueModel,
    gae,
    kl_estimate,
    policy_loss,
    response_mask,
    value_loss,
    whiten,
)

TARGET, EOS, PAD, VOCAB = 5, 1, 0, 16


# --------------------------------------------------------------------------------------------- math

def test_gae_and_returns_match_a_hand_computed_example():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 9.0]])
    values = torch.tensor([[0.5, 0.2, 0.4, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the 4th token is padding: ignored
    gamma, lam = 0.9, 0.8
    # by hand: deltas d2 = 1 - 0.4 = 0.6; d1 = 0 + 0.9*0.4 - 0.2 = 0.16; d0 = 0 + 0.9*0.2 - 0.5 = -0.32
    # A2 = 0.6; A1 = 0.16 + 0.72*0.6 = 0.592; A0 = -0.32 + 0.72*0.592 = 0.10624
    adv, ret = gae(rewards, values, mask, gamma, lam)
    assert torch.allclose(adv, torch.tensor([[0.10624, 0.592, 0.6, 0.0]]), atol=1e-6)
    assert torch.allclose(ret, torch.tensor([[0.60624, 0.792, 1.0, 0.0]]), atol=1e-6)
    # gamma = lam = 1: advantages are reward-to-go minus value
    adv1, ret1 = gae(rewards, values, mask, 1.0, 1.0)
    assert torch.allclose(ret1, torch.tensor([[1.0, 1.0, 1.0, 0.0]]), atol=1e-6)
    assert torch.allclose(adv1, torch.tensor([[0.5, 0.8, 0.6, 0.0]]), atol=1e-6)


def test_whitening_gives_zero_mean_unit_variance_on_the_mask():
    torch.manual_seed(0)
    x = torch.randn(6, 9) * 3 + 5
    mask = (torch.rand(6, 9) > 0.3).float()
    w = whiten(x, mask)
    vals = w[mask.bool()]
    assert abs(vals.mean().item()) < 1e-5
    assert abs(vals.var(unbiased=False).item() - 1) < 1e-4
    assert torch.all(w[~mask.bool()] == 0)


def test_kl_estimators():
    logp = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-1.5, -1.0, -0.5])
    assert torch.equal(kl_estimate(logp, logp, "k1"), torch.zeros(3))
    assert torch.equal(kl_estimate(logp, logp, "k3"), torch.zeros(3))
    assert torch.allclose(kl_estimate(logp, ref, "k1"), logp - ref)
    r = torch.exp(ref - logp)
    assert torch.allclose(kl_estimate(logp, ref, "k3"), r - 1 - torch.log(r))
    assert torch.all(kl_estimate(logp, ref, "k3") >= 0)


def test_clipped_losses():
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    mask = torch.ones(1, 3)
    old = torch.zeros(1, 3)
    same = policy_loss(old.clone(), old, adv, mask, 0.2)
    assert torch.equal(same["ratio"], torch.ones(1, 3)) and same["loss"] == same["loss_unclipped"]
    assert same["clipfrac"] == 0 and same["approx_kl"] == 0
    new = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))  # ratios 1.5 (clipped), 0.5 (clipped), 1.1
    out = policy_loss(new, old, adv, mask, 0.2)
    expected = torch.tensor([-1.2, 0.8, -2.2]).mean()  # max(-A r, -A clip(r))
    assert torch.allclose(out["loss"], expected) and torch.isclose(out["clipfrac"], torch.tensor(2 / 3))
    v = value_loss(torch.tensor([[2.0]]), torch.tensor([[0.0]]), torch.tensor([[2.0]]), torch.ones(1, 1), 0.5)
    assert torch.isclose(v["loss"], torch.tensor(0.5 * 1.5 ** 2))  # clipped value 0.5 is 1.5 from the return


def test_response_mask_stops_at_the_first_eos():
    resp = torch.tensor([[3, 1, 4, 1], [3, 4, 5, 6]])
    mask, ended = response_mask(resp, EOS)
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]] and ended.tolist() == [True, False]


# ---------------------------------------------------------------------------------------- toy loop

def toy_args(**over) -> SimpleNamespace:
    base = dict(learning_rate=1e-2, weight_decay=0.0, lr_scheduler_type="constant", min_lr_rate=0.1, warmup_ratio=0.0,
                max_grad_norm=1.0, max_steps=12, gradient_accumulation_steps=2, rollout_batch_size=32, max_new_tokens=2,
                temperature=1.0, unfinished_penalty=None, kl_coef=0.01, kl_estimator="k3", kl_target=0.0,
                gamma=1.0, lam=0.95, ppo_epochs=4, num_minibatches=2, clip_range=0.2, clip_range_value=0.2,
                vf_coef=0.5, whiten_advantages=True, logging_steps=1, save_steps=0)
    return SimpleNamespace(**{**base, **over})


def toy_loop(work: Path, args: SimpleNamespace, accelerator=None, log_path: Path | None = None) -> PPOLoop:
    """A random 2-layer Llama over 16 tokens; reward 1 when the response starts with token 5 (p ~ 1/16)."""
    from accelerate import Accelerator
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32, pad_token_id=PAD,
                      eos_token_id=EOS, bos_token_id=2)
    policy = LlamaForCausalLM(cfg)
    ref = copy.deepcopy(policy)
    value = ValueModel(LlamaForSequenceClassification(LlamaConfig(**{**cfg.to_dict(), "num_labels": 1})))
    g = torch.Generator().manual_seed(1)
    prompts = [{"input_ids": torch.randint(2, VOCAB, (int(torch.randint(2, 5, (1,), generator=g)),),
                                           generator=g).tolist()} for _ in range(64)]

    def reward(rows, responses):
        return [1.0 if r and r[0] == TARGET else 0.0 for r in responses]

    acc = accelerator or Accelerator(cpu=True)
    return PPOLoop(args, acc, policy, value, ref, prompts, reward, PAD, EOS, work, seed=0, log_path=log_path)


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    torch.set_num_threads(2)
    loop = toy_loop(tmp_path_factory.mktemp("toy"), toy_args())
    return loop.train()


@pytest.mark.slow
def test_toy_task_is_learned(toy_run):
    rewards = [h["reward_mean"] for h in toy_run["history"]]
    assert rewards[0] < 0.3
    assert max(rewards[-3:]) > 0.8, rewards
    assert toy_run["steps"] == 12 and toy_run["tokens"] > 0
    for key in ("reward_std", "kl", "entropy", "clipfrac", "approx_kl", "value_loss", "explained_variance",
                "response_length", "rollout_tokens_per_s"):
        assert all(key in h for h in toy_run["history"])


def test_first_minibatch_ratio_is_one_and_kl_is_zero_against_the_same_weights(toy_run):
    first = toy_run["history"][0]
    assert first["kl"] == pytest.approx(0.0, abs=1e-5)  # the reference is a copy of the policy before any update
    for h in toy_run["history"]:  # old log-probs came from the rollout's batches: equal up to float rounding
        assert h["first_ratio_max_dev"] == pytest.approx(0.0, abs=1e-5)
        assert h["first_pg_loss"] == pytest.approx(h["first_pg_loss_unclipped"], abs=1e-6)
    assert any(h["kl"] != 0 for h in toy_run["history"][1:])


@pytest.mark.slow
def test_resume_continues_where_the_checkpoint_left(tmp_path):
    torch.set_num_threads(2)
    args = toy_args(max_steps=4, save_steps=2)

    class Stop(Exception):
        pass

    def stop_after_3(stats):
        if stats["update"] == 3:
            raise Stop

    loop = toy_loop(tmp_path, args)
    with pytest.raises(Stop):
        loop.train(on_update=stop_after_3)
    interrupted = loop.history
    assert (tmp_path / "update-2" / "state.pt").is_file()
    resumed = toy_loop(tmp_path, args).train()
    assert resumed["resumed_from"].endswith("update-2") and resumed["steps"] == 4
    skip = {"time_s", "rollout_tokens_per_s"}
    a = {k: v for k, v in interrupted[2].items() if k not in skip}
    b = {k: v for k, v in resumed["history"][2].items() if k not in skip}
    assert a == b


def _two_process_main(out: str) -> None:
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    out_dir = Path(out)
    loop = toy_loop(out_dir / "work", toy_args(max_steps=3, rollout_batch_size=8, save_steps=2), acc,
                    log_path=out_dir / f"rank{acc.process_index}.jsonl")
    loop.train()
    (out_dir / f"world{acc.process_index}.json").write_text(json.dumps({"world_size": acc.num_processes}))
    acc.wait_for_everyone()
    torch.distributed.destroy_process_group()  # a live gloo group can abort the interpreter at exit
    # and one rank of this test still aborted once in CI ("terminate called without an active exception"): what
    # the test checks is written by now, so leave without the interpreter's teardown
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


@pytest.mark.slow
def test_two_processes_share_statistics(tmp_path):
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", __file__, str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        assert json.loads((tmp_path / f"world{rank}.json").read_text())["world_size"] == 2
    logs = [[json.loads(x) for x in (tmp_path / f"rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)]
    assert len(logs[0]) == len(logs[1]) == 3
    for a, b in zip(*logs, strict=True):
        a.pop("time_s"), b.pop("time_s")
        assert a == b


# ------------------------------------------------------------------------------------ CLI stages

def _format_pairs(path: Path, n: int) -> Path:
    """A preference mixture with a learnable rule: the worked answer (chosen) over the same answer without
    its `#### N` line (rejected). Returns the mixture YAML."""
    from pipeline.tiny.data import build_splits

    splits = build_splits({"seed": 7, "sft_examples": n, "midtrain_examples": 1, "general_examples": 1,
                           "pretrain_examples": 1, "test_examples": 1, "validation_examples": 1})
    with open(path / "pairs.jsonl", "w", encoding="utf-8") as fh:
        for row in splits["sft"]:
            question, answer = (m["content"] for m in row["messages"])
            fh.write(json.dumps({"prompt": [{"role": "user", "content": question}],
                                 "chosen": [{"role": "assistant", "content": answer}],
                                 "rejected": [{"role": "assistant", "content": answer.rsplit("\n", 1)[0]}]}) + "\n")
    (path / "format_prefs.yaml").write_text(f"sources:\n  - path: {path / 'pairs.jsonl'}\n", encoding="utf-8")
    return path / "format_prefs.yaml"


@pytest.mark.slow
def test_reward_stage_then_ppo_with_the_reward_model(tmp_path, cache_dir):
    from conftest import FAST, run_cli

    mixture = _format_pairs(tmp_path, 300)
    proc = run_cli("recipe=tiny", f"output_root={tmp_path}", f"cache_dir={cache_dir}", *FAST,
                   "stages=[sft,reward,ppo]", f"reward.mixture={mixture}", "reward.learning_rate=1e-4",
                   "reward.max_steps=40", "reward.per_device_train_batch_size=8", "reward.max_length=256",
                   "reward.gradient_checkpointing=false", "reward.logging_steps=5",
                   "ppo.mixture=tiny_rl", "ppo.reward=model", "ppo.reward_model=reward", "ppo.value_init=reward_model",
                   "ppo.max_steps=2", "ppo.rollout_batch_size=8", "ppo.num_minibatches=2", "ppo.ppo_epochs=1",
                   "ppo.max_new_tokens=48", "ppo.learning_rate=1e-5", "ppo.logging_steps=1", "ppo.save_steps=1")
    assert proc.returncode == 0, proc.stderr[-4000:]
    reward = json.loads((tmp_path / "tiny/stages/02-reward/stage.json").read_text())["metrics"]
    # 30 held-out pairs (a tenth); chance is 0.5
    assert reward["heldout_pairs"] == 30 and reward["heldout_accuracy_after"] >= 0.9
    assert reward["steps"] == 40 and reward["loss_last"] < 0.5 * reward["loss_first"]
    ppo = json.loads((tmp_path / "tiny/stages/03-ppo/stage.json").read_text())
    assert ppo["metrics"]["steps"] == 2 and (tmp_path / "tiny/stages/03-ppo/model/model.safetensors").is_file()
    assert not (tmp_path / "tiny/stages/03-ppo/work").exists()


@pytest.mark.slow
def test_ppo_and_grpo_stages_with_the_verifiable_reward(tmp_path, cache_dir):
    from conftest import FAST, run_cli

    proc = run_cli("recipe=tiny", f"output_root={tmp_path}", f"cache_dir={cache_dir}", *FAST,
                   "stages=[sft,ppo,grpo]", "ppo.mixture=tiny_rl", "ppo.max_steps=2", "ppo.rollout_batch_size=8",
                   "ppo.num_minibatches=2", "ppo.max_new_tokens=48", "ppo.learning_rate=1e-5", "ppo.kl_target=0.1",
                   "grpo.mixture=tiny_rl", "grpo.max_steps=2", "grpo.per_device_train_batch_size=4",
                   "grpo.num_generations=4", "grpo.max_new_tokens=48", "grpo.gradient_checkpointing=false",
                   "grpo.logging_steps=1")
    assert proc.returncode == 0, proc.stderr[-4000:]
    ppo = json.loads((tmp_path / "tiny/stages/02-ppo/stage.json").read_text())["metrics"]
    assert ppo["steps"] == 2 and ppo["heldout_reward_before"] is not None and ppo["heldout_reward_after"] is not None
    grpo = json.loads((tmp_path / "tiny/stages/03-grpo/stage.json").read_text())["metrics"]
    assert grpo["steps"] == 2 and grpo["rewards"]
    why = grpo["diagnostics"]  # the first step's 1 prompt x 4 samples (a quarter of 2 steps, at least one)
    assert why["prompts"] == 1 and why["k"] == 4 and 0 <= why["pass1"] <= why["passk"] <= 1
    assert len(why["reward"]) == 2 and len(why["answer_length"]) == 2
    assert set(ppo["diagnostics"]) == {"reward", "kl", "answer_length"}
    assert "- why grpo: input pass@1" in (tmp_path / "tiny/leaderboard.md").read_text()


if __name__ == "__main__":
    _two_process_main(sys.argv[1])
