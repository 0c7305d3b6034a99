"""What a simulated process group refuses, and how: the arguments real gloo refuses, with gloo's words.

Each check raises what gloo raises (its message first) followed by the rank, the operation, the group, the
call site and what was expected; inputs gloo would crash on (a peer out of range) get the same kind of error.
The process group (:mod:`simdist.c10d.process_group`) calls these before it issues an operation.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from simdist.comm.group import GroupState
from simdist.comm.ops import dtype_name
from simdist.errors import InvalidArgumentError

#: element types gloo can move (it answers "Invalid scalar type" for the others); complex tensors reach the
#: backend as real views (torch's front end makes them) except in reduce, which passes them through
SUPPORTED_DTYPES = frozenset(
    {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32, torch.int64,
     torch.bool, torch.complex32, torch.complex64, torch.complex128}
)


def check_tensor(t: Any, what: str, stacklevel: int = 4) -> torch.Tensor:
    """``t`` if gloo can communicate it (a dense CPU tensor of a supported dtype); warns for a strided view.

    ``stacklevel`` points the warning at the user's call: 4 frames up from a process group's method.
    """
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
            stacklevel=stacklevel,
        )
    return t


class GlooArguments:
    """The checks of one rank's handle on one group: its size, its global ranks, where the call came from."""

    def __init__(self, state: GroupState, group_rank: int, call_site: Callable[[], object]) -> None:
        self.state = state
        self.grank = group_rank
        self.call_site = call_site

    def reject(self, op: str, problem: str, expected: str) -> InvalidArgumentError:
        """The error for a bad argument: gloo's words, then the rank, the op and what was expected."""
        st = self.state
        return InvalidArgumentError(
            f"{problem} (rank {st.global_ranks[self.grank]}, {op} on group {st.name or 'default'} of "
            f"{st.size} ranks, at {self.call_site()}): {expected}"
        )

    def root(self, op: str, root: int, arg: str) -> None:
        """``root`` (argument ``arg``) must be a rank of the group."""
        n = self.state.size
        if not 0 <= root < n:
            raise self.reject(
                op, f"ProcessGroupGloo::{op}: invalid root rank: {root}",
                f"{arg} must be a rank of the group, 0..{n - 1} (global ranks {self.state.global_ranks[0]}.."
                f"{self.state.global_ranks[-1]} in the default group)",
            )

    def tensor_list(self, op: str, tensors: Sequence[torch.Tensor], ref: torch.Tensor, what: str, ref_what: str) -> None:
        """One tensor per rank, each holding as many elements of the same dtype as ``ref``."""
        n = self.state.size
        if len(tensors) != n:
            raise self.reject(
                op, f"ProcessGroupGloo::{op}: invalid {what} list size {len(tensors)}",
                f"{what} needs one tensor per rank of the group ({n})",
            )
        for i, t in enumerate(tensors):
            check_tensor(t, f"{op} {what}", stacklevel=5)
            if t.numel() != ref.numel() or t.dtype != ref.dtype:
                raise self.reject(
                    op, f"ProcessGroupGloo::{op}: invalid tensor size or type at index {i}",
                    f"{what}[{i}] is {tuple(t.shape)} {t.dtype}, the {ref_what} is {tuple(ref.shape)} {ref.dtype}; "
                    f"every {what} tensor must match it",
                )

    def one_dtype(self, op: str, tensors: Sequence[torch.Tensor]) -> None:
        """A coalesced call moves tensors of one dtype."""
        dtypes = sorted({str(t.dtype) for t in tensors})
        if len(dtypes) > 1:
            raise self.reject(
                op, f"{op}: tensors of different dtypes {dtypes}",
                "coalesce tensors of one dtype per call (issue one call per dtype)",
            )

    def allreduce_coalesced(self, tensors: Sequence[torch.Tensor]) -> None:
        """At least one tensor, all of one dtype."""
        if not tensors:
            raise self.reject(
                "allreduce_coalesced", "all_reduce_coalesced got an empty list of tensors",
                "pass at least one tensor (torch's dispatcher rejects an empty list with gloo too)",
            )
        for t in tensors:
            check_tensor(t, "all_reduce_coalesced tensor", stacklevel=5)
        if len({t.dtype for t in tensors}) > 1:
            raise self.reject(
                "allreduce_coalesced", "all_reduce_coalesced: tensors of different dtypes",
                f"all tensors must have one dtype, got {sorted({str(t.dtype) for t in tensors})}",
            )

    def allgather_coalesced(self, output_lists: Sequence[Sequence[torch.Tensor]], input_list: Sequence[torch.Tensor]) -> None:
        """One output list per rank, each matching the input list tensor by tensor, all of one dtype."""
        n = self.state.size
        op = "allgather_coalesced"
        if len(output_lists) != n:
            raise self.reject(
                op, "ProcessGroupGloo::allgather_coalesced: output lists should be equal to world size",
                f"got {len(output_lists)} output lists for {n} ranks",
            )
        if not input_list:
            raise self.reject(op, "all_gather_coalesced got no input tensors", "pass at least one")
        for t in input_list:
            check_tensor(t, "all_gather_coalesced input", stacklevel=5)
        for r, outs in enumerate(output_lists):
            if len(outs) != len(input_list):
                raise self.reject(
                    op, "ProcessGroupGloo::allgather_coalesced: invalid output list",
                    f"output list {r} has {len(outs)} tensors, the input list {len(input_list)}",
                )
            for i, (o, t) in enumerate(zip(outs, input_list)):
                check_tensor(o, "all_gather_coalesced output", stacklevel=5)
                if tuple(o.shape) != tuple(t.shape) or o.dtype != t.dtype:
                    raise self.reject(
                        op, "ProcessGroupGloo::allgather_coalesced: invalid tensor size or type",
                        f"output_tensor_lists[{r}][{i}] is {tuple(o.shape)} {o.dtype}, input_tensor_list[{i}] is "
                        f"{tuple(t.shape)} {t.dtype}; they must match",
                    )
        if any(t.dtype != input_list[0].dtype for t in input_list):
            raise self.reject(op, "all_gather_coalesced: tensors of different dtypes", "use one dtype")

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """The output holds world_size times the input's elements, of its dtype."""
        check_tensor(output, "all_gather_into_tensor output", stacklevel=5)
        check_tensor(input, "all_gather_into_tensor input", stacklevel=5)
        n = self.state.size
        if output.numel() != n * input.numel() or output.dtype != input.dtype:
            raise self.reject(
                "allgather", "ProcessGroupGloo::allgather: invalid output tensor size or type",
                f"all_gather_into_tensor's output must hold world_size ({n}) x input.numel() = "
                f"{n * input.numel()} elements of {input.dtype}; got {output.numel()} of {output.dtype}",
            )

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """The input holds world_size times the output's elements, of its dtype."""
        check_tensor(output, "reduce_scatter_tensor output", stacklevel=5)
        check_tensor(input, "reduce_scatter_tensor input", stacklevel=5)
        n = self.state.size
        if input.numel() != n * output.numel() or output.dtype != input.dtype:
            raise self.reject(
                "reduce_scatter_tensor", "ProcessGroupGloo::reduce_scatter_tensor: invalid input size or type",
                f"the input must hold world_size ({n}) x output.numel() = {n * output.numel()} elements of "
                f"{output.dtype}; got {input.numel()} of {input.dtype}",
            )

    def coalesced_pairs(self, op: str, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], gather: bool) -> None:
        """One output per input; each pair sized as all_gather_into_tensor's (``gather``) or reduce_scatter's."""
        if len(outputs) != len(inputs) or not inputs:
            raise self.reject(
                op, f"{op}: invalid tensor lists",
                f"pass one output per input and at least one pair; got {len(outputs)} outputs, {len(inputs)} inputs",
            )
        n = self.state.size
        for i, (o, t) in enumerate(zip(outputs, inputs)):
            check_tensor(o, f"{op} output", stacklevel=5)
            check_tensor(t, f"{op} input", stacklevel=5)
            big, small, big_name, small_name = (o, t, "outputs", "inputs") if gather else (t, o, "inputs", "outputs")
            if big.numel() != n * small.numel() or o.dtype != t.dtype:
                problem = "invalid output tensor size or type" if gather else "invalid input size or type"
                raise self.reject(
                    op, f"{op}: {problem}",
                    f"{big_name}[{i}] must hold world_size ({n}) x {small_name}[{i}].numel() = {n * small.numel()} "
                    f"elements of {small.dtype}; got {big.numel()} of {big.dtype}",
                )
        self.one_dtype(op, inputs if gather else outputs)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Input and output of one dtype."""
        check_tensor(output, "all_to_all_single output", stacklevel=5)
        check_tensor(input, "all_to_all_single input", stacklevel=5)
        if input.dtype != output.dtype:
            raise self.reject(
                "alltoall_base", "all_to_all_single: input and output dtypes differ",
                f"input is {input.dtype}, output {output.dtype}",
            )

    def splits(self, t: torch.Tensor, sizes: Sequence[int] | None, what: str) -> list[int]:
        """The rows of ``t`` each rank gets (``sizes``, or equal parts), checked against its rows."""
        n = self.state.size
        rows = t.shape[0] if t.dim() > 0 else t.numel()
        if not sizes:
            if rows % n:
                raise self.reject(
                    "alltoall_base", f"all_to_all_single: the {what} has {rows} rows, not divisible by the group size {n}",
                    f"pass {what}_split_sizes (NCCL rejects this too; gloo silently drops the remainder)",
                )
            return [rows // n] * n
        sizes = list(sizes)
        if len(sizes) != n:
            raise self.reject(
                "alltoall_base", "Number of tensor splits not equal to group size",
                f"{what}_split_sizes {sizes} has {len(sizes)} entries for {n} ranks",
            )
        if sum(sizes) != rows or any(s < 0 for s in sizes):
            raise self.reject(
                "alltoall_base", "Split sizes doesn't match total dim 0 size",
                f"{what}_split_sizes {sizes} must be {n} non-negative row counts summing to the {what}'s {rows} rows",
            )
        return sizes

    def alltoall(self, output_tensors: Sequence[torch.Tensor], input_tensors: Sequence[torch.Tensor]) -> None:
        """One input and one output tensor per rank."""
        n = self.state.size
        for name, lst in (("input", input_tensors), ("output", output_tensors)):
            if len(lst) != n:
                raise self.reject(
                    "alltoall", f"ProcessGroupGloo::alltoall: {name} tensor list size {len(lst)} does not match world size {n}",
                    f"pass one {name} tensor per rank",
                )
        for t in list(output_tensors) + list(input_tensors):
            check_tensor(t, "all_to_all tensor", stacklevel=5)

    def peer(self, kind: str, peer: int | None, tag: int) -> None:
        """A send's or receive's peer is another rank of the group (gloo crashes otherwise); tags are >= 0."""
        st = self.state
        arg = "dst" if kind == "send" else "src"
        if peer is not None and not 0 <= peer < st.size:
            raise self.reject(
                kind, f"{kind}: invalid peer rank {peer}", f"{arg} must be a rank of the group, 0..{st.size - 1}"
            )
        if peer is not None and peer == self.grank:
            raise self.reject(
                kind, f"{kind}: rank {st.global_ranks[self.grank]} cannot {kind} to/from itself (gloo: \"Pair is not "
                "connected\")",
                f"{arg} must be another rank of the group",
            )
        if tag < 0:
            raise self.reject(kind, "Tag must be nonnegative", f"got tag={tag}")
