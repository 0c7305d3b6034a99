"""Roofline time of one aten op on a modelled device, and a dispatch mode that charges it per op (seconds)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from math import prod
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from simdist import uninitialised
from simdist.compute.attention import AttentionCall, attention_calls
from simdist.compute.devices import DeviceSpec, get_device
from simdist.compute.fusion import FusedRegion, is_pointwise
from simdist.compute.sdpa import MetaAttention, attention_seconds
from simdist.cuda import device as cuda_devices
from simdist.cuda.pinned import ASKS as PINNED_OPS
from simdist.cuda.rank import RankCuda
from simdist.cuda.tensor import (
    COPY,
    META,
    TO_COPY,
    TO_OVERLOADS,
    Call,
    SimCudaTensor,
    on_host,
    plain,
    rewrap,
    unwrap,
    unwrap_plain,
    without_values,
)
from simdist.cuda.tensor import CPU as HOST_DEVICE
from simdist.cuda.transfers import copies_or_plans, planned_bytes, transfer
from simdist.errors import NoValuesError
from simdist.untraced import never_compiled

aten = torch.ops.aten
#: a factory's ``device`` argument that makes host memory (where ``pin_memory=True`` applies)
_HOST = (None, "cpu", torch.device("cpu"))

# A FLOP formula gets (args, out) of one call and returns (flops, dtype whose peak applies).
_FlopFn = Callable[[Sequence[Any], Any], tuple[float, torch.dtype]]


# Matmul formulas read the output's element count: each output element is one length-K dot product
# (2K FLOPs). Reading numel() once is cheaper than indexing three shapes, and this runs on every matmul.


def _mm(args: Sequence[Any], out: Any) -> tuple[float, torch.dtype]:
    a = args[0]  # mm(self[M,K], mat2[K,N]) -> [M,N]; also bmm(self[B,M,K], mat2[B,K,N]) -> [B,M,N]
    return 2.0 * out.numel() * a.shape[-1], a.dtype


def _addmm(args: Sequence[Any], out: Any) -> tuple[float, torch.dtype]:
    a = args[1]  # addmm(self, mat1[M,K], mat2[K,N]) and baddbmm(self, batch1[B,M,K], batch2[B,K,N])
    return 2.0 * out.numel() * a.shape[-1], a.dtype  # the bias add is left to the memory term


def _addbmm(args: Sequence[Any], out: Any) -> tuple[float, torch.dtype]:
    a = args[1]  # addbmm(self, batch1[B,M,K], batch2[B,K,N]) -> [M,N], summed over the batch
    return 2.0 * out.numel() * a.shape[0] * a.shape[2], a.dtype


def _grouped_mm(args: Sequence[Any], out: Any) -> tuple[float, torch.dtype]:
    # _grouped_mm / _scaled_grouped_mm(self, mat2, ..., offs): each output element is a dot product over the
    # contracted dimension, self's last, except where both operands are 2-D: then offs cuts that dimension into
    # the groups, and the output holds one [M, N] block per group, each a product over its share of it.
    a, b = args[0], args[1]
    k = a.shape[-1]
    if a.dim() == 2 and b.dim() == 2:
        return 2.0 * out.numel() * k / out.shape[0], a.dtype
    return 2.0 * out.numel() * k, a.dtype


def _mv(args: Sequence[Any], out: Any) -> tuple[float, torch.dtype]:
    a = args[0]  # mv(self[M,N], vec[N]) -> [M]
    return 2.0 * out.numel() * a.shape[1], a.dtype


def _addmv(args: Sequence[Any], out: Any) -> tuple[float, torch.dtype]:
    a = args[1]  # addmv(self, mat[M,N], vec[N]) -> [M]
    return 2.0 * out.numel() * a.shape[1], a.dtype


def _dot(args: Sequence[Any], out: Any) -> tuple[float, torch.dtype]:
    a = args[0]  # dot/vdot(self[N], tensor[N]) -> scalar
    return 2.0 * a.shape[0], a.dtype


def _conv_macs(x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, transposed: bool) -> float:
    # A convolution does one multiply-add per weight element per spatial position of its "wide" side:
    # the output for a normal conv, the input for a transposed one. prod(weight.shape) already divides
    # by groups, since the weight holds in_channels / groups (resp. out_channels / groups).
    wide = x if transposed else y
    return float(wide.shape[0] * prod(wide.shape[2:]) * prod(weight.shape))


def _convolution(args: Sequence[Any], out: Any) -> tuple[float, torch.dtype]:
    x, weight, transposed = (
        args[0],
        args[1],
        args[6],
    )  # convolution(input, weight, bias, stride, ..., transposed, ...)
    return 2.0 * _conv_macs(x, weight, out, transposed), x.dtype


def _convolution_backward(args: Sequence[Any], out: Any) -> tuple[float, torch.dtype]:
    # convolution_backward(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
    #                      output_padding, groups, output_mask). grad_input and grad_weight are each a
    # convolution with the forward's multiply-add count; grad_bias is a reduction (memory term only).
    grad_out, x, weight, transposed, mask = args[0], args[1], args[2], args[7], args[10]
    macs = _conv_macs(x, weight, grad_out, transposed)
    return 2.0 * macs * (int(bool(mask[0])) + int(bool(mask[1]))), grad_out.dtype


def _attention_dims(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int, int]:
    # Dense (batch, heads, seq, dim) layout. Grouped-query attention broadcasts key/value heads to the query's.
    return q.shape[0] * q.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3]


def _score_pairs(sq: int, sk: int, causal: bool) -> int:
    """(query, key) pairs attention computes: all of them, or with ``is_causal`` the ones torch's mask keeps
    (aligned top-left: query i sees keys 0..i), whose tiles the fused kernels compute while they skip the rest."""
    if not causal:
        return sq * sk
    seen = min(sq, sk)  # queries before the sk-th see i + 1 keys; every later one sees all sk
    return seen * (seen + 1) // 2 + (sq - seen) * sk


def _sdpa(causal_at: int | None) -> _FlopFn:
    """The forward formula of a fused attention kernel whose ``is_causal`` is positional argument ``causal_at``."""

    def flops(args: Sequence[Any], out: Any) -> tuple[float, torch.dtype]:
        q, k, v = args[0], args[1], args[2]
        if q.dim() != 4:
            return 0.0, q.dtype  # nested/jagged layout: no closed form here, the memory term applies
        bh, sq, sk, dq, dv = _attention_dims(q, k, v)
        # scores = q @ k^T, out = softmax(scores) @ v, over the pairs the mask keeps
        causal = causal_at is not None and len(args) > causal_at and bool(args[causal_at])
        return 2.0 * bh * _score_pairs(sq, sk, causal) * (dq + dv), q.dtype

    return flops


def _sdpa_backward(causal_at: int | None) -> _FlopFn:
    """The backward formula of a fused attention kernel whose ``is_causal`` is positional argument ``causal_at``."""

    def flops(args: Sequence[Any], out: Any) -> tuple[float, torch.dtype]:
        q, k, v = (
            args[1],
            args[2],
            args[3],
        )  # every *_backward variant starts (grad_out, query, key, value, ...)
        if q.dim() != 4:
            return 0.0, q.dtype
        bh, sq, sk, dq, dv = _attention_dims(q, k, v)
        # Five matmuls: recompute q @ k^T (dq), grad_scores = grad_out @ v^T (dv), grad_v (dv), grad_q (dq),
        # grad_k (dq). Without a causal mask, the count of torch.utils.flop_counter (which ignores the mask).
        causal = causal_at is not None and len(args) > causal_at and bool(args[causal_at])
        return 2.0 * bh * _score_pairs(sq, sk, causal) * (3 * dq + 2 * dv), q.dtype

    return flops


def _causal_position(name: str) -> int | None:
    """Where ``aten::<name>`` takes ``is_causal`` positionally (a dispatch mode sees it there; torch drops it
    from the end when it is the default, False), or None."""
    schema = getattr(torch.ops.aten, name).default._schema
    return next(
        (i for i, a in enumerate(schema.arguments) if a.name == "is_causal" and not a.kwarg_only), None
    )


def _aten(name: str) -> str:
    return f"aten::{name}"


#: the fused scaled-dot-product-attention kernels, one per backend
_SDPA_KERNELS = (
    "flash_attention",
    "flash_attention_for_cpu",
    "efficient_attention",
    "cudnn_attention",
    "fused_attention_overrideable",
)

_FLOP_FORMULAS: dict[str, _FlopFn] = {
    _aten("mm"): _mm,
    _aten("_int_mm"): _mm,
    _aten("_scaled_mm"): _mm,  # FP8 operands, with their scales: at the operand dtype's (FP8) rate
    _aten("_grouped_mm"): _grouped_mm,
    _aten("_scaled_grouped_mm"): _grouped_mm,
    _aten("addmm"): _addmm,
    _aten("_addmm_activation"): _addmm,
    _aten("bmm"): _mm,
    _aten("baddbmm"): _addmm,
    _aten("addbmm"): _addbmm,
    _aten("mv"): _mv,
    _aten("addmv"): _addmv,
    _aten("dot"): _dot,
    _aten("vdot"): _dot,
    _aten("convolution"): _convolution,
    _aten("convolution_backward"): _convolution_backward,
    **{
        _aten(f"_scaled_dot_product_{kind}"): _sdpa(_causal_position(f"_scaled_dot_product_{kind}"))
        for kind in _SDPA_KERNELS
    },
    **{
        _aten(f"_scaled_dot_product_{kind}_backward"): _sdpa_backward(
            _causal_position(f"_scaled_dot_product_{kind}_backward")
        )
        for kind in _SDPA_KERNELS
    },
}


#: how each fused attention op reads its call, by aten name
_ATTENTION_CALLS: dict[str, AttentionCall] = attention_calls(
    {
        _aten(f"_scaled_dot_product_{kind}{suffix}"): _causal_position(f"_scaled_dot_product_{kind}{suffix}")
        for kind in _SDPA_KERNELS
        for suffix in ("", "_backward")
    }
)


def _cublas_tf32() -> bool:
    """Whether torch lets cuBLAS run float32 matmuls on TF32 tensor cores.

    ``torch.backends.cuda.matmul.allow_tf32``, ``torch.set_float32_matmul_precision`` ("high" and "medium" allow
    it) and ``torch.backends.cuda.matmul.fp32_precision`` all set the switch this reads; the legacy getters
    raise once the newer API has been used, this one never does. Off by default, as in torch.
    """
    return torch.backends.cuda.matmul.fp32_precision == "tf32"


def _cudnn_tf32() -> bool:
    """Whether torch lets cuDNN run float32 convolutions on TF32 tensor cores (``torch.backends.cudnn.allow_tf32``
    or ``torch.backends.cudnn.conv.fp32_precision``; on by default, as in torch)."""
    return torch.backends.cudnn.conv.fp32_precision == "tf32"


#: the torch switch under which each op's float32 kernel may use TF32 (read when the op is priced, since a
#: program may flip it at any point). Attention is not here: the fused kernels ignore both switches.
_TF32_SWITCHES: dict[str, Callable[[], bool]] = {
    **{
        _aten(name): _cublas_tf32 for name in ("mm", "addmm", "_addmm_activation", "bmm", "baddbmm", "addbmm")
    },
    _aten("convolution"): _cudnn_tf32,
    _aten("convolution_backward"): _cudnn_tf32,
}

#: the matmuls a GPU runs as tiled GEMM kernels: priced through the device's shape model where it has one
_GEMMS: frozenset[str] = frozenset(
    _aten(n)
    for n in (
        "mm",
        "_int_mm",
        "_scaled_mm",
        "_grouped_mm",
        "_scaled_grouped_mm",
        "addmm",
        "_addmm_activation",
        "bmm",
        "baddbmm",
        "addbmm",
    )
)

#: ops that read only the elements they gather from their first input (an embedding's rows, not its table):
#: that input counts as at most the output's bytes
_GATHERS: frozenset[str] = frozenset(
    _aten(n) for n in ("embedding", "index_select", "gather", "index", "take")
)

# Ops that run no kernel although their schema does not mark them as views: in-place metadata changes,
# _unsafe_view (a view that autograd does not track), allocation without initialisation, and the host-side checks
# whether a vendor library's CTC kernel applies and which attention kernel does.
_NO_KERNEL: frozenset[str] = frozenset(
    _aten(n)
    for n in (
        "_unsafe_view",
        "t_",
        "transpose_",
        "swapdims_",
        "swapaxes_",
        "squeeze_",
        "unsqueeze_",
        "as_strided_",
        "detach_",
        "resize_",
        "resize_as_",
        "set_",
        "empty",
        "empty_like",
        "empty_strided",
        "empty_permuted",
        "new_empty",
        "new_empty_strided",
        "size",
        "stride",
        "sym_size",
        "sym_stride",
        "sym_numel",
        "sym_storage_offset",
        "is_same_size",
        "_use_cudnn_ctc_loss",
        "_use_miopen_ctc_loss",
        "_fused_sdp_choice",
    )
)

# Collectives and profiler markers are not compute: the network model times collectives, so charging
# them here would count their time twice. prim ops (prim::device, prim::layout, ...) read tensor metadata.
_NO_COMPUTE_NAMESPACES: frozenset[str] = frozenset(
    {"c10d", "_c10d_functional", "c10d_functional", "profiler", "prim"}
)


class _OpInfo:
    """What op_cost needs to know about one OpOverload, computed once per overload."""

    __slots__ = (
        "attention",
        "call",
        "converts",
        "factory",
        "flops",
        "free",
        "func",
        "gathers",
        "gemm",
        "name",
        "out_args",
        "pinned",
        "plain_gpu",
        "pointwise",
        "tf32",
        "uninitialised",
        "writes",
    )

    def __init__(self, func: torch._ops.OpOverload) -> None:
        #: the overload itself: the table is keyed by its id, which is this overload's only while it lives
        self.func = func
        #: what runs it: the C++ operator an OpOverload's __call__ calls, without that Python frame
        self.call: Callable[..., Any] = func._op if type(func) is torch._ops.OpOverload else func
        #: whether it is one of ``Tensor.to``'s overloads (whose device argument may be a string)
        self.converts: bool = func in TO_OVERLOADS
        #: whether it leaves memory uninitialised (filled by simdist.uninitialised after it runs)
        self.uninitialised: bool = func in uninitialised.OPS
        #: whether it asks about or pins host memory (answered from a simulated GPU's pinned memory)
        self.pinned: bool = func in PINNED_OPS
        schema = func._schema
        self.name: str = schema.name
        namespace = self.name.split("::", 1)[0]
        self.free: bool = bool(func.is_view) or self.name in _NO_KERNEL or namespace in _NO_COMPUTE_NAMESPACES
        self.flops: _FlopFn | None = _FLOP_FORMULAS.get(self.name)
        self.tf32: Callable[[], bool] | None = _TF32_SWITCHES.get(self.name)
        self.gathers: bool = self.name in _GATHERS
        self.gemm: bool = self.name in _GEMMS
        #: how a fused attention kernel reads its call, where the op is one (priced by the device's attention model)
        self.attention: AttentionCall | None = _ATTENTION_CALLS.get(self.name)
        self.pointwise: bool = is_pointwise(func)
        # out= arguments are written, not read: they are counted once, through the returned value.
        self.out_args: frozenset[str] = frozenset(a.name for a in schema.arguments if a.is_out)
        #: whether it makes a tensor from no tensor (``torch.ones``, ``torch.rand``) with ``device`` and
        #: ``pin_memory`` arguments that may be left out: see :func:`_as_aten_assumes` (prims' are required)
        self.factory: bool = (
            any(a.name == "device" for a in schema.arguments)
            and all(
                str(a.type).startswith("Optional")
                for a in schema.arguments
                if a.name in ("device", "pin_memory")
            )
            and not any("Tensor" in str(a.type) for a in schema.arguments)
        )
        #: whether one of its outputs is an argument it writes (in place, ``out=``): rewrap returns the caller's
        self.writes: bool = any(r.alias_info is not None and r.alias_info.is_write for r in schema.returns)
        #: whether a call of it on simulated-GPU tensors of one device and scalars alone may take ComputeCostMode's
        #: short way: no copy across the host link, nothing planned before it runs, no values read (see
        #: simdist.cuda.tensor.plain); ``copy_`` between two tensors of one simulated GPU is one too
        self.plain_gpu: bool = func is COPY or (
            not self.converts
            and not self.pinned
            and not self.uninitialised
            and plain(func)
            and not copies_or_plans(func)
            and func not in _VALUE_READS
            and torch.Tag.data_dependent_output not in func.tags
            and torch.Tag.dynamic_output_shape not in func.tags
        )


# Shared by all rank threads; a racing first insert stores an identical value, so no lock is needed. Keyed by
# id(): an OpOverload hashes in Python (about a microsecond), and this is looked up once per op of every rank.
_INFO: dict[int, _OpInfo] = {}


def _op_info(func: Any) -> _OpInfo:
    info = _INFO.get(id(func))
    # a new overload, or one made after another overload with its id was freed
    if info is None or info.func is not func:
        info = _INFO[id(func)] = _OpInfo(func)
    return info


def _as_aten_assumes(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A factory's ``kwargs`` without ``device=cpu`` and ``pin_memory=False``, which aten assumes when they are not
    given (the Python default device is torch's function mode, above aten): torch passes both to a dispatch mode for
    every factory of a program, and each costs the C++ operator's argument parsing some 2.5 us."""
    device = kwargs.get("device")
    host = type(device) is torch.device and device.type == "cpu" and device.index is None
    unpinned = kwargs.get("pin_memory") is False
    if not (host or unpinned):
        return kwargs
    return {
        k: v for k, v in kwargs.items() if not ((host and k == "device") or (unpinned and k == "pin_memory"))
    }


def _nbytes(t: torch.Tensor) -> int:
    try:
        return t.nbytes  # numel * element_size, not the storage size (an expanded view counts in full)
    except RuntimeError:
        return t.numel() * t.element_size()  # sparse and other layouts without a dense nbytes


def _tree_bytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return _nbytes(x)
    if isinstance(x, (list, tuple)):
        return sum(_tree_bytes(y) for y in x)
    return 0


def _info_cost(
    info: _OpInfo, args: Sequence[Any], kwargs: dict[str, Any] | None, out: Any, device: DeviceSpec
) -> float:
    if info.free:
        return 0.0
    # Runs once per op on every rank thread: plain tensors and flat lists are handled inline, without
    # a generic pytree walk, to keep the per-op cost to a microsecond or two.
    tensor = torch.Tensor
    moved = written = _nbytes(out) if isinstance(out, tensor) else _tree_bytes(out)
    if info.gathers and args and isinstance(args[0], tensor):
        moved -= max(0, _nbytes(args[0]) - written)  # the part of the source it never reads
    for a in args:
        if isinstance(a, tensor):
            moved += _nbytes(a)
        elif isinstance(a, (list, tuple)):
            moved += _tree_bytes(a)
    if kwargs:
        out_args = info.out_args
        for key, a in kwargs.items():
            if key not in out_args:
                moved += _tree_bytes(a)
    seconds = moved / device.memory_bandwidth
    if info.flops is not None:
        flops, dtype = info.flops(args, out)
        # The switch is read only where it can matter: it costs about a microsecond.
        tf32 = (
            device.tf32_flops is not None and dtype == torch.float32 and info.tf32 is not None and info.tf32()
        )
        rate = device.flops_for(dtype, tf32=tf32)
        if info.gemm and device.gemm is not None and isinstance(out, tensor) and out.dim() >= 2 and flops > 0:
            seconds = _gemm_seconds(device, out, flops, rate, moved)
        elif info.attention is not None and device.attention is not None and flops > 0:
            seconds = max(seconds, attention_seconds(device, info.attention, args, kwargs, rate))
        else:
            seconds = max(seconds, flops / rate)
    return seconds + device.launch_overhead


def _gemm_seconds(device: DeviceSpec, out: torch.Tensor, flops: float, rate: float, moved: float) -> float:
    """A matmul's time under the device's shape model: its output [..., M, N] in tiles and waves, its depth K the
    FLOPs per output element over 2 (for a grouped GEMM, the mean over its groups)."""
    shape = out.shape
    m, n = shape[-2], shape[-1]
    batch = out.numel() // (m * n) if m * n else 0
    if not batch:
        return moved / device.memory_bandwidth
    k = flops / (2.0 * out.numel())
    return device.gemm.seconds(  # type: ignore[union-attr]
        batch, m, n, k, rate, moved, device.memory_bandwidth, device.multiprocessors
    )


def op_cost(
    func: Any, args: Sequence[Any], kwargs: dict[str, Any] | None, out: Any, device: DeviceSpec
) -> float:
    """Seconds one aten op takes on ``device``: max(flops / peak, bytes moved / bandwidth) + launch overhead.

    ``func`` is the OpOverload seen by a dispatch mode, ``args``/``kwargs`` its inputs and ``out`` its result.
    FLOPs come from closed forms for the matmul, convolution and attention families (float32 matmuls and
    convolutions at the device's TF32 rate where torch's switches allow TF32); every other op is memory-bound
    with bytes = tensor inputs + tensor outputs, where a gathering op (embedding, index_select, gather, index,
    take) reads at most as much of its source as it writes. Views and allocation-only ops cost 0.
    """
    if device.is_zero_cost:
        return 0.0
    return _info_cost(_op_info(func), args, kwargs, out, device)


def op_flops(func: Any, args: Sequence[Any], kwargs: dict[str, Any] | None, out: Any) -> float:
    """FLOPs the closed-form formulas assign to one op (0 for ops treated as memory-bound)."""
    formula = _op_info(func).flops
    return 0.0 if formula is None else formula(args, out)[0]


class ComputeCostMode(TorchDispatchMode):
    """Runs every op for real and calls ``charge(seconds, "aten::name")`` with its modelled time when > 0.

    Dispatch modes are thread-local: enter one instance per rank thread. Autograd's backward ops pass
    through the mode of the thread that called ``backward()``.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in a dynamo-disabling shim unless this says no; the shim
        # costs microseconds on every op and its first use imports torch._dynamo (seconds). never_compiled keeps
        # dynamo out of the mode at no cost per op instead.
        return False

    def __init__(
        self,
        device: DeviceSpec,
        charge: Callable[[float, str], None],
        before: Callable[[Any, Sequence[Any], dict[str, Any]], None] | None = None,
        *,
        price_meta: bool = False,
        after: Callable[[Any, Sequence[Any], dict[str, Any] | None, Any], None] | None = None,
        cuda: RankCuda | None = None,
        reserve: Callable[[int, Any], None] | None = None,
        launch: Callable[[float], None] | None = None,
        provider: Callable[[str, Sequence[Any], dict[str, Any] | None, float], float] | None = None,
        launched: Callable[[float, str, float], None] | None = None,
    ) -> None:
        super().__init__()
        self.device = device
        #: called with the host's seconds to launch each kernel before it is charged (the device's
        #: ``host_overhead``; a run's host time), where the device has one
        self._launch = launch if device.host_overhead > 0 else None
        #: ``launched(seconds, name, host seconds)``: ``launch`` then ``charge`` in one call (one of each per op)
        self._launched = launched if self._launch is not None else None
        #: charge ops on meta tensors as if they ran (pricing shapes without data, as ``estimate`` does);
        #: otherwise meta tensors, like fake ones, are tracing or shape propagation, and cost nothing
        self._price_meta = price_meta
        self._charge = charge
        #: prices each op that runs a kernel instead of the model, given the model's seconds (profile replay)
        self._provider = provider
        self._zero_cost = device.is_zero_cost and provider is None
        # Another per-op check (the race detector's) runs here rather than in a mode of its own: each
        # Python dispatch mode on the stack costs about 10 us per op.
        self._before = before
        #: sees each op's (func, args, kwargs, out) before it is charged (memory accounting rides here too)
        self._after = after
        #: the rank's simulated CUDA devices, when the run emulates them: ops on them are unwrapped here too
        self._cuda = cuda
        #: called with the bytes an op will allocate on a simulated GPU and the op, before it runs (memory
        #: accounting's out-of-memory check)
        self._reserve = reserve
        #: the outermost region torch.compile compiled that the thread is in (its elementwise chains are fused),
        #: and how deep
        self._region: FusedRegion | None = None
        self._depth = 0
        #: where the simulated GPU's tensors keep their data (no values in a timing-only run)
        self._target = META if cuda is not None and cuda.fake else HOST_DEVICE

    @never_compiled
    def __torch_dispatch__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        info = _INFO.get(id(func))  # _op_info's look-up, inline: this runs for every op of every rank
        if info is None or info.func is not func:
            info = _op_info(func)
        if (
            info.plain_gpu
            and not kwargs
            and args
            and self._cuda is not None
            and (type(args[0]) is SimCudaTensor or (type(args[0]) is list and args[0]))
        ):
            result = self._plain_on_gpu(func, info, args)
            if result is not _NOT_PLAIN:
                return result
        if not info.uninitialised:
            return self._dispatch(func, info, args, kwargs)
        before = uninitialised.stored_bytes(func, args)
        out = self._dispatch(func, info, args, kwargs)
        uninitialised.fill(func, out, before)
        return out

    def _dispatch(self, func: Any, info: _OpInfo, args: Sequence[Any], kwargs: dict[str, Any] | None) -> Any:
        """One op run, checked, accounted and charged (see :meth:`__torch_dispatch__`); ``info`` is ``func``'s."""
        if self._cuda is not None:
            if info.pinned or (kwargs and kwargs.get("pin_memory") and kwargs.get("device") in _HOST):
                return self._pinned(func, args, kwargs or {})
            # most ops of a program written for the CPU hold host tensors only: told apart without unwrap's walk
            if info.converts or not on_host(args, kwargs):
                call = unwrap(func, args, kwargs or {}, self._target)
                if call is not None:
                    return NotImplemented if call is NotImplemented else self._on_gpu(call)
            if self._cuda.in_use:
                # a host op of a rank that uses its GPU: host work (the host's CPU is not modelled), not on the
                # GPU's stream, not device memory
                if self._before is not None:
                    self._before(func, args, kwargs or {})
                if kwargs and info.factory:
                    kwargs = _as_aten_assumes(kwargs)
                return info.call(*args, **kwargs) if kwargs else info.call(*args)
        if self._before is not None:
            self._before(func, args, kwargs or {})
        if kwargs and info.factory:
            kwargs = _as_aten_assumes(kwargs)
        out = info.call(*args, **kwargs) if kwargs else info.call(*args)
        if self._after is not None:
            self._after(func, args, kwargs, out)
        # a view or an op without a kernel is free whatever its output: decided before looking at the output
        if not self._zero_cost and not info.free and not _without_data(out, self._price_meta):
            if self._region is not None:
                if info.pointwise:
                    self._region.pointwise(info.name, args, kwargs, out)
                    return out
                self._region.other(args, kwargs)
            seconds = _info_cost(info, args, kwargs, out, self.device)
            if self._provider is not None:
                seconds = self._provider(info.name, args, kwargs, seconds)
            # symbolic shapes (torch.export tracing) give a symbolic cost: no kernel runs, nothing is charged
            if type(seconds) in (int, float) and seconds > 0:
                self._kernel(seconds, info.name)
        return out

    def _kernel(self, seconds: float, name: str) -> None:
        """Charge one kernel of ``seconds`` on the device, after the host has launched it."""
        if self._launched is not None:
            self._launched(seconds, name, self.device.host_overhead)
            return
        if self._launch is not None:
            self._launch(self.device.host_overhead)
        self._charge(seconds, name)

    @contextlib.contextmanager
    def fusing(self) -> Iterator[None]:
        """A region ``torch.compile`` compiled runs: its chains of elementwise ops are charged as one kernel each
        when it returns (see simdist.compute.fusion); a region inside another is part of it."""
        self._depth += 1
        if self._region is None:
            self._region = FusedRegion()
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth:
                region, self._region = self._region, None
                if not self._zero_cost:
                    for name, moved in region.close():
                        self._kernel(moved / self.device.memory_bandwidth + self.device.launch_overhead, name)

    def _pinned(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """``is_pinned``, ``pin_memory()`` or a factory with ``pin_memory=True``: answered from, or recorded in, the
        rank's pinned memory; pinning host memory is a CUDA call (the rank uses its GPU from then on)."""
        if func is not aten.is_pinned.default:
            self._cuda.use()
        return self._cuda.pinned.dispatch(func, args, kwargs)

    def _on_gpu(self, call: Any) -> Any:
        """One op with a simulated-GPU operand: run on the CPU tensors, charged on the current stream of its
        tensors' device; a copy across the host link at its bandwidth, the host waiting for a blocking one."""
        cuda = self._cuda
        index = call.device.index if call.device is not None else None
        if index is not None and cuda.on_device is not None and index != cuda_devices.current():
            with cuda.on_device(index):
                return self._on_this_gpu(call)
        return self._on_this_gpu(call)

    def _on_this_gpu(self, call: Any) -> Any:
        """:meth:`_on_gpu` on the stream it charges."""
        cuda = self._cuda
        cuda.use()
        func = call.func
        if cuda.fake:
            without_values(call)
        if cuda.fake and _reads_values(call):
            raise NoValuesError(
                f"rank {cuda.rank}: {func._schema.name} reads the values of a tensor on {call.device} (to the host, or "
                'for the shape of its result), and this run is timing-only (tensors="fake"): its tensors hold shapes '
                "and dtypes but no values. Leave value reads (.item(), .cpu(), .tolist(), comparisons on the host, "
                'nonzero, masked_select, unique) out of the timed code, or run with tensors="real" at a size that fits'
            )
        if self._before is not None:
            self._before(func, call.args, call.kwargs)
        if self._reserve is not None:
            planned = planned_bytes(call)
            if planned:
                self._reserve(planned, func)
        out = self._run(call)
        result = rewrap(call, out)
        if self._after is not None:
            self._after(func, call.inputs(), None, result)
        if self._zero_cost or _without_data(out, self._price_meta or cuda.fake):
            return result
        copy = transfer(call, out)
        if copy is not None and self._region is not None:
            self._region.other(call.args, call.kwargs)
        if copy is not None:
            if copy.pins:
                cuda.pinned.add(out)
            share = cuda.pinned.share(copy.host)
            self._charge(cuda.copy_seconds(copy.nbytes, share), copy.direction)
            if cuda.on_kernel is not None:
                cuda.on_kernel(call, out)
            if copy.blocking or share < 1:  # a copy from or to pageable memory is synchronous for the host
                cuda.synchronize()
            return result
        info = _op_info(func)
        if not info.free:
            self._device_kernel(info, call, out)
        return result

    def _plain_on_gpu(self, func: Any, info: _OpInfo, args: Sequence[Any]) -> Any:
        """:meth:`_on_gpu` the short way, for a :func:`~simdist.cuda.tensor.plain` op whose arguments are
        simulated-GPU tensors of one device and scalars: what it does for such an op, without its general
        cases (no keywords, no host operand, no copy, nothing planned, no values read). ``_NOT_PLAIN`` where the
        call is not such a call after all, before anything is done: :meth:`_on_gpu` takes it."""
        cuda = self._cuda
        # (in a timing-only run, operands with values from the host go the general way: without_values decides)
        found = unwrap_plain(args, cuda.fake)
        if found is None:
            return _NOT_PLAIN
        elems, dev = found
        index = dev.index
        if index is not None and cuda.on_device is not None and index != cuda_devices.current():
            # another device is current (an autograd node's op): the work goes to the operands' device, as _on_gpu
            with cuda.on_device(index):
                return self._plain_on_this_gpu(func, info, args, elems, dev)
        return self._plain_on_this_gpu(func, info, args, elems, dev)

    def _plain_on_this_gpu(
        self, func: Any, info: _OpInfo, args: Sequence[Any], elems: list[Any], dev: torch.device
    ) -> Any:
        """:meth:`_plain_on_gpu` on the stream it charges: ``elems`` are ``args`` unwrapped, on device ``dev``."""
        cuda = self._cuda
        cuda.use()
        call = Call(func, tuple(elems), {}, args, {})
        call.device = call.out_device = dev
        call.elem_device = self._target
        if self._before is not None:
            self._before(func, call.args, call.kwargs)
        out = self._run(call, info)
        # rewrap's result for an op that writes no argument, where the result is a plain tensor on the host or,
        # in a timing-only run, the meta device
        if info.writes or type(out) is not torch.Tensor or (out.is_meta and self._target is not META):
            result = rewrap(call, out)
        else:
            result = SimCudaTensor(out, dev)
        if self._after is not None:
            self._after(func, call.inputs(), None, result)
        if self._zero_cost or _without_data(out, self._price_meta or cuda.fake):
            return result
        if not info.free:
            self._device_kernel(info, call, out)
        return result

    def _run(self, call: Call, plain: _OpInfo | None = None) -> Any:
        """``call`` run on its CPU (or, timing-only, meta) tensors: by :meth:`Call.run`, or for a plain op (``plain``
        its info) by its operator at once, Call.run's way for an op without a fallback, random numbers or memory
        left uninitialised. An op without a meta kernel in a timing-only run is a :class:`NoValuesError`."""
        cuda = self._cuda
        failure = None
        try:
            if plain is None:
                return call.run(cuda.generator, cuda.meta_outputs)
            if self._target is META and cuda.meta_outputs is not None:
                return cuda.meta_outputs.call(call.func, call.args, {})
            return plain.call(*call.args)
        except NotImplementedError as e:
            if not cuda.fake:
                raise
            failure = e
        # raised outside the handler: torch's C++ caller keeps the meta kernel's error otherwise, and loses this one
        raise self._no_meta_kernel(call, failure)

    def _no_meta_kernel(self, call: Call, failure: NotImplementedError) -> NoValuesError:
        """The error for ``call`` in a timing-only run, whose meta kernel torch lacks (``failure``)."""
        return NoValuesError(
            f"rank {self._cuda.rank}: {call.func._schema.name} on {call.device} has no kernel that works from shapes "
            'alone (torch has no meta kernel for it), and this run is timing-only (tensors="fake"); leave it out of '
            f'the timed code, or run with tensors="real" at a size that fits. torch: {str(failure).splitlines()[0]}'
        )

    def _device_kernel(self, info: _OpInfo, call: Call, out: Any) -> None:
        """The kernel of ``call`` (an op with a kernel, ``info`` its), priced and charged on the current stream."""
        cuda = self._cuda
        if self._region is not None:
            if info.pointwise:
                self._region.pointwise(info.name, call.args, call.kwargs, out)
                if cuda.on_kernel is not None:
                    cuda.on_kernel(call, out)
                return
            self._region.other(call.args, call.kwargs)
        seconds = _info_cost(info, call.args, call.kwargs, out, self.device)
        if self._provider is not None:
            seconds = self._provider(info.name, call.args, call.kwargs, seconds)
        if type(seconds) in (int, float) and seconds > 0:
            self._kernel(seconds, info.name)
            if cuda.on_kernel is not None:
                cuda.on_kernel(call, out)


#: what ComputeCostMode._plain_on_gpu returns for a call it leaves to the general path
_NOT_PLAIN = object()

#: ops that hand a tensor's values to the host as Python numbers (torch tags most: ``data_dependent_output``)
_VALUE_READS = frozenset({aten._local_scalar_dense.default, aten.is_nonzero.default})


def _reads_values(call: Any) -> bool:
    """Whether ``call`` needs values a simulated GPU does not have: it hands them to the host (a Python number, a copy
    into host memory), or the shape of its result depends on them (``nonzero``, ``masked_select``, ``unique``)."""
    func = call.func
    if (
        func in _VALUE_READS
        or (func is TO_COPY and call.out_device is None)
        or torch.Tag.data_dependent_output in func.tags
        or torch.Tag.dynamic_output_shape in func.tags
    ):
        return any(t.is_meta for t in call.args if isinstance(t, torch.Tensor))
    if func is COPY and type(call.orig_args[0]) is not SimCudaTensor:
        return call.args[1].is_meta
    return False


def _without_data(out: Any, price_meta: bool) -> bool:
    """Whether ``out`` is a fake (or, unless ``price_meta``, meta) tensor: tracing or shape propagation, where no
    kernel runs, so no time is charged."""
    if type(out) is torch.Tensor:  # most ops' result: neither fake nor a list
        return out.is_meta and not price_meta
    if isinstance(out, (tuple, list)):
        out = next((o for o in out if isinstance(o, torch.Tensor)), None)
    if not isinstance(out, torch.Tensor):
        return False
    if out.is_meta:
        return not price_meta
    # No FakeTensor can exist unless torch has loaded its module (importing it costs over a second).
    fake = sys.modules.get("torch._subclasses.fake_tensor")
    return fake is not None and isinstance(out, fake.FakeTensor)


def estimate(
    fn: Callable[..., Any], *args: Any, device: DeviceSpec | str, **kwargs: Any
) -> tuple[float, list[tuple[str, float]]]:
    """Run ``fn(*args, **kwargs)`` under ComputeCostMode; return (total seconds, [(op name, seconds), ...]).

    Attention on meta tensors takes the CPU's fused kernel where the CPU would (one kernel forward and one backward,
    as in a run), not the math path torch picks for the meta device."""
    spec = get_device(device) if isinstance(device, str) else device
    charges: list[tuple[str, float]] = []
    with MetaAttention(), ComputeCostMode(spec, lambda s, name: charges.append((name, s)), price_meta=True):
        fn(*args, **kwargs)
    return sum(s for _, s in charges), charges
