"""Uninitialised memory in a run reads as torch's deterministic mode fills it, the same in every run and on every
rank (the oracle: torch's own fill under ``torch.use_deterministic_algorithms(True)`` in this process)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import simdist

RING = simdist.Cluster.preset("ring", world_size=2)
GPUS = simdist.Cluster.switch(2, device="H100")


def _reads_empty(kind: str) -> list[torch.Tensor]:
    """Tensors of every op that hands out uninitialised memory, read before anything writes them."""
    dev = "cuda" if kind == "cuda" else "cpu"
    if kind == "cuda":
        torch.cuda.set_device(dist.get_rank())
    grown = torch.arange(3.0, device=dev)
    grown.resize_(9)  # its first three values stay, the six new ones are uninitialised
    ones = torch.ones(2, device=dev)
    out = [
        torch.empty(64, device=dev),
        torch.empty(4, dtype=torch.bfloat16, device=dev),
        torch.empty(3, dtype=torch.complex64, device=dev),
        torch.empty(5, dtype=torch.int64, device=dev),
        torch.empty(5, dtype=torch.uint8, device=dev),
        torch.empty(2, dtype=torch.bool, device=dev),
        torch.empty_like(ones),
        ones.new_empty(3),
        ones.new_empty_strided((2, 2), (1, 2)),
        torch.empty_strided((2, 3), (1, 2), device=dev),
        torch.nn.Parameter(torch.empty(6, device=dev)).detach(),
        grown,
        torch.Tensor(4),
        torch.Tensor().resize_(3),
    ]
    return [t.cpu() for t in out]


def _torch_deterministic() -> list[torch.Tensor]:
    """The same tensors as torch's deterministic mode gives them in this process."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        return _reads_empty("cpu")
    finally:
        torch.use_deterministic_algorithms(before)


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (NaN equal to NaN)."""
    bits = [t.contiguous().view(-1).view(torch.uint8) for t in (a, b)]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(*bits)


@pytest.mark.parametrize(
    ("cluster", "kind", "options"),
    [(RING, "cpu", {}), (RING, "cpu", {"races": "off"}), (RING, "cpu", {"memory": True}), (GPUS, "cuda", {})],
    ids=["cpu", "cpu-no-race-check", "cpu-memory", "gpu"],
)
def test_uninitialised_memory_is_torchs_deterministic_fill_in_every_run_and_rank(
    cluster: simdist.Cluster, kind: str, options: dict[str, Any]
) -> None:
    expected = _torch_deterministic()
    assert torch.isnan(expected[0]).all() and expected[3].eq(torch.iinfo(torch.int64).max).all()
    first = simdist.run(_reads_empty, cluster, args=(kind,), **options)
    second = simdist.run(_reads_empty, cluster, args=(kind,), **options)
    assert first.trace_hash == second.trace_hash
    for run in (first, second):
        for rank in range(cluster.world_size):
            got = run.returns[rank]
            assert len(got) == len(expected)
            for i, (g, e) in enumerate(zip(got, expected)):
                assert _equal(g, e), (rank, i, g, e)


def _never_reset(kind: str) -> tuple[list[torch.Tensor], float]:
    """pytorch/examples' FSDP2 pattern: a model built on the meta device, sharded, moved with ``to_empty`` and
    reset by a ``reset_parameters`` that skips its blocks; the blocks keep the memory ``to_empty`` gave them."""
    dev = "cuda" if kind == "cuda" else "cpu"
    if kind == "cuda":
        torch.cuda.set_device(dist.get_rank())
    torch.manual_seed(0)
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    fully_shard(model[1])
    fully_shard(model)
    model.to_empty(device=dev)
    model[0].reset_parameters()  # model[1], the block, is never reset
    loss = model(torch.ones(4, 8, device=dev)).sum()
    loss.backward()
    return [p.full_tensor().detach().cpu() for p in model.parameters()], loss.item()


@pytest.mark.filterwarnings("ignore:DTensor random operators may not have complete support:UserWarning")
@pytest.mark.parametrize(("cluster", "kind"), [(RING, "cpu"), (GPUS, "cuda")], ids=["cpu", "gpu"])
def test_fsdp2_parameters_no_reset_reaches_are_nan_in_every_run(cluster: simdist.Cluster, kind: str) -> None:
    first = simdist.run(_never_reset, cluster, args=(kind,))
    second = simdist.run(_never_reset, cluster, args=(kind,))
    assert first.trace_hash == second.trace_hash
    for run in (first, second):
        for rank in range(cluster.world_size):
            (w0, b0, w1, b1), loss = run.returns[rank]
            assert torch.isfinite(w0).all() and torch.isfinite(b0).all()  # reset: drawn from the generator
            assert torch.equal(w0, first.returns[0][0][0])
            assert torch.isnan(w1).all() and torch.isnan(b1).all()
            assert torch.isnan(torch.tensor(loss))  # the program's bug shows


def test_rank_code_sees_torchs_own_deterministic_setting() -> None:
    """The fill needs no process-wide switch: rank code sees torch's setting as the process has it."""

    def settings() -> tuple[bool, bool]:
        return (
            torch.are_deterministic_algorithms_enabled(),
            torch.utils.deterministic.fill_uninitialized_memory,
        )

    before = settings()
    res = simdist.run(settings, RING)
    assert res.returns == [before, before]
    assert settings() == before
