"""FSDP: fully sharded data parallelism in plain torch.distributed, with one sharding unit per sharded parameter.

    model = FSDP(net, compute_dtype=torch.bfloat16)
    loss_fn(model(batch), labels).backward()
    model.finish_gradient_synchronization()
    optimizer.step()                      # an optimizer built on model.parameters(): the local fp32 shards

Each sharded parameter (by default the weights of ``nn.Linear`` and ``nn.Embedding`` and of modules that
subclass or mimic them) becomes a :class:`~simdist.strategies.fsdp.units.ShardingUnit`: this rank keeps one
chunk of it as the fp32 master, and the module holds in its place a full-shape parameter whose memory exists
only while it is gathered. Every other parameter is replicated and its gradient all-reduced.

- Forward: before a module runs, its units are all-gathered (cast to ``compute_dtype`` first, so half the bytes
  move) and the next unit's all-gather is started asynchronously (prefetch); after it, with
  ``reshard_after_forward``, their memory is freed and a hook on the module's outputs gathers them again when
  backward reaches the module.
- Backward: a post-accumulate-grad hook on each unit's full parameter fires once autograd has summed every use
  of it and starts the unit's reduce-scatter (async) into the local shard's gradient, so it overlaps the rest of
  backward (:class:`~simdist.strategies.fsdp.hooks.FSDPBackwardHook`); replicated parameters are all-reduced
  the same way. ``finish_gradient_synchronization()`` waits for all of them and divides by the group size.
- Gradients are reduced in the master's dtype (fp32) even with a 16-bit ``compute_dtype``: a ring sum of
  ``world`` bf16 partial gradients would round at every hop, an error that grows with the group; fp32 costs
  twice the bytes of the reduce-scatter and keeps the result within rounding of the single-process model.

This module imports nothing from the simulator: the same code runs under simdist and under ``real``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from simdist.strategies.ddp import broadcast_from_first
from simdist.strategies.fsdp.hooks import FSDPBackwardHook, Hazards
from simdist.strategies.fsdp.resharded import Resharded, op_name
from simdist.strategies.fsdp.units import SHARD_ATTR, ShardingUnit, all_gather_single

#: which parameters become sharding units: ``shard(owner module, attribute name, parameter) -> bool``
ShardPolicy = Callable[[nn.Module, str, nn.Parameter], bool]

_TWICE = (
    "{what} received a second gradient before finish_gradient_synchronization(); call it after every "
    "synchronising backward, or run the extra forward and backward passes inside no_sync()"
)

# --------------------------------------------------------------------------------------- policy


def is_linear_or_embedding(module: nn.Module) -> bool:
    """Whether ``module`` is, subclasses or mimics ``nn.Linear`` / ``nn.Embedding`` (by their shape attributes)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        return True
    return all(hasattr(module, a) for a in ("in_features", "out_features")) or all(
        hasattr(module, a) for a in ("num_embeddings", "embedding_dim")
    )


def shard_linear_and_embedding_weights(module: nn.Module, name: str, param: nn.Parameter) -> bool:
    """The default policy: shard the ``weight`` of Linear- and Embedding-like modules, replicate the rest.

    Weights hold nearly all of a transformer's parameters; biases and norms are small, and replicating them
    saves a collective per tiny tensor.
    """
    return name == "weight" and is_linear_or_embedding(module)


# ------------------------------------------------------------------------------------ mechanism


@dataclass(eq=False)
class _Gathered:
    """A unit's full parameter as the module sees it, and the padded flat buffer its memory lives in."""

    flat: torch.Tensor  # (chunk * world,) in the compute dtype; storage freed while not gathered
    param: nn.Parameter  # a view of flat[:numel] shaped as the parameter, in the owner modules while gathered
    placeholder: Resharded  # in every owner module while not gathered
    owners: list[tuple[nn.Module, str]]
    gathered: bool = False
    work: Any = None  # an all-gather in flight (prefetch)
    source: torch.Tensor | None = None  # its input, kept alive until it completes
    version: int = 0  # flat's autograd version before the gather


@dataclass(eq=False)
class _Replica:
    """A replicated parameter: its master, the parameter modules compute with (the master itself in fp32).

    The owner modules hold the compute copy during FSDP's forward and the master otherwise, so that outside
    forward a module's parameter is the master, with its gradient, as with the model's own dtype.
    """

    name: str
    master: nn.Parameter
    compute: nn.Parameter
    owners: list[tuple[nn.Module, str]]
    work: Any = None
    buffer: torch.Tensor | None = None
    add_into: torch.Tensor | None = None


@dataclass
class _Slot:
    """One parameter of the wrapped module, in parameter order: a unit's name or a replica."""

    name: str
    unit: ShardingUnit | None = None
    replica: _Replica | None = None
    owners: list[tuple[nn.Module, str]] = field(default_factory=list)
    #: every qualified name of the parameter (a tied one has several), as torch's state_dict lists them
    aliases: list[str] = field(default_factory=list)


def _slots_of(module: nn.Module) -> list[_Slot]:
    """Every parameter once (a tied one under its first name) with every (module, attribute) that holds it."""
    slots: dict[int, _Slot] = {}
    for name, param in module.named_parameters():
        slots[id(param)] = _Slot(name)
    for name, param in module.named_parameters(remove_duplicate=False):
        slots[id(param)].aliases.append(name)
    for sub in module.modules():
        for attr, param in sub._parameters.items():
            if param is not None and id(param) in slots:
                slots[id(param)].owners.append((sub, attr))
    return list(slots.values())


def _free(flat: torch.Tensor) -> None:
    """Release ``flat``'s memory while views of it (saved for backward) stay valid objects."""
    flat.untyped_storage().resize_(0)


def _allocate(flat: torch.Tensor) -> None:
    """Give ``flat`` back its memory (contents undefined until written)."""
    flat.untyped_storage().resize_(flat.numel() * flat.element_size())


def _install(owners: list[tuple[nn.Module, str]], param: nn.Parameter) -> None:
    """Make ``param`` the parameter every owner module holds under its attribute name."""
    for owner, attr in owners:
        owner._parameters[attr] = param


class FSDP(nn.Module):
    """Fully sharded data parallelism: sharded fp32 masters, gathered full parameters, reduce-scattered gradients."""

    def __init__(
        self,
        module: nn.Module,
        compute_dtype: torch.dtype | None = None,
        *,
        group: dist.ProcessGroup | None = None,
        reshard_after_forward: bool = True,
        shard: ShardPolicy | None = None,
        hazards: Hazards | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"FSDP wraps a torch.nn.Module; got {type(module).__name__}")
        if not dist.is_initialized():
            raise RuntimeError("FSDP needs an initialised default process group; call torch.distributed.init_process_group() first")
        if group is not None and dist.get_rank(group) < 0:
            raise ValueError(
                f"rank {dist.get_rank()} is not a member of the group given to FSDP; wrap only on the ranks "
                "passed to dist.new_group()"
            )
        if compute_dtype is not None and not compute_dtype.is_floating_point:
            raise ValueError(f"compute_dtype must be a floating dtype (torch.bfloat16, torch.float16); got {compute_dtype}")
        self.module = module
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.shard_index = dist.get_rank(group)
        self.compute_dtype = compute_dtype
        self.reshard_after_forward = reshard_after_forward
        self.hazards = hazards or Hazards()
        policy = shard or shard_linear_and_embedding_weights
        global_ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
        # Every rank cuts its shard from the first rank's values, as torch DDP starts every replica from them.
        broadcast_from_first(list(module.parameters()) + list(module.buffers()), group)

        self.units: dict[str, ShardingUnit] = {}
        self._gathered: dict[str, _Gathered] = {}
        self._replicas: list[_Replica] = []
        self._slots = _slots_of(module)
        self._units_of: dict[int, list[str]] = {}  # id(owner module) -> its units, in unit order
        for slot in self._slots:
            owner, attr = slot.owners[0]
            param = owner._parameters[attr]
            if param.numel() > 0 and param.is_floating_point() and policy(owner, attr, param):
                slot.unit = self._make_unit(slot, param, global_ranks)
            else:
                slot.replica = self._make_replica(slot, param)
        self._order = list(self.units)

        self._forwarding = False  # inside forward(): a sharded parameter used outside its module is gathered
        self._pinned: set[str] = set()  # units gathered that way: kept until their gradient is reduced
        self._require_sync = True  # False inside no_sync()
        self._sync_this_backward = True  # fixed by the forward that builds the graph, as in torch DDP
        self._backward_expected = False  # a synchronising forward ran and no finish since
        self._fired: set[str] = set()
        self._hook_handles: list[Any] = []
        self.hook = FSDPBackwardHook(self)
        self.hook.register_hooks(module, self.units)
        self._hook_modules()
        self._hook_replicas()
        weakref.finalize(self, _remove, self._hook_handles, self.hook)

    # ------------------------------------------------------------------------------ construction

    def _make_unit(self, slot: _Slot, param: nn.Parameter, global_ranks: tuple[int, ...]) -> ShardingUnit:
        unit = ShardingUnit.from_full(slot.name, param.detach(), self.shard_index, self.world_size, param.requires_grad)
        setattr(
            unit.local,
            SHARD_ATTR,
            (slot.name, tuple(unit.shape), unit.shard_index, self.world_size, unit.chunk, global_ranks),
        )
        dtype = self.compute_dtype or param.dtype
        flat = torch.empty(unit.chunk * self.world_size, dtype=dtype, device=param.device)
        full = nn.Parameter(flat[: unit.numel].view(param.shape), requires_grad=param.requires_grad)
        placeholder = Resharded.of(flat[: unit.numel].view(param.shape), param.requires_grad, slot.name, self)
        _free(flat)
        _install(slot.owners, placeholder)
        for owner, _ in slot.owners:
            self._units_of.setdefault(id(owner), []).append(slot.name)
        self.units[slot.name] = unit
        self._gathered[slot.name] = _Gathered(flat, full, placeholder, slot.owners)
        return unit

    def _make_replica(self, slot: _Slot, param: nn.Parameter) -> _Replica:
        compute = param
        if self.compute_dtype is not None and param.is_floating_point() and param.dtype != self.compute_dtype:
            compute = nn.Parameter(param.detach().to(self.compute_dtype), requires_grad=param.requires_grad)
            # The master leaves the module tree during forward: tell the equivalence oracle its name (a replica
            # on every rank).
            setattr(param, SHARD_ATTR, (slot.name, tuple(param.shape), 0, 1, param.numel(), (dist.get_rank(),)))
        replica = _Replica(slot.name, param, compute, slot.owners)
        self._replicas.append(replica)
        return replica

    def _hook_modules(self) -> None:
        me = weakref.ref(self)
        done: set[int] = set()
        for slot in self._slots:
            for owner, _ in slot.owners:
                if slot.unit is None or id(owner) in done:
                    continue
                done.add(id(owner))
                names = self._units_of[id(owner)]

                def before(module: nn.Module, args: Any, names: list[str] = names) -> None:
                    fsdp = me()
                    if fsdp is not None:
                        fsdp._before_use(names)

                def after(module: nn.Module, args: Any, output: Any, names: list[str] = names) -> None:
                    fsdp = me()
                    if fsdp is not None:
                        fsdp._after_use(names, output)

                self._hook_handles.append(owner.register_forward_pre_hook(before))
                self._hook_handles.append(owner.register_forward_hook(after))

    def _hook_replicas(self) -> None:
        me = weakref.ref(self)
        for replica in self._replicas:
            if not replica.master.requires_grad:
                continue

            def ready(p: torch.Tensor, replica: _Replica = replica) -> None:
                fsdp = me()
                if fsdp is not None and fsdp._sync_this_backward:
                    fsdp._replica_ready(replica)

            self._hook_handles.append(replica.compute.register_post_accumulate_grad_hook(ready))

    # ------------------------------------------------------------------------------ gathering

    def _start_gather(self, name: str) -> None:
        """Start the all-gather of unit ``name``'s full parameter (cast to the compute dtype) into its buffer."""
        g, unit = self._gathered[name], self.units[name]
        with torch.no_grad():
            _allocate(g.flat)
            source = unit.local.detach()
            if source.dtype != g.flat.dtype:
                source = source.to(g.flat.dtype)
            g.source, g.version = source, g.flat._version
            g.work = all_gather_single(g.flat, source, group=self.group, async_op=True)

    def _complete(self, g: _Gathered) -> None:
        """Wait for ``g``'s all-gather and hide its write from autograd.

        Backward's views of the full parameter were saved before the memory was freed and gathered again with
        the same values; autograd would otherwise see the in-place write as a modification and refuse them.
        """
        g.work.wait()
        torch._C._autograd._unsafe_set_version_counter((g.flat,), (g.version,))
        g.work, g.source, g.gathered = None, None, True
        _install(g.owners, g.param)

    def _ensure_gathered(self, name: str) -> None:
        g = self._gathered[name]
        if g.gathered:
            return
        if g.work is None:
            self._start_gather(name)
        self._complete(g)

    def _reshard(self, name: str) -> None:
        """Free unit ``name``'s full parameter (after waiting for an all-gather still in flight)."""
        g = self._gathered[name]
        self._pinned.discard(name)
        if g.work is not None:
            self._complete(g)
        if g.gathered:
            _free(g.flat)
            g.gathered = False
            _install(g.owners, g.placeholder)

    def _release(self, name: str) -> None:
        """Reshard unit ``name`` after a use in forward, unless a use outside its module pinned it for backward."""
        if name not in self._pinned:
            self._reshard(name)

    def _use_sharded(self, name: str, func: Any, metadata: bool) -> nn.Parameter:
        """Unit ``name``'s full parameter for the op ``func``, which found its placeholder in a module.

        Metadata needs no values. Inside forward the unit is gathered (every rank runs the same forward, so
        every rank issues the same all-gather) and, when autograd records the op, kept gathered until its
        gradient is reduced: backward may need its values before the owner module's backward regathers it.
        """
        g = self._gathered[name]
        if metadata:
            return g.param
        if self._forwarding:
            self._ensure_gathered(name)
            if torch.is_grad_enabled():
                self._pinned.add(name)
            return g.param
        if g.gathered:
            return g.param
        start, stop = self.units[name].real
        raise RuntimeError(
            f"FSDP's sharded parameter {name!r} was used by {op_name(func)} on rank {dist.get_rank()} outside the "
            "forward of the FSDP module that shards it, where only this rank's shard exists (elements "
            f"[{start}, {stop}) of {self.units[name].numel}, in model.units[{name!r}].local). Read full values with "
            "model.gather_full_params() or model.state_dict() (collectives: call them on every rank), use the "
            "parameter inside the wrapped model's forward, or keep it replicated with FSDP(..., shard=...)"
        )

    def _before_use(self, names: list[str]) -> None:
        """Gather a module's units before it runs, then prefetch the next unit in order."""
        for name in names:
            self._ensure_gathered(name)
        following = self._order[max(self._order.index(n) for n in names) + 1 :]
        if following:
            g = self._gathered[following[0]]
            if not g.gathered and g.work is None:
                self._start_gather(following[0])

    def _after_use(self, names: list[str], output: Any) -> None:
        """Free a module's units after it ran; gather them again when backward reaches the module."""
        if not self.reshard_after_forward:
            return
        for name in names:
            self._release(name)
        if not torch.is_grad_enabled():
            return
        me = weakref.ref(self)

        def regather(grad: torch.Tensor) -> None:
            fsdp = me()
            if fsdp is not None:
                for name in names:
                    fsdp._ensure_gathered(name)
                fsdp._prefetch_backward(names)

        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(regather)

    def _prefetch_backward(self, names: list[str]) -> None:
        """Start the all-gather of the unit before ``names`` in order, which backward reaches next.

        Issued now, it sits on the communication stream ahead of this module's reduce-scatter, so the next
        module's backward does not wait behind that reduce-scatter (on one stream per group, NCCL-like).
        """
        first = min(self._order.index(n) for n in names)
        if first > 0:
            g = self._gathered[self._order[first - 1]]
            if not g.gathered and g.work is None:
                self._start_gather(self._order[first - 1])

    def _reshard_all(self) -> None:
        for name in self._order:
            self._reshard(name)

    # ------------------------------------------------------------------------------ forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module, gathering each unit around its use (inputs cast to ``compute_dtype``)."""
        self._reshard_all()  # every forward gathers from the current masters
        self._sync_this_backward = self._require_sync
        if torch.is_grad_enabled() and self._require_sync:
            self._backward_expected = True
        with torch.no_grad():
            for replica in self._replicas:
                if replica.compute is not replica.master:
                    replica.compute.copy_(replica.master)
                    _install(replica.owners, replica.compute)
        if self.compute_dtype is not None:
            args, kwargs = tree_map(self._cast, (args, kwargs))
        self._forwarding = True
        try:
            return self.module(*args, **kwargs)
        finally:
            self._forwarding = False
            for replica in self._replicas:
                _install(replica.owners, replica.master)
            for name in self._order:
                g = self._gathered[name]
                if g.work is not None:  # a prefetch no module used: complete it, every rank issued it
                    self._ensure_gathered(name)
                if self.reshard_after_forward:
                    self._release(name)

    def _cast(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.to(self.compute_dtype)
        return x

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside: backward keeps each full gradient locally (summed over micro-batches), no collective is issued.

        As in torch DDP the forward decides: the next synchronising backward reduce-scatters the sums.
        """
        previous = self._require_sync
        self._require_sync = False
        try:
            yield
        finally:
            self._require_sync = previous

    # ------------------------------------------------------------------------------ backward

    def _gradient_ready(self, unit: ShardingUnit, param: nn.Parameter) -> None:
        """A unit's full gradient of this backward is complete: reduce-scatter it (unless in no_sync), free memory."""
        if self._sync_this_backward:
            if unit.name in self._fired:
                raise RuntimeError(_TWICE.format(what=f"sharding unit {unit.name!r}"))
            self._fired.add(unit.name)
            self.hook.scatter_gradient(unit, param.grad)
            param.grad = None
        self._reshard(unit.name)

    def _replica_ready(self, replica: _Replica) -> None:
        if replica.name in self._fired:
            raise RuntimeError(_TWICE.format(what=f"parameter {replica.name!r}"))
        self._fired.add(replica.name)
        self._reduce_replica(replica, replica.compute.grad)

    def _reduce_replica(self, replica: _Replica, grad: torch.Tensor | None) -> None:
        """Start the SUM all-reduce of a replicated parameter's gradient (zeros where it has none)."""
        master = replica.master
        if replica.compute is master:
            buffer = master.grad if master.grad is not None else torch.zeros_like(master)
            master.grad = buffer  # reduced in place: the tensor the optimizer reads
            replica.add_into = None
        else:
            buffer = torch.zeros_like(master) if grad is None else grad.detach().to(master.dtype)
            replica.compute.grad = None
            replica.add_into = master.grad
            if master.grad is None:
                master.grad = buffer
        replica.buffer = buffer
        replica.work = dist.all_reduce(buffer, group=self.group, async_op=True)

    def finish_gradient_synchronization(self) -> None:
        """Reduce what no hook reduced (unused parameters, as zeros), wait for every reduction, average.

        Every rank must issue the same collectives in the same order, so a parameter that got no gradient in
        this backward still takes part, with zeros (or the sum kept by ``no_sync()``), and ends with a zero
        gradient where a single process would leave ``None``. Does nothing after a forward inside ``no_sync()``.
        """
        if not self._sync_this_backward or not self._backward_expected:
            return
        try:
            for slot in self._slots:
                if slot.name in self._fired:
                    continue
                if slot.unit is not None and slot.unit.local.requires_grad:
                    full = self._gathered[slot.name].param
                    grad = full.grad
                    if grad is None:
                        grad = torch.zeros(slot.unit.shape, dtype=slot.unit.dtype, device=slot.unit.local.device)
                    self.hook.scatter_gradient(slot.unit, grad)
                    full.grad = None
                elif slot.replica is not None and slot.replica.master.requires_grad:
                    self._reduce_replica(slot.replica, slot.replica.compute.grad)
            self.hook.wait_all()
            with torch.no_grad():
                for replica in self._replicas:
                    if replica.work is None:
                        continue
                    replica.work.wait()
                    if self.hazards.average:
                        replica.buffer.div_(self.world_size)
                    if replica.add_into is not None:
                        replica.add_into.add_(replica.buffer)
                    replica.work, replica.buffer, replica.add_into = None, None, None
        finally:
            self._fired = set()
            self._backward_expected = False
            self._reshard_all()

    # ------------------------------------------------------------------------------ parameters and state

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """(name, master) in parameter order: each unit's local shard, each replicated parameter's master."""
        for slot in self._slots:
            master = slot.unit.local if slot.unit is not None else slot.replica.master  # type: ignore[union-attr]
            yield (f"{prefix}.{slot.name}" if prefix else slot.name), master

    def _full(self, unit: ShardingUnit) -> torch.Tensor:
        """Unit ``unit``'s full parameter in the master's dtype, gathered from every rank (a collective)."""
        flat = torch.empty(unit.chunk * self.world_size, dtype=unit.dtype, device=unit.local.device)
        all_gather_single(flat, unit.local.detach(), group=self.group)
        return flat[: unit.numel].view(unit.shape).clone()

    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter at full shape in the master's dtype, by qualified name (collective: call on every rank)."""
        out: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for slot in self._slots:
                if slot.unit is not None:
                    out[slot.name] = self._full(slot.unit)
                else:
                    out[slot.name] = slot.replica.master.detach().clone()  # type: ignore[union-attr]
        return out

    def _named_buffers(self) -> list[tuple[str, torch.Tensor]]:
        out = []
        for prefix, sub in self.module.named_modules():
            for n, b in sub._buffers.items():
                if b is not None and n not in sub._non_persistent_buffers_set:
                    out.append((f"{prefix}.{n}" if prefix else n, b))
        return out

    def state_dict(self, *, full: bool = True) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """Parameters and persistent buffers by the wrapped module's names: full tensors (a collective, loadable
        into the unwrapped module) or, with ``full=False``, each unit's local shard (shape (chunk,)).

        A tied parameter appears under each of its names, as in torch's ``state_dict``.
        """
        if full:
            params = self.gather_full_params()
        else:
            params = {
                slot.name: (slot.unit.local if slot.unit is not None else slot.replica.master).detach().clone()  # type: ignore[union-attr]
                for slot in self._slots
            }
        out = {alias: params[slot.name] for slot in self._slots for alias in slot.aliases}
        for name, b in self._named_buffers():
            out[name] = b.detach().clone()
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor], *, full: bool = True) -> None:  # type: ignore[override]
        """Load what :meth:`state_dict` returned (``full`` as it was given there); every key must match."""
        buffers = dict(self._named_buffers())
        expected = [alias for slot in self._slots for alias in slot.aliases] + list(buffers)
        missing = [k for k in expected if k not in state]
        unexpected = [k for k in state if k not in set(expected)]
        if missing or unexpected:
            raise KeyError(
                f"FSDP.load_state_dict(full={full}): missing keys {missing}, unexpected keys {unexpected}; load a "
                "state_dict() of the same model taken with the same full="
            )
        with torch.no_grad():
            for slot in self._slots:
                value = state[slot.name]
                if slot.unit is None:
                    _copy_checked(slot.replica.master, value, slot.name)  # type: ignore[union-attr]
                    continue
                unit = slot.unit
                if full:
                    _check_shape(value, unit.shape, slot.name)
                    start, stop = unit.real
                    unit.local.zero_()
                    unit.local[: stop - start].copy_(value.reshape(-1)[start:stop])
                else:
                    _copy_checked(unit.local, value, slot.name)
            for name, b in buffers.items():
                _copy_checked(b, state[name], name)


def _check_shape(value: torch.Tensor, shape: torch.Size, name: str) -> None:
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"state for {name!r} has shape {tuple(value.shape)}, expected {tuple(shape)}")


def _copy_checked(target: torch.Tensor, value: torch.Tensor, name: str) -> None:
    _check_shape(value, target.shape, name)
    target.copy_(value)


def _remove(handles: list[Any], hook: FSDPBackwardHook) -> None:
    for handle in handles:
        handle.remove()
    hook.close()

