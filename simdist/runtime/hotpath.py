"""Hot paths: find the op sequence a training loop repeats, and follow later instances of it.

The worker sees a stream of `OpRecord`s, each tagged with the phase (forward or backward) the client's
autograd was in. A training loop sends the same ops with the same dependency structure every step, only with
new tensor ids, so a sequence is named by its `signature`, which forgets the ids. `SegmentDetector` cuts the
stream at phase changes and reports a segment once its signature has recurred `threshold` times;
`PathMatcher` then recognises further instances op by op so the worker can buffer them and run each instance
as one compiled batch.

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

from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from simdist.runtime.errors import RuntimeConfigError

InputRef = tuple[int, int]
OpSignature = tuple[str, tuple[Hashable, ...], int, tuple[InputRef, ...]]
Signature = tuple[OpSignature, ...]


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


class SegmentDetector:
    """Finds hot paths at phase granularity: the ops between two phase changes form a segment.

    Rules:
      - A segment ends when an op of another phase arrives; the last segment of a stream never ends.
      - A segment is eligible when it has `min_length` to `max_length` ops; other segments are ignored
        (they neither count nor take a place in the window).
      - An eligible segment is named by its phase and its `signature`; it becomes hot when that name occurs
        `threshold` times among the last `window` eligible segments, itself included.
      - A name becomes hot once: `observe` returns its `HotPath` at the op that ends the segment that made it
        hot (that segment is the path's template), and never again.
    Instances then start at a phase's first op, so a batch never spans a phase change. Cost per segment:
    one signature (O(ops + inputs)) and O(window) to count; memory O(window + max_length) plus the paths.
    """

    def __init__(self, window: int, threshold: int, min_length: int, max_length: int) -> None:
        if threshold < 1 or window < threshold or not 1 <= min_length <= max_length:
            raise RuntimeConfigError(
                f"need 1 <= threshold <= window and 1 <= min_length <= max_length; got window={window}, "
                f"threshold={threshold}, min_length={min_length}, max_length={max_length}"
            )
        self.window, self.threshold = window, threshold
        self.min_length, self.max_length = min_length, max_length
        self._phase: str | None = None
        self._ops: list[OpRecord] = []
        self._recent: deque[tuple[str, Signature]] = deque(maxlen=window)
        self._hot: dict[tuple[str, Signature], HotPath] = {}

    @property
    def hot_paths(self) -> tuple[HotPath, ...]:
        """The hot paths found so far, in the order they became hot."""
        return tuple(self._hot.values())

    def observe(self, record: OpRecord, phase: str) -> HotPath | None:
        """One more op, of `phase`; return the hot path of the segment it ends, if it just became hot."""
        path = None
        if phase != self._phase:
            if self._phase is not None:
                path = self._end_segment(self._phase)
            self._phase = phase
        # One op past max_length tells the segment is too long; keeping more would only cost memory.
        if len(self._ops) <= self.max_length:
            self._ops.append(record)
        return path

    def _end_segment(self, phase: str) -> HotPath | None:
        ops, self._ops = self._ops, []
        if not self.min_length <= len(ops) <= self.max_length:
            return None
        name = (phase, signature(ops))
        self._recent.append(name)
        if name in self._hot or self._recent.count(name) < self.threshold:
            return None
        path = self._hot[name] = HotPath(name[1], len(ops), tuple(ops))
        return path


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
            raise RuntimeConfigError("a hot path needs at least one op, got an empty signature")
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
