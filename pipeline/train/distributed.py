"""Process state for one or many processes: the process group, DeepSpeed detection, the CPU / gloo
workaround, and the one rule for run files: the main process writes, every rank waits.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from accelerate import PartialState
from accelerate.state import AcceleratorState
from accelerate.utils import broadcast_object_list

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


@contextlib.contextmanager
def main_writes() -> Iterator[bool]:
    """`with main_writes() as main: if main: write(...)`: every rank waits until the main process has written.

    The wait happens only when the block finishes; an exception on one rank is raised there as is.
    """
    state = PartialState()
    yield state.is_main_process
    state.wait_for_everyone()


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
            torch.distributed.barrier()
        torch.distributed.destroy_process_group()
