"""When two tensors count as equal: bitwise (exact mode), or within a tolerance per dtype (numeric mode).

A parallel program sums in another order than one process: a data-parallel gradient is the all-reduce of
per-rank partial sums, a sharded matmul adds partial products in other blocks. Floating-point addition is not
associative, so the results differ in their last bits, by at most about ``n * u * sum(|x_i|)`` for a sum of
``n`` terms with unit roundoff ``u`` (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., §4.2),
typically ``sqrt(n) * u`` relative to the sum's magnitude. Elements near zero that come out of cancellation
carry the absolute error of the large terms they cancel, so an element-wise relative test reports rounding as
divergence. The oracle therefore compares against the tensor's scale:

    max |parallel - reference|  <=  atol + rtol * max |reference|

with ``rtol`` a multiple of the dtype's unit roundoff that covers reductions of 10^4 to 10^5 terms and a few
optimizer steps of propagation (``rtol ≈ 10^3 u`` for float32/float64, looser for the 8-bit-mantissa formats
whose rounding is coarse), and ``atol`` for all-zero tensors. The bugs the oracle exists for move values by
far more: a factor of the world size, a wrong shard, a mask from the wrong seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    """Numeric tolerance: ``max|a - b| <= atol + rtol * max|b|`` (b the reference)."""

    rtol: float
    atol: float

    def __post_init__(self) -> None:
        if not (self.rtol >= 0 and self.atol >= 0):
            raise ValueError(f"a tolerance needs rtol >= 0 and atol >= 0, got rtol={self.rtol}, atol={self.atol}")


#: unit roundoff of each floating dtype (half the machine epsilon)
UNIT_ROUNDOFF = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
}

#: the numeric mode's defaults (see the module's text for why): about 10^3 unit roundoffs for the wide formats;
#: 16-bit formats accumulate in float32 inside matmuls but round every stored result, so a few tens of roundoffs
DEFAULT_TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(rtol=1e-12, atol=1e-15),
    torch.float32: Tolerance(rtol=5e-5, atol=1e-7),
    torch.float16: Tolerance(rtol=2e-2, atol=1e-4),
    torch.bfloat16: Tolerance(rtol=1e-1, atol=1e-3),
}


def tolerance_for(dtype: torch.dtype, overrides: dict[torch.dtype, Tolerance] | None = None) -> Tolerance | None:
    """The tolerance for ``dtype``; ``None`` for integer and boolean dtypes, which must match exactly."""
    if overrides and dtype in overrides:
        return overrides[dtype]
    if dtype in DEFAULT_TOLERANCES:
        return DEFAULT_TOLERANCES[dtype]
    if dtype.is_floating_point or dtype.is_complex:
        return DEFAULT_TOLERANCES[torch.float32]
    return None


@dataclass(frozen=True)
class Difference:
    """How far a tensor is from the reference: the largest absolute difference, and that over ``max|ref|``."""

    max_abs: float
    rel: float
    #: elements that differ (beyond the tolerance in numeric mode, at all in exact mode)
    count: int
    numel: int
    #: ``c`` when the tensor is ``c`` times the reference (to the dtype's tolerance): the mark of a loss or
    #: gradient scaled by a wrong factor (a world size, a number of micro-steps); None otherwise
    scale: float | None = None

    def __str__(self) -> str:
        text = f"max |diff| {self.max_abs:.1e}, rel {self.rel:.1e}"
        text = text if self.numel == 1 else f"{text}; {self.count} of {self.numel} elements"
        return text if self.scale is None else f"{text}; {self.scale:.4g} x the reference"


def differing(
    value: torch.Tensor, reference: torch.Tensor, exact: bool, overrides: dict[torch.dtype, Tolerance] | None = None
) -> torch.Tensor | None:
    """A boolean mask of ``value``'s elements that differ from ``reference``; ``None`` if the tensors are equal.

    Equal means bitwise in exact mode (and for integer dtypes), within the dtype's :class:`Tolerance` at the
    reference's scale otherwise. Shapes must agree (callers report a shape mismatch themselves). NaN equals NaN
    at the same place; an infinity equals the same infinity.
    """
    a, b = value.detach(), reference.detach()
    if a.dtype != b.dtype:
        a = a.to(b.dtype)
    tol = tolerance_for(b.dtype, overrides)
    if exact or tol is None:
        ab, bb = _bits(a), _bits(b)
        return None if ab.equal(bb) else ab != bb
    if b.numel() == 0:
        return None
    # the common case in a few passes over the data, in the tensors' own dtype
    # (aminmax and a max reduction are several times faster than an inf-norm or an element-wise ``le().all()``;
    # a NaN anywhere makes both reductions NaN, which fails the test and takes the careful path)
    low, high = torch.aminmax(b)
    scale = max(-low.item(), high.item())
    if math.isfinite(scale) and torch.sub(a, b).abs_().max().item() <= tol.atol + tol.rtol * scale:
        return None
    # special values (NaN, infinities) or a difference: the careful form, in float64
    af, bf = a.double(), b.double()
    same_special = (af.isnan() & bf.isnan()) | ((af == bf) & af.isinf())
    finite = bf[bf.isfinite()]
    limit = tol.atol + tol.rtol * (finite.abs().max().item() if finite.numel() else 0.0)
    bad = ~same_special & ~((af - bf).abs() <= limit)
    return bad if bool(bad.any()) else None


def compare(
    value: torch.Tensor, reference: torch.Tensor, exact: bool, overrides: dict[torch.dtype, Tolerance] | None = None
) -> Difference | None:
    """``None`` if ``value`` equals ``reference`` (see :func:`differing`), else how far apart they are."""
    bad = differing(value, reference, exact, overrides)
    return None if bad is None else difference(value, reference, bad)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` have the same dtype, shape and bits (NaNs with equal payloads are equal)."""
    return a.dtype == b.dtype and a.shape == b.shape and _bits(a).equal(_bits(b))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of the same width (so NaN payloads and -0.0 compare bitwise)."""
    t = t.contiguous()
    if t.dtype.is_floating_point and t.element_size() in (2, 4, 8):
        return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def difference(a: torch.Tensor, b: torch.Tensor, differ: torch.Tensor) -> Difference:
    """How far ``a`` is from the reference ``b``, ``differ`` marking the elements that count as different."""
    a, b = a.detach(), b.detach().to(a.dtype) if b.dtype != a.dtype else b.detach()
    if a.dtype.is_floating_point or a.dtype.is_complex:
        d = (a.double() - b.double()).abs()
        d = torch.where(d.isnan(), torch.full_like(d, float("inf")), d)
        finite = b.double()[b.double().isfinite()]
    else:
        d = (a.double() - b.double()).abs()
        finite = b.double()
    max_abs = d.max().item() if d.numel() else 0.0
    scale = finite.abs().max().item() if finite.numel() else 0.0
    rel = max_abs / scale if scale > 0 else float("inf") if max_abs > 0 else 0.0
    return Difference(max_abs, rel, int(differ.sum().item()), a.numel(), _multiple(a, b))


def _multiple(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """``c`` if ``a`` is ``c`` times ``b`` (least squares, to ``a``'s dtype tolerance), for ``c`` neither 0 nor 1."""
    tol = tolerance_for(a.dtype)
    if a.numel() < 2 or tol is None or not (a.dtype.is_floating_point and b.dtype.is_floating_point):
        return None
    x, y = a.double().flatten(), b.double().flatten()
    if not (bool(x.isfinite().all()) and bool(y.isfinite().all())):
        return None
    yy = float(y.dot(y))
    if yy == 0.0:
        return None
    c = float(x.dot(y)) / yy
    bound = tol.atol + tol.rtol * float(x.abs().max())
    if c == 0.0 or abs(c - 1.0) <= tol.rtol or float((x - c * y).abs().max()) > bound:
        return None
    return c
