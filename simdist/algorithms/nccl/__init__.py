"""NCCL's own cost model of its collectives (NCCL 2.21.5): what its tuner predicts and picks, per call.

    from simdist.algorithms import nccl
    fabric = nccl.fabric("H100", ranks=8, nodes=1, nic_bandwidth=50e9)
    choice = nccl.choose(fabric, "all_reduce", 1 << 20)   # Choice(algorithm='NVLS', protocol='Simple', ...)
    choice.seconds

``graphs`` reproduces what NCCL's topology search finds on NVSwitch nodes (channels and bandwidth per
channel), ``tuning`` transcribes ``src/graph/tuning.cc`` (latencies, bandwidths, the choice), ``runtime``
holds what NCCL runs once it has chosen (the NVLS pipeline's chunks and fill, their constants in one
``Runtime``), ``env`` reads ``NCCL_ALGO``, ``NCCL_PROTO`` and ``NCCL_NVLS_ENABLE`` as NCCL does, and
``overrides`` holds a cluster's fitted corrections.
"""

from simdist.algorithms.nccl.env import Enabled, parse_enabled
from simdist.algorithms.nccl.graphs import GENERATIONS, Fabric, Graph, fabric, generation_of
from simdist.algorithms.nccl.overrides import NO_OVERRIDES, Overrides
from simdist.algorithms.nccl.runtime import Runtime
from simdist.algorithms.nccl.tuning import (
    ALGORITHMS,
    COLLECTIVES,
    PROTOCOLS,
    Choice,
    candidates,
    choose,
    cost,
)

__all__ = [
    "ALGORITHMS",
    "COLLECTIVES",
    "GENERATIONS",
    "NO_OVERRIDES",
    "PROTOCOLS",
    "Choice",
    "Enabled",
    "Fabric",
    "Graph",
    "Overrides",
    "Runtime",
    "candidates",
    "choose",
    "cost",
    "fabric",
    "generation_of",
    "parse_enabled",
]
