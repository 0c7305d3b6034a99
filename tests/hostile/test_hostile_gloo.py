"""Hostile inputs to the simulated backend: what real gloo rejects is rejected, what it computes is computed."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hostile_cases import Case, check, params

import simdist
from simdist.errors import InvalidArgumentError

R = dist.ReduceOp


def _run(fn: Callable[[], Any], n: int = 2, **kw: Any) -> Callable[[], simdist.RunResult]:
    """A case body: run ``fn`` on ``n`` ranks; an error raised in a rank is re-raised as the rank raised it."""

    def go() -> simdist.RunResult:
        try:
            return simdist.run(fn, simdist.Cluster.switch(n, device="cpu"), **kw)
        except simdist.RankError as e:
            if isinstance(e.exc, simdist.SimdistError):
                raise e.exc from e
            raise

    return go


def _all_reduce(t_fn: Callable[[int], torch.Tensor], op: Any = R.SUM) -> Callable[[], torch.Tensor]:
    def fn() -> torch.Tensor:
        t = t_fn(dist.get_rank())
        dist.all_reduce(t, op=op)
        return t

    return fn


def _sparse_sum() -> torch.Tensor:
    r = dist.get_rank()
    t = torch.sparse_coo_tensor([[r, 2, 2]], [1.0, 2.0, 3.0], (4,))  # uncoalesced: index 2 twice
    dist.all_reduce(t)
    return t


def _check_sparse(res: simdist.RunResult) -> None:
    n = res.world_size
    want = torch.zeros(4)
    for r in range(n):
        want += torch.sparse_coo_tensor([[r, 2, 2]], [1.0, 2.0, 3.0], (4,)).to_dense()
    for t in res.returns:
        assert t.layout == torch.sparse_coo and t.is_coalesced()
        assert torch.equal(t.to_dense(), want), (t, want)


def _monitored(missing: int | None, wait_all: bool = False) -> Callable[[], float]:
    def fn() -> float:
        if dist.get_rank() == missing:
            simdist.charge(60.0)  # busy elsewhere for a simulated minute
            return simdist.now()
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=2), wait_all_ranks=wait_all)
        return simdist.now()

    return fn


def _check_barrier_passes(res: simdist.RunResult) -> None:
    assert all(0 < t < 1e-3 for t in res.returns), res.returns  # microseconds of messages, no timeout


def _names() -> tuple:
    g = dist.new_group([0, 1], backend="gloo")
    return (str(dist.get_backend()), dist.get_backend_config(), dist.group.WORLD._get_backend_name(), str(dist.get_backend(g)))



def _ddp_step() -> torch.Tensor:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    model(torch.full((3, 4), float(dist.get_rank()))).sum().backward()
    return model.module.weight.grad


def _expect_same_gradients(res: simdist.RunResult) -> None:
    """Oracle: the single-process gradient of the mean of both ranks' losses (inputs 0 and 1)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    (model(torch.cat([torch.zeros(3, 4), torch.ones(3, 4)])).sum() / 2).backward()
    for got in res.returns:
        torch.testing.assert_close(got, model.weight.grad)

def _expect_names(*want: str) -> Callable[[simdist.RunResult], None]:
    def check_(res: simdist.RunResult) -> None:
        assert all(tuple(r) == want for r in res.returns), res.returns

    return check_


def _all_gather_coalesced() -> list:
    r = dist.get_rank()
    outs = [[torch.zeros(2), torch.zeros(1)] for _ in range(2)]
    dist.all_gather_coalesced(outs, [torch.full((2,), float(r)), torch.full((1,), 10.0 + r)])
    return outs


def _gather_list(outs: Callable[[], list[torch.Tensor]]) -> Callable[[], None]:
    def fn() -> None:
        dist.gather(torch.ones(2), outs() if dist.get_rank() == 0 else None, dst=0)

    return fn


def _scatter_list(ins: Callable[[], list[torch.Tensor]]) -> Callable[[], None]:
    def fn() -> None:
        dist.scatter(torch.ones(2), ins() if dist.get_rank() == 0 else None, src=0)

    return fn


def _p2p(kind: str, peer: Callable[[int], int], tag: int = 0) -> Callable[[], None]:
    def fn() -> None:
        t = torch.ones(2)
        p = peer(dist.get_rank())
        (dist.send if kind == "send" else dist.recv)(t, p, tag=tag)

    return fn


def _complex(dtype: torch.dtype = torch.complex64) -> torch.Tensor:
    return torch.tensor([1 + 2j, 3 - 1j], dtype=dtype)


def _complex_reduce() -> torch.Tensor:
    t = _complex() * (dist.get_rank() + 1)
    dist.reduce(t, 0, op=R.SUM)
    return t


def _each(values: list[float]) -> Callable[[int], torch.Tensor]:
    """Rank r's one-element float32 tensor ``values[r]``."""
    return lambda r: torch.tensor([values[r]], dtype=torch.float32)


def _gloo_gives(value: float) -> Callable[[simdist.RunResult], None]:
    """Oracle: what gloo's ring gives every rank, worked out by hand in the case's line (checked against real
    gloo processes). On n ranks a one-element buffer is block 0, which starts at rank n-1 and ends at rank 0,
    each rank applying ``fn(own, arrived)``: ``fn(x0, fn(x1, ... fn(x[n-2], x[n-1])))``."""

    def check_(res: simdist.RunResult) -> None:
        want = torch.tensor([value], dtype=torch.float32)
        for t in res.returns:
            assert torch.equal(t.view(torch.int32), want.view(torch.int32)), (t, want)  # bit for bit: -0.0 too

    return check_


E = InvalidArgumentError
CASES: list[Case] = [
    Case("broadcast-src-outside-world", "broadcast(src=7) in a world of 2",
         _run(lambda: dist.broadcast(torch.ones(3), src=7)), error=E, match=r"invalid root rank: 7 \(rank \d, broadcast.*src must be a rank of the group, 0\.\.1"),
    Case("broadcast-src-negative", "broadcast(src=-1)",
         _run(lambda: dist.broadcast(torch.ones(3), src=-1)), error=E, match=r"invalid root rank: -1"),
    Case("reduce-dst-outside-world", "reduce(dst=5) in a world of 2",
         _run(lambda: dist.reduce(torch.ones(3), dst=5)), error=E, match=r"ProcessGroupGloo::reduce: invalid root rank: 5 \(rank \d, reduce.*dst"),
    Case("gather-dst-outside-world", "gather(dst=2) in a world of 2",
         _run(lambda: dist.gather(torch.ones(3), None, dst=2)), error=E, match=r"gather: invalid root rank: 2"),
    Case("scatter-src-outside-world", "scatter(src=2) in a world of 2",
         _run(lambda: dist.scatter(torch.ones(3), None, src=2)), error=E, match=r"scatter: invalid root rank: 2"),
    Case("avg-on-int64", "all_reduce(ReduceOp.AVG) of an int64 tensor",
         _run(_all_reduce(lambda r: torch.arange(3) + r, R.AVG)), error=E, match=r"cannot be cast|can't be cast to the desired output type Long.*AVG"),
    Case("avg-on-uint8-reduce", "reduce(ReduceOp.AVG) of a uint8 tensor",
         _run(lambda: dist.reduce(torch.ones(3, dtype=torch.uint8), 0, op=R.AVG)), error=E, match=r"output type Byte"),
    Case("avg-on-int32-reduce-scatter", "reduce_scatter_tensor(ReduceOp.AVG) of int32 tensors",
         _run(lambda: dist.reduce_scatter_tensor(torch.zeros(2, dtype=torch.int32), torch.ones(4, dtype=torch.int32), op=R.AVG)),
         error=E, match=r"output type Int"),
    Case("band-on-float", "all_reduce(ReduceOp.BAND) of a float32 tensor",
         _run(_all_reduce(lambda r: torch.ones(3), R.BAND)), error=E, match=r"Cannot use ReduceOp.BAND with non-integral dtype.*float32"),
    Case("bxor-on-bfloat16", "all_reduce(ReduceOp.BXOR) of a bfloat16 tensor",
         _run(_all_reduce(lambda r: torch.ones(3, dtype=torch.bfloat16), R.BXOR)), error=E, match=r"BXOR with non-integral dtype"),
    Case("bor-on-float-reduce-scatter", "reduce_scatter_tensor(ReduceOp.BOR) of float tensors",
         _run(lambda: dist.reduce_scatter_tensor(torch.zeros(2), torch.ones(4), op=R.BOR)), error=E, match=r"BOR with non-integral"),
    Case("premul-sum", "all_reduce with ReduceOp.PREMUL_SUM (an NCCL-only op)",
         _run(_all_reduce(lambda r: torch.ones(3), dist._make_nccl_premul_sum(2.0))), error=E, match=r"Cannot use ReduceOp.PREMUL_SUM with Gloo"),
    Case("min-on-complex-reduce", "reduce(ReduceOp.MIN) of a complex64 tensor (gloo: reduce does not support it on complex)",
         _run(lambda: dist.reduce(_complex(), 0, op=R.MIN)), error=E, match=r"ReduceOp.MIN on complex tensors.*the reduce tensor has dtype torch.complex64"),
    Case("max-on-complex-reduce-scatter", "reduce_scatter(ReduceOp.MAX) of complex128 tensors",
         _run(lambda: dist.reduce_scatter(_complex(torch.complex128), [_complex(torch.complex128)] * 2, op=R.MAX)),
         error=E, match=r"ReduceOp.MAX on complex tensors.*complex128"),
    Case("product-on-complex-reduce-scatter", "reduce_scatter_tensor(ReduceOp.PRODUCT) of complex tensors (gloo refuses; "
         "a result would be silently not gloo's)",
         _run(lambda: dist.reduce_scatter_tensor(_complex(), torch.cat([_complex()] * 2), op=R.PRODUCT)),
         error=E, match=r"ReduceOp.PRODUCT on complex tensors.*SUM and AVG"),
    Case("sum-on-complex-reduce-computes", "reduce(ReduceOp.SUM) of complex64 tensors (gloo computes it)",
         _run(_complex_reduce), check=lambda res: torch.testing.assert_close(res.returns[0], _complex() * 3, rtol=0, atol=0)),
    Case("band-on-int-computes", "all_reduce(ReduceOp.BAND) of int64 tensors (gloo computes it)",
         _run(_all_reduce(lambda r: torch.tensor([3, 5, 7]) + r, R.BAND)),
         check=lambda res: [torch.testing.assert_close(t, torch.tensor([3, 5, 7]) & torch.tensor([4, 6, 8])) for t in res.returns]),
    Case("send-to-self", "dist.isend to the sending rank itself",
         _run(lambda: dist.isend(torch.ones(2), dist.get_rank()).wait()), error=E, match=r"cannot send to/from itself.*dst must be another rank"),
    Case("recv-from-self", "dist.recv from the receiving rank itself",
         _run(_p2p("recv", lambda r: r)), error=E, match=r"rank \d cannot recv to/from itself"),
    Case("send-to-rank-outside-world", "dist.send(dst=7) in a world of 2 (gloo crashes the process)",
         _run(_p2p("send", lambda r: 7)), error=E, match=r"invalid peer rank 7 \(rank \d, send.*dst must be a rank of the group, 0\.\.1"),
    Case("irecv-from-negative-rank", "dist.irecv(src=-3)",
         _run(lambda: dist.irecv(torch.ones(2), -3).wait()), error=E, match=r"invalid peer rank -3"),
    Case("negative-tag", "dist.send(..., tag=-5)",
         _run(_p2p("send", lambda r: 1 - r, tag=-5)), error=E, match=r"Tag must be nonnegative.*tag=-5"),
    Case("all-gather-short-list", "all_gather into a list of 1 tensor in a world of 2",
         _run(lambda: dist.all_gather([torch.ones(2)], torch.ones(2))), error=E, match=r"allgather: invalid output list size 1.*one tensor per rank of the group \(2\)"),
    Case("all-gather-wrong-size", "all_gather into tensors of another size than the input",
         _run(lambda: dist.all_gather([torch.ones(3), torch.ones(3)], torch.ones(2))), error=E, match=r"output\[0\] is \(3,\).*the input is \(2,\)"),
    Case("all-gather-into-tensor-wrong-size", "all_gather_into_tensor with an output of 5 elements for 2 x 2",
         _run(lambda: dist.all_gather_into_tensor(torch.zeros(5), torch.ones(2))), error=E, match=r"world_size \(2\) x input.numel\(\) = 4 elements"),
    Case("all-gather-coalesced-wrong-lists", "all_gather_coalesced with one output list in a world of 2",
         _run(lambda: dist.all_gather_coalesced([[torch.zeros(2)]], [torch.ones(2)])), error=E, match=r"output lists should be equal to world size"),
    Case("all-gather-coalesced-computes", "all_gather_coalesced of two tensors (gloo supports it)",
         _run(_all_gather_coalesced),
         check=lambda res: [torch.testing.assert_close(o, [[torch.zeros(2), torch.full((1,), 10.0)], [torch.ones(2), torch.full((1,), 11.0)]]) for o in res.returns]),
    Case("reduce-scatter-short-list", "reduce_scatter with an input list of 1 tensor in a world of 2",
         _run(lambda: dist.reduce_scatter(torch.zeros(2), [torch.ones(2)])), error=E, match=r"invalid input list size 1"),
    Case("reduce-scatter-tensor-wrong-size", "reduce_scatter_tensor with a 5-element input for a 2-element output",
         _run(lambda: dist.reduce_scatter_tensor(torch.zeros(2), torch.ones(5))), error=E, match=r"world_size \(2\) x output.numel\(\) = 4 elements.*got 5"),
    Case("all-to-all-single-bad-split-sum", "all_to_all_single with output splits summing to 3 of 4 rows",
         _run(lambda: dist.all_to_all_single(torch.zeros(4), torch.ones(4), [1, 2], [2, 2])), error=E, match=r"Split sizes doesn't match total dim 0 size.*output_split_sizes \[1, 2\]"),
    Case("all-to-all-single-split-count", "all_to_all_single with one split size in a world of 2",
         _run(lambda: dist.all_to_all_single(torch.zeros(4), torch.ones(4), [4], [4])), error=E, match=r"Number of tensor splits not equal to group size"),
    Case("all-to-all-single-negative-split", "all_to_all_single with a negative split size",
         _run(lambda: dist.all_to_all_single(torch.zeros(4), torch.ones(4), [-1, 5], [2, 2])), error=E, match=r"non-negative row counts"),
    Case("all-to-all-short-list", "all_to_all with one input tensor in a world of 2",
         _run(lambda: dist.all_to_all([torch.zeros(2)], [torch.ones(2)])), error=E, match=r"alltoall: input tensor list size 1 does not match world size 2"),
    Case("gather-short-list-on-root", "gather with a gather_list of 1 tensor on the root",
         _run(_gather_list(lambda: [torch.zeros(2)])), error=E, match=r"gather: invalid output list size 1 \(rank 0"),
    Case("gather-wrong-size-on-root", "gather into tensors of another size than the input",
         _run(_gather_list(lambda: [torch.zeros(3), torch.zeros(3)])), error=E, match=r"output\[0\] is \(3,\)"),
    Case("scatter-short-list-on-root", "scatter from a scatter_list of 1 tensor",
         _run(_scatter_list(lambda: [torch.zeros(2)])), error=E, match=r"scatter: invalid input list size 1 \(rank 0"),
    Case("scatter-wrong-size-on-root", "scatter from tensors of another size than the output",
         _run(_scatter_list(lambda: [torch.zeros(3), torch.zeros(3)])), error=E, match=r"input\[0\] is \(3,\)"),
    Case("all-reduce-coalesced-empty", "all_reduce_coalesced of an empty list",
         _run(lambda: dist.all_reduce_coalesced([])), error=E, match=r"empty list of tensors.*at least one tensor"),
    Case("expanded-view-all-reduce", "all_reduce of torch.ones(1).expand(4), a view that owns 1 element",
         _run(_all_reduce(lambda r: torch.ones(1).expand(4))), error=E, match=r"does not own 4 elements of memory.*contiguous"),
    Case("csr-all-reduce", "all_reduce of a sparse CSR tensor",
         _run(_all_reduce(lambda r: torch.eye(2).to_sparse_csr())), error=E, match=r"layout torch.sparse_csr"),
    Case("sparse-broadcast", "broadcast of a sparse COO tensor (gloo: no sparse kernel)",
         _run(lambda: dist.broadcast(torch.eye(2).to_sparse(), 0)), error=E, match=r"broadcast tensor: only dense.*sparse_coo"),
    Case("sparse-all-reduce-max", "all_reduce(ReduceOp.MAX) of a sparse COO tensor",
         _run(_all_reduce(lambda r: torch.eye(2).to_sparse(), R.MAX)), error=E, match=r"allreduce of sparse tensors only works with ReduceOp.SUM.*MAX"),
    Case("sparse-all-reduce-sum", "all_reduce (SUM) of uncoalesced sparse COO tensors with different nonzeros per rank",
         _run(_sparse_sum, 3), check=_check_sparse),
    Case("float-sum-in-gloos-order", "all_reduce of float32 1, 1e8, -1e8, 1 on 4 ranks, whose sum depends on the "
         "order: gloo's ring gives 1 + (1e8 + (-1e8 + 1)) = 1",
         _run(_all_reduce(_each([1.0, 1e8, -1e8, 1.0])), 4, backend_name="gloo"), check=_gloo_gives(1.0)),
    Case("min-drops-nan-as-gloo", "all_reduce(ReduceOp.MIN) of 1, 2, NaN on 3 ranks: gloo's std::min(2, NaN) keeps "
         "2, so min(1, 2) = 1, not NaN",
         _run(_all_reduce(_each([1.0, 2.0, float("nan")]), R.MIN), 3, backend_name="gloo"), check=_gloo_gives(1.0)),
    Case("max-drops-nan-as-gloo", "all_reduce(ReduceOp.MAX) of -0.0, 1, NaN on 3 ranks: gloo's std::max(1, NaN) "
         "keeps 1, so max(-0.0, 1) = 1, not NaN",
         _run(_all_reduce(_each([-0.0, 1.0, float("nan")]), R.MAX), 3, backend_name="gloo"), check=_gloo_gives(1.0)),
    Case("min-signed-zero-as-gloo", "all_reduce(ReduceOp.MIN) of 1, -0.0, 0.0 on 3 ranks: std::min keeps its first "
         "operand on a tie, min(1, min(-0.0, 0.0)) = -0.0",
         _run(_all_reduce(_each([1.0, -0.0, 0.0]), R.MIN), 3, backend_name="gloo"), check=_gloo_gives(-0.0)),
    Case("zero-element-all-reduce", "all_reduce of an empty tensor",
         _run(_all_reduce(lambda r: torch.ones(0))), check=lambda res: [torch.testing.assert_close(t, torch.ones(0)) for t in res.returns]),
    Case("monitored-barrier-passes", "monitored_barrier on every rank",
         _run(_monitored(None), 3), check=_check_barrier_passes),
    Case("monitored-barrier-names-missing-rank", "monitored_barrier where rank 2 never arrives",
         _run(_monitored(2), 3), error=simdist.SimTimeoutError, match=r"\[Rank 0\]: Rank 2 failed to pass monitoredBarrier in 2000 ms"),
    Case("monitored-barrier-wait-all-lists-ranks", "monitored_barrier(wait_all_ranks=True) where ranks 1 and 3 never arrive",
         _run(lambda: None if dist.get_rank() in (1, 3) else dist.monitored_barrier(timeout=datetime.timedelta(seconds=1), wait_all_ranks=True), 4),
         error=simdist.SimTimeoutError, match=r"\[Rank 0\]: Ranks 1, 3 failed to pass monitoredBarrier in 1000 ms"),
    Case("backend-name-gloo", "code that reads dist.get_backend() in a run presenting gloo",
         _run(_names, backend_name="gloo"), check=_expect_names("gloo", "cpu:gloo,cuda:gloo", "gloo", "gloo")),
    Case("backend-name-nccl", "code that reads dist.get_backend() in a run presenting nccl (and makes a gloo group)",
         _run(_names, backend_name="nccl"), check=_expect_names("nccl", "cuda:nccl", "nccl", "gloo")),
    Case("backend-name-gloo-ddp", "torch's DDP in a run presenting gloo (its C++ logger reads the group as ProcessGroupGloo)",
         _run(_ddp_step, backend_name="gloo"), check=_expect_same_gradients),
    Case("backend-name-unknown", "simdist.run(..., backend_name='mpi')",
         _run(_names, backend_name="mpi"), error=simdist.RunArgumentError, match=r"backend_name must be one of \('simdist', 'gloo', 'nccl'\).*'mpi'"),
]


@pytest.mark.parametrize("case", params(CASES))
def test_hostile(case: Case) -> None:
    check(case)


def _monitored_follower_raises() -> str:
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=1)) if dist.get_rank() != 2 else None
    except simdist.SimTimeoutError as e:
        return str(e)
    return "passed"


def test_monitored_barrier_failure_reaches_waiting_ranks():
    """Rank 0 catches its own failure; rank 1, waiting for rank 0's reply, raises with rank 0's finding."""
    res = simdist.run(_monitored_follower_raises, simdist.Cluster.switch(3, device="cpu"))
    assert res.returns[0].startswith("[Rank 0]: Rank 2 failed to pass monitoredBarrier in 1000 ms")
    assert res.returns[1].startswith("Rank 1 successfully reached monitoredBarrier, but received errors")
    assert "Rank 0 reported: [Rank 0]: Rank 2 failed" in res.returns[1]
    assert res.returns[2] == "passed"
    assert res.finish_times[0] == pytest.approx(1.0, rel=1e-3)  # the timeout elapsed in simulated time
