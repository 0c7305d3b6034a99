"""Hot paths: find the op sequence a training loop repeats, and follow later instances of it.

The worker sees a stream of `OpRecord`s. A training loop sends the same ops with the same dependency
structure every step, only with new tensor ids, so a sequence is named by its `signature`, which forgets the
ids. `HotPathDetector` watches the stream and reports a sequence once it has been repeated `threshold` times
back to back; `PathMatcher` then recognises further instances op by op so the worker can buffer them and run
each instance as one compiled batch.

Signature encoding (`signature`): one entry per op, in order, `(op, attrs, n_outputs, inputs)`, where each
input is either
  - `(d, k)` with `d >= 1`: output `k` of the op `d` positions earlier in the sequence (an internal edge), or
  - `(0, e)`: external tensor number `e`, numbered 0, 1, 2, ... in order of first appearance in the sequence,
    so a tensor read twice gets one number and two different tensors get two.
A tensor counts as internal only when an op of the sequence produced it; anything else, including a tensor
produced just before the sequence starts, is external. The entry for position p depends on ops 0..p only, so
the signature of a prefix is the prefix of the signature (the matcher relies on it).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

InputRef = tuple[int, int]
OpSignature = tuple[str, tuple[Hashable, ...], int, tuple[InputRef, ...]]
Signature = tuple[OpSignature, ...]

# Segment hashes are polynomials in _BASE modulo a Mersenne prime. A match is confirmed with `signature`
# before a path is reported, so a collision there only costs a check; the lock test trusts the hash, so a
# collision (odds about 2**-61 per op) would hold a lock one op too long.
_MOD = (1 << 61) - 1
_BASE = 0x9E3779B97F4A7C15 % _MOD
_BASE_INV = pow(_BASE, -1, _MOD)


@dataclass(frozen=True)
class OpRecord:
    """One op as the worker receives it: name, tensor ids read, fresh tensor ids written, hashable attributes."""

    op: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    attrs: tuple[Hashable, ...] = ()


@dataclass(frozen=True)
class HotPath:
    """A repeated op sequence: its signature, its length in ops, and the ops of the instance that made it hot."""

    signature: Signature
    length: int
    template: tuple[OpRecord, ...]


class _Encoder:
    """Encodes ops one at a time relative to the start of a sequence (the body of `signature`)."""

    __slots__ = ("_external", "_pos", "_produced")

    def __init__(self) -> None:
        self._produced: dict[int, tuple[int, int]] = {}
        self._external: dict[int, int] = {}
        self._pos = 0

    def encode(self, rec: OpRecord) -> OpSignature:
        """The signature entry of `rec` as the next op of the sequence."""
        pos, refs = self._pos, []
        for t in rec.inputs:
            src = self._produced.get(t)
            if src is not None:
                refs.append((pos - src[0], src[1]))
            else:
                refs.append((0, self._external.setdefault(t, len(self._external))))
        # Inputs before outputs: an op reading and re-producing one id reads the old tensor.
        for k, t in enumerate(rec.outputs):
            self._produced[t] = (pos, k)
        self._pos = pos + 1
        return (rec.op, rec.attrs, len(rec.outputs), tuple(refs))


def signature(ops: Sequence[OpRecord]) -> Signature:
    """The id-free signature of `ops` (encoding in the module docstring): equal iff same ops and dependencies."""
    enc = _Encoder()
    return tuple(enc.encode(rec) for rec in ops)


# --- detection --------------------------------------------------------------------------------------------
#
# Hot at step n with period L means: the last threshold*L ops are threshold back-to-back segments of length L
# with equal signatures. Recomputing signatures for every L at every step costs O(max_length^2) per op, so
# instead each arriving op is recorded once with *relative* facts, per input slot:
#   dp, k: the producer is dp ops back (output k), and
#   dr, m: the same tensor was last read dr ops back (slot m; dr == 0 is an earlier slot of this op).
# Inside a segment where the op sits at position p, a slot is internal iff dp <= p; otherwise it is external,
# and "read before in this segment" (dr <= p) pointing at its previous read is the same partition of external
# reads as numbering them by first appearance. So the op's code at position p is a function of p alone that
# only changes when p crosses one of its dp or dr. When a segment slides by one op, the codes that change
# are exactly those of the ops that depend on the op leaving the segment (`_deps`), and each dependency is
# crossed once per period; that makes a rolling polynomial hash of each candidate period O(1) amortised.
#
# Name runs are cheap to keep for every L; a period gets a rolling hash (a track) only once its names have
# been L-periodic for (threshold-1)*L ops, which a repeating stream needs anyway, so a stream that does not
# repeat costs little. While locked on a loop only the lock's own track is rolled.


@dataclass
class _Track:
    """Rolling state for one candidate period: the current segment hash and the last (threshold-1)*L+1."""

    h: int
    hist: deque[int]


def _code_hash(key: int, slots: tuple[tuple[int, int, int, int], ...], p: int) -> int:
    """Hash of an op's code at segment position p (internal (dp, k), re-read (-1-dr, m), new (0, 0))."""
    codes = tuple((dp, k) if dp <= p else ((-1 - dr, m) if dr <= p else (0, 0)) for dp, k, dr, m in slots)
    return hash((key, codes)) % _MOD


class HotPathDetector:
    """Finds an op sequence repeated `threshold` times back to back among the last `window` ops.

    Policy (the choices the spec leaves open):
      - Only back-to-back repetition counts: the last threshold*L ops must be threshold equal segments.
        That is what a training loop produces, and it is what makes the check cheap.
      - When several lengths qualify at one op, the shortest L in [min_length, max_length] wins, so a loop
        body of 6 ops is reported as 6, not 12; a body shorter than min_length (say 3 with min_length 4)
        is reported as its smallest multiple that is at least min_length (6).
      - Once a period L has qualified, the detector stays locked on it while each new op keeps the last 2L
        ops two equal segments; a locked stream reports nothing, so rotations of the loop body
        (ops 2..L then op 1) are never reported as paths of their own.
      - `observe` returns a `HotPath` once per signature; a signature seen again only re-locks.
    Cost: O(inputs) per op plus O(1) amortised per tracked period (O(max_length) worst case, one while
    locked); memory O(window) plus the hot paths.
    """

    def __init__(
        self, window: int = 256, threshold: int = 3, min_length: int = 4, max_length: int = 64
    ) -> None:
        if threshold < 2:
            raise ValueError(f"threshold must be >= 2 (a path must repeat to be hot), got {threshold}")
        if min_length < 1:
            raise ValueError(f"min_length must be >= 1, got {min_length}")
        if max_length < min_length:
            raise ValueError(f"max_length must be >= min_length ({min_length}), got {max_length}")
        if window < threshold * max_length:
            raise ValueError(
                f"window must hold threshold * max_length = {threshold} * {max_length} = "
                f"{threshold * max_length} ops to see the longest path repeat, got {window}; "
                "raise window or lower max_length"
            )
        self.window, self.threshold = window, threshold
        self.min_length, self.max_length = min_length, max_length
        self._pow = [pow(_BASE, p, _MOD) for p in range(max_length)]
        self._n = 0  # ops observed so far; op indices are absolute
        self._base = 0  # absolute index of the first op still stored
        self._ops: list[OpRecord] = []
        # Per op: the positions where its code changes (ascending, from 0) and the code hash from each on.
        self._cuts: list[tuple[int, ...]] = []
        self._codes: list[tuple[int, ...]] = []
        self._deps: list[list[int]] = []  # ops (ascending) whose code changes when this op leaves a segment
        self._producer: dict[int, tuple[int, int]] = {}
        self._last_read: dict[int, tuple[int, int]] = {}
        self._keys: dict[tuple[str, tuple[Hashable, ...], int, int], int] = {}
        self._recent: dict[int, deque[int]] = {}  # key -> indices of its ops within the last max_length
        self._run_start: dict[int, int] = {}  # L -> first i of the current run of key(i) == key(i - L)
        self._tracks: dict[int, _Track] = {}
        self._lock: int | None = None
        self._hot: dict[Signature, HotPath] = {}

    @property
    def hot_paths(self) -> tuple[HotPath, ...]:
        """The hot paths found so far, in the order they became hot."""
        return tuple(self._hot.values())

    def observe(self, op: OpRecord) -> HotPath | None:
        """Record one arriving op; return the new `HotPath` it completes, if any."""
        e = self._n
        self._n += 1
        self._update_runs(self._record(op, e), e)
        if self._lock is not None:
            period, tr = self._lock, self._tracks.get(self._lock)
            if tr is not None and period in self._run_start:
                self._shift(tr, period, e)
                if tr.hist[-1] == tr.hist[-1 - period]:
                    return None
            # Left the loop: the other periods' tracks were dropped while locked; rebuild them all.
            self._lock, self._tracks = None, {}
        self._roll_tracks(e)
        return self._find_hot(e)

    def _record(self, op: OpRecord, e: int) -> int:
        """Store op `e`'s relative facts, codes and dependencies; return its interned name key."""
        far = self.max_length  # distances >= max_length never fall inside one segment
        key = self._keys.setdefault((op.op, op.attrs, len(op.inputs), len(op.outputs)), len(self._keys))
        b = self._base
        slots = []
        cuts = {0}
        for q, t in enumerate(op.inputs):
            src = self._producer.get(t)
            dp, k = (e - src[0], src[1]) if src is not None and e - src[0] < far else (far, 0)
            prev = self._last_read.get(t)
            dr, m = (e - prev[0], prev[1]) if prev is not None and e - prev[0] < far else (far, 0)
            self._last_read[t] = (e, q)
            slots.append((dp, k, dr, m))
            for d in (dp, dr):
                if 0 < d < far:
                    cuts.add(d)
                    deps = self._deps[e - d - b]
                    if not deps or deps[-1] != e:
                        deps.append(e)
        for k, t in enumerate(op.outputs):
            # A re-produced id keeps its read history: a read pointer can only cross the new producer,
            # and any segment holding both reads holds the producer, which makes the later read internal.
            self._producer[t] = (e, k)
        frozen, ordered = tuple(slots), tuple(sorted(cuts))
        self._ops.append(op)
        self._cuts.append(ordered)
        self._codes.append(tuple(_code_hash(key, frozen, p) for p in ordered))
        self._deps.append([])
        self._evict(e - self.window)
        return key

    def _evict(self, old: int) -> None:
        """Forget op `old` (now outside the window) in the id maps, and compact storage now and then."""
        if old < self._base:
            return
        rec = self._ops[old - self._base]
        for k, t in enumerate(rec.outputs):
            if self._producer.get(t) == (old, k):
                del self._producer[t]
        for q, t in enumerate(rec.inputs):
            if self._last_read.get(t) == (old, q):
                del self._last_read[t]
        if len(self._ops) > 2 * self.window:
            cut = len(self._ops) - self.window
            del self._ops[:cut], self._cuts[:cut], self._codes[:cut], self._deps[:cut]
            self._base += cut

    def _update_runs(self, key: int, e: int) -> None:
        """Extend, for every L, the run of ops whose name equals the name L ops earlier."""
        recent = self._recent.setdefault(key, deque())
        while recent and recent[0] < e - self.max_length:
            recent.popleft()
        old, runs = self._run_start, {}
        for q in recent:
            if e - q >= self.min_length:
                runs[e - q] = old.get(e - q, e)
        recent.append(e)
        self._run_start = runs

    def _roll_tracks(self, e: int) -> None:
        """Roll the tracks whose name run goes on, drop the others, start those whose run got long enough."""
        tracks, need = {}, self.threshold - 1
        for period, start in self._run_start.items():
            tr = self._tracks.get(period)
            if tr is not None:
                self._shift(tr, period, e)
                tracks[period] = tr
            elif e - start + 1 >= need * period:
                tracks[period] = self._start_track(period, e)
        self._tracks = tracks

    def _hash_at(self, i: int, p: int) -> int:
        """Code hash of op `i` at segment position `p`."""
        j = i - self._base
        cuts = self._cuts[j]
        return self._codes[j][bisect_right(cuts, p) - 1] if len(cuts) > 1 else self._codes[j][0]

    def _start_track(self, period: int, e: int) -> _Track:
        """Hash the oldest segment a hot check at `e` compares from scratch, then roll it up to `e`."""
        depth = (self.threshold - 1) * period
        first = e + 1 - depth - period
        h = sum(self._hash_at(first + p, p) * self._pow[p] for p in range(period)) % _MOD
        tr = _Track(h, deque([h], maxlen=depth + 1))
        for end in range(e + 1 - depth, e + 1):
            self._shift(tr, period, end)
        return tr

    def _shift(self, tr: _Track, period: int, e: int) -> None:
        """Slide the period's segment by one op so that it ends with op `e`."""
        s = e - period
        pw = self._pow
        h = (tr.h - self._codes[s - self._base][0]) * _BASE_INV % _MOD
        for i in self._deps[s - self._base]:
            if i >= e:
                break
            p = i - s - 1
            d = self._hash_at(i, p) - self._hash_at(i, p + 1)
            if d:
                h = (h + d * pw[p]) % _MOD
        h = (h + self._hash_at(e, period - 1) * pw[period - 1]) % _MOD
        tr.h = h
        tr.hist.append(h)

    def _find_hot(self, e: int) -> HotPath | None:
        """Lock on the shortest period that is hot at op `e`; return its path if its signature is new."""
        t = self.threshold
        for period in sorted(self._tracks):
            hist = self._tracks[period].hist
            if any(hist[-1 - j * period] != hist[-1] for j in range(1, t)):
                continue
            end = e + 1 - self._base
            segments = [self._ops[end - (j + 1) * period : end - j * period] for j in range(t)]
            sig = signature(segments[0])
            if any(signature(seg) != sig for seg in segments[1:]):
                continue  # hash collision
            self._lock, self._tracks = period, {period: self._tracks[period]}
            if sig in self._hot:
                return None
            path = HotPath(sig, period, tuple(segments[0]))
            self._hot[sig] = path
            return path
        return None


# --- matching ---------------------------------------------------------------------------------------------

MatchKind = Literal["start", "continue", "complete", "mismatch"]


@dataclass(frozen=True)
class Match:
    """What feeding one op did (see `PathMatcher.feed`): the kind, the completed path, the ops handed back."""

    kind: MatchKind
    path: HotPath | None = None
    ops: tuple[OpRecord, ...] = ()


class _Node:
    """A trie node over signature entries; `path` is set where a hot path ends."""

    __slots__ = ("children", "path")

    def __init__(self) -> None:
        self.children: dict[OpSignature, _Node] = {}
        self.path: HotPath | None = None


class PathMatcher:
    """Follows arriving ops against hot paths, buffering a consistent prefix until it completes or fails.

    `feed(op)` returns a `Match`:
      - "start": `op` begins a prefix of some hot path (nothing was buffered); it is buffered.
      - "continue": `op` extends the buffered prefix, renormalised ids included; it is buffered.
      - "complete": `op` ends a hot path; `path` is that path and `ops` the whole instance (op included),
        and the buffer is empty again.
      - "mismatch": buffer + [op] is not a prefix of any hot path. The matcher keeps the longest proper
        suffix of buffer + [op] that is itself the start of a hot path (re-encoded from its own first op,
        so reads of dropped ops become external) and hands back the rest in `ops`, in arrival order, for
        eager execution. So `op` is in `ops` exactly when no suffix survives; `pending` shows what was
        kept. An op that starts nothing on an empty buffer is a mismatch with `ops == (op,)`.
    Paths are matched greedily: when one hot path is a prefix of another, the shorter completes and the
    longer one never does. A kept suffix that would already be a whole path is not kept (run eagerly).
    """

    def __init__(self, paths: Iterable[HotPath] = ()) -> None:
        self._root = _Node()
        self._paths: list[HotPath] = []
        for path in paths:
            self.add(path)
        self._buf: list[OpRecord] = []
        self._node = self._root
        self._enc = _Encoder()

    @property
    def paths(self) -> tuple[HotPath, ...]:
        """The hot paths this matcher follows."""
        return tuple(self._paths)

    @property
    def pending(self) -> tuple[OpRecord, ...]:
        """The buffered ops: a consistent, incomplete prefix of some hot path."""
        return tuple(self._buf)

    def add(self, path: HotPath) -> None:
        """Follow one more hot path (a path with an already-known signature is ignored)."""
        if not path.signature:
            raise ValueError("a hot path needs at least one op, got an empty signature")
        node = self._root
        for entry in path.signature:
            node = node.children.setdefault(entry, _Node())
        if node.path is None:
            node.path = path
            self._paths.append(path)

    def flush(self) -> tuple[OpRecord, ...]:
        """Hand back the buffered ops (to run eagerly) and start over, e.g. at the end of a stream."""
        ops = tuple(self._buf)
        self._buf, self._node, self._enc = [], self._root, _Encoder()
        return ops

    def feed(self, op: OpRecord) -> Match:
        """Follow one arriving op (semantics in the class docstring)."""
        child = self._node.children.get(self._enc.encode(op))
        if child is not None:
            self._buf.append(op)
            if child.path is not None:
                return Match("complete", child.path, self.flush())
            self._node = child
            return Match("start" if len(self._buf) == 1 else "continue")
        seq = [*self._buf, op]
        for cut in range(1, len(seq) + 1):
            kept = self._walk(seq[cut:])
            if kept is not None:
                self._node, self._enc = kept
                self._buf = seq[cut:]
                return Match("mismatch", None, tuple(seq[:cut]))
        raise AssertionError("unreachable: the empty suffix always walks")

    def _walk(self, ops: Sequence[OpRecord]) -> tuple[_Node, _Encoder] | None:
        """The node and encoder reached by `ops` from the root, if they are a proper prefix of a path."""
        node, enc = self._root, _Encoder()
        for rec in ops:
            nxt = node.children.get(enc.encode(rec))
            if nxt is None or nxt.path is not None:
                return None
            node = nxt
        return node, enc
