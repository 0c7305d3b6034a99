"""An exploration's progress bar (tqdm): runs done of the bound, runs/s, failures found so far and an ETA.

Shown on a terminal only: by default the bar appears when standard error is a terminal, so output that is
captured (pytest, a pipe, a log file) never holds it.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from simdist.explore.runs import Outcome


class ProgressBar:
    """Counts runs as they end; ``show=None`` shows it only where ``file`` (default: standard error) is a
    terminal."""

    def __init__(self, total: int, show: bool | None = None, file: TextIO | None = None) -> None:
        file = sys.stderr if file is None else file
        if show is None:
            show = bool(getattr(file, "isatty", lambda: False)())
        self.failures = 0
        self._bar: Any = None
        if not show:
            return
        # imported only where a bar is drawn: an exploration without one (captured output) never needs tqdm
        from tqdm import tqdm

        self._bar = tqdm(
            total=total,
            desc="exploring",
            unit=" runs",
            file=file,
            dynamic_ncols=True,
            postfix={"failures": 0},
        )

    def update(self, outcome: Outcome) -> None:
        """One more run ended with ``outcome``."""
        if outcome.kind is not None:
            self.failures += 1
        if self._bar is not None:
            if outcome.kind is not None:
                self._bar.set_postfix(failures=self.failures, refresh=False)
            self._bar.update(1)

    def close(self) -> None:
        """Leave the bar's last state on the terminal."""
        if self._bar is not None:
            self._bar.close()
