"""The remote-tensor runtime over a real channel: the same client and worker code, the worker in its own process.

``run_remote(fn, *args)`` starts a worker process, connects to it over a loopback socket
(``multiprocessing.connection``, authenticated with a random key) and runs ``fn(*args)`` as the client, with
``simdist.autograd`` tensors living on the worker, as ``simdist.runtime.simulate`` does in simulated time.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Client as Connect
from multiprocessing.connection import Connection, Listener
from typing import Any

from real import warm
from real.errors import RealError
from simdist.autograd.executor import use_executor
from simdist.errors import SimdistError
from simdist.runtime.buffering import BufferingWorker
from simdist.runtime.client import Client
from simdist.runtime.commands import Command, Response
from simdist.runtime.policies import BufferPolicy
from simdist.runtime.steps import ThreadDriver
from simdist.runtime.worker import Worker, WorkerStats

_HOST = "127.0.0.1"
_CLOSE = "close"


class RemoteTimeoutError(RealError, SimdistError, TimeoutError):
    """The runtime's worker process did not start or did not answer within the session's timeout."""


@dataclass
class RealRuntimeResult:
    """What a session against a real worker process produced."""

    value: Any
    wall_seconds: float
    stats: WorkerStats
    sent: dict[str, int]
    #: the kind ("A", "B", "C", "other") of every failure the worker saw, in order
    failure_kinds: list[str]


def _serve(
    port_queue: Any, authkey: bytes, policy: str | BufferPolicy | None, inherited: None = None
) -> None:
    """The worker process: accept one client, run its commands in order, answer fetches, report at close.

    ``inherited`` is what is left of a :class:`real.warm.Inherited` once unpickling has put this process's
    environment and output in place.

    With a buffer ``policy`` the worker is a :class:`BufferingWorker` whose compile stream runs on its own
    thread (``ThreadDriver``); the main thread holds the driver's lock except while it waits for a command.
    """
    with Listener((_HOST, 0), authkey=authkey) as listener:
        port_queue.put(listener.address[1])
        with listener.accept() as conn:
            worker = BufferingWorker(policy) if policy else Worker()
            driver = ThreadDriver()
            with driver.lock:
                worker.attach(driver)
                while True:
                    driver.lock.release()
                    try:
                        cmd = conn.recv()
                    finally:
                        driver.lock.acquire()
                    if cmd == _CLOSE:
                        kinds = [k for k, _, _ in getattr(worker, "failures_by_kind", [])]
                        conn.send((worker.stats, kinds))
                        return
                    driver.run(worker.process(cmd, conn.send))


def run_remote(
    fn: Any, *args: Any, policy: str | BufferPolicy | None = None, timeout: float = 60.0
) -> RealRuntimeResult:
    """Run ``fn(*args)`` as the client of a worker in a fresh process on this machine.

    ``policy`` (a ``simdist.runtime.BufferPolicy`` or the name of one in ``simdist.runtime.POLICIES``) makes
    the worker buffer hot paths with that policy, its compile stream on a thread of its own; None runs every
    op eagerly. A worker failure is raised in the client as ``RemoteError`` at its next fetch.
    """
    # the worker process starts as real's rank processes do: forked from the warm fork server where there is
    # one for this environment (real.warm), held for the session, whose exit status the server reports
    with warm.start_method() as method, warm.unloadable_main_hidden():
        return _session(multiprocessing.get_context(method), fn, args, policy, timeout)


def _session(
    ctx: Any, fn: Any, args: tuple[Any, ...], policy: str | BufferPolicy | None, timeout: float
) -> RealRuntimeResult:
    """One session of ``run_remote`` against a worker process started by the context ``ctx``."""
    ports = ctx.Queue()
    authkey = os.urandom(16)
    inherited = warm.Inherited(stdio=True) if ctx.get_start_method() == "forkserver" else None
    proc = ctx.Process(target=_serve, args=(ports, authkey, policy, inherited), daemon=True)
    proc.start()
    try:
        try:
            port = ports.get(timeout=timeout)
        except queue.Empty:
            raise RemoteTimeoutError(
                f"the worker process did not start listening within {timeout:g} s (exit code "
                f"{proc.exitcode}); see its output above, or raise run_remote(timeout=...) on a slow machine"
            ) from None
        with Connect((_HOST, port), authkey=authkey) as conn:
            channel = _Channel(conn, timeout)
            client = Client(channel.send, channel.request)
            start = time.perf_counter()
            try:
                with use_executor(client):
                    value = fn(*args)
            except Exception as e:
                client.close()
                # what the worker saw (e.g. which race), for the caller of a failed session
                e.worker_stats, e.failure_kinds = channel.close()  # type: ignore[attr-defined]
                raise
            client.close()
            wall = time.perf_counter() - start
            stats, kinds = channel.close()
        proc.join(timeout)
        return RealRuntimeResult(value, wall, stats, dict(client.sent), kinds)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()


class _Channel:
    """Commands out, responses in, over one connection; sends may come from finalizers in other threads."""

    def __init__(self, conn: Connection, timeout: float) -> None:
        self.conn = conn
        self.timeout = timeout
        self._lock = threading.Lock()

    def send(self, cmd: Command | str) -> None:
        with self._lock:
            self.conn.send(cmd)

    def request(self, cmd: Command) -> Response:
        self.send(cmd)
        return self._receive(cmd)

    def close(self) -> tuple[WorkerStats, list[str]]:
        self.send(_CLOSE)
        return self._receive(_CLOSE)

    def _receive(self, what: Any) -> Any:
        if not self.conn.poll(self.timeout):
            raise RemoteTimeoutError(
                f"the worker process did not answer {what} within {self.timeout:g} s; it may have died "
                "(see its output) or be slower than that: raise run_remote(timeout=...)"
            )
        return self.conn.recv()
