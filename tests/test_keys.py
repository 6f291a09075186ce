"""The key-property suite: for each key the pipeline reuses by (pipeline/keys.py), the changes that must change it
and the changes that must not, each tried on real scratch folders with the real key functions. No model is
trained: a model folder is its files."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from pipeline import keys
from pipeline.chain import sweep
from pipeline.chain.resume import base_fingerprint, decide, eval_fingerprint
from pipeline.config import load_config
from pipeline.data.mixtures import fingerprints
from pipeline.evaluation import lmeval
from pipeline.evaluation.scorecache import score_key
from pipeline.runfolder import StageContext
from pipeline.tiny.data import tiny_dir

TASK = """task: my_task
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
doc_to_text: "Q: {{{{question}}}}"
"""


def _model(folder: Path, weights: bytes = b"w1") -> Path:
    """A checkpoint folder as the keys see it: config, weights, tokenizer, a model card."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "tokenizer.json").write_text("{}")
    (folder / "README.md").write_text(f"a card written by the run in {folder}")
    return folder


def _tasks(root: Path, prompt: str = "Q:", rows: str = '{"question": "1+1"}\n') -> Path:
    """A run's task folder whose one task names a data file outside it (as the shipped tasks name the cache's)."""
    data = root / "data" / "test.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text(rows)
    tasks = root / "run" / "eval_tasks"
    tasks.mkdir(parents=True, exist_ok=True)
    (tasks / "my_task.yaml").write_text(TASK.format(data=data).replace("Q:", prompt))
    return tasks


EV = {"tasks": ["my_task"], "num_fewshot": 0, "limit": 0, "max_gen_toks": 256, "batch_size": 16,
      "apply_chat_template": True, "include_path": "", "gsm8k_dir": "", "backend": "hf",
      "chat_template_kwargs": None}
MODEL_CFG = {"name_or_path": "x", "precision": "auto", "attn_implementation": "sdpa", "trust_remote_code": False}


def _score(model: Path, tasks: Path, ev: dict | None = None) -> str:
    found = score_key(model, ev or EV, tasks, MODEL_CFG)
    assert found is not None
    return found[0]


def _hub_snapshot(root: Path) -> Path:
    """A model laid out as the Hugging Face cache lays it: files in blobs/, symlinked from snapshots/<commit>/."""
    repo = root / ".cache" / "huggingface" / "hub" / "models--org--m"
    snapshot = repo / "snapshots" / ("a" * 40)
    _model(root / "staging")
    for file in sorted((root / "staging").iterdir()):
        blob = repo / "blobs" / file.name
        blob.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(file, blob)
        snapshot.mkdir(parents=True, exist_ok=True)
        (snapshot / file.name).symlink_to(blob)
    return snapshot


# --- the score cache's key --------------------------------------------------------------------------------------

def _edit_weights(m: Path, t: Path) -> tuple[Path, Path]:
    (m / "model.safetensors").write_bytes(b"w2")
    return m, t


def _edit_prompt(m: Path, t: Path) -> tuple[Path, Path]:
    (t / "my_task.yaml").write_text((t / "my_task.yaml").read_text().replace("Q:", "Question:"))
    return m, t


def _edit_task_data(m: Path, t: Path) -> tuple[Path, Path]:
    (t.parent.parent / "data" / "test.jsonl").write_text('{"question": "2+2"}\n')
    return m, t


def _move_model(m: Path, t: Path) -> tuple[Path, Path]:
    return Path(shutil.move(m, m.parent / "elsewhere")), t


def _model_under_cache(m: Path, t: Path) -> tuple[Path, Path]:
    target = m.parent / ".cache" / "runs" / "tiny" / "stages" / "01-sft" / "model"
    target.parent.mkdir(parents=True)
    return Path(shutil.move(m, target)), t


def _move_run_and_data(m: Path, t: Path) -> tuple[Path, Path]:
    """Another output root: the run's tasks and the cache's data they name both elsewhere, the same bytes."""
    old, new = t.parent.parent, t.parent.parent.parent / "moved"
    shutil.move(old, new)
    tasks = new / "run" / "eval_tasks"
    (tasks / "my_task.yaml").write_text(TASK.format(data=new / "data" / "test.jsonl"))
    return (new / m.relative_to(old) if m.is_relative_to(old) else m), tasks


def _rewrite_card(m: Path, t: Path) -> tuple[Path, Path]:
    (m / "README.md").write_text("another run's card")
    return m, t


MUST_CHANGE: dict[str, Callable] = {"weights": _edit_weights, "a task's prompt": _edit_prompt,
                                    "a task's data file": _edit_task_data}
MUST_NOT: dict[str, Callable] = {"the model folder moved": _move_model, "a .cache folder above the model":
                                 _model_under_cache, "another output root": _move_run_and_data,
                                 "the model card": _rewrite_card}


@pytest.mark.parametrize("change", MUST_CHANGE, ids=list(MUST_CHANGE))
def test_score_key_changes_with_what_decides_the_score(tmp_path, change):
    model, tasks = _model(tmp_path / "w" / "model"), _tasks(tmp_path / "w")
    before = _score(model, tasks)
    assert _score(*MUST_CHANGE[change](model, tasks)) != before


@pytest.mark.parametrize("change", MUST_NOT, ids=list(MUST_NOT))
def test_score_key_ignores_where_things_lie(tmp_path, change):
    model, tasks = _model(tmp_path / "w" / "model"), _tasks(tmp_path / "w")
    before = _score(model, tasks)
    assert _score(*MUST_NOT[change](model, tasks)) == before


def test_two_models_under_cache_folders_get_two_score_keys(tmp_path):
    """Finding 1: every file under a `.cache` folder was left out of the digest, so all such models shared a key."""
    tasks = _tasks(tmp_path)
    a = _model(tmp_path / ".cache" / "runs" / "tiny" / "stages" / "01-midtrain" / "model", b"midtrain")
    b = _model(tmp_path / ".cache" / "runs" / "tiny" / "stages" / "02-sft" / "model", b"sft")
    assert _score(a, tasks) != _score(b, tasks)


def test_a_hub_snapshot_is_keyed_by_its_files_like_the_same_folder_elsewhere(tmp_path):
    tasks = _tasks(tmp_path / "w")
    snapshot = _hub_snapshot(tmp_path / "home")
    assert _score(snapshot, tasks) == _score(_model(tmp_path / "plain" / "model"), tasks)
    (snapshot / "model.safetensors").resolve().write_bytes(b"other")
    assert _score(snapshot, tasks) != _score(_model(tmp_path / "plain" / "model"), tasks)


def test_score_key_and_eval_fingerprint_change_with_a_library_version(tmp_path, monkeypatch):
    model, tasks = _model(tmp_path / "w" / "model"), _tasks(tmp_path / "w")
    before, efp = _score(model, tasks), eval_fingerprint("stage", EV, tasks)
    real = metadata.version
    monkeypatch.setattr(keys.metadata, "version", lambda name: "9.9" if name == "transformers" else real(name))
    assert _score(model, tasks) != before and eval_fingerprint("stage", EV, tasks) != efp


def test_include_path_tasks_are_keyed_by_their_contents(tmp_path):
    """Finding 2: `eval.include_path` entered keys as a path string only."""
    own = tmp_path / "mine"
    _tasks(own)
    ev = {**EV, "include_path": str(own / "run" / "eval_tasks")}
    empty = tmp_path / "run_tasks"
    empty.mkdir()
    model = _model(tmp_path / "model")
    before, efp = _score(model, empty, ev), eval_fingerprint("stage", ev, empty)
    _edit_prompt(model, own / "run" / "eval_tasks")
    assert _score(model, empty, ev) != before and eval_fingerprint("stage", ev, empty) != efp


# --- the eval fingerprint ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("change", ["a task's prompt", "a task's data file"])
def test_eval_fingerprint_changes_with_the_tasks_contents(tmp_path, change):
    tasks = _tasks(tmp_path / "w")
    before = eval_fingerprint("stage", EV, tasks)
    MUST_CHANGE[change](tmp_path, tasks)
    assert eval_fingerprint("stage", EV, tasks) != before


def test_eval_fingerprint_ignores_another_output_root(tmp_path):
    tasks = _tasks(tmp_path / "w")
    before = eval_fingerprint("stage", EV, tasks)
    assert eval_fingerprint("stage", EV, _move_run_and_data(tmp_path, tasks)[1]) == before


# --- mixture fingerprints and the stage fingerprint --------------------------------------------------------------

def _mixture(folder: Path, **source) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "rows.jsonl").write_text("".join(f'{{"text": "row {i}", "body": "other {i}"}}\n' for i in range(8)))
    spec = {"seed": source.pop("seed", 0), "sources": [{"path": "rows.jsonl", **source}]}
    (folder / "mix.yaml").write_text(OmegaConf.to_yaml(spec))
    return str(folder / "mix.yaml")


MIXTURE_CHANGES = {"weight": {"weight": 0.25}, "seed": {"seed": 7}, "columns": {"columns": {"text": "body"}},
                   "remove": {"remove": ["row "]}}


@pytest.mark.slow
@pytest.mark.parametrize("change", MIXTURE_CHANGES, ids=list(MIXTURE_CHANGES))
def test_a_mixture_edit_changes_its_fingerprint_and_the_stage_fingerprint(tmp_path, change):
    """Finding 3: weight, seed and columns were in no fingerprint."""
    def stage_fp(mix: str) -> str:
        cfg = load_config(["recipe=tiny", f"output_root={tmp_path}", f"cache_dir={tmp_path / 'c'}", "stages=[midtrain]",
                           f"midtrain.mixture={mix}", "eval.tasks=[]", "midtrain.gate.metric="])
        return decide(cfg, tmp_path / "run")[0].fingerprint

    cfg = load_config(["recipe=tiny", f"output_root={tmp_path}"])
    path = _mixture(tmp_path / "a")
    data, stage = fingerprints(path, cfg), stage_fp(path)
    _mixture(tmp_path / "a", **MIXTURE_CHANGES[change])  # the same file, edited
    assert fingerprints(path, cfg) != data and stage_fp(path) != stage


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["mixture", "data"])
def test_a_moved_checkout_keeps_every_stage_fingerprint(tmp_path, setting):
    """A stage's settings that name a path (a mixture file, a data folder) key what they name, not where."""
    def decisions(folder: Path) -> list[tuple[str, str]]:
        value = [f"midtrain.mixture={folder / 'mix.yaml'}"] if setting == "mixture" else [
            "midtrain.mixture=", f"midtrain.data={folder}"]
        cfg = load_config(["recipe=tiny", f"output_root={tmp_path}", f"cache_dir={tmp_path / 'c'}",
                           "stages=[midtrain,sft]", *value, "eval.tasks=[]",
                           "midtrain.gate.metric=", "sft.gate.metric="])
        return [(d.fingerprint, d.prepared) for d in decide(cfg, tmp_path / "run")]

    _mixture(tmp_path / "checkout")
    before = decisions(tmp_path / "checkout")
    shutil.move(tmp_path / "checkout", tmp_path / "moved")
    assert decisions(tmp_path / "moved") == before
    (tmp_path / "moved" / "rows.jsonl").write_text('{"text": "other"}\n')
    assert decisions(tmp_path / "moved")[0] != before[0]


def test_a_moved_mixture_keeps_its_fingerprint(tmp_path):
    cfg = load_config(["recipe=tiny", f"output_root={tmp_path}"])
    before = fingerprints(_mixture(tmp_path / "checkout"), cfg)
    shutil.move(tmp_path / "checkout", tmp_path / "moved")
    assert fingerprints(str(tmp_path / "moved" / "mix.yaml"), cfg) == before


# --- the base fingerprint ---------------------------------------------------------------------------------------

def _base(tmp_path: Path, model: Path, *overrides: str) -> str:
    return base_fingerprint(load_config(["recipe=smol", f"output_root={tmp_path}", f"model.name_or_path={model}",
                                         *overrides]))


@pytest.mark.slow
def test_the_base_fingerprint_is_the_checkpoint_and_template_contents_not_their_paths(tmp_path):
    """Finding 4: a local checkpoint and `model.chat_template` entered as path strings."""
    model, template = _model(tmp_path / "base"), tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    before = _base(tmp_path, model, f"model.chat_template={template}")
    template.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    assert _base(tmp_path, model, f"model.chat_template={template}") != before
    after_template = _base(tmp_path, model, f"model.chat_template={template}")
    (model / "model.safetensors").write_bytes(b"retrained")
    assert _base(tmp_path, model, f"model.chat_template={template}") != after_template
    again = _base(tmp_path, model, f"model.chat_template={template}")
    moved = Path(shutil.move(model, tmp_path / "moved"))
    shutil.move(template, tmp_path / "moved.jinja")
    assert _base(tmp_path, moved, f"model.chat_template={tmp_path / 'moved.jinja'}") == again


def test_a_hub_base_model_is_keyed_by_its_revision(tmp_path):
    """Finding 4: `model.revision` was refused, so a Hub model could not be pinned."""
    cfg = ["recipe=smol", f"output_root={tmp_path}"]
    main = base_fingerprint(load_config(cfg))
    commit = "0123456789abcdef0123456789abcdef01234567"
    pinned = base_fingerprint(load_config([*cfg, f"model.revision={commit}"]))
    assert main != pinned and keys.pinned(commit) and not keys.pinned("main")


def test_a_hub_dataset_as_stage_data_is_keyed_by_its_revision(tmp_path):
    def data(*extra: str) -> list[dict]:
        cfg = load_config(["recipe=smol", f"output_root={tmp_path}", "sft.mixture=", "sft.data=org/chats", *extra])
        return decide(cfg, tmp_path / "run")[0].data

    assert data()[0]["revision"] == "main"
    assert data("sft.data_revision=" + "f" * 40)[0]["revision"] == "f" * 40


# --- sweep candidates and prepared data ---------------------------------------------------------------------------

def test_candidates_scored_under_other_eval_settings_are_scored_again(tmp_path):
    """Finding 5: a finished candidate kept the scores of other eval settings (limit, few-shot, tokens)."""
    cfg = load_config(["recipe=smol", f"output_root={tmp_path}", "dpo.sweep={beta: [0.1, 0.5]}"])
    ctx = StageContext(cfg, "dpo", tmp_path / "input", tmp_path / "run" / "stages" / "03-dpo")
    trained, scored = [], []

    def train(c: StageContext) -> dict:
        trained.append(c.out_dir.name)
        _model(c.model_dir)
        return {}

    def score(model: Path, out: Path) -> dict:
        scored.append(model.parent.name)
        return {"metrics": {}, "model_digest": keys.tree_digest(model)}  # as the score cache's result holds it

    ev = {**EV, "tasks": ["my_task"]}
    tasks = _tasks(tmp_path / "w")
    first = sweep.Scorer(score, eval_fingerprint("inputs", ev, tasks))
    sweep.train_candidates(ctx, "inputs", [{"id": "a", "beta": 0.1}, {"id": "b", "beta": 0.5}], train, first)
    assert trained == scored == ["a", "b"]
    trained.clear(), scored.clear()
    sweep.train_candidates(ctx, "inputs", [{"id": "a", "beta": 0.1}, {"id": "b", "beta": 0.5}], train, first)
    assert trained == scored == []
    for change in ({"limit": 50}, {"num_fewshot": 5}, {"max_gen_toks": 64}):
        other = sweep.Scorer(score, eval_fingerprint("inputs", {**ev, **change}, tasks))
        sweep.train_candidates(ctx, "inputs", [{"id": "a", "beta": 0.1}], train, other)
        assert trained == [] and scored == ["a"], change
        scored.clear()
    # a candidate whose model changed after it was scored is scored anew, never ranked on the old scores
    (ctx.stage_dir / "candidates" / "b" / "model" / "model.safetensors").write_bytes(b"edited")
    sweep.train_candidates(ctx, "inputs", [{"id": "b", "beta": 0.5}], train, first)
    assert trained == [] and scored == ["b"]
    sweep.train_candidates(ctx, "inputs", [{"id": "b", "beta": 0.5}], train, first)
    assert scored == ["b"]  # and kept under the new files' digest


def test_swept_truncation_gets_its_own_reference_log_probs(tmp_path):
    """Finding 7: candidates sweeping max_length shared reference log-probs cut at the first one's length."""
    cfg = load_config(["recipe=smol", f"output_root={tmp_path}"])
    ctx = StageContext(cfg, "dpo", tmp_path / "input", tmp_path / "stages" / "03-dpo")
    dirs = {ctx.for_candidate({"id": str(i), **c}).ref_pairs_dir for i, c in
            enumerate([{"max_length": 64}, {"max_length": 128}, {"truncation_mode": "keep_start"}, {"beta": 0.1}])}
    assert len(dirs) == 4 and ctx.for_candidate({"id": "x", "beta": 0.5}).ref_pairs_dir == ctx.ref_pairs_dir


# --- the tiny base model's cache folder ----------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("override", ["model.precision=bf16", "model.load_dtype=bf16",
                                      "model.attn_implementation=eager", "model.chat_template=chatml"])
def test_the_tiny_base_is_keyed_by_the_model_settings_it_was_built_with(tmp_path, override):
    """Finding 6: `tiny_dir` keyed only the tiny settings and the seed."""
    def folder(*extra: str) -> str:
        cfg = load_config(["recipe=tiny", f"output_root={tmp_path}", *extra])
        return tiny_dir(tmp_path, OmegaConf.to_container(cfg.tiny), cfg.model, cfg.seed).name

    assert folder(override) != folder()
    assert folder("output_root=/elsewhere") == folder()


def test_scoring_inputs_name_vllm_only_for_its_backend(tmp_path):
    tasks = _tasks(tmp_path)
    assert "vllm" in lmeval.scoring_inputs({**EV, "backend": "vllm"}, tasks)["libraries"]
    assert "vllm" not in lmeval.scoring_inputs(EV, tasks)["libraries"]


@pytest.mark.slow
def test_the_plan_says_which_hub_sources_move(tmp_path):
    from pipeline.chain.plan import build, report

    cfg = ["recipe=smol", f"output_root={tmp_path}", "plan=true"]
    plan = build(load_config(cfg))
    assert plan["model"]["pinned"] is False
    assert all(s["pinned"] is False for s in plan["stages"][0]["datasets"][0]["sources"])
    assert "revision main is a branch: it moves" in report(load_config(cfg))
    commit = "0123456789abcdef0123456789abcdef01234567"
    assert build(load_config([*cfg, f"model.revision={commit}"]))["model"]["pinned"] is True
    assert "is a branch" not in report(load_config([*cfg, f"model.revision={commit}"])).split("data weights")[0]


def test_a_run_folder_pins_its_hub_references_and_keeps_them_after_the_branch_moves(tmp_path, monkeypatch):
    """Reuse compares commits: a branch is resolved once per run folder (offline here: from the local Hugging Face
    cache's refs), recorded, keyed on and read at; after the branch moves the folder keeps its commit."""
    from huggingface_hub import constants

    from pipeline.chain import revisions
    from pipeline.chain.plan import report

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(keys, "_pins", {})

    def branch_at(commit: str) -> None:
        for folder in ("models--HuggingFaceTB--SmolLM3-3B-Base", "datasets--org--chats"):
            (tmp_path / "hub" / folder / "refs").mkdir(parents=True, exist_ok=True)
            (tmp_path / "hub" / folder / "refs" / "main").write_text(commit)

    c1, c2 = "1" * 40, "2" * 40
    args = ["recipe=smol", f"output_root={tmp_path}", "sft.mixture=", "sft.data=org/chats"]
    cfg, run = load_config(args), tmp_path / "smol"
    unpinned = decide(cfg, run)
    branch_at(c1)
    keys.use_pins(revisions.pin(cfg, run / "hub_revisions.json"))
    first = decide(cfg, run)
    assert first[0].data[0]["revision"] == c1 and first[0].upstream != unpinned[0].upstream
    # smoltalk2 is not in the cache: offline it cannot be read at all (the preflight refuses it), so not pinned
    assert OmegaConf.load(run / "hub_revisions.json") == {"model:HuggingFaceTB/SmolLM3-3B-Base@main": c1,
                                                          "dataset:org/chats@main": c1}
    branch_at(c2)  # the branch moves
    keys.use_pins(revisions.pin(cfg, run / "hub_revisions.json"))
    assert [d.fingerprint for d in decide(cfg, run)] == [d.fingerprint for d in first]
    plan = report(load_config([*args, "plan=true"]))
    assert f"revision {c1} (a commit)" in plan and f"@{c1}" in plan
    keys.use_pins(revisions.pin(cfg, tmp_path / "new" / "hub_revisions.json"))  # a new run folder
    assert decide(cfg, run)[0].data[0]["revision"] == c2



def test_a_hub_reference_the_hub_does_not_resolve_stays_a_branch_in_its_run_folder(tmp_path, monkeypatch, caplog):
    """Online, when the Hub does not answer and the cache has no ref: the folder records the branch name, and keeps
    it after a download leaves the commit in the cache (its keys never switch from the name to a commit)."""
    from huggingface_hub import HfApi, constants

    from pipeline.chain import revisions

    def unreachable(*args, **kwargs):
        raise ConnectionError("the Hub did not answer")

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(HfApi, "model_info", unreachable)
    monkeypatch.setattr(HfApi, "dataset_info", unreachable)
    cfg, pins = load_config(["recipe=smol", f"output_root={tmp_path}"]), tmp_path / "smol" / "hub_revisions.json"
    first = revisions.pin(cfg, pins)
    assert first["dataset:HuggingFaceTB/smoltalk2@main"] == "main" and "keys it by its branch name" in caplog.text
    later = tmp_path / "hub" / "datasets--HuggingFaceTB--smoltalk2" / "refs"
    later.mkdir(parents=True)
    (later / "main").write_text("3" * 40)  # the download left the commit in the cache
    assert revisions.pin(cfg, pins) == first
