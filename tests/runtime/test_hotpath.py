"""Hot paths: id-free signatures, detection of hot phase segments and path matching, each against a
brute-force oracle."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from simdist.runtime.errors import RuntimeConfigError
from simdist.runtime.hotpath import HotPath, OpRecord, PathMatcher, SegmentDetector, signature

# A loop-body op input: ("int", j, k) output k of body op j of this iteration; ("carry", j, k) the same output
# of the previous iteration; ("param", i) a tensor every iteration reads; ("data",) a fresh external tensor.
Ref = tuple
BodyOp = tuple[str, tuple[Ref, ...], int]
PARAMS = 3


# --- generators -------------------------------------------------------------------------------------------


@st.composite
def programs(draw: st.DrawFn, max_size: int = 10) -> list[OpRecord]:
    """A straight-line program: fresh outputs, inputs read from earlier outputs or a small external pool."""
    ops: list[OpRecord] = []
    produced: list[int] = []
    fresh = itertools.count(100)
    for _ in range(draw(st.integers(1, max_size))):
        inputs = []
        for _ in range(draw(st.integers(0, 3))):
            if produced and draw(st.booleans()):
                inputs.append(draw(st.sampled_from(produced)))
            else:
                inputs.append(draw(st.integers(0, 5)))
        outputs = tuple(next(fresh) for _ in range(draw(st.integers(1, 2))))
        produced.extend(outputs)
        name = draw(st.sampled_from(["add", "mul"]))
        attrs = draw(st.sampled_from([(), (("axis", 0),)]))
        ops.append(OpRecord(name, tuple(inputs), outputs, attrs))
    return ops


def tensor_ids(ops: list[OpRecord]) -> list[int]:
    return sorted({t for rec in ops for t in (*rec.inputs, *rec.outputs)})


def rename(ops: list[OpRecord], mapping: dict[int, int]) -> list[OpRecord]:
    return [
        OpRecord(r.op, tuple(mapping[t] for t in r.inputs), tuple(mapping[t] for t in r.outputs), r.attrs)
        for r in ops
    ]


def isomorphic(a: list[OpRecord], b: list[OpRecord]) -> bool:
    """Oracle: some bijection of tensor ids turns `a` into `b` (the definition signatures must capture)."""
    if len(a) != len(b):
        return False
    fwd: dict[int, int] = {}
    bwd: dict[int, int] = {}
    for p, q in zip(a, b):
        if (p.op, p.attrs, len(p.inputs), len(p.outputs)) != (q.op, q.attrs, len(q.inputs), len(q.outputs)):
            return False
        for x, y in zip((*p.inputs, *p.outputs), (*q.inputs, *q.outputs)):
            if fwd.setdefault(x, y) != y or bwd.setdefault(y, x) != x:
                return False
    return True


@st.composite
def loop_bodies(
    draw: st.DrawFn, min_size: int, max_size: int, names: list[str] | None = None
) -> list[BodyOp]:
    """A loop body; op p is named f"op{p}" (so the body has no shorter period) unless `names` is given."""
    size = draw(st.integers(min_size, max_size))
    body: list[BodyOp] = []
    for p in range(size):
        refs: list[Ref] = []
        for _ in range(draw(st.integers(0, 3))):
            kind = draw(
                st.sampled_from(["int", "carry", "param", "data"] if p else ["carry", "param", "data"])
            )
            if kind == "int":
                j = draw(st.integers(0, p - 1))
                refs.append(("int", j, draw(st.integers(0, body[j][2] - 1))))
            elif kind == "carry":
                refs.append(("carry", draw(st.integers(0, size - 1)), draw(st.integers(0, 1))))
            elif kind == "param":
                refs.append(("param", draw(st.integers(0, PARAMS - 1))))
            else:
                refs.append(("data",))
        name = f"op{p}" if names is None else draw(st.sampled_from(names))
        body.append((name, tuple(refs), draw(st.integers(1, 2))))
    return body


def iterations(body: list[BodyOp], count: int, ids: Iterator[int]) -> list[list[OpRecord]]:
    """`count` iterations of `body`, each with fresh ids, reading the previous one's outputs as carried state."""
    params = [next(ids) for _ in range(PARAMS)]
    prev = {(j, k): next(ids) for j in range(len(body)) for k in range(2)}
    out = []
    for _ in range(count):
        cur: dict[tuple[int, int], int] = {}
        ops = []
        for p, (name, refs, n_out) in enumerate(body):
            inputs = []
            for ref in refs:
                if ref[0] in ("int", "carry"):
                    j = ref[1]
                    inputs.append((cur if ref[0] == "int" else prev)[j, min(ref[2], body[j][2] - 1)])
                elif ref[0] == "param":
                    inputs.append(params[ref[1]])
                else:
                    inputs.append(next(ids))
            outputs = tuple(next(ids) for _ in range(n_out))
            cur.update({(p, k): t for k, t in enumerate(outputs)})
            ops.append(OpRecord(name, tuple(inputs), outputs))
        prev, out = cur, [*out, ops]
    return out


@st.composite
def noise(draw: st.DrawFn, ids: Iterator[int], max_size: int, names: list[str]) -> list[OpRecord]:
    """Ops with random dependencies on recent outputs, fresh outputs and names drawn from `names`."""
    ops: list[OpRecord] = []
    produced = [next(ids)]
    for _ in range(draw(st.integers(0, max_size))):
        inputs = tuple(draw(st.sampled_from(produced[-8:])) for _ in range(draw(st.integers(0, 2))))
        outputs = (next(ids),)
        produced.extend(outputs)
        ops.append(OpRecord(draw(st.sampled_from(names)), inputs, outputs))
    return ops


def instantiate(
    body: list[BodyOp], previous: list[int], params: list[int], ids: Iterator[int]
) -> list[OpRecord]:
    """One phase segment from `body` with fresh ids; a carried input reads an output of the segment before."""
    made: dict[tuple[int, int], int] = {}
    ops = []
    for p, (name, refs, n_out) in enumerate(body):
        inputs = []
        for ref in refs:
            if ref[0] == "int":
                inputs.append(made[ref[1], min(ref[2], body[ref[1]][2] - 1)])
            elif ref[0] == "carry":
                inputs.append(previous[(2 * ref[1] + ref[2]) % len(previous)] if previous else next(ids))
            elif ref[0] == "param":
                inputs.append(params[ref[1]])
            else:
                inputs.append(next(ids))
        outputs = tuple(next(ids) for _ in range(n_out))
        made.update({(p, k): t for k, t in enumerate(outputs)})
        ops.append(OpRecord(name, tuple(inputs), outputs))
    return ops


PHASES = ("forward", "backward")
NAMES = ["a", "b"]


@st.composite
def segment_streams(draw: st.DrawFn, max_size: int) -> list[tuple[str, OpRecord]]:
    """(phase, op) pairs as a training loop sends them: segments alternate phases and follow a repeated
    pattern of a few bodies, some segments replaced by bodies of their own; two names make coincidences."""
    bodies = draw(st.lists(loop_bodies(1, max_size, names=NAMES), min_size=1, max_size=3))
    pattern = draw(st.lists(st.integers(0, len(bodies) - 1), min_size=1, max_size=4))
    schedule: list[list[BodyOp]] = [bodies[b] for b in pattern] * draw(st.sampled_from([6, 3, 8, 1]))
    for pos in draw(st.lists(st.integers(0, len(schedule) - 1), max_size=3)):
        schedule[pos] = draw(loop_bodies(1, max_size, names=NAMES))
    ids = itertools.count(1000)
    params = [next(ids) for _ in range(PARAMS)]
    phase = draw(st.sampled_from(PHASES))
    stream: list[tuple[str, OpRecord]] = []
    previous: list[int] = []
    for body in schedule:
        ops = instantiate(body, previous, params, ids)
        stream += [(phase, op) for op in ops]
        previous = [t for op in ops for t in op.outputs]
        phase = PHASES[1 - PHASES.index(phase)]
    return stream


# --- signature --------------------------------------------------------------------------------------------


def test_signature_encoding_example() -> None:
    ops = [
        OpRecord("matmul", (7, 8), (10,)),
        OpRecord("add", (10, 9), (11,), (("alpha", 1),)),
        OpRecord("mul", (11, 7, 10), (12, 13)),
        OpRecord("sum", (13,), (14,)),
    ]
    assert signature(ops) == (
        ("matmul", (), 1, ((0, 0), (0, 1))),  # two externals, numbered by first appearance
        ("add", (("alpha", 1),), 1, ((1, 0), (0, 2))),  # op 1 back, output 0; a third external
        ("mul", (), 2, ((1, 0), (0, 0), (2, 0))),  # external 0 again: the same tensor as matmul's first input
        ("sum", (), 1, ((1, 1),)),
    )
    assert signature(ops[:2]) == signature(ops)[:2]


@given(programs(), st.data())
def test_signature_ignores_tensor_ids(ops: list[OpRecord], data: st.DataObject) -> None:
    ids = tensor_ids(ops)
    new = data.draw(st.lists(st.integers(-(10**9), 10**9), min_size=len(ids), max_size=len(ids), unique=True))
    assert signature(rename(ops, dict(zip(ids, new)))) == signature(ops)


@given(programs(), st.data())
def test_signature_equal_iff_isomorphic(ops: list[OpRecord], data: st.DataObject) -> None:
    pos = data.draw(st.integers(0, len(ops) - 1))
    rec = ops[pos]
    assume(rec.inputs)
    slot = data.draw(st.integers(0, len(rec.inputs) - 1))
    brand_new = 10**6
    earlier = [t for r in ops[:pos] for t in r.outputs] + list(range(6)) + [brand_new]
    inputs = list(rec.inputs)
    inputs[slot] = data.draw(st.sampled_from(earlier))
    other = [*ops[:pos], OpRecord(rec.op, tuple(inputs), rec.outputs, rec.attrs), *ops[pos + 1 :]]
    assert (signature(other) == signature(ops)) == isomorphic(other, ops)


@given(programs(), st.data())
def test_repointing_an_input_to_another_producer_changes_signature(
    ops: list[OpRecord], data: st.DataObject
) -> None:
    producer = {t: (i, k) for i, r in enumerate(ops) for k, t in enumerate(r.outputs)}
    reads = [(i, q) for i, r in enumerate(ops) for q, t in enumerate(r.inputs) if t in producer]
    assume(reads)
    i, q = data.draw(st.sampled_from(reads))
    choices = [t for r in ops[:i] for t in r.outputs if t != ops[i].inputs[q]]
    assume(choices)
    inputs = list(ops[i].inputs)
    inputs[q] = data.draw(st.sampled_from(choices))
    other = [*ops[:i], OpRecord(ops[i].op, tuple(inputs), ops[i].outputs, ops[i].attrs), *ops[i + 1 :]]
    assert signature(other) != signature(ops)


@given(programs(), st.data())
def test_reused_versus_distinct_external_changes_signature(ops: list[OpRecord], data: st.DataObject) -> None:
    produced = {t for r in ops for t in r.outputs}
    reads = [(i, q) for i, r in enumerate(ops) for q, t in enumerate(r.inputs) if t not in produced]
    assume(len(reads) >= 2)
    (i, q), (j, m) = data.draw(st.permutations(reads))[:2]
    a, b = ops[i].inputs[q], ops[j].inputs[m]
    # Make the two reads one tensor if they were two, or two tensors if they were one.
    new = b if a != b else 10**6
    inputs = list(ops[i].inputs)
    inputs[q] = new
    other = [*ops[:i], OpRecord(ops[i].op, tuple(inputs), ops[i].outputs, ops[i].attrs), *ops[i + 1 :]]
    assert signature(other) != signature(ops)


# --- detection --------------------------------------------------------------------------------------------


def detect(detector: SegmentDetector, stream: list[tuple[str, OpRecord]]) -> list[tuple[int, HotPath]]:
    """Feed `stream`; the hot paths reported, with the index of the op that reported each."""
    reported = ((i, detector.observe(op, phase)) for i, (phase, op) in enumerate(stream))
    return [(i, path) for i, path in reported if path is not None]


def brute_force_hot(
    stream: list[tuple[str, OpRecord]], window: int, threshold: int, min_length: int, max_length: int
) -> list[tuple[int, list[OpRecord]]]:
    """The detector's rules (class docstring) with segments compared by id bijection instead of signatures.

    Returns, for each segment that becomes hot, the index of the op that ends it and the segment's ops.
    """
    ended: list[tuple[int, str, list[OpRecord]]] = []  # maximal runs of one phase; the last one never ends
    start = 0
    for i in range(1, len(stream)):
        if stream[i][0] != stream[i - 1][0]:
            ended.append((i, stream[i - 1][0], [op for _, op in stream[start:i]]))
            start = i

    def same(a: tuple[str, list[OpRecord]], b: tuple[str, list[OpRecord]]) -> bool:
        return a[0] == b[0] and isomorphic(a[1], b[1])

    eligible: list[tuple[str, list[OpRecord]]] = []
    hot: list[tuple[str, list[OpRecord]]] = []
    events = []
    for i, phase, ops in ended:
        if not min_length <= len(ops) <= max_length:
            continue
        segment = (phase, ops)
        eligible.append(segment)
        if any(same(segment, h) for h in hot):
            continue
        if sum(same(segment, other) for other in eligible[-window:]) >= threshold:
            hot.append(segment)
            events.append((i, ops))
    return events


def fresh_ids(ops: list[OpRecord]) -> bool:
    """The oracles' premise, as the runtime's client guarantees: every id is written once, and never read
    before it is written (then equal signatures and an id bijection are the same thing)."""
    written: set[int] = set()
    read: set[int] = set()
    for op in ops:
        if any(t in written or t in read for t in op.outputs):
            return False
        read.update(op.inputs)
        written.update(op.outputs)
    return True


# sampled_from rather than integers: hypothesis favours small integers, and most of what can go wrong needs a
# threshold above 1 with a window that is sometimes too short for it
@given(
    segment_streams(max_size=7),
    st.sampled_from([4, 2, 6, 1, 3]),
    st.sampled_from([2, 3, 1, 4]),
    st.sampled_from([1, 2, 3]),
    st.sampled_from([3, 1, 0, 2]),
)
def test_detector_agrees_with_brute_force(
    stream: list[tuple[str, OpRecord]], window: int, threshold: int, min_length: int, extra: int
) -> None:
    assert fresh_ids([op for _, op in stream])
    threshold = min(threshold, window)
    max_length = min_length + extra
    detector = SegmentDetector(window, threshold, min_length, max_length)
    got = detect(detector, stream)
    assert [(i, list(p.template)) for i, p in got] == brute_force_hot(
        stream, window, threshold, min_length, max_length
    )
    for _, path in got:
        assert path.signature == signature(path.template) and path.length == len(path.template)
    assert detector.hot_paths == tuple(p for _, p in got)


def test_segments_become_hot_at_the_threshold_within_their_length_bounds() -> None:
    det = SegmentDetector(window=8, threshold=2, min_length=2, max_length=3)
    first = [OpRecord("mul", (0, 1), (2,)), OpRecord("add", (2, 0), (3,))]
    second = [OpRecord("mul", (5, 6), (7,)), OpRecord("add", (7, 5), (8,))]  # the same structure, new ids
    too_long = [OpRecord("mul", (0, 1), (9 + k,)) for k in range(4)]
    stream = [("forward", op) for op in first] + [("backward", OpRecord("neg", (3,), (4,)))]
    stream += [("forward", op) for op in second] + [("backward", op) for op in too_long]
    stream += [("forward", OpRecord("neg", (8,), (20,)))]
    events = detect(det, stream)
    # the second forward segment makes the pair hot when the op after it arrives; the backward ones are too
    # short (one op) or too long (four)
    assert [(i, p.length, p.template) for i, p in events] == [(5, 2, tuple(second))]


@pytest.mark.parametrize(
    ("ref", "changed_ref"),
    [
        (("int", 0, 0), ("int", 0, 1)),  # the other output of the same producer
        (("int", 0, 0), ("int", 1, 0)),  # another producer
        (("param", 0), ("param", 1)),  # another external
        (("param", 0), ("data",)),  # a distinct external instead of a reused one
    ],
)
def test_each_kind_of_dependency_change_makes_a_new_hot_path(ref: Ref, changed_ref: Ref) -> None:
    def forward(r: Ref) -> list[BodyOp]:
        return [("op0", (("param", 0),), 2), ("op1", (), 1), ("op2", (("int", 1, 0), r), 1), ("op3", (), 1)]

    backward: list[BodyOp] = [("grad", (("carry", 0, 0),), 1)]
    ids = itertools.count(1000)
    params = [next(ids) for _ in range(PARAMS)]
    previous: list[int] = []
    stream: list[tuple[str, OpRecord]] = []
    for body in [forward(ref)] * 3 + [forward(changed_ref)] * 3:
        for phase, ops in (("forward", body), ("backward", backward)):
            instance = instantiate(ops, previous, params, ids)
            stream += [(phase, op) for op in instance]
            previous = [t for op in instance for t in op.outputs]
    events = detect(SegmentDetector(window=4, threshold=2, min_length=1, max_length=8), stream)
    assert [(i, list(p.template)) for i, p in events] == brute_force_hot(stream, 4, 2, 1, 8)
    forward_paths = [p for _, p in events if p.template[0].op == "op0"]
    # same names before and after the change: only the dependencies tell the two loops apart
    assert len(forward_paths) == 2 and forward_paths[0].signature != forward_paths[1].signature


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"window": 1, "threshold": 2, "min_length": 1, "max_length": 4}, "threshold <= window"),
        ({"window": 4, "threshold": 0, "min_length": 1, "max_length": 4}, "1 <= threshold"),
        ({"window": 4, "threshold": 2, "min_length": 0, "max_length": 4}, "1 <= min_length"),
        ({"window": 4, "threshold": 2, "min_length": 5, "max_length": 4}, "min_length <= max_length"),
    ],
)
def test_bad_parameters_are_rejected(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(RuntimeConfigError, match=message):
        SegmentDetector(**kwargs)


# --- matching ---------------------------------------------------------------------------------------------


def hot(ops: list[OpRecord]) -> HotPath:
    return HotPath(signature(ops), len(ops), tuple(ops))


@given(loop_bodies(1, 10))
def test_matcher_completes_an_instance_with_fresh_ids(body: list[BodyOp]) -> None:
    loop = iterations(body, 4, itertools.count())
    path = hot(loop[0])
    matcher = PathMatcher([path])
    matches = [matcher.feed(op) for op in loop[3]]
    expected = ["start"] + ["continue"] * (len(body) - 2) if len(body) > 1 else []
    assert [m.kind for m in matches[:-1]] == expected
    assert matches[-1].kind == "complete"
    assert matches[-1].path == path
    assert list(matches[-1].ops) == loop[3]
    assert matcher.pending == ()


@given(loop_bodies(1, 10), st.data())
def test_matcher_reports_a_perturbed_input_at_that_op(body: list[BodyOp], data: st.DataObject) -> None:
    loop = iterations(body, 3, itertools.count())
    ops = loop[2]
    pos = data.draw(st.integers(0, len(ops) - 1))
    assume(ops[pos].inputs)
    slot = data.draw(st.integers(0, len(ops[pos].inputs) - 1))
    candidates = [t for r in ops[:pos] for t in r.outputs] + [t for r in loop[1] for t in r.outputs] + [-1]
    inputs = list(ops[pos].inputs)
    inputs[slot] = data.draw(st.sampled_from(candidates))
    bad = OpRecord(ops[pos].op, tuple(inputs), ops[pos].outputs)
    assume(signature([*ops[:pos], bad]) != signature(ops[: pos + 1]))
    matcher = PathMatcher([hot(loop[0])])
    assert all(matcher.feed(op).kind in ("start", "continue") for op in ops[:pos])
    match = matcher.feed(bad)
    assert match.kind == "mismatch"
    # Names are unique per position, so no suffix can restart the path: everything comes back.
    assert list(match.ops) == [*ops[:pos], bad]
    assert matcher.pending == ()


def test_matcher_resyncs_on_a_self_overlapping_path() -> None:
    path = hot([OpRecord("A", (1,), (2,)), OpRecord("A", (1,), (3,)), OpRecord("B", (2, 3), (4,))])
    a1, a2, a3 = (OpRecord("A", (9,), (t,)) for t in (10, 11, 12))
    b = OpRecord("B", (11, 12), (13,))
    matcher = PathMatcher([path])
    assert [matcher.feed(op).kind for op in (a1, a2)] == ["start", "continue"]
    mismatch = matcher.feed(a3)
    assert (mismatch.kind, mismatch.ops, matcher.pending) == ("mismatch", (a1,), (a2, a3))
    done = matcher.feed(b)
    assert (done.kind, done.path, done.ops) == ("complete", path, (a2, a3, b))


def test_matcher_runs_a_whole_path_eagerly_when_it_ends_a_mismatch() -> None:
    # The greedy rule's price: a mismatch never also completes, so C here runs eagerly (class docstring).
    short = hot([OpRecord("C", (), (1,))])
    matcher = PathMatcher([hot([OpRecord("A", (), (1,)), OpRecord("B", (1,), (2,))]), short])
    a, c = OpRecord("A", (), (5,)), OpRecord("C", (), (6,))
    assert matcher.feed(a).kind == "start"
    assert (matcher.feed(c).ops, matcher.pending) == ((a, c), ())
    assert matcher.feed(OpRecord("C", (), (7,))).path == short


def test_matcher_hands_back_an_op_that_starts_nothing() -> None:
    matcher = PathMatcher([hot([OpRecord("A", (1,), (2,)), OpRecord("B", (2,), (3,))])])
    stray = OpRecord("C", (1,), (5,))
    assert matcher.feed(stray).ops == (stray,)
    assert matcher.feed(OpRecord("A", (7,), (8,))).kind == "start"
    assert [op.op for op in matcher.flush()] == ["A"]
    with pytest.raises(RuntimeConfigError, match="at least one op"):
        matcher.add(HotPath((), 0, ()))


def reference_matcher(paths: list[HotPath], stream: list[OpRecord]) -> list[tuple[str, tuple[OpRecord, ...]]]:
    """The `PathMatcher` contract with ops compared to the paths' templates by id bijection: prefixes
    compared whole, suffixes tried in order."""
    templates = [list(p.template) for p in paths]

    def whole(ops: list[OpRecord]) -> bool:
        return any(isomorphic(ops, t) for t in templates)

    def proper_prefix(ops: list[OpRecord]) -> bool:
        return any(len(t) > len(ops) and isomorphic(ops, t[: len(ops)]) for t in templates)

    out, buf = [], []
    for op in stream:
        seq = [*buf, op]
        if whole(seq):
            out.append(("complete", tuple(seq)))
            buf = []
        elif proper_prefix(seq):
            out.append(("start" if not buf else "continue", ()))
            buf = seq
        else:
            # Keep the longest suffix that starts a path without passing through a whole one.
            cut = next(
                c
                for c in range(1, len(seq) + 1)
                if not seq[c:]
                or (proper_prefix(seq[c:]) and not any(whole(seq[c:e]) for e in range(c + 1, len(seq) + 1)))
            )
            out.append(("mismatch", tuple(seq[:cut])))
            buf = seq[cut:]
    return out


@given(st.lists(loop_bodies(1, 5, names=["a", "b"]), min_size=1, max_size=3), st.data())
def test_matcher_agrees_with_reference(bodies: list[list[BodyOp]], data: st.DataObject) -> None:
    # Two names and short paths: paths overlap themselves and each other, so resyncs happen all the time.
    ids = itertools.count(1000)
    paths = [hot(iterations(body, 1, ids)[0]) for body in bodies]
    stream: list[OpRecord] = []
    for _ in range(data.draw(st.integers(1, 8))):
        if data.draw(st.booleans()):
            stream += data.draw(noise(ids, max_size=4, names=["a", "b"]))
        else:
            it = iterations(data.draw(st.sampled_from(bodies)), data.draw(st.integers(1, 3)), ids)
            instances = [op for ops in it for op in ops]
            stream += instances[: data.draw(st.integers(1, len(instances)))]  # often cut short
    assert fresh_ids(stream) and all(fresh_ids(list(p.template)) for p in paths)
    matcher = PathMatcher(paths)
    got = [(m.kind, m.ops) for m in (matcher.feed(op) for op in stream)]
    assert got == reference_matcher(paths, stream)


@given(loop_bodies(1, 6), loop_bodies(1, 6), st.integers(1, 3))
def test_detected_paths_match_the_later_instances_of_their_phase(
    forward: list[BodyOp], backward: list[BodyOp], threshold: int
) -> None:
    # A training loop: forward then backward, the backward reading forward's outputs and the next forward
    # reading backward's (the first forward reads stand-ins of as many tensors, so every step is alike).
    ids = itertools.count(1000)
    params = [next(ids) for _ in range(PARAMS)]
    detector = SegmentDetector(window=8, threshold=threshold, min_length=1, max_length=6)
    matchers = {phase: PathMatcher() for phase in PHASES}
    previous = [next(ids) for _ in range(sum(n_out for _, _, n_out in backward))]
    instances: dict[str, list[list[OpRecord]]] = {phase: [] for phase in PHASES}
    for step in range(threshold + 3):
        for phase, body in zip(PHASES, (forward, backward)):
            ops = instantiate(body, previous, params, ids)
            previous = [t for op in ops for t in op.outputs]
            instances[phase].append(ops)
            for k, op in enumerate(ops):
                path = detector.observe(op, phase)
                if path is not None:  # it ended the other phase's segment: the threshold-th instance
                    ended = PHASES[1 - PHASES.index(phase)]
                    assert k == 0 and list(path.template) == instances[ended][threshold - 1]
                    matchers[ended].add(path)
                if step >= threshold:
                    match = matchers[phase].feed(op)
                    assert match.kind == ("complete" if k == len(ops) - 1 else "continue" if k else "start")
            if step >= threshold:
                assert list(match.ops) == ops and match.path is not None
    assert len(detector.hot_paths) == 2
