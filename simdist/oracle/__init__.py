"""The equivalence oracle: check a parallel training run against its single-process reference, step by step.

    rep = simdist.check_equivalence(parallel_train, reference_train, cluster, steps=5, seed=0)
    rep.ok, rep.first, print(rep)
"""

from simdist.oracle.assemble import AssemblyError
from simdist.oracle.capture import Capture, Piece, RankStep, UnsupportedLayoutError
from simdist.oracle.check import check_equivalence, single_rank
from simdist.oracle.names import NameMap
from simdist.oracle.report import Divergence, EquivalenceReport, StepDifference
from simdist.oracle.tolerance import DEFAULT_TOLERANCES, Difference, Tolerance

__all__ = [
    "DEFAULT_TOLERANCES",
    "AssemblyError",
    "Capture",
    "Difference",
    "Divergence",
    "EquivalenceReport",
    "NameMap",
    "Piece",
    "RankStep",
    "StepDifference",
    "Tolerance",
    "UnsupportedLayoutError",
    "check_equivalence",
    "single_rank",
]
