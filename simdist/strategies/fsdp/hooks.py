"""FSDPBackwardHook: reduce-scatter each sharding unit's full gradient into this rank's shard, asynchronously.

A post-accumulate-grad hook on each unit's gathered full parameter fires once autograd has summed every use
of it in this backward (a tied weight used by two modules is one unit, reduced once) and starts the unit's
reduce-scatter at once, so it overlaps the rest of backward. The works are waited, in issue order, by
:meth:`FSDPBackwardHook.wait_all` (called by ``FSDP.finish_gradient_synchronization()``), which then divides
by the group size. The helper surface (``scatter_multiple``, ``accumulate_gradients``, ``clear_gradients``,
``verify_gradients``) is for code that moves gradients by hand, with the hazards of the original design
behind the switches of :class:`Hazards` (each default is the correct behaviour).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from simdist.strategies.fsdp.resharded import full_parameter
from simdist.strategies.fsdp.units import ShardingUnit, chunk_size, reduce_scatter_single

_SCATTER_ORDERS = ("fixed", "per_rank")
_PAIRINGS = ("name", "position")
_ACCUMULATIONS = ("strict", "truncate")


@dataclass(frozen=True)
class Hazards:
    """Switches that reproduce the original design's hazards; every default is the correct behaviour.

    - ``scatter_order="per_rank"``: ``scatter_multiple`` issues its reduce-scatters in an order of each rank's
      own (rank ``r`` rotates the sorted names by ``r`` places), as a thread pool's completion order differs
      between processes; ``"fixed"`` issues them in sorted-name order on every rank.
    - ``pair_by="position"``: ``scatter_multiple`` pairs units and gradients by their position in the two
      mappings, not by name: where the orders differ, a gradient lands in another unit's shard.
    - ``accumulate="truncate"``: ``accumulate_gradients`` adds over ``min(len(a), len(b))`` elements without a
      word where the shapes differ; ``"strict"`` raises.
    - ``zero_padding=False``: the padding of the reduce-scatter's input is not cleared, so the last shard's
      gradient padding holds what the staging memory held. Real memory would hold arbitrary bytes; to keep
      runs reproducible each rank's stale padding is the value ``shard index + 1``.
    - ``average=False``: the reduce-scatter's sum is not divided by the group size (a learning rate times
      the world size).
    """

    scatter_order: str = "fixed"
    pair_by: str = "name"
    accumulate: str = "strict"
    zero_padding: bool = True
    average: bool = True

    def __post_init__(self) -> None:
        for field_name, allowed in (
            ("scatter_order", _SCATTER_ORDERS),
            ("pair_by", _PAIRINGS),
            ("accumulate", _ACCUMULATIONS),
        ):
            value = getattr(self, field_name)
            if value not in allowed:
                raise ValueError(f"Hazards.{field_name} must be one of {allowed}; got {value!r}")


class ShardOwner(Protocol):
    """What :class:`FSDPBackwardHook` needs from its FSDP wrapper."""

    group: dist.ProcessGroup | None
    world_size: int
    shard_index: int
    hazards: Hazards

    def _gradient_ready(self, unit: ShardingUnit, param: nn.Parameter) -> None: ...


@dataclass
class _Pending:
    """One reduce-scatter in flight: its work, what it writes, and what the finish does with that."""

    unit: ShardingUnit
    work: Any
    output: torch.Tensor
    staging: torch.Tensor  # the input: kept alive until the work completes
    add_into: torch.Tensor | None  # an existing local gradient to add the result to (else output is local.grad)


class FSDPBackwardHook:
    """Backward hooks and helpers that reduce-scatter full gradients into sharding units' local gradients."""

    def __init__(self, fsdp: ShardOwner) -> None:
        if fsdp is None:
            raise ValueError("FSDPBackwardHook needs the FSDP wrapper whose units it reduces; got None")
        self._fsdp = fsdp
        self._handles: list[RemovableHandle] = []
        self._pending: list[_Pending] = []

    @property
    def pending(self) -> int:
        """Reduce-scatters issued and not yet waited."""
        return len(self._pending)

    # ----------------------------------------------------------------------------------- hooks

    def register_hooks(self, model: nn.Module, units: Mapping[str, ShardingUnit]) -> None:
        """Hook every unit's full parameter in ``model`` (looked up by the unit's name) to reduce-scatter its gradient.

        The hook hands the parameter to the wrapper (``_gradient_ready``), which decides whether this backward
        synchronises and calls :meth:`scatter_gradient`. Frozen parameters get no hook.
        """
        if model is None:
            raise ValueError("register_hooks needs the module holding the units' full parameters; got None")
        owner = weakref.ref(self._fsdp)  # hooks must not keep a discarded wrapper alive
        for name, unit in units.items():
            try:
                param = full_parameter(model.get_parameter(name))  # the placeholder stands in while not gathered
            except AttributeError as e:
                raise ValueError(
                    f"sharding unit {name!r} names no parameter of {type(model).__name__}: {e}; register the "
                    "hooks on the module the units were made from"
                ) from e
            if not param.requires_grad:
                continue

            def ready(p: torch.Tensor, unit: ShardingUnit = unit) -> None:
                fsdp = owner()
                if fsdp is not None:
                    fsdp._gradient_ready(unit, p)  # type: ignore[arg-type]

            self._handles.append(param.register_post_accumulate_grad_hook(ready))

    # --------------------------------------------------------------------------------- scatter

    def scatter_gradient(self, unit: ShardingUnit, full_gradient: torch.Tensor | None) -> torch.Tensor:
        """Start the reduce-scatter of ``full_gradient`` into ``unit.local_gradient``; return the tensor it writes.

        Asynchronous: the result is valid once :meth:`wait_all` (``finish_gradient_synchronization()``) ran.
        The reduction is a SUM in the master's dtype (fp32 for an fp32 model, whatever the compute dtype),
        averaged at the wait.
        """
        self._issue(unit, full_gradient)
        pending = self._pending[-1]
        return pending.output

    def _issue(self, unit: ShardingUnit, full_gradient: torch.Tensor | None) -> Any:
        if full_gradient is None:
            raise ValueError(
                f"no gradient to reduce-scatter for '{unit.name}' (rank {self._fsdp.shard_index} of the group); "
                "pass zeros for a parameter this rank did not use: every rank must issue the same reduce-scatters"
            )
        if full_gradient.numel() != unit.numel:
            raise ValueError(
                f"the gradient for '{unit.name}' has shape {tuple(full_gradient.shape)}, expected "
                f"{tuple(unit.shape)} ({unit.numel} elements); pass each unit its own parameter's gradient"
            )
        world = self._fsdp.world_size
        staging = torch.empty(unit.chunk * world, dtype=unit.dtype, device=unit.local.device)
        with torch.no_grad():
            staging[: unit.numel].copy_(full_gradient.detach().reshape(-1))
            if self._fsdp.hazards.zero_padding:
                staging[unit.numel :].zero_()
            else:
                staging[unit.numel :].fill_(self._fsdp.shard_index + 1)  # stands for stale bytes
        existing = unit.local.grad
        # Into local.grad itself where it is free: the optimizer reads that tensor, so stepping before the
        # wait is a read of a buffer in flight, which a race detector sees.
        output = torch.empty(unit.chunk, dtype=unit.dtype, device=unit.local.device)
        if existing is None:
            unit.local.grad = output
        try:
            work = reduce_scatter_single(
                output, staging, op=dist.ReduceOp.SUM, group=self._fsdp.group, async_op=True
            )
        except (RuntimeError, ValueError) as e:  # backend failures; a simulator's diagnoses pass unchanged
            if existing is None:
                unit.local.grad = None
            raise RuntimeError(f"reduce-scatter of '{unit.name}' failed: {e}") from e
        self._pending.append(_Pending(unit, work, output, staging, existing))
        return work

    def scatter_multiple(
        self, units: Mapping[str, ShardingUnit], grads: Mapping[str, torch.Tensor | None]
    ) -> list[Any]:
        """Start one reduce-scatter per unit with its gradient; return the works (waited by :meth:`wait_all`).

        Units and gradients are paired by name and issued in sorted-name order on every rank, unless
        ``Hazards.pair_by`` / ``Hazards.scatter_order`` say otherwise. Counts must match.
        """
        if not units:
            return []
        if len(units) != len(grads):
            raise ValueError(
                f"scatter_multiple got {len(units)} sharding units and {len(grads)} gradients; pass one gradient "
                f"per unit (units {sorted(units)}, gradients {sorted(grads)})"
            )
        hazards = self._fsdp.hazards
        if hazards.pair_by == "position":
            pairs = list(zip(units.values(), grads.values()))
        else:
            missing = sorted(set(units) - set(grads))
            if missing:
                raise ValueError(
                    f"scatter_multiple has no gradient for units {missing} (gradients given for {sorted(grads)}); "
                    "key the gradients by the units' names"
                )
            pairs = [(units[name], grads[name]) for name in units]
        pairs.sort(key=lambda pair: pair[0].name)
        if hazards.scatter_order == "per_rank" and pairs:
            shift = self._fsdp.shard_index % len(pairs)
            pairs = pairs[shift:] + pairs[:shift]
        return [self._issue(unit, grad) for unit, grad in pairs]

    def wait_all(self) -> list[ShardingUnit]:
        """Wait for every reduce-scatter in issue order, average, and leave the result in each ``local.grad``."""
        pending, self._pending = self._pending, []
        for p in pending:
            p.work.wait()
        world = self._fsdp.world_size
        with torch.no_grad():
            for p in pending:
                if self._fsdp.hazards.average:
                    p.output.div_(world)
                if p.add_into is not None:
                    p.add_into.add_(p.output)
                    if p.unit.local.grad is None:
                        p.unit.local.grad = p.add_into
        return [p.unit for p in pending]

    # ---------------------------------------------------------------------------- local helpers

    def accumulate_gradients(
        self, units: Mapping[str, ShardingUnit], new_grads: Mapping[str, torch.Tensor | None]
    ) -> None:
        """Add ``new_grads`` (shard-shaped) into the units' local gradients, by name; a missing one is skipped."""
        if not units or not new_grads:
            return
        for name, unit in units.items():
            new = new_grads.get(name)
            if new is None:
                continue
            with torch.no_grad():
                if unit.local_gradient is None:
                    unit.local_gradient = new.detach().clone().to(unit.dtype)
                    continue
                local, incoming = unit.local_gradient.reshape(-1), new.detach().reshape(-1)
                if local.numel() != incoming.numel():
                    if self._fsdp.hazards.accumulate != "truncate":
                        raise ValueError(
                            f"cannot accumulate a gradient of shape {tuple(new.shape)} into '{name}', whose local "
                            f"gradient has shape {tuple(unit.local_gradient.shape)}; pass shard-shaped gradients"
                        )
                    n = min(local.numel(), incoming.numel())
                    local[:n].add_(incoming[:n])
                    continue
                local.add_(incoming)

    def clear_gradients(self, units: Mapping[str, ShardingUnit]) -> None:
        """Zero the units' local gradients in place (a unit with none keeps none)."""
        with torch.no_grad():
            for unit in units.values():
                if unit.local_gradient is not None:
                    unit.local_gradient.zero_()

    def verify_gradients(
        self,
        units: Mapping[str, ShardingUnit],
        full_grads: Mapping[str, torch.Tensor],
        tolerance: float = 1e-5,
    ) -> bool:
        """Whether each unit's local gradient equals its chunk of the full gradient, within ``tolerance``.

        Chunk = ceil(n / world); the last shard's real part is shorter and its padding is not looked at.
        A unit with no full gradient given is skipped; one with no local gradient fails.
        """
        if not units or not full_grads:
            return True
        world = self._fsdp.world_size
        for name, unit in units.items():
            full = full_grads.get(name)
            if full is None:
                continue
            local = unit.local_gradient
            if local is None:
                return False
            flat = full.detach().reshape(-1)
            chunk = chunk_size(flat.numel(), world)
            start = unit.shard_index * chunk
            size = max(0, min(chunk, flat.numel() - start))
            if size == 0:
                continue
            expected = flat[start : start + size].to(torch.float64)
            actual = local.detach().reshape(-1)[:size].to(torch.float64)
            if bool(((expected - actual).abs() > tolerance).any()):
                return False
        return True

    def close(self) -> None:
        """Remove the hooks and forget works not waited (call after the last finish)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._pending.clear()
