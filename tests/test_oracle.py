"""The equivalence oracle: clean parallel runs equal their single-process reference, injected faults are found.

The oracle of these tests is the reference model trained in one process; a perturbation of one gradient
element is a fault whose step, tensor and rank are known beforehand.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import simdist
from simdist.errors import RunArgumentError
from simdist.oracle import AssemblyError, NameMap, Tolerance
from simdist.oracle.names import named_tensors
from simdist.oracle.tolerance import compare
from tests.oracle_fns import STRATEGIES, Setup, data, layers, model, parallel, reference


def cpu(n: int) -> simdist.Cluster:
    return simdist.Cluster.switch(n, device="cpu")


def check(setup: Setup, strategy: str, world: int, **options) -> simdist.EquivalenceReport:
    return simdist.check_equivalence(
        parallel, reference, cpu(world), args=(setup, strategy), reference_args=(setup,), **options
    )


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_data_parallel_strategy_matches_its_reference(strategy: str) -> None:
    rep = check(Setup(), strategy, 2)
    assert rep.ok, str(rep)
    assert rep.steps == 3
    assert rep.compared["parameters"] == 4 and rep.compared["gradients"] == 4
    assert "equivalent" in str(rep)


@settings(deadline=None)
@given(
    widths=st.lists(st.integers(1, 7), min_size=2, max_size=4).map(tuple),
    world=st.sampled_from([1, 2, 4]),
    strategy=st.sampled_from(STRATEGIES),
    opt=st.sampled_from(["sgd", "adam"]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_clean_runs_are_always_equivalent(widths, world, strategy, opt, dtype) -> None:
    setup = Setup(widths=widths, batch=8, steps=2, optimizer=opt, dtype=dtype)
    rep = check(setup, strategy, world)
    assert rep.ok, str(rep)


@settings(deadline=None)
@given(
    widths=st.lists(st.integers(1, 6), min_size=2, max_size=3).map(tuple),
    world=st.sampled_from([2, 4]),
    strategy=st.sampled_from(STRATEGIES),
    step=st.integers(0, 2),
    data=st.data(),
)
def test_a_perturbed_gradient_element_is_found_at_its_step_and_parameter(widths, world, strategy, step, data) -> None:
    n_params = 2 * (len(widths) - 1)
    index = data.draw(st.integers(0, n_params - 1), label="parameter")
    element = data.draw(st.integers(0, 64), label="element")
    # a rank of FSDP2 may hold no element of a small parameter: perturb every rank's shard there
    rank = None if strategy == "fsdp2" else data.draw(st.sampled_from([None, *range(world)]), label="rank")
    setup = Setup(widths=widths, steps=3, perturb=(step, index, element, rank), delta=0.5)
    rep = check(setup, strategy, world)
    assert not rep.ok
    first = rep.first
    assert first.step == step, str(rep)
    names = [n for n, _ in named_tensors(nn.Sequential(*layers(widths)))[0]]
    expected = names[index]
    assert first.kind == "grad" and first.name == expected, str(rep)
    if rank is not None:
        # the other replicas still hold the synchronised gradient
        assert first.ranks == (rank,), str(rep)
        # and the copies disagree: the ones that differ from the lowest rank's copy are named
        odd = (rank,) if rank else tuple(range(1, world))
        assert any(d.kind == "replica" and d.name == expected and d.ranks == odd for d in rep.divergences)


# ---- programs with classic silent bugs


def _scaled_twice(setup: Setup) -> None:
    m = nn.parallel.DistributedDataParallel(model(setup))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for step in range(setup.steps):
        x, y = _my_batch(setup, step)
        opt.zero_grad()
        (F.mse_loss(m(x), y) / dist.get_world_size()).backward()  # DDP averages already
        opt.step()


def _same_shard(setup: Setup) -> None:
    m = nn.parallel.DistributedDataParallel(model(setup))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for step in range(setup.steps):
        x, y = data(setup, step)
        n = setup.batch // dist.get_world_size()
        opt.zero_grad()
        F.mse_loss(m(x[:n]), y[:n]).backward()  # every rank reads the first shard
        opt.step()


def _my_batch(setup: Setup, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = data(setup, step)
    n = setup.batch // dist.get_world_size()
    r = dist.get_rank()
    return x[r * n : (r + 1) * n], y[r * n : (r + 1) * n]


def _sgd_reference(setup: Setup) -> None:
    m = model(setup)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for step in range(setup.steps):
        x, y = data(setup, step)
        opt.zero_grad()
        F.mse_loss(m(x), y).backward()
        opt.step()


def test_a_loss_scaled_twice_is_found_at_the_first_step_with_its_values() -> None:
    rep = simdist.check_equivalence(_scaled_twice, _sgd_reference, cpu(4), args=(Setup(),))
    assert not rep.ok and rep.first.step == 0 and rep.first.kind == "loss"
    assert rep.first.ranks == (0, 1, 2, 3)
    # mean of 4 losses each divided by 4: a quarter of the reference's
    assert rep.first.difference.rel == pytest.approx(0.75, rel=1e-6)
    assert "mean of 4 backward roots" in str(rep)
    grads = [d for d in rep.divergences if d.kind == "grad"]
    assert grads and grads[0].name == "2.bias", "gradients are reported in backward order, last layer first"


def test_every_rank_reading_the_same_shard_is_found() -> None:
    rep = simdist.check_equivalence(_same_shard, _sgd_reference, cpu(2), args=(Setup(),))
    assert not rep.ok and rep.first.step == 0
    assert {d.kind for d in rep.divergences} >= {"loss", "grad", "param"}


def _accumulated(setup: Setup, micro: int, divide: bool) -> None:
    """torch DDP with ``micro`` micro-steps per optimizer step; each backpropagates loss / micro if ``divide``."""
    m = nn.parallel.DistributedDataParallel(model(setup))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for step in range(setup.steps):
        x, y = _my_batch(setup, step)
        opt.zero_grad()
        for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
            loss = F.mse_loss(m(xs), ys)
            (loss / micro if divide else loss).backward()
        opt.step()


@pytest.mark.parametrize("micro", [2, 4])
def test_accumulated_losses_are_each_rank_s_sum_averaged_over_ranks(micro: int) -> None:
    setup = Setup(batch=16)
    rep = simdist.check_equivalence(_accumulated, _sgd_reference, cpu(2), args=(setup, micro, True),
                                    reference_args=(setup,), loss="accumulated")
    assert rep.ok, str(rep)
    assert rep.compared["loss"] == 1
    # the plain mean of every micro-step's loss / micro is a micro-th of the step's loss
    rep = simdist.check_equivalence(_accumulated, _sgd_reference, cpu(2), args=(setup, micro, True),
                                    reference_args=(setup,), loss="mean", localize=False)
    assert rep.first.kind == "loss" and rep.first.difference.rel == pytest.approx(1 - 1 / micro)
    rep = simdist.check_equivalence(_accumulated, _sgd_reference, cpu(2), args=(setup, micro, False),
                                    reference_args=(setup,), loss="accumulated", localize=False)
    assert rep.first.kind == "loss" and rep.first.difference.rel == pytest.approx(micro - 1)
    assert "averaged over 2 ranks" in str(rep)
    grad = next(d for d in rep.divergences if d.kind == "grad")
    assert grad.difference.scale == pytest.approx(micro), "the gradient is micro times the reference's"


@given(c=st.sampled_from([-1.0, 0.5, 2.0, 4.0, 0.25, 8.0]), n=st.integers(2, 40), seed=st.integers(0, 1000),
       dtype=st.sampled_from([torch.float32, torch.float64]))
@settings(deadline=None)
def test_a_multiple_of_the_reference_is_recognised_and_nothing_else_is(c: float, n: int, seed: int, dtype) -> None:
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(n, generator=g, dtype=dtype)
    d = compare(ref * c, ref, exact=False)
    assert d is not None and d.scale == pytest.approx(c, rel=1e-6)
    other = ref * c + torch.randn(n, generator=g, dtype=dtype) * 0.1
    d = compare(other, ref, exact=False)
    assert d is not None and d.scale is None


def test_losses_are_not_compared_with_loss_none() -> None:
    rep = simdist.check_equivalence(_scaled_twice, _sgd_reference, cpu(2), args=(Setup(),), loss=None)
    assert rep.first.kind == "grad"


def test_capture_leaves_the_simulation_unchanged() -> None:
    setup = Setup()
    cluster = simdist.Cluster.switch(2, device="H100")
    plain = simdist.run(parallel, cluster, args=(setup, "bucketed"))
    rep = simdist.check_equivalence(parallel, reference, cluster, args=(setup, "bucketed"), reference_args=(setup,))
    assert rep.ok, str(rep)
    assert rep.parallel.trace_hash == plain.trace_hash and rep.parallel.sim_time == plain.sim_time


def test_steps_limits_the_comparison() -> None:
    setup = Setup(perturb=(2, 0, 0, None), delta=1.0)
    assert check(setup, "torch_ddp", 2, steps=2).ok
    assert not check(setup, "torch_ddp", 2, steps=3).ok


def test_exact_mode_is_bitwise() -> None:
    # on one rank the parallel program computes exactly what the reference does
    assert check(Setup(dtype=torch.float32), "allreduce", 1, exact=True).ok
    tiny = Setup(dtype=torch.float64, perturb=(1, 0, 0, None), delta=1e-13)
    assert check(tiny, "allreduce", 1).ok, "within the float64 tolerance"
    rep = check(tiny, "allreduce", 1, exact=True)
    assert rep.first.step == 1 and rep.first.kind == "grad"


def test_tolerance_overrides_apply_per_dtype() -> None:
    setup = Setup(perturb=(0, 1, 0, None), delta=1e-3)
    assert not check(setup, "torch_ddp", 2).ok
    loose = {torch.float64: Tolerance(rtol=1.0, atol=1.0)}
    assert check(setup, "torch_ddp", 2, tolerances=loose).ok


def test_the_report_serialises_to_json() -> None:
    rep = check(Setup(perturb=(1, 1, 0, 1), delta=0.5), "naive", 2)
    d = json.loads(json.dumps(rep.to_dict()))
    assert d["ok"] is False and d["divergences"][0]["step"] == 1
    assert d["divergences"][0]["text"] == str(rep.first)


# ---- names


def _renamed(setup: Setup) -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = model(setup)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x)

    m = nn.parallel.DistributedDataParallel(Net())
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for step in range(setup.steps):
        x, y = _my_batch(setup, step)
        opt.zero_grad()
        F.mse_loss(m(x), y).backward()
        opt.step()


def test_names_that_differ_are_reported_then_mapped() -> None:
    rep = simdist.check_equivalence(_renamed, _sgd_reference, cpu(2), args=(Setup(),))
    assert rep.first.kind == "structure" and "names=" in str(rep.first)
    rep = simdist.check_equivalence(_renamed, _sgd_reference, cpu(2), args=(Setup(),), names={"body.*": "*"})
    assert rep.ok, str(rep)
    rep = simdist.check_equivalence(
        _renamed, _sgd_reference, cpu(2), args=(Setup(),), names=lambda n: n.removeprefix("body.")
    )
    assert rep.ok, str(rep)


def test_wrapper_prefixes_are_removed_only_from_wrappers() -> None:
    inner = nn.Linear(2, 2)

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = inner
            self.other = nn.Linear(2, 2)

    class Wrapper(nn.Module):
        def __init__(self, m: nn.Module) -> None:
            super().__init__()
            self.module = m

    assert [n for n, _ in named_tensors(Wrapper(inner))[0]] == ["weight", "bias"]
    assert [n for n, _ in named_tensors(Holder())[0]][:2] == ["module.weight", "module.bias"]
    names = NameMap({"a.*.w": "b.*.v", "x": "y"}, ignore=("skip.*",))
    assert names.reference_name("a.3.w") == "b.3.v"
    assert names.reference_name("x") == "y" and names.reference_name("z") == "z"
    assert names.reference_name("skip.me") is None


# ---- sharded state: DTensor tensor parallelism, hand-written shards


def _tp(setup: Setup, bug: bool = False) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    m = model(setup)
    parallelize_module(m, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    for step in range(setup.steps):
        x, y = data(setup, step)
        opt.zero_grad()
        F.mse_loss(m(x), y).backward()
        if bug and step == 1 and dist.get_rank() == 1:
            m[0].weight.grad.to_local().mul_(2.0)
        opt.step()


def _adam_reference(setup: Setup) -> None:
    m = model(setup)
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    for step in range(setup.steps):
        x, y = data(setup, step)
        opt.zero_grad()
        F.mse_loss(m(x), y).backward()
        opt.step()


def test_dtensor_tensor_parallel_state_is_assembled_and_a_shard_fault_names_its_rank() -> None:
    setup = Setup(widths=(4, 6, 4))
    assert simdist.check_equivalence(_tp, _adam_reference, cpu(2), args=(setup,)).ok
    rep = simdist.check_equivalence(_tp, _adam_reference, cpu(2), args=(setup, True), reference_args=(setup,))
    assert rep.first.step == 1 and rep.first.kind == "grad" and rep.first.name == "0.weight"
    assert rep.first.ranks == (1,), "only rank 1's rows of the column-parallel weight differ"


def _megatron(setup: Setup, wrong_shard: bool = False) -> None:
    """Column-parallel first layer with plain tensors: each rank holds rows of W1 and b1, columns of W2."""
    rank, world = dist.get_rank(), dist.get_world_size()
    full = model(setup)
    h = setup.widths[1] // world
    take = (world - 1 - rank) if wrong_shard else rank
    w1 = nn.Parameter(full[0].weight.detach()[take * h : (take + 1) * h].clone())
    b1 = nn.Parameter(full[0].bias.detach()[take * h : (take + 1) * h].clone())
    w2 = nn.Parameter(full[2].weight.detach()[:, rank * h : (rank + 1) * h].clone())
    b2 = nn.Parameter(full[2].bias.detach().clone())

    class Shard(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Module()
            self.first.weight, self.first.bias = w1, b1
            self.second = nn.Module()
            self.second.weight, self.second.bias = w2, b2

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            partial = torch.tanh(x @ w1.T + b1) @ w2.T
            dist.all_reduce(partial)  # forward value; its gradient is the local one, as Megatron's f/g pair
            return partial + b2

    net = Shard()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(setup.steps):
        x, y = data(setup, step)
        opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        opt.step()


def test_hand_written_shards_are_assembled_as_described() -> None:
    setup = Setup(widths=(4, 6, 4), batch=4)
    shards = {"first.*": 0, "second.weight": 1}
    names = {"first.weight": "0.weight", "first.bias": "0.bias", "second.weight": "2.weight", "second.bias": "2.bias"}
    rep = simdist.check_equivalence(_megatron, _sgd_reference, cpu(2), args=(setup,), shards=shards, names=names)
    assert rep.ok, str(rep)
    rep = simdist.check_equivalence(
        _megatron, _sgd_reference, cpu(2), args=(setup, True), reference_args=(setup,), shards=shards, names=names
    )
    assert rep.first.step == 0
    assert any(d.kind == "loss" for d in rep.divergences)
    # without the description the ranks' pieces look like replicas that differ
    rep = simdist.check_equivalence(_megatron, _sgd_reference, cpu(2), args=(setup,), names=names)
    assert any(d.kind == "replica" for d in rep.divergences)
    assert any(d.kind == "structure" and "shards=" in d.detail for d in rep.divergences)


def test_a_shard_description_that_does_not_fit_is_an_error() -> None:
    setup = Setup(widths=(4, 6, 4), batch=4)
    with pytest.raises(AssemblyError, match="groups of 3 ranks"):
        simdist.check_equivalence(
            _megatron, _sgd_reference, cpu(2), args=(setup,), shards={"first.*": (0, 3)}, names={"first.*": "0.*"}
        )


# ---- arguments and the tolerance


@pytest.mark.parametrize("bad, match", [
    ({"steps": 0}, "steps must be"),
    ({"loss": "median"}, "loss must be"),
    ({"shards": {"x": "rows"}}, "shards"),
])
def test_bad_arguments_are_refused(bad: dict, match: str) -> None:
    with pytest.raises(RunArgumentError, match=match):
        simdist.check_equivalence(_sgd_reference, _sgd_reference, cpu(1), args=(Setup(),), **bad)


def test_the_tolerance_is_at_the_tensor_scale() -> None:
    ref = torch.tensor([1.0, 1e-9], dtype=torch.float32)
    near = ref + torch.tensor([0.0, 1e-6])
    assert compare(near, ref, exact=False) is None, "a rounding error next to a large element is tolerated"
    far = ref + torch.tensor([1e-3, 0.0])
    d = compare(far, ref, exact=False)
    assert d is not None and d.count == 1 and d.max_abs == pytest.approx(1e-3, rel=1e-3)
    nan = torch.tensor([float("nan"), 1.0])
    assert compare(nan, nan.clone(), exact=True) is None and compare(nan, nan.clone(), exact=False) is None
    assert compare(torch.tensor([1, 2]), torch.tensor([1, 3]), exact=False).count == 1
