"""Localisation: tiny parallel programs with one known bug each, checked against their single-process model.

Each program is written here, so the call sites localisation names are lines of this file (found by the marker
comment at the end of the line). Clean programs must localise nothing.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import hypothesis.strategies as st
import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import simdist
from simdist.c10d import process_group
from simdist.oracle.localize import Localization, localize
from simdist.oracle.names import NameMap
from simdist.oracle.record import recording, wrap

BATCH = 8
SOURCE = Path(__file__).read_text().splitlines()
FILE = Path(__file__).name


def line_of(marker: str) -> str:
    """``test_oracle_localize.py:N`` for the line carrying ``# <marker>``."""
    (n,) = [i + 1 for i, text in enumerate(SOURCE) if text.rstrip().endswith(f"# {marker}")]
    return f"{FILE}:{n}"


def data() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The model and the full batch, the same in every program (seeded here, not by the run)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    return model, torch.randn(BATCH, 4), torch.randn(BATCH, 2)


def reference(steps: int = 2, clip: float | None = None) -> None:
    """The single-process model: full batch, mean loss, SGD."""
    model, x, y = data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()


def data_parallel(steps: int = 2, bug: str | None = None, bug_step: int = 0, clip: float | None = None) -> None:
    """Hand-written data parallelism: each rank its rows, gradients all-reduced and averaged."""
    model, x, y = data()
    r, n = dist.get_rank(), dist.get_world_size()
    b = BATCH // n
    rows = slice(0, b) if bug == "same shard" else slice(r * b, (r + 1) * b)
    xs, ys = x[rows], y[rows]  # shard
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(xs), ys)
        if bug == "scale" and r == 1 and step == bug_step:
            loss = loss * n  # scale
        loss.backward()
        if bug == "local clip":
            nn.utils.clip_grad_norm_(model.parameters(), clip)  # local clip
        for p in model.parameters():
            dist.all_reduce(p.grad)  # all_reduce
            if bug != "sum":
                p.grad /= n
        if clip is not None and bug != "local clip":
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()


def torch_ddp(steps: int = 2) -> None:
    """The same training under torch's DistributedDataParallel."""
    model, x, y = data()
    r, n = dist.get_rank(), dist.get_world_size()
    b = BATCH // n
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x[r * b : (r + 1) * b]), y[r * b : (r + 1) * b]).backward()
        opt.step()


def microbatched(steps: int = 2, micro: int = 2) -> None:
    """Data parallelism with gradient accumulation over ``micro`` microbatches per rank."""
    model, x, y = data()
    r, n = dist.get_rank(), dist.get_world_size()
    b = BATCH // n
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        for k in range(micro):
            rows = slice(r * b + k * b // micro, r * b + (k + 1) * b // micro)
            (nn.functional.mse_loss(model(x[rows]), y[rows]) / micro).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= n
        opt.step()


class ColumnParallel(nn.Module):
    """``full``'s output features split across ranks; the full output all-gathered along the last dim."""

    def __init__(self, full: nn.Linear, shard: int) -> None:
        super().__init__()
        n = dist.get_world_size()
        rows = full.out_features // n
        self.weight = nn.Parameter(full.weight[shard * rows : (shard + 1) * rows].clone())  # weight shard
        self.bias = nn.Parameter(full.bias[shard * rows : (shard + 1) * rows].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = nn.functional.linear(x, self.weight, self.bias)
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local)
        parts[dist.get_rank()] = local  # the gathered copy of its own part carries no gradient
        return torch.cat(parts, dim=-1)


def tensor_parallel_reference(steps: int = 1) -> None:
    """The single-process model of :func:`tensor_parallel`."""
    torch.manual_seed(0)
    model = nn.Linear(4, 8)
    x, y = torch.randn(BATCH, 4), torch.randn(BATCH, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def tensor_parallel(steps: int = 1, wrong_shard: bool = False) -> None:
    """A column-parallel linear layer; with ``wrong_shard`` each rank holds its neighbour's rows."""
    torch.manual_seed(0)
    full = nn.Linear(4, 8)
    x, y = torch.randn(BATCH, 4), torch.randn(BATCH, 8)
    r, n = dist.get_rank(), dist.get_world_size()
    model = ColumnParallel(full, (r + 1) % n if wrong_shard else r)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        # each rank's weight gradient is its shard's; the loss is replicated, so no gradient sync is needed
        opt.step()


def run_localize(parallel, reference_fn, world: int, step: int = 0, kwargs=None, reference_kwargs=None, **extra):
    return localize(
        parallel, reference_fn, simdist.Cluster.switch(world, device="cpu"), step,
        kwargs=kwargs or {}, reference_kwargs=reference_kwargs or {}, run_options={"compute": False}, **extra,
    )


@pytest.mark.parametrize("world", [2, 4])
def test_clean_data_parallel_localizes_nothing(world: int) -> None:
    assert run_localize(data_parallel, reference, world) is None
    assert run_localize(data_parallel, reference, world, step=1) is None


def test_clean_torch_ddp_microbatches_and_tensor_parallel_localize_nothing() -> None:
    assert run_localize(torch_ddp, reference, 2) is None
    assert run_localize(microbatched, reference, 2) is None
    assert run_localize(tensor_parallel, tensor_parallel_reference, 2) is None
    assert run_localize(data_parallel, reference, 2, kwargs={"clip": 0.05}, reference_kwargs={"clip": 0.05}) is None


def test_a_loss_scaled_on_one_rank_is_found_at_the_scaling_line_on_that_rank() -> None:
    loc = run_localize(data_parallel, reference, 4, kwargs={"bug": "scale"})
    assert isinstance(loc, Localization)
    assert loc.op == "aten.mul"
    assert loc.ranks == (1,)
    assert line_of("scale") in loc.site
    assert loc.phase == "backward"  # the forward mul has no reference counterpart; its backward carries it on
    # rank 1's loss gradient is n = 4 where the reference's is 1
    assert loc.difference is not None and loc.difference.rel == pytest.approx(3.0)
    assert "first divergent op: aten.mul" in str(loc)


def test_the_step_asked_for_is_the_one_recorded() -> None:
    kwargs = {"bug": "scale", "bug_step": 1, "steps": 3}
    assert run_localize(data_parallel, reference, 2, step=0, kwargs=kwargs, reference_kwargs={"steps": 3}) is None
    loc = run_localize(data_parallel, reference, 2, step=1, kwargs=kwargs, reference_kwargs={"steps": 3})
    assert loc is not None and loc.op == "aten.mul" and line_of("scale") in loc.site


def test_gradients_summed_instead_of_averaged_are_found_at_the_all_reduce_output() -> None:
    loc = run_localize(data_parallel, reference, 2, kwargs={"bug": "sum"})
    assert loc is not None
    assert loc.op == "all_reduce"
    assert line_of("all_reduce") in loc.site
    assert loc.ranks == (0, 1)
    assert loc.inputs_matched
    # 6 parameters: the first gradient all-reduced is the first one the optimizer reads
    assert loc.difference is not None and loc.difference.rel == pytest.approx(1.0)
    assert loc.last_collective is None or "all_reduce #" in loc.last_collective


def test_clipping_on_the_local_norm_is_found_inside_the_clip() -> None:
    loc = run_localize(
        data_parallel, reference, 2, kwargs={"bug": "local clip", "clip": 0.05}, reference_kwargs={"clip": 0.05}
    )
    assert loc is not None
    assert line_of("local clip") in loc.site
    assert loc.phase == "other"
    assert loc.inputs_matched


def test_every_rank_reading_the_same_shard_is_found_at_the_slice() -> None:
    loc = run_localize(data_parallel, reference, 2, kwargs={"bug": "same shard"})
    assert loc is not None
    assert loc.op == "aten.slice"
    assert line_of("shard") in loc.site
    assert loc.ranks == (1,)


def test_a_column_parallel_layer_on_the_wrong_shard_is_found_where_the_shard_is_cut() -> None:
    loc = run_localize(tensor_parallel, tensor_parallel_reference, 2, kwargs={"wrong_shard": True})
    assert loc is not None
    assert line_of("weight shard") in loc.site
    assert set(loc.ranks) <= {0, 1} and loc.ranks


def test_hooks_and_observers_are_removed_after_a_run_even_when_it_fails() -> None:
    def failing() -> None:
        raise RuntimeError("boom")

    hooks = len(nn.modules.module._global_forward_pre_hooks), len(nn.modules.module._global_forward_hooks)
    with pytest.raises(simdist.RankError):
        run_localize(failing, reference, 2)
    assert (len(nn.modules.module._global_forward_pre_hooks), len(nn.modules.module._global_forward_hooks)) == hooks
    assert process_group.ISSUE_OBSERVERS == []


def written_in_place() -> None:
    """An in-place op whose output one op reads and an all-reduce reduces, and a reader of the reduction."""
    g = torch.ones(4)
    g.mul_(2)
    h = g + 1  # noqa: F841 - recorded, not used
    dist.all_reduce(g)
    k = g * 3  # noqa: F841 - recorded, not used


def test_readers_of_an_in_place_op_s_output_and_of_its_reduction_are_linked_to_it() -> None:
    # autograd bumps the version of what an in-place op writes after the recorder has seen the op: the reader's
    # input must still be found as that op's output, and the all-reduce's output as a reduction of it
    recorders: dict = {}
    with recording():
        simdist.run(wrap(written_in_place, 0, recorders, dist.get_rank), simdist.Cluster.switch(2), compute=False)
    for rank in (0, 1):
        ops = recorders[rank].stream.ops
        (scaled,) = [o for o in ops if o.op == "aten.mul_"]
        (add,) = [o for o in ops if o.op == "aten.add"]
        (mul,) = [o for o in ops if o.op == "aten.mul"]
        assert isinstance(add.inputs[0][0], int), "the reader's input is a copy, not the in-place op's output"
        assert add.inputs[0] == (scaled.index, 0)
        value, source = mul.inputs[0]
        assert source.collective is not None and source.collective.name == "all_reduce"
        assert source.previous == (scaled.index, 0)
        assert torch.equal(value, torch.full((4,), 4.0))


def test_the_recorder_charges_no_simulated_time_and_trips_no_race_detector() -> None:
    cluster = simdist.Cluster.switch(2, device="H100")
    plain = simdist.run(data_parallel, cluster, races="error")
    recorders: dict = {}
    with recording():
        recorded = simdist.run(wrap(data_parallel, 0, recorders, dist.get_rank), cluster, races="error")
    assert recorded.sim_time == plain.sim_time
    assert recorded.trace_hash == plain.trace_hash
    assert len(recorders[0].stream.ops) > 30 and recorders[0].stream.collectives


def test_module_names_drop_wrappers_and_backward_ops_know_their_module() -> None:
    recorders: dict = {}
    with recording():
        simdist.run(wrap(torch_ddp, 0, recorders, dist.get_rank), simdist.Cluster.switch(2, device="cpu"), compute=False)
    ops = recorders[1].stream.ops
    addmm = [o for o in ops if o.op == "aten.addmm"]
    assert [o.module for o in addmm] == ["0", "2", "0", "2"][: len(addmm)]
    backward_mm = [o for o in ops if o.phase == "backward" and o.op == "aten.mm"]
    assert {o.module for o in backward_mm} == {"0", "2"}
    assert all(o.site.startswith("backward of aten.addmm at ") for o in backward_mm)
    assert inspect.isfunction(torch_ddp)


def test_a_name_map_aligns_renamed_modules() -> None:
    def renamed(steps: int = 2) -> None:
        model, x, y = data()
        wrapped = nn.Sequential()
        wrapped.add_module("body", model)
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
        for _ in range(steps):
            opt.zero_grad()
            (nn.functional.mse_loss(wrapped(x), y) * 1.5).backward()  # renamed bug
            opt.step()

    def solo(steps: int = 2) -> None:
        reference(steps)

    names = NameMap(lambda n: n.removeprefix("body.") if n != "body" else "")
    loc = run_localize(renamed, solo, 1, names=names)
    assert loc is not None and line_of("renamed bug") in loc.site


def rank_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s rows, drawn from its own generator (as a per-rank data loader would)."""
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(BATCH // 2, 4, generator=g), torch.randn(BATCH // 2, 2, generator=g)  # rank batch


def per_rank_data(steps: int = 1, unsynchronised: bool = False) -> None:
    """Data parallelism over per-rank batches; ``unsynchronised`` steps on the local gradients."""
    model, _, _ = data()
    r, n = dist.get_rank(), dist.get_world_size()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        x, y = rank_batch(r)
        nn.functional.mse_loss(model(x), y).backward()
        for p in model.parameters():
            if not unsynchronised:
                dist.all_reduce(p.grad)
                p.grad /= n
        opt.step()  # local step


def per_rank_reference(steps: int = 1, world: int = 2) -> None:
    """The reference builds its batch from every rank's rows in turn."""
    model, _, _ = data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        xs, ys = zip(*(rank_batch(r) for r in range(world)))
        nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()


def test_each_rank_s_data_ops_align_with_the_reference_s_repetition_for_that_rank() -> None:
    # without matching rank r's randn with the reference's r-th, rank 1's data would look like the divergence
    assert run_localize(per_rank_data, per_rank_reference, 2) is None
    loc = run_localize(per_rank_data, per_rank_reference, 2, kwargs={"unsynchronised": True})
    assert loc is not None and loc.op == "aten.add_" and line_of("local step") in loc.site
    # the gradient the step reads came straight from backward (no all-reduce wrote it)
    assert "aten.t at backward of" in loc.note and "a missing or wrong synchronisation" in loc.note


def two_stages(steps: int = 1, synchronised: bool = True) -> None:
    """Ranks 0-1 hold the first layer, ranks 2-3 the last one; each pair splits the batch (pipeline x data)."""
    model, x, y = data()
    r = dist.get_rank()
    first, last = r < 2, r >= 2
    dp = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    b = BATCH // 2
    rows = slice((r % 2) * b, (r % 2 + 1) * b)
    # each stage keeps the whole model with the other stage's layers replaced, so names stay the reference's
    for i in (2,) if first else (0, 1):
        model[i] = nn.Identity()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        if first:
            h = model(x[rows])
            dist.send(h.detach(), r + 2)
            grad = torch.empty_like(h)
            dist.recv(grad, r + 2)
            h.backward(grad)
        else:
            h = torch.empty(b, 8)
            dist.recv(h, r - 2)
            h.requires_grad_()
            nn.functional.mse_loss(model(h), y[rows]).backward()
            dist.send(h.grad, r - 2)
        for p in params:
            if synchronised or last:
                dist.all_reduce(p.grad, group=dp[0 if first else 1])
                p.grad /= 2
        opt.step()  # stage step


def test_optimizer_ops_align_by_parameter_and_stage_ranks_combine_among_themselves() -> None:
    # the last stage's first update is the reference's third, not its first; stage ranks are a subset of the world
    assert run_localize(two_stages, reference, 4, reference_kwargs={"steps": 1}) is None
    loc = run_localize(two_stages, reference, 4, kwargs={"synchronised": False}, reference_kwargs={"steps": 1})
    assert loc is not None and loc.op == "aten.add_" and line_of("stage step") in loc.site
    assert loc.ranks == (0, 1)


def presummed(steps: int = 2, bug: str | None = None, scaled: tuple | None = None) -> None:
    """Data parallelism as torch's DDP does it: every gradient divided by the world size, then all-reduced.

    ``bug``: "divide twice" divides every gradient a second time before the all-reduce; "scale one rank" makes
    rank 1 scale its gradients by 1e-3. ``scaled = (where, rank, parameter, factor, step)`` scales one gradient on
    one rank at one step, before the division, between it and the all-reduce, or after the all-reduce.
    """
    model, x, y = data()
    r, n = dist.get_rank(), dist.get_world_size()
    b = BATCH // n
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x[r * b : (r + 1) * b]), y[r * b : (r + 1) * b]).backward()
        for i, p in enumerate(model.parameters()):
            where, factor = None, 1.0
            if scaled is not None and (scaled[1], scaled[2], scaled[4]) == (r, i, step):
                where, factor = scaled[0], scaled[3]
            if where == "before the division":
                p.grad.mul_(factor)  # scaled before the division
            p.grad.div_(n)  # divide
            if bug == "divide twice":
                p.grad.div_(n)  # divide again
            if bug == "scale one rank" and r == 1:
                p.grad.mul_(1e-3)  # scale one rank
            if where == "before the all-reduce":
                p.grad.mul_(factor)  # scaled before the all-reduce
            dist.all_reduce(p.grad)  # presummed all-reduce
            if where == "after the all-reduce":
                p.grad.mul_(factor)  # scaled after the all-reduce
        opt.step()


def test_a_gradient_divided_twice_is_found_at_the_second_division() -> None:
    # the first division makes each rank's gradient a part of the sum the all-reduce completes; the second
    # leaves parts whose sum is 1/n of the reference's, and the all-reduce only carries that on
    assert run_localize(presummed, reference, 2) is None
    for world in (2, 4):
        loc = run_localize(presummed, reference, world, kwargs={"bug": "divide twice"})
        assert loc is not None, world
        assert loc.op == "aten.div_" and line_of("divide again") in loc.site, str(loc)
        assert loc.ranks == tuple(range(world)) and loc.inputs_matched and loc.phase == "other"
        assert "ranks 0-" in loc.note and "summed" in loc.note, str(loc)  # how the value matched before it
        # the parts after the second division sum to 1/n of the reference's gradient
        assert loc.difference is not None and loc.difference.scale == pytest.approx(1 / world)


def test_gradients_scaled_on_one_rank_are_found_at_the_scaling_on_that_rank() -> None:
    loc = run_localize(presummed, reference, 2, kwargs={"bug": "scale one rank"})
    assert loc is not None
    assert loc.op == "aten.mul_" and line_of("scale one rank") in loc.site, str(loc)
    assert loc.ranks == (1,) and loc.inputs_matched


def test_the_all_reduce_is_named_only_when_its_output_is_the_first_to_differ() -> None:
    # gradients summed and never divided: each rank's gradient matched (as a mean) until the all-reduce
    loc = run_localize(data_parallel, reference, 4, kwargs={"bug": "sum"})
    assert loc is not None and loc.op == "all_reduce" and line_of("all_reduce") in loc.site
    assert "the value it reduces matched the reference's (ranks 0-3 averaged)" in loc.note, str(loc)
    # divided before the all-reduce, as torch's DDP does: a correct program, nothing to localise
    assert run_localize(presummed, reference, 4) is None


SCALINGS = ("before the division", "before the all-reduce", "after the all-reduce")


@given(
    where=st.sampled_from(SCALINGS),
    world=st.sampled_from([2, 4]),
    rank=st.integers(0, 3),
    parameter=st.integers(0, 3),
    factor=st.sampled_from([1e-3, 0.25, 0.5, 2.0, 3.0, 1e3]),
    step=st.integers(0, 1),
)
def test_a_gradient_scaled_anywhere_on_any_rank_is_found_at_that_scaling(
    where: str, world: int, rank: int, parameter: int, factor: float, step: int
) -> None:
    rank %= world
    scaled = (where, rank, parameter, factor, step)
    loc = run_localize(presummed, reference, world, step=step, kwargs={"scaled": scaled})
    assert loc is not None, scaled
    assert loc.op == "aten.mul_" and line_of(f"scaled {where}") in loc.site, (scaled, str(loc))
    assert loc.ranks == (rank,), (scaled, str(loc))
    assert loc.inputs_matched
