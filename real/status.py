"""Per-rank status files: how far each rank process got and why it failed, as the launcher reads them."""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path
from typing import Any

STARTED = "started"
RETURNED = "returned"
#: a rank's script created its default process group; the file holds the backend's name
GROUP = "group"
#: what faulthandler writes when a rank process dies of a fatal signal (SIGSEGV, SIGFPE, SIGABRT, SIGBUS, SIGILL)
CRASH = "crash.txt"


class StatusDir:
    """A directory holding ``rank<R>.<kind>`` files, written by rank processes and read by the launcher."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def path(self, rank: int, kind: str) -> Path:
        """The file of ``kind`` for ``rank``."""
        return self.root / f"rank{rank}.{kind}"

    def mark(self, rank: int, kind: str) -> None:
        """Record that ``rank`` reached stage ``kind`` (STARTED, RETURNED)."""
        self.path(rank, kind).touch()

    def mark_started(self, rank: int, pid: int) -> None:
        """Record that ``rank`` started, in process ``pid`` (its peers and the launcher look it up)."""
        tmp = self.path(rank, "started.tmp")
        tmp.write_text(str(pid))
        os.replace(tmp, self.path(rank, STARTED))

    def pid(self, rank: int) -> int | None:
        """The process ``rank`` runs in, once it started; None before (or if it recorded none)."""
        try:
            text = self.path(rank, STARTED).read_text()
        except OSError:
            return None
        return int(text) if text.isdigit() else None

    def has(self, rank: int, kind: str) -> bool:
        """Whether ``rank`` reached stage ``kind``."""
        return self.path(rank, kind).exists()

    def started_ranks(self) -> list[int]:
        """The ranks whose processes started here, in order (on one node of several: that node's ranks)."""
        found = (
            p.name.removeprefix("rank").removesuffix(f".{STARTED}")
            for p in self.root.glob(f"rank*.{STARTED}")
        )
        return sorted(int(r) for r in found if r.isdigit())

    def record_group(self, rank: int, backend: str) -> None:
        """Record that ``rank``'s own code created its default process group, with ``backend``."""
        self.path(rank, GROUP).write_text(backend)

    def group(self, rank: int) -> str | None:
        """The backend of the default group ``rank``'s own code created, or None if it created none."""
        try:
            return self.path(rank, GROUP).read_text()
        except OSError:
            return None

    def record_error(
        self,
        rank: int,
        exc: BaseException,
        skip_files: tuple[str, ...] = (),
        gone: list[int] | None = None,
        summary: str | None = None,
        note: str = "",
        chain: bool = True,
    ) -> None:
        """Save ``exc`` raised on ``rank`` with the time it was caught (to order failures across ranks).

        Leading traceback frames from ``skip_files`` (real's own rank-process code, runpy) are left out.
        ``gone`` lists the peers whose processes had already ended (or were ending) when it was caught: this
        rank's failure came after theirs, whatever the clocks say. ``summary`` replaces the exception's own
        one-line description, and ``note`` is added after the traceback; ``chain=False`` leaves out the
        exceptions ``exc`` was raised while handling.
        """
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename in skip_files:
            tb = tb.tb_next
        text = "".join(traceback.format_exception(type(exc), exc, tb, chain=chain))
        data = {
            "time": time.time(),
            "type": type(exc).__name__,
            "summary": summary or "".join(traceback.format_exception_only(type(exc), exc)).strip(),
            "traceback": f"{summary}\n{text}" if summary else text,
            "gone": sorted(gone or []),
        }
        if note:
            data["traceback"] = data["traceback"].rstrip("\n") + "\n" + note
        # Written then renamed so the launcher never reads half a file.
        tmp = self.path(rank, "error.tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.path(rank, "error.json"))

    def error(self, rank: int) -> dict[str, Any] | None:
        """The error ``rank`` recorded, or None."""
        path = self.path(rank, "error.json")
        if not path.exists():
            return None
        return json.loads(path.read_text())

    def crash(self, rank: int) -> tuple[str, float] | None:
        """What faulthandler wrote when ``rank`` died of a fatal signal, and when (the file's time); or None."""
        path = self.path(rank, CRASH)
        try:
            text, when = path.read_text().strip(), path.stat().st_mtime
        except OSError:
            return None
        return (text, when) if text else None

    def stack(self, rank: int) -> str | None:
        """The Python stacks ``rank`` dumped when asked at the timeout, or None if it dumped nothing."""
        path = self.path(rank, "stack.txt")
        if not path.exists():
            return None
        text = path.read_text().strip()
        return text or None
