"""Waiting, before a backward pass returns, for the collectives whose futures were taken inside it.

torch's C++ DDP reducer takes the future of each bucket's all-reduce inside backward and waits on it from an
autograd engine callback, in C++, where a simulated rank cannot hand the baton back. A callback queued here,
when the first future of a backward is taken, runs before the reducer's (callbacks run in queue order, and
the reducer queues its own after launching its last bucket) and waits on those works through the baton, so
they are complete when C++ looks at them. Works whose future nobody takes are left alone: they complete
whenever the other ranks join them.

For the race detector, a drained work counts as waited for (its buffers are rank code's again) only if torch
took its future (the reducer or one of torch's comm hooks, which C++ waits on) or a callback was chained to it
(a custom comm hook's ``fut.then(...)``). A future that rank code took in a hook and never waited on still
owns its buffers after backward, as on real hardware.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

#: per rank thread: the autograd graph task being drained and the works taken in it
_tls = threading.local()


def drain_at_end_of_backward(work: Any, taken_by_torch: bool) -> None:
    """Have the current backward pass wait for ``work`` before it returns (no-op outside backward).

    ``work`` needs ``wait()`` and ``block_until_done()`` (and ``future``, if it is a work); ``taken_by_torch``
    says whether torch's own code took its future.
    """
    task = torch._C._current_graph_task_id()
    if task == -1:
        return
    if getattr(_tls, "task", None) != task:
        _tls.task = task
        works: list[tuple[Any, bool]] = []
        _tls.works = works
        torch.autograd.Variable._execution_engine.queue_callback(lambda: _drain(works))
    _tls.works.append((work, taken_by_torch))


def _drain(works: list[tuple[Any, bool]]) -> None:
    for w, by_torch in works:
        if by_torch or getattr(getattr(w, "future", None), "chained", False):
            w.wait()
        else:
            w.block_until_done()
