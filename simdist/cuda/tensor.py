"""A tensor on a simulated GPU, and how each aten op on one runs: on the CPU tensor it holds, checked as CUDA
checks it, its results wrapped again.

The construction is DTensor's: a storage-less wrapper subclass (``_make_wrapper_subclass``) whose device is
``cuda:i``, so torch dispatches as for CUDA (autograd, CUDA autocast's kernels, DDP and FSDP's device checks)
while every kernel runs on the CPU tensor the wrapper holds (``_elem``). Results are bit for bit those of the
same program written for the CPU: the same CPU kernels compute them.

Per op (:func:`unwrap`, then :func:`rewrap`): operands are unwrapped; operands on two devices are refused as
CUDA refuses them (CPU scalars, copies, CPU indices and collectives are allowed); ``device="cuda"`` means the
calling thread's current device; results come back on the operands' device, and an in-place or ``out=`` op
returns the caller's own tensor. Ops on other tensor subclasses (DTensor, funcol's AsyncCollectiveTensor) are
left to them first (they unwrap to these); fake tensors (tracing) pass through untouched. Random ops draw from
the device's own generator, as on CUDA, not from the CPU's.
"""

from __future__ import annotations

import itertools
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass, transform_subclass

from simdist import uninitialised
from simdist.cuda import device, pending, philox
from simdist.cuda.fallbacks import FALLBACKS, unsupported
from simdist.cuda.meta_outputs import MetaOutputs
from simdist.cuda.rngstate import DeviceGenerator
from simdist.cuda.swap import swap_keeping_own
from simdist.errors import DeviceMismatchError, HostConversionError, NoValuesError
from simdist.untraced import never_compiled

CPU = torch.device("cpu")
#: what a simulated GPU's tensors hold in a timing-only run (``tensors="fake"``): shapes, dtypes, no values
META = torch.device("meta")
aten = torch.ops.aten
#: torch's own ``Tensor.data`` descriptor (C++ metadata only)
_TENSOR_DATA = torch.Tensor.data
#: torch's bindings that hold a C++ device guard around the op (see :mod:`simdist.cuda.pending`)
_TENSOR_COPY = torch.Tensor.copy_
_TENSOR_SETITEM = torch.Tensor.__setitem__
_TENSOR_GETITEM = torch.Tensor.__getitem__
_TENSOR_NEW_TENSOR = torch.Tensor.new_tensor
#: the CPU generator's own state methods (a device generator's own add CUDA's seed and offset)
_CPU_GET_STATE = torch._C.Generator.get_state
_CPU_SET_STATE = torch._C.Generator.set_state
#: torch's own ``torch.utils.swap_tensors`` (a run replaces it: :func:`swapping`)
_TORCH_SWAP = torch.utils.swap_tensors
#: what a wrapper's Python object holds for its data (the CPU tensor, the device, the mark ``nn.Parameter`` puts on
#: a subclass): a swap moves it with the data; the object's other attributes are its own
_DATA_STATE = frozenset({"_elem", "_dev", "_is_param"})


class SimCudaTensor(torch.Tensor):
    """A tensor on simulated CUDA device ``_dev``; its values are the CPU tensor ``_elem``."""

    _elem: torch.Tensor
    _dev: torch.device

    @staticmethod
    def __new__(cls, elem: torch.Tensor, dev: torch.device, requires_grad: bool = False) -> SimCudaTensor:  # noqa: PYI034
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            elem.size(),
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            layout=elem.layout,
            device=dev,
            requires_grad=requires_grad,
        )
        out._elem = elem
        out._dev = dev
        return out

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        if self._elem.is_meta:  # a timing-only run's tensor: shape and dtype, as torch shows a meta tensor
            return (
                f"tensor(..., device='{self._dev}', size={tuple(self.shape)}, dtype={self.dtype}, no values)"
            )
        text = torch._tensor_str._str(self, tensor_contents=tensor_contents)
        return "tensor" + text[len(type(self).__name__) :] if text.startswith(type(self).__name__) else text

    def is_pinned(self, device: Any = None) -> bool:
        """False: device memory is not pinned host memory (on the CPU the tensor inside answers for the host)."""
        return False

    def record_stream(self, stream: Any) -> None:
        """One stream per simulated device: the memory is never reused early, nothing to record."""

    # ------------------------------------------------------------------ reads to the host
    def tolist(self) -> Any:
        """The values as (nested) Python numbers, copied to the host first as for a CUDA tensor."""
        return self.cpu().tolist()

    def numpy(self, *, force: bool = False) -> Any:
        """Refused as for a CUDA tensor; ``force=True`` copies to the host first, as torch does."""
        if force:
            return self.detach().cpu().numpy()
        raise HostConversionError(
            f"can't convert {self._dev} device type tensor to numpy. Use Tensor.cpu() to copy the tensor to host "
            "memory first. (The tensor is on a simulated GPU, which refuses this as a real one does.)"
        )

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        return self.numpy()

    def __format__(self, spec: str) -> str:
        if self.dim() == 0:
            return self.item().__format__(spec)
        return object.__format__(self, spec)

    # ------------------------------------------------------------------ the data, for Python callers
    # The wrapper has no storage of its own: Python code that resizes storage (FSDP2 frees unsharded
    # parameters so) or compares data pointers gets the CPU tensor's. C++ callers see the wrapper's.
    def untyped_storage(self) -> torch.UntypedStorage:
        """The CPU tensor's storage (the wrapper has none)."""
        return self._elem.untyped_storage()

    def data_ptr(self) -> int:
        """The CPU tensor's data pointer (the wrapper has none)."""
        return self._elem.data_ptr()

    # ------------------------------------------------------------------ bindings under a C++ device guard
    # An error raised in the op reaches the program through simdist.cuda.pending, not as a SystemError
    def copy_(self, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        """As ``torch.Tensor.copy_``."""
        return pending.guarded(_TENSOR_COPY, self, src, non_blocking)

    def __getitem__(self, key: Any) -> Any:
        return pending.guarded(_TENSOR_GETITEM, self, key)

    def __setitem__(self, key: Any, value: Any) -> None:
        pending.guarded(_TENSOR_SETITEM, self, key, value)

    def new_tensor(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """As ``torch.Tensor.new_tensor``."""
        return pending.guarded(_TENSOR_NEW_TENSOR, self, *args, **kwargs)

    # ``x.data = y`` copies y's C++ metadata into x's TensorImpl, not its Python attributes: without this setter
    # x would keep reading its old CPU tensor (FSDP1's flat-parameter views, weight surgery, dtype changes)
    @property
    def data(self) -> torch.Tensor:
        """A detached alias of this tensor, on the same simulated device (as ``torch.Tensor.data``)."""
        return _TENSOR_DATA.__get__(self)

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        if type(new) is SimCudaTensor:
            _TENSOR_DATA.__set__(self, new)
            self._elem = new._elem
            self._dev = new._dev
        else:
            _take_host_data(self, new)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # torch.load(weights_only=True) refuses classes it does not know: saved as the CPU tensor it holds, what
        # torch.load(map_location="cpu") of a real checkpoint gives
        if self._elem.is_meta:
            # a timing-only run's tensor: a checkpoint of meta tensors would load without an error and hold nothing
            raise NoValuesError(
                f"saving a tensor on {self._dev} (torch.save, pickle) copies its values to the host, and this run is "
                'timing-only (tensors="fake"): its tensors hold shapes and dtypes but no values. Leave checkpoints '
                'out of the timed code, or run with tensors="real" at a size that fits'
            )
        return self._elem.detach().clone().requires_grad_(self.requires_grad).__reduce_ex__(protocol)

    # ------------------------------------------------------------------ a traceable wrapper subclass
    # nn.Module.to/cuda swaps parameters in place for subclasses that declare these (Parameter identity and
    # weight ties are kept), and memory accounting and torch.compile look inside through them.
    def __tensor_flatten__(self) -> tuple[list[str], torch.device]:
        return ["_elem"], self._dev

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, torch.Tensor], dev: torch.device, outer_size: Any, outer_stride: Any
    ) -> SimCudaTensor:
        return SimCudaTensor(inner["_elem"], dev)

    @classmethod
    @never_compiled
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # Reached where no rank's dispatch mode is active (a simulator thread, code that disables modes):
        # the op runs as under the mode, uncharged, its results kept where its operands keep their data (the
        # meta device in a timing-only run).
        call = unwrap(func, args, kwargs or {}, _elem_device(args, kwargs))
        if call is None:
            return func(*args, **(kwargs or {}))
        if call is NotImplemented:
            return NotImplemented
        return rewrap(call, call.run())


def _elem_device(args: Any, kwargs: dict[str, Any] | None) -> torch.device:
    """Where the simulated-GPU operands of a call keep their data: the meta device where the first one's is
    there (a timing-only run), else the CPU."""
    for a in itertools.chain(args, (kwargs or {}).values()):
        items = a if isinstance(a, (list, tuple)) else (a,)
        for t in items:
            if type(t) is SimCudaTensor:
                return META if t._elem.is_meta else CPU
    return CPU


def host_values(t: torch.Tensor) -> torch.Tensor:
    """The CPU tensor holding ``t``'s values where ``t`` is on a simulated GPU, else ``t``: what simdist's own
    bookkeeping (the equivalence oracle's snapshots) reads, with no copy priced and no device waited for."""
    return t._elem if isinstance(t, SimCudaTensor) else t


def _take_host_data(t: SimCudaTensor, new: torch.Tensor) -> None:
    """``t.data = new`` for ``new`` off the simulated GPUs (``Module.cpu()`` does it): on CUDA ``t`` becomes a host
    tensor, keeping its identity; here its Python object is swapped with one of ``new``'s (a wrapper cannot hold
    host data), keeping ``requires_grad``, its being a parameter, and its gradient (moved alongside)."""
    if type(new) is not torch.Tensor and type(new) is not torch.nn.Parameter:
        raise DeviceMismatchError(
            f"tensor.data = <a {type(new).__name__}> for a tensor on {t._dev}: a tensor on a simulated GPU can take "
            "the data of a plain tensor only"
        )
    grad, requires_grad = t.grad, t.requires_grad
    replacement = new.detach()
    replacement = (
        torch.nn.Parameter(replacement, requires_grad=requires_grad)
        if isinstance(t, torch.nn.Parameter)
        else replacement.requires_grad_(requires_grad)
    )
    if grad is not None:
        t.grad = None  # the gradient's reference would block the swap
    try:
        swap_keeping_own(_TORCH_SWAP, t, replacement, _DATA_STATE)
    except RuntimeError as e:
        if grad is not None:
            t.grad = grad
        raise DeviceMismatchError(
            f"tensor.data = <a tensor on {new.device}> for a tensor on {t._dev}: a tensor on a simulated GPU becomes "
            f"a host tensor only where nothing else holds it ({e}). Make a new tensor instead (x = x.to({str(new.device)!r}))"
        ) from e
    if grad is not None:
        t.grad = grad.to(device=new.device, dtype=new.dtype) if grad.shape == new.shape else None


def swapping(
    swap: Callable[[torch.Tensor, torch.Tensor], None],
) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """``torch.utils.swap_tensors`` (``swap``) for a run: where a tensor on a simulated GPU takes part, the swap
    stands for the ``param.data = moved`` a GPU makes (``Module.to``), and each object keeps its
    attributes and hooks (:mod:`simdist.cuda.swap`); other swaps are torch's."""

    def swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> None:
        if isinstance(t1, SimCudaTensor) or isinstance(t2, SimCudaTensor):
            swap_keeping_own(swap, t1, t2, _DATA_STATE)
        else:
            swap(t1, t2)

    swap_tensors.__doc__ = swap.__doc__
    return swap_tensors


# ---------------------------------------------------------------------------------------------- per op
#: ops that take tensors on several devices by design, as CUDA's do: copies between host and device, indexing
#: a device tensor with host indices, storage swaps, lifting a constant, CTC's lengths
_MIXED_DEVICES = frozenset(
    {
        aten.copy_.default,
        aten._to_copy.default,
        aten._copy_from.default,
        aten._copy_from_and_resize.default,
        aten.index.Tensor,
        aten.index_put_.default,
        aten.index_put.default,
        aten._index_put_impl_.default,
        aten.set_.source_Storage,
        aten.set_.source_Storage_storage_offset,
        aten.set_.source_Tensor,
        aten.lift_fresh.default,
        aten.lift_fresh_copy.default,
        # CTC's sequence lengths may stay on the host, as CUDA's kernels take them
        aten._use_cudnn_ctc_loss.Tensor,
        aten._use_miopen_ctc_loss.Tensor,
        aten._ctc_loss.Tensor,
        aten._ctc_loss_backward.Tensor,
    }
)
#: namespaces whose ops move data between ranks or devices (collectives take and give device buffers)
_MIXED_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional", "_dtensor", "fsdp"})
#: namespaces of collectives that reach a process group with the CPU tensors of their device operands
_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional", "_dtensor"})
#: the kernels a functional collective runs on host tensors, reached by redispatch from meta ones
_HOST_KERNELS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)

#: per thread, how many collectives with simulated-GPU operands are running (their buffers reach the process
#: group unwrapped, and the group must take them for device memory)
_ON_DEVICE = threading.local()


def collective_on_device() -> bool:
    """Whether the calling thread is inside a collective op whose operands are on a simulated GPU: the CPU tensors
    a process group gets from it hold device memory (functional collectives reach the group so)."""
    return getattr(_ON_DEVICE, "depth", 0) > 0


class _Schema:
    """What :func:`unwrap` and :func:`rewrap` need to know about one OpOverload, computed once."""

    __slots__ = ("alias_names", "aliases", "generator", "mixed", "random")

    def __init__(self, func: Any) -> None:
        schema = func._schema
        arguments = schema.arguments
        # output i is the caller's argument j when both carry the same written alias set (in-place, out=)
        self.aliases: list[int | None] = []
        for r in schema.returns:
            found = None
            if r.alias_info is not None and r.alias_info.is_write:
                for j, a in enumerate(arguments):
                    info = a.alias_info
                    if info is not None and info.is_write and info.before_set == r.alias_info.before_set:
                        found = j
                        break
            self.aliases.append(found)
        self.alias_names: list[str | None] = [None if j is None else arguments[j].name for j in self.aliases]
        self.mixed: bool = func in _MIXED_DEVICES or func.namespace in _MIXED_NAMESPACES
        self.random: bool = torch.Tag.nondeterministic_seeded in func.tags
        self.generator: bool = any(a.name == "generator" for a in arguments)


_SCHEMAS: dict[Any, _Schema] = {}


def _schema(func: Any) -> _Schema:
    info = _SCHEMAS.get(func)
    if info is None:
        info = _SCHEMAS[func] = _Schema(func)
    return info


class Call:
    """One op with its simulated-GPU operands unwrapped: run it on their CPU tensors, then :func:`rewrap`."""

    __slots__ = (
        "args",
        "device",
        "elem_device",
        "func",
        "host_operand",
        "kwargs",
        "orig_args",
        "orig_kwargs",
        "out_device",
    )

    def __init__(
        self, func: Any, args: Any, kwargs: dict[str, Any], orig_args: Any, orig_kwargs: dict[str, Any]
    ) -> None:
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self.orig_args = orig_args
        self.orig_kwargs = orig_kwargs
        #: the simulated device the op involves (an operand's, or a ``device=`` argument's)
        self.device: torch.device | None = None
        #: the device its results are on: None when they stay on the host (``.to("cpu")``, ``empty(device="cpu")``)
        self.out_device: torch.device | None = None
        #: a host tensor of at least one dimension is an operand (a copy from or to the host)
        self.host_operand = False
        #: where the simulated GPU's tensors keep their data: the CPU, or the meta device in a timing-only run
        self.elem_device = CPU

    def run(
        self,
        generator: Callable[[int], DeviceGenerator | None] | None = None,
        meta_outputs: MetaOutputs | None = None,
    ) -> Any:
        """Run the op on the CPU tensors; a random op draws from the device's generator (``generator(index)``):
        from its CPU generator, or counter-based numbers at its Philox offset inside DTensor's RNG region.
        Memory the op leaves uninitialised is filled as torch's deterministic mode fills it. On meta tensors (a
        timing-only run), ``meta_outputs`` remakes results it has seen (see :mod:`simdist.cuda.meta_outputs`)."""
        if self.func not in uninitialised.OPS:
            return self._run(generator, meta_outputs)
        before = uninitialised.stored_bytes(self.func, self.args)
        out = self._run(generator, meta_outputs)
        uninitialised.fill(self.func, out, before)
        return out

    def _run(
        self,
        generator: Callable[[int], DeviceGenerator | None] | None,
        meta_outputs: MetaOutputs | None = None,
    ) -> Any:
        """The op on the CPU tensors (see :meth:`run`)."""
        func, args, kwargs = self.func, self.args, self.kwargs
        fallback = FALLBACKS.get(func)
        if fallback is not None:
            return fallback(*args, **kwargs)
        if self.device is not None and func.namespace in _COLLECTIVE_NAMESPACES:
            _ON_DEVICE.depth = getattr(_ON_DEVICE, "depth", 0) + 1
            try:
                if self.elem_device == META and func.namespace != "c10d":
                    # a timing-only run's tensors are meta tensors, whose functional-collective kernels are
                    # funcol's Python ones for tracing: they return without communicating. The CPU kernels (torch's
                    # C++ ones, simdist's run-scoped ones) reach the process group as with data.
                    return func.redispatch(_HOST_KERNELS, *args, **kwargs)
                return func(*args, **kwargs)
            finally:
                _ON_DEVICE.depth -= 1
        try:
            if generator is not None and self.device is not None and _schema(func).random:
                gen = generator((self.out_device or self.device).index)
                if gen is not None:
                    if gen.at_offset:
                        return philox.draw(func, args, kwargs, gen)
                    if kwargs.get("generator") is None:
                        return _advanced(gen, _with_generator(func, args, kwargs, gen))
            if meta_outputs is not None and self.elem_device == META:
                return meta_outputs.call(func, args, kwargs)
            return func(*args, **kwargs)
        except NotImplementedError as e:
            if self.device is None or _has_cpu_kernel(func):
                raise
            raise unsupported(func, self.device) from e

    def inputs(self) -> list[Any]:
        """The caller's simulated-GPU operands (wrappers), in argument order."""
        out = [a for a in self.orig_args if type(a) is SimCudaTensor]
        for a in self.orig_args:
            if isinstance(a, (list, tuple)):
                out.extend(t for t in a if type(t) is SimCudaTensor)
        return out


def _has_cpu_kernel(func: Any) -> bool:
    """Whether ``func`` runs on CPU tensors (a CPU kernel, or a composite one that decomposes into such)."""
    name = func.name()
    return any(
        torch._C._dispatch_has_kernel_for_dispatch_key(name, key)
        for key in ("CPU", "CompositeExplicitAutograd", "CompositeImplicitAutograd")
    )


def _with_generator(func: Any, args: Any, kwargs: dict[str, Any], gen: DeviceGenerator) -> Any:
    """Run a random op drawing from ``gen``'s CPU generator: as its generator argument, or (ops without one, such
    as dropout) in place of the CPU default generator's state for the op's duration."""
    if _schema(func).generator:
        return func(*args, **{**kwargs, "generator": gen})
    cpu = torch.default_generator
    saved = cpu.get_state()
    cpu.set_state(_CPU_GET_STATE(gen))
    try:
        return func(*args, **kwargs)
    finally:
        _CPU_SET_STATE(gen, cpu.get_state())
        cpu.set_state(saved)


def _advanced(gen: DeviceGenerator, result: Any) -> Any:
    """``result`` of a random op that drew from ``gen``, whose Philox offset moves past it, as CUDA's does."""
    drawn = result[0] if isinstance(result, (tuple, list)) else result
    gen.advance(drawn.numel() if isinstance(drawn, torch.Tensor) else 0)
    return result


def _fake(t: torch.Tensor) -> bool:
    # No FakeTensor exists unless torch has loaded its module (importing it costs over a second).
    module = sys.modules.get("torch._subclasses.fake_tensor")
    return module is not None and isinstance(t, module.FakeTensor)


def _joined(func: Any, dev: torch.device | None, t: SimCudaTensor) -> torch.device:
    """The device of a call's simulated-GPU operands so far, with ``t``'s: an operand on another GPU is CUDA's
    device mismatch."""
    if dev is None:
        return t._dev
    if t._dev != dev:
        raise _mismatch(func, dev, t._dev)
    return dev


def _mismatch(func: Any, first: torch.device, second: torch.device) -> DeviceMismatchError:
    return DeviceMismatchError(
        f"Expected all tensors to be on the same device, but found at least two devices, {first} and {second}! "
        f"(in {func._schema.name}, which CUDA runs on one device: move one operand with .to({str(first)!r}) or "
        f".to({str(second)!r}))"
    )


#: ``Tensor.to``'s overloads: composite ops that reach a dispatch mode undecomposed where autograd is skipped
#: (DTensor's random-number tracker moves a generator state to the device so)
TO_OVERLOADS = frozenset({aten.to.device, aten.to.dtype, aten.to.dtype_layout, aten.to.other})
#: the copies a timing-only run keeps host values through (:func:`without_values`); looked up once, not per op
TO_COPY = aten._to_copy.default
COPY = aten.copy_.default


def _as_to_copy(func: Any, args: Any, kwargs: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    """A ``Tensor.to`` call as what it decomposes to: ``_to_copy`` (a copy, across devices included), or ``alias``
    when nothing changes, as ``to`` returns its own tensor then."""
    arguments = func._schema.arguments
    values = {a.name: a.default_value if a.has_default_value() else None for a in arguments}
    values.update(zip((a.name for a in arguments), args))
    values.update(kwargs)
    src = values["self"]
    if func is aten.to.other:
        dev, dtype = values["other"].device, values["other"].dtype
    else:
        dev, dtype = values.get("device"), values.get("dtype")
    if isinstance(dev, str):
        dev = torch.device(dev)
    if isinstance(dev, torch.device) and dev.type == "cuda":
        dev = device.resolve(dev.index)
    same = (dev is None or dev == src.device) and (dtype is None or dtype == src.dtype)
    fmt = values.get("memory_format")
    if same and not values.get("copy") and fmt in (None, torch.preserve_format):
        return aten.alias.default, (src,), {}
    copy_kwargs = {"dtype": dtype, "device": dev, "non_blocking": bool(values.get("non_blocking"))}
    for name in ("layout", "pin_memory", "memory_format"):
        if values.get(name) is not None:
            copy_kwargs[name] = values[name]
    return aten._to_copy.default, (src,), copy_kwargs


def _plain(kind: type) -> bool:
    """Whether tensors of ``kind`` hold their data themselves: ``torch.Tensor``, ``nn.Parameter`` and their
    subclasses that add attributes but no ``__torch_dispatch__`` of their own (as libraries' parameter classes
    do); a wrapper subclass (DTensor, a fake tensor) unwraps first."""
    return kind is torch.Tensor or kind is torch.nn.Parameter or kind.__torch_dispatch__ is _NO_DISPATCH


#: what a tensor class without a ``__torch_dispatch__`` of its own has in its place
_NO_DISPATCH = torch.Tensor.__torch_dispatch__


#: argument types that neither are nor name a simulated GPU's memory: plain host tensors and what is not a tensor
#: (``unwrap`` ignores the others; a ``torch.device`` matters only where it is CUDA's)
_HOST_KINDS = frozenset({torch.Tensor, torch.nn.Parameter, int, float, bool, str, type(None)}) | frozenset(
    {torch.dtype, torch.layout, torch.memory_format}
)


def _host_value(a: Any) -> bool:
    """Whether ``a`` is of a host kind, a list or tuple of such, or a device other than CUDA's."""
    kind = type(a)
    if kind in _HOST_KINDS:
        return True
    if kind is list or kind is tuple:
        for t in a:
            if type(t) not in _HOST_KINDS:
                return False
        return True
    return kind is torch.device and a.type != "cuda"


def on_host(args: Any, kwargs: dict[str, Any] | None) -> bool:
    """Whether a call's arguments hold only plain host tensors and values that name no CUDA device, so that
    :func:`unwrap` returns None for it (``False`` says nothing: ask :func:`unwrap`). Not for ``Tensor.to``'s
    overloads, whose device may be a string. Runs on every op of a GPU cluster's ranks, most of them host ops of
    programs written for the CPU: a microsecond where :func:`unwrap`'s walk takes several."""
    for a in args:
        if type(a) not in _HOST_KINDS and not _host_value(a):
            return False
    if kwargs:
        for a in kwargs.values():
            if type(a) not in _HOST_KINDS and not _host_value(a):
                return False
    return True


def unwrap(func: Any, args: Any, kwargs: dict[str, Any], target: torch.device = CPU) -> Call | None | Any:
    """``func``'s call with simulated-GPU operands replaced by their CPU tensors.

    ``target`` is where the simulated GPU's tensors keep their data: the CPU, or ``META`` in a timing-only run (a
    ``device="cuda"`` argument becomes ``target``, so that new tensors hold no values either).

    Returns None when the op involves no simulated GPU (a host op: run it as it is), ``NotImplemented`` when
    another tensor subclass must unwrap first, or the :class:`Call`. Raises :class:`DeviceMismatchError` where
    CUDA would refuse the operands' devices.
    """
    if func in TO_OVERLOADS:
        func, args, kwargs = _as_to_copy(func, args, kwargs)
    dev: torch.device | None = None
    host = False
    new_args: list[Any] | None = None
    for i, a in enumerate(args):
        kind = type(a)
        if kind is SimCudaTensor:
            dev = _joined(func, dev, a)
            if new_args is None:
                new_args = list(args)
            new_args[i] = a._elem
        elif (
            kind is torch.Tensor
            or kind is torch.nn.Parameter
            or (isinstance(a, torch.Tensor) and _plain(kind))
        ):
            if a.dim() > 0 and not a.is_meta:
                host = True
        elif isinstance(a, torch.Tensor):
            if _fake(a):
                return None  # tracing or shape propagation: nothing runs, nothing to unwrap
            return NotImplemented  # DTensor, AsyncCollectiveTensor, ...: they unwrap to these first
        elif (kind is list or kind is tuple) and a and type(a[0]) is list:
            # lists of tensor lists: a collective's outputs (all_gather's, gather's) or inputs (scatter's), which
            # a process group of real processes reads in C++
            nested = []
            for inner in a:
                items = list(inner)
                for j, t in enumerate(items):
                    if type(t) is SimCudaTensor:
                        dev = _joined(func, dev, t)
                        items[j] = t._elem
                nested.append(items)
            if new_args is None:
                new_args = list(args)
            new_args[i] = nested
        elif kind is list or kind is tuple:
            if a and isinstance(a[0], torch.Tensor) or any(type(t) is SimCudaTensor for t in a):
                items = list(a)
                for j, t in enumerate(items):
                    if type(t) is SimCudaTensor:
                        dev = _joined(func, dev, t)
                        items[j] = t._elem
                    elif isinstance(t, torch.Tensor):
                        # a subclass unwraps first, whatever its shape: a list of 0-dim DTensors (the norms
                        # clip_grad_norm_ stacks) must reach DTensor's dispatch with this mode still active
                        if not _plain(type(t)):
                            return None if _fake(t) else NotImplemented
                        if t.dim() > 0 and not t.is_meta:
                            host = True
                if new_args is None:
                    new_args = list(args)
                new_args[i] = items if kind is list else tuple(items)
        elif kind is torch.device and a.type == "cuda":
            dev = device.resolve(a.index)
            if new_args is None:
                new_args = list(args)
            new_args[i] = target
    out_dev = dev
    new_kwargs = kwargs
    if kwargs:
        new_kwargs = dict(kwargs)
        for k, v in kwargs.items():
            kind = type(v)
            if kind is SimCudaTensor:
                if dev is None:
                    dev = out_dev = v._dev
                elif v._dev != dev:
                    raise _mismatch(func, dev, v._dev)
                new_kwargs[k] = v._elem
            elif kind is torch.device:
                if v.type == "cuda":
                    out_dev = device.resolve(v.index)
                    if dev is None:
                        dev = out_dev
                    new_kwargs[k] = target
                elif k == "device":
                    out_dev = None  # .to("cpu"), empty(device="cpu"): the result is on the host
            elif kind is list or kind is tuple:
                if any(type(t) is SimCudaTensor for t in v):
                    items = [t._elem if type(t) is SimCudaTensor else t for t in v]
                    for t in v:
                        if type(t) is SimCudaTensor:
                            if dev is None:
                                dev = out_dev = t._dev
                            elif t._dev != dev:
                                raise _mismatch(func, dev, t._dev)
                    new_kwargs[k] = items if kind is list else tuple(items)
            elif isinstance(v, torch.Tensor) and not _plain(kind):
                return None if _fake(v) else NotImplemented
    if dev is None:
        return None
    if host and not _schema(func).mixed:
        raise _mismatch(func, dev, CPU)
    call = Call(func, tuple(new_args) if new_args is not None else args, new_kwargs, args, kwargs)
    call.device = dev
    call.out_device = out_dev
    call.host_operand = host
    call.elem_device = target
    return call


#: argument types a plain call (:func:`plain`) may hold besides simulated-GPU tensors and lists of them: scalars, and
#: lists of scalars
PLAIN_SCALARS = frozenset({int, float, bool, type(None)})


def plain(func: Any) -> bool:
    """Whether ``func``, called with simulated-GPU tensors of one device and scalars only (no keywords), needs none of
    :func:`unwrap`'s, :meth:`Call.run`'s or :func:`rewrap`'s special cases: not ``Tensor.to``, no fallback kernel,
    no collective, no mixed devices, no random numbers, no memory left uninitialised, no device argument (a
    factory). Such a call unwraps to its operands' CPU tensors, runs its operator on them, and its result, where
    the op writes no argument, is a new wrapper on the same device: :class:`~simdist.compute.cost.ComputeCostMode`
    takes that short way for most ops of a GPU program."""
    if type(func) is not torch._ops.OpOverload:
        return False
    if func in TO_OVERLOADS or func in FALLBACKS or func in uninitialised.OPS:
        return False
    if func.namespace in _COLLECTIVE_NAMESPACES:
        return False
    info = _schema(func)
    if info.mixed or info.random or info.generator:
        return False
    return not any(a.name == "device" for a in func._schema.arguments)


def unwrap_plain(args: Any, fake: bool = False) -> tuple[list[Any], torch.device] | None:
    """A :func:`plain` op's positional ``args`` with their simulated-GPU tensors (alone or in lists) replaced by their
    CPU tensors, and the device they are on; None where the call is not plain after all (an operand of another kind,
    operands on two devices, no simulated-GPU operand; in a timing-only run, ``fake``, an operand with values from
    the host): :func:`unwrap` then decides."""
    dev = None
    elems = list(args)
    for i, a in enumerate(args):
        kind = type(a)
        if kind is SimCudaTensor:
            if dev is None:
                dev = a._dev
            elif a._dev != dev:
                return None
            elems[i] = a._elem
            if fake and not a._elem.is_meta:
                return None
        elif kind in PLAIN_SCALARS:
            continue
        elif kind is not list and kind is not tuple:
            return None
        elif a and type(a[0]) is SimCudaTensor:  # a foreach op's tensors
            items = []
            for t in a:
                if type(t) is not SimCudaTensor:
                    return None
                if dev is None:
                    dev = t._dev
                elif t._dev != dev:
                    return None
                if fake and not t._elem.is_meta:
                    return None
                items.append(t._elem)
            elems[i] = items if kind is list else tuple(items)
        else:
            for t in a:
                if type(t) not in PLAIN_SCALARS:
                    return None
    if dev is None:
        return None
    return elems, dev


def _original(info: _Schema, n: int, call: Call) -> Any:
    """The caller's tensor that output ``n`` is (the argument an in-place or ``out=`` op wrote), or None."""
    j = info.aliases[n] if n < len(info.aliases) else None
    if j is None:
        return None
    if j < len(call.orig_args):
        return call.orig_args[j]
    return call.orig_kwargs.get(info.alias_names[n])


def rewrap(call: Call, out: Any) -> Any:
    """``out`` (the op's CPU results) as the caller sees them: on the simulated device, or the caller's own tensor
    for what the op wrote in place."""
    dev = call.out_device
    if isinstance(out, torch.Tensor):
        info = _schema(call.func)
        mine = _original(info, 0, call) if info.aliases else None
        if mine is not None:
            if type(mine) is SimCudaTensor and (mine.shape != out.shape or mine.stride() != out.stride()):
                _resync(mine, out)
            elif type(mine) is SimCudaTensor and mine._elem.device != out.device:
                mine._elem = out  # a timing-only run's copy from the host (see without_values)
            return mine
        if dev is None or (out.device.type != "cpu" and out.device != call.elem_device):
            return out
        if type(out) is not torch.Tensor:
            return _rewrap_subclass(out, dev)
        return SimCudaTensor(out, dev)
    if isinstance(out, (tuple, list)):
        info = _schema(call.func)
        res = []
        for n, o in enumerate(out):
            mine = _original(info, n, call)
            if mine is not None:
                if (
                    type(mine) is SimCudaTensor
                    and isinstance(o, torch.Tensor)
                    and (mine.shape != o.shape or mine.stride() != o.stride())
                ):
                    _resync(mine, o)
                res.append(mine)
            elif dev is None:
                res.append(o)
            elif type(o) is torch.Tensor:
                res.append(SimCudaTensor(o, dev))
            elif isinstance(o, list):
                res.append([SimCudaTensor(t, dev) if type(t) is torch.Tensor else t for t in o])
            else:
                res.append(o)
        return type(out)(res) if isinstance(out, tuple) else res
    return out


def _resync(mine: SimCudaTensor, elem: torch.Tensor) -> None:
    """An op changed the CPU tensor's sizes or strides in place (``t_``, ``resize_``, an ``out=`` resize): give the
    caller's wrapper, the Python object rank code holds, the new metadata."""
    # shallow_copy_from through the .data setter: the caller's TensorImpl takes the new sizes and strides in place,
    # so C++ references to it (an out= op returns its argument by reference) see them too
    torch.Tensor.data.__set__(mine, SimCudaTensor(elem, mine._dev))
    mine._elem = elem


def _rewrap_subclass(out: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A wrapper subclass a Python kernel built around CPU tensors (funcol's AsyncCollectiveTensor): rebuilt
    around simulated-GPU tensors, so that it reports the device too."""
    if is_traceable_wrapper_subclass(out):
        return transform_subclass(
            out, lambda name, t: SimCudaTensor(t, dev) if type(t) is torch.Tensor else t
        )
    return out


def without_values(call: Call) -> None:
    """``call`` in a timing-only run, made to run on the meta device where any of its simulated-GPU operands has no
    values: its operands that have values (copied from the host, made from host data) take part without them.

    A timing-only run's tensors made on a simulated GPU hold no values (their data is a meta tensor); a tensor
    copied there from the host keeps its values, as the host had them, so what torch computes from host data and
    reads back (DDP's checks of parameter shapes and bucket order) still has them. A copy from the host keeps them,
    and a copy into a tensor on the device gives it the host's values.
    """
    func, orig = call.func, call.orig_args
    if func is TO_COPY and call.out_device is not None and _plain(type(orig[0])):
        call.kwargs = {**call.kwargs, "device": CPU}
        return
    if func is COPY and type(orig[0]) is SimCudaTensor and _plain(type(orig[1])):
        dst = call.args[0]
        if dst.is_meta and orig[1].device.type == "cpu":
            # the destination takes the host's values (rewrap gives the caller's tensor this CPU tensor)
            call.args = (torch.empty_strided(dst.size(), dst.stride(), dtype=dst.dtype), *call.args[1:])
        return
    if not _any_meta(call.args) and not _any_meta(list(call.kwargs.values())):
        return
    call.args = _to_meta(call.args)
    call.kwargs = {k: _to_meta(v) for k, v in call.kwargs.items()}


def _any_meta(values: Any) -> bool:
    for v in values:
        if isinstance(v, torch.Tensor) and v.is_meta:
            return True
        if isinstance(v, (list, tuple)) and _any_meta(v):
            return True
    return False


def _to_meta(value: Any) -> Any:
    """``value`` with its plain tensors on the meta device (shape, strides and dtype kept)."""
    if isinstance(value, torch.Tensor) and type(value) is torch.Tensor and value.device.type == "cpu":
        return torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device=META)
    if isinstance(value, list):
        return [_to_meta(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_to_meta(v) for v in value)
    return value
