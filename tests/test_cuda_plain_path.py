"""The short way ops on simulated GPUs take (``ComputeCostMode``'s path for plain ops: simulated-GPU operands of one
device and scalars, no keywords) does what the general path does: the oracle is the same run with every op sent the
general way (unwrap, ``Call.run``, rewrap), compared in results, spans, messages and memory."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from cuda_fns import ddp_train, fsdp2_train
from hypothesis import given
from hypothesis import strategies as st
from test_device_waits import _events
from test_fake import TINY, llama_step

import simdist
from simdist.compute import cost
from simdist.errors import DeviceMismatchError

DGX2 = simdist.Cluster.preset("dgx-h100", world_size=2)


def _both_ways(monkeypatch: pytest.MonkeyPatch, fn: Any, *args: Any, **options: Any) -> tuple[Any, Any, int]:
    """``fn`` run on two simulated H100s the short way and then the general way only: the two results, and how many
    ops took the short way."""
    taken = 0
    short = cost.ComputeCostMode._plain_on_gpu

    def counted(self: Any, func: Any, info: Any, args: Any) -> Any:
        nonlocal taken
        result = short(self, func, info, args)
        taken += result is not cost._NOT_PLAIN
        return result

    with monkeypatch.context() as m:
        m.setattr(cost.ComputeCostMode, "_plain_on_gpu", counted)
        fast = _outcome(fn, args, options)
    with monkeypatch.context() as m:
        m.setattr(cost, "_INFO", {})  # op infos made afresh, none of them plain
        m.setattr(cost, "plain", lambda func: False)
        general = _outcome(fn, args, options)
    if isinstance(fast, Exception) or isinstance(general, Exception):
        # the same error (their tracebacks pass through different frames of the cost mode)
        assert type(fast) is type(general) and str(fast).split("\n")[0] == str(general).split("\n")[0]
        assert (type(fast.__cause__), str(fast.__cause__)) == (
            type(general.__cause__),
            str(general.__cause__),
        )
        return fast, general, taken
    assert fast.sim_time == general.sim_time
    assert fast.messages == general.messages
    assert _events(fast) == _events(general)
    if fast.memory is not None:
        assert fast.memory == general.memory
    return fast, general, taken


def _outcome(fn: Any, args: Any, options: dict[str, Any]) -> simdist.RunResult | simdist.RankError:
    try:
        return simdist.run(fn, DGX2, args=args, **options)
    except simdist.RankError as e:  # an error rank code raises, which either way must raise alike
        return e


def _same_tensors(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b) if not a.is_meta else b.is_meta
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same_tensors(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("program", ["ddp", "fsdp2"])
def test_a_training_loop_on_gpus_is_the_same_run_either_way(
    monkeypatch: pytest.MonkeyPatch, program: str
) -> None:
    fn = {"ddp": ddp_train, "fsdp2": fsdp2_train}[program]
    fast, general, taken = _both_ways(monkeypatch, fn, "cuda", memory=True)
    assert taken > 100  # most of the loop's ops took the short way
    for rank in range(2):
        _same_tensors(fast.returns[rank], general.returns[rank])


def test_a_timing_only_llama_step_is_the_same_run_either_way(monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, taken = _both_ways(
        monkeypatch, llama_step.train_step, "fsdp2", TINY, 1, tensors="fake", memory=True, watchdog=math.inf
    )
    assert taken > 100


#: ops a program applies to tensors on its GPU: (name, function of the tensor and a second operand)
OPS = {
    "add": lambda x, y: x + y,
    "mul_scalar": lambda x, y: x * 3,
    "relu": lambda x, y: torch.relu(x),
    "sum": lambda x, y: x - x.sum(),
    "mean_dim": lambda x, y: x.mean(0, keepdim=True).expand_as(x).contiguous(),
    "matmul": lambda x, y: x @ (y.t() @ y),
    "on_another_gpu": lambda x, y: x + y.to((x.device.index + 1) % 8),  # CUDA's device mismatch
    "view": lambda x, y: x.view(-1).view(x.shape),
    "transpose": lambda x, y: x.t().contiguous().t(),
    "add_": lambda x, y: x.add_(y, alpha=0.5),
    "mul_": lambda x, y: x.mul_(0.5),
    "clamp": lambda x, y: x.clamp(-1.0, 1.0),
    "where": lambda x, y: torch.where(x > 0, x, y),
    "cat": lambda x, y: torch.cat([x, y])[: x.shape[0]],
    "softmax": lambda x, y: torch.softmax(x, dim=-1),
    "pow": lambda x, y: x.pow(2),
    "to_half_and_back": lambda x, y: x.half().float(),
    "one_from_the_host": lambda x, y: x + torch.ones(x.shape[1]).cuda(),
    "item": lambda x, y: x * float(x.sum().item() != 0.0),
    "copy_": lambda x, y: torch.empty_like(x).copy_(x),
    "copy_from_the_host": lambda x, y: x.clone().copy_(x.cpu()),
    "foreach": lambda x, y: torch._foreach_add([x, y], 1.0)[0],
    "foreach_": lambda x, y: torch._foreach_mul_([x, y], [0.5, 2.0]) or x,
}


def _ops(names: list[str], width: int) -> list[torch.Tensor]:
    torch.cuda.set_device(dist.get_rank())
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(8, width, generator=g).cuda()
    y = torch.randn(8, width, generator=g).cuda()
    out = []
    for name in names:
        x = OPS[name](x, y)
        out.append(x.cpu())
    x = x.contiguous()
    dist.all_reduce(x)
    out.append(x.cpu())
    return out


@given(
    names=st.lists(st.sampled_from(sorted(OPS)), min_size=1, max_size=8), width=st.sampled_from([4, 8, 33])
)
def test_any_mix_of_ops_is_the_same_run_either_way(names: list[str], width: int) -> None:
    with pytest.MonkeyPatch.context() as monkeypatch:
        fast, general, _ = _both_ways(monkeypatch, _ops, names, width, memory=True)
    if isinstance(fast, Exception):
        return  # raised alike both ways (a view of a transposed tensor, operands on two GPUs)
    for rank in range(2):
        _same_tensors(fast.returns[rank], general.returns[rank])


def test_operands_on_two_gpus_are_cudas_error_either_way(monkeypatch: pytest.MonkeyPatch) -> None:
    fast, _, _ = _both_ways(monkeypatch, _ops, ["add", "on_another_gpu"], 4)
    assert isinstance(fast, simdist.RankError) and isinstance(fast.__cause__, DeviceMismatchError)
