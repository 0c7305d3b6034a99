"""The remote-tensor runtime over a real channel: the same client and worker code, the worker in its own process.

``run_remote(fn, *args)`` starts a worker process, connects to it over a loopback socket
(``multiprocessing.connection``, authenticated with a random key) and runs ``fn(*args)`` as the client, with
``simdist.autograd`` tensors living on the worker, as ``simdist.runtime.simulate`` does in simulated time.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Client as Connect
from multiprocessing.connection import Connection, Listener
from typing import Any

from simdist.autograd.executor import use_executor
from simdist.runtime.client import Client
from simdist.runtime.commands import Command, Response
from simdist.runtime.worker import Worker, WorkerStats

_HOST = "127.0.0.1"
_CLOSE = "close"


@dataclass
class RealRuntimeResult:
    """What a session against a real worker process produced."""

    value: Any
    wall_seconds: float
    stats: WorkerStats
    sent: dict[str, int]


def _serve(port_queue: Any, authkey: bytes) -> None:
    """The worker process: accept one client, run its commands in order, answer fetches, report stats at close."""
    with Listener((_HOST, 0), authkey=authkey) as listener:
        port_queue.put(listener.address[1])
        with listener.accept() as conn:
            worker = Worker()
            while True:
                cmd = conn.recv()
                if cmd == _CLOSE:
                    conn.send(worker.stats)
                    return
                response = worker.run(cmd)
                if response is not None:
                    conn.send(response)


def run_remote(fn: Any, *args: Any, timeout: float = 60.0) -> RealRuntimeResult:
    """Run ``fn(*args)`` as the client of a worker in a fresh process on this machine."""
    ctx = multiprocessing.get_context("spawn")
    ports = ctx.Queue()
    authkey = os.urandom(16)
    proc = ctx.Process(target=_serve, args=(ports, authkey), daemon=True)
    proc.start()
    try:
        port = ports.get(timeout=timeout)
        with Connect((_HOST, port), authkey=authkey) as conn:
            channel = _Channel(conn, timeout)
            client = Client(channel.send, channel.request)
            start = time.perf_counter()
            try:
                with use_executor(client):
                    value = fn(*args)
            finally:
                client.close()
            wall = time.perf_counter() - start
            stats = channel.close()
        proc.join(timeout)
        return RealRuntimeResult(value, wall, stats, dict(client.sent))
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

    def close(self) -> WorkerStats:
        self.send(_CLOSE)
        return self._receive(_CLOSE)

    def _receive(self, what: Any) -> Any:
        if not self.conn.poll(self.timeout):
            raise TimeoutError(f"the worker process did not answer {what} within {self.timeout:g} s")
        return self.conn.recv()
