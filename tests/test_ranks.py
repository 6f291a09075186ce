"""Ranks agree or stop with a message (pipeline/chain/ranks.py, pipeline/distributed.py), the bounded wait
for a cache folder (pipeline/data/prep.py), and which rank prints an error (pipeline/run.py `_tell`).

The same checks on two real "machines" (two launchers whose run folders differ): tests/test_multinode.py.
"""

from __future__ import annotations

import threading
import time

import pytest

from pipeline import run
from pipeline.chain import ranks
from pipeline.data import prep
from pipeline.errors import ConfigError


@pytest.mark.slow
def test_a_cache_folder_that_never_appears_stops_the_wait_with_its_name(tmp_path):
    folder = tmp_path / "tokenized" / "abc"
    started = time.monotonic()
    with pytest.raises(ConfigError) as err:
        prep.wait_for_dir(folder, "01-sft's tokenised data", limit_s=1.5)
    assert 1.5 <= time.monotonic() - started < 5
    assert str(err.value) == (
        f"waited 2 s (prep_timeout_s) for the main process to prepare 01-sft's tokenised data in {folder}, and it "
        f"never appeared: the cache folder (cache_dir) must be on a filesystem every node shares; if the main "
        f"process is still preparing, raise prep_timeout_s")


def test_a_folder_that_appears_in_time_ends_the_wait(tmp_path, monkeypatch):
    folder = tmp_path / "ready"
    monkeypatch.setattr(prep, "POLL_S", 0.05)
    threading.Timer(0.3, folder.mkdir).start()
    prep.set_wait_limit(30)
    try:
        prep.wait_for_dir(folder, "the data")  # the run's limit
    finally:
        prep.set_wait_limit(86400)
    assert folder.is_dir()


def _report(host: str, run: str, cache: str, sees: tuple[bool, bool] = (True, True), config: str = "c1",
            code: str = "commit abc") -> dict:
    return {"host": host, "sees": {"run folder": sees[0], "cache folder": sees[1]},
            "paths": {"run folder": run, "cache folder": cache}, "config": config, "code": code}


def test_ranks_that_agree_give_no_message():
    same = _report("node-a", "/shared/runs/tiny", "/shared/cache")
    assert ranks.disagreements([same, {**same, "host": "node-b"}]) is None


def test_a_node_local_run_folder_names_the_rank_its_host_and_both_paths():
    reports = [_report("node-a", "/a/runs/tiny", "/a/cache"),
               _report("node-a", "/a/runs/tiny", "/a/cache"),
               *[_report("node-b", "/b/runs/tiny", "/b/cache", sees=(False, False)) for _ in range(2)],
               _report("node-c", "/a/runs/tiny", "/a/cache", sees=(True, False))]
    assert ranks.disagreements(reports) == (
        "ranks 2-3 on node-b do not see the run folder /a/runs/tiny (looking in /b/runs/tiny) or the cache folder "
        "/a/cache (looking in /b/cache) that rank 0 on node-a writes; rank 4 on node-c does not see the cache folder "
        "/a/cache that rank 0 on node-a writes: output_root and cache_dir must be on a filesystem every node shares")


def test_other_code_or_config_is_named_with_the_keys_that_differ():
    main = _report("node-a", "/s/runs", "/s/cache")
    assert ranks.disagreements([main, {**main, "host": "node-b", "code": "commit def"}]) == (
        "rank 1 on node-b runs commit def where rank 0 on node-a runs commit abc: every node must run the same "
        "checkout of the pipeline")
    configs = [{"sft": {"learning_rate": 1e-4, "max_steps": 5}, "seed": 1},
               {"sft": {"learning_rate": 2e-4, "max_steps": 5}, "seed": 2}]
    assert ranks.disagreements([main, {**main, "host": "node-b", "config": "c2"}], configs) == (
        "rank 1 on node-b runs another config than rank 0 on node-a (differing in seed, sft.learning_rate): start "
        "every node with the same command line, recipe files and environment")


def test_one_process_skips_the_checks(tmp_path):
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"cache_dir": str(tmp_path / "cache"), "output_root": str(tmp_path)})
    ranks.check_start(cfg, tmp_path / "run")  # no process group: nothing to compare, nothing written
    assert list(tmp_path.iterdir()) == []
    assert ranks.collectively(lambda x: x + 1, 1) == 2

    def bad() -> None:
        raise ConfigError("bad")
    with pytest.raises(ConfigError, match="^bad$") as err:
        ranks.collectively(bad)
    assert err.value.every_rank


@pytest.mark.parametrize(("rank", "local", "own", "said"), [
    ("0", "0", False, "error: x\n"),  # the main process: as it is
    ("1", "1", False, ""),  # an error every rank met: the main process's machine says it once
    ("1", "1", True, "rank 1 on HOST: error: x\n"),  # its own error
    ("8", "0", False, "rank 8 on HOST: error: x\n"),  # the first process of another machine
])
def test_which_rank_prints_an_error(monkeypatch, capsys, rank, local, own, said):
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("LOCAL_RANK", local)
    monkeypatch.setattr(run.socket, "gethostname", lambda: "HOST")
    run._tell("error: x", own=own)
    assert capsys.readouterr().err == said


def _two_ranks(rank: int, port: int, out: str) -> None:
    """One of two gloo ranks: a value only rank 1 computes differently, then a check only rank 1 fails."""
    import json
    import os
    from datetime import timedelta

    import torch.distributed as dist

    from pipeline.distributed import same_on_every_rank

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=30))
    said = []
    try:
        same_on_every_rank(f"key{rank}", "the key", "fix it")
    except ConfigError as err:
        said.append([str(err), err.every_rank])

    def check() -> str:
        if rank == 1:
            raise ConfigError("data file missing on this node")
        return "decisions"
    try:
        said.append(ranks.collectively(check))
    except ConfigError as err:
        said.append([str(err), err.every_rank])
    dist.destroy_process_group()
    with open(f"{out}/{rank}.json", "w") as fh:
        json.dump(said, fh)


@pytest.mark.slow
def test_a_rank_that_differs_stops_every_rank_with_one_message(tmp_path):
    import json
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_two_ranks, args=(port, str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    host = socket.gethostname()
    expected = [[f"rank 1 on {host} computes the key key1, but rank 0 on {host} computes key0: fix it", True],
                [f"rank 1 on {host}: data file missing on this node", True]]
    for rank in (0, 1):
        assert json.loads((tmp_path / f"{rank}.json").read_text()) == expected
