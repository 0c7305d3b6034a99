"""A straggler and a crashed rank in data-parallel training: the step time they cost, and what the peers see.

A small MLP (16 -> 32 -> 1, tanh, float64) trains for 3 steps with torch's DistributedDataParallel and SGD on
8 ranks of a two-level cluster (2 nodes of 4 ranks; NVLink-like links inside a node, a fabric between them).
Every rank spends ``COMPUTE`` simulated seconds on its forward and backward pass (``simdist.charge``; the CPU
cluster's ops cost nothing else), then DDP's all-reduce averages the gradients of its share of the step's batch.

(1) ``simdist.faults.Straggler(rank=3, slowdown=s)`` for s in 1, 1.5, 2, 3, 4: rank 3 computes s times slower.
    Every rank waits for it in the all-reduce, so the step takes the straggler's compute plus the all-reduce,
    which starts when rank 3 joins and then runs as it always does: T(s) = T(1) + (s - 1) x COMPUTE (the closed
    form, within 1 ns: rank 3, on node 0, leaves each all-reduce 0.39 ns before rank 7 does, so a late rank 3
    starts its compute that much before the last rank of an undelayed step), and never less than s x COMPUTE.
(2) ``Crash(rank=5, collective=4)``: rank 5 dies as it issues its 4th collective, the first step's gradient
    all-reduce (DDP's wrap issues three: it checks the parameters across ranks and broadcasts rank 0's state,
    each counting). Without a timeout its peers would hang: simdist stops
    the run with a diagnosis naming the dead rank, its call site, and where every rank waits. With
    ``init_process_group(timeout=...)`` the peers' all-reduce times out at that simulated time, naming the crash;
    on GPUs under NCCL with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` the watchdog takes each peer's process down.
(3) One ``simdist.explore`` call: 8 runs with latency and compute jitter around the straggler, each checked
    against one process training the same model on the whole batch (the single-process model): none differs.

Writes its HTML report (the step-time table and plot, the diagnoses) and ddp_faults.json to the output
directory (reports/ by default).

Usage: python scenarios/ddp_faults.py [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from verdicts import difference, finish

import simdist
import simdist.report
from simdist.faults import Crash, Straggler

NODES, PER_NODE = 2, 4
STEPS, BATCH, LR = 3, 32, 0.05
#: simulated seconds each rank spends on one step's forward and backward pass
COMPUTE = 1e-3
STRAGGLER, SLOWDOWNS = 3, (1.0, 1.5, 2.0, 3.0, 4.0)
#: the rank that crashes, and the collective it dies issuing: DDP's wrap issues three (it checks the parameters'
#: shapes across ranks and broadcasts rank 0's state), so the 4th is the first step's gradient all-reduce
CRASHED, AT_COLLECTIVE = 5, 4
#: the timeout the peers' process group is made with in (2), simulated seconds
TIMEOUT = 0.05
#: float64 round-off: the all-reduce sums the ranks' gradients in another order than one process does
ROUND_OFF = 1e-12
#: how far a step time may lie from the closed form: the simulated messages' timing is not in it (seconds)
NANOSECOND = 1e-9
#: the exploration around the straggler: runs, and the relative latency and compute jitter of each
RUNS, JITTER = 8, {"latency": 0.2, "compute": 0.1}
CLUSTER = simdist.Cluster.two_level(NODES, PER_NODE, device="cpu")
REPORTS = Path(__file__).resolve().parent.parent / "reports"


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).double()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of step ``step``: the same for any world size."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, 16, generator=g, dtype=torch.float64)
    return x, x[:, :1].sin() + 0.1 * x[:, 1:2]


#: what each rank caught from a timed-out collective: a run in which a rank crashed raises, so the others' returns
#: are lost (simdist.run copies its args per rank, as separate processes would; a module's state is shared)
CAUGHT: list[dict] = []


def train(backend: str | None = None, timeout: float | None = None, handling: str | None = None) -> dict:
    """One rank's training loop; with ``backend`` it makes its own process group (``timeout`` in seconds). A timed-out
    collective is caught, kept in :data:`CAUGHT` and returned."""
    if handling is not None:
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = handling
    if backend is not None:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout or 600))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = "cuda"
    net = model().to(device)
    ddp = DistributedDataParallel(net)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    share = BATCH // world
    ends = []
    try:
        for step in range(STEPS):
            x, y = (t[rank * share : (rank + 1) * share].to(device) for t in batch(step))
            simdist.charge(COMPUTE)
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            ends.append(simdist.now())
    except (
        dist.DistBackendError
    ) as e:  # a timed-out collective: what a training loop would log before exiting
        out = {"rank": rank, "caught": str(e), "at": simdist.now()}
        CAUGHT.append(out)
        return out
    return {"ends": ends, "weights": [p.detach().cpu() for p in net.parameters()]}


def reference() -> list[torch.Tensor]:
    """One process, the whole batch of every step."""
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach() for p in net.parameters()]


def largest_difference(res: simdist.RunResult) -> float:
    """The largest |weight - the single-process model's weight| over every rank."""
    ref = reference()
    return max(
        float((a - b).abs().max()) for out in res.returns for a, b in zip(out["weights"], ref, strict=True)
    )


def matches_one_process(res: simdist.RunResult) -> bool:
    """The exploration's check: every rank ends with the single-process model's weights (up to round-off)."""
    return largest_difference(res) < ROUND_OFF


def step_time(res: simdist.RunResult) -> float:
    """Simulated seconds of a step after the first, the mean of the others (the first also holds the collectives
    DDP issues at wrap time)."""
    ends = res.returns[0]["ends"]
    return (ends[-1] - ends[0]) / (len(ends) - 1)


def stragglers(verdicts: list, page: simdist.report.ScenarioReport) -> dict:
    print(
        f"(1) Straggler(rank={STRAGGLER}, slowdown=s) on {CLUSTER.world_size} ranks, {COMPUTE * 1e3:g} ms of compute "
        "per step:"
    )
    print(
        f"  {'s':>4s} {'step (ms)':>10s} {'T(1) + (s-1) C (ms)':>20s} {'s C (ms)':>9s} {'max |w - 1 proc|':>17s}"
    )
    rows, times, worst = [], {}, 0.0
    for s in SLOWDOWNS:
        res = simdist.run(train, CLUSTER, faults=[Straggler(rank=STRAGGLER, slowdown=s)])
        times[s] = step_time(res)
        diff = largest_difference(res)
        worst = max(worst, diff)
        rows.append((s, times[s], diff))
    base = times[SLOWDOWNS[0]]
    closed = {s: base + (s - 1) * COMPUTE for s in SLOWDOWNS}
    for s, t, diff in rows:
        print(
            f"  {s:4g} {t * 1e3:10.4f} {closed[s] * 1e3:20.4f} {s * COMPUTE * 1e3:9.4f} {difference(diff):>17s}"
        )
    print()
    off = max(abs(times[s] - closed[s]) for s in SLOWDOWNS)
    late = [s for s in SLOWDOWNS if s > 1]
    slope = max(abs(times[s] - times[late[0]] - (s - late[0]) * COMPUTE) for s in late)
    verdicts.append(
        (
            "the step time follows T(1) + (s-1) x compute",
            off < NANOSECOND,
            "within 1 ns" if off < NANOSECOND else f"{off:.1e} s off",
        )
    )
    verdicts.append(
        (
            "once rank 3 is late each unit of slowdown adds the compute",
            slope < ROUND_OFF,
            f"max |off| {difference(slope)} s",
        )
    )
    verdicts.append(
        (
            "no step is shorter than the straggler's compute",
            all(times[s] >= s * COMPUTE for s in SLOWDOWNS),
            f"T(1) = {base * 1e3:.4f} ms",
        )
    )
    verdicts.append(("a straggler changes no weight", worst < ROUND_OFF, f"max |diff| {difference(worst)}"))
    page.table(
        "Step time vs the straggler's slowdown",
        ["slowdown", "step (ms)", "closed form (ms)", "s x compute (ms)"],
        [[s, f"{t * 1e3:.4f}", f"{closed[s] * 1e3:.4f}", f"{s * COMPUTE * 1e3:.4f}"] for s, t, _ in rows],
        note="Closed form: T(s) = T(1) + (s - 1) x compute: every rank waits for the straggler in the all-reduce, "
        "which then takes what it always takes.",
        nav="stragglers",
    )
    page.line_plot(
        "Step time vs slowdown",
        {
            "simulated": [(s, times[s]) for s in SLOWDOWNS],
            "T(1) + (s-1) x compute": [(s, closed[s]) for s in SLOWDOWNS],
        },
        x_label="slowdown of rank 3",
        y_label="step time",
        unit="time",
        nav="plot",
    )
    return {"step_seconds": {str(s): times[s] for s in SLOWDOWNS}, "compute_seconds": COMPUTE}


def crash(verdicts: list, page: simdist.report.ScenarioReport) -> dict:
    fault = Crash(rank=CRASHED, collective=AT_COLLECTIVE)
    print(f"(2) {fault!r}")
    try:
        simdist.run(train, CLUSTER, faults=[fault])
        hang = None
    except simdist.RankCrashError as e:
        hang = e
    text = str(hang) if hang else "(no error)"
    first = text.splitlines()[0]
    print("  no timeout: simdist.RankCrashError")
    print("    " + "\n    ".join(line for line in text.splitlines() if not line.startswith("  ranks ")))
    page.text("A crash without a timeout: the diagnosis", text, error=True, nav="crash")
    verdicts.append(
        (
            "the diagnosis names the dead rank and its call site",
            hang is not None and f"rank {CRASHED} crashed" in first and "ddp_faults.py:" in first,
            f"rank {CRASHED}, collective {AT_COLLECTIVE}",
        )
    )

    CAUGHT.clear()
    try:
        simdist.run(train, CLUSTER, faults=[fault], default_group=False, args=("gloo", TIMEOUT))
        timed = None
    except simdist.RankCrashError as e:
        timed = e
    caught = timed.peer_failure if timed is not None else None
    # the peers caught their timeout and returned: the run still ends in RankCrashError, as torchrun reports a
    # failed worker, with no peer failure
    timed_returns = sorted(CAUGHT, key=lambda out: out["rank"])
    print(f"  init_process_group(timeout={TIMEOUT:g} s): {len(timed_returns)} peers caught a timeout")
    if timed_returns:
        first_peer = timed_returns[0]
        print(f"    rank {first_peer['rank']} at {first_peer['at']:.6f} s: {first_peer['caught']}")
    print()

    try:
        simdist.run(
            train,
            simdist.Cluster.two_level(NODES, PER_NODE),
            faults=[fault],
            default_group=False,
            backend_name="nccl",
            args=("nccl", TIMEOUT, "1"),
        )
        torn = None
    except simdist.RankCrashError as e:
        torn = e.peer_failure
    print(
        f"  NCCL on GPUs, TORCH_NCCL_ASYNC_ERROR_HANDLING=1: a peer's process ended with {type(torn).__name__}:"
    )
    torn_text = str(torn) if torn is not None else "(none)"
    print("    " + "\n    ".join(torn_text.splitlines()[:3]))
    print()
    page.text(
        "NCCL's watchdog under TORCH_NCCL_ASYNC_ERROR_HANDLING=1", torn_text, error=True, nav="watchdog"
    )
    verdicts.append(
        (
            "under NCCL's error handling the watchdog tears the peers down",
            isinstance(torn, simdist.errors.ProcessTornDown),
            type(torn).__name__,
        )
    )
    named = [out for out in timed_returns if f"rank {CRASHED} crashed" in out["caught"]]
    verdicts.append(
        (
            "with a timeout every peer's all-reduce times out naming the crash",
            timed is not None and caught is None and len(named) == CLUSTER.world_size - 1,
            f"{len(named)} of {CLUSTER.world_size - 1} peers",
        )
    )
    return {"crashed": CRASHED, "collective": AT_COLLECTIVE, "diagnosis": first}


def explored(verdicts: list, page: simdist.report.ScenarioReport) -> dict:
    """Jitter around the straggler: every run still ends with the single-process model's weights."""
    straggler = Straggler(rank=STRAGGLER, slowdown=2.0)
    ex = simdist.explore(
        train,
        CLUSTER,
        runs=RUNS,
        strategy="random",
        seed=0,
        jitter=JITTER,
        faults=[straggler],
        check=matches_one_process,
    )
    print(
        f"(3) simdist.explore(train, runs={RUNS}, strategy='random', jitter={JITTER}, faults=[{straggler!r}],"
    )
    print("                    check=matches_one_process)")
    print("  " + ex.summary().splitlines()[0])
    print()
    page.text(
        "Explored around the straggler",
        ex.summary(),
        nav="explore",
        note="Each run draws its tie order and stretches every message's latency by up to 20% and every op by "
        "up to 10%; the check compares every rank's weights with one process's.",
    )
    verdicts.append(
        (
            "every explored run matches the single-process model",
            not ex.failures and ex.runs == RUNS,
            f"{len(ex.failures)} failures in {ex.runs} runs",
        )
    )
    verdicts.append(
        (
            "the jitter gives the runs other timings",
            ex.interleavings > 1,
            f"{ex.interleavings} distinct traces",
        )
    )
    return {"runs": ex.runs, "failures": len(ex.failures), "interleavings": ex.interleavings}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out",
        type=Path,
        default=REPORTS,
        metavar="DIR",
        help="where the HTML report and ddp_faults.json are written (default: %(default)s)",
    )
    args = ap.parse_args(argv)
    verdicts: list = []
    page = simdist.report.ScenarioReport(
        "A straggler and a crash in DDP training",
        description=__doc__,
        command="python scenarios/ddp_faults.py",
    )
    summary = {
        "stragglers": stragglers(verdicts, page),
        "crash": crash(verdicts, page),
        "explore": explored(verdicts, page),
    }
    path = args.out / "ddp_faults.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2))
    print(f"summary written to {path}")
    print()
    return finish(page, verdicts, args.out, "ddp_faults")


if __name__ == "__main__":
    sys.exit(main())
