"""Scaled-dot-product attention in the cost model: a fused kernel's time on a device with an attention model, and
``estimate``'s routing of attention on meta tensors to the CPU's fused kernel, as a run's tensors take it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from torch.overrides import TorchFunctionMode

from simdist.compute.attention import AttentionCall, sdpa_backend
from simdist.compute.devices import DeviceSpec
from simdist.cuda.attention import choice_operand


def attention_seconds(
    device: DeviceSpec, call: AttentionCall, args: Sequence[Any], kwargs: dict[str, Any] | None, rate: float
) -> float:
    """A fused attention kernel's time under the device's attention model: the kernel torch picks on the device
    (the one the op names, else by torch's rules), its tiles over the SMs; the math path as its matmuls and the
    passes over the score matrix (no launch, no memory floor)."""
    qkv = call.read(args, kwargs)
    if qkv is None:
        return 0.0
    q, k, v = qkv
    causal = call.causal(args)
    backend = call.backend or sdpa_backend(
        device.compute_capability,
        q.dtype,
        q,
        k,
        v,
        call.masked(args, kwargs),
        call.dropout(args),
        causal,
        device.attention.cudnn_head_dim,  # type: ignore[union-attr]
    )
    heads, sq, sk, dq, dv = q.shape[0] * q.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3]
    if backend != "math":
        half = q.dtype in (torch.float16, torch.bfloat16)
        if half:
            # the efficiencies are fractions of the float16 rate they were fitted at; bfloat16 runs on the same
            # tensor cores at the same rate (the datasheets'), whatever cuBLAS's measured medians say
            rate = device.flops_for(torch.float16)
        return device.attention.seconds(  # type: ignore[union-attr]
            backend, call.backward, heads, sq, sk, dq, dv, causal, rate, device.multiprocessors, half
        )
    # unfused: scores = q @ k^T and out = p @ v as batched GEMMs, the scores written and read by the scale, the
    # mask and the softmax (three more kernels); the backward pass twice all of it (four GEMMs, softmax's backward)
    item = q.element_size()
    scores = heads * sq * sk * item
    gemms = [
        (sq, sk, dq, (sq * dq + sk * dq) * heads * item),
        (sq, dv, sk, (sk * dv + sq * dv) * heads * item),
    ]
    seconds = 0.0
    for m, n, depth, inputs in gemms:
        moved = inputs + scores
        if device.gemm is not None:
            seconds += device.gemm.seconds(
                heads, m, n, depth, rate, moved, device.memory_bandwidth, device.multiprocessors
            )
        else:
            seconds += max(2.0 * heads * m * n * depth / rate, moved / device.memory_bandwidth)
    seconds += 6 * scores / device.memory_bandwidth + 3 * device.launch_overhead
    return seconds * (2 if call.backward else 1)


def _bind(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> tuple[Any, ...]:
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


#: torch's number for its flash backend, what torch._fused_sdp_choice answers where the CPU takes its fused kernel
_FLASH = int(SDPBackend.FLASH_ATTENTION.value)


class MetaAttention(TorchFunctionMode):
    """Sends ``F.scaled_dot_product_attention`` on meta tensors to the CPU's fused kernel where the CPU takes it for
    tensors of those shapes and dtypes (torch picks by the tensors' device, and on meta takes the unfused math path),
    so ``estimate`` prices one attention kernel forward and one backward, as a run's tensors give it."""

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v, mask, dropout_p, is_causal, scale, enable_gqa = _bind(*args, **kwargs)
            operands = [t for t in (q, k, v, mask) if t is not None]
            if all(isinstance(t, torch.Tensor) and t.is_meta for t in operands) and not enable_gqa:
                stand_ins = [choice_operand(t) for t in (q, k, v)]
                mask_in = None if mask is None else choice_operand(mask)
                choice = torch._fused_sdp_choice(*stand_ins, mask_in, dropout_p, is_causal, scale=scale)
                if choice == _FLASH:
                    if mask is not None and mask.dtype == torch.bool:
                        # what torch does to a boolean mask before the CPU kernel
                        mask = torch.zeros_like(mask, dtype=q.dtype).masked_fill_(
                            mask.logical_not(), float("-inf")
                        )
                    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                        q, k, v, dropout_p, is_causal, attn_mask=mask, scale=scale
                    )[0]
        return func(*args, **kwargs)
