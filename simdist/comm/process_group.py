"""The ``"simdist"`` torch.distributed backend: a Python ``ProcessGroup`` whose collectives run in simulated time.

One ``SimProcessGroup`` object exists per (rank, group); the ranks of a group share a :class:`GroupState`.
Each call records the user's call site, joins the group's matching instance and returns a :class:`SimWork`;
torch's own front end (``dist.all_reduce`` and friends) validates arguments, converts complex tensors and
calls ``wait()`` for synchronous calls.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from simdist.algorithms import Reduction, reduce_op_of
from simdist.comm import funcol, monitored, ops
from simdist.comm.group import Call, GroupState, Instance
from simdist.comm.internal import internal
from simdist.comm.launch import launch
from simdist.comm.ops import dtype_name
from simdist.comm.work import SimWork
from simdist.errors import InvalidArgumentError

#: functions called as ``observe(group, op_name, written)`` when a rank issues a collective or a point-to-point
#: operation, before it runs (``written``: the user's buffers it will write); the equivalence oracle's
#: localisation counts and names collectives with it. Empty unless a tool installs one around a run.
ISSUE_OBSERVERS: list[Callable[[Any, str, list[torch.Tensor]], None]] = []

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
        raise InvalidArgumentError(
            f"{what}: only dense (strided) tensors are supported here, got layout {t.layout} "
            f"(gloo: \"Could not run ... with arguments from the 'Sparse' backend\"); sparse COO tensors work "
            f"with all_reduce (SUM) only, as with gloo"
        )
    if t.device.type not in ("cpu", "meta"):
        raise InvalidArgumentError(f"{what}: simulated ranks hold CPU tensors, got a tensor on {t.device}")
    if not t.is_contiguous():
        if t.device.type != "meta" and t.numel() and t.storage_offset() + t.numel() > (
            t.untyped_storage().nbytes() // t.element_size()
        ):
            raise InvalidArgumentError(
                f"{what} of shape {tuple(t.shape)} and strides {t.stride()} does not own {t.numel()} elements of "
                f"memory from its first element (an expanded or strided view): gloo would read and write past "
                f"its storage. Pass tensor.contiguous() and copy the result back."
            )
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

    def __init__(self, sim: Any, state: GroupState, group_rank: int, backend_name: str = "simdist") -> None:
        super().__init__(group_rank, state.size)
        self.sim = sim
        self.state = state
        self.grank = group_rank
        #: the backend name rank code sees (``pg.name()``, ``pg._get_backend_name()``)
        self.backend_name = backend_name
        #: the works issued inside a ``_coalescing_manager(device=...)`` block (None outside one)
        self._coalesced: list[SimWork] | None = None


    # ------------------------------------------------------------------ identity
    def getBackendName(self) -> str:
        return self.backend_name

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
        for observe in ISSUE_OBSERVERS:
            observe(self, spec.name, list(writes))
        with internal():
            work = self._issue_internal(spec, outputs, reads, writes)
        funcol.track(self.global_rank, work, writes)
        if self._coalesced is not None:
            self._coalesced.append(work)
        return work

    def _issue_internal(self, spec: ops.OpSpec, outputs: list[torch.Tensor], reads: Any, writes: Any) -> SimWork:
        sim = self.sim
        ready_at = sim.issue_time()
        site = sim.call_site()
        seq = self.state.next_seq(self.grank)
        sim.call_sites[(self.global_rank, self.state.name or "default", seq)] = site
        desc = (
            f"rank {self.global_rank} waits in {spec.name} #{seq} on group {self.state.name or 'default'} "
            f"(issued at {site})"
        )
        work = SimWork(sim, desc, outputs, self.state.timeout)
        work.group_state, work.seq, work.rank = self.state, seq, self.global_rank
        if sim.races.enabled:
            sim.races.issue(self.global_rank, work, spec.name, seq, self.state.name, site, list(reads), list(writes))
        call = Call(spec, self.grank, site, work, spec.signature(), ready_at)
        self.state.join(call, self._start)
        return work

    def _start(self, inst: Instance) -> None:
        launch(self.sim, self.state, inst)

    # ------------------------------------------------------------------ argument checks
    def _reject(self, op: str, problem: str, expected: str) -> InvalidArgumentError:
        """The error for a bad argument: gloo's words, then the rank, the op and what was expected."""
        return InvalidArgumentError(
            f"{problem} (rank {self.global_rank}, {op} on group {self.state.name or 'default'} of "
            f"{self.state.size} ranks, at {self.sim.call_site()}): {expected}"
        )

    def _check_root(self, op: str, root: int, arg: str) -> None:
        n = self.state.size
        if not 0 <= root < n:
            raise self._reject(
                op, f"ProcessGroupGloo::{op}: invalid root rank: {root}",
                f"{arg} must be a rank of the group, 0..{n - 1} (global ranks {self.state.global_ranks[0]}.."
                f"{self.state.global_ranks[-1]} in the default group)",
            )

    def _check_list(self, op: str, tensors: list[torch.Tensor], ref: torch.Tensor, what: str, ref_what: str) -> None:
        """Every tensor of ``tensors`` must hold as many elements of the same dtype as ``ref``."""
        n = self.state.size
        if len(tensors) != n:
            raise self._reject(
                op, f"ProcessGroupGloo::{op}: invalid {what} list size {len(tensors)}",
                f"{what} needs one tensor per rank of the group ({n})",
            )
        for i, t in enumerate(tensors):
            _check_tensor(t, f"{op} {what}")
            if t.numel() != ref.numel() or t.dtype != ref.dtype:
                raise self._reject(
                    op, f"ProcessGroupGloo::{op}: invalid tensor size or type at index {i}",
                    f"{what}[{i}] is {tuple(t.shape)} {t.dtype}, the {ref_what} is {tuple(ref.shape)} {ref.dtype}; "
                    f"every {what} tensor must match it",
                )

    # ------------------------------------------------------------------ collectives
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> SimWork:
        (t,) = tensors
        red = reduce_op_of(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        if t.layout == torch.sparse_coo:
            return self._allreduce_sparse(t, red)
        _check_tensor(t, "all_reduce tensor")
        red.check_dtype(t.dtype, "the all_reduce tensor")
        return self._issue(ops.AllReduce(t, red.name), [t], writes=[t])

    def _allreduce_sparse(self, t: torch.Tensor, red: Reduction) -> SimWork:
        if red.torch_op != dist.ReduceOp.SUM:
            raise self._reject(
                "allreduce", "ProcessGroupGloo::allreduce: unsupported reduction operation (allreduce of sparse "
                "tensors only works with ReduceOp.SUM)", f"got ReduceOp.{red.torch_op.name} on a sparse COO tensor",
            )
        if t.dtype not in SUPPORTED_DTYPES or t.device.type != "cpu":
            _check_tensor(t.values(), "all_reduce sparse tensor values")
        return self._issue(ops.AllReduceSparse(t), [t], writes=[t])

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> SimWork:
        if not tensors:
            raise self._reject(
                "allreduce_coalesced", "all_reduce_coalesced got an empty list of tensors",
                "pass at least one tensor (torch's dispatcher rejects an empty list with gloo too)",
            )
        for t in tensors:
            _check_tensor(t, "all_reduce_coalesced tensor")
        if len({t.dtype for t in tensors}) > 1:
            raise self._reject(
                "allreduce_coalesced", "all_reduce_coalesced: tensors of different dtypes",
                f"all tensors must have one dtype, got {sorted({str(t.dtype) for t in tensors})}",
            )
        red = reduce_op_of(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        red.check_dtype(tensors[0].dtype, "the all_reduce_coalesced tensors")
        with internal():
            flat = torch.cat([t.reshape(-1) for t in tensors])
        shapes = tuple(tuple(t.shape) for t in tensors)
        work = self._issue(ops.AllReduceCoalesced(shapes, flat, red.name), list(tensors), writes=list(tensors))
        _scatter_back_on_completion(work, flat, tensors)
        return work

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> SimWork:
        (t,) = tensors
        root = opts.rootRank
        self._check_root("broadcast", root, "src")
        _check_tensor(t, "broadcast tensor")
        mine = self.grank == root
        return self._issue(ops.Broadcast(t, root), [t], reads=[t] if mine else [], writes=[] if mine else [t])

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> SimWork:
        (t,) = tensors
        root = opts.rootRank
        self._check_root("reduce", root, "dst")
        _check_tensor(t, "reduce tensor")
        red = reduce_op_of(opts.reduceOp)
        red.check_dtype(t.dtype, "the reduce tensor")
        mine = self.grank == root
        return self._issue(ops.Reduce(t, root, red.name), [t], reads=[] if mine else [t], writes=[t] if mine else [])

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None) -> SimWork:
        (outs,) = output_tensors
        (inp,) = input_tensors
        _check_tensor(inp, "all_gather input")
        self._check_list("allgather", outs, inp, "output", "input")
        return self._issue(ops.AllGather(inp, tuple(outs)), list(outs), reads=[inp], writes=list(outs))

    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor], opts: Any = None
    ) -> SimWork:
        n = self.state.size
        if len(output_lists) != n:
            raise self._reject(
                "allgather_coalesced", "ProcessGroupGloo::allgather_coalesced: output lists should be equal to world size",
                f"got {len(output_lists)} output lists for {n} ranks",
            )
        if not input_list:
            raise self._reject("allgather_coalesced", "all_gather_coalesced got no input tensors", "pass at least one")
        for t in input_list:
            _check_tensor(t, "all_gather_coalesced input")
        for r, outs in enumerate(output_lists):
            if len(outs) != len(input_list):
                raise self._reject(
                    "allgather_coalesced", "ProcessGroupGloo::allgather_coalesced: invalid output list",
                    f"output list {r} has {len(outs)} tensors, the input list {len(input_list)}",
                )
            for i, (o, t) in enumerate(zip(outs, input_list)):
                _check_tensor(o, "all_gather_coalesced output")
                if tuple(o.shape) != tuple(t.shape) or o.dtype != t.dtype:
                    raise self._reject(
                        "allgather_coalesced", "ProcessGroupGloo::allgather_coalesced: invalid tensor size or type",
                        f"output_tensor_lists[{r}][{i}] is {tuple(o.shape)} {o.dtype}, input_tensor_list[{i}] is "
                        f"{tuple(t.shape)} {t.dtype}; they must match",
                    )
        dtype = input_list[0].dtype
        if any(t.dtype != dtype for t in input_list):
            raise self._reject("allgather_coalesced", "all_gather_coalesced: tensors of different dtypes", "use one dtype")
        flat_outs = [o for outs in output_lists for o in outs]
        with internal():
            flat_in = torch.cat([t.reshape(-1) for t in input_list])
            flat_out = torch.empty(n * flat_in.numel(), dtype=dtype)
        shapes = tuple(tuple(t.shape) for t in input_list)
        spec = ops.AllGatherCoalesced(flat_in, flat_out, shapes)
        work = self._issue(spec, flat_outs, reads=list(input_list), writes=flat_outs)
        _scatter_back_on_completion(work, flat_out, flat_outs)
        return work

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> SimWork:
        _check_tensor(output, "all_gather_into_tensor output")
        _check_tensor(input, "all_gather_into_tensor input")
        n = self.state.size
        if output.numel() != n * input.numel() or output.dtype != input.dtype:
            raise self._reject(
                "allgather", "ProcessGroupGloo::allgather: invalid output tensor size or type",
                f"all_gather_into_tensor's output must hold world_size ({n}) x input.numel() = "
                f"{n * input.numel()} elements of {input.dtype}; got {output.numel()} of {output.dtype}",
            )
        return self._issue(ops.AllGatherIntoTensor(input, output), [output], reads=[input], writes=[output])

    _allgather_base = all_gather_single

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any) -> SimWork:
        (out,) = output_tensors
        (ins,) = input_tensors
        _check_tensor(out, "reduce_scatter output")
        self._check_list("reduce_scatter", ins, out, "input", "output")
        red = reduce_op_of(opts.reduceOp)
        red.check_dtype(out.dtype, "the reduce_scatter output")
        return self._issue(ops.ReduceScatter(tuple(ins), out, red.name), [out], reads=list(ins), writes=[out])

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> SimWork:
        _check_tensor(output, "reduce_scatter_tensor output")
        _check_tensor(input, "reduce_scatter_tensor input")
        n = self.state.size
        if input.numel() != n * output.numel() or output.dtype != input.dtype:
            raise self._reject(
                "reduce_scatter_tensor", "ProcessGroupGloo::reduce_scatter_tensor: invalid input size or type",
                f"the input must hold world_size ({n}) x output.numel() = {n * output.numel()} elements of "
                f"{output.dtype}; got {input.numel()} of {input.dtype}",
            )
        red = reduce_op_of(opts.reduceOp)
        red.check_dtype(output.dtype, "the reduce_scatter_tensor output")
        return self._issue(ops.ReduceScatterTensor(input, output, red.name), [output], reads=[input], writes=[output])

    _reduce_scatter_base = reduce_scatter_single

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> SimWork:
        """``all_gather_into_tensor`` of each ``inputs[i]`` into ``outputs[i]`` as one collective (functional
        collectives, DTensor and ``_coalescing_manager`` issue these; torch's C++ reaches it by this name)."""
        if len(outputs) != len(inputs) or not inputs:
            raise self._reject(
                "all_gather_into_tensor_coalesced", "all_gather_into_tensor_coalesced: invalid tensor lists",
                f"pass one output per input and at least one pair; got {len(outputs)} outputs, {len(inputs)} inputs",
            )
        if len(inputs) == 1:
            return self.all_gather_single(outputs[0], inputs[0], opts)
        n = self.state.size
        for i, (o, t) in enumerate(zip(outputs, inputs)):
            _check_tensor(o, "all_gather_into_tensor_coalesced output")
            _check_tensor(t, "all_gather_into_tensor_coalesced input")
            if o.numel() != n * t.numel() or o.dtype != t.dtype:
                raise self._reject(
                    "all_gather_into_tensor_coalesced", "all_gather_into_tensor_coalesced: invalid output tensor size or type",
                    f"outputs[{i}] must hold world_size ({n}) x inputs[{i}].numel() = {n * t.numel()} elements of "
                    f"{t.dtype}; got {o.numel()} of {o.dtype}",
                )
        self._check_one_dtype("all_gather_into_tensor_coalesced", inputs)
        with internal():
            flat_in = torch.cat([t.reshape(-1) for t in inputs])
            flat_out = torch.empty(n * flat_in.numel(), dtype=flat_in.dtype)
        spec = ops.AllGatherIntoTensorCoalesced(flat_in, flat_out, tuple(tuple(t.shape) for t in inputs))
        work = self._issue(spec, list(outputs), reads=list(inputs), writes=list(outputs))
        work.on_complete = functools.partial(_unpack_gathered, flat_out, list(outputs), n)
        return work

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> SimWork:
        """``reduce_scatter_tensor`` of each ``inputs[i]`` into ``outputs[i]`` as one collective."""
        if len(outputs) != len(inputs) or not inputs:
            raise self._reject(
                "reduce_scatter_tensor_coalesced", "reduce_scatter_tensor_coalesced: invalid tensor lists",
                f"pass one output per input and at least one pair; got {len(outputs)} outputs, {len(inputs)} inputs",
            )
        if len(inputs) == 1:
            return self.reduce_scatter_single(outputs[0], inputs[0], opts)
        n = self.state.size
        for i, (o, t) in enumerate(zip(outputs, inputs)):
            _check_tensor(o, "reduce_scatter_tensor_coalesced output")
            _check_tensor(t, "reduce_scatter_tensor_coalesced input")
            if t.numel() != n * o.numel() or o.dtype != t.dtype:
                raise self._reject(
                    "reduce_scatter_tensor_coalesced", "reduce_scatter_tensor_coalesced: invalid input size or type",
                    f"inputs[{i}] must hold world_size ({n}) x outputs[{i}].numel() = {n * o.numel()} elements of "
                    f"{o.dtype}; got {t.numel()} of {t.dtype}",
                )
        self._check_one_dtype("reduce_scatter_tensor_coalesced", outputs)
        red = reduce_op_of(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        red.check_dtype(outputs[0].dtype, "the reduce_scatter_tensor_coalesced outputs")
        with internal():
            # rank r's chunk of every input, one after another, for r = 0..n-1: the layout a flat
            # reduce-scatter hands out
            flat_in = torch.cat([t.reshape(n, -1) for t in inputs], dim=1).reshape(-1)
            flat_out = torch.empty(flat_in.numel() // n, dtype=flat_in.dtype)
        spec = ops.ReduceScatterTensorCoalesced(flat_in, flat_out, tuple(tuple(o.shape) for o in outputs), red.name)
        work = self._issue(spec, list(outputs), reads=list(inputs), writes=list(outputs))
        _scatter_back_on_completion(work, flat_out, list(outputs))
        return work

    def _check_one_dtype(self, op: str, tensors: list[torch.Tensor]) -> None:
        dtypes = sorted({str(t.dtype) for t in tensors})
        if len(dtypes) > 1:
            raise self._reject(
                op, f"{op}: tensors of different dtypes {dtypes}",
                "coalesce tensors of one dtype per call (issue one call per dtype)",
            )

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any) -> SimWork:
        (inp,) = input_tensors
        root = opts.rootRank
        self._check_root("gather", root, "dst")
        _check_tensor(inp, "gather input")
        outs = output_tensors[0] if output_tensors else []
        if self.grank == root:
            self._check_list("gather", outs, inp, "output", "input")
        return self._issue(ops.Gather(inp, tuple(outs), root), list(outs), reads=[inp], writes=list(outs))

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any) -> SimWork:
        (out,) = output_tensors
        root = opts.rootRank
        self._check_root("scatter", root, "src")
        _check_tensor(out, "scatter output")
        ins = input_tensors[0] if input_tensors else []
        if self.grank == root:
            self._check_list("scatter", ins, out, "input", "output")
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
        if input.dtype != output.dtype:
            raise self._reject(
                "alltoall_base", "all_to_all_single: input and output dtypes differ",
                f"input is {input.dtype}, output {output.dtype}",
            )
        in_splits = self._splits(input, input_split_sizes, n, "input")
        out_splits = self._splits(output, output_split_sizes, n, "output")
        spec = ops.AllToAllSingle(input, output, tuple(in_splits), tuple(out_splits))
        return self._issue(spec, [output], reads=[input], writes=[output])

    def _splits(self, t: torch.Tensor, sizes: list[int] | None, n: int, what: str) -> list[int]:
        rows = t.shape[0] if t.dim() > 0 else t.numel()
        if not sizes:
            if rows % n:
                raise self._reject(
                    "alltoall_base", f"all_to_all_single: the {what} has {rows} rows, not divisible by the group size {n}",
                    f"pass {what}_split_sizes (NCCL rejects this too; gloo silently drops the remainder)",
                )
            return [rows // n] * n
        sizes = list(sizes)
        if len(sizes) != n:
            raise self._reject(
                "alltoall_base", "Number of tensor splits not equal to group size",
                f"{what}_split_sizes {sizes} has {len(sizes)} entries for {n} ranks",
            )
        if sum(sizes) != rows or any(s < 0 for s in sizes):
            raise self._reject(
                "alltoall_base", "Split sizes doesn't match total dim 0 size",
                f"{what}_split_sizes {sizes} must be {n} non-negative row counts summing to the {what}'s {rows} rows",
            )
        return sizes

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], opts: Any = None) -> SimWork:
        n = self.state.size
        for name, lst in (("input", input_tensors), ("output", output_tensors)):
            if len(lst) != n:
                raise self._reject(
                    "alltoall", f"ProcessGroupGloo::alltoall: {name} tensor list size {len(lst)} does not match world size {n}",
                    f"pass one {name} tensor per rank",
                )
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

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        """gloo's ``monitored_barrier``: rank 0 names the ranks that do not arrive within ``timeout``."""
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else self.state.timeout
        with internal():
            monitored.barrier(self.sim, self.state, self.grank, seconds, wait_all_ranks)

    def _start_coalescing(self, device: Any) -> None:
        """Open a ``_coalescing_manager(device=...)`` block: the works issued until its end form one."""
        self._coalesced = []

    def _end_coalescing(self, device: Any) -> dist.Work:
        """Close the block: one work that is done when every operation issued inside it is."""
        works, self._coalesced = self._coalesced or [], None
        return works[0] if len(works) == 1 else CoalescedWork(works)

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
        for observe in ISSUE_OBSERVERS:
            observe(self, kind, [t] if kind == "recv" else [])
        with internal():
            work = self._p2p_internal(kind, t, peer, tag)
        if kind == "recv":
            funcol.track(self.global_rank, work, [t])
        if self._coalesced is not None:
            self._coalesced.append(work)
        return work

    def _p2p_internal(self, kind: str, t: torch.Tensor, peer: int | None, tag: int) -> SimWork:
        sim = self.sim
        st = self.state
        ready_at = sim.issue_time()
        site = sim.call_site()
        me = self.global_rank
        arg = "dst" if kind == "send" else "src"
        if peer is not None and not 0 <= peer < st.size:
            # gloo crashes the process (a segfault) on such a peer
            raise self._reject(
                kind, f"{kind}: invalid peer rank {peer}", f"{arg} must be a rank of the group, 0..{st.size - 1}"
            )
        if peer is not None and peer == self.grank:
            raise self._reject(
                kind, f"{kind}: rank {me} cannot {kind} to/from itself (gloo: \"Pair is not connected\")",
                f"{arg} must be another rank of the group",
            )
        if tag < 0:
            raise self._reject(kind, "Tag must be nonnegative", f"got tag={tag}")
        g_peer = None if peer is None else st.global_ranks[peer]
        what = f"{'send to' if kind == 'send' else 'recv from'} rank {'any' if g_peer is None else g_peer}"
        desc = f"rank {me} waits in {what} (tag {tag}, {tuple(t.shape)} {dtype_name(t.dtype)}, issued at {site})"
        work = SimWork(sim, desc, [t], st.timeout)
        work.rank = me
        if sim.races.enabled:
            reads, writes = ([t], []) if kind == "send" else ([], [t])
            sim.races.issue(me, work, kind, None, st.name, site, reads, writes)
        if kind == "send":
            sim.p2p.post_send(st, me, g_peer, tag, t, work, site, ready_at)
        else:
            sim.p2p.post_recv(st, g_peer, me, tag, t, work, site, ready_at)
        return work


def _scatter_back_on_completion(work: SimWork, flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy a flat internal buffer back into the user's list of tensors when the work completes."""
    # a partial, not a closure over ``work``: the work must not keep itself alive through a cycle
    work.on_complete = functools.partial(_copy_back, flat, tensors)


def _copy_back(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    off = 0
    for t in tensors:
        t.copy_(flat[off : off + t.numel()].view(t.shape))
        off += t.numel()


def _unpack_gathered(flat: torch.Tensor, outputs: list[torch.Tensor], n: int) -> None:
    """Copy a rank-major gathered buffer (each rank's inputs concatenated) into one output per input."""
    rows = flat.view(n, -1)
    off = 0
    for o in outputs:
        m = o.numel() // n
        o.copy_(rows[:, off : off + m].reshape(o.shape))
        off += m


class CoalescedWork(dist.Work):
    """The work of a ``_coalescing_manager(device=...)`` block: waits for each operation issued inside it."""

    def __init__(self, works: list[SimWork]) -> None:
        super().__init__()
        self.works = works

    def wait(self, timeout: Any = None) -> bool:
        """Wait (in simulated time) for every operation of the block, in issue order."""
        for w in self.works:
            w.wait(timeout)
        return True

    def is_completed(self) -> bool:
        """Whether every operation of the block has completed (polling lets simulated time pass)."""
        return all(w.is_completed() for w in self.works)

    def result(self) -> list[torch.Tensor]:
        """The output tensors of every operation of the block."""
        return [t for w in self.works for t in w.outputs]
