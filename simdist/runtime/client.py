"""The client of the remote-tensor runtime: an autograd executor whose arrays are ids on a worker.

Every array computation the autograd engine asks for, forward or backward, becomes an ``Op`` command; results
are handles (ids the client allocates at once, so later ops can name them before the worker has run anything).
Reading values (``.numpy()``, ``.item()``) sends a ``Fetch`` and waits for the answer; a handle that dies sends
a ``Free``. How commands travel is the transport's business: ``send`` (fire and forget) and ``request``
(send, then wait for the response) are given by the simulated link or by the real channel.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from simdist.autograd.executor import Executor, TensorMeta
from simdist.autograd.grad_mode import in_backward
from simdist.runtime.commands import Command, Failure, Fetch, Free, Op, Put, Response, Value
from simdist.runtime.errors import RemoteError


class RemoteArray:
    """A handle: the id of a tensor in the worker's store."""

    __slots__ = ("__weakref__", "tid")

    def __init__(self, tid: int) -> None:
        self.tid = tid

    def __repr__(self) -> str:
        return f"RemoteArray(t{self.tid})"


class Client(Executor):
    """Turns the autograd engine's array commands into runtime commands."""

    def __init__(self, send: Callable[[Command], None], request: Callable[[Command], Response]) -> None:
        self._send = send
        self._request = request
        self._tids = itertools.count()
        self._seqs = itertools.count()
        self.closed = False
        #: commands sent, by kind
        self.sent: dict[str, int] = {"op": 0, "put": 0, "fetch": 0, "free": 0}

    def _handle(self) -> RemoteArray:
        handle = RemoteArray(next(self._tids))
        weakref.finalize(handle, self._free, handle.tid)
        return handle

    def _free(self, tid: int) -> None:
        if not self.closed:
            self.sent["free"] += 1
            self._send(Free(next(self._seqs), tid))

    # ---------------------------------------------------------------- Executor
    def execute(
        self, op: str, inputs: tuple[Any, ...], attrs: Mapping[str, Any], outputs: tuple[TensorMeta, ...]
    ) -> tuple[RemoteArray, ...]:
        """Send ``op`` as a command; return handles for its results at once."""
        handles = tuple(self._handle() for _ in outputs)
        cmd = Op(
            next(self._seqs),
            op,
            tuple(h.tid for h in inputs),
            tuple(h.tid for h in handles),
            tuple(outputs),
            tuple(sorted(attrs.items())),
            "backward" if in_backward() else "forward",
        )
        self.sent["op"] += 1
        self._send(cmd)
        return handles

    def upload(self, value: np.ndarray) -> RemoteArray:
        """Send a copy of ``value``; return its handle."""
        handle = self._handle()
        self.sent["put"] += 1
        self._send(Put(next(self._seqs), handle.tid, np.array(value, copy=True)))
        return handle

    def download(self, array: RemoteArray, meta: TensorMeta) -> np.ndarray:
        """Fetch the values behind ``array`` (waits for the worker); raise :class:`RemoteError` if it failed."""
        self.sent["fetch"] += 1
        response = self._request(Fetch(next(self._seqs), array.tid))
        if isinstance(response, Failure):
            raise RemoteError(f"{response.message} (in {response.command})")
        assert isinstance(response, Value)
        return response.value

    def close(self) -> None:
        """Stop sending frees (the session is over; the worker goes with it)."""
        self.closed = True
