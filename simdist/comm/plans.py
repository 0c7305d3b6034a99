"""Per-collective plans: which flat buffers each rank's messages read and write, and what happens at the end.

A :class:`Plan` turns the matched calls of one collective into per-rank flat buffers for the algorithm
schedule, plus a ``finish(r)`` step run when rank ``r``'s part completes (copying out of internal buffers,
dividing for AVG). Buffers are views of the user's tensors wherever the collective writes them in place, so
data lands in the user's memory at the simulated times of the messages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from simdist.algorithms import Algorithm, Msg, Problem, offsets_from_sizes, reduce_op
from simdist.algorithms.gloo_order import Span, all_reduce_block, reduce_block


@dataclass
class Plan:
    """Buffers and schedule of one collective instance."""

    msgs: Sequence[Msg]
    src: list[torch.Tensor | None]
    dst: list[torch.Tensor | None]
    reduce_op: str = "sum"
    finish: list[Callable[[], None]] = field(default_factory=list)
    #: for a reducing collective, per rank: the elements of its ``dst`` buffer that hold its result, and
    #: where gloo's ring reduces them (an empty list for a rank without a result); None for the others
    gloo_spans: list[list[Span]] | None = None


def _gloo_span(
    t: torch.Tensor,
    n: int,
    lo: int,
    hi: int,
    base: int,
    ring: int,
    block: Callable[[int, int, int], int] = all_reduce_block,
) -> Span:
    """Elements ``[lo, hi)`` of a flat buffer of ``t``'s type as elements ``[base, ...)`` of a gloo ring of
    ``ring`` elements on ``n`` ranks, counted as gloo counts them: a complex tensor's real view."""
    f = 2 if t.is_complex() else 1
    return Span(lo * f, hi * f, base * f, block(n, ring * f, t.element_size() // f))


def raw_flat(t: torch.Tensor) -> torch.Tensor:
    """The ``numel`` elements of memory starting at ``t``'s first element, as gloo reads and writes them.

    For a contiguous tensor that is ``t.view(-1)``. For the tensors it works on in place (all_reduce,
    broadcast, reduce, the output of all_gather_into_tensor and scatter, point-to-point) gloo hands its
    transport the data pointer and element count and ignores strides, so for a non-contiguous view it works
    on the block of memory the view starts at, not on the elements the view shows (an all-reduce of a
    transposed tensor still comes out right; a broadcast of a column does not). The list-API inputs of
    all_gather, gather and reduce_scatter it copies as shown. simdist does the same, so simulated results
    equal gloo's, and warns (see ``simdist.c10d.arguments.check_tensor``).
    """
    if t.is_contiguous():
        return t.view(-1)
    n = t.numel()
    capacity = t.untyped_storage().nbytes() // t.element_size()
    if t.storage_offset() + n > capacity:
        raise ValueError(
            f"a non-contiguous tensor of shape {tuple(t.shape)} and strides {t.stride()} does not own "
            f"{n} elements of memory from its first element (gloo would read past its storage); "
            f"pass tensor.contiguous()"
        )
    return t.as_strided((n,), (1,), t.storage_offset())


def _finisher(ws: torch.Tensor, op: str | None = None, n: int = 1) -> Callable[[], None]:
    """Finish reduce op ``op`` on ``ws`` (the user's memory) at the end: AVG divides by the group size ``n``;
    nothing otherwise, nor without an op."""
    reduction = reduce_op(op) if op is not None else None

    def finish() -> None:
        if reduction is not None:
            reduction.finish(ws, n)

    return finish


def plan_all_reduce(tensors: list[torch.Tensor], op: str, algo: Algorithm) -> Plan:
    """In place on each rank's tensor (``tensors[r]``; a coalesced call passes one flat buffer per rank)."""
    n = len(tensors)
    bufs = [raw_flat(t) for t in tensors]
    fins = [_finisher(ws, op, n) for ws in bufs]
    msgs = algo.schedule(Problem(n, bufs[0].numel(), bufs[0].element_size()))
    # gloo: one ring all-reduce of the whole buffer (all_reduce_coalesced: of the tensors flattened into one)
    numel = bufs[0].numel()
    spans = [[_gloo_span(bufs[0], n, 0, numel, 0, numel)] for _ in range(n)]
    return Plan(msgs, bufs, bufs, op, fins, spans)


def _sparse_parts(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The coalesced indices (int64, ``sparse_dim x nnz``) and values of a sparse COO tensor."""
    c = t.detach().coalesce()
    return c.indices(), c.values()


def sparse_payload_bytes(t: torch.Tensor) -> int:
    """Bytes of a sparse COO tensor's indices and values, what one rank contributes to a sparse all-reduce."""
    return t._indices().numel() * 8 + t._values().numel() * t.element_size()


def plan_all_reduce_sparse(tensors: list[torch.Tensor], algo: Algorithm) -> Plan:
    """Each rank's sparse COO tensor becomes the coalesced sum of every rank's.

    Like gloo, the ranks all-gather their indices and values (serialised as bytes, each rank's chunk padded
    to the largest), and each rank sums what it received, in gloo's order.
    """
    n = len(tensors)
    parts = [_sparse_parts(t) for t in tensors]
    payloads = []
    for idx, val in parts:
        raw = [idx.contiguous().reshape(-1).view(torch.uint8), val.contiguous().reshape(-1).view(torch.uint8)]
        payloads.append(torch.cat(raw))
    m = max(p.numel() for p in payloads)
    bufs, fins = [], []
    for r, p in enumerate(payloads):
        ws = torch.zeros(n * m, dtype=torch.uint8)
        ws[r * m : r * m + p.numel()].copy_(p)
        bufs.append(ws)
        fins.append(_sparse_sum_into(ws, m, parts, tensors[r]))
    msgs = algo.schedule(Problem(n, n * m, 1))
    return Plan(msgs, bufs, bufs, "sum", fins)


def _sparse_sum_into(ws: torch.Tensor, m: int, parts: list, out: torch.Tensor) -> Callable[[], None]:
    """Decode every rank's chunk of ``ws`` (shapes from ``parts``) and write the coalesced sum into ``out``."""

    def finish() -> None:
        idxs, vals = [], []
        for k, (idx, val) in enumerate(parts):
            chunk = ws[k * m : (k + 1) * m]
            ni = idx.numel() * 8
            idxs.append(chunk[:ni].clone().view(torch.int64).view(idx.shape))
            nv = val.numel() * val.element_size()
            vals.append(chunk[ni : ni + nv].clone().view(val.dtype).view(val.shape))
        # gloo adds the ranks' tensors one after another, in rank order, then coalesces: the order in which
        # values at one index are summed is that one (the indices come from coalesced tensors: valid)
        total = torch.sparse_coo_tensor(idxs[0], vals[0], out.shape, check_invariants=False)
        for idx, val in zip(idxs[1:], vals[1:]):
            total = total + torch.sparse_coo_tensor(idx, val, out.shape, check_invariants=False)
        with torch.no_grad():
            out.copy_(total.coalesce())

    return finish


def plan_broadcast(tensors: list[torch.Tensor], root: int, algo: Algorithm) -> Plan:
    """Root's tensor is copied into every rank's tensor."""
    n = len(tensors)
    bufs = [raw_flat(t) for t in tensors]
    fins = [_finisher(ws) for ws in bufs]
    msgs = algo.schedule(Problem(n, bufs[0].numel(), bufs[0].element_size(), root))
    return Plan(msgs, bufs, bufs, "sum", fins)


def plan_reduce(tensors: list[torch.Tensor], root: int, op: str, algo: Algorithm) -> Plan:
    """Root's tensor receives the reduction; other ranks' tensors are left unchanged."""
    n = len(tensors)
    bufs, fins = [], []
    for r, t in enumerate(tensors):
        if r == root:
            ws = raw_flat(t)
            fins.append(_finisher(ws, op, n))
        else:
            ws = raw_flat(t).clone()
            fins.append(lambda: None)
        bufs.append(ws)
    msgs = algo.schedule(Problem(n, bufs[0].numel(), bufs[0].element_size(), root))
    numel = bufs[0].numel()
    spans = [
        [_gloo_span(bufs[0], n, 0, numel, 0, numel, reduce_block)] if r == root else [] for r in range(n)
    ]
    return Plan(msgs, bufs, bufs, op, fins, spans)


def plan_all_gather(
    inputs: list[torch.Tensor], outputs: list[list[torch.Tensor] | torch.Tensor], algo: Algorithm
) -> Plan:
    """Rank r's input lands in chunk r of every rank's output (a flat tensor or a list of n tensors)."""
    n = len(inputs)
    m = inputs[0].numel()
    bufs, fins = [], []
    for r, (inp, out) in enumerate(zip(inputs, outputs)):
        if isinstance(out, torch.Tensor):
            ws = raw_flat(out)
            fin = _finisher(ws)
        else:
            ws = torch.empty(n * m, dtype=inp.dtype, device=inp.device)
            fin = _copy_out_chunks(ws, out)
        ws[r * m : (r + 1) * m].copy_(inp.reshape(-1))  # gloo copies list-API inputs as shown
        bufs.append(ws)
        fins.append(fin)
    msgs = algo.schedule(Problem(n, n * m, inputs[0].element_size()))
    return Plan(msgs, bufs, bufs, "sum", fins)


def _copy_out_chunks(ws: torch.Tensor, outs: list[torch.Tensor], order: list[int] | None = None) -> Callable[[], None]:
    def finish() -> None:
        off = 0
        idx = order if order is not None else list(range(len(outs)))
        for i in idx:
            o = outs[i]
            o.copy_(ws[off : off + o.numel()].view(o.shape))
            off += o.numel()

    return finish


def plan_reduce_scatter(
    inputs: list[list[torch.Tensor] | torch.Tensor],
    outputs: list[torch.Tensor],
    op: str,
    algo: Algorithm,
    parts: list[int] | None = None,
) -> Plan:
    """Chunk r of the element-wise reduction of every rank's input lands in rank r's output.

    ``parts``, for a coalesced call, are the element counts of each tensor's chunk in a rank's chunk (rank r's
    chunk is chunk r of every tensor, one after another).
    """
    n = len(outputs)
    m = outputs[0].numel()
    bufs, fins = [], []
    for r, (inp, out) in enumerate(zip(inputs, outputs)):
        if isinstance(inp, torch.Tensor):
            ws = raw_flat(inp).clone()
        else:
            ws = torch.cat([t.reshape(-1) for t in inp]) if inp else torch.empty(0, dtype=out.dtype, device=out.device)
        bufs.append(ws)
        fins.append(_chunk_to(ws, r * m, m, out, op, n))
    msgs = algo.schedule(Problem(n, n * m, outputs[0].element_size()))
    spans = _reduce_scatter_spans(isinstance(inputs[0], torch.Tensor), outputs[0], n, parts)
    return Plan(msgs, bufs, bufs, op, fins, spans)


def _reduce_scatter_spans(flat: bool, out: torch.Tensor, n: int, parts: list[int] | None) -> list[list[Span]]:
    """Where gloo reduces each rank's chunk: ``reduce_scatter_tensor`` all-reduces the whole input (rank r
    keeps chunk r), ``reduce_scatter`` all-reduces each input of the list apart (rank r keeps input r's), and
    a coalesced call all-reduces each tensor apart."""
    m = out.numel()
    if parts is None:
        parts = [m]
    assert sum(parts) == m, f"chunk parts {parts} do not make a chunk of {m} elements"
    spans = []
    for r in range(n):
        mine, lo = [], r * m
        for part in parts:
            base, ring = (r * part, n * part) if flat else (0, part)
            mine.append(_gloo_span(out, n, lo, lo + part, base, ring))
            lo += part
        spans.append(mine)
    return spans


def _chunk_to(
    ws: torch.Tensor, lo: int, m: int, out: torch.Tensor, op: str | None = None, n: int = 1
) -> Callable[[], None]:
    reduction = reduce_op(op) if op is not None else None

    def finish() -> None:
        chunk = ws[lo : lo + m]
        if reduction is not None:
            reduction.finish(chunk, n)
        out.copy_(chunk.view(out.shape))

    return finish


def plan_gather(inputs: list[torch.Tensor], root_outputs: list[torch.Tensor], root: int, algo: Algorithm) -> Plan:
    """Every rank's input lands in ``root_outputs[rank]`` on the root (relative-rank buffers, rotated)."""
    n = len(inputs)
    m = inputs[0].numel()
    bufs, fins = [None] * n, [None] * n
    for r, inp in enumerate(inputs):
        v = (r - root) % n
        ws = torch.empty(n * m, dtype=inp.dtype, device=inp.device)
        ws[v * m : (v + 1) * m].copy_(inp.reshape(-1))
        bufs[v] = ws
        if r == root:
            order = [(v2 + root) % n for v2 in range(n)]
            fins[r] = _copy_out_chunks(ws, root_outputs, order)
        else:
            fins[r] = lambda: None
    msgs = algo.schedule(Problem(n, n * m, inputs[0].element_size(), root))
    bufs = [bufs[(r - root) % n] for r in range(n)]
    return Plan(msgs, bufs, bufs, "sum", fins)


def plan_scatter(root_inputs: list[torch.Tensor], outputs: list[torch.Tensor], root: int, algo: Algorithm) -> Plan:
    """``root_inputs[rank]`` on the root lands in each rank's output."""
    n = len(outputs)
    m = outputs[0].numel()
    bufs, fins = [], []
    for r, out in enumerate(outputs):
        v = (r - root) % n
        if r == root:
            ws = torch.cat([raw_flat(root_inputs[(v2 + root) % n]) for v2 in range(n)])
        else:
            ws = torch.empty(n * m, dtype=out.dtype, device=out.device)
        bufs.append(ws)
        fins.append(_chunk_to(ws, v * m, m, raw_flat(out)))  # gloo writes the output's raw memory
    msgs = algo.schedule(Problem(n, n * m, outputs[0].element_size(), root))
    return Plan(msgs, bufs, bufs, "sum", fins)


def plan_all_to_all(
    inputs: list[torch.Tensor],
    outputs: list[torch.Tensor],
    in_splits: list[list[int]],
    out_splits: list[list[int]],
    algo: Algorithm,
) -> Plan:
    """Rank r's input block j lands in rank j's output block r (blocks along dim 0, sizes in rows)."""
    n = len(inputs)
    src, dst, fins, in_el, out_el = [], [], [], [], []
    for r in range(n):
        inp, out = inputs[r], outputs[r]
        row_in = inp[0].numel() if inp.dim() > 0 and inp.shape[0] else 1
        row_out = out[0].numel() if out.dim() > 0 and out.shape[0] else 1
        in_el.append([s * row_in for s in in_splits[r]])
        out_el.append([s * row_out for s in out_splits[r]])
        s_ws = raw_flat(inp).clone()
        d_ws = raw_flat(out)
        src.append(s_ws)
        dst.append(d_ws)
        fins.append(_finisher(d_ws))
        i_off = offsets_from_sizes(in_el[r])
        o_off = offsets_from_sizes(out_el[r])
        d_ws[o_off[r] : o_off[r + 1]].copy_(s_ws[i_off[r] : i_off[r + 1]])
    counts = Problem(n, sum(in_el[0]), inp.element_size(), 0, tuple(map(tuple, in_el)), tuple(map(tuple, out_el)))
    msgs = algo.schedule(counts)
    return Plan(msgs, src, dst, "sum", fins)


def plan_barrier(n: int, algo: Algorithm) -> Plan:
    """A one-element all-reduce on internal buffers (what NCCL's barrier does)."""
    bufs = [torch.zeros(1) for _ in range(n)]
    msgs = algo.schedule(Problem(n, 1, 4))
    return Plan(msgs, bufs, bufs, "sum", [lambda: None for _ in range(n)])
