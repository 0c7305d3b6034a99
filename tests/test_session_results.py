"""The suite's once-per-session results: computed once whichever worker asks first, failures raised to every reader."""

from __future__ import annotations

from pathlib import Path

import pytest
from session_results import SessionResults


def _counting(calls: list[int], value: object):
    def compute() -> object:
        calls.append(1)
        return value

    return compute


def test_a_result_is_computed_once_for_every_worker_sharing_the_directory(tmp_path: Path) -> None:
    calls: list[int] = []
    first, second = SessionResults(tmp_path), SessionResults(tmp_path)  # two workers of one session
    assert first.get("launch", _counting(calls, {"rank": [1, 2]})) == {"rank": [1, 2]}
    assert second.get("launch", _counting(calls, "never computed")) == {"rank": [1, 2]}
    assert first.get("launch", _counting(calls, "never computed")) == {"rank": [1, 2]}
    assert len(calls) == 1
    assert SessionResults(None).get("launch", _counting(calls, 3)) == 3 and len(calls) == 2


def test_a_failure_is_raised_to_every_reader_without_computing_again(tmp_path: Path) -> None:
    calls: list[int] = []

    def fails() -> None:
        calls.append(1)
        raise ValueError("the launch failed on rank 1")

    for results in (SessionResults(tmp_path), SessionResults(tmp_path), SessionResults(None)):
        for _ in range(2):
            with pytest.raises(ValueError, match="the launch failed on rank 1"):
                results.get("launch", fails)
    assert len(calls) == 2  # once in the shared directory, once in the process without one


def test_an_unpicklable_failure_reaches_the_other_workers_as_its_text(tmp_path: Path) -> None:
    class Local(Exception):  # a local class: pickle cannot find it by name
        pass

    def fails() -> None:
        raise Local("rank 0 hung")

    with pytest.raises(Local):
        SessionResults(tmp_path).get("launch", fails)
    with pytest.raises(RuntimeError, match=r"launch: Local\('rank 0 hung'\) \(not picklable"):
        SessionResults(tmp_path).get("launch", fails)
