"""Evaluation with lm-eval: task YAMLs written into the run, HF model scoring, metric flattening.

Shipped tasks (`eval/*.yaml`) include lm-eval's own gsm8k definition and override its data
source; their `${...}` placeholders are filled here and the result is written to
`<run>/eval_tasks/`, so `lm_eval --include_path <run>/eval_tasks` reproduces a score. Any task of lm-eval's
registry is used by name (its data from the Hub), and `eval.include_path` adds a folder of user task YAMLs;
`check_tasks` refuses an unknown name with the closest ones. Metrics are named `<task>/<metric>,<filter>` (e.g.
`gsm8k_local_val/exact_match,strict-match`); `expected_metrics` reads them from the tasks' configs.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import json
import logging
import os
import string
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pipeline import extension, keys
from pipeline.data.mixtures import hub_source
from pipeline.errors import ConfigError
from pipeline.evaluation import stats
from pipeline.files import write_text
from pipeline.recipe_files import TASKS_DIR
from pipeline.runfolder import remember, samples_file

log = logging.getLogger("pipeline")


def settings(cfg: DictConfig, section: str | None) -> dict:
    """Effective eval settings: top-level `eval`, overridden by the set fields of `base_eval` or a stage's."""
    out = OmegaConf.to_container(cfg.eval)
    override = cfg.base_eval if section is None else cfg[section].eval
    out.update({k: v for k, v in OmegaConf.to_container(override).items() if v is not None})
    if not isinstance(out["chat_template_kwargs"] or {}, dict):
        where = "eval" if section is None else f"{section}.eval"
        raise ConfigError(f"{where}.chat_template_kwargs must be a mapping such as {{enable_thinking: false}}, "
                          f"got {out['chat_template_kwargs']!r}")
    return out


def gsm8k_source(cfg: DictConfig) -> dict:
    """Where task gsm8k_local reads GSM8K (`datasets.load_dataset` arguments): the train.jsonl / test.jsonl of
    `eval.gsm8k_dir` when set, else `openai/gsm8k` (`main`) from the Hub or from `hub_mirror`'s copy."""
    if cfg.eval.gsm8k_dir:
        folder = Path(cfg.eval.gsm8k_dir).resolve()
        return {"path": "json", "name": None,
                "data_files": {split: str(folder / f"{split}.jsonl") for split in ("train", "test")}}
    return hub_source("openai/gsm8k", "main", ["train", "test"], cfg)


def write_tasks(cfg: DictConfig, out: Path) -> Path:
    """Fill the shipped task templates with this run's data paths and write them, and the recipe extension's
    tasks, to `out`."""
    import lm_eval
    from lm_eval.tasks import TaskManager  # noqa: F401 - fails early if lm-eval is missing

    values = {
        "gsm8k_yaml": str(Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / "gsm8k.yaml"),
    }
    source = gsm8k_source(cfg)
    values.update(gsm8k_path=json.dumps(source["path"]), gsm8k_name=json.dumps(source["name"]),
                  gsm8k_kwargs=json.dumps({"data_files": source["data_files"]} if "data_files" in source else None))
    for template in sorted(TASKS_DIR.glob("*.yaml")):
        try:
            text = string.Template(template.read_text(encoding="utf-8")).substitute(values)
        except KeyError as err:
            raise ConfigError(f"task template {template.name} uses an unknown placeholder {err}") from None
        write_text(out / template.name, text)
    for helper in sorted(TASKS_DIR.glob("*.py")):  # functions the YAMLs name (`!function module.name`)
        write_text(out / helper.name, helper.read_text(encoding="utf-8"))
    extension.write_tasks(cfg, out)
    return out


@functools.cache
def task_manager(include_paths: tuple[str, ...], defaults: bool):
    """One lm-eval TaskManager per process and include paths, with lm-eval's own task index (thousands of YAMLs:
    seconds to build) or without it."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(include_paths) or None, include_defaults=defaults)


def include_folder(ev: dict) -> Path | None:
    """The folder `ev["include_path"]` names (a folder of task YAMLs, or one task YAML: the folder it is in)."""
    if not ev.get("include_path"):
        return None
    path = Path(ev["include_path"]).expanduser().resolve()
    return path.parent if path.suffix in (".yaml", ".yml") else path


LOCATIONS = ("include_path", "gsm8k_dir")  # eval settings that say where tasks and data are, not what they hold


def scoring_inputs(ev: dict, tasks_dir: Path) -> dict:
    """What decides a score besides the model (`pipeline.keys`' rule): the eval settings `ev` without the places
    of tasks and data (`LOCATIONS`), the contents of the run's task files and `eval.include_path`'s, with the data
    files they name (`keys.tasks_digest`), and the versions of the scoring libraries (vLLM's too for its
    backend)."""
    libraries = (*keys.SCORING, "vllm") if ev.get("backend") == "vllm" else keys.SCORING
    return {"eval": {k: v for k, v in ev.items() if k not in LOCATIONS},
            "tasks": keys.tasks_digest(tasks_dir, include_folder(ev)), "libraries": keys.versions(libraries)}


def _task_manager(ev: dict, tasks_dir: Path):
    """The TaskManager that knows `ev`'s tasks: the run's task folder and `eval.include_path` alone when they hold
    every task, else with lm-eval's own index too."""
    paths = tuple(str(p) for p in (tasks_dir, include_folder(ev)) if p)
    local = task_manager(paths, False)
    return local if all(task in local.task_index for task in ev["tasks"]) else task_manager(paths, True)


def check_tasks(ev: dict, tasks_dir: Path):
    """The TaskManager of `ev`'s tasks, each a task, group or tag it knows; a ConfigError naming the first unknown
    one with the closest names lm-eval knows (or the include path that does not exist, or its YAMLs that do not
    load)."""
    folder = include_folder(ev)
    if folder is not None and not folder.is_dir():
        raise ConfigError(f"eval.include_path {ev['include_path']} does not exist: name a folder of lm-eval task "
                          "YAMLs, or one task YAML")
    tm = _task_manager(ev, tasks_dir)
    for task in [t for t in ev["tasks"] if t not in tm.task_index]:
        close = difflib.get_close_matches(task, tm.all_tasks, n=3, cutoff=0.6)
        hint = f"; closest: {', '.join(close)}" if close else ""
        own = ", ".join(sorted(p.stem for p in tasks_dir.glob("*.yaml")))
        raise ConfigError(f"unknown eval task '{task}': not among the run's tasks ({own}), eval.include_path's or "
                          f"lm-eval's registry{hint}{_unreadable(folder)}")
    return tm


def _unreadable(folder: Path | None) -> str:
    """"; X.yaml does not load (why)" for the first YAML of the include folder lm-eval cannot read (it skips it)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    for path in sorted(folder.glob("**/*.yaml")) if folder else []:
        try:
            load_yaml(path, resolve_func=False)
        except Exception as err:  # any reason lm-eval skips the file
            return f"; {path} does not load ({' '.join(str(err).split())[:200]})"
    return ""


def _produced(tm: Any, name: str, config: dict | None = None) -> set[str]:
    """The `<task>/<metric>,<filter>` names task, group or tag `name` of `tm` produces, read from its config
    (`config` over the registered one): a task's `metric_list` (else lm-eval's defaults for its `output_type`)
    under each of its filters ("none" without); a group's aggregate metrics and its tasks'; a tag's tasks'."""
    from lm_eval.api.registry import DEFAULT_METRIC_REGISTRY

    entry = tm.task_index.get(name)
    if entry is not None and entry.kind.name == "TAG":
        return set().union(*(_produced(tm, task) for task in sorted(entry.tags)))
    cfg = {**((entry.cfg or {}) if entry else {}), **(config or {})}
    if "group" in cfg:
        out = {f"{name}/{m['metric']},{f}" for m in _as_list(cfg.get("aggregate_metric_list"))
               for f in _as_list(m.get("filter_list", "none"))}
        children = [(c, None) if isinstance(c, str) else (c.get("group") or c["task"], c)
                    for c in _as_list(cfg.get("task"))]  # a name, or a config of its own (over a registered one)
        return out.union(*(_produced(tm, child, own) for child, own in children))
    metrics = [m["metric"] for m in cfg.get("metric_list") or []] or \
        DEFAULT_METRIC_REGISTRY[cfg.get("output_type") or "generate_until"]
    filters = [f["name"] for f in cfg.get("filter_list") or []] or ["none"]
    return {f"{name}/{m},{f}" for m in metrics for f in filters}


def _as_list(value: Any) -> list:
    return value if isinstance(value, list) else [] if value is None else [value]


def expected_metrics(ev: dict, tasks_dir: Path) -> set[str]:
    """The `<task>/<metric>,<filter>` names that `ev`'s tasks produce, read from their configs (`check_tasks`'
    error for an unknown task)."""
    if not ev["tasks"]:
        return set()
    tm = check_tasks(ev, tasks_dir)
    return set().union(*(_produced(tm, task) for task in ev["tasks"]))


def split_of(task_config: dict) -> str:
    """Which split a task scores: its `metadata.split` (the shipped tasks say `validation` or `test`), else the
    split lm-eval evaluates (`test_split`, or `validation_split` when it has no test split)."""
    stated = (task_config.get("metadata") or {}).get("split")
    return stated or task_config.get("test_split") or task_config.get("validation_split") or "test"


def metric_splits(ev: dict, tasks_dir: Path) -> dict[str, str]:
    """`<task>` -> the split it scores (`split_of`), for `ev`'s tasks, read from their configs."""
    index = _task_manager(ev, tasks_dir).task_index
    return {task: split_of(index[task].cfg) for task in ev["tasks"] if task in index and index[task].cfg}


def quiet_progress(lm: Any) -> None:
    """No progress bars from `lm`'s request loops where the run shows none (`TQDM_DISABLE`, set off a terminal):
    lm-eval passes its own `disable` to tqdm, which outranks the environment."""
    if os.environ.get("TQDM_DISABLE") == "1":
        for name in ("generate_until", "loglikelihood", "loglikelihood_rolling"):
            setattr(lm, name, functools.partial(getattr(lm, name), disable_tqdm=True))


def prompt_format(ev: dict) -> dict:
    """How `ev` renders prompts: chat template or plain text, few-shot count (None: the task's own) and form,
    and the chat template's switches (only with the chat template)."""
    fewshot = ev["num_fewshot"] if ev["num_fewshot"] >= 0 else None
    chat = bool(ev["apply_chat_template"])
    return {"apply_chat_template": chat, "num_fewshot": fewshot, "fewshot_as_multiturn": bool(chat and fewshot),
            "chat_template_kwargs": (ev.get("chat_template_kwargs") or {}) if chat else {}}


def describe_format(fmt: dict) -> str:
    """`prompt_format` in a few words for the leaderboard, e.g. `chat, 5-shot multi-turn, enable_thinking=False`."""
    shots = "task's n-shot" if fmt["num_fewshot"] is None else f"{fmt['num_fewshot']}-shot"
    parts = ["chat" if fmt["apply_chat_template"] else "plain",
             shots + (" multi-turn" if fmt["fewshot_as_multiturn"] else "")]
    return ", ".join(parts + [f"{k}={v}" for k, v in fmt["chat_template_kwargs"].items()])


def fast_generation(ev: dict) -> bool:
    """Whether `run_eval` scores through `lmeval_fast.applied()`: unless `eval.fast_generation` is false, and only
    while every target it patches is there as expected (else one warning naming it, and stock lm-eval)."""
    from pipeline.evaluation import lmeval_fast

    if ev.get("fast_generation") is False:
        return False
    changed = lmeval_fast.drift()
    if changed:
        log.warning("eval.fast_generation: %s is missing or takes other arguments in this lm-eval / transformers; "
                    "scoring with stock lm-eval", changed)
    return changed is None


def selection(ev: dict) -> dict:
    """lm-eval's arguments for the problems `ev["limit"]` scores: `limit` (one number for every task; 0: all) or,
    for a mapping task -> number, `samples` (the first N of those tasks, the same doc_ids as `limit=N`; the tasks
    it leaves out, or maps to 0, in full)."""
    limit = ev["limit"]
    if not isinstance(limit, dict):
        return {"limit": limit or None}
    return {"limit": None, "samples": {t: list(range(n)) for t, n in limit.items() if n and t in ev["tasks"]} or None}


def run_eval(model_path: str | Path, ev: dict, tasks_dir: Path, out_dir: Path, model_cfg: Any) -> dict:
    """Score one checkpoint with lm-eval (call on one process only); keep per-sample output in `out_dir`.
    `ev["backend"]`: `hf` (lm-eval's HF model around a generator loaded here, through `lmeval_fast` unless off) or
    `vllm` (lm-eval's vllm model on the checkpoint's files with the loader's engine settings, started and stopped
    here)."""
    from lm_eval import simple_evaluate

    from pipeline.evaluation import lmeval_fast

    started = time.time()
    fmt = prompt_format(ev)
    vllm = ev.get("backend") == "vllm"
    fast = not vllm and fast_generation(ev)
    lm_model = _vllm_lm if vllm else _hf_lm
    with lmeval_fast.applied() if fast else contextlib.nullcontext(), lm_model(model_path, ev, fmt, model_cfg) as lm:
        quiet_progress(lm)
        results = simple_evaluate(
            model=lm, tasks=list(ev["tasks"]), num_fewshot=fmt["num_fewshot"], **selection(ev),
            apply_chat_template=fmt["apply_chat_template"], fewshot_as_multiturn=fmt["fewshot_as_multiturn"],
            gen_kwargs={"max_gen_toks": ev["max_gen_toks"]}, task_manager=_task_manager(ev, tasks_dir),
            log_samples=True, random_seed=0, numpy_random_seed=1234, torch_random_seed=1234,
            fewshot_random_seed=1234,
        )
    mark_stops(results, model_path, model_cfg, ev)
    metrics, stderr = {}, {}
    for task, values in results["results"].items():
        for key, value in values.items():
            name, _, filt = key.partition(",")
            if not filt or not isinstance(value, (int, float)):  # aliases, sample counts, "N/A" stderr
                continue
            if name.endswith("_stderr"):
                stderr[f"{task}/{name[: -len('_stderr')]},{filt}"] = float(value)
            else:
                metrics[f"{task}/{key}"] = float(value)
    for task, samples in results.get("samples", {}).items():
        lines = "".join(json.dumps(s, default=str) + "\n" for s in samples)
        write_text(samples_file(out_dir, task), lines)
        remember(samples_file(out_dir, task), stats.problem_scores(lines))  # the statistics read no file back
    return {
        "metrics": metrics,
        "stderr": stderr,
        "samples": {t: v["effective"] for t, v in results.get("n-samples", {}).items()},
        "task_configs": results.get("configs", {}),
        "splits": {task: split_of(config) for task, config in results.get("configs", {}).items()},
        "higher_is_better": results.get("higher_is_better", {}),
        "settings": ev,
        "prompt_format": describe_format(fmt),
        "fast_generation": fast,
        "backend": "vllm" if vllm else "hf",
        "wall_time_s": round(time.time() - started, 2),
    }


def mark_stops(results: dict, model_path: str | Path, model_cfg: Any, ev: dict) -> None:
    """Give each generated answer's sample row (under the task's first answer filter) a metric `stopped`: 1.0 when
    it ended (a stop sequence, the end of the turn) before the token budget (`eval.max_gen_toks`, else the task's,
    else lm-eval's 256), 0.0 when the budget cut it; and each generating task the share `stopped,<filter>`. An
    answer cut short, or one that loops until cut, is told apart from one that finished."""
    configs = results.get("configs", {})
    generated = {t: rows for t, rows in results.get("samples", {}).items()
                 if configs.get(t, {}).get("output_type") == "generate_until"}
    if not generated:
        return
    from pipeline.train.models import load_tokenizer

    tok = load_tokenizer(model_path, model_cfg, saved=True)
    for task, rows in generated.items():
        budget = (ev.get("max_gen_toks") or (configs[task].get("generation_kwargs") or {}).get("max_gen_toks")
                  or 256)
        first = rows[0].get("filter", "none")  # the same answer under every filter: counted under the first
        mine = [row for row in rows if row.get("filter", "none") == first]
        for row in mine:
            text = row["resps"][0][0] if row.get("resps") and row["resps"][0] else ""
            row["stopped"] = float(len(tok(text, add_special_tokens=False).input_ids) < budget - 1)
            row["metrics"] = [*row.get("metrics", []), "stopped"]
        results["results"].setdefault(task, {})[f"stopped,{first}"] = sum(r["stopped"] for r in mine) / len(mine)


@contextlib.contextmanager
def _hf_lm(model_path: str | Path, ev: dict, fmt: dict, model_cfg: Any) -> Iterator[Any]:
    """lm-eval's HF model around a generator on the checkpoint as saved (its own tokenizer and template), loaded
    here: lm-eval then starts no Accelerator of its own, which in a multi-process launch would share the samples
    with ranks that are not evaluating (GPUs) or take on DeepSpeed's settings."""
    from lm_eval.models.huggingface import HFLM

    from pipeline.generation import generator

    with generator.load(model_path, model_cfg, saved=True) as gen:
        yield HFLM(pretrained=gen.model, tokenizer=gen.tokenizer, batch_size=ev["batch_size"],
                   chat_template_args=fmt["chat_template_kwargs"])


@contextlib.contextmanager
def _vllm_lm(model_path: str | Path, ev: dict, fmt: dict, model_cfg: Any) -> Iterator[Any]:
    """lm-eval's vllm model on the checkpoint's files, its engine built with the loader's settings for `model_cfg`
    (`models.engine_args`: precision and trust_remote_code) and shut down on leaving; handed `eval.batch_size`
    requests at a time (a number: with "auto", lm-eval asks vLLM for a progress bar, which fails under
    TQDM_DISABLE). lm-eval builds the engine itself: its model takes no engine built elsewhere."""
    from pipeline.generation import engines
    from pipeline.train.models import engine_args

    with engines.starting():
        lm = engines.lmeval_vllm_class()(pretrained=str(model_path), batch_size=ev["batch_size"],
                                         max_gen_toks=ev["max_gen_toks"], seed=1234,
                                         chat_template_args=fmt["chat_template_kwargs"], **engine_args(model_cfg))
    try:
        yield lm
    finally:
        engines.shutdown(lm.model)


def merge(earlier: dict, later: dict, ev: dict) -> dict:
    """One checkpoint's evaluations on disjoint tasks (`earlier`, then `later`, which may have scored nothing) as
    one evaluation on `ev`."""
    keyed = ("metrics", "stderr", "samples", "task_configs", "splits", "higher_is_better")
    return {**earlier, **later, **{k: {**earlier.get(k, {}), **later.get(k, {})} for k in keyed}, "settings": ev,
            "fast_generation": earlier.get("fast_generation") is True and later.get("fast_generation", True),
            "wall_time_s": round(earlier["wall_time_s"] + later.get("wall_time_s", 0.0), 2)}
