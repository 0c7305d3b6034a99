"""simdist's pytest plugin in a pytest session of its own: the fixture fails a test whose exploration finds a
failing run, with a replay token that replays that run; the marker and the command line set its keywords."""

from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path

import pytest
import tomllib

import simdist

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _only_this_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    """The inner sessions load the plugin by -p only: where simdist is installed, its entry point would load it a
    second time."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")


USER_TESTS = '''
import pytest
import torch
import torch.distributed as dist

import simdist

CLUSTER = simdist.Cluster.switch(4, device="cpu")


def collect():
    """Rank 0 receives from any source and assumes rank order."""
    if dist.get_rank() != 0:
        dist.send(torch.tensor([float(dist.get_rank())]), 0)
        return None
    got = []
    for _ in range(3):
        buf = torch.zeros(1)
        dist.recv(buf)
        got.append(int(buf.item()))
    assert got == sorted(got), f"arrival order {got}"
    return got


def by_rank():
    """The fix: receive from each rank by name."""
    if dist.get_rank() != 0:
        dist.send(torch.tensor([float(dist.get_rank())]), 0)
        return None
    got = []
    for src in (1, 2, 3):
        buf = torch.zeros(1)
        dist.recv(buf, src)
        got.append(int(buf.item()))
    return got


@pytest.mark.simdist_explore(runs=10, strategy="pct", seed=0)
def test_collect(simdist_explore):
    simdist_explore(collect, CLUSTER)


@pytest.mark.simdist_explore(runs=10, strategy="pct", seed=0, shrink=False)
def test_collect_unshrunk(simdist_explore):
    simdist_explore(collect, CLUSTER)


@pytest.mark.simdist_explore(runs=10, strategy="pct", seed=0)
def test_by_rank(simdist_explore):
    ex = simdist_explore(by_rank, CLUSTER, runs=5)
    print(f"RUNS={ex.runs}")
'''


def test_the_fixture_fails_a_test_with_a_replay_token_and_passes_a_correct_one(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_user=USER_TESTS)
    # -rN: no short summary, whose lines would repeat the tokens where pytest does not truncate them (CI=1)
    result = pytester.runpytest_inprocess("-p", "simdist.pytest_plugin", "-s", "-q", "-rN")
    result.assert_outcomes(passed=1, failed=2)
    out = result.stdout.str()
    assert "simdist.explore(collect) found" in out and "first RankError (AssertionError)" in out
    assert "RUNS=5" in out  # the call's keywords win over the marker's
    shrunk, found = [json.loads(line) for line in result.stdout.lines if '"kind": "simdist-replay"' in line]
    assert found["strategy"] == "pct" and found["program"]["name"] == "collect"
    # by default the message shows the first failure shrunk, and its token is the shrunk run's
    assert "shrunk to 1 decision off the unperturbed order" in out and "replay it (the shrunk run) with" in out
    assert shrunk["perturbation"]["ties"] == "choices"
    sys.path.insert(0, str(pytester.path))
    try:
        user = importlib.import_module("test_user")
    finally:
        sys.path.remove(str(pytester.path))
    explored = simdist.explore(user.collect, user.CLUSTER, runs=10, strategy="pct", seed=0)
    failure = next(f for f in explored.failures if f.run == found["run"])
    # shrink=False: the failure as found; its token replays the run that failed, with the same trace
    assert json.loads(failure.replay) == found
    with pytest.raises(simdist.RankError) as err:
        simdist.replay(user.collect, user.CLUSTER, failure.replay)
    assert err.value.trace_hash == failure.trace_hash
    # the shrunk token is simdist.shrink's, and fails the same way
    assert json.loads(simdist.shrink(user.collect, user.CLUSTER, failure).replay) == shrunk
    with pytest.raises(simdist.RankError, match="arrival order"):
        simdist.replay(user.collect, user.CLUSTER, json.dumps(shrunk))


def test_the_command_line_overrides_runs_and_seed(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_user=USER_TESTS)
    result = pytester.runpytest_inprocess(
        "-p",
        "simdist.pytest_plugin",
        "-s",
        "-q",
        "--simdist-runs",
        "3",
        "--simdist-seed",
        "7",
        "-k",
        "by_rank",
    )
    result.assert_outcomes(passed=1)
    assert "RUNS=3" in result.stdout.str()
    marker = re.compile(r"simdist_explore\(\*\*keywords\)")
    assert any(
        marker.search(line)
        for line in pytester.runpytest_inprocess("-p", "simdist.pytest_plugin", "--markers").stdout.lines
    )


def test_the_plugin_is_registered_as_an_entry_point() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["pytest11"] == {"simdist": "simdist.pytest_plugin"}
