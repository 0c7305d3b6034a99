"""simdist: run torch.distributed programs for N ranks in one process, in simulated time on a modelled cluster.

    cluster = simdist.Cluster.ring(8, bandwidth="100GB/s", latency="5us", device="H100")
    res = simdist.run(step, cluster, args=(1000,), seed=0)
    res.returns[3], res.sim_time, res.trace_hash
    res.trace.save_chrome("step.json")
"""

from simdist import algorithms, calibrate, faults, report
from simdist.calibrate import CalibrationError
from simdist.comm.symmetry import NotSimulated
from simdist.compute.memory import MemoryStats
from simdist.compute.profile import Profile, ReplayStats, profile
from simdist.engine.api import charge, now, set_algorithms, synchronize
from simdist.engine.runner import RunResult, install_report_writer, run
from simdist.engine.torchrun import run_script
from simdist.errors import (
    ClusterSpecError,
    CollectiveMismatchError,
    DeadlockError,
    FaultSpecError,
    InvalidArgumentError,
    LinkFailureError,
    NcclEnvironmentError,
    NoValuesError,
    OutOfMemoryError,
    ProfileError,
    RaceError,
    RaceWarning,
    RankCrashError,
    RankError,
    RunArgumentError,
    SimdistError,
    SimTimeoutError,
    SymmetryError,
    SymmetryWarning,
    WatchdogError,
)
from simdist.explore import (
    CheckFailed,
    Exploration,
    ExplorationError,
    Failure,
    NondeterminismError,
    Perturbation,
    ReplayTokenError,
    ReplayWarning,
    SearchSpaceError,
    ShrinkError,
    Shrunk,
    explore,
    replay,
    shrink,
)
from simdist.network import Cluster, load_cluster
from simdist.oracle import Divergence, EquivalenceReport, StepDifference, Tolerance, check_equivalence
from simdist.oracle.report import install_report_writer as install_equivalence_writer
from simdist.report.page import write_equivalence_report, write_run_report
from simdist.script import ScriptError
from simdist.trace.trace import Trace

__version__ = "0.1.0"

# The composition root fills the extension points lower layers declare (simdist.layers.EXTENSION_POINTS): any
# import of a simdist module runs this file first, so every result can save its report.
install_report_writer(write_run_report)
install_equivalence_writer(write_equivalence_report)

__all__ = [
    "CalibrationError",
    "CheckFailed",
    "Cluster",
    "ClusterSpecError",
    "CollectiveMismatchError",
    "DeadlockError",
    "Divergence",
    "EquivalenceReport",
    "Exploration",
    "ExplorationError",
    "Failure",
    "FaultSpecError",
    "InvalidArgumentError",
    "LinkFailureError",
    "MemoryStats",
    "NcclEnvironmentError",
    "NoValuesError",
    "NondeterminismError",
    "NotSimulated",
    "OutOfMemoryError",
    "Perturbation",
    "Profile",
    "ProfileError",
    "RaceError",
    "RaceWarning",
    "RankCrashError",
    "RankError",
    "ReplayStats",
    "ReplayTokenError",
    "ReplayWarning",
    "RunArgumentError",
    "RunResult",
    "ScriptError",
    "SearchSpaceError",
    "ShrinkError",
    "Shrunk",
    "SimTimeoutError",
    "SimdistError",
    "StepDifference",
    "SymmetryError",
    "SymmetryWarning",
    "Tolerance",
    "Trace",
    "WatchdogError",
    "algorithms",
    "calibrate",
    "charge",
    "check_equivalence",
    "explore",
    "faults",
    "load_cluster",
    "now",
    "profile",
    "replay",
    "report",
    "run",
    "run_script",
    "set_algorithms",
    "shrink",
    "synchronize",
]
