"""Collective algorithms as message schedules, declared once in a registry, beside one record per collective
and per reduce op.

    from simdist import algorithms
    algorithms.names("all_reduce")                    # ('ring', 'tree', 'rhd', 'direct')
    algo = algorithms.get("all_reduce", "ring")
    algo.estimate(8, 1 << 20, alpha=5e-6, beta=1 / 100e9)
    print(algorithms.format_schedule(algo.schedule(algorithms.Problem(n=4, numel=8, itemsize=4)), 4))
    algorithms.collective("all_gather").bus_factor(8)  # 0.875, as nccl-tests reports busbw
    algorithms.reduce_op("avg").divides               # True
"""

from simdist.algorithms import nccl
from simdist.algorithms.collectives import COLLECTIVE_RECORDS, Collective
from simdist.algorithms.reduce_ops import REDUCE_OPS, Reduction, reduce_op, reduce_op_of
from simdist.algorithms.registry import (
    ALGORITHMS,
    AUTO,
    COLLECTIVES,
    NAMES,
    Algorithm,
    Problem,
    build,
    check_choice,
    check_collective,
    choose,
    collective,
    estimate,
    get,
    names,
)
from simdist.algorithms.schedule import Msg, format_schedule, offsets_from_sizes, split_offsets, steps

__all__ = [
    "ALGORITHMS",
    "AUTO",
    "COLLECTIVES",
    "COLLECTIVE_RECORDS",
    "NAMES",
    "REDUCE_OPS",
    "Algorithm",
    "Collective",
    "Msg",
    "Problem",
    "Reduction",
    "build",
    "check_choice",
    "check_collective",
    "choose",
    "collective",
    "estimate",
    "format_schedule",
    "get",
    "names",
    "nccl",
    "offsets_from_sizes",
    "reduce_op",
    "reduce_op_of",
    "split_offsets",
    "steps",
]
