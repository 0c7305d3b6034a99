"""Fuzzing the inputs a user types: unit strings, numbers, cluster builder arguments and config files.

Every input must either be accepted (and then be in range: a finite positive bandwidth, a finite latency, a
cluster whose routes have finite latency) or raise ClusterSpecError; never another exception. Sizes are kept
small or absurd (never a legal million ranks) so each example builds in milliseconds.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import simdist
from simdist.network import BUILDERS, PRESETS
from simdist.network.builders import SIZE_KEY
from simdist.network.graph import MAX_WORLD_SIZE
from simdist.units import (
    BANDWIDTH_UNITS,
    MAX_BANDWIDTH,
    MAX_LATENCY,
    MIN_BANDWIDTH,
    SIZE_UNITS,
    TIME_UNITS,
    parse_bandwidth,
    parse_latency,
    parse_size,
    parse_time,
)

_UNITS = sorted({*BANDWIDTH_UNITS, *TIME_UNITS, *SIZE_UNITS})

# Near-misses of a quantity: a number-like head (signs, exponents, dots, underscores, digits of other
# scripts), optional spaces, and a unit-like tail (real units, their pieces, case changes, junk).
_NUMBERISH = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.integers(min_value=-(10**30), max_value=10**30).map(str),
    st.from_regex(r"\A[+-]{0,2}[0-9._]{0,6}([eE][+-]?[0-9]{1,12})?\Z", fullmatch=True),
    st.sampled_from(["nan", "inf", "-inf", "1e999", "1e-400", "1e-320", "\u0663", "\uff11", "0x10", "1_000", ""]),
)
_UNITISH = st.one_of(
    st.sampled_from(_UNITS),
    st.sampled_from(_UNITS).map(str.swapcase),
    st.text(alphabet="kKMGTPiBbps/ uµμnm", max_size=6),
    st.text(max_size=4),
)
_QUANTITY_TEXT = st.one_of(
    st.text(max_size=20),
    st.tuples(_NUMBERISH, st.sampled_from(["", " ", "  ", "\t"]), _UNITISH).map("".join),
)
_NUMBERS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(10**400), max_value=10**400),
    st.fractions(max_denominator=10**6),
    st.booleans(),
    st.none(),
)


def _accepted_or_spec_error(parse: Any, value: object) -> float | None:
    """``parse(value)``, or None when it raised ClusterSpecError; any other exception fails the test."""
    try:
        return parse(value)
    except simdist.ClusterSpecError:
        return None


@given(st.one_of(_QUANTITY_TEXT, _NUMBERS))
def test_bandwidths_parse_in_range_or_raise_a_spec_error(value: object) -> None:
    got = _accepted_or_spec_error(parse_bandwidth, value)
    if got is not None:
        assert isinstance(got, float) and MIN_BANDWIDTH <= got <= MAX_BANDWIDTH, got
        assert math.isfinite(1.0 / got)


@given(st.one_of(_QUANTITY_TEXT, _NUMBERS))
def test_times_parse_finite_or_raise_a_spec_error(value: object) -> None:
    got = _accepted_or_spec_error(parse_time, value)
    if got is not None:
        assert isinstance(got, float) and math.isfinite(got) and got >= 0 and math.copysign(1.0, got) == 1.0
    latency = _accepted_or_spec_error(parse_latency, value)
    if latency is not None:
        assert 0 <= latency <= MAX_LATENCY


@given(st.one_of(_QUANTITY_TEXT, _NUMBERS))
def test_sizes_parse_to_whole_bytes_or_raise_a_spec_error(value: object) -> None:
    got = _accepted_or_spec_error(parse_size, value)
    if got is not None:
        assert isinstance(got, int) and got >= 0


# --- cluster specs ------------------------------------------------------------------------------------

# Sizes: small legal ones, or ones no cluster may have (never a legal huge world: it would take seconds).
_SIZE = st.one_of(
    st.integers(min_value=-2, max_value=12),
    st.integers(min_value=MAX_WORLD_SIZE + 1, max_value=10**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
)
_SCALAR = st.one_of(
    _SIZE,
    _QUANTITY_TEXT,
    st.sampled_from(["100GB/s", "5us", "1e-320 B/s", "1e999GB/s", "H100", "cpu", "TPUv9", "ring", "auto", ""]),
    st.none(),
)
_VALUE = st.recursive(
    _SCALAR,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.sampled_from(["all_reduce", "broadcast", "ring", "x"]), inner, max_size=2),
    ),
    max_leaves=6,
)
_BUILDER_KEYS = sorted({k for b in BUILDERS for k in simdist.Cluster.builder_keys(b)})


def _mostly(good: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Values that are usually fine and sometimes odd, so that both outcomes get explored."""
    return st.one_of(good, good, good, _VALUE)


_BANDWIDTH = _mostly(
    st.one_of(st.floats(MIN_BANDWIDTH, MAX_BANDWIDTH), st.sampled_from(["100GB/s", "400Gb/s", "25 GiB/s", "1e-3B/s"]))
)
_LATENCY = _mostly(st.one_of(st.floats(0, MAX_LATENCY), st.sampled_from(["5us", "1 ms", "0s", "3600s"])))
#: each builder argument with values that usually suit it
_ARGS: dict[str, st.SearchStrategy[Any]] = {
    "n": _mostly(st.integers(1, 8)),
    "nodes": _mostly(st.integers(1, 3)),
    "gpus_per_node": _mostly(st.integers(1, 4)),
    "ranks_per_node": _mostly(st.integers(1, 4)),
    "dims": _mostly(st.lists(st.integers(1, 4), min_size=1, max_size=3)),
    "bidirectional": _mostly(st.booleans()),
    "device": _mostly(st.sampled_from(["H100", "A100", "cpu", "h200"])),
    "name": _mostly(st.text(min_size=1, max_size=8)),
    "collective_model": _mostly(st.sampled_from(["alpha-beta", "nccl"])),
    "algorithms": _mostly(
        st.dictionaries(st.sampled_from(["all_reduce", "broadcast", "barrier"]),
                        st.sampled_from(["ring", "tree", "rhd", "direct", "auto"]), max_size=2)
    ),
    **{k: _BANDWIDTH for k in _BUILDER_KEYS if k.endswith("bandwidth")},
    **{k: _LATENCY for k in _BUILDER_KEYS if k.endswith("latency")},
}
assert set(_BUILDER_KEYS) <= set(_ARGS), set(_BUILDER_KEYS) - set(_ARGS)
_WORLD_SIZE = st.one_of(st.none(), st.integers(1, 8), _SIZE)


def _params(builder: str) -> st.SearchStrategy[dict[str, Any]]:
    """Arguments of ``builder``, each present or not (the size usually present), once in ten with a misspelt one."""
    size = SIZE_KEY[builder]
    optional = {k: _ARGS[k] for k in simdist.Cluster.builder_keys(builder) if k != size}
    base = st.fixed_dictionaries({size: _ARGS[size]}, optional=optional)
    return st.tuples(base, st.integers(0, 9)).map(
        # hypothesis favours small integers: 0..7 keep the arguments as drawn
        lambda pair: {**pair[0], "bandwdith": "1GB/s"} if pair[1] == 9
        else {k: v for k, v in pair[0].items() if k != size} if pair[1] == 8
        else pair[0]
    )


_BUILDER_AND_PARAMS = st.sampled_from(BUILDERS).flatmap(lambda b: st.tuples(st.just(b), _params(b)))


def _check_cluster(cluster: simdist.Cluster) -> None:
    """An accepted cluster: every link in range, every route from rank 0 of finite latency."""
    assert 1 <= cluster.world_size <= MAX_WORLD_SIZE
    for link in cluster.links:
        assert MIN_BANDWIDTH <= link.bandwidth <= MAX_BANDWIDTH and 0 <= link.latency <= MAX_LATENCY
    for dst in range(min(cluster.world_size, 8)):
        assert math.isfinite(cluster.path_latency(0, dst))


def _built_or_spec_error(build: Any) -> None:
    try:
        cluster = build()
    except simdist.ClusterSpecError:
        return
    _check_cluster(cluster)


@given(_BUILDER_AND_PARAMS, _WORLD_SIZE)
def test_builders_build_or_raise_a_spec_error(builder_and_params: tuple[str, dict[str, Any]], world_size: Any) -> None:
    builder, params = builder_and_params
    # a world size only fills in a size the arguments leave out, as a config file's world_size does
    _built_or_spec_error(lambda: simdist.Cluster.build(builder, params, world_size))


_PRESET_NAMES = st.sampled_from(["ring", "switch", "dgx-h100", "torus", "cpu-ethernet", "dgx_a100"])


@given(
    st.one_of(_PRESET_NAMES.flatmap(lambda name: st.tuples(st.just(name), _params(PRESETS[
        name.replace("_", "-")].builder))), st.tuples(_SCALAR, st.just({}))),
    _WORLD_SIZE,
)
def test_presets_build_or_raise_a_spec_error(name_and_overrides: tuple[Any, dict[str, Any]], world_size: Any) -> None:
    name, overrides = name_and_overrides
    _built_or_spec_error(lambda: simdist.Cluster.preset(name, world_size, **overrides))


# --- config files -------------------------------------------------------------------------------------

_LINK = st.fixed_dictionaries(
    {"src": _mostly(st.one_of(st.integers(0, 3), st.just("sw"))), "dst": _mostly(st.one_of(st.integers(0, 3), st.just("sw"))),
     "bandwidth": _BANDWIDTH, "latency": _LATENCY},
    optional={"duplex": _mostly(st.booleans()), "x": _SCALAR},
)
_FORM = st.one_of(
    _BUILDER_AND_PARAMS.map(lambda bp: {"builder": bp[0], **bp[1]}),
    _PRESET_NAMES.flatmap(lambda name: _params(PRESETS[name.replace("_", "-")].builder).map(
        lambda d: {"preset": name, **{k: v for k, v in d.items() if k not in ("n", "nodes", "dims")}})),
    st.fixed_dictionaries({"world_size": _mostly(st.integers(1, 4))}, optional={"device": _ARGS["device"]}),
)
_CONFIG = st.one_of(
    st.fixed_dictionaries({"cluster": _mostly(_FORM)}, optional={"links": _mostly(st.lists(_LINK, max_size=8))}),
    _VALUE,
)

_DIR = Path(tempfile.mkdtemp(prefix="simdist-fuzz-configs-"))


def _from_file(name: str, data: bytes) -> None:
    path = _DIR / name
    path.write_bytes(data)
    _built_or_spec_error(lambda: simdist.Cluster.from_file(path))


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(_CONFIG)
def test_config_structures_build_or_raise_a_spec_error(config: Any) -> None:
    _built_or_spec_error(lambda: simdist.Cluster.from_config(config))
    try:
        text = json.dumps(config)  # NaN and Infinity are written as the literals Python's json reads back
    except (ValueError, TypeError):
        return
    _from_file("fuzz.json", text.encode())


@pytest.mark.parametrize("suffix", [".json", ".toml"])
@given(data=st.one_of(st.binary(max_size=200), _QUANTITY_TEXT.map(lambda t: f"[cluster]\nn = {t}\n".encode("utf-8", "surrogatepass"))))
def test_config_bytes_build_or_raise_a_spec_error(suffix: str, data: bytes) -> None:
    _from_file("bytes" + suffix, data)
