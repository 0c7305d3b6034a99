"""Symmetric runs (``simdist.run(..., symmetric=True)``) against the full run of the same program.

The oracle for times is the full run, every rank's collective simulated message by message; for data it is
NumPy, applying the documented rule (a rank not simulated holds what the first simulated member holds).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given, settings
from hypothesis import strategies as st

import simdist
from simdist.comm.symmetry import sampled_ranks

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))  # a folder of scripts
from fsdp_tp_step import fsdp2_over_tp

#: every test here but the one that expects it fails if a run warns that its collectives overlapped
pytestmark = pytest.mark.filterwarnings("error::simdist.SymmetryWarning")


def mlp_step(width: int = 16, layers: int = 2, buckets: int = 2) -> tuple[int, int]:
    """A data-parallel step: forward and backward, then the flat gradients all-reduced in async buckets."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    torch.manual_seed(dist.get_rank())
    model(torch.randn(4, width)).square().mean().backward()
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    works = [dist.all_reduce(chunk, async_op=True) for chunk in flat.chunk(buckets)]
    for w in works:
        w.wait()
    return dist.get_rank(), dist.get_world_size()


def timelines(result: simdist.RunResult, rank: int) -> list[tuple[str, str, float, float]]:
    """``rank``'s spans in the order recorded: (stream, name, start, end)."""
    return [(s.stream, s.name, s.start, s.end) for s in result.trace.spans if s.rank == rank]


def assert_same_times(a: float, b: float) -> None:
    """Equal up to the rounding of the closed form against the sum of per-message times."""
    assert math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15), (a, b)


def assert_same_rank(full: simdist.RunResult, reduced: simdist.RunResult, rank: int) -> None:
    """``rank``'s spans in ``reduced`` are its spans in ``full``, in order, at the same times."""
    want, got = timelines(full, rank), timelines(reduced, rank)
    assert [w[:2] for w in want] == [g[:2] for g in got], rank
    for w, g in zip(want, got):
        assert_same_times(w[2], g[2])
        assert_same_times(w[3], g[3])


def assert_same_timelines(full: simdist.RunResult, reduced: simdist.RunResult) -> None:
    """Every simulated rank's spans equal the full run's; every rank's finish time equals the full run's."""
    assert reduced.simulated_ranks is not None
    for r in reduced.simulated_ranks:
        assert_same_rank(full, reduced, r)
    assert_same_times(full.sim_time, reduced.sim_time)
    for f, g in zip(full.finish_times, reduced.finish_times, strict=True):
        assert_same_times(f, g)


@settings(max_examples=4, deadline=None)
@given(
    n=st.integers(2, 9),
    width=st.sampled_from([8, 12, 16]),
    layers=st.integers(1, 3),
    topology=st.sampled_from(["switch", "ring"]),
)
def test_a_ring_step_times_as_the_full_run_on_every_rank(
    n: int, width: int, layers: int, topology: str
) -> None:
    # the buckets' sizes are multiples of n, so every chunk of the ring is the same size as the closed form assumes
    width = width * n
    build = simdist.Cluster.switch if topology == "switch" else simdist.Cluster.ring
    cluster = build(n, algorithms={"all_reduce": "ring"})
    full = simdist.run(mlp_step, cluster, kwargs={"width": width, "layers": layers}, races="off")
    reduced = simdist.run(
        mlp_step, cluster, kwargs={"width": width, "layers": layers}, races="off", symmetric=True
    )
    assert reduced.simulated_ranks == list(sampled_ranks(n, None))
    assert_same_timelines(full, reduced)


def rooted_step(kind: str, root: int, n_elems: int) -> float:
    """A scatter from, or a gather to, ``root`` of ``n_elems`` float32 per rank; every rank makes the lists, so
    that the ranks run alike."""
    n = dist.get_world_size()
    chunks = list(torch.ones(n * n_elems).chunk(n))
    mine = dist.get_rank() == root
    if kind == "scatter":
        dist.scatter(torch.empty(n_elems), chunks if mine else None, src=root)
    else:
        dist.gather(torch.ones(n_elems), chunks if mine else None, dst=root)
    return simdist.now()


@pytest.mark.parametrize("kind", ["scatter", "gather"])
@pytest.mark.parametrize(("preset", "n"), [("switch", 6), ("switch", 9), ("dgx-h100", 8)])
def test_a_scatter_or_gather_takes_the_full_runs_time(kind: str, preset: str, n: int) -> None:
    # the root sends or receives every chunk: timed for its whole buffer of n chunks, as the full run's messages
    cluster = simdist.Cluster.preset(preset, world_size=n)
    for root, n_elems in ((0, 1), (n - 1, 1000), (0, 64_000)):
        full = simdist.run(rooted_step, cluster, args=(kind, root, n_elems), races="off")
        reduced = simdist.run(rooted_step, cluster, args=(kind, root, n_elems), races="off", symmetric=True)
        assert_same_times(full.sim_time, reduced.sim_time)


def coalesced_reduce_scatter(n_elems: int) -> float:
    """Two tensors reduce-scattered in one call, as DTensor and FSDP2 issue them through funcol."""
    import torch.distributed._functional_collectives as funcol

    n = dist.get_world_size()
    pieces = [torch.ones(n * n_elems), torch.ones(n * 2 * n_elems)]
    for piece in funcol.reduce_scatter_single_coalesced(pieces, "sum", [0, 0], dist.group.WORLD):
        if isinstance(piece, funcol.AsyncCollectiveTensor):
            piece.wait()
    return simdist.now()


@pytest.mark.parametrize(("preset", "n"), [("switch", 8), ("ring", 12), ("dgx-h100", 16)])
def test_a_coalesced_reduce_scatter_takes_the_full_runs_time(preset: str, n: int) -> None:
    cluster = simdist.Cluster.preset(preset, world_size=n)
    for n_elems in (1, 1000, 64_000):
        full = simdist.run(coalesced_reduce_scatter, cluster, args=(n_elems,), races="off")
        reduced = simdist.run(coalesced_reduce_scatter, cluster, args=(n_elems,), races="off", symmetric=True)
        assert "nccl:reduce_scatter_tensor_coalesced" in [s.name for s in reduced.trace.collectives(0)]
        assert_same_times(full.sim_time, reduced.sim_time)


def test_rank_code_sees_the_whole_world_and_unsimulated_ranks_return_a_marker() -> None:
    reduced = simdist.run(mlp_step, simdist.Cluster.switch(10), races="off", symmetric=True)
    assert reduced.simulated_ranks == [0, 1, 5, 9]
    for r in range(10):
        got = reduced.returns[r]
        if r in reduced.simulated_ranks:
            assert got == (r, 10)
        else:
            assert isinstance(got, simdist.NotSimulated) and got.rank == r and got.representative == 0
            assert "not simulated" in repr(got)
    assert reduced.world_size == 10


def gpu_step(width: int = 512) -> None:
    """A data-parallel step written as GPU code: big enough gradients that NCCL's tuner picks its ring."""
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, width)).to(dev)
    model(torch.randn(8, width, device=dev)).square().mean().backward()
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    dist.all_reduce(flat)
    torch.cuda.synchronize()


def test_an_nccl_timed_step_on_gpus_times_as_the_full_run() -> None:
    cluster = simdist.Cluster.preset("dgx-h100", world_size=16)
    full = simdist.run(gpu_step, cluster, races="off")
    reduced = simdist.run(gpu_step, cluster, races="off", symmetric=True)
    assert reduced.simulated_ranks == [0, 1, 7, 8, 15]
    assert [s.args["nccl"] for s in reduced.trace.collectives(0)] == [
        s.args["nccl"] for s in full.trace.collectives(0)
    ]
    assert_same_timelines(full, reduced)


def test_a_timing_only_step_times_as_the_full_timing_only_run() -> None:
    """tensors="fake" and symmetric=True together (a model too big for the machine, on many ranks): the same
    timelines and peak memory as the full timing-only run."""
    cluster = simdist.Cluster.preset("dgx-h100", world_size=16)
    full = simdist.run(gpu_step, cluster, tensors="fake", memory=True)
    reduced = simdist.run(gpu_step, cluster, tensors="fake", memory=True, symmetric=True)
    assert_same_timelines(full, reduced)
    assert [m.peak_bytes for m in reduced.memory] == [m.peak_bytes for m in full.memory]


def test_fsdp2_over_tensor_parallelism_times_as_the_full_run() -> None:
    # two nodes of four GPUs: tensor-parallel groups inside a node, FSDP's groups across the nodes
    cluster = simdist.Cluster.preset("dgx-h100", world_size=8, gpus_per_node=4)
    # made on the meta device and materialised on the GPUs, tensor-parallel groups of 4, one step
    full = simdist.run(fsdp2_over_tp, cluster, args=(64, 4, 1, True), tensors="fake")
    reduced = simdist.run(fsdp2_over_tp, cluster, args=(64, 4, 1, True), tensors="fake", symmetric=True)
    assert len(reduced.simulated_ranks) < 8
    # the broadcast at its start ends on each rank at its own time in the full run, on all at the last one's here
    # (docs/symmetry.md, condition 3): the step and the last rank agree
    assert_same_times(full.sim_time, reduced.sim_time)
    assert_same_rank(full, reduced, 7)


def ddp_step() -> None:
    """torch's own DDP: its constructor's broadcast and shape check, then a step's bucketed all-reduces."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)))
    torch.manual_seed(dist.get_rank())
    model(torch.randn(4, 32)).square().mean().backward()


def test_torchs_ddp_step_takes_the_full_runs_time() -> None:
    # the broadcast from rank 0 reaches the ranks down its chain at different times in the full run; a symmetric run
    # ends it everywhere when its last rank is done, so the step (and the last rank's timeline) agree, not the rest
    cluster = simdist.Cluster.switch(6, algorithms={"all_reduce": "ring", "broadcast": "ring"})
    full = simdist.run(ddp_step, cluster, races="off")
    reduced = simdist.run(ddp_step, cluster, races="off", symmetric=True)
    assert_same_times(full.sim_time, reduced.sim_time)
    assert_same_rank(full, reduced, 5)


# ----------------------------------------------------------------------------- data


def collectives(n_elems: int) -> dict[str, list[torch.Tensor]]:
    """Each collective's result on the calling rank, from inputs that depend on the rank."""
    rank, n = dist.get_rank(), dist.get_world_size()
    x = torch.arange(n_elems, dtype=torch.float64) + 10 * rank + 1
    out: dict[str, list[torch.Tensor]] = {}
    for op in ("SUM", "AVG", "MAX", "MIN", "PRODUCT"):
        t = x.clone() if op != "PRODUCT" else torch.full((n_elems,), float(rank % 3 + 1), dtype=torch.float64)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        out[f"all_reduce_{op}"] = [t]
    b = x.clone()
    dist.broadcast(b, src=n - 1)
    out["broadcast"] = [b]
    gathered = [torch.empty(n_elems, dtype=torch.float64) for _ in range(n)]
    dist.all_gather(gathered, x)
    out["all_gather"] = gathered
    flat = torch.empty(n * n_elems, dtype=torch.float64)
    dist.all_gather_single(flat, x)
    out["all_gather_into_tensor"] = [flat]
    big = torch.arange(n * n_elems, dtype=torch.float64) + rank
    piece = torch.empty(n_elems, dtype=torch.float64)
    dist.reduce_scatter_single(piece, big)
    out["reduce_scatter_tensor"] = [piece]
    pieces = torch.empty(n_elems, dtype=torch.float64)
    dist.reduce_scatter(pieces, list(big.chunk(n)))
    out["reduce_scatter"] = [pieces]
    r = x.clone()
    dist.reduce(r, dst=0)
    out["reduce"] = [r]
    import torch.distributed._functional_collectives as funcol

    # two tensors at once: one coalesced reduce-scatter (funcol's, as DTensor and FSDP2 issue them)
    halves = funcol.reduce_scatter_single_coalesced([big, big * 2], "sum", [0, 0], dist.group.WORLD)
    out["reduce_scatter_tensor_coalesced"] = [
        h.wait() if isinstance(h, funcol.AsyncCollectiveTensor) else h for h in halves
    ]
    for root in (n - 1, 2 % n):  # the last rank is always simulated; rank 2 of more than 5 is not
        landed = [torch.empty(n_elems, dtype=torch.float64) for _ in range(n)] if rank == root else None
        dist.gather(x, landed, dst=root)
        out[f"gather_{root}"] = landed or []
        piece = torch.full((n_elems,), -1.0, dtype=torch.float64)
        dist.scatter(piece, list(big.chunk(n)) if rank == root else None, src=root)
        out[f"scatter_{root}"] = [piece]
    dist.barrier()
    return out


def expected(rank: int, n: int, n_elems: int, simulated: list[int]) -> dict[str, list[np.ndarray]]:
    """NumPy's results for ``rank`` where every rank not in ``simulated`` holds what ``simulated[0]`` holds."""
    holder = [r if r in simulated else simulated[0] for r in range(n)]
    xs = [np.arange(n_elems, dtype=np.float64) + 10 * holder[r] + 1 for r in range(n)]
    ps = [np.full(n_elems, float(holder[r] % 3 + 1)) for r in range(n)]
    bigs = [np.arange(n * n_elems, dtype=np.float64) + holder[r] for r in range(n)]
    total = np.sum(bigs, axis=0)
    mine = slice(rank * n_elems, (rank + 1) * n_elems)
    rooted = {}
    for root in (n - 1, 2 % n):
        rooted[f"gather_{root}"] = xs if rank == root else []
        # only the root holds the chunks: from a root not simulated, the output keeps what it held
        rooted[f"scatter_{root}"] = [bigs[root][mine] if root in simulated else np.full(n_elems, -1.0)]
    return {
        **rooted,
        "reduce_scatter_tensor_coalesced": [total[mine], 2 * total[mine]],
        "all_reduce_SUM": [np.sum(xs, axis=0)],
        "all_reduce_AVG": [np.sum(xs, axis=0) / n],
        "all_reduce_MAX": [np.max(xs, axis=0)],
        "all_reduce_MIN": [np.min(xs, axis=0)],
        "all_reduce_PRODUCT": [np.prod(ps, axis=0)],
        "broadcast": [xs[n - 1]],
        "all_gather": xs,
        "all_gather_into_tensor": [np.concatenate(xs)],
        "reduce_scatter_tensor": [total[rank * n_elems : (rank + 1) * n_elems]],
        "reduce_scatter": [total[rank * n_elems : (rank + 1) * n_elems]],
        "reduce": [np.sum(xs, axis=0) if rank == 0 else xs[rank]],
    }


@settings(max_examples=3, deadline=None)
@given(n=st.integers(2, 11), n_elems=st.integers(1, 6))
# ranks 0, 1, 5 and 10 simulated: a scatter from rank 2 comes from a rank that is not
@example(n=11, n_elems=3)
def test_collectives_carry_the_data_of_a_world_of_copies_of_the_first_simulated_rank(
    n: int, n_elems: int
) -> None:
    result = simdist.run(collectives, simdist.Cluster.switch(n), args=(n_elems,), races="off", symmetric=True)
    simulated = result.simulated_ranks
    for r in simulated:
        want = expected(r, n, n_elems, simulated)
        got = result.returns[r]
        assert set(got) == set(want)
        for name in want:
            for g, w in zip(got[name], want[name], strict=True):
                np.testing.assert_allclose(g.numpy(), w, rtol=1e-12, err_msg=f"{name} on rank {r}")


def test_replicated_data_gives_the_full_runs_results_exactly() -> None:
    def step() -> torch.Tensor:
        t = torch.arange(12, dtype=torch.float32) * 3 + 1  # the same on every rank, integers: sums are exact
        dist.all_reduce(t)
        return t

    cluster = simdist.Cluster.switch(7, algorithms={"all_reduce": "ring"})
    full = simdist.run(step, cluster, races="off")
    reduced = simdist.run(step, cluster, races="off", symmetric=True)
    for r in reduced.simulated_ranks:
        assert torch.equal(reduced.returns[r], full.returns[r])


def test_subgroups_of_one_shape_run_alike_and_carry_their_first_simulated_members_data() -> None:
    def step() -> float:
        r, n = dist.get_rank(), dist.get_world_size()
        groups = [
            dist.new_group(list(range(i, i + 4))) for i in range(0, n, 4)
        ]  # every rank makes every group
        t = torch.full((8,), float(r + 1))
        dist.all_reduce(t, group=groups[r // 4])
        return t[0].item()

    cluster = simdist.Cluster.switch(16, algorithms={"all_reduce": "ring"})
    full = simdist.run(step, cluster, races="off")
    reduced = simdist.run(step, cluster, races="off", symmetric=True)
    assert_same_times(full.sim_time, reduced.sim_time)
    for r in reduced.simulated_ranks:
        assert_same_rank(full, reduced, r)
        group = range(r // 4 * 4, r // 4 * 4 + 4)
        holder = [
            g if g in reduced.simulated_ranks else min(set(group) & set(reduced.simulated_ranks))
            for g in group
        ]
        assert reduced.returns[r] == sum(h + 1 for h in holder)


SCRIPT = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Linear(32, 32)
model(torch.randn(4, 32)).sum().backward()
dist.all_reduce(model.weight.grad)
"""


def test_a_script_that_initialises_its_own_group_runs_symmetric_from_the_command_line(
    tmp_path, capsys
) -> None:
    from simdist.cli import main

    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    cluster = simdist.Cluster.switch(8, algorithms={"all_reduce": "ring"})
    full = simdist.run_script(str(script), cluster, races="off")
    reduced = simdist.run_script(str(script), cluster, races="off", symmetric=True)
    assert reduced.simulated_ranks == [0, 1, 4, 7]
    assert_same_timelines(full, reduced)
    assert main(["run", str(script), "--cluster", "switch", "--world-size", "8", "--symmetric"]) == 0
    out = capsys.readouterr()
    assert "symmetric run: simulated ranks 0-1, 4, 7; the others ran as rank 0" in out.out
    assert "communicated" not in out.err


def test_collectives_that_overlap_on_shared_ranks_are_warned_about() -> None:
    # gloo's two threads run two buckets at once: the full run shares the links between them, and is slower
    cluster = simdist.Cluster.switch(8, algorithms={"all_reduce": "ring"})
    kw = {"width": 64, "buckets": 4}
    full = simdist.run(mlp_step, cluster, kwargs=kw, races="off", progress="gloo")
    with pytest.warns(
        simdist.SymmetryWarning, match=r"all_reduce on group 0 ran from .* while a collective of group 0"
    ):
        reduced = simdist.run(mlp_step, cluster, kwargs=kw, races="off", progress="gloo", symmetric=True)
    assert reduced.sim_time < full.sim_time
