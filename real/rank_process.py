"""What each spawned rank process runs: set up torch.distributed, call the user's code, clean up.

torchrun and torch's elastic agent call these processes "workers"; this module is their entry point
(`entry`), one call per rank.
"""

from __future__ import annotations

import copy
import faulthandler
import os
import pickle
import signal
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from real.liveness import ended
from real.main_script import MainScript
from real.status import CRASH, RETURNED, StatusDir
from real.target import load_job

# Sent by the launcher at a timeout: each still-running rank process dumps its Python stacks to its
# status file.
STACK_DUMP_SIGNAL = signal.SIGUSR1


# Elastic's own wrapper applies `record` too; applying it here keeps the error file written for any
# wrapper, so the agent's failure report carries the traceback.
@record
def entry(sys_path: list[str], status_root: str, main: MainScript | None, job_blob: bytes) -> Any:
    """Run one rank of a job: the launcher's elastic agent calls this in each spawned process.

    ``main`` is the calling script when the job refers to functions or classes of ``__main__``.
    """
    # The job is unpickled only after the parent's sys.path is in place, so functions from test
    # directories and other path-only locations resolve exactly as they did in the parent.
    sys.path[:0] = [p for p in sys_path if p not in sys.path]
    rank = int(os.environ["RANK"])
    status = StatusDir(status_root)
    status.mark_started(rank, os.getpid())
    stack_file = open(status.path(rank, "stack.txt"), "w")  # noqa: SIM115 - faulthandler keeps it open
    faulthandler.register(STACK_DUMP_SIGNAL, file=stack_file, all_threads=True)
    # A fatal signal (a segfault in an extension) leaves its Python stacks here for the launcher's report.
    crash_file = open(status.path(rank, CRASH), "w")  # noqa: SIM115 - faulthandler keeps it open
    faulthandler.enable(file=crash_file, all_threads=True)
    try:
        job = load_job(job_blob, main)
        os.environ.update(job.env)
        _limit_threads()
        result = _run(job.target.resolve(), job.backend, job.args, job.kwargs, status, rank)
        result = _to_cpu(result)
        _check_picklable(result, rank)
    except Exception as exc:
        if status.error(rank) is None:
            status.record_error(rank, exc, skip_file=__file__, gone=_ended_peers(status, rank))
        raise
    status.mark(rank, RETURNED)
    return result


def _run(
    fn: Any, backend: str, args: tuple[Any, ...], kwargs: dict[str, Any], status: StatusDir, rank: int
) -> Any:
    """Call ``fn`` inside a process group created from the launcher's environment variables."""
    if backend == "nccl":
        # One GPU per local rank, selected before the group exists so NCCL binds to it.
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)
    try:
        result = fn(*args, **kwargs)
    except Exception as exc:
        # Recorded at once, while the peers are still waiting for this rank: its exit makes them fail
        # too, and the failure times must show this rank first. The group is left to die with the
        # process, since destroying it could block on peers that are still inside a collective.
        status.record_error(rank, exc, skip_file=__file__, gone=_ended_peers(status, rank))
        raise
    # The user's code may already have destroyed the group.
    if dist.is_initialized():
        dist.destroy_process_group()
    return result


def _ended_peers(status: StatusDir, rank: int) -> list[int]:
    """The other ranks whose processes ended (or are ending) without returning: failures before this one."""
    peers = [r for r in range(int(os.environ["WORLD_SIZE"])) if r != rank and not status.has(r, RETURNED)]
    return [r for r in peers if (pid := status.pid(r)) is not None and ended(pid)]


def _limit_threads() -> None:
    """One intra-op thread per rank process unless told otherwise, as torchrun does for several processes."""
    if "OMP_NUM_THREADS" not in os.environ and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1:
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def _to_cpu(value: Any) -> Any:
    """``value`` with every tensor moved to the CPU (inside lists, tuples, named tuples and dicts)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_to_cpu(v) for v in value))
    if type(value) in (list, tuple):
        return type(value)(_to_cpu(v) for v in value)
    if isinstance(value, dict):
        # A shallow copy keeps the mapping's own type (OrderedDict, defaultdict with its factory).
        moved = copy.copy(value)
        for key, item in value.items():
            moved[key] = _to_cpu(item)
        return moved
    return value


def _check_picklable(value: Any, rank: int) -> None:
    """Fail with a clear message here rather than inside the launcher's result queue."""
    try:
        pickle.dumps(value)
    except Exception as exc:
        raise TypeError(
            f"rank {rank} returned a {type(value).__name__} that cannot be pickled back to the launcher "
            f"({exc}); return plain data, NumPy arrays or tensors"
        ) from exc
