"""Shared fixtures: offline Hub, a tiny-recipe runner on the real CLI, one cache for all tests, a browser."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import faultmatrix
import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# A smaller tiny setup than the recipe's, so end-to-end tests take seconds per stage.
FAST = [
    "stages=[sft,midtrain]", "tiny.pretrain_steps=60", "tiny.pretrain_examples=1500", "tiny.sft_examples=600",
    "tiny.midtrain_examples=400", "tiny.general_examples=200", "tiny.test_examples=50",
    "sft.max_steps=30", "midtrain.max_steps=20", "sft.logging_steps=5", "midtrain.logging_steps=5",
    # SFT packs chats (95 tokens on average) into rows of 256: 6 rows hold about 16 chats
    "sft.per_device_train_batch_size=6", "midtrain.per_device_train_batch_size=16",
    # the recipe's gates are set for its full training; these few steps only check the plumbing
    "sft.gate.action=warn", "midtrain.gate.action=warn", "dpo.gate.action=warn",
    # one eval task (the 50 test problems) keeps every scoring step short; tests/test_eval.py scores the
    # recipe's validation task and gates on it
    "tiny.validation_examples=50", "eval.tasks=[tiny_gsm]",
    *(f"{s}.gate.metric=tiny_gsm/exact_match,strict-match" for s in ("sft", "midtrain", "dpo", "ppo", "grpo")),
]


def missing(why: str) -> None:
    """A resource a test needs is missing: skip it on a developer's machine, fail it in CI (`CI` set), where
    .ci/run installs everything."""
    if os.environ.get("CI"):
        pytest.fail(why)
    pytest.skip(why)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One cache (synthetic data, tiny base model) shared by every test of the session."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def tiny_base(cache_dir) -> Path:
    """The tiny base checkpoint of the FAST setup, built once (a one-step run builds it)."""
    models = list(Path(cache_dir).glob("tiny-*/model"))
    if not models:
        proc = run_cli("recipe=tiny", f"output_root={cache_dir}/warm", f"cache_dir={cache_dir}", *FAST,
                       "stages=[sft]", "sft.max_steps=1", "eval.tasks=[]", "sft.gate.metric=")
        assert proc.returncode == 0, proc.stderr[-3000:]
        models = list(Path(cache_dir).glob("tiny-*/model"))
    (model,) = models
    return model


def run_cli(*args: str, launcher: list[str] | None = None, env: dict | None = None,
            timeout: int = 900) -> subprocess.CompletedProcess:
    """Run `pipeline/run.py` in a subprocess (optionally under a launcher) and capture its output."""
    cmd = [*(launcher or [sys.executable]), str(ROOT / "pipeline" / "run.py"), *args]
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=full_env)


def render_in_chromium(page: Path, tmp: Path, width: int = 1280, height: int = 2400) -> tuple[int, Path, str]:
    """Render an HTML file in headless Chromium at `width` px: (document scroll width, screenshot, DOM).

    The scroll width is read by a script run on a copy of the page (written into the dumped DOM);
    a value above `width` means the page scrolls sideways. Skips (fails on CI) without Chromium.
    """
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        missing("chromium is not installed (.ci/run installs it)")
    flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp / 'profile'}",
             f"--window-size={width},{height}"]
    probe = tmp / "probe.html"
    probe.write_text(page.read_text().replace(
        "</body>", "<script>document.body.dataset.scrollWidth = document.documentElement.scrollWidth</script></body>"))
    dom = subprocess.run([*flags, "--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=120).stdout
    shot = tmp / "screenshot.png"
    subprocess.run([*flags, f"--screenshot={shot}", page.resolve().as_uri()], capture_output=True, timeout=120)
    found = re.search(r'data-scroll-width="(\d+)"', dom)
    assert found and shot.is_file(), dom[-2000:]
    return int(found.group(1)), shot, dom


def ink(png: Path) -> float:
    """The fraction of a screenshot's pixels that are not white (0: a blank page)."""
    from PIL import Image

    gray = Image.open(png).convert("L")
    return sum(1 for v in gray.getdata() if v < 250) / (gray.width * gray.height)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under mutmut (pyproject's `[tool.mutmut]`, run from its `mutants/` copy), the quickest tests first: most
    mutants fail the first test that runs, and a mutant's run stops at its first failure."""
    took = Path("mutmut-stats.json")  # each test's duration, as mutmut measured it
    if os.environ.get("MUTANT_UNDER_TEST") and took.is_file():
        durations = json.loads(took.read_text())["duration_by_test"]
        items.sort(key=lambda item: durations.get(item.nodeid, 0.0))


def pytest_addoption(parser: pytest.Parser) -> None:
    """`--fault-matrix FILE`: rewrite the fault matrix in FILE (docs/reliability.md) from this run (faultmatrix.py)."""
    parser.addoption("--fault-matrix", metavar="FILE", help="rewrite the fault matrix in FILE from the marked tests "
                     "that pass in this run")


def pytest_configure(config: pytest.Config) -> None:
    """The `fault` marker (tests/faultmatrix.py) and the cells of this run's passing marked tests."""
    config.addinivalue_line("markers", "fault(phase, fault, code, rerun): the fault matrix cell a test checks")
    config.fault_cells = {}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Keep the cell of each `fault` marker (checked against the matrix's rows and columns) of a test that passed."""
    report = yield
    for mark in item.iter_markers("fault"):
        phase, fault, code, rerun = mark.args
        faultmatrix.check(phase, fault)
        if report.when == "call" and report.passed:
            item.config.fault_cells.setdefault((phase, fault), []).append(
                faultmatrix.entry(f"{item.path.stem}::{item.name}", code, rerun))
    return report


def pytest_sessionfinish(session: pytest.Session) -> None:
    """With `--fault-matrix FILE`: write the cells this run's tests passed into FILE."""
    path = session.config.getoption("--fault-matrix")
    if path:
        faultmatrix.write(Path(path), session.config.fault_cells)
