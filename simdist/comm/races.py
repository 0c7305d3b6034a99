"""The in-flight buffer race detector.

An asynchronous collective or point-to-point operation owns its buffers from the moment a rank issues it until
that rank has *observed* its completion (``Work.wait()``, a wait on its future, ``is_completed()`` or the
future's ``done()`` returning True, ``torch.futures.wait_all``; see ``comm.work``). While it owns them, two
things are races on real hardware:

- **overlap**: the same rank issues a second operation whose buffers overlap the first's in memory, and at
  least one of the two writes the overlapping bytes (a tied weight's gradient all-reduced twice). Under
  NCCL-like progress the two run one after another on the group's stream and the result can come out right
  by luck; under gloo-like progress they run at once on gloo threads and corrupt each other.
- **access**: rank code (any aten op, e.g. ``optimizer.step()`` or autograd accumulating a gradient) reads a
  buffer the operation writes, or writes a buffer it reads or writes.

Buffers are compared as byte ranges of the process's memory (all ranks share one process, so the ranges of
different ranks never meet; checks are per rank anyway). An operation's range for a tensor is the block gloo
touches: ``numel`` elements from the first one. Mode ``"error"`` raises :class:`RaceError` in the rank at the
racing call; ``"warn"`` issues a :class:`RaceWarning` once per distinct pair of call sites and keeps every
finding in ``RunResult.races``. A finding every side of which a race waiver names (``comm.waivers``) neither
raises nor warns: it is kept apart, in ``RunResult.waived_races``.
"""

from __future__ import annotations

import functools
import math
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from simdist import uninitialised
from simdist.clock.baton import current_rank_state
from simdist.comm.waivers import RaceWaiver
from simdist.errors import RaceError, RaceWarning, RunArgumentError
from simdist.options import RACE_MODES
from simdist.untraced import never_compiled


@dataclass
class Region:
    """Bytes ``[lo, hi)`` of one tensor an operation reads (and maybe writes)."""

    lo: int
    hi: int
    writes: bool
    what: str  # "tensor (4, 8) float32" style

    def overlaps(self, lo: int, hi: int) -> bool:
        """Whether ``[lo, hi)`` shares a byte with this region."""
        return lo < self.hi and self.lo < hi


@dataclass
class InFlight:
    """One rank's part of an operation that rank has not yet seen complete."""

    rank: int
    op: str
    seq: int | None
    group: str
    site: str
    issued_at: float
    regions: list[Region]
    #: the tensors themselves, so their memory cannot be reused while the operation owns it
    tensors: list[torch.Tensor]
    #: simulated time the operation completed on this rank (set by the work), None before
    done_at: float | None = None
    #: storage keys of its regions (where the detector indexes them)
    keys: list[int] = field(default_factory=list)
    #: for a kernel on a side stream of a simulated GPU: that stream's number (None: a communication operation)
    stream: int | None = None
    #: whether the kernel's buffer is still where it was (None: always, for an operation that holds its tensors)
    alive: Callable[[], bool] | None = None

    def describe(self) -> str:
        """``all_reduce #3 on group default`` style text."""
        if self.stream is not None:
            return f"{self.op} on {stream_text(self.stream)}"
        num = f" #{self.seq}" if self.seq is not None else ""
        return f"{self.op}{num} on group {self.group or 'default'}"


@dataclass
class Race:
    """One race found on one rank.

    ``kind`` is ``"overlap"`` (two operations) or ``"access"`` (rank code and an operation). ``first`` is the
    operation in flight; for an overlap ``second`` is the operation issued while it was, for an access
    ``access`` names the aten op and whether it read or wrote. Times are simulated seconds.
    """

    kind: str
    rank: int
    first: InFlight
    second: InFlight | None
    access: str | None
    site: str
    time: float
    buffer: str
    address: int
    nbytes: int
    progress: str
    #: the race waivers that named this finding's sides (empty: not waived)
    waived_by: tuple[str, ...] = ()

    @property
    def _first_writes(self) -> bool:
        """Whether the operation in flight writes the bytes of the finding."""
        lo, hi = self.address, self.address + self.nbytes
        return any(r.writes and r.overlaps(lo, hi) for r in self.first.regions)

    @property
    def sites(self) -> tuple[str, str]:
        """The call sites of both sides: the operation in flight, then the second operation or the access."""
        return (self.first.site, self.second.site if self.second is not None else self.site)

    @property
    def window(self) -> tuple[float, float | None]:
        """The simulated interval in which both sides held the buffer (end None while still unknown)."""
        if self.kind == "access":
            return (self.first.issued_at, self.time)
        ends = (self.first.done_at, self.second.done_at if self.second else None)
        return (self.time, None if None in ends else min(ends))  # type: ignore[type-var]

    def key(self) -> tuple:
        """What makes two findings (on different ranks) the same bug."""
        other = self.second.site if self.second else self.access
        return (self.kind, self.first.op, self.first.site, other, self.site)

    def __str__(self) -> str:
        f = self.first
        start, end = self.window
        until = f"{end:.9g} s" if end is not None else "(still in flight)"
        head = f"race on rank {self.rank}"
        lines = []
        if self.kind == "overlap":
            s = self.second
            assert s is not None
            lines.append(
                f"{head}: two operations in flight on overlapping memory ({self.nbytes} bytes of {self.buffer} "
                f"at 0x{self.address:x}), both in flight from {start:.9g} s until {until}"
            )
            lines.append(f"  first:  {f.describe()}, issued at {f.issued_at:.9g} s from {f.site}")
            lines.append(f"  second: {s.describe()}, issued at {s.issued_at:.9g} s from {s.site}")
            if self.progress == "nccl":
                lines.append(
                    "  Under NCCL-like progress these ran one after the other on the group's stream, so the data "
                    "may have come out right; on gloo (a pool of threads) they run at once and corrupt each other."
                )
            lines.append(
                "  Fix: issue one operation per buffer (de-duplicate shared parameters), or wait() the first "
                "before issuing the second."
            )
        elif f.stream is not None:
            lines.append(
                f"{head}: rank code {self.access} {self.nbytes} bytes of {self.buffer} at 0x{self.address:x} at "
                f"{self.time:.9g} s, which {f.describe()} (queued at {f.issued_at:.9g} s from {f.site}, done at "
                f"{f.done_at:.9g} s on the device) {'writes' if self._first_writes else 'reads'}, without waiting "
                "for that stream"
            )
            lines.append(f"  access at: {self.site}")
            lines.append(
                "  Fix: make the stream that touches it wait for the side stream first "
                "(torch.cuda.current_stream().wait_stream(s), or event.wait() on an event recorded on s after the "
                "kernel), or synchronize the host with it."
            )
        else:
            lines.append(
                f"{head}: rank code {self.access} {self.nbytes} bytes of {self.buffer} at 0x{self.address:x} at "
                f"{self.time:.9g} s, while {f.describe()} (issued at {f.issued_at:.9g} s from {f.site}) owns it"
            )
            lines.append(f"  access at: {self.site}")
            lines.append(
                "  Fix: wait() on the operation's work (or its future) before touching its buffers "
                "(e.g. finish gradient synchronisation before optimizer.step())."
            )
        if self.waived_by:
            lines.append(f"  waived by race_waivers {list(self.waived_by)}")
        return "\n".join(lines)


def _same_storage(ref: weakref.ref, key: int) -> Callable[[], bool]:
    """Whether the storage ``ref`` refers to is alive and still at ``key``."""

    def alive() -> bool:
        storage = ref()
        return storage is not None and storage.data_ptr() == key

    return alive


def stream_text(stream: int) -> str:
    """``the default stream`` or ``side stream 3``."""
    return "the default stream" if stream == 0 else f"side stream {stream}"


def _nbytes_block(t: torch.Tensor) -> int:
    """Bytes an operation touches for ``t``: ``numel`` elements from the first (gloo ignores strides)."""
    return t.numel() * t.element_size()


def _extent(t: torch.Tensor) -> int:
    """Bytes spanned by a strided view from its first element to one past its last."""
    if t.is_contiguous():
        return t.numel() * t.element_size()
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0)
    return (last + 1) * t.element_size()


@functools.cache
def _own_dispatch(cls: type) -> bool:
    """Whether a tensor subclass handles dispatch itself (its data is not its storage's bytes)."""
    return any("__torch_dispatch__" in c.__dict__ for c in cls.__mro__ if c is not torch.Tensor and issubclass(c, torch.Tensor))


def _memory(t: torch.Tensor) -> tuple[int, int] | None:
    """(storage key, first byte) of a tensor with host memory; None for empty, meta and wrapper tensors."""
    if t.numel() == 0 or t.device.type != "cpu":
        return None
    cls = type(t)
    if cls is not torch.Tensor and cls is not torch.nn.Parameter and _own_dispatch(cls):
        return None
    try:
        return t.untyped_storage().data_ptr(), t.data_ptr()
    except RuntimeError:  # tensors without storage
        return None


class RaceDetector:
    """Per-run race book-keeping: each rank's operations in flight, and the races found.

    In-flight regions are indexed per rank by storage: only regions of one storage can overlap, so checking
    an operation or an access costs the number of in-flight regions on the same storage, not all of them.
    """

    def __init__(self, mode: str, progress: str, now: Any) -> None:
        if mode not in RACE_MODES:
            raise RunArgumentError(f"races must be one of {RACE_MODES}, got {mode!r}")
        self.mode = mode
        self.progress = progress
        self._now = now
        #: rank -> storage key -> [(operation, region)] of the operations that rank has not seen complete
        self.inflight: dict[int, dict[int, list[tuple[InFlight, Region]]]] = {}
        self.races: list[Race] = []
        #: known findings: every side named by a waiver (kept, counted, never raised or warned)
        self.waived: list[Race] = []
        self.waivers: tuple[RaceWaiver, ...] = ()
        #: findings each waiver named, by its text
        self.waiver_hits: dict[str, int] = {}
        self._warned: set[tuple] = set()
        #: ranks whose accesses are not checked right now (inside a future's callback, which runs after completion)
        self.suspended: set[int] = set()
        #: rank -> stream -> how far (simulated seconds on each other stream) that stream's later work is
        #: ordered
        #: after the others: a vector clock, merged when a stream waits for an event (waits are transitive)
        self.clocks: dict[int, dict[int, dict[int, float]]] = {}

    @property
    def enabled(self) -> bool:
        """Whether anything is checked."""
        return self.mode != "off"

    # ------------------------------------------------------------------ operations
    def issue(
        self,
        rank: int,
        work: Any,
        op: str,
        seq: int | None,
        group: str,
        site: str,
        reads: list[torch.Tensor],
        writes: list[torch.Tensor],
    ) -> None:
        """Record that ``rank`` issued ``work`` over these buffers; report overlaps with its operations in flight."""
        placed, tensors = [], []
        for ts, w in ((writes, True), (reads, False)):
            for t in ts:
                mem = _memory(t)
                if mem is None:
                    continue
                lo = mem[1]
                placed.append((mem[0], Region(lo, lo + _nbytes_block(t), w, f"tensor {tuple(t.shape)} {str(t.dtype)[6:]}")))
                tensors.append(t)
        if not placed:
            return
        new = InFlight(rank, op, seq, group, site, self._now(), [r for _, r in placed], tensors)
        by_storage = self.inflight.setdefault(rank, {})
        reported: set[int] = set()
        stream = None
        for key, b in placed:
            for old, a in by_storage.get(key, ()):
                if old.stream is not None:
                    # a side stream's kernel: the collective starts when the issuing thread's current stream
                    # reaches it, which is after the kernel only if that stream waited for it
                    if stream is None:
                        state = current_rank_state()
                        stream = state.stream if state is not None else 0
                    if (
                        id(old) not in reported
                        and not self.ordered(old, rank, stream)
                        and old.alive()
                        and (a.writes or b.writes)
                        and a.overlaps(b.lo, b.hi)
                    ):
                        reported.add(id(old))
                        lo, hi = max(a.lo, b.lo), min(a.hi, b.hi)
                        verb = "wrote" if b.writes else "read"
                        access = f"{verb} (in {new.describe()}, issued on {stream_text(stream)})"
                        self._report(
                            Race("access", rank, old, None, access, site, new.issued_at, b.what, lo, hi - lo, self.progress)
                        )
                    continue
                if id(old) not in reported and (a.writes or b.writes) and a.overlaps(b.lo, b.hi):
                    reported.add(id(old))
                    lo, hi = max(a.lo, b.lo), min(a.hi, b.hi)
                    self._report(Race("overlap", rank, old, new, None, site, new.issued_at, b.what, lo, hi - lo, self.progress))
        for key, region in placed:
            by_storage.setdefault(key, []).append((new, region))
        new.keys = [key for key, _ in placed]
        work._race_entry = new
        weakref.finalize(work, self._forget, new)

    def issue_on_stream(
        self,
        rank: int,
        op: str,
        stream: int,
        site: str,
        reads: list[torch.Tensor],
        writes: list[torch.Tensor],
        done_at: float,
    ) -> None:
        """Record that ``rank`` queued kernel ``op`` on its side stream ``stream`` (done at ``done_at`` on the
        device): until another stream waits for it, that stream touching these buffers is a race.

        Each buffer is held weakly, one entry per tensor: the entry ends with the tensor's storage, and is ignored
        once that storage has moved (FSDP frees and re-allocates storages in place), so memory a freed storage had
        is never mistaken for the kernel's.
        """
        now = self._now()
        by_storage = self.inflight.setdefault(rank, {})
        for ts, w in ((writes, True), (reads, False)):
            for t in ts:
                mem = _memory(t)
                if mem is None:
                    continue
                key, lo = mem
                region = Region(lo, lo + _extent(t), w, f"tensor {tuple(t.shape)} {str(t.dtype)[6:]}")
                entry = InFlight(rank, op, None, "", site, now, [region], [], done_at, [key], stream=stream)
                storage = t.untyped_storage()
                entry.alive = _same_storage(weakref.ref(storage), key)
                by_storage.setdefault(key, []).append((entry, region))
                weakref.finalize(storage, self._forget, entry)

    def clock(self, rank: int, stream: int, now: float) -> dict[int, float]:
        """What an event recorded now on ``rank``'s ``stream`` (at ``now`` on it) orders after it: that stream up to
        ``now``, and what the stream had waited for."""
        clock = dict(self.clocks.get(rank, {}).get(stream, {}))
        clock[stream] = max(clock.get(stream, now), now)
        return clock

    def stream_waited(self, rank: int, waiter: int | None, clock: dict[int, float]) -> None:
        """``rank``'s stream ``waiter`` (the host, for None) waited for an event whose :meth:`clock` is ``clock``: the
        kernels it covers are ordered before that stream's later work (for the host, before everything queued
        afterwards on any stream, so they are no longer in flight)."""
        if waiter is not None:
            mine = self.clocks.setdefault(rank, {}).setdefault(waiter, {})
            for stream, until in clock.items():
                if until > mine.get(stream, -math.inf):
                    mine[stream] = until
            return
        by_storage = self.inflight.get(rank)
        if not by_storage:
            return
        done = {
            id(entry): entry
            for items in by_storage.values()
            for entry, _ in items
            if entry.stream is not None
            and entry.done_at is not None
            and entry.done_at <= clock.get(entry.stream, -math.inf)
        }
        for entry in done.values():
            self._forget(entry)

    def ordered(self, entry: InFlight, rank: int, stream: int) -> bool:
        """Whether work on ``rank``'s ``stream`` is ordered after ``entry`` (always, for a communication operation,
        whose ownership ends when its rank observes it)."""
        if entry.stream is None or entry.stream == stream:
            return True
        seen = self.clocks.get(rank, {}).get(stream, {}).get(entry.stream, -math.inf)
        return entry.done_at is not None and entry.done_at <= seen

    def host_synchronized(self, rank: int) -> None:
        """``rank``'s host waited for every stream of its device: no kernel is in flight any more."""
        by_storage = self.inflight.get(rank)
        if not by_storage:
            return
        kernels = {id(e): e for items in by_storage.values() for e, _ in items if e.stream is not None}
        for entry in kernels.values():
            self._forget(entry)

    def observed(self, work: Any) -> None:
        """``work``'s rank has seen it complete: its buffers are the rank's again."""
        entry = work.__dict__.pop("_race_entry", None)
        if entry is not None:
            self._forget(entry)

    def _forget(self, entry: InFlight) -> None:
        by_storage = self.inflight.get(entry.rank)
        if by_storage is None:
            return
        for key in set(entry.keys):
            kept = [item for item in by_storage.get(key, ()) if item[0] is not entry]
            if kept:
                by_storage[key] = kept
            else:
                by_storage.pop(key, None)
        if not by_storage:
            del self.inflight[entry.rank]
        entry.tensors = []  # a recorded race keeps the description, not the memory

    # ------------------------------------------------------------------ rank code
    def check_access(self, rank: int, func: Any, args: tuple, kwargs: dict, site: Any) -> None:
        """Report aten op ``func(*args, **kwargs)`` on ``rank`` touching a buffer one of its operations owns."""
        writes = _written_args(func)
        if writes is None:  # views and metadata-only ops touch no data
            return
        name = str(func).removesuffix(".default")
        for i, a in enumerate(args):
            self.check_tensors(rank, name, a, i in writes[0], site)
        for k, a in kwargs.items():
            self.check_tensors(rank, name, a, k in writes[1], site)

    def check_tensors(self, rank: int, name: str, arg: Any, written: bool, site: Any) -> None:
        """Report rank code (``name``) reading (or writing) the tensors in ``arg`` while an operation owns them."""
        by_storage = self.inflight.get(rank)
        if not by_storage or rank in self.suspended:
            return
        stream = None
        for t in tree_leaves(arg) if isinstance(arg, (list, tuple)) else (arg,):
            if not isinstance(t, torch.Tensor):
                continue
            mem = _memory(t)
            if mem is None or mem[0] not in by_storage:
                continue
            lo = mem[1]
            hi = lo + _extent(t)
            for entry, reg in by_storage[mem[0]]:
                if entry.stream is not None:
                    if stream is None:
                        state = current_rank_state()
                        stream = state.stream if state is not None else 0
                    if self.ordered(entry, rank, stream) or not entry.alive():
                        continue
                if (reg.writes or written) and reg.overlaps(lo, hi):
                    verb = "wrote" if written else "read"
                    a, b = max(lo, reg.lo), min(hi, reg.hi)
                    where = "" if entry.stream is None else f" on {stream_text(stream or 0)}"
                    self._report(
                        Race("access", rank, entry, None, f"{verb} (in {name}{where})", site(), self._now(), reg.what, a, b - a, self.progress)
                    )
                    # one finding per tensor, so that a list argument (a foreach op) reports each tensor it
                    # touches, as the loop of single-tensor ops it replaces does
                    break

    # ------------------------------------------------------------------ waivers
    def waive(self, waivers: tuple[RaceWaiver, ...]) -> None:
        """Set the run's race waivers (parsed by ``comm.waivers.parse_waivers``)."""
        self.waivers = waivers
        self.waiver_hits = {w.text: 0 for w in waivers}

    def _waivers_of(self, race: Race) -> tuple[str, ...]:
        """The waivers that name ``race``: all of them when each side is named by one, else none."""
        if not self.waivers:
            return ()
        used: list[str] = []
        for site in race.sites:
            named = [w.text for w in self.waivers if w.matches_site(site)]
            if not named:
                return ()
            used += [t for t in named if t not in used]
        return tuple(used)

    def unused_waivers(self) -> list[str]:
        """The waivers that named no finding (empty when nothing was checked)."""
        return [t for t, hits in self.waiver_hits.items() if hits == 0] if self.enabled else []

    # ------------------------------------------------------------------ reporting
    def _report(self, race: Race) -> None:
        race.waived_by = self._waivers_of(race)
        if race.waived_by:
            self.waived.append(race)
            for t in race.waived_by:
                self.waiver_hits[t] += 1
            return
        self.races.append(race)
        if self.mode == "error":
            raise RaceError(str(race))
        key = race.key()
        if key not in self._warned:
            self._warned.add(key)
            text = str(race) + "\n  (reported once per call-site pair; every rank's finding is in RunResult.races)"
            user = getattr(race.site, "user", None)
            if user is not None:  # point the warning at the user's line, not at simdist or torch
                warnings.warn_explicit(RaceWarning(text), RaceWarning, user[0], user[1])
            else:
                warnings.warn(RaceWarning(text), stacklevel=2)


@functools.cache
def _written_args(func: Any) -> tuple[frozenset[int], frozenset[str]] | None:
    """Positions and keyword names of the arguments ``func`` writes; None for ops that read no data."""
    if getattr(func, "is_view", False) or func.__name__.split(".")[0] in _NO_DATA:
        return None
    schema = func._schema
    pos, kw = set(), set()
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            pos.add(i)
            kw.add(a.name)
    return frozenset(pos), frozenset(kw)


#: aten ops that take tensors for their metadata (shape, dtype) only, change only a tensor's metadata
#: (in-place views), or wrap/wait on a functional collective's result (the wait is the simulator's)
_NO_DATA = frozenset(
    {
        "detach", "alias", "lift_fresh", "empty_like", "zeros_like", "ones_like", "full_like", "rand_like",
        "randn_like", "randint_like", "new_empty", "new_zeros", "new_ones", "new_full", "new_empty_strided",
        "is_same_size", "_has_compatible_shallow_copy_type", "size", "stride", "sym_size", "sym_stride",
        "sym_numel", "sym_storage_offset",
        "t_", "transpose_", "unsqueeze_", "squeeze_", "as_strided_", "swapdims_", "swapaxes_", "detach_",
        "_wrap_tensor_autograd", "wait_tensor",
    }
)


class RaceCheckMode(TorchDispatchMode):
    """Per-rank dispatch mode: every aten op of rank code is checked against that rank's buffers in flight."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __init__(self, detector: RaceDetector, rank: int, site: Any) -> None:
        super().__init__()
        self.detector = detector
        self.rank = rank
        self.site = site
        self._inflight = detector.inflight

    def check(self, func: Any, args: Any, kwargs: dict) -> None:
        """Check one aten op of rank code (also called by the compute cost mode, which then replaces this mode)."""
        if self.rank in self._inflight:
            self.detector.check_access(self.rank, func, args, kwargs, self.site)

    @never_compiled
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.check(func, args, kwargs or {})
        if func not in uninitialised.OPS:
            return func(*args, **(kwargs or {}))
        before = uninitialised.stored_bytes(func, args)
        out = func(*args, **(kwargs or {}))
        uninitialised.fill(func, out, before)
        return out


def direct_read(detector: RaceDetector, site: Any, name: str, tensor: torch.Tensor, read: Callable[[], Any]) -> Any:
    """``read()``, the calling rank's ``Tensor.name`` of ``tensor``, reported first as a read of ``tensor``.

    Tensor methods that read data without the dispatcher (``tolist``, NumPy views) or with dispatch modes off
    (printing) are patched to come here during a run (:mod:`simdist.engine.process`).
    """
    state = current_rank_state()
    if state is None or state.rank not in detector.inflight or state.rank in detector.suspended:
        return read()
    detector.check_tensors(state.rank, f"Tensor.{name}", tensor, False, site)
    detector.suspended.add(state.rank)  # printing reads through tolist and friends: report once
    try:
        return read()
    finally:
        detector.suspended.discard(state.rank)
