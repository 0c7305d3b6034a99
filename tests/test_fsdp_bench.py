"""simdist's memory accounting against the ZeRO formulas, on the model of ``benchmarks/fsdp_bench.py``.

Not a timed test: the oracle is arithmetic on the model's parameter count. Adam keeps two fp32 moments per
element and one 4-byte step counter per parameter tensor, so the optimizer state a rank holds is exactly
8 x (its elements) + 4 x (its tensors): all of them under DDP, its ShardedOptimizer share under ZeRO-1,
1/N of every tensor (and every counter) under FSDP2.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

import simdist
from simdist.oracle.tolerance import compare
from simdist.strategies.fsdp import FSDP

_spec = importlib.util.spec_from_file_location(
    "fsdp_bench", Path(__file__).resolve().parent.parent / "benchmarks" / "fsdp_bench.py"
)
bench = importlib.util.module_from_spec(_spec)
sys.modules["fsdp_bench"] = bench  # its dataclasses look their module up there
_spec.loader.exec_module(bench)

#: every width divisible by the 4 ranks, so FSDP2's shards are equal
TINY = bench.ModelConfig(dim=16, layers=2, heads=2, vocab=32, seq=8, batch=2)
RANKS = 4


@pytest.fixture(scope="module")
def rows() -> dict[str, bench.Row]:
    # the figures are the third step's, the steady state the formulas describe: torch's DDP rebuilds its buckets
    # in the second, when for a moment the old bucket (the gradients) and a gradient accumulated before the new
    # bucket holds it are both alive
    return {name: bench.measure(name, TINY, ranks=RANKS, steps=3) for name in ("torch DDP", "ZeRO-1", "torch FSDP2")}


def test_ddp_holds_all_of_adams_state_on_every_rank(rows: dict) -> None:
    r = rows["torch DDP"]
    assert r.per_rank_state == [8 * r.psi + 4 * r.tensors] * RANKS
    assert r.measured["parameters"] == 4 * r.psi and r.measured["gradients"] == 4 * r.psi
    assert r.model_states == sum(bench.replicated_states(r.psi, RANKS, r.tensors)) == 16 * r.psi + 4 * r.tensors


def test_zero1_holds_adams_state_for_its_share_only(rows: dict) -> None:
    r, ddp = rows["ZeRO-1"], rows["torch DDP"]
    shares = bench.zero1_shares(TINY, RANKS)
    assert r.per_rank_state == [8 * elements + 4 * tensors for elements, tensors in shares]
    assert sum(r.per_rank_state) == ddp.per_rank_state[0]  # each state tensor held once over the group
    # parameters and gradients stay whole on every rank: ZeRO stage 1 shards the optimizer state only
    assert r.measured["parameters"] == 4 * r.psi and r.measured["gradients"] == 4 * r.psi


def test_fsdp2_holds_a_quarter_of_adams_moments_and_every_step_counter(rows: dict) -> None:
    r = rows["torch FSDP2"]
    assert r.per_rank_state == [8 * r.psi // RANKS + 4 * r.tensors] * RANKS
    assert r.per_rank_state[0] == bench.sharded_states(r.psi, RANKS, r.tensors)[2]
    # the sharded fp32 parameters, plus the bf16 unit FSDP2 has gathered at the moment of the maximum
    assert r.measured["parameters"] > 4 * r.psi / RANKS


def _one_step(kind: str) -> dict[str, torch.Tensor]:
    """One fp32 SGD step (lr 1: parameters move by exactly their gradient) of the bench's model under ``kind``
    ("ours" or "fsdp2"); the full parameters after it."""
    torch.manual_seed(0)
    net = bench.TinyGPT(TINY)
    if kind == "ours":
        model = FSDP(net)
        finish = model.finish_gradient_synchronization
    else:
        for block in net.blocks:
            fully_shard(block)
        model = fully_shard(net)
        finish = None
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    g = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, TINY.vocab, (TINY.batch, TINY.seq + 1), generator=g)
    F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    if finish is not None:
        finish()
    opt.step()
    if kind == "ours":
        return model.gather_full_params()
    return {n: p.full_tensor().detach().clone() for n, p in net.named_parameters()}


def test_torch_fsdp2_gives_the_same_gradients_as_simdists_fsdp() -> None:
    cluster = simdist.Cluster.switch(RANKS, device="cpu")
    ours = simdist.run(_one_step, cluster, args=("ours",), compute=False).returns
    theirs = simdist.run(_one_step, cluster, args=("fsdp2",), compute=False).returns
    torch.manual_seed(0)
    before = dict(bench.TinyGPT(TINY).named_parameters())
    for rank in range(RANKS):
        assert ours[rank].keys() == theirs[rank].keys() == before.keys()
        for name, p in before.items():
            # after one step of SGD with lr 1 a parameter is its initial value minus its averaged gradient
            mine, torchs = p.detach() - ours[rank][name], p.detach() - theirs[rank][name]
            assert torchs.abs().max() > 0, name
            assert compare(mine, torchs, exact=False) is None, f"rank {rank} {name}: {compare(mine, torchs, exact=False)}"
