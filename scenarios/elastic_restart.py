"""Elastic training under a crash: torchrun's restarts resume from the last checkpoint and end where one process does.

A small MLP (8 -> 16 -> 1, tanh, float64) trains for 8 steps with torch's DistributedDataParallel and SGD with
momentum on a two-node cluster (2 ranks per node). Every step's global batch of 16 samples is fixed by the
step's number and split evenly over the world; rank 0 saves a checkpoint (step, model, optimizer) every 2
steps, and every rank resumes from it when it starts. The job runs as torchrun would run it
(``simdist.run_script(..., entry="train", max_restarts=..., nnodes=...)``):

(1) rank 1 crashes at 5.5 ms (during step 6) under ``--max-restarts 1``: the agent stops every rank and starts
    them again (``TORCHELASTIC_RESTART_COUNT=1``); they resume from step 4's checkpoint;
(2) node 1 is lost at 5.5 ms under ``--nnodes 1:2 --max-restarts 1``: the surviving node re-forms a world of 2
    ranks, which resumes from the same checkpoint with each rank taking 8 of the 16 samples;
(3) the same crash without restarts: the job fails, naming the dead rank.

The oracle is one process training the same model on the same 16 samples per step. Each completed job must end
with its weights (the sums differ only in their order: differences are float64 round-off).

Writes its HTML report (a table of the jobs) and elastic_restart.json to the output directory (reports/ by
default).

Usage: python scenarios/elastic_restart.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from verdicts import difference, finish

import simdist
import simdist.report
from simdist.faults import Crash, NodeLoss

STEPS, EVERY, BATCH, LR = 8, 2, 16, 0.05
#: simulated seconds of compute each rank spends on a step
STEP_TIME = 1e-3
REPORTS = Path(__file__).resolve().parent.parent / "reports"


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of optimizer step ``step`` (from 0): the same whatever the world."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, 8, generator=g, dtype=torch.float64)
    return x, x[:, :1].sin() + 0.1 * x[:, 1:2]


def train() -> dict:
    """One rank's training loop: resume from the checkpoint if there is one, save one every EVERY steps."""
    path = Path(sys.argv[1]) / "checkpoint.pt"
    rank, world = dist.get_rank(), dist.get_world_size()
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    start = 0
    if path.exists():
        saved = torch.load(path)
        net.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        start = saved["step"]
    ddp = DistributedDataParallel(net)
    share = BATCH // world
    for step in range(start, STEPS):
        x, y = batch(step)
        x, y = x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]
        simdist.charge(STEP_TIME)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % EVERY == 0:
            if rank == 0:
                torch.save(
                    {"step": step + 1, "model": net.state_dict(), "opt": opt.state_dict()}, f"{path}.tmp"
                )
                os.replace(f"{path}.tmp", path)
            dist.barrier()
    return {
        "restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
        "resumed_from": start,
        "world": world,
        "weights": [p.detach().clone() for p in net.parameters()],
    }


def reference() -> list[torch.Tensor]:
    """One process, the whole batch of every step."""
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    for step in range(STEPS):
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


def job(faults: list, **torchrun: object) -> simdist.RunResult:
    """The job as torchrun runs it, with a fresh checkpoint directory."""
    cluster = simdist.Cluster.two_level(2, 2, device="cpu")
    with tempfile.TemporaryDirectory() as directory:
        return simdist.run_script(
            __file__, cluster, entry="train", argv=[directory], faults=faults, prefix_output=False, **torchrun
        )


def largest_difference(res: simdist.RunResult, ref: list[torch.Tensor]) -> float:
    return max(float((a - b).abs().max()) for out in res.returns for a, b in zip(out["weights"], ref))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, default=REPORTS, help="directory for the HTML report and elastic_restart.json"
    )
    args = parser.parse_args()
    ref = reference()
    verdicts = []
    summary = {}

    plain = job([])
    print(
        f"no fault: {STEPS} steps on {plain.world_size} ranks in {plain.sim_time * 1e3:.4f} ms of simulated time"
    )
    diff = largest_difference(plain, ref)
    verdicts.append(
        ("the job without faults ends as one process does", diff < 1e-12, f"max |diff| {difference(diff)}")
    )

    crash = job([Crash(rank=1, at=5.5e-3)], max_restarts=1)
    first = crash.failures[0].splitlines()[0] if crash.failures else "(no failure)"
    out = crash.returns[0]
    print(f"\n(1) Crash(rank=1, at=5.5 ms), --max-restarts 1: {crash.restarts} restart")
    print(f"    attempt 0 failed: {first}")
    print(
        f"    attempt {out['restart']} resumed from step {out['resumed_from']}'s checkpoint on {out['world']} ranks "
        f"and ran {crash.sim_time * 1e3:.4f} ms"
    )
    diff = largest_difference(crash, ref)
    verdicts.append(
        (
            "a crash restarts the job once",
            crash.restarts == 1 and out["restart"] == 1,
            f"{crash.restarts} restart",
        )
    )
    verdicts.append(
        (
            "the restart resumes from the last checkpoint",
            out["resumed_from"] == 4,
            f"step {out['resumed_from']}",
        )
    )
    verdicts.append(
        ("after the crash the job ends as one process does", diff < 1e-12, f"max |diff| {difference(diff)}")
    )
    rows = [
        ("no fault", 0, plain.world_size, 0, plain.sim_time * 1e3, difference(largest_difference(plain, ref)))
    ]
    rows.append(
        (
            "Crash(rank=1, at=5.5 ms)",
            crash.restarts,
            crash.world_size,
            out["resumed_from"],
            crash.sim_time * 1e3,
            difference(diff),
        )
    )
    summary["crash"] = {
        "restarts": crash.restarts,
        "resumed_from": out["resumed_from"],
        "max_diff": difference(diff),
    }

    lost = job([NodeLoss(node=1, at=5.5e-3)], max_restarts=1, nnodes="1:2")
    first = lost.failures[0].splitlines()[0] if lost.failures else "(no failure)"
    out = lost.returns[0]
    print(f"\n(2) NodeLoss(node=1, at=5.5 ms), --nnodes 1:2 --max-restarts 1: {lost.restarts} restart")
    print(f"    attempt 0 failed: {first}")
    print(
        f"    attempt {out['restart']} re-formed a world of {lost.world_size} ranks on {lost.cluster.name}, resumed "
        f"from step {out['resumed_from']} and ran {lost.sim_time * 1e3:.4f} ms"
    )
    diff = largest_difference(lost, ref)
    verdicts.append(
        ("a lost node shrinks the world to the survivors", lost.world_size == 2, f"{lost.world_size} ranks")
    )
    verdicts.append(
        ("the smaller world ends as one process does", diff < 1e-12, f"max |diff| {difference(diff)}")
    )
    rows.append(
        (
            "NodeLoss(node=1, at=5.5 ms)",
            lost.restarts,
            lost.world_size,
            out["resumed_from"],
            lost.sim_time * 1e3,
            difference(diff),
        )
    )
    summary["node_loss"] = {
        "world": lost.world_size,
        "resumed_from": out["resumed_from"],
        "max_diff": difference(diff),
    }

    print("\n(3) Crash(rank=1, at=5.5 ms) without restarts:")
    try:
        job([Crash(rank=1, at=5.5e-3)])
        failed = ""
    except simdist.RankCrashError as e:
        failed = str(e).splitlines()[0]
        print(f"    RankCrashError: {failed}")
    verdicts.append(
        ("without restarts the job fails naming the dead rank", "rank 1 crashed" in failed, failed[:40])
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "elastic_restart.json").write_text(json.dumps(summary, indent=2) + "\n")
    page = simdist.report.ScenarioReport(
        "Elastic training under a crash", description=__doc__, command="python scenarios/elastic_restart.py"
    )
    page.table(
        "Jobs",
        [
            "faults",
            "restarts",
            "last world",
            "resumed from step",
            "last attempt (ms)",
            "max |diff| vs one process",
        ],
        rows,
    )
    print()
    return finish(page, verdicts, args.out, "elastic_restart")


if __name__ == "__main__":
    sys.exit(main())
