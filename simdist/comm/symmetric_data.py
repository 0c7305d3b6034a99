"""What a symmetric run's collectives write: every rank not simulated holds what the first simulated member holds.

A symmetric run (:mod:`simdist.comm.symmetry`) simulates a few members of each group; the rest are copies of the
first simulated member, its buffers included. So a reduction counts the first member's contribution once for
itself and once for each rank not simulated, and a gather shows its input in the chunk of each such rank.
Where every rank holds the same data (replicated parameters, a seeded batch) that is exactly the full run's
result, up to the order of floating-point additions; where the ranks' data differ it is a model of it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from simdist.algorithms import reduce_op
from simdist.comm import ops
from simdist.comm.plans import raw_flat
from simdist.errors import SymmetryError

#: writes one collective's results: (the simulated members' calls, their group ranks, the group's size)
Writer = Callable[[list, list[int], int], None]


def reduced(parts: list[torch.Tensor], weights: list[int], op: str, size: int) -> torch.Tensor:
    """``op`` over ``parts[i]`` counted ``weights[i]`` times each (``size`` contributions in all), in a new tensor."""
    red = reduce_op(op)
    dtype = parts[0].dtype
    if dtype != torch.bool:  # on bool, SUM is a logical or and PRODUCT an and: repeats change nothing
        if op in ("sum", "avg"):
            parts = [p * w if w != 1 else p for p, w in zip(parts, weights)]
        elif op == "product":
            parts = [p.pow(w) if w != 1 else p for p, w in zip(parts, weights)]
    if op == "bxor":
        parts = [p if w % 2 else torch.zeros_like(p) for p, w in zip(parts, weights)]
    combine = red.combiner(dtype)
    acc = parts[0].clone()
    for p in parts[1:]:
        combine(acc, p)
    red.finish(acc, size)
    return acc


def _weights(members: list[int], size: int) -> list[int]:
    """How many ranks each simulated member's data stands for: itself, and the first also every rank not simulated."""
    return [1 + (size - len(members) if i == 0 else 0) for i in range(len(members))]


def _all_reduce(calls: list, members: list[int], size: int) -> None:
    bufs = [raw_flat(c.tensor) if isinstance(c, ops.AllReduce) else c.flat for c in calls]
    result = reduced([b.clone() for b in bufs], _weights(members, size), calls[0].reduce_op, size)
    for b in bufs:
        b.copy_(result)


def _broadcast(calls: list[ops.Broadcast], members: list[int], size: int) -> None:
    root = calls[0].root
    source = raw_flat(calls[members.index(root)].tensor if root in members else calls[0].tensor).clone()
    for c in calls:
        raw_flat(c.tensor).copy_(source)


def _reduce(calls: list[ops.Reduce], members: list[int], size: int) -> None:
    root = calls[0].root
    if root in members:
        result = reduced(
            [raw_flat(c.tensor).clone() for c in calls], _weights(members, size), calls[0].reduce_op, size
        )
        raw_flat(calls[members.index(root)].tensor).copy_(result)


def _inputs_by_rank(inputs: list[torch.Tensor], members: list[int], size: int) -> list[torch.Tensor]:
    """Each group rank's input: a simulated member's own, the first member's for every other rank."""
    out = [inputs[0]] * size
    for i, r in enumerate(members):
        out[r] = inputs[i]
    return out


def _all_gather(calls: list[ops.AllGather], members: list[int], size: int) -> None:
    sources = _inputs_by_rank([c.input.clone() for c in calls], members, size)
    for c in calls:
        torch._foreach_copy_(list(c.outputs), sources)


def _all_gather_flat(calls: list, members: list[int], size: int) -> None:
    inputs = [c.input.reshape(-1).clone() for c in calls]
    for c in calls:
        rows = raw_flat(c.output).view(size, -1)
        rows.copy_(inputs[0])
        for i, r in enumerate(members):
            rows[r].copy_(inputs[i])


def _reduce_scatter(calls: list[ops.ReduceScatter], members: list[int], size: int) -> None:
    weights = _weights(members, size)
    results = [
        reduced([c.inputs[r].clone() for c in calls], weights, calls[0].reduce_op, size) for r in members
    ]
    for c, result in zip(calls, results):
        c.output.copy_(result)


def _reduce_scatter_tensor(calls: list[ops.ReduceScatterTensor], members: list[int], size: int) -> None:
    weights = _weights(members, size)
    chunks = [c.input.reshape(size, -1) for c in calls]
    results = [reduced([ch[r].clone() for ch in chunks], weights, calls[0].reduce_op, size) for r in members]
    for c, result in zip(calls, results):
        raw_flat(c.output).copy_(result)


def _gather(calls: list[ops.Gather], members: list[int], size: int) -> None:
    root = calls[0].root
    if root in members:
        sources = _inputs_by_rank([c.input.clone() for c in calls], members, size)
        torch._foreach_copy_(list(calls[members.index(root)].outputs), sources)


def _scatter(calls: list[ops.Scatter], members: list[int], size: int) -> None:
    # only the root holds the chunks: from a root not simulated, the members' outputs keep what they held
    root = calls[0].root
    if root in members:
        chunks = [t.clone() for t in calls[members.index(root)].inputs]
        for c, r in zip(calls, members):
            raw_flat(c.output).copy_(chunks[r].reshape(-1))


def _nothing(calls: list, members: list[int], size: int) -> None:
    return None


#: the collectives a symmetric run carries data for, by their op description's type
WRITERS: dict[type, Writer] = {
    ops.AllReduce: _all_reduce,
    ops.AllReduceCoalesced: _all_reduce,
    ops.Broadcast: _broadcast,
    ops.Reduce: _reduce,
    ops.AllGather: _all_gather,
    ops.AllGatherIntoTensor: _all_gather_flat,
    ops.AllGatherCoalesced: _all_gather_flat,
    ops.AllGatherIntoTensorCoalesced: _all_gather_flat,
    ops.ReduceScatter: _reduce_scatter,
    ops.ReduceScatterTensor: _reduce_scatter_tensor,
    ops.ReduceScatterTensorCoalesced: _reduce_scatter_tensor,  # its input is rank-major too
    ops.Gather: _gather,
    ops.Scatter: _scatter,
    ops.Barrier: _nothing,
}


def writer(spec: ops.OpSpec, site: str) -> Writer:
    """What writes the results of collectives described as ``spec`` (issued at ``site``) in a symmetric run."""
    found = WRITERS.get(type(spec))
    if found is None:
        supported = ", ".join(sorted({k.name for k in WRITERS}))
        why = (
            ": its closed form does not see how every rank's n-1 simultaneous messages share the links (measured: "
            "7% short of the full run's time at 4 KB per pair of ranks on a switch of 48 ranks, 45% at 256 KB)"
            if spec.collective == "all_to_all"
            else ""
        )
        raise SymmetryError(
            f"{spec.name} at {site}: a symmetric run (symmetric=True) supports {supported}, not {spec.name}{why}. "
            "Run without symmetric=True"
        )
    return found
