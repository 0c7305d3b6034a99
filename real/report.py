"""Turning what the rank processes and the elastic agent left behind into one RealRunError."""

from __future__ import annotations

from collections.abc import Sequence

from real.errors import RealRunError
from real.exits import ProcessExit
from real.failures import Failure, collect, first_failure, user_frames
from real.status import RETURNED, STARTED, StatusDir

_NO_ENTRY_HINT = (
    "No rank process reached real's entry point: the spawned processes failed while starting (their stderr "
    "above shows why). A common cause is a program that calls real.run without an "
    '`if __name__ == "__main__":` guard: each spawned rank process re-imports the main module and runs it '
    "again."
)


_RDZV_HINT = (
    "No rank process started: the nodes never all met. Start one python -m real per node, each with the same "
    "--nnodes and rendezvous endpoint (--rdzv-endpoint, or --master-addr and --master-port), and for the static "
    "rendezvous node ranks 0 to nnodes-1 (node 0 serves the endpoint), or for c10d the same --rdzv-id."
)


def failure_error(
    status: StatusDir,
    nproc: int,
    backend: str | None,
    error: BaseException | None,
    timed_out: bool,
    timeout: float,
    exits: dict[int, ProcessExit] | None = None,
    *,
    ranks: Sequence[int] | None = None,
    place: str | None = None,
) -> RealRunError:
    """The RealRunError describing a run that failed (``error``) or ran past ``timeout``.

    ``exits`` maps the pid of each rank process the launcher saw end to how and when it ended. ``ranks`` are
    this node's ranks as far as known (default ``0..nproc-1``); ``place`` says which node this is of several.
    ``backend`` is None for a torchrun-style script, which chose its own.
    """
    ranks = list(range(nproc)) if ranks is None else list(ranks)
    found = collect(status, ranks, error, timed_out, exits or {})
    first = first_failure(found)
    failures = {rank: f.text for rank, f in found.items()}
    summaries = {rank: f.summary for rank, f in found.items()}

    where = f"{nproc} real process{'es' if nproc != 1 else ''}"
    if backend is not None:
        where += f" (backend {backend})"
    if place is not None:
        where += f" on {place}"
    if timed_out:
        return _timeout_error(status, nproc, ranks, where, timeout, failures, summaries, first)
    if first is None:
        detail = f"{type(error).__name__}: {error}" if error is not None else "no result and no error"
        if "EADDRINUSE" in detail:
            detail += "\nThe rendezvous port is in use: pass another master_port, or None to pick a free one."
        if place is not None and not status.started_ranks():
            return RealRunError(
                f"the rendezvous failed before any rank process started, {where}: {detail}\n{_RDZV_HINT}"
            )
        return RealRunError(
            f"the elastic launcher failed before the rank processes finished on {where}: {detail}"
        )

    lines = [f"rank {first} failed on {where}:", failures[first].rstrip()]
    others = sorted(r for r in failures if r != first)
    if others:
        lines.append(f"other failing ranks (often a consequence of rank {first}'s failure):")
        lines += [f"  rank {r}: {summaries[r]}{_after(found[r], found)}" for r in others]
    if not status.started_ranks():
        lines.append(_NO_ENTRY_HINT)
    return RealRunError("\n".join(lines), failures=failures, first_rank=first)


def _timeout_error(
    status: StatusDir,
    nproc: int,
    ranks: list[int],
    where: str,
    timeout: float,
    failures: dict[int, str],
    summaries: dict[int, str],
    first: int | None,
) -> RealRunError:
    """The RealRunError for a run killed at its timeout, with the stacks of the ranks still running."""
    returned = [r for r in ranks if status.has(r, RETURNED)]
    unstarted = [r for r in ranks if not status.has(r, STARTED)]
    running = [r for r in ranks if r not in returned and r not in unstarted and r not in failures]
    stacks = {r: user_frames(text) for r in running if (text := status.stack(r)) is not None}
    lines = [f"real run timed out after {timeout:g} s on {where}; its processes were killed."]
    if running:
        lines.append(f"still running: ranks {_ranks(running)} (a hang, e.g. mismatched collectives?)")
    if returned:
        lines.append(f"returned: ranks {_ranks(returned)}")
    if unstarted:
        lines.append(f"never reached the rank code: ranks {_ranks(unstarted)}")
    elif len(ranks) < nproc:  # ranks given out by a c10d rendezvous that never completed
        lines.append(f"never reached the rank code: {nproc - len(ranks)} of this node's {nproc} processes")
    if not status.started_ranks() and "rendezvous at" in where:
        lines.append(_RDZV_HINT)
    for rank in sorted(failures):
        lines.append(f"failed: rank {rank}: {summaries[rank]}")
    for rank, text in stacks.items():
        lines += [f"--- Python stacks of rank {rank} at the timeout ---", text]
    return RealRunError("\n".join(lines), failures=failures, first_rank=first, timed_out=True, stacks=stacks)


def _after(failure: Failure, failures: dict[int, Failure]) -> str:
    """`` (after rank 1's process had ended)`` for a failure known to come after others, else nothing."""
    before = [r for r in failure.after if r in failures]
    if not before:
        return ""
    whose = " and ".join(f"rank {r}'s" for r in before)
    return f" (after {whose} process had ended)"


def _ranks(ranks: list[int]) -> str:
    """``[0, 2]`` as ``"0, 2"``."""
    return ", ".join(str(r) for r in ranks)
