"""Publishing a run (pipeline/report/hub.py): the upload plan of a finished tiny run (the final model to main, each
stage's to its branch, candidates only when asked, the LoRA-trained final model as full weights), its model cards
as the Hub reads them, resume safety, the login check and no token in any file. `hub.upload`, the one call to the
Hub, is not run: huggingface_hub offers no local stand-in of the Hub."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml
from conftest import FAST, run_cli
from huggingface_hub import ModelCard, ModelCardData, constants, metadata_load
from huggingface_hub.repocard_data import eval_results_to_model_index, model_index_to_eval_results
from safetensors import safe_open

from pipeline import redact
from pipeline.chain import preflight
from pipeline.config import load_config
from pipeline.errors import BAD_INPUT, ConfigError
from pipeline.evaluation.lmeval import write_tasks
from pipeline.files import write_json
from pipeline.report import hub, modelcard
from pipeline.runfolder import RunPaths, StageRecord

TOKEN = "hf_NotARealTokenButLongEnough123"
REPO = "me/smol-tiny"
RUN = ["recipe=tiny", *FAST, "stages=[midtrain,sft]", "midtrain.max_steps=1", "sft.max_steps=2", "sft.lora.r=8",
       "sft.sweep={learning_rate: [1e-3, 2e-3]}", "eval.limit=4", "eval.max_gen_toks=32"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, cache_dir) -> tuple[list[str], Path]:
    """A finished tiny run of mid-training, then SFT with LoRA through a two-candidate sweep, a few steps each, with
    a token in the environment: (its arguments, its run folder)."""
    out = tmp_path_factory.mktemp("runs")
    args = [*RUN, f"output_root={out}", f"cache_dir={cache_dir}"]
    proc = run_cli(*args, env={"HF_TOKEN": TOKEN})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return args, out / "tiny"


def _plan(finished, *overrides: str) -> list[hub.Upload]:
    args, root = finished
    cfg = load_config([*args, f"push_to_hub={REPO}", *overrides])
    return hub.plan(cfg, root, [root / "stages/01-midtrain", root / "stages/02-sft"])


@pytest.mark.slow
def test_the_plan_pushes_each_stage_to_its_branch_and_the_final_model_to_main(finished):
    uploads = _plan(finished)
    root = finished[1]
    assert [u.target for u in uploads] == [f"{REPO}@01-midtrain", f"{REPO}@02-sft", f"{REPO}@main"]  # no candidates
    assert [u.folder for u in uploads] == [root / "stages/01-midtrain/model", root / "stages/02-sft/model",
                                           root / "stages/02-sft/model"]
    for u in uploads:
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(u.files) and "README.md" not in u.files
        assert all((u.folder / f).is_file() for f in u.files)
    assert 'model="me/smol-tiny", revision="01-midtrain")' in uploads[0].card
    assert 'model="me/smol-tiny")' in uploads[-1].card
    assert "This is the main branch of `me/smol-tiny`" in uploads[-1].card
    assert uploads[-1].message == "tiny: the final model, 02-sft (smol-pipeline, recipe tiny)"
    assert [u.key for u in _plan(finished)] == [u.key for u in uploads]  # the same run, the same plan


@pytest.mark.slow
def test_sweep_candidates_are_pushed_only_when_asked(finished):
    targets = [u.target for u in _plan(finished, "push_candidates=true")]
    assert targets == [f"{REPO}@01-midtrain", f"{REPO}@02-sft-lr0.001", f"{REPO}@02-sft-lr0.002", f"{REPO}@02-sft",
                       f"{REPO}@main"]


@pytest.mark.parametrize(("label", "branch"), [
    ("01-sft", "01-sft"), ("03-dpo/beta0.1-lr1e-05", "03-dpo-beta0.1-lr1e-05"),
    ("02-dpo/loss_type['apo_zero', 'sigmoid']", "02-dpo-loss_type_apo_zero_sigmoid"), ("02-dpo/x..y.", "02-dpo-x_y")])
def test_revision_names(label, branch):
    assert modelcard.revision(label) == branch


@pytest.mark.slow
def test_the_lora_trained_final_model_goes_as_full_weights(finished):
    final = _plan(finished)[-1]
    assert StageRecord.read(finished[1] / "stages/02-sft").config["lora"]["r"] == 8
    assert not [f for f in final.files if "adapter" in f]  # no PEFT adapter: merged when the stage saved it
    with safe_open(final.folder / "model.safetensors", "pt") as weights:
        names = list(weights.keys())
    assert "model.embed_tokens.weight" in names and not [n for n in names if "lora" in n]
    assert yaml.safe_load(final.card.split("---")[1])["library_name"] == "transformers"


@pytest.mark.slow
def test_the_cards_metadata_is_what_the_hub_reads(finished, tmp_path):
    """huggingface_hub's offline checks (the Hub's own validation, `ModelCard.validate`, needs the network): the
    YAML header parses (`metadata_load`), ModelCardData takes it, and `model-index` survives the round trip through
    `model_index_to_eval_results` / `eval_results_to_model_index`; the results are the stage record's scores."""
    root = finished[1]
    for upload in _plan(finished):
        path = tmp_path / "README.md"
        path.write_text(upload.card)
        meta = metadata_load(path)
        name, results = model_index_to_eval_results(meta["model-index"])
        assert eval_results_to_model_index(name, results) == meta["model-index"]
        assert ModelCardData(**meta).to_dict() == meta and ModelCard.load(path).data.to_dict() == meta
        record = StageRecord.read(upload.folder.parent)
        assert {f"{r.dataset_name}/{r.metric_name}": r.metric_value for r in results} == record.scores()
        assert {(r.dataset_type, r.dataset_split, r.task_type) for r in results} == {
            ("tiny_gsm", "test", "text-generation")}  # local data: no Hub id, its task's name
        kinds = ["midtrain", "sft"][: int(upload.folder.parent.name[:2])]  # the stage kinds up to this model
        assert meta["tags"] == ["smol-pipeline", "trl", *kinds] and meta["library_name"] == "transformers"
        assert "base_model" not in meta and "datasets" not in meta  # a built base, generated data: nothing on the Hub
        assert str(root) not in upload.card  # no path of this machine


@pytest.mark.slow
def test_a_rerun_does_not_push_again(finished):
    """What `hub_pushes.json` holds with the same key is not pushed again: with everything recorded, `push` reaches
    no network (offline here, any call to the Hub would fail); `push_again` and a changed card push again."""
    args, root = finished
    uploads = _plan(finished)
    record = RunPaths(root).hub_pushes
    write_json(record, {u.target: {"key": u.key} for u in uploads})
    try:
        cfg = load_config([*args, f"push_to_hub={REPO}"])
        hub.push(cfg, root, [root / "stages/01-midtrain", root / "stages/02-sft"])
        assert hub.pending(uploads, {u.target: {"key": u.key} for u in uploads}, again=True) == uploads
        changed = _plan(finished, "seed=1")  # the card names the seed
        assert hub.pending(changed, {u.target: {"key": u.key} for u in uploads}) == changed
        assert hub.pending(uploads, {u.target: {"key": u.key} for u in uploads[:-1]}) == uploads[-1:]
    finally:
        record.unlink()


@pytest.mark.slow
def test_no_token_in_any_file(finished):
    """The run had a token in its environment; its files, the cards written for a push and the record of pushes hold
    none of it."""
    args, root = finished
    cfg = load_config([*args, f"push_to_hub={REPO}"])
    uploads = hub.plan(cfg, root, [root / "stages/01-midtrain", root / "stages/02-sft"])
    assert not [u for u in uploads if TOKEN in u.card + u.message]
    for stage in ("01-midtrain", "02-sft"):
        modelcard.write(cfg, root, root / "stages" / stage)
    files = [p for p in root.rglob("*") if p.is_file()]
    assert len(files) > 20 and not [p for p in files if TOKEN.encode() in p.read_bytes()]


@pytest.mark.parametrize(("value", "message"), [
    ("true", "push_to_hub takes the Hub repository to push to, not true: push_to_hub=ORG/NAME"),
    ("smol", "push_to_hub is 'smol': name its owner too, ORG/NAME (e.g. push_to_hub=me/smol)"),
    ("me/bad name", "push_to_hub is 'me/bad name', not a Hub repository id: Repo id must use alphanumeric chars")])
def test_push_to_hub_takes_a_repository(value, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        load_config([f"push_to_hub={value}"])


def test_a_push_without_a_hub_login_exits_2_in_the_preflight(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))  # not this machine's login
    cfg = load_config(["recipe=tiny", *FAST, f"output_root={tmp_path}", f"cache_dir={tmp_path / 'cache'}",
                       f"push_to_hub={REPO}"])
    with pytest.raises(ConfigError) as err:  # the one-pass check before any model loads
        preflight.check(cfg, tmp_path / "tiny", write_tasks(cfg, tmp_path / "tasks"), 1)
    assert err.value.code == BAD_INPUT and str(err.value) == (
        f"push_to_hub={REPO} needs a Hub login, and there is none: run `hf auth login` or set HF_TOKEN (a token that "
        "can write to it)")


def test_a_push_while_the_hub_is_off_exits_2_and_the_token_is_kept_out_of_the_log(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    with pytest.raises(ConfigError, match="HF_HUB_OFFLINE is set: unset it, or run without push_to_hub") as err:
        preflight.hub_login(load_config([f"push_to_hub={REPO}"]))  # the tests run with HF_HUB_OFFLINE=1
    assert err.value.code == BAD_INPUT
    assert redact.scrub(f"Authorization: Bearer {TOKEN}") == "Authorization: Bearer <redacted>"


def test_no_push_is_started_that_the_job_s_end_would_cut_short(tmp_path, monkeypatch):
    """Each push is timed in hub_pushes.json; under a Slurm time limit, a push that the slowest rate so far says
    would not end in time is not started: the run stops as on a signal (exit 75), and the requeued job pushes it."""
    from pipeline import preempt
    from pipeline.errors import Preempted

    monkeypatch.setattr(preempt, "_requested", dict(preempt._requested))  # this test's stop stays in it
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model.safetensors").write_bytes(b"w" * 4000)
    item = hub.Upload(REPO, "main", tmp_path / "model", ["model.safetensors"], "card", "m", "k")
    sent = []
    monkeypatch.setattr(hub, "upload", lambda u: sent.append(u) or "https://hub/commit/1")
    record = tmp_path / "hub_pushes.json"
    pushed = {f"{REPO}@01-sft": {"key": "j", "bytes": 1000, "seconds": 10.0}}  # 100 bytes/s: 40 s for this one
    monkeypatch.setenv("SLURM_JOB_END_TIME", str(time.time() + 20))
    with pytest.raises(Preempted, match=rf"\d+ s left, {REPO}@main would take about 40 s\); stopped cleanly"):
        hub.push_uploads([item], pushed, record, tmp_path)
    assert sent == [] and not record.exists()
    preempt._requested.update(signal=None, reason=None)
    monkeypatch.setenv("SLURM_JOB_END_TIME", str(time.time() + 3600))
    hub.push_uploads([item], pushed, record, tmp_path)
    assert sent == [item] and pushed[item.target]["bytes"] == 4004 and pushed[item.target]["seconds"] >= 0
