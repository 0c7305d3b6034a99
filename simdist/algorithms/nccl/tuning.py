"""NCCL's tuner, transcribed from ``src/graph/tuning.cc`` of NCCL 2.21.5 (line numbers of that file below).

For each collective, algorithm and protocol NCCL keeps a latency (us) and a bandwidth (GB/s, already divided
by the algorithm's traffic, so that ``time = latency + bytes / bandwidth``); it runs a call with the pair of
smallest time (``topoGetAlgoInfo``, src/enqueue.cc 1484-1537). ``bytes`` is the whole buffer: the all-reduce
buffer, the all-gather output, the reduce-scatter input (src/include/info.h 79-84), as simdist's ``m``.
CollNet (SHARP in the fabric) is not modelled: the clusters have no SHARP switches, so NCCL disables it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from simdist.algorithms.nccl.env import ALGORITHM_NAMES, PROTOCOL_NAMES, Enabled
from simdist.algorithms.nccl.graphs import Fabric
from simdist.algorithms.nccl.runtime import nvls_fill

ALGORITHMS = ("Tree", "Ring", "NVLS", "NVLSTree")
"""The algorithms modelled (NCCL's CollNetDirect and CollNetChain need SHARP switches)."""
PROTOCOLS = PROTOCOL_NAMES
#: simdist's collectives NCCL's tuner prices (a barrier is a one-element all-reduce, as NCCL's)
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "barrier")

_A = {name: i for i, name in enumerate(ALGORITHM_NAMES)}
_P = {name: i for i, name in enumerate(PROTOCOL_NAMES)}

# fmt: off
# Latencies in us (tuning.cc 54-59): base latency per call, [algorithm][protocol]
_BASE_LAT = ((6.8, 14.0, 0.0), (6.6, 14.0, 8.4), (0, 0, 0), (0, 0, 0), (0, 0, 0), (0, 0, 0))
# Hardware latency per step, [link class][algorithm][protocol] (tuning.cc 61-78)
_NVLINK, _PCI, _NET = 0, 1, 2
_HW_LAT = (
    ((0.6, 1.25, 28), (0.6, 1.9, 3.4), (0, 0, 3.7), (0, 0, 2.8), (0, 0, 25), (0, 0, 25)),
    ((1.0, 1.9, 28), (1.0, 2.5, 5.7), (0, 0, 3.7), (0, 0, 2.8), (0, 0, 0), (0, 0, 0)),
    ((5.0, 8.5, 28), (2.7, 4.0, 14.0), (0, 0, 31), (0, 0, 30), (0, 0, 18), (0, 0, 14)),
)
# [Volta, Ampere, Hopper] x [1 node, 2 nodes, more] (tuning.cc 85-106); across nodes the LL row is chosen by
# the CPU vendor (0: Intel, 1: AMD; tuning.cc 143-145)
_LL_MAX_BWS = ((39.0, 39.0, 20.4), (87.7, 22.5, 19.0), (141.0, 45.0, 35.0))
_PER_CH_MAX_RING_LL128_BWS = ((20.0, 20.0, 20.0), (20.0, 20.0, 20.0), (36.7, 36.7, 36.7))
_PER_CH_MAX_TREE_LL128_BWS = ((20.0, 20.0, 20.0), (20.0, 20.0, 20.0), (36.7, 36.7, 29.0))
_PER_CH_MAX_TREE_BWS = ((26.5, 18.5, 10.0), (24.0, 23.6, 17.8), (38.7, 41.4, 36.0))
# Measured corrections of the tree's bandwidth at 64 B x 2^k, k = 0..22 (tuning.cc 410-416)
_TREE_CORRECTION = (
    (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0),
    (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9),
)
# fmt: on
#: NCCL's network post overhead, us (``getNetOverhead``, tuning.cc 111-118)
_NET_OVERHEAD = {"intel": 1.0, "amd": 2.0}
_NCCL_COLL = {
    "all_reduce": "AllReduce",
    "barrier": "AllReduce",
    "reduce_scatter": "ReduceScatter",
    "all_gather": "AllGather",
    "broadcast": "Broadcast",
    "reduce": "Reduce",
}


@dataclass(frozen=True)
class Choice:
    """What NCCL runs a call with, what its tuner predicts for it and how long it takes."""

    algorithm: str
    protocol: str
    #: seconds the call takes: the tuner's prediction and ``fill``
    seconds: float
    #: the part of ``seconds`` that does not depend on the size (the call's latency)
    latency: float
    #: seconds of the run's pipeline filling up, which the tuner does not count (:mod:`.runtime`)
    fill: float = 0.0

    @property
    def estimate(self) -> float:
        """The tuner's predicted seconds, which NCCL chooses by."""
        return self.seconds - self.fill

    @property
    def label(self) -> str:
        """``"Ring/LL128"``, as NCCL's INFO lines name the pair."""
        return f"{self.algorithm}/{self.protocol}"


def _log2i(n: int) -> int:
    return n.bit_length() - 1 if n > 0 else 0


def _allowed(coll: str, algo: str, proto: str, fab: Fabric) -> bool:
    """Whether NCCL prices and may pick ``algo``/``proto`` for ``coll`` on ``fab`` (tuning.cc 166-172, 284-290;
    enqueue.cc 1500-1505)."""
    if coll in ("Broadcast", "Reduce") and algo != "Ring":
        return False
    if coll in ("ReduceScatter", "AllGather") and algo not in ("Ring", "NVLS"):
        return False
    if algo in ("NVLS", "NVLSTree"):
        if proto != "Simple" or fab.nvls is None:
            return False
        # NVLS across nodes needs CollNet (SHARP); NVLS-tree exists across nodes only
        return (fab.nodes == 1) == (algo == "NVLS")
    return True


def _bandwidth(coll: str, algo: str, proto: str, fab: Fabric) -> float:
    """NCCL's bandwidth of ``algo``/``proto`` for ``coll`` in GB/s (tuning.cc 170-219)."""
    graph = fab.nvls if algo in ("NVLS", "NVLSTree") else fab.tree if algo == "Tree" else fab.ring
    assert graph is not None
    cc = fab.generation.compute_capability
    cap = 2 if cc >= 90 else 1 if cc >= 80 else 0
    index2 = fab.nodes - 1 if fab.nodes <= 2 else 2
    index1 = cap if fab.nodes == 1 else (1 if fab.generation.cpu == "amd" else 0)
    ll_max = _LL_MAX_BWS[index1][index2]
    nodes, ch = fab.nodes, graph.channels
    bw = graph.bw_intra if nodes <= 2 else graph.bw_inter
    if algo == "NVLS":
        bw = min(graph.bw_intra, graph.bw_inter)
    if algo == "NVLSTree":
        bw = min(graph.bw_intra, graph.bw_inter if nodes <= 2 else graph.bw_inter / 2)
    bus = ch * bw
    if algo == "Ring" and proto == "LL":
        bus = min(ll_max, bus * 0.5)
    if algo == "Ring" and proto == "LL128":
        bus = min(bus * (0.7 if fab.per_node < 2 else 0.92), ch * _PER_CH_MAX_RING_LL128_BWS[cap][index2])
    if algo == "Tree":
        bus = min(bus * 0.92, ch * _PER_CH_MAX_TREE_BWS[cap][index2])
    if algo == "Tree" and proto == "LL":
        bus = min(bus / 3.8, ll_max)
    if algo == "Tree" and proto == "LL128":
        bus = min(
            bus * (7.0 / 9.0 if nodes == 1 else 120.0 / 128.0), ch * _PER_CH_MAX_TREE_LL128_BWS[cap][index2]
        )
    # the tree's graph on these nodes has NCCL's balanced-tree pattern: no 0.85 (tuning.cc 185)
    n = fab.ranks
    nsteps = 2 * (n - 1) if coll == "AllReduce" else n - 1 if coll in ("ReduceScatter", "AllGather") else n
    if algo == "Ring":
        return bus * n / nsteps
    if algo in ("NVLS", "NVLSTree"):
        return bus * 5.0 / 6.0
    return bus * 0.5


def _latency(coll: str, algo: str, proto: str, fab: Fabric) -> float:
    """NCCL's latency of ``algo``/``proto`` for ``coll`` in us (tuning.cc 225-263)."""
    a, p = _A[algo], _P[proto]
    n, nodes = fab.ranks, fab.nodes
    nsteps = 2 * (n - 1) if coll == "AllReduce" else n - 1 if coll in ("ReduceScatter", "AllGather") else n
    if coll == "AllReduce":
        inter_steps = 2 * nodes if nodes > 1 else 0
    else:
        inter_steps = nodes - 1 if coll in ("ReduceScatter", "AllGather") else nodes
    hw = _NVLINK if nodes == 1 else _NET
    lat = _BASE_LAT[a][p]
    intra = _HW_LAT[_NVLINK][a][p]
    inter = _HW_LAT[_NET][a][p]  # + the graph's latencyInter: 0 on InfiniBand NICs
    if algo == "Ring":
        step = _HW_LAT[hw][a][p]
        if coll in ("Reduce", "Broadcast"):
            return lat + step  # the search keeps the same channels inside the node (sameChannels)
        overhead = 0.0
        if nodes > 1:
            overhead = _NET_OVERHEAD[fab.generation.cpu] * (3 if proto == "Simple" else 1)
        intra = max(intra, overhead)
        return lat + (nsteps - inter_steps) * intra + inter_steps * inter
    per_node = n // nodes
    if algo == "Tree":
        return lat + 2 * ((per_node - 1) * intra + _log2i(nodes) * inter)
    if algo == "NVLS":
        return intra + (inter if nodes > 1 else 0.0)
    return lat + intra + 2 * _log2i(nodes) * inter  # NVLSTree


def _tree_factor(proto: str, nbytes: int, exact: bool) -> float:
    """tuning.cc 434-435; ``exact=False`` joins the steps at powers of two by straight lines in log2 size, so
    the time never drops as the size grows (NCCL's steps would make it drop at some powers of two)."""
    row = _TREE_CORRECTION[_P[proto]]
    if exact:
        k = _log2i(nbytes >> 6)
        return row[k] if k < 23 else 1.0
    x = math.log2(nbytes / 64) if nbytes > 64 else 0.0
    k = int(x)
    if k >= 23:
        return 1.0
    hi = row[k + 1] if k + 1 < 23 else 1.0
    return row[k] + (hi - row[k]) * (x - k)


def candidates(fab: Fabric, collective: str, enabled: Enabled | None = None) -> list[tuple[str, str]]:
    """The (algorithm, protocol) pairs NCCL may run ``collective`` with on ``fab`` (tuning.cc 268-336)."""
    coll = _NCCL_COLL[collective]
    enabled = enabled or Enabled()
    pairs = [
        (a, p)
        for a in ALGORITHMS
        for p in PROTOCOLS
        if _allowed(coll, a, p, fab) and a in enabled.algorithms and p in enabled.protocols
    ]
    if not pairs:
        # nothing enabled: NCCL falls back to the ring (tuning.cc 322-336)
        pairs = [("Ring", p) for p in PROTOCOLS if p in enabled.protocols] or [("Ring", p) for p in PROTOCOLS]
    return pairs


def cost(
    fab: Fabric, collective: str, algorithm: str, protocol: str, nbytes: int, exact: bool = False
) -> Choice:
    """The time of ``collective`` on ``nbytes`` (the whole buffer) with ``algorithm``/``protocol``: NCCL's
    prediction (``ncclTopoGetAlgoTime``, tuning.cc 418-445) and the pipeline's fill it leaves out."""
    coll = _NCCL_COLL[collective]
    bw = _bandwidth(coll, algorithm, protocol, fab) * fab.overrides.factor(algorithm)
    lat = max(0.0, _latency(coll, algorithm, protocol, fab) + fab.overrides.latency * 1e6)
    if algorithm == "Tree":
        bw *= _tree_factor(protocol, nbytes, exact)
    comm_channels = min(32, 2 * fab.ring.channels)
    if (
        algorithm == "Ring"
        and protocol == "Simple"
        and fab.nodes > 1
        and coll == "AllReduce"
        and nbytes // (comm_channels * fab.ranks) >= 64
    ):
        lat *= (
            1.4 if fab.generation.compute_capability >= 80 else 1.9
        )  # the ring's plateau (tuning.cc 437-440)
    seconds = (lat + nbytes / (1000.0 * bw)) * 1e-6
    fill = 0.0
    if algorithm in ("NVLS", "NVLSTree") and coll == "AllReduce" and fab.nvls is not None:
        fill = nvls_fill(nbytes, fab.nvls.channels, fab.nodes, bw * 1e9, fab.runtime)
    return Choice(algorithm, protocol, seconds + fill, lat * 1e-6, fill)


def choose(
    fab: Fabric, collective: str, nbytes: int, enabled: Enabled | None = None, exact: bool = False
) -> Choice:
    """The pair NCCL runs ``collective`` of ``nbytes`` with, and its time: the smallest time the tuner predicts
    (not counting the fill NCCL does not know of), ties to the first pair in NCCL's order (algorithms Tree,
    Ring, NVLS, NVLSTree; protocols LL, LL128, Simple)."""
    best: Choice | None = None
    for a, p in candidates(fab, collective, enabled):
        c = cost(fab, collective, a, p, nbytes, exact)
        if best is None or c.estimate < best.estimate:
            best = c
    assert best is not None
    return best
