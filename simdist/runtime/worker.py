"""The worker of the remote-tensor runtime: a tensor store and eager execution of the client's commands.

The worker runs commands in arrival order. An op whose input is not in the store fails with ``Input tensor
not found``; the first failure is kept and becomes the answer to the client's next fetch (the client cannot
learn earlier: ops are fire-and-forget). Transports (simulated in :mod:`simdist.runtime.simulated`, real in
``real.runtime``) deliver commands to :meth:`Worker.run` and carry its responses back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from simdist.autograd.numpy_executor import NumpyExecutor
from simdist.runtime.commands import Command, Failure, Fetch, Free, Op, Put, Response, Value
from simdist.runtime.steps import Sleep

#: simulated seconds the worker spends per eager op (dispatch and a small kernel) and per element it touches
EAGER_OP_SECONDS = 5e-6
SECONDS_PER_ELEMENT = 1e-9


@dataclass
class WorkerStats:
    """What the worker did: ops in total, compiled and eager, fallbacks and failures by cause."""

    ops_total: int = 0
    ops_compiled: int = 0
    ops_eager: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)

    def compiled_fraction(self) -> float:
        """Share of ops that ran inside a compiled batch."""
        return self.ops_compiled / self.ops_total if self.ops_total else 0.0


class Worker:
    """Stores tensors by id and runs ops on them eagerly."""

    def __init__(self) -> None:
        self.store: dict[int, np.ndarray] = {}
        self.stats = WorkerStats()
        self.failure: Failure | None = None
        self._numpy = NumpyExecutor()

    def seconds(self, cmd: Command) -> float:
        """Simulated time ``cmd`` takes on the worker when run eagerly."""
        if isinstance(cmd, Op):
            return EAGER_OP_SECONDS + SECONDS_PER_ELEMENT * sum(int(np.prod(m.shape)) for m in cmd.metas)
        return 0.0

    def attach(self, driver: Any) -> None:
        """The eager worker needs nothing from its driver (see :mod:`simdist.runtime.steps`)."""

    def process(self, cmd: Command, reply: Callable[[Response], None]) -> Iterator[Any]:
        """Handle one arriving command: spend its time (a step for the driver), then run it."""
        seconds = self.seconds(cmd)
        if seconds:
            yield Sleep(seconds)
        response = self.run(cmd)
        if response is not None:
            reply(response)

    def run(self, cmd: Command) -> Response | None:
        """Run one command; return the response a Fetch gets (None for the others)."""
        if isinstance(cmd, Op):
            self.run_eager(cmd)
            return None
        if isinstance(cmd, Put):
            self.store[cmd.tid] = cmd.value
            return None
        if isinstance(cmd, Free):
            self.store.pop(cmd.tid, None)
            return None
        assert isinstance(cmd, Fetch)
        if self.failure is not None:  # the answer to this fetch is the first failure
            return Failure(cmd.seq, self.failure.message, self.failure.command)
        value = self.store.get(cmd.tid)
        if value is None:
            return self._fail(cmd.seq, "fetch", f"Input tensor not found: t{cmd.tid}", cmd.describe())
        return Value(cmd.seq, value.copy())

    def run_eager(self, cmd: Op) -> bool:
        """Run ``cmd`` on the store now; False (and a recorded failure) if an input is missing."""
        missing = self.missing_inputs(cmd)
        if missing:
            self._fail(cmd.seq, "input not found", f"Input tensor not found: t{missing[0]}", cmd.describe())
            return False
        results = self._numpy.execute(cmd.op, tuple(self.store[t] for t in cmd.inputs), dict(cmd.attrs), cmd.metas)
        for tid, value in zip(cmd.outputs, results):
            self.store[tid] = value
        self.stats.ops_total += 1
        self.stats.ops_eager += 1
        return True

    def missing_inputs(self, cmd: Op) -> list[int]:
        """The inputs of ``cmd`` the store does not hold."""
        return [t for t in cmd.inputs if t not in self.store]

    def _fail(self, seq: int, cause: str, message: str, command: str) -> Failure:
        self.stats.failures[cause] = self.stats.failures.get(cause, 0) + 1
        failure = Failure(seq, message, command)
        if self.failure is None:
            self.failure = failure
        return failure
