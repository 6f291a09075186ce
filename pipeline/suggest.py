"""One-line messages for mistyped keys and values: the closest key or choice (`did you mean`), and OmegaConf's errors in
words."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from pipeline.errors import ConfigError


def show(value: Any) -> str:
    """A config value as an override writes it: true, null, 0.002, [a, b], ''."""
    if isinstance(value, DictConfig | ListConfig):
        value = OmegaConf.to_container(value)
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    if isinstance(value, list):
        return "[" + ", ".join(show(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {show(v)}" for k, v in value.items()) + "}"
    return value if isinstance(value, str) and value else repr(value)


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The choice a mistyped `word` most likely means: one whose initials it is (lr: learning_rate), then one that
    contains it (epochs: num_train_epochs), then the closest spelling; None when none is close."""
    choices = list(choices)
    for match in (lambda c: len(word) > 1 and word == "".join(part[:1] for part in c.split("_")),
                  lambda c: len(word) > 3 and word in c):
        found = [c for c in choices if match(c)]
        if found:
            return min(found, key=len)
    close = difflib.get_close_matches(word, choices, n=1)
    return close[0] if close else None


def did_you_mean(word: str, choices: Iterable[str], prefix: str = "") -> str:
    """"; did you mean 'X'?" for the choice closest to a mistyped `word` (named `prefix` + choice); empty when none
    is close."""
    match = closest(word, choices)
    return f"; did you mean '{prefix}{match}'?" if match else ""


def _keys(node: Any, prefix: str = "") -> list[str]:
    """Every dotted key of a config node, sections included."""
    if not isinstance(node, DictConfig):
        return []
    return [k for key in node for k in (f"{prefix}{key}", *_keys(node[key], f"{prefix}{key}."))]


def _suggest(cfg: DictConfig, full_key: str) -> str:
    """The full dotted key a mistyped `full_key` most likely means: one of the same section first, then any key
    with that last part, then any key; else the section's keys."""
    parent_key, _, leaf = full_key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    keys = [str(k) for k in parent] if isinstance(parent, DictConfig) else []
    if hint := did_you_mean(leaf, keys, f"{parent_key}." if parent_key else ""):
        return hint
    everywhere = _keys(cfg)
    by_leaf = {k: k.rpartition(".")[2] for k in everywhere}
    if match := closest(leaf, set(by_leaf.values())):
        return f"; did you mean '{next(k for k, v in by_leaf.items() if v == match)}'?"
    if hint := did_you_mean(full_key, everywhere):
        return hint
    where = f" of '{parent_key}'" if parent_key else ""
    return f"; valid keys{where}: {', '.join(keys)}" if keys else "; help=true lists every key"


# OmegaConf's messages about a value of the wrong type (they name its classes) -> what the key takes, in words
EXPECTED = (("to Float", "a number"), ("to Integer", "a whole number"), ("valid bool", "true or false"),
            ("ListConfig", "a list, e.g. [a,b]"), ("to Dict", "a mapping, e.g. {a: 1}"))


def explain_error(cfg: DictConfig, err: OmegaConfBaseException, where: str) -> ConfigError:
    """A one-line error for OmegaConf's `err` on key `err.full_key`: an unknown key with a suggestion, or a bad
    value with what the key takes."""
    key = err.full_key or "?"
    if isinstance(err, (ConfigKeyError, ConfigAttributeError)):
        return ConfigError(f"unknown config key '{key}' in {where}{_suggest(cfg, key)}")
    msg = str(err).splitlines()[0]
    if "is not a subclass of" in msg:
        return ConfigError(f"'{key}' in {where} is a section, not a value: set its keys ({key}.KEY=value)")
    expected = next((words for marker, words in EXPECTED if marker in msg), None)
    if expected is not None:
        msg = f"'{show(err.value)}' is not {expected}"
    return ConfigError(f"bad value for '{key}' in {where}: {msg}")


def apply(cfg: DictConfig, key: str, value: Any, where: str) -> None:
    """Set dotted `key` of `cfg` to `value`; a value that does not fit is a ConfigError naming `where`."""
    try:
        OmegaConf.update(cfg, key, value, merge=True)
    except OmegaConfBaseException as err:
        if not err.full_key:
            err.full_key = key
        raise explain_error(cfg, err, where) from None

