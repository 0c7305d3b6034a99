"""simdist: run torch.distributed programs for N ranks in one process, in simulated time on a modelled cluster.

    cluster = simdist.Cluster.ring(8, bandwidth="100GB/s", latency="5us", device="H100")
    res = simdist.run(step, cluster, args=(1000,), seed=0)
    res.returns[3], res.sim_time, res.trace_hash
    res.trace.save_chrome("step.json")
"""

from simdist.errors import (
    ClusterSpecError,
    CollectiveMismatchError,
    DeadlockError,
    RaceError,
    RaceWarning,
    RankError,
    SimdistError,
)

__version__ = "0.1.0"

__all__ = [
    "Cluster",
    "ClusterSpecError",
    "CollectiveMismatchError",
    "DeadlockError",
    "RaceError",
    "RaceWarning",
    "RankError",
    "RunResult",
    "SimTimeoutError",
    "SimdistError",
    "Trace",
    "charge",
    "load_cluster",
    "now",
    "run",
    "set_algorithms",
]


def __getattr__(name: str):  # lazy: importing simdist stays cheap and free of import cycles
    if name == "Cluster":
        from simdist.network.topology import Cluster

        return Cluster
    if name == "load_cluster":
        from simdist.network.presets import load_cluster

        return load_cluster
    if name in ("run", "RunResult"):
        from simdist.engine import runner

        return getattr(runner, name)
    if name == "Trace":
        from simdist.trace.trace import Trace

        return Trace
    if name == "SimTimeoutError":
        from simdist.comm.work import SimTimeoutError

        return SimTimeoutError
    if name in ("now", "charge", "set_algorithms"):
        from simdist.engine import api

        return getattr(api, name)
    raise AttributeError(f"module 'simdist' has no attribute {name!r}")
