"""Targets the exploration tests drive: simulations other than ``simdist.run``, defined at module level so that
worker processes rebuild them by name."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

import simdist
import simdist.autograd as ag
from simdist.explore import Ran, Target
from simdist.runtime import LinkSpec, simulate


def client() -> float:
    """A few remote ops and a fetch: each crosses the simulated link, so each draws a delivery delay."""
    x = ag.tensor(np.arange(4.0).reshape(2, 2), requires_grad=True)
    y = (x @ x).tanh().sum()
    y.backward()
    return float(y.item())


@dataclass(frozen=True)
class Deadline(Target):
    """A remote session that fails when the link's jitter makes it last longer than ``limit`` seconds."""

    limit: float
    jitter: float = 50e-6

    def run(self, perturbation: simdist.Perturbation) -> Ran:
        res = simulate(client, link=LinkSpec(jitter=self.jitter), perturbation=perturbation)
        if res.sim_time > self.limit:
            error = TimeoutError(f"session took {res.sim_time * 1e6:.1f} us, over {self.limit * 1e6:.1f} us")
            error.trace_hash = res.trace_hash  # type: ignore[attr-defined]
            raise error
        return Ran(res.sim_time, res.trace_hash)

    def kind(self, error: Exception) -> str | None:
        return "over the deadline" if isinstance(error, TimeoutError) else None


_calls = itertools.count()


@dataclass(frozen=True)
class Drifting(Target):
    """A target that keeps state between runs: its second run of one perturbation differs from its first."""

    def run(self, perturbation: simdist.Perturbation) -> Ran:
        error = RuntimeError("always fails")
        error.trace_hash = f"call {next(_calls)}"  # type: ignore[attr-defined]
        raise error


class NotADataclass(Target):
    """A target without fields to ship."""

    def run(self, perturbation: simdist.Perturbation) -> Ran:
        return Ran(None, "")
