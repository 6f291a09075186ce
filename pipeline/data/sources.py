"""A stage's `data` key: one Hub dataset (`org/name`, `org/name:split`, `org/name@config:split`) or a local file
(.jsonl, .json, .parquet, .csv) or folder of such files, read as a one-source mixture (a folder: one source per
file) by pipeline/data/mixtures.py, so weights, seeding, fingerprints, `hub_mirror` and caching are the mixtures'.

Light (no datasets, no torch): the config loader checks the key with `check`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pipeline.data.formats import TARGETS
from pipeline.errors import ConfigError

SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
HUB_ID = re.compile(r"(?P<hub>[\w.-]+/[\w.-]+)(?:@(?P<name>[\w.-]+))?(?::(?P<split>.+))?")


def is_local(value: str) -> bool:
    """Whether a `data` value names a local file or folder: a path that exists, starts with `.`, `/` or `~`, or
    ends in a data file's suffix; anything else is a Hub dataset id."""
    return value.startswith((".", "/", "~")) or value.lower().endswith(SUFFIXES) or Path(value).expanduser().exists()


def parse(value: str, key: str = "data") -> dict[str, str]:
    """The mixture source a `data` value reads: `{"path": ...}` for a local file or folder, `{"hub", "name",
    "split"}` for a Hub dataset (split `train` unless named); a value that is neither is a ConfigError naming
    `key`."""
    if is_local(value):
        return {"path": value}
    found = HUB_ID.fullmatch(value)
    if found is None:
        raise ConfigError(f"'{key}' is {value!r}: neither a local file or folder (none there) nor a Hub dataset id "
                          "org/name, org/name:split or org/name@config:split")
    return {"hub": found["hub"], "name": found["name"] or "", "split": found["split"] or "train"}


def files(folder: Path) -> list[Path]:
    """The data files directly in `folder`, in name order; a folder with none is a ConfigError."""
    found = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in SUFFIXES)
    if not found:
        raise ConfigError(f"data folder {folder} holds no {', '.join(SUFFIXES)} file")
    return found


def check(stage: Any, name: str) -> None:
    """Section `name` reads either `data` or `mixture`, its `data` is a path or a Hub id, and its `data_columns`
    map known targets of a `data` it sets (ConfigError)."""
    if stage.data and stage.mixture:
        raise ConfigError(f"'{name}' sets both data ({stage.data}) and mixture ({stage.mixture}): data reads one "
                          f"dataset, a mixture blends several; keep one ({name}.mixture= clears the recipe's mixture)")
    if stage.data_columns and not stage.data:
        raise ConfigError(f"'{name}.data_columns' maps the columns of '{name}.data', which is not set (a mixture maps "
                          "its sources' columns in its YAML)")
    unknown = [str(t) for t in stage.data_columns if t not in TARGETS]
    if unknown:
        raise ConfigError(f"'{name}.data_columns' maps unknown target(s) {', '.join(unknown)}; targets: "
                          f"{', '.join(TARGETS)}")
    if stage.data:
        parse(stage.data, f"{name}.data")
