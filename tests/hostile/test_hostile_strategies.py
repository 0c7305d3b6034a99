"""Hostile uses of the strategies: unordered parameters for ZeRO-1, FSDP misused, odd pipeline settings.

Each case runs the strategy inside ``simdist.run``: an error the strategy raises reaches the caller as a
:class:`simdist.RankError` naming the rank, and the message must say what was wrong and what to pass instead.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hostile_cases import Case, check, params
from torch import nn

import simdist
from simdist.strategies import PipelineOptimizer, PipelineOptimizerConfig, ShardedOptimizer
from simdist.strategies.fsdp import FSDP

RING2 = simdist.Cluster.ring(2, device="cpu")


def _on_two_ranks(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` on two simulated ranks without compute time."""
    return lambda: simdist.run(fn, RING2, args=args, compute=False)


def _three_layers() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3), nn.Linear(3, 2))


# --------------------------------------------------------------------------- ZeRO-1
def _zero_over_a_set() -> None:
    ShardedOptimizer(set(_three_layers().parameters()), torch.optim.SGD, lr=0.1)


def _zero_reversed_on_rank_1() -> None:
    params = list(_three_layers().parameters())
    ShardedOptimizer(params if dist.get_rank() == 0 else params[::-1], torch.optim.SGD, lr=0.1)


_ZERO = [
    Case("zero-set-of-parameters", "ShardedOptimizer(set(model.parameters()), ...): each rank orders the set its own way",
         _on_two_ranks(_zero_over_a_set), error=simdist.RankError,
         match=r"TypeError: optimizer parameters need to be organized in ordered collections"),
    Case("zero-parameters-reversed-on-one-rank", "ShardedOptimizer over the parameters reversed on rank 1 only",
         _on_two_ranks(_zero_reversed_on_rank_1), error=simdist.RankError,
         match=r"at param group 0, position 0: rank 0 has \(4, 4\) float32 and rank 1 has \(2,\) float32"),
]

# --------------------------------------------------------------------------- FSDP
def _fsdp_ranks_gather_different_units() -> None:
    model = FSDP(nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2)))
    if dist.get_rank() == 0:
        model(torch.ones(4))
    else:
        model.module[1](torch.ones(6))


def _fsdp_weight_read_after_the_step() -> None:
    net = _three_layers()
    model = FSDP(net)
    model(torch.ones(2, 4)).sum().backward()
    model.finish_gradient_synchronization()
    net[0].weight.sum()  # only this rank's shard exists here; the full weight's memory is freed


class _TiedByFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 5)
        self.mid = nn.Linear(5, 5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.mid(self.embed(tokens))) @ self.embed.weight.T  # the embedding's weight, outside it


def _tied_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 101 + rank)
    return torch.randint(0, 7, (3,), generator=g), torch.randint(0, 7, (3,), generator=g)


def _tied_training(world: int) -> None:
    """Two SGD steps, under FSDP on each rank's batch, or (``world`` given) in one process on every rank's."""
    torch.manual_seed(0)
    model = _TiedByFunction() if world else FSDP(_TiedByFunction())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        parts = [_tied_batch(step, r) for r in range(world)] if world else [_tied_batch(step, dist.get_rank())]
        F.cross_entropy(model(torch.cat([p[0] for p in parts])), torch.cat([p[1] for p in parts])).backward()
        if not world:
            model.finish_gradient_synchronization()
        optimizer.step()
        optimizer.zero_grad()


def _two_ranks_against_one_process() -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """FSDP on two ranks, and one process adding the two ranks' gradients (a backward of loss / 2 per batch)."""

    def train(world: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        net = _TiedByFunction()
        model = net if world else FSDP(net)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for step in range(3):
            for rank in range(world) if world else [dist.get_rank()]:
                tokens, targets = _tied_batch(step, rank)
                (F.cross_entropy(model(tokens), targets) / (world or 1)).backward()
            if not world:
                model.finish_gradient_synchronization()
            optimizer.step()
            optimizer.zero_grad()
        return model.gather_full_params() if not world else {n: p.detach() for n, p in net.named_parameters()}

    return simdist.run(train, simdist.Cluster.switch(2, device="cpu"), args=(0,), compute=False).returns, train(2)


def _bitwise_equal(result: tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> None:
    ranks, reference = result
    for got in ranks:
        assert all(torch.equal(got[n], reference[n]) for n in reference), "not bitwise equal"


def _fsdp_functional_tie() -> simdist.EquivalenceReport:
    cluster = simdist.Cluster.switch(2, device="cpu")
    return simdist.check_equivalence(_tied_training, _tied_training, cluster, args=(0,), reference_args=(2,))


def _oracle_agrees(rep: simdist.EquivalenceReport) -> None:
    assert rep.ok, str(rep)


class _Indexed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(7, 5))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.weight[tokens]


def _fsdp_fp16_indexed_embedding() -> tuple[bool, torch.dtype]:
    torch.manual_seed(0)
    net = nn.Sequential(_Indexed(), nn.Linear(5, 3))
    model = FSDP(net, compute_dtype=torch.float16)
    model(torch.tensor([0, 3, 6])).float().sum().backward()
    model.finish_gradient_synchronization()
    master = dict(model.named_parameters())["0.weight"]
    return net[0].weight.grad is master.grad, net[0].weight.grad.dtype


def _module_holds_the_fp32_gradient(result: simdist.RunResult) -> None:
    assert result.returns == [(True, torch.float32)] * 2, result.returns


_FSDP = [
    Case("fsdp-weight-read-outside-forward", "w.sum() of an FSDP-sharded weight after the step, outside forward",
         _on_two_ranks(_fsdp_weight_read_after_the_step), error=simdist.RankError,
         match=r"FSDP's sharded parameter '0.weight' was used by torch.Tensor.sum on rank \d outside the forward .*"
               r"model.gather_full_params\(\)"),
    Case("fsdp-weight-tied-by-function", "a head that reads the embedding's weight in the parent's forward",
         _fsdp_functional_tie, check=_oracle_agrees),
    Case("fsdp-fp32-two-ranks-bitwise", "fp32 SGD steps on 2 ranks against one process adding both ranks' gradients",
         _two_ranks_against_one_process, check=_bitwise_equal),
    Case("fsdp-fp16-hand-written-embedding-gradient", "compute_dtype=float16: the module's indexed weight's .grad",
         _on_two_ranks(_fsdp_fp16_indexed_embedding), check=_module_holds_the_fp32_gradient),
    Case("fsdp-mismatch-names-the-users-line", "rank 1 runs one FSDP layer alone: the mismatch's sites are FSDP's",
         _on_two_ranks(_fsdp_ranks_gather_different_units), error=simdist.CollectiveMismatchError,
         match=r"(?s)rank 0: .*wrapper\.py:\d+ in _start_gather, called from \S+test_hostile_strategies\.py:\d+ in "
               r"_fsdp_ranks_gather_different_units.*rank 1: .*called from \S+test_hostile_strategies\.py:\d+ in "
               r"_fsdp_ranks_gather_different_units"),
]


# --------------------------------------------------------------------------- pipeline
def _pipeline_with_timeout(timeout_ms: Any) -> None:
    stage = nn.Linear(2, 2)
    opt = PipelineOptimizer(torch.optim.SGD(stage.parameters(), lr=0.1), [stage],
                            PipelineOptimizerConfig(communication_timeout_ms=timeout_ms))
    stage(torch.ones(2)).sum().backward()
    opt.step()


_PIPELINE = [
    Case("pipeline-timeout-1e30-ms", "PipelineOptimizerConfig(communication_timeout_ms=10**30), then step()",
         _on_two_ranks(_pipeline_with_timeout, 10**30), error=simdist.RankError,
         match=r"ValueError: PipelineOptimizerConfig.communication_timeout_ms must be at most 4611686018427 "
               r"milliseconds .*; got 1000000000000000000000000000000"),
    Case("pipeline-timeout-nan-ms", "PipelineOptimizerConfig(communication_timeout_ms=float('nan'))",
         _on_two_ranks(_pipeline_with_timeout, float("nan")), error=simdist.RankError,
         match=r"TypeError: PipelineOptimizerConfig.communication_timeout_ms must be an int of milliseconds; "
               r"got nan"),
]

CASES: list[Case] = [*_ZERO, *_FSDP, *_PIPELINE]


@pytest.mark.parametrize("case", params(CASES))
def test_hostile(case: Case) -> None:
    check(case)
