"""When each rank process of a launch ended, and with what exit code, as the launcher saw it.

torch's elastic agent reports one failed process (the first its poll notices), so a rank that ended by
``os._exit`` or a signal goes unreported whenever a peer's failure was noticed first. The launcher's thread
watches every rank process instead: it waits on their sentinels, which become ready the moment a process
ends, and notes the time; the exit codes are read once the agent has joined them.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import time
from dataclasses import dataclass
from multiprocessing.process import BaseProcess


@dataclass(frozen=True)
class ProcessExit:
    """How one rank process ended: its exit code (negative: killed by that signal; None: unknown) and when."""

    exitcode: int | None
    #: seconds since the epoch (``time.time()``) at which the launcher saw the process end; None if it did not
    time: float | None


class ExitWatch:
    """The rank processes this launch starts (children started after it was made) and when each ended."""

    def __init__(self, nproc: int) -> None:
        self._nproc = nproc
        self._before = set(multiprocessing.active_children())
        self._processes: list[BaseProcess] = []
        self._ended: dict[int, float] = {}

    @property
    def before(self) -> set[BaseProcess]:
        """Child processes that existed before the launch (not rank processes)."""
        return self._before

    def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for a rank process to end, noting the time of every one that did."""
        if len(self._processes) < self._nproc:
            # Only until all are known: active_children() also reaps ended children, which the agent must do.
            known = set(self._processes)
            self._processes += [p for p in multiprocessing.active_children() if p not in self._before | known]
        sentinels = {p.sentinel: p.pid for p in self._processes if p.pid not in self._ended}
        if not sentinels:
            time.sleep(timeout)
            return
        try:
            ready = multiprocessing.connection.wait(list(sentinels), timeout)
        except (OSError, ValueError):  # a sentinel closed under us: its process was joined and closed
            return
        now = time.time()
        for sentinel in ready:
            self._ended.setdefault(sentinels[sentinel], now)  # type: ignore[index]

    def exits(self) -> dict[int, ProcessExit]:
        """pid -> how that rank process ended; read once the elastic agent has finished with them."""
        out = {}
        for process in self._processes:
            assert process.pid is not None  # started processes have a pid
            try:
                code = process.exitcode
            except ValueError:  # closed by the agent: its exit code is gone with it
                code = None
            out[process.pid] = ProcessExit(code, self._ended.get(process.pid))
        return out
