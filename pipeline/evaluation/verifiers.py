"""Verifiable rewards: a function that scores completions against known answers, named by reference.

A verifier is called on a batch, `fn(completions: list[str], answers: list[str]) -> list[float]`: one score per
completion, 1.0 for a right answer and 0.0 for a wrong one (values in between are partial credit). A stage names
it as a built-in (`gsm8k`: GSM8K's strict `#### N` check, `gsm.is_correct`; `verifiable` is its former name) or
as `module:function`, any importable function (`package.module:object.method` reaches an attribute). `load`
imports it and checks that it takes those two arguments (`inspect.signature`), so a bad reference stops the run
when the config loads; light: nothing here imports torch.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import numbers
from collections.abc import Callable

from pipeline.errors import ConfigError
from pipeline.evaluation.gsm import is_correct

Verifier = Callable[[list[str], list[str]], list[float]]


def gsm8k(completions: list[str], answers: list[str]) -> list[float]:
    """1.0 for each completion whose last `#### N` answer equals its answer (a number or a GSM8K solution), else 0."""
    return [1.0 if is_correct(c, str(a)) else 0.0 for c, a in zip(completions, answers, strict=True)]


BUILT_IN: dict[str, Verifier] = {"gsm8k": gsm8k, "verifiable": gsm8k}


def _imported(reference: str, key: str) -> Callable:
    """The object `module:attribute` names; a ConfigError naming `key` when it does not import or is not there."""
    module, _, attribute = reference.partition(":")
    if not module or not attribute:
        raise ConfigError(f"'{key}' is '{reference}': name a built-in verifier ({', '.join(BUILT_IN)}) or a function "
                          "as module:function")
    try:
        found = importlib.import_module(module)
    except Exception as err:  # the module's own errors too: the run cannot use it
        raise ConfigError(f"'{key}' is '{reference}': module {module} does not import ({type(err).__name__}: "
                          f"{' '.join(str(err).split())[:200]}); is it on PYTHONPATH?") from None
    try:
        return functools.reduce(getattr, attribute.split("."), found)
    except AttributeError:
        raise ConfigError(f"'{key}' is '{reference}': module {module} has no {attribute}") from None


def load(reference: str, key: str) -> Verifier:
    """The verifier `reference` names (`BUILT_IN` or `module:function`), checked: callable with (completions,
    answers); its call checked to give one number per completion. A ConfigError naming `key` otherwise."""
    fn = BUILT_IN.get(reference) or _imported(reference, key)
    if not callable(fn):
        raise ConfigError(f"'{key}' is '{reference}': {type(fn).__name__} is not callable; name a function "
                          "fn(completions: list[str], answers: list[str]) -> list[float]")
    try:
        inspect.signature(fn).bind(["completion"], ["answer"])
    except TypeError:
        raise ConfigError(f"'{key}' is '{reference}': its signature {inspect.signature(fn)} does not take "
                          "(completions, answers); a verifier is fn(completions: list[str], answers: list[str]) -> "
                          "list[float]") from None
    except ValueError:  # no signature to read (some built-in callables): its first call tells
        pass

    def scored(completions: list[str], answers: list[str]) -> list[float]:
        result = fn(list(completions), list(answers))
        scores = list(result) if hasattr(result, "__len__") and not isinstance(result, str) else []
        if len(scores) != len(completions) or not all(isinstance(s, numbers.Real) for s in scores):
            raise ConfigError(f"'{key}' is '{reference}': it returned {str(result)[:100]} for {len(completions)} "
                              "completions; a verifier returns one number per completion")
        return [float(s) for s in scores]
    return scored
