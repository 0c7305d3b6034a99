"""``simdist.strategies.PipelineOptimizer``: its surface, each sync mode against NumPy and against single-device
training (the equivalence oracle), ties, timeouts, shape errors, and properties over pipeline layouts.

Stages either hold replicas of one model (what AVERAGE and SUM are right for) or partitions of it (what
STAGE_WISE is right for); tests/pipeline_fns.py trains partitioned stages with a hand-written GPipe loop.
"""

from __future__ import annotations

import dataclasses
import io
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.pipelining import PipelineStage

import real
import simdist
from simdist.strategies import (
    GradientSyncMode,
    PipelineOptimizer,
    PipelineOptimizerConfig,
    PipelineShapeError,
    PipelineTimeoutError,
)
from simdist.strategies.pipeline import MAX_TIMEOUT_MS
from tests import pipeline_fns as fns
from tests.pipeline_fns import Layout

#: examples per property: each is two simulated runs of a few hundredths of a second
EXAMPLES = 12 if os.environ.get("HYPOTHESIS_PROFILE", "ci") == "ci" else 150


def run(fn: Callable[..., Any], world: int, *args: Any, **kwargs: Any) -> list[Any]:
    """``fn(*args, **kwargs)`` on ``world`` simulated ranks; each rank's return value."""
    result = simdist.run(fn, simdist.Cluster.switch(world, device="cpu"), args=args, kwargs=kwargs, compute=False)
    return result.returns


def rank_error(fn: Callable[..., Any], world: int, *args: Any, **kwargs: Any) -> BaseException:
    """The exception ``fn`` raised in a rank (the run must fail)."""
    with pytest.raises(simdist.RankError) as info:
        run(fn, world, *args, **kwargs)
    return info.value.exc


def check(layout: Layout, mode: str = "stage_wise", **options: Any) -> simdist.EquivalenceReport:
    """``pipeline_fns.train(layout, mode, **options)`` on ``layout.world`` ranks against the single-device model."""
    # the last stage's tied projection is the embedding of the reference (named once there)
    names = {"head.weight*": "embed.weight*"} if layout.tie else None
    return simdist.check_equivalence(
        fns.train, fns.reference, simdist.Cluster.switch(layout.world, device="cpu"), args=(layout, mode),
        kwargs=options, reference_args=(layout,), reference_kwargs={}, names=names, compute=False, localize=False,
    )


def linear(rank: int, out: int = 3, into: int = 2) -> nn.Linear:
    """A float64 Linear whose values depend on ``rank`` (replicas that start different)."""
    torch.manual_seed(rank)
    return nn.Linear(into, out).double()


def integer_grads(params: list[nn.Parameter], rank: int) -> list[torch.Tensor]:
    """Integer-valued float64 gradients: their sums and quotients by 2 and 4 are exact in any order."""
    g = torch.Generator().manual_seed(10 + rank)
    return [torch.randint(-50, 50, p.shape, generator=g).double() for p in params]


def optimizer(module: nn.Module, mode: str = "average", lr: float = 0.5, **config: Any) -> PipelineOptimizer:
    """A PipelineOptimizer over plain SGD for one stage."""
    cfg = PipelineOptimizerConfig(sync_mode=mode, **config)
    return PipelineOptimizer(torch.optim.SGD(module.parameters(), lr=lr), [module], cfg)


# --------------------------------------------------------------------------------------- configuration


@pytest.mark.parametrize("value, converted", [("average", GradientSyncMode.AVERAGE),
                                              ("STAGE_WISE", GradientSyncMode.STAGE_WISE),
                                              (GradientSyncMode.NONE, GradientSyncMode.NONE)])
def test_validate_accepts_modes_and_converts_their_names(value: Any, converted: GradientSyncMode) -> None:
    config = PipelineOptimizerConfig(sync_mode=value)
    config.validate()
    assert config.sync_mode is converted


@pytest.mark.parametrize("field, value, error, words", [
    ("sync_mode", "mean", ValueError, "must be one of ['none', 'average', 'sum', 'stage_wise']"),
    ("sync_mode", 2, TypeError, "got 2 of type int"),
    ("synchronize_gradients", "yes", TypeError, "synchronize_gradients must be True or False; got 'yes'"),
    ("broadcast_parameters", 1, TypeError, "broadcast_parameters must be True or False; got 1"),
    ("communication_timeout_ms", 0, ValueError, "must be > 0 milliseconds; got 0"),
    ("communication_timeout_ms", -5, ValueError, "must be > 0 milliseconds; got -5"),
    ("communication_timeout_ms", 1.5, TypeError, "an int of milliseconds; got 1.5"),
    ("communication_timeout_ms", True, TypeError, "an int of milliseconds; got True"),
])
def test_validate_names_the_field_and_the_value(field: str, value: Any, error: type, words: str) -> None:
    config = PipelineOptimizerConfig(**{field: value})
    with pytest.raises(error) as info:
        config.validate()
    assert f"PipelineOptimizerConfig.{field}" in str(info.value) and words in str(info.value)


#: values a careless or hostile caller puts in any field
ODD_VALUES = st.one_of(
    st.booleans(),
    st.none(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([MAX_TIMEOUT_MS, MAX_TIMEOUT_MS + 1, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["average", "SUM", "Stage_Wise", "none", " average", "avg"]),
    st.sampled_from(list(GradientSyncMode)),
    st.builds(np.int64, st.integers(-5, 10**12)),
    st.sampled_from([np.float64(30.0), np.bool_(True), b"sum", [1], {}]),
)

#: a valid value of each field, drawn beside the odd ones so that one bad field among good ones is common
VALID_VALUES = {
    "sync_mode": st.sampled_from([*GradientSyncMode, "average", "SUM", "Stage_Wise"]),
    "synchronize_gradients": st.booleans(),
    "broadcast_parameters": st.booleans(),
    "communication_timeout_ms": st.one_of(
        st.integers(1, MAX_TIMEOUT_MS), st.builds(np.int64, st.integers(1, 10**12))
    ),
}


def valid(field: str, value: Any) -> bool:
    """Oracle: whether ``value`` is a valid ``field`` (the rules docs/pipeline.md states)."""
    if field == "sync_mode":
        modes = [m.value for m in GradientSyncMode]
        return isinstance(value, GradientSyncMode) or (isinstance(value, str) and value.lower() in modes)
    if field in ("synchronize_gradients", "broadcast_parameters"):
        return isinstance(value, bool)
    integer = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
    return integer and 0 < value <= MAX_TIMEOUT_MS


FIELDS = [f.name for f in dataclasses.fields(PipelineOptimizerConfig)]


@given(values=st.fixed_dictionaries({name: st.one_of(VALID_VALUES[name], ODD_VALUES) for name in FIELDS}))
@example(values={"sync_mode": "sum", "synchronize_gradients": True, "broadcast_parameters": True,
                 "communication_timeout_ms": 10**30})
@example(values={"sync_mode": "none", "synchronize_gradients": False, "broadcast_parameters": True,
                 "communication_timeout_ms": MAX_TIMEOUT_MS + 1})
@example(values={"sync_mode": GradientSyncMode.SUM, "synchronize_gradients": True, "broadcast_parameters": False,
                 "communication_timeout_ms": np.int64(500)})
@example(values={"sync_mode": True, "synchronize_gradients": float("nan"), "broadcast_parameters": None,
                 "communication_timeout_ms": float("inf")})
def test_validate_refuses_every_invalid_field_by_name_and_normalises_the_valid_ones(values: dict[str, Any]) -> None:
    config = PipelineOptimizerConfig(**values)
    invalid = [name for name in FIELDS if not valid(name, values[name])]
    if invalid:
        with pytest.raises((TypeError, ValueError)) as info:
            config.validate()
        # the first invalid field in declaration order is named, with the value it got
        assert f"PipelineOptimizerConfig.{invalid[0]} must be" in str(info.value), str(info.value)
        assert not isinstance(info.value, OverflowError)
        return
    config.validate()
    assert isinstance(config.sync_mode, GradientSyncMode)
    timeout = config.communication_timeout_ms
    assert type(timeout) is int and timeout == values["communication_timeout_ms"]


def timeout_refused(timeout_ms: Any) -> None:
    """Rank code: a PipelineOptimizer whose collectives may take ``timeout_ms``."""
    module = nn.Linear(2, 2)
    PipelineOptimizer(torch.optim.SGD(module.parameters(), lr=0.1), [module],
                      PipelineOptimizerConfig(communication_timeout_ms=timeout_ms))


@pytest.mark.parametrize("timeout_ms", [10**30, MAX_TIMEOUT_MS + 1, 2**63])
def test_a_timeout_beyond_what_the_backends_can_count_is_refused_at_construction(timeout_ms: int) -> None:
    exc = rank_error(timeout_refused, 2, timeout_ms)
    assert isinstance(exc, ValueError) and f"must be at most {MAX_TIMEOUT_MS} milliseconds" in str(exc), str(exc)


def test_the_longest_timeout_waits_and_steps_in_simulation() -> None:
    assert run(fns.patient, 2, MAX_TIMEOUT_MS, 0.0) == run(fns.patient, 2, 30000, 0.0)


#: the checks on two real gloo processes, run in turn by one launch: (function of pipeline_fns, arguments)
ON_TWO_REAL_RANKS = {
    "patient": ("patient", (MAX_TIMEOUT_MS, 1.0)),
    "pp2": ("train", (Layout(2), "stage_wise")),
    "tie": ("train", (Layout(2, tie=True), "stage_wise")),
}


@pytest.fixture(scope="module")
def on_two_real_ranks(session_results) -> dict[str, list]:
    """What each check of ON_TWO_REAL_RANKS returned on each rank, from one launch of two real gloo processes."""

    def launch() -> dict[str, list]:
        returns = real.run(fns.in_turn, 2, args=(list(ON_TWO_REAL_RANKS.values()),), timeout=240).returns
        return {key: [r[i] for r in returns] for i, key in enumerate(ON_TWO_REAL_RANKS)}

    return session_results.get("pipeline-on-two-real-ranks", launch)


@pytest.mark.real
def test_the_longest_timeout_is_one_real_gloo_accepts_and_waits_out(on_two_real_ranks: dict) -> None:
    # gloo refuses 1e13 ms ("Invalid timeout") and times out at once at 9e12 ms (its deadline overflows)
    assert on_two_real_ranks["patient"] == run(fns.patient, 2, 30000, 0.0)


def test_defaults_are_the_documented_ones() -> None:
    config = PipelineOptimizerConfig()
    assert (config.sync_mode, config.synchronize_gradients, config.broadcast_parameters,
            config.communication_timeout_ms) == (GradientSyncMode.AVERAGE, True, True, 30000)


# --------------------------------------------------------------------------------------- construction


def created() -> dict[str, Any]:
    rank = dist.get_rank()
    module = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    other = nn.Linear(1, 1)
    sgd = torch.optim.SGD([{"params": module.parameters(), "lr": 0.1}, {"params": other.parameters(), "lr": 0.1}])
    opt = PipelineOptimizer(sgd, [module, other], None, ties=[])
    stage = PipelineStage(nn.Linear(2, 2), rank, 2, torch.device("cpu"))
    torch_opt = PipelineOptimizer(torch.optim.SGD(stage.submod.parameters(), lr=0.1), [stage])
    return {"num_stages": opt.num_stages, "current_rank": opt.current_rank, "lr": opt.learning_rate,
            "mode": opt.config.sync_mode, "torch_num_stages": torch_opt.num_stages}


def test_creation_with_valid_inputs_reports_stages_rank_and_learning_rate() -> None:
    returns = run(created, 2)
    for rank, got in enumerate(returns):
        # two local modules on each of 2 ranks; a torch PipelineStage knows its own count
        assert got == {"num_stages": 4, "current_rank": rank, "lr": 0.1, "mode": GradientSyncMode.AVERAGE,
                       "torch_num_stages": 2}


def construction_error(case: str) -> None:
    module = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    sgd = torch.optim.SGD(module.parameters(), lr=0.1)
    if case == "empty":
        PipelineOptimizer(sgd, [])
    elif case == "not a list":
        PipelineOptimizer(sgd, module)
    elif case == "not a stage":
        PipelineOptimizer(sgd, ["stage"])
    elif case == "not an optimizer":
        PipelineOptimizer(module, [module])
    elif case == "foreign parameters":
        PipelineOptimizer(torch.optim.SGD(list(module.parameters()) + [nn.Parameter(torch.zeros(7, 5))], lr=0.1),
                          [module])
    elif case == "missing parameters":
        PipelineOptimizer(torch.optim.SGD(module[0].parameters(), lr=0.1), [module])
    elif case == "invalid config":
        PipelineOptimizer(sgd, [module], PipelineOptimizerConfig(communication_timeout_ms=0))
    elif case == "unknown tie":
        PipelineOptimizer(sgd, [module], ties=[{0: "0.weight", 1: "embed.weight"}])
    elif case == "lonely tie":
        PipelineOptimizer(sgd, [module], ties=[{0: "0.weight"}])
    elif case == "not a member":
        group = dist.new_group([0])
        PipelineOptimizer(sgd, [module], pp_group=group)


@pytest.mark.parametrize("case, error, words", [
    ("empty", ValueError, "empty stage list; pass the stages this rank runs"),
    ("not a list", TypeError, "wrap a single stage in a list"),
    ("not a stage", TypeError, "stages[0] must be an nn.Module or a torch PipelineStage; got str"),
    ("not an optimizer", TypeError, "wraps a torch.optim.Optimizer; got Sequential"),
    ("foreign parameters", ValueError, ("holds 1 parameter(s) that are not trainable parameters of this rank's "
                                        "stages (shapes [(7, 5)])")),
    ("missing parameters", ValueError, ("does not hold these trainable parameters of this rank's stages: "
                                        "stage 0 '1.weight', stage 0 '1.bias'")),
    ("invalid config", ValueError, "communication_timeout_ms must be > 0"),
    ("unknown tie", ValueError, ("ties[0] on global rank 1: 'embed.weight' is not a trainable parameter of this "
                                 "rank's stages (parameters: ['0.weight', '0.bias', '1.weight', '1.bias'])")),
    ("lonely tie", ValueError, "ties[0] must map at least two global ranks"),
    ("not a member", ValueError, "rank 1 is not a member of the pp_group"),
])
def test_construction_errors_say_what_and_what_to_do(case: str, error: type, words: str) -> None:
    exc = rank_error(construction_error, 2, case)
    assert isinstance(exc, error), repr(exc)
    assert words in str(exc)


# --------------------------------------------------------------------------------------- unit behaviour


def zeroed(set_to_none: bool) -> list[Any]:
    a, b = nn.Linear(2, 3), nn.Linear(3, 1)
    opt = PipelineOptimizer(torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1), [a, b])
    b(a(torch.ones(4, 2))).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in [*a.parameters(), *b.parameters()])
    opt.zero_grad(set_to_none=set_to_none)
    return [p.grad for p in [*a.parameters(), *b.parameters()]]


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_clears_every_gradient_of_every_stage(set_to_none: bool) -> None:
    for grads in run(zeroed, 2, set_to_none):
        assert len(grads) == 4
        if set_to_none:
            assert all(g is None for g in grads)
        else:
            assert all(g is not None and not g.any() for g in grads)


def reduced(mode: str, synchronize: bool, broadcast: bool) -> dict[str, Any]:
    rank = dist.get_rank()
    module = linear(rank)
    params = list(module.parameters())
    before = [p.detach().clone() for p in params]
    grads = integer_grads(params, rank)
    opt = optimizer(module, mode, synchronize_gradients=synchronize, broadcast_parameters=broadcast)
    opt.set_gradients(grads)
    opt.step()
    return {"before": before, "grads_in": grads, "grads": [p.grad.clone() for p in params],
            "after": [p.detach().clone() for p in params]}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode", ["average", "sum"])
def test_averaging_and_summing_are_exact(world: int, mode: str) -> None:
    returns = run(reduced, world, mode, True, False)
    for i in range(2):
        stacked = np.stack([r["grads_in"][i].numpy() for r in returns])
        expected = stacked.sum(axis=0) if mode == "sum" else stacked.mean(axis=0)
        for r in returns:
            np.testing.assert_array_equal(r["grads"][i].numpy(), expected)
            # SGD on the reduced gradient, from this rank's own starting point
            np.testing.assert_allclose(r["after"][i].numpy(), r["before"][i].numpy() - 0.5 * expected, rtol=1e-15)


def test_step_without_synchronisation_steps_each_rank_on_its_own_gradients() -> None:
    returns = run(reduced, 2, "average", False, False)
    for r in returns:
        for i in range(2):
            np.testing.assert_array_equal(r["grads"][i].numpy(), r["grads_in"][i].numpy())
            np.testing.assert_allclose(r["after"][i].numpy(), r["before"][i].numpy() - 0.5 * r["grads_in"][i].numpy(),
                                       rtol=1e-15)
    assert not torch.equal(returns[0]["after"][0], returns[1]["after"][0])


@pytest.mark.parametrize("mode", ["none", "average", "sum"])
def test_broadcasting_gives_every_stage_the_parameters_of_stage_0(mode: str) -> None:
    returns = run(reduced, 4, mode, False, True)
    for i in range(2):
        expected = returns[0]["before"][i].numpy() - 0.5 * returns[0]["grads_in"][i].numpy()
        for r in returns:
            np.testing.assert_allclose(r["after"][i].numpy(), expected, rtol=1e-15)
    assert not torch.equal(returns[0]["before"][0], returns[1]["before"][0]), "the ranks started different"


def stage_wise_over_dp() -> dict[str, Any]:
    """4 ranks as 2 stages x 2 replicas: rank = replica * 2 + stage; stage s holds its own shape."""
    rank = dist.get_rank()
    replica, stage = divmod(rank, 2)
    pp = [dist.new_group([0, 1]), dist.new_group([2, 3])][replica]
    dp = [dist.new_group([0, 2]), dist.new_group([1, 3])][stage]
    module = linear(rank, out=3 + stage)
    params = list(module.parameters())
    grads = integer_grads(params, rank)
    opt = PipelineOptimizer(torch.optim.SGD(params, lr=0.5), [module],
                            PipelineOptimizerConfig(sync_mode="stage_wise"), pp_group=pp, dp_group=dp)
    opt.set_gradients(grads)
    opt.step()
    return {"grads_in": grads, "grads": [p.grad.clone() for p in params], "after": [p.detach().clone() for p in params]}


def test_stage_wise_averages_over_the_replicas_of_a_stage_only() -> None:
    returns = run(stage_wise_over_dp, 4)
    for stage in range(2):
        replicas = [returns[stage], returns[2 + stage]]
        for i in range(2):
            expected = np.mean([r["grads_in"][i].numpy() for r in replicas], axis=0)
            for r in replicas:
                np.testing.assert_array_equal(r["grads"][i].numpy(), expected)
        # the broadcast over dp_group keeps the replicas bitwise equal
        assert all(torch.equal(a, b) for a, b in zip(replicas[0]["after"], replicas[1]["after"]))


def learning_rates() -> list[float]:
    module = nn.Linear(2, 2)
    sgd = torch.optim.SGD([{"params": [module.weight], "lr": 0.1}, {"params": [module.bias], "lr": 0.2}])
    opt = PipelineOptimizer(sgd, [module])
    seen = [opt.learning_rate]
    opt.set_learning_rate(0.05)
    seen += [g["lr"] for g in sgd.param_groups] + [opt.learning_rate]
    with pytest.raises(ValueError, match="learning rate must be a number >= 0; got -1"):
        opt.set_learning_rate(-1)
    return seen


def test_learning_rate_getter_and_setter_cover_every_param_group() -> None:
    assert run(learning_rates, 1) == [[0.1, 0.05, 0.05, 0.05]]


def gradients_set() -> dict[str, Any]:
    a, b = nn.Linear(2, 3), nn.Linear(3, 1)
    opt = PipelineOptimizer(torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1), [a, b])
    grads = [torch.full(p.shape, float(i)) for i, p in enumerate([*a.parameters(), *b.parameters()])]
    opt.set_gradients(grads)
    errors = []
    for bad in ([], grads[:3], [grads[1], *grads[1:]]):
        with pytest.raises(ValueError) as info:
            opt.set_gradients(bad)
        errors.append(str(info.value))
    empty = nn.Tanh()  # a stage without parameters: an empty gradient list is its whole gradient
    empty_opt = PipelineOptimizer(torch.optim.SGD([{"params": []}], lr=0.1), [empty],
                                  PipelineOptimizerConfig(sync_mode="stage_wise"))
    empty_opt.set_gradients([])
    empty_opt.step()
    return {"grads": [p.grad for p in [*a.parameters(), *b.parameters()]], "errors": errors}


def test_set_gradients_goes_by_position_and_checks_count_and_shape() -> None:
    (got,) = run(gradients_set, 1)
    assert [float(g.flatten()[0]) for g in got["grads"]] == [0.0, 1.0, 2.0, 3.0]
    assert "one gradient per trainable parameter of this rank's stages (4: ['weight', 'bias', 'weight', 'bias']); " \
           "got 0" in got["errors"][0]
    assert "got 3" in got["errors"][1]
    assert "gradient 0 is for stage 0 of pipeline rank 0 'weight' of shape (3, 2); got (3,)" in got["errors"][2]


def parameterless(mode: str) -> list[Any]:
    """Every rank holds a stage without parameters: an activation between two devices."""
    stage = nn.Tanh()
    opt = PipelineOptimizer(torch.optim.SGD([{"params": []}], lr=0.1), [stage],
                            PipelineOptimizerConfig(sync_mode=mode), dp_group=dist.group.WORLD)
    opt.set_gradients([])
    opt.zero_grad()
    opt.step()
    return opt.get_state()["pipeline"]["parameters"]


@pytest.mark.parametrize("mode", [m.value for m in GradientSyncMode])
def test_stages_without_parameters_step_in_every_mode(mode: str) -> None:
    assert run(parameterless, 2, mode) == [[], []]


def with_an_empty_stage() -> None:
    module = nn.Linear(2, 2) if dist.get_rank() == 0 else nn.Tanh()
    params = list(module.parameters())
    opt = PipelineOptimizer(torch.optim.SGD(params or [{"params": []}], lr=0.1), [module])
    opt.step()


def test_a_stage_without_parameters_beside_one_with_is_a_shape_error_under_average() -> None:
    exc = rank_error(with_an_empty_stage, 2)
    assert isinstance(exc, PipelineShapeError)
    assert "stage 0 has 2 parameters to synchronise and stage 1 has 0: stage 0 'weight' (2, 2) has no counterpart" \
        in str(exc)


def saved_and_loaded() -> dict[str, Any]:
    """Train two steps, save; a fresh optimizer loads the state and takes the third step as the first one does."""
    rank = dist.get_rank()
    module = linear(0)
    opt = PipelineOptimizer(torch.optim.SGD(module.parameters(), lr=0.5, momentum=0.9), [module])
    for step in range(2):
        opt.set_gradients(integer_grads(list(module.parameters()), step))
        opt.step()
    buffer = io.BytesIO()
    torch.save(opt.get_state(), buffer)
    snapshot = {k: v.detach().clone() for k, v in module.state_dict().items()}
    opt.set_gradients(integer_grads(list(module.parameters()), 2))
    opt.step()
    uninterrupted = [p.detach().clone() for p in module.parameters()]

    module.load_state_dict(snapshot)
    fresh = PipelineOptimizer(torch.optim.SGD(module.parameters(), lr=0.5, momentum=0.9), [module])
    buffer.seek(0)
    state = torch.load(buffer)  # tuples come back as they went; a JSON round trip would give lists
    fresh.load_state(state)
    fresh.set_gradients(integer_grads(list(module.parameters()), 2))
    fresh.step()
    resumed = [p.detach().clone() for p in module.parameters()]

    errors = {}
    other_mode = PipelineOptimizer(torch.optim.SGD(module.parameters(), lr=0.5, momentum=0.9), [module],
                                   PipelineOptimizerConfig(sync_mode="sum"))
    bigger = linear(0, out=4)
    other_shape = PipelineOptimizer(torch.optim.SGD(bigger.parameters(), lr=0.5, momentum=0.9), [bigger])
    # the state of the other rank (another pipeline position) arrives through an all-gather
    states: list[Any] = [None, None]
    dist.all_gather_object(states, state)
    for name, target, loaded in [("mode", other_mode, state), ("shape", other_shape, state),
                                 ("rank", fresh, states[1 - rank])]:
        with pytest.raises(ValueError) as info:
            target.load_state(loaded)
        errors[name] = str(info.value)
    return {"uninterrupted": uninterrupted, "resumed": resumed, "pipeline": state["pipeline"], "errors": errors}


def test_state_save_and_load_resumes_exactly_and_refuses_another_layout() -> None:
    returns = run(saved_and_loaded, 2)
    for rank, got in enumerate(returns):
        assert all(torch.equal(a, b) for a, b in zip(got["uninterrupted"], got["resumed"]))
        assert got["pipeline"] == {"num_stages": 2, "current_rank": rank, "pp_size": 2, "dp_size": 1,
                                   "sync_mode": "average", "parameters": [("weight", (3, 2)), ("bias", (3,))]}
        assert "sync_mode is 'average' in the state and 'sum' here" in got["errors"]["mode"]
        assert "parameters is [('weight', (3, 2)), ('bias', (3,))] in the state and " \
               "[('weight', (4, 2)), ('bias', (4,))] here" in got["errors"]["shape"]
        assert f"current_rank is {1 - rank} in the state and {rank} here" in got["errors"]["rank"]
        assert "load it with the layout it was saved under" in got["errors"]["rank"]


def closed() -> list[str]:
    module = nn.Linear(2, 2)
    with PipelineOptimizer(torch.optim.SGD(module.parameters(), lr=0.1), [module]) as opt:
        pass
    opt.close()  # idempotent
    messages = []
    for call in (opt.step, opt.zero_grad):
        with pytest.raises(RuntimeError) as info:
            call()
        messages.append(str(info.value))
    return messages


def test_close_and_the_context_manager_stop_the_optimizer() -> None:
    (messages,) = run(closed, 1)
    assert messages == ["PipelineOptimizer.step() after close(); build a new PipelineOptimizer",
                        "PipelineOptimizer.zero_grad() after close(); build a new PipelineOptimizer"]


# --------------------------------------------------------------------------------------- shapes and timeouts


def mismatched(mode: str, torch_stage: bool = False) -> None:
    """Partitioned stages: stage s holds block s of widths (3, 5, 3)."""
    rank = dist.get_rank()
    model = fns.build_stage(Layout(2, widths=(3, 5, 3)), rank)
    stage: Any = PipelineStage(model, rank, 2, torch.device("cpu")) if torch_stage else model
    opt = PipelineOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), [stage],
                            PipelineOptimizerConfig(sync_mode=mode))
    opt.step()


@pytest.mark.parametrize("mode", ["average", "sum"])
@pytest.mark.parametrize("torch_stage", [False, True])
def test_inconsistent_shapes_raise_naming_both_stages_and_parameters(mode: str, torch_stage: bool) -> None:
    exc = rank_error(mismatched, 2, mode, torch_stage)
    assert isinstance(exc, PipelineShapeError) and isinstance(exc, ValueError)
    assert "stage 0 'layers.0.0.weight' (5, 3) vs stage 1 'layers.1.0.weight' (3, 5)" in str(exc)
    assert "use GradientSyncMode.STAGE_WISE" in str(exc)


def test_the_broadcast_of_none_checks_shapes_too() -> None:
    exc = rank_error(mismatched, 2, "none")
    assert isinstance(exc, PipelineShapeError)
    assert "stage 0 'layers.0.0.weight' (5, 3) vs stage 1 'layers.1.0.weight' (3, 5)" in str(exc)


def counted() -> None:
    rank = dist.get_rank()
    module = nn.Sequential(*[nn.Linear(2, 2) for _ in range(1 + rank)])
    opt = PipelineOptimizer(torch.optim.SGD(module.parameters(), lr=0.1), [module])
    opt.step()


def test_a_stage_with_more_parameters_is_an_error_naming_the_extra_one() -> None:
    exc = rank_error(counted, 2)
    assert isinstance(exc, PipelineShapeError)
    assert "stage 1 has 4 parameters to synchronise and stage 0 has 2: stage 1 '1.weight' (2, 2) has no " \
           "counterpart" in str(exc)


def stops_answering(mode: str) -> None:
    """Rank 1 takes part in the first step, then never calls step() again."""
    rank = dist.get_rank()
    module = linear(0)
    group = dist.new_group([0, 1])
    opt = PipelineOptimizer(torch.optim.SGD(module.parameters(), lr=0.1), [module],
                            PipelineOptimizerConfig(sync_mode=mode, communication_timeout_ms=250),
                            pp_group=group if mode == "average" else None,
                            dp_group=group if mode == "stage_wise" else None)
    for step in range(2):
        if rank == 1 and step == 1:
            return
        opt.set_gradients(integer_grads(list(module.parameters()), rank))
        opt.step()


@pytest.mark.parametrize("mode, group", [("average", "the pipeline group"), ("stage_wise", "dp_group")])
def test_a_stage_that_stops_answering_times_out_naming_stage_op_and_simulated_time(mode: str, group: str) -> None:
    exc = rank_error(stops_answering, 2, mode)
    assert isinstance(exc, PipelineTimeoutError) and isinstance(exc, RuntimeError)
    text = str(exc)
    assert text.startswith("stage 0 (pipeline rank 0, global rank 0): ")
    assert f"all_reduce of gradient 'weight' over {group} did not complete within 250 ms" in text
    assert isinstance(exc.__cause__, simdist.SimTimeoutError)
    assert "Timed out after 0.25 s of simulated time" in text and "Not issued by rank 1" in text


# --------------------------------------------------------------------------------------- training


def replicas(mode: str, reduction: str = "mean", steps: int = 3, broadcast: bool = True) -> dict[str, Any]:
    """Every rank holds the whole model (stages as replicas) and trains on its slice of the batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = Layout(1, dp=world)
    model = fns.build(layout)
    opt = PipelineOptimizer(torch.optim.SGD(model.parameters(), lr=fns.LR, momentum=0.9), [model],
                            PipelineOptimizerConfig(sync_mode=mode, broadcast_parameters=broadcast),
                            dp_group=dist.group.WORLD if mode == "stage_wise" else None)
    rows = layout.m * fns.ROWS
    for step in range(steps):
        x, y = fns.batch(layout, step)
        opt.zero_grad()
        fns.loss_fn(layout, model(x[rank * rows : (rank + 1) * rows]), y[rank * rows : (rank + 1) * rows],
                    reduction).backward()
        opt.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def single(world: int, reduction: str = "mean", steps: int = 3) -> None:
    """The replicas' model on the full batch."""
    layout = Layout(1, dp=world)
    model = fns.build(layout)
    opt = torch.optim.SGD(model.parameters(), lr=fns.LR, momentum=0.9)
    for step in range(steps):
        x, y = fns.batch(layout, step)
        opt.zero_grad()
        fns.loss_fn(layout, model(x), y, reduction).backward()
        opt.step()


def check_replicas(mode: str, reduction: str = "mean", **options: Any) -> simdist.EquivalenceReport:
    return simdist.check_equivalence(
        replicas, single, simdist.Cluster.switch(4, device="cpu"), args=(mode, reduction), kwargs=options,
        reference_args=(4, reduction), reference_kwargs={}, loss="mean" if reduction == "mean" else "sum",
        compute=False, localize=False,
    )


@pytest.mark.parametrize("mode", ["average", "stage_wise"])
def test_replicated_stages_train_as_single_device_and_stay_equal(mode: str) -> None:
    rep = check_replicas(mode)
    assert rep.ok, str(rep)
    assert rep.steps == 3 and rep.compared["parameters"] == 2
    returns = run(replicas, 4, mode)
    for r in returns[1:]:
        assert all(torch.equal(r[name], returns[0][name]) for name in r)


def test_sum_over_replicas_is_single_device_training_of_the_summed_loss() -> None:
    assert check_replicas("sum", "sum").ok
    rep = check_replicas("sum")  # with a mean loss the sum is 4 x the full batch's gradient
    assert not rep.ok and rep.first.step == 0 and rep.first.kind == "grad", str(rep)


def test_none_lets_replicas_drift_and_broadcast_hides_it_behind_rank_0s_update() -> None:
    rep = check_replicas("none", broadcast=False)
    assert not rep.ok and rep.first.step == 0, str(rep)
    returns = run(replicas, 4, "none", broadcast=False)
    assert not torch.equal(returns[0]["layers.0.0.weight"], returns[1]["layers.0.0.weight"])
    returns = run(replicas, 4, "none")
    assert all(torch.equal(r["layers.0.0.weight"], returns[0]["layers.0.0.weight"]) for r in returns)


@pytest.mark.parametrize("layout", [
    Layout(2), Layout(2, dp=2), Layout(4, m=4, widths=(3, 5, 2, 4, 3)), Layout(1, m=4),
], ids=["pp2", "pp2xdp2", "pp4-uneven", "single-stage"])
def test_stage_wise_on_partitioned_stages_equals_single_device(layout: Layout) -> None:
    rep = check(layout)
    assert rep.ok, str(rep)
    assert rep.steps == fns.STEPS and rep.compared["parameters"] == 2 * layout.p and rep.compared["loss"] == 1


def test_training_converges_with_the_single_device_loss_curve() -> None:
    layout = Layout(2, dp=2, m=2)
    returns = run(fns.train, layout.world, layout, steps=15, fixed_data=True)
    expected = run(fns.reference, 1, layout, steps=15, fixed_data=True)[0]
    # the loss of the whole batch: the mean over the replicas' last stages (ranks 1 and 3)
    losses = np.mean([returns[1]["losses"], returns[3]["losses"]], axis=0)
    np.testing.assert_allclose(losses, expected, rtol=1e-12)
    assert np.all(np.diff(losses) < 0) and losses[-1] < 0.5 * losses[0], losses  # one batch, learnt
    single_params = fns.reference_params(layout, steps=15, fixed_data=True)
    for rank, r in enumerate(returns):
        for name, value in r["params"].items():
            torch.testing.assert_close(value, single_params[name], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("layout", [Layout(2), Layout(4, widths=(3, 5, 2, 4, 3))], ids=["pp2", "pp4-uneven"])
def test_none_without_broadcast_is_correct_for_partitions_with_one_replica_each(layout: Layout) -> None:
    assert check(layout, "none", broadcast=False).ok
    rep = check(Layout(layout.p, dp=2, widths=layout.widths), "none", broadcast=False)
    assert not rep.ok and rep.first.step == 0, str(rep)  # replicas of a stage never meet


def test_torch_pipeline_stages_under_schedule_gpipe_are_accepted() -> None:
    rep = check(Layout(2, m=4), torch_schedule=True)
    assert rep.ok, str(rep)
    assert rep.compared["parameters"] == 4


@pytest.mark.parametrize("mode", ["average", "sum"])
def test_average_and_sum_on_equal_partitions_raise_nothing_and_train_another_model(mode: str) -> None:
    rep = check(Layout(2), mode)  # equal widths: every position matches, the layers are different ones
    assert not rep.ok and rep.first.step == 0 and rep.first.kind == "grad", str(rep)


# --------------------------------------------------------------------------------------- ties


@pytest.mark.parametrize("layout", [Layout(2, tie=True), Layout(4, tie=True, m=1), Layout(2, dp=2, tie=True)],
                         ids=["pp2", "pp4", "pp2xdp2"])
def test_a_tie_between_first_and_last_stage_matches_single_device_only_when_declared(layout: Layout) -> None:
    rep = check(layout)
    assert rep.ok, str(rep)
    rep = check(layout, use_ties=False)
    assert not rep.ok and rep.first.step == 0, str(rep)
    diverged = {d.name for d in rep.divergences if d.kind == "grad"}
    # both copies lack the other's part of the gradient; nothing else differs at the first step
    assert diverged == {"embed.weight", "head.weight"}, str(rep)


# --------------------------------------------------------------------------------------- properties


@st.composite
def layouts(draw: st.DrawFn) -> Layout:
    """p in {1, 2, 4} stages, dp in {1, 2} replicas (p * dp <= 4), m in {1, 2, 4}, equal or uneven widths, a tie."""
    p = draw(st.sampled_from([1, 2, 4]))
    dp = draw(st.sampled_from([d for d in (1, 2) if p * d <= 4]))
    m = draw(st.sampled_from([1, 2, 4]))
    tie = draw(st.booleans())
    if draw(st.booleans()):
        widths = (3,) * (p + 1)
    else:
        widths = tuple(3 + 2 * (i % 2) for i in range(p + 1))
        if tie:
            widths = (*widths[:-1], widths[0])
    return Layout(p, dp, m, widths, tie)


@settings(max_examples=EXAMPLES)
@given(layout=layouts())
def test_stage_wise_with_correct_groups_always_equals_single_device(layout: Layout) -> None:
    rep = check(layout)
    assert rep.ok, f"{layout}\n{rep}"


def is_safe(layout: Layout, mode: str, use_dp_group: bool, use_ties: bool) -> bool:
    """Whether the combination trains the single-device model (each pipeline on its own group)."""
    if mode != "stage_wise":
        # AVERAGE/SUM reduce across partitions and NONE across nothing; all broadcast across partitions
        return layout.p == 1 and layout.dp == 1
    return (layout.dp == 1 or use_dp_group) and (not layout.tie or layout.p == 1 or use_ties)


@settings(max_examples=EXAMPLES)
@given(layout=layouts(), mode=st.sampled_from([m.value for m in GradientSyncMode]),
       use_dp_group=st.booleans(), use_ties=st.booleans())
def test_an_unsafe_combination_is_rejected_or_reported_divergent(layout: Layout, mode: str, use_dp_group: bool,
                                                                 use_ties: bool) -> None:
    assume(not is_safe(layout, mode, use_dp_group, use_ties))
    try:
        rep = check(layout, mode, use_dp_group=use_dp_group, use_ties=use_ties)
    except simdist.RankError as error:
        assert isinstance(error.exc, PipelineShapeError), repr(error.exc)
        assert mode != "stage_wise" and layout.p > 1
        return
    assert not rep.ok, f"{layout} {mode} dp_group={use_dp_group} ties={use_ties} reported equivalent"


def test_the_safe_combinations_are_exactly_the_equivalent_ones_on_a_small_grid() -> None:
    """Not only unsafe -> divergent: each safe combination is equivalent (the oracle of the property above)."""
    for layout in (Layout(1), Layout(1, dp=2), Layout(2, tie=True)):
        for mode in [m.value for m in GradientSyncMode]:
            for use_dp_group, use_ties in [(True, True), (False, False)]:
                if is_safe(layout, mode, use_dp_group, use_ties):
                    assert check(layout, mode, use_dp_group=use_dp_group, use_ties=use_ties).ok, (layout, mode)


# --------------------------------------------------------------------------------------- real gloo


def assert_matches_single_device(returns: list[dict[str, Any]], layout: Layout) -> None:
    expected = fns.reference_params(layout)
    held = set()
    for r in returns:
        for name, value in r["params"].items():
            torch.testing.assert_close(value, expected[name], rtol=1e-10, atol=1e-12)
            held.add(name)
    assert held == set(expected)


@pytest.mark.real
@pytest.mark.parametrize("key", ["pp2", "pp2xdp2", "tie"])
def test_stage_wise_on_real_gloo_processes_matches_single_device(
    key: str, request: pytest.FixtureRequest
) -> None:
    if key in ON_TWO_REAL_RANKS:  # two ranks: a check of the shared launch
        layout = ON_TWO_REAL_RANKS[key][1][0]
        returns = request.getfixturevalue("on_two_real_ranks")[key]
    else:
        layout = Layout(2, dp=2)
        returns = real.run(fns.train, layout.world, args=(layout, "stage_wise"), timeout=120).returns
    assert_matches_single_device(returns, layout)
    # the simulated run gives the same parameters
    simulated = run(fns.train, layout.world, layout, "stage_wise")
    for r, s in zip(returns, simulated):
        for name in r["params"]:
            torch.testing.assert_close(r["params"][name], s["params"][name], rtol=1e-12, atol=1e-14)


@pytest.mark.real
def test_average_on_uneven_stages_raises_the_shape_error_on_real_gloo() -> None:
    with pytest.raises(real.RealRunError) as info:
        real.run(fns.train, 2, args=(Layout(2, widths=(3, 5, 3)), "average"), timeout=120)
    assert "PipelineShapeError" in str(info.value)
    assert "stage 0 'layers.0.0.weight' (5, 3) vs stage 1 'layers.1.0.weight' (3, 5)" in str(info.value)


@pytest.mark.real
def test_a_stalled_stage_times_out_on_real_gloo_naming_stage_and_op() -> None:
    with pytest.raises(real.RealRunError) as info:
        real.run(fns.stalls, 2, args=(3.0,), timeout=120)
    error = info.value
    assert error.first_rank == 0, str(error)
    assert "PipelineTimeoutError: stage 0 (pipeline rank 0, global rank 0): all_reduce of gradient " \
           "'layers.0.0.weight' over the pipeline group did not complete within 500 ms" in error.failures[0]


@pytest.mark.parametrize("layout", [Layout(p=2, dp=2), Layout(p=2, tie=True)], ids=["pp2xdp2", "tied"])
def test_stage_wise_with_adam_equals_single_device(layout: Layout) -> None:
    # Adam's state (moments, step count) follows each stage's own parameters, replicas kept equal by dp_group
    names = {"head.weight*": "embed.weight*"} if layout.tie else None
    rep = simdist.check_equivalence(
        fns.train, fns.reference, simdist.Cluster.switch(layout.world, device="cpu"), args=(layout,),
        kwargs={"optimizer": "adam"}, reference_args=(layout,),
        reference_kwargs={"optimizer": "adam"}, names=names, compute=False, localize=False,
    )
    assert rep.ok, str(rep)
    assert rep.compared["optimizer state tensors"] == 3 * rep.compared["parameters"]


def step_on_gpus(out: int) -> None:
    """One step of a stage of width ``out`` on the GPU its rank names, under NCCL."""
    dist.init_process_group("nccl")
    torch.cuda.set_device(dist.get_rank())
    module = linear(dist.get_rank(), out).to("cuda")
    opt = optimizer(module)
    module(torch.ones(4, 2, dtype=torch.float64, device="cuda")).sum().backward()
    opt.step()


def test_the_shape_check_of_gpu_stages_gathers_on_their_gpus_as_nccl_requires(monkeypatch: pytest.MonkeyPatch) -> None:
    # NCCL moves GPU tensors only: a CPU tensor in a collective of an NCCL group fails on GPUs ("No backend type
    # associated with device type cpu"), while simdist's groups and gloo accept it
    devices: dict[int, set[str]] = {}
    gather = dist.all_gather

    def recording(outputs: list[torch.Tensor], tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        devices.setdefault(dist.get_rank(), set()).update(str(t.device) for t in [tensor, *outputs])
        return gather(outputs, tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_gather", recording)
    cluster = simdist.Cluster.preset("dgx-h100", world_size=2)
    simdist.run(step_on_gpus, cluster, args=(3,), compute=False)
    assert devices == {0: {"cuda:0"}, 1: {"cuda:1"}}
    # and stages of different shapes are still told apart from the GPU tensors' contents
    with pytest.raises(simdist.RankError) as info:
        simdist.run(lambda: step_on_gpus(3 + dist.get_rank()), cluster, compute=False)
    assert isinstance(info.value.exc, PipelineShapeError), info.value
    assert "stage 0 'weight' (3, 2) vs stage 1 'weight' (4, 2)" in str(info.value.exc)
