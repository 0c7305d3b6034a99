"""``F.scaled_dot_product_attention`` on simulated GPUs: the kernel the CPU program takes, not torch's math path.

torch picks an attention kernel in C++ by the query's device type. For CUDA a CPU build has no kernel to pick, so
on a simulated GPU it would take its math path (matmuls and a softmax), where the same program written for the
CPU takes the CPU's fused flash kernel: the results would differ in round-off, and the cost model would price
the math path's ops instead of one fused kernel. In rank code, a call on simulated GPU tensors asks torch which
kernel the CPU would pick for the same tensors and, where that is the flash kernel, calls it directly (converting
a boolean mask as torch does first); anything else goes to torch's own function.
"""

from __future__ import annotations

from typing import Any

import torch

from simdist.cuda.tensor import SimCudaTensor
from simdist.cudart.state import in_ranks

_FLASH = int(torch.nn.attention.SDPBackend.FLASH_ATTENTION.value)
_flash_for_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def scaled_dot_product_attention(original: Any) -> Any:
    """``torch.nn.functional.scaled_dot_product_attention``, taking the CPU's kernel choice on simulated GPUs."""

    def attention(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        args = (query, key, value, attn_mask, dropout_p, is_causal)
        if (
            type(query) is not SimCudaTensor
            or type(key) is not SimCudaTensor
            or type(value) is not SimCudaTensor
            or (attn_mask is not None and type(attn_mask) is not SimCudaTensor)
        ):
            return original(*args, scale=scale, enable_gqa=enable_gqa)
        host_mask = attn_mask._elem if attn_mask is not None else None
        choice = torch._fused_sdp_choice(
            query._elem,
            key._elem,
            value._elem,
            host_mask,
            dropout_p,
            is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )
        if choice != _FLASH:
            return original(*args, scale=scale, enable_gqa=enable_gqa)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            # what torch's convert_boolean_attn_mask does before the CPU kernel
            attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill_(
                attn_mask.logical_not(), float("-inf")
            )
        return _flash_for_cpu(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]

    return in_ranks(original, attention)
