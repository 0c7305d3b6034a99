"""Parallel training strategies written in plain torch.distributed (they import nothing from the simulator).

``ddp``: data-parallel wrappers (naive, flat, overlapped, bucketed) with switches that reproduce classic
bugs; ``consistency``: a check that the replicas agree across ranks.
"""

from simdist.strategies.consistency import Divergence, ReplicaMismatch, assert_replicas_equal, check_replicas
from simdist.strategies.ddp import BucketedDDP, FlatDDP, NaiveDDP, OverlapDDP

__all__ = [
    "BucketedDDP",
    "Divergence",
    "FlatDDP",
    "NaiveDDP",
    "OverlapDDP",
    "ReplicaMismatch",
    "assert_replicas_equal",
    "check_replicas",
]
