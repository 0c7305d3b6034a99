"""Collective algorithms as message schedules, declared once in a registry.

    from simdist import algorithms
    algorithms.names("all_reduce")                    # ('ring', 'tree', 'rhd', 'direct')
    algo = algorithms.get("all_reduce", "ring")
    algo.estimate(8, 1 << 20, alpha=5e-6, beta=1 / 100e9)
    print(algorithms.format_schedule(algo.schedule(algorithms.Problem(n=4, numel=8, itemsize=4)), 4))
"""

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
    estimate,
    get,
    names,
)
from simdist.algorithms.schedule import Msg, format_schedule, offsets_from_sizes, split_offsets, steps

__all__ = [
    "ALGORITHMS",
    "AUTO",
    "COLLECTIVES",
    "NAMES",
    "Algorithm",
    "Msg",
    "Problem",
    "build",
    "check_choice",
    "check_collective",
    "choose",
    "estimate",
    "format_schedule",
    "get",
    "names",
    "offsets_from_sizes",
    "split_offsets",
    "steps",
]
