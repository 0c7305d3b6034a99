"""Errors the remote-tensor runtime raises on purpose; each is a :class:`~simdist.errors.SimdistError`."""

from __future__ import annotations

from simdist.errors import SimdistError


class RemoteError(SimdistError, RuntimeError):
    """The worker failed a command (e.g. ``Input tensor not found``); names the command and its number."""


class RuntimeConfigError(SimdistError, ValueError):
    """A runtime setting is invalid: a link spec, the hot-path detector's window or lengths, an empty path."""


class BufferPolicyError(SimdistError, ValueError):
    """A buffer policy is not registered, or answered what the worker cannot do."""
