"""Why a preference or RL stage moved: pass rates, usable prompts, margins and rewards at start and end, in the
stage's record and the headline (`pipeline.rl.diagnostics`)."""

from __future__ import annotations

import pytest

from pipeline.rl import diagnostics
from pipeline.rl.onpolicy import build_pairs


def test_pass_rates_read_groups_of_k_samples():
    rates = diagnostics.pass_rates([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    assert rates == {"prompts": 3, "k": 4, "pass1": 5 / 12, "passk": 2 / 3, "varied": 1 / 3}
    assert diagnostics.pass_rates([]) == {"prompts": 0}


def test_the_group_recorder_groups_a_call_by_prompt_and_reads_the_first_steps():
    recorder = diagnostics.GroupRecorder(lambda prompts, texts, answers: [float(t == a) for t, a in
                                                                         zip(texts, answers, strict=True)])
    prompts = [[{"role": "user", "content": q}] for q in ("a", "a", "b", "b")]
    assert recorder(prompts, ["1", "2", "3", "3"], ["1", "1", "3", "3"]) == [1.0, 0.0, 1.0, 1.0]
    for _ in range(3):
        recorder(prompts, ["0"] * 4, ["1", "1", "3", "3"])
    assert recorder.start() == {"prompts": 2, "k": 2, "pass1": 0.75, "passk": 1.0, "varied": 0.5, "batches": 1}
    assert recorder.start(share=1.0)["passk"] == pytest.approx(2 / 8)


def test_a_format_bonus_is_not_a_right_answer_and_a_reward_model_has_no_pass_rates():
    formatted = diagnostics.GroupRecorder(lambda prompts, texts, answers: [1.5, 0.5], bonus=0.5)  # right, formatted
    assert formatted(["a", "a"], ["x", "y"], ["1", "1"]) == [1.5, 0.5]  # TRL gets the scores as they are
    assert formatted.start()["pass1"] == 0.5
    learned = diagnostics.GroupRecorder(lambda prompts, texts, answers: [2.3, -0.7], bonus=None)
    learned(["a", "a"], ["x", "y"], [None, None])
    assert learned.start() == {"prompts": 1, "k": 2, "varied": 1.0, "batches": 1}
    text = diagnostics.sentence("grpo", diagnostics.grpo(learned.start(), {}))
    assert text == "grpo: 100% gave rewards that vary"


def test_dpo_diagnostics_from_its_sampling_and_its_logged_margins():
    prompts = [[{"role": "user", "content": str(i)}] for i in range(4)]
    samples = [["#### 1", "#### 2"], ["#### 2", "#### 2"], ["#### 3", "#### 3"], ["#### 9", "#### 4"]]
    _, stats = build_pairs(prompts, ["1", "2", "5", "4"], samples)
    stats["generated_tokens"] = 32
    metrics = {"first_logged": {"rewards/margins": 0.0, "rewards/chosen": 0.0, "rewards/rejected": 0.0},
               "last_logged": {"rewards/margins": 0.6, "rewards/chosen": 0.1, "rewards/rejected": -0.5}}
    diag = diagnostics.dpo(stats, metrics, beta=0.5)
    assert diag["pass1"] == 4 / 8 and diag["passk"] == 3 / 4 and diag["usable"] == 2 / 4 and diag["k"] == 2
    assert diag["margin"] == [0.0, 0.6] and diag["log_ratio_rejected"] == -1.0 and diag["answer_tokens"] == 4
    text = diagnostics.sentence("dpo", diag)
    assert text.startswith("dpo: input pass@1 0.50, pass@2 0.75 on 4 training prompts; 50% gave a right and a wrong")
    assert "margin 0.00 -> 0.60" in text and "rejected -1.00" in text
    assert diagnostics.sentence("dpo", {}) is None
    empty = {"prompts": 0, "samples": 0, "correct_rate": 0.0, "pairs": 0, "all_correct": 0, "all_wrong": 0}
    assert diagnostics.sentence("dpo", diagnostics.dpo(empty, metrics, beta=0.5)).startswith("dpo: margin 0.00")


def test_grpo_and_ppo_diagnostics_carry_reward_kl_and_length_at_start_and_end():
    metrics = {"first_logged": {"reward": 0.4, "kl": 0.0, "completions/mean_length": 40.0},
               "last_logged": {"reward": 0.5, "kl": 0.01, "completions/mean_length": 38.0}}
    diag = diagnostics.grpo({"prompts": 16, "k": 8, "pass1": 0.4, "passk": 0.75, "varied": 0.6, "batches": 2},
                            metrics)
    text = diagnostics.sentence("grpo", diag)
    assert "pass@8 0.75 on 16 training prompts (its first 2 generation batch(es))" in text
    assert "60% gave rewards that vary" in text
    assert "mean reward 0.40 -> 0.50" in text and "KL 0.0000 -> 0.0100" in text and "answer length 40 -> 38" in text
    history = [{"reward_mean": 0.3, "kl": 0.0, "response_length": 50.0}, {"reward_mean": 0.5, "kl": 0.2,
                                                                          "response_length": 45.0}]
    assert diagnostics.ppo(history) == {"reward": [0.3, 0.5], "kl": [0.0, 0.2], "answer_length": [50.0, 45.0]}
