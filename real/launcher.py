"""Run the same rank functions the simulator runs on real processes, through torch's elastic launcher."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import multiprocessing
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# Imported up front so every logger the launch uses already exists when `_quiet_launcher_logs` runs.
import torch.distributed.elastic.rendezvous.static_tcp_rendezvous  # noqa: F401
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from real import rank_process
from real.backend import resolve_backend
from real.errors import RealConfigError
from real.exits import ExitWatch
from real.report import failure_error
from real.status import RETURNED, STARTED, StatusDir
from real.target import CallableTarget, Job, ScriptTarget, dump_job, target_for
from simdist_base.host import available_memory
from simdist_base.script import load_entry

_HOST = "127.0.0.1"
# Environment variables the launcher sets per rank process; letting `env` override them would break the run.
_RESERVED_ENV = frozenset(
    {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"}
)
_LOGGER_PREFIXES = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
_STACK_DUMP_WAIT = 2.0  # seconds the still-running rank processes get to write their stacks at a timeout
_AGENT_EXIT_WAIT = 30.0  # seconds the agent gets to notice killed rank processes and return
_WATCH_INTERVAL = 0.02  # seconds between checks of the agent's thread while waiting for rank processes to end
_PORT_ATTEMPTS = 3  # launches tried with a fresh free port when the previous one was taken meanwhile
#: the longest ``timeout`` accepted, seconds (30 days): the elastic launcher and thread waits need a finite,
#: representable limit, and a run meant to be longer is not a test
MAX_TIMEOUT = 30 * 24 * 3600.0
#: resident memory of one rank process once torch and torch.distributed are imported (about 220 MB
#: measured), before the rank code allocates anything: ``nproc`` of them must fit in the memory available
PROCESS_MEMORY = 256 << 20


@dataclasses.dataclass(frozen=True)
class RealResult:
    """The outcome of a real run: each rank's return value and the wall time of the whole launch."""

    returns: list[Any]
    wall_time: float
    backend: str
    nproc: int


def run(
    fn: Callable[..., Any],
    nproc: int,
    backend: str | None = "gloo",
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    master_port: int | None = None,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
) -> RealResult:
    """Run ``fn(*args, **kwargs)`` as every rank of ``nproc`` real processes and collect the returns.

    Functions and classes reach the spawned processes by reference (module and qualified name), as
    ``torch.multiprocessing.spawn`` sends them: ``fn`` may be a top-level function of an importable
    module or of the script that calls ``run``, whose call then sits under
    ``if __name__ == "__main__":``. Each process loads that script under another module name
    (``__mp_main__``, or ``pkg.mod`` for ``python -m pkg.mod``), so the guarded block does not run
    there while the rest of its top level does, once per process. Functions and classes of the script
    passed inside ``args``/``kwargs`` travel the same way. Rejected before any process starts, with a
    RealConfigError that says what to do: lambdas, functions nested in other functions, anything
    defined inside the script's ``if __name__ == "__main__":`` block, functions of an interactive
    ``__main__`` with no file (``python -c``, the REPL, notebooks), and arguments that cannot be pickled.
    """
    return _launch(target_for(fn), nproc, backend, args, kwargs, master_port, timeout, env)


def run_script(
    path: str | Path,
    nproc: int,
    backend: str | None = "gloo",
    entry: str = "main",
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    master_port: int | None = None,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
) -> RealResult:
    """Run the entry function of the script at ``path`` as every rank of ``nproc`` real processes."""
    # Loaded once here so a missing file or entry fails before any process starts, not once per rank.
    load_entry(path, entry)
    target = ScriptTarget(str(Path(path).expanduser().resolve()), entry)
    return _launch(target, nproc, backend, args, kwargs, master_port, timeout, env)


def free_port(host: str = _HOST) -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _launch(
    target: CallableTarget | ScriptTarget,
    nproc: int,
    backend: str | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    master_port: int | None,
    timeout: float,
    env: dict[str, str] | None,
) -> RealResult:
    """Check everything, start the rank processes, wait for them (at most ``timeout``), collect or explain."""
    _check_arguments(nproc, timeout, master_port, env)
    resolved = resolve_backend(backend, nproc)
    blob, main = dump_job(Job(target, resolved, tuple(args), dict(kwargs or {}), dict(env or {})))
    with tempfile.TemporaryDirectory(prefix="real-run-") as root:
        status = StatusDir(root)
        # A port found free can be taken before the launcher binds it; then try another one.
        for _attempt in range(_PORT_ATTEMPTS if master_port is None else 1):
            config = _launch_config(nproc, master_port or free_port(), timeout, root)
            start = time.perf_counter()
            watch = ExitWatch(nproc)
            values, error, timed_out = _supervise(
                config, (list(sys.path), root, main, blob), timeout, status, watch
            )
            wall_time = time.perf_counter() - start
            if not _port_taken(error):
                break
        if error is not None or timed_out or values is None:
            failure = failure_error(status, nproc, resolved, error, timed_out, timeout, watch.exits())
            # Elastic's ChildFailedError is fully retold by the failure; any other error is the cause.
            raise failure from (None if isinstance(error, ChildFailedError) else error)
    return RealResult([values[rank] for rank in range(nproc)], wall_time, resolved, nproc)


@contextlib.contextmanager
def _unloadable_main_hidden() -> Iterator[None]:
    """Keep the spawn start method from re-running a ``__main__`` that has no source file (a program fed on stdin).

    A spawned process re-runs its parent's main script from ``__main__.__file__``; ``python - < prog.py`` leaves
    "<stdin>" there, which each rank process then fails to open before it reaches the rank code. Such a
    ``__main__`` holds nothing the ranks need (``dump_job`` refuses a rank function defined in it), so while
    the processes start it is left without a file name, as under ``python -c``.
    """
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or path is None or os.path.isfile(path):
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


def _port_taken(error: BaseException | None) -> bool:
    """Whether the launcher failed because the rendezvous port was in use."""
    return error is not None and not isinstance(error, ChildFailedError) and "EADDRINUSE" in str(error)


def _check_arguments(nproc: int, timeout: float, master_port: int | None, env: dict[str, str] | None) -> None:
    """Raise RealConfigError for arguments no launch could use."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise RealConfigError(f"nproc must be a positive int (processes to start); got {nproc!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_TIMEOUT:
        raise RealConfigError(
            f"timeout must be a positive number of seconds, at most {MAX_TIMEOUT:.0f} (30 days); got {timeout!r}"
        )
    available = available_memory()
    if available is not None and nproc * PROCESS_MEMORY > available:
        raise RealConfigError(
            f"nproc {nproc} would not fit: each rank process needs about {_mib(PROCESS_MEMORY)} once torch is "
            f"imported, {_mib(nproc * PROCESS_MEMORY)} in all, but only {_mib(available)} of memory is "
            f"available; start at most {available // PROCESS_MEMORY} processes"
        )
    if master_port is not None and not (isinstance(master_port, int) and 0 < master_port < 65536):
        raise RealConfigError(
            f"master_port must be a TCP port in 1..65535, or None to pick a free one; got {master_port!r}"
        )
    for key, value in (env or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise RealConfigError(f"env must map str to str; got {key!r}: {value!r}")
        if key in _RESERVED_ENV:
            raise RealConfigError(
                f"env may not set {key}: the launcher sets it for each rank process "
                f"(reserved: {', '.join(sorted(_RESERVED_ENV))})"
            )


def _mib(n_bytes: int) -> str:
    """A byte count in whole MiB (simdist's unit formatting lives with the simulator, which is not imported here)."""
    return f"{n_bytes >> 20} MiB"


def _launch_config(nproc: int, port: int, timeout: float, root: str) -> LaunchConfig:
    """A single-node elastic launch of ``nproc`` spawned rank processes, static rendezvous on localhost."""
    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"real-{uuid.uuid4().hex[:12]}",
        # Static rendezvous: one node needs no negotiation, and it starts measurably faster than c10d.
        rdzv_backend="static",
        rdzv_endpoint=f"{_HOST}:{port}",
        rdzv_configs={"rank": 0, "timeout": max(1, math.ceil(timeout))},
        max_restarts=0,
        monitor_interval=0.05,
        start_method="spawn",
        # Elastic's per-run log and error files go under our temporary directory, removed afterwards.
        logs_specs=DefaultLogsSpecs(log_dir=os.path.join(root, "elastic")),
        **_optional_config(
            # Skips a host-name lookup that can be slow on machines without DNS.
            local_addr=_HOST,
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
    with _quiet_launcher_logs(), _env_restored("TORCHELASTIC_SIGNALS_TO_HANDLE"), _unloadable_main_hidden():
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
            _dump_stacks(before, status, config.nproc_per_node)
            _kill_rank_processes(before)
            done.wait(_AGENT_EXIT_WAIT)
    return outcome.get("values"), outcome.get("error"), not finished


def _rank_processes(
    before: set[multiprocessing.process.BaseProcess],
) -> list[multiprocessing.process.BaseProcess]:
    """Live child processes started since ``before`` was taken: this launch's rank processes."""
    return [p for p in multiprocessing.active_children() if p not in before]


def _dump_stacks(before: set[multiprocessing.process.BaseProcess], status: StatusDir, nproc: int) -> None:
    """Ask the still-running rank processes for their Python stacks and give them a moment to write them."""
    for process in _rank_processes(before):
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, rank_process.STACK_DUMP_SIGNAL)  # type: ignore[arg-type]
    running = [r for r in range(nproc) if status.has(r, STARTED) and not status.has(r, RETURNED)]
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
