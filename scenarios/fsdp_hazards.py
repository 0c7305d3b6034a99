"""The hazards of the original FSDP backward-hook design, each behind a switch of ``simdist.strategies.fsdp``.

The design scatters gradients into shards from backward hooks and offers helpers that scatter, accumulate and
verify them. Each of its hazards is kept in ``FSDP(..., hazards=Hazards(...))`` with the correct behaviour as
the default. Every case trains a small float64 model for a few SGD steps on 4 GPUs of a simulated DGX-H100
node, the correct way and the hazardous way, and compares each with the single-process model trained on the
full batch on the CPU through the equivalence oracle (``simdist.check_equivalence``): the first divergent step
and tensor, what differs, the largest parameter difference after the last step, and the loss by step.

Every rank function is written as for torchrun on GPUs: NCCL, the GPU its LOCAL_RANK names, the model and each
batch copied to it, the step timed with CUDA events and its memory read from ``torch.cuda``; on simulated H100s
they run on this machine's CPU.

(a) ``scatter_multiple`` run as from a thread pool, so each rank issues its reduce-scatters in its own order:
    units of different sizes make a collective mismatch that names the ranks and calls, under NCCL-like and
    gloo-like progress alike; units of one size pair up silently, and the sums mix different parameters.
    Issuing them in one fixed order is right.
(b) Units and gradients paired by position in two mappings, where one rank collected its gradients in the order
    backward produced them: gradients land in other units' shards.
(c) Accumulation over ``min(len(a), len(b))`` elements: a full gradient accumulated into a shard is silently
    cut to the shard's length; the strict check refuses it.
(d) The padding of the last shard's gradient not zeroed: a global gradient-norm clip over the shards counts
    the stale padding and scales every gradient by the wrong factor.
(e) The reduce-scatter summed but not averaged: every gradient (the learning rate, in effect) is world-size
    times too large.
(f) The optimizer stepping before the reduce-scatters finished (``finish_gradient_synchronization()``
    forgotten): the race detector names the reduce-scatter in flight and the optimizer's read of its output.

With ``--real`` every case also runs on real gloo processes (one per rank, through ``real``, each emulating its
GPU): the same errors, and the final state compared with the reference's (``real.oracle.check_final_state``)
must agree with the simulated verdict. The race of (f) is a finding of the simulation only; on real processes
its outcome depends on timing, and is shown without a verdict.

Then the step time and the in-step peak memory per rank of torch's DDP, FSDP and FSDP without resharding on one
simulated DGX-H100 node; the HTML report fsdp_hazards.html (in the output directory, reports/ by default) has
every variant, these figures as plots, and the DDP and FSDP timelines side by side.

Usage: python scenarios/fsdp_hazards.py [--seed N] [--real] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from oracle_cases import Case, CaseSections, Outcome, Variant, on_real_gloo, outcome_of, show, verdict
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from verdicts import finish, importable_by_rank_processes

import simdist
import simdist.report
from simdist.strategies.fsdp import FSDP, Hazards

WORLD = 4
#: rows of one optimizer step's global batch (every rank takes BATCH / WORLD of them)
BATCH, STEPS, LR = 8, 3, 0.1
#: max_norm of the gradient clipping of case (d), small enough that every step clips
CLIP = 0.05
REPORTS = Path(__file__).resolve().parent.parent / "reports"


def setup() -> torch.device:
    """What a script launched by torchrun on GPUs does first: NCCL, and the GPU its LOCAL_RANK names."""
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


# ------------------------------------------------------------------------------------------- models, data
def build(kind: str, seed: int) -> nn.Sequential:
    """The single-process model: "mixed" (6 -> 7 -> 5, sizes that leave padding in the last shard on 4 ranks)
    or "square" (four 8 x 8 layers without bias: every parameter of one size)."""
    torch.manual_seed(seed)
    if kind == "mixed":
        layers: list[nn.Module] = [nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 5)]
    else:
        layers = [m for _ in range(4) for m in (nn.Linear(8, 8, bias=False), nn.Tanh())][:-1]
    return nn.Sequential(*layers).double()


def batch(kind: str, step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch (inputs, targets) as a data loader gives it: on the host."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    d_in, d_out = (6, 5) if kind == "mixed" else (8, 8)
    x = torch.randn(BATCH, d_in, generator=g, dtype=torch.float64)
    return x, torch.randn(BATCH, d_out, generator=g, dtype=torch.float64)


def every_parameter(module: nn.Module, name: str, param: nn.Parameter) -> bool:
    """Shard every parameter (biases too), so that the hook helpers see all of them."""
    return True


# --------------------------------------------------------------------------------------------- the layouts
@dataclass(frozen=True)
class Layout:
    """One variant: the model, how gradients reach the shards, the hazard switches, what the program does."""

    kind: str = "mixed"
    hazards: Hazards = field(default_factory=Hazards)
    #: "hooks": FSDP's backward hooks; "manual": a full replica's gradients through hook.scatter_multiple
    scatter: str = "hooks"
    #: "manual": rank 1 collects its gradients in the order backward produced them (last layer first)
    backward_order: bool = False
    #: "manual": micro-steps per step; after the first, "scatter" again or "accumulate" the full gradients
    micro: int = 1
    then: str = "scatter"
    clip: bool = False
    #: shard biases too (the norm of case d is then a sum over shards alone; "manual" always does)
    shard_all: bool = False
    finish: bool = True
    progress: str = "nccl"
    steps: int = STEPS


def replicas_from(model: FSDP, full: nn.Module) -> None:
    """Load the sharded model's full parameters into the plain replica (a collective: every rank calls it)."""
    with torch.no_grad():
        params = model.gather_full_params()
        for name, p in full.named_parameters():
            p.copy_(params[name])


def clip_by_global_norm(model: FSDP, max_norm: float) -> None:
    """Clip the shards' gradients by the norm of the whole gradient: the sum of every rank's squares."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = torch.stack([g.pow(2).sum() for g in grads]).sum()
    dist.all_reduce(total)
    scale = (max_norm / (total.sqrt() + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(scale)


def train(layout: Layout, seed: int) -> dict[str, Any]:
    """A rank: its rows of each step, FSDP over the model on its GPU, SGD on the local shards; its losses and
    full parameters."""
    device = setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = every_parameter if layout.scatter == "manual" or layout.shard_all else None
    model = FSDP(build(layout.kind, seed).to(device), shard=shard, hazards=layout.hazards)
    full = build(layout.kind, seed).to(device) if layout.scatter == "manual" else None
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(layout.steps):
        x, y = batch(layout.kind, step, seed)
        x, y = x.chunk(world)[rank].to(device), y.chunk(world)[rank].to(device)
        opt.zero_grad()
        if full is None:
            loss = F.mse_loss(model(x), y)
            loss.backward()
            if layout.finish:
                model.finish_gradient_synchronization()
            losses.append(loss.item())
        else:
            losses.append(manual_step(layout, model, full, x, y, rank))
        if layout.clip:
            clip_by_global_norm(model, CLIP)
        opt.step()
    return {"losses": losses, "params": model.gather_full_params()}


def manual_step(
    layout: Layout, model: FSDP, full: nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int
) -> float:
    """The original design's way: a full replica's gradients scattered into the shards by the hook helpers."""
    replicas_from(model, full)
    total = 0.0
    for k, (xk, yk) in enumerate(zip(x.chunk(layout.micro), y.chunk(layout.micro))):
        full.zero_grad()
        loss = F.mse_loss(full(xk), yk)
        (loss / layout.micro).backward()
        total += loss.item() / layout.micro
        named = list(full.named_parameters())
        if layout.backward_order and rank == 1:
            named.reverse()  # the order autograd finished them: last layer first
        grads = {name: p.grad for name, p in named}
        if k > 0 and layout.then == "accumulate":
            model.hook.accumulate_gradients(model.units, grads)
        else:
            model.hook.scatter_multiple(model.units, grads)
            model.hook.wait_all()
    return total


def reference(layout: Layout, seed: int) -> dict[str, Any]:
    """The oracle: one process (here on the CPU) trains the model on the full batch, the mean loss (clipped in
    case d)."""
    model = build(layout.kind, seed)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = batch(layout.kind, step, seed)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if layout.clip:
            nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        losses.append(loss.item())
        opt.step()
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


# --------------------------------------------------------------------------------------------------- the cases
MANUAL = Layout(scatter="manual")
SQUARE = replace(MANUAL, kind="square")
PER_RANK = Hazards(scatter_order="per_rank")

CASES = [
    Case(
        "a",
        "scatter_multiple in each rank's own order",
        (
            Variant(
                "units of different sizes, NCCL-like",
                replace(MANUAL, hazards=PER_RANK),
                "raises",
                ("does not match across ranks", "reduce_scatter"),
                "CollectiveMismatchError",
            ),
            Variant(
                "units of different sizes, gloo-like",
                replace(MANUAL, hazards=PER_RANK, progress="gloo"),
                "raises",
                ("does not match across ranks", "reduce_scatter"),
                "CollectiveMismatchError",
            ),
            Variant(
                "units of one size", replace(SQUARE, hazards=PER_RANK), "diverges", ("0.weight",), "grad"
            ),
            Variant("one fixed order", SQUARE, "equal"),
        ),
    ),
    Case(
        "b",
        "units and gradients paired by position",
        (
            Variant(
                "paired by position",
                replace(SQUARE, backward_order=True, hazards=Hazards(pair_by="position")),
                "diverges",
                ("0.weight", "6.weight"),
                "grad",
            ),
            Variant("paired by name", replace(SQUARE, backward_order=True), "equal"),
        ),
    ),
    Case(
        "c",
        "accumulating a full gradient into a shard",
        (
            Variant(
                "truncated",
                replace(MANUAL, micro=2, then="accumulate", hazards=Hazards(accumulate="truncate")),
                "diverges",
                ("0.weight",),
                "grad",
            ),
            Variant(
                "strict",
                replace(MANUAL, micro=2, then="accumulate"),
                "raises",
                ("0.weight", "shard"),
                "ValueError",
            ),
            Variant("scattered every micro-step", replace(MANUAL, micro=2), "equal"),
        ),
    ),
    Case(
        "d",
        "stale padding in the last shard, global-norm clipping",
        (
            Variant(
                "padding not zeroed",
                Layout(clip=True, shard_all=True, hazards=Hazards(zero_padding=False)),
                "diverges",
                ("2.weight",),
                "grad",
            ),
            Variant("padding zeroed", Layout(clip=True, shard_all=True), "equal"),
        ),
    ),
    Case(
        "e",
        "reduce-scatter summed, not averaged",
        (
            Variant(
                "summed",
                Layout(hazards=Hazards(average=False)),
                "diverges",
                ("2.weight",),
                "grad",
                scale=float(WORLD),
            ),
            Variant("averaged", Layout(), "equal"),
        ),
    ),
]

#: case (f) is a race, found by the detector rather than the oracle: (label, layout, whether a race is expected).
#: One step: the next backward would refuse to run over gradients never synchronised, which FSDP reports.
STEP_BEFORE_FINISH = (
    ("finish_gradient_synchronization() forgotten", Layout(finish=False, steps=1), True),
    ("finish_gradient_synchronization() called", Layout(steps=1), False),
)


def cluster() -> simdist.Cluster:
    """4 GPUs of one DGX-H100 node, as ``torchrun --nproc_per_node 4`` takes them."""
    return simdist.Cluster.preset("dgx-h100", world_size=WORLD)


def loss_mode(layout: Layout) -> str:
    return "accumulated" if layout.micro > 1 else "mean"


def simulate(v: Variant, seed: int) -> Outcome:
    """Run the variant through the oracle; a program error is the outcome."""
    return outcome_of(
        lambda: simdist.check_equivalence(
            train,
            reference,
            cluster(),
            args=(v.layout, seed),
            seed=seed,
            loss=loss_mode(v.layout),
            localize=False,
            progress=v.layout.progress,
        )
    )


def races(layout: Layout, seed: int) -> list[str]:
    """The races the detector reports in ``layout``: each one's finding and where the access was."""
    res = simdist.run(train, cluster(), args=(layout, seed), seed=seed, races="warn")
    return [" / ".join(line.strip() for line in str(r).splitlines()[:2]) for r in res.races]


def simulated(
    seed: int, verdicts: list[tuple[str, bool, str]], page: simdist.report.ScenarioReport
) -> dict[tuple[str, str], bool]:
    """Every variant under simdist; returns whether each equalled one process, for --real."""
    print(
        f"FSDP hazards: {WORLD} GPUs of a simulated {cluster().name} node, {STEPS} SGD steps, float64, "
        f"seed {seed}; each against one process on the full batch"
    )
    print()
    outcome: dict[tuple[str, str], bool] = {}
    sections = CaseSections()
    for case in CASES:
        print(f"({case.key}) {case.title}")
        for v in case.variants:
            o = simulate(v, seed)
            show(v, o)
            ok, detail = verdict(v, o)
            verdicts.append((f"({case.key}) {v.label}: {v.expect}", ok, detail))
            sections.add(case, v, o, ok, detail)
            outcome[(case.key, v.label)] = o.report.ok if o.report is not None else False
        print()
    sections.write(
        page,
        f"{WORLD} GPUs of a simulated {cluster().name} node, {STEPS} SGD steps, float64, seed {seed}; each "
        "against one process on the full batch (on the CPU).",
    )
    race_rows = []
    print("(f) the optimizer stepping before the reduce-scatters finished")
    with warnings.catch_warnings():  # the findings are read from the result
        warnings.simplefilter("ignore", simdist.RaceWarning)
        for label, layout, expected in STEP_BEFORE_FINISH:
            found = races(layout, seed)
            print(f"  {label:45s} {len(found)} race{'s' if len(found) != 1 else ''}")
            for line in found[:2]:
                print(f"    {line}")
            # the optimizer's read of a gradient a reduce-scatter still owns
            named = any("reduce_scatter" in line and "optim" in line for line in found)
            verdicts.append(
                (
                    f"(f) {label}: {'race' if expected else 'no race'}",
                    named if expected else not found,
                    f"{len(found)} races",
                )
            )
            race_rows.append(
                [
                    label,
                    "race" if expected else "no race",
                    (len(found), "fail" if found else "pass"),
                    "\n".join(found[:2]) or "-",
                ]
            )
    print()
    page.table(
        "(f) the optimizer stepping before the reduce-scatters finished",
        ["variant", "expects", "races", "first findings"],
        race_rows,
        nav="(f) races",
    )
    return outcome


# ------------------------------------------------------------------------------------------------- timing
TIMING_WORLD, WIDTH, LAYERS, ROWS = 8, 512, 4, 128
#: the wrappers timed: torch's DDP on the rank's GPU, and this package's FSDP resharding after forward or keeping
#: full weights
WRAPPERS = {
    "DDP": lambda m: DistributedDataParallel(m, device_ids=[torch.cuda.current_device()]),
    "FSDP": lambda m: FSDP(m),
    "FSDP (no reshard)": lambda m: FSDP(m, reshard_after_forward=False),
}


def timed_step(wrapper: str) -> tuple[float, int]:
    """A warm-up step, then one step (forward, backward, gradient synchronisation, Adam) timed with CUDA events
    from an idle device, as a GPU script times it; returns the second step's seconds and the most device memory
    allocated in it (bytes; building and sharding the model, when every rank holds the full model for a
    moment, comes before and is left out)."""
    device = setup()
    torch.manual_seed(0)
    net = nn.Sequential(*[m for _ in range(LAYERS) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())])
    model = WRAPPERS[wrapper](net.to(device))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(dist.get_rank())).to(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(2):
        dist.barrier()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start.record()
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        if isinstance(model, FSDP):
            model.finish_gradient_synchronization()
        opt.step()
        end.record()
        torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3, torch.cuda.max_memory_allocated()


def timing(verdicts: list[tuple[str, bool, str]], page: simdist.report.ScenarioReport) -> None:
    """Step time and peak memory per rank of each wrapper on one DGX-H100 node (H100 cost model)."""
    cluster = simdist.Cluster.preset("dgx-h100", world_size=TIMING_WORLD)
    print(
        f"Step time per wrapper: {LAYERS}x Linear({WIDTH}) float32, Adam, {ROWS} rows per rank, "
        f"{TIMING_WORLD} ranks of {cluster.name} (H100 cost model); the second of two steps, as CUDA events and "
        "torch.cuda's memory statistics measure it"
    )
    print(f"  {'wrapper':20s} {'step (us)':>10s} {'peak memory per rank in the step':>33s}")
    figures: dict[str, tuple[float, float]] = {}
    runs = {}
    for name in WRAPPERS:
        res = simdist.run(timed_step, cluster, args=(name,), memory=True, races="off")
        figures[name] = (max(t for t, _ in res.returns), max(peak for _, peak in res.returns))
        runs[name] = res
        print(f"  {name:20s} {figures[name][0] * 1e6:10.1f} {figures[name][1] / 2**20:29.2f} MiB")
    print()
    page.bar_plot(
        "Step time per wrapper",
        {n: {"step": t} for n, (t, _) in figures.items()},
        y_label="simulated step",
        unit="time",
        nav="step time",
        note=f"{LAYERS}x Linear({WIDTH}) float32, Adam, {ROWS} rows per rank, {TIMING_WORLD} ranks of "
        f"{cluster.name} (H100 cost model); the second of two steps.",
    )
    page.bar_plot(
        "Peak memory per rank, per wrapper",
        {n: {"peak": b} for n, (_, b) in figures.items()},
        y_label="peak live bytes",
        unit="bytes",
        nav="memory",
        note="The most device memory any rank allocated during the timed step "
        "(torch.cuda.max_memory_allocated(): parameters, gradients, Adam's state, activations, "
        "gathered weights).",
    )
    page.runs(
        "DDP vs FSDP",
        {"DDP": runs["DDP"], "FSDP": runs["FSDP"]},
        ranks=[0, 1, TIMING_WORLD - 1],
        nav="timelines",
        note="Both steps of each run (warm-up, then the timed one).",
    )
    ddp, fsdp = figures["DDP"][1], figures["FSDP"][1]
    verdicts.append(
        (
            "FSDP holds less memory per rank than DDP",
            fsdp < ddp,
            f"peak {fsdp / 2**20:.1f} vs {ddp / 2**20:.1f} MiB",
        )
    )


# ---------------------------------------------------------------------------------------------- real gloo
def on_real(variants: list[Variant], seed: int) -> list[simdist.EquivalenceReport]:
    """The variants on one launch of real gloo processes, one per rank, each emulating its GPU and running them in
    turn: each one's final state against the reference's."""
    from real.oracle import FinalStateCheck, check_final_states

    checks = [
        FinalStateCheck(train, reference, seed, (v.layout, seed), loss=loss_mode(v.layout)) for v in variants
    ]
    with importable_by_rank_processes(Path(__file__).parent):
        return check_final_states(checks, WORLD, backend="nccl", emulate_cuda=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--real", action="store_true", help="also run every variant on real gloo processes")
    ap.add_argument(
        "--out",
        type=Path,
        default=REPORTS,
        metavar="DIR",
        help="where the HTML report is written (default: %(default)s)",
    )
    args = ap.parse_args(argv)
    verdicts: list[tuple[str, bool, str]] = []
    page = simdist.report.ScenarioReport(
        "FSDP hazards",
        description=__doc__,
        seed=args.seed,
        command=f"python scenarios/fsdp_hazards.py --seed {args.seed}" + (" --real" if args.real else ""),
    )
    outcome = simulated(args.seed, verdicts, page)
    timing(verdicts, page)
    if args.real:
        on_real_gloo(CASES, lambda vs: on_real(vs, args.seed), outcome, verdicts, page=page)
    return finish(page, verdicts, args.out, "fsdp_hazards")


if __name__ == "__main__":
    sys.exit(main())
