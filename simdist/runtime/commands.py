"""What the client and the worker of the remote-tensor runtime say to each other.

Commands go from client to worker in order; responses come back. Tensors are named by ids the client
allocates, so the client can issue an op on the result of an op the worker has not run yet.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from simdist.autograd.executor import TensorMeta

#: bytes a command costs on the wire besides tensor payloads (header, op name, ids)
HEADER_BYTES = 64


@dataclass(frozen=True)
class Op:
    """Run ``op`` on stored tensors ``inputs``; store the results under ``outputs``."""

    seq: int
    op: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    metas: tuple[TensorMeta, ...]
    attrs: tuple[tuple[str, Any], ...]
    #: "forward" or "backward": whether the client's autograd was in a backward pass when it issued the op
    phase: str = "forward"

    def describe(self) -> str:
        """``matmul(t3, t7) -> t9`` style text."""
        ins = ", ".join(f"t{t}" for t in self.inputs)
        outs = ", ".join(f"t{t}" for t in self.outputs)
        return f"#{self.seq} {self.op}({ins}) -> {outs} [{self.phase}]"

    @property
    def nbytes(self) -> int:
        """Bytes on the wire."""
        return HEADER_BYTES + 8 * (len(self.inputs) + len(self.outputs))


@dataclass(frozen=True)
class Put:
    """Store ``value`` under ``tid`` (an upload)."""

    seq: int
    tid: int
    value: np.ndarray = field(repr=False)

    def describe(self) -> str:
        """``put t3 (4, 8) float64`` style text."""
        return f"#{self.seq} put t{self.tid} {self.value.shape} {self.value.dtype}"

    @property
    def nbytes(self) -> int:
        """Bytes on the wire."""
        return HEADER_BYTES + self.value.nbytes


@dataclass(frozen=True)
class Fetch:
    """Send back the value of ``tid`` (the client waits for it)."""

    seq: int
    tid: int

    def describe(self) -> str:
        """``fetch t3`` style text."""
        return f"#{self.seq} fetch t{self.tid}"

    @property
    def nbytes(self) -> int:
        """Bytes on the wire."""
        return HEADER_BYTES


@dataclass(frozen=True)
class Free:
    """The client dropped its handle of ``tid``: the worker may forget it."""

    seq: int
    tid: int

    def describe(self) -> str:
        """``free t3`` style text."""
        return f"#{self.seq} free t{self.tid}"

    @property
    def nbytes(self) -> int:
        """Bytes on the wire."""
        return HEADER_BYTES


Command = Op | Put | Fetch | Free


@dataclass(frozen=True)
class Value:
    """The answer to a Fetch."""

    seq: int
    value: np.ndarray = field(repr=False)

    @property
    def nbytes(self) -> int:
        """Bytes on the wire."""
        return HEADER_BYTES + self.value.nbytes


@dataclass(frozen=True)
class Failure:
    """The worker could not run a command; the answer to the client's next Fetch."""

    seq: int
    message: str
    command: str

    @property
    def nbytes(self) -> int:
        """Bytes on the wire."""
        return HEADER_BYTES + len(self.message)


Response = Value | Failure
