"""torch's functional collectives, ``wait_tensor`` and ``_coalescing_manager`` under both progress modes.

Every result is compared with what the collective means, computed from every rank's input in the test
(the inputs are a function of the rank), at 2 and 4 ranks.
"""

from __future__ import annotations

import time
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.testing import assert_close

import simdist
from simdist.errors import CollectiveMismatchError, DeadlockError, RaceError, SimTimeoutError

PROGRESS = ("nccl", "gloo")
SIZES = (2, 4)

pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated:FutureWarning")


def cluster(n: int) -> simdist.Cluster:
    return simdist.Cluster.switch(n, bandwidth="100GB/s", latency="2us", device="cpu")


def x_of(rank: int, k: int = 6, salt: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input: distinct small values per rank and salt (exact in float32)."""
    return torch.arange(k, dtype=torch.float32) * (rank + 1) + 100 * salt + rank


def run(fn, n: int, progress: str, **kw) -> simdist.RunResult:
    return simdist.run(fn, cluster(n), progress=progress, races="error", **kw)


# ---------------------------------------------------------------------------------------------- the ops
def _every_op() -> dict[str, torch.Tensor]:
    r, n, g = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    x = x_of(r, 2 * n)
    out = {
        "all_reduce": funcol.all_reduce(x, "sum", g),
        "all_reduce_max": funcol.all_reduce(x, "max", g),
        "broadcast": funcol.broadcast(x, 1, g),
        "all_gather_tensor": funcol.all_gather_tensor(x, 0, g),
        "all_gather_tensor_dim1": funcol.all_gather_tensor(x.view(2, n), 1, g),
        "reduce_scatter_tensor": funcol.reduce_scatter_tensor(x, "sum", 0, g),
        "reduce_scatter_tensor_avg": funcol.reduce_scatter_tensor(x, "avg", 0, g),
        "all_to_all_single": funcol.all_to_all_single(x, None, None, g),
    }
    out["all_reduce_coalesced"] = torch.cat(funcol.all_reduce_coalesced([x, 2 * x], "sum", g))
    out["all_gather_coalesced"] = torch.cat(funcol.all_gather_into_tensor_coalesced([x, x[:2] + 1], g))
    out["reduce_scatter_coalesced"] = torch.cat(funcol.reduce_scatter_tensor_coalesced([x, 3 * x], "sum", [0, 0], g))
    y = x.clone()
    funcol.all_reduce_inplace(y, "sum", g)
    out["all_reduce_inplace"] = y
    gathered = torch.empty(2 * n * n)
    funcol.all_gather_tensor_inplace(gathered, x, g)
    out["all_gather_tensor_inplace"] = gathered
    scattered = torch.empty(2)
    funcol.reduce_scatter_tensor_inplace(scattered, x, "sum", g)
    out["reduce_scatter_tensor_inplace"] = scattered
    exchanged = torch.empty(2 * n)
    funcol.all_to_all_inplace(exchanged, x, group=g)
    out["all_to_all_inplace"] = exchanged
    pieces = [torch.empty(2 * n) for _ in range(n)]
    funcol.all_gather_inplace(pieces, x, g)
    out["all_gather_inplace"] = torch.cat(pieces)
    buf = torch.empty(2 * n * n)
    torch.ops._c10d_functional.all_gather_into_tensor_out(x, n, g.group_name, out=buf)
    out["all_gather_into_tensor_out"] = torch.ops._c10d_functional.wait_tensor(buf)
    return {k: (v.wait() if isinstance(v, funcol.AsyncCollectiveTensor) else v).clone() for k, v in out.items()}


def _expected(n: int) -> list[dict[str, torch.Tensor]]:
    xs = [x_of(r, 2 * n) for r in range(n)]
    total = sum(xs)
    want = []
    for r in range(n):
        chunk = slice(2 * r, 2 * r + 2)
        w = {
            "all_reduce": total,
            "all_reduce_max": torch.stack(xs).max(0).values,
            "broadcast": xs[1],
            "all_gather_tensor": torch.cat(xs),
            "all_gather_tensor_dim1": torch.cat([x.view(2, n) for x in xs], dim=1),
            "reduce_scatter_tensor": total[chunk],
            "reduce_scatter_tensor_avg": total[chunk] / n,
            "all_to_all_single": torch.cat([x[chunk] for x in xs]),
            "all_reduce_coalesced": torch.cat([total, 2 * total]),
            "all_gather_coalesced": torch.cat([torch.cat(xs), torch.cat([x[:2] + 1 for x in xs])]),
            "reduce_scatter_coalesced": torch.cat([total[chunk], 3 * total[chunk]]),
            "all_reduce_inplace": total,
            "all_gather_tensor_inplace": torch.cat(xs),
            "reduce_scatter_tensor_inplace": total[chunk],
            "all_to_all_inplace": torch.cat([x[chunk] for x in xs]),
            "all_gather_inplace": torch.cat(xs),
            "all_gather_into_tensor_out": torch.cat(xs),
        }
        want.append(w)
    return want


@pytest.mark.parametrize("progress", PROGRESS)
@pytest.mark.parametrize("n", SIZES)
def test_every_functional_collective_gives_its_meaning(n, progress):
    res = run(_every_op, n, progress)
    for r, (got, want) in enumerate(zip(res.returns, _expected(n))):
        assert got.keys() == want.keys()
        for k in want:
            assert_close(got[k], want[k], msg=lambda m, k=k, r=r: f"{k} on rank {r}: {m}")


def _autograd_ops() -> list[torch.Tensor]:
    r, n, g = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    a = x_of(r, 2 * n).requires_grad_()
    b = x_of(r, 2 * n, 1).requires_grad_()
    c = x_of(r, 2 * n, 2).requires_grad_()
    w = torch.arange(2 * n * n, dtype=torch.float32)
    loss = (funcol.all_gather_tensor_autograd(a, 0, g) * w).sum()
    loss = loss + (funcol.reduce_scatter_tensor_autograd(b, "sum", 0, g) * w[:2]).sum()
    loss = loss + (funcol.all_to_all_single_autograd(c, None, None, g) * w[: 2 * n]).sum()
    loss.backward()
    return [a.grad, b.grad, c.grad]


@pytest.mark.parametrize("progress", PROGRESS)
@pytest.mark.parametrize("n", SIZES)
def test_autograd_variants_send_gradients_back_across_ranks(n, progress):
    res = run(_autograd_ops, n, progress)
    w = torch.arange(2 * n * n, dtype=torch.float32)
    for r, (ga, gb, gc) in enumerate(res.returns):
        # all_gather's backward reduce-scatters: every rank weighted rank r's chunk by w's chunk r
        assert_close(ga, n * w[2 * n * r : 2 * n * (r + 1)])
        # reduce_scatter's backward all-gathers: chunk j of b feeds rank j's output, weighted by w[:2]
        assert_close(gb, w[:2].repeat(n))
        # all_to_all's backward is the reverse all-to-all: rank r's block j went to rank j's block r
        assert_close(gc, w[2 * r : 2 * r + 2].repeat(n))


# ---------------------------------------------------------------------------------------- coalescing
def _coalescing_manager(async_ops: bool, device: str | None) -> list[torch.Tensor]:
    r, n = dist.get_rank(), dist.get_world_size()
    ga, gb = torch.empty(4 * n), torch.empty(2 * n)
    ra, rb = torch.empty(4), torch.empty(2)
    with dist._coalescing_manager(device=device and torch.device(device), async_ops=async_ops) as cm:
        dist.all_gather_into_tensor(ga, x_of(r, 4))
        dist.all_gather_into_tensor(gb, x_of(r, 2, 1))
    if async_ops:
        cm.wait()
    with dist._coalescing_manager(device=device and torch.device(device), async_ops=async_ops) as cm:
        dist.reduce_scatter_tensor(ra, x_of(r, 4 * n))
        dist.reduce_scatter_tensor(rb, x_of(r, 2 * n, 1))
    if async_ops:
        cm.wait()
    return [ga, gb, ra, rb]


@pytest.mark.parametrize(("async_ops", "device"), [(False, None), (True, None), (True, "cpu")])
@pytest.mark.parametrize("progress", PROGRESS)
@pytest.mark.parametrize("n", SIZES)
def test_coalescing_manager_all_gather_and_reduce_scatter(n, progress, async_ops, device):
    res = run(_coalescing_manager, n, progress, args=(async_ops, device))
    ra_total = sum(x_of(r, 4 * n) for r in range(n))
    rb_total = sum(x_of(r, 2 * n, 1) for r in range(n))
    for r, (ga, gb, ra, rb) in enumerate(res.returns):
        assert_close(ga, torch.cat([x_of(q, 4) for q in range(n)]))
        assert_close(gb, torch.cat([x_of(q, 2, 1) for q in range(n)]))
        assert_close(ra, ra_total[4 * r : 4 * r + 4])
        assert_close(rb, rb_total[2 * r : 2 * r + 2])
    # one collective per coalesced block, not one per tensor
    names = [s.args["Collective name"] for s in res.trace.collectives(rank=0)]
    assert names == ["all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced"]


def _one_tensor_coalesced_against_plain() -> None:
    x = torch.ones(3)
    out = torch.empty(3 * dist.get_world_size())
    if dist.get_rank() == 0:
        funcol.all_gather_tensor(x, 0, dist.group.WORLD).wait()  # a one-tensor coalesced call in torch's C++
    else:
        dist.all_gather_into_tensor(out, x)


def _one_tensor_coalesced_mismatch() -> None:
    x = torch.ones(3 if dist.get_rank() == 0 else 2)
    funcol.all_gather_tensor(x, 0, dist.group.WORLD).wait()


@pytest.mark.parametrize("progress", PROGRESS)
def test_one_tensor_coalesced_call_matches_the_plain_op_and_names_the_users_line(progress):
    run(_one_tensor_coalesced_against_plain, 2, progress)
    with pytest.raises(CollectiveMismatchError) as e:
        run(_one_tensor_coalesced_mismatch, 2, progress)
    text = str(e.value)
    assert "all_gather_into_tensor(shape=(3,)" in text and "all_gather_into_tensor(shape=(2,)" in text
    assert "test_funcol.py" in text and "_functional_collectives.py" not in text


def _funcol_on_one_rank_only() -> None:
    if dist.get_rank() == 0:
        funcol.reduce_scatter_tensor(torch.ones(4), "sum", 0, dist.group.WORLD).wait()


@pytest.mark.parametrize("progress", PROGRESS)
def test_deadlock_in_a_functional_collective_names_the_users_line(progress):
    with pytest.raises(DeadlockError) as e:
        run(_funcol_on_one_rank_only, 2, progress)
    text = str(e.value)
    assert "reduce_scatter_tensor" in text and "test_funcol.py" in text


def _funcol_timeout() -> None:
    pg = dist.new_group([0, 1], timeout=timedelta(seconds=1))
    if dist.get_rank() == 0:
        funcol.all_gather_tensor(torch.ones(4), 0, pg).wait()
    else:
        time.sleep(5)  # simulated seconds: rank 0 times out first


def test_timeout_in_a_functional_collective_names_the_users_line():
    with pytest.raises(simdist.RankError) as e:
        run(_funcol_timeout, 2, "nccl")
    assert isinstance(e.value.__cause__, SimTimeoutError)
    assert "test_funcol.py" in str(e.value.__cause__) and "all_gather_into_tensor" in str(e.value.__cause__)


# ------------------------------------------------------------------------------------------ wait_tensor
def _async_then_wait_tensor(read_first: bool) -> list[float]:
    t = torch.ones(3) * (dist.get_rank() + 1)
    dist.all_reduce(t, async_op=True)
    if read_first:
        t.sum()
    torch.ops._c10d_functional.wait_tensor(t)
    return t.tolist()


@pytest.mark.parametrize("progress", PROGRESS)
@pytest.mark.parametrize("n", SIZES)
def test_wait_tensor_waits_for_an_async_dist_collective(n, progress):
    res = run(_async_then_wait_tensor, n, progress, args=(False,))
    assert res.returns == [[n * (n + 1) / 2] * 3] * n


@pytest.mark.parametrize("progress", PROGRESS)
def test_reading_before_wait_tensor_is_a_race(progress):
    with pytest.raises(RaceError) as e:
        run(_async_then_wait_tensor, 2, progress, args=(True,))
    assert "all_reduce" in str(e.value) and "test_funcol.py" in str(e.value)


def _read_funcol_output_before_wait() -> None:
    out = torch.ops._c10d_functional.all_reduce(torch.ones(4), "sum", dist.group.WORLD.group_name)
    out.sum()
    torch.ops._c10d_functional.wait_tensor(out)


def test_reading_a_raw_functional_output_before_wait_tensor_is_a_race():
    with pytest.raises(RaceError) as e:
        run(_read_funcol_output_before_wait, 2, "gloo")
    assert "test_funcol.py" in str(e.value)


def _waited_then_read() -> tuple[float, int, int]:
    out = torch.ops._c10d_functional.all_reduce(torch.ones(4), "sum", dist.group.WORLD.group_name)
    registered = torch._C._distributed_c10d._get_work_registry_size()
    torch.ops._c10d_functional.wait_tensor(out)
    return out.sum().item(), registered, torch._C._distributed_c10d._get_work_registry_size()


def test_wait_tensor_still_empties_torchs_work_registry():
    res = run(_waited_then_read, 2, "nccl")
    assert res.returns == [(8.0, 1, 0)] * 2


def test_kernels_are_installed_only_during_a_run():
    before = torch._C._dispatch_dump_table("_c10d_functional::wait_tensor")
    run(_waited_then_read, 2, "nccl")
    assert torch._C._dispatch_dump_table("_c10d_functional::wait_tensor") == before
    assert "CPU: registered at" in before and "Functional.cpp" in before.split("CPU:")[1].splitlines()[0]


# ---------------------------------------------------------------------------------------- determinism
def _train_some_steps() -> float:
    r, g = dist.get_rank(), dist.group.WORLD
    x = x_of(r, 8)
    for _ in range(3):
        x = funcol.all_gather_tensor(x, 0, g)
        x = funcol.reduce_scatter_tensor(x * 0.5, "sum", 0, g)
    return x.sum().item()


@pytest.mark.parametrize("progress", PROGRESS)
def test_runs_repeat_exactly(progress):
    a, b = run(_train_some_steps, 4, progress), run(_train_some_steps, 4, progress)
    assert a.returns == b.returns and a.sim_time == b.sim_time and a.trace_hash == b.trace_hash
    assert a.sim_time > 0


def test_private_torch_internals_the_kernels_use():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert callable(torch.ops._c10d_functional.all_gather_into_tensor_out.default)
    table = torch._C._dispatch_dump_table("_c10d_functional::wait_tensor")
    assert "PrivateUse3: registered at" in table and "Functional.cpp" in table.split("PrivateUse3:")[1].splitlines()[0]
