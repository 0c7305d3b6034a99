"""Counter-based random numbers for DTensor's random ops on simulated GPUs.

DTensor runs a random op on a CUDA mesh (``torch.nn.init`` on a sharded parameter, dropout on a DTensor,
``torch.distributed.tensor.randn``) inside its RNG tracker's region: the device generator's offset is moved to the
local shard's place in the whole tensor, the op runs, and every rank moves the offset past the whole tensor. That
gives each shard its own numbers only where what an element draws depends on the offset, as with CUDA's Philox
generator. Here element ``i`` (in row-major order) of an op run at (``seed``, ``offset``) draws 128 bits: the two
64-bit words of Philox4x64-10 (NumPy's ``np.random.Philox``, key ``seed``) at position ``offset + i`` of its
stream, two words per position. So a number depends only on (seed, offset + index): a tensor drawn in shards whose
offsets are their places in the whole (``Shard(0)`` of evenly split rows) equals the whole tensor drawn at once.

The numbers are not CUDA's (CUDA's kernels spread a tensor over threads and draw four 32-bit numbers per
Philox4x32 round); what they share with CUDA is what DTensor relies on: they depend on the seed and the offset only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from simdist.cuda.fallbacks import user_line
from simdist.cuda.rngstate import DeviceGenerator
from simdist.errors import UnsupportedCudaOpError

aten = torch.ops.aten
CPU = torch.device("cpu")
_U64 = (1 << 64) - 1
#: random bits a uniform number of each floating dtype keeps (its significand's): the rest of the word is dropped,
#: so that no number rounds up to the interval's end
_MANTISSA_BITS = {torch.float64: 53, torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}


def element_bits(seed: int, offset: int, n: int) -> np.ndarray:
    """The 128 random bits of elements ``offset`` .. ``offset + n - 1`` of seed ``seed``'s stream: (n, 2) uint64."""
    # np.random.Philox(counter=c) starts at round c + 1; a round gives four words, two elements
    start, skip = divmod(offset & _U64, 2)
    raw = np.random.Philox(key=seed & _U64, counter=start).random_raw(2 * (n + skip))
    return raw[2 * skip :].reshape(n, 2)


def _take(gen: DeviceGenerator, n: int) -> np.ndarray:
    """``n`` elements' bits at the generator's offset, moving the offset past them."""
    bits = element_bits(gen.philox_seed, gen.offset, n)
    gen.advance(n)
    return bits


def _unit(words: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Uniform numbers in [0, 1) (float64), with as many random bits as ``dtype`` keeps."""
    keep = _MANTISSA_BITS.get(dtype, 53)
    return (words >> np.uint64(64 - keep)).astype(np.float64) * 2.0**-keep


def _normal(bits: np.ndarray) -> np.ndarray:
    """Standard normal numbers (float64), one per element, by Box and Muller's transform of its two words."""
    radius = 1.0 - _unit(bits[:, 0], torch.float64)  # in (0, 1]: its logarithm is finite
    angle = _unit(bits[:, 1], torch.float64)
    return np.sqrt(-2.0 * np.log(radius)) * np.cos(2.0 * math.pi * angle)


def _filled(like: torch.Tensor, values: np.ndarray) -> torch.Tensor:
    """``like`` filled in row-major order with ``values``, converted to its dtype."""
    like.copy_(torch.from_numpy(values).view(like.shape))
    return like


def _new(args: dict[str, Any], shape: Any, like: torch.Tensor | None) -> torch.Tensor:
    """An empty host tensor for a factory (``rand``) or ``*_like`` op's result."""
    if like is None:
        dtype = args.get("dtype") or torch.get_default_dtype()
        return torch.empty([int(s) for s in shape], dtype=dtype, device=CPU)
    fmt = args.get("memory_format") or torch.preserve_format
    return torch.empty_like(like, dtype=args.get("dtype") or like.dtype, device=CPU, memory_format=fmt)


def _uniform(out: torch.Tensor, gen: DeviceGenerator, low: float = 0.0, high: float = 1.0) -> torch.Tensor:
    u = _unit(_take(gen, out.numel())[:, 0], out.dtype)
    return _filled(out, low + (high - low) * u)


def _gaussian(out: torch.Tensor, gen: DeviceGenerator, mean: float = 0.0, std: float = 1.0) -> torch.Tensor:
    return _filled(out, mean + std * _normal(_take(gen, out.numel())))


def _bernoulli(out: torch.Tensor, gen: DeviceGenerator, p: float | torch.Tensor) -> torch.Tensor:
    u = torch.from_numpy(_unit(_take(gen, out.numel())[:, 0], torch.float64)).view(out.shape)
    chance = p.to(CPU, torch.float64) if isinstance(p, torch.Tensor) else p
    return out.copy_(u < chance)


def _integers(out: torch.Tensor, gen: DeviceGenerator, low: int, high: int) -> torch.Tensor:
    if high <= low:
        raise RuntimeError(f"random_ expects 'from' to be less than 'to', but got from={low} >= to={high}")
    words = _take(gen, out.numel())[:, 0]
    return _filled(out, (words % np.uint64(high - low)).astype(np.int64) + low)


def _dropout(a: dict[str, Any], gen: DeviceGenerator) -> Any:
    x, p, train = a["input"], a["p"], a["train"]
    if train is False or x.numel() == 0:
        return aten.native_dropout.default(x, p, train)
    # as ATen's native_dropout: keep with probability 1 - p, scale what is kept by 1 / (1 - p)
    keep = 1.0 - p
    mask = _bernoulli(torch.empty_like(x, memory_format=torch.contiguous_format), gen, keep)
    return x.mul(mask).mul_(0.0 if keep == 0 else 1.0 / keep), mask.to(torch.bool)


#: each random op DTensor runs in its RNG tracker's region, drawn counter-based: f(bound arguments, generator)
_DRAWS: dict[Any, Callable[[dict[str, Any], DeviceGenerator], Any]] = {
    aten.uniform_.default: lambda a, g: _uniform(a["self"], g, a["from"], a["to"]),
    aten.normal_.default: lambda a, g: _gaussian(a["self"], g, a["mean"], a["std"]),
    aten.rand.default: lambda a, g: _uniform(_new(a, a["size"], None), g),
    aten.randn.default: lambda a, g: _gaussian(_new(a, a["size"], None), g),
    aten.rand_like.default: lambda a, g: _uniform(_new(a, None, a["self"]), g),
    aten.randn_like.default: lambda a, g: _gaussian(_new(a, None, a["self"]), g),
    aten.randint_like.default: lambda a, g: _integers(_new(a, None, a["self"]), g, 0, int(a["high"])),
    aten.randint_like.low_dtype: lambda a, g: _integers(
        _new(a, None, a["self"]), g, int(a["low"]), int(a["high"])
    ),
    aten.randint_like.low_dtype_out: lambda a, g: _integers(a["out"], g, int(a["low"]), int(a["high"])),
    aten.bernoulli.default: lambda a, g: _bernoulli(torch.empty_like(a["self"]), g, a["self"]),
    aten.bernoulli.p: lambda a, g: _bernoulli(torch.empty_like(a["self"]), g, a["p"]),
    aten.bernoulli_.float: lambda a, g: _bernoulli(a["self"], g, a["p"]),
    aten.bernoulli_.Tensor: lambda a, g: _bernoulli(a["self"], g, a["p"]),
    aten.native_dropout.default: _dropout,
}


def _bound(func: Any, args: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The op's arguments by name, defaults included."""
    schema = func._schema.arguments
    values = {a.name: a.default_value for a in schema if a.has_default_value()}
    values.update(zip((a.name for a in schema), args))
    values.update(kwargs)
    return values


def draw(func: Any, args: Any, kwargs: dict[str, Any], gen: DeviceGenerator) -> Any:
    """Run random op ``func`` on host tensors, drawing counter-based numbers at ``gen``'s seed and offset."""
    run = _DRAWS.get(func)
    if run is None:
        raise UnsupportedCudaOpError(
            f"{func._schema.name} (called at {user_line()}) ran inside DTensor's random-number region on a simulated "
            f"GPU, which draws counter-based numbers for these ops only: "
            f"{', '.join(sorted({str(f.overloadpacket) for f in _DRAWS}))}"
        )
    return run(_bound(func, args, kwargs), gen)
