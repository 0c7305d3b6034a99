"""An oracle for gloo's reduction order: gloo's ring loops, transcribed from its C++ and run in lockstep.

``ring_all_reduce`` follows ``gloo::ring`` in ``gloo/allreduce.cc`` and ``ring_reduce`` follows
``gloo::reduce`` in ``gloo/reduce.cc`` line by line (segment sizes, the offsets each iteration sends and
receives, two operations in flight, the reduction of a received segment into the rank's own), with every
rank's buffer in one process. It shares nothing with :mod:`simdist.algorithms.gloo_order`, whose closed
form (which block an element is in, which ranks add it, in which order) the tests check against it. The
functions named after torch's collectives map them onto the loops as ProcessGroupGloo does (torch 2.13).
Real gloo processes check this oracle in turn (``tests/test_gloo_numerics.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: gloo's ``kMaxSegmentSize`` (bytes)
MAX_SEGMENT = 1024 * 1024

#: gloo's reduction functions ``fn(a, b)`` as ``gloo/math.h`` writes them (``std::min``: ``b < a ? b : a``;
#: ``std::max``: ``a < b ? b : a``); AVG is a SUM that torch divides afterwards
FUNCTIONS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "sum": lambda a, b: a + b,
    "avg": lambda a, b: a + b,
    "product": lambda a, b: a * b,
    "min": lambda a, b: torch.where(b < a, b, a),
    "max": lambda a, b: torch.where(a < b, b, a),
}


def _round_up(value: int, multiple: int) -> int:
    return value if value % multiple == 0 else value + multiple - value % multiple


def ring_all_reduce(inputs: list[torch.Tensor], op: str) -> list[torch.Tensor]:
    """Every rank's buffer after ``gloo::allreduce`` (ring) of the flat ``inputs``, one per rank."""
    size, fn = len(inputs), FUNCTIONS[op]
    out = [x.clone() for x in inputs]
    elem = inputs[0].element_size()
    total = inputs[0].numel() * elem
    if total == 0 or size == 1:
        return out
    max_segment_bytes = elem * max(1, MAX_SEGMENT // elem)
    num_segments = _round_up(max((total + max_segment_bytes - 1) // max_segment_bytes, size * 2), size)
    per_rank = num_segments // size
    segment_bytes = _round_up((total + num_segments - 1) // num_segments, elem)

    def offsets(rank: int, i: int, send_base: int, recv_base: int) -> tuple[int, int, int, int]:
        send = (((rank + send_base) * per_rank + i) * segment_bytes) % (num_segments * segment_bytes)
        recv = (((rank + recv_base) * per_rank + i) * segment_bytes) % (num_segments * segment_bytes)
        return send, recv, min(segment_bytes, total - send), min(segment_bytes, total - recv)

    def elems(offset: int, length: int) -> slice:
        return slice(offset // elem, (offset + length) // elem)

    # reduce/scatter: rank r sends to r - 1 and receives from r + 1
    tmp: dict[tuple[int, int], torch.Tensor] = {}  # (receiving rank, iteration) -> segment
    for i in range(num_segments - per_rank + 2):
        for rank in range(size):
            if i >= 2:
                _, recv, _, recv_len = offsets(rank, i - 2, 1, 2)
                if recv_len > 0:
                    region = elems(recv, recv_len)
                    out[rank][region] = fn(out[rank][region], tmp.pop((rank, i - 2)))
            if i < num_segments - per_rank:
                send, _, send_len, _ = offsets(rank, i, 1, 2)
                if send_len > 0:
                    tmp[((rank - 1) % size, i)] = out[rank][elems(send, send_len)].clone()
    # allgather
    for i in range(num_segments - per_rank + 2):
        for rank in range(size):
            if i >= 2:
                _, recv, _, recv_len = offsets(rank, i - 2, 0, 1)
                if recv_len > 0:
                    out[rank][elems(recv, recv_len)] = tmp.pop((rank, i - 2))
            if i < num_segments - per_rank:
                send, _, send_len, _ = offsets(rank, i, 0, 1)
                if send_len > 0:
                    tmp[((rank - 1) % size, i)] = out[rank][elems(send, send_len)].clone()
    return out


def ring_reduce(inputs: list[torch.Tensor], root: int, op: str) -> torch.Tensor:
    """The root's buffer after ``gloo::reduce`` of the flat ``inputs`` (torch passes only an output, so
    gloo's ``in`` is its ``out``)."""
    size, fn = len(inputs), FUNCTIONS[op]
    out = [x.clone() for x in inputs]
    elem = inputs[0].element_size()
    total = inputs[0].numel() * elem
    if total == 0 or size == 1:
        return out[root]
    max_segment_size = elem * (MAX_SEGMENT // elem)
    segment_bytes = _round_up(min((total + size * 2 - 1) // (size * 2), max_segment_size), elem)
    num_segments = _round_up(max((total + segment_bytes - 1) // segment_bytes, size * 2), size)
    per_rank = num_segments // size
    chunk_bytes = per_rank * segment_bytes

    def offsets(rank: int, i: int) -> tuple[int, int, int, int]:
        send = (((rank + 1) * per_rank + i) * segment_bytes) % (num_segments * segment_bytes)
        recv = (((rank + 2) * per_rank + i) * segment_bytes) % (num_segments * segment_bytes)
        return send, recv, min(segment_bytes, total - send), min(segment_bytes, total - recv)

    def elems(offset: int, length: int) -> slice:
        return slice(offset // elem, (offset + length) // elem)

    tmp: dict[tuple[int, int], torch.Tensor] = {}
    for i in range(num_segments):
        for rank in range(size):
            if i >= 2:
                _, recv, _, recv_len = offsets(rank, i - 2)
                if recv_len > 0:
                    region = elems(recv, recv_len)
                    out[rank][region] = fn(out[rank][region], tmp.pop((rank, i - 2)))
            if i < num_segments - 2:
                send, _, send_len, _ = offsets(rank, i)
                if send_len > 0:
                    tmp[((rank - 1) % size, i)] = out[rank][elems(send, send_len)].clone()
    result = out[root].clone()
    for rank in range(size):  # the root receives every other rank's chunk
        offset = rank * chunk_bytes
        length = min(chunk_bytes, total - offset)
        if rank != root and length > 0:
            result[elems(offset, length)] = out[rank][elems(offset, length)]
    return result


def _real(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t).reshape(-1) if t.is_complex() else t.reshape(-1)


def _complex_like(flat: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return (torch.view_as_complex(flat.view(-1, 2)) if like.is_complex() else flat).view(like.shape)


def all_reduce(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    """``dist.all_reduce``: torch's front end hands gloo a complex tensor's real view, and AVG divides it."""
    out = ring_all_reduce([_real(t) for t in inputs], op)[0]
    if op == "avg":
        out = out / len(inputs)
    return _complex_like(out, inputs[0])


def reduce(inputs: list[torch.Tensor], root: int, op: str) -> torch.Tensor:
    """``dist.reduce``: gloo reduces the real view; AVG divides the tensor itself (complex division)."""
    out = _complex_like(ring_reduce([_real(t) for t in inputs], root, op), inputs[0])
    return out / len(inputs) if op == "avg" else out


def _all_reduce_divided(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    """An all-reduce run by ProcessGroupGloo itself on a tensor copy: AVG divides that tensor (for a complex
    one, a complex division; the front end's ``all_reduce`` divides the real view instead)."""
    out = _complex_like(ring_all_reduce([_real(t) for t in inputs], op)[0], inputs[0])
    return out / len(inputs) if op == "avg" else out


def reduce_scatter_tensor(inputs: list[torch.Tensor], op: str) -> list[torch.Tensor]:
    """``dist.reduce_scatter_tensor``: ProcessGroupGloo all-reduces a copy of the whole input, and rank r
    keeps chunk r."""
    return list(_all_reduce_divided(inputs, op).chunk(len(inputs)))


def reduce_scatter(input_lists: list[list[torch.Tensor]], op: str) -> list[torch.Tensor]:
    """``dist.reduce_scatter``: one all-reduce per input of the lists; rank r keeps input r's."""
    n = len(input_lists)
    return [_all_reduce_divided([input_lists[q][r] for q in range(n)], op) for r in range(n)]
