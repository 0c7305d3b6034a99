"""Full tensors from every rank's pieces, read from the ranks' memory after the run, without a collective.

A plain tensor held by several ranks is a replica (data parallelism): the full tensor is the lowest rank's
copy, and every other copy must be bitwise equal to it. A hand-written shard (Megatron-style tensor parallelism
with plain tensors) is described by the caller: ``(dim, group_size)`` concatenates the pieces of each
``group_size`` consecutive holders along ``dim``, blocks of holders being replicas of each other. A DTensor
(tensor parallelism, torch FSDP2, FSDP2 over tensor parallelism) carries its own layout: each piece is written
where its mesh coordinate puts it (a box, or strided rows under FSDP2 over TP), replicated mesh dimensions are
checked like replicas, partial ones are reduced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from simdist.errors import SimdistError
from simdist.options import ShardSpec
from simdist.oracle.capture import MeshLayout, Piece
from simdist.oracle.dtensors import placements as dtensor_placements
from simdist.oracle.flat import FlatAssemblyError, FlatLayout, assemble_flat
from simdist.oracle.tolerance import bitwise_equal
from simdist.ranks import ranges


class AssemblyError(SimdistError):
    """The ranks' pieces of a tensor do not form a full tensor (missing ranks, inconsistent shapes)."""


@dataclass
class Assembled:
    """A full tensor, where each rank's piece sits in it, and the replicas that are not bitwise equal."""

    full: torch.Tensor
    #: rank -> the index of its piece in ``full`` (a box, or a boolean mask where the piece is no box)
    regions: dict[int, tuple[slice, ...] | torch.Tensor]
    #: ranks whose copy differs from the replica it must equal
    replica_ranks: tuple[int, ...] = ()
    #: why the replicas differ, when it is more than their values (shapes)
    note: str = ""
    #: how the pieces were combined, for reports
    how: str = field(default="")


def assemble(name: str, pieces: list[Piece], shard: ShardSpec | None = None) -> Assembled:
    """Assemble ``name`` from all ranks' ``pieces`` (at least one)."""
    pieces = sorted(pieces, key=lambda p: p.rank)
    layouts = {type(p.layout) for p in pieces}
    if len(layouts) > 1:
        raise AssemblyError(f"{name!r}: ranks hold it in different forms ({sorted(t.__name__ for t in layouts)})")
    if isinstance(pieces[0].layout, MeshLayout):
        return _mesh(name, pieces)
    if isinstance(pieces[0].layout, FlatLayout):
        return _flat(name, pieces)
    if shard is not None:
        return _sharded(name, pieces, shard)
    return _replicated(pieces)


def _whole(t: torch.Tensor) -> tuple[slice, ...]:
    return tuple(slice(None) for _ in t.shape)


def _replicated(pieces: list[Piece]) -> Assembled:
    first = pieces[0].value
    differ = [p.rank for p in pieces[1:] if p.value is not first and not bitwise_equal(p.value, first)]
    shapes = sorted({tuple(p.value.shape) for p in pieces})
    note = ""
    if len(shapes) > 1:
        note = (
            f"the ranks hold it in different shapes {shapes}: if it is sharded by hand, describe the layout "
            "with shards={name: dim}"
        )
    return Assembled(first, {p.rank: _whole(p.value) for p in pieces}, tuple(differ), note, "replicated")


def _sharded(name: str, pieces: list[Piece], shard: ShardSpec) -> Assembled:
    dim, size = shard
    size = size or len(pieces)
    if len(pieces) % size:
        raise AssemblyError(
            f"{name!r} is described as sharded over groups of {size} ranks, but ranks "
            f"{ranges([p.rank for p in pieces])} ({len(pieces)}) hold it"
        )
    blocks = [pieces[i : i + size] for i in range(0, len(pieces), size)]
    first = blocks[0]
    ndim = first[0].value.dim()
    if not -ndim <= dim < ndim:
        raise AssemblyError(f"{name!r} is described as sharded along dim {dim}, but its pieces have {ndim} dims")
    dim %= ndim
    try:
        full = torch.cat([p.value for p in first], dim)
    except RuntimeError as e:
        raise AssemblyError(f"{name!r}: the shards of ranks {ranges([p.rank for p in first])} do not concatenate "
                            f"along dim {dim}: {e}") from e
    regions: dict[int, tuple[slice, ...]] = {}
    differ: list[int] = []
    for block in blocks:
        offset = 0
        for p, ref in zip(block, first):
            n = p.value.shape[dim] if p.value.dim() == ndim else 0
            regions[p.rank] = tuple(slice(offset, offset + n) if d == dim else slice(None) for d in range(ndim))
            offset += n
            if block is not first and not bitwise_equal(p.value, ref.value):
                differ.append(p.rank)
    how = f"concatenated along dim {dim} over {size} ranks" + (f", {len(blocks)} replicas" if len(blocks) > 1 else "")
    return Assembled(full, regions, tuple(differ), "", how)


def _mesh(name: str, pieces: list[Piece]) -> Assembled:
    layout: MeshLayout = pieces[0].layout  # type: ignore[assignment]
    by_rank = {p.rank: p for p in pieces}
    missing = [r for r in layout.mesh_ranks if r not in by_rank]
    if missing:
        raise AssemblyError(
            f"{name!r} is a DTensor on the mesh of ranks {ranges(list(layout.mesh_ranks))}, but ranks "
            f"{ranges(missing)} hold no piece of it"
        )
    full = torch.zeros(layout.global_shape, dtype=pieces[0].value.dtype)
    replicate = [i for i, p in enumerate(layout.placements) if p[0] == "replicate"]
    partial = [i for i, p in enumerate(layout.placements) if p[0] == "partial"]
    regions: dict[int, tuple[slice, ...] | torch.Tensor] = {}
    differ: list[int] = []
    for rank in layout.mesh_ranks:
        p = by_rank[rank]
        coord = tuple(int(c) for c in np.unravel_index(layout.mesh_ranks.index(rank), layout.mesh_shape))
        held = held_indices(layout, coord)
        if tuple(len(h) for h in held) != tuple(p.value.shape):
            raise AssemblyError(
                f"{name!r}: rank {rank} (mesh coordinate {coord}) holds a piece of shape {tuple(p.value.shape)}, "
                f"but placements {_layout_text(layout)} of shape {layout.global_shape} give it "
                f"{tuple(len(h) for h in held)}; the DTensor's local tensor does not match its placements"
            )
        where, regions[rank] = _region(held, layout.global_shape)
        base = tuple(0 if i in replicate else c for i, c in enumerate(coord))
        if base != coord:
            if not bitwise_equal(p.value, by_rank[layout.mesh_ranks[_index(base, layout.mesh_shape)]].value):
                differ.append(rank)
            continue
        if partial:
            full[where] += p.value.to(full.dtype)
        else:
            full[where] = p.value
    for i in partial:
        op = layout.placements[i][1]
        if op in ("avg", "mean"):
            full /= layout.mesh_shape[i]
        elif op != "sum":
            raise AssemblyError(f"{name!r}: partial placement with reduce op {op!r}; the oracle reduces sum and avg")
    how = f"DTensor {_layout_text(layout)} over mesh {list(layout.mesh_shape)}"
    return Assembled(full, regions, tuple(sorted(differ)), "", how)


def held_indices(layout: MeshLayout, coord: tuple[int, ...]) -> list[torch.Tensor]:
    """Per tensor dimension, the global indices held by the piece at mesh coordinate ``coord``, in the piece's order.

    A DTensor's piece is the product of one index list per tensor dimension: every placement shards one dimension.
    The lists come from torch's own split (``Shard`` and ``_StridedShard._split_tensor``, as ``distribute_tensor``
    shards without a source rank) replayed on index vectors, left to right over the mesh dimensions, so uneven
    chunks and FSDP2-over-TP's strided order come out as torch lays them out.
    """
    held = [torch.arange(n) for n in layout.global_shape]
    types = dtensor_placements()
    for mesh_dim, p in enumerate(layout.placements):
        if p[0] == "shard":
            split: Any = types.Shard(0)
        elif p[0] == "strided":
            split = types._StridedShard(0, split_factor=p[2])
        else:
            continue
        chunks, _ = split._split_tensor(held[p[1]], layout.mesh_shape[mesh_dim], with_padding=False, contiguous=False)
        held[p[1]] = chunks[coord[mesh_dim]]
    return held


def _region(held: list[torch.Tensor], shape: tuple[int, ...]) -> tuple[tuple, tuple[slice, ...] | torch.Tensor]:
    """How to write a piece holding ``held`` into the full tensor, and its region: a box, or a mask where strided."""
    if all(len(h) == 0 or bool((h == torch.arange(int(h[0]), int(h[0]) + len(h))).all()) for h in held):
        box = tuple(slice(int(h[0]), int(h[0]) + len(h)) if len(h) else slice(0, 0) for h in held)
        return box, box
    # one index vector per dimension, each shaped to broadcast along its own axis: the open mesh of the lists
    grid = tuple(h.view([-1 if d == k else 1 for d in range(len(held))]) for k, h in enumerate(held))
    mask = torch.zeros(shape, dtype=torch.bool)
    mask[grid] = True
    return grid, mask


def _flat(name: str, pieces: list[Piece]) -> Assembled:
    """A torch FSDP1 parameter from its flat shards; regions are masks (a flat range is no box of the tensor)."""
    try:
        got = assemble_flat([(p.rank, p.layout, p.value) for p in pieces])  # type: ignore[misc]
    except FlatAssemblyError as e:
        raise AssemblyError(str(e)) from e
    layout: FlatLayout = pieces[0].layout  # type: ignore[assignment]
    param = layout.names[layout.param]  # type: ignore[index]  # `name` may be an optimizer state's "param:key"
    full = got.tensors[param]
    regions: dict[int, torch.Tensor] = {}
    for rank, (lo, hi) in got.regions[param].items():
        mask = torch.zeros(full.numel(), dtype=torch.bool)
        mask[lo:hi] = True
        regions[rank] = mask.view(full.shape)
    differ = tuple(r for n, ranks in got.diverged for r in ranks if n == param)
    groups = len({p.layout.group_ranks for p in pieces})  # type: ignore[union-attr]
    how = f"FSDP1 flat shards over {layout.shard_count} ranks" + (f", {groups} replicas" if groups > 1 else "")
    return Assembled(full, regions, differ, "", how)


def _index(coord: tuple[int, ...], shape: tuple[int, ...]) -> int:
    return int(np.ravel_multi_index(coord, shape))


def _layout_text(layout: MeshLayout) -> str:
    return ", ".join(_placement_text(p) for p in layout.placements)


def _placement_text(p: tuple) -> str:
    if p[0] == "shard":
        return f"Shard({p[1]})"
    if p[0] == "strided":
        return f"_StridedShard({p[1]}, split_factor={p[2]})"
    return "Replicate()" if p[0] == "replicate" else f"Partial({p[1]})"


def region_numel(region: tuple[slice, ...], shape: tuple[int, ...]) -> int:
    """Elements in ``region`` of a tensor of ``shape``."""
    return math.prod(len(range(*s.indices(n))) for s, n in zip(region, shape))

