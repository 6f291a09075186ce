"""Process state for one or many processes: the process group, DeepSpeed detection, the CPU / gloo
workaround, the one rule for run files (the main process writes, every rank waits), and how the ranks agree:
a value every rank must share is gathered from all of them and compared (`same_on_every_rank`), and a
disagreement is raised on every rank alike (`agreed_error`), so that no rank is left waiting at a collective.
"""

from __future__ import annotations

import contextlib
import os
import socket
import warnings
from collections.abc import Iterator
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from accelerate import PartialState
from accelerate.state import AcceleratorState
from accelerate.utils import broadcast_object_list

from pipeline.errors import ConfigError

T = TypeVar("T")


def deepspeed_on() -> bool:
    """Whether `accelerate launch` runs this process under DeepSpeed (a config with `distributed_type: DEEPSPEED`)."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"


def process_state(timeout_s: int) -> PartialState:
    """The process group, created once per process before any trainer, with collectives timing out after
    `timeout_s` (every trainer reuses this group: their own `ddp_timeout` never applies).

    DeepSpeed without CUDA (docs/cluster.md): accelerate would pick no backend and fill DeepSpeed's "auto"
    batch sizes for a world size of 1, so the state is created over gloo first and every trainer
    reuses it (`trainer_state_args`). Otherwise a plain state (CPU processes over gloo when there is no GPU).
    """
    timeout = timedelta(seconds=timeout_s)
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # what DeepSpeed picks without a GPU, without its warning
    if deepspeed_on():
        import deepspeed  # noqa: F401 - imported before the run's logging takes over its stdout handler

        if not torch.cuda.is_available():
            warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated")  # per DeepSpeed call
            return PartialState(backend="gloo", timeout=timeout)
    return PartialState(cpu=not torch.cuda.is_available(), timeout=timeout)


def trainer_state_args() -> dict:
    """Training arguments that make a trainer keep `process_state`'s gloo group under DeepSpeed without CUDA,
    with a fresh accelerator state (accelerate takes one DeepSpeed plugin per state, and the previous stage's
    trainer left its own); empty otherwise."""
    if not (deepspeed_on() and not torch.cuda.is_available()):
        return {}
    AcceleratorState._reset_state()
    return {"accelerator_config": {"use_configured_state": True}}


def is_main() -> bool:
    """Whether this is the main process (the one that writes run files)."""
    return PartialState().is_main_process


def any_rank(flag: bool) -> bool:
    """Whether `flag` is true on any rank (an all-reduce of the verdict; every rank must call it)."""
    verdict = torch.tensor([float(flag)], device=PartialState().device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
    return bool(verdict.item())


def main_value(value: T) -> T:
    """The main process's `value`, on every rank. A rank's look at a folder that another run may be writing (a
    shared cache) can differ from its neighbours'; a choice between collective paths must follow one answer."""
    if PartialState().num_processes == 1:
        return value
    box = [value]
    broadcast_object_list(box)
    return box[0]


def world_size() -> int:
    """The number of ranks of the process group (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def every_value(value: T) -> list[T]:
    """`value` of every rank, in rank order, on every rank (an all-gather; every rank must call it)."""
    if world_size() == 1:
        return [value]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def host() -> str:
    """This machine's name, as errors name it."""
    return socket.gethostname()


def ranks_on(ranks: list[int], on: str) -> str:
    """`rank 3 on node-b`, `ranks 8-15 on node-b`, `ranks 1, 3 on node-b`."""
    if len(ranks) == 1:
        return f"rank {ranks[0]} on {on}"
    run = ranks == list(range(ranks[0], ranks[-1] + 1))
    return f"ranks {ranks[0]}-{ranks[-1]} on {on}" if run else f"ranks {', '.join(map(str, ranks))} on {on}"


PLURAL = {"does": "do", "runs": "run", "computes": "compute", "plans": "plan", "has": "have"}


def ranks_do(ranks: list[int], on: str, what: str) -> str:
    """`rank 3 on node-b computes X`, `ranks 8-15 on node-b compute X`: `what` starts with a verb of `PLURAL`."""
    verb, _, rest = what.partition(" ")
    return f"{ranks_on(ranks, on)} {PLURAL.get(verb, verb) if len(ranks) > 1 else verb} {rest}"


def agreed_error(message: str) -> ConfigError:
    """The `ConfigError` every rank raises alike once the ranks have agreed on it (printed once per machine)."""
    err = ConfigError(message)
    err.every_rank = True
    return err


def same_on_every_rank(value: object, what: str, advice: str) -> None:
    """Raise the same `ConfigError` on every rank when some rank's `value` differs from the main process's,
    naming those ranks, their hosts and both values: `"rank 1 on node-b computes <what> X, but rank 0 on node-a
    computes Y: <advice>"`. Every rank must call it."""
    seen = every_value((host(), value))
    main_host, first = seen[0]
    odd: dict[tuple[str, str], list[int]] = {}
    for rank, (on, mine) in enumerate(seen):
        if mine != first:
            odd.setdefault((on, str(mine)), []).append(rank)
    if odd:
        theirs = "; ".join(ranks_do(ranks, on, f"computes {what} {mine}") for (on, mine), ranks in odd.items())
        raise agreed_error(f"{theirs}, but rank 0 on {main_host} computes {first}: {advice}")


def barrier(what: str) -> None:
    """Wait for every rank, at most `collective_timeout_s`; a timeout names `what` the ranks waited for."""
    try:
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        else:
            PartialState().wait_for_everyone()
    except RuntimeError as err:
        if "timed out" not in str(err).lower() and "timeout" not in str(err).lower():
            raise
        raise RuntimeError(f"rank {dist.get_rank()} on {host()} waited for {what} longer than collective_timeout_s: "
                           f"a rank is stuck or gone ({err})") from err


@contextlib.contextmanager
def main_writes() -> Iterator[bool]:
    """`with main_writes() as main: if main: write(...)`: every rank waits until the main process has written.

    The wait happens only when the block finishes; an exception on one rank is raised there as is.
    """
    yield PartialState().is_main_process
    barrier("the main process to write run files")


def share_cpu_threads() -> None:
    """`accelerate launch` pins CPU runs to 1 thread; share the cores among this node's processes instead."""
    if torch.cuda.is_available():
        return
    share = (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    torch.set_num_threads(int(os.environ.get("PIPELINE_CPU_THREADS", 0)) or max(1, share))


def close_process_group(together: bool = False) -> None:
    """Destroy a live process group (a live gloo group can abort the interpreter at exit). `together`: every rank
    ends here at the same point, so they first wait for each other, and none closes its connections while another
    still uses them."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if together and torch.distributed.get_world_size() > 1:
            barrier("every rank to finish the run")
        torch.distributed.destroy_process_group()
