"""Fused attention on a GPU: the kernel torch's ``scaled_dot_product_attention`` picks on the device, and the time
its forward and backward passes take by head dim, sequence length and causal mask (seconds)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import pairwise

import torch

from simdist.errors import ClusterSpecError

#: the kernels torch's scaled_dot_product_attention chooses among on a GPU (torch's SDPBackend names)
BACKENDS = ("cudnn", "flash", "efficient", "math")

#: the fused kernel each aten op names, where the op is one GPU kernel's (the CPU's fused kernel and the
#: overrideable one stand for whichever kernel torch picks on the device)
KERNEL_OF_OP = {
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_flash_attention_backward": "flash",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_efficient_attention_backward": "efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_cudnn_attention_backward": "cudnn",
}


@dataclass(frozen=True)
class KernelFit:
    """How one attention kernel's pass (forward or backward) on one GPU architecture falls short of the device's
    rate for its dtype.

    The kernel cuts each (batch, head)'s queries into blocks of ``tile`` rows, one thread block (CTA) each, which
    walks the keys in blocks of ``tile`` (FlashAttention's tiling; the backward pass walks the transpose, with the
    same count). A tile runs at ``efficiency`` (by head dim) of the device's rate; every CTA also pays
    ``cta_tiles`` tiles' time (loading its queries, writing its output and softmax statistics), which is what keeps
    short sequences far from peak. Under a causal mask a CTA stops at the diagonal, and each tile the diagonal cuts
    costs ``diagonal_tiles`` more (masking scores one by one); ``causal_efficiency`` is what remains of the causal
    kernels' shortfall at long sequences (load imbalance between short and long CTAs).
    """

    #: (head dim, fraction of the device's rate inside a tile), by increasing head dim; interpolated between them
    efficiency: tuple[tuple[int, float], ...]
    #: tiles' worth of time each CTA adds besides its tiles
    cta_tiles: float
    #: tiles' worth of time each tile a causal mask cuts adds
    diagonal_tiles: float
    #: the fraction of the rate a causal kernel keeps at long sequences
    causal_efficiency: float = 1.0

    def __post_init__(self) -> None:
        dims = [d for d, _ in self.efficiency]
        if (
            not self.efficiency
            or dims != sorted(set(dims))
            or not all(isinstance(d, int) and d > 0 and 0 < e <= 1 for d, e in self.efficiency)
        ):
            raise ClusterSpecError(
                f"KernelFit: efficiency must be (head dim, efficiency) pairs by increasing positive int head dim "
                f"with 0 < efficiency <= 1, found {self.efficiency!r}"
            )
        for name in ("cta_tiles", "diagonal_tiles"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ClusterSpecError(f"KernelFit: {name} must be a finite number >= 0, found {value!r}")
        if not 0 < self.causal_efficiency <= 1:
            raise ClusterSpecError(
                f"KernelFit: causal_efficiency must be in (0, 1], found {self.causal_efficiency!r}"
            )

    def at(self, head_dim: float) -> float:
        """The efficiency at ``head_dim``: linear between the fitted head dims, the nearest one outside them."""
        points = self.efficiency
        if head_dim <= points[0][0]:
            return points[0][1]
        for (d0, e0), (d1, e1) in pairwise(points):
            if head_dim <= d1:
                return e0 + (e1 - e0) * (head_dim - d0) / (d1 - d0)
        return points[-1][1]


@dataclass(frozen=True)
class AttentionModel:
    """One GPU architecture's fused attention kernels: each backend's forward and backward :class:`KernelFit`, the
    tile they cut scores into, and the largest head dim torch lets cuDNN's kernel take."""

    #: (backend, forward, backward) for each fused backend of BACKENDS ("math" is priced as its matmuls)
    kernels: tuple[tuple[str, KernelFit, KernelFit], ...]
    #: rows (and columns) of the score tiles each CTA computes at a time
    tile: int = 128
    #: the largest query and value head dim cuDNN's kernel takes (torch's check_cudnn_tensor_shapes: 128 unless
    #: cuDNN 9.22 and cudnn-frontend 1.24 are at hand on sm90/sm10x)
    cudnn_head_dim: int = 128

    def __post_init__(self) -> None:
        names = [k[0] for k in self.kernels]
        if sorted(names) != sorted(set(names)) or not set(names) <= set(BACKENDS[:3]) or not names:
            raise ClusterSpecError(
                f"AttentionModel: kernels must name each of {BACKENDS[:3]} at most once, found {names!r}"
            )
        if not all(isinstance(f, KernelFit) and isinstance(b, KernelFit) for _, f, b in self.kernels):
            raise ClusterSpecError("AttentionModel: each kernel needs a forward and a backward KernelFit")
        if not (isinstance(self.tile, int) and self.tile > 0):
            raise ClusterSpecError(f"AttentionModel: tile must be a positive int, found {self.tile!r}")

    def fit(self, backend: str, backward: bool) -> KernelFit:
        """The fit of ``backend``'s pass; a backend without one takes flash's (or the first one's)."""
        table = {name: (f, b) for name, f, b in self.kernels}
        pair = table.get(backend) or table.get("flash") or self.kernels[0][1:]
        return pair[1] if backward else pair[0]

    def seconds(
        self,
        backend: str,
        backward: bool,
        heads: int,
        sq: int,
        sk: int,
        dq: int,
        dv: int,
        causal: bool,
        rate: float,
        sms: int,
        tensor_cores: bool = True,
    ) -> float:
        """Seconds ``backend``'s forward (or backward) pass over ``heads`` (batch x heads) of ``sq`` queries and
        ``sk`` keys takes at ``rate`` FLOP/s on ``sms`` SMs (no launch, no memory floor). Without ``tensor_cores``
        (float32) a tile runs at the full rate: the efficiencies are what the softmax's exponentials and the
        pipeline leave of tensor cores' rate, and next to float32's multiply-adds on the CUDA cores those cost
        little (an exponential per score against 4 x head dim multiply-add FLOPs at 1/20 of the half rate)."""
        fit = self.fit(backend, backward)
        tile = self.tile
        blocks_q, blocks_k = -(-sq // tile), -(-sk // tile)
        if causal:
            # query block j (rows j*tile..) sees keys up to its last row: min(blocks_k, j + 1) blocks, the last cut
            full = min(blocks_q, blocks_k)
            per_head = full * (full + 1) // 2 + (blocks_q - full) * blocks_k
            longest = blocks_k
            cut = full
        else:
            per_head, longest, cut = blocks_q * blocks_k, blocks_k, 0
        work = heads * (per_head + blocks_q * fit.cta_tiles + cut * fit.diagonal_tiles)
        # one tile: tile x tile scores, each 2 (dq + dv) FLOPs forward, 2.5 times that backward
        flops = tile * tile * 2.0 * (dq + dv) * (2.5 if backward else 1.0)
        efficiency = (fit.at(max(dq, dv)) if tensor_cores else 1.0) * (
            fit.causal_efficiency if causal else 1.0
        )
        tile_seconds = flops / (rate / sms * efficiency)
        # the SMs share the CTAs; the longest CTA bounds the time where there are few
        return max(work / sms, longest + fit.cta_tiles) * tile_seconds


def sdpa_backend(
    capability: tuple[int, int],
    dtype: torch.dtype,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    masked: bool,
    dropout: float,
    causal: bool,
    cudnn_head_dim: int = 128,
) -> str:
    """The kernel torch's scaled_dot_product_attention picks on a GPU of compute ``capability`` for these dense
    (batch, heads, seq, dim) operands (torch's sdp_utils.cpp: its priority order, each kernel's constraints and the
    switches of torch.backends.cuda, read now as torch reads them at each call)."""
    sq, sk = q.shape[-2], k.shape[-2]
    dq, dk, dv = q.shape[-1], k.shape[-1], v.shape[-1]
    half = dtype in (torch.float16, torch.bfloat16)
    modern = capability >= (8, 0)
    backends = torch.backends.cuda

    def cudnn() -> bool:
        return (
            backends.cudnn_sdp_enabled()
            and half
            and modern
            and not torch.are_deterministic_algorithms_enabled()
            and dq <= cudnn_head_dim
            and dv <= cudnn_head_dim
            and dq % 8 == 0
            and dv % 8 == 0
            and sk != 1
            and dropout * 16 == math.floor(dropout * 16)
        )

    def flash() -> bool:
        return (
            backends.flash_sdp_enabled()
            and half
            and (8, 0) <= capability <= (12, 1)
            and not masked
            and dq == dk == dv <= 256
            and (not causal or sq == sk)
        )

    def efficient() -> bool:
        align = 8 if half and modern else 4
        return (
            backends.mem_efficient_sdp_enabled()
            and dtype in (torch.float16, torch.bfloat16, torch.float32)
            and dq == dk
            and dq % align == 0
            and dv % align == 0
        )

    checks = {"cudnn": cudnn, "flash": flash, "efficient": efficient}
    # torch prefers cuDNN's kernel on sm90 and sm10x (check_prefer_cudnn_attention, with cuDNN above 9.15), else
    # flash, then memory-efficient, then the math path, cuDNN last
    order = ("cudnn", "flash", "efficient") if capability[0] in (9, 10) else ("flash", "efficient")
    for name in order:
        if checks[name]():
            return name
    if backends.math_sdp_enabled() or capability[0] in (9, 10) or not cudnn():
        return "math"
    return "cudnn"


@dataclass(frozen=True)
class AttentionCall:
    """Where one fused attention op keeps what its price needs: the index of its query (key and value follow), of
    ``is_causal`` and ``dropout_p`` (None: the op has none), its mask (an int: the positional index of
    ``attn_bias``; a str: the keyword ``attn_mask``), whether it is a backward pass, and the backend it is one of
    (None: the one torch would pick on the device)."""

    query_at: int
    causal_at: int | None
    dropout_at: int | None
    mask_at: int | str | None
    backward: bool
    backend: str | None

    def read(self, args: tuple | list, kwargs: dict | None) -> tuple[torch.Tensor, ...] | None:
        """(query, key, value) of a dense (batch, heads, seq, dim) call, or None for another layout."""
        q, k, v = args[self.query_at : self.query_at + 3]
        return (q, k, v) if q.dim() == 4 and k.dim() == 4 and v.dim() == 4 else None

    def causal(self, args: tuple | list) -> bool:
        """Whether the call masks causally (torch drops a default ``is_causal`` from the end of the arguments)."""
        return self.causal_at is not None and len(args) > self.causal_at and bool(args[self.causal_at])

    def dropout(self, args: tuple | list) -> float:
        """The call's dropout probability."""
        at = self.dropout_at
        return float(args[at]) if at is not None and len(args) > at else 0.0

    def masked(self, args: tuple | list, kwargs: dict | None) -> bool:
        """Whether the call has a mask or bias tensor."""
        at = self.mask_at
        if isinstance(at, str):
            return (kwargs or {}).get(at) is not None
        return at is not None and len(args) > at and isinstance(args[at], torch.Tensor)


def attention_calls(causal_position: dict[str, int | None]) -> dict[str, AttentionCall]:
    """Each fused attention op's AttentionCall, by aten name; ``causal_position`` gives where each takes
    ``is_causal`` (read from its schema)."""
    calls: dict[str, AttentionCall] = {}
    for kernel, dropout, mask in (
        ("flash_attention_for_cpu", (3, 6), "attn_mask"),
        ("fused_attention_overrideable", (4, 12), (3, 4)),
        ("flash_attention", (3, 10), None),
        ("efficient_attention", (5, 9), (3, 4)),
        ("cudnn_attention", (5, 13), (3, 8)),
    ):
        for backward in (False, True):
            name = f"aten::_scaled_dot_product_{kernel}" + ("_backward" if backward else "")
            calls[name] = AttentionCall(
                query_at=1 if backward else 0,
                causal_at=causal_position[name],
                dropout_at=dropout[backward],
                mask_at=mask if isinstance(mask, (str, type(None))) else mask[backward],
                backward=backward,
                backend=KERNEL_OF_OP.get(name),
            )
    return calls


# The fitted architectures. Each figure comes from benchmarks/fidelity_attention.py's fit (`python3
# benchmarks/fidelity_attention.py` prints them; tests/test_attention_model.py checks they are its output), on the
# rows it names: per kernel and pass, the efficiency at head dim 128 and cta_tiles from the 16k and 512 non-causal
# rows at head dim 128, the efficiencies at head dims 64 and 256 from their 16k non-causal rows, causal_efficiency
# and diagonal_tiles from the 16k and 512 causal rows at head dim 128. Every other row is held out.
HOPPER_ATTENTION = AttentionModel(
    kernels=(
        # cuDNN's forward: the FlashAttention-3 paper's cuDNN bars on an H100; its backward (no published row
        # here): flash's backward pass, faster by what cuDNN's forward pass is at each head dim
        (
            "cudnn",
            KernelFit(((64, 0.646), (128, 0.931), (256, 0.909)), 0.645, 0.197, 0.921),
            KernelFit(((64, 0.575), (128, 0.828), (256, 0.809)), 1.725, 0.118, 1.0),
        ),
        # FlashAttention-2 (torch's flash kernel): forward from the FlashAttention-3 paper's FlashAttention-2 bars,
        # backward from FlashAttention-2's forward+backward bars less that forward (head dim 256 at the forward's
        # ratio of 256 to 128)
        (
            "flash",
            KernelFit(((64, 0.507), (128, 0.579), (256, 0.51)), 0.712, 0.283, 0.922),
            KernelFit(((64, 0.451), (128, 0.515), (256, 0.454)), 1.725, 0.118, 1.0),
        ),
        # the memory-efficient kernel (xformers'): not measured on an H100; flash's, slower by what xformers is
        # on the A100
        (
            "efficient",
            KernelFit(((64, 0.216), (128, 0.279), (256, 0.246)), 0.712, 0.283, 0.922),
            KernelFit(((64, 0.192), (128, 0.249), (256, 0.219)), 1.725, 0.118, 1.0),
        ),
    )
)
#: the A100: the same sm80 FlashAttention-2 and xformers code as on the H100, so flash's shape constants; each head
#: dim's efficiency scaled to FlashAttention-2's and xformers' 16k non-causal forward+backward rows on an A100
AMPERE_ATTENTION = AttentionModel(
    kernels=(
        (
            "flash",
            KernelFit(((64, 0.621), (128, 0.717), (256, 0.631)), 0.712, 0.283, 0.922),
            KernelFit(((64, 0.553), (128, 0.637), (256, 0.562)), 1.725, 0.118, 1.0),
        ),
        (
            "efficient",
            KernelFit(((64, 0.265), (128, 0.346), (256, 0.305)), 0.712, 0.283, 0.922),
            KernelFit(((64, 0.235), (128, 0.308), (256, 0.271)), 1.725, 0.118, 1.0),
        ),
    )
)
