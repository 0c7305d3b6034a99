"""What NCCL's topology search finds on nodes of NVSwitch-connected GPUs with one NIC per GPU (a DGX).

NCCL prices its algorithms from "graphs": per algorithm, a number of channels and the bandwidth each channel
may use inside a node (``bwIntra``) and across nodes (``bwInter``), in GB/s. The search
(``src/graph/search.cc`` of NCCL 2.21.5, ``ncclTopoCompute``, lines 860-1044) tries the speeds of a fixed
list from the highest down and keeps the layout with the most channels x bandwidth that the links carry;
this module replays that search on the one topology the ``two_level`` clusters describe: every GPU has
``nvlinks`` NVLinks of ``nvlink_bw`` GB/s into the node's NVSwitches, and its own NIC. Ring and tree
channels use one NVLink path out of every GPU (and one NIC per channel across nodes); an NVLS channel
uses every GPU's NVLinks once and its head's twice (``ncclTopoSearchTryNvls``, lines 337-369).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from simdist.algorithms.nccl.overrides import NO_OVERRIDES, Overrides
from simdist.algorithms.nccl.runtime import DEFAULT, Runtime

#: speeds NCCL's search tries, GB/s per channel (search.cc 850-856): before Hopper and on Hopper, inside one
#: node (no NIC in the topology) and with NICs
# fmt: off
_SPEEDS_INTRA = (40.0, 30.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0)
_SPEEDS_INTER = (48.0, 30.0, 28.0, 24.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.4, 1.2, 0.24, 0.12)
_SM90_SPEEDS_INTRA = (60.0, 50.0, 40.0, 30.0, 24.0, 20.0, 15.0, 12.0, 11.0, 6.0, 3.0)
_SM90_SPEEDS_INTER = (48.0, 45.0, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0, 6.0, 3.0, 2.4, 1.2, 0.24, 0.12)
# fmt: on
#: ring and tree channels the search may find (``MAXCHANNELS/2``, init.cc): 16
_MAX_CHANNELS = 16


@dataclass(frozen=True)
class Generation:
    """A GPU as NCCL's tuner sees it."""

    #: compute capability x 10 (90: Hopper, 80: Ampere)
    compute_capability: int
    #: GB/s of one NVLink as NCCL counts it (``SM80_NVLINK_BW`` 20.0, ``SM90_NVLINK_BW`` 20.6: topo.h 16-17)
    nvlink_bw: float
    #: NVLinks per GPU (A100 SXM4: 12, H100/H200 SXM5: 18; NVIDIA data sheets)
    nvlinks: int
    #: the host CPU's vendor in the DGX that carries it ("intel": DGX H100/H200, Xeon 8480C; "amd": DGX A100,
    #: EPYC 7742): NCCL's LL bandwidth across nodes and its network overhead depend on it
    cpu: str

    @property
    def nvlink_total(self) -> float:
        """GB/s a GPU reaches its NVSwitches with, as NCCL counts it."""
        return self.nvlinks * self.nvlink_bw


GENERATIONS: dict[str, Generation] = {
    "H100": Generation(90, 20.6, 18, "intel"),
    "H200": Generation(90, 20.6, 18, "intel"),
    "A100": Generation(80, 20.0, 12, "amd"),
    "A100-40GB": Generation(80, 20.0, 12, "amd"),
}
"""The devices NCCL's model is known for, by simdist device name."""


@dataclass(frozen=True)
class Graph:
    """One algorithm's channels and per-channel bandwidths (GB/s), as ``struct ncclTopoGraph`` holds them."""

    channels: int
    bw_intra: float
    bw_inter: float


@dataclass(frozen=True)
class Fabric:
    """A communicator as NCCL's tuner sees it: its GPUs, its nodes and the graphs its search found."""

    generation: Generation
    ranks: int
    nodes: int
    ring: Graph
    tree: Graph
    #: NVLink SHARP (in-switch reduction): Hopper and later on NVSwitch nodes only (search.cc 893)
    nvls: Graph | None
    #: the run-time constants (channels, chunks) NCCL runs its choice with
    runtime: Runtime = DEFAULT
    #: the cluster's corrections of the tuner's latencies and bandwidths (fitted by simdist calibrate)
    overrides: Overrides = NO_OVERRIDES

    @property
    def per_node(self) -> float:
        """Ranks per node (NCCL's ``ppn``)."""
        return self.ranks / self.nodes


def generation_of(device: str) -> Generation | None:
    """The generation of simdist device ``device``, or None where NCCL's model is not known for it."""
    return GENERATIONS.get(device)


def _search(speeds: tuple[float, ...], max_bw: float, total: float, fits: object) -> tuple[int, float]:
    """search.cc 917-999: from the first speed at most ``max_bw``, the (channels, GB/s) with the most
    channels x speed; lower speeds are tried while they are above .49 of the best one found."""
    i = next((k for k, s in enumerate(speeds) if s <= max_bw), len(speeds) - 1)
    best_n, best_bw = 0, 0.0
    while True:
        n = fits(speeds[i])  # type: ignore[operator]
        if n * speeds[i] > best_n * best_bw:
            best_n, best_bw = n, speeds[i]
        if best_n and best_n * best_bw >= total:
            break
        if i + 1 < len(speeds) and (best_n == 0 or speeds[i + 1] / best_bw > 0.49):
            i += 1
            continue
        break
    return best_n, best_bw


def _count(capacity: float, bw: float) -> int:
    return math.floor(capacity / bw + 1e-9)


def _ring_graph(gen: Generation, per_node: int, nodes: int, nic_bw: float) -> Graph:
    total = gen.nvlink_total
    hopper = gen.compute_capability >= 90
    if nodes == 1:
        speeds = _SM90_SPEEDS_INTRA if hopper else _SPEEDS_INTRA

        def fits(bw: float) -> int:
            return min(_MAX_CHANNELS, _count(total, bw))

        n, bw = _search(speeds, total, total, fits)
    else:
        speeds = _SM90_SPEEDS_INTER if hopper else _SPEEDS_INTER

        def fits(bw: float) -> int:  # one NIC per GPU: a channel leaves and enters the node through one NIC
            return min(_MAX_CHANNELS, _count(total, bw), per_node * _count(nic_bw, bw))

        n, bw = _search(speeds, min(total, nic_bw), total, fits)
    # ncclTopoDupChannels (search.cc 835-848): fast channels are split in two
    if bw >= 25.0 and not (gen.compute_capability > 80 and bw < 50.0 and n > 4):
        dup = min(2 * n, _MAX_CHANNELS)
        bw /= -(-dup // n)
        n = dup
    # pass 2 (search.cc 1014-1020): a faster speed with as many channels is kept
    higher = [s for s in speeds if s > bw]
    while higher and fits(higher[-1]) >= n:
        bw = higher.pop()
    return Graph(n, bw, bw)


def _nvls_graph(gen: Generation, per_node: int, nodes: int, nic_bw: float) -> Graph | None:
    # NCCL turns NVLS off where a node holds two GPUs of the communicator or fewer (ncclNvlsInit,
    # src/transport/nvls.cc 241)
    if gen.compute_capability < 90 or per_node <= 2:
        return None
    total = gen.nvlink_total
    if nodes == 1:
        # every GPU heads a channel (search.cc 899-902)
        def fits(bw: float) -> int:
            return per_node if (per_node + 1) * bw <= total + 1e-9 else 0

        n, bw = _search(_SM90_SPEEDS_INTRA, total, math.inf, fits)
        return Graph(n, bw, bw)

    def fits_net(bw: float) -> int:
        return max(0, min(per_node, _count(total, bw) - 1))

    n, bw = _search(_SM90_SPEEDS_INTER, nic_bw, math.inf, fits_net)
    # pass 2 for NVLS (search.cc 1021-1024): the inter-node speed rises while the NICs carry it
    inter = bw
    for s in reversed(_SM90_SPEEDS_INTER):
        if inter < s <= nic_bw and inter < 2 * bw:
            inter = s
    return Graph(n, bw, inter)


def fabric(device: str, ranks: int, nodes: int, nic_bandwidth: float) -> Fabric:
    """The fabric of ``ranks`` GPUs ``device`` on ``nodes`` DGX-like nodes, NICs of ``nic_bandwidth`` bytes/s."""
    gen = generation_of(device)
    if gen is None:
        raise ValueError(
            f"NCCL's collective model is known for {', '.join(GENERATIONS)}; found device {device!r}: use the "
            f"alpha-beta model (collective_model='alpha-beta') for other devices"
        )
    per_node = -(-ranks // nodes)
    nic = nic_bandwidth / 1e9
    ring = _ring_graph(gen, per_node, nodes, nic)
    # the tree's search finds the ring's layout on these nodes (one chain per channel through the NVSwitch)
    return Fabric(gen, ranks, nodes, ring, ring, _nvls_graph(gen, per_node, nodes, nic))
