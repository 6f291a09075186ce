"""The commits a run reads its Hub models and datasets at.

Each branch or tag the run names (`model.revision`, a mixture source's `revision`, `<stage>.data_revision`) is
resolved to a commit once, when the run folder first meets it (the Hub's answer, or offline the local cache's), and
recorded in `<run>/hub_revisions.json`. Every later run in that folder reads the recorded commit: a resume or a
rerun reads what its stages were trained on even after the branch moved (the log says it moved; a new run folder
reads the new commit). Every key holds the commit (`keys.resolved`), so reuse compares commits. A commit given in
the config is used as it is. A reference that neither the Hub nor the cache resolves when the folder first meets
it is recorded as its branch name, and the log says that it moves: the folder's keys stay as they were made, and
never switch to a commit the download later leaves in the cache (offline, one that is not in the cache cannot
be read at all, and the preflight refuses it).
"""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig

from pipeline import extension, keys
from pipeline.data.mixtures import hub_source, load_spec, stage_mixtures
from pipeline.files import read_json, write_json

log = logging.getLogger("pipeline")


def references(cfg: DictConfig) -> list[tuple[str, str, str]]:
    """Every Hub reference the run reads, as (repo type, repo, revision): the base model when it is a Hub id, and
    each Hub source of every enabled stage's mixtures that is not read from `hub_mirror`."""
    refs = []
    name = cfg.model.name_or_path
    if not extension.builds_base(cfg) and not Path(name).expanduser().exists() and _hub_id(name):
        refs.append(("model", name, cfg.model.revision or "main"))
    for stage in (n for n in cfg.stages if cfg[n].enabled):
        for mixture in stage_mixtures(cfg, stage):
            refs += [("dataset", s.hub, s.revision or "main") for s in load_spec(mixture).sources
                     if s.hub and hub_source(s.hub, s.name, [s.split], cfg)["path"] == s.hub]
    return list(dict.fromkeys(refs))


def _hub_id(name: str) -> bool:
    """Whether `name` is a well-formed Hub id (one that is not, the preflight refuses)."""
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except ValueError:
        return False
    return True


def recorded(path: Path) -> dict[str, str]:
    """The pins a run folder recorded (`hub_revisions.json`); empty when there are none."""
    return read_json(path) or {}


def pin(cfg: DictConfig, path: Path) -> dict[str, str]:
    """Resolve the run's Hub references to commits (the ones `path` recorded first), record new ones in `path` and
    return them all (`keys.ref_name` -> commit, or the branch name when none was known). On the main process
    only: it may ask the Hub. Whatever goes wrong here is logged and leaves the recorded pins as they are (a bad
    mixture: the preflight, on every rank, names it)."""
    import huggingface_hub

    kept, pins = recorded(path), {}
    try:
        refs = references(cfg)
    except Exception as err:  # noqa: BLE001 - on the main process alone: the other ranks wait for its answer
        log.debug("Hub references not pinned: %s", err)
        return kept
    for repo_type, repo, revision in refs:
        if keys.pinned(revision):
            continue
        name, now = keys.ref_name(repo_type, repo, revision), keys.hub_commit(repo, revision, repo_type)
        if name in kept:
            pins[name] = kept[name]
            if now and now != kept[name]:
                log.info("%s is now commit %s; this run folder keeps reading %s, which its stages were keyed on "
                         "(a new run_name reads the new commit)", name, now[:12], kept[name][:12])
        elif now:
            pins[name] = now
            log.info("%s: commit %s, recorded in %s; this run folder reads it there from now on", name, now[:12], path)
        elif not huggingface_hub.constants.HF_HUB_OFFLINE:  # offline and not cached: the preflight refuses it
            pins[name] = revision
            log.warning("%s: no commit known (the Hub did not answer and it is not in the local cache): this run "
                        "folder keys it by its branch name, which moves", name)
    if any(name not in kept for name in pins):
        try:
            write_json(path, {**kept, **pins})
        except OSError as err:  # the run's own writes say more; the pins hold for this run
            log.warning("could not record the Hub pins in %s: %s", path, err)
    return pins
