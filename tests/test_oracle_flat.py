"""torch FSDP1's flat-parameter shards assembled by name from all ranks' memory, against the single-process model."""

from __future__ import annotations

import functools
import itertools
import pickle
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy

import simdist
from simdist.oracle.flat import (
    FlatAssemblyError,
    FlatLayout,
    assemble_flat,
    fsdp1_layouts,
    local_piece,
    pieces_by_name,
)
from simdist.oracle.names import named_tensors

STEPS = 3


@dataclass(frozen=True)
class Config:
    """One FSDP1 set-up: sizes chosen so that units hold numbers of elements no world size divides."""

    world: int
    d_in: int
    d_h: int
    d_ff: int
    blocks: int
    strategy: str
    use_orig_params: bool
    optimizer: str


class Block(nn.Module):
    def __init__(self, d_h: int, d_ff: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_h, d_ff)
        self.fc2 = nn.Linear(d_ff, d_h)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(torch.tanh(self.fc1(h)))


class Head(nn.Module):
    """Reads out through the embedding's weight (tied)."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.weight


class Model(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.emb = nn.Linear(cfg.d_in, cfg.d_h, bias=False)
        self.blocks = nn.ModuleList([Block(cfg.d_h, cfg.d_ff) for _ in range(cfg.blocks)])
        self.norm = nn.LayerNorm(cfg.d_h)
        self.head = Head(self.emb.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.emb(x))
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h))


def make_model(cfg: Config) -> Model:
    torch.manual_seed(0)
    return Model(cfg).double()


def batch(cfg: Config, rank: int, step: int) -> torch.Tensor:
    return torch.randn(3, cfg.d_in, dtype=torch.float64, generator=torch.Generator().manual_seed(1000 * step + rank))


def make_optimizer(cfg: Config, params) -> torch.optim.Optimizer:
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=0.05)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def wrap(cfg: Config, model: Model) -> FSDP:
    """Each block its own FSDP1 unit, the rest (the tied embedding, the norm) in the root unit."""
    kw: dict = {
        "use_orig_params": cfg.use_orig_params,
        "sharding_strategy": getattr(ShardingStrategy, cfg.strategy),
        "device_id": torch.device("cpu"),
    }
    if cfg.strategy == "HYBRID_SHARD":  # two replicas, each sharded over half the ranks (one rank each on 2 ranks)
        kw["device_mesh"] = init_device_mesh("cpu", (2, cfg.world // 2), mesh_dim_names=("replicate", "shard"))
    for i in range(len(model.blocks)):
        model.blocks[i] = FSDP(model.blocks[i], **kw)
    return FSDP(model, **kw)


def train_and_capture(cfg: Config) -> dict[str, list[tuple[FlatLayout, torch.Tensor]]]:
    """Rank code: train FSDP1 for STEPS steps, then each parameter's, gradient's and optimizer state's pieces."""
    rank = dist.get_rank()
    fsdp = wrap(cfg, make_model(cfg))
    opt = make_optimizer(cfg, fsdp.parameters())
    for step in range(STEPS):
        opt.zero_grad()
        fsdp(batch(cfg, rank, step)).pow(2).mean().backward()
        opt.step()
    layouts = fsdp1_layouts(fsdp)
    out: dict[str, list[tuple[FlatLayout, torch.Tensor]]] = {}
    for p in fsdp.parameters():
        layout = layouts[id(p)]
        out.setdefault("param", []).append((layout, local_piece(layout, p)))
        if p.grad is not None:
            out.setdefault("grad", []).append((layout, local_piece(layout, p.grad)))
        for key, value in opt.state.get(p, {}).items():
            if isinstance(value, torch.Tensor) and layout.holds(value):
                out.setdefault(key, []).append((layout, local_piece(layout, value)))
    return out


def reference(cfg: Config) -> dict[str, dict[str, torch.Tensor]]:
    """The single-process model on the concatenated batch: parameters, gradients, optimizer state by name."""
    model = make_model(cfg)
    opt = make_optimizer(cfg, model.parameters())
    for step in range(STEPS):
        opt.zero_grad()
        model(torch.cat([batch(cfg, r, step) for r in range(cfg.world)])).pow(2).mean().backward()
        opt.step()
    params, _ = named_tensors(model)
    out: dict[str, dict[str, torch.Tensor]] = {"param": {}, "grad": {}}
    for name, p in params:
        out["param"][name] = p.detach()
        out["grad"][name] = p.grad
        for key, value in opt.state[p].items():
            if value.dim() > 0:
                out.setdefault(key, {})[name] = value
    return out


def run(cfg: Config) -> dict[str, list[tuple[int, FlatLayout, torch.Tensor]]]:
    res = simdist.run(train_and_capture, simdist.Cluster.switch(cfg.world, device="cpu"), args=(cfg,), compute=False)
    pieces: dict[str, list[tuple[int, FlatLayout, torch.Tensor]]] = {}
    for rank, captured in enumerate(res.returns):
        for kind, items in captured.items():
            pieces.setdefault(kind, []).extend((rank, layout, piece) for layout, piece in items)
    return pieces


def gathered(pieces: list[tuple[int, FlatLayout, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return assemble_flat(pieces).tensors


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"])
@settings(max_examples=4)
@given(
    world=st.sampled_from([2, 4]),
    d_in=st.integers(2, 5),
    d_h=st.integers(2, 7),
    d_ff=st.integers(1, 6),
    blocks=st.integers(1, 2),
    optimizer=st.sampled_from(["adam", "sgd"]),
)
def test_assembled_shards_equal_the_single_process_model(
    strategy: str, use_orig_params: bool, world: int, d_in: int, d_h: int, d_ff: int, blocks: int, optimizer: str
) -> None:
    if strategy == "HYBRID_SHARD":  # two replicas of at least two shards (one-rank shard groups: see below)
        world = 4
    cfg = Config(world, d_in, d_h, d_ff, blocks, strategy, use_orig_params, optimizer)
    pieces = run(cfg)
    want = reference(cfg)
    assert set(pieces) == set(want)
    for kind, expected in want.items():
        got = assemble_flat(pieces[kind])
        assert set(got.tensors) == set(expected), kind
        for name, value in expected.items():
            torch.testing.assert_close(got.tensors[name], value, msg=lambda m, where=f"{kind} {name}": f"{where}: {m}")
        # replicas (HYBRID_SHARD's two groups, NO_SHARD's ranks) are bitwise equal after a clean run
        assert got.diverged == []


@functools.cache
def captured(cfg: Config) -> dict[str, list[tuple[int, FlatLayout, torch.Tensor]]]:
    """One run's pieces, shared by the tests that only read them."""
    return run(cfg)


SHARDED = Config(world=4, d_in=3, d_h=5, d_ff=3, blocks=2, strategy="FULL_SHARD", use_orig_params=False, optimizer="adam")
ORIG = Config(world=4, d_in=3, d_h=5, d_ff=3, blocks=2, strategy="FULL_SHARD", use_orig_params=True, optimizer="adam")
HYBRID = Config(world=4, d_in=3, d_h=5, d_ff=3, blocks=1, strategy="HYBRID_SHARD", use_orig_params=True, optimizer="adam")


def test_layouts_are_picklable_and_name_the_units_without_wrapper_prefixes() -> None:
    layouts = {layout.unit: layout for _, layout, _ in captured(SHARDED)["param"]}
    assert sorted(layouts) == [
        ("", ("emb.weight", "norm.weight", "norm.bias"), None),
        ("blocks.0", ("blocks.0.fc1.weight", "blocks.0.fc1.bias", "blocks.0.fc2.weight", "blocks.0.fc2.bias"), None),
        ("blocks.1", ("blocks.1.fc1.weight", "blocks.1.fc1.bias", "blocks.1.fc2.weight", "blocks.1.fc2.bias"), None),
    ]
    for layout in layouts.values():
        assert pickle.loads(pickle.dumps(layout)) == layout
        assert layout.shard_count == 4 and layout.group_ranks == (0, 1, 2, 3)


def test_regions_say_which_rank_holds_which_elements() -> None:
    got = assemble_flat(captured(ORIG)["param"])
    for name, value in got.tensors.items():
        regions = got.regions[name]
        spans = sorted(regions.values())
        # the ranks' parts tile the parameter in rank order, without gaps or overlaps
        assert spans[0][0] == 0 and spans[-1][1] == value.numel()
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
        assert sorted(regions) == sorted(regions, key=regions.get)


@pytest.mark.parametrize("cfg", [SHARDED, ORIG, HYBRID], ids=["flat", "orig", "hybrid"])
def test_pieces_cut_by_name_assemble_to_the_same_tensors(cfg: Config) -> None:
    for kind, pieces in captured(cfg).items():
        cut = [(rank, *one[1:]) for rank, layout, piece in pieces for one in pieces_by_name(layout, piece)]
        assert all(layout.param is not None and piece.numel() > 0 for _, layout, piece in cut)
        whole, by_name = assemble_flat(pieces), assemble_flat(cut)
        assert by_name.regions == whole.regions and by_name.diverged == whole.diverged == []
        for name, value in whole.tensors.items():
            assert torch.equal(by_name.tensors[name], value), (kind, name)


def test_a_missing_rank_is_named() -> None:
    pieces = [p for p in captured(SHARDED)["grad"] if p[0] != 2]
    with pytest.raises(FlatAssemblyError, match=r"no piece from rank 2 of the sharding group \[0, 1, 2, 3\]"):
        assemble_flat(pieces)


def test_orig_params_a_rank_holds_none_of_need_no_piece_from_it() -> None:
    # with use_orig_params=True a rank holding none of a parameter has an empty view and no gradient for it
    params, grads = captured(ORIG)["param"], captured(ORIG)["grad"]
    empty = [(r, layout.names[layout.param]) for r, layout, piece in params if piece.numel() == 0]
    assert empty and len(grads) == len(params) - len(empty)
    without = [p for p in params if p[2].numel() > 0]
    for name, value in gathered(params).items():
        assert torch.equal(gathered(without)[name], value)


def test_inconsistent_layouts_are_reported_with_both_ranks() -> None:
    pieces = list(captured(SHARDED)["param"])
    rank, layout, piece = pieces[-1]
    pieces[-1] = (rank, FlatLayout(**{**layout.__dict__, "shard_count": 2}), piece)
    with pytest.raises(FlatAssemblyError, match=f"shard_count 4 on rank 0 but 2 on rank {rank}"):
        assemble_flat(pieces)


def test_a_piece_under_the_wrong_rank_is_rejected() -> None:
    pieces = [(1 if r == 0 else 0 if r == 1 else r, layout, piece) for r, layout, piece in captured(SHARDED)["param"]]
    with pytest.raises(FlatAssemblyError, match="rank 1 sent a piece for shard 0 of group"):
        assemble_flat(pieces)


def test_local_piece_rejects_what_is_not_the_shard() -> None:
    _, layout, _ = captured(SHARDED)["param"][0]
    with pytest.raises(FlatAssemblyError, match=f"expected {layout.numel} elements"):
        local_piece(layout, torch.zeros(layout.shard_numel * layout.shard_count))
    assert not layout.holds(torch.tensor(3.0))  # Adam's step: a replica, not a shard


def test_one_diverged_replica_element_names_its_parameter_and_rank() -> None:
    pieces = captured(HYBRID)["param"]
    clean = assemble_flat(pieces)
    assert clean.diverged == []
    # rank 3 is shard 1 of the second replica group; change its first element of the first parameter it holds
    index = next(i for i, (r, layout, piece) in enumerate(pieces) if r == 3 and piece.numel() > 0)
    rank, layout, piece = pieces[index]
    changed = list(pieces)
    changed[index] = (rank, layout, piece.clone().index_add_(0, torch.tensor([0]), torch.tensor([1.0], dtype=piece.dtype)))
    got = assemble_flat(changed)
    assert got.diverged == [(layout.names[layout.param], (3,))]
    # the result is the replica group of the lowest rank, unchanged
    for name, value in clean.tensors.items():
        assert torch.equal(got.tensors[name], value)


def test_hybrid_shard_with_one_rank_per_shard_group_never_syncs_its_replicas() -> None:
    # torch falls back to NO_SHARD when the shard group has one rank, and then never all-reduces over the
    # replicate group: each rank trains on its own data alone. The replica check finds it.
    cfg = Config(world=2, d_in=3, d_h=4, d_ff=2, blocks=1, strategy="HYBRID_SHARD", use_orig_params=False, optimizer="sgd")
    with pytest.warns(UserWarning, match="switching to use `NO_SHARD`"):
        pieces = run(cfg)
    got = assemble_flat(pieces["param"])
    assert sorted(got.diverged) == sorted((name, (1,)) for name in reference(cfg)["param"])


def fsdp1_program(cfg: Config, bug: str | None = None) -> None:
    """FSDP1 training, clean or with one silent bug: "scaled" loss, "same_data" on every rank, "perturb" a grad."""
    rank = dist.get_rank()
    fsdp = wrap(cfg, make_model(cfg))
    opt = make_optimizer(cfg, fsdp.parameters())
    for step in range(STEPS):
        opt.zero_grad()
        loss = fsdp(batch(cfg, 0 if bug == "same_data" else rank, step)).pow(2).mean()
        (loss * cfg.world if bug == "scaled" and step == 1 else loss).backward()
        if bug == "perturb" and step == 1 and rank == cfg.world - 1:
            # the first element this rank holds of the first parameter with a gradient on it (not padding)
            p = next(p for p in fsdp.parameters() if p.grad is not None and p.grad.numel() > 0)
            p.grad.view(-1)[0] += 1e-3
        opt.step()


def reference_program(cfg: Config) -> None:
    """The same model in one process on the concatenated batch."""
    model = make_model(cfg)
    opt = make_optimizer(cfg, model.parameters())
    for step in range(STEPS):
        opt.zero_grad()
        model(torch.cat([batch(cfg, r, step) for r in range(cfg.world)])).pow(2).mean().backward()
        opt.step()


def check_fsdp1(cfg: Config, bug: str | None = None) -> simdist.EquivalenceReport:
    return simdist.check_equivalence(
        fsdp1_program, reference_program, simdist.Cluster.switch(cfg.world, device="cpu"),
        args=(cfg, bug), reference_args=(cfg,), compute=False,
    )


@pytest.mark.parametrize("cfg", [SHARDED, ORIG, HYBRID], ids=["flat", "orig", "hybrid"])
def test_check_equivalence_finds_a_clean_fsdp1_program_equal(cfg: Config) -> None:
    rep = check_fsdp1(cfg)
    assert rep.ok, str(rep)
    assert rep.steps == STEPS
    assert rep.compared["parameters"] == len(reference(cfg)["param"])


@pytest.mark.parametrize("cfg", [SHARDED, ORIG], ids=["flat", "orig"])
def test_check_equivalence_finds_a_loss_scaled_on_every_rank_at_its_step(cfg: Config) -> None:
    rep = check_fsdp1(cfg, "scaled")
    assert not rep.ok and rep.first.step == 1 and rep.first.kind == "loss"
    assert {d.kind for d in rep.divergences} >= {"loss", "grad"}


def test_check_equivalence_finds_every_rank_reading_the_same_data() -> None:
    rep = check_fsdp1(SHARDED, "same_data")
    assert not rep.ok and rep.first.step == 0


@pytest.mark.parametrize("cfg", [SHARDED, ORIG], ids=["flat", "orig"])
def test_check_equivalence_names_the_parameter_and_rank_of_a_perturbed_gradient_shard(cfg: Config) -> None:
    rep = check_fsdp1(cfg, "perturb")
    grads = [d for d in rep.divergences if d.kind == "grad"]
    assert not rep.ok and rep.first.step == 1
    assert len(grads) == 1 and grads[0].ranks == (cfg.world - 1,), str(rep)


def test_check_equivalence_reports_hybrid_shard_replicas_torch_never_synchronises() -> None:
    cfg = Config(world=2, d_in=3, d_h=4, d_ff=2, blocks=1, strategy="HYBRID_SHARD", use_orig_params=False, optimizer="sgd")
    with pytest.warns(UserWarning, match="switching to use `NO_SHARD`"):
        rep = check_fsdp1(cfg)
    assert not rep.ok and rep.first.step == 0
    assert any(d.kind == "replica" and d.ranks == (1,) for d in rep.divergences), str(rep)
