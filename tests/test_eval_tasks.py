"""Any lm-eval task as an evaluation or a gate (shipped, lm-eval's registry, a user's task folder), and verifiable
rewards named by reference (`module:function`, or the built-in `gsm8k`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from pipeline.chain.dryrun import eval_tasks, gate_metrics
from pipeline.config import load_config
from pipeline.errors import ConfigError
from pipeline.evaluation import stats, verifiers
from pipeline.evaluation.gates import judge
from pipeline.evaluation.lmeval import expected_metrics, run_eval, settings, write_tasks

# (question, choices, index of the right one): a multiple-choice task scored by log-likelihood
PROBLEMS = [(f"What is {a} + {b}?", [str(a + b), str(a + b + 1), str(a * b + 7)], 0)
            for a, b in [(1, 2), (3, 4), (2, 2), (5, 1), (6, 3), (7, 2), (4, 4), (8, 1)]]


def exact_answer(completions: list[str], answers: list[str]) -> list[float]:
    """A user's verifier: 1.0 where the completion, stripped, is the answer."""
    return [float(c.strip() == a) for c, a in zip(completions, answers, strict=True)]


def one_argument(completions: list[str]) -> list[float]:
    """Not a verifier: it takes no answers."""
    return [0.0] * len(completions)


def one_score(completions: list[str], answers: list[str]) -> list[float]:
    """Not a verifier: one score for the whole batch."""
    return [1.0]


NOT_A_FUNCTION = 3


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A run's output root with a user's task folder, `my_tasks/`: a multiple-choice task (lm-eval's default
    metrics: acc, acc_norm) on a local jsonl, and a YAML that does not load. One folder for every test here: lm-eval's
    own index is built once per process and set of task folders."""
    root = tmp_path_factory.mktemp("tasks")
    folder = root / "my_tasks"
    folder.mkdir()
    rows = [{"question": q, "choices": c, "label": i} for q, c, i in PROBLEMS]
    (folder / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "sums_mc.yaml").write_text(
        f"task: sums_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'sums.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: label\nmetadata:\n  split: validation\n")
    (folder / "broken.yaml").write_text("task: broken\ndoc_to_text: [unclosed\n")
    return root


def _config(root: Path, *overrides: str):
    cfg = load_config(["recipe=tiny", f"output_root={root}", f"cache_dir={root / 'cache'}",
                       f"eval.include_path={root / 'my_tasks'}", *overrides])
    return cfg, write_tasks(cfg, root / "tasks")


@pytest.mark.slow
def test_tasks_of_the_run_a_user_folder_and_lm_evals_registry_and_the_metrics_each_produces(root):
    cfg, tasks = _config(root)
    ev = settings(cfg, "sft")

    def produced(*names: str) -> set[str]:
        return expected_metrics({**ev, "tasks": list(names)}, tasks)
    assert produced("sums_mc", "tiny_gsm_val") == {"sums_mc/acc,none", "sums_mc/acc_norm,none",
                                                   "tiny_gsm_val/exact_match,strict-match",
                                                   "tiny_gsm_val/exact_match,flexible-extract"}
    assert produced("arc_easy") == {"arc_easy/acc,none", "arc_easy/acc_norm,none"}  # lm-eval's registry
    assert "ifeval/prompt_level_strict_acc,none" in produced("ifeval")
    assert {"gsm8k/exact_match,strict-match", "arc_challenge/acc_norm,none"} <= produced("gsm8k", "ai2_arc")  # a tag
    assert {"mmlu/acc,none", "mmlu_anatomy/acc,none"} <= produced("mmlu")  # a group: its aggregate and its tasks
    file_only = {**ev, "include_path": str(root / "my_tasks" / "sums_mc.yaml"), "tasks": ["sums_mc"]}
    assert expected_metrics(file_only, tasks) == {"sums_mc/acc,none", "sums_mc/acc_norm,none"}  # one task YAML


@pytest.mark.slow
@pytest.mark.parametrize(("overrides", "expected"), [
    (["eval.tasks=[arc_esy]"], "unknown eval task 'arc_esy'"),
    (["base_eval.tasks=[tiny_gsm_vla]"], "unknown eval task 'tiny_gsm_vla'"),
    (["sft.eval.tasks=[sums_mcq]"], "unknown eval task 'sums_mcq'"),
])
def test_an_unknown_task_is_one_line_with_the_closest_names(root, overrides, expected):
    cfg, tasks = _config(root, *overrides)
    with pytest.raises(ConfigError) as err:
        eval_tasks(cfg, tasks)
    message = str(err.value)
    assert expected in message and "\n" not in message and err.value.code == 2
    closest = {"arc_esy": "arc_easy", "tiny_gsm_vla": "tiny_gsm_val", "sums_mcq": "sums_mc"}[expected.split("'")[1]]
    assert f"closest: {closest}" in message and "tiny_gsm, tiny_gsm_bpb, tiny_gsm_val" in message  # the run's own tasks


@pytest.mark.slow
def test_a_missing_include_path_or_a_task_yaml_that_does_not_load_is_named(root):
    cfg, tasks = _config(root, "eval.tasks=[sums_mc]", f"eval.include_path={root / 'nowhere'}")
    with pytest.raises(ConfigError, match="eval.include_path .*nowhere does not exist"):
        eval_tasks(cfg, tasks)
    cfg, tasks = _config(root, "eval.tasks=[broken]")
    with pytest.raises(ConfigError, match=f"unknown eval task 'broken'.*; {root / 'my_tasks/broken.yaml'} does not "
                                          "load"):
        eval_tasks(cfg, tasks)


@pytest.mark.slow
def test_gates_on_any_tasks_metric_and_only_those(root):
    cfg, tasks = _config(root, "eval.tasks=[sums_mc,tiny_gsm_val]", "sft.gate.metric=sums_mc/acc_norm,none",
                         "midtrain.gate.metric=sums_mc/acc,none")
    eval_tasks(cfg, tasks)
    gate_metrics(cfg, tasks)
    cfg, tasks = _config(root, "stages=[sft]", "eval.tasks=[sums_mc]", "sft.gate.metric=sums_mc/exact_match,none")
    with pytest.raises(ConfigError) as err:
        gate_metrics(cfg, tasks)
    assert str(err.value) == ("'sft.gate.metric' is 'sums_mc/exact_match,none', which the stage's eval does not "
                              "produce; did you mean 'sums_mc/acc,none'? (eval tasks ['sums_mc'] produce: "
                              "sums_mc/acc,none, sums_mc/acc_norm,none)")
    # a sweep's tie-break metric: its task is scored with the candidates whether eval.tasks lists it or not
    cfg, tasks = _config(root, "stages=[dpo]", "eval.tasks=[tiny_gsm_val]")
    gate_metrics(cfg, tasks)  # the recipe's tie-break, tiny_gsm_val_bpb/bits_per_byte,none
    cfg, tasks = _config(root, "stages=[dpo]", "dpo.gate.tie_break=tiny_gsm_val_bpb/acc,none")
    with pytest.raises(ConfigError, match="'dpo.gate.tie_break' is 'tiny_gsm_val_bpb/acc,none', which the stage's "
                                          "eval does not produce; did you mean 'tiny_gsm_val_bpb/bits_per_byte,none'"):
        gate_metrics(cfg, tasks)


@pytest.mark.slow
def test_a_multiple_choice_task_scores_through_both_hf_paths_and_pairs_per_problem(root, tmp_path, tiny_base):
    """The user's log-likelihood task through lm-eval's HF model, with lmeval_fast and stock; per-problem `acc` in
    the samples, paired between two evaluations of other prompt formats (chat template and plain)."""
    cfg, tasks = _config(root, "eval.tasks=[sums_mc]")
    ev = settings(cfg, "sft")
    fast = run_eval(tiny_base, ev, tasks, tmp_path / "fast", cfg.model)
    stock = run_eval(tiny_base, {**ev, "fast_generation": False}, tasks, tmp_path / "stock", cfg.model)
    plain = run_eval(tiny_base, {**ev, "apply_chat_template": False}, tasks, tmp_path / "plain", cfg.model)
    assert fast["fast_generation"] and not stock["fast_generation"]
    assert fast["metrics"] == stock["metrics"] and set(fast["metrics"]) == {"sums_mc/acc,none", "sums_mc/acc_norm,none"}
    assert fast["samples"] == {"sums_mc": len(PROBLEMS)} and fast["splits"] == {"sums_mc": "validation"}
    rows = {run: [json.loads(line) for line in (tmp_path / run / "samples_sums_mc.jsonl").open()]
            for run in ("fast", "stock", "plain")}
    assert [r["resps"] for r in rows["fast"]] == [r["resps"] for r in rows["stock"]]
    assert "<|im_start|>assistant" in rows["fast"][0]["arguments"][0][0]
    assert "<|im_start|>" not in rows["plain"][0]["arguments"][0][0]
    acc = {run: {r["doc_id"]: r["acc"] for r in rows[run]} for run in rows}
    assert fast["metrics"]["sums_mc/acc,none"] == pytest.approx(sum(acc["fast"].values()) / len(PROBLEMS))
    text = (tmp_path / "fast" / "samples_sums_mc.jsonl").read_text()
    assert set(stats.problem_scores(text)) == {"acc,none", "acc_norm,none"}  # not the answer's index (`target`)
    paired = stats.paired_difference(tmp_path / "fast", tmp_path / "plain", "sums_mc/acc,none")
    diffs = [acc["plain"][i] - acc["fast"][i] for i in range(len(PROBLEMS))]
    assert paired["n"] == len(PROBLEMS) and paired["diff"] == pytest.approx(sum(diffs) / len(PROBLEMS))
    gate = load_config(["recipe=tiny", "sft.gate.metric=sums_mc/acc,none", "sft.gate.max_drop=1.0"]).sft.gate
    verdict = judge(gate, plain["metrics"], ("fast", fast["metrics"]["sums_mc/acc,none"]), paired)
    assert verdict["passed"] and f"n={len(PROBLEMS)})" in verdict["reason"]


def test_the_built_in_and_a_referenced_verifier_score_completions():
    gsm8k = verifiers.load("gsm8k", "ppo.reward")
    assert gsm8k(["so #### 1,200", "#### 7", "no answer"], ["1200", "Work...\n#### 8", "3"]) == [1.0, 0.0, 0.0]
    assert verifiers.load("verifiable", "ppo.reward")(["#### 3"], ["3"]) == [1.0]  # its former name
    mine = verifiers.load("test_eval_tasks:exact_answer", "ppo.reward")
    assert mine([" 42 ", "41"], ["42", "42"]) == [1.0, 0.0]
    with pytest.raises(ConfigError, match="returned \\[1.0\\] for 2 completions; a verifier returns one number"):
        verifiers.load("test_eval_tasks:one_score", "ppo.reward")(["a", "b"], ["a", "b"])


def test_rl_stages_and_on_policy_pairs_use_the_referenced_verifier(tmp_path):
    from pipeline.rl.onpolicy import build_pairs
    from pipeline.rl.rewards import reward_function

    cfg = load_config(["recipe=tiny", "stages=[sft,ppo]", "ppo.reward=test_eval_tasks:exact_answer",
                       "ppo.format_reward=0.5", "dpo.on_policy.reward=test_eval_tasks:exact_answer"])
    score = reward_function(cfg.ppo, tmp_path, cfg.model)
    assert score([[]] * 3, ["42", "#### 42", "7"], ["42", "42", "42"]) == [1.0, 0.5, 0.0]  # + the `#### N` bonus
    verify = verifiers.load(cfg.dpo.on_policy.reward, "dpo.on_policy.reward")
    prompts = [[{"role": "user", "content": q}] for q in ("a", "b")]
    pairs, counts = build_pairs(prompts, ["42", "7"], [["41", "42"], ["#### 7", "8"]], verify=verify)
    assert [(p["chosen"][0]["content"], p["rejected"][0]["content"]) for p in pairs] == [("42", "41")]
    assert counts["correct_rate"] == 1 / 4 and counts["all_wrong"] == 1  # `#### 7` is not this verifier's 7


@pytest.mark.parametrize(("overrides", "expected"), [
    (["stages=[sft,ppo]", "ppo.reward=no_such_module_here:score"],
     "'ppo.reward' is 'no_such_module_here:score': module no_such_module_here does not import (ModuleNotFoundError"),
    (["stages=[sft,grpo]", "grpo.mixture=tiny_rl", "grpo.reward=test_eval_tasks:missing"],
     "'grpo.reward' is 'test_eval_tasks:missing': module test_eval_tasks has no missing"),
    (["stages=[sft,ppo]", "ppo.reward=test_eval_tasks:NOT_A_FUNCTION"], "int is not callable"),
    (["stages=[sft,ppo]", "ppo.reward=test_eval_tasks:one_argument"],
     "its signature (completions: 'list[str]') -> 'list[float]' does not take (completions, answers)"),
    (["stages=[sft,ppo]", "ppo.reward=exact"], "name a built-in verifier (gsm8k, verifiable) or a function as "
                                               "module:function"),
    (["dpo.on_policy.reward=test_eval_tasks:one_argument"], "'dpo.on_policy.reward' is 'test_eval_tasks:one_argument'"),
])
def test_a_bad_reward_reference_is_one_line_when_the_config_loads(overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_config(["recipe=tiny", *overrides])
    assert expected in str(err.value) and "\n" not in str(err.value) and err.value.code == 2


def test_a_bad_reward_reference_exits_2_before_torch_is_imported():
    code = ("import sys; from pipeline.run import main; rc = main(['stages=[sft,ppo]', 'ppo.reward=nowhere:fn']); "
            "assert 'torch' not in sys.modules, 'torch imported before the config error'; sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: 'ppo.reward' is 'nowhere:fn': module nowhere does not import (ModuleNotFoundError: No module named "
        "'nowhere'); is it on PYTHONPATH?"]
