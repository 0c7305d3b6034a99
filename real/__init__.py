"""Run the rank functions simdist simulates on real processes, through torch's elastic launcher."""

from real.errors import RealConfigError, RealError, RealRunError
from real.launcher import RealResult, free_port, run, run_script

__all__ = ["RealConfigError", "RealError", "RealResult", "RealRunError", "free_port", "run", "run_script"]
