"""Kernels on side streams, for the race detector: what a kernel queued on a side stream reads and writes.

Values are computed eagerly in program order, so a program that reads a side stream's result without waiting
for that stream still gets the value it would get with the wait. On a GPU it would read whatever the memory held
then: such a read is reported as a race (:meth:`simdist.comm.races.RaceDetector.issue_on_stream`), naming the
kernel's call site and the reading op's. Kernels on the default stream are not tracked (a side stream reading
what the default stream still writes goes unreported): naming their call sites would cost every op of every
program that has a side stream (FSDP2 makes four) a stack walk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from simdist.clock.baton import current_rank_state
from simdist.comm.context import RunContext
from simdist.comm.races import _written_args


def kernel_tracker(ctx: RunContext) -> Callable[[Any, Any], None]:
    """The function the cost mode calls after each op on a simulated GPU (``call``, its CPU result ``out``): an op
    queued on a side stream is recorded with its buffers until another stream waits for it."""
    races = ctx.races

    def track(call: Any, out: Any) -> None:
        state = current_rank_state()
        if state is None or state.stream == 0:
            return
        written = _written_args(call.func)
        if written is None:
            return
        positions, names = written
        reads: list[torch.Tensor] = []
        writes = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        for i, a in enumerate(call.args):
            _sort(a, i in positions, reads, writes)
        for k, a in call.kwargs.items():
            _sort(a, k in names, reads, writes)
        op = str(call.func).removesuffix(".default")
        done_at = ctx.time.stream_end(state.stream)
        races.issue_on_stream(state.rank, op, state.stream, ctx.call_site(), reads, writes, done_at)

    return track


def _sort(arg: Any, written: bool, reads: list[torch.Tensor], writes: list[torch.Tensor]) -> None:
    """Add the tensors in ``arg`` to ``writes`` or ``reads``, once each."""
    target = writes if written else reads
    for t in tree_leaves(arg) if isinstance(arg, (list, tuple)) else (arg,):
        if (
            isinstance(t, torch.Tensor)
            and not any(t is seen for seen in writes)
            and not any(t is seen for seen in reads)
        ):
            target.append(t)
