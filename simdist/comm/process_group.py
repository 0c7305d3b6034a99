"""The ``"simdist"`` torch.distributed backend: a Python ``ProcessGroup`` whose collectives run in simulated time.

One ``SimProcessGroup`` object exists per (rank, group); the ranks of a group share a :class:`GroupState`.
Each call records the user's call site, joins the group's matching instance and returns a :class:`SimWork`;
torch's own front end (``dist.all_reduce`` and friends) validates arguments, converts complex tensors and
calls ``wait()`` for synchronous calls.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
import torch.distributed as dist

from simdist.comm import algorithms, collectives
from simdist.comm.group import Call, GroupState, Instance, dtype_name
from simdist.comm.work import SimWork
from simdist.engine.internal import internal
from simdist.trace.trace import Span

_RED = dist.ReduceOp.RedOpType
_REDUCE_NAMES = {
    _RED.SUM: "sum",
    _RED.AVG: "avg",
    _RED.PRODUCT: "product",
    _RED.MIN: "min",
    _RED.MAX: "max",
    _RED.BAND: "band",
    _RED.BOR: "bor",
    _RED.BXOR: "bxor",
}


def reduce_op_name(op: Any) -> str:
    """``"sum"`` for ``ReduceOp.SUM``; a clear error for ops simdist does not implement."""
    kind = getattr(op, "op", op)
    name = _REDUCE_NAMES.get(kind)
    if name is None:
        raise ValueError(f"simdist does not implement reduce op {op}; use SUM, AVG, PRODUCT, MIN, MAX or a bitwise op")
    return name


#: element types gloo can move (it answers "Invalid scalar type" for the others); complex tensors reach the
#: backend as real views (torch's front end makes them) except in reduce, which passes them through
SUPPORTED_DTYPES = frozenset(
    {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool,
     torch.complex32, torch.complex64, torch.complex128}
)


def _check_tensor(t: Any, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise RuntimeError(
            f"Invalid scalar type: {what} has dtype {t.dtype}, which gloo cannot communicate either; "
            f"supported: {', '.join(sorted(dtype_name(d) for d in SUPPORTED_DTYPES))} (and complex via real views). "
            f"Cast the tensor first."
        )
    if t.layout != torch.strided:
        raise ValueError(f"{what}: only dense (strided) tensors are supported, got layout {t.layout}")
    if t.device.type not in ("cpu", "meta"):
        raise ValueError(f"{what}: simulated ranks hold CPU tensors, got a tensor on {t.device}")
    if not t.is_contiguous():
        warnings.warn(
            f"{what} is not contiguous (shape {tuple(t.shape)}, strides {t.stride()}): like gloo, simdist "
            f"reads and writes its {t.numel()} elements as one block of memory from its first element, which "
            f"is what the view shows only if the view covers that whole block. NCCL rejects such tensors; "
            f"pass tensor.contiguous() and copy the result back.",
            stacklevel=4,
        )
    return t


def _sig_tensor(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), dtype_name(t.dtype))


class SimProcessGroup(dist.ProcessGroup):
    """One rank's handle on one simulated process group."""

    def __init__(self, sim: Any, state: GroupState, group_rank: int) -> None:
        super().__init__(group_rank, state.size)
        self.sim = sim
        self.state = state
        self.grank = group_rank


    # ------------------------------------------------------------------ identity
    def getBackendName(self) -> str:
        return "simdist"

    @property
    def group_name(self) -> str:
        """The group's name, the same on every member rank (functional collectives look groups up by it)."""
        return self.state.name

    @property
    def global_rank(self) -> int:
        """This rank's global rank."""
        return self.state.global_ranks[self.grank]

    # ------------------------------------------------------------------ machinery
    def _issue(
        self,
        op: str,
        signature: tuple,
        outputs: list[torch.Tensor],
        data: dict[str, Any],
        reads: list[torch.Tensor] = (),  # type: ignore[assignment]
        writes: list[torch.Tensor] = (),  # type: ignore[assignment]
    ) -> SimWork:
        """Issue this rank's part of collective ``op``; ``reads``/``writes`` are the user buffers it owns until waited."""
        with internal():
            return self._issue_internal(op, signature, outputs, data, reads, writes)

    def _issue_internal(
        self, op: str, signature: tuple, outputs: list[torch.Tensor], data: dict[str, Any], reads: Any, writes: Any
    ) -> SimWork:
        sim = self.sim
        sim.settle()
        site = sim.call_site()
        seq = self.state._seq[self.grank]
        desc = (
            f"rank {self.global_rank} waits in {op} #{seq} on group {self.state.name or 'default'} "
            f"(issued at {site})"
        )
        work = SimWork(sim, desc, outputs, self.state.timeout)
        work.group_state, work.seq, work.rank = self.state, seq, self.global_rank
        if sim.races.enabled:
            sim.races.issue(self.global_rank, work, op, seq, self.state.name, site, list(reads), list(writes))
        call = Call(op, self.grank, tuple(signature), site, work, data)
        self.state.join(call, self._start)
        return work

    def _start(self, inst: Instance) -> None:
        sim = self.sim
        st = self.state
        n = st.size
        calls = [inst.calls[r] for r in range(n)]
        op = calls[0].op
        d = [c.data for c in calls]
        nbytes = d[0].get("nbytes", 0)
        coll = op if op in algorithms.SUPPORTED else _ALGO_FAMILY.get(op, op)
        algo = algorithms.effective_algorithm(coll, sim.algorithm_for(st, coll, nbytes), n)
        if op in ("all_reduce", "all_reduce_coalesced"):
            plan = collectives.plan_all_reduce([x["tensor"] for x in d], d[0]["reduce_op"], algo)
        elif op == "broadcast":
            plan = collectives.plan_broadcast([x["tensor"] for x in d], d[0]["root"], algo)
        elif op == "reduce":
            plan = collectives.plan_reduce([x["tensor"] for x in d], d[0]["root"], d[0]["reduce_op"], algo)
        elif op in ("all_gather", "all_gather_into_tensor"):
            plan = collectives.plan_all_gather([x["input"] for x in d], [x["output"] for x in d], algo)
        elif op in ("reduce_scatter", "reduce_scatter_tensor"):
            plan = collectives.plan_reduce_scatter(
                [x["input"] for x in d], [x["output"] for x in d], d[0]["reduce_op"], algo
            )
        elif op == "gather":
            root = d[0]["root"]
            plan = collectives.plan_gather([x["input"] for x in d], d[root]["outputs"], root, algo)
        elif op == "scatter":
            root = d[0]["root"]
            plan = collectives.plan_scatter(d[root]["inputs"], [x["output"] for x in d], root, algo)
        elif op in ("all_to_all_single", "all_to_all"):
            plan = _plan_all_to_all(calls)
        elif op == "barrier":
            plan = collectives.plan_barrier(n, algo)
        else:  # pragma: no cover - every op issued above is handled
            raise AssertionError(op)
        name = f"{sim.progress}:{op}"
        start_time = sim.env.now
        streams = [st.stream_of(inst, r) for r in range(n)]

        def rank_done(r: int) -> None:
            plan.finish[r]()
            g = st.global_ranks[r]
            c = calls[r]
            sim.trace.add(
                Span(
                    g,
                    streams[r],
                    name,
                    start_time,
                    sim.env.now,
                    {
                        "Collective name": op,
                        "In msg nelems": c.data.get("in_nelems", 0),
                        "Out msg nelems": c.data.get("out_nelems", 0),
                        "Group size": n,
                        "dtype": c.data.get("dtype", ""),
                        "Process Group Name": st.name or "default",
                        "Seq": inst.seq,
                        "algorithm": algo,
                        "issued": c.work.issued_at,
                    },
                )
            )
            c.work.complete()
            st.rank_done(inst, r)

        from simdist.comm.executor import ScheduleRun

        run = ScheduleRun(sim, plan.msgs, n, plan.src, plan.dst, plan.reduce_op, st.global_ranks, rank_done, streams, name)
        run.start()

    # ------------------------------------------------------------------ collectives
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> SimWork:
        (t,) = tensors
        _check_tensor(t, "all_reduce tensor")
        red = reduce_op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        return self._issue(
            "all_reduce",
            (("shape", tuple(t.shape)), ("dtype", dtype_name(t.dtype)), ("op", red)),
            [t],
            {"tensor": t, "reduce_op": red, **_meta(t, t)},
            writes=[t],
        )

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> SimWork:
        for t in tensors:
            _check_tensor(t, "all_reduce_coalesced tensor")
        if len({t.dtype for t in tensors}) > 1:
            raise ValueError("all_reduce_coalesced: all tensors must have the same dtype")
        red = reduce_op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        with internal():
            flat = torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.empty(0)
        work = self._issue(
            "all_reduce_coalesced",
            (("shapes", tuple(tuple(t.shape) for t in tensors)), ("dtype", dtype_name(flat.dtype)), ("op", red)),
            list(tensors),
            {"tensor": flat, "reduce_op": red, **_meta(flat, flat)},
            writes=list(tensors),
        )
        _scatter_back_on_completion(work, flat, tensors)
        return work

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> SimWork:
        (t,) = tensors
        _check_tensor(t, "broadcast tensor")
        root = opts.rootRank
        return self._issue(
            "broadcast",
            (("shape", tuple(t.shape)), ("dtype", dtype_name(t.dtype)), ("root", root)),
            [t],
            {"tensor": t, "root": root, **_meta(t, t)},
            reads=[t] if self.grank == root else [],
            writes=[] if self.grank == root else [t],
        )

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> SimWork:
        (t,) = tensors
        _check_tensor(t, "reduce tensor")
        red = reduce_op_name(opts.reduceOp)
        root = opts.rootRank
        return self._issue(
            "reduce",
            (("shape", tuple(t.shape)), ("dtype", dtype_name(t.dtype)), ("op", red), ("root", root)),
            [t],
            {"tensor": t, "root": root, "reduce_op": red, **_meta(t, t)},
            reads=[] if self.grank == root else [t],
            writes=[t] if self.grank == root else [],
        )

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None) -> SimWork:
        (outs,) = output_tensors
        (inp,) = input_tensors
        _check_tensor(inp, "all_gather input")
        n = self.state.size
        if len(outs) != n:
            raise ValueError(f"all_gather: tensor_list has {len(outs)} tensors, the group has {n} ranks")
        for o in outs:
            _check_tensor(o, "all_gather output")
            if o.numel() != inp.numel() or o.dtype != inp.dtype:
                raise ValueError(
                    f"all_gather: every output tensor must match the input ({tuple(inp.shape)}, {inp.dtype}); "
                    f"got {tuple(o.shape)}, {o.dtype}"
                )
        return self._issue(
            "all_gather",
            (("shape", tuple(inp.shape)), ("dtype", dtype_name(inp.dtype))),
            list(outs),
            {"input": inp, "output": list(outs), **_meta(inp, inp, out_nelems=inp.numel() * n)},
            reads=[inp],
            writes=list(outs),
        )

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> SimWork:
        _check_tensor(output, "all_gather_into_tensor output")
        _check_tensor(input, "all_gather_into_tensor input")
        n = self.state.size
        if output.numel() != n * input.numel() or output.dtype != input.dtype:
            raise ValueError(
                f"all_gather_into_tensor: output must have world_size ({n}) x input.numel() = "
                f"{n * input.numel()} elements of {input.dtype}; got {output.numel()} of {output.dtype}"
            )
        return self._issue(
            "all_gather_into_tensor",
            (("shape", tuple(input.shape)), ("dtype", dtype_name(input.dtype))),
            [output],
            {"input": input, "output": output, **_meta(input, input, out_nelems=output.numel())},
            reads=[input],
            writes=[output],
        )

    _allgather_base = all_gather_single

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any) -> SimWork:
        (out,) = output_tensors
        (ins,) = input_tensors
        _check_tensor(out, "reduce_scatter output")
        n = self.state.size
        if len(ins) != n:
            raise ValueError(f"reduce_scatter: input_list has {len(ins)} tensors, the group has {n} ranks")
        for t in ins:
            _check_tensor(t, "reduce_scatter input")
            if t.numel() != out.numel() or t.dtype != out.dtype:
                raise ValueError(
                    f"reduce_scatter: every input must match the output ({tuple(out.shape)}, {out.dtype}); "
                    f"got {tuple(t.shape)}, {t.dtype}"
                )
        red = reduce_op_name(opts.reduceOp)
        return self._issue(
            "reduce_scatter",
            (("shape", tuple(out.shape)), ("dtype", dtype_name(out.dtype)), ("op", red)),
            [out],
            {"input": list(ins), "output": out, "reduce_op": red, **_meta(out, out, in_nelems=out.numel() * n)},
            reads=list(ins),
            writes=[out],
        )

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> SimWork:
        _check_tensor(output, "reduce_scatter_tensor output")
        _check_tensor(input, "reduce_scatter_tensor input")
        n = self.state.size
        if input.numel() != n * output.numel() or output.dtype != input.dtype:
            raise ValueError(
                f"reduce_scatter_tensor: input must have world_size ({n}) x output.numel() = "
                f"{n * output.numel()} elements of {output.dtype}; got {input.numel()} of {input.dtype}"
            )
        red = reduce_op_name(opts.reduceOp)
        return self._issue(
            "reduce_scatter_tensor",
            (("shape", tuple(output.shape)), ("dtype", dtype_name(output.dtype)), ("op", red)),
            [output],
            {"input": input, "output": output, "reduce_op": red, **_meta(input, output)},
            reads=[input],
            writes=[output],
        )

    _reduce_scatter_base = reduce_scatter_single

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any) -> SimWork:
        (inp,) = input_tensors
        _check_tensor(inp, "gather input")
        root = opts.rootRank
        n = self.state.size
        outs = output_tensors[0] if output_tensors else []
        if self.grank == root:
            if len(outs) != n:
                raise ValueError(f"gather: gather_list on the root has {len(outs)} tensors, the group has {n} ranks")
            for o in outs:
                _check_tensor(o, "gather output")
                if o.numel() != inp.numel() or o.dtype != inp.dtype:
                    raise ValueError(f"gather: output {tuple(o.shape)} {o.dtype} does not match input {tuple(inp.shape)} {inp.dtype}")
        return self._issue(
            "gather",
            (("shape", tuple(inp.shape)), ("dtype", dtype_name(inp.dtype)), ("root", root)),
            list(outs),
            {"input": inp, "outputs": list(outs), "root": root, **_meta(inp, inp)},
            reads=[inp],
            writes=list(outs),
        )

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any) -> SimWork:
        (out,) = output_tensors
        _check_tensor(out, "scatter output")
        root = opts.rootRank
        n = self.state.size
        ins = input_tensors[0] if input_tensors else []
        if self.grank == root:
            if len(ins) != n:
                raise ValueError(f"scatter: scatter_list on the root has {len(ins)} tensors, the group has {n} ranks")
            for t in ins:
                _check_tensor(t, "scatter input")
                if t.numel() != out.numel() or t.dtype != out.dtype:
                    raise ValueError(f"scatter: input {tuple(t.shape)} {t.dtype} does not match output {tuple(out.shape)} {out.dtype}")
        return self._issue(
            "scatter",
            (("shape", tuple(out.shape)), ("dtype", dtype_name(out.dtype)), ("root", root)),
            [out],
            {"output": out, "inputs": list(ins), "root": root, **_meta(out, out)},
            reads=list(ins),
            writes=[out],
        )

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> SimWork:
        _check_tensor(output, "all_to_all_single output")
        _check_tensor(input, "all_to_all_single input")
        n = self.state.size
        in_splits = _splits(input, input_split_sizes, n, "input")
        out_splits = _splits(output, output_split_sizes, n, "output")
        if input.dtype != output.dtype:
            raise ValueError(f"all_to_all_single: input dtype {input.dtype} != output dtype {output.dtype}")
        return self._issue(
            "all_to_all_single",
            (("dtype", dtype_name(input.dtype)), ("row", tuple(input.shape[1:]))),
            [output],
            {"input": input, "output": output, "in_splits": in_splits, "out_splits": out_splits, **_meta(input, output)},
            reads=[input],
            writes=[output],
        )

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], opts: Any = None) -> SimWork:
        n = self.state.size
        if len(output_tensors) != n or len(input_tensors) != n:
            raise ValueError(f"all_to_all: expected {n} input and {n} output tensors")
        for t in list(output_tensors) + list(input_tensors):
            _check_tensor(t, "all_to_all tensor")
        dtype = input_tensors[0].dtype
        with internal():
            flat_in = torch.cat([t.reshape(-1) for t in input_tensors])
            flat_out = torch.empty(sum(t.numel() for t in output_tensors), dtype=dtype)
        work = self._issue(
            "all_to_all",
            (("dtype", dtype_name(dtype)),),
            list(output_tensors),
            {
                "input": flat_in,
                "output": flat_out,
                "in_splits": [t.numel() for t in input_tensors],
                "out_splits": [t.numel() for t in output_tensors],
                **_meta(flat_in, flat_out),
            },
            reads=list(input_tensors),
            writes=list(output_tensors),
        )
        _scatter_back_on_completion(work, flat_out, output_tensors)
        return work

    def barrier(self, opts: Any = None) -> SimWork:
        return self._issue("barrier", (), [], {"nbytes": 4})

    # ------------------------------------------------------------------ point to point
    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> SimWork:
        (t,) = tensors
        _check_tensor(t, "send tensor")
        return self._p2p("send", t, dstRank, tag)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> SimWork:
        (t,) = tensors
        _check_tensor(t, "recv tensor")
        return self._p2p("recv", t, srcRank, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> SimWork:
        (t,) = tensors
        _check_tensor(t, "recv tensor")
        return self._p2p("recv", t, None, tag)

    def _p2p(self, kind: str, t: torch.Tensor, peer: int | None, tag: int) -> SimWork:
        with internal():
            return self._p2p_internal(kind, t, peer, tag)

    def _p2p_internal(self, kind: str, t: torch.Tensor, peer: int | None, tag: int) -> SimWork:
        sim = self.sim
        st = self.state
        sim.settle()
        site = sim.call_site()
        me = self.global_rank
        if peer is not None and not 0 <= peer < st.size:
            raise ValueError(f"{kind}: peer rank {peer} is not in the group of size {st.size}")
        if peer is not None and peer == self.grank:
            raise ValueError(f"{kind}: rank {me} cannot {kind} to/from itself")
        g_peer = None if peer is None else st.global_ranks[peer]
        what = f"{'send to' if kind == 'send' else 'recv from'} rank {'any' if g_peer is None else g_peer}"
        desc = f"rank {me} waits in {what} (tag {tag}, {tuple(t.shape)} {dtype_name(t.dtype)}, issued at {site})"
        work = SimWork(sim, desc, [t], st.timeout)
        work.rank = me
        if sim.races.enabled:
            reads, writes = ([t], []) if kind == "send" else ([], [t])
            sim.races.issue(me, work, kind, None, st.name, site, reads, writes)
        if kind == "send":
            sim.p2p.post_send(st, me, g_peer, tag, t, work, site)
        else:
            sim.p2p.post_recv(st, g_peer, me, tag, t, work, site)
        return work


def drain_at_end_of_backward(work: SimWork, taken_by_torch: bool) -> None:
    """Wait, in Python, before a backward pass returns, for works whose future was taken inside it.

    torch's C++ DDP reducer takes the future of each bucket's all-reduce inside backward and waits on it from
    an autograd engine callback, in C++, where a simulated rank cannot hand the baton back. A callback
    queued here, when the first future of a backward is taken, runs before the reducer's (callbacks run in
    queue order, and the reducer queues its own after launching its last bucket) and waits on those works
    through the baton, so they are complete when C++ looks at them. Works whose future nobody takes are
    left alone: they complete whenever the other ranks join them.

    For the race detector, a drained work counts as waited for (its buffers are rank code's again) only if
    torch took its future (``taken_by_torch``: the reducer or one of torch's comm hooks, which C++ waits on)
    or a callback was chained to it (a custom comm hook's ``fut.then(...)``). A future that rank code took
    in a hook and never waited on still owns its buffers after backward, as on real hardware.
    """
    task = torch._C._current_graph_task_id()
    if task == -1:
        return
    from simdist.engine.baton import current_rank_state

    state = current_rank_state()
    pending = state.backward_works
    if pending.get("task") != task:
        pending["task"] = task
        pending["works"] = []

        def drain(works: list[tuple[SimWork, bool]] = pending["works"]) -> None:
            for w, by_torch in works:
                if by_torch or getattr(w.future, "chained", False):
                    w.wait()
                else:
                    w.block_until_done()

        torch.autograd.Variable._execution_engine.queue_callback(drain)
    pending["works"].append((work, taken_by_torch))


_ALGO_FAMILY = {
    "all_reduce_coalesced": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all",
}


def _meta(inp: torch.Tensor, out: torch.Tensor, in_nelems: int | None = None, out_nelems: int | None = None) -> dict:
    return {
        "nbytes": inp.numel() * inp.element_size(),
        "in_nelems": inp.numel() if in_nelems is None else in_nelems,
        "out_nelems": out.numel() if out_nelems is None else out_nelems,
        "dtype": dtype_name(inp.dtype),
    }


def _splits(t: torch.Tensor, sizes: list[int] | None, n: int, what: str) -> list[int]:
    rows = t.shape[0] if t.dim() > 0 else t.numel()
    if not sizes:
        if rows % n:
            raise ValueError(
                f"all_to_all_single: {what} has {rows} rows, not divisible by the group size {n}; pass split sizes"
            )
        return [rows // n] * n
    sizes = list(sizes)
    if len(sizes) != n or sum(sizes) != rows or any(s < 0 for s in sizes):
        raise ValueError(f"all_to_all_single: {what} split sizes {sizes} must be {n} non-negative counts summing to {rows}")
    return sizes


def _plan_all_to_all(calls: list[Call]) -> collectives.Plan:
    n = len(calls)
    for r, c in enumerate(calls):
        for j in range(n):
            sent, expected = c.data["in_splits"][j], calls[j].data["out_splits"][r]
            row_in = c.data["input"].numel() // max(1, sum(c.data["in_splits"]))
            row_out = calls[j].data["output"].numel() // max(1, sum(calls[j].data["out_splits"]))
            if sent * row_in != expected * row_out:
                from simdist.errors import CollectiveMismatchError

                raise CollectiveMismatchError(
                    f"all_to_all: rank {r} sends {sent} rows to rank {j} (at {c.site}) but rank {j} expects "
                    f"{expected} rows from rank {r} (at {calls[j].site})"
                )
    return collectives.plan_all_to_all(
        [c.data["input"] for c in calls],
        [c.data["output"] for c in calls],
        [c.data["in_splits"] for c in calls],
        [c.data["out_splits"] for c in calls],
    )


def _scatter_back_on_completion(work: SimWork, flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy a flat internal buffer back into the user's list of tensors when the work completes."""
    # a partial, not a closure over ``work``: the work must not keep itself alive through a cycle
    work.on_complete = functools.partial(_copy_back, flat, tensors)


def _copy_back(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    off = 0
    for t in tensors:
        t.copy_(flat[off : off + t.numel()].view(t.shape))
        off += t.numel()
