"""The in-flight buffer race detector.

An asynchronous collective or point-to-point operation owns its buffers from the moment a rank issues it until
that rank has *observed* its completion (``Work.wait()``, a wait on its future, ``is_completed()`` returning
True, ``torch.futures.wait_all``). While it owns them, two things are races on real hardware:

- **overlap**: the same rank issues a second operation whose buffers overlap the first's in memory, and at
  least one of the two writes the overlapping bytes (a tied weight's gradient all-reduced twice). Under
  NCCL-like progress the two run one after another on the group's stream and the result can come out right
  by luck; under gloo-like progress they run at once on worker threads and corrupt each other.
- **access**: rank code (any aten op, e.g. ``optimizer.step()`` or autograd accumulating a gradient) reads a
  buffer the operation writes, or writes a buffer it reads or writes.

Buffers are compared as byte ranges of the process's memory (all ranks share one process, so the ranges of
different ranks never meet; checks are per rank anyway). An operation's range for a tensor is the block gloo
touches: ``numel`` elements from the first one. Mode ``"error"`` raises :class:`RaceError` in the rank at the
racing call; ``"warn"`` issues a :class:`RaceWarning` once per distinct pair of call sites and keeps every
finding in ``RunResult.races``.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from simdist.errors import RaceError, RaceWarning

#: what ``run(races=...)`` accepts
RACE_MODES = ("error", "warn", "off")


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
    work: Any  # weakref to the SimWork
    #: the tensors themselves, so their memory cannot be reused while the operation owns it
    tensors: list[torch.Tensor]
    #: simulated time the operation completed on this rank (set by the work), None before
    done_at: float | None = None

    def describe(self) -> str:
        """``all_reduce #3 on group default`` style text."""
        num = f" #{self.seq}" if self.seq is not None else ""
        return f"{self.op}{num} on group {self.group or 'default'}"

    def completed_at(self) -> float | None:
        """Simulated time the operation completed on this rank, None if it has not."""
        return self.done_at


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

    @property
    def window(self) -> tuple[float, float | None]:
        """The simulated interval in which both sides held the buffer (end None while still unknown)."""
        if self.kind == "access":
            return (self.first.issued_at, self.time)
        ends = [e for e in (self.first.completed_at(), self.second.completed_at() if self.second else None)]
        end = None if any(e is None for e in ends) else min(ends)  # type: ignore[type-var]
        return (self.time, end)

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
                    "may have come out right; on gloo (worker threads) they run at once and corrupt each other."
                )
            lines.append(
                "  Fix: issue one operation per buffer (de-duplicate shared parameters), or wait() the first "
                "before issuing the second."
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
        return "\n".join(lines)


def _nbytes_block(t: torch.Tensor) -> int:
    """Bytes an operation touches for ``t``: ``numel`` elements from the first (gloo ignores strides)."""
    return t.numel() * t.element_size()


def _extent(t: torch.Tensor) -> int:
    """Bytes spanned by a strided view from its first element to one past its last."""
    if t.is_contiguous():
        return t.numel() * t.element_size()
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0)
    return (last + 1) * t.element_size()


def _address(t: torch.Tensor) -> int | None:
    """The tensor's first byte, or None for tensors without host memory (meta, fake, empty)."""
    if t.numel() == 0 or t.device.type != "cpu" or type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        return None
    try:
        return t.data_ptr()
    except RuntimeError:  # tensors without storage (e.g. some subclasses)
        return None


class RaceDetector:
    """Per-run race book-keeping: each rank's operations in flight, and the races found."""

    def __init__(self, mode: str, progress: str, now: Any) -> None:
        if mode not in RACE_MODES:
            raise ValueError(f"races must be one of {RACE_MODES}, got {mode!r}")
        self.mode = mode
        self.progress = progress
        self._now = now
        self.inflight: dict[int, list[InFlight]] = {}
        self.races: list[Race] = []
        self._warned: set[tuple] = set()

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
        regions, tensors = [], []
        for ts, w in ((writes, True), (reads, False)):
            for t in ts:
                lo = _address(t)
                if lo is None:
                    continue
                regions.append(Region(lo, lo + _nbytes_block(t), w, f"tensor {tuple(t.shape)} {str(t.dtype)[6:]}"))
                tensors.append(t)
        if not regions:
            return
        new = InFlight(rank, op, seq, group, site, self._now(), regions, weakref.ref(work), tensors)
        live = self.inflight.setdefault(rank, [])
        for old in live:
            for a in old.regions:
                for b in regions:
                    if (a.writes or b.writes) and a.overlaps(b.lo, b.hi):
                        lo, hi = max(a.lo, b.lo), min(a.hi, b.hi)
                        self._report(Race("overlap", rank, old, new, None, site, new.issued_at, b.what, lo, hi - lo, self.progress))
                        break
                else:
                    continue
                break
        live.append(new)
        work._race_entry = new
        weakref.finalize(work, self._forget, rank, new)

    def observed(self, work: Any) -> None:
        """``work``'s rank has seen it complete: its buffers are the rank's again."""
        entry = work.__dict__.pop("_race_entry", None)
        if entry is not None:
            self._forget(entry.rank, entry)

    def _forget(self, rank: int, entry: InFlight) -> None:
        live = self.inflight.get(rank)
        if live:
            for i, e in enumerate(live):
                if e is entry:
                    del live[i]
                    break
            if not live:
                del self.inflight[rank]

    # ------------------------------------------------------------------ rank code
    def check_access(self, rank: int, func: Any, args: tuple, kwargs: dict, site: Any) -> None:
        """Report ``func(*args, **kwargs)`` on ``rank`` touching a buffer one of its operations owns."""
        live = self.inflight.get(rank)
        if not live:
            return
        writes = _written_args(func)
        if writes is None:  # views and metadata-only ops touch no data
            return
        for i, a in enumerate(args):
            self._check_arg(rank, func, a, i in writes[0], live, site)
        for k, a in kwargs.items():
            self._check_arg(rank, func, a, k in writes[1], live, site)

    def _check_arg(self, rank: int, func: Any, arg: Any, written: bool, live: list[InFlight], site: Any) -> None:
        for t in tree_leaves(arg) if isinstance(arg, (list, tuple)) else (arg,):
            if not isinstance(t, torch.Tensor):
                continue
            lo = _address(t)
            if lo is None:
                continue
            hi = lo + _extent(t)
            for entry in live:
                for reg in entry.regions:
                    if (reg.writes or written) and reg.overlaps(lo, hi):
                        verb = "wrote" if written else "read"
                        a, b = max(lo, reg.lo), min(hi, reg.hi)
                        name = str(func).removesuffix(".default")
                        self._report(
                            Race("access", rank, entry, None, f"{verb} (in {name})", site(), self._now(), reg.what, a, b - a, self.progress)
                        )
                        return

    # ------------------------------------------------------------------ reporting
    def _report(self, race: Race) -> None:
        self.races.append(race)
        if self.mode == "error":
            raise RaceError(str(race))
        key = race.key()
        if key not in self._warned:
            self._warned.add(key)
            text = str(race) + "\n  (reported once per call-site pair; every rank's finding is in RunResult.races)"
            path, _, rest = race.site.rpartition(":")
            line = rest.split(" ", 1)[0]
            if path and line.isdigit():  # point the warning at the user's line, not at simdist
                warnings.warn_explicit(RaceWarning(text), RaceWarning, path, int(line))
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


#: aten ops that take tensors for their metadata (shape, dtype) only, or only re-point them
_NO_DATA = frozenset(
    {
        "detach", "alias", "lift_fresh", "empty_like", "zeros_like", "ones_like", "full_like", "rand_like",
        "randn_like", "randint_like", "new_empty", "new_zeros", "new_ones", "new_full", "new_empty_strided",
        "set_", "resize_", "is_same_size", "_has_compatible_shallow_copy_type", "size", "stride",
        "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "_local_scalar_dense_meta",
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

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if self.rank in self._inflight:
            self.detector.check_access(self.rank, func, args, kwargs or {}, self.site)
        return func(*args, **(kwargs or {}))
