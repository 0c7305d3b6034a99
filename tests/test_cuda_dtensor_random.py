"""DTensor's random ops on simulated GPUs draw at CUDA's Philox offsets: a shard draws the part of one stream that
DTensor's offset rule gives it, so a tensor drawn in row blocks equals the whole tensor drawn on one rank, replicas
agree, every rank's offset moves past the whole tensor, and a run repeats.

The oracle is a run on one rank: the same op on a one-dimensional DTensor on a one-rank mesh draws the stream
itself; each rank's shard must be the slice of it that DTensor's documented rule names (a shard's offset is its
linear index times the first shard's size, rounded up to a multiple of 4; afterwards every rank's offset is the
whole tensor's size past the old one, rounded likewise).
"""

from __future__ import annotations

import json
import logging
import math
import os
import runpy
import subprocess
import sys
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor import _random as dtensor_rng
from torch.distributed.tensor import randn as dtensor_randn

import simdist
from simdist.cuda.rngstate import PHILOX_STATE_BYTES, STATE_BYTES
from simdist.errors import InvalidArgumentError, RankError, UnsupportedCudaOpError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPS = ("normal", "uniform", "randn", "dropout", "bernoulli")


def _cluster(ranks: int) -> simdist.Cluster:
    return simdist.Cluster.switch(ranks, device="H100")


def _round4(n: int) -> int:
    return (n + 3) // 4 * 4


def _apply(op: str, mesh, placements, shape) -> torch.Tensor:
    """One DTensor random op on a tensor of ``shape`` placed so on ``mesh``."""
    if op == "randn":
        return dtensor_randn(*shape, device_mesh=mesh, placements=placements)
    if op == "dropout":
        return F.dropout(distribute_tensor(torch.ones(shape, device="cuda"), mesh, placements), 0.3)
    t = distribute_tensor(torch.zeros(shape, device="cuda"), mesh, placements)
    if op == "normal":
        torch.nn.init.normal_(t, 0.5, 2.0)
    elif op == "uniform":
        torch.nn.init.uniform_(t, -1.0, 3.0)
    else:
        t.bernoulli_(0.4)
    return t


def _philox(state: torch.Tensor) -> list[int]:
    return state[:PHILOX_STATE_BYTES].view(torch.int64).tolist()


def _sharded(mesh_shape, placements, shape, op, seed) -> dict:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.manual_seed(seed)
    mesh = init_device_mesh("cuda", mesh_shape)
    before = _philox(torch.cuda.get_rng_state())
    first = _apply(op, mesh, placements, shape)
    after = _philox(torch.cuda.get_rng_state())
    second = _apply(op, mesh, placements, shape)
    return {
        "coordinate": mesh.get_coordinate(),
        "first": first.to_local().cpu(),
        "second": second.to_local().cpu(),
        "whole": first.full_tensor().cpu(),
        "philox": (before, after, _philox(torch.cuda.get_rng_state())),
    }


def _stream(op: str, length: int, seed: int) -> torch.Tensor:
    """The numbers ``op`` draws at offsets 0 .. length - 1: the op on a whole one-dimensional tensor, one rank."""
    torch.cuda.set_device(0)
    torch.manual_seed(seed)
    mesh = init_device_mesh("cuda", (1,))
    return _apply(op, mesh, [Replicate()], (length,)).full_tensor().cpu()


def _shard_start(coordinate, mesh_shape, placements, shape) -> int:
    """DTensor's offset of a rank's shard: its linear index over the sharded tensor dimensions times the size of
    the first shard (torch.distributed.tensor._random's documented rule), rounded up to a multiple of 4. torch sizes
    that shard one mesh dimension at a time from the whole dimension: a dimension sharded over two mesh dimensions
    counts as split by the last one only, so such shards leave gaps in the stream."""
    index, count = [0] * len(shape), [1] * len(shape)
    first = list(shape)
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Shard):
            n = mesh_shape[mesh_dim]
            index[p.dim] = index[p.dim] * n + coordinate[mesh_dim]
            count[p.dim] *= n
            first[p.dim] = -(-shape[p.dim] // n)  # torch's chunks: the first is the ceiling's size
    linear = 0
    for i, c in zip(index, count):
        linear = linear * c + i
    return _round4(linear * math.prod(first))


_MESHES = st.sampled_from([(2,), (4,), (2, 2)])
_PLACEMENT = st.sampled_from([Replicate(), Shard(0), Shard(1)])


@settings(max_examples=10)
@given(
    mesh_shape=_MESHES,
    data=st.data(),
    shape=st.tuples(st.integers(1, 9), st.integers(1, 9)),
    op=st.sampled_from(OPS),
    seed=st.integers(0, 2**32 - 1),
)
def test_each_shard_draws_its_slice_of_one_stream_at_dtensors_offsets(
    mesh_shape, data, shape, op, seed
) -> None:
    placements = data.draw(st.lists(_PLACEMENT, min_size=len(mesh_shape), max_size=len(mesh_shape)))
    ranks = math.prod(mesh_shape)
    res = simdist.run(_sharded, _cluster(ranks), args=(mesh_shape, placements, shape, op, seed))
    whole = _round4(math.prod(shape))
    stream = simdist.run(_stream, _cluster(1), args=(op, 2 * whole + 64, seed)).returns[0]
    for out in res.returns:
        start = _shard_start(out["coordinate"], mesh_shape, placements, shape)
        for key, base in (("first", 0), ("second", whole)):
            local = out[key]
            expected = stream[base + start : base + start + local.numel()].view(local.shape)
            assert torch.equal(local, expected), (key, out["coordinate"])
        # every rank's offset moves past the whole tensor, whatever shard it drew
        before, after, last = out["philox"]
        assert after == [before[0], before[1] + whole] and last == [before[0], before[1] + 2 * whole]


@pytest.mark.parametrize(
    ("mesh_shape", "placements"),
    [((4,), [Shard(0)]), ((2, 2), [Shard(0), Replicate()]), ((2, 2), [Replicate(), Shard(0)])],
    ids=["1d", "2d_dim0", "2d_dim1"],
)
def test_a_tensor_drawn_in_row_blocks_equals_the_whole_tensor_drawn_on_one_rank(
    mesh_shape, placements
) -> None:
    shape = (8, 6)  # row blocks of a multiple of 4 elements: each block's offset is its place in the whole
    res = simdist.run(_sharded, _cluster(4), args=(mesh_shape, placements, shape, "normal", 7))

    def one_rank() -> torch.Tensor:
        torch.manual_seed(7)
        return _apply("normal", init_device_mesh("cuda", (1,)), [Replicate()], shape).full_tensor().cpu()

    (whole,) = simdist.run(one_rank, _cluster(1)).returns
    for out in res.returns:
        assert torch.equal(out["whole"], whole)
        assert not torch.equal(out["second"], out["first"])


def test_dtensor_random_ops_repeat_run_after_run() -> None:
    args = ((2, 2), [Shard(1), Replicate()], (5, 7), "dropout", 3)
    a = simdist.run(_sharded, _cluster(4), args=args).returns
    b = simdist.run(_sharded, _cluster(4), args=args).returns
    assert all(torch.equal(x["first"], y["first"]) and x["philox"] == y["philox"] for x, y in zip(a, b))


def _ordinary_then_dtensor() -> tuple:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.manual_seed(5)
    plain = torch.randn(5, device="cuda").cpu()
    offset = _philox(torch.cuda.get_rng_state())[1]
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    return plain, offset, _apply("normal", mesh, [Replicate()], (4,)).to_local().cpu()


def test_an_ordinary_random_op_draws_the_cpu_generators_numbers_and_moves_the_offset_as_cuda_does() -> None:
    (plain, offset, after), _ = simdist.run(_ordinary_then_dtensor, _cluster(2)).returns
    assert torch.equal(plain, torch.randn(5, generator=torch.Generator().manual_seed(5)))
    assert offset == 8  # 5 elements, in steps of 4
    stream = simdist.run(_stream, _cluster(1), args=("normal", 12, 5)).returns[0]
    assert torch.equal(after, stream[8:12])


def _save_and_restore() -> tuple:
    torch.cuda.set_device(0)
    torch.manual_seed(11)
    mesh = init_device_mesh("cuda", (1,))
    state = torch.cuda.get_rng_state()

    def draws() -> tuple:
        return torch.rand(3, device="cuda").cpu(), _apply(
            "uniform", mesh, [Replicate()], (6,)
        ).full_tensor().cpu()

    first = draws()
    torch.cuda.set_rng_state(state)
    again = draws()
    # CUDA's 16 bytes: the seed and offset; the CPU stream starts from that seed (the state was taken just after it)
    torch.cuda.set_rng_state(state[:PHILOX_STATE_BYTES])
    return state.numel(), first, again, draws()


def test_the_device_state_is_cudas_seed_and_offset_then_the_cpu_generators_and_restores_both() -> None:
    ((size, first, again, cuda_only),) = simdist.run(_save_and_restore, _cluster(1)).returns
    assert size == STATE_BYTES == PHILOX_STATE_BYTES + torch.get_rng_state().numel()
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert all(torch.equal(a, b) for a, b in zip(first, cuda_only))


def _wrong_state() -> None:
    torch.cuda.set_rng_state(torch.get_rng_state())


def test_a_state_of_another_size_is_refused_naming_the_sizes() -> None:
    with pytest.raises(RankError) as info:
        simdist.run(_wrong_state, _cluster(1))
    assert isinstance(info.value.exc, InvalidArgumentError) and isinstance(info.value.exc, RuntimeError)
    assert f"is {STATE_BYTES} bytes" in str(info.value) and "got 5056 bytes" in str(info.value)


def _with_a_generator(kind: str) -> None:
    torch.cuda.set_device(0)
    mesh = init_device_mesh("cuda", (1,))
    t = distribute_tensor(torch.zeros(6, device="cuda"), mesh, [Replicate()])
    torch.nn.init.normal_(t, generator=torch.Generator(device=kind).manual_seed(9))


@pytest.mark.parametrize("kind", ["cuda", "cpu"])
def test_a_generator_passed_to_a_dtensor_op_on_simulated_gpus_is_refused_naming_the_line(kind: str) -> None:
    with pytest.raises(RankError) as info:
        simdist.run(_with_a_generator, _cluster(1), args=(kind,))
    assert isinstance(info.value.exc, UnsupportedCudaOpError)
    line = _with_a_generator.__code__.co_firstlineno + 4
    assert f"test_cuda_dtensor_random.py:{line})" in str(info.value.exc) and "Pass no generator" in str(
        info.value
    )


def _seeded_by_dtensor(seed: int) -> torch.Tensor:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    dtensor_rng.manual_seed(seed, mesh)  # DTensor's own seeding makes the rank's tracker, then seeds torch
    return _apply("normal", mesh, [Shard(0)], (4, 2)).full_tensor().cpu()


def test_dtensors_manual_seed_makes_each_ranks_tracker_and_the_process_keeps_none() -> None:
    res = simdist.run(_seeded_by_dtensor, _cluster(2), args=(13,)).returns
    stream = simdist.run(_stream, _cluster(1), args=("normal", 8, 13)).returns[0]
    assert all(torch.equal(r, stream.view(4, 2)) for r in res)
    # torch keeps the tracker in a module global: the run leaves the module and that global as it found them
    assert type(dtensor_rng) is types.ModuleType and vars(dtensor_rng)["_rng_tracker"] is None


def _first_dtensor_draw(seeds: list[int]) -> dict:
    """The simulated time of a rank's first DTensor random op (which makes its RNG tracker), the device states around
    it, and whether torch's tracker logged that the states differed."""
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    torch.manual_seed(seeds[rank])
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    t = distribute_tensor(torch.zeros(4, 4, device="cuda"), mesh, [Shard(0)])
    before = torch.cuda.get_rng_state()
    handler = _Records()
    logging.getLogger(dtensor_rng.__name__).addHandler(handler)
    torch.cuda.synchronize()
    start = simdist.now()
    try:
        torch.nn.init.uniform_(t)
    finally:
        logging.getLogger(dtensor_rng.__name__).removeHandler(handler)
    torch.cuda.synchronize()
    # the logger is the process's: each rank's handler sees every rank's records
    warned = [text for by, text in handler.seen if by == rank]
    return {
        "seconds": simdist.now() - start,
        "before": before,
        "after": torch.cuda.get_rng_state(),
        "warned": warned,
    }


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append((dist.get_rank(), record.getMessage()))


def _reads(count: int) -> float:
    """The simulated time of ``count`` reads to the host of one element each, on an idle simulated H100."""

    def read() -> float:
        torch.cuda.set_device(0)
        x = torch.ones(count, dtype=torch.uint8, device="cuda")
        y = x.clone()
        torch.cuda.synchronize()
        start = simdist.now()
        all(x == y)
        return simdist.now() - start

    return simdist.run(read, _cluster(1)).returns[0]


@pytest.mark.parametrize("seeds", [[3, 3], [3, 4]], ids=["same_seed", "other_seeds"])
def test_the_tracker_compares_cudas_16_bytes_and_sets_rank_0s_whole_state(seeds) -> None:
    # DTensor's tracker broadcasts rank 0's device state and compares it with each rank's, one element read to the
    # host at a time: on CUDA 16 bytes, the Philox seed and offset. A simulated GPU's state goes on with the CPU
    # generator's 5,056 bytes; only CUDA's are compared, so the first op costs what 16 reads cost, not 5,072.
    res = simdist.run(_first_dtensor_draw, _cluster(2), args=(seeds,)).returns
    assert res[0]["before"].numel() == STATE_BYTES
    sixteen, every_byte = _reads(PHILOX_STATE_BYTES), _reads(STATE_BYTES)
    assert all(r["seconds"] < 2 * sixteen < every_byte / 100 for r in res), (
        [r["seconds"] for r in res],
        sixteen,
    )
    # torch's warning where a rank's seed and offset differ from rank 0's, and only there
    differ = seeds[0] != seeds[1]
    assert [bool(r["warned"]) for r in res] == [False, differ]
    assert not differ or "synchronizing RNG states of every rank" in res[1]["warned"][0]
    # every rank goes on from rank 0's whole state, its CPU generator's too, as one Philox stream on CUDA
    assert torch.equal(res[0]["after"], res[1]["after"])
    assert torch.equal(res[1]["after"][PHILOX_STATE_BYTES:], res[0]["before"][PHILOX_STATE_BYTES:])


#: a program that imports DTensor itself, inside the run (as a torchrun-style script does at its top)
_LATE_IMPORT = """
import os

import torch


def draw_late():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.manual_seed(5)
    t = distribute_tensor(torch.zeros(6, 4, device="cuda"), init_device_mesh("cuda", (2,)), [Shard(0)])
    torch.nn.init.normal_(t)
    return t.full_tensor().cpu().tolist()
"""

_LATE_SCRIPT = """
import json, runpy, sys
import simdist
imported_by_simdist = "torch.distributed.tensor" in sys.modules
draw_late = runpy.run_path(sys.argv[1])["draw_late"]
drawn = simdist.run(draw_late, simdist.Cluster.switch(2, device="H100")).returns
from torch.distributed.tensor import _random
restored = [
    type(_random) is type(sys),
    _random._PhiloxState.state.fget.__module__,
    *(f.__qualname__ for f in (
        _random._PhiloxState.__init__, _random.OffsetBasedRNGTracker._distribute_region, _random.manual_seed
    )),
]
print(json.dumps([imported_by_simdist, drawn, restored]))
"""


def test_dtensor_first_imported_inside_a_run_draws_as_when_imported_before(tmp_path) -> None:
    # importing simdist leaves DTensor (and sympy, about a second of CPU) out; the run still puts its random
    # module in place the moment rank code imports it, and takes it away afterwards
    program = tmp_path / "late.py"
    program.write_text(_LATE_IMPORT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-c", _LATE_SCRIPT, str(program)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    imported_by_simdist, drawn, restored = json.loads(out.stdout.splitlines()[-1])
    assert not imported_by_simdist, "import simdist imports torch.distributed.tensor"
    here = simdist.run(runpy.run_path(str(program))["draw_late"], _cluster(2)).returns
    assert drawn == here  # lists of floats: JSON carries each float exactly
    # afterwards the module is torch's own again
    assert restored == [
        True,
        "torch.distributed.tensor._random",
        "_PhiloxState.__init__",
        "OffsetBasedRNGTracker._distribute_region",
        "manual_seed",
    ]
