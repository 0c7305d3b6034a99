"""Recording a rank process's collectives and sends/recvs with their times (``real.run(..., timeline=DIR)``).

Where the hook sits, and why there: every collective and point-to-point call of a torch.distributed process
group, whoever makes it (``dist.all_reduce`` in rank code, torch's C++ DDP reducer inside ``backward()``,
functional collectives, DTensor, FSDP2), goes through the dispatcher as an op of the ``c10d`` namespace
(``c10d::allreduce_``, ``c10d::send``, ...). Those ops have kernels for the backends' keys only; the
``ADInplaceOrView`` key in front of them falls through. The recorder registers a kernel there (for the
duration of the rank code, through a ``torch.library.Library`` it destroys afterwards) that notes the time,
hands the call on unchanged to the backend's kernel, and watches the returned work complete. Autograd's own
handling of these ops (above that key) is untouched, and no other op passes through Python, so a rank that
records computes as one that does not, each collective paying the recorder's Python (tens to hundreds of
microseconds on a loaded 2-core machine; see docs/real.md). Collectives issued inside
``torch.inference_mode()`` skip that key and are not recorded.

How an op's end is seen: by a callback on its work's future (gloo completes it on its worker thread when the
op is done; NCCL's future carries CUDA events, and the callback records an event on a stream that waits for
them, read back on the host's clock at the end). gloo's sends and receives have no future: their end is when
a ``wait()`` on them (``dist.send``'s own, or the rank code's on an ``isend``) returned, found by a
replacement of ``torch.distributed.Work.wait`` that calls the original and is undone afterwards.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from simdist_base.timeline import BY_FUTURE, BY_WAIT, UNOBSERVED, CommRecord, RankTimeline, write

#: c10d's dispatcher ops -> (the name simdist's trace gives the operation, the argument holding its input)
OPS: dict[str, tuple[str, str]] = {
    "allreduce_": ("all_reduce", "tensors"),
    "allreduce_coalesced_": ("all_reduce_coalesced", "tensors"),
    "broadcast_": ("broadcast", "tensors"),
    "reduce_": ("reduce", "tensors"),
    "allgather_": ("all_gather", "input_tensors"),
    "_allgather_base_": ("all_gather_into_tensor", "input_tensor"),
    "allgather_coalesced_": ("all_gather_coalesced", "input_list"),
    "allgather_into_tensor_coalesced_": ("all_gather_into_tensor_coalesced", "inputs"),
    "reduce_scatter_": ("reduce_scatter", "input_tensors"),
    "_reduce_scatter_base_": ("reduce_scatter_tensor", "input_tensor"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter_tensor_coalesced", "inputs"),
    "gather_": ("gather", "input_tensors"),
    "scatter_": ("scatter", "output_tensors"),
    "alltoall_": ("all_to_all", "input_tensors"),
    "alltoall_base_": ("all_to_all_single", "input"),
    "barrier": ("barrier", ""),
    "send": ("send", "tensors"),
    "recv_": ("recv", "tensors"),
    "recv_any_source_": ("recv", "tensors"),
}
#: the dispatch key the recording kernels sit at (see the module's description)
KEY = "ADInplaceOrView"
#: frames of these directories are not the rank code's call site: torch's, real's and the stdlib's wrappers
_NOT_SITES = (
    os.path.dirname(torch.__file__) + os.sep,
    os.path.dirname(__file__) + os.sep,
    os.path.dirname(contextlib.__file__) + os.sep + "functools.py",
    contextlib.__file__,
)


def profile_name(rank: int) -> str:
    """The name of ``rank``'s torch profiler trace in a timeline directory."""
    return f"rank{rank}.trace.json"


@dataclass
class _Pending:
    """A record while its op may still be running (its end set from another thread, or from CUDA events)."""

    record: dict[str, Any]
    end: float | None = None
    completion: str = UNOBSERVED
    start_event: Any = None
    end_event: Any = None
    #: the op's future, where it has one, and set once the callback that notes its end has run
    future: Any = None
    noted: threading.Event | None = None


#: how long the records wait, at the end, for the end of an op whose future has completed to be noted (torch
#: wakes a future's waiters before it runs its callbacks, on the thread that completed it)
NOTE_TIMEOUT = 10.0


class Recorder:
    """Records this process's collectives and sends/recvs while its ``with`` block runs; writes them at the end.

    The process's state is as it was after the block: the kernels are deregistered, ``Work.wait`` restored, the
    profiler (``profile=True``) stopped.
    """

    def __init__(
        self, rank: int, directory: str | Path, profile: bool = False, device_events: bool = True
    ) -> None:
        self.rank = rank
        self.directory = Path(directory)
        self.profile = profile
        # CUDA tensors' ops are timed by CUDA events only on a real device: an emulated one computes on the
        # CPU, where the host's times are the op's
        self.device_events = device_events
        self._pending: list[_Pending] = []
        self._count = itertools.count()
        self._by_work: dict[int, tuple[Any, _Pending]] = {}
        self._inside = threading.local()
        self._groups: dict[int, tuple[str, tuple[int, ...]]] = {}
        self._cuda_anchor: tuple[Any, float] | None = None

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Record while the block runs; write ``rank<R>.timeline.json`` (and the profile) however it ends."""
        self.directory.mkdir(parents=True, exist_ok=True)
        origin = time.monotonic()
        timeline = RankTimeline(self.rank, socket.gethostname(), origin, time.time() - origin)
        library = torch.library.Library("c10d", "IMPL")
        original_wait = dist.Work.wait
        profiler = self._profiler() if self.profile else None
        try:
            for name in OPS:
                library.impl(name, self._kernel(name), KEY, with_keyset=True)
            dist.Work.wait = self._waiting(original_wait)  # type: ignore[method-assign]
            if profiler is not None:
                profiler.start()
            yield
        finally:
            dist.Work.wait = original_wait  # type: ignore[method-assign]
            library._destroy()
            if profiler is not None:
                profiler.stop()
                profiler.export_chrome_trace(str(self.directory / profile_name(self.rank)))
                timeline.profile = profile_name(self.rank)
            timeline.records = self._records()
            write(timeline, self.directory)

    # ------------------------------------------------------------------ the hook
    def _kernel(self, name: str) -> Any:
        """The recording kernel of c10d op ``name``: note, hand on below this key, watch the work."""
        op = getattr(torch.ops.c10d, name).default
        schema = [a.name for a in op._schema.arguments]
        group_at = schema.index("process_group")
        op_name, input_name = OPS[name]
        input_at = schema.index(input_name) if input_name else None
        peer_at = next((schema.index(a) for a in ("dst", "src") if a in schema), None)
        below = torch._C._after_ADInplaceOrView_keyset

        def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
            # an op a tensor subclass issues again on its inner tensors is the same operation
            if getattr(self._inside, "active", False):
                return op.redispatch(keyset & below, *args, **kwargs)
            self._inside.active = True
            try:
                tensors = _tensors(args[input_at]) if input_at is not None and input_at < len(args) else []
                cuda = self.device_events and any(t.is_cuda for t in tensors)
                pending = _Pending(self._describe(op_name, args, group_at, peer_at, tensors))
                if cuda:
                    pending.start_event = self._event()
                self._pending.append(pending)
                pending.record["start"] = time.monotonic()
                out = op.redispatch(keyset & below, *args, **kwargs)
                # the op ran; a work this recorder cannot watch leaves its end unobserved, never fails the call
                with contextlib.suppress(RuntimeError, TypeError, AttributeError):
                    self._watch(pending, out[-1] if isinstance(out, tuple) else out, cuda)
                return out
            finally:
                self._inside.active = False

        return kernel

    def _describe(
        self, op: str, args: tuple[Any, ...], group_at: int, peer_at: int | None, tensors: list[torch.Tensor]
    ) -> dict[str, Any]:
        """The record's fields known at issue: op, group, sizes, peer and call site."""
        try:
            group, ranks = self._group(args[group_at])
        except (RuntimeError, TypeError, AttributeError):
            group, ranks = "", ()  # a group this recorder cannot name: the op still runs, unnamed
        peer = None
        if peer_at is not None and peer_at < len(args):
            local = int(args[peer_at])
            peer = ranks[local] if 0 <= local < len(ranks) else local
        return {
            "rank": self.rank, "index": next(self._count), "op": op, "group": group, "group_ranks": ranks,
            "nbytes": sum(t.numel() * t.element_size() for t in tensors),
            "dtype": str(tensors[0].dtype).removeprefix("torch.") if tensors else "", "site": _site(),
            "peer": peer,
        }  # fmt: skip

    def _group(self, boxed: Any) -> tuple[str, tuple[int, ...]]:
        """The name and global ranks of the process group the dispatcher passed (boxed as a ScriptObject)."""
        group = dist.ProcessGroup.unbox(boxed)
        key = id(group)
        if key not in self._groups:
            try:
                ranks = tuple(dist.get_process_group_ranks(group))
            except (ValueError, RuntimeError, KeyError):  # a group torch's world map does not know
                ranks = ()
            self._groups[key] = (group.group_name or "default", ranks)
        return self._groups[key]

    def _watch(self, pending: _Pending, boxed_work: Any, cuda: bool) -> None:
        """Set ``pending``'s end when its work completes: by its future, else when a wait on it returns."""
        work = dist.Work.unbox(boxed_work)
        try:
            future = work.get_future()
        except RuntimeError:  # gloo's send and recv works have none
            self._by_work[id(work)] = (work, pending)
            return
        self._on_future(pending, future, cuda)

    def _on_future(self, pending: _Pending, future: Any, cuda: bool) -> None:
        """Set ``pending``'s end when ``future`` completes."""
        pending.future, pending.noted = future, threading.Event()

        def completed(_future: Any) -> None:
            try:
                pending.end, pending.completion = time.monotonic(), BY_FUTURE
                if (
                    cuda
                ):  # on a stream that waits for the op's own events; without one, the host's times stand
                    with contextlib.suppress(RuntimeError):
                        pending.end_event = self._event()
            finally:
                pending.noted.set()  # type: ignore[union-attr]

        future.add_done_callback(completed)

    def _waiting(self, original: Any) -> Any:
        """``Work.wait`` that notes when a wait on a work without a future returned."""
        by_work = self._by_work

        def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(work, *args, **kwargs)
            entry = by_work.pop(id(work), None)
            if entry is not None and entry[0] is work:
                entry[1].end, entry[1].completion = time.monotonic(), BY_WAIT
            return result

        return wait

    # ------------------------------------------------------------------ CUDA and the profiler
    def _event(self) -> Any:
        """A timed CUDA event recorded on the current stream now (the clock's anchor taken first)."""
        if self._cuda_anchor is None:
            torch.cuda.synchronize()
            anchor = torch.cuda.Event(enable_timing=True)
            anchor.record()
            anchor.synchronize()
            self._cuda_anchor = (anchor, time.monotonic())
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _profiler(self) -> Any:
        """A torch profiler of this process's CPU (and CUDA, where there is one) activity."""
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        return torch.profiler.profile(activities=activities, record_shapes=True)

    def _records(self) -> list[CommRecord]:
        """The finished records; CUDA ops' times read from their events on the host's clock."""
        if self._cuda_anchor is not None:
            torch.cuda.synchronize()
        out = []
        deadline = time.monotonic() + NOTE_TIMEOUT
        for p in self._pending:
            if p.noted is not None and p.future.done():  # completed: its end is noted now, or in a moment
                p.noted.wait(max(0.0, deadline - time.monotonic()))
            fields = dict(p.record)
            end, completion = p.end, p.completion
            if self._cuda_anchor is not None and p.start_event is not None and p.end_event is not None:
                anchor, at = self._cuda_anchor
                # an event that cannot be read (another device's, a failed op's) leaves the host's times
                with contextlib.suppress(RuntimeError):
                    fields["start"], end = (
                        at + anchor.elapsed_time(p.start_event) / 1e3,
                        at + anchor.elapsed_time(p.end_event) / 1e3,
                    )
            out.append(CommRecord(**fields, end=end, completion=completion))
        return out


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in an op's argument (a tensor, or lists of them nested)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _site() -> str:
    """``file:line in function`` of the innermost frame of the rank code that led to this op."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_NOT_SITES):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return ""
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
