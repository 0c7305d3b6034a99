"""Errors raised by simdist. Each names the ranks, operations and call sites involved."""

from __future__ import annotations

import torch.distributed as dist


class SimdistError(Exception):
    """Base class of every error simdist raises on purpose."""


class ClusterSpecError(SimdistError, ValueError):
    """A cluster description is invalid (bad unit, negative bandwidth, disconnected graph, unknown preset)."""


class RankError(SimdistError):
    """A rank's function raised; the original exception is ``__cause__`` and the text has its traceback."""

    def __init__(self, rank: int, exc: BaseException, traceback_text: str, others: list[int] | None = None):
        self.rank = rank
        self.exc = exc
        self.traceback_text = traceback_text
        extra = f" (ranks {others} also raised)" if others else ""
        super().__init__(
            f"rank {rank} raised {type(exc).__name__}: {exc}{extra}\n"
            f"--- traceback of rank {rank} ---\n{traceback_text}"
        )


class InvalidArgumentError(SimdistError, RuntimeError, ValueError):
    """A collective or point-to-point call has an argument the backend rejects (a root or peer outside the
    group, a reduce op the dtype does not support, a wrong list length or tensor size).

    Also a ``RuntimeError``, what ProcessGroupGloo raises for these, and a ``ValueError``, what simdist
    raised for some of them before.
    """


class CollectiveMismatchError(SimdistError):
    """Ranks of one group issued different collectives (op, shape, dtype or order) at the same position."""


class DeadlockError(SimdistError):
    """Every unfinished rank is blocked and nothing is scheduled: the program can never make progress."""


class SimTimeoutError(SimdistError, dist.DistBackendError):
    """A collective or point-to-point operation did not complete within its timeout (simulated seconds).

    Also a ``torch.distributed.DistBackendError``, which is what a real backend raises on a timeout.
    """


class RaceError(SimdistError):
    """Rank code or a second operation touched a buffer that an operation still in flight owns."""


class RaceWarning(UserWarning):
    """The warning-mode form of :class:`RaceError` (``simdist.run(..., races="warn")``)."""
