"""Buffer policies: what a buffering worker does with commands that touch tensors a batch has not stored yet.

A :class:`~simdist.runtime.buffering.BufferingWorker` holds the mechanism (buffers, the compile stream,
waits); the policy answers four questions the worker asks, and nothing else:

- ``buffers(phase)``: may ops of this phase be buffered at all?
- ``drains_on_entering(phase)``: when the client switches to this phase, does the worker first wait for every
  buffered batch to run?
- ``place_op(cmd, ...)``: where and when does an op that is not buffered run (an :class:`OpPlacement`)?
- ``place_free(...)``: when does a free of a tensor take effect (a :class:`FreePlacement`)?

:data:`POLICIES` registers them by name. ``"fallback"`` is the behaviour with no coordination, which loses
tensors in three races (see :mod:`simdist.runtime.buffering`); the other four are the race's fixes 1 to 4,
each closing all three: flush on backward entry, cross-buffer dependency tracking, separate forward and
backward work, and eager execution only for ops independent of pending tensors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import Enum
from typing import ClassVar

from simdist.runtime.commands import Op
from simdist.runtime.errors import BufferPolicyError


class OpPlacement(Enum):
    """Where an op that is not buffered runs."""

    EAGER = "eagerly at arrival"
    AFTER_INPUTS = "eagerly, once the batches that produce its inputs have stored them"
    AFTER_DRAIN = "eagerly, once every buffered batch has run"
    JOIN_FILLING = "appended to the buffer that is filling, after the inputs it reads there"
    ON_STREAM = "on the compile stream, behind every batch queued before it"


class FreePlacement(Enum):
    """When a free of a tensor takes effect."""

    NOW = "at arrival"
    AFTER_READERS = "once every batch that looks the tensor up when it runs has run (at once if none)"
    AFTER_DRAIN = "once every buffered batch has run"
    ON_STREAM = "on the compile stream, behind every batch queued before it"


class BufferPolicy(ABC):
    """What a buffering worker does with commands that touch pending tensors; subclasses answer its questions.

    A policy is stateless: one object may serve any number of workers.
    """

    #: the registry key (:data:`POLICIES`) and the name the scenario and the report print
    name: ClassVar[str] = ""
    #: one line: what the policy does
    description: ClassVar[str] = ""

    def buffers(self, phase: str) -> bool:
        """Whether ops of ``phase`` ("forward" or "backward") may be buffered."""
        return True

    def drains_on_entering(self, phase: str) -> bool:
        """Whether the worker waits for every buffered batch when the client enters ``phase``."""
        return False

    @abstractmethod
    def place_op(self, cmd: Op, *, reads_pending: bool, reads_filling: bool) -> OpPlacement:
        """Where ``cmd``, not buffered, runs; ``reads_pending``: an input is still to be stored by a batch;
        ``reads_filling``: one is to be stored by the batch of ``cmd``'s phase that is still filling."""

    @abstractmethod
    def place_free(self, *, read_by_pending: bool, phase: str) -> FreePlacement:
        """When a free takes effect; ``read_by_pending``: a batch not yet run looks the tensor up when it
        runs; ``phase``: the phase of the last op that arrived."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class FallBackToEager(BufferPolicy):
    """No coordination: eager ops and frees act at arrival; a batch whose inputs are missing when it runs
    falls back to running its ops one by one (and fails on the missing one)."""

    name = "fallback"
    description = "eager ops and frees act at arrival; a batch whose inputs are missing falls back to eager"

    def place_op(self, cmd: Op, *, reads_pending: bool, reads_filling: bool) -> OpPlacement:
        """Eagerly at arrival, whatever it reads."""
        return OpPlacement.EAGER

    def place_free(self, *, read_by_pending: bool, phase: str) -> FreePlacement:
        """At arrival, whoever reads it."""
        return FreePlacement.NOW


class FlushOnBackward(BufferPolicy):
    """Flush on backward entry: every buffer drains when backward starts, and backward is never buffered, so
    forward tensors exist before anything reads them (fix 1; backward loses its compilation)."""

    name = "flush_on_backward"
    description = "drain every buffer when backward starts; backward runs eagerly"

    def buffers(self, phase: str) -> bool:
        """Forward only."""
        return phase != "backward"

    def drains_on_entering(self, phase: str) -> bool:
        """When backward starts."""
        return phase == "backward"

    def place_op(self, cmd: Op, *, reads_pending: bool, reads_filling: bool) -> OpPlacement:
        """After a drain if it reads a pending tensor, else at arrival."""
        return OpPlacement.AFTER_DRAIN if reads_pending else OpPlacement.EAGER

    def place_free(self, *, read_by_pending: bool, phase: str) -> FreePlacement:
        """After a drain if a pending batch still reads it, else at arrival."""
        return FreePlacement.AFTER_DRAIN if read_by_pending else FreePlacement.NOW


class TrackDependencies(BufferPolicy):
    """Cross-buffer dependency tracking: an op waits for the batches that produce its inputs, and a free waits
    for the batches that still read the tensor (fix 2)."""

    name = "track_dependencies"
    description = "a command touching a pending tensor waits for its batch; frees of inputs wait"

    def place_op(self, cmd: Op, *, reads_pending: bool, reads_filling: bool) -> OpPlacement:
        """After its producing batches if it reads a pending tensor, else at arrival."""
        return OpPlacement.AFTER_INPUTS if reads_pending else OpPlacement.EAGER

    def place_free(self, *, read_by_pending: bool, phase: str) -> FreePlacement:
        """After its readers if a pending batch still reads it, else at arrival."""
        return FreePlacement.AFTER_READERS if read_by_pending else FreePlacement.NOW


class SeparateBuffers(BufferPolicy):
    """Separate forward and backward work: backward ops (and ops reading pending tensors) and backward frees
    queue on the compile stream behind the forward batches, so they see every forward tensor stored
    (fix 3)."""

    name = "separate_buffers"
    description = "backward ops and frees queue behind the forward batches on the stream"

    def place_op(self, cmd: Op, *, reads_pending: bool, reads_filling: bool) -> OpPlacement:
        """On the stream if it is a backward op or reads a pending tensor, else at arrival."""
        return OpPlacement.ON_STREAM if cmd.phase == "backward" or reads_pending else OpPlacement.EAGER

    def place_free(self, *, read_by_pending: bool, phase: str) -> FreePlacement:
        """After its readers if a pending batch reads it; on the stream during backward; else at arrival."""
        if read_by_pending:
            return FreePlacement.AFTER_READERS
        return FreePlacement.ON_STREAM if phase == "backward" else FreePlacement.NOW


class EagerIfIndependent(BufferPolicy):
    """Eager only when independent: an op reading the filling buffer joins it, one reading a flushed batch
    waits for it, and only ops that read no pending tensor run eagerly at arrival; frees wait for their
    readers (fix 4)."""

    name = "eager_if_independent"
    description = "ops reading pending tensors join the filling buffer or wait for the flushed one"

    def place_op(self, cmd: Op, *, reads_pending: bool, reads_filling: bool) -> OpPlacement:
        """Into the filling buffer if it reads it; after its producers if it reads another batch; else now."""
        if reads_filling:
            return OpPlacement.JOIN_FILLING
        return OpPlacement.AFTER_INPUTS if reads_pending else OpPlacement.EAGER

    def place_free(self, *, read_by_pending: bool, phase: str) -> FreePlacement:
        """After its readers if a pending batch still reads it, else at arrival."""
        return FreePlacement.AFTER_READERS if read_by_pending else FreePlacement.NOW


#: the buffer policies by name, the one with no coordination first
POLICIES: dict[str, BufferPolicy] = {
    policy.name: policy
    for policy in (
        FallBackToEager(),
        FlushOnBackward(),
        TrackDependencies(),
        SeparateBuffers(),
        EagerIfIndependent(),
    )
}


def buffer_policy(policy: str | BufferPolicy) -> BufferPolicy:
    """The policy registered as ``policy`` in :data:`POLICIES`, or ``policy`` itself if it is a policy."""
    if isinstance(policy, BufferPolicy):
        return policy
    found = POLICIES.get(policy) if isinstance(policy, str) else None
    if found is None:
        raise BufferPolicyError(
            f"unknown buffer policy {policy!r}; choose one of {', '.join(POLICIES)} "
            "or pass a simdist.runtime.BufferPolicy object"
        )
    return found
