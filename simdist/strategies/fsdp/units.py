"""Sharding units: one parameter flattened and split into equal chunks, one per rank of the group.

A parameter of ``numel`` elements is cut into ``world`` chunks of ``chunk = ceil(numel / world)`` elements;
rank ``i`` keeps elements ``[i * chunk, (i + 1) * chunk)`` of the flattened parameter, so the last ranks'
real part is shorter (possibly empty) and the rest of their chunk is padding, kept at zero. Every chunk has
the same length, which is what ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` need.

Each local shard parameter carries :data:`SHARD_ATTR`, a plain tuple that tells the equivalence oracle where
the shard sits in the full tensor, so a run can be compared with the single-process model by the original
parameter names and full shapes without the oracle knowing this module (see ``docs/fsdp.md``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

#: attribute set on every local shard parameter: ``(qualified name, full shape, shard index, shard count,
#: chunk, global ranks of the group)``; the name is relative to the module FSDP wraps; padding is not part of
#: the full tensor
SHARD_ATTR = "_simdist_shard"

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (the old names warn); same arguments
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def chunk_size(numel: int, world: int) -> int:
    """Elements per rank's chunk: ``ceil(numel / world)``."""
    if world < 1:
        raise ValueError(f"a sharding group needs at least one rank; got world size {world}")
    return math.ceil(numel / world)


def shard_range(numel: int, world: int, index: int) -> tuple[int, int]:
    """[start, stop) of rank ``index``'s real elements in the flattened parameter (stop - start <= chunk)."""
    chunk = chunk_size(numel, world)
    start = min(index * chunk, numel)
    return start, min(start + chunk, numel)


def pad_flat(tensor: torch.Tensor, total: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``tensor`` flattened into a new zero-padded 1-D tensor of ``total`` elements (in ``dtype`` if given)."""
    out = torch.zeros(total, dtype=dtype or tensor.dtype, device=tensor.device)
    out[: tensor.numel()].copy_(tensor.detach().reshape(-1))
    return out


@dataclass(eq=False)
class ShardingUnit:
    """One sharded parameter: its full shape and dtype, the chunk size, and this rank's master shard."""

    #: qualified parameter name in the wrapped module
    name: str
    #: the full parameter's shape and dtype
    shape: torch.Size
    dtype: torch.dtype
    numel: int
    #: ceil(numel / world): elements of every rank's shard, padding included
    chunk: int
    #: this rank's index in the group
    shard_index: int
    #: this rank's master shard, shape (chunk,), in the full parameter's dtype; its padding is zero
    local: nn.Parameter

    @property
    def local_gradient(self) -> torch.Tensor | None:
        """What the reduce-scatter wrote (shape (chunk,)): ``local.grad``."""
        return self.local.grad

    @local_gradient.setter
    def local_gradient(self, value: torch.Tensor | None) -> None:
        self.local.grad = value

    @property
    def real(self) -> tuple[int, int]:
        """[start, stop) of this shard's real elements in the flattened full parameter."""
        start = min(self.shard_index * self.chunk, self.numel)
        return start, min(start + self.chunk, self.numel)

    @classmethod
    def from_full(
        cls, name: str, full: torch.Tensor, shard_index: int, world: int, requires_grad: bool = True
    ) -> ShardingUnit:
        """The unit of rank ``shard_index`` of ``world`` for the full tensor ``full`` (its chunk copied out)."""
        if not 0 <= shard_index < world:
            raise ValueError(f"shard index {shard_index} of {name!r} is outside the group of {world} ranks")
        chunk = chunk_size(full.numel(), world)
        padded = pad_flat(full, chunk * world)
        local = nn.Parameter(padded[shard_index * chunk : (shard_index + 1) * chunk].clone(), requires_grad)
        return cls(name, full.shape, full.dtype, full.numel(), chunk, shard_index, local)
