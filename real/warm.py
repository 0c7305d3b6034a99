"""Rank processes forked from a warm server that imported torch once, instead of each importing it again.

A spawned rank process starts a fresh interpreter and imports torch, torch.distributed and real: about two
seconds of CPU per process, which is most of what a short launch costs. Where the platform offers it, real
starts its rank processes the way ``torchrun --start-method forkserver`` does: Python's fork server (one per
process that launches) imports those modules once, and every rank process of every later launch is a fork of
it. What a rank process sees is what a spawned one sees:

- a fork of the server's pristine state, never of a rank that ran before (nothing of one launch reaches the
  next; the server itself runs no rank code), with torch's, NumPy's and Python's global random generators
  seeded afresh from the system's entropy, as a new interpreter seeds them;
- the launching process's environment as it is when the process starts (a fork server's children would
  otherwise inherit the server's); and the server is used only while the launcher's environment is the one
  it was started with, since torch and the libraries under it read some variables when imported
  (``OMP_NUM_THREADS`` among them): after a change the next launch starts a new server;
- the launching process's current standard output and error (not the descriptors the server was started
  with), its ``sys.path`` and working directory, and its ``__main__`` loaded under ``__mp_main__``.

One difference remains: Python's string hashing is seeded once per interpreter (``PYTHONHASHSEED``), so rank
processes forked from one server iterate sets of strings in the same order, where spawned ones may not.
``SIMDIST_REAL_START_METHOD=spawn`` starts every rank process as a fresh interpreter instead, as before.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import sys
import threading
from collections.abc import Iterator
from multiprocessing import reduction
from typing import Any

import numpy
import torch

from real.errors import RealConfigError

#: the environment variable that picks how rank processes start
START_METHOD_VARIABLE = "SIMDIST_REAL_START_METHOD"
START_METHODS = ("forkserver", "spawn")
#: what the server imports before forking: everything a rank process imports on its way to the rank code;
#: DTensor, which torch imports at the first backward through a tensor subclass (emulated CUDA tensors); and
#: TorchDynamo, which torch imports at the first call of a function it keeps from being compiled (every
#: optimizer's constructor and step, DistributedDataParallel's): a second of CPU in each rank process otherwise
PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo", "real.rank_process")
#: imported too where the launching process has imported simdist (so its environment has what simdist needs;
#: the launcher itself never imports the simulator): the runtime's worker, and with it the simdist modules
#: that rank code of simdist's users often imports
PRELOAD_WITH_SIMDIST = ("real.runtime",)
#: variables a server serves whatever their value: nothing it imports reads them, and they change while the
#: launching process runs (pytest names the current test in PYTEST_CURRENT_TEST before each test: a server
#: restarted for each would cost every test that launches a torch import). Rank processes still see the
#: launcher's values at their start.
IGNORED_VARIABLES = (START_METHOD_VARIABLE, "PYTEST_CURRENT_TEST")

_lock = threading.Lock()
#: the server this module started: its pid and the environment it was started with
_server: tuple[int, dict[str, str]] | None = None
#: launches now forking from the server (it is never replaced under them)
_in_use = 0


@contextlib.contextmanager
def unloadable_main_hidden() -> Iterator[None]:
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


def requested_method() -> str:
    """The start method the environment asks for (default: forkserver), checked."""
    method = os.environ.get(START_METHOD_VARIABLE, "forkserver")
    if method not in START_METHODS:
        raise RealConfigError(
            f"{START_METHOD_VARIABLE}={method!r} is not a start method real knows: use one of {', '.join(START_METHODS)}"
        )
    return method


@contextlib.contextmanager
def start_method() -> Iterator[str]:
    """The start method for one launch, held for the launch's duration: "forkserver" while a server this
    module started serves this environment, else "spawn" (asked for, not offered by the platform, a fork
    server of someone else's already running, or the environment changed while another launch uses ours)."""
    global _in_use
    if requested_method() != "forkserver" or "forkserver" not in multiprocessing.get_all_start_methods():
        yield "spawn"
        return
    with _lock:
        usable = _ensure_server()
        if usable:
            _in_use += 1
    if not usable:
        yield "spawn"
        return
    try:
        yield "forkserver"
    finally:
        with _lock:
            _in_use -= 1


def _ensure_server() -> bool:
    """Start (or restart) the fork server for the current environment; whether it can serve this launch."""
    global _server
    server = multiprocessing.forkserver._forkserver
    running = server._forkserver_pid
    if running is not None and (_server is None or _server[0] != running):
        return False  # a fork server this module did not start: its modules and environment are unknown
    if running is not None and _server is not None and not _alive(running):
        running, _server = None, None  # it died; multiprocessing starts another on demand
    if running is not None and _server is not None and _server[1] != _environment():
        if _in_use:
            return False
        server._stop()
        running, _server = None, None
    if running is None:
        saved = server._preload_modules
        with_simdist = PRELOAD_WITH_SIMDIST if "simdist" in sys.modules else ()
        server.set_forkserver_preload([*PRELOAD, *with_simdist])
        try:
            server.ensure_running()
        finally:
            server._preload_modules = saved
        assert server._forkserver_pid is not None
        _server = (server._forkserver_pid, _environment())
    return True


def _environment() -> dict[str, str]:
    """The environment a server serves: the process's, less the variables no import reads (IGNORED_VARIABLES)."""
    return {k: v for k, v in os.environ.items() if k not in IGNORED_VARIABLES}


def _alive(pid: int) -> bool:
    """Whether the child process ``pid`` still runs (reaping it if it ended)."""
    try:
        ended, _status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return False
    return ended == 0


class Inherited:
    """What a spawned process inherits from the launcher when it starts, handed to a fork server's child.

    Pickled with the rank process's arguments at the moment multiprocessing starts it, as spawn would copy
    it: the launcher's environment then (the elastic agent sets variables in it during the launch), and,
    with ``stdio``, its standard output and error, passed along as descriptors. Unpickling in the rank
    process puts them in place (the environment replaced, the descriptors made its 1 and 2) before elastic
    adds the rank's own variables. ``stdio`` is False where elastic redirects the rank's output to files.
    """

    def __init__(self, stdio: bool) -> None:
        self.stdio = stdio

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        if multiprocessing.context.get_spawning_popen() is None:
            return (_nothing, ())  # pickled outside a process start: nothing to hand over
        fds = (reduction.DupFd(1), reduction.DupFd(2)) if self.stdio else ()
        return (_attach, (dict(os.environ), *fds))


def _nothing() -> None:
    return None


def _attach(environ: dict[str, str], *stdio: Any) -> None:
    """In the rank process: take the launcher's environment, and its stdout and stderr as descriptors 1 and 2;
    seed torch's and NumPy's global generators afresh, as each seeds itself from the system's entropy when a
    new interpreter imports it (Python reseeds ``random`` in a forked child itself)."""
    os.environ.clear()
    os.environ.update(environ)
    torch.seed()
    numpy.random.seed()
    for dup, target in zip(stdio, (1, 2)):
        fd = dup.detach()
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)
