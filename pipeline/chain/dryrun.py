"""The checks that read no model, no data and no network, and import no torch: every eval task is one lm-eval knows,
every gate's metric is one its evaluation produces. `plan=true` makes them (`dry_run`; it refuses a missing data
file as it counts tokens); the preflight (preflight.py) makes them among its own, in the same pass.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig

from pipeline.errors import ConfigError
from pipeline.evaluation import lmeval as evaluate
from pipeline.evaluation import power
from pipeline.settings import enabled_stages
from pipeline.suggest import did_you_mean

FAILED = object()  # what a check that found a problem returns


class Problems:
    """The problems the checks find: each check is attempted, and all are raised at the end as one ConfigError."""

    def __init__(self) -> None:
        self.found: list[str] = []

    def attempt(self, check: Callable, *args: object) -> object:
        """`check(*args)`, or FAILED when it raised a ConfigError (kept, once: a bad row met by two checks is one
        problem)."""
        try:
            return check(*args)
        except ConfigError as err:
            if str(err) not in self.found:
                self.found.append(str(err))
            return FAILED

    def raise_them(self) -> None:
        """One ConfigError naming every problem found, if any."""
        if len(self.found) == 1:
            raise ConfigError(self.found[0])
        if self.found:
            raise ConfigError(f"{len(self.found)} problems: " + "; ".join(f"({i}) {p}" for i, p in
                                                                          enumerate(self.found, 1)))


def dry_run(cfg: DictConfig, tasks_dir: Path) -> None:
    """The checks of `plan=true`, offline and with no model or data loaded (the eval tasks already written to
    `tasks_dir`): every eval task is one lm-eval knows, every gate's metric is one its evaluation produces; one
    ConfigError naming every problem."""
    problems = Problems()
    problems.attempt(eval_tasks, cfg, tasks_dir)
    problems.attempt(gate_metrics, cfg, tasks_dir)
    problems.raise_them()


def eval_tasks(cfg: DictConfig, tasks_dir: Path) -> None:
    """Every task the base's and each enabled stage's evaluation scores is one lm-eval knows: written into the run
    (`tasks_dir`: shipped and the recipe extension's), in `eval.include_path`, or in lm-eval's own registry (its
    index is built once per process, only when a task is not local); an unknown name is refused with the closest
    names lm-eval knows."""
    for name in [None, *enabled_stages(cfg)]:
        evaluate.check_tasks(evaluate.settings(cfg, name), tasks_dir)


def gate_metrics(cfg: DictConfig, tasks_dir: Path) -> None:
    """Each gate's metric is one its stage's evaluation produces (a metric its tasks report per problem under one of
    their filters, read from the tasks' configs), and its `min` and `max_drop` fit the values it takes
    (`power.impossible`)."""
    for name in [n for n in enabled_stages(cfg) if cfg[n].gate.metric]:
        ev, gate = evaluate.settings(cfg, name), cfg[name].gate
        produced = evaluate.expected_metrics(ev, tasks_dir)
        tie = gate.tie_break.partition("/")[0]  # candidates are scored on the tie-break's task too (sweep)
        if tie and tie not in ev["tasks"]:
            produced |= evaluate.expected_metrics({**ev, "tasks": [tie]}, tasks_dir)
        for key, metric in (("metric", gate.metric), ("tie_break", gate.tie_break)):
            if metric and metric not in produced:
                listed = sorted(produced)[:12] + ([f"{len(produced) - 12} more"] if len(produced) > 12 else [])
                raise ConfigError(f"'{name}.gate.{key}' is '{metric}', which the stage's eval does not produce"
                                  f"{did_you_mean(metric, produced)} (eval tasks {ev['tasks']} produce: "
                                  f"{', '.join(listed) or 'nothing'})")
        problem = power.impossible(gate)
        if problem:
            raise ConfigError(f"'{name}.gate': {problem}")
