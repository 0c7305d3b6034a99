"""Errors raised by the real launcher, part of simdist's error hierarchy (whose root needs no simulator)."""

from __future__ import annotations

from simdist_base.errors import SimdistError


class RealError(SimdistError):
    """Base class of every error the real launcher raises on purpose (a SimdistError)."""


class RealConfigError(RealError, ValueError):
    """A run cannot start: bad arguments, an unavailable backend, a function or argument it cannot send."""


class RealRunError(RealError, RuntimeError):
    """Worker processes failed or timed out; names the ranks and carries their tracebacks."""

    def __init__(
        self,
        message: str,
        *,
        failures: dict[int, str] | None = None,
        first_rank: int | None = None,
        timed_out: bool = False,
        stacks: dict[int, str] | None = None,
    ) -> None:
        super().__init__(message)
        # rank -> traceback text (or a description such as "killed by signal SIGSEGV")
        self.failures: dict[int, str] = dict(failures or {})
        # the rank that failed first: the likely root cause when several ranks fail
        self.first_rank = first_rank
        self.timed_out = timed_out
        # rank -> Python stacks of a rank that was still running when the timeout hit
        self.stacks: dict[int, str] = dict(stacks or {})


class RealGroupError(RealError, ValueError):
    """Rank code's ``init_process_group`` asks for another group than the one real created for its entry function."""
