"""Every bench script at its smallest size, run as a user runs it (`python bench/X.py ...`), so that a bench broken
by a dependency or a rename fails CI. Nothing is timed: each run must exit 0 and print its figures (the keys it
promises, finite numbers). `bench/gpu.py`'s CPU variant is tests/test_gpu_kit.py's.

The runs share the session's cache (tests/conftest.py): the tiny base model of the FAST setup is built once.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import FAST, ROOT, run_cli

pytestmark = pytest.mark.slow

TINY = [o for o in FAST if o.startswith("tiny.")]  # the FAST setup's data and base model (its cache key)
ONE_CANDIDATE = ["dpo.sweep.beta=[0.5]", "dpo.sweep.learning_rate=[1e-5]"]  # a sweep of one candidate
# The smallest tiny chain with a sweep: 2 SFT steps, one DPO candidate of one step on the shipped preference pairs
CHAIN = [*TINY, "stages=[sft,dpo]", "sft.max_steps=2", "dpo.max_steps=1", "dpo.on_policy.enabled=false",
         "dpo.mixture=tiny_prefs", *ONE_CANDIDATE, "dpo.soup.top_k=0", "sft.gate.action=warn",
         "dpo.gate.action=warn", "eval.max_gen_toks=16"]
PROBLEMS = 50  # the FAST setup's test and validation problems


def numbers(value: Any) -> Iterator[float]:
    """Every number in a parsed JSON value."""
    if isinstance(value, dict):
        for item in value.values():
            yield from numbers(item)
    elif isinstance(value, list):
        for item in value:
            yield from numbers(item)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        yield value


def printed_json(stdout: str) -> dict:
    """The indented JSON object a bench prints last (after any progress lines), its numbers checked finite."""
    lines = stdout.splitlines()
    out = json.loads("\n".join(lines[max(i for i, line in enumerate(lines) if line == "{"):]))
    assert all(math.isfinite(n) for n in numbers(out)), out
    return out


def check_dpo_sweep(stdout: str) -> None:
    """Each variant's wall and CPU seconds, and the ratios to the shared variant."""
    out = printed_json(stdout)
    assert out["candidates"] == 1 and out["pairs"] == 8
    for name in ("shared", "per_candidate", "per_step"):
        assert {f"{name}_wall_s", f"{name}_cpu_s"} <= set(out) and out[f"{name}_cpu_s"] > 0
    ratios = {f"{kind}_ratio_{name}_vs_shared" for kind in ("wall", "cpu") for name in ("per_candidate", "per_step")}
    assert ratios <= set(out)


def check_gain(stdout: str) -> None:
    """One line per trained checkpoint and metric: its score on every test problem and its paired gain (McNemar for
    exact match, the paired t for bits per byte)."""
    lines = stdout.splitlines()
    metrics = ("tiny_gsm/exact_match,strict-match", "tiny_gsm/exact_match,flexible-extract",
               "tiny_gsm_bpb/bits_per_byte,none")
    assert [line.split(":")[0] for line in lines] == [f"{stage} {m}" for stage in ("01-sft", "02-dpo") for m in metrics]
    diff = r"[+-]\d\.\d{3}"
    for line in lines:
        test = (rf"Tango score, \+\d+ / -\d+, n={PROBLEMS}" if "exact_match" in line else rf"paired t, n={PROBLEMS}")
        pattern = rf": \d\.\d{{3}} \(n={PROBLEMS}\), vs base {diff} \[{diff}, {diff}\], p\S+ \({test}\)$"
        assert re.search(pattern, line), line


def check_generation(stdout: str) -> None:
    """Stock and fast lm-eval score the problems, hf samples; each backend's tokens/s is reported."""
    assert re.search(r"^eval 1: stock [\d.]+ s, flexible-extract [\d.]+$", stdout, re.M), stdout
    assert re.search(r"^eval 2: fast [\d.]+ s", stdout, re.M) and re.search(r"^sampling 1: hf [\d.]+ s", stdout, re.M)
    rates = re.findall(r"^  (\w+) +wall .* ([\d.]+) tokens/s, ([\d.]+)x", stdout, re.M)
    assert [name for name, _, _ in rates] == ["stock", "fast", "hf"], stdout
    assert all(math.isfinite(float(rate)) for _, rate, _ in rates)
    assert re.search(r"identical greedy answers fast vs stock: \d/2", stdout), stdout


def check_pipeline_overhead(stdout: str) -> None:
    """Each part of the chain's wall time, as median and range."""
    out = printed_json(stdout)
    for key in ("wall_s", "training_steps_s", "evaluation_s", "outside_training_share"):
        assert set(out[key]) == {"median", "min", "max"}, key
    assert out["training_steps_s"]["median"] > 0 and out["evaluation_s"]["median"] > 0
    assert 0 <= out["outside_training_share"]["median"] < 1


def check_sft_settings(stdout: str) -> None:
    """Both variants' tokens/s, padding and step times, and their ratio to the first named."""
    variants = printed_json(stdout)["variants"]
    assert list(variants) == ["unpacked", "recipe"]
    for summary in variants.values():
        assert summary["tokens_per_s"]["median"] > 0 and 0 <= summary["padding_fraction"]["median"] < 1
        assert summary["tokens_per_s_vs_unpacked"]["median"] > 0
    assert variants["recipe"]["padding_fraction"]["median"] < variants["unpacked"]["padding_fraction"]["median"]


def check_sft_throughput(stdout: str) -> None:
    """Plain TRL's four settings and our two variants (tokens/s, ratios), and the accuracy comparison."""
    out = printed_json(stdout)
    for name in ("trl_defaults", "trl_no_checkpointing", "trl_packed", "trl_padding_free", "ours_recipe",
                 "ours_unpacked"):
        assert out[f"{name}_tokens_per_s"]["median"] > 0, name
    assert out["ratio_ours_recipe_vs_trl_best_fair"]["median"] > 0 and set(out["ours_recipe_breakdown"]) == {
        "forward_s", "backward_s", "optimizer_s", "data_wait_s", "save_s"}
    (seed,) = out["accuracy"]["seeds"].values()
    assert all(0 <= seed[name]["score"] <= 1 for name in ("recipe", "unpacked"))
    assert seed["recipe_minus_unpacked"]["n"] == PROBLEMS


def check_stage_gains(stdout: str) -> None:
    """Per seed, each stage's change on test with its gained and lost problems and mid-p; per stage, in how many seeds
    the gain was significant."""
    out = printed_json(stdout)
    assert list(out) == ["42"] and all([c["stage"] for c in r["stages"]] == ["sft", "dpo"] for r in out.values())
    for row in (c for r in out.values() for c in r["stages"]):
        assert row["n"] == PROBLEMS and 0 <= row["mid_p"] <= 1 and row["gained"] + row["lost"] <= PROBLEMS
    assert re.search(r"^seed 42       dpo: \d\.\d{3} -> \d\.\d{3}  \+\d+ / -\d+ of 50  mid-p ", stdout, re.M), stdout
    assert re.search(r"^sft: a significant gain in [01] of 1 seeds$", stdout, re.M), stdout


def check_tiny_demo(stdout: str) -> None:
    """Every checkpoint's accuracy on the test problems, its paired test against the previous one, the candidate."""
    out = printed_json(stdout)
    assert out["cpu_s"] > 0
    chain = out["checkpoints"]
    assert list(chain) == ["00-base", "01-sft", "02-dpo"] and all(c["n"] == PROBLEMS for c in chain.values())
    assert set(chain["01-sft"]["vs_previous"]) == {"won", "lost", "p"}
    assert chain["02-dpo"]["selected"] == "beta0.5-lr1e-05"
    assert chain["02-dpo"]["candidates"]["beta0.5-lr1e-05"]["steps"] == 1


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, cache_dir) -> Path:
    """A run folder of the smallest chain, through the CLI (the run `gain.py` reads)."""
    out = tmp_path_factory.mktemp("bench-run")
    proc = run_cli("recipe=tiny", f"output_root={out}", f"cache_dir={cache_dir}", *CHAIN)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "tiny"


# Each bench's arguments at its smallest size (from the test's temporary folder and a fixture's value by name: the
# session's cache, the tiny base model, the run folder) and the check of what it prints
CASES: dict[str, tuple[Callable[[Path, Callable], list[str]], Callable[[str], None]]] = {
    "dpo_sweep": (lambda tmp, get: ["--pairs", "8", "--cache", str(get("cache_dir")), *TINY, *ONE_CANDIDATE],
                  check_dpo_sweep),
    "gain": (lambda tmp, get: [str(get("tiny_run")), "--task", "tiny_gsm"], check_gain),
    "generation": (lambda tmp, get: [
        "--model", str(get("tiny_base")), "--limit", "2", "--max-new-tokens", "8", "--batch-size", "2", "--rounds", "1",
        "--samples", "2", "--prompts", "2", "--skip-vllm"], check_generation),
    "pipeline_overhead": (lambda tmp, get: [
        "--repeats", "1", "--out", str(tmp / "out"), f"cache_dir={get('cache_dir')}", *CHAIN], check_pipeline_overhead),
    "sft_settings": (lambda tmp, get: [
        "recipe=tiny", f"cache_dir={get('cache_dir')}", *TINY, "--steps", "1", "--rounds", "1",
        "--variant", "unpacked:sft.packing=false,sft.per_device_train_batch_size=8"], check_sft_settings),
    "sft_throughput": (lambda tmp, get: [
        "--steps", "1", "--batch", "2", "--repeats", "1", "--accuracy", "--cache", str(get("cache_dir")), *TINY,
        "sft.max_steps=2", "midtrain.max_steps=2", "eval.tasks=[tiny_gsm_val]", "eval.max_gen_toks=16"],
        check_sft_throughput),
    # the recipe's seed, whose base model the session's cache holds (another seed would build one more there)
    "stage_gains": (lambda tmp, get: ["--seeds", "1", "--first-seed", "42", "--out", str(tmp / "gains"),
                                      f"cache_dir={get('cache_dir')}", *CHAIN], check_stage_gains),
    "tiny_demo": (lambda tmp, get: ["--out", str(tmp / "demo"), f"cache_dir={get('cache_dir')}", *CHAIN],
                  check_tiny_demo),
}


def test_every_bench_is_tested():
    """A new bench script gets a case here (gpu.py: tests/test_gpu_kit.py)."""
    assert sorted(p.stem for p in (ROOT / "bench").glob("*.py")) == sorted([*CASES, "gpu"])


@pytest.mark.parametrize("bench", sorted(CASES))
def test_bench_smallest_size(bench, tmp_path, tiny_base, request):
    """`python bench/<bench>.py` at its smallest size exits 0 and prints what it promises."""
    arguments, check = CASES[bench]
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, str(ROOT / "bench" / f"{bench}.py"),
           *arguments(tmp_path, request.getfixturevalue)]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check(proc.stdout)
