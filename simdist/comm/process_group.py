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

from simdist.comm import ops
from simdist.comm.group import Call, GroupState, Instance
from simdist.comm.internal import internal
from simdist.comm.launch import launch
from simdist.comm.ops import dtype_name
from simdist.comm.work import SimWork

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
        spec: ops.OpSpec,
        outputs: list[torch.Tensor],
        reads: list[torch.Tensor] = (),  # type: ignore[assignment]
        writes: list[torch.Tensor] = (),  # type: ignore[assignment]
    ) -> SimWork:
        """Issue this rank's part of ``spec``; ``reads``/``writes`` are the user buffers it owns until waited."""
        with internal():
            return self._issue_internal(spec, outputs, reads, writes)

    def _issue_internal(self, spec: ops.OpSpec, outputs: list[torch.Tensor], reads: Any, writes: Any) -> SimWork:
        sim = self.sim
        sim.settle()
        site = sim.call_site()
        seq = self.state._seq[self.grank]
        desc = (
            f"rank {self.global_rank} waits in {spec.name} #{seq} on group {self.state.name or 'default'} "
            f"(issued at {site})"
        )
        work = SimWork(sim, desc, outputs, self.state.timeout)
        work.group_state, work.seq, work.rank = self.state, seq, self.global_rank
        if sim.races.enabled:
            sim.races.issue(self.global_rank, work, spec.name, seq, self.state.name, site, list(reads), list(writes))
        call = Call(spec, self.grank, site, work, spec.signature())
        self.state.join(call, self._start)
        return work

    def _start(self, inst: Instance) -> None:
        launch(self.sim, self.state, inst)

    # ------------------------------------------------------------------ collectives
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> SimWork:
        (t,) = tensors
        _check_tensor(t, "all_reduce tensor")
        red = reduce_op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        return self._issue(ops.AllReduce(t, red), [t], writes=[t])

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> SimWork:
        for t in tensors:
            _check_tensor(t, "all_reduce_coalesced tensor")
        if len({t.dtype for t in tensors}) > 1:
            raise ValueError("all_reduce_coalesced: all tensors must have the same dtype")
        red = reduce_op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        with internal():
            flat = torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.empty(0)
        shapes = tuple(tuple(t.shape) for t in tensors)
        work = self._issue(ops.AllReduceCoalesced(shapes, flat, red), list(tensors), writes=list(tensors))
        _scatter_back_on_completion(work, flat, tensors)
        return work

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> SimWork:
        (t,) = tensors
        _check_tensor(t, "broadcast tensor")
        root = opts.rootRank
        mine = self.grank == root
        return self._issue(ops.Broadcast(t, root), [t], reads=[t] if mine else [], writes=[] if mine else [t])

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> SimWork:
        (t,) = tensors
        _check_tensor(t, "reduce tensor")
        red = reduce_op_name(opts.reduceOp)
        root = opts.rootRank
        mine = self.grank == root
        return self._issue(ops.Reduce(t, root, red), [t], reads=[] if mine else [t], writes=[t] if mine else [])

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
        return self._issue(ops.AllGather(inp, tuple(outs)), list(outs), reads=[inp], writes=list(outs))

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> SimWork:
        _check_tensor(output, "all_gather_into_tensor output")
        _check_tensor(input, "all_gather_into_tensor input")
        n = self.state.size
        if output.numel() != n * input.numel() or output.dtype != input.dtype:
            raise ValueError(
                f"all_gather_into_tensor: output must have world_size ({n}) x input.numel() = "
                f"{n * input.numel()} elements of {input.dtype}; got {output.numel()} of {output.dtype}"
            )
        return self._issue(ops.AllGatherIntoTensor(input, output), [output], reads=[input], writes=[output])

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
        return self._issue(ops.ReduceScatter(tuple(ins), out, red), [out], reads=list(ins), writes=[out])

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
        return self._issue(ops.ReduceScatterTensor(input, output, red), [output], reads=[input], writes=[output])

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
        return self._issue(ops.Gather(inp, tuple(outs), root), list(outs), reads=[inp], writes=list(outs))

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
        return self._issue(ops.Scatter(out, tuple(ins), root), [out], reads=list(ins), writes=[out])

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
        spec = ops.AllToAllSingle(input, output, tuple(in_splits), tuple(out_splits))
        return self._issue(spec, [output], reads=[input], writes=[output])

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
        spec = ops.AllToAll(
            flat_in, flat_out, tuple(t.numel() for t in input_tensors), tuple(t.numel() for t in output_tensors)
        )
        work = self._issue(spec, list(output_tensors), reads=list(input_tensors), writes=list(output_tensors))
        _scatter_back_on_completion(work, flat_out, output_tensors)
        return work

    def barrier(self, opts: Any = None) -> SimWork:
        return self._issue(ops.Barrier(), [])

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


def _scatter_back_on_completion(work: SimWork, flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy a flat internal buffer back into the user's list of tensors when the work completes."""
    # a partial, not a closure over ``work``: the work must not keep itself alive through a cycle
    work.on_complete = functools.partial(_copy_back, flat, tensors)


def _copy_back(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    off = 0
    for t in tensors:
        t.copy_(flat[off : off + t.numel()].view(t.shape))
        off += t.numel()
