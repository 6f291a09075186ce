"""The one rule for every key the pipeline reuses by, and the functions every key is built with.

A key names content that is reused instead of being made again. It is computed from what decides that content, and
from nothing else:

- **files by their bytes**, each named by its path relative to the folder it belongs to, symlinks followed
  (`tree_digest`, `file_digest`): a checkpoint, a task folder, a chat template, a data file. A path written inside
  a task file stands for the contents of what it names (`text_digest`). Never an absolute path, the working
  directory, the run's name or folder, or where a cache lies: moving a checkout or a run folder, another output
  root, or a model kept under `.cache` or in a Hub snapshot changes no key;
- **the settings that change the result** (the config views of `pipeline.fingerprints`);
- **Hub models and datasets by commit**: a branch or tag is resolved to a commit once per run folder
  (chain/revisions.py, `hub_commit`) and keys hold the commit (`resolved`); one that cannot be resolved stays a
  branch name, which the log and the plan say moves;
- **the versions of the libraries that make the content** (`versions`);
- **`FORMAT`** (through `key`): bumped when what a key holds changes, so that entries made under older keys are
  never trusted.

The keys (docs/reliability.md lists what each holds): the base fingerprint (`chain/resume.base_fingerprint`), a
stage's fingerprint, its inputs and its prepared-data key, the eval fingerprint (`chain/resume.decide`), a sweep
candidate's fingerprint (`chain/sweep.candidate_fingerprint`), a mixture source's fingerprint
(`data/mixtures.fingerprints`), the score cache's key (`evaluation/scorecache.score_key`), the tokenised cache's
key (`data/tokcache.cache_key`) and the folder of a base model a recipe's extension builds (the extension's
`base_settings`).
"""

from __future__ import annotations

import hashlib
import os
import re
from importlib import metadata
from pathlib import Path
from typing import Any

from pipeline.files import fingerprint, sha256_file

FORMAT = 2  # bump when what any key holds changes: entries kept under older keys are then never found
NOT_CONTENT = ("README.md",)  # a model card changes with the run that wrote it, not with the model
SCORING = ("torch", "transformers", "tokenizers", "lm_eval")  # the libraries that decide a score
TRAINING = ("torch", "transformers", "tokenizers", "trl", "datasets")  # ... a tokenisation, a built model
# an absolute path written in a task file: what it names decides the task, where it lies does not
ABSOLUTE_PATH = re.compile(r"(?<![\w.:/~-])(?:~|/)[^\s\"'<>|,;\]\[{}()]*[^\s\"'<>|,;\]\[{}().]")


def key(obj: dict) -> str:
    """A key: the short hash of `obj` under the key `FORMAT`."""
    return fingerprint({"key_format": FORMAT, "key": obj})


def file_digest(path: str | Path) -> str:
    """sha256 of a file's bytes (through symlinks)."""
    return sha256_file(Path(path))


def _content(name: str) -> bool:
    """Whether a file or folder of this name can be content: not a hidden one (`.git`, `.cache` of a local Hub
    download, a writer's temp file `.x.tmp-...`) nor Python's byte-code (`__pycache__`, `.pyc`), which importing a
    task's functions writes."""
    return not name.startswith(".") and name != "__pycache__" and not name.endswith(".pyc")


def _files(folder: Path, skip: tuple[str, ...]) -> list[Path]:
    """Every content file under `folder` (`_content`), symlinks followed (each folder once: a link to a parent
    is no loop), without those of `skip` directly in `folder`, nor a link that leads nowhere."""
    out, seen = [], set()
    for base, dirs, names in os.walk(folder, followlinks=True):
        st = os.stat(base)
        if (st.st_dev, st.st_ino) in seen:
            dirs[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        top = Path(base) == Path(folder)
        dirs[:] = sorted(d for d in dirs if _content(d) and not (top and d in skip))
        out += [Path(base) / n for n in names if _content(n) and not (top and n in skip) and
                os.path.exists(Path(base) / n)]
    return sorted(out)


def tree_digest(folder: str | Path, skip: tuple[str, ...] = NOT_CONTENT) -> str:
    """sha256 of the files of `folder` (`_files`): each one's path relative to `folder` and its bytes. Where the
    folder lies (an absolute path, a `.cache` or `huggingface/hub` above it, a symlinked snapshot) changes
    nothing."""
    folder, h = Path(folder), hashlib.sha256()
    for path in _files(folder, skip):
        h.update(path.relative_to(folder).as_posix().encode() + b"\0" + file_digest(path).encode())
    return h.hexdigest()


def path_digest(path: str | Path) -> str:
    """The contents of a file (`file_digest`) or a folder (`tree_digest`, nothing skipped) at `path`."""
    path = Path(path).expanduser()
    return tree_digest(path, ()) if path.is_dir() else file_digest(path)


def by_contents(value: Any) -> Any:
    """`value` (a config view: mappings, lists, scalars) with every string that is a path (absolute, `~`, `./` or
    `../`) naming an existing file or folder replaced by its contents (`path_digest`): a setting that points at a
    mixture file, a data folder or a reward model keys what it points at, wherever that lies."""
    if isinstance(value, dict):
        return {k: by_contents(v) for k, v in value.items()}
    if isinstance(value, list):
        return [by_contents(v) for v in value]
    if isinstance(value, str) and value.startswith(("/", "~", "./", "../")) and _kind(Path(value).expanduser()):
        return {"contents": path_digest(value)}
    return value


def _kind(path: Path) -> str:
    """`file`, `dir` or `` (nothing there, or nothing this process may look at)."""
    try:
        return "file" if path.is_file() else "dir" if path.is_dir() else ""
    except OSError:  # a name too long, a folder it may not enter
        return ""


def text_digest(text: str) -> str:
    """sha256 of `text` with each absolute path in it that names a file replaced by that file's contents, and each
    that a `dataset_path:` names (a local dataset folder, such as `hub_mirror`'s copy) by the folder's: a task YAML
    that names its data is keyed by the data, not its place."""

    def contents(found: re.Match) -> str:
        path, line = Path(found.group(0)).expanduser(), text[text.rfind("\n", 0, found.start()) + 1: found.start()]
        kind = _kind(path)
        named = kind == "file" or (kind == "dir" and line.strip().startswith("dataset_path:"))
        return f"<{path_digest(path)}>" if named else found.group(0)

    return hashlib.sha256(ABSOLUTE_PATH.sub(contents, text).encode()).hexdigest()


TASK_FILES = (".yaml", ".yml", ".py", ".json", ".jinja", ".txt")  # what lm-eval reads of a task folder


def tasks_digest(*folders: str | Path | None) -> str:
    """What decides a set of lm-eval tasks: every task file (`TASK_FILES`) of `folders` (the run's written tasks,
    `eval.include_path`) by its name relative to its folder and its text, paths in it standing for what they name
    (`text_digest`); a folder that is None or absent adds nothing."""
    h = hashlib.sha256()
    for i, folder in enumerate(Path(f) for f in folders if f):
        if not folder.is_dir():
            continue
        for path in (p for p in _files(folder, ()) if p.suffix in TASK_FILES):
            try:
                digest = text_digest(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError):  # not text, or not readable: its bytes, or that it is not
                digest = file_digest(path) if os.access(path, os.R_OK) else "unreadable"
            h.update(f"{i}/{path.relative_to(folder).as_posix()}".encode() + b"\0" + digest.encode())
    return h.hexdigest()


def versions(names: tuple[str, ...] = SCORING) -> dict[str, str | None]:
    """The installed versions of the distributions `names` (None: not installed)."""
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


COMMIT = re.compile(r"[0-9a-f]{40}")


def pinned(revision: str | None) -> bool:
    """Whether `revision` names one commit (40 hex digits) rather than a branch or tag that moves."""
    return bool(revision) and COMMIT.fullmatch(str(revision)) is not None


def cached_commit(repo: str, revision: str, repo_type: str = "model") -> str | None:
    """The commit `revision` of the Hub repository `repo` named when it was last downloaded here (the Hugging Face
    cache's `refs/`); None when it never was."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    try:
        ref = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo, repo_type=repo_type) / "refs" / revision
        return ref.read_text().strip() or None
    except (OSError, ValueError):  # not there, or not a Hub id (HFValidationError is a ValueError)
        return None


def hub_commit(repo: str, revision: str, repo_type: str = "model") -> str | None:
    """The commit `revision` of the Hub repository `repo` names now: itself when it is one, else the Hub's answer
    (online), else the local cache's (`cached_commit`); None when neither knows."""
    import huggingface_hub

    if pinned(revision):
        return revision
    if not huggingface_hub.constants.HF_HUB_OFFLINE:
        api = huggingface_hub.HfApi()
        info = api.model_info if repo_type == "model" else api.dataset_info
        try:
            return info(repo, revision=revision, timeout=15).sha
        except Exception:  # noqa: BLE001 - unreachable, gated, unknown: the cache's word, else the load tells
            pass
    return cached_commit(repo, revision, repo_type)


_pins: dict[str, str] = {}  # ref_name(...) -> the commit this run reads it at (`use_pins`)


def ref_name(repo_type: str, repo: str, revision: str) -> str:
    """A Hub reference as the run's pins name it: `dataset:org/name@main`."""
    return f"{repo_type}:{repo}@{revision}"


def use_pins(pins: dict[str, str]) -> None:
    """Read every Hub reference of `pins` (`ref_name` -> commit) at its commit from now on in this process
    (`resolved`); the run pins its references once at start (chain/revisions.py)."""
    _pins.clear()
    _pins.update(pins)


def resolved(repo: str, revision: str, repo_type: str) -> str:
    """The revision this process reads `repo` at: the commit the run pinned `revision` to, else `revision`."""
    return _pins.get(ref_name(repo_type, repo, revision or "main"), revision or "main")
