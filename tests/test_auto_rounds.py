"""``auto`` under the alpha-beta model prices recursive halving/doubling and the binomial tree round by round,
and a ring by the mean latency of its hops: on two-level clusters its choice is as fast as the fastest
algorithm the simulator runs (the oracle: every eligible algorithm simulated)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import simdist
from simdist import Cluster, algorithms


def _all_reduce(numel: int, algorithm: str) -> tuple[float, str]:
    dist.init_process_group("gloo")
    simdist.set_algorithms(all_reduce=algorithm)
    x = torch.ones(numel)
    t0 = simdist.now()
    dist.all_reduce(x)
    return simdist.now() - t0


def _time(cluster: Cluster, numel: int, algorithm: str) -> tuple[float, str]:
    res = simdist.run(_all_reduce, cluster, args=(numel, algorithm), compute=False, trace="collectives")
    return max(res.returns), res.trace.spans[-1].args["algorithm"]


@pytest.mark.parametrize(("nodes", "per_node", "numel"), [(3, 8, 1 << 20), (3, 8, 1 << 14), (2, 4, 1 << 18)])
def test_auto_is_as_fast_as_the_fastest_algorithm(nodes: int, per_node: int, numel: int) -> None:
    cluster = Cluster.two_level(nodes, 8, ranks_per_node=per_node)
    chosen, name = _time(cluster, numel, "auto")
    eligible = [a for a in algorithms.names("all_reduce") if a != "direct"]
    fastest = min(_time(cluster, numel, a)[0] for a in eligible)
    assert chosen <= fastest * 1.02, (
        f"auto ran {name} in {chosen * 1e6:.1f} us; the fastest took {fastest * 1e6:.1f} us"
    )


def test_rounds_price_the_uncontended_halving_exactly() -> None:
    # on 2 nodes of 8, only the first halving round (and the last doubling one) crosses the fabric
    cluster = Cluster.two_level(2, 8)
    numel = 1 << 20
    simulated, _ = _time(cluster, numel, "rhd")
    ranks = list(range(16))
    priced = algorithms.get("all_reduce", "rhd").estimate_rounds(
        16, 4 * numel, lambda d: cluster.hop_alpha_beta(ranks, d)
    )
    assert simulated == pytest.approx(priced, rel=1e-3)
