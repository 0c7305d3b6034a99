"""Unit strings: bandwidths (bytes/s), times (seconds) and sizes (bytes), parsed and formatted."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from simdist.errors import ClusterSpecError
from simdist.units import (
    BANDWIDTH_UNITS,
    MAX_BANDWIDTH,
    MAX_LATENCY,
    MIN_BANDWIDTH,
    SIZE_UNITS,
    TIME_UNITS,
    format_bandwidth,
    format_size,
    format_time,
    parse_bandwidth,
    parse_latency,
    parse_size,
    parse_time,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("100GB/s", 100e9),
        ("400Gb/s", 50e9),  # bits: a 400 Gb/s NIC moves 50 GB/s
        ("25 GiB/s", 25 * 2**30),
        ("1.5TB/s", 1.5e12),
        ("900GBps", 900e9),
        ("10Gbps", 1.25e9),
        ("8 bit/s", 1.0),
        ("1kB/s", 1e3),
        ("1KB/s", 1e3),
        ("1KiB/s", 1024.0),
        ("2.5e3 MB/s", 2.5e9),
        ("  7 B/s ", 7.0),
        ("123", 123.0),
        (123, 123.0),
        (4.5e11, 4.5e11),
    ],
)
def test_parse_bandwidth_examples(text: str | float, expected: float) -> None:
    assert parse_bandwidth(text) == pytest.approx(expected, rel=1e-15)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("5us", 5e-6),
        ("5\u00b5s", 5e-6),  # micro sign
        ("5\u03bcs", 5e-6),  # Greek mu
        ("1.2ms", 1.2e-3),
        ("3s", 3.0),
        ("100ns", 100e-9),
        ("0us", 0.0),
        (0, 0.0),
        (2.5, 2.5),
        ("0.25", 0.25),
    ],
)
def test_parse_time_examples(text: str | float, expected: float) -> None:
    assert parse_time(text) == pytest.approx(expected, rel=1e-15)


def test_parse_time_rounds_once() -> None:
    # Scaling decimal digits before converting gives the same float as writing the literal.
    assert parse_time("5us") == 5e-6
    assert parse_time("1.2ms") == 0.0012
    assert parse_bandwidth("0.1GB/s") == 1e8


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("25MiB", 25 * 2**20),
        ("1KB", 1000),
        ("1kB", 1000),
        ("8B", 8),
        ("1.5KiB", 1536),
        ("0.5B", 1),
        ("2GiB", 2 * 2**30),
        (8, 8),
        (0, 0),
        (8.0, 8),
        ("4096", 4096),
    ],
)
def test_parse_size_examples(text: str | float, expected: int) -> None:
    value = parse_size(text)
    assert value == expected
    assert isinstance(value, int)


_MAGNITUDES = st.floats(min_value=1e-3, max_value=1e6, allow_nan=False, allow_infinity=False)


@given(_MAGNITUDES, st.sampled_from(sorted(BANDWIDTH_UNITS)), st.sampled_from(["", " "]))
def test_bandwidth_number_times_unit(value: float, unit: str, gap: str) -> None:
    assert parse_bandwidth(f"{value!r}{gap}{unit}") == pytest.approx(value * BANDWIDTH_UNITS[unit], rel=1e-12)


@given(_MAGNITUDES, st.sampled_from(sorted(TIME_UNITS)), st.sampled_from(["", " "]))
def test_time_number_times_unit(value: float, unit: str, gap: str) -> None:
    assert parse_time(f"{value!r}{gap}{unit}") == pytest.approx(value * TIME_UNITS[unit], rel=1e-12)


@given(st.integers(min_value=0, max_value=10**6), st.sampled_from(sorted(SIZE_UNITS)))
def test_size_number_times_unit(count: int, unit: str) -> None:
    assert parse_size(f"{count}{unit}") == round(count * SIZE_UNITS[unit])


def test_bits_are_an_eighth_of_bytes() -> None:
    for unit in BANDWIDTH_UNITS:
        if unit.endswith(("B/s", "Bps")):
            bits = unit.replace("B/s", "b/s").replace("Bps", "bps")
            assert BANDWIDTH_UNITS[bits] * 8 == BANDWIDTH_UNITS[unit]


@given(st.floats(min_value=1e-3, max_value=1e18))
def test_bandwidth_format_round_trip(value: float) -> None:
    assert parse_bandwidth(format_bandwidth(value)) == pytest.approx(value, rel=1e-5)


@given(st.floats(min_value=1e-15, max_value=1e7) | st.just(0.0))
def test_time_format_round_trip(value: float) -> None:
    assert parse_time(format_time(value)) == pytest.approx(value, rel=1e-5, abs=0)


@given(st.integers(min_value=0, max_value=2**60))
def test_size_format_round_trip(value: int) -> None:
    assert parse_size(format_size(value)) == pytest.approx(value, rel=1e-5)


def test_formats_read_naturally() -> None:
    assert format_bandwidth(450e9) == "450 GB/s"
    assert format_bandwidth(1.25e9) == "1.25 GB/s"
    assert format_time(5e-6) == "5 us"
    assert format_time(1.2e-3) == "1.2 ms"
    assert format_time(0) == "0 s"
    assert format_size(25 * 2**20) == "25 MiB"
    assert format_size(8) == "8 B"


@pytest.mark.parametrize(
    "bad", ["-5GB/s", "0GB/s", 0, -1.0, "0", math.nan, math.inf, "nan", "inf", "1e400GB/s"]
)
def test_bad_bandwidth_values_are_rejected(bad: object) -> None:
    with pytest.raises(ClusterSpecError) as info:
        parse_bandwidth(bad)  # type: ignore[arg-type]
    assert repr(bad) in str(info.value)
    assert "GB/s" in str(info.value)  # lists accepted units


@pytest.mark.parametrize(
    "bad", ["100 GB", "100 Gbs", "5 furlongs/s", "", "   ", "GB/s", "1.2.3GB/s", "--1GB/s"]
)
def test_bad_bandwidth_strings_are_rejected(bad: str) -> None:
    with pytest.raises(ClusterSpecError) as info:
        parse_bandwidth(bad)
    assert repr(bad) in str(info.value)
    assert "b/s" in str(info.value) and "Gi" in str(info.value)


@pytest.mark.parametrize("bad", ["-1us", -1e-9, "5 minutes", "5 sec", "", math.nan, math.inf, "5GB/s"])
def test_bad_times_are_rejected(bad: object) -> None:
    with pytest.raises(ClusterSpecError) as info:
        parse_time(bad)  # type: ignore[arg-type]
    assert repr(bad) in str(info.value)
    assert "us" in str(info.value) and "ms" in str(info.value)


@pytest.mark.parametrize("bad", ["-1B", -8, "8 bytes", "1MB/s", "", math.inf])
def test_bad_sizes_are_rejected(bad: object) -> None:
    with pytest.raises(ClusterSpecError) as info:
        parse_size(bad)  # type: ignore[arg-type]
    assert repr(bad) in str(info.value)
    assert "MiB" in str(info.value)


@pytest.mark.parametrize("bad", [None, True, [100], {"bandwidth": 1}])
@pytest.mark.parametrize("parse", [parse_bandwidth, parse_time, parse_size])
def test_non_quantities_are_rejected(bad: object, parse: object) -> None:
    with pytest.raises(ClusterSpecError, match="expected"):
        parse(bad)  # type: ignore[operator]


@given(_MAGNITUDES, st.sampled_from(sorted(BANDWIDTH_UNITS)))
def test_negative_bandwidths_are_rejected(value: float, unit: str) -> None:
    with pytest.raises(ClusterSpecError, match="negative"):
        parse_bandwidth(f"-{value!r}{unit}")


@given(st.text(alphabet="abcdefghijklmnopqrstuvwxyzGMKTPB/", min_size=1, max_size=6))
def test_unknown_time_units_are_rejected(unit: str) -> None:
    if unit in TIME_UNITS:
        assert parse_time(f"3{unit}") == pytest.approx(3 * TIME_UNITS[unit])
    else:
        with pytest.raises(ClusterSpecError, match="unknown unit"):
            parse_time(f"3{unit}")


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (10**400, "not finite"),  # an int float() cannot hold
        ("1e99999999999GB/s", "not finite"),  # an exponent beyond any decimal context
        ("1e-320 B/s", "outside the accepted range"),  # subnormal: 1 / bandwidth overflows
        (MIN_BANDWIDTH / 2, "outside the accepted range"),
        (MAX_BANDWIDTH * 2, "outside the accepted range"),
        ("1e-99999999999GB/s", "rounds to zero"),
        ("\u0663GB/s", "not a quantity"),  # an Arabic-Indic three: digits are ASCII
    ],
)
def test_bandwidths_beyond_the_accepted_range_are_rejected(bad: object, match: str) -> None:
    with pytest.raises(ClusterSpecError, match=match):
        parse_bandwidth(bad)  # type: ignore[arg-type]


def test_bandwidth_range_ends_are_accepted() -> None:
    assert parse_bandwidth(MIN_BANDWIDTH) == MIN_BANDWIDTH
    assert parse_bandwidth(MAX_BANDWIDTH) == MAX_BANDWIDTH


def test_latencies_are_bounded_and_negative_zero_is_zero() -> None:
    assert parse_latency(MAX_LATENCY) == MAX_LATENCY
    with pytest.raises(ClusterSpecError, match="largest link latency"):
        parse_latency(MAX_LATENCY * 1.5)
    assert math.copysign(1.0, parse_time("-0s")) == 1.0
    assert parse_time(10**300) == 1e300  # a plain time (not a link latency) only needs to be finite
    with pytest.raises(ClusterSpecError, match="not finite"):
        parse_time(10**400)


def test_sizes_that_are_whole_numbers_stay_exact() -> None:
    assert parse_size(2**60 + 1) == 2**60 + 1
    with pytest.raises(ClusterSpecError, match="not finite"):
        parse_size(10**400)
