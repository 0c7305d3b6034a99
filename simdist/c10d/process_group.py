"""The ``"simdist"`` torch.distributed backend: a Python ``ProcessGroup`` whose collectives run in simulated time.

One ``SimProcessGroup`` object exists per (rank, group); the ranks of a group share a :class:`GroupState`.
Each call records the user's call site, joins the group's matching instance and returns a :class:`SimWork`;
torch's own front end (``dist.all_reduce`` and friends) validates arguments, converts complex tensors and
calls ``wait()`` for synchronous calls.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from simdist.algorithms import Reduction, nccl, reduce_op_of
from simdist.c10d import funcol
from simdist.c10d.arguments import SUPPORTED_DTYPES, GlooArguments, check_tensor
from simdist.c10d.devices import DevicePolicy, call_device, gpu_index, policy
from simdist.comm import monitored, ops
from simdist.comm.context import RunContext
from simdist.comm.group import Call, GroupState, Instance
from simdist.comm.internal import internal
from simdist.comm.launch import launch
from simdist.comm.ops import dtype_name
from simdist.comm.work import SimWork
from simdist.cuda.tensor import SimCudaTensor
from simdist.cudart.state import device_work
from simdist.errors import NcclEnvironmentError

#: functions called as ``observe(group, op_name, written)`` when a rank issues a collective or a point-to-point
#: operation, before it runs (``written``: the user's buffers it will write); the equivalence oracle's
#: localisation counts and names collectives with it. Empty unless a tool installs one around a run.
ISSUE_OBSERVERS: list[Callable[[Any, str, list[torch.Tensor]], None]] = []

class SimProcessGroup(dist.ProcessGroup):
    """One rank's handle on one simulated process group."""

    def __init__(self, sim: RunContext, state: GroupState, group_rank: int, backend_name: str = "simdist") -> None:
        super().__init__(group_rank, state.size)
        self.sim = sim
        self.state = state
        self.grank = group_rank
        #: the backend name rank code sees (``pg.name()``, ``pg._get_backend_name()``)
        self.backend_name = backend_name
        state.backend_name = backend_name  # the same on every member: results follow its reduction order
        #: whether this rank has read NCCL_ALGO/NCCL_PROTO for the group (at its first collective, where torch
        #: creates the NCCL communicator)
        self._nccl_env_read = sim.cluster.collective_model != "nccl"
        #: the works issued inside a ``_coalescing_manager(device=...)`` block (None outside one)
        self._coalesced: list[SimWork] | None = None
        #: what this group refuses, as gloo refuses it
        self.args = GlooArguments(state, group_rank, sim.call_site)
        #: on a GPU cluster, the tensors the backend it presents takes per device (None elsewhere: any CPU tensor)
        self.devices: DevicePolicy | None = None
        self.present_devices(backend_name)
        #: the device type of the tensors of the call being issued, as the caller holds them
        self._call_device: str | None = None

    def present_devices(self, name: str) -> None:
        """Take tensors as a group created with backend ``name`` takes them, on a GPU cluster."""
        self.devices = policy(name) if self.sim.emulates_cuda else None

    @property
    def _device_types(self) -> list[torch.device]:
        """The device types the group has a backend for, as the backend it presents answers on a GPU cluster
        (torch's object collectives pick their device from these)."""
        if self.devices is None:
            return dist.ProcessGroup._device_types.__get__(self)
        return list(self.devices.device_types)

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
        crashes = self.sim.crashes
        if crashes is not None:
            crashes.before_collective(self.global_rank)
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
        if not self._nccl_env_read:
            self._nccl_env_read = True
            self.state.nccl_enabled = _nccl_enabled(sim, self.global_rank)
        if self._call_device is not None:
            object.__setattr__(spec, "on_device", self._call_device)  # the caller's, not the unwrapped buffers'
        ready_at = sim.issue_time()
        site = sim.call_site()
        seq = self.state.next_seq(self.grank)
        sim.call_sites[(self.global_rank, self.state.name or "default", seq)] = site
        desc = (
            f"rank {self.global_rank} waits in {spec.name} #{seq} on group {self.state.name or 'default'} "
            f"(issued at {site})"
        )
        work = SimWork(sim, desc, outputs, self.state.timeout)
        work.group_state, work.seq, work.rank, work.op_name = self.state, seq, self.global_rank, spec.name
        if self.state.timeout is not None and self.state.backend_name == "nccl":
            sizes = spec.sizes()  # what NCCL's watchdog names if it times out
            work.numel = (sizes.in_nelems, sizes.out_nelems)
        if sim.races.enabled:
            sim.races.issue(self.global_rank, work, spec.name, seq, self.state.name, site, list(reads), list(writes))
        call = Call(spec, self.grank, site, work, spec.signature(), ready_at)
        self.state.join(call, self._start)
        return work

    def _start(self, inst: Instance) -> None:
        launch(self.sim, self.state, inst)

    # ------------------------------------------------------------------ collectives
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> SimWork:
        (t,) = tensors
        red = reduce_op_of(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        if t.layout == torch.sparse_coo:
            return self._allreduce_sparse(t, red)
        check_tensor(t, "all_reduce tensor")
        red.check_dtype(t.dtype, "the all_reduce tensor")
        return self._issue(ops.AllReduce(t, red.name), [t], writes=[t])

    def _allreduce_sparse(self, t: torch.Tensor, red: Reduction) -> SimWork:
        if red.torch_op != dist.ReduceOp.SUM:
            raise self.args.reject(
                "allreduce", "ProcessGroupGloo::allreduce: unsupported reduction operation (allreduce of sparse "
                "tensors only works with ReduceOp.SUM)", f"got ReduceOp.{red.torch_op.name} on a sparse COO tensor",
            )
        if t.dtype not in SUPPORTED_DTYPES or t.device.type != "cpu":
            check_tensor(t.values(), "all_reduce sparse tensor values")
        return self._issue(ops.AllReduceSparse(t), [t], writes=[t])

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> SimWork:
        self.args.allreduce_coalesced(tensors)
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
        self.args.root("broadcast", root, "src")
        check_tensor(t, "broadcast tensor")
        mine = self.grank == root
        return self._issue(ops.Broadcast(t, root), [t], reads=[t] if mine else [], writes=[] if mine else [t])

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> SimWork:
        (t,) = tensors
        root = opts.rootRank
        self.args.root("reduce", root, "dst")
        check_tensor(t, "reduce tensor")
        red = reduce_op_of(opts.reduceOp)
        red.check_dtype(t.dtype, "the reduce tensor")
        mine = self.grank == root
        return self._issue(ops.Reduce(t, root, red.name), [t], reads=[] if mine else [t], writes=[t] if mine else [])

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None) -> SimWork:
        (outs,) = output_tensors
        (inp,) = input_tensors
        check_tensor(inp, "all_gather input")
        self.args.tensor_list("allgather", outs, inp, "output", "input")
        return self._issue(ops.AllGather(inp, tuple(outs)), list(outs), reads=[inp], writes=list(outs))

    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor], opts: Any = None
    ) -> SimWork:
        self.args.allgather_coalesced(output_lists, input_list)
        n, dtype = self.state.size, input_list[0].dtype
        flat_outs = [o for outs in output_lists for o in outs]
        with internal():
            flat_in = torch.cat([t.reshape(-1) for t in input_list])
            flat_out = torch.empty(n * flat_in.numel(), dtype=dtype, device=flat_in.device)
        shapes = tuple(tuple(t.shape) for t in input_list)
        spec = ops.AllGatherCoalesced(flat_in, flat_out, shapes)
        work = self._issue(spec, flat_outs, reads=list(input_list), writes=flat_outs)
        _scatter_back_on_completion(work, flat_out, flat_outs)
        return work

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> SimWork:
        self.args.all_gather_into_tensor(output, input)
        return self._issue(ops.AllGatherIntoTensor(input, output), [output], reads=[input], writes=[output])

    _allgather_base = all_gather_single

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any) -> SimWork:
        (out,) = output_tensors
        (ins,) = input_tensors
        check_tensor(out, "reduce_scatter output")
        self.args.tensor_list("reduce_scatter", ins, out, "input", "output")
        red = reduce_op_of(opts.reduceOp)
        red.check_dtype(out.dtype, "the reduce_scatter output")
        return self._issue(ops.ReduceScatter(tuple(ins), out, red.name), [out], reads=list(ins), writes=[out])

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> SimWork:
        self.args.reduce_scatter_tensor(output, input)
        red = reduce_op_of(opts.reduceOp)
        red.check_dtype(output.dtype, "the reduce_scatter_tensor output")
        return self._issue(ops.ReduceScatterTensor(input, output, red.name), [output], reads=[input], writes=[output])

    _reduce_scatter_base = reduce_scatter_single

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> SimWork:
        """``all_gather_into_tensor`` of each ``inputs[i]`` into ``outputs[i]`` as one collective (functional
        collectives, DTensor and ``_coalescing_manager`` issue these; torch's C++ reaches it by this name)."""
        self.args.coalesced_pairs("all_gather_into_tensor_coalesced", outputs, inputs, gather=True)
        if len(inputs) == 1:
            return self.all_gather_single(outputs[0], inputs[0], opts)
        n = self.state.size
        with internal():
            flat_in = torch.cat([t.reshape(-1) for t in inputs])
            flat_out = torch.empty(n * flat_in.numel(), dtype=flat_in.dtype, device=flat_in.device)
        spec = ops.AllGatherIntoTensorCoalesced(flat_in, flat_out, tuple(tuple(t.shape) for t in inputs))
        work = self._issue(spec, list(outputs), reads=list(inputs), writes=list(outputs))
        work.on_complete = functools.partial(_unpack_gathered, flat_out, list(outputs), n)
        return work

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> SimWork:
        """``reduce_scatter_tensor`` of each ``inputs[i]`` into ``outputs[i]`` as one collective."""
        self.args.coalesced_pairs("reduce_scatter_tensor_coalesced", outputs, inputs, gather=False)
        if len(inputs) == 1:
            return self.reduce_scatter_single(outputs[0], inputs[0], opts)
        n = self.state.size
        red = reduce_op_of(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        red.check_dtype(outputs[0].dtype, "the reduce_scatter_tensor_coalesced outputs")
        with internal():
            # rank r's chunk of every input, one after another, for r = 0..n-1: the layout a flat
            # reduce-scatter hands out
            flat_in = torch.cat([t.reshape(n, -1) for t in inputs], dim=1).reshape(-1)
            flat_out = torch.empty(flat_in.numel() // n, dtype=flat_in.dtype, device=flat_in.device)
        spec = ops.ReduceScatterTensorCoalesced(flat_in, flat_out, tuple(tuple(o.shape) for o in outputs), red.name)
        work = self._issue(spec, list(outputs), reads=list(inputs), writes=list(outputs))
        _scatter_back_on_completion(work, flat_out, list(outputs))
        return work

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any) -> SimWork:
        (inp,) = input_tensors
        root = opts.rootRank
        self.args.root("gather", root, "dst")
        check_tensor(inp, "gather input")
        outs = output_tensors[0] if output_tensors else []
        if self.grank == root:
            self.args.tensor_list("gather", outs, inp, "output", "input")
        return self._issue(ops.Gather(inp, tuple(outs), root), list(outs), reads=[inp], writes=list(outs))

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any) -> SimWork:
        (out,) = output_tensors
        root = opts.rootRank
        self.args.root("scatter", root, "src")
        check_tensor(out, "scatter output")
        ins = input_tensors[0] if input_tensors else []
        if self.grank == root:
            self.args.tensor_list("scatter", ins, out, "input", "output")
        return self._issue(ops.Scatter(out, tuple(ins), root), [out], reads=list(ins), writes=[out])

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> SimWork:
        self.args.all_to_all_single(output, input)
        in_splits = self.args.splits(input, input_split_sizes, "input")
        out_splits = self.args.splits(output, output_split_sizes, "output")
        spec = ops.AllToAllSingle(input, output, tuple(in_splits), tuple(out_splits))
        return self._issue(spec, [output], reads=[input], writes=[output])

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], opts: Any = None) -> SimWork:
        self.args.alltoall(output_tensors, input_tensors)
        dtype = input_tensors[0].dtype
        with internal():
            flat_in = torch.cat([t.reshape(-1) for t in input_tensors])
            flat_out = torch.empty(sum(t.numel() for t in output_tensors), dtype=dtype, device=flat_in.device)
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
        check_tensor(t, "send tensor")
        return self._p2p("send", t, dstRank, tag)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> SimWork:
        (t,) = tensors
        check_tensor(t, "recv tensor")
        return self._p2p("recv", t, srcRank, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> SimWork:
        (t,) = tensors
        check_tensor(t, "recv tensor")
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
        self.args.peer(kind, peer, tag)
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


def _nccl_enabled(sim: RunContext, rank: int) -> nccl.Enabled:
    """What ``NCCL_ALGO``, ``NCCL_PROTO`` and ``NCCL_NVLS_ENABLE`` in the calling rank's environment leave NCCL,
    as NCCL reads them
    when a communicator is made (torch makes it at the group's first collective)."""
    try:
        return nccl.parse_enabled(os.environ)
    except ValueError as exc:
        raise NcclEnvironmentError(
            f"rank {rank}: {exc} (read at the group's first collective, {sim.call_site()})"
        ) from None


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


def _host_buffers(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` called with every simulated-GPU tensor in its arguments replaced by the CPU tensor that holds its
    values (the buffers messages read and write); the work's outputs (``result()``, the future's value) are the
    caller's own tensors again.

    C++ callers (DDP's reducer and parameter check) call a process group's methods directly, not through the
    dispatcher, so the rank's dispatch mode cannot unwrap them.
    """

    @functools.wraps(method)
    def call(self: SimProcessGroup, *args: Any, **kwargs: Any) -> Any:
        if self._call_device is not None:  # one method delegating to another: the caller's call was checked
            return method(self, *args, **kwargs)
        if self.devices is not None:
            self.devices.check(method.__name__, args, self.args.reject)
        callers: dict[int, torch.Tensor] = {}
        self._call_device = call_device(args)
        index = gpu_index(args)
        try:
            # issued on the current stream of its tensors' GPU (NCCL's), whatever the thread's current device
            with device_work(index) if index is not None else contextlib.nullcontext():
                work = method(self, *[_on_host(a, callers) for a in args], **kwargs)
        finally:
            self._call_device = None
        if callers and isinstance(work, SimWork):
            work.outputs = [callers.get(id(t), t) for t in work.outputs]
        return work

    return call


def _on_host(value: Any, callers: dict[int, torch.Tensor]) -> Any:
    if type(value) is SimCudaTensor:
        callers[id(value._elem)] = value
        return value._elem
    if type(value) is list and value and (type(value[0]) is SimCudaTensor or type(value[0]) is list):
        return [_on_host(v, callers) for v in value]
    return value


for _name in (
    "allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather", "allgather_coalesced", "all_gather_single",
    "reduce_scatter", "reduce_scatter_single", "all_gather_single_coalesced", "reduce_scatter_single_coalesced",
    "gather", "scatter", "all_to_all_single", "alltoall", "send", "recv", "recv_anysource",
):
    setattr(SimProcessGroup, _name, _host_buffers(getattr(SimProcessGroup, _name)))
SimProcessGroup._allgather_base = SimProcessGroup.all_gather_single
SimProcessGroup._reduce_scatter_base = SimProcessGroup.reduce_scatter_single
