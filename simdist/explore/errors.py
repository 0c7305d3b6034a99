"""What exploration raises, warns and reports."""

from __future__ import annotations

from simdist.errors import SimdistError


class ExplorationError(SimdistError, ValueError):
    """``simdist.explore`` was given something it cannot explore (a strategy, a bound, a program it cannot ship to
    a worker); the message names it and what is expected."""


class SearchSpaceError(SimdistError):
    """An exhaustive search met more orders than its bound allows; the message names the bound and what was seen."""


class ReplayTokenError(SimdistError, ValueError):
    """A replay token is not one ``simdist.explore`` wrote (not JSON, a field missing or of the wrong kind)."""


class ReplayWarning(UserWarning):
    """A replay token was recorded with other code, another simdist or torch version, or another cluster: the
    replayed run may take other paths. The message names what changed."""


class CheckFailed(SimdistError):
    """An exploration's ``check(result)`` returned False for a run."""


class NondeterminismError(SimdistError):
    """A run replayed from its own token gave another trace: simdist (or the program, through state it keeps
    between runs) is not deterministic. Carries every run's trace hash."""

    def __init__(self, message: str, hashes: list[str]) -> None:
        super().__init__(message)
        self.message = message
        self.hashes = hashes

    def __reduce__(self) -> tuple:
        return (type(self), (self.message, self.hashes))


class RemoteError(SimdistError):
    """A run's error as a worker process reported it, when the exception itself could not be sent back."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message

    def __reduce__(self) -> tuple:
        return (type(self), (self.kind, self.message))
