"""``dist.Work`` handles whose ``wait()`` blocks in simulated time."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import simpy
import torch
import torch.distributed as dist
from torch.futures import Future


class SimTimeoutError(dist.DistBackendError):
    """A collective or point-to-point operation did not complete within its timeout (simulated seconds)."""


class SimWork(dist.Work):
    """The handle of one rank's part of a collective or point-to-point operation.

    Completes at the simulated time that rank's part finishes; ``get_future()`` then holds the output
    tensors (what DDP's communication hooks read).
    """

    def __init__(self, sim: Any, description: str, outputs: list[torch.Tensor], timeout: float | None) -> None:
        super().__init__()
        self.sim = sim
        self.description = description
        self.outputs = outputs
        self.timeout = timeout
        self.event: simpy.Event = sim.env.event()
        self.future: Future = Future()
        self.source_rank = -1
        self.error: BaseException | None = None
        self.issued_at = sim.env.now
        self.completed_at: float | None = None

    # ---------------------------------------------------------------- completion (simpy thread)
    def complete(self) -> None:
        """Mark done at the current simulated time and fulfil the future."""
        if self.event.triggered:
            return
        self.completed_at = self.sim.env.now
        self.event.succeed()
        self.future.set_result(self.outputs)

    # ---------------------------------------------------------------- torch API (rank threads)
    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Block the calling rank until done; raises :class:`SimTimeoutError` after ``timeout``."""
        self.sim.settle()
        if self.event.processed:
            return True
        limit = self.timeout
        if timeout is not None:
            limit = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
            if limit <= 0:  # torch treats a zero/negative timedelta as "no timeout"
                limit = self.timeout
        env = self.sim.env
        if limit is None:
            self.sim.baton.block(self.event, self.description)
            return True
        deadline = env.timeout(limit)
        self.sim.baton.block(env.any_of([self.event, deadline]), self.description)
        if not self.event.triggered:
            raise SimTimeoutError(
                f"Timed out after {limit:g} s of simulated time: {self.description}. "
                + self.sim.who_is_missing(self)
            )
        return True

    def is_completed(self) -> bool:
        """Whether the operation has finished at the calling rank's current simulated time."""
        self.sim.settle()
        return self.event.processed

    def is_success(self) -> bool:
        """Whether it finished without error."""
        return self.event.processed

    def exception(self) -> BaseException | None:
        """The error it failed with, if any."""
        return self.error

    def result(self) -> list[torch.Tensor]:
        """The output tensors."""
        return self.outputs

    def get_future(self) -> Future:
        """A ``torch.futures.Future`` completed with the output tensors."""
        return self.future

    def synchronize(self) -> None:
        """No device streams to synchronise with on CPU."""

    def _source_rank(self) -> int:
        return self.source_rank

    def source_rank_(self) -> int:
        """Rank a ``recv`` from any source got its message from."""
        return self.source_rank
