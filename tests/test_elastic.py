"""torchrun's restarts in simulated jobs: run_script(..., max_restarts=, nnodes=) and simdist run's flags."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import simdist
from simdist import cli
from simdist.faults import Crash, LinkDown, NodeLoss, Straggler

PROGRAM = """
import os
import torch
import torch.distributed as dist
import simdist


def main():
    t = torch.ones(4)
    for _ in range(3):
        simdist.charge(1e-3)
        dist.all_reduce(t)
    return (int(os.environ["TORCHELASTIC_RESTART_COUNT"]), dist.get_world_size(), t[0].item())
"""


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "job.py"
    path.write_text(PROGRAM)
    return path


def nodes() -> simdist.Cluster:
    return simdist.Cluster.two_level(2, 2, device="cpu")


def job(script: Path, faults: list, **torchrun) -> simdist.RunResult:
    return simdist.run_script(script, nodes(), entry="main", faults=faults, prefix_output=False, **torchrun)


def test_a_crash_restarts_every_rank_with_the_restart_count_in_their_environment(script: Path) -> None:
    res = job(script, [Crash(rank=1, at=1.5e-3)], max_restarts=2)
    assert res.restarts == 1 and len(res.failures) == 1 and "rank 1 crashed" in res.failures[0]
    assert res.returns == [(1, 4, 64.0)] * 4  # the second attempt ran the whole program on the same world


def test_a_fault_that_happened_does_not_happen_again(script: Path) -> None:
    # the crash at the 2nd collective fires once; a second crash later on the job's clock fires in the second attempt
    res = job(script, [Crash(rank=0, collective=2), Crash(rank=2, at=2.5e-3)], max_restarts=2)
    assert res.restarts == 2
    assert "rank 0 crashed" in res.failures[0] and "rank 2 crashed" in res.failures[1]


def test_faults_are_on_the_jobs_clock(script: Path) -> None:
    # attempt 0 fails at 1.5 ms: a straggler window starting at 1.5 ms covers all of attempt 1
    plain = job(script, [Crash(rank=1, at=1.5e-3)], max_restarts=1)
    slow = job(
        script,
        [Crash(rank=1, at=1.5e-3), Straggler(rank=0, slowdown=2.0, window=(1.5e-3, 1.0))],
        max_restarts=1,
    )
    assert slow.sim_time == pytest.approx(plain.sim_time + 3e-3, rel=1e-9)


def test_a_lost_node_shrinks_the_world_within_nnodes(script: Path) -> None:
    res = job(script, [NodeLoss(node=0, at=1.5e-3), LinkDown(link=0, at=0.0)], max_restarts=1, nnodes="1:2")
    assert res.world_size == 2 and res.cluster.ranks_per_node == 2
    assert res.returns == [(1, 2, 8.0)] * 2


def test_a_lost_node_below_nnodes_min_ends_the_job(script: Path) -> None:
    with pytest.raises(
        simdist.SimdistError, match=r"cannot re-form: 1 node\(s\) survive and nnodes asks for at least 2"
    ):
        job(script, [NodeLoss(node=1, at=1.5e-3)], max_restarts=3, nnodes="2:2")


def test_without_restarts_left_the_last_failure_is_raised(script: Path) -> None:
    with pytest.raises(simdist.RankCrashError, match="rank 3 crashed"):
        job(script, [Crash(rank=3, collective=1)], max_restarts=0, nnodes="2")


@pytest.mark.parametrize(
    ("torchrun", "message"),
    [
        ({"max_restarts": -1}, r"max_restarts must be a whole number >= 0"),
        ({"max_restarts": 1, "nnodes": "x"}, r"nnodes must be N or MIN:MAX"),
        ({"max_restarts": 1, "nnodes": "3:1"}, r"expected 1 <= MIN <= MAX"),
        ({"max_restarts": 1, "nnodes": "3:4"}, r"the cluster has 2 node\(s\)"),
    ],
)
def test_bad_torchrun_options_are_refused(script: Path, torchrun: dict, message: str) -> None:
    with pytest.raises(simdist.RunArgumentError, match=message):
        job(script, [], **torchrun)


def test_simdist_run_takes_faults_and_restarts_on_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "job.py"
    path.write_text(PROGRAM)
    cmd = [
        sys.executable,
        "-m",
        "simdist.cli",
        "run",
        str(path),
        "--entry",
        "main",
        "--cluster",
        "switch",
        "--world-size",
        "4",
        "--fault",
        '{"type": "Crash", "rank": 1, "collective": 2}',
        "--max-restarts",
        "1",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert "attempt 0 failed and the job restarted (--max-restarts): rank 1 crashed" in out.stdout
    # a fault the parser refuses: argparse's usage error, exit status 2 (in this process: the launch above
    # showed the command's own)
    capsys.readouterr()
    with pytest.raises(SystemExit) as usage:
        cli.main([*cmd[3:-4], "--fault", '{"type": "Crash", "rank": 1}'])
    assert usage.value.code == 2 and "give exactly one of at=" in capsys.readouterr().err
