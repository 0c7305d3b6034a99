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

    def __str__(self) -> str:
        return f"max |diff| {self.max_abs:.2g}, rel {self.rel:.2g}; {self.count} of {self.numel} elements"


def compare(
    value: torch.Tensor, reference: torch.Tensor, exact: bool, overrides: dict[torch.dtype, Tolerance] | None = None
) -> Difference | None:
    """``None`` if ``value`` equals ``reference`` (bitwise in exact mode, within tolerance otherwise).

    Shapes must agree (the caller reports a shape mismatch itself). NaN equals NaN at the same place; an
    infinity equals the same infinity.
    """
    a, b = value.detach(), reference.detach()
    if a.dtype != b.dtype:
        a = a.to(b.dtype)
    if exact or tolerance_for(b.dtype, overrides) is None:
        if _bits(a).equal(_bits(b)):
            return None
        differ = _bits(a) != _bits(b)
        return _difference(a, b, differ)
    tol = tolerance_for(b.dtype, overrides)
    af, bf = a.double(), b.double()
    nan_a, nan_b = af.isnan(), bf.isnan()
    same_special = (nan_a & nan_b) | ((af == bf) & af.isinf())
    finite = bf[bf.isfinite()]
    scale = finite.abs().max().item() if finite.numel() else 0.0
    diff = (af - bf).abs()
    bad = ~same_special & ~(diff <= tol.atol + tol.rtol * scale)
    if not bool(bad.any()):
        return None
    return _difference(a, b, bad)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of the same width (so NaN payloads and -0.0 compare bitwise)."""
    t = t.contiguous()
    if t.dtype.is_floating_point and t.element_size() in (2, 4, 8):
        return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def _difference(a: torch.Tensor, b: torch.Tensor, differ: torch.Tensor) -> Difference:
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
    return Difference(max_abs, rel, int(differ.sum().item()), a.numel())
