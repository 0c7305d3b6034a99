"""Programs the exploration tests run: module-level functions, so that worker processes load them by name."""

from __future__ import annotations

import torch
import torch.distributed as dist

import simdist


def any_source_order() -> list[int] | None:
    """Rank 0 receives one value from every other rank from any source and assumes they come in rank order."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank != 0:
        dist.send(torch.tensor([float(rank)]), 0)
        return None
    order = []
    for _ in range(world - 1):
        buf = torch.zeros(1)
        dist.recv(buf)
        order.append(int(buf.item()))
    assert order == sorted(order), f"arrival order {order}"
    return order


def arrival_order() -> list[int] | None:
    """As :func:`any_source_order` without the assertion: rank 0 returns the order the values came in."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank != 0:
        dist.send(torch.tensor([float(rank)]), 0)
        return None
    order = []
    for _ in range(world - 1):
        buf = torch.zeros(1)
        dist.recv(buf)
        order.append(int(buf.item()))
    return order


def mixed() -> float:
    """Collectives, point-to-point and a future's ``then()`` callbacks: every scheduling point meets a tie."""
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.arange(8, dtype=torch.float32) + rank
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future().then(lambda f: f.value()[0] * 2)
    simdist.charge(1e-6 * (rank + 1))
    peer = (rank + 1) % world
    out = torch.zeros(8)
    reqs = [dist.isend(torch.full((8,), float(rank)), peer), dist.irecv(out, (rank - 1) % world)]
    for r in reqs:
        r.wait()
    doubled = fut.wait()
    dist.all_gather_into_tensor(torch.zeros(8 * world), t)
    return float(doubled.sum() + out.sum())


def sleeps(steps: int) -> None:
    """Each rank computes ``steps`` times for 1 ms and waits for it: every wake-up ties with the other ranks'."""
    for _ in range(steps):
        simdist.charge(1e-3)
        simdist.synchronize()


def two_sleeps() -> None:
    """:func:`sleeps` of two steps."""
    sleeps(2)


def returns_rank() -> int:
    """Each rank's rank."""
    return dist.get_rank()


def order_is_sorted(result: simdist.RunResult) -> bool:
    """A check: rank 0 saw the values in rank order."""
    order = result.returns[0]
    return order == sorted(order)


_calls = [0]


def keeps_state() -> None:
    """Not deterministic across runs: rank 0 makes one more all-reduce every other time the module runs it."""
    if dist.get_rank() == 0:
        _calls[0] += 1
    flag = torch.tensor([float(_calls[0] % 2)])
    dist.broadcast(flag, 0)
    for _ in range(int(flag.item()) + 1):
        dist.all_reduce(torch.ones(2))
    raise AssertionError("always fails, so that every run is replayed")


def ring_once() -> float:
    """A ring all-reduce: each step's messages arrive together at distinct ranks over distinct links."""
    simdist.set_algorithms(all_reduce="ring")
    t = torch.ones(6) * dist.get_rank()
    dist.all_reduce(t)
    return float(t.sum())


def callback_order() -> list[str]:
    """Two async all-reduces of empty tensors on gloo threads complete together; their ``then()`` callbacks log
    the order they ran in."""
    seen: list[str] = []
    first, second = torch.ones(0), torch.ones(0)
    a = dist.all_reduce(first, async_op=True).get_future().then(lambda _f: seen.append("a"))
    b = dist.all_reduce(second, async_op=True).get_future().then(lambda _f: seen.append("b"))
    a.wait()
    b.wait()
    return seen


def four_rounds() -> list[int] | None:
    """Ranks 1, 2, 3 each do the same work and send rank 0 a value, four times; rank 0 returns the arrival order
    (from any source). The sends of a round are due at the same time: a tie in every round."""
    rank = dist.get_rank()
    if rank != 0:
        sends = []
        for _ in range(4):
            simdist.charge(1e-3)
            sends.append(dist.isend(torch.tensor([float(rank)]), 0))
        for s in sends:
            s.wait()
        return None
    order = []
    for _ in range(12):
        buf = torch.zeros(1)
        dist.recv(buf)
        order.append(int(buf.item()))
    return order
