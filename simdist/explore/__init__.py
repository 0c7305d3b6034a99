"""Exploration: run a program under many perturbations (tie orders, jitter) and collect what fails, replayably."""

from simdist.clock.perturbation import Perturbation
from simdist.explore.api import STRATEGIES, explore, replay
from simdist.explore.errors import (
    CheckFailed,
    ExplorationError,
    NondeterminismError,
    ReplayTokenError,
    ReplayWarning,
    SearchSpaceError,
)
from simdist.explore.exploration import Exploration, Failure
from simdist.explore.shrink import ShrinkError, Shrunk, shrink
from simdist.explore.target import Ran, Target

__all__ = [
    "STRATEGIES",
    "CheckFailed",
    "Exploration",
    "ExplorationError",
    "Failure",
    "NondeterminismError",
    "Perturbation",
    "Ran",
    "ReplayTokenError",
    "ReplayWarning",
    "SearchSpaceError",
    "ShrinkError",
    "Shrunk",
    "Target",
    "explore",
    "replay",
    "shrink",
]
