"""NCCL's tuning model (simdist.algorithms.nccl): tuning.cc's numbers worked by hand from its constants, the
published bandwidths it must land near, the NVLS pipeline's fill worked by hand from computeCollChunkInfo, and
properties over every size (the tuner's estimate monotone and continuous where the algorithm or protocol
changes, the time within the fill of it, above the physical bound)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from simdist.algorithms import nccl
from simdist.algorithms.nccl.table import update

H100_1 = nccl.fabric("H100", 8, 1, math.inf)
H100_2N = nccl.fabric("H100", 16, 2, 50e9)
A100_1 = nccl.fabric("A100", 8, 1, math.inf)
A100_2N = nccl.fabric("A100", 16, 2, 25e9)
#: (fabric, line rate of a GPU's NVLinks in bytes/s, NIC bytes/s): DGX data sheets
FABRICS = [
    (H100_1, 450e9, math.inf),
    (H100_2N, 450e9, 50e9),
    (nccl.fabric("H100", 2, 1, math.inf), 450e9, math.inf),
    (nccl.fabric("H100", 4, 1, math.inf), 450e9, math.inf),
    (A100_1, 300e9, math.inf),
    (A100_2N, 300e9, 25e9),
    (nccl.fabric("H100", 32, 4, 50e9), 450e9, 50e9),
]
BUS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
}


def test_graphs_as_ncclTopoCompute_finds_them() -> None:
    # H100: 18 NVLinks x 20.6 GB/s = 370.8; the search's 6 x 60 GB/s rings are split into 12 x 30 (search.cc 835-848)
    assert (H100_1.ring.channels, H100_1.ring.bw_intra) == (12, 30.0)
    # NVLS: every GPU heads a channel and its head uses its links twice: 9 x 40 <= 370.8 < 9 x 50
    assert (H100_1.nvls.channels, H100_1.nvls.bw_intra) == (8, 40.0)
    # A100: 12 x 20 = 240 GB/s; 6 x 40 fills it, then split in two
    assert (A100_1.ring.channels, A100_1.ring.bw_intra) == (12, 20.0)
    assert A100_1.nvls is None
    # across nodes, one channel per 50 GB/s NIC: 8 x 45 GB/s (8 x 48 would exceed the NVLinks); no split (bw < 50)
    assert (H100_2N.ring.channels, H100_2N.ring.bw_inter) == (8, 45.0)
    assert (H100_2N.nvls.channels, H100_2N.nvls.bw_intra, H100_2N.nvls.bw_inter) == (8, 40.0, 48.0)


def test_reproduces_tuning_cc_by_hand() -> None:
    us = 1e-6
    # ring LL, 8 GPUs: baseLat 6.6 + 2(n-1) x hwLat[NVLink][Ring][LL] 0.6; bw min(llMaxBw 141, 360 x .5) x n/nsteps
    c = nccl.cost(H100_1, "all_reduce", "Ring", "LL", 1 << 20, exact=True)
    assert c.latency == pytest.approx(15.0 * us)
    assert c.seconds == pytest.approx((15.0 + (1 << 20) / (1000 * 141.0 * 8 / 14)) * us)
    # NVLS: latency hwLat[NVLink][NVLS][Simple] 25; bw 8 channels x 40 x 5/6
    c = nccl.cost(H100_1, "all_reduce", "NVLS", "Simple", 64 << 20, exact=True)
    assert c.estimate == pytest.approx((25.0 + (64 << 20) / (1000 * 8 * 40 * 5 / 6)) * us)
    # two nodes, ring Simple: 8.4 + (30 - 4) x max(3.4, 3 x 1.0) + 4 x 14.0, x 1.4 on the plateau; 8 x 45 x 16/30
    c = nccl.cost(H100_2N, "all_reduce", "Ring", "Simple", 1 << 30, exact=True)
    lat = (8.4 + 26 * 3.4 + 4 * 14.0) * 1.4
    assert c.seconds == pytest.approx((lat + (1 << 30) / (1000 * 8 * 45 * 16 / 30)) * us)
    # A100 two nodes (AMD hosts), tree LL128 at 1 MiB: min(192 x .92, 8 x 23.6) = 176.64, x 120/128 capped at
    # 8 x 20 = 160, x .5, x treeCorrectionFactor[LL128][14] = .6; latency 14 + 2((8-1) x 1.25 + 1 x 8.5)
    c = nccl.cost(A100_2N, "all_reduce", "Tree", "LL128", 1 << 20, exact=True)
    assert c.seconds == pytest.approx((48.5 + (1 << 20) / (1000 * 160 * 0.5 * 0.6)) * us)
    assert nccl.choose(A100_2N, "all_reduce", 1 << 20, exact=True).label == "Tree/LL128"


def test_nvls_chunks_as_computeCollChunkInfo_picks_them() -> None:
    # one node of 8: 16 channels x 8 heads = 128 chunks at once; 128 KiB shrinks to 64 KiB below 64 x 128 x 128 KiB
    # (1 GiB), to 32 KiB below 8 x 128 x 64 KiB (64 MiB), to 16 KiB below 2 x 128 x 32 KiB (8 MiB)
    chunk = nccl.runtime.nvls_chunk
    assert [chunk(n, 8) for n in (1 << 20, (8 << 20) - 1, 8 << 20, (64 << 20) - 1, 64 << 20, 1 << 30)] == [
        16 << 10,
        16 << 10,
        32 << 10,
        32 << 10,
        64 << 10,
        128 << 10,
    ]
    # NVLS-tree: 64 KiB below 4 x 128 x 128 KiB (64 MiB), 32 KiB below 128 x 64 KiB (8 MiB); 64 KiB at most from
    # 4 nodes up
    tree = nccl.runtime.nvls_tree_chunk
    assert [tree(n, 8, 2) for n in ((8 << 20) - 1, 8 << 20, 64 << 20)] == [32 << 10, 64 << 10, 128 << 10]
    assert tree(1 << 30, 8, 4) == 64 << 10


def test_nvls_all_reduce_fills_its_pipeline() -> None:
    # 64 MiB on 8 H100s: 16 channels of 4 MiB, loops of 8 heads x 64 KiB = 512 KiB, through three stages
    # (scatter, reduce-and-broadcast, gather): two loops more than the tuner's time, at a channel's share of its
    # 8 x 40 x 5/6 GB/s
    c = nccl.choose(H100_1, "all_reduce", 64 << 20)
    assert c.label == "NVLS/Simple"
    loop, per_channel_bw = 8 * (64 << 10), 8 * 40e9 * 5 / 6 / 16
    assert c.fill == pytest.approx(2 * loop / per_channel_bw)
    assert c.seconds == pytest.approx(c.estimate + 2 * loop / per_channel_bw)
    # a buffer smaller than one loop per channel fills with what it has: 1 MiB is 64 KiB per channel
    c = nccl.cost(H100_1, "all_reduce", "NVLS", "Simple", 1 << 20)
    assert c.fill == pytest.approx(2 * (64 << 10) / per_channel_bw)
    # rings fill step by step, which the tuner's latency counts: no fill
    assert nccl.choose(H100_1, "all_gather", 64 << 20).fill == 0.0


@given(
    st.integers(min_value=3, max_value=8),
    st.sampled_from([1, 2, 4, 8]),
    st.integers(min_value=0, max_value=1 << 34),
    st.integers(min_value=0, max_value=1 << 34),
)
def test_nvls_fill_never_falls_as_the_size_grows(heads: int, nodes: int, a: int, b: int) -> None:
    lo, hi = sorted((a, b))
    fill = nccl.runtime.nvls_fill
    assert 0.0 <= fill(lo, heads, nodes, 266e9) <= fill(hi, heads, nodes, 266e9)


def test_nccl_chooses_by_its_tuner_not_by_the_fill() -> None:
    # at 2 MiB NCCL's tuner prefers NVLS (32.9 us to the ring's 41.0), which its pipeline makes slower than the ring
    # would have been: the choice stays NCCL's
    c = nccl.choose(H100_1, "all_reduce", 2 << 20)
    ring = nccl.cost(H100_1, "all_reduce", "Ring", "LL", 2 << 20)
    assert c.label == "NVLS/Simple"
    assert c.estimate < ring.estimate
    assert ring.seconds < c.seconds


def test_time_drops_where_nccl_leaves_the_nvls_tree_for_the_ring() -> None:
    # 4 nodes of 8 H100s: the tuner's estimates of NVLS-tree and ring cross between 256 and 512 MiB; NCCL moves to
    # the ring there, and the NVLS-tree's fill goes with it: one byte more takes less time, by at most that fill
    fab = nccl.fabric("H100", 32, 4, 50e9)
    lo, hi = 256 << 20, 512 << 20
    assert (nccl.choose(fab, "all_reduce", lo).label, nccl.choose(fab, "all_reduce", hi).label) == (
        "NVLSTree/Simple",
        "Ring/Simple",
    )
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if nccl.choose(fab, "all_reduce", mid).algorithm == "NVLSTree" else (lo, mid)
    before, after = nccl.choose(fab, "all_reduce", lo), nccl.choose(fab, "all_reduce", hi)
    assert after.estimate >= before.estimate
    assert 0 < before.seconds - after.seconds <= before.fill


def test_choices_as_published() -> None:
    # NVLS wins large all-reduces on 8 H100s; NCCL turns it off on 2 GPUs of a node (ncclNvlsInit, nvls.cc 241)
    assert nccl.choose(H100_1, "all_reduce", 1 << 30).algorithm == "NVLS"
    assert nccl.fabric("H100", 2, 1, math.inf).nvls is None
    assert nccl.fabric("H100", 3, 1, math.inf).nvls is not None
    assert nccl.choose(nccl.fabric("H100", 2, 1, math.inf), "all_reduce", 1 << 30).algorithm == "Ring"
    # small messages take the low-latency protocol
    assert nccl.choose(H100_1, "all_reduce", 8).label == "Ring/LL"
    # across nodes NVLS-tree: reduce in the switch, then between nodes over every NIC
    assert nccl.choose(H100_2N, "all_reduce", 1 << 30).algorithm == "NVLSTree"


@pytest.mark.parametrize(
    ("fab", "collective", "published"),
    [
        # sjeaugey, NVIDIA/nccl-tests#212: ring-class busbw ~370 GB/s on H100 NVLink4; NVLS all-reduce ~480
        (H100_1, "all_gather", 370e9),
        (H100_1, "all_reduce", 480e9),
        # A100 all-reduce ~230 GB/s busbw of a 300 GB/s NVLink3 (NVIDIA/nccl-tests#178: 208-230)
        (A100_1, "all_reduce", 230e9),
    ],
)
def test_peak_bus_bandwidth_near_published(fab: nccl.Fabric, collective: str, published: float) -> None:
    size = 8 << 30
    busbw = size / nccl.choose(fab, collective, size).seconds * BUS[collective](fab.ranks)
    assert busbw == pytest.approx(published, rel=0.05)


def _bound(fab: nccl.Fabric, collective: str, nbytes: int, line: float, nic: float) -> float:
    """Seconds no implementation can beat: each GPU's share of the data over its NVLinks, each node's over its NICs."""
    n, nodes = fab.ranks, fab.nodes
    share = (n - 1) / n if collective in ("all_reduce", "all_gather", "reduce_scatter") else 1.0
    t = share * nbytes / line
    if nodes > 1:
        t = max(t, (nodes - 1) / nodes * nbytes / (fab.per_node * nic))
    return t


sizes = st.integers(min_value=0, max_value=1 << 34)
collectives = st.sampled_from(nccl.COLLECTIVES)
fabrics = st.sampled_from(range(len(FABRICS)))


@given(fabrics, collectives, sizes, sizes)
def test_time_monotone_in_size(f: int, collective: str, a: int, b: int) -> None:
    fab = FABRICS[f][0]
    lo, hi = sorted((a, b))
    small, large = nccl.choose(fab, collective, lo), nccl.choose(fab, collective, hi)
    # the tuner's estimate never falls as the size grows; the time may, by at most the smaller call's fill, where
    # NCCL leaves an NVLS(-tree) pipeline for the ring at a size its estimates cross (as on 4 nodes near 370 MB)
    assert small.estimate <= large.estimate
    assert small.seconds - small.fill <= large.seconds


@given(fabrics, collectives, sizes)
def test_never_below_physical_bound(f: int, collective: str, nbytes: int) -> None:
    fab, line, nic = FABRICS[f]
    choice = nccl.choose(fab, collective, nbytes)
    assert choice.seconds >= _bound(fab, collective, nbytes, line, nic)
    # and never below the latency of a hop through the NVSwitch (1 us per link in the presets)
    assert choice.seconds >= choice.latency >= 2e-6


@given(fabrics, collectives, st.integers(min_value=1, max_value=1 << 33))
def test_continuous_where_the_choice_changes(f: int, collective: str, top: int) -> None:
    fab = FABRICS[f][0]
    lo, hi = top // 2, top
    if nccl.choose(fab, collective, lo).label == nccl.choose(fab, collective, hi).label:
        return
    while hi - lo > 1:  # bisect to the byte where the algorithm or protocol changes
        mid = (lo + hi) // 2
        if nccl.choose(fab, collective, mid).label == nccl.choose(fab, collective, lo).label:
            lo = mid
        else:
            hi = mid
    before, after = nccl.choose(fab, collective, lo), nccl.choose(fab, collective, hi)
    assert after.estimate >= before.estimate
    # NCCL chooses by its tuner's estimate, which one more byte changes by at most a byte at the slowest
    # bandwidth (unless the ring's plateau factor starts there); what it leaves out, an NVLS pipeline's fill,
    # comes or goes with the choice: the time jumps, up or down, by at most the larger of the two fills
    plateau = fab.nodes > 1 and after.label == "Ring/Simple"
    assert plateau or after.estimate - before.estimate < 1e-9
    assert plateau or abs(after.seconds - before.seconds) <= max(before.fill, after.fill) + 1e-9


def test_env_syntax_as_nccl_parses_it() -> None:
    env = nccl.parse_enabled({"NCCL_ALGO": "ring,TREE", "NCCL_PROTO": "^ll"})
    assert env.algorithms == {"Ring", "Tree"}
    assert env.protocols == {"LL128", "Simple"}
    assert nccl.choose(H100_1, "all_reduce", 1 << 30, env).label == "Ring/Simple"
    assert nccl.choose(H100_1, "all_reduce", 8, env).protocol == "LL128"
    # NCCL_NVLS_ENABLE=0 leaves out NVLS and NVLS-tree, whatever NCCL_ALGO says; 1 and 2 leave them to the fabric
    assert nccl.parse_enabled({"NCCL_NVLS_ENABLE": "0"}).algorithms == {
        "Tree",
        "Ring",
        "CollNetDirect",
        "CollNetChain",
    }
    assert nccl.parse_enabled({"NCCL_NVLS_ENABLE": "0", "NCCL_ALGO": "NVLS,Ring"}).algorithms == {"Ring"}
    assert nccl.parse_enabled({"NCCL_NVLS_ENABLE": "1"}) == nccl.parse_enabled({})
    assert nccl.parse_enabled({"NCCL_NVLS_ENABLE": ""}) == nccl.parse_enabled({})  # empty: the default
    no_nvls = nccl.parse_enabled({"NCCL_NVLS_ENABLE": "0"})
    assert nccl.choose(H100_1, "all_reduce", 1 << 30, no_nvls).label == "Ring/Simple"
    for bad in (
        {"NCCL_ALGO": "rng"},
        {"NCCL_PROTO": "LL129"},
        {"NCCL_ALGO": ""},
        {"NCCL_NVLS_ENABLE": "yes"},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            nccl.parse_enabled(bad)


def test_docs_page_is_current() -> None:
    page = (Path(__file__).parent.parent / "docs" / "nccl.md").read_text()
    assert update(page) == page, (
        "docs/nccl.md is stale: run python3 -m simdist.algorithms.nccl.table docs/nccl.md"
    )


def test_unknown_device_refused() -> None:
    with pytest.raises(ValueError, match="alpha-beta"):
        nccl.fabric("cpu", 8, 1, math.inf)
