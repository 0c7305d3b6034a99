"""Which rank of a real run failed first, from what the rank processes, faulthandler and the launcher saw.

These check the pieces without starting a launch: tests/hostile/test_hostile_real.py runs real processes
that die by ``os._exit``, a segfault and SIGKILL.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from real import rank_process
from real.exits import ExitWatch, ProcessExit
from real.failures import collect, first_failure
from real.liveness import ended
from real.report import failure_error
from real.status import CRASH, RETURNED, StatusDir

PIDS = {0: 1000, 1: 1001, 2: 1002}


def _status(tmp: Path, nproc: int = 2) -> StatusDir:
    status = StatusDir(tmp)
    for rank in range(nproc):
        status.mark_started(rank, PIDS[rank])
    return status


def _record(status: StatusDir, rank: int, message: str, gone: list[int] | None = None) -> None:
    try:
        raise RuntimeError(message)
    except RuntimeError as exc:
        status.record_error(rank, exc, gone=gone)


def test_a_live_process_has_not_ended() -> None:
    assert not ended(os.getpid())


def test_a_zombie_and_a_reaped_process_have_ended() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    # Wait for the exit without reaping it: the child stays a zombie, as a rank's process is until the
    # launcher's agent joins it.
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
    assert ended(child.pid)
    child.wait()
    assert ended(child.pid)


def test_the_watch_sees_when_a_child_process_ends_and_its_exit_code() -> None:
    watch = ExitWatch(1)
    child = multiprocessing.get_context("spawn").Process(target=os._exit, args=(5,))
    before = time.time()
    child.start()
    deadline = time.monotonic() + 60
    while child.pid not in {pid for pid, e in watch.exits().items() if e.time is not None}:
        assert time.monotonic() < deadline, "the child's end was not seen"
        watch.wait(0.05)
    child.join()
    ended_at = watch.exits()[child.pid]
    assert ended_at.exitcode == 5 and before <= ended_at.time <= time.time()  # type: ignore[operator]


def test_the_started_mark_carries_the_pid(tmp_path: Path) -> None:
    status = _status(tmp_path)
    assert [status.pid(0), status.pid(1), status.pid(2)] == [1000, 1001, None]


@given(exit_time=st.floats(0, 1e3), error_time=st.floats(0, 1e3))
def test_a_rank_whose_process_ended_before_a_peer_failed_is_first_whatever_the_clocks(
    tmp_path_factory: object, exit_time: float, error_time: float
) -> None:
    # Rank 1 ended by os._exit(7); rank 0 caught a gloo error once rank 1's process was gone. The launcher
    # saw rank 1 end at exit_time, rank 0 stamped its error at error_time: either may be the smaller.
    status = _status(tmp_path_factory.mktemp("status"))  # type: ignore[attr-defined]
    _record(status, 0, "Connection closed by peer", gone=[1])
    failures = collect(status, [0, 1], None, False, {PIDS[1]: ProcessExit(7, exit_time)})
    failures[0] = dataclasses.replace(failures[0], time=error_time)
    assert first_failure(failures) == 1
    assert failures[1].summary.startswith("process exited with code 7 without a Python exception")


def test_the_report_names_the_rank_that_ended_and_marks_the_consequence(tmp_path: Path) -> None:
    status = _status(tmp_path)
    _record(status, 0, "Connection closed by peer", gone=[1])
    error = failure_error(status, 2, "gloo", None, False, 60, {PIDS[1]: ProcessExit(7, 1e18)})
    assert error.first_rank == 1 and sorted(error.failures) == [0, 1]
    text = str(error)
    assert text.startswith("rank 1 failed on 2 real processes (backend gloo):\nprocess exited with code 7")
    assert "  rank 0: RuntimeError: Connection closed by peer (after rank 1's process had ended)" in text


def test_the_launchers_sigterm_after_a_failure_is_not_a_failure(tmp_path: Path) -> None:
    status = _status(tmp_path, 3)
    _record(status, 2, "bad batch")  # rank 2 fails on its own; the launcher then stops ranks 0 and 1
    when = status.error(2)["time"]  # type: ignore[index]
    exits = {
        PIDS[0]: ProcessExit(-signal.SIGTERM, when + 0.1),
        PIDS[1]: ProcessExit(-signal.SIGKILL, when + 5),
    }
    failures = collect(status, [0, 1, 2], None, False, exits)
    assert sorted(failures) == [2] and first_failure(failures) == 2


def test_a_sigkill_before_any_failure_is_the_failure(tmp_path: Path) -> None:
    # The OOM killer's SIGKILL on rank 1; rank 0's error came later but did not see rank 1 gone (a clock
    # comparison is all there is): rank 1 is still first, and its kill is not taken for the launcher's.
    status = _status(tmp_path)
    _record(status, 0, "Connection reset by peer")
    when = status.error(0)["time"]  # type: ignore[index]
    failures = collect(status, [0, 1], None, False, {PIDS[1]: ProcessExit(-signal.SIGKILL, when - 0.5)})
    assert failures[1].summary == "killed by signal SIGKILL (exit code -9)"
    assert first_failure(failures) == 1


def test_kills_at_a_timeout_are_not_failures_but_an_earlier_exit_is(tmp_path: Path) -> None:
    status = _status(tmp_path, 3)
    exits = {PIDS[0]: ProcessExit(-signal.SIGKILL, 50.0), PIDS[1]: ProcessExit(3, 10.0)}
    error = failure_error(status, 3, "gloo", None, True, 40, exits)
    assert error.timed_out and sorted(error.failures) == [1] and error.first_rank == 1
    assert "failed: rank 1: process exited with code 3" in str(error)


def test_a_returned_rank_is_no_failure_and_a_clean_exit_is_none(tmp_path: Path) -> None:
    status = _status(tmp_path)
    status.mark(0, RETURNED)
    failures = collect(
        status, [0, 1], None, False, {PIDS[0]: ProcessExit(1, 1.0), PIDS[1]: ProcessExit(0, 2.0)}
    )
    assert failures == {}


def test_a_fatal_signal_shows_the_stacks_faulthandler_wrote_without_the_launchers_frames(
    tmp_path: Path,
) -> None:
    status = _status(tmp_path)
    status.path(1, CRASH).write_text(
        "Fatal Python error: Segmentation fault\n\nCurrent thread 0x1 (most recent call first):\n"
        '  File "/usr/lib/python3/ctypes/__init__.py", line 519 in string_at\n'
        '  File "/home/u/train.py", line 14 in step\n'
        f'  File "{rank_process.__file__}", line 70 in _run\n'
    )
    failures = collect(status, [0, 1], None, False, {PIDS[1]: ProcessExit(-signal.SIGSEGV, None)})
    assert failures[1].summary == "killed by signal SIGSEGV (exit code -11)"
    assert failures[1].text.endswith('  File "/home/u/train.py", line 14 in step')
    assert failures[1].time is not None  # the dump's own time orders it


def test_without_an_exit_code_a_crash_dump_still_names_the_signal(tmp_path: Path) -> None:
    status = _status(tmp_path)
    status.path(1, CRASH).write_text("Fatal Python error: Floating point exception\n\nCurrent thread 0x1:\n")
    assert (
        collect(status, [0, 1], None, False, {})[1].summary == "Fatal Python error: Floating point exception"
    )
