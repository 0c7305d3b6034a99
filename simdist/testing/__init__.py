"""hypothesis strategies for users' test suites: ``perturbations``, ``clusters`` and ``faults``, each shrinking
toward today's plain run (see docs/explore-at-scale.md). Needs hypothesis (``pip install 'simdist[testing]'``)."""

from simdist.testing.strategies import FAULT_KINDS, SURVIVABLE, TOPOLOGIES, clusters, faults, perturbations

__all__ = ["FAULT_KINDS", "SURVIVABLE", "TOPOLOGIES", "clusters", "faults", "perturbations"]
