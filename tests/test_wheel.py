"""The package as a user installs it: the wheel carries every file of `pipeline/`, and, inside the package, the
checkout's `recipes/` (with the accelerate and DeepSpeed configs), `data_mixtures/` and `eval/` (lm-eval task files),
and the license; installed into a fresh virtual environment outside the
checkout, every shipped recipe loads and plans, and `smol-pipeline recipe=tiny` (FAST) runs from a folder outside
the checkout on the wheel's own code.

That run is the product's end-to-end check: the terminal, the run folder's contract, each stage's training and
handoff, the final model, and resume / refusal / redo are asserted on it. The fresh environment sees the test
environment's libraries through a `.pth` naming their site-packages folders (whose own `.pth` files, the project's
editable install among them, Python does not run from there), and the wheel goes in without its dependencies:
seconds, not the minutes torch's install takes.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import FAST, ROOT
from test_e2e import changed, weights
from transformers import AutoModelForCausalLM, AutoTokenizer

pytestmark = pytest.mark.slow
SHIPPED = ("recipes", "data_mixtures", "eval")  # top-level folders the wheel carries as pipeline/<name>
BUILT_FROM = ("pyproject.toml", "README.md", "LICENSE", "pipeline", *SHIPPED)  # what the wheel is built from
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of the checkout on the path


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A copy of what the wheel is built from (a build in the checkout would reuse its build/ folder)."""
    src = tmp_path_factory.mktemp("src")
    for name in BUILT_FROM:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, src)
    return src


@pytest.fixture(scope="module")
def wheel(source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                           str(out), str(source)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (built,) = out.glob("*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh virtual environment holding the wheel, with the test environment's libraries on its path."""
    env = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
    python = str(env / "bin" / "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], env=ENV,
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "outer-environment.pth").write_text("".join(f"{p}\n" for p in site.getsitepackages()))
    # pip from the outer environment installs into this one; --ignore-installed: the outer project is left alone
    proc = subprocess.run([python, "-m", "pip", "install", "--no-deps", "--ignore-installed", "--no-index", "-q",
                           str(wheel)], env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return env


@pytest.fixture(scope="module")
def elsewhere(tmp_path_factory) -> Path:
    """The working folder of every command here: outside the checkout."""
    return tmp_path_factory.mktemp("elsewhere")


def installed(venv: Path, elsewhere: Path, *cmd: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """Run `cmd` (a program of the fresh environment's bin/, then its arguments) from outside the checkout."""
    return subprocess.run([str(venv / "bin" / cmd[0]), *cmd[1:]], cwd=elsewhere, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def test_the_wheel_carries_every_file_of_the_package_and_the_license(source, wheel):
    names = zipfile.ZipFile(wheel).namelist()
    files = {p.relative_to(source).as_posix() for p in (source / "pipeline").rglob("*") if p.is_file()}
    files |= {f"pipeline/{p.relative_to(source).as_posix()}" for name in SHIPPED for p in (source / name).rglob("*")
              if p.is_file()}
    assert {n for n in names if n.startswith("pipeline/")} == files
    dist = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
    assert zipfile.ZipFile(wheel).read(f"{dist}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
    metadata = zipfile.ZipFile(wheel).read(f"{dist}/METADATA").decode()
    assert "\nLicense-Expression: Apache-2.0\n" in metadata and "\nLicense-File: LICENSE\n" in metadata


def test_every_shipped_recipe_loads_and_plans_from_the_installed_package(venv, elsewhere, tmp_path):
    """`help=true` and `plan=true` of every recipe and a shipped accelerate config by name, read from the installed
    package (in one process: each command would import the same; the tiny run below writes the eval task files)."""
    script = f"""
import pipeline
from pipeline.chain.plan import report
from pipeline.config import load_config
from pipeline.describe import describe
from pipeline.recipe_files import available_recipes
from pipeline.launch import config_options

print(pipeline.__file__)
for recipe in available_recipes():
    cfg = load_config([f"recipe={{recipe}}", "output_root={tmp_path}", "plan=true"])
    assert describe(cfg).startswith(f"recipe {{recipe}}: stages "), recipe
    assert report(cfg).startswith(f"plan for recipe {{recipe}} "), recipe
    print(recipe)
print(*config_options("zero3", None))
"""
    proc = installed(venv, elsewhere, "python", "-c", script, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    package, *recipes, options = proc.stdout.splitlines()
    where = Path(package).parent
    assert where.is_relative_to(venv) and where.parent.name == "site-packages"
    assert recipes == sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
    assert options.split() == ["--config_file", str(where / "recipes/accelerate/zero3.yaml"),
                               "--deepspeed_config_file", str(where / "recipes/accelerate/zero3.json")]


def quickstart() -> list[list[str]]:
    """The commands of the README's Quickstart: one list of command lines per fenced bash block."""
    section = (ROOT / "README.md").read_text().split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    return [[line.split("#", 1)[0].strip() for line in b.splitlines() if line.split("#", 1)[0].strip()] for b in blocks]


def test_the_quickstart_is_two_blocks_whose_last_commands_the_tests_run():
    first, second = quickstart()  # exactly two
    assert first[-1] == "smol-pipeline recipe=tiny"  # what tiny_chain runs, from the installed wheel
    ci = [line.split(" || ")[0] for line in (ROOT / ".ci/run").read_text().splitlines()]
    assert second[-1] == 'python -m pytest -q -m "not slow"' and second[-1] in ci  # the fast tier, which CI runs
    assert ci.index(second[-1]) < ci.index("python -m pytest -q -m slow")  # then the slow tier


@pytest.fixture(scope="module")
def tiny_chain(venv, elsewhere, tmp_path_factory, cache_dir):
    """The README's first Quickstart command, through the installed `smol-pipeline` from outside the checkout, with
    the FAST settings: (run folder, arguments, the process)."""
    out = tmp_path_factory.mktemp("runs")
    command, *readme_args = shlex.split(quickstart()[0][-1])
    args = [*readme_args, f"output_root={out}", f"cache_dir={cache_dir}", *FAST]
    proc = installed(venv, elsewhere, command, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "tiny", args, proc


@pytest.fixture(scope="module")
def tiny_run(tiny_chain):
    return tiny_chain[:2]


def test_the_run_is_the_wheels_code(tiny_run, venv, wheel):
    run, _ = tiny_run
    code = json.loads((run / "manifest.json").read_text())["code"]
    assert Path(code["path"]).is_relative_to(venv) and code["path"].endswith("site-packages/pipeline")
    version = wheel.name.split("-")[1]
    assert code["version"] == version and code["git_commit"] is None and code["git_dirty"] is None
    assert f"code smol-pipeline {version}" in (run / "leaderboard.md").read_text()  # no commit outside a checkout
    board = json.loads((run / "leaderboard.json").read_text())
    assert [row["checkpoint"] for row in board["rows"]] == ["00-base", "01-sft", "02-midtrain"]


def test_terminal_reads_like_a_report(tiny_chain):
    """No library warning, raw dict or Python repr on the terminal: one line per logging step, rounded figures,
    the summary table and the leaderboard's path at the end; the trainers' full records are in pipeline.log."""
    run, _, proc = tiny_chain
    text = proc.stdout + proc.stderr
    for noise in ("Warning", "warn(", "{'", "forward_call", "accelerate launch", "[WARNING]", "it/s]"):
        assert noise not in text, noise
    lines = proc.stderr.splitlines()
    assert all(line.strip() for line in lines[: lines.index(next(x for x in lines if "## tiny" in x))])  # no blanks
    steps = [line for line in lines if re.search(r" INFO 01-sft: step \d+/30, loss \d+\.\d{3}, [\d,]+ tokens/s", line)]
    assert len(steps) == 7 and "ETA" in steps[1]  # steps 1, 5, ..., 30
    assert re.search(r"sft: trained in [\w ]+: 30 steps, loss \d\.\d{3} -> \d\.\d{3}, padding \d+%", proc.stderr)
    assert "| checkpoint | validation | test |" in proc.stderr
    assert lines[-1] == f"leaderboard: {run / 'leaderboard.html'}"
    log = (run / "pipeline.log").read_text()
    assert "01-sft: step 5: loss=" in log and "learning_rate=" in log  # the trainer's own record, in the file only


def test_run_folder_matches_the_contract(tiny_run):
    run, _ = tiny_run
    for name in ("resolved.yaml", "manifest.json", "pipeline.log", "outcome.json", "leaderboard.csv",
                 "leaderboard.md", "leaderboard.html"):
        assert (run / name).is_file(), name
    manifest = json.loads((run / "manifest.json").read_text())
    assert {"code", "packages", "hardware", "data", "seeds"} <= set(manifest)
    assert manifest["packages"]["trl"] and set(manifest["data"]) == {"sft", "midtrain"}
    # the CPU's kernels shape fp32 results (README, 'Results'): the manifest names them
    assert manifest["hardware"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert manifest["hardware"]["cpu"]
    assert json.loads((run / "outcome.json").read_text())["exit_code"] == 0
    assert sorted(p.name for p in (run / "stages").iterdir()) == ["00-base", "01-sft", "02-midtrain"]
    for stage in ("01-sft", "02-midtrain"):
        files = {p.name for p in (run / "stages" / stage / "model").iterdir()}
        assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= files
        assert not [p for p in (run / "stages" / stage).iterdir() if p.name.startswith(".")]  # no temp leftovers


def test_each_stage_trained_and_handed_off(tiny_run, cache_dir):
    run, _ = tiny_run
    sft = json.loads((run / "stages/01-sft/stage.json").read_text())
    mid = json.loads((run / "stages/02-midtrain/stage.json").read_text())
    for record in (sft, mid):
        assert record["status"] == "done" and record["world_size"] == 1
        m = record["metrics"]
        assert m["steps"] > 0 and m["tokens"] > 0
        assert m["loss_last"] < m["loss_first"], m["losses"]
    assert mid["input_model"] == sft["output_model"] == "stages/01-sft/model"  # relative to the run folder
    assert mid["upstream"] == sft["fingerprint"]
    (base,) = Path(cache_dir).glob("tiny-*/model")
    assert sft["input_model"] == str(base)
    w_base, w_sft, w_mid = (weights(p) for p in (base, run / "stages/01-sft/model", run / "stages/02-midtrain/model"))
    assert changed(w_base, w_sft) and changed(w_sft, w_mid)


def test_final_model_loads_and_chats(tiny_run):
    run, _ = tiny_run
    path = run / "stages/02-midtrain/model"
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok.apply_chat_template([{"role": "user", "content": "Tom has 3 apples."}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] > ids["input_ids"].shape[1]


def test_rerun_reuses_then_refuses_a_changed_stage_then_redoes(tiny_run, venv, elsewhere):
    run, args = tiny_run

    def again(*extra: str) -> subprocess.CompletedProcess:  # one process, no launcher: what the launcher runs
        return installed(venv, elsewhere, "python", "-m", "pipeline.run", *args, *extra)

    before = {p: p.stat().st_mtime_ns for p in run.glob("stages/*/stage.json")}
    same = again()
    assert same.returncode == 0, same.stderr[-2000:]
    assert same.stderr.count("reusing finished stage") == 2
    assert before == {p: p.stat().st_mtime_ns for p in run.glob("stages/*/stage.json")}

    refused = again("sft.learning_rate=3e-4")
    assert refused.returncode == 2
    message = refused.stderr.strip().splitlines()[-1]
    assert "01-sft" in message and "learning_rate" in message and "redo=[sft]" in message
    assert before == {p: p.stat().st_mtime_ns for p in run.glob("stages/*/stage.json")}

    redo = again("sft.learning_rate=3e-4", "redo=[sft]")
    assert redo.returncode == 0, redo.stderr[-2000:]
    sft = json.loads((run / "stages/01-sft/stage.json").read_text())
    mid = json.loads((run / "stages/02-midtrain/stage.json").read_text())
    assert sft["config"]["learning_rate"] == pytest.approx(3e-4)
    assert mid["upstream"] == sft["fingerprint"]
    assert all(p.stat().st_mtime_ns > t for p, t in before.items() if "00-base" not in str(p))  # base eval reused
