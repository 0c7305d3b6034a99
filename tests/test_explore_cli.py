"""``simdist explore``: a script explored as ``simdist run`` runs it, its failures' tokens written and replayable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import simdist
from simdist.cli import main
from simdist.explore.program import Program

SCRIPT = """\
import sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() != 0:
    dist.send(torch.tensor([float(dist.get_rank())]), 0)
else:
    got = []
    for _ in range(dist.get_world_size() - 1):
        buf = torch.zeros(1)
        dist.recv(buf)
        got.append(int(buf.item()))
    if sys.argv[1:] == ["--strict"]:
        assert got == sorted(got), f"arrival order {got}"
dist.destroy_process_group()
"""


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "collect.py"
    path.write_text(SCRIPT)
    return path


def test_explore_reports_failures_and_writes_replayable_tokens(
    script: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tokens = tmp_path / "tokens.json"
    status = main(["explore", str(script), "--world-size", "3", "--runs", "8", "--strategy", "pct", "--workers", "1",
                   "--tokens", str(tokens), "--", "--strict"])  # fmt: skip
    out = capsys.readouterr().out
    assert status == 1
    assert "8 runs (pct)" in out and "RankError (AssertionError)" in out
    # the first failure of the kind, shrunk: gloo-like progress fails without any reordering
    assert "  shrunk to 0 decisions off the unperturbed order" in out
    assert "the unperturbed run itself fails so: no reordering is needed" in out
    found = json.loads(tokens.read_text())
    assert found and all(f["kind"] == "RankError (AssertionError)" for f in found)
    program = Program(script=str(script), argv=("--strict",))
    cluster = simdist.Cluster.load("switch", 3)
    with pytest.raises(simdist.RankError, match="arrival order"):
        simdist.replay(program, cluster, found[0]["replay"])


def test_no_shrink_leaves_the_failures_as_found(script: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["explore", str(script), "--world-size", "3", "--runs", "2", "--workers", "1", "--no-shrink"]
    assert main([*args, "--", "--strict"]) == 1
    assert "shrunk to" not in capsys.readouterr().out


def test_explore_of_a_script_without_failures_exits_0(
    script: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["explore", str(script), "--world-size", "3", "--runs", "4", "--workers", "1"]) == 0
    assert "4 runs (random)" in capsys.readouterr().out


def test_explore_refuses_a_missing_script_before_any_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["explore", str(tmp_path / "nope.py"), "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert "nope.py" in err and "not found" in err
