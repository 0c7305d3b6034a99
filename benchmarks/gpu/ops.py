"""The ops the compute measurements time: one catalogue for the GPU (compute.py) and simdist's side (compare.py).

Each case builds its inputs on any device (the GPU, a CPU for dry runs, the meta device for simdist's estimate)
and runs the op once. The classes are those simdist's cost model prices (simdist/compute/cost.py): matmuls
(FLOP-bound, per dtype), attention, norms, elementwise ops, softmax, embedding lookups, and a whole transformer
block forward, and forward with backward. ``dtype`` "tf32" is float32 run with TF32 tensor cores allowed;
"fp32" is float32 with TF32 off (PyTorch's default for matmuls).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from model import BlockShape, block, block_input

DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

Inputs = tuple[Any, ...]


@dataclass(frozen=True)
class OpCase:
    """One measured op: its class, dtype label, shape, how to build inputs and how to run it once."""

    id: str
    cls: str
    op: str
    dtype: str
    shape: dict[str, Any]
    make: Callable[[torch.device | str, int], Inputs] = field(repr=False)
    run: Callable[[Inputs], Any] = field(repr=False)
    #: closed-form FLOPs (matmul-like ops; 0 for memory-bound ones), for the achieved-rate column
    flops: float = 0.0
    #: bytes an ideal kernel reads and writes once, for the achieved-bandwidth column
    bytes: float = 0.0


@contextlib.contextmanager
def precision(dtype: str) -> Iterator[None]:
    """TF32 allowed for "tf32" cases only (matmuls and convolutions): float32 is exact float32 otherwise.

    compute.py measures each case inside it, and compare.py prices each case inside it, so simdist reads the
    switches the measurement ran under.
    """
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = dtype == "tf32"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _rand(device: torch.device | str, dtype: torch.dtype, *shape: int, seed: int) -> torch.Tensor:
    """A random tensor drawn on ``device`` itself (large inputs would take seconds on a CPU), or a meta one."""
    if torch.device(device).type == "meta":
        return torch.empty(*shape, dtype=dtype, device="meta")
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(*shape, generator=gen, device=device, dtype=dtype)


def _matmul(m: int, n: int, k: int, dt: str) -> OpCase:
    """``mm`` of (m, k) by (k, n)."""
    dtype = DTYPES[dt]
    return OpCase(
        f"mm {dt} {m}x{n}x{k}",
        "matmul",
        "mm",
        dt,
        {"m": m, "n": n, "k": k},
        lambda dev, s: (_rand(dev, dtype, m, k, seed=s), _rand(dev, dtype, k, n, seed=s + 1)),
        lambda x: torch.mm(*x),
        flops=2.0 * m * n * k,
        bytes=float((m * k + k * n + m * n) * dtype.itemsize),
    )


def _bmm(b: int, m: int, n: int, k: int, dt: str) -> OpCase:
    """``bmm`` of b batches of (m, k) by (k, n)."""
    dtype = DTYPES[dt]
    return OpCase(
        f"bmm {dt} {b}x{m}x{n}x{k}",
        "matmul",
        "bmm",
        dt,
        {"b": b, "m": m, "n": n, "k": k},
        lambda dev, s: (_rand(dev, dtype, b, m, k, seed=s), _rand(dev, dtype, b, k, n, seed=s + 1)),
        lambda x: torch.bmm(*x),
        flops=2.0 * b * m * n * k,
        bytes=float(b * (m * k + k * n + m * n) * dtype.itemsize),
    )


def _attention(
    b: int, h: int, s: int, d: int, dt: str, causal: bool = False, backward: bool = False
) -> OpCase:
    """``scaled_dot_product_attention`` on (b, h, s, d) queries, keys and values; optionally causal, with backward."""
    dtype = DTYPES[dt]

    def make(dev: torch.device | str, seed: int) -> Inputs:
        q, k, v = (_rand(dev, dtype, b, h, s, d, seed=seed + i).requires_grad_(backward) for i in range(3))
        return q, k, v

    def run(x: Inputs) -> Any:
        out = F.scaled_dot_product_attention(*x, is_causal=causal)
        if backward:
            for t in x:
                t.grad = None
            out.backward(torch.ones_like(out))
        return out

    # Full attention: scores and output, two matmuls of 2*b*h*s*s*d each; backward five (as the cost model).
    flops = 4.0 * b * h * s * s * d * (1 + 1.5 * backward)
    name = "sdpa" + (" causal" if causal else "") + (" fwd+bwd" if backward else "")
    return OpCase(
        f"{name} {dt} b{b} h{h} s{s} d{d}",
        "attention",
        name,
        dt,
        {"b": b, "h": h, "s": s, "d": d},
        make,
        run,
        flops=flops,
        bytes=4.0 * b * h * s * d * dtype.itemsize,
    )


def _norm(kind: str, tokens: int, hidden: int, dt: str) -> OpCase:
    """``layer_norm`` or ``rms_norm`` over the last dimension of (tokens, hidden)."""
    dtype = DTYPES[dt]

    def make(dev: torch.device | str, seed: int) -> Inputs:
        return _rand(dev, dtype, tokens, hidden, seed=seed), _rand(dev, dtype, hidden, seed=seed + 1)

    def run(x: Inputs) -> Any:
        if kind == "layer_norm":
            return F.layer_norm(x[0], (hidden,), x[1], x[1])
        return F.rms_norm(x[0], (hidden,), x[1])

    return OpCase(
        f"{kind} {dt} {tokens}x{hidden}",
        "norm",
        kind,
        dt,
        {"tokens": tokens, "hidden": hidden},
        make,
        run,
        bytes=2.0 * tokens * hidden * dtype.itemsize,
    )


def _elementwise(kind: str, n: int, dt: str) -> OpCase:
    """``add``, ``mul`` (two inputs) or ``gelu`` (one) on ``n`` elements."""
    dtype = DTYPES[dt]
    arity = 1 if kind == "gelu" else 2
    fns: dict[str, Callable[..., Any]] = {"add": torch.add, "mul": torch.mul, "gelu": F.gelu}
    return OpCase(
        f"{kind} {dt} n{n}",
        "elementwise",
        kind,
        dt,
        {"n": n},
        lambda dev, s: tuple(_rand(dev, dtype, n, seed=s + i) for i in range(arity)),
        lambda x: fns[kind](*x),
        bytes=float((arity + 1) * n * dtype.itemsize),
    )


def _softmax(rows: int, cols: int, dt: str) -> OpCase:
    """Softmax over the last dimension of (rows, cols)."""
    dtype = DTYPES[dt]
    return OpCase(
        f"softmax {dt} {rows}x{cols}",
        "softmax",
        "softmax",
        dt,
        {"rows": rows, "cols": cols},
        lambda dev, s: (_rand(dev, dtype, rows, cols, seed=s),),
        lambda x: torch.softmax(x[0], dim=-1),
        bytes=2.0 * rows * cols * dtype.itemsize,
    )


def _embedding(vocab: int, dim: int, tokens: int, dt: str) -> OpCase:
    """Lookup of ``tokens`` random ids in a (vocab, dim) table."""
    dtype = DTYPES[dt]

    def make(dev: torch.device | str, seed: int) -> Inputs:
        if torch.device(dev).type == "meta":
            idx = torch.empty(tokens, dtype=torch.long, device="meta")
        else:
            gen = torch.Generator(device=dev).manual_seed(seed)
            idx = torch.randint(vocab, (tokens,), generator=gen, device=dev)
        return idx, _rand(dev, dtype, vocab, dim, seed=seed + 1)

    return OpCase(
        f"embedding {dt} v{vocab} d{dim} t{tokens}",
        "embedding",
        "embedding",
        dt,
        {"vocab": vocab, "dim": dim, "tokens": tokens},
        make,
        lambda x: F.embedding(*x),
        bytes=float(2 * tokens * dim * dtype.itemsize + tokens * 8),
    )


def _block(shape: BlockShape, dt: str, backward: bool) -> OpCase:
    """A transformer block forward (with autograd recording), or forward and backward."""
    dtype = DTYPES[dt]

    def make(dev: torch.device | str, seed: int) -> Inputs:
        return block(shape, dtype, dev, seed), block_input(shape, dtype, dev, seed + 1).requires_grad_(
            backward
        )

    def run(x: Inputs) -> Any:
        module, inp = x
        out = module(inp)
        if backward:
            # Gradients set to None first: backward then writes them rather than adding to old ones.
            module.zero_grad(set_to_none=True)
            inp.grad = None
            out.backward(torch.ones_like(out))
        return out

    d, tokens = shape.d_model, shape.batch * shape.seq
    # Matmul FLOPs only (QKV, proj, MLP: 12 d^2 per token; attention 4 s d per token): forward, x3 with backward.
    flops = (24.0 * tokens * d * d + 4.0 * tokens * shape.seq * d) * (3 if backward else 1)
    kind = "block fwd+bwd" if backward else "block fwd"
    return OpCase(
        f"{kind} {dt} {shape.label}",
        "block",
        kind,
        dt,
        {"d_model": shape.d_model, "heads": shape.heads, "batch": shape.batch, "seq": shape.seq},
        make,
        run,
        flops=flops,
    )


def cases(dry_run: bool) -> list[OpCase]:
    """Every case, in the order they are measured; ``dry_run`` gives tiny shapes that run on a CPU."""
    if dry_run:
        return [
            *(_matmul(64, 48, 32, dt) for dt in DTYPES),
            _bmm(2, 16, 16, 8, "fp32"),
            _attention(1, 2, 32, 16, "fp32"),
            _attention(1, 2, 32, 16, "fp32", causal=True, backward=True),
            _norm("layer_norm", 64, 128, "fp32"),
            _norm("rms_norm", 64, 128, "bf16"),
            *(_elementwise(k, 4096, "fp32") for k in ("add", "mul", "gelu")),
            _softmax(64, 128, "fp32"),
            _embedding(1000, 64, 128, "fp32"),
            _block(BlockShape(64, 4, 2, 32), "fp32", backward=False),
            _block(BlockShape(64, 4, 2, 32), "fp32", backward=True),
        ]
    shapes = [(n, n, n) for n in (512, 1024, 2048, 4096, 8192)]
    shapes += [(8192, 11008, 4096), (8192, 4096, 11008), (16, 4096, 4096), (8192, 50304, 768)]
    out = [_matmul(m, n, k, dt) for m, n, k in shapes for dt in DTYPES]
    out.append(_bmm(32, 2048, 2048, 128, "bf16"))
    for b, h, s, d in ((8, 16, 1024, 64), (4, 32, 2048, 128), (1, 16, 8192, 128)):
        out += [_attention(b, h, s, d, "bf16"), _attention(b, h, s, d, "fp16")]
    out += [
        _attention(4, 32, 2048, 128, "fp32"),
        _attention(4, 32, 2048, 128, "bf16", causal=True),
        _attention(4, 32, 2048, 128, "bf16", backward=True),
    ]
    out += [
        _norm(k, t, h, dt)
        for k in ("layer_norm", "rms_norm")
        for t, h in ((8192, 4096), (16384, 8192))
        for dt in ("bf16", "fp32")
    ]
    out += [
        _elementwise(k, n, dt)
        for k in ("add", "mul", "gelu")
        for n in (1 << 24, 1 << 27)
        for dt in ("bf16", "fp32")
    ]
    out += [_elementwise(k, 1 << 16, "fp32") for k in ("add", "mul", "gelu")]  # the launch floor
    out += [_softmax(r, c, dt) for r, c in ((16384, 1024), (8192, 50304)) for dt in ("bf16", "fp32")]
    out += [
        _embedding(v, d, t, dt)
        for v, d, t in ((50304, 4096, 8192), (32000, 1024, 16384))
        for dt in ("bf16", "fp32")
    ]
    blocks = (BlockShape(1024, 16, 8, 1024), BlockShape(2048, 16, 4, 2048), BlockShape(4096, 32, 2, 2048))
    out += [_block(s, "bf16", backward) for s in blocks for backward in (False, True)]
    out.append(_block(blocks[0], "fp32", backward=True))
    return out


def by_id(dry_run: bool) -> dict[str, OpCase]:
    """The catalogue keyed by case id (what compute.json records)."""
    return {c.id: c for c in cases(dry_run)}
