"""Per-op recording of one optimizer step on every rank: what each aten op computed, where, and in which module.

A :class:`Recorder` is a dispatch mode each rank's thread enters around the user's function, above simdist's
own per-rank mode. For the ops of one optimizer step (those after the rank's previous step, its optimizer's
own ops included) it keeps an :class:`OpRecord`: the op's name, a copy of its outputs, its inputs (a reference
to the recorded op that produced each, or a copy of the value and where it came from: a collective, a
parameter, or outside the step), the module invocation it ran in (backward ops are traced to the forward
invocation that created their autograd node), the phase and the user's call site, and the last collective the
rank issued before it. Its own tensor work runs with every dispatch mode disabled, so it costs no simulated
time and the race detector and memory accounting never see it.

:func:`recording` installs the process-wide hooks this needs (module forward hooks, optimizer step hooks, an
observer of issued collectives) around a run and removes them afterwards.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.optim import optimizer as torch_optimizer
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from simdist.c10d import process_group
from simdist.clock.sites import caller_site
from simdist.cuda.tensor import SimCudaTensor, host_values
from simdist.layers import NOT_CALL_SITES
from simdist.oracle.dtensors import is_dtensor
from simdist.oracle.names import canonical_names, named_tensors
from simdist.oracle.shared import SharedHooks
from simdist.patching import replaced
from simdist.untraced import never_compiled

#: ops not recorded: they compute nothing (aliases autograd makes for itself)
_SILENT = frozenset({"aten.detach", "aten.alias", "aten.lift_fresh", "aten._to_copy.out", "aten.set_"})

#: tensor types whose storage is their data (subclasses such as DTensor dispatch to plain ops, recorded then);
#: a simulated GPU's tensor is recorded as one: the rank's mode runs its ops on the host tensor inside, unseen here
_PLAIN = (torch.Tensor, nn.Parameter, SimCudaTensor)

#: the recorder of the calling rank thread (hooks are process-wide; each rank's thread sets its own)
_current = threading.local()

#: torch pipelining's stage methods that, before a schedule's first step, run the stage's forward, the loss and
#: a backward on placeholder inputs to infer the shapes stages exchange: no training happens there, and
#: recording it would add an invocation of every module to step 0
_PIPELINE_INFERENCE = ("torch.distributed.pipelining.stage", ("PipelineStage", "_PipelineStage"),
                       ("_prepare_forward_infra", "_prepare_backward_infra"))


@dataclass(frozen=True)
class Collective:
    """One collective or point-to-point operation a rank issued (``number``: 1 for its first in the run)."""

    name: str
    number: int
    site: str
    phase: str
    module: str | None
    #: how race and mismatch reports name it: ``all_reduce #3 on group 0`` (the group's call number), or the
    #: bare name for point-to-point operations, which groups do not number
    label: str = ""

    def __str__(self) -> str:
        return f"{self.label or self.name} at {self.site}"


@dataclass(frozen=True)
class Source:
    """Where an input not produced by a recorded op came from: a collective, a parameter, or neither."""

    collective: Collective | None = None
    parameter: str | None = None
    #: the parameter whose gradient (``.grad``) this is, as the optimizer's step found it
    gradient: str | None = None
    #: for the output of an in-place reduction (an all-reduce): the recorded op whose output it reduced, as
    #: (op index, output index), when the value read is that whole tensor
    previous: tuple[int, int] | None = None

    def __str__(self) -> str:
        if self.collective is not None:
            return f"the output of {self.collective}"
        if self.gradient is not None:
            # the backward's own accumulation and a DDP reducer's copies may run where no dispatch mode sees them
            return f"the gradient of {self.gradient!r} as the backward pass and its synchronisation left it"
        if self.parameter is not None:
            return f"parameter {self.parameter!r} as the step found it"
        return "a tensor no recorded op produced (the data, or state from before the step)"


@dataclass
class OpRecord:
    """One aten op a rank ran during the recorded step."""

    index: int
    #: the op's name without overload, e.g. ``aten.div_``
    op: str
    #: "forward", "backward", "optimizer" or "other"
    phase: str
    #: (qualified module name, its invocation number within the step), None outside every module
    invocation: tuple[str, int] | None
    site: str
    #: the last collective the rank issued before this op
    collective: Collective | None
    #: copies of the tensors the op returned or wrote (None for a non-tensor output)
    outputs: list[torch.Tensor | None]
    #: per tensor input: (producing record, its output index) or (copied value, its source)
    inputs: list[tuple[int, int] | tuple[torch.Tensor, Source]]
    #: for ops outside every module: how many outermost module invocations of the step began before it, less
    #: one (a microbatch's loss follows its own forward)
    segment: int = -1
    #: the forward op whose autograd node a backward op belongs to (index), else None
    forward: int | None = None
    #: the next autograd sequence number when the op ran (maps forward ops to their autograd nodes)
    seq: int = -1
    #: for an optimizer op: the first parameter among its inputs, or whose gradient is (by qualified name)
    parameter: str | None = None
    #: for an optimizer op: input position -> the parameter whose gradient (``.grad``) that input is
    gradients: dict[int, str] = field(default_factory=dict)

    @property
    def module(self) -> str | None:
        """The qualified name of the module the op ran in (wrappers' prefixes removed), None outside any."""
        return None if self.invocation is None else self.invocation[0]

    def checksum(self) -> float:
        """Sum of the outputs' elements in float64 (a cheap fingerprint for displays)."""
        return float(sum(o.double().sum().item() for o in self.outputs if o is not None and o.is_floating_point()))


@dataclass
class Stream:
    """Everything recorded on one rank: its ops in order and its collectives."""

    rank: int
    ops: list[OpRecord] = field(default_factory=list)
    collectives: list[Collective] = field(default_factory=list)

    def input_value(self, item: tuple[int, int] | tuple[torch.Tensor, Source]) -> torch.Tensor | None:
        """The value of one recorded input."""
        a, b = item
        if isinstance(a, int):
            return self.ops[a].outputs[b]
        return a


def _key(t: torch.Tensor, bump: int = 0) -> tuple:
    """What identifies a tensor's current value (``bump`` versions on): its storage, view geometry and version."""
    return (*_view(t), t._version + bump)


def _view(t: torch.Tensor) -> tuple:
    """What identifies a tensor apart from its version: its storage and view geometry (metadata only)."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)


#: collectives that reduce a rank's tensor in place: their output is a function of the value they were given
IN_PLACE_REDUCTIONS = frozenset({"all_reduce", "all_reduce_coalesced"})


def _tensors(values: Any) -> list[torch.Tensor]:
    """The tensors among an op's arguments or results, lists flattened, in order."""
    out: list[torch.Tensor] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(x for x in v if isinstance(x, torch.Tensor))
    return out


#: op -> positions of the arguments it writes (in-place and ``out=`` ops)
_WRITES: dict[Any, tuple[int, ...]] = {}


def _written(func: Any) -> tuple[int, ...]:
    pos = _WRITES.get(func)
    if pos is None:
        pos = tuple(
            i for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write
        )
        _WRITES[func] = pos
    return pos


def _backed(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage holds all its elements (FSDP frees a storage by resizing it to 0 under the tensor)."""
    if t.numel() == 0:
        return True
    end = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1
    return t.untyped_storage().nbytes() >= end * t.element_size()


class Recorder(TorchDispatchMode):
    """One rank's per-op recorder for optimizer step ``step`` (0-based) of that rank."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __init__(self, rank: int, step: int) -> None:
        super().__init__()
        self.rank = rank
        self.step = step
        self.stream = Stream(rank)
        #: completed steps per optimizer (by id; the optimizers are kept alive in ``_optimizers``)
        self._steps: dict[int, int] = {}
        self._optimizers: list[Any] = []
        self.active = step == 0
        self._in_optimizer = 0
        #: module invocations open on this rank: (module id, invocation or None, seq at entry)
        self._stack: list[tuple[int, tuple[str, int] | None, int]] = []
        self._invocations: dict[str, int] = {}
        #: outermost module invocations begun in the step
        self._roots = 0
        #: closed invocations as autograd sequence-number intervals, ordered by start: starts, (end, inv)
        self._starts: list[int] = []
        self._spans: list[tuple[int, tuple[str, int]]] = []
        self._names: dict[int, str] = {}
        self._modules: list[nn.Module] = []
        self._params: dict[int, str] = {}
        #: (storage address, offset, shape) of each parameter's gradient when an optimizer step begins -> the
        #: parameter's name (gradients may be views of one bucket: the address alone does not tell them apart)
        self._grads: dict[tuple, str] = {}
        #: recorded outputs by :func:`_key`, and their storages, kept alive so that no later tensor reuses an
        #: address. Storages, not tensors: autograd steals a gradient only while nothing else holds the tensor,
        #: so holding tensors would change what the program does.
        self._producers: dict[tuple, tuple[int, int]] = {}
        self._alive: list[torch.UntypedStorage] = []
        #: storage address -> the collective that last wrote it
        self._writers: dict[int, Collective] = {}
        #: :func:`_view` of a tensor an in-place reduction was issued on -> the recorded op whose output it reduced
        self._reduced: dict[tuple, tuple[int, int]] = {}
        #: autograd sequence number -> the forward record that created that node
        self._node_ops: dict[int, int] = {}
        #: :func:`_key` of tensors a collective was issued to write while their version stayed (see :meth:`collective`)
        self._overwritten: set[tuple] = set()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Record nothing and count no module invocation inside the block."""
        active, self.active = self.active, False
        try:
            yield
        finally:
            self.active = active

    # ------------------------------------------------------------------ hooks (called by the process-wide hooks)
    def module_enter(self, module: nn.Module) -> None:
        """A module's forward begins on this rank."""
        name = self._names.get(id(module))
        if name is None:
            if self._stack:  # a module outside its root's tree (made on the fly): named by its class
                outer = self._stack[-1][1]
                name = f"{outer[0] + '.' if outer and outer[0] else ''}<{type(module).__name__}>"
            else:
                self._register_root(module)
                name = self._names[id(module)]
        outer_inv = self._stack[-1][1] if self._stack else None
        if outer_inv is not None and outer_inv[0] == name:
            inv = outer_inv  # a wrapper and the module it wraps are one invocation
        elif self.active:
            if not self._stack:
                self._roots += 1
            n = self._invocations.get(name, 0)
            self._invocations[name] = n + 1
            inv = (name, n)
        else:
            inv = None
        self._stack.append((id(module), inv, torch._C._autograd._get_sequence_nr()))

    def module_exit(self, module: nn.Module) -> None:
        """A module's forward returned on this rank."""
        if not self._stack or self._stack[-1][0] != id(module):
            return
        _, inv, start = self._stack.pop()
        if inv is None or (self._stack and self._stack[-1][1] == inv):
            return
        end = torch._C._autograd._get_sequence_nr()
        # an enclosing invocation closes after the ones inside it; among equal starts it goes first, so the
        # look-up (which walks back from the last start) meets the innermost first
        pos = bisect.bisect_left(self._starts, start)
        self._starts.insert(pos, start)
        self._spans.insert(pos, (end, inv))

    def _register_root(self, root: nn.Module) -> None:
        for name, module, _ in canonical_names(root):
            self._names.setdefault(id(module), name)
            self._modules.append(module)
        params, _ = named_tensors(root)
        for name, p in params:
            # a DTensor (FSDP2, tensor parallelism) has no storage of its own: its local shard has
            local = p._local_tensor if is_dtensor(p) else p
            self._params.setdefault(local.untyped_storage().data_ptr(), name)

    def optimizer_pre(self, optimizer: Any) -> None:
        """An optimizer's ``step()`` begins on this rank."""
        if id(optimizer) not in self._steps:
            self._steps[id(optimizer)] = min(self._steps.values(), default=0)
            self._optimizers.append(optimizer)
        if not self._in_optimizer:
            self._grads.clear()
        self._in_optimizer += 1
        for group in optimizer.param_groups:
            for p in group["params"]:
                grad = p.grad._local_tensor if is_dtensor(p.grad) else p.grad
                local = p._local_tensor if is_dtensor(p) else p
                name = self._params.get(local.untyped_storage().data_ptr())
                if grad is not None and name is not None:
                    self._grads[(grad.untyped_storage().data_ptr(), grad.storage_offset(), tuple(grad.shape))] = name

    def optimizer_post(self, optimizer: Any) -> None:
        """An optimizer's ``step()`` returned on this rank: the window of recorded ops moves."""
        self._in_optimizer -= 1
        self._steps[id(optimizer)] += 1
        done = min(self._steps.values())
        if self.active and done > self.step:
            self.active = False
        elif not self.active and done == self.step:
            self.active = True
            self._invocations.clear()
            self._roots = 0

    def collective(self, name: str, written: list[torch.Tensor], label: str = "") -> None:
        """This rank issues a collective (counted always; its buffers are marked only while recording)."""
        phase, inv = self._context(())
        c = Collective(name, len(self.stream.collectives) + 1, caller_site(NOT_CALL_SITES), phase, inv and inv[0], label)
        self.stream.collectives.append(c)
        if self.active:
            for t in written:
                key = _key(t)
                # the collective writes t next: an in-place op's guessed next version (see _record) is stale
                self._producers.pop(_key(t, 1), None)
                self._writers[t.untyped_storage().data_ptr()] = c
                made = self._producers.get(key)
                # a reader that still finds t at this version reads what the collective wrote, not what ``made``
                # produced: a simulated GPU tensor keeps its version when the collective writes the host tensor
                # inside it (its version counter is not the caller's), as any tensor does until the write lands
                self._overwritten.add(key)
                if name in IN_PLACE_REDUCTIONS and made is not None:
                    self._reduced[key[:-1]] = made
                else:
                    self._reduced.pop(key[:-1], None)

    # ------------------------------------------------------------------ the dispatch mode
    def _context(self, inputs: list[torch.Tensor]) -> tuple[str, tuple[str, int] | None]:
        """(phase, module invocation) of the op about to run."""
        node = torch._C._current_autograd_node()
        if self._in_optimizer:
            return "optimizer", self._stack[-1][1] if self._stack else None
        if node is not None:
            return "backward", self._invocation_of(node._sequence_nr())
        if self._stack:
            return "forward", self._stack[-1][1]
        if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
            return "forward", None
        return "other", None

    def _parameter_of(self, t: torch.Tensor) -> str | None:
        """The parameter ``t`` is, or whose gradient it is, as the current optimizer step found them."""
        ptr = t.untyped_storage().data_ptr()
        return self._grads.get((ptr, t.storage_offset(), tuple(t.shape))) or self._params.get(ptr)

    def _invocation_of(self, seq: int) -> tuple[str, int] | None:
        """The innermost module invocation whose forward created the autograd node ``seq``."""
        i = bisect.bisect_right(self._starts, seq) - 1
        while i >= 0:
            end, inv = self._spans[i]
            if seq < end:
                return inv
            i -= 1
        return None

    @never_compiled
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not self.active:
            return func(*args, **kwargs)
        name = str(func.overloadpacket)
        if func.namespace != "aten" or name in _SILENT:
            return func(*args, **kwargs)
        inputs = _tensors(args) + _tensors(kwargs.values())
        if any(type(t) not in _PLAIN for t in inputs):
            return func(*args, **kwargs)  # a tensor subclass's op: the plain ops it runs are recorded instead
        keys = [_key(t) for t in inputs]
        written = _written(func)
        before: dict[int, torch.Tensor] = {}
        if written:
            # values an in-place op overwrites, if no recorded op made them, must be copied before it runs
            targets = {id(t) for i in written if i < len(args) for t in _tensors((args[i],))}
            with _disable_current_modes(), torch.no_grad():
                for i, t in enumerate(inputs):
                    produced = keys[i] in self._producers and keys[i] not in self._overwritten
                    if id(t) in targets and not produced and _backed(t):
                        before[i] = host_values(t).detach().clone()
        context = self._context(inputs)  # before the op, and outside the no_grad below (the phase reads grad mode)
        out = func(*args, **kwargs)
        with _disable_current_modes(), torch.no_grad():
            self._record(name, args, inputs, keys, before, out, written, context)
        return out

    def _record(
        self,
        name: str,
        args: tuple,
        inputs: list[torch.Tensor],
        keys: list[tuple],
        before: dict[int, torch.Tensor],
        out: Any,
        written: tuple[int, ...],
        context: tuple[str, tuple[str, int] | None],
    ) -> None:
        stream = self.stream
        index = len(stream.ops)
        phase, inv = context
        recorded_inputs: list[tuple[int, int] | tuple[torch.Tensor, Source]] = []
        for i, t in enumerate(inputs):
            ref = None if keys[i] in self._overwritten else self._producers.get(keys[i])
            if ref is not None:
                recorded_inputs.append(ref)
                continue
            value = before.get(i)
            if value is None:
                value = host_values(t).detach().clone()
            ptr = t.untyped_storage().data_ptr()
            writer = self._writers.get(ptr)
            recorded_inputs.append((value, Source(
                writer, self._params.get(ptr), self._grads.get((ptr, t.storage_offset(), tuple(t.shape))),
                self._reduced.get(keys[i][:-1]) if writer is not None else None,
            )))
        results = _tensors(out if isinstance(out, (tuple, list)) else (out,))
        if not results and written:
            results = _tensors(tuple(args[i] for i in written if i < len(args)))
        outputs: list[torch.Tensor | None] = []
        for j, t in enumerate(results):
            outputs.append(host_values(t).detach().clone())
            self._producers[_key(t)] = (index, j)
            self._overwritten.discard(_key(t))
            if written and any(t is x for x in inputs):
                # an in-place or out= op bumps the version of what it writes only on its way back through
                # autograd's ADInplaceOrView kernel, after this mode has returned: the readers see one version
                # on (a collective that writes the tensor next drops this guess before it can mislead)
                self._producers[_key(t, 1)] = (index, j)
            self._alive.append(t.untyped_storage())
        seq = torch._C._autograd._get_sequence_nr()
        rec = OpRecord(index, name, phase, inv, "", stream.collectives[-1] if stream.collectives else None,
                       outputs, recorded_inputs, segment=self._roots - 1, seq=seq)
        if phase == "optimizer":
            rec.parameter = next((n for n in map(self._parameter_of, inputs) if n is not None), None)
            for i, t in enumerate(inputs):
                name = self._grads.get((t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)))
                if name is not None:
                    rec.gradients[i] = name
        if phase == "backward":
            node = torch._C._current_autograd_node()
            rec.forward = self._node_ops.get(node._sequence_nr()) if node is not None else None
        else:
            self._node_ops.setdefault(seq - 1, index)
        fwd = stream.ops[rec.forward] if rec.forward is not None else None
        if fwd is not None:
            rec.segment = fwd.segment
        rec.site = f"backward of {fwd.op} at {fwd.site}" if fwd is not None else str(caller_site(NOT_CALL_SITES))
        stream.ops.append(rec)


def recorder() -> Recorder | None:
    """The recorder of the calling rank thread, None elsewhere."""
    return getattr(_current, "recorder", None)


def wrap(fn: Callable[..., Any], step: int, recorders: dict[int, Recorder], rank_of: Callable[[], int]) -> Callable[..., Any]:
    """``fn`` run under a fresh :class:`Recorder` for step ``step`` in each rank's thread (kept in ``recorders``)."""

    def recorded(*args: Any, **kwargs: Any) -> Any:
        rank = rank_of()
        rec = recorders[rank] = Recorder(rank, step)
        _current.recorder = rec
        try:
            with rec:
                return fn(*args, **kwargs)
        finally:
            rec.active = False
            _current.recorder = None

    return recorded


def _pre_forward(module: nn.Module, args: Any) -> None:
    rec = recorder()
    if rec is not None:
        rec.module_enter(module)


def _post_forward(module: nn.Module, args: Any, output: Any) -> None:
    rec = recorder()
    if rec is not None:
        rec.module_exit(module)


def _pre_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    rec = recorder()
    if rec is not None:
        rec.optimizer_pre(optimizer)


def _post_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    rec = recorder()
    if rec is not None:
        rec.optimizer_post(optimizer)


def _issued(group: Any, name: str, written: list[torch.Tensor]) -> None:
    rec = recorder()
    if rec is not None:
        label = "" if name in ("send", "recv") else f"{name} #{group.state.next_seq(group.grank)} on group {group.group_name or 'default'}"
        rec.collective(name, written, label)


def _unrecorded(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` run with the calling rank's recorder paused."""

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        rec = recorder()
        if rec is None:
            return method(*args, **kwargs)
        with rec.paused():
            return method(*args, **kwargs)

    return run


#: the targets of torch pipelining's shape inference methods patched while recording, and what restores them
_patched: list[str] = []
_unpatch = contextlib.ExitStack()
_patch_lock = threading.Lock()


def _patch_pipelining() -> None:
    """Pause recording in torch pipelining's shape inference, if the program imported pipelining.

    Checked at every :func:`recording`, not only the one that installed the hooks: pipelining may have been
    imported since (it is not imported here: it costs half a second).
    """
    module_name, classes, methods = _PIPELINE_INFERENCE
    module = sys.modules.get(module_name)
    with _patch_lock:
        for c in classes:
            cls = getattr(module, c, None)
            for name in methods:
                target = f"{module_name}.{c}.{name}"
                if not isinstance(cls, type) or name not in cls.__dict__ or target in _patched:
                    continue
                _unpatch.enter_context(replaced(_OWNER, {target: _unrecorded(cls.__dict__[name])}))
                _patched.append(target)


#: the patches of simdist.patching.INVENTORY this module makes
_OWNER = "simdist.oracle.record"


def _install() -> Callable[[], None]:
    """Install the process-wide hooks every recorder shares; returns what removes them."""
    handles = [
        nn.modules.module.register_module_forward_pre_hook(_pre_forward),
        # always_call: a forward that raises still closes its invocation
        nn.modules.module.register_module_forward_hook(_post_forward, always_call=True),
        torch_optimizer.register_optimizer_step_pre_hook(_pre_step),
        torch_optimizer.register_optimizer_step_post_hook(_post_step),
    ]
    process_group.ISSUE_OBSERVERS.append(_issued)

    def remove() -> None:
        with _patch_lock:
            _unpatch.close()
            _patched.clear()
        if _issued in process_group.ISSUE_OBSERVERS:
            process_group.ISSUE_OBSERVERS.remove(_issued)
        for h in handles:
            h.remove()

    return remove


#: the process-wide hooks of every recording in progress (concurrent localisations share one set)
_HOOKS = SharedHooks(_install)


@contextlib.contextmanager
def recording() -> Iterator[None]:
    """Hold the process-wide hooks the recorders need; the last holder removes them, whatever happens.

    The hooks route every event to the recorder of the rank thread it happens in (:func:`wrap`), so recordings
    in several Python threads at once, and plain runs beside them, never see each other's ranks.
    """
    with _HOOKS.held():
        _patch_pipelining()
        yield
