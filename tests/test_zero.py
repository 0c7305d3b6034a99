"""ZeRO stage 1 (``simdist.strategies.ShardedOptimizer``): equal to the unsharded optimizer, state only for a share.

Oracles: the single-process model through ``simdist.check_equivalence`` (torch DDP averages the gradients),
the unsharded torch optimizer stepped beside the sharded one on the same gradients (bitwise), and that
optimizer's own ``state_dict()`` for consolidation. The same program on real gloo processes is marked ``real``.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import simdist
from real.oracle import check_final_state
from simdist.strategies import ShardedOptimizer
from simdist.strategies.zero import SHARD_KEY, partition_parameters
from tests.zero_fns import OPTIMIZERS, ZeroSetup, average_gradients, reference, sharded, unsharded, zero_ddp


def run(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """``fn(*args)`` on ``world`` simulated ranks of a zero-cost cluster; each rank's return value."""
    return simdist.run(fn, simdist.Cluster.switch(world, device="cpu"), args=args, compute=False).returns


def rank_error(fn: Callable[..., Any], world: int, *args: Any) -> BaseException:
    """The exception ``fn`` raised in a rank (the run must fail)."""
    with pytest.raises(simdist.RankError) as info:
        run(fn, world, *args)
    return info.value.exc


# ---- the partition


@given(numels=st.lists(st.integers(0, 50), min_size=1, max_size=20), world=st.integers(1, 8))
def test_shares_are_contiguous_runs_balanced_within_the_largest_parameter(numels: list[int], world: int) -> None:
    owners = partition_parameters(numels, world)
    assert len(owners) == len(numels)
    assert owners == sorted(owners) and all(0 <= o < world for o in owners)
    shares = [sum(n for n, o in zip(numels, owners) if o == r) for r in range(world)]
    assert sum(shares) == sum(numels)
    assert max(shares) <= sum(numels) / world + max(numels)


def test_a_model_of_equal_layers_splits_evenly() -> None:
    assert partition_parameters([10] * 8, 4) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert partition_parameters([100, 1, 1, 1], 2) == [0, 1, 1, 1]


# ---- equal to single-process training (the oracle)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("groups", [False, True])
def test_torch_ddp_with_a_sharded_optimizer_equals_single_process_training(optimizer: str, groups: bool) -> None:
    setup = ZeroSetup(optimizer=optimizer, groups=groups)
    rep = simdist.check_equivalence(zero_ddp, reference, simdist.Cluster.switch(4, device="cpu"), args=(setup,),
                                    compute=False)
    assert rep.ok, str(rep)
    assert rep.steps == setup.base.steps


# ---- bitwise equal to the unsharded optimizer, state only for the share


class Vectors(nn.Module):
    """Parameters of the given shapes; ``used[i]`` says whether the loss reads parameter ``i``."""

    def __init__(self, shapes: list[tuple[int, ...]], used: list[bool]) -> None:
        super().__init__()
        self.ps = nn.ParameterList(nn.Parameter(torch.randn(s)) for s in shapes)
        self.used = used

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        terms = [(p.reshape(-1).sin() * x[: p.numel()]).sum() for p, u in zip(self.ps, self.used) if u]
        return torch.stack(terms).pow(2).sum()


def side_by_side(shapes: list[tuple[int, ...]], used: list[bool], optimizer: str, steps: int) -> dict[str, Any]:
    """Rank code: the unsharded and the sharded optimizer stepped on the same averaged gradients."""
    torch.manual_seed(0)
    plain = Vectors(shapes, used)
    zero = copy.deepcopy(plain)
    setup = ZeroSetup(optimizer=optimizer)
    opt_plain, opt_zero = unsharded(setup, plain), sharded(setup, zero)
    width = max(1, max(int(torch.tensor(s).prod()) for s in shapes))
    for step in range(steps):
        x = torch.randn(width, generator=torch.Generator().manual_seed(100 * step + dist.get_rank()))
        for net, opt in ((plain, opt_plain), (zero, opt_zero)):
            opt.zero_grad()
            net(x).backward()
            average_gradients(list(net.parameters()))
            opt.step()
    owned = {id(p) for p in opt_zero.owned_parameters()}
    index = {id(p): i for i, p in enumerate(zero.parameters())}
    return {
        "equal": all(torch.equal(a, b) for a, b in zip(plain.parameters(), zero.parameters())),
        "state_of": sorted(index[id(p)] for p in opt_zero.state),
        "owned": sorted(index[i] for i in owned),
        "state_equal": all(
            torch.equal(torch.as_tensor(v), torch.as_tensor(opt_plain.state[p_plain][k]))
            for p_plain, p_zero in zip(plain.parameters(), zero.parameters())
            if p_zero in opt_zero.state
            for k, v in opt_zero.state[p_zero].items()
        ),
        "bytes": state_bytes(opt_zero),
        "plain_bytes": state_bytes(opt_plain),
    }


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in ``opt.state`` (this rank's share for a ShardedOptimizer)."""
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))


@given(
    params=st.lists(st.tuples(st.integers(1, 7), st.integers(1, 5), st.booleans()), min_size=1, max_size=9),
    world=st.integers(1, 8),
    optimizer=st.sampled_from(sorted(OPTIMIZERS)),
)
def test_sharded_equals_unsharded_bitwise_and_keeps_state_for_its_share(
    params: list[tuple[int, int, bool]], world: int, optimizer: str
) -> None:
    shapes = [(rows, cols) if cols > 1 else (rows,) for rows, cols, _ in params]
    used = [u for *_, u in params]
    used[0] = True  # the loss reads at least one parameter
    returns = run(side_by_side, world, shapes, used, optimizer, 2)
    holders: list[int] = []
    for got in returns:
        assert got["equal"] and got["state_equal"]
        # state exactly for the owned parameters that had a gradient: unused ones are skipped, as torch skips them
        assert got["state_of"] == [i for i in got["owned"] if used[i]]
        holders += got["state_of"]
    assert sorted(holders) == [i for i, u in enumerate(used) if u]  # each state held once, on its owner
    assert sum(got["bytes"] for got in returns) == returns[0]["plain_bytes"]


def adam_state_per_rank() -> dict[str, int]:
    """Rank code: Adam's state bytes on this rank after a step, and what its share predicts."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = ShardedOptimizer(net.parameters(), torch.optim.Adam, lr=1e-3)
    net(torch.randn(8, 16)).sum().backward()
    average_gradients(list(net.parameters()))
    opt.step()
    owned = opt.owned_parameters()
    return {"bytes": state_bytes(opt), "tensors": sum(len(s) for s in opt.state.values()),
            "owned_numel": sum(p.numel() for p in owned), "owned": len(owned)}


def test_each_rank_holds_adam_state_for_its_share_only() -> None:
    returns = run(adam_state_per_rank, 4)
    total = (16 * 32 + 32) + (32 * 32 + 32) + (32 * 4 + 4)
    assert sum(r["owned_numel"] for r in returns) == total
    for r in returns:
        # exp_avg and exp_avg_sq (fp32) per owned parameter, plus its step counter (a 0-d fp32 tensor)
        assert r["tensors"] == 3 * r["owned"]
        assert r["bytes"] == 2 * 4 * r["owned_numel"] + 4 * r["owned"]
        assert r["owned_numel"] < total  # nobody holds it all
    assert max(r["owned_numel"] for r in returns) <= total / 4 + 32 * 32


# ---- state dicts


def state_dicts(optimizer: str) -> dict[str, Any]:
    """Rank code: consolidation, loading (consolidated, own share, into torch's optimizer) and resuming."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    shapes, used = [(5, 3), (3,), (4, 4), (7,)], [True] * 4
    plain = Vectors(shapes, used)
    zero = copy.deepcopy(plain)
    setup = ZeroSetup(optimizer=optimizer, groups=False)
    opt_plain, opt_zero = unsharded(setup, plain), sharded(setup, zero)

    def train(net: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
        for step in steps:
            x = torch.randn(16, generator=torch.Generator().manual_seed(100 * step + rank))
            opt.zero_grad()
            net(x).backward()
            average_gradients(list(net.parameters()))
            opt.step()

    train(plain, opt_plain, range(2))
    train(zero, opt_zero, range(2))
    consolidated = opt_zero.state_dict()  # on rank 0
    # state dicts hold the optimizer's own tensors, which later steps update in place (torch's do too): copy
    own = copy.deepcopy(opt_zero.state_dict(consolidate_to=None))
    expected = opt_plain.state_dict()
    same_as_torch = rank != 0 or (
        consolidated["param_groups"] == expected["param_groups"]
        and consolidated["state"].keys() == expected["state"].keys()
        and all(torch.equal(torch.as_tensor(v), torch.as_tensor(expected["state"][i][k]))
                for i, s in consolidated["state"].items() for k, v in s.items())
    )
    # what rank 0 saved reaches every rank as a file would
    buffer = io.BytesIO()
    if rank == 0:
        torch.save(consolidated, buffer)
    shared = [buffer.getvalue()]
    dist.broadcast_object_list(shared, group_src=0)
    loaded = torch.load(io.BytesIO(shared[0]), weights_only=False)

    snapshot = copy.deepcopy(zero.state_dict())
    train(zero, opt_zero, range(2, 4))
    after_uninterrupted = [p.detach().clone() for p in zero.parameters()]
    resumed_nets = []
    for state in (loaded, own):
        zero.load_state_dict(snapshot)
        fresh = sharded(setup, zero)
        fresh.load_state_dict(copy.deepcopy(state))
        train(zero, fresh, range(2, 4))
        resumed_nets.append([p.detach().clone() for p in zero.parameters()])
    # torch's own optimizer loads the consolidated dict and continues the same way
    zero.load_state_dict(snapshot)
    torch_opt = unsharded(setup, zero)
    torch_opt.load_state_dict(copy.deepcopy(loaded))
    train(zero, torch_opt, range(2, 4))
    resumed_nets.append([p.detach().clone() for p in zero.parameters()])

    errors = {}
    others = [None] * dist.get_world_size()
    dist.all_gather_object(others, own)
    bad_cases = {
        "other rank": others[(rank + 1) % len(others)],
        "other groups": {"state": {}, "param_groups": [{"params": [0, 1]}]},
        "not a state dict": {"weights": 1},
    }
    for name, state in bad_cases.items():
        try:
            sharded(setup, zero).load_state_dict(state)
        except ValueError as e:
            errors[name] = str(e)
    try:
        opt_zero.state_dict(consolidate_to=dist.get_world_size())
    except ValueError as e:
        errors["consolidate_to"] = str(e)
    return {
        "same_as_torch": same_as_torch,
        "own_marked": own[SHARD_KEY] == {"rank": rank, "world_size": dist.get_world_size()},
        "own_keys": sorted(own["state"]),
        "owned": sorted(i for i, p in enumerate(zero.parameters()) if opt_zero.owner_of(p) == rank),
        "resumed_equal": [all(torch.equal(a, b) for a, b in zip(after_uninterrupted, r)) for r in resumed_nets],
        "errors": errors,
    }


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_state_dict_consolidates_like_torch_and_round_trips(optimizer: str) -> None:
    returns = run(state_dicts, 3, optimizer)
    for rank, got in enumerate(returns):
        assert got["same_as_torch"]
        assert got["own_marked"] and got["own_keys"] == got["owned"]
        # resumed from the consolidated dict, from the rank's own share, and in torch's optimizer: all identical
        assert got["resumed_equal"] == [True, True, True]
        errors = got["errors"]
        assert set(errors) == {"other rank", "other groups", "not a state dict", "consolidate_to"}
        assert f"rank {(rank + 1) % 3}'s share" in errors["other rank"]
        assert "hold [2] parameters, this optimizer's hold [4]" in errors["other groups"]
        assert "'state' and 'param_groups'" in errors["not a state dict"]
        assert "consolidate_to=3" in errors["consolidate_to"]


# ---- param groups and schedulers


def scheduled(world: int) -> bool:
    """Rank code: two groups, a StepLR schedule and a group added after a step; equal to the unsharded run."""
    torch.manual_seed(0)
    shapes, used = [(6, 2), (3,), (5,), (2, 2)], [True] * 4
    plain = Vectors(shapes, used)
    zero = copy.deepcopy(plain)
    results = []
    for net, make in ((plain, None), (zero, ShardedOptimizer)):
        ps = list(net.parameters())
        groups = [{"params": ps[:2]}, {"params": ps[2:3], "lr": 0.05, "betas": (0.5, 0.6)}]
        opt = torch.optim.Adam(groups, lr=0.01) if make is None else make(groups, torch.optim.Adam, lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for step in range(4):
            if step == 2:
                opt.add_param_group({"params": ps[3:], "lr": 0.2})
            x = torch.randn(16, generator=torch.Generator().manual_seed(step + dist.get_rank()))
            opt.zero_grad()
            net(x).backward()
            average_gradients(ps)
            opt.step()
            sched.step()
        results.append([p.detach().clone() for p in ps])
    return all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("world", [2, 3])
def test_groups_schedulers_and_added_groups_behave_as_unsharded(world: int) -> None:
    assert run(scheduled, world, world) == [True] * world


# ---- errors


def bad_arguments(case: str) -> None:
    net = nn.Linear(2, 2)
    if case == "empty":
        ShardedOptimizer([], torch.optim.SGD, lr=0.1)
    elif case == "empty groups":
        ShardedOptimizer([{"params": []}], torch.optim.SGD, lr=0.1)
    elif case == "instance":
        ShardedOptimizer(net.parameters(), torch.optim.SGD(net.parameters(), lr=0.1))
    elif case == "not an optimizer":
        ShardedOptimizer(net.parameters(), nn.Linear, lr=0.1)


@pytest.mark.parametrize(
    ("case", "kind", "text"),
    [
        ("empty", ValueError, "empty parameter list"),
        ("empty groups", ValueError, "empty parameter list"),
        ("instance", TypeError, "the class itself"),
        ("not an optimizer", TypeError, "torch.optim.Optimizer subclass"),
    ],
)
def test_bad_arguments_are_refused_with_what_to_pass(case: str, kind: type, text: str) -> None:
    exc = rank_error(bad_arguments, 2, case)
    assert isinstance(exc, kind) and text in str(exc), str(exc)


def unordered(case: str) -> None:
    """Rank code: a ShardedOptimizer over an unordered collection of parameters (or a bare tensor)."""
    net = nn.Linear(2, 2)
    if case == "set":
        ShardedOptimizer(set(net.parameters()), torch.optim.SGD, lr=0.1)
    elif case == "frozenset":
        ShardedOptimizer(frozenset(net.parameters()), torch.optim.SGD, lr=0.1)
    elif case == "set in a group":
        ShardedOptimizer([{"params": set(net.parameters())}], torch.optim.SGD, lr=0.1)
    elif case == "set added":
        ShardedOptimizer([net.weight], torch.optim.SGD, lr=0.1).add_param_group({"params": {net.bias}})
    elif case == "tensor":
        ShardedOptimizer(net.weight, torch.optim.SGD, lr=0.1)


def torch_refusal(params: Any) -> str:
    """What torch's own optimizer says when given ``params``."""
    with pytest.raises(TypeError) as info:
        torch.optim.SGD(params, lr=0.1)
    return str(info.value)


@pytest.mark.parametrize("case", ["set", "frozenset", "set in a group", "set added", "tensor"])
def test_unordered_parameters_are_refused_with_torchs_own_type_error(case: str) -> None:
    exc = rank_error(unordered, 2, case)
    p = nn.Parameter(torch.zeros(2))
    # the oracle: torch's optimizer on a set inside a param group, and on a bare tensor (torch itself takes a
    # bare set as a list, which every rank would order differently here)
    expected = torch_refusal(p) if case == "tensor" else torch_refusal([{"params": {p}}])
    assert isinstance(exc, TypeError) and str(exc) == expected, str(exc)


#: shapes that tell every parameter apart: a rank that lists them in another order differs in some position
SHAPES = [(4, 3), (3,), (3, 3), (5,), (2, 3), (2,)]


def ordered_as(orders: list[list[int]], members: list[int] | None) -> None:
    """Rank code: a ShardedOptimizer over the parameters in this rank's order (over a group of ``members``)."""
    params = [nn.Parameter(torch.zeros(s)) for s in SHAPES]
    group = None if members is None else dist.new_group(members)
    if dist.get_rank() in (members or range(dist.get_world_size())):
        ShardedOptimizer([params[i] for i in orders[dist.get_rank()]], torch.optim.SGD, group=group, lr=0.5)


@given(orders=st.lists(st.permutations(range(len(SHAPES))), min_size=2, max_size=4), subgroup=st.booleans())
def test_parameters_listed_in_another_order_on_some_rank_are_refused_naming_the_first_difference(
    orders: list[list[int]], subgroup: bool
) -> None:
    world = len(orders)
    members = list(range(1, world)) if subgroup and world > 2 else list(range(world))
    first = members[0]
    # oracle: the first position where a member's order differs from the group's first rank's, and that member
    differing = [(i, r) for r in members[1:] for i in range(len(SHAPES)) if orders[r][i] != orders[first][i]]
    if not differing:
        assert run(ordered_as, world, orders, members) == [None] * world
        return
    position, rank = min(differing)
    exc = rank_error(ordered_as, world, orders, members)
    assert isinstance(exc, ValueError)
    a, b = (f"{SHAPES[orders[r][position]]} float32" for r in (first, rank))
    want = f"at param group 0, position {position}: rank {first} has {a} and rank {rank} has {b}"
    assert want in str(exc) and "never a set" in str(exc), str(exc)


def swapped_twins() -> None:
    """Rank code: two named parameters of one shape, listed in swapped order on rank 1."""
    params = {"a": nn.Parameter(torch.zeros(3)), "b": nn.Parameter(torch.ones(3))}
    order = ["a", "b"] if dist.get_rank() == 0 else ["b", "a"]
    ShardedOptimizer([(n, params[n]) for n in order], torch.optim.SGD, lr=1.0)


def test_parameters_of_one_shape_in_swapped_order_are_told_apart_by_their_names() -> None:
    exc = rank_error(swapped_twins, 2)
    want = "at param group 0, position 0: rank 0 has (3,) float32 'a' and rank 1 has (3,) float32 'b'"
    assert want in str(exc), str(exc)


def test_outside_a_process_group_it_says_to_initialise_one() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        ShardedOptimizer(nn.Linear(2, 2).parameters(), torch.optim.SGD, lr=0.1)


# ---- real processes


@pytest.mark.real
@pytest.mark.parametrize("nproc", [4])  # the larger world size: 2 ranks are covered by the simulated tests above
def test_sharded_optimizer_on_real_gloo_processes_equals_single_process_training(nproc: int) -> None:
    setup = ZeroSetup(optimizer="adamw", groups=True)
    rep = check_final_state(zero_ddp, reference, nproc, args=(setup,))
    assert rep.ok, str(rep)


# ---- a consolidated state dict resumes on another number of ranks


def full_batch_training(steps: range, state: bytes | None, params: list[torch.Tensor] | None) -> dict[str, Any]:
    """Rank code: every rank trains on the same full batch (so the world size cannot matter), from ``state``."""
    torch.manual_seed(0)
    net = Vectors([(5, 3), (3,), (4, 4), (7,)], [True] * 4)
    if params is not None:
        with torch.no_grad():
            for p, saved in zip(net.parameters(), params):
                p.copy_(saved)
    opt = ShardedOptimizer(net.parameters(), torch.optim.AdamW, lr=0.01, weight_decay=0.1)
    if state is not None:
        opt.load_state_dict(torch.load(io.BytesIO(state), weights_only=False))
    for step in steps:
        x = torch.randn(16, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        net(x).backward()
        opt.step()
    consolidated = opt.state_dict()
    buffer = io.BytesIO()
    torch.save(consolidated, buffer)
    return {"state": buffer.getvalue(), "params": [p.detach().clone() for p in net.parameters()]}


def test_a_consolidated_state_dict_resumes_on_another_world_size() -> None:
    uninterrupted = run(full_batch_training, 1, range(4), None, None)[0]
    saved = run(full_batch_training, 3, range(2), None, None)[0]  # rank 0 holds the consolidated dict
    for world in (2, 4):
        resumed = run(full_batch_training, world, range(2, 4), saved["state"], saved["params"])
        for got in resumed:
            assert all(torch.equal(a, b) for a, b in zip(got["params"], uninterrupted["params"]))
