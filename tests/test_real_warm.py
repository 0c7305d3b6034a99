"""Rank processes forked from a warm fork server (real.warm): each launch after the first skips importing
torch, and a rank process still sees exactly what a spawned one sees."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import real_fns

import real
from real import RealConfigError
from real.warm import START_METHOD_VARIABLE

REPO = Path(__file__).resolve().parents[1]


def _seen(fn=real_fns.seen_at_start) -> list[dict]:
    return real.run(fn, 2, "gloo").returns


@pytest.mark.real
def test_launches_fork_from_a_warm_server_and_see_what_a_spawned_process_sees(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(START_METHOD_VARIABLE, raising=False)
    monkeypatch.setenv("REAL_WARM_PROBE", "one")
    monkeypatch.setenv("REAL_WARM_GONE", "here")
    first = _seen(real_fns.leave_traces)
    second = _seen()
    parents = {r["ppid"] for r in first + second}
    assert len(parents) == 1 and os.getpid() not in parents  # the one fork server, not this process
    for rank in second:
        assert rank["trace"] is None and rank["left"] is None  # no module state, no environment of launch 1
    assert [(r["probe"], r["gone"]) for r in first + second] == [("one", "here")] * 4
    # a changed environment gets a new server (torch reads some variables when imported); a variable removed from
    # the launcher is gone in its ranks too
    monkeypatch.setenv("REAL_WARM_PROBE", "two")
    monkeypatch.delenv("REAL_WARM_GONE")
    removed = _seen()
    assert [(r["probe"], r["gone"]) for r in removed] == [("two", None)] * 2
    assert {r["ppid"] for r in removed}.isdisjoint(parents)
    # torch, NumPy and random seeded from entropy in every process, as a fresh interpreter seeds them
    everyone = first + second + removed
    for generator in range(3):
        assert len({r["seeds"][generator] for r in everyone}) == len(everyone)
    assert len({tuple(r["rand"].tolist()) for r in everyone}) == len(everyone)
    # otherwise the same as a spawned process, a fresh interpreter started by this one
    monkeypatch.setenv(START_METHOD_VARIABLE, "spawn")
    spawned = _seen()
    assert {r["ppid"] for r in spawned} == {os.getpid()}
    for mine, theirs in zip(removed, spawned):
        assert {k: v for k, v in mine.items() if k not in ("ppid", "rand", "seeds")} == {
            k: v for k, v in theirs.items() if k not in ("ppid", "rand", "seeds")
        }


@pytest.mark.real
def test_the_server_stays_while_pytest_names_another_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """pytest sets PYTEST_CURRENT_TEST before each test, and nothing the server imports reads it: launches in
    one test after another fork from one server, and each launch's ranks see the name at its start."""
    monkeypatch.delenv(START_METHOD_VARIABLE, raising=False)
    seen = {}
    for name in ("tests/a.py::test_one (call)", "tests/b.py::test_two (call)"):
        monkeypatch.setenv("PYTEST_CURRENT_TEST", name)
        seen[name] = _seen()
    assert len({r["ppid"] for ranks in seen.values() for r in ranks}) == 1
    assert {name: [r["test"] for r in ranks] for name, ranks in seen.items()} == {n: [n, n] for n in seen}


@pytest.mark.real
def test_the_ranks_write_to_the_launchers_current_stdout_and_stderr(tmp_path: Path) -> None:
    """The server started while one pair of files held descriptors 1 and 2; a later launch's ranks write to
    the pair that holds them at its start, as a spawned process would."""

    def launch(name: str, word: str) -> None:
        saved = [os.dup(1), os.dup(2)]
        out, err = open(tmp_path / f"{name}.out", "w"), open(tmp_path / f"{name}.err", "w")  # noqa: SIM115
        try:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            real.run(real_fns.say_hello, 2, "gloo", args=(word,))
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            out.close()
            err.close()

    launch("a", "first")
    launch("b", "second")
    for name, word, other in (("a", "first", "second"), ("b", "second", "first")):
        out, err = (tmp_path / f"{name}.out").read_text(), (tmp_path / f"{name}.err").read_text()
        for rank in (0, 1):
            assert f"{word} from rank {rank} on stdout" in out and f"{word} from rank {rank} on stderr" in err
        assert other not in out + err


def test_an_unknown_start_method_is_refused_before_launching(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(START_METHOD_VARIABLE, "fork")
    with pytest.raises(RealConfigError, match=f"{START_METHOD_VARIABLE}='fork'.*forkserver, spawn"):
        real.run(real_fns.seen_at_start, 2, "gloo")


@pytest.mark.real
def test_a_fork_server_started_by_someone_else_is_left_alone(tmp_path: Path) -> None:
    """Its modules and environment are unknown: the ranks are spawned, and that server stays as it was."""
    script = tmp_path / "foreign.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import multiprocessing.forkserver, os, sys
            sys.path[:0] = [{str(REPO)!r}, {str(REPO / "tests")!r}]
            import real, real_fns

            if __name__ == "__main__":
                multiprocessing.forkserver.ensure_running()
                theirs = multiprocessing.forkserver._forkserver._forkserver_pid
                ranks = real.run(real_fns.seen_at_start, 2, "gloo").returns
                assert {{r["ppid"] for r in ranks}} == {{os.getpid()}}, ranks
                assert multiprocessing.forkserver._forkserver._forkserver_pid == theirs
                print("spawned")
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if k != START_METHOD_VARIABLE}
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0 and done.stdout.strip() == "spawned", done.stderr[-3000:]
