"""Plan / dry run (`plan=true`): what a run would do and roughly what it would cost, loading no model or data.

Per stage, in order: the orchestrator's action, input and output checkpoints, the datasets with their
weights, the DPO sweep's candidates, a token budget and an estimate of GPU-hours. A token budget is
an upper bound (max_steps x global batch x max_length) or epochs x the token count a mixture states
(`tokens:`). FLOPs per token are the telemetry's (6 x parameters + 12 x layers x hidden x max_length,
forward + backward); GPU-hours = FLOPs / (the GPU's peak x the assumed MFU). The parameter count comes
from the model's config, never its weights: a local `config.json` (a built model's too), the settings a
built model is made from, a table of known models, or `plan.params`. A new run folder is planned without
importing torch; for an existing one the orchestrator's own per-stage decision (`pipeline.resume`: reuse /
evaluate / resume / train) is shown, which loads the training stack. Before it, the checks that need no model,
data or network (chain/dryrun.py: eval tasks known, gate metrics produced) refuse what a run would refuse. The
settings set over the defaults are listed by where they came from (base recipe, recipe file, command line).
"""

from __future__ import annotations

import json
import re
import tempfile
import textwrap
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pipeline.chain import dryrun, revisions
from pipeline.chain.basemodel import architecture
from pipeline.data.mixtures import load_spec, source_name
from pipeline.errors import ConfigError
from pipeline.evaluation import lmeval as evaluate
from pipeline.evaluation import power
from pipeline.grid import grid, sweeps
from pipeline.keys import pinned, resolved, use_pins
from pipeline.runfolder import RunPaths, model_dir, run_dir, stage_dir
from pipeline.settings import data_source, enabled_stages, kind_of
from pipeline.train.flops import PEAK_FLOPS, flops_per_token, param_count, peak_flops

KNOWN_MODELS = {  # published config.json fields of dense Llama-style models, so that planning needs no Hub
    "HuggingFaceTB/SmolLM3-3B": {"vocab_size": 128256, "hidden_size": 2048, "num_hidden_layers": 36,
                                 "intermediate_size": 11008, "num_attention_heads": 16, "num_key_value_heads": 4,
                                 "tie_word_embeddings": True},
    "HuggingFaceTB/SmolLM2-1.7B": {"vocab_size": 49152, "hidden_size": 2048, "num_hidden_layers": 24,
                                   "intermediate_size": 8192, "num_attention_heads": 32, "tie_word_embeddings": True},
    "HuggingFaceTB/SmolLM2-360M": {"vocab_size": 49152, "hidden_size": 960, "num_hidden_layers": 32,
                                   "intermediate_size": 2560, "num_attention_heads": 15, "num_key_value_heads": 5,
                                   "tie_word_embeddings": True},
    "HuggingFaceTB/SmolLM2-135M": {"vocab_size": 49152, "hidden_size": 576, "num_hidden_layers": 30,
                                   "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
                                   "tie_word_embeddings": True},
}


def _model(cfg: DictConfig) -> dict:
    name = cfg.model.name_or_path
    path, settings = architecture(cfg)
    config, source = None, "unknown offline: set plan.params"
    if (path / "config.json").is_file():
        config, source = json.loads((path / "config.json").read_text()), str(path / "config.json")
    elif settings:
        config = settings
        source = "the settings it is built from; an upper bound, the tokenizer may learn fewer tokens"
    elif re.sub(r"-(Base|Instruct)$", "", name) in KNOWN_MODELS:
        config, source = KNOWN_MODELS[re.sub(r"-(Base|Instruct)$", "", name)], "the table of known models"
    params = param_count(config) if config and "intermediate_size" in config else None
    if cfg.plan.params:
        params, source = cfg.plan.params, "plan.params"
    config = config or {}
    checkpoint = f"{path}{'' if path.is_dir() else ' (built on first use)'}" if settings else name
    hub = not settings and not path.exists()
    return {"name": name, "checkpoint": checkpoint, "params": params, "layers": config.get("num_hidden_layers", 0),
            "hidden": config.get("hidden_size", 0), "source": source,
            **(_revision(name, cfg.model.revision, "model") if hub else {})}


def _tokens(cfg: DictConfig, name: str) -> tuple[float | None, str]:
    s, kind = cfg[name], kind_of(cfg, name)
    if kind.generates:
        return None, "not estimated: RL is bound by generation, which this cost model leaves out"
    pairs = " x 2 (chosen, rejected)" if kind.pairs else ""
    if s.max_steps > 0:
        batch = s.per_device_train_batch_size * s.gradient_accumulation_steps * cfg.plan.num_gpus
        return (s.max_steps * batch * (2 if pairs else 1) * s.max_length,
                f"upper bound: {s.max_steps} steps x global batch {batch}{pairs} x max_length {s.max_length}")
    parts = []
    if source := data_source(s):
        stated = load_spec(source).tokens
        if not stated:
            return None, f"unknown: {source_name(source)} states no `tokens:` and {name}.max_steps is not set"
        parts.append((stated, f"{stated:.3g} tokens stated by {source_name(source)}"))
    if extra := kind.extra_tokens(s, name):
        if extra[0] is None:
            return extra
        parts.append(extra)
    return (s.num_train_epochs * sum(t for t, _ in parts),
            f"{s.num_train_epochs:g} epoch(s) x ({' + '.join(b for _, b in parts)})")


def _revision(repo: str, revision: str, repo_type: str) -> dict:
    """A Hub reference's revision as the run reads it: the commit the run folder pinned it to (`keys.resolved`), or
    the config's; `pinned`: whether that is a commit (a branch moves)."""
    found = resolved(repo, revision, repo_type)
    return {"revision": found, "pinned": pinned(found)}


def _datasets(cfg: DictConfig, name: str) -> list[dict]:
    """The sources of each mixture stage `name` reads, with their weights and Hub revisions; a local data file
    that is not there is refused, as the run's preflight would."""
    out = []
    for mixture, _, role in kind_of(cfg, name).mixtures(cfg[name]):
        spec = load_spec(mixture)
        missing = [s.path for s in spec.sources if s.path and not Path(s.path).is_file()]
        if missing:
            raise ConfigError(f"'{name}' reads {source_name(mixture)}: dataset file not found: {missing[0]}")
        sources = [{"source": s.path or (f"{s.hub}[{s.name}/{s.split}]" if s.hub else f"{s.generator}:{s.split}"),
                    "weight": s.weight, **(_revision(s.hub, s.revision, "dataset") if s.hub else {})}
                   for s in spec.sources]
        out.append({"mixture": str(mixture), "role": role, "sources": sources})
    return out


def _estimate(cfg: DictConfig, name: str, row: dict, model: dict, flops_per_s: float) -> None:
    """Add a stage's FLOPs and GPU-hours to its row, when its tokens and the model's size are known."""
    s, runs = cfg[name], 1
    if sweeps(s):
        row["sweep"] = {"candidates": grid(s), "soup_top_k": s.soup.top_k,
                        "merge": OmegaConf.to_container(s.merge) if s.merge.stage else None,
                        "selected_by": s.gate.metric or None}
        runs = len(row["sweep"]["candidates"])
    reference = 0.0
    if kind_of(cfg, name).reference:  # a forward pass of the reference model: a third of a training step
        reference = (1 if s.get("precompute_ref_log_probs") else runs) / 3
    if row["tokens"] and model["params"]:
        flops = row["tokens"] * flops_per_token(model["params"], model["layers"], model["hidden"], cfg[name].max_length)
        row["flops"] = flops * (runs + reference)
        row["gpu_hours"] = row["flops"] / flops_per_s / 3600
        row["wall_hours"] = row["gpu_hours"] / cfg.plan.num_gpus


def _stages(cfg: DictConfig, root: Path, model: dict, flops_per_s: float) -> list[dict]:
    """One row per listed stage: its action, checkpoints, data and estimates."""
    enabled = enabled_stages(cfg)
    if RunPaths(root).stages.is_dir():
        from pipeline.chain.resume import decide  # an existing run: the orchestrator's own decision per stage

        actions = {d.name: d.action for d in decide(cfg, root)}
    else:
        actions = dict.fromkeys(enabled, "train")
    previous, stages = model["checkpoint"], []
    for name in cfg.stages:
        if name not in enabled:
            stages.append({"stage": name, "action": f"skip ({name}.enabled=false)"})
            continue
        out = stage_dir(root, enabled.index(name) + 1, name)
        tokens, basis = _tokens(cfg, name)
        row = {"stage": name, "dir": str(out), "action": actions[name], "input": previous,
               "output": str(model_dir(out)), "datasets": _datasets(cfg, name), "tokens": tokens,
               "tokens_basis": basis}
        _estimate(cfg, name, row, model, flops_per_s)
        sight = power.before_run(cfg, name)
        if sight:
            row["gate"] = {"metric": cfg[name].gate.metric, "test": cfg[name].gate.test,
                           "max_drop": cfg[name].gate.max_drop, **sight}
        stages.append(row)
        previous = row["output"]
    return stages


def build(cfg: DictConfig, sources: dict[str, str] | None = None) -> dict:
    """The plan as plain data (stages in order, checkpoints, data, sweep, tokens, estimates, and `provenance`: where
    each setting set over the defaults came from, `sources` as `config.load_with_sources` records them); raises
    ConfigError."""
    p, precision = cfg.plan, "fp32" if cfg.model.precision == "fp32" else "bf16"
    peak = peak_flops(p.gpu, precision)
    if not peak:
        raise ConfigError(f"'plan.gpu' is '{p.gpu}' (no {precision} peak known); choose one of {', '.join(PEAK_FLOPS)}")
    if not 0 < p.mfu <= 1 or p.num_gpus < 1 or p.params < 0 or p.output not in ("table", "json"):
        raise ConfigError("plan needs 0 < plan.mfu <= 1, plan.num_gpus >= 1, plan.params >= 0 and plan.output "
                          f"table | json; got {OmegaConf.to_container(p)}")
    with tempfile.TemporaryDirectory() as tasks:  # the run's eval tasks, as a run writes them into its folder
        dryrun.dry_run(cfg, evaluate.write_tasks(cfg, Path(tasks)))
    root = run_dir(cfg)
    use_pins(revisions.recorded(RunPaths(root).hub_revisions))  # what an existing run folder reads
    model = _model(cfg)
    stages = _stages(cfg, root, model, peak * p.mfu)
    estimated = [s for s in stages if "gpu_hours" in s]
    return {
        "recipe": cfg.recipe, "run_dir": str(root), "new_run": not RunPaths(root).stages.is_dir(), "model": model,
        "assumptions": {"gpu": p.gpu, "num_gpus": p.num_gpus, "mfu": p.mfu, "precision": precision,
                        "peak_flops": peak,
                        "flops_per_token": "6 x params + 12 x layers x hidden x max_length (forward + backward; "
                                           "attention over the full length: an upper bound)",
                        "sweeps": "each sweep candidate trains on the stage's tokens; a reference model's log-probs "
                                  "add a forward pass (a third of a training step) once if precomputed, else per "
                                  "candidate",
                        "not_counted": "evaluation, on-policy sampling, RL rollouts, soups and merges"},
        "stages": stages,
        "total_gpu_hours": sum(s["gpu_hours"] for s in estimated),
        "total_wall_hours": sum(s["wall_hours"] for s in estimated),
        "not_estimated": [s["stage"] for s in stages if "dir" in s and "gpu_hours" not in s],
        "provenance": dict(sources or {}),
    }


def _provenance(sources: dict[str, str]) -> list[str]:
    """The settings set over the defaults, one paragraph per source in the order they apply."""
    lines = ["settings over the defaults, by where they came from:"]
    for source in dict.fromkeys(sources.values()):
        keys = ", ".join(k for k, s in sources.items() if s == source)
        lines.append(textwrap.fill(f"{source}: {keys}", 120, initial_indent="  ", subsequent_indent="    "))
    return lines


def report(cfg: DictConfig, sources: dict[str, str] | None = None) -> str:
    """The plan as JSON (`plan.output=json`) or as a readable report."""
    plan = build(cfg, sources)
    if cfg.plan.output == "json":
        return json.dumps(plan, indent=2)
    m, a = plan["model"], plan["assumptions"]
    size = f"{m['params']:,.0f} parameters" if m["params"] else "parameters unknown"
    lines = [
        f"plan for recipe {plan['recipe']} (dry run: nothing is loaded, trained or written)",
        f"run folder: {plan['run_dir']} ({'new: every stage trains' if plan['new_run'] else 'exists'})",
        f"model: {m['name']}, {size}, " + (f"{m['layers']} layers, hidden {m['hidden']}" if m["layers"] else
                                           "layers and hidden unknown (no attention term)") + f" (from {m['source']})",
        f"ESTIMATES (not measurements) assume {a['num_gpus']} x {a['gpu']} at MFU {a['mfu']:g} of "
        f"{a['peak_flops'] / 1e12:g} TFLOP/s ({a['precision']})",
        f"  FLOPs/token = {a['flops_per_token']}", f"  sweeps: {a['sweeps']}", f"  not counted: {a['not_counted']}",
        *([f"  revision {m['revision']}" + (" (a commit)" if m["pinned"] else " is a branch: it moves, and stages "
           "keyed on it do not see the move (pin a commit: model.revision=<40 hex digits>)")] if "pinned" in m else []),
        "data weights: <= 1 a fraction of the source's rows, > 1 a number of rows",
        *(_provenance(plan["provenance"]) if plan["provenance"] else []),
    ]
    for s in plan["stages"]:
        if "dir" not in s:
            lines.append(f"\n[-] {s['stage']}: {s['action']}")
            continue
        lines += [f"\n[{Path(s['dir']).name}] {s['stage']}: {s['action']}", f"    input:   {s['input']}",
                  f"    output:  {s['output']}"]
        for d in s["datasets"]:
            lines.append(f"    data:    {d['mixture']} ({d['role']}; weight, source)")
            lines += [f"             {src['weight']:<6g} {src['source']}" + (
                "" if "pinned" not in src else f" @{src['revision']}" + ("" if src["pinned"] else
                                                                         " (a branch: it moves; pin a commit)"))
                      for src in d["sources"]]
        if "sweep" in s:
            sw = s["sweep"]
            lines.append(f"    sweep:   {len(sw['candidates'])} candidate(s) under {s['dir']}/candidates/: "
                         + ", ".join(c["id"] for c in sw["candidates"]))
            extra = [f"soup of the {sw['soup_top_k']} best"] if sw["soup_top_k"] else []
            if sw["merge"]:
                extra.append(f"merge with {sw['merge']['stage']} at weight {sw['merge']['weight']:g}")
            extra.append(f"selected by {sw['selected_by'] or 'the only candidate'}")
            lines.append(f"             {'; '.join(extra)}")
        if "gate" in s:
            g = s["gate"]
            drop = f" max_drop {g['max_drop']:g}" if g["max_drop"] is not None else ""
            lines.append(f"    gate:    {g['metric']} ({g['test']}{drop}): {g['text']}")
            if g.get("may_miss"):
                lines.append(f"             under that assumption it may miss what it judges: {g['may_miss']}")
        tokens = f"{s['tokens']:.3g}" if s["tokens"] else "?"
        lines.append(f"    tokens:  {tokens} ({s['tokens_basis']})")
        if "gpu_hours" in s:
            lines.append(f"    compute: {s['flops']:.3g} FLOPs = {s['gpu_hours']:.3g} GPU-hours, "
                         f"{s['wall_hours']:.3g} h on {a['num_gpus']} x {a['gpu']} (estimate)")
    skipped = f", without {', '.join(plan['not_estimated'])}" if plan["not_estimated"] else ""
    lines.append(f"\ntotal (estimate{skipped}): {plan['total_gpu_hours']:.3g} GPU-hours, "
                 f"{plan['total_wall_hours']:.3g} h on {a['num_gpus']} x {a['gpu']}")
    return "\n".join(lines)
