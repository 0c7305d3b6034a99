"""Parallel training strategies written in plain torch.distributed (they import nothing from the simulator).

``ddp``: data-parallel wrappers (naive, flat, overlapped, bucketed) with switches that reproduce classic
bugs; ``consistency``: a check that the replicas agree across ranks; ``pipeline``: an optimizer wrapper for
pipeline stages with gradient-synchronisation modes; ``zero``: an optimizer whose state is sharded over the
ranks (ZeRO stage 1).
"""

from simdist.strategies.consistency import Divergence, ReplicaMismatch, assert_replicas_equal, check_replicas
from simdist.strategies.ddp import BucketedDDP, FlatDDP, NaiveDDP, OverlapDDP
from simdist.strategies.pipeline import (
    GradientSyncMode,
    PipelineOptimizer,
    PipelineOptimizerConfig,
    PipelineShapeError,
    PipelineTimeoutError,
)
from simdist.strategies.zero import ShardedOptimizer

__all__ = [
    "BucketedDDP",
    "Divergence",
    "FlatDDP",
    "GradientSyncMode",
    "NaiveDDP",
    "OverlapDDP",
    "PipelineOptimizer",
    "PipelineOptimizerConfig",
    "PipelineShapeError",
    "PipelineTimeoutError",
    "ReplicaMismatch",
    "ShardedOptimizer",
    "assert_replicas_equal",
    "check_replicas",
]
