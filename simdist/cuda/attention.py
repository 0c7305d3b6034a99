"""``F.scaled_dot_product_attention`` on simulated GPUs: the CPU's fused kernel, where the CPU program takes it.

torch picks attention's kernel in C++ by the tensors' device. On a simulated GPU it finds none of CUDA's fused
kernels usable and takes the math path (matmuls and a softmax): results that differ from the program written for
the CPU in round-off, priced as the math path's ops. Here the call asks torch which kernel it picks for the CPU
tensors the simulated GPU holds (``F.scaled_dot_product_attention`` is replaced by :func:`scaled_dot_product_attention`
during a run that emulates CUDA) and, where that is the CPU's fused (flash) kernel, calls it on the simulated GPU
tensors, so autograd records its own backward: the values are the CPU program's bit for bit, and the cost model
prices one fused attention kernel (forward and backward), as a GPU runs one. Where the CPU takes the math path too
(dropout, for instance), so does the simulated GPU.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.nn.attention import SDPBackend
from torch.overrides import handle_torch_function, has_torch_function

from simdist.cuda.tensor import SimCudaTensor

#: the function users call (``F.scaled_dot_product_attention`` is this object)
SDPA = torch._C._nn.scaled_dot_product_attention
_FLASH = int(SDPBackend.FLASH_ATTENTION.value)


def choice_operand(t: torch.Tensor) -> torch.Tensor:
    """What torch's choice of attention kernel reads for ``t``: ``t``, or for a meta tensor (no values, and a device
    torch takes the math path on) a CPU tensor of its shape and dtype that allocates one row."""
    if not t.is_meta:
        return t
    return (
        torch.empty(t.shape[-1:], dtype=t.dtype).expand(t.shape)
        if t.dim()
        else torch.empty((), dtype=t.dtype)
    )


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


def scaled_dot_product_attention(*args: Any, **kwargs: Any) -> Any:
    """``F.scaled_dot_product_attention``, taking the CPU's fused kernel on simulated GPU tensors where the CPU
    program takes it."""
    query, key, value, mask = _bind(*args, **kwargs)[:4]
    operands = tuple(t for t in (query, key, value, mask) if isinstance(t, torch.Tensor))
    if has_torch_function(operands):
        # as torch.nn.functional's Python functions do: a TorchFunctionMode or a subclass sees this function, which is
        # F.scaled_dot_product_attention during the run (a mode comparing func with it keeps working)
        return handle_torch_function(scaled_dot_product_attention, operands, *args, **kwargs)
    out = _fused(args, kwargs)
    return SDPA(*args, **kwargs) if out is NotImplemented else out


def _fused(args: Any, kwargs: dict[str, Any]) -> Any:
    """The output of the CPU's fused attention kernel on the call's simulated-GPU tensors, or ``NotImplemented``
    where the CPU program would not take that kernel."""
    wrapper = SimCudaTensor
    query, key, value, mask, dropout_p, is_causal, scale, enable_gqa = _bind(*args, **kwargs)
    if not all(type(t) is wrapper for t in (query, key, value)):
        return _fused_dtensor(query, key, value, mask, dropout_p, is_causal, scale, enable_gqa)
    # grouped-query attention (expanded by torch first) stays on torch's own path
    if enable_gqa or (mask is not None and type(mask) is not wrapper):
        return NotImplemented
    if mask is not None and not (mask.dtype.is_floating_point or mask.dtype == torch.bool):
        return NotImplemented  # torch's own function refuses it, with its message
    elems = [choice_operand(t._elem) for t in (query, key, value)]
    mask_elem = None if mask is None else choice_operand(mask._elem)
    choice = torch._fused_sdp_choice(
        *elems, mask_elem, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
    )
    if choice != _FLASH:
        return NotImplemented
    if mask is not None and mask.dtype == torch.bool:
        # what torch's convert_boolean_attn_mask does before the CPU kernel
        mask = torch.zeros_like(mask, dtype=query.dtype).masked_fill_(mask.logical_not(), float("-inf"))
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=mask, scale=scale
    )[0]


def _fused_dtensor(
    query: Any,
    key: Any,
    value: Any,
    mask: Any,
    dropout_p: float,
    is_causal: bool,
    scale: Any,
    enable_gqa: bool,
) -> Any:
    """Attention on DTensors over simulated GPUs: CUDA's flash kernel (DTensor has sharding rules for CUDA's
    kernels, not for the CPU's), which the simulated GPU computes with the CPU's flash kernel; ``NotImplemented``
    where the CPU would not take its flash kernel for the local shards, or with a mask (the flash kernel takes none)."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    cls = getattr(dtensor, "DTensor", None)
    if cls is None or mask is not None or enable_gqa:
        return NotImplemented
    if not all(type(t) is cls and type(t._local_tensor) is SimCudaTensor for t in (query, key, value)):
        return NotImplemented
    elems = [choice_operand(t._local_tensor._elem) for t in (query, key, value)]
    if torch._fused_sdp_choice(*elems, None, dropout_p, is_causal, scale=scale) != _FLASH:
        return NotImplemented
    return torch.ops.aten._scaled_dot_product_flash_attention(
        query, key, value, dropout_p, is_causal, scale=scale
    )[0]
