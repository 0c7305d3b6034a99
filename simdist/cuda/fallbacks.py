"""CPU stand-ins for the CUDA-only kernels that torch's composite code picks on a CUDA device, and the error for
the ones that have none.

torch's C++ picks some kernels by the tensors' device: on ``cuda`` ``SyncBatchNorm`` calls the batch-norm
statistics kernels, ``nn.LSTM`` / ``nn.GRU`` the fused cell kernels, DTensor's attention CUDA's flash kernel, none
of which a CPU build has. Each entry
of :data:`FALLBACKS` computes what its CUDA kernel computes, with CPU ops on the CPU tensors a simulated GPU
holds. It runs as one op of the rank's dispatch mode, so the cost model prices it as the one CUDA kernel it stands
for (its bytes read and written, plus one launch; these kernels are memory-bound), under the CUDA kernel's name.
An op with neither a CPU kernel nor an entry here raises :class:`~simdist.errors.UnsupportedCudaOpError`, naming
the op and the user's line.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from simdist.errors import UnsupportedCudaOpError
from simdist.layers import NOT_CALL_SITES

aten = torch.ops.aten


def _acc(t: torch.Tensor) -> torch.dtype:
    """The dtype CUDA's normalisation kernels accumulate ``t`` in (float32 for half precision)."""
    return torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype


def _channels(x: torch.Tensor) -> list[int]:
    """The dimensions a batch norm reduces over: all but the channels (dimension 1)."""
    return [d for d in range(x.dim()) if d != 1]


def _per_channel(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A per-channel vector shaped to broadcast over ``x`` (channels in dimension 1)."""
    return v.view([1, -1] + [1] * (x.dim() - 2))


# ---------------------------------------------------------------------------------------------- SyncBatchNorm
def batch_norm_stats(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA's ``batch_norm_stats``: per-channel mean and 1/sqrt(biased variance + eps) of this rank's batch."""
    xf = x.to(_acc(x))
    var, mean = torch.var_mean(xf, dim=_channels(x), correction=0)
    return mean, torch.rsqrt(var + eps)


def batch_norm_gather_stats_with_counts(
    x: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    momentum: float,
    eps: float,
    counts: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA's ``batch_norm_gather_stats_with_counts``: the global mean and invstd from every rank's (mean, invstd,
    count), the running statistics updated in place (with the unbiased variance, as CUDA does)."""
    n = counts.to(mean.dtype).view(-1, 1)
    total = n.sum()
    var_i = (1.0 / (invstd * invstd)) - eps
    global_mean = (n * mean).sum(0) / total
    # parallel variance: within-rank sums of squares plus the spread of the rank means
    m2 = (n * (var_i + (mean - global_mean) ** 2)).sum(0)
    var = m2 / total
    if running_mean is not None:
        running_mean.copy_((1 - momentum) * running_mean + momentum * global_mean.to(running_mean.dtype))
    if running_var is not None:
        unbiased = var * total / (total - 1)
        running_var.copy_((1 - momentum) * running_var + momentum * unbiased.to(running_var.dtype))
    return global_mean, torch.rsqrt(var + eps)


def batch_norm_elemt(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """CUDA's ``batch_norm_elemt``: (x - mean) * invstd * weight + bias, in ``x``'s dtype."""
    y = (x.to(mean.dtype) - _per_channel(mean, x)) * _per_channel(invstd, x)
    if weight is not None:
        y = y * _per_channel(weight.to(mean.dtype), x)
    if bias is not None:
        y = y + _per_channel(bias.to(mean.dtype), x)
    return y.to(x.dtype)


def batch_norm_backward_reduce(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None,
    input_g: bool,
    weight_g: bool,
    bias_g: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """CUDA's ``batch_norm_backward_reduce``: per channel, sum(dy), sum(dy * (x - mean)), and the weight and bias
    gradients (sum(dy * (x - mean)) * invstd and sum(dy)). All four are computed: the caller drops what it does not
    need."""
    dims = _channels(x)
    dy = grad_out.to(mean.dtype)
    sum_dy = dy.sum(dims)
    sum_dy_xmu = (dy * (x.to(mean.dtype) - _per_channel(mean, x))).sum(dims)
    dtype = weight.dtype if weight is not None else x.dtype
    return sum_dy, sum_dy_xmu, (sum_dy_xmu * invstd).to(dtype), sum_dy.to(dtype)


def batch_norm_backward_elemt(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None,
    sum_dy: torch.Tensor,
    sum_dy_xmu: torch.Tensor,
    count: torch.Tensor,
) -> torch.Tensor:
    """CUDA's ``batch_norm_backward_elemt``: the input's gradient from the global sums (``count``: each rank's
    element count per channel)."""
    total = count.to(mean.dtype).sum()
    mean_dy = _per_channel(sum_dy / total, x)
    mean_dy_xmu = _per_channel(sum_dy_xmu / total, x)
    inv = _per_channel(invstd, x)
    xmu = x.to(mean.dtype) - _per_channel(mean, x)
    scale = inv if weight is None else inv * _per_channel(weight.to(mean.dtype), x)
    grad = (grad_out.to(mean.dtype) - mean_dy - xmu * inv * inv * mean_dy_xmu) * scale
    return grad.to(x.dtype)


# ---------------------------------------------------------------------------------------------- recurrent cells
def _gates(
    input_gates: torch.Tensor,
    hidden_gates: torch.Tensor,
    input_bias: torch.Tensor | None,
    hidden_bias: torch.Tensor | None,
) -> torch.Tensor:
    gates = input_gates + hidden_gates
    if input_bias is not None:
        gates = gates + input_bias
    if hidden_bias is not None:
        gates = gates + hidden_bias
    return gates


def thnn_fused_lstm_cell(
    input_gates: torch.Tensor,
    hidden_gates: torch.Tensor,
    cx: torch.Tensor,
    input_bias: torch.Tensor | None = None,
    hidden_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CUDA's fused LSTM cell: (hy, cy, workspace), the workspace holding the activated gates (i, f, g, o)."""
    i, f, g, o = _gates(input_gates, hidden_gates, input_bias, hidden_bias).chunk(4, 1)
    i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
    cy = f * cx + i * g
    hy = o * cy.tanh()
    return hy, cy, torch.cat([i, f, g, o], 1)


def thnn_fused_lstm_cell_backward_impl(
    grad_hy: torch.Tensor | None,
    grad_cy: torch.Tensor | None,
    cx: torch.Tensor,
    cy: torch.Tensor,
    workspace: torch.Tensor,
    has_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CUDA's fused LSTM cell backward: (gradient of the gates before activation, of cx, of the bias)."""
    i, f, g, o = workspace.chunk(4, 1)
    tanh_cy = cy.tanh()
    ghy = torch.zeros_like(cy) if grad_hy is None else grad_hy
    gcx = ghy * o * (1 - tanh_cy * tanh_cy)
    if grad_cy is not None:
        gcx = gcx + grad_cy
    grad_gates = torch.cat(
        [gcx * g * i * (1 - i), gcx * cx * f * (1 - f), gcx * i * (1 - g * g), ghy * tanh_cy * o * (1 - o)], 1
    )
    grad_bias = grad_gates.sum(0) if has_bias else grad_gates.new_empty(0)
    return grad_gates, gcx * f, grad_bias


def thnn_fused_gru_cell(
    input_gates: torch.Tensor,
    hidden_gates: torch.Tensor,
    hx: torch.Tensor,
    input_bias: torch.Tensor | None = None,
    hidden_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA's fused GRU cell: (hy, workspace), the workspace holding r, z, the input's and the hidden state's
    new-gate terms, n and hx."""
    if input_bias is not None:
        input_gates = input_gates + input_bias
    if hidden_bias is not None:
        hidden_gates = hidden_gates + hidden_bias
    ir, iz, i_n = input_gates.chunk(3, 1)
    hr, hz, h_n = hidden_gates.chunk(3, 1)
    r = (ir + hr).sigmoid()
    z = (iz + hz).sigmoid()
    n = (i_n + r * h_n).tanh()
    hy = n + z * (hx - n)
    return hy, torch.cat([r, z, i_n, h_n, n, hx], 1)


def thnn_fused_gru_cell_backward(
    grad_hy: torch.Tensor, workspace: torch.Tensor, has_bias: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """CUDA's fused GRU cell backward: gradients of the input gates, the hidden gates, hx, and the two biases."""
    r, z, _, h_n, n, hx = workspace.chunk(6, 1)
    grad_n = grad_hy * (1 - z) * (1 - n * n)
    grad_z = grad_hy * (hx - n) * z * (1 - z)
    grad_r = grad_n * h_n * r * (1 - r)
    grad_input = torch.cat([grad_r, grad_z, grad_n], 1)
    grad_hidden = torch.cat([grad_r, grad_z, grad_n * r], 1)
    empty = grad_hy.new_empty(0)
    return (
        grad_input,
        grad_hidden,
        grad_hy * z,
        grad_input.sum(0) if has_bias else empty,
        grad_hidden.sum(0) if has_bias else empty,
    )


# ---------------------------------------------------------------------------------------------- attention
def flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    return_debug_mask: bool = False,
    *,
    scale: float | None = None,
) -> tuple[Any, ...]:
    """CUDA's flash attention kernel, as the CPU's flash kernel computes it: the output and the log-sum-exp its
    backward needs; the varlen and random-state outputs are what CUDA returns for dense, dropout-free attention."""
    out, logsumexp = aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, scale=scale
    )
    unused = torch.empty((), dtype=torch.uint64)
    return (
        out,
        logsumexp,
        None,
        None,
        query.shape[2],
        key.shape[2],
        torch.zeros(2, dtype=torch.uint64),
        unused,
        query.new_empty(0),
    )


def flash_attention_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    cum_seq_q: Any,
    cum_seq_k: Any,
    max_q: int,
    max_k: int,
    dropout_p: float,
    is_causal: bool,
    philox_seed: Any,
    philox_offset: Any,
    *,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CUDA's flash attention backward, as the CPU's flash backward computes it."""
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, scale=scale
    )


def no_vendor_ctc_loss(*args: Any) -> bool:
    """CUDA's ``_use_cudnn_ctc_loss`` (and ROCm's ``_use_miopen_ctc_loss``): False, cuDNN is not emulated, so CUDA's
    native CTC kernel runs."""
    return False


#: CUDA-only aten ops and the CPU computation standing in for each (keyed by OpOverload)
FALLBACKS: dict[Any, Callable[..., Any]] = {
    # SyncBatchNorm's forward: local statistics (Welford in CUDA), their combination across ranks (running
    # statistics updated with the unbiased variance), the normalisation
    aten.batch_norm_stats.default: batch_norm_stats,
    aten.batch_norm_gather_stats_with_counts.default: batch_norm_gather_stats_with_counts,
    aten.batch_norm_elemt.default: batch_norm_elemt,
    # SyncBatchNorm's backward: per-channel reductions, then the input's gradient from the all-reduced sums
    aten.batch_norm_backward_reduce.default: batch_norm_backward_reduce,
    aten.batch_norm_backward_elemt.default: batch_norm_backward_elemt,
    # nn.LSTM / nn.LSTMCell on CUDA: the pointwise part of a cell (gate activations, cell and hidden state) in
    # one kernel (lstm_cell_forward in RNN.cu), and its backward
    aten._thnn_fused_lstm_cell.default: thnn_fused_lstm_cell,
    aten._thnn_fused_lstm_cell_backward_impl.default: thnn_fused_lstm_cell_backward_impl,
    # nn.GRU / nn.GRUCell on CUDA: gru_cell_forward in RNN.cu, and its backward
    aten._thnn_fused_gru_cell.default: thnn_fused_gru_cell,
    aten._thnn_fused_gru_cell_backward.default: thnn_fused_gru_cell_backward,
    # CUDA's flash attention kernel and its backward: what DTensor's attention calls on the local shards (it has
    # sharding rules for CUDA's kernels only)
    aten._scaled_dot_product_flash_attention.default: flash_attention,
    aten._scaled_dot_product_flash_attention_backward.default: flash_attention_backward,
    # F.ctc_loss on CUDA asks whether cuDNN's (or MIOpen's) CTC kernel applies: a check on the host, no kernel (the
    # cost model charges nothing); the loss and its backward have CPU kernels
    aten._use_cudnn_ctc_loss.default: no_vendor_ctc_loss,
    aten._use_cudnn_ctc_loss.Tensor: no_vendor_ctc_loss,
    aten._use_miopen_ctc_loss.default: no_vendor_ctc_loss,
    aten._use_miopen_ctc_loss.Tensor: no_vendor_ctc_loss,
}

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def user_line() -> str:
    """The innermost frame that is neither torch's nor the simulator's: the user's line, as ``file:line``."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_TORCH_DIR) and not name.startswith(NOT_CALL_SITES):
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"


def unsupported(func: Any, device: torch.device) -> UnsupportedCudaOpError:
    """The error for ``func``, which has no CPU kernel and no entry in :data:`FALLBACKS`, called on ``device``."""
    return UnsupportedCudaOpError(
        f"{func._schema.name} (called at {user_line()}) has a CUDA kernel only, and the simulated GPU ({device}) has "
        "no CPU stand-in for it: the simulated GPUs compute with the CPU kernels. Use an op with a CPU kernel there "
        "(the program written for the CPU shows which), or run this part of the program on the CPU"
    )
