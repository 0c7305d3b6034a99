"""Run the same rank functions the simulator runs on real processes, through torch's elastic launcher."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

# Imported up front so every logger the launch uses already exists when `_quiet_launcher_logs` runs.
import torch.distributed.elastic.rendezvous.c10d_rendezvous_backend
import torch.distributed.elastic.rendezvous.static_tcp_rendezvous  # noqa: F401
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from real import rank_process, warm
from real.backend import emulated_backend, resolve_backend
from real.emulated_cuda import EmulatedCuda
from real.errors import RealConfigError
from real.exits import ExitWatch
from real.options import LINE_PREFIX, MAX_TIMEOUT, PROCESS_MEMORY, LaunchOptions, TimelineOptions
from real.rendezvous import LOOPBACK, Rendezvous
from real.report import failure_error
from real.status import RETURNED, StatusDir
from real.target import Job, MainTarget, Target, checked_entry, dump_job, main_target, target_for
from simdist_base.timeline import Timeline, clear, load

__all__ = [
    "MAX_TIMEOUT",
    "PROCESS_MEMORY",
    "EmulatedCuda",
    "RealResult",
    "free_port",
    "launch",
    "run",
    "run_script",
]

_LOGGER_PREFIXES = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
_STACK_DUMP_WAIT = 2.0  # seconds the still-running rank processes get to write their stacks at a timeout
_AGENT_EXIT_WAIT = 30.0  # seconds the agent gets to notice killed rank processes and return
_WATCH_INTERVAL = 0.02  # seconds between checks of the agent's thread while waiting for rank processes to end
_PORT_ATTEMPTS = 3  # launches tried with a fresh free port when the previous one was taken meanwhile


class _DefaultBackend(str):
    """``backend``'s default: ``"gloo"``, or ``"nccl"`` (presented over gloo) for code on emulated GPUs."""

    def __repr__(self) -> str:
        return "'gloo' (with emulate_cuda: 'nccl')"


DEFAULT_BACKEND = _DefaultBackend("gloo")

#: the backend a torchrun-style run reports when no rank created a process group
NO_GROUP = "none"


@dataclasses.dataclass(frozen=True)
class RealResult:
    """The outcome of a real run: each rank's return value and the wall time of the whole launch.

    ``returns[i]`` is the value of rank ``ranks[i]``: on one node every rank, in order (``returns[r]`` is rank
    ``r``'s); on one node of several, that node's ranks. ``backend`` is the default group's: the one real
    created around a function, or the one a torchrun-style script's ranks created (``"none"`` if none did).
    ``nproc`` counts this node's processes. ``timeline`` holds every rank's collectives and sends/recvs with
    their times when the run recorded them (``timeline=``), else None.
    """

    returns: list[Any]
    wall_time: float
    backend: str
    nproc: int
    ranks: tuple[int, ...] = ()
    timeline: Timeline | None = None


def run(
    fn: Callable[..., Any],
    nproc: int,
    backend: str | None = DEFAULT_BACKEND,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    master_port: int | None = None,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
    rendezvous: Rendezvous | None = None,
    emulate_cuda: bool | EmulatedCuda = False,
    timeline: bool | str | Path = False,
    profile: bool = False,
) -> RealResult:
    """Run ``fn(*args, **kwargs)`` as every rank of ``nproc`` real processes and collect the returns.

    Each process creates its default group with ``backend`` before calling ``fn`` (a call of
    ``init_process_group`` in ``fn`` that asks for the same is accepted). Functions and classes reach the
    spawned processes by reference (module and qualified name), as ``torch.multiprocessing.spawn`` sends them:
    ``fn`` may be a top-level function of an importable module or of the script that calls ``run``, whose call
    then sits under ``if __name__ == "__main__":``. Each process loads that script under another module name
    (``__mp_main__``, or ``pkg.mod`` for ``python -m pkg.mod``), so the guarded block does not run there while
    the rest of its top level does, once per process. Functions and classes of the script passed inside
    ``args``/``kwargs`` travel the same way. Rejected before any process starts, with a RealConfigError that
    says what to do: lambdas, functions nested in other functions, anything defined inside the script's
    ``if __name__ == "__main__":`` block, functions of an interactive ``__main__`` with no file (``python -c``,
    the REPL, notebooks), and arguments that cannot be pickled. ``rendezvous`` runs this node's part of a
    launch on several nodes. ``emulate_cuda`` (True, or an :class:`EmulatedCuda` naming the devices) runs code
    written for GPUs on simdist's simulated CUDA device in each process, its NCCL groups over gloo.
    ``timeline`` (True, or a directory to write the files to) records each rank's collectives and sends/recvs
    with their times into ``RealResult.timeline``; ``profile`` also writes a torch profiler trace per rank
    into that directory.
    """
    options = _options(nproc, timeout, master_port, env, rendezvous, emulate_cuda, timeline, profile)
    return launch(target_for(fn), backend, options, args, kwargs)


def run_script(
    path: str | Path,
    nproc: int,
    backend: str | None = DEFAULT_BACKEND,
    entry: str | None = "main",
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    argv: Sequence[str] = (),
    master_port: int | None = None,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
    rendezvous: Rendezvous | None = None,
    emulate_cuda: bool | EmulatedCuda = False,
    timeline: bool | str | Path = False,
    profile: bool = False,
) -> RealResult:
    """Run the script at ``path`` as every rank of ``nproc`` real processes.

    With ``entry`` (default ``"main"``) each process creates its group with ``backend`` and calls the script's
    function ``entry(*args, **kwargs)``, the script loaded under a module name of its own. With
    ``entry=None`` each process runs the script as torchrun does: as ``__main__``, with
    ``sys.argv == [path, *argv]``, creating its own group; every return is then None. Either way ``argv`` is
    the command line the script sees. ``emulate_cuda``, ``timeline`` and ``profile`` as for :func:`run`.
    """
    options = _options(nproc, timeout, master_port, env, rendezvous, emulate_cuda, timeline, profile)
    argv = _checked_argv(argv)
    if entry is None:
        if args or kwargs:
            raise RealConfigError(
                "args and kwargs are passed to an entry function; a script run torchrun-style (entry=None) "
                "reads its command line instead: pass argv=[...]"
            )
        if backend not in ("gloo", None):
            raise RealConfigError(
                f"backend {backend!r} chooses the group real creates around an entry function; a script run "
                f"torchrun-style (entry=None) creates its own with init_process_group(backend=...): leave "
                f"backend out, or name the entry function"
            )
        return launch(main_target(path, argv), None, options)
    return launch(checked_entry(path, entry, argv), backend, options, args, kwargs)


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def launch(
    target: Target,
    backend: str | None,
    options: LaunchOptions,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
) -> RealResult:
    """Start the rank processes of ``target`` (with ``backend``'s group unless it is a torchrun-style script),
    wait for them (at most ``options.timeout``), collect their returns or explain their failure."""
    emulation = options.emulate_cuda
    resolved = group_backend(target, backend, options)
    rdzv, nproc = options.rendezvous, options.nproc
    with tempfile.TemporaryDirectory(prefix="real-run-") as root:
        timeline = _timeline_in(options.timeline, root)
        if timeline is not None and rdzv.nnodes == 1:  # nodes sharing a directory each write their own ranks
            clear(timeline.directory)
        blob, main = dump_job(
            Job(
                target,
                resolved,
                tuple(args),
                dict(kwargs or {}),
                dict(options.env),
                emulate_cuda=emulation,
                timeline=timeline,
            )
        )
        status = StatusDir(root)
        # A port found free can be taken before the launcher binds it; then try another one.
        for _attempt in range(_PORT_ATTEMPTS if rdzv.needs_port and options.master_port is None else 1):
            endpoint = rdzv.endpoint_with(options.master_port or free_port())
            with warm.start_method() as method:
                config = _launch_config(options, endpoint, root, method)
                # forked from the fork server, a rank process is handed this process's environment, and its
                # stdout and stderr unless elastic redirects them to its files (prefixed output)
                inherited = (
                    warm.Inherited(stdio=not options.console.prefix) if method == "forkserver" else None
                )
                start = time.perf_counter()
                watch = ExitWatch(nproc)
                values, error, timed_out = _supervise(
                    config, (list(sys.path), root, main, blob, inherited), options.timeout, status, watch
                )
                wall_time = time.perf_counter() - start
            if not _port_taken(error):
                break
        if error is not None or timed_out or values is None:
            known = rdzv.local_ranks(nproc)
            failed = error.failures if isinstance(error, ChildFailedError) else {}
            ranks = list(known) if known is not None else sorted({*status.started_ranks(), *failed})
            place = None if rdzv.nnodes == 1 else rdzv.describe(endpoint)
            failure = failure_error(
                status,
                nproc,
                resolved,
                error,
                timed_out,
                options.timeout,
                watch.exits(),
                ranks=ranks,
                place=place,
            )
            # Elastic's ChildFailedError is fully retold by the failure; any other error is the cause.
            raise failure from (None if isinstance(error, ChildFailedError) else error)
        used = resolved if resolved is not None else _script_backend(status, sorted(values))
        recorded = None if timeline is None else load(timeline.directory)
        if recorded is not None and options.timeline is not None and not options.timeline.directory:
            recorded.directory = ""  # timeline=True: the files went with the launch's temporary directory
    ranks = tuple(sorted(values))
    return RealResult([values[rank] for rank in ranks], wall_time, used, nproc, ranks, recorded)


#: the directory, under a launch's own, where ``timeline=True`` records (removed with it)
_TIMELINE_DIR = "timeline"


def _timeline_in(timeline: TimelineOptions | None, root: str) -> TimelineOptions | None:
    """``timeline`` with a directory: its own, or for ``timeline=True`` (directory "") one under ``root``."""
    if timeline is None or timeline.directory:
        return timeline
    return TimelineOptions(os.path.join(root, _TIMELINE_DIR), timeline.profile)


def _options(
    nproc: int,
    timeout: float,
    master_port: int | None,
    env: dict[str, str] | None,
    rendezvous: Rendezvous | None,
    emulate_cuda: bool | EmulatedCuda = False,
    timeline: bool | str | Path = False,
    profile: bool = False,
) -> LaunchOptions:
    """The public functions' keywords as one checked LaunchOptions."""
    if env is not None and not isinstance(env, dict):
        raise RealConfigError(f"env must be a dict of str to str; got {type(env).__name__}")
    if emulate_cuda is True:
        emulation: EmulatedCuda | None = EmulatedCuda()
    elif emulate_cuda is False:
        emulation = None
    elif isinstance(emulate_cuda, EmulatedCuda):
        emulation = emulate_cuda
    else:
        raise RealConfigError(
            f"emulate_cuda must be True, False or a real.EmulatedCuda; got {emulate_cuda!r}"
        )
    return LaunchOptions(
        nproc,
        timeout,
        master_port,
        dict(env or {}),
        rendezvous or Rendezvous(),
        emulate_cuda=emulation,
        timeline=timeline_options(timeline, profile),
    )


def timeline_options(timeline: bool | str | Path, profile: bool) -> TimelineOptions | None:
    """``timeline=`` and ``profile=`` as TimelineOptions (directory "" for a temporary one); RealConfigError
    for anything else."""
    if not isinstance(profile, bool):
        raise RealConfigError(f"profile must be True or False; got {profile!r}")
    if timeline is False:
        if profile:
            raise RealConfigError(
                "profile=True writes each rank's profiler trace beside its timeline: pass timeline=DIR too"
            )
        return None
    if timeline is True:
        if profile:
            raise RealConfigError(
                "profile=True writes each rank's profiler trace into the timeline's directory, and timeline=True "
                "keeps none: pass timeline=DIR, a directory to write to"
            )
        return TimelineOptions("")
    if not isinstance(timeline, (str, Path)) or not str(timeline):
        raise RealConfigError(f"timeline must be True, False or a directory to write to; got {timeline!r}")
    path = Path(timeline).expanduser().resolve()
    if path.exists() and not path.is_dir():
        raise RealConfigError(
            f"timeline directory {str(timeline)!r} is a file; name a directory (created if missing)"
        )
    return TimelineOptions(str(path), profile)


def _checked_argv(argv: Sequence[str]) -> tuple[str, ...]:
    """``argv`` as a tuple of strings; RealConfigError for anything else (a lone string most of all)."""
    if isinstance(argv, (str, bytes)) or not all(isinstance(a, str) for a in argv):
        raise RealConfigError(f"argv must be a list of strings (the script's arguments); got {argv!r}")
    return tuple(argv)


def group_backend(target: Target, backend: str | None, options: LaunchOptions) -> str | None:
    """The backend of the group real creates around ``target``; None for a torchrun-style script (it creates
    its own)."""
    if isinstance(target, MainTarget):
        return None
    if options.emulate_cuda is not None:
        return emulated_backend(None if backend is DEFAULT_BACKEND else backend)
    return resolve_backend(backend, options.nproc)


def _script_backend(status: StatusDir, ranks: list[int]) -> str:
    """The backend the ranks of a torchrun-style script created their group with, ``"none"`` if none did."""
    found = sorted({backend for rank in ranks if (backend := status.group(rank)) is not None})
    return ", ".join(found) if found else NO_GROUP


def _port_taken(error: BaseException | None) -> bool:
    """Whether the launcher failed because the rendezvous port was in use."""
    return error is not None and not isinstance(error, ChildFailedError) and "EADDRINUSE" in str(error)


def _launch_config(options: LaunchOptions, endpoint: str, root: str, start_method: str) -> LaunchConfig:
    """The elastic launch of this node's ``nproc`` rank processes, started by ``start_method`` ("spawn" or
    "forkserver": real.warm), meeting the others at ``endpoint``."""
    console = options.console
    meeting = options.rendezvous.settings(endpoint, options.timeout)
    return LaunchConfig(
        nproc_per_node=options.nproc,
        role="default",  # torchrun's: rank processes see it as ROLE_NAME
        max_restarts=0,
        monitor_interval=0.05,
        start_method=start_method,
        # Elastic's per-run log and error files go under our temporary directory, removed afterwards; with a
        # prefix, each rank's output is written there and copied to this terminal line by line.
        logs_specs=DefaultLogsSpecs(
            log_dir=os.path.join(root, "elastic"),
            tee=Std.ALL if console.prefix else Std.NONE,
            local_ranks_filter=set(console.local_ranks) if console.local_ranks is not None else None,
        ),
        log_line_prefix_template=LINE_PREFIX if console.prefix else None,
        **{k: v for k, v in meeting.items() if k != "local_addr"},
        **_optional_config(
            # The address other nodes reach this one at (on one machine the loopback address, which skips a
            # host-name lookup that can be slow on machines without DNS).
            local_addr=meeting["local_addr"],
            # Seconds between SIGTERM and SIGKILL for the ranks still running after one failed.
            shutdown_timeout=5,
        ),
    )


def _optional_config(**settings: Any) -> dict[str, Any]:
    """The ``settings`` this torch's LaunchConfig has fields for: newer torch releases added some of them."""
    known = {f.name for f in dataclasses.fields(LaunchConfig)}
    return {name: value for name, value in settings.items() if name in known}


def _supervise(
    config: LaunchConfig, entry_args: tuple[Any, ...], timeout: float, status: StatusDir, watch: ExitWatch
) -> tuple[dict[int, Any] | None, BaseException | None, bool]:
    """Run the elastic agent on a thread; watch its processes end; kill them at ``timeout``.

    Returns (the ranks' return values, the agent's error, whether the run timed out).
    """
    outcome: dict[str, Any] = {}
    # An Event rather than Thread.join: after a KeyboardInterrupt, Thread.join can return at once on
    # Python < 3.13 even though the thread still runs.
    done = threading.Event()

    def agent() -> None:
        """The elastic agent's thread: launch, then hand the outcome over."""
        try:
            outcome["values"] = elastic_launch(config, rank_process.entry)(*entry_args)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread, which raises it
            outcome["error"] = exc
        finally:
            done.set()

    # The agent on a non-main thread installs no signal handlers, so the caller's Ctrl-C and SIGTERM
    # handling stays as it was; the rank processes are the only new children of this process.
    before = watch.before
    thread = threading.Thread(target=agent, name="real-elastic-agent", daemon=True)
    with _quiet_launcher_logs(), _env_restored("TORCHELASTIC_SIGNALS_TO_HANDLE"), warm.unloadable_main_hidden():
        thread.start()
        deadline = time.monotonic() + timeout
        try:
            while not (finished := done.is_set()) and (left := deadline - time.monotonic()) > 0:
                watch.wait(min(left, _WATCH_INTERVAL))
        except BaseException:  # e.g. KeyboardInterrupt: take the rank processes down before propagating
            _kill_rank_processes(before)
            done.wait(_AGENT_EXIT_WAIT)
            raise
        if not finished:
            _dump_stacks(before, status)
            _kill_rank_processes(before)
            done.wait(_AGENT_EXIT_WAIT)
    return outcome.get("values"), outcome.get("error"), not finished


def _rank_processes(
    before: set[multiprocessing.process.BaseProcess],
) -> list[multiprocessing.process.BaseProcess]:
    """Live child processes started since ``before`` was taken: this launch's rank processes."""
    return [p for p in multiprocessing.active_children() if p not in before]


def _dump_stacks(before: set[multiprocessing.process.BaseProcess], status: StatusDir) -> None:
    """Ask the still-running rank processes for their Python stacks and give them a moment to write them."""
    for process in _rank_processes(before):
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, rank_process.STACK_DUMP_SIGNAL)  # type: ignore[arg-type]
    running = [r for r in status.started_ranks() if not status.has(r, RETURNED)]
    deadline = time.monotonic() + _STACK_DUMP_WAIT
    while time.monotonic() < deadline and any(status.stack(r) is None for r in running):
        time.sleep(0.05)


def _kill_rank_processes(before: set[multiprocessing.process.BaseProcess]) -> None:
    """SIGKILL this launch's rank processes: one stuck in a collective ignores gentler requests."""
    for process in _rank_processes(before):
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)  # type: ignore[arg-type]


@contextlib.contextmanager
def _quiet_launcher_logs() -> Iterator[None]:
    """Mute the elastic launcher's logs (failures come back as RealRunError) unless LOGLEVEL asks for them."""
    if "LOGLEVEL" in os.environ:  # elastic's own switch for its log level: the user wants to see them
        yield
        return
    loggers = [
        logger
        for name, logger in logging.Logger.manager.loggerDict.items()
        if isinstance(logger, logging.Logger) and name.startswith(_LOGGER_PREFIXES)
    ]
    saved = [(logger, logger.level) for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in saved:
            logger.setLevel(level)


@contextlib.contextmanager
def _env_restored(name: str) -> Iterator[None]:
    """Restore environment variable ``name`` afterwards: the elastic launcher sets it process-wide."""
    saved = os.environ.get(name)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved
