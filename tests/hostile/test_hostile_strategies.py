"""Hostile uses of the strategies: unordered parameters for ZeRO-1, FSDP misused, odd pipeline settings.

Each case runs the strategy inside ``simdist.run``: an error the strategy raises reaches the caller as a
:class:`simdist.RankError` naming the rank, and the message must say what was wrong and what to pass instead.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
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


_FSDP = [
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
