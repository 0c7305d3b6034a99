"""simdist.strategies.ddp against the oracle: the same model trained in one process on the full batch.

Rank functions and models live in tests/strategies_fns.py so ``real`` workers can import them. Float64
models keep the tolerances tight: the only difference to the oracle is the order of summation.
"""

from __future__ import annotations

import ast
import contextlib
import subprocess
import sys
from pathlib import Path

import pytest
import strategies_fns as sf
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import real
import simdist
from simdist.strategies import BucketedDDP, Divergence, FlatDDP, NaiveDDP, OverlapDDP, ReplicaMismatch
from simdist.strategies.ddp import assign_buckets

REPO = Path(__file__).resolve().parents[1]
TIGHT = {"rtol": 1e-10, "atol": 1e-12}
KINDS = ["naive", "flat", "overlap", "bucketed"]
# Some deliberately buggy variants (OverlapDDP with dedup=False or reduce_hook_tensor=True) touch buffers of
# collectives in flight, which the simulator's race detector reports (an error under pytest): the buggy runs
# switch it off (tests/test_races.py and the tied-weights scenario check what it reports).
BUGGY_RUN_OPTIONS: dict = {"races": "off"}
PROGRESS = ["nccl", "gloo"]


def sim(fn, n: int, *args, **options):
    """Run rank function ``fn`` on ``n`` simulated ranks behind one switch, without compute time."""
    return simdist.run(fn, simdist.Cluster.switch(n, device="H100"), args=args, compute=False, **options)


def all_reduces(res, rank: int = 0) -> list:
    """The all-reduce spans of ``rank`` in a run's trace."""
    return [s for s in res.trace.collectives(rank) if s.args.get("Collective name") == "all_reduce"]


def assert_params_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TIGHT)


# --------------------------------------------------------------------------------------- oracle


@st.composite
def model_specs(draw: st.DrawFn) -> sf.ModelSpec:
    """Small models with random ties, reuse and frozen parameters."""
    return sf.ModelSpec(
        vocab=draw(st.integers(2, 6)),
        dim=draw(st.integers(1, 5)),
        layers=draw(st.integers(0, 3)),
        tie_out=draw(st.booleans()),
        tie_hidden=draw(st.booleans()),
        reuse_first=draw(st.booleans()),
        unused=draw(st.booleans()),
        frozen=draw(st.integers(0, 2**11 - 1)),
    )


BUCKET_CAPS = st.one_of(st.sampled_from([1e-6, 25.0]), st.floats(1e-5, 2e-3))


@given(
    spec=model_specs(),
    n=st.integers(1, 8),
    bucket_cap_mb=BUCKET_CAPS,
    steps=st.integers(1, 3),
    seed=st.integers(0, 2**16),
    accumulate=st.booleans(),
    progress=st.sampled_from(PROGRESS),
)
def test_every_strategy_trains_like_the_single_process_model(
    spec, n, bucket_cap_mb, steps, seed, accumulate, progress
):
    variants = [*sf.CORRECT[:3], ("bucketed", {"bucket_cap_mb": bucket_cap_mb})]
    extra = {"progress": progress} if progress != "nccl" else {}
    res = sim(sf.train_variants, n, spec, variants, steps, 2, seed, accumulate, **extra)
    want = sf.single_process(spec, steps, 2, seed, list(range(n)), accumulate)
    for key in res.returns[0]:
        for rank in range(n):
            assert_params_close(res.returns[rank][key], want)
            # replicas agree bit for bit, as DDP guarantees: every rank receives the same reduced values
            for a, b in zip(res.returns[rank][key], res.returns[0][key]):
                assert torch.equal(a, b), (key, rank)


@pytest.mark.parametrize("kind", KINDS)
def test_gradient_accumulation_with_no_sync(kind):
    spec = sf.ModelSpec(tie_out=True, layers=2, reuse_first=True)
    options = {"bucket_cap_mb": 0.0002} if kind == "bucketed" else {}
    res = sim(sf.train_variants, 3, spec, [(kind, options)], 2, 3, 11, True)
    want = sf.single_process(spec, 2, 3, 11, [0, 1, 2], accumulate=True)
    for rank in range(3):
        assert_params_close(res.returns[rank][f"0:{kind}"], want)


@pytest.mark.parametrize("kind", KINDS)
def test_no_sync_issues_no_collective(kind):
    res = sim(sf.backward_in_no_sync, 2, sf.ModelSpec(), kind)
    assert all_reduces(res) == []


@pytest.mark.parametrize("kind", KINDS)
def test_a_subgroup_trains_on_its_own_and_starts_from_its_first_rank(kind):
    spec = sf.ModelSpec(tie_out=True, layers=1)
    res = sim(sf.train_in_halves, 4, spec, kind, 2, 3, 5)
    out = res.returns
    for first, ranks in ((0, [0, 1]), (2, [2, 3])):
        want = sf.single_process(spec, 2, 3, 5, ranks, initial=out[first]["initial"])
        for rank in ranks:
            assert_params_close(list(out[rank]["initial"].values()), list(out[first]["initial"].values()))
            assert_params_close(out[rank]["final"], want)
    # rank 2's replica was perturbed before wrapping: its group really broadcast from rank 2, not rank 0
    assert not torch.equal(out[2]["initial"]["embed.weight"], out[0]["initial"]["embed.weight"])
    assert not torch.equal(out[2]["initial"]["scale"], out[0]["initial"]["scale"])


# ----------------------------------------------------------------------------- torch's DDP


@pytest.mark.parametrize("n", [2, 4, 16])
@pytest.mark.parametrize("bucket_cap_mb", [25.0, 0.0002])
def test_torch_ddp_and_bucketed_give_the_single_process_gradients(n, bucket_cap_mb):
    spec = sf.ModelSpec(tie_out=True, layers=2, reuse_first=True)
    res = sim(sf.torch_and_bucketed_grads, n, spec, bucket_cap_mb, 2)
    want = sf.single_process_grads(spec, 2, list(range(n)))
    for rank in range(n):
        assert_params_close(res.returns[rank]["torch"], want)
        assert_params_close(res.returns[rank]["bucketed"], res.returns[rank]["torch"])


# ------------------------------------------------------------------ counting the collectives


def tied_spec() -> sf.ModelSpec:
    # embed.weight is also out.weight; hidden.1.bias is frozen
    return sf.ModelSpec(tie_out=True, layers=2, frozen=0b10000)


def trainable(spec: sf.ModelSpec) -> list[nn.Parameter]:
    return [p for p in sf.make_model(spec, 0).parameters() if p.requires_grad]


@pytest.mark.parametrize("kind", ["naive", "overlap"])
def test_dedup_reduces_each_parameter_once_and_the_bug_reduces_the_tied_one_twice(kind):
    spec = tied_spec()
    params = trainable(spec)
    once = all_reduces(sim(sf.one_step, 2, spec, kind, {"dedup": True}))
    twice = all_reduces(sim(sf.one_step, 2, spec, kind, {"dedup": False}, **BUGGY_RUN_OPTIONS))
    if kind == "naive":  # first, one small all-reduce counts the ranks that have each gradient
        assert once[0].args["In msg nelems"] == len(params) and twice[0].args["In msg nelems"] == len(params) + 1
        once, twice = once[1:], twice[1:]
    assert len(once) == len(params)
    assert sorted(s.args["In msg nelems"] for s in once) == sorted(p.numel() for p in params)
    assert len(twice) == len(params) + 1
    embed = spec.vocab * spec.dim
    assert [s.args["In msg nelems"] for s in twice].count(embed) == 2


def test_flat_issues_one_all_reduce_of_every_gradient():
    spec = tied_spec()
    (span,) = all_reduces(sim(sf.one_step, 2, spec, "flat", {}))
    params = trainable(spec)
    # every gradient, then one flag per parameter (how many ranks had a gradient for it)
    assert span.args["In msg nelems"] == sum(p.numel() for p in params) + len(params)


@pytest.mark.parametrize("bucket_cap_mb", [1e-6, 0.0002, 25.0])
def test_bucketed_issues_one_all_reduce_per_bucket(bucket_cap_mb):
    spec = tied_spec()
    params = trainable(spec)
    buckets = assign_buckets(params, bucket_cap_mb * 2**20)
    spans = all_reduces(sim(sf.one_step, 2, spec, "bucketed", {"bucket_cap_mb": bucket_cap_mb}))
    assert [s.args["In msg nelems"] for s in spans] == [sum(params[i].numel() for i in b) + len(b) for b in buckets]


def test_buckets_follow_reverse_parameter_order_and_the_cap():
    params = [nn.Parameter(torch.zeros(n)) for n in (4, 4, 4, 4, 4)]  # 16 bytes each
    assert assign_buckets(params, 32) == [[4, 3], [2, 1], [0]]
    assert assign_buckets(params, 1) == [[4], [3], [2], [1], [0]]
    assert assign_buckets(params, 1e9) == [[4, 3, 2, 1, 0]]
    mixed = [nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(4, dtype=torch.float64))]
    assert assign_buckets(mixed, 1e9) == [[1], [0]]  # one dtype per bucket


@pytest.mark.parametrize("kind", ["naive", "flat", "overlap", "bucketed"])
def test_dedup_false_is_numerically_harmless_on_an_in_order_backend(kind):
    spec = tied_spec()
    res = sim(sf.train_variants, 3, spec, [(kind, {"dedup": False})], 2, 3, 1, **BUGGY_RUN_OPTIONS)
    want = sf.single_process(spec, 2, 3, 1, [0, 1, 2])
    for rank in range(3):
        assert_params_close(res.returns[rank][f"0:{kind}"], want)


def test_dedup_false_overlap_races_on_a_gloo_like_backend():
    # Two in-place all-reduces of the tied gradient progress at once on gloo's worker threads.
    spec = tied_spec()
    run = {"progress": "gloo", "races": "warn"}
    with pytest.warns(Warning, match="two operations in flight on overlapping memory"):
        res = sim(sf.train_variants, 3, spec, [("overlap", {"dedup": False})], 2, 3, 1, **run)
    want = sf.single_process(spec, 2, 3, 1, [0, 1, 2])
    assert not torch.allclose(res.returns[0]["0:overlap"][0], want[0])
    assert res.races and {race.kind for race in res.races} == {"overlap"}


# ------------------------------------------------------------------ the reduce-hook-tensor bug


@pytest.mark.parametrize("kind", ["overlap", "bucketed"])
def test_reducing_the_hook_tensor_leaves_replicas_diverged_and_the_check_names_them(kind):
    spec = sf.ModelSpec(tie_out=True, layers=1)
    res = sim(sf.step_then_check, 3, spec, kind, {"reduce_hook_tensor": True}, **BUGGY_RUN_OPTIONS)
    names = [name for name, p in sf.make_model(spec, 0).named_parameters()]
    for out in res.returns:
        assert out["divergences"] == [Divergence(name, (1, 2)) for name in names]
        assert out["message"].startswith("replicas diverge at 'embed.weight': ranks [1, 2] hold values")
    good = sim(sf.step_then_check, 3, spec, kind, {})
    assert [out["divergences"] for out in good.returns] == [[], [], []]
    assert good.returns[0]["message"] is None


def test_replica_mismatch_lists_the_other_differing_tensors():
    error = ReplicaMismatch([Divergence("a.weight", (3,)), Divergence("b.bias", (1, 3))], 0)
    assert (error.name, error.ranks) == ("a.weight", (3,))
    assert (
        str(error)
        == "replicas diverge at 'a.weight': ranks [3] hold values other than rank 0's; 1 more differ: b.bias"
    )


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("cap", [0, -1.0, float("nan"), float("inf")])
def test_bucket_cap_must_be_a_positive_number(cap):
    with pytest.raises(ValueError, match="bucket_cap_mb must be a finite number of MiB > 0"):
        BucketedDDP(nn.Linear(2, 2), bucket_cap_mb=cap)
    with pytest.raises(TypeError, match="bucket_cap_mb must be a number of MiB"):
        BucketedDDP(nn.Linear(2, 2), bucket_cap_mb="25")


@pytest.mark.parametrize("wrapper", [NaiveDDP, FlatDDP, OverlapDDP, BucketedDDP])
def test_wrapping_needs_a_module_and_a_process_group(wrapper):
    with pytest.raises(TypeError, match=f"{wrapper.__name__} wraps a torch.nn.Module; got str"):
        wrapper("model")
    with pytest.raises(RuntimeError, match="call torch.distributed.init_process_group"):
        wrapper(nn.Linear(2, 2))


def test_a_rank_outside_the_given_group_is_told_so():
    with pytest.raises(simdist.RankError) as info:
        sim(sf.wrap_outside_group, 2, "bucketed")
    assert info.value.rank == 1
    assert "rank 1 is not a member of the process_group given to BucketedDDP" in str(info.value.exc)


@pytest.mark.parametrize("kind", ["overlap", "bucketed"])
def test_a_second_backward_without_finish_is_an_error(kind):
    with pytest.raises(simdist.RankError) as info:
        # the second backward accumulates into a gradient still being reduced: a race, not checked here
        sim(sf.backward_twice, 2, sf.ModelSpec(), kind, **BUGGY_RUN_OPTIONS)
    assert "received a second gradient before finish_gradient_synchronization()" in str(info.value.exc)


def test_a_model_without_trainable_parameters_is_fine():
    res = sim(sf.train_variants, 2, sf.ModelSpec(layers=0, frozen=2**9 - 1), sf.CORRECT, 1, 2, 0)
    assert len(res.returns[0]) == 4


# --------------------------------------------------------------------- simulator independence


def test_strategies_import_nothing_from_the_simulator():
    for path in sorted((REPO / "simdist" / "strategies").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for name in names:
                top = name.split(".")[0]
                assert top != "real" and (top != "simdist" or name.startswith("simdist.strategies")), (
                    f"{path.name} imports {name}"
                )
    # simdist's own __init__ loads the simulator for its public API; a bare package in its place shows what
    # the strategies themselves load.
    code = (
        "import sys, types\n"
        "bare = types.ModuleType('simdist'); bare.__path__ = [sys.argv[1]]; sys.modules['simdist'] = bare\n"
        "import simdist.strategies, simdist.strategies.ddp, simdist.strategies.consistency\n"
        "print(sorted(m for m in sys.modules if m.startswith(('simdist', 'real'))))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code, str(REPO / "simdist")], cwd=REPO, capture_output=True, text=True, check=True
    )
    modules = eval(loaded.stdout)
    assert [m for m in modules if not m.startswith("simdist.strategies")] == ["simdist"], modules


# ------------------------------------------------------------------------------- real gloo


@pytest.mark.real
def test_the_four_strategies_on_real_gloo_processes():
    spec = sf.ModelSpec(tie_out=True, tie_hidden=True, layers=3, reuse_first=True, frozen=0b100)
    out = real.run(sf.real_suite, 2, args=(spec, 2, 3, 9), timeout=120).returns
    for mode, accumulate in (("plain", False), ("accumulate", True)):
        want = sf.single_process(spec, 2, 3, 9, [0, 1], accumulate)
        for rank in range(2):
            assert sorted(out[rank][mode]) == [f"{i}:{kind}" for i, kind in enumerate(KINDS)]
            for params in out[rank][mode].values():
                assert_params_close(params, want)


# ------------------------------------------------------------------------------ behaviours a review pinned down
WRAPPERS = sf.WRAPPERS


class TwoLayers(nn.Module):
    """``a`` always used; ``b`` used where ``use_b`` says; ``c`` never used."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(4, 4).double(), nn.Linear(4, 4).double(), nn.Linear(4, 4).double()
        self.norm = nn.BatchNorm1d(4).double()

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        y = self.norm(self.a(x))
        return self.b(y) if use_b else y


def _x(rank: int, step: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(100 * step + rank), dtype=torch.float64)


def _train_two_layers(kind: str, b_on: list[int], steps: int):
    rank = dist.get_rank()
    model = TwoLayers()
    ddp = WRAPPERS[kind](model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.1)
    for step in range(steps):
        opt.zero_grad()
        ddp(_x(rank, step), rank in b_on).pow(2).mean().backward()
        ddp.finish_gradient_synchronization()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, model.c.weight.grad, ddp.state_dict()


def _two_layers_oracle(n: int, b_on: list[int], steps: int) -> dict[str, torch.Tensor]:
    """One process: the mean over ranks of each rank's loss (BatchNorm statistics per rank's batch)."""
    model = TwoLayers()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.1)
    for step in range(steps):
        opt.zero_grad()
        sum(model(_x(r, step), r in b_on).pow(2).mean() for r in range(n)).div(n).backward()
        opt.step()
    return {k: p.detach() for k, p in model.named_parameters()}


@pytest.mark.parametrize("kind", KINDS)
def test_a_parameter_no_rank_uses_keeps_no_gradient_and_weight_decay_leaves_it(kind):
    # BatchNorm's running statistics are per rank (train mode); parameters do not depend on them.
    res = sim(_train_two_layers, 2, kind, [0, 1], 3)
    want = _two_layers_oracle(2, [0, 1], 3)
    for params, c_grad, _ in res.returns:
        assert c_grad is None
        for name, value in want.items():
            torch.testing.assert_close(params[name], value, **TIGHT)


@pytest.mark.parametrize("kind", ["naive", "flat", "bucketed"])
def test_a_parameter_used_on_some_ranks_only_is_averaged_over_all(kind):
    res = sim(_train_two_layers, 3, kind, [0], 2)
    want = _two_layers_oracle(3, [0], 2)
    for params, _, _ in res.returns:
        for name, value in want.items():
            torch.testing.assert_close(params[name], value, **TIGHT)


def test_the_wrapper_is_an_ordinary_module_with_its_state_under_module():
    res = sim(_train_two_layers, 2, "bucketed", [0, 1], 1)
    state = res.returns[0][2]
    assert "module.a.weight" in state and "module.norm.running_mean" in state


def _rewrap(first: str, second: str):
    rank = dist.get_rank()
    model = TwoLayers()
    old = WRAPPERS[first](model)
    del old  # a discarded wrapper's hooks must go with it
    ddp = WRAPPERS[second](model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.1)
    for step in range(2):
        opt.zero_grad()
        ddp(_x(rank, step), True).pow(2).mean().backward()
        ddp.finish_gradient_synchronization()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("first,second", [("overlap", "overlap"), ("overlap", "naive"), ("bucketed", "bucketed")])
def test_a_discarded_wrapper_stops_reducing(first, second):
    res = sim(_rewrap, 2, first, second)
    want = _two_layers_oracle(2, [0, 1], 2)
    for params in res.returns:
        for name, value in want.items():
            torch.testing.assert_close(params[name], value, **TIGHT)


def _bn_accumulation(kind: str):
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    out = []
    for wrap in (WRAPPERS[kind], DDP):
        model = TwoLayers()
        ddp = wrap(model)
        for step in range(3):
            ctx = ddp.no_sync() if step < 2 else contextlib.nullcontext()
            with ctx:
                ddp(_x(rank, step) * (rank + 1), True).sum().backward()
        if hasattr(ddp, "finish_gradient_synchronization"):
            ddp.finish_gradient_synchronization()
        out.append(model.norm.running_mean.clone())
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_buffers_are_broadcast_when_torch_ddp_broadcasts_them(kind):
    for mine, torchs in sim(_bn_accumulation, 2, kind).returns:
        torch.testing.assert_close(mine, torchs, **TIGHT)


@pytest.mark.parametrize("wrapper", [FlatDDP, BucketedDDP])
def test_flat_buffers_refuse_sparse_gradients_at_wrap_time(wrapper):
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1))
    with pytest.raises(ValueError, match=r"cannot hold the sparse gradients of 0; use NaiveDDP or OverlapDDP"):
        wrapper(model)


def _finish_twice(kind: str):
    model = TwoLayers()
    ddp = WRAPPERS[kind](model)
    ddp(_x(dist.get_rank(), 0), True).sum().backward()
    ddp.finish_gradient_synchronization()
    ddp.finish_gradient_synchronization()  # a no-op, on every wrapper


@pytest.mark.parametrize("kind", KINDS)
def test_a_second_finish_is_a_no_op(kind):
    once = sim(_finish_twice, 2, kind)
    assert len(all_reduces(once)) == {"naive": 1 + 6, "flat": 1, "overlap": 6, "bucketed": 1}[kind]
