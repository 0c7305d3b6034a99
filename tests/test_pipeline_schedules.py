"""torch's pipeline schedules in simulated time: bubbles and in-flight activations against their closed forms,
a custom schedule loaded from a CSV action list, and a schedule that deadlocks.

The figures come from ``benchmarks/pipeline_bench.py`` (equal, compute-bound stages on the dgx-h100 preset);
the closed forms are the oracle. A custom schedule is compared with the single-process model by the
equivalence oracle; a deadlocking one must be reported with its ranks, stages and microbatches.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

import simdist

_spec = importlib.util.spec_from_file_location(
    "pipeline_bench", Path(__file__).resolve().parent.parent / "benchmarks" / "pipeline_bench.py"
)
bench = importlib.util.module_from_spec(_spec)
sys.modules["pipeline_bench"] = bench  # its dataclasses look their module up there
_spec.loader.exec_module(bench)

WIDTH, BLOCKS, BATCH, MICROBATCHES, STEPS = 4, 2, 8, 4, 2
#: a 1F1B order written by hand for 2 stages on 2 ranks, 4 microbatches (torch's compute-only CSV form)
CUSTOM_1F1B = "0F0,0F1,0B0,0F2,0B1,0F3,0B2,0B3\n1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3\n"
#: with its communication spelled out: rank 0 never sends microbatch 0's activations (no ``0SEND_F0``)
MISSING_SEND = "0F0,0RECV_B0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0\n"


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 4), (2, 8)])
def test_the_measured_bubble_is_the_closed_form(schedule: str, p: int, m: int) -> None:
    row = bench.measure(schedule, p, m, bench.compute_bound_device())
    assert row.skipped is None, row.skipped
    assert row.closed_bubble == pytest.approx((p - 1) / (m + p - 1))
    # every rank, not only on average: the stages are equal
    assert all(abs(b - row.closed_bubble) <= bench.TARGET for b in row.bubbles), (row.bubbles, row.closed_bubble)
    # the step itself: (m + p - 1) units of one stage's F + B, measured busy on a rank at m microbatches
    unit = (1 - row.bubbles[1]) * row.step / m
    assert row.step == pytest.approx((m + p - 1) * unit, rel=bench.TARGET)


def test_gpipe_holds_every_microbatch_in_flight_and_1f1b_only_p() -> None:
    p, m = 2, 8
    device = bench.compute_bound_device()
    unit = bench.measure("GPipe", p, 1, device).activations[0]
    gpipe, one_f_one_b = bench.measure("GPipe", p, m, device), bench.measure("1F1B", p, m, device)
    assert gpipe.activations[0] / unit == pytest.approx(m, abs=0.05)
    # 1F1B: p microbatches, plus at most one block's output of a microbatch that is being handed on
    assert p <= one_f_one_b.activations[0] / unit < p + 0.5
    # and less memory on the first stage for it: (m - p) microbatches' activations fewer
    assert gpipe.peak[0] - one_f_one_b.peak[0] >= (m - p - 0.5) * unit


class Model(nn.Module):
    """Blocks of Linear + Tanh; a stage deletes the blocks it does not own, keeping the reference's names."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for i in range(BLOCKS)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers.values():
            x = block(x)
        return x


def build() -> Model:
    torch.manual_seed(7)
    return Model().double()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    return (torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64),
            torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64))


def reference() -> None:
    """The whole model on the full batch with the mean loss."""
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()


def csv_schedule(path: str, fmt: str, microbatches: int = MICROBATCHES) -> tuple[_PipelineScheduleRuntime, nn.Module]:
    """Rank code: this rank's stage (block ``rank`` of the model) under the schedule the CSV file lists."""
    rank = dist.get_rank()
    model = build()
    for name in list(model.layers):
        if name != str(rank):
            del model.layers[name]
    stage = PipelineStage(model, rank, BLOCKS, torch.device("cpu"))
    sched = _PipelineScheduleRuntime([stage], microbatches, loss_fn=F.mse_loss)
    sched._load_csv(path, format=fmt)
    return sched, model


def custom_pipeline(path: str) -> None:
    """Train with the schedule the CSV file lists (compute-only form: torch adds the sends and receives)."""
    rank = dist.get_rank()
    sched, model = csv_schedule(path, "compute_only")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        sched.step(*([x] if rank == 0 else []), **({"target": y} if rank == BLOCKS - 1 else {}))
        opt.step()


def test_a_custom_schedule_from_a_csv_action_list_trains_as_the_single_process_model(tmp_path: Path) -> None:
    path = tmp_path / "custom_1f1b.csv"
    path.write_text(CUSTOM_1F1B)
    rep = simdist.check_equivalence(
        custom_pipeline, reference, simdist.Cluster.preset("dgx-h100", gpus_per_node=2), args=(str(path),),
        reference_args=(), steps=STEPS, localize=False,
    )
    assert rep.ok, str(rep)
    assert rep.steps == STEPS and rep.compared["parameters"] == 2 * BLOCKS and rep.compared["loss"] == 1


def test_torch_rejects_a_csv_that_leaves_out_a_compute_action_when_loading_it(tmp_path: Path) -> None:
    path = tmp_path / "no_backward.csv"
    path.write_text(CUSTOM_1F1B.replace(",1B3", ""))  # stage 1 never runs microbatch 3's backward
    with pytest.raises(simdist.RankError) as err:
        simdist.run(custom_pipeline, simdist.Cluster.switch(2, device="cpu"), args=(str(path),))
    assert isinstance(err.value.exc, AssertionError)
    assert "Invalid backward microbatches for stage 1: expected 4" in str(err.value.exc)


def missing_send(path: str) -> None:
    """Rank code: one step of the CSV schedule given with its communication (``compute_comms``)."""
    rank = dist.get_rank()
    sched, _ = csv_schedule(path, "compute_comms", microbatches=1)
    x, y = batch(0)
    sched.step(*([x] if rank == 0 else []), **({"target": y} if rank == BLOCKS - 1 else {}))


def test_a_missing_send_is_a_deadlock_naming_each_ranks_stage_and_microbatch(tmp_path: Path) -> None:
    path = tmp_path / "missing_send.csv"
    path.write_text(MISSING_SEND)
    with pytest.raises(simdist.DeadlockError) as err:
        simdist.run(missing_send, simdist.Cluster.switch(2, device="cpu"), args=(str(path),))
    text = str(err.value)
    # rank 0 (stage 0) waits for microbatch 0's gradient in its backward, rank 1 (stage 1) for its activations
    assert "rank 0: waits in recv from rank 1" in text and "blocked in torch's _perform_action(action=0B0)" in text
    assert "rank 1: waits in recv from rank 0" in text and "blocked in torch's _perform_action(action=1F0)" in text
    assert "unmatched point-to-point operations" in text


def dry_run(path: str) -> str:
    """Rank code: load the CSV (torch validates it) and run torch's own dry-run simulation of its messages."""
    sched, _ = csv_schedule(path, "compute_comms", microbatches=1)
    try:
        sched._simulate()
    except ValueError as e:
        return str(e)
    return "ok"


def test_torch_validates_the_csv_at_load_but_only_its_dry_run_finds_the_missing_send(tmp_path: Path) -> None:
    path = tmp_path / "missing_send.csv"
    path.write_text(MISSING_SEND)
    res = simdist.run(dry_run, simdist.Cluster.switch(2, device="cpu"), args=(str(path),))
    assert res.returns == ["Schedule is not progressing"] * 2
    good = tmp_path / "good.csv"
    good.write_text(MISSING_SEND.replace("0F0,", "0F0,0SEND_F0,"))
    assert simdist.run(dry_run, simdist.Cluster.switch(2, device="cpu"), args=(str(good),)).returns == ["ok"] * 2
