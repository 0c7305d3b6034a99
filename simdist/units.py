"""Parse and format quantities written with units: bandwidths (bytes/s), times (seconds), sizes (bytes)."""

from __future__ import annotations

import decimal
import math
import numbers
import re
from decimal import Decimal

from simdist.errors import ClusterSpecError

# A unit is (power of ten, power-of-two factor). Scaling the decimal digits by a power of ten before
# converting to float rounds once, so "5us" parses to exactly the float 5e-06 rather than 5 * 1e-06
# (4.9999999999999996e-06); multiplying by a power of two is exact.
_Unit = tuple[int, float]
_DECIMAL: dict[str, _Unit] = {
    "": (0, 1.0),
    "k": (3, 1.0),
    "K": (3, 1.0),
    "M": (6, 1.0),
    "G": (9, 1.0),
    "T": (12, 1.0),
    "P": (15, 1.0),
}
_BINARY: dict[str, _Unit] = {
    "Ki": (0, 2.0**10),
    "Mi": (0, 2.0**20),
    "Gi": (0, 2.0**30),
    "Ti": (0, 2.0**40),
    "Pi": (0, 2.0**50),
}
_PREFIXES = {**_DECIMAL, **_BINARY}

# Upper-case B is bytes and lower-case b is bits, as in network data sheets ("400Gb/s" NICs).
_BANDWIDTH: dict[str, _Unit] = {
    **{p + u: (e, f) for p, (e, f) in _PREFIXES.items() for u in ("B/s", "Bps")},
    **{p + u: (e, f / 8) for p, (e, f) in _PREFIXES.items() for u in ("b/s", "bps", "bit/s")},
}
# "µ" (U+00B5, micro sign) and "μ" (U+03BC, Greek mu) look alike; users type either.
_TIME: dict[str, _Unit] = {
    "s": (0, 1.0),
    "ms": (-3, 1.0),
    "us": (-6, 1.0),
    "\u00b5s": (-6, 1.0),
    "\u03bcs": (-6, 1.0),
    "ns": (-9, 1.0),
}
_SIZE: dict[str, _Unit] = {p + "B": u for p, u in _PREFIXES.items()}

BANDWIDTH_UNITS: dict[str, float] = {u: 10.0**e * f for u, (e, f) in _BANDWIDTH.items()}
"""Accepted bandwidth units and their value in bytes/s."""
TIME_UNITS: dict[str, float] = {u: 10.0**e * f for u, (e, f) in _TIME.items()}
"""Accepted time units and their value in seconds."""
SIZE_UNITS: dict[str, float] = {u: 10.0**e * f for u, (e, f) in _SIZE.items()}
"""Accepted size units and their value in bytes."""

_BANDWIDTH_HELP = (
    "a number followed by B/s, Bps (bytes) or b/s, bps, bit/s (bits), optionally prefixed by "
    "k, M, G, T, P (powers of 1000) or Ki, Mi, Gi, Ti, Pi (powers of 1024), e.g. '100GB/s', "
    "'400Gb/s', '25 GiB/s'; or a plain number of bytes/s"
)
_TIME_HELP = "a number followed by s, ms, us, µs or ns, e.g. '5us', '1.2ms'; or a plain number of seconds"
_SIZE_HELP = (
    "a number followed by B, kB/KB, MB, GB, TB, PB or KiB, MiB, GiB, TiB, PiB, e.g. '25MiB'; "
    "or a plain number of bytes"
)

# ASCII digits only: Python's float() also reads other scripts' digits ("\u0663" is 3), which a config
# file meant as a number would not silently contain.
_QUANTITY = re.compile(r"^\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*(\S*)\s*$", re.ASCII)
# Decimal arithmetic with float's exponent range is enough to scale any literal: beyond it the result is
# infinite or zero as a float anyway. Without a bounded context "1e99999999999GB/s" raises decimal.Overflow.
_SCALING = decimal.Context(prec=60, Emax=999_999, Emin=-999_999)

#: smallest link bandwidth accepted, bytes/s (one byte per 1000 s): below it, or at a subnormal float such
#: as 1e-320, ``bytes / bandwidth`` overflows to an infinite transfer time for ordinary message sizes
MIN_BANDWIDTH = 1e-3
#: largest link bandwidth accepted, bytes/s (a yottabyte per second): a terabyte crosses it in a
#: picosecond, so any larger number models nothing more; it also keeps ``1 / bandwidth`` a normal float
MAX_BANDWIDTH = 1e24
#: largest latency accepted on one link, seconds (an hour, more than a round trip to Mars): routes sum
#: link latencies (as integer picoseconds and as float seconds), which this keeps finite and exact
MAX_LATENCY = 3600.0
# Whole numbers of bytes up to here are returned as they are (int64, what torch counts in).
_EXACT_INT = 2**63 - 1


def _parse(x: object, what: str, units: dict[str, _Unit], help_text: str) -> float:
    """Return ``x`` converted to the base unit of ``units``; reject non-finite and negative values."""
    if isinstance(x, bool) or not isinstance(x, (str, numbers.Real)):
        raise ClusterSpecError(f"{what} {x!r}: expected {help_text}; found a {type(x).__name__}")
    if isinstance(x, str):
        match = _QUANTITY.match(x)
        if match is None:
            raise ClusterSpecError(f"{what} {x!r} is not a quantity: expected {help_text}")
        number, unit = match.groups()
        if unit and unit not in units:
            raise ClusterSpecError(f"{what} {x!r} has unknown unit {unit!r}: expected {help_text}")
        exponent, factor = units[unit] if unit else (0, 1.0)
        try:
            value = float(Decimal(number).scaleb(exponent, _SCALING)) * factor
        except decimal.Overflow:  # an exponent beyond even the context's range; tiny ones round to 0
            value = math.inf
    else:
        try:
            value = float(x)
        except OverflowError:  # an int (or Fraction) beyond float's range: 10**400
            value = math.inf if x > 0 else -math.inf  # type: ignore[operator]
    if not math.isfinite(value):
        why = "not a number" if math.isnan(value) else "not finite (too large for a float)"
        raise ClusterSpecError(f"{what} {_short(x)} is {why}: expected {help_text}")
    if value < 0:
        raise ClusterSpecError(f"{what} {_short(x)} is negative: expected {help_text}")
    return value + 0.0  # -0.0 becomes 0.0


def _short(x: object) -> str:
    """``repr(x)`` cut to a readable length: a hostile number may have thousands of digits."""
    text = repr(x)
    return text if len(text) <= 60 else f"{text[:40]}...{text[-10:]} ({len(text)} characters)"


def parse_bandwidth(x: str | float) -> float:
    """Return the bandwidth ``x`` in bytes/s; strings carry units ("400Gb/s" is 50e9), numbers are bytes/s.

    Accepted: MIN_BANDWIDTH (1e-3) to MAX_BANDWIDTH (1e24) bytes/s.
    """
    value = _parse(x, "bandwidth", _BANDWIDTH, _BANDWIDTH_HELP)
    if value == 0:
        raise ClusterSpecError(
            f"bandwidth {_short(x)} is zero (or rounds to zero): a link must move data; expected {_BANDWIDTH_HELP}"
        )
    if not MIN_BANDWIDTH <= value <= MAX_BANDWIDTH:
        raise ClusterSpecError(
            f"bandwidth {_short(x)} is {value:.6g} bytes/s, outside the accepted range {MIN_BANDWIDTH:g} to "
            f"{MAX_BANDWIDTH:g} bytes/s: "
            + (
                "so slow a link gives infinite transfer times; give a larger bandwidth"
                if value < MIN_BANDWIDTH
                else "no larger number models anything more; give a bandwidth up to 1e24 bytes/s"
            )
        )
    return value


def parse_time(x: str | float) -> float:
    """Return the duration ``x`` in seconds; strings carry units ("5us" is 5e-6), numbers are seconds."""
    return _parse(x, "time", _TIME, _TIME_HELP)


def parse_latency(x: str | float) -> float:
    """Return the link latency ``x`` in seconds (as ``parse_time``), at most MAX_LATENCY (an hour)."""
    value = _parse(x, "latency", _TIME, _TIME_HELP)
    if value > MAX_LATENCY:
        raise ClusterSpecError(
            f"latency {_short(x)} is {value:.6g} s, above the largest link latency accepted, {MAX_LATENCY:g} s "
            f"(an hour): routes sum the latencies of their links, which must stay finite; give a smaller latency"
        )
    return value


def parse_size(x: str | float) -> int:
    """Return the size ``x`` in bytes, rounded to a whole byte; strings carry units ("25MiB"), numbers are bytes."""
    if isinstance(x, numbers.Integral) and not isinstance(x, bool) and 0 <= x <= _EXACT_INT:
        return int(x)  # exact: through a float, sizes above 2**53 would round
    value = _parse(x, "size", _SIZE, _SIZE_HELP)
    # Round half up rather than to even: "0.5B" means "at least something", never nothing.
    return math.floor(value + 0.5)


def _format(value: float, steps: tuple[tuple[float, str], ...], zero_unit: str) -> str:
    """Write ``value`` with the largest unit of ``steps`` (descending) that keeps the number at least 1."""
    if value == 0:
        return f"0 {zero_unit}"
    for scale, unit in steps:
        if abs(value) >= scale:
            return f"{value / scale:.6g} {unit}"
    scale, unit = steps[-1]
    return f"{value / scale:.6g} {unit}"


def format_bandwidth(bytes_per_s: float) -> str:
    """Write a bandwidth given in bytes/s with a decimal unit, e.g. 4.5e11 -> "450 GB/s"."""
    steps = ((1e15, "PB/s"), (1e12, "TB/s"), (1e9, "GB/s"), (1e6, "MB/s"), (1e3, "kB/s"), (1.0, "B/s"))
    return _format(bytes_per_s, steps, "B/s")


def format_time(seconds: float) -> str:
    """Write a duration given in seconds, e.g. 5e-6 -> "5 us"."""
    return _format(seconds, ((1.0, "s"), (1e-3, "ms"), (1e-6, "us"), (1e-9, "ns")), "s")


def format_size(n_bytes: float) -> str:
    """Write a size given in bytes with a binary unit, e.g. 26214400 -> "25 MiB"."""
    steps = (
        (2.0**50, "PiB"),
        (2.0**40, "TiB"),
        (2.0**30, "GiB"),
        (2.0**20, "MiB"),
        (2.0**10, "KiB"),
        (1.0, "B"),
    )
    return _format(n_bytes, steps, "B")
