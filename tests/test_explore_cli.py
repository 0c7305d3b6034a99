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


def test_replay_runs_a_failure_again_from_the_tokens_file(
    script: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tokens = tmp_path / "tokens.json"
    args = ["explore", str(script), "--world-size", "3", "--runs", "4", "--workers", "1", "--no-shrink"]
    assert main([*args, "--tokens", str(tokens), "--", "--strict"]) == 1
    found = json.loads(tokens.read_text())
    capsys.readouterr()
    assert main(["replay", str(tokens), "--failure", str(len(found) - 1)]) == 1
    captured = capsys.readouterr()
    assert f"the run failed again; trace hash {found[-1]['trace_hash'][:16]} (the same as explored)" in captured.err
    assert "arrival order" in captured.err
    one = tmp_path / "one.json"
    one.write_text(json.dumps(found[0]["replay"]))  # a token by itself (no recorded trace hash to compare)
    assert main(["replay", str(one)]) == 1
    assert "the run failed again; trace hash" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("content", "argv", "message"),
    [
        ("[]", [], "lists no failures"),
        ('[{"run": 0}]', [], "failure 0 holds no replay token"),
        ('[{"run": 0, "replay": {}}]', ["--failure", "1"], "lists 1 failures (--failure 0 to 0); got --failure 1"),
        ("{nope", [], "is not JSON"),
        ('{"kind": "other"}', [], "not a simdist replay token"),
        ('{"kind": "other"}', ["--failure", "2"], "holds one token, not a list of failures"),
    ],
)
def test_replay_refuses_what_is_not_a_token_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, argv: list[str], message: str
) -> None:
    path = tmp_path / "t.json"
    path.write_text(content)
    assert main(["replay", str(path), *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_fault_on_the_command_line_is_in_every_run_and_its_token(
    script: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tokens = tmp_path / "tokens.json"
    crash = '{"type": "Crash", "rank": 1, "at": 0}'
    args = ["explore", str(script), "--world-size", "3", "--runs", "2", "--workers", "1", "--no-shrink"]
    assert main([*args, "--fault", crash, "--tokens", str(tokens)]) == 1
    assert "2 runs (random), " in capsys.readouterr().out
    found = json.loads(tokens.read_text())
    assert len(found) == 2 and all("rank 1" in f["error"] for f in found)
    assert main(["replay", str(tokens)]) == 1
    assert "rank 1" in capsys.readouterr().err


LOUD = """\
import torch.distributed as dist

dist.init_process_group("gloo")
print(f"hello from rank {dist.get_rank()}")
with open("written.txt", "w") as f:
    f.write("a run was here")
dist.barrier()
dist.destroy_process_group()
"""


def test_quiet_hides_the_ranks_output_and_files_the_runs_write_are_warned_of(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "loud.py"
    path.write_text(LOUD)
    monkeypatch.chdir(tmp_path)
    args = ["explore", str(path), "--world-size", "2", "--runs", "2", "--workers", "1"]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "hello from rank 1" in captured.out
    assert "the runs wrote written.txt in the working directory" in captured.err
    assert main([*args, "--quiet"]) == 0
    captured = capsys.readouterr()
    assert "hello from rank" not in captured.out and "2 runs (random)" in captured.out
    assert "written.txt" in captured.err  # written again: its modification time moved
