"""Turning what the rank processes and the elastic agent left behind into one RealRunError."""

from __future__ import annotations

from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from real import rank_process
from real.errors import RealRunError
from real.status import RETURNED, STARTED, StatusDir

_NO_ENTRY_HINT = (
    "No rank process reached real's entry point: the spawned processes failed while starting (their stderr "
    "above shows why). A common cause is a program that calls real.run without an "
    '`if __name__ == "__main__":` guard: each spawned rank process re-imports the main module and runs it '
    "again."
)


def failure_error(
    status: StatusDir,
    nproc: int,
    backend: str,
    error: BaseException | None,
    timed_out: bool,
    timeout: float,
) -> RealRunError:
    """The RealRunError describing a run that failed (``error``) or ran past ``timeout``."""
    failures, summaries, times = _recorded_failures(status, nproc)
    # After a timeout the agent reports the processes we killed; those are not failures of the rank code.
    if isinstance(error, ChildFailedError) and not timed_out:
        for rank, failure in error.failures.items():
            if rank not in failures:
                failures[rank] = _describe_process_failure(failure)
                summaries[rank] = failures[rank].splitlines()[0]
    if times:
        first: int | None = min(times, key=lambda r: times[r])
    elif isinstance(error, ChildFailedError) and error.failures and not timed_out:
        first = error.get_first_failure()[0]
    else:
        first = min(failures) if failures else None

    where = f"{nproc} real process{'es' if nproc != 1 else ''} (backend {backend})"
    if timed_out:
        return _timeout_error(status, nproc, where, timeout, failures, summaries, first)
    if first is None:
        detail = f"{type(error).__name__}: {error}" if error is not None else "no result and no error"
        if "EADDRINUSE" in detail:
            detail += "\nThe rendezvous port is in use: pass another master_port, or None to pick a free one."
        return RealRunError(
            f"the elastic launcher failed before the rank processes finished on {where}: {detail}"
        )

    lines = [f"rank {first} failed on {where}:", failures[first].rstrip()]
    others = sorted(r for r in failures if r != first)
    if others:
        lines.append(f"other failing ranks (often a consequence of rank {first}'s failure):")
        lines += [f"  rank {r}: {summaries[r]}" for r in others]
    if not any(status.has(r, STARTED) for r in range(nproc)):
        lines.append(_NO_ENTRY_HINT)
    return RealRunError("\n".join(lines), failures=failures, first_rank=first)


def _timeout_error(
    status: StatusDir,
    nproc: int,
    where: str,
    timeout: float,
    failures: dict[int, str],
    summaries: dict[int, str],
    first: int | None,
) -> RealRunError:
    """The RealRunError for a run killed at its timeout, with the stacks of the ranks still running."""
    returned = [r for r in range(nproc) if status.has(r, RETURNED)]
    unstarted = [r for r in range(nproc) if not status.has(r, STARTED)]
    running = [r for r in range(nproc) if r not in returned and r not in unstarted and r not in failures]
    stacks = {r: _user_frames(text) for r in running if (text := status.stack(r)) is not None}
    lines = [f"real run timed out after {timeout:g} s on {where}; its processes were killed."]
    if running:
        lines.append(f"still running: ranks {_ranks(running)} (a hang, e.g. mismatched collectives?)")
    if returned:
        lines.append(f"returned: ranks {_ranks(returned)}")
    if unstarted:
        lines.append(f"never reached the rank code: ranks {_ranks(unstarted)}")
    for rank in sorted(failures):
        lines.append(f"failed: rank {rank}: {summaries[rank]}")
    for rank, text in stacks.items():
        lines += [f"--- Python stacks of rank {rank} at the timeout ---", text]
    return RealRunError("\n".join(lines), failures=failures, first_rank=first, timed_out=True, stacks=stacks)


def _recorded_failures(
    status: StatusDir, nproc: int
) -> tuple[dict[int, str], dict[int, str], dict[int, float]]:
    """Tracebacks, one-line summaries and failure times the rank processes recorded themselves."""
    failures: dict[int, str] = {}
    summaries: dict[int, str] = {}
    times: dict[int, float] = {}
    for rank in range(nproc):
        record = status.error(rank)
        if record is not None:
            failures[rank] = record["traceback"]
            summaries[rank] = record["summary"].splitlines()[0]
            times[rank] = record["time"]
    return failures, summaries, times


def _describe_process_failure(failure: ProcessFailure) -> str:
    """A failure the rank process could not record itself: a signal, os._exit, a crash while starting."""
    if failure.exitcode < 0:
        text = f"killed by signal {failure.signal_name()} (exit code {failure.exitcode})"
    else:
        text = (
            f"process exited with code {failure.exitcode} without a Python exception in the rank code "
            f"(its stderr above may show why)"
        )
    message: Any = failure.message
    if isinstance(message, dict):
        message = message.get("extraInfo", {}).get("py_callstack") or message.get("message")
    # Elastic fills in placeholders when it has no error file; those add nothing to the text above.
    if message and "To enable traceback" not in str(message) and not str(message).startswith("Signal"):
        text += f"\n{message}"
    return text


def _user_frames(stack: str) -> str:
    """A faulthandler dump cut where the launcher's own frames begin (most recent call comes first)."""
    kept = []
    for line in stack.splitlines():
        if rank_process.__file__ in line:
            break
        kept.append(line)
    return "\n".join(kept)


def _ranks(ranks: list[int]) -> str:
    """``[0, 2]`` as ``"0, 2"``."""
    return ", ".join(str(r) for r in ranks)
