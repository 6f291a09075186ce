"""Nothing finished is removed by accident: every call in pipeline/ that deletes or renames over a file or folder
(`shutil.rmtree`, `unlink`, `os.remove`, `rmdir`, `os.replace`, `rename`) is listed here with why it loses nothing,
read from the code with `ast`. A new one fails the test until it is listed, with its reason, under one of:

- temp: a temporary file or folder of this process (or one a dead writer left under a temporary name);
- replace: a complete new version takes the name in one step (or the old one comes back);
- finished: training checkpoints once the record says the model is trained and saved, or older checkpoints once a
  newer one is marked complete;
- redo: what a stage or candidate that trains anew replaces, once resume's decision allows it (redo=, or its own
  inputs or settings changed);
- own: a marker this process wrote for itself (its lock, its rank token, the previous invocation's outcome).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = {"rmtree", "unlink", "rmdir", "rename", "removedirs", "renames"}  # os.remove / os.replace by name
KINDS = {"temp", "replace", "finished", "redo", "own"}
SITES = {
    ("pipeline/chain/orchestrator.py", "open_run_dir", "probe.unlink()"):
        ("temp", "the write probe this process just wrote"),
    ("pipeline/chain/orchestrator.py", "tidy", "shutil.rmtree(work_dir(folder), ignore_errors=True)"):
        ("finished", "work/ of a stage whose record says finished and whose model/ is there"),
    ("pipeline/chain/orchestrator.py", "_clear_stale", "shutil.rmtree(child)"):
        ("redo", "work/ and eval/ (and prepared data for other inputs) of a stage resume.decide lets train anew"),
    ("pipeline/chain/orchestrator.py", "_clear_stale", "child.unlink()"):
        ("redo", "the same, for files"),
    ("pipeline/chain/outcome.py", "Outcome.start", "self.path.unlink(missing_ok=True)"):
        ("own", "the previous invocation's outcome.json, with the run lock held: this run writes the new one"),
    ("pipeline/chain/ranks.py", "_remove_tokens", "(folder / TOKEN.format(token)).unlink(missing_ok=True)"):
        ("own", "the token file this run wrote to check that its ranks share the folder"),
    ("pipeline/chain/sweep.py", "_clear", "shutil.rmtree(folder)"):
        ("redo", "a candidate folder with no record, or a stale one (a finished or interrupted one is kept)"),
    ("pipeline/runfolder.py", "restore", "shutil.rmtree(folder)"):
        ("redo", "a stage or candidate folder with no record, or a stale one, where a kept one of this chain's "
                 "fingerprint goes back (a finished or interrupted one is kept)"),
    ("pipeline/files.py", "move_dir", "os.rename(src, dest)"):
        ("replace", "a folder moved to a free name (a finished stage to kept/ and back); never onto another"),
    ("pipeline/evaluation/scorecache.py", "_keep", "shutil.rmtree(entry, ignore_errors=True)"):
        ("replace", "a cache entry that does not read as this model's scores, replaced by the ones just computed"),
    ("pipeline/files.py", "write_text", "os.replace(tmp, path)"):
        ("replace", "the atomic write: the complete new file takes the name"),
    ("pipeline/files.py", "commit_dir", "os.replace(path, old)"):
        ("replace", "the folder being replaced steps aside (where renameat2 cannot exchange the two)"),
    ("pipeline/files.py", "commit_dir", "os.replace(tmp, path)"):
        ("replace", "the complete new folder takes the name"),
    ("pipeline/files.py", "commit_dir", "shutil.rmtree(old, ignore_errors=True)"):
        ("replace", "the replaced folder, once the new one holds the name"),
    ("pipeline/files.py", "publish_dir", "os.rename(tmp, path)"):
        ("replace", "first complete publish wins; onto an existing folder it fails, never merges"),
    ("pipeline/files.py", "publish_dir", "shutil.rmtree(tmp, ignore_errors=True)"):
        ("temp", "this process's copy when another one published first"),
    ("pipeline/files.py", "atomic_dir", "shutil.rmtree(tmp, ignore_errors=True)"):
        ("temp", "this process's folder when building it failed or another one won"),
    ("pipeline/files.py", "RunLock._link_new", "tmp.unlink(missing_ok=True)"):
        ("temp", "the lock file's temporary name, once linked"),
    ("pipeline/files.py", "RunLock._take_over", "claim.unlink()"):
        ("temp", "a claim on a stale lock left by a contender that died while taking it over, older than the lease"),
    ("pipeline/files.py", "RunLock._take_over", "self.path.unlink(missing_ok=True)"):
        ("own", "a lock judged stale (holder gone, requeued or lease expired), under this process's claim"),
    ("pipeline/files.py", "RunLock._take_over", "claim.unlink(missing_ok=True)"):
        ("own", "this process's claim, released"),
    ("pipeline/files.py", "RunLock.renew", "os.replace(tmp, self.path)"):
        ("replace", "the lock's renewed lease, written whole"),
    ("pipeline/files.py", "RunLock.renew", "tmp.unlink(missing_ok=True)"):
        ("temp", "the renewal's temporary file, once linked or replaced into place (or refused)"),
    ("pipeline/files.py", "RunLock.release", "self.path.unlink(missing_ok=True)"):
        ("own", "this process's own lock"),
    ("pipeline/files.py", "remove_leftovers", "path.rename(original)"):
        ("replace", "a commit killed between its renames: the old folder back under its name"),
    ("pipeline/files.py", "remove_leftovers", "shutil.rmtree(path, ignore_errors=True)"):
        ("temp", "temporary folders of writers that are gone (this host's dead pids, or past the lease)"),
    ("pipeline/files.py", "storage_now", "probe.unlink(missing_ok=True)"):
        ("temp", "the empty file this process wrote to read the storage's clock"),
    ("pipeline/files.py", "remove_leftovers", "path.unlink(missing_ok=True)"):
        ("temp", "the same, for files"),
    ("pipeline/rl/actor_critic.py", "PPOLoop.save", "shutil.rmtree(old, ignore_errors=True)"):
        ("finished", "older PPO checkpoints, once this update's is saved whole"),
    ("pipeline/runfolder.py", "drop_work", "shutil.rmtree(work_dir(folder), ignore_errors=True)"):
        ("finished", "work/ once the record says trained"),
    ("pipeline/stages/dpo.py", "with_reference", "shutil.rmtree(work, ignore_errors=True)"):
        ("temp", "the output folder of a trainer that only computed the reference log-probs (it saves nothing)"),
    ("pipeline/tiny/model.py", "ensure_base_model", "shutil.rmtree(build, ignore_errors=True)"):
        ("temp", "this world's build folder of the tiny base, once its model is published"),
    ("pipeline/train/trainer.py", "CheckpointMarker._rotate", "shutil.rmtree(old, ignore_errors=True)"):
        ("finished", "marked checkpoints beyond save_total_limit, once a newer one is marked complete"),
    ("pipeline/train/trainer.py", "last_complete_checkpoint", "path.rename(aside)"):
        ("replace", "an incomplete checkpoint set aside as incomplete-checkpoint-N: kept, never deleted"),
    ("pipeline/train/trainer.py", "save_checkpoint", "(tmp / 'training_args.bin').unlink(missing_ok=True)"):
        ("temp", "a file of the checkpoint being written (the pickled arguments), before it is committed"),
    ("pipeline/train/trainer.py", "save_checkpoint", "shutil.rmtree(tmp, ignore_errors=True)"):
        ("temp", "the checkpoint being written, when writing it failed"),
}


def sites(path: str, source: str) -> list[tuple[str, str, str]]:
    """(module, enclosing class.function, call) of every deleting or renaming call in `source`."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        if node.func.attr not in METHODS and ast.unparse(node.func) not in ("os.remove", "os.replace"):
            continue
        scope, up = [], node
        while up in parents:
            up = parents[up]
            if isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                scope.append(up.name)
        out.append((path, ".".join(reversed(scope)), ast.unparse(node)))
    return out


def test_the_scan_finds_deletions_and_renames_and_not_list_removals():
    source = "import os, shutil\ndef f(p, xs):\n    shutil.rmtree(p)\n    p.unlink()\n    os.replace(p, p)\n" \
             "    xs.remove(1)\n    p.rename(p)\n"
    assert [call for _, _, call in sites("m.py", source)] == ["shutil.rmtree(p)", "p.unlink()", "os.replace(p, p)",
                                                              "p.rename(p)"]


def test_every_deletion_in_the_product_is_listed_with_why_it_loses_nothing():
    found = {s for f in sorted((ROOT / "pipeline").rglob("*.py"))
             for s in sites(f.relative_to(ROOT).as_posix(), f.read_text(encoding="utf-8"))}
    assert not found - set(SITES), "not listed in SITES: " + "; ".join(map(str, sorted(found - set(SITES))))
    assert not set(SITES) - found, "listed but gone: " + "; ".join(map(str, sorted(set(SITES) - found)))
    assert {kind for kind, _ in SITES.values()} <= KINDS
