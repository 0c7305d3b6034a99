"""Rank code for real_nccl.py: every collective checked against what it must compute, on the launcher's backend.

Top-level functions, so the spawned rank processes find them by module name. Also a script in the shared
convention (``python -m real nccl_checks.py --nproc 1 --entry main --backend nccl``; ``--entry fail``
raises). The expected values hold at any world size; on one GPU NCCL runs them at world size 1.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

Check = Callable[[torch.device, int, int], str | None]


def _device() -> torch.device:
    """The rank's device: its GPU under NCCL (the launcher selected it), else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _expect(got: torch.Tensor, want: float | torch.Tensor, what: str) -> str | None:
    """None when ``got`` equals ``want`` everywhere, else what differed."""
    want_t = torch.as_tensor(want, dtype=got.dtype).to(got.device).expand_as(got)
    if torch.equal(got, want_t):
        return None
    return f"{what}: got {got.flatten()[:4].tolist()}, expected {want_t.flatten()[:4].tolist()}"


def _full(dev: torch.device, value: float, n: int = 4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor of ``n`` elements equal to ``value`` on ``dev``."""
    return torch.full((n,), float(value), device=dev, dtype=dtype)


def _all_reduce(dev: torch.device, rank: int, world: int) -> str | None:
    """Sum of rank + 1 over the ranks."""
    t = _full(dev, rank + 1)
    dist.all_reduce(t)
    return _expect(t, world * (world + 1) / 2, "sum")


def _all_reduce_async_bf16(dev: torch.device, rank: int, world: int) -> str | None:
    """Asynchronous maximum in bfloat16, waited on."""
    t = _full(dev, rank + 1, dtype=torch.bfloat16)
    work = dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)
    work.wait()
    return _expect(t, world, "max")


def _broadcast(dev: torch.device, rank: int, world: int) -> str | None:
    """Rank 0's value everywhere."""
    t = _full(dev, rank + 1)
    dist.broadcast(t, src=0)
    return _expect(t, 1, "from rank 0")


def _all_gather(dev: torch.device, rank: int, world: int) -> str | None:
    """Every rank's value, into a list."""
    out = [torch.empty(4, device=dev) for _ in range(world)]
    dist.all_gather(out, _full(dev, rank + 1))
    return next((e for i, o in enumerate(out) if (e := _expect(o, i + 1, f"slot {i}"))), None)


def _all_gather_into_tensor(dev: torch.device, rank: int, world: int) -> str | None:
    """Every rank's value, into one tensor."""
    out = torch.empty(4 * world, device=dev)
    dist.all_gather_into_tensor(out, _full(dev, rank + 1))
    return _expect(out, torch.arange(1, world + 1, dtype=torch.float32).repeat_interleave(4), "gathered")


def _reduce_scatter(dev: torch.device, rank: int, world: int) -> str | None:
    """Slot j summed over the ranks lands on rank j (list input)."""
    out = torch.empty(4, device=dev)
    dist.reduce_scatter(out, [_full(dev, (rank + 1) * (j + 1)) for j in range(world)])
    return _expect(out, (rank + 1) * world * (world + 1) / 2, "scattered sum")


def _reduce_scatter_tensor(dev: torch.device, rank: int, world: int) -> str | None:
    """Slot j summed over the ranks lands on rank j (one tensor)."""
    inp = torch.cat([_full(dev, (rank + 1) * (j + 1)) for j in range(world)])
    out = torch.empty(4, device=dev)
    dist.reduce_scatter_tensor(out, inp)
    return _expect(out, (rank + 1) * world * (world + 1) / 2, "scattered sum")


def _all_to_all(dev: torch.device, rank: int, world: int) -> str | None:
    """Rank i sends slot j to rank j (lists)."""
    out = [torch.empty(4, device=dev) for _ in range(world)]
    dist.all_to_all(out, [_full(dev, rank * world + j) for j in range(world)])
    return next((e for i, o in enumerate(out) if (e := _expect(o, i * world + rank, f"from rank {i}"))), None)


def _all_to_all_single(dev: torch.device, rank: int, world: int) -> str | None:
    """Rank i sends slot j to rank j (one tensor)."""
    inp = torch.cat([_full(dev, rank * world + j) for j in range(world)])
    out = torch.empty(4 * world, device=dev)
    dist.all_to_all_single(out, inp)
    want = torch.tensor([i * world + rank for i in range(world)], dtype=torch.float32).repeat_interleave(4)
    return _expect(out, want, "exchanged")


def _reduce(dev: torch.device, rank: int, world: int) -> str | None:
    """Sum of rank + 1 at rank 0."""
    t = _full(dev, rank + 1)
    dist.reduce(t, dst=0)
    return _expect(t, world * (world + 1) / 2, "sum at rank 0") if rank == 0 else None


def _gather(dev: torch.device, rank: int, world: int) -> str | None:
    """Every rank's value at rank 0."""
    out = [torch.empty(4, device=dev) for _ in range(world)] if rank == 0 else None
    dist.gather(_full(dev, rank + 1), out, dst=0)
    if out is None:
        return None
    return next((e for i, o in enumerate(out) if (e := _expect(o, i + 1, f"slot {i}"))), None)


def _scatter(dev: torch.device, rank: int, world: int) -> str | None:
    """Rank 0's slot r at rank r."""
    out = torch.empty(4, device=dev)
    dist.scatter(out, [_full(dev, j + 1) for j in range(world)] if rank == 0 else None, src=0)
    return _expect(out, rank + 1, "scattered")


def _barrier(dev: torch.device, rank: int, world: int) -> str | None:
    """Every rank reaches it."""
    dist.barrier()
    return None


def _objects(dev: torch.device, rank: int, world: int) -> str | None:
    """Every rank's Python object, gathered (pickled through the device)."""
    out: list[Any] = [None] * world
    dist.all_gather_object(out, {"rank": rank})
    return None if out == [{"rank": r} for r in range(world)] else f"gathered objects {out}"


def _send_recv(dev: torch.device, rank: int, world: int) -> str | None:
    # A ring: even ranks send first, odd ranks receive first, so no pair waits on each other.
    """Each rank sends its value to the next one around a ring."""
    t, got = _full(dev, rank + 1), torch.empty(4, device=dev)
    peer_to, peer_from = (rank + 1) % world, (rank - 1) % world
    if rank % 2 == 0:
        dist.send(t, peer_to)
        dist.recv(got, peer_from)
    else:
        dist.recv(got, peer_from)
        dist.send(t, peer_to)
    return _expect(got, peer_from + 1, f"from rank {peer_from}")


CHECKS: dict[str, Check] = {
    "all_reduce": _all_reduce,
    "all_reduce async bf16 max": _all_reduce_async_bf16,
    "broadcast": _broadcast,
    "all_gather": _all_gather,
    "all_gather_into_tensor": _all_gather_into_tensor,
    "reduce_scatter": _reduce_scatter,
    "reduce_scatter_tensor": _reduce_scatter_tensor,
    "all_to_all": _all_to_all,
    "all_to_all_single": _all_to_all_single,
    "reduce": _reduce,
    "gather": _gather,
    "scatter": _scatter,
    "barrier": _barrier,
    "all_gather_object": _objects,
    "send/recv": _send_recv,
}


def collectives() -> dict[str, Any]:
    """Run every check on this rank: name -> None (passed), an error text, or why it cannot run."""
    rank, world, dev = dist.get_rank(), dist.get_world_size(), _device()
    results: dict[str, str | None] = {}
    for name, check in CHECKS.items():
        if name == "send/recv" and world == 1:
            results[name] = "not applicable: point-to-point needs a peer, and one GPU holds one NCCL rank"
            continue
        try:
            results[name] = check(dev, rank, world)
        except Exception as exc:  # noqa: BLE001 - every check reports, whatever another did
            results[name] = f"raised {type(exc).__name__}: {exc}"
    if dev.type == "cuda":
        torch.cuda.synchronize()
    # Tensors on the device, nested as rank code returns them: the launcher must bring them back on the CPU.
    back = {"tensor": _full(dev, 7), "nested": [_full(dev, 8), (_full(dev, 9),)]}
    seen = {
        "backend": dist.get_backend(),
        "world": world,
        "device": str(dev),
        "local_rank": os.environ.get("LOCAL_RANK"),
        "current_device": torch.cuda.current_device() if dev.type == "cuda" else None,
    }
    return {"checks": results, "returned": back, "seen": seen}


def raise_after_a_collective() -> None:
    """Initialise the backend with a collective, then rank 0 fails as rank code does (its peers wait)."""
    t = _full(_device(), 1)
    dist.all_reduce(t)
    if dist.get_rank() == 0:
        raise ValueError("deliberate failure after an all_reduce")
    dist.barrier()


def exit_after_a_collective() -> None:
    """Initialise the backend with a collective, then rank 0 leaves without a Python exception."""
    t = _full(_device(), 1)
    dist.all_reduce(t)
    if _device().type == "cuda":
        torch.cuda.synchronize()
    if dist.get_rank() == 0:
        os._exit(3)
    dist.barrier()


def main() -> torch.Tensor:
    """Script entry for ``python -m real``: an all-reduce on the rank's device, returned (on the CPU)."""
    t = _full(_device(), dist.get_rank() + 1)
    dist.all_reduce(t)
    return t


def fail() -> None:
    """Script entry that fails: ``python -m real ... --entry fail`` must exit with status 1."""
    raise_after_a_collective()
