"""Which ranks of a real run failed, how, when, and which failed first.

Four witnesses, each filling in what the ones before it could not: the error a rank process recorded for a
Python exception (with the time and the peers already gone when it was caught), the stacks faulthandler wrote
for a fatal signal, the exit code and time the launcher saw when a process ended (``os._exit``, a signal with
no dump, the OOM killer), and the one failure torch's elastic agent reports. The first failure is that of a
rank no other failure came after: a rank that caught its error once a failed peer's process had ended is a
consequence, whatever the clocks say (see `real.liveness`); among the rest the earliest time wins, as in
torchrun's error files.
"""

from __future__ import annotations

import math
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from real import rank_process
from real.exits import ProcessExit
from real.status import RETURNED, StatusDir

# How the launcher itself ends rank processes: elastic's agent sends SIGTERM (then SIGKILL) to the ranks
# still running once one has failed, and a timeout sends SIGKILL. Such an exit is no failure of the rank code.
_LAUNCHER_SIGNALS = frozenset({-signal.SIGTERM, -signal.SIGKILL})


@dataclass(frozen=True)
class Failure:
    """One rank's failure: its full description, a one-line summary, when (seconds since the epoch, None if
    unknown) and the peers whose processes had ended before it (so failed first)."""

    text: str
    summary: str
    time: float | None = None
    after: tuple[int, ...] = ()


def collect(
    status: StatusDir,
    ranks: Sequence[int],
    error: BaseException | None,
    timed_out: bool,
    exits: dict[int, ProcessExit],
) -> dict[int, Failure]:
    """rank -> how it failed, from every witness, for this node's ``ranks``; the launcher's own kills are left out."""
    failures: dict[int, Failure] = {}
    by_rank = {rank: exits[pid] for rank in ranks if (pid := status.pid(rank)) in exits}
    for rank in ranks:
        record = status.error(rank)
        if record is not None:
            summary = record["summary"].splitlines()[0]
            failures[rank] = Failure(
                record["traceback"], summary, record["time"], tuple(record.get("gone", ()))
            )
        elif (crash := status.crash(rank)) is not None:
            exitcode = by_rank[rank].exitcode if rank in by_rank else None
            failures[rank] = _crash_failure(crash, exitcode)
    _add_abrupt_exits(failures, by_rank, status, timed_out)
    # After a timeout the agent reports the processes we killed; those are not failures of the rank code.
    if isinstance(error, ChildFailedError) and not timed_out:
        for rank, failure in error.failures.items():
            if rank not in failures:
                text = _describe_process_failure(failure)
                failures[rank] = Failure(text, text.splitlines()[0])
    return failures


def first_failure(failures: dict[int, Failure]) -> int | None:
    """The rank that failed first: no other failure came before it, and it is the earliest such one."""
    consequences = {r for r, f in failures.items() if any(p in failures and p != r for p in f.after)}
    roots = [r for r in failures if r not in consequences] or list(failures)
    if not roots:
        return None
    return min(roots, key=lambda r: (_time(failures[r]), r))


def _time(failure: Failure) -> float:
    """The failure's time for ordering; unknown times sort last."""
    return math.inf if failure.time is None else failure.time


def _add_abrupt_exits(
    failures: dict[int, Failure], exits: dict[int, ProcessExit], status: StatusDir, timed_out: bool
) -> None:
    """Add the ranks whose processes ended with a non-zero code and left no record of why."""
    abrupt = {
        rank: Failure(_describe_exit(ended.exitcode), "", ended.time)  # type: ignore[arg-type]
        for rank, ended in sorted(exits.items())
        if rank not in failures and ended.exitcode not in (0, None) and not status.has(rank, RETURNED)
    }
    others = {**failures, **abrupt}
    for rank, failure in abrupt.items():
        if exits[rank].exitcode in _LAUNCHER_SIGNALS and (timed_out or _killed_after(rank, others)):
            continue
        failures[rank] = Failure(failure.text, failure.text.splitlines()[0], failure.time)


def _killed_after(rank: int, failures: dict[int, Failure]) -> bool:
    """Whether ``rank``'s process, killed by SIGTERM or SIGKILL, ended after a failure it did not cause.

    The launcher kills only after a failure; a kill before any (the OOM killer, a user's ``kill``) is the
    failure itself. Failures that came after this rank's end (``after`` names it) are its consequences.
    """
    end = failures[rank].time
    return end is None or any(
        f.time is not None and f.time < end and rank not in f.after for r, f in failures.items() if r != rank
    )


def _crash_failure(crash: tuple[str, float], exitcode: int | None) -> Failure:
    """A rank that died of a fatal signal, with the Python stacks faulthandler wrote as it died."""
    dump, when = crash
    head = _describe_exit(exitcode) if exitcode is not None and exitcode < 0 else dump.splitlines()[0]
    return Failure(f"{head}\n{user_frames(dump)}", head, when)


def _describe_exit(exitcode: int) -> str:
    """An exit code as a failure: negative codes are signals, as multiprocessing reports them."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"killed by signal {name} (exit code {exitcode})"
    return (
        f"process exited with code {exitcode} without a Python exception in the rank code "
        f"(os._exit, or a crash its stderr above may explain)"
    )


def _describe_process_failure(failure: ProcessFailure) -> str:
    """A failure the rank process could not record itself: a signal, os._exit, a crash while starting."""
    text = _describe_exit(failure.exitcode)
    message: Any = failure.message
    if isinstance(message, dict):
        message = message.get("extraInfo", {}).get("py_callstack") or message.get("message")
    # Elastic fills in placeholders when it has no error file; those add nothing to the text above.
    if message and "To enable traceback" not in str(message) and not str(message).startswith("Signal"):
        text += f"\n{message}"
    return text


def user_frames(stack: str) -> str:
    """A faulthandler dump cut where the launcher's own frames begin (most recent call comes first)."""
    kept = []
    for line in stack.splitlines():
        if rank_process.__file__ in line:
            break
        kept.append(line)
    return "\n".join(kept)
