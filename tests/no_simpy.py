"""A child interpreter's environment in which simpy cannot be imported, as on a GPU machine with torch alone.

simdist's package imports simpy first thing, so in such an interpreter any import of a ``simdist`` module fails:
what runs there proves it needs nothing of the simulator. The environment (``PYTHONPATH``) is inherited by the
rank processes the launcher spawns, so it holds for them too.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_BLOCKER = (
    '"""Stands in for a missing simpy: the test\'s interpreter must run without the simulator."""\n'
    'raise ModuleNotFoundError("No module named \'simpy\' (hidden by tests/no_simpy.py)", name="simpy")\n'
)


def env_without_simpy(root: Path) -> dict[str, str]:
    """``os.environ`` with this checkout first on the path and a ``simpy`` under ``root`` that refuses to load."""
    shadow = root / "without-simpy"
    (shadow / "simpy").mkdir(parents=True, exist_ok=True)
    (shadow / "simpy" / "__init__.py").write_text(_BLOCKER)
    path = [str(shadow), str(REPO), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
