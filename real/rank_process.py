"""What each spawned rank process runs: set up torch.distributed, call the user's code, clean up.

torchrun and torch's elastic agent call these processes "workers"; this module is their entry point
(`entry`), one call per rank. A function, or a script's entry function, runs inside a default group real
creates for it; a torchrun-style script runs as ``__main__`` and creates its own, as under torchrun.
"""

from __future__ import annotations

import contextlib
import copy
import faulthandler
import os
import pickle
import runpy
import signal
import stat
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from real import init_guard
from real.emulated_cuda import emulating
from real.errors import RealGroupError
from real.liveness import ended
from real.main_script import MainScript
from real.status import CRASH, RETURNED, StatusDir
from real.target import Job, MainTarget, ScriptTarget, load_job
from real.timeline import Recorder

# Sent by the launcher at a timeout: each still-running rank process dumps its Python stacks to its
# status file.
STACK_DUMP_SIGNAL = signal.SIGUSR1
# Leading traceback frames of these files are real's and Python's machinery, not the rank code (runpy is
# frozen into the interpreter from Python 3.11, and its frames are named so).
_MACHINERY = (__file__, runpy.__file__, "<frozen runpy>")
# How much of a rank's own stderr its failure quotes when it exits with a status (argparse's usage error).
_STDERR_LINES = 10
_STDERR_BYTES = 8192


# Elastic's own wrapper applies `record` too; applying it here keeps the error file written for any
# wrapper, so the agent's failure report carries the traceback.
@record
def entry(
    sys_path: list[str], status_root: str, main: MainScript | None, job_blob: bytes, inherited: None = None
) -> Any:
    """Run one rank of a job: the launcher's elastic agent calls this in each rank process.

    ``main`` is the calling script when the job refers to functions or classes of ``__main__``.
    ``inherited`` is what is left of a :class:`real.warm.Inherited` once unpickling has put the launcher's
    environment, stdout and stderr in place.
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
    _line_buffered()
    try:
        job = load_job(job_blob, main)
        os.environ.update(job.env)
        _limit_threads()
        with _devices(job):
            if isinstance(job.target, MainTarget):
                result = _run_main(job.target, status, rank, _recording(job, rank))
            else:
                if isinstance(job.target, ScriptTarget):
                    sys.argv = [job.target.path, *job.target.argv]
                assert job.backend is not None  # the launcher resolves the backend of every function target
                result = _run(
                    job.target.resolve(),
                    job.backend,
                    job.args,
                    job.kwargs,
                    status,
                    rank,
                    _recording(job, rank),
                )
            result = _to_cpu(result)
        _check_picklable(result, rank)
    except Exception as exc:
        if status.error(rank) is None:
            status.record_error(rank, exc, skip_files=_MACHINERY, gone=_ended_peers(status, rank))
        raise
    status.mark(rank, RETURNED)
    return result


def _devices(job: Job) -> contextlib.AbstractContextManager[None]:
    """The CUDA devices the rank code runs on: simulated ones where the launch asked for them, else the machine's."""
    if job.emulate_cuda is None:
        return contextlib.nullcontext()
    return emulating(job.emulate_cuda)  # imports simdist: only where the emulation is asked for


def _recording(job: Job, rank: int) -> contextlib.AbstractContextManager[None]:
    """Where the launch asked for a timeline, the recording of this rank's collectives around its code."""
    if job.timeline is None:
        return contextlib.nullcontext()
    recorder = Recorder(
        rank, job.timeline.directory, job.timeline.profile, device_events=job.emulate_cuda is None
    )
    return recorder.recording()


def _run(
    fn: Callable[..., Any],
    backend: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    status: StatusDir,
    rank: int,
    recording: contextlib.AbstractContextManager[None],
) -> Any:
    """Call ``fn`` inside a process group created from the launcher's environment variables."""
    if backend == "nccl":
        # One GPU per local rank, selected before the group exists so NCCL binds to it.
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    # With torch's init barrier (on the store), no rank starts its code before every rank's group is connected:
    # otherwise a rank whose code has no collective can return, and its process end, while a peer is still
    # connecting to it, which fails that peer's init_process_group ("Connection closed by peer").
    with _env_set("TORCH_DIST_INIT_BARRIER", "1"):
        dist.init_process_group(backend)
    keep = init_guard.keeper(dist.group.WORLD, backend, rank, int(os.environ["WORLD_SIZE"]))
    with init_guard.intercepted(keep), recording:
        result = _call(lambda: fn(*args, **kwargs), status, rank)
    # The user's code may already have destroyed the group.
    if dist.is_initialized():
        dist.destroy_process_group()
    return result


@contextlib.contextmanager
def _env_set(name: str, value: str) -> Any:
    """The environment variable ``name`` set to ``value`` for the block, then as it was."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def _run_main(
    target: MainTarget, status: StatusDir, rank: int, recording: contextlib.AbstractContextManager[None]
) -> None:
    """Run a script as ``__main__`` with its own command line, as ``python -u script.py ARGS`` under torchrun."""
    sys.argv = [target.path, *target.argv]
    # as `python script.py` puts the script's directory first
    sys.path.insert(0, os.path.dirname(target.path))
    noted = init_guard.observer(lambda backend: status.record_group(rank, backend))
    with init_guard.intercepted(noted), recording:
        _call(lambda: runpy.run_path(target.path, run_name="__main__"), status, rank)


def _call(code: Callable[[], Any], status: StatusDir, rank: int) -> Any:
    """Run the rank code; a failure is recorded at once, and ``sys.exit(0)`` ends the rank as a return does.

    Recorded at once, while the peers are still waiting for this rank: its exit makes them fail too, and the
    failure times must show this rank first. The group is left to die with the process, since destroying it
    could block on peers that are still inside a collective.
    """
    try:
        return code()
    except SystemExit as exc:
        code_ = exit_status(exc)
        if code_ == 0:
            return None
        # Where it exited matters, not what it was handling then (argparse exits while handling its own error).
        summary = f"exited with status {code_}: SystemExit({exc.code!r})"
        status.record_error(
            rank,
            exc,
            skip_files=_MACHINERY,
            gone=_ended_peers(status, rank),
            summary=summary,
            note=_stderr_tail(status),
            chain=False,
        )
        raise
    except Exception as exc:
        if isinstance(exc, RealGroupError):
            init_guard.cut_at_caller(exc)  # the error names the call; real's own frames add nothing
        status.record_error(rank, exc, skip_files=_MACHINERY, gone=_ended_peers(status, rank))
        raise


def exit_status(exc: SystemExit) -> int:
    """The status a process leaving with ``exc`` exits with, as Python and the OS make it (``None`` is 0)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    return 1  # Python prints any other object to stderr and exits with 1


def _stderr_tail(status: StatusDir) -> str:
    """The last lines this rank wrote to its stderr when that is its own log file under the launch's directory.

    A prefixed launch copies each rank's output from such a file. Anything else (a terminal, a pipe, a file the
    user shares between ranks) is left alone: the lines went there, where the user sees them.
    """
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    try:
        path = os.readlink("/proc/self/fd/2")
        own = f"{os.path.realpath(status.root)}{os.sep}"
        if not path.startswith(own) or not stat.S_ISREG(os.stat(path).st_mode):
            return ""
        with open(path, "rb") as file:
            file.seek(max(0, os.fstat(file.fileno()).st_size - _STDERR_BYTES))
            lines = file.read().decode(errors="replace").splitlines()[-_STDERR_LINES:]
    except OSError:
        return ""  # no /proc (not Linux), or the file went away
    if not lines:
        return ""
    return "its stderr ended with:\n" + "\n".join(f"  {line}" for line in lines)


def _line_buffered() -> None:
    """Each line the rank code prints leaves the process at once, as under torchrun's ``python -u``.

    A prefixed launch copies each rank's output from a file, to which Python would otherwise write in blocks.
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError, OSError):
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]


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
