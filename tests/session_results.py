"""Results computed once per test session and shared by every test that reads them, on any pytest-xdist worker.

An expensive launch (real processes, say) whose results several tests check runs once: the first worker to
ask computes and stores the outcome, the others wait for it and load it, so a test reading it costs the same
whichever worker ``--dist worksteal`` hands it to. Each test still checks its part and fails on its own.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

from filelock import FileLock  # a dependency of torch's, so present wherever the suite runs


class SessionResults:
    """Outcomes of named computations, each computed once per session: a value, or the exception it raised."""

    def __init__(self, shared_dir: Path | None) -> None:
        """``shared_dir``: a directory every worker of the session sees (None: one process, memory only)."""
        self._dir = shared_dir
        self._memo: dict[str, tuple[bool, Any]] = {}

    def get(self, key: str, compute: Callable[[], Any]) -> Any:
        """``compute()``'s value for ``key`` in this session (it raises again what it raised the first time)."""
        if key not in self._memo:
            self._memo[key] = self._outcome(key, compute)
        ok, value = self._memo[key]
        if not ok:
            raise value
        return value

    def _outcome(self, key: str, compute: Callable[[], Any]) -> tuple[bool, Any]:
        if self._dir is None:
            return _run(compute)
        path = self._dir / f"session-result-{key}.pickle"
        with FileLock(f"{path}.lock"):
            if path.exists():
                return pickle.loads(path.read_bytes())
            outcome = _run(compute)
            try:
                data = pickle.dumps(outcome)
            except Exception as error:  # noqa: BLE001 - an unpicklable outcome: the other workers get its text
                data = pickle.dumps((False, RuntimeError(f"{key}: {outcome[1]!r} (not picklable: {error})")))
            path.write_bytes(data)
            return outcome


def _run(compute: Callable[[], Any]) -> tuple[bool, Any]:
    try:
        return True, compute()
    except Exception as error:  # noqa: BLE001 - every test reading the result fails with it, not only the first
        return False, error


def shared_dir(base_temp: Path) -> Path | None:
    """The directory pytest-xdist's workers share (their base temporary directories' parent), or None
    outside xdist."""
    return base_temp.parent if os.environ.get("PYTEST_XDIST_WORKER") else None
