"""The equivalence oracle on torch's own pipeline parallelism (``torch.distributed.pipelining``).

Each rank builds the whole model from the same seed and deletes the blocks its stages do not own, as torchtitan
does, so the stages keep the reference's qualified names; a schedule trains them on microbatches of the full
batch with a mean loss. The reference is the single-process model on the full batch.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
    SplitPoint,
    pipeline,
)

import simdist

WIDTH, OUT, BLOCKS, BATCH, MICROBATCHES, STEPS = 4, 3, 4, 8, 4, 3
#: schedule -> (its class, stages per rank, placement of stage s of n on r ranks: "loop" s % r, or "v")
SCHEDULES = {
    "GPipe": (ScheduleGPipe, 1, "loop"),
    "1F1B": (Schedule1F1B, 1, "loop"),
    "Interleaved1F1B": (ScheduleInterleaved1F1B, 2, "loop"),
    "LoopedBFS": (ScheduleLoopedBFS, 2, "loop"),
    "InterleavedZeroBubble": (ScheduleInterleavedZeroBubble, 2, "loop"),
    "ZBVZeroBubble": (ScheduleZBVZeroBubble, 2, "v"),
}
#: every parameter of the model: two per block and two of the head
PARAMETERS = 2 * BLOCKS + 2


class Model(nn.Module):
    """Blocks of Linear + Tanh and a Linear head; a stage deletes what it does not own (torchtitan's way)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for i in range(BLOCKS)})
        self.head: nn.Linear | None = nn.Linear(WIDTH, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers.values():
            x = block(x)
        return self.head(x) if self.head is not None else x


def build() -> Model:
    torch.manual_seed(1234)
    return Model().double()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64),
            torch.randn(BATCH, OUT, generator=g, dtype=torch.float64))


def make_optimizer(name: str, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=0.01)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def reference(optimizer: str = "sgd", reduction: str = "mean") -> None:
    """The whole model on the full batch with the mean (or summed) loss."""
    m = build()
    opt = make_optimizer(optimizer, list(m.parameters()))
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        F.mse_loss(m(x), y, reduction=reduction).backward()
        opt.step()


def stage_indices(schedule: str, rank: int, ranks: int) -> list[int]:
    """The stages ``rank`` of ``ranks`` pipeline ranks holds, in the order its schedule takes them."""
    _, per, placement = SCHEDULES[schedule]
    if placement == "v":
        return [rank, 2 * ranks - 1 - rank]
    return [rank + i * ranks for i in range(per)]


def owned(stage: int, stages: int) -> list[str]:
    """The blocks of stage ``stage`` of ``stages``: an equal run of consecutive blocks."""
    per = BLOCKS // stages
    return [str(i) for i in range(stage * per, (stage + 1) * per)]


def torchtitan_stage(stage: int, stages: int) -> nn.Module:
    """The whole model with the blocks (and head) of other stages deleted: qualified names are kept."""
    m = build()
    for name in list(m.layers):
        if name not in owned(stage, stages):
            del m.layers[name]
    if stage != stages - 1:
        m.head = None
    return m


def bare_stage(stage: int, stages: int) -> nn.Module:
    """The stage's blocks (and head) copied into a bare Sequential: names are ``2.0.weight``, ``head.weight``."""
    m = build()
    parts = [(name, m.layers[name]) for name in owned(stage, stages)]
    if stage == stages - 1:
        parts.append(("head", m.head))
    return nn.Sequential(OrderedDict(parts))


def pipelined(
    schedule: str,
    optimizer: str = "sgd",
    dp: int = 1,
    bare: bool = False,
    unscaled: tuple[int, int] | None = None,
    loss_divided_twice: bool = False,
    reduction: str = "mean",
) -> None:
    """Train with torch's pipelining: ``dp`` pipelines of ``world // dp`` consecutive ranks each.

    ``dp`` data-parallel replicas of the pipeline each take an equal slice of the batch and average their
    gradients over the data-parallel group before the step. ``unscaled=(step, rank)`` makes ``rank`` skip the
    division of its gradients by the number of microbatches at ``step``; ``loss_divided_twice`` divides each
    microbatch's mean loss by the number of microbatches once more. ``reduction="sum"`` sums each microbatch's
    loss and leaves the gradients unscaled, as torch's schedules expect of a summed loss.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    pp = world // dp
    # rank = replica * pp + pipeline position: pipelines are runs of consecutive ranks
    pp_groups = [dist.new_group(list(range(d * pp, (d + 1) * pp))) for d in range(dp)]
    dp_groups = [dist.new_group(list(range(p, world, pp))) for p in range(pp)]
    replica, position = divmod(rank, pp)
    cls, per, _ = SCHEDULES[schedule]
    stages = per * pp
    mine = stage_indices(schedule, position, pp)
    modules = [(bare_stage if bare else torchtitan_stage)(s, stages) for s in mine]
    cpu = torch.device("cpu")
    pipeline = [PipelineStage(m, s, stages, cpu, group=pp_groups[replica]) for m, s in zip(modules, mine)]
    microbatches = MICROBATCHES // dp
    divisor = microbatches if loss_divided_twice else 1

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out, target, reduction=reduction) / divisor

    sched = cls(pipeline if per > 1 else pipeline[0], microbatches, loss_fn=loss_fn)
    scale = reduction == "mean"
    opt = make_optimizer(optimizer, [p for m in modules for p in m.parameters()])
    rows = BATCH // dp
    first, last = 0 in mine, stages - 1 in mine
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x[replica * rows : (replica + 1) * rows], y[replica * rows : (replica + 1) * rows]
        sched.scale_grads = scale and unscaled != (step, rank)
        opt.zero_grad()
        sched.step(*([x] if first else []), **({"target": y} if last else {}))
        if dp > 1:
            for m in modules:
                for p in m.parameters():
                    dist.all_reduce(p.grad, group=dp_groups[position])
                    p.grad /= dp
        opt.step()


def check(schedule: str, world: int = 2, **options: object) -> simdist.EquivalenceReport:
    """``pipelined(schedule, **options)`` on ``world`` ranks against the reference.

    ``names``, ``loss`` and ``localize`` (off unless asked for) go to the oracle, the rest to ``pipelined``.
    """
    oracle: dict = {"localize": False}
    oracle.update({k: options.pop(k) for k in ("names", "loss", "localize") if k in options})
    return simdist.check_equivalence(
        pipelined, reference, simdist.Cluster.switch(world, device="cpu"), args=(schedule,), kwargs=options,
        reference_args=(options.get("optimizer", "sgd"), options.get("reduction", "mean")), reference_kwargs={},
        compute=False, **oracle,
    )


def assert_whole_model_compared(rep: simdist.EquivalenceReport, optimizer: str) -> None:
    """Every step compared the loss and every parameter, gradient and optimizer state tensor of the model."""
    assert rep.steps == STEPS
    assert rep.compared["parameters"] == PARAMETERS and rep.compared["gradients"] == PARAMETERS
    state = 3 if optimizer == "adam" else 1  # exp_avg, exp_avg_sq, step; momentum_buffer
    assert rep.compared["optimizer state tensors"] == state * PARAMETERS
    assert rep.compared["loss"] == 1


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_clean_pipeline_matches_the_single_process_model(schedule: str) -> None:
    optimizer = "adam" if SCHEDULES[schedule][1] > 1 else "sgd"
    rep = check(schedule, optimizer=optimizer)
    assert rep.ok, str(rep)
    assert_whole_model_compared(rep, optimizer)


def stage_parameters(schedule: str, rank: int, ranks: int) -> set[str]:
    """The qualified names of the parameters ``rank`` holds."""
    stages = SCHEDULES[schedule][1] * ranks
    out: set[str] = set()
    for s in stage_indices(schedule, rank, ranks):
        out |= {f"layers.{b}.0.{w}" for b in owned(s, stages) for w in ("weight", "bias")}
        if s == stages - 1:
            out |= {"head.weight", "head.bias"}
    return out


def assert_unscaled_found(rep: simdist.EquivalenceReport, schedule: str, step: int, ranks: tuple[int, ...],
                          position: int, pp: int, bare: bool = False) -> None:
    """The gradients of exactly the stages at pipeline ``position`` diverge first, at ``step``, on ``ranks``.

    Divergences carry the parallel program's names: a bare stage's lack the ``layers.`` prefix.
    """
    assert not rep.ok and rep.first.step == step, str(rep)
    assert rep.first.kind == "grad" and rep.first.ranks == ranks, str(rep)
    grads = {d.name for d in rep.divergences if d.kind == "grad"}
    expected = stage_parameters(schedule, position, pp)
    assert grads == ({n.removeprefix("layers.") for n in expected} if bare else expected), str(rep)
    assert not any(d.kind == "loss" for d in rep.divergences), "the loss is computed before the scaling"


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_stage_that_skips_scaling_its_gradients_is_found(schedule: str) -> None:
    rep = check(schedule, unscaled=(1, 1))
    assert_unscaled_found(rep, schedule, 1, (1,), 1, 2)


@pytest.mark.parametrize("schedule", ["GPipe", "Interleaved1F1B", "ZBVZeroBubble"])
def test_localisation_names_the_unscaled_gradient_and_its_factor(schedule: str) -> None:
    # shape inference before the first step is not recorded: step 0 aligns microbatch by microbatch
    rep = check(schedule, unscaled=(0, 1), localize=True)
    loc = rep.localization
    assert loc is not None, rep.localization_note
    assert loc.phase == "optimizer" and loc.ranks == (1,), str(loc)
    assert "the gradient of 'layers." in loc.note and f"{MICROBATCHES} x the reference's" in loc.note, str(loc)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_loss_divided_by_the_microbatches_twice_is_found_at_the_first_step(schedule: str) -> None:
    rep = check(schedule, loss_divided_twice=True)
    assert not rep.ok and rep.first.step == 0 and rep.first.kind == "loss", str(rep)
    # every microbatch's loss is recorded once, on the rank of the last stage
    assert "mean of 4 backward roots" in rep.first.detail, str(rep)
    assert rep.first.difference.rel == pytest.approx(1 - 1 / MICROBATCHES, rel=1e-9)
    every = stage_parameters(schedule, 0, 2) | stage_parameters(schedule, 1, 2)
    assert {d.name for d in rep.divergences if d.kind == "grad"} == every, str(rep)


@settings(max_examples=8)  # each example is two simulated runs of about 0.1 s
@given(schedule=st.sampled_from(sorted(SCHEDULES)), step=st.integers(0, STEPS - 1), rank=st.integers(0, 1),
       optimizer=st.sampled_from(["sgd", "adam"]))
def test_a_perturbed_stage_is_found_at_its_step_and_rank(schedule: str, step: int, rank: int, optimizer: str) -> None:
    rep = check(schedule, optimizer=optimizer, unscaled=(step, rank))
    assert_unscaled_found(rep, schedule, step, (rank,), rank, 2)


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B"])
def test_data_parallel_pipelines_match_and_a_fault_in_one_replica_is_found(schedule: str) -> None:
    """4 ranks: 2 pipelines of 2 ranks; ranks 0 and 2 (1 and 3) hold the same stages and average their gradients."""
    rep = check(schedule, world=4, dp=2)
    assert rep.ok, str(rep)
    assert_whole_model_compared(rep, "sgd")
    # rank 3's unscaled gradients enter the average: both replicas of the second position hold the wrong one
    rep = check(schedule, world=4, dp=2, unscaled=(1, 3))
    assert_unscaled_found(rep, schedule, 1, (1, 3), 1, 2)
    assert not any(d.kind == "replica" for d in rep.divergences), "the replicas agree with each other"


@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
def test_summed_microbatch_losses_are_compared_with_loss_sum(schedule: str) -> None:
    """A summed loss per microbatch with unscaled gradients is the full batch's summed loss: ``loss="sum"``."""
    rep = check(schedule, reduction="sum", loss="sum")
    assert rep.ok, str(rep)
    assert_whole_model_compared(rep, "sgd")
    # the default mean of the 4 microbatch sums is a quarter of the full batch's sum
    rep = check(schedule, reduction="sum")
    assert rep.first.kind == "loss" and rep.first.difference.rel == pytest.approx(0.75, rel=1e-9), str(rep)


def sharded(unscaled: tuple[int, int] | None = None) -> None:
    """torchtitan's DP x PP on 4 ranks: a (dp 2, pp 2) mesh, each stage sharded with ``fully_shard`` over "dp"."""
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    replica, position = divmod(rank, 2)
    module = torchtitan_stage(position, 2)
    fully_shard(module, mesh=mesh["dp"])
    stage = PipelineStage(module, position, 2, torch.device("cpu"), group=mesh.get_group("pp"))
    sched = Schedule1F1B(stage, MICROBATCHES // 2, loss_fn=F.mse_loss)
    opt = make_optimizer("sgd", list(module.parameters()))
    rows = BATCH // 2
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x[replica * rows : (replica + 1) * rows], y[replica * rows : (replica + 1) * rows]
        sched.scale_grads = unscaled != (step, rank)
        opt.zero_grad()
        sched.step(*([x] if position == 0 else []), **({"target": y} if position == 1 else {}))
        opt.step()


def test_fsdp2_sharded_stages_are_assembled_and_a_fault_names_its_shard() -> None:
    cluster = simdist.Cluster.switch(4, device="cpu")
    options = {"reference_args": ("sgd",), "reference_kwargs": {}, "compute": False, "localize": False}
    rep = simdist.check_equivalence(sharded, reference, cluster, **options)
    assert rep.ok, str(rep)
    assert_whole_model_compared(rep, "sgd")
    # the scaling follows FSDP2's reduce-scatter: only rank 3's shard of the second stage is left unscaled
    rep = simdist.check_equivalence(sharded, reference, cluster, kwargs={"unscaled": (1, 3)}, **options)
    assert_unscaled_found(rep, "1F1B", 1, (3,), 1, 2)


#: a bare stage's names ("2.0.weight", "head.bias") mapped to the reference's; "*" carries the rest over
BARE_NAMES = {"head.*": "head.*", "*": "layers.*"}


def test_bare_stage_modules_are_compared_once_their_names_are_mapped() -> None:
    rep = check("1F1B", bare=True)
    assert not rep.ok and rep.first.kind == "structure" and "names=" in rep.first.detail, str(rep)
    rep = check("1F1B", bare=True, names=BARE_NAMES)
    assert rep.ok, str(rep)
    assert_whole_model_compared(rep, "sgd")
    rep = check("1F1B", bare=True, names=BARE_NAMES, unscaled=(2, 0))
    assert_unscaled_found(rep, "1F1B", 2, (0,), 0, 2, bare=True)


def traced(steps: int = STEPS, unscaled: tuple[int, int] | None = None) -> None:
    """torch's tracer frontend: ``pipeline()`` splits the model at block 2, ``build_stage`` gives each rank its stage."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x0, _ = batch(0)
    with warnings.catch_warnings():  # torch's tracer warns about its own pytree internals
        warnings.simplefilter("ignore", FutureWarning)
        pipe = pipeline(build(), mb_args=(x0.chunk(MICROBATCHES)[0],), split_spec={"layers.2": SplitPoint.BEGINNING})
    stage = pipe.build_stage(rank, torch.device("cpu"))
    sched = ScheduleGPipe(stage, MICROBATCHES, loss_fn=F.mse_loss)
    opt = make_optimizer("sgd", list(stage.submod.parameters()))
    for step in range(steps):
        x, y = batch(step)
        sched.scale_grads = unscaled != (step, rank)
        opt.zero_grad()
        sched.step(*([x] if rank == 0 else []), **({"target": y} if rank == world - 1 else {}))
        opt.step()


def test_stages_from_torchs_tracer_keep_the_reference_names() -> None:
    cluster = simdist.Cluster.switch(2, device="cpu")
    options = {"reference_args": ("sgd",), "reference_kwargs": {}, "compute": False, "localize": False}
    rep = simdist.check_equivalence(traced, reference, cluster, **options)
    assert rep.ok, str(rep)
    assert_whole_model_compared(rep, "sgd")
    rep = simdist.check_equivalence(traced, reference, cluster, kwargs={"unscaled": (1, 0)}, **options)
    assert_unscaled_found(rep, "GPipe", 1, (0,), 0, 2)
