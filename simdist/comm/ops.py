"""Collective operations as small typed descriptions: one class per op, built by each rank's process group.

An op description carries one rank's arguments. It gives the signature every rank of the group must agree
on (compared for mismatch diagnosis), the sizes its trace span reports, the collective whose algorithms run
it, and the planner that turns the matched descriptions of every rank into buffers and a schedule
(:mod:`simdist.comm.plans`).
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from simdist.algorithms import Algorithm
from simdist.comm import plans
from simdist.errors import CollectiveMismatchError


def dtype_name(dtype: torch.dtype) -> str:
    """``float32`` for ``torch.float32``."""
    return str(dtype).removeprefix("torch.")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class Sizes:
    """A collective's sizes: the bytes its algorithm is chosen for (each rank's whole buffer, as in the
    closed forms: the all-gather output, the reduce-scatter input), and the element counts and dtype its
    trace span reports."""

    nbytes: int
    in_nelems: int
    out_nelems: int
    dtype: str

    @classmethod
    def of(
        cls,
        inp: torch.Tensor,
        out: torch.Tensor,
        in_nelems: int | None = None,
        out_nelems: int | None = None,
        nbytes: int | None = None,
    ) -> Sizes:
        """Sizes read from the input and output tensors (bytes and counts may be given instead)."""
        return cls(
            _nbytes(inp) if nbytes is None else nbytes,
            inp.numel() if in_nelems is None else in_nelems,
            out.numel() if out_nelems is None else out_nelems,
            dtype_name(inp.dtype),
        )


class OpSpec(ABC):
    """One rank's call of a collective."""

    #: the name shown in traces and errors (torch's, e.g. ``all_gather_into_tensor``)
    name: ClassVar[str]
    #: the registry collective whose algorithms run it
    collective: ClassVar[str]

    @abstractmethod
    def signature(self) -> tuple[tuple[str, object], ...]:
        """What every rank of the group must agree on, as (field, value) pairs."""

    @abstractmethod
    def sizes(self) -> Sizes:
        """Sizes for the trace span and algorithm selection."""

    def buffer_bytes(self, group_size: int) -> int:
        """The bytes of the buffer the algorithm is chosen and timed for on a group of ``group_size`` ranks
        (``sizes().nbytes`` unless a rank's call holds only its own chunk of it)."""
        return self.sizes().nbytes

    @classmethod
    def check_across(cls, ops: list, sites: list[str]) -> None:
        """Raise :class:`CollectiveMismatchError` if the matched calls disagree beyond their signatures
        (``sites[r]`` is group rank r's call site); nothing to check by default."""

    @classmethod
    @abstractmethod
    def plan(cls, ops: list, algo: Algorithm) -> plans.Plan:
        """Buffers and schedule for the matched calls ``ops`` (indexed by group rank)."""

    #: the device type of the caller's tensors where the fields hold the host tensors of device memory (a
    #: simulated GPU's tensors are unwrapped before the call is described); None: read the fields
    on_device: ClassVar[str | None] = None

    def device_type(self) -> str:
        """The device type of the tensors it works on (``"cpu"``, or ``"cuda"`` for CUDA tensors)."""
        if self.__dict__.get("on_device"):
            return self.__dict__["on_device"]
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            first = value[0] if isinstance(value, tuple) and value else value
            if isinstance(first, torch.Tensor):
                return first.device.type
        return "cpu"

    def describe(self) -> str:
        """``all_reduce(shape=(4,), dtype=float32, op=sum)`` style text."""
        inner = ", ".join(f"{k}={v}" for k, v in self.signature())
        return f"{self.name}({inner})"


def _shape_dtype(t: torch.Tensor) -> tuple[tuple[str, object], ...]:
    return (("shape", tuple(t.shape)), ("dtype", dtype_name(t.dtype)))


@dataclass(frozen=True, eq=False)
class AllReduce(OpSpec):
    """``all_reduce``: in place on ``tensor``."""

    name: ClassVar[str] = "all_reduce"
    collective: ClassVar[str] = "all_reduce"
    tensor: torch.Tensor
    reduce_op: str

    def signature(self) -> tuple[tuple[str, object], ...]:
        return (*_shape_dtype(self.tensor), ("op", self.reduce_op))

    def sizes(self) -> Sizes:
        return Sizes.of(self.tensor, self.tensor)

    @classmethod
    def plan(cls, ops: list[AllReduce], algo: Algorithm) -> plans.Plan:
        return plans.plan_all_reduce([o.tensor for o in ops], ops[0].reduce_op, algo)


@dataclass(frozen=True, eq=False)
class AllReduceCoalesced(OpSpec):
    """``all_reduce_coalesced``: one all-reduce of ``flat`` (the tensors concatenated), copied back after."""

    name: ClassVar[str] = "all_reduce_coalesced"
    collective: ClassVar[str] = "all_reduce"
    shapes: tuple[tuple[int, ...], ...]
    flat: torch.Tensor
    reduce_op: str

    def signature(self) -> tuple[tuple[str, object], ...]:
        return (("shapes", self.shapes), ("dtype", dtype_name(self.flat.dtype)), ("op", self.reduce_op))

    def sizes(self) -> Sizes:
        return Sizes.of(self.flat, self.flat)

    @classmethod
    def plan(cls, ops: list[AllReduceCoalesced], algo: Algorithm) -> plans.Plan:
        return plans.plan_all_reduce([o.flat for o in ops], ops[0].reduce_op, algo)


@dataclass(frozen=True, eq=False)
class AllReduceSparse(OpSpec):
    """``all_reduce`` (SUM) of a sparse COO ``tensor``, as gloo runs it: every rank's indices and values are
    all-gathered, and each rank's tensor becomes the coalesced sum."""

    name: ClassVar[str] = "all_reduce"
    collective: ClassVar[str] = "all_gather"
    tensor: torch.Tensor

    def signature(self) -> tuple[tuple[str, object], ...]:
        t = self.tensor
        return (*_shape_dtype(t), ("op", "sum"), ("layout", "sparse_coo"), ("sparse_dim", t.sparse_dim()))

    def sizes(self) -> Sizes:
        nbytes = plans.sparse_payload_bytes(self.tensor)
        nnz = self.tensor._nnz()
        return Sizes(nbytes, nnz, nnz, dtype_name(self.tensor.dtype))

    @classmethod
    def plan(cls, ops: list[AllReduceSparse], algo: Algorithm) -> plans.Plan:
        return plans.plan_all_reduce_sparse([o.tensor for o in ops], algo)


@dataclass(frozen=True, eq=False)
class Broadcast(OpSpec):
    """``broadcast``: the root's ``tensor`` lands in every rank's."""

    name: ClassVar[str] = "broadcast"
    collective: ClassVar[str] = "broadcast"
    tensor: torch.Tensor
    root: int

    def signature(self) -> tuple[tuple[str, object], ...]:
        return (*_shape_dtype(self.tensor), ("root", self.root))

    def sizes(self) -> Sizes:
        return Sizes.of(self.tensor, self.tensor)

    @classmethod
    def plan(cls, ops: list[Broadcast], algo: Algorithm) -> plans.Plan:
        return plans.plan_broadcast([o.tensor for o in ops], ops[0].root, algo)


@dataclass(frozen=True, eq=False)
class Reduce(OpSpec):
    """``reduce``: the reduction of every rank's ``tensor`` lands in the root's."""

    name: ClassVar[str] = "reduce"
    collective: ClassVar[str] = "reduce"
    tensor: torch.Tensor
    root: int
    reduce_op: str

    def signature(self) -> tuple[tuple[str, object], ...]:
        return (*_shape_dtype(self.tensor), ("op", self.reduce_op), ("root", self.root))

    def sizes(self) -> Sizes:
        return Sizes.of(self.tensor, self.tensor)

    @classmethod
    def plan(cls, ops: list[Reduce], algo: Algorithm) -> plans.Plan:
        return plans.plan_reduce([o.tensor for o in ops], ops[0].root, ops[0].reduce_op, algo)


@dataclass(frozen=True, eq=False)
class AllGather(OpSpec):
    """``all_gather``: rank r's ``input`` lands in ``outputs[r]`` of every rank."""

    name: ClassVar[str] = "all_gather"
    collective: ClassVar[str] = "all_gather"
    input: torch.Tensor
    outputs: tuple[torch.Tensor, ...]

    def signature(self) -> tuple[tuple[str, object], ...]:
        return _shape_dtype(self.input)

    def sizes(self) -> Sizes:
        n = len(self.outputs)
        return Sizes.of(self.input, self.input, out_nelems=self.input.numel() * n, nbytes=_nbytes(self.input) * n)

    @classmethod
    def plan(cls, ops: list[AllGather], algo: Algorithm) -> plans.Plan:
        return plans.plan_all_gather([o.input for o in ops], [list(o.outputs) for o in ops], algo)


@dataclass(frozen=True, eq=False)
class AllGatherIntoTensor(OpSpec):
    """``all_gather_into_tensor``: rank r's ``input`` lands in chunk r of every rank's flat ``output``."""

    name: ClassVar[str] = "all_gather_into_tensor"
    collective: ClassVar[str] = "all_gather"
    input: torch.Tensor
    output: torch.Tensor

    def signature(self) -> tuple[tuple[str, object], ...]:
        return _shape_dtype(self.input)

    def sizes(self) -> Sizes:
        return Sizes.of(self.input, self.input, out_nelems=self.output.numel(), nbytes=_nbytes(self.output))

    @classmethod
    def plan(cls, ops: list[AllGatherIntoTensor], algo: Algorithm) -> plans.Plan:
        return plans.plan_all_gather([o.input for o in ops], [o.output for o in ops], algo)


@dataclass(frozen=True, eq=False)
class AllGatherCoalesced(OpSpec):
    """``all_gather_coalesced``: one all-gather of ``input`` (the input list concatenated) into ``output``,
    copied back into the output lists after."""

    name: ClassVar[str] = "all_gather_coalesced"
    collective: ClassVar[str] = "all_gather"
    input: torch.Tensor
    output: torch.Tensor
    shapes: tuple[tuple[int, ...], ...]

    def signature(self) -> tuple[tuple[str, object], ...]:
        return (("shapes", self.shapes), ("dtype", dtype_name(self.input.dtype)))

    def sizes(self) -> Sizes:
        return Sizes.of(self.input, self.input, out_nelems=self.output.numel(), nbytes=_nbytes(self.output))

    @classmethod
    def plan(cls, ops: list[AllGatherCoalesced], algo: Algorithm) -> plans.Plan:
        return plans.plan_all_gather([o.input for o in ops], [o.output for o in ops], algo)


class AllGatherIntoTensorCoalesced(AllGatherCoalesced):
    """``all_gather_into_tensor`` of several tensors at once (a coalesced group, as funcol and
    ``_coalescing_manager`` issue it): one all-gather of ``input`` (each rank's inputs concatenated) into
    ``output`` (rank-major), copied into each output tensor after. A one-tensor call is an
    :class:`AllGatherIntoTensor`, so that it matches the plain op across ranks."""

    name: ClassVar[str] = "all_gather_into_tensor_coalesced"


@dataclass(frozen=True, eq=False)
class ReduceScatter(OpSpec):
    """``reduce_scatter``: the reduction of every rank's ``inputs[r]`` lands in rank r's ``output``."""

    name: ClassVar[str] = "reduce_scatter"
    collective: ClassVar[str] = "reduce_scatter"
    inputs: tuple[torch.Tensor, ...]
    output: torch.Tensor
    reduce_op: str

    def signature(self) -> tuple[tuple[str, object], ...]:
        return (*_shape_dtype(self.output), ("op", self.reduce_op))

    def sizes(self) -> Sizes:
        n = len(self.inputs)
        return Sizes.of(self.output, self.output, in_nelems=self.output.numel() * n, nbytes=_nbytes(self.output) * n)

    @classmethod
    def plan(cls, ops: list[ReduceScatter], algo: Algorithm) -> plans.Plan:
        return plans.plan_reduce_scatter([list(o.inputs) for o in ops], [o.output for o in ops], ops[0].reduce_op, algo)


@dataclass(frozen=True, eq=False)
class ReduceScatterTensor(OpSpec):
    """``reduce_scatter_tensor``: chunk r of the reduction of every rank's flat ``input`` lands in rank r's ``output``."""

    name: ClassVar[str] = "reduce_scatter_tensor"
    collective: ClassVar[str] = "reduce_scatter"
    input: torch.Tensor
    output: torch.Tensor
    reduce_op: str

    def signature(self) -> tuple[tuple[str, object], ...]:
        return (*_shape_dtype(self.output), ("op", self.reduce_op))

    def sizes(self) -> Sizes:
        return Sizes.of(self.input, self.output)

    @classmethod
    def plan(cls, ops: list[ReduceScatterTensor], algo: Algorithm) -> plans.Plan:
        return plans.plan_reduce_scatter([o.input for o in ops], [o.output for o in ops], ops[0].reduce_op, algo)


@dataclass(frozen=True, eq=False)
class ReduceScatterTensorCoalesced(OpSpec):
    """``reduce_scatter_tensor`` of several tensors at once: one reduce-scatter of ``input`` (chunk r of every
    input, concatenated, for each rank r in turn) into ``output`` (the outputs concatenated), copied into
    each output tensor after. A one-tensor call is a :class:`ReduceScatterTensor`."""

    name: ClassVar[str] = "reduce_scatter_tensor_coalesced"
    collective: ClassVar[str] = "reduce_scatter"
    input: torch.Tensor
    output: torch.Tensor
    shapes: tuple[tuple[int, ...], ...]
    reduce_op: str

    def signature(self) -> tuple[tuple[str, object], ...]:
        return (("shapes", self.shapes), ("dtype", dtype_name(self.output.dtype)), ("op", self.reduce_op))

    def sizes(self) -> Sizes:
        return Sizes.of(self.input, self.output)

    @classmethod
    def plan(cls, ops: list[ReduceScatterTensorCoalesced], algo: Algorithm) -> plans.Plan:
        parts = [math.prod(shape) for shape in ops[0].shapes]
        return plans.plan_reduce_scatter(
            [o.input for o in ops], [o.output for o in ops], ops[0].reduce_op, algo, parts
        )


@dataclass(frozen=True, eq=False)
class Gather(OpSpec):
    """``gather``: every rank's ``input`` lands in the root's ``outputs[rank]`` (empty on other ranks)."""

    name: ClassVar[str] = "gather"
    collective: ClassVar[str] = "gather"
    input: torch.Tensor
    outputs: tuple[torch.Tensor, ...]
    root: int

    def signature(self) -> tuple[tuple[str, object], ...]:
        return (*_shape_dtype(self.input), ("root", self.root))

    def sizes(self) -> Sizes:
        return Sizes.of(self.input, self.input)

    def buffer_bytes(self, group_size: int) -> int:
        return group_size * _nbytes(self.input)  # the root's buffer: every rank's chunk

    @classmethod
    def plan(cls, ops: list[Gather], algo: Algorithm) -> plans.Plan:
        root = ops[0].root
        return plans.plan_gather([o.input for o in ops], list(ops[root].outputs), root, algo)


@dataclass(frozen=True, eq=False)
class Scatter(OpSpec):
    """``scatter``: the root's ``inputs[rank]`` lands in every rank's ``output`` (``inputs`` empty off the root)."""

    name: ClassVar[str] = "scatter"
    collective: ClassVar[str] = "scatter"
    output: torch.Tensor
    inputs: tuple[torch.Tensor, ...]
    root: int

    def signature(self) -> tuple[tuple[str, object], ...]:
        return (*_shape_dtype(self.output), ("root", self.root))

    def sizes(self) -> Sizes:
        return Sizes.of(self.output, self.output)

    def buffer_bytes(self, group_size: int) -> int:
        return group_size * _nbytes(self.output)  # the root's buffer: every rank's chunk

    @classmethod
    def plan(cls, ops: list[Scatter], algo: Algorithm) -> plans.Plan:
        root = ops[0].root
        return plans.plan_scatter(list(ops[root].inputs), [o.output for o in ops], root, algo)


@dataclass(frozen=True, eq=False)
class AllToAllSingle(OpSpec):
    """``all_to_all_single``: block j (rows ``in_splits[j]``) of rank r's ``input`` lands in block r of rank j's
    ``output``."""

    name: ClassVar[str] = "all_to_all_single"
    collective: ClassVar[str] = "all_to_all"
    input: torch.Tensor
    output: torch.Tensor
    in_splits: tuple[int, ...]
    out_splits: tuple[int, ...]

    def signature(self) -> tuple[tuple[str, object], ...]:
        return (("dtype", dtype_name(self.input.dtype)), ("row", tuple(self.input.shape[1:])))

    def sizes(self) -> Sizes:
        return Sizes.of(self.input, self.output)

    @classmethod
    def check_across(cls, ops: list[AllToAllSingle], sites: list[str]) -> None:
        """What each rank sends each other rank must be what that rank expects to receive."""
        n = len(ops)
        for r, c in enumerate(ops):
            for j in range(n):
                sent, expected = c.in_splits[j], ops[j].out_splits[r]
                row_in = c.input.numel() // max(1, sum(c.in_splits))
                row_out = ops[j].output.numel() // max(1, sum(ops[j].out_splits))
                if sent * row_in != expected * row_out:
                    raise CollectiveMismatchError(
                        f"all_to_all: rank {r} sends {sent} rows to rank {j} (at {sites[r]}) but rank {j} expects "
                        f"{expected} rows from rank {r} (at {sites[j]})"
                    )

    @classmethod
    def plan(cls, ops: list[AllToAllSingle], algo: Algorithm) -> plans.Plan:
        return plans.plan_all_to_all(
            [o.input for o in ops], [o.output for o in ops], [list(o.in_splits) for o in ops],
            [list(o.out_splits) for o in ops], algo,
        )


@dataclass(frozen=True, eq=False)
class AllToAll(AllToAllSingle):
    """``all_to_all`` of tensor lists, run as an all-to-all of the flattened lists (copied back after)."""

    name: ClassVar[str] = "all_to_all"

    def signature(self) -> tuple[tuple[str, object], ...]:
        return (("dtype", dtype_name(self.input.dtype)),)


@dataclass(frozen=True, eq=False)
class Barrier(OpSpec):
    """``barrier``: a one-element all-reduce on internal buffers."""

    name: ClassVar[str] = "barrier"
    collective: ClassVar[str] = "barrier"

    def signature(self) -> tuple[tuple[str, object], ...]:
        return ()

    def sizes(self) -> Sizes:
        return Sizes(4, 0, 0, "")

    @classmethod
    def plan(cls, ops: list[Barrier], algo: Algorithm) -> plans.Plan:
        return plans.plan_barrier(len(ops), algo)
