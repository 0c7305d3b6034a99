"""Fully sharded data parallelism in plain torch.distributed (it imports nothing from the simulator).

``units``: sharding units and the chunk arithmetic; ``hooks``: the backward hooks that reduce-scatter full
gradients into shards, with the helper surface and the :class:`Hazards` switches; ``wrapper``: the FSDP module;
``resharded``: the placeholder a module holds for a sharded parameter while it is not gathered;
``accumulate``: a gradient accumulator for micro-batches. ``ShardedOptimizer`` (ZeRO-1) lives in
:mod:`simdist.strategies.zero`. See docs/fsdp.md.
"""

from simdist.strategies.fsdp.accumulate import GradientAccumulator
from simdist.strategies.fsdp.hooks import FSDPBackwardHook, Hazards
from simdist.strategies.fsdp.units import SHARD_ATTR, ShardingUnit, chunk_size, shard_range
from simdist.strategies.fsdp.wrapper import (
    FSDP,
    ShardPolicy,
    is_linear_or_embedding,
    shard_linear_and_embedding_weights,
)
from simdist.strategies.zero import ShardedOptimizer

__all__ = [
    "FSDP",
    "SHARD_ATTR",
    "FSDPBackwardHook",
    "GradientAccumulator",
    "Hazards",
    "ShardPolicy",
    "ShardedOptimizer",
    "ShardingUnit",
    "chunk_size",
    "is_linear_or_embedding",
    "shard_linear_and_embedding_weights",
    "shard_range",
]
