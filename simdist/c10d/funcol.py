"""torch's functional collectives (``torch.ops._c10d_functional``) inside a run: the two kernels simdist supplies.

Most functional collectives reach a :class:`~simdist.c10d.process_group.SimProcessGroup` through torch's C++
trampoline, which forwards ``allreduce``, ``broadcast``, ``all_to_all_single`` and the ``*_single_coalesced``
calls. Two pieces do not:

- ``wait_tensor``: torch's kernel waits only for works in torch's work registry, where its C++ front end puts
  functional collectives (and, inside ``allow_inflight_collective_as_graph_input_ctx()``, the works of
  ``dist.*`` calls). A Python process group's ``dist.all_reduce(t, async_op=True)`` never gets there, so
  ``wait_tensor(t)`` returned ``t`` unreduced. Here it first waits, in simulated time, for every collective
  or point-to-point operation of the calling rank still writing ``t``'s memory (and hands the buffer back to
  rank code for the race detector), then runs torch's kernel (which empties torch's registry).
- ``all_gather_into_tensor_out``: torch's kernel calls ``_allgather_base``, which the trampoline does not
  forward. Here it calls the group's ``all_gather_single`` and leaves the work for ``wait_tensor``.

Both are CPU kernels registered with ``torch.library`` for the run's duration only (:func:`installed`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed.distributed_c10d as c10d

from simdist.clock.baton import current_rank_state
from simdist.errors import InvalidArgumentError

_WAIT = torch.ops._c10d_functional.wait_tensor.default
#: torch's C++ kernels are registered for CompositeExplicitAutograd, which fills every backend key;
#: redispatching to one no library claims reaches them past the CPU kernels registered here (not Meta:
#: funcol registers Python meta kernels there)
_TORCH_KERNEL = torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse3)


class PendingWrites:
    """Per rank, the operations not yet waited for by that rank and the memory they write, by storage.

    Works are held weakly: one that rank code dropped (and that has finished) leaves the index by itself.
    """

    def __init__(self) -> None:
        #: rank -> storage pointer -> [(first byte, end byte, work)]
        self._by_rank: dict[int, dict[int, list[tuple[int, int, weakref.ref]]]] = {}
        self._size = 0
        self._sweep_at = 1024

    def add(self, rank: int, work: Any, tensors: Any) -> None:
        """Record that ``work`` (issued by ``rank``) writes ``tensors`` until waited for."""
        ref = None
        for t in tensors:
            mem = _memory(t)
            if mem is None:
                continue
            ref = ref or weakref.ref(work)
            self._by_rank.setdefault(rank, {}).setdefault(mem[0], []).append((mem[1], mem[2], ref))
            self._size += 1
        if self._size > self._sweep_at:
            self._sweep()

    def writers(self, rank: int, t: torch.Tensor) -> list[Any]:
        """The live works of ``rank`` whose written memory overlaps ``t``'s, in issue order (removed from the index)."""
        mem = _memory(t)
        by_storage = self._by_rank.get(rank)
        if mem is None or not by_storage or mem[0] not in by_storage:
            return []
        found, kept = [], []
        for lo, hi, ref in by_storage[mem[0]]:
            work = ref()
            if work is None:
                continue
            if lo < mem[2] and mem[1] < hi:
                if work not in found:
                    found.append(work)
            else:
                kept.append((lo, hi, ref))
        if kept:
            by_storage[mem[0]] = kept
        else:
            del by_storage[mem[0]]
        return found

    def _sweep(self) -> None:
        """Drop the entries of works that no longer exist."""
        size = 0
        for by_storage in self._by_rank.values():
            for key in list(by_storage):
                alive = [e for e in by_storage[key] if not _stale(e[2]())]
                if alive:
                    by_storage[key] = alive
                    size += len(alive)
                else:
                    del by_storage[key]
        self._size = size
        self._sweep_at = max(1024, 2 * size)


def _stale(work: Any) -> bool:
    """Whether waiting for ``work`` would change nothing: gone, or complete and not owning buffers for the
    race detector (which forgets an operation once rank code has waited for it)."""
    return work is None or (work.event.processed and "_race_entry" not in work.__dict__)


def _memory(t: Any) -> tuple[int, int, int] | None:
    """(storage pointer, first byte, end byte) of a CPU tensor with data; None for others."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.numel() == 0:
        return None
    try:
        lo = t.data_ptr()
        return t.untyped_storage().data_ptr(), lo, lo + t.numel() * t.element_size()
    except RuntimeError:  # wrapper subclasses and tensors without storage
        return None


#: the index of the run in progress (None outside a run)
_pending: dict[str, PendingWrites | None] = {"index": None}


def track(rank: int, work: Any, writes: Any) -> None:
    """Record that ``work``, issued by global rank ``rank``, writes ``writes`` (no-op outside a run)."""
    index = _pending["index"]
    if index is not None:
        index.add(rank, work, writes)


def _wait_tensor(t: torch.Tensor) -> torch.Tensor:
    """``wait_tensor`` in a run: wait for the rank's operations writing ``t``, then torch's registry."""
    state = current_rank_state()
    index = _pending["index"]
    if state is not None and index is not None:
        for work in index.writers(state.rank, t):
            work.wait()
    return _WAIT.redispatch(_TORCH_KERNEL, t)


def _all_gather_into_tensor_out(input: torch.Tensor, group_size: int, group_name: Any, *, out: torch.Tensor) -> torch.Tensor:
    """``all_gather_into_tensor_out``: all-gather ``input`` into ``out``; ``wait_tensor(out)`` waits for it."""
    group = c10d._resolve_process_group(group_name) if isinstance(group_name, str) else group_name
    if group.size() != group_size:
        raise InvalidArgumentError(
            f"all_gather_into_tensor_out: group_size={group_size} but group {group.group_name!r} has "
            f"{group.size()} ranks; pass the group's size"
        )
    group.all_gather_single(out, input)
    return out


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """The run-scoped kernels and the pending-writes index, removed afterwards."""
    lib = torch.library.Library("_c10d_functional", "IMPL")
    lib.impl("wait_tensor", _wait_tensor, "CPU")
    lib.impl("all_gather_into_tensor_out", _all_gather_into_tensor_out, "CPU")
    _pending["index"] = PendingWrites()
    try:
        yield
    finally:
        _pending["index"] = None
        lib._destroy()
