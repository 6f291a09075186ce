"""Recipe files: a shipped recipe by name (`recipes/NAME.yaml`) or any recipe file by path, the chain of
recipes it starts from (`base:`), and the relative paths in each file, read against that file.

A recipe may say `base: NAME` (a shipped recipe) or `base: path/to/other.yaml` (relative to the file that says it)
and override part of its base: mappings merge key by key, any other value (a list too) replaces the base's. In a
recipe file, a relative value of a path key is read against the file's folder when it starts with ./ or ../, or,
for a key that only takes a path to read, when it names a file or folder there (the `path` a field declares:
`settings.arg`); the command line's values stay relative to the current directory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from pipeline.errors import ConfigError


def shipped(folder: str) -> Path:
    """A folder the project ships beside `pipeline/` (`recipes`, `data_mixtures`, `eval`): in a checkout (or an
    editable install) at the top of it, in an installed wheel inside the package (pyproject.toml's package-dir)."""
    here = Path(__file__).resolve().parent
    return here / folder if (here / folder).is_dir() else here.parent / folder


RECIPES_DIR = shipped("recipes")
MIXTURES_DIR = shipped("data_mixtures")
TASKS_DIR = shipped("eval")  # lm-eval task files and the functions they name
SUFFIXES = (".yaml", ".yml")


@dataclass(frozen=True)
class RecipeFile:
    """One file of a recipe's chain: where it is, what it is to the run (`recipe FILE` or `base recipe FILE`: the
    source of its values in messages, `help=true` and the plan) and its values, without `base`."""

    path: Path
    source: str
    values: dict


def available_recipes() -> list[str]:
    """Names of the shipped recipes (`recipes/*.yaml`)."""
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def shown(path: Path) -> str:
    """A recipe file as messages name it: a shipped one as `recipes/NAME.yaml`, another relative to the
    current directory when it is under it."""
    for root in (RECIPES_DIR.parent, Path.cwd()):
        if path.is_relative_to(root):
            return str(path.relative_to(root))
    return str(path)


def run_name(recipe: str) -> str:
    """The default run name of `recipe=...`: a shipped recipe's name, a recipe file's stem."""
    return Path(recipe).stem


def yaml_problem(err: Exception, where: bool = True) -> str:
    """A YAML parser's error in one line: what is wrong and, with `where`, at which line and column; any other
    error (a file that is not UTF-8 text) in its own words."""
    if isinstance(err, UnicodeDecodeError):
        return f"not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start})"
    problem = getattr(err, "problem", None) or (str(err).splitlines() or [type(err).__name__])[0]
    mark, context, start = (getattr(err, k, None) for k in ("problem_mark", "context", "context_mark"))
    if not where or mark is None:
        return problem
    opened = f" ({context} at line {start.line + 1}, column {start.column + 1})" if context and start else ""
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}{opened}"


def _locate(name: str, folder: Path, chain: list[Path]) -> Path:
    """The file `name` means, said in the file last in `chain` (or on the command line when `chain` is empty): a
    path (it ends .yaml / .yml, holds a /, or is a file) relative to `folder`, else a shipped recipe's name."""
    given = folder / Path(name).expanduser()
    is_path = name.endswith(SUFFIXES) or "/" in name or given.is_file()
    path = given.resolve() if is_path else RECIPES_DIR / f"{name}.yaml"
    trail = " -> ".join(shown(p) for p in [*chain, path])
    if path in chain:
        raise ConfigError(f"the recipe's bases go round in a circle: {trail}")
    if not path.is_file():
        known = ", ".join(available_recipes())
        what = f"recipe file '{name}'" if is_path else f"recipe '{name}'"
        if chain:
            raise ConfigError(f"base {what} of {shown(chain[-1])} not found ({path}); chain: {trail}; shipped "
                              f"recipes: {known}")
        if is_path:
            raise ConfigError(f"{what} not found ({path}); shipped recipes: {known}")
        raise ConfigError(f"unknown {what}; available: {known}")
    return path


def _read(path: Path) -> dict:
    """A recipe file's values, as written."""
    try:
        values = OmegaConf.to_container(OmegaConf.load(path)) or {}
    except Exception as err:  # noqa: BLE001 - YAML parser errors come in many types
        raise ConfigError(f"cannot parse recipe {path}: {yaml_problem(err)}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"recipe {path} is not a mapping of settings (key: value lines)")
    return values


def chain(recipe: str) -> list[RecipeFile]:
    """The files `recipe=...` reads, its farthest base first and the recipe itself last; a missing file or base and
    a circle of bases are one ConfigError, naming the chain."""
    paths, values, name, folder = [], [], recipe, Path()
    while name is not None:
        paths.append(_locate(name, folder, paths))
        values.append(_read(paths[-1]))
        name, folder = values[-1].pop("base", None), paths[-1].parent
        if name is not None and (not isinstance(name, str) or not name):
            raise ConfigError(f"'base' in recipe {shown(paths[-1])} is {name!r}: name a shipped recipe or a recipe "
                              "file (a path relative to this one)")
    sources = [f"recipe {shown(paths[0])}", *(f"base recipe {shown(p)}" for p in paths[1:])]
    return [RecipeFile(p, s, v) for p, s, v in reversed(list(zip(paths, sources, values, strict=True)))]


def rebase(value: Any, folder: Path, how: str) -> Any:
    """A recipe file's `value` of a key that holds a path `how` (`settings.arg`'s `path`: local, marked, mixture;
    empty: no path), with a relative path in it read against the file's `folder` (the module's rule); any other
    value as it is."""
    if not isinstance(value, str) or not value or "${" in value or "://" in value:
        return value
    if how == "mixture":  # a shipped mixture's name, or a path
        how = "local" if value.endswith(SUFFIXES) else ""
    if not how or Path(value).expanduser().is_absolute():
        return value
    if value.startswith(("./", "../")) or value in (".", "..") or (how == "local" and (folder / value).exists()):
        return os.path.normpath(folder / value)
    return value
