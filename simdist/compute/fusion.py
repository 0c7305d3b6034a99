"""Elementwise chains of a ``torch.compile``d region priced as fused kernels: each chain one pass over what it
reads from outside and what it writes for later, as a compiler that fuses pointwise ops (inductor) runs them."""

from __future__ import annotations

import weakref
from typing import Any

import torch

#: the name a fused kernel's charge carries, before the names of the ops it fused (as inductor names its kernels
#: "triton_poi_fused_<ops>")
FUSED_PREFIX = "fused::"


def is_pointwise(func: Any) -> bool:
    """Whether aten op ``func`` is elementwise (torch tags it ``pointwise``): a compiler fuses chains of them."""
    return torch.Tag.pointwise in getattr(func, "tags", ())


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensors(y)]
    if isinstance(x, dict):
        return [t for y in x.values() for t in _tensors(y)]
    return []


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Chain:
    """Consecutive pointwise ops: their names, what they read from outside the chain, what they made."""

    def __init__(self) -> None:
        self.names: list[str] = []
        #: tensors read from outside the chain, by id (held, so that an id stays unique while the region runs)
        self.reads: dict[int, torch.Tensor] = {}
        #: [weak reference, bytes, read outside the chain] of every tensor an op of the chain made
        self.made: list[list[Any]] = []

    def made_entry(self, t: torch.Tensor) -> list[Any] | None:
        return next((m for m in self.made if m[0]() is t), None)


class FusedRegion:
    """The pointwise chains of one compiled region, charged when the region returns.

    A chain is the run of pointwise ops between two other ops (a matmul, a reduction, a copy). It reads each
    tensor it did not make once, and writes what it made that outlives it: read by a later op of the region, or
    still alive when the region returns (an output, or a value the program keeps). Made tensors are held weakly,
    so an intermediate the region dropped (a local of the compiled function, gone when it returns) is not written,
    as a fused kernel keeps it in registers. The chains are priced when the region returns, when that is known:
    inside the region the other ops' kernels are therefore charged before the chains'.
    """

    def __init__(self) -> None:
        self._chains: list[_Chain] = []
        self._open: _Chain | None = None

    def _note_reads(self, tensors: list[torch.Tensor], chain: _Chain | None) -> list[torch.Tensor]:
        """Mark what closed chains made and ``tensors`` read as written; return those the open chain did not make."""
        outside = []
        for t in tensors:
            if chain is not None and chain.made_entry(t) is not None:
                continue
            outside.append(t)
            for done in self._chains:
                if done is chain:
                    continue
                entry = done.made_entry(t)
                if entry is not None:
                    entry[2] = True
        return outside

    def pointwise(self, name: str, args: Any, kwargs: Any, out: Any) -> None:
        """A pointwise op of the region ran: ``args``/``kwargs`` its inputs, ``out`` its result."""
        if self._open is None:
            self._open = _Chain()
            self._chains.append(self._open)
        chain = self._open
        chain.names.append(name.removeprefix("aten::"))
        for t in self._note_reads(_tensors(args) + _tensors(kwargs), chain):
            chain.reads.setdefault(id(t), t)
        for t in _tensors(out):
            chain.made.append([weakref.ref(t), _nbytes(t), False])

    def other(self, args: Any, kwargs: Any) -> None:
        """Another op of the region ran: the open chain ends, and what the chains made that it reads is written."""
        self._open = None
        self._note_reads(_tensors(args) + _tensors(kwargs), None)

    def close(self) -> list[tuple[str, int]]:
        """The region returned: each chain's kernel name and bytes moved."""
        kernels = []
        for chain in self._chains:
            written = sum(nbytes for ref, nbytes, read in chain.made if read or ref() is not None)
            reads = sum(_nbytes(t) for t in chain.reads.values())
            kernels.append((FUSED_PREFIX + "_".join(chain.names), reads + written))
        self._chains, self._open = [], None
        return kernels
