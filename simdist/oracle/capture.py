"""Capture each rank's training state at every optimizer step, with no change to the program.

Three process-wide hooks, installed while some capture needs them and removed after, see every rank (each rank
is a thread of this process under simdist, or the only rank of a real process):

- torch's global optimizer step post-hook (``register_optimizer_step_post_hook``) snapshots, after each
  ``optimizer.step()``, the optimizer's parameters, their gradients (synchronised by then), its state, and the
  buffers of the rank's modules. A rank's step ``k`` is the ``k``-th step of each of its optimizers.
- the global module forward pre-hook records which modules each rank runs; those not inside another one are the
  rank's root modules, whose qualified names (wrappers' prefixes removed, :mod:`simdist.oracle.names`) name
  the tensors.
- ``torch.autograd.backward`` (which ``Tensor.backward`` calls) and ``torch.autograd.grad`` record scalar roots
  whose gradient is absent or one: the losses of the step. ``grad`` matters for torch's zero-bubble pipeline
  schedules, whose last stage starts backward from each microbatch's loss with ``autograd.grad`` and a gradient
  of ones (``stage_backward_input``); other pipeline schedules call ``backward`` with ``grad_tensors=[None]``.
  The backward pass torch's pipelining runs once on placeholder inputs to infer gradient shapes is left out.

Which capture an event belongs to is decided by the thread it happens in, so that captures in several
Python threads at once (concurrent ``check_equivalence`` calls) and plain ``simdist.run`` calls beside them never
see each other's ranks: a simulated rank running a function wrapped by :meth:`Capture.bind` (and every thread
that rank starts) reports to that capture alone; any other thread reports to the captures installed with
``everywhere=True`` (a real run's rank process, which holds one rank and nothing else).

Snapshots are taken with the rank's dispatch modes disabled, so they cost no simulated time, allocate nothing
the memory accounting sees and read nothing the race detector checks. A sharded tensor is captured as the
rank's own piece with its layout (DTensor placements over its mesh, FSDP1's flat parameters, or a shard
parameter that carries :data:`~simdist.oracle.flat.SHARD_ATTR`); assembly into full tensors happens after the
run, from all ranks' pieces (:mod:`simdist.oracle.assemble`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._python_dispatch import _disable_current_modes

from simdist.clock.baton import RankState, current_rank_state
from simdist.cuda.tensor import host_values
from simdist.errors import SimdistError
from simdist.oracle.dtensors import is_dtensor
from simdist.oracle.dtensors import placements as dtensor_placements
from simdist.oracle.flat import (
    SHARD_ATTR,
    FlatLayout,
    fsdp1_layouts,
    local_piece,
    pieces_by_name,
    shard_layout,
    unpadded,
)
from simdist.oracle.names import named_tensors
from simdist.oracle.shared import SharedHooks
from simdist.oracle.tolerance import bitwise_equal
from simdist.patching import replaced

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


class UnsupportedLayoutError(SimdistError, NotImplementedError):
    """A sharded tensor laid out in a way the oracle cannot assemble (a DTensor placement it does not know)."""


@dataclass(frozen=True)
class MeshLayout:
    """How a DTensor is laid out over its device mesh; a rank's mesh coordinate says which elements its piece holds."""

    #: global ranks of the mesh, row-major, and the mesh's shape
    mesh_ranks: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    #: per mesh dimension: ("shard", dim), ("strided", dim, split factor), ("replicate",) or ("partial", reduce op)
    placements: tuple[tuple[Any, ...], ...]
    global_shape: tuple[int, ...]


#: a piece's layout: ``None`` for a plain tensor (a replica, or a hand-written shard the caller describes)
Layout = MeshLayout | FlatLayout | None


@dataclass
class Piece:
    """One rank's copy (or part) of a tensor at a step, on the host."""

    rank: int
    value: torch.Tensor
    layout: Layout = None

    def __post_init__(self) -> None:
        # a simulated GPU's tensor is kept as its host values: pieces of several ranks' devices are compared
        # with each other and with the reference's CPU tensors, and a simulated device ends with its run
        self.value = host_values(self.value)


@dataclass
class RankStep:
    """What one rank held after its ``k``-th optimizer step."""

    #: values of the scalar backward roots since the rank's previous step
    losses: list[torch.Tensor] = field(default_factory=list)
    params: dict[str, Piece] = field(default_factory=dict)
    #: ``None`` where the parameter had no gradient
    grads: dict[str, Piece | None] = field(default_factory=dict)
    #: ``"name:key"`` of every tensor (and number) in the optimizer's state
    optim: dict[str, Piece] = field(default_factory=dict)
    buffers: dict[str, Piece] = field(default_factory=dict)
    #: parameter names in the order the rank's modules define them
    order: list[str] = field(default_factory=list)


#: guards the routing tables below (read without it: each is replaced or updated in one step)
_LOCK = threading.Lock()
#: captures that every thread no :meth:`Capture.bind` wrapper claimed reports to
_everywhere: tuple[Capture, ...] = ()
#: id of a simulated rank's own :class:`RankState` -> (that state, the capture its threads report to)
_bound: dict[int, tuple[RankState, Capture]] = {}
#: ``capture``: the capture a thread outside simulated ranks reports to while a bound function runs in it
_local = threading.local()


class Capture:
    """Records every rank's :class:`RankStep` for its first ``steps`` optimizer steps (all if ``None``)."""

    def __init__(self, steps: int | None = None) -> None:
        self.steps = steps
        #: rank -> its steps, in order
        self.ranks: dict[int, list[RankStep]] = {}
        self._modules: dict[int, dict[int, nn.Module]] = {}
        self._roots: dict[int, tuple[int, list[nn.Module]]] = {}
        self._counts: dict[tuple[int, int], int] = {}
        self._losses: dict[int, list[torch.Tensor]] = {}
        self._optimizers: dict[int, dict[int, int]] = {}
        #: (step, table, name) -> the first copy taken of a plain tensor, shared by the ranks whose copy is bitwise equal
        self._copies: dict[tuple[int, str, str], torch.Tensor] = {}

    @contextlib.contextmanager
    def installed(self, everywhere: bool = True) -> Iterator[Capture]:
        """Capture for the duration of the block.

        With ``everywhere``, every thread that no :meth:`bind` wrapper has claimed for another capture reports to
        this one (a real rank process); otherwise only the simulated ranks running functions :meth:`bind` wrapped.
        """
        global _everywhere
        with _HOOKS.held():
            if everywhere:
                with _LOCK:
                    _everywhere = (*_everywhere, self)
            try:
                yield self
            finally:
                with _LOCK:
                    _everywhere = tuple(c for c in _everywhere if c is not self)
                    for key in [k for k, (_, c) in _bound.items() if c is self]:
                        del _bound[key]

    def bind(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn``, reporting to this capture alone in every simulated rank that runs it (and the threads it starts).

        Pass the result to :func:`simdist.run` inside :meth:`installed`. A coroutine or generator function is
        returned as it is, for ``simdist.run`` to refuse with its own error.
        """
        if not callable(fn) or _not_plain(fn):
            return fn
        capture = self

        @functools.wraps(fn)
        def bound(*args: Any, **kwargs: Any) -> Any:
            state = current_rank_state()
            if state is None:  # not a simulated rank: the calling thread reports here while fn runs
                previous = getattr(_local, "capture", None)
                _local.capture = capture
                try:
                    return fn(*args, **kwargs)
                finally:
                    _local.capture = previous
            while state.parent is not None:
                state = state.parent
            # kept until the capture is uninstalled: the rank's threads may step after fn returns, and holding
            # the state keeps its id from naming another run's rank meanwhile
            with _LOCK:
                _bound[id(state)] = (state, capture)
            return fn(*args, **kwargs)

        return bound

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        seen = self._modules.setdefault(_rank(), {})
        if id(module) not in seen:
            seen[id(module)] = module

    def _root(self, tensors: Any, grads: Any) -> None:
        """Record a backward root that is a loss: one scalar floating tensor whose gradient is absent or one."""
        if isinstance(tensors, (list, tuple)):
            if len(tensors) != 1:
                return
            tensors = tensors[0]
        if isinstance(grads, (list, tuple)):
            grads = grads[0] if len(grads) == 1 else grads
        if not isinstance(tensors, torch.Tensor) or tensors.numel() != 1:
            return
        if not tensors.dtype.is_floating_point or is_dtensor(tensors) or _inferring_shapes():
            return
        with _disable_current_modes(), torch.no_grad():
            # a gradient of one is what backward() supplies itself: the root is still the loss
            if grads is not None and not _is_one(grads):
                return
            self._losses.setdefault(_rank(), []).append(host_values(tensors).detach().reshape(()).clone())

    def roots(self, rank: int) -> list[nn.Module]:
        """The rank's root modules: those it ran that are not inside another module it ran."""
        seen = self._modules.get(rank, {})
        cached = self._roots.get(rank)
        if cached is not None and cached[0] == len(seen):
            return cached[1]
        inner: set[int] = set()
        for m in seen.values():
            inner.update(id(sub) for sub in m.modules() if sub is not m)
        roots = [m for k, m in seen.items() if k not in inner]
        self._roots[rank] = (len(seen), roots)
        return roots

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        rank = _rank()
        key = (rank, id(optimizer))
        k = self._counts.get(key, 0)
        self._counts[key] = k + 1
        if self.steps is not None and k >= self.steps:
            return
        number = self._optimizers.setdefault(rank, {}).setdefault(id(optimizer), len(self._optimizers[rank]))
        with _disable_current_modes(), torch.no_grad():
            self._snapshot(rank, k, number, optimizer)

    def _snapshot(self, rank: int, k: int, number: int, optimizer: torch.optim.Optimizer) -> None:
        steps = self.ranks.setdefault(rank, [])
        while len(steps) <= k:
            steps.append(RankStep())
        step = steps[k]
        step.losses.extend(self._losses.pop(rank, []))
        names: dict[int, str] = {}
        buffers: list[tuple[str, torch.Tensor]] = []
        order: list[str] = []
        flat: dict[int, FlatLayout] = {}
        for root in self.roots(rank):
            flat.update(fsdp1_layouts(root))
            params, bufs = named_tensors(root)
            for n, p in params:
                if id(p) not in names:
                    names[id(p)] = n
                    order.append(n)
            buffers += [(n, b) for n, b in bufs if isinstance(b, torch.Tensor)]
        for g, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                if id(p) in flat:
                    _flat_snapshot(step, rank, flat[id(p)], p, p.grad, optimizer.state.get(p, {}))
                    continue
                spec = getattr(p, SHARD_ATTR, None)
                if spec is not None:  # a hand-written shard that describes itself: a flat piece, padding dropped
                    one = shard_layout(spec)
                    state = {key: unpadded(one, v) if isinstance(v, torch.Tensor) else v
                             for key, v in optimizer.state.get(p, {}).items()}
                    grad = None if p.grad is None else unpadded(one, p.grad)
                    _flat_snapshot(step, rank, one, unpadded(one, p), grad, state)
                    continue
                name = names.get(id(p), f"optimizer{number}.group{g}.param{i}")
                if name not in step.order:
                    step.order.append(name)
                step.params[name] = self._piece(k, "params", name, rank, p)
                step.grads[name] = None if p.grad is None else self._piece(k, "grads", name, rank, p.grad)
                for state_key, v in optimizer.state.get(p, {}).items():
                    if isinstance(v, torch.Tensor):
                        step.optim[f"{name}:{state_key}"] = self._piece(k, "optim", f"{name}:{state_key}", rank, v)
                    elif isinstance(v, (int, float)) and not isinstance(v, bool):
                        step.optim[f"{name}:{state_key}"] = Piece(rank, torch.tensor(float(v), dtype=torch.float64))
        for n, b in buffers:
            step.buffers[n] = self._piece(k, "buffers", n, rank, b)

    def _piece(self, k: int, table: str, name: str, rank: int, tensor: torch.Tensor) -> Piece:
        """A detached copy of ``rank``'s part of ``tensor`` with its layout.

        A plain tensor bitwise equal to the copy another rank made of it at this step shares that copy: replicas
        (every DDP parameter, gradient and optimizer state) cost one comparison each instead of a copy, and the
        assembly's replica check sees the same object.
        """
        if is_dtensor(tensor):
            return Piece(rank, host_values(tensor._local_tensor).detach().clone(), mesh_layout(tensor))
        value = host_values(tensor).detach()
        key = (k, table, name)
        first = self._copies.get(key)
        if first is not None and bitwise_equal(value, first):
            return Piece(rank, first)
        copy = value.clone()
        self._copies.setdefault(key, copy)
        return Piece(rank, copy)


def _not_plain(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is a coroutine or generator function (calling it runs nothing)."""
    return inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn)


def _targets() -> tuple[Capture, ...]:
    """The captures an event in the calling thread belongs to (see the module's text)."""
    state = current_rank_state()
    if state is not None:
        while state.parent is not None:  # a thread the rank started acts as the rank
            state = state.parent
        entry = _bound.get(id(state))
        if entry is not None and entry[0] is state:
            return (entry[1],)
    else:
        mine = getattr(_local, "capture", None)
        if mine is not None:
            return (mine,)
    return _everywhere


def _install() -> Callable[[], None]:
    """Install the hooks every capture shares; returns what removes them."""
    original, original_grad = torch.autograd.backward, torch.autograd.grad

    def backward(tensors: Any, grad_tensors: Any = None, *args: Any, **kwargs: Any) -> Any:
        for capture in _targets():
            capture._root(tensors, grad_tensors)
        return original(tensors, grad_tensors, *args, **kwargs)

    def grad(outputs: Any, inputs: Any, grad_outputs: Any = None, *args: Any, **kwargs: Any) -> Any:
        for capture in _targets():
            capture._root(outputs, grad_outputs)
        return original_grad(outputs, inputs, grad_outputs, *args, **kwargs)

    def after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for capture in _targets():
            capture._after_step(optimizer, args, kwargs)

    def before_forward(module: nn.Module, args: Any) -> None:
        for capture in _targets():
            capture._before_forward(module, args)

    stack = contextlib.ExitStack()
    stack.enter_context(
        replaced("simdist.oracle.capture", {"torch.autograd.backward": backward, "torch.autograd.grad": grad})
    )
    for handle in (
        register_optimizer_step_post_hook(after_step),
        nn.modules.module.register_module_forward_pre_hook(before_forward),
    ):
        stack.callback(handle.remove)
    return stack.close


#: the process-wide hooks of every installed capture
_HOOKS = SharedHooks(_install)


def _flat_snapshot(
    step: RankStep, rank: int, layout: FlatLayout, p: torch.Tensor, grad: torch.Tensor | None, state: dict
) -> None:
    """Record ``rank``'s part of a flat-sharded parameter (FSDP1's, or a shard carrying ``SHARD_ATTR``) by name.

    A rank records nothing for a parameter it holds none of (FSDP1 gives it an empty view and no gradient);
    scalars of the optimizer state (Adam's step) are replicas on the ranks holding part of the parameter.
    """
    held = pieces_by_name(layout, local_piece(layout, p))
    for name, one, value in held:
        if name not in step.order:
            step.order.append(name)
        step.params[name] = Piece(rank, value, one)
        step.grads[name] = None
    if grad is not None:
        for name, one, value in pieces_by_name(layout, local_piece(layout, grad)):
            step.grads[name] = Piece(rank, value, one)
    for state_key, v in state.items():
        if isinstance(v, torch.Tensor) and layout.holds(v):
            for name, one, value in pieces_by_name(layout, local_piece(layout, v)):
                step.optim[f"{name}:{state_key}"] = Piece(rank, value, one)
            continue
        if isinstance(v, torch.Tensor):
            scalar = v.detach().clone()
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            scalar = torch.tensor(float(v), dtype=torch.float64)
        else:
            continue
        for name, _, _ in held:
            step.optim[f"{name}:{state_key}"] = Piece(rank, scalar)


#: torch's pipelining runs the last stage's loss function and a backward pass once before the first step, on
#: placeholder inputs, to infer the shapes of the gradients stages exchange: that root is no training loss
_SHAPE_INFERENCE = (os.path.join("torch", "distributed", "pipelining", "stage.py"), "_backward_metadata_inference")


def _inferring_shapes() -> bool:
    """Whether the calling thread is inside torch pipelining's backward shape inference."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == _SHAPE_INFERENCE[1] and code.co_filename.endswith(_SHAPE_INFERENCE[0]):
            return True
        frame = frame.f_back
    return False


def _is_one(grad: Any) -> bool:
    """Whether ``grad`` is a plain one-element tensor holding 1."""
    if not isinstance(grad, torch.Tensor) or is_dtensor(grad) or grad.numel() != 1:
        return False
    return bool(grad.detach().reshape(()) == 1)


def _rank() -> int:
    """The calling thread's global rank (0 outside a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def mesh_layout(tensor: DTensor) -> MeshLayout:
    """The layout of the calling rank's piece of ``tensor``."""
    mesh = tensor.device_mesh
    placements: list[tuple[Any, ...]] = []
    types = dtensor_placements()
    for p in tensor.placements:
        if type(p) is types.Shard:
            placements.append(("shard", p.dim))
        elif isinstance(p, types._StridedShard):
            placements.append(("strided", p.dim, int(p.split_factor)))
        elif isinstance(p, types.Replicate):
            placements.append(("replicate",))
        elif isinstance(p, types.Partial):
            placements.append(("partial", p.reduce_op))
        else:
            raise UnsupportedLayoutError(
                f"the equivalence oracle cannot assemble a DTensor placed {p!r} (placements {tensor.placements}); "
                "it knows Shard, _StridedShard, Replicate and Partial"
            )
    return MeshLayout(
        mesh_ranks=tuple(int(r.item()) for r in mesh.mesh.flatten()),  # .tolist() would wait for a device
        mesh_shape=tuple(mesh.mesh.shape),
        placements=tuple(placements),
        global_shape=tuple(tensor.shape),
    )
