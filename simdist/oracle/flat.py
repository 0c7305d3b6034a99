"""Full tensors by name from the shards of torch FSDP1's flat parameters, read from every rank's memory.

torch's ``FullyShardedDataParallel`` (FSDP1) flattens the parameters of each unit (the module it wraps, minus
nested units) into one 1-D ``FlatParameter``: the parameters in module order, each ``numel`` long, with
alignment padding between them when ``use_orig_params=True``, then right-hand padding so that its length
divides by the sharding group's size ``W``. Rank ``j`` of the group keeps elements ``[j*s, (j+1)*s)`` with
``s = ceil(numel / W)``; the last ranks may hold padding only. The gradient and the optimizer state of the
flat parameter have the same shard. With ``use_orig_params=True`` the optimizer sees each original parameter
instead, as a 1-D view of its part of the shard (empty where the rank holds none of it), and its gradient and
optimizer state have that view's shape. ``HYBRID_SHARD`` shards within a group and replicates across groups;
``NO_SHARD`` keeps the whole flat parameter on every rank (one group per rank).

:func:`fsdp1_layouts` describes, on a rank at an optimizer step, where each such tensor sits in its unit's
unsharded flat tensor (:class:`FlatLayout`, picklable, no tensors); :func:`local_piece` copies a tensor
(the parameter, its gradient or one of its optimizer-state tensors) in that flat form; after the run
:func:`assemble_flat` places all ranks' pieces and cuts the full tensors out by qualified name (wrappers'
prefixes removed, as :mod:`simdist.oracle.names` names them). Replicas are compared bit for bit, never averaged.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from simdist.errors import SimdistError
from simdist.oracle.dtensors import is_fsdp1
from simdist.oracle.names import canonical_names
from simdist.ranks import format_ranks


class FlatAssemblyError(SimdistError, ValueError):
    """The ranks' pieces of an FSDP1 flat parameter do not form its full tensors (missing or inconsistent)."""


@dataclass(frozen=True)
class FlatLayout:
    """Where one rank's tensor sits in an FSDP1 unit's unsharded flat tensor (element offsets, no padding units)."""

    #: the unit's module name without wrappers' prefixes ("" for the root module)
    prefix: str
    #: qualified names (wrappers' prefixes removed) of the unit's original parameters, in flat order
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    #: where each parameter starts in the unsharded flat tensor (alignment padding lies between)
    offsets: tuple[int, ...]
    #: elements of each rank's shard, right-hand padding included (the whole flat tensor for ``NO_SHARD``)
    shard_numel: int
    #: this rank's index in its sharding group, and the group's size
    shard_index: int
    shard_count: int
    #: global ranks of the sharding group, by index in the group
    group_ranks: tuple[int, ...]
    #: ``None``: the tensor is the FlatParameter (``use_orig_params=False``); ``i``: it is ``names[i]``'s view
    param: int | None = None

    @property
    def span(self) -> tuple[int, int]:
        """[start, stop) of this rank's tensor in the unsharded flat tensor (elements)."""
        lo, hi = self.shard_index * self.shard_numel, (self.shard_index + 1) * self.shard_numel
        if self.param is None:
            return lo, hi
        start = self.offsets[self.param]
        stop = start + _numel(self.shapes[self.param])
        return (max(lo, start), max(max(lo, start), min(hi, stop)))

    @property
    def numel(self) -> int:
        """Elements of this rank's tensor (0 for an original parameter the rank holds none of)."""
        start, stop = self.span
        return stop - start

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is laid out like this rank's shard (a gradient, ``exp_avg``), not a scalar (``step``)."""
        return tensor.dim() >= 1 and tensor.numel() == self.numel

    @property
    def unit(self) -> tuple[str, tuple[str, ...], int | None]:
        """The key under which all ranks' pieces of the same tensor meet."""
        return self.prefix, self.names, self.param


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def fsdp1_layouts(root: nn.Module) -> dict[int, FlatLayout]:
    """``id(tensor)`` -> layout for every parameter under ``root`` that torch FSDP1 manages, on the calling rank.

    The tensor is each unit's FlatParameter (``use_orig_params=False``) or each original parameter
    (``use_orig_params=True``). Call it inside the rank, with the process group initialised, while the
    parameters are sharded (at an optimizer step).
    """
    prefixes: dict[int, str] = {}
    units: list[tuple[str, Any]] = []  # FSDP1 wrappers
    for name, module, _ in canonical_names(root):
        prefixes.setdefault(id(module), name)
        if is_fsdp1(module) and module._handle is not None:
            units.append((name, module))
    out: dict[int, FlatLayout] = {}
    for prefix, unit in units:
        handle = unit._handle
        flat = handle.flat_param
        names = tuple(
            _join(prefixes.get(id(info.module), _join(prefix, info.module_name)), info.param_name)
            for info in flat._param_infos
        )
        offsets, at = [], 0
        for numel, is_padding in zip(flat._numels_with_padding, flat._is_padding_mask):
            if not is_padding:
                offsets.append(at)
            at += numel
        if handle.uses_sharded_strategy:
            group = tuple(dist.get_process_group_ranks(handle.process_group))
            index, count, shard_numel = handle.rank, handle.world_size, flat._sharded_size.numel()
        else:  # NO_SHARD: every rank holds the whole flat tensor, a replica of every other rank's
            group, index, count, shard_numel = (dist.get_rank(),), 0, 1, flat._unpadded_unsharded_size.numel()
        base = FlatLayout(
            prefix=prefix,
            names=names,
            shapes=tuple(tuple(s) for s in flat._shapes),
            offsets=tuple(offsets),
            shard_numel=shard_numel,
            shard_index=index,
            shard_count=count,
            group_ranks=group,
        )
        if flat._params is None:
            out[id(flat)] = base
        else:
            # shared (tied) parameters are the same objects as their primary ones: one entry each
            for i, p in enumerate(flat._params):
                out[id(p)] = _replace_param(base, i)
    return out


#: attribute a hand-written sharding wrapper (simdist.strategies.fsdp) sets on each rank's shard parameter: a
#: plain tuple ``(qualified name, full shape, shard index, shard count, shard numel, global ranks of the group)``;
#: shard ``i`` holds elements ``[i * numel, (i + 1) * numel)`` of the flattened parameter, the rest padding
SHARD_ATTR = "_simdist_shard"


def shard_layout(spec: object) -> FlatLayout:
    """The layout a :data:`SHARD_ATTR` tuple describes: a one-parameter flat unit with right-hand padding."""
    try:
        name, shape, index, count, shard_numel, group = spec  # type: ignore[misc]
        layout = FlatLayout(
            prefix=str(name),
            names=(str(name),),
            shapes=(tuple(int(d) for d in shape),),
            offsets=(0,),
            shard_numel=int(shard_numel),
            shard_index=int(index),
            shard_count=int(count),
            group_ranks=tuple(int(r) for r in group),
            param=0,
        )
    except (TypeError, ValueError) as e:
        raise FlatAssemblyError(
            f"{SHARD_ATTR} must be (name, full shape, shard index, shard count, shard numel, group ranks); got "
            f"{spec!r} ({e})"
        ) from e
    if len(layout.group_ranks) != layout.shard_count or layout.shard_numel * layout.shard_count < _numel(layout.shapes[0]):
        raise FlatAssemblyError(
            f"{SHARD_ATTR} {spec!r}: {layout.shard_count} shards of {layout.shard_numel} elements over ranks "
            f"{list(layout.group_ranks)} cannot hold a parameter of shape {layout.shapes[0]}"
        )
    return layout


def unpadded(layout: FlatLayout, tensor: torch.Tensor) -> torch.Tensor:
    """A padded shard (shape ``(shard_numel,)``) cut to the elements of the parameter it holds; others unchanged."""
    if tensor.dim() == 1 and tensor.numel() == layout.shard_numel:
        return tensor[: layout.numel]
    return tensor


def _replace_param(layout: FlatLayout, param: int) -> FlatLayout:
    return FlatLayout(**{**layout.__dict__, "param": param})


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def local_piece(layout: FlatLayout, tensor: torch.Tensor) -> torch.Tensor:
    """A detached 1-D copy of the calling rank's ``tensor`` (parameter, gradient or optimizer state) in flat form."""
    if not layout.holds(tensor):
        what = layout.names[layout.param] if layout.param is not None else f"the flat parameter of {layout.names}"
        raise FlatAssemblyError(
            f"expected {layout.numel} elements (rank {layout.shard_index} of {layout.shard_count} in the sharding "
            f"group of {what}), found a tensor of shape {tuple(tensor.shape)}; FSDP1's parameters must be sharded "
            "when they are captured (not inside summon_full_params or after a no_sync backward), and scalars such "
            "as Adam's step are replicas, not shards"
        )
    return tensor.detach().reshape(-1).clone()


def pieces_by_name(layout: FlatLayout, piece: torch.Tensor) -> list[tuple[str, FlatLayout, torch.Tensor]]:
    """``piece`` cut into one piece per parameter it holds part of: (name, that parameter's layout, its elements).

    A FlatParameter's piece becomes pieces shaped as ``use_orig_params=True`` ones, so that a caller which
    handles tensors one name at a time treats both modes alike; a rank holding none of a parameter gets none.
    """
    lo = layout.span[0]
    out: list[tuple[str, FlatLayout, torch.Tensor]] = []
    for i in range(len(layout.names)) if layout.param is None else [layout.param]:
        one = _replace_param(layout, i)
        start, stop = one.span
        if stop > start:
            out.append((layout.names[i], one, piece[start - lo : stop - lo]))
    return out


@dataclass
class FlatAssembly:
    """Full tensors by name, which rank holds which elements of each, and replicas that differ."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    #: name -> rank -> [start, stop) of that rank's elements in the flattened full tensor (assembled replica only)
    regions: dict[str, dict[int, tuple[int, int]]] = field(default_factory=dict)
    #: (name, ranks of a replica whose elements differ bitwise from the assembled one's)
    diverged: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)


def assemble_flat(pieces: Iterable[tuple[int, FlatLayout, torch.Tensor]]) -> FlatAssembly:
    """Full tensors by qualified name from (global rank, layout, piece) of every rank holding a shard.

    Each sharding group's pieces are placed in its unit's flat tensor; the group that contains the lowest rank
    gives the result, and every other group (``HYBRID_SHARD``'s or ``NO_SHARD``'s replicas) is compared with
    it bit for bit.
    """
    units: dict[tuple, dict[tuple[int, ...], list[tuple[int, FlatLayout, torch.Tensor]]]] = {}
    for rank, layout, piece in pieces:
        units.setdefault(layout.unit, {}).setdefault(layout.group_ranks, []).append((rank, layout, piece))
    out = FlatAssembly()
    owner: dict[str, str] = {}
    for unit in sorted(units, key=lambda u: (u[0], u[1], -1 if u[2] is None else u[2])):
        groups = units[unit]
        _check_same_unit(groups)
        first, *others = sorted(groups, key=min)
        full, regions = _assemble_group(groups[first])
        for name in full:
            if owner.setdefault(name, unit[0]) != unit[0]:
                raise FlatAssemblyError(
                    f"{name!r} is held by two FSDP1 units ({owner[name] or '<root>'!r} and {unit[0] or '<root>'!r}); "
                    "pass the pieces of one model's units, captured at the same step"
                )
        out.tensors.update(full)
        out.regions.update(regions)
        for other in others:
            replica, replica_regions = _assemble_group(groups[other])
            for name, value in full.items():
                ranks = _differing_ranks(value, replica[name], replica_regions[name])
                if ranks:
                    out.diverged.append((name, ranks))
    return out


def _check_same_unit(groups: dict[tuple[int, ...], list[tuple[int, FlatLayout, torch.Tensor]]]) -> None:
    """Every piece of one unit agrees on the flat tensor's contents and shard size."""
    entries = [(rank, layout) for members in groups.values() for rank, layout, _ in members]
    rank0, ref = entries[0]
    for rank, layout in entries[1:]:
        for attr in ("shapes", "offsets", "shard_numel", "shard_count"):
            if getattr(layout, attr) != getattr(ref, attr):
                raise FlatAssemblyError(
                    f"the FSDP1 unit {ref.prefix or '<root>'!r} ({', '.join(ref.names)}) has {attr} "
                    f"{getattr(ref, attr)} on rank {rank0} but {getattr(layout, attr)} on rank {rank}; every rank "
                    "must wrap the same model the same way"
                )


def _assemble_group(
    members: list[tuple[int, FlatLayout, torch.Tensor]],
) -> tuple[dict[str, torch.Tensor], dict[str, dict[int, tuple[int, int]]]]:
    """Full tensors of one sharding group's pieces, and where each rank's elements sit in them."""
    ref = members[0][1]
    where = f"FSDP1 unit {ref.prefix or '<root>'!r} ({', '.join(ref.names)})"
    group = ref.group_ranks
    by_index: dict[int, tuple[int, torch.Tensor]] = {}
    dtypes = {piece.dtype for _, _, piece in members}
    if len(dtypes) > 1:
        raise FlatAssemblyError(f"{where}: the pieces of ranks {[r for r, _, _ in members]} mix dtypes {dtypes}")
    for rank, layout, piece in members:
        if not 0 <= layout.shard_index < len(group) or group[layout.shard_index] != rank:
            raise FlatAssemblyError(
                f"{where}: rank {rank} sent a piece for shard {layout.shard_index} of group {list(group)}, which "
                "that rank does not hold; pass each piece with the global rank that captured it"
            )
        if layout.shard_index in by_index:
            raise FlatAssemblyError(f"{where}: rank {rank} sent two pieces of the same tensor")
        if piece.dim() != 1 or piece.numel() != layout.numel:
            raise FlatAssemblyError(
                f"{where}: rank {rank}'s piece has shape {tuple(piece.shape)}, expected ({layout.numel},); "
                "make pieces with local_piece"
            )
        by_index[layout.shard_index] = (rank, piece)
    flat = torch.zeros(ref.shard_numel * ref.shard_count, dtype=next(iter(dtypes)))
    covered = torch.zeros(flat.numel(), dtype=torch.bool)
    for index, (rank, piece) in by_index.items():
        start, stop = _replace_index(ref, index).span
        flat[start:stop] = piece
        covered[start:stop] = True
    names = range(len(ref.names)) if ref.param is None else [ref.param]
    full: dict[str, torch.Tensor] = {}
    regions: dict[str, dict[int, tuple[int, int]]] = {}
    for i in names:
        name, shape, start = ref.names[i], ref.shapes[i], ref.offsets[i]
        stop = start + _numel(shape)
        if not bool(covered[start:stop].all()):
            missing = [
                group[j]
                for j in range(ref.shard_count)
                if j not in by_index and _overlap((start, stop), _shard_range(ref, j))
            ]
            raise FlatAssemblyError(
                f"{name!r} in {where}: no piece from {format_ranks(missing)} of the sharding group "
                f"{list(group)}, which hold{'s' if len(missing) == 1 else ''} part of it; capture every rank"
            )
        full[name] = flat[start:stop].clone().view(shape)
        regions[name] = {}
        for j, (rank, _) in sorted(by_index.items()):
            lo, hi = _shard_range(ref, j)
            if _overlap((start, stop), (lo, hi)):
                regions[name][rank] = (max(lo, start) - start, min(hi, stop) - start)
    return full, regions


def _replace_index(layout: FlatLayout, index: int) -> FlatLayout:
    return FlatLayout(**{**layout.__dict__, "shard_index": index})


def _shard_range(layout: FlatLayout, index: int) -> tuple[int, int]:
    return index * layout.shard_numel, (index + 1) * layout.shard_numel


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return max(a[0], b[0]) < min(a[1], b[1])


def _differing_ranks(value: torch.Tensor, replica: torch.Tensor, regions: dict[int, tuple[int, int]]) -> tuple[int, ...]:
    """Ranks whose elements of ``replica`` are not bitwise equal to ``value``'s (equal NaNs are equal)."""
    size = value.element_size()
    a = value.contiguous().reshape(-1).view(torch.uint8).reshape(-1, size)
    b = replica.contiguous().reshape(-1).view(torch.uint8).reshape(-1, size)
    differs = (a != b).any(dim=1)
    return tuple(rank for rank, (lo, hi) in sorted(regions.items()) if bool(differs[lo:hi].any()))
