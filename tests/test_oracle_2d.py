"""The equivalence oracle on 2-D parallelism: FSDP2 over tensor parallelism, whose pieces are ``_StridedShard``.

``fully_shard`` over the "dp" mesh dimension of parameters that ``parallelize_module`` already sharded over "tp"
shards the column-parallel weights' dim 0 twice, right to left; torch records that as
``(_StridedShard(0, split_factor=tp), Shard(0))``. The oracles here: the single-process model for training runs
(simulated, and on real gloo processes), the DTensor's own ``full_tensor()`` (a collective) for the assembly,
torch's offset logic for the index lists.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

import simdist
from real.oracle import check_final_state
from simdist.oracle import AssemblyError
from simdist.oracle.assemble import assemble, held_indices
from simdist.oracle.capture import MeshLayout, Piece, mesh_layout
from simdist.oracle.names import named_tensors
from tests.oracle_fns import Setup, data, layers, model, optimizer, reference


def cpu(n: int) -> simdist.Cluster:
    return simdist.Cluster.switch(n, device="cpu")


def fsdp_over_tp(setup: Setup, tp: int = 2) -> None:
    """``setup``'s MLP: column- then row-parallel over "tp", then FSDP2 over "dp"; each dp replica reads its rows."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    m = model(setup)
    parallelize_module(m, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(m, mesh=mesh["dp"])
    params = list(m.parameters())
    opt = optimizer(setup, params)
    dp, n = mesh.get_local_rank("dp"), setup.batch // (world // tp)
    for step in range(setup.steps):
        x, y = data(setup, step)
        opt.zero_grad()
        F.mse_loss(m(x[dp * n : (dp + 1) * n]), y[dp * n : (dp + 1) * n]).backward()
        if setup.perturb is not None and setup.perturb[0] == step and setup.perturb[3] == dist.get_rank():
            _, index, element, _ = setup.perturb
            local = params[index].grad.to_local()
            local.view(-1)[element % local.numel()] += setup.delta
        opt.step()


def check(setup: Setup, world: int = 4) -> simdist.EquivalenceReport:
    return simdist.check_equivalence(fsdp_over_tp, reference, cpu(world), args=(setup,))


def test_fsdp2_over_tp_places_column_parallel_weights_strided() -> None:
    def placements() -> dict[str, str]:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        m = model(Setup())
        parallelize_module(m, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(m, mesh=mesh["dp"])
        return {n: str(p.placements) for n, p in m.named_parameters()}

    got = simdist.run(placements, cpu(4)).returns[0]
    assert got["0.weight"] == got["0.bias"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert got["2.weight"] == "(Shard(dim=0), Shard(dim=1))"


@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.parametrize("widths", [(6, 8, 4), (5, 6, 3)])
def test_clean_fsdp2_over_tp_runs_match_the_reference(opt: str, widths: tuple[int, ...]) -> None:
    # (5, 6, 3): every sharded dimension is uneven somewhere (3 rows per tp rank split 2 + 1 over dp)
    rep = check(Setup(widths=widths, batch=8, steps=3, optimizer=opt))
    assert rep.ok, str(rep)
    assert rep.steps == 3 and rep.compared["parameters"] == 4 and rep.compared["gradients"] == 4


@pytest.mark.parametrize("step, index, rank", [(0, 0, 1), (1, 0, 2), (2, 1, 3), (1, 2, 0)])
def test_a_perturbed_gradient_element_names_its_step_parameter_and_rank(step: int, index: int, rank: int) -> None:
    # 0.weight and 0.bias are strided over dp (rank 1 holds rows 4-5 of 8, rank 2 rows 2-3); 2.weight is a box
    setup = Setup(widths=(6, 8, 4), steps=3, optimizer="adam", perturb=(step, index, 5, rank), delta=0.5)
    rep = check(setup)
    assert not rep.ok
    names = [n for n, _ in named_tensors(nn.Sequential(*layers(setup.widths)))[0]]
    assert (rep.first.step, rep.first.kind, rep.first.name) == (step, "grad", names[index]), str(rep)
    assert rep.first.ranks == (rank,), str(rep)


@pytest.mark.real
def test_fsdp2_over_tp_on_real_gloo_processes_is_checked_at_its_last_step() -> None:
    # torch's FSDP2 and TP on real processes lay the pieces out; the oracle assembles them in this process.
    # One launch (four processes) checks both sides: one element of rank 2's gradient piece is perturbed before
    # the last step, so every other element of every tensor must match (the assembly puts each piece in its
    # place) and that element, with what Adam's step derives from it, must be found on rank 2.
    bad = Setup(widths=(5, 6, 3), optimizer="adam", perturb=(2, 0, 3, 2), delta=0.5)
    rep = check_final_state(fsdp_over_tp, reference, 4, args=(bad,), reference_args=(bad,))
    assert (rep.first.step, rep.first.kind, rep.first.name, rep.first.ranks) == (2, "grad", "0.weight", (2,)), str(rep)
    found = {(d.kind, d.name, d.ranks, d.difference.count, d.difference.numel) for d in rep.divergences}
    derived = {("grad", "0.weight"), ("param", "0.weight"), ("optimizer", "0.weight:exp_avg"),
               ("optimizer", "0.weight:exp_avg_sq")}
    assert found == {(kind, name, (2,), 1, 30) for kind, name in derived}, str(rep)
    assert rep.compared == {"loss": 1, "gradients": 4, "parameters": 4, "optimizer state tensors": 12, "buffers": 0}


# ---- the assembly of a strided layout against the DTensor's own full tensor


#: (global shape, placements over a 2x2 mesh): FSDP2 over column- and row-parallel layouts, a strided last dim
CASES = [
    ((8, 6), (_StridedShard(0, split_factor=2), Shard(0))),
    ((8,), (_StridedShard(0, split_factor=2), Shard(0))),
    ((4, 8), (_StridedShard(1, split_factor=2), Shard(1))),
    ((8, 4), (Replicate(), _StridedShard(0, split_factor=2))),
    ((7, 5), (Shard(0), Shard(1))),
]


def _distribute() -> list[tuple[MeshLayout, torch.Tensor, torch.Tensor]]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = []
    for shape, placements in CASES:
        # distinct values, so a piece written at the wrong place cannot go unnoticed
        full = torch.arange(float(np.prod(shape)), dtype=torch.float64).view(shape)
        dt = distribute_tensor(full, mesh, placements)
        out.append((mesh_layout(dt), dt.to_local().clone(), dt.full_tensor()))
    return out


def test_strided_pieces_assemble_into_the_dtensors_full_tensor() -> None:
    per_rank = simdist.run(_distribute, cpu(4)).returns
    for i, (shape, placements) in enumerate(CASES):
        pieces = [Piece(rank, got[i][1], got[i][0]) for rank, got in enumerate(per_rank)]
        a = assemble("t", pieces)
        assert torch.equal(a.full, per_rank[0][i][2]), f"{shape} {placements}"
        assert not a.replica_ranks
        for rank, piece in enumerate(pieces):
            # the region names exactly the elements the rank holds
            assert sorted(a.full[a.regions[rank]].flatten().tolist()) == sorted(piece.value.flatten().tolist())


def test_a_piece_that_does_not_fit_its_placements_is_an_error() -> None:
    per_rank = simdist.run(_distribute, cpu(4)).returns
    pieces = [Piece(rank, got[0][1], got[0][0]) for rank, got in enumerate(per_rank)]
    pieces[3] = Piece(3, pieces[3].value[:1], pieces[3].layout)
    with pytest.raises(AssemblyError, match=r"rank 3 \(mesh coordinate \(1, 1\)\).*shape \(1, 6\)"):
        assemble("t", pieces)


# ---- the index lists against torch's own offset logic, uneven sizes included


@settings(deadline=None)
@given(
    shape=st.lists(st.integers(1, 13), min_size=1, max_size=2).map(tuple),
    mesh_shape=st.sampled_from([(2, 2), (2, 3), (3, 2), (4,)]),
    data=st.data(),
)
def test_held_indices_agree_with_torch_and_cover_each_element_once(shape, mesh_shape, data) -> None:
    kinds = []
    for size in mesh_shape:
        dim = data.draw(st.integers(0, len(shape) - 1), label="dim")
        kind = data.draw(st.sampled_from(["replicate", "shard", "strided"]), label="kind")
        kinds.append(("strided", dim, data.draw(st.integers(2, 3), label="split factor")) if kind == "strided"
                     else ("shard", dim) if kind == "shard" else ("replicate",))
    torch_placements = [_StridedShard(p[1], split_factor=p[2]) if p[0] == "strided" else Shard(p[1])
                        if p[0] == "shard" else Replicate() for p in kinds]
    layout = MeshLayout(tuple(range(int(np.prod(mesh_shape)))), mesh_shape, tuple(kinds), shape)
    count = torch.zeros(shape, dtype=torch.int64)
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        held = held_indices(layout, coord)
        local_shape, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), torch_placements)
        assert tuple(len(h) for h in held) == tuple(local_shape)
        assert all(int(h[0]) == o for h, o in zip(held, offset) if len(h))
        if all(c == 0 for c, p in zip(coord, kinds) if p[0] == "replicate"):
            grid = tuple(h.view([-1 if d == k else 1 for d in range(len(shape))]) for k, h in enumerate(held))
            count[grid] += 1
    assert bool((count == 1).all()), "the pieces of one replica hold every element exactly once"
