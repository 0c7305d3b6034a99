"""Which gradient synchronisation is right for which pipeline layout: PipelineOptimizer's modes against one process.

A pipeline's stages either hold replicas of one model or different partitions of it, and the optimizer's
gradient synchronisation is right for one of the two only. Every case trains a small float64 model for a few
SGD steps with a hand-written GPipe schedule (send/recv of activations and their gradients per microbatch) and
``simdist.strategies.PipelineOptimizer``, and compares it with the single-process model trained on the full
batch through the equivalence oracle (``simdist.check_equivalence``): the first divergent step and tensor, the
largest parameter difference after the last step, and the loss by step. Every rank is written as for torchrun
on GPUs (NCCL, the GPU its LOCAL_RANK names, its stage and each batch moved to it) and runs on the first GPUs of
a simulated DGX-H100 node; the reference runs in one process on the CPU.

(a) Partitioned stages of different shapes: AVERAGE and SUM match parameters by position across stages and
    refuse the shapes; STAGE_WISE (each stage steps its own parameters) equals one process.
(b) Partitioned stages of identical shapes (equal blocks): AVERAGE raises nothing and trains another model,
    each stage's gradients averaged with the other stage's; STAGE_WISE equals one process.
(c) Two stages x two data-parallel replicas: STAGE_WISE with the stage's ``dp_group`` equals one process;
    AVERAGE over all four ranks does not; NONE lets the replicas of a stage drift apart.
(d) An embedding tied between the first and the last stage, each holding a copy: without ``ties`` the copies
    drift apart; with it (their gradients summed across the two stages) the model equals one process.
(e) The microbatch loss not divided by the number of microbatches: every gradient is that many times too large.
(f) Parameters broadcast from stage 0 after the step, across partitioned stages: refused for stages of
    different shapes, and silently overwriting the last stage's parameters with the first stage's for equal ones.
(g) A stage that stops sending: the next stage's receive times out, and the error names the stage, the
    microbatch, the operation and the simulated time.
(h) A hand-written 1F1B exchange of 8 MiB activations where both neighbours send before they receive: a
    deadlock under NCCL's progress that names both sends (messages that fit NCCL's 4 MiB staging buffer leave
    without waiting for their receive); with ``batch_isend_irecv`` it runs and equals one process.

Then the partitioned stages under GPipe and under 1F1B on simulated H100s: each stage's bubble (the share of
the run its compute is idle) and the two timelines, in the HTML report pipeline_sync.html (in the output
directory, reports/ by default).

With ``--real`` every case also runs on real gloo processes (one per rank, through ``real``, each emulating its
GPU): the same errors, and the final state compared with the reference's (``real.oracle.check_final_state``)
must agree with the simulated verdict.

Usage: python scenarios/pipeline_sync.py [--seed N] [--real] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from oracle_cases import Case, CaseSections, Outcome, Variant, on_real_gloo, outcome_of, show, verdict
from torch import nn
from verdicts import finish, importable_by_rank_processes

import simdist
import simdist.report
from simdist.strategies import GradientSyncMode, PipelineOptimizer, PipelineOptimizerConfig

D_IN, HIDDEN, D_OUT = 6, 8, 3
#: width of every block of the "equal" model (its stages hold parameters of identical shapes)
WIDTH = 8
#: the language model of case (d): vocabulary, embedding width, tokens per row
VOCAB, DIM, SEQ = 12, 6, 4
BATCH, STEPS, LR = 8, 3, 0.1
#: milliseconds a stage waits for its neighbour before it gives up (case g): simulated ones under simdist; real
#: processes get REAL_TIMEOUT_MS, since a loaded machine can start one process seconds after the other
TIMEOUT_MS, REAL_TIMEOUT_MS = 50, 5_000
REPORTS = Path(__file__).resolve().parent.parent / "reports"


# ------------------------------------------------------------------------------------------- models, data
def setup() -> torch.device:
    """What a script launched by torchrun on GPUs does first: NCCL, and the GPU its LOCAL_RANK names."""
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


class Stack(nn.Module):
    """Layers applied in turn; a stage is the whole stack with the other stages' layers replaced by identities,
    so its parameters keep the single-process model's names."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def build(kind: str, seed: int) -> Stack:
    """The single-process model: "partitioned" (two layers of different shapes), "equal" (two blocks of
    identical shapes) or "tied" (embedding, hidden block, projection sharing the embedding's weight)."""
    torch.manual_seed(seed)
    if kind == "partitioned":
        layers = [nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Tanh()), nn.Linear(HIDDEN, D_OUT)]
    elif kind == "equal":
        layers = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()), nn.Linear(WIDTH, WIDTH)]
    else:
        layers = [
            nn.Embedding(VOCAB, DIM),
            nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()),
            nn.Linear(DIM, VOCAB, bias=False),
        ]
        layers[2].weight = layers[0].weight
    return Stack(layers).double()


#: which layers each of the two stages owns
OWNED = {"partitioned": ((0,), (1,)), "equal": ((0,), (1,)), "tied": ((0, 1), (2,))}


def stage_model(kind: str, seed: int, stage: int) -> Stack:
    """Stage ``stage`` of ``kind``'s model: its own layers, identities elsewhere; a tied projection gets its own copy."""
    model = build(kind, seed)
    if kind == "tied" and stage == 1:
        model.layers[2].weight = nn.Parameter(model.layers[0].weight.detach().clone())
    for i in range(len(model.layers)):
        if i not in OWNED[kind][stage]:
            model.layers[i] = nn.Identity()
    return model


def batch(kind: str, step: int, seed: int, rows: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of optimizer step ``step`` (``rows`` rows): inputs and targets, on the host (as a data
    loader gives them)."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    if kind == "tied":
        t = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
        return t[:, :-1], t[:, 1:]
    d_in, d_out = (D_IN, D_OUT) if kind == "partitioned" else (WIDTH, WIDTH)
    x = torch.randn(rows, d_in, generator=g, dtype=torch.float64)
    return x, torch.randn(rows, d_out, generator=g, dtype=torch.float64)


def loss_of(kind: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if kind == "tied":
        return F.cross_entropy(out.reshape(-1, VOCAB), target.reshape(-1))
    return F.mse_loss(out, target)


def boundary(kind: str, rows: int) -> tuple[int, ...]:
    """Shape of the activation the first stage sends the second for ``rows`` rows."""
    return (rows, SEQ, DIM) if kind == "tied" else (rows, HIDDEN if kind == "partitioned" else WIDTH)


# --------------------------------------------------------------------------------------------- the layouts
@dataclass(frozen=True)
class Layout:
    """One variant of a case: the model, the ranks, the optimizer's configuration and what the program does."""

    kind: str
    mode: GradientSyncMode
    #: data-parallel replicas of the two-stage pipeline (ranks = 2 x dp; rank = replica * 2 + stage)
    dp: int = 1
    micro: int = 2
    broadcast: bool = False
    #: reduce gradients over the replicas of a stage (STAGE_WISE's dp_group)
    dp_group: bool = True
    #: the pipeline group is every rank instead of the replica's two stages
    world_pipeline: bool = False
    ties: bool = False
    scale_loss: bool = True
    #: (step, microbatch) at which the first stage stops sending
    stop: tuple[int, int] | None = None
    #: "gpipe", or "1f1b-blocking" / "1f1b-batched" (two stages exchanging in the steady state)
    schedule: str = "gpipe"
    timeout_ms: int = TIMEOUT_MS
    #: rows of the global batch
    rows: int = BATCH

    @property
    def world(self) -> int:
        return 2 * self.dp


def groups(layout: Layout) -> tuple[Any, Any]:
    """(this rank's pipeline group, its data-parallel group); every rank creates every group, as new_group requires."""
    rank = dist.get_rank()
    pipelines = [dist.new_group([2 * r, 2 * r + 1]) for r in range(layout.dp)]
    replicas = (
        [dist.new_group(list(range(s, layout.world, 2))) for s in (0, 1)] if layout.dp > 1 else [None, None]
    )
    pp = None if layout.world_pipeline or layout.dp == 1 else pipelines[rank // 2]
    return pp, replicas[rank % 2] if layout.dp_group else None


def _wait(layout: Layout, work: Any, stage: int, what: str, micro: int) -> None:
    """Wait for a point-to-point operation, at most the layout's timeout; a timeout names the stage, microbatch
    and op."""
    try:
        work.wait(timeout=timedelta(milliseconds=layout.timeout_ms))
    except Exception as e:  # the backend's timeout error (simdist's names the simulated time)
        raise TimeoutError(
            f"stage {stage}: {what} of microbatch {micro} did not complete within {layout.timeout_ms} ms "
            f"({type(e).__name__}: {str(e).splitlines()[0]})"
        ) from e


def gpipe(
    layout: Layout, model: Stack, stage: int, peer: int, x: torch.Tensor, y: torch.Tensor, step: int
) -> float | None:
    """One GPipe step: every microbatch forward, then every backward in reverse; the last stage's summed loss
    (None when the first stage stops answering)."""
    micro_x, micro_y = x.chunk(layout.micro), y.chunk(layout.micro)
    inputs: list[torch.Tensor] = []
    outputs: list[torch.Tensor] = []
    for k, xk in enumerate(micro_x):
        if stage == 0:
            out = model(xk)
            if layout.stop == (step, k):
                return None  # the stage stops answering: it sends nothing more
            _wait(layout, dist.isend(out.detach(), peer), stage, "send of the activation", k)
        else:
            h = torch.empty(boundary(layout.kind, xk.shape[0]), dtype=torch.float64, device=xk.device)
            _wait(layout, dist.irecv(h, peer), stage, "recv of the activation", k)
            h.requires_grad_()
            inputs.append(h)
            out = model(h)
        outputs.append(out)
    total = 0.0
    for k in reversed(range(len(outputs))):
        if stage == 1:
            loss = loss_of(layout.kind, outputs[k], micro_y[k])
            (loss / layout.micro if layout.scale_loss else loss).backward()
            total += loss.item() / layout.micro
            _wait(layout, dist.isend(inputs[k].grad, peer), stage, "send of the input gradient", k)
        else:
            g = torch.empty_like(outputs[k])
            _wait(layout, dist.irecv(g, peer), stage, "recv of the output gradient", k)
            outputs[k].backward(g)
    return total


def exchange(layout: Layout, send: torch.Tensor, recv: torch.Tensor, peer: int) -> None:
    """Send one tensor to the neighbour and receive one from it: blocking (send, then recv) or batched."""
    if layout.schedule == "1f1b-blocking":
        dist.send(send, peer)  # both neighbours block here
        dist.recv(recv, peer)
        return
    for work in dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]
    ):
        work.wait()


def one_f_one_b(
    layout: Layout, model: Stack, stage: int, peer: int, x: torch.Tensor, y: torch.Tensor
) -> float:
    """One 1F1B step on two stages: in the steady state the first stage sends microbatch k+1's activation while
    the second sends microbatch k's input gradient, an exchange between the two."""
    micro_x, micro_y = x.chunk(layout.micro), y.chunk(layout.micro)
    m, total = layout.micro, 0.0
    if stage == 0:
        outputs = [model(micro_x[0])]
        dist.send(outputs[0].detach(), peer)
        for k in range(m):
            g = torch.empty_like(outputs[k])
            if k + 1 < m:
                outputs.append(model(micro_x[k + 1]))
                exchange(layout, outputs[k + 1].detach(), g, peer)
            else:
                dist.recv(g, peer)
            outputs[k].backward(g)
        return total
    h = torch.empty(boundary(layout.kind, micro_x[0].shape[0]), dtype=torch.float64, device=x.device)
    dist.recv(h, peer)
    for k in range(m):
        h.requires_grad_()
        loss = loss_of(layout.kind, model(h), micro_y[k])
        (loss / m).backward()
        total += loss.item() / m
        if k + 1 < m:
            nxt = torch.empty(
                boundary(layout.kind, micro_x[k + 1].shape[0]), dtype=torch.float64, device=x.device
            )
            exchange(layout, h.grad, nxt, peer)
            h = nxt
        else:
            dist.send(h.grad, peer)
    return total


def train(layout: Layout, seed: int) -> dict[str, Any]:
    """A rank of the pipeline on its GPU: its stage's model, PipelineOptimizer, STEPS steps; its losses and parameters."""
    device = setup()
    rank = dist.get_rank()
    stage, replica = rank % 2, rank // 2
    pp, dp = groups(layout)
    model = stage_model(layout.kind, seed, stage).to(device)
    ties = (
        [{2 * r: "layers.0.weight", 2 * r + 1: "layers.2.weight"} for r in range(layout.dp)]
        if layout.ties
        else []
    )
    config = PipelineOptimizerConfig(layout.mode, broadcast_parameters=layout.broadcast)
    losses = []
    with PipelineOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR), [model], config, pp_group=pp, dp_group=dp, ties=ties
    ) as opt:
        for step in range(STEPS):
            x, y = batch(layout.kind, step, seed, layout.rows)
            x, y = x.chunk(layout.dp)[replica].to(device), y.chunk(layout.dp)[replica].to(device)
            opt.zero_grad()
            peer = rank + 1 if stage == 0 else rank - 1
            loss = (
                gpipe(layout, model, stage, peer, x, y, step)
                if layout.schedule == "gpipe"
                else one_f_one_b(layout, model, stage, peer, x, y)
            )
            if loss is None:
                break
            losses.append(loss)
            opt.step()
    return {"losses": losses if stage == 1 else [], "params": _params(model)}


def reference(layout: Layout, seed: int) -> dict[str, Any]:
    """The single-process model trained on the full batch, the mean loss."""
    model = build(layout.kind, seed)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = batch(layout.kind, step, seed, layout.rows)
        opt.zero_grad()
        loss = loss_of(layout.kind, model(x), y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
    return {"losses": losses, "params": _params(model)}


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# --------------------------------------------------------------------------------------------------- the cases
SW, AVG, SUM, NONE = (
    GradientSyncMode.STAGE_WISE,
    GradientSyncMode.AVERAGE,
    GradientSyncMode.SUM,
    GradientSyncMode.NONE,
)
PART, EQ = Layout("partitioned", SW), Layout("equal", SW)
TIED = Layout("tied", SW)
#: the partitioned stages with activations of 8 MiB per microbatch (two microbatches of float64 rows of HIDDEN),
#: past NCCL's staging buffer (NCCL_BUFFSIZE, 4 MiB): on GPUs a smaller send between connected ranks leaves
#: without waiting for its receive, a larger one waits for it
LARGE = replace(PART, rows=2 * (8 * 2**20) // (HIDDEN * 8))

CASES = [
    Case(
        "a",
        "partitioned stages of different shapes",
        (
            Variant(
                "AVERAGE",
                replace(PART, mode=AVG),
                "raises",
                ("stage 0", "stage 1", "layers.0.0.weight", "layers.1.weight"),
                "PipelineShapeError",
            ),
            Variant("SUM", replace(PART, mode=SUM), "raises", ("stage 0", "stage 1"), "PipelineShapeError"),
            Variant("STAGE_WISE", PART, "equal"),
        ),
    ),
    Case(
        "b",
        "partitioned stages of identical shapes",
        (
            Variant(
                "AVERAGE", replace(EQ, mode=AVG), "diverges", ("layers.1.weight", "layers.0.0.weight"), "grad"
            ),
            Variant("STAGE_WISE", EQ, "equal"),
        ),
    ),
    Case(
        "c",
        "two stages x two data-parallel replicas",
        (
            Variant("STAGE_WISE, dp_group", replace(EQ, dp=2), "equal"),
            Variant(
                "AVERAGE over all ranks",
                replace(EQ, mode=AVG, dp=2, world_pipeline=True),
                "diverges",
                ("layers.1.weight",),
                "grad",
            ),
            Variant(
                "NONE",
                replace(EQ, mode=NONE, dp=2, dp_group=False),
                "diverges",
                ("layers.1.weight",),
                "grad",
                replicas=True,
            ),
        ),
    ),
    Case(
        "d",
        "embedding tied between the first and the last stage",
        (
            Variant("STAGE_WISE, no ties", TIED, "diverges", ("layers.2.weight",), "grad"),
            Variant("STAGE_WISE, ties", replace(TIED, ties=True), "equal"),
        ),
    ),
    Case(
        "e",
        "microbatch loss not divided by the number of microbatches",
        (
            Variant(
                "loss not divided",
                replace(PART, micro=4, scale_loss=False),
                "diverges",
                ("layers.1.bias",),
                "loss",
                scale=4.0,
            ),
            Variant("loss / microbatches", replace(PART, micro=4), "equal"),
        ),
    ),
    Case(
        "f",
        "parameters broadcast from stage 0 across partitioned stages",
        (
            Variant(
                "different shapes",
                replace(PART, mode=NONE, broadcast=True),
                "raises",
                ("stage 0", "stage 1"),
                "PipelineShapeError",
            ),
            # the oracle captures at the base optimizer's step, before the broadcast: the damage shows a step later
            Variant(
                "identical shapes",
                replace(EQ, mode=NONE, broadcast=True),
                "diverges",
                ("layers.1.weight",),
                "loss",
            ),
        ),
    ),
    Case(
        "g",
        "a stage stops sending",
        (
            Variant(
                "stops at step 1, microbatch 1",
                replace(PART, stop=(1, 1)),
                "raises",
                ("stage 1", "recv of the activation of microbatch 1", "simulated"),
                "TimeoutError",
            ),
        ),
    ),
    Case(
        "h",
        "1F1B exchange of 8 MiB activations between neighbours",
        (
            Variant(
                "send, then recv",
                replace(LARGE, schedule="1f1b-blocking"),
                "raises",
                ("rank 0: waits in send", "rank 1: waits in send"),
                "DeadlockError",
            ),
            Variant("batch_isend_irecv", replace(LARGE, schedule="1f1b-batched"), "equal"),
        ),
    ),
]

#: the tied projection's copy is the reference's embedding
NAMES = {"layers.2.weight": "layers.0.weight"}


def cluster(world: int) -> simdist.Cluster:
    """``world`` GPUs of one DGX-H100 node (the first ones, as ``torchrun --nproc-per-node`` takes them)."""
    return simdist.Cluster.preset("dgx-h100", world_size=world)


def simulate(v: Variant, seed: int) -> Outcome:
    """Run the variant through the oracle; a program error is the outcome (the rank's own exception if one raised)."""
    return outcome_of(
        lambda: simdist.check_equivalence(
            train,
            reference,
            cluster(v.layout.world),
            args=(v.layout, seed),
            seed=seed,
            loss="accumulated",
            names=NAMES if v.layout.kind == "tied" else None,
            localize=False,
            progress="nccl",
        )
    )


def simulated(
    seed: int, verdicts: list[tuple[str, bool, str]], page: simdist.report.ScenarioReport
) -> dict[tuple[str, str], bool]:
    """Every variant under simdist; returns whether each equalled one process (or raised), for --real."""
    print(
        f"Pipeline gradient synchronisation: two stages (x replicas), GPipe with microbatches, {STEPS} SGD steps, "
        f"float64, seed {seed}; each against one process on the full batch"
    )
    print()
    outcome: dict[tuple[str, str], bool] = {}
    sections = CaseSections()
    for case in CASES:
        print(f"({case.key}) {case.title}")
        for v in case.variants:
            o = simulate(v, seed)
            show(v, o, NAMES)
            ok, detail = verdict(v, o)
            verdicts.append((f"({case.key}) {v.label}: {v.expect}", ok, detail))
            sections.add(case, v, o, ok, detail)
            outcome[(case.key, v.label)] = o.report.ok if o.report is not None else False
        print()
    sections.write(
        page,
        f"Two stages (x replicas), GPipe with microbatches unless the variant says otherwise, {STEPS} SGD "
        f"steps, float64, seed {seed}; each against one process on the full batch.",
    )
    return outcome


#: microbatches of the schedule comparison
SCHEDULE_MICRO = 4


def schedules(seed: int, page: simdist.report.ScenarioReport) -> None:
    """The partitioned stages under GPipe and under 1F1B with the H100 compute model: each stage's bubble."""
    runs = {}
    for name, schedule in (("GPipe", "gpipe"), ("1F1B", "1f1b-batched")):
        layout = replace(PART, schedule=schedule, micro=SCHEDULE_MICRO)
        runs[name] = simdist.run(train, cluster(layout.world), args=(layout, seed), seed=seed)
    idle = {
        name: [1 - res.trace.busy_time(r, "compute") / res.sim_time for r in range(res.world_size)]
        for name, res in runs.items()
    }
    print(
        f"Bubble per schedule: the partitioned stages, {SCHEDULE_MICRO} microbatches, {STEPS} steps, H100 compute model"
    )
    for name, res in runs.items():
        shares = ", ".join(f"stage {r} {v * 100:.1f}%" for r, v in enumerate(idle[name]))
        print(f"  {name:6s} simulated {res.sim_time * 1e6:8.1f} us; compute idle: {shares}")
    print()
    page.bar_plot(
        "Bubble per schedule",
        {name: {f"stage {r}": v for r, v in enumerate(shares)} for name, shares in idle.items()},
        y_label="idle share of compute",
        unit="percent",
        nav="bubble",
        note=f"The two partitioned stages with {SCHEDULE_MICRO} microbatches and {STEPS} SGD steps under the "
        "two hand-written schedules, on simulated H100s: the share of the run each stage's compute "
        "stream is idle (pipeline bubble, waiting on the other stage, the optimizer's step).",
    )
    page.runs("GPipe vs 1F1B", runs, nav="schedules")


# ---------------------------------------------------------------------------------------------- real gloo
def on_real(variants: list[Variant], seed: int) -> list[simdist.EquivalenceReport]:
    """The variants on real gloo processes, one per rank, a launch per world size running its variants in turn:
    each one's final state against the reference's."""
    from real.oracle import FinalStateCheck, check_final_states

    reports: dict[int, simdist.EquivalenceReport] = {}
    for world in sorted({v.layout.world for v in variants}):
        chosen = [k for k, v in enumerate(variants) if v.layout.world == world]
        checks = [
            FinalStateCheck(
                train,
                reference,
                seed,
                (replace(variants[k].layout, timeout_ms=REAL_TIMEOUT_MS), seed),
                loss="accumulated",
                names=NAMES if variants[k].layout.kind == "tied" else None,
            )
            for k in chosen
        ]
        with importable_by_rank_processes(Path(__file__).parent):
            reports.update(zip(chosen, check_final_states(checks, world, backend="nccl", emulate_cuda=True)))
    return [reports[k] for k in range(len(variants))]


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
        "Pipeline gradient synchronisation",
        description=__doc__,
        seed=args.seed,
        command=f"python scenarios/pipeline_sync.py --seed {args.seed}" + (" --real" if args.real else ""),
    )
    outcome = simulated(args.seed, verdicts, page)
    schedules(args.seed, page)
    if args.real:
        on_real_gloo(CASES, lambda vs: on_real(vs, args.seed), outcome, verdicts, page=page)
    return finish(page, verdicts, args.out, "pipeline_sync")


if __name__ == "__main__":
    sys.exit(main())
