"""Run the rank functions simdist simulates on real processes, through torch's elastic launcher."""

from real.emulated_cuda import EmulatedCuda
from real.errors import RealConfigError, RealError, RealGroupError, RealRunError
from real.launcher import RealResult, free_port, run, run_script
from real.rendezvous import Rendezvous

__all__ = [
    "EmulatedCuda",
    "RealConfigError",
    "RealError",
    "RealGroupError",
    "RealResult",
    "RealRunError",
    "Rendezvous",
    "free_port",
    "run",
    "run_script",
]
