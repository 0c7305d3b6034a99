"""Step time, bubble and memory of torch's pipeline schedules in simulated time, against their closed forms.

Prints figures; it is not a test. Usage: ``python benchmarks/pipeline_bench.py [--quick] [--json PATH]
[--device H100]``.

Each schedule of ``torch.distributed.pipelining`` runs under ``simdist.run`` for p ranks and m microbatches
on the ``dgx-h100`` preset sized to p GPUs (NVLink through NVSwitch, 1 us per link). The model is p x LAYERS
blocks of ``Linear(WIDTH, WIDTH) + ReLU``, split into equal stages: one stage of LAYERS blocks per rank, or
``v = 2`` stages of LAYERS / 2 blocks per rank for the interleaved and V-shaped schedules. Each microbatch has
MICROBATCH rows, whatever m is, so a stage's forward (F) and backward (B) cost the same at every m.

Equal stages, compute-bound: the default device is the preset's H100 with its FLOP rate divided by
``DERATE`` and no launch overhead. A 64 x 256 x 256 matmul then takes the simulated time a 640 x 2560 x 2560
one takes on a real H100, so the matmuls (which every stage has equally many of) set the time, and the loss
on the last stage, the gradient scaling and the messages (about 2 us a hop) are small beside a stage's F + B
(about 1.5 ms). The input requires grad, so the first stage's backward also computes its input gradient, as
every other stage's does. ``--device H100`` runs the preset's own device instead: then every kernel costs its
5 us launch overhead, the elementwise loss costs about as much as a block, and the last stage is the slow one.

Definitions (per rank, over the second of two steps; the first also infers shapes):
- step time T: from the moment every rank starts the step (after a barrier and a device synchronize) until
  the last rank's device finishes it;
- bubble of a rank: 1 - (time its compute stream is busy within T) / T, i.e. its idle fraction of the step.
  The table gives the mean over ranks and the spread (max - min);
- in-flight microbatches of rank 0: the most activation bytes (autograd's saved tensors, simdist's memory
  accounting) live on rank 0 during the step, divided by what one microbatch leaves there (GPipe, m = 1);
- peak memory of a rank: ``RunResult.memory[rank].peak_bytes`` over the run (parameters, gradients,
  activations, buffers; no optimizer here).

Closed forms (equal stages, messages free): a rank is busy m (F + B) of a step of (m + p - 1)(F + B) under
GPipe and 1F1B, so its bubble is (p - 1) / (m + p - 1). This holds for any ratio of B to F (the fill costs
(p - 1) F, the drain (p - 1) B), so "F + B counted as one unit" is exact here. Interleaving v stages per rank
shrinks the fill and drain to (p - 1)(F + B) / v: bubble (p - 1) / (v m + p - 1). In flight on the first
stage: m microbatches under GPipe (every forward before any backward), min(m, p) under 1F1B.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

import simdist
from simdist.compute import DeviceSpec, get_device

WIDTH, LAYERS, MICROBATCH = 256, 4, 64  # features, blocks per rank, rows per microbatch
DERATE = 1000  # the default device's FLOP rate is the H100's divided by this (10x each matmul dimension)
RANKS, MICROBATCHES = (2, 4, 8), (1, 4, 8, 16)
QUICK_RANKS, QUICK_MICROBATCHES = (2, 4), (1, 4, 8)
#: schedule -> (its class, stages per rank, placement of stage s of n on p ranks: "loop" s % p, or "v")
SCHEDULES: dict[str, tuple[type, int, str]] = {
    "GPipe": (ScheduleGPipe, 1, "loop"),
    "1F1B": (Schedule1F1B, 1, "loop"),
    "Interleaved1F1B": (ScheduleInterleaved1F1B, 2, "loop"),
    "InterleavedZeroBubble": (ScheduleInterleavedZeroBubble, 2, "loop"),
    "DualPipeV": (ScheduleDualPipeV, 2, "v"),
}
TARGET = 0.02  # the measured bubble should be within this (absolute) of the closed form


def compute_bound_device() -> DeviceSpec:
    """The H100 with every FLOP rate divided by ``DERATE`` and no launch overhead (see the module text)."""
    h100 = get_device("H100")
    return dataclasses.replace(
        h100, name=f"H100/{DERATE}", peak_flops={k: v / DERATE for k, v in h100.peak_flops.items()},
        launch_overhead=0.0, source=f"the H100 preset's FLOP rates / {DERATE}, no launch overhead",
    )


def cluster(p: int, device: DeviceSpec | str) -> simdist.Cluster:
    """The dgx-h100 preset with ``p`` GPUs in its one node and ``device`` as each GPU."""
    return simdist.Cluster.preset("dgx-h100", gpus_per_node=p, device=device)


def closed_bubble(schedule: str, p: int, m: int) -> float | None:
    """The closed-form bubble (idle fraction of a step on each rank), or None where there is none here."""
    v = SCHEDULES[schedule][1]
    if schedule in ("GPipe", "1F1B"):
        return (p - 1) / (m + p - 1)
    if schedule == "Interleaved1F1B":
        return (p - 1) / (v * m + p - 1)
    return None


def closed_in_flight(schedule: str, p: int, m: int) -> int | None:
    """Microbatches whose activations the first stage holds at once, in closed form, or None."""
    if schedule == "GPipe":
        return m
    if schedule == "1F1B":
        return min(m, p)
    return None


def stage_indices(schedule: str, rank: int, p: int) -> list[int]:
    """The stages ``rank`` of ``p`` holds, in the order its schedule takes them."""
    _, v, placement = SCHEDULES[schedule]
    if placement == "v":
        return [rank, 2 * p - 1 - rank]
    return [rank + i * p for i in range(v)]


def block_stack(stage: int, blocks: int) -> torch.nn.Sequential:
    """Stage ``stage``: ``blocks`` blocks of Linear + ReLU, seeded by the stage index."""
    torch.manual_seed(stage)
    layers: list[torch.nn.Module] = []
    for _ in range(blocks):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The loss of one microbatch: mean squared error."""
    return (out - target).pow(2).mean()


def timed_steps(schedule: str, m: int, steps: int = 2) -> tuple[float, float]:
    """Rank code: build this rank's stages and run ``steps`` steps; the last step's (start, end) in seconds."""
    cls, v, _ = SCHEDULES[schedule]
    rank, p = dist.get_rank(), dist.get_world_size()
    n = v * p
    mine = stage_indices(schedule, rank, p)
    stages = [PipelineStage(block_stack(s, LAYERS // v), s, n, torch.device("cpu")) for s in mine]
    sched = cls(stages if v > 1 else stages[0], m, loss_fn=mse)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(MICROBATCH * m, WIDTH, generator=g, requires_grad=True)
    target = torch.randn(MICROBATCH * m, WIDTH, generator=g)
    inputs = [x] if 0 in mine else []
    targets = {"target": target} if n - 1 in mine else {}
    span = (0.0, 0.0)
    for _ in range(steps):
        dist.barrier()
        simdist.synchronize()  # the device drains before the clock is read: every rank starts together
        start = simdist.now()
        sched.step(*inputs, **targets)
        simdist.synchronize()
        span = (start, simdist.now())
    return span


@dataclass
class Row:
    """One (schedule, p, m) point; times in seconds, memory in bytes; ``skipped`` says why torch refused it."""

    schedule: str
    p: int
    m: int
    step: float = 0.0
    bubbles: list[float] = field(default_factory=list)
    activations: list[float] = field(default_factory=list)  # per rank: see activations_in_step
    peak: list[int] = field(default_factory=list)
    closed_bubble: float | None = None
    closed_in_flight: int | None = None
    in_flight: float | None = None
    skipped: str | None = None

    @property
    def bubble(self) -> float:
        """Mean over ranks of the idle fraction of the step."""
        return sum(self.bubbles) / len(self.bubbles)

    @property
    def met(self) -> bool | None:
        """Whether the bubble is within ``TARGET`` of the closed form (None without a closed form)."""
        if self.closed_bubble is None or self.skipped is not None:
            return None
        return abs(self.bubble - self.closed_bubble) <= TARGET


def busy(res: simdist.RunResult, rank: int, start: float, end: float) -> float:
    """Seconds ``rank``'s compute stream is busy within [start, end]."""
    total = 0.0
    for s in res.trace.spans:
        if s.rank == rank and s.stream == "compute" and s.end > start and s.start < end:
            total += min(s.end, end) - max(s.start, start)
    return total


def activations_in_step(res: simdist.RunResult, rank: int, start: float, end: float) -> float:
    """The most activation bytes live on ``rank`` within [start, end] beyond those live at ``start`` (bytes).

    What is live at the start outlasts the step: the input batch and the receive buffers torch's stages keep
    from step to step, counted as activations once autograd has saved them.
    """
    track = [c for c in res.trace.counters if c.rank == rank and c.name == "memory"]
    before = [c.values["activations"] for c in track if c.time <= start]
    base = before[-1] if before else 0.0
    return max([base] + [c.values["activations"] for c in track if start < c.time <= end]) - base


def measure(schedule: str, p: int, m: int, device: DeviceSpec | str) -> Row:
    """Run ``schedule`` on ``p`` ranks with ``m`` microbatches; a combination torch rejects comes back skipped."""
    row = Row(schedule, p, m, closed_bubble=closed_bubble(schedule, p, m),
              closed_in_flight=closed_in_flight(schedule, p, m))
    try:
        res = simdist.run(timed_steps, cluster(p, device), args=(schedule, m), races="off", memory=True)
    except simdist.RankError as e:
        if isinstance(e.exc, ValueError):  # torch's schedule constructors reject with ValueError
            row.skipped = str(e.exc).splitlines()[0]
            return row
        raise
    start = min(s for s, _ in res.returns)
    end = max(e for _, e in res.returns)
    row.step = end - start
    row.bubbles = [1 - busy(res, r, start, end) / row.step for r in range(p)]
    row.activations = [activations_in_step(res, r, start, end) for r in range(p)]
    row.peak = [res.memory[r].peak_bytes for r in range(p)]
    return row


def grid(ranks: tuple[int, ...], microbatches: tuple[int, ...], schedules: list[str],
         device: DeviceSpec | str) -> list[Row]:
    """Every (schedule, p, m) point, with rank 0's in-flight microbatches in units of GPipe's at m = 1."""
    rows = []
    for p in ranks:
        unit = measure("GPipe", p, 1, device).activations[0]  # what one microbatch leaves on the first stage
        for schedule in schedules:
            for m in microbatches:
                row = measure(schedule, p, m, device)
                if row.skipped is None:
                    row.in_flight = row.activations[0] / unit
                rows.append(row)
    return rows


def fmt(x: float | None, spec: str) -> str:
    """``x`` formatted, or "-" for None."""
    return "-" if x is None else format(x, spec)


def table(rows: list[Row]) -> str:
    """The rows as a fixed-width table (times in microseconds, memory in MiB)."""
    head = (f"{'schedule':<21} {'p':>2} {'m':>3} {'step (us)':>10} {'bubble':>7} {'spread':>7} {'closed':>7} "
            f"{'diff':>7} {'ok':>3} {'in-flight':>9} {'closed':>6}  peak memory per rank (MiB)")
    lines = [head]
    for r in rows:
        if r.skipped is not None:
            lines.append(f"{r.schedule:<21} {r.p:>2} {r.m:>3}  skipped: torch rejects it: {r.skipped}")
            continue
        diff = None if r.closed_bubble is None else r.bubble - r.closed_bubble
        ok = {None: "-", True: "yes", False: "NO"}[r.met]
        peaks = " ".join(f"{b / 2**20:.2f}" for b in r.peak)
        lines.append(
            f"{r.schedule:<21} {r.p:>2} {r.m:>3} {r.step * 1e6:>10.1f} {r.bubble:>7.4f} "
            f"{max(r.bubbles) - min(r.bubbles):>7.4f} {fmt(r.closed_bubble, '.4f'):>7} {fmt(diff, '+.4f'):>7} "
            f"{ok:>3} {fmt(r.in_flight, '.2f'):>9} {fmt(r.closed_in_flight, 'd'):>6}  {peaks}"
        )
    return "\n".join(lines)


def notes(rows: list[Row]) -> list[str]:
    """Why each row that misses its closed form misses it, or that no row does."""
    out = []
    for r in rows:
        if r.met is not False:
            continue
        if r.schedule == "Interleaved1F1B" and r.m < r.p:
            # one round of m < p microbatches: a microbatch's forward crosses all v p stages before its
            # backward starts, so the step is (v p + m - 1) stage-chunks of F + B, of which v m are busy
            v = SCHEDULES[r.schedule][1]
            fill = (v * (r.p - r.m) + r.m - 1) / (v * r.p + r.m - 1)
            out.append(f"Interleaved1F1B p={r.p} m={r.m}: the closed form assumes m >= p; with fewer microbatches "
                       f"than ranks each rank idles until a microbatch returns from the last rank: "
                       f"(v (p - m) + m - 1) / (v p + m - 1) = {fill:.4f}, {r.bubble - fill:+.4f} off")
        else:
            out.append(f"{r.schedule} p={r.p} m={r.m}: {r.bubble - r.closed_bubble:+.4f} off the closed form")
    return out or [f"every row with a closed form is within {TARGET} of it"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"p in {QUICK_RANKS}, m in {QUICK_MICROBATCHES}")
    ap.add_argument("--schedules", nargs="+", choices=list(SCHEDULES), default=list(SCHEDULES))
    ap.add_argument("--device", default=None,
                    help=f"a device name for the preset (e.g. H100); default: the H100 derated {DERATE}x")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = ap.parse_args()
    device = compute_bound_device() if args.device is None else get_device(args.device)
    ranks, microbatches = (QUICK_RANKS, QUICK_MICROBATCHES) if args.quick else (RANKS, MICROBATCHES)
    print(f"# machine: {platform.machine()}; python {platform.python_version()}; torch {torch.__version__}")
    print(f"# cluster: dgx-h100 preset, p GPUs in one node; device {device.name} ({device.source})")
    print(f"# model: p x {LAYERS} blocks of Linear({WIDTH}, {WIDTH}) + ReLU; {MICROBATCH} rows per microbatch; "
          f"v = 2 stages per rank for the interleaved and V schedules")
    print(f"# bubble: mean over ranks of 1 - busy compute / step; spread: max - min over ranks; "
          f"ok: |bubble - closed| <= {TARGET}")
    print("# in-flight: rank 0's most live activation bytes / one microbatch's (GPipe, m = 1)")
    rows = grid(ranks, microbatches, args.schedules, device)
    print(table(rows))
    for line in notes(rows):
        print(f"# note: {line}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(r) | {"bubble": r.bubble if r.bubbles else None, "met": r.met}
                       for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
