"""The table of bad inputs: each is one clear message naming the culprit, exit code 2, nothing lost; all but the
one that needs the input model's tokenizer are found before any model loads (pipeline/chain/preflight.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import FAST, run_cli

pytestmark = pytest.mark.slow


def _jsonl(path: Path, rows: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _mixture(tmp: Path, rows: list | None, columns: dict | None = None) -> str:
    tmp = tmp / f"mixture{len(list(tmp.glob('mixture*')))}"  # one folder per case
    tmp.mkdir()
    data = _jsonl(tmp / "rows.jsonl", rows) if rows is not None else str(tmp / "absent.jsonl")
    mix = tmp / "mix.yaml"
    mix.write_text(json.dumps({"sources": [{"path": data, "columns": columns or {}}]}))
    return str(mix)


DPO = ["stages=[dpo]", "dpo.on_policy.enabled=false", "dpo.gate.metric=", "dpo.soup.top_k=0", "dpo.merge.stage=",
       "dpo.sweep.beta=null", "dpo.sweep.learning_rate=null"]


def _hub_mirror(tmp: Path) -> Path:
    """A local copy of a Hub dataset `acme/prefs` (no card: `train.jsonl`) whose second row is bad."""
    pair = {"prompt": "p", "chosen": [{"role": "user", "content": "p"}, {"role": "assistant", "content": "a"}],
            "rejected": [{"role": "user", "content": "p"}, {"role": "assistant", "content": "b"}]}
    (tmp / "hub/acme/prefs").mkdir(parents=True)
    _jsonl(tmp / "hub/acme/prefs/train.jsonl", [pair, {**pair, "rejected": pair["chosen"]}])
    mix = tmp / "hub_mix.yaml"
    mix.write_text(json.dumps({"sources": [{"hub": "acme/prefs", "split": "train", "columns": {
        "prompt": "prompt", "chosen": "chosen", "rejected": "rejected"}}]}))
    return tmp / "hub"


def _hub_chats(tmp: Path) -> tuple[Path, str]:
    """A local copy of a Hub dataset `acme/chats` (chat rows, no preference pairs) and a mixture reading it."""
    (tmp / "chats_hub/acme/chats").mkdir(parents=True)
    _jsonl(tmp / "chats_hub/acme/chats/train.jsonl", [CHAT])
    mix = tmp / "hub_chats.yaml"
    mix.write_text(json.dumps({"sources": [{"hub": "acme/chats", "split": "train"}]}))
    return tmp / "chats_hub", str(mix)


def _file(path: Path, content: str | bytes) -> str:
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(path)


# a template that renders only conversations opening with a system turn (the tiny recipe's rows have none)
NEEDS_SYSTEM = ("{%- if messages[0]['role'] != 'system' -%}{{ raise_exception('the first message must be a system "
                "message') }}{%- endif -%}{%- for m in messages -%}{{ m['role'] + ': ' + m['content'] + '\\n' }}"
                "{%- endfor -%}{%- if add_generation_prompt -%}{{ 'assistant: ' }}{%- endif -%}")
CHAT = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
EMPTY_ANSWER = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " "}]}
SAME_ONCE_NORMALISED = {"prompt": "p", "chosen": "x",
                        "rejected": [{"role": "user", "content": "p"}, {"role": "assistant", "content": "x"}]}
NUMBER_PROMPT = {"prompt": 7, "chosen": "x", "rejected": "y"}


def cases(tmp: Path, base: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (overrides, expected text in the one-line error)."""
    no_template = tmp / "no_template"
    shutil.copytree(base, no_template)
    (no_template / "chat_template.jinja").unlink()
    cfg = json.loads((no_template / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (no_template / "tokenizer_config.json").write_text(json.dumps(cfg))
    not_ckpt = tmp / "not_a_checkpoint"
    not_ckpt.mkdir()
    bad_config = tmp / "bad_config"
    bad_config.mkdir()
    (bad_config / "config.json").write_text('{"model_type": "llama", ')
    blocker = tmp / "a_file"
    blocker.write_text("x")
    latin1 = tmp / "latin1"
    latin1.mkdir()
    latin1_rows = _file(latin1 / "rows.jsonl", json.dumps(CHAT).encode() + b'\n{"messages": [{"role": "user", '
                        b'"content": "caf\xe9"}, {"role": "assistant", "content": "a"}]}\n')
    hub_chats, hub_chats_mix = _hub_chats(tmp)
    broken_yaml = _file(tmp / "broken.yaml", "sources:\n  - path: a.jsonl\n    columns: {user: q\n")
    docs = _jsonl(tmp / "docs.jsonl", [{"text": "a document"}])
    table = {
        "unknown key": (["sft.learnin_rate=1"], "did you mean 'sft.learning_rate'"),
        "wrong type": (["sft.max_steps=many"], "bad value for 'sft.max_steps'"),
        "unknown recipe": (["recipe=nope"], "unknown recipe 'nope'; available:"),
        "unknown stage kind": (["stages=[sft,rlhf]"], "unknown stage 'rlhf'"),
        "empty stage list": (["stages=[]"], "'stages' is empty"),
        "missing dataset file": ([f"sft.mixture={_mixture(tmp, None)}"], "dataset file not found"),
        "empty dataset": ([f"sft.mixture={_mixture(tmp, [])}"], "is empty"),
        "malformed JSONL line": ([f"sft.mixture={_mixture(tmp, [CHAT, '{oops'])}"], "rows.jsonl:2: malformed JSON"),
        "row missing a mapped column": ([f"sft.mixture={_mixture(tmp, [{'q': 1}], {'user': 'question'})}"],
                                        "rows.jsonl:1: row has no column 'question'"),
        "chosen equals rejected": (["stages=[dpo]", "dpo.on_policy.enabled=false", "dpo.gate.metric=",
                                    "dpo.soup.top_k=0", "dpo.merge.stage=",
                                    "dpo.sweep.beta=null", "dpo.sweep.learning_rate=null",
                                    f"dpo.mixture={_mixture(tmp, [{'prompt': 'p', 'chosen': 'x', 'rejected': 'x'}])}"],
                                   "chosen equal to rejected"),
        "empty assistant turn": ([f"sft.mixture={_mixture(tmp, [CHAT, EMPTY_ANSWER])}"],
                                 "rows.jsonl:2: chat row has an empty assistant turn"),
        "chosen equals rejected once normalised": ([*DPO, f"dpo.mixture={_mixture(tmp, [SAME_ONCE_NORMALISED])}"],
                                                   "rows.jsonl:1: preference row has chosen equal to rejected"),
        "prompt neither a string nor messages": ([*DPO, f"dpo.mixture={_mixture(tmp, [NUMBER_PROMPT])}"],
                                                 "rows.jsonl:1: prompt must be a string or a list of"),
        "bad row of a Hub split (hub_mirror)": ([*DPO, f"hub_mirror={_hub_mirror(tmp)}",
                                                 f"dpo.mixture={tmp / 'hub_mix.yaml'}"],
                                                "acme/prefs[train] row 2: preference row has chosen equal"),
        "unknown role": ([f"sft.mixture={_mixture(tmp, [{'messages': [{'role': 'bot', 'content': 'x'}]}])}"],
                         "unknown message role 'bot'"),
        "every prompt longer than max_length": (["sft.max_length=4"], "all 600 rows are longer than max_length=4"),
        "tokenizer without chat template": ([f"model.name_or_path={no_template}"], "has no chat template"),
        "chat stage after a text stage, no template": (["stages=[midtrain,sft]", f"model.name_or_path={no_template}"],
                                                       "stage(s) sft need a chat template"),
        "model path that does not exist": (["model.name_or_path=/no/such/model"], "does not exist"),
        "model path that is not a checkpoint": ([f"model.name_or_path={not_ckpt}"], "not a checkpoint folder"),
        "checkpoint with a malformed config.json": ([f"model.name_or_path={bad_config}"], "config.json cannot be read"),
        "output folder that cannot be written": ([f"output_root={blocker}/runs"], "cannot write the run folder"),
        "sweep with an empty grid": (["stages=[dpo]", "dpo.sweep.beta=[]"], "empty grid"),
        "dpo sweep without a metric to pick by": (["stages=[sft,dpo]", "dpo.gate.metric="], "picks its model among 4"),
        "gate metric the eval does not produce": (["sft.gate.metric=tiny_gsm/acc,none"], "does not produce"),
        "0/1 metric given a floor above 1": (["sft.gate.min=1.5"],
                                             "'sft.gate': min 1.5 lies outside [0, 1], the values exact_match takes"),
        "continuous metric given a share's negative floor": (
            ["eval.tasks=[tiny_gsm_bpb]", "sft.gate.metric=tiny_gsm_bpb/bits_per_byte,none", "sft.gate.min=-0.5"],
            "min -0.5 lies outside [0, inf], the values bits_per_byte takes (a continuous metric)"),
        "negative allowed drop": (["sft.gate.max_drop=-0.1"], "max_drop -0.1 is not a drop exact_match can make"),
        "ppo rollout batch that minibatches do not divide": (
            ["stages=[ppo]", "ppo.rollout_batch_size=6", "ppo.num_minibatches=4"],
            "ppo.rollout_batch_size=6 must be divisible by ppo.num_minibatches x ppo.gradient_accumulation_steps"),
        "unbalanced brackets in a command-line value": (["stages=[sft,dpo"],
                                                         "argument 'stages=[sft,dpo' in command line: its value does "
                                                         "not parse (did not find expected ',' or ']')"),
        "mixture YAML with a syntax error": ([f"sft.mixture={broken_yaml}"],
                                             "broken.yaml: did not find expected ',' or '}' at line 4"),
        "JSONL that is not UTF-8": (
            [f"sft.mixture={_file(tmp / 'latin1.yaml', json.dumps({'sources': [{'path': latin1_rows}]}))}"],
            "rows.jsonl:2: not UTF-8 text (byte 0xe9"),
        "Hub model id not in the cache, offline": (["model.name_or_path=NotAnOrg/not-a-model"],
                                                   "NotAnOrg/not-a-model is not a local folder and not in the local "
                                                   "Hugging Face cache, and HF_HUB_OFFLINE is set"),
        "malformed Hub model id": (["model.name_or_path=not a model!"], "is neither a local folder nor a valid Hub id"),
        "LoRA target modules the model does not have": (["sft.lora.r=4", "sft.lora.target_modules=q_proj"],
                                                        "'sft.lora.target_modules' is 'q_proj': peft refuses it"),
        "chat template that cannot render a row": (
            [f"model.chat_template={_file(tmp / 'needs_system.jinja', NEEDS_SYSTEM)}"],
            "sft.jsonl:1: the first message must be a system message"),
        "Hub source neither mirrored nor cached, offline": (
            [f"sft.mixture={_file(tmp / 'hub_only.yaml', json.dumps({'sources': [{'hub': 'acme/absent'}]}))}"],
            "hub dataset acme/absent[train] is not in the local datasets cache"),
        "rows a stage cannot use (Hub copy)": ([*DPO, f"hub_mirror={hub_chats}", f"dpo.mixture={hub_chats_mix}"],
                                               "stage 'dpo' (dpo) trains on preference (prompt, chosen, rejected; "
                                               "or chosen, rejected sharing an implicit prompt) rows; "
                                               "acme/chats[train] row 1"),
        "data rows a stage cannot train on": (["sft.mixture=", f"sft.data={docs}"],
                                              f"{docs}:1 (data {docs}) is language modeling (text)"),
        "data and mixture both set": (["sft.data=org/chats"], "'sft' sets both data (org/chats) and mixture"),
        "several problems, all reported at once": (
            ["stages=[sft,ppo]", "sft.optim=adamw_nope", "sft.gate.metric=tiny_gsm/acc,none",
             f"sft.mixture={_mixture(tmp, None)}"],
            "3 problems: (1) bad value in 'sft': TRL's SFTConfig refuses it: adamw_nope"),
    }
    from transformers.utils import is_flash_attn_2_available

    if not is_flash_attn_2_available():  # CPU machines, GPU machines without flash-attn
        table["attention implementation without its package"] = (["model.attn_implementation=flash_attention_2"],
                                                                  "flash_attention_2 needs the flash-attn package")
    return table


# known only once the input model's tokenizer exists: the tiny recipe builds it with its base model
NEEDS_THE_TOKENIZER = {"every prompt longer than max_length"}


@pytest.fixture
def restore_logging(monkeypatch):
    """`main` sets up the "pipeline" logger and TQDM_DISABLE for its process: give both back afterwards."""
    import logging

    monkeypatch.setenv("TQDM_DISABLE", "1")
    log = logging.getLogger("pipeline")
    saved = list(log.handlers), log.level, log.propagate
    yield
    for handler in list(log.handlers):
        log.removeHandler(handler)
        handler.close()
    for handler in saved[0]:
        log.addHandler(handler)
    log.setLevel(saved[1])
    log.propagate = saved[2]


def _in_process(capsys, *argv: str) -> tuple[int, str]:
    """Run `pipeline/run.py`'s main in this process (one torch import for the whole table): (code, stderr)."""
    from pipeline.run import main

    capsys.readouterr()
    code = main(list(argv))
    return code, capsys.readouterr().err


@pytest.mark.usefixtures("restore_logging")
def test_every_bad_input_is_one_clear_line_with_exit_2(tmp_path, cache_dir, tiny_base, capsys):
    table = cases(tmp_path, tiny_base)
    seen = []
    for i, (name, (overrides, expected)) in enumerate(table.items()):
        out = tmp_path / "runs" / name.replace(" ", "_")
        argv = ["recipe=tiny", f"output_root={out}", f"cache_dir={cache_dir}", *FAST, "stages=[sft]", *overrides]
        if i == 0:  # the first through the real command line: the process's exit code
            proc = run_cli(*argv)
            code, stderr = proc.returncode, proc.stderr
        else:
            code, stderr = _in_process(capsys, *argv)
        errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
        seen.append((name, errors[0] if errors else stderr[-300:]))
        assert code == 2, (name, stderr[-2000:])
        assert len(errors) == 1 and expected in errors[0], (name, errors)
        stages = out / "tiny" / "stages"
        assert not stages.exists() or not any(stages.rglob("model.safetensors")), name  # nothing trained
        if name not in NEEDS_THE_TOKENIZER:  # found before any model loaded: not even the base was scored
            assert not (stages / "00-base" / "stage.json").exists(), name
    with capsys.disabled():  # the table for the closing note
        print("\n" + "\n".join(f"| {n} | {m} |" for n, m in seen))
