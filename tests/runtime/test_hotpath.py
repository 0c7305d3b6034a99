"""Hot paths: id-free signatures, detection of repeated loops (against a brute-force oracle), path matching."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from simdist.runtime.hotpath import HotPath, HotPathDetector, OpRecord, PathMatcher, signature

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


def square_free(n: int) -> list[int]:
    """A prefix of a ternary square-free word (Thue-Morse differences): no factor ever repeats back to back."""
    tm = [i.bit_count() & 1 for i in range(n + 1)]
    return [tm[i + 1] - tm[i] + 1 for i in range(n)]


@st.composite
def noise(
    draw: st.DrawFn,
    ids: Iterator[int],
    max_size: int = 20,
    names: list[str] | None = None,
    reuse: bool = False,
) -> list[OpRecord]:
    """Ops with random dependencies, named by a square-free word unless `names` is given.

    With `reuse`, outputs may recycle ids 0..3, as a runtime that frees tensors might.
    """
    size = draw(st.integers(0, max_size))
    word = square_free(size)
    ops: list[OpRecord] = []
    produced = [next(ids)]
    for p in range(size):
        inputs = tuple(draw(st.sampled_from(produced[-8:])) for _ in range(draw(st.integers(0, 2))))
        outputs = (draw(st.integers(0, 3)) if reuse and draw(st.booleans()) else next(ids),)
        produced.extend(outputs)
        name = f"noise{word[p]}" if names is None else draw(st.sampled_from(names))
        ops.append(OpRecord(name, inputs, outputs))
    return ops


def run(detector: HotPathDetector, stream: list[OpRecord]) -> list[tuple[int, HotPath]]:
    return [(i, path) for i, op in enumerate(stream) if (path := detector.observe(op)) is not None]


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


@given(loop_bodies(4, 12), st.integers(2, 4), st.data())
def test_loop_becomes_hot_at_the_threshold_repetition(
    body: list[BodyOp], threshold: int, data: st.DataObject
) -> None:
    ids = itertools.count(1000)
    prefix = data.draw(noise(ids))
    loop = iterations(body, threshold + 3, ids)
    stream = prefix + [op for it in loop for op in it]
    detector = HotPathDetector(window=12 * threshold, threshold=threshold, min_length=4, max_length=12)
    events = run(detector, stream)
    size = len(body)
    assert [i for i, _ in events] == [len(prefix) + threshold * size - 1]
    path = events[0][1]
    assert path.length == size
    assert path.signature == signature(loop[0])
    assert list(path.template) == loop[threshold - 1]
    assert detector.hot_paths == (path,)


@given(loop_bodies(1, 8), st.integers(1, 10), st.integers(2, 3), st.data())
def test_short_body_is_reported_as_its_smallest_multiple_of_min_length(
    body: list[BodyOp], min_length: int, threshold: int, data: st.DataObject
) -> None:
    size = len(body)
    period = size * -(-min_length // size)  # the fundamental period, or its smallest multiple >= min_length
    ids = itertools.count(1000)
    prefix = data.draw(noise(ids))
    stream = prefix + [op for it in iterations(body, threshold * period // size + 4, ids) for op in it]
    detector = HotPathDetector(
        window=threshold * 24, threshold=threshold, min_length=min_length, max_length=24
    )
    events = run(detector, stream)
    end = len(prefix) + threshold * period
    assert [(i, p.length) for i, p in events] == [(end - 1, period)]
    assert events[0][1].signature == signature(stream[len(prefix) : len(prefix) + period])


@given(st.integers(2, 4), st.integers(1, 4), st.data())
def test_square_free_stream_is_never_hot(threshold: int, min_length: int, data: st.DataObject) -> None:
    # Equal segments need equal names, and the names spell a word with no factor repeated back to back.
    stream = data.draw(noise(itertools.count(0), max_size=300))
    detector = HotPathDetector(
        window=threshold * 16, threshold=threshold, min_length=min_length, max_length=16
    )
    assert run(detector, stream) == []


def brute_force(
    stream: list[OpRecord], threshold: int, min_length: int, max_length: int
) -> list[tuple[int, tuple]]:
    """The detector's policy (class docstring) straight from `signature`, O(max_length^2) per op."""

    def seg(period: int, end: int) -> tuple:
        return signature(stream[end - period : end])

    events, seen, lock = [], set(), None
    for n in range(1, len(stream) + 1):
        if lock is not None and seg(lock, n) == seg(lock, n - lock):
            continue
        lock = None
        for period in range(min_length, max_length + 1):
            if n < threshold * period:
                break
            sig = seg(period, n)
            if all(seg(period, n - j * period) == sig for j in range(1, threshold)):
                lock = period
                if sig not in seen:
                    seen.add(sig)
                    events.append((n - 1, sig))
                break
    return events


@given(st.integers(2, 3), st.integers(1, 3), st.integers(0, 4), st.integers(0, 3), st.data())
def test_detector_agrees_with_brute_force(
    threshold: int, min_length: int, extra: int, spare: int, data: st.DataObject
) -> None:
    # Few names and short bodies, so coincidental repeats, nested periods and re-entered loops all happen.
    max_length = min_length + extra
    ids = itertools.count(1000)
    stream: list[OpRecord] = []
    for _ in range(data.draw(st.integers(1, 5))):
        if data.draw(st.booleans()):
            stream += data.draw(noise(ids, max_size=12, names=["a", "b"], reuse=data.draw(st.booleans())))
        else:
            body = data.draw(loop_bodies(1, max_length + 1, names=["a", "b", "c"]))
            stream += [op for it in iterations(body, data.draw(st.integers(1, 6)), ids) for op in it]
    detector = HotPathDetector(threshold * max_length + spare, threshold, min_length, max_length)
    got = [(i, p.signature) for i, p in run(detector, stream)]
    assert got == brute_force(stream, threshold, min_length, max_length)


@given(loop_bodies(2, 8), st.integers(2, 3), st.data())
def test_a_loop_that_changes_only_its_dependencies_is_a_new_path(
    body: list[BodyOp], threshold: int, data: st.DataObject
) -> None:
    # Same names before and after the change, so only the structural hashes can see the loop switch.
    pos = data.draw(st.integers(1, len(body) - 1))
    name, refs, n_out = body[pos]
    assume(refs)
    slot = data.draw(st.integers(0, len(refs) - 1))
    old = refs[slot]
    other_output = [(old[0], old[1], 1 - old[2])] if old[0] in ("int", "carry") else []
    new_ref = data.draw(
        st.sampled_from(
            [
                ("int", 0, 0),
                ("carry", 0, 0),
                ("carry", pos, 1),
                ("param", 0),
                ("param", 1),
                ("data",),
                *other_output,
            ]
        )
    )
    changed = [*body[:pos], (name, (*refs[:slot], new_ref, *refs[slot + 1 :]), n_out), *body[pos + 1 :]]
    assume(
        signature(iterations(body, 1, itertools.count())[0])
        != signature(iterations(changed, 1, itertools.count())[0])
    )
    check_loop_switch(body, changed, threshold)


def check_loop_switch(body: list[BodyOp], changed: list[BodyOp], threshold: int) -> None:
    """A loop running `threshold` + 2 times, then its changed version as often: the same as brute force."""
    ids = itertools.count(1000)
    before, after = iterations(body, threshold + 2, ids), iterations(changed, threshold + 2, ids)
    assert signature(before[0]) != signature(after[0])
    stream = [op for it in before + after for op in it]
    detector = HotPathDetector(window=threshold * 8, threshold=threshold, min_length=2, max_length=8)
    events = [(i, p.signature) for i, p in run(detector, stream)]
    assert events == brute_force(stream, threshold, 2, 8)
    # The switch is noticed: the new loop (or the rotation of it that repeats first) is reported.
    assert events[-1][0] >= len(before) * len(body)


@pytest.mark.parametrize(
    ("ref", "changed_ref"),
    [
        (("int", 0, 0), ("int", 0, 1)),  # the other output of the same producer
        (("int", 0, 0), ("int", 1, 0)),  # another producer
        (("param", 0), ("param", 1)),  # another external
        (("param", 0), ("data",)),  # a distinct external instead of a reused one
    ],
)
def test_each_kind_of_dependency_change_is_a_new_path(ref: Ref, changed_ref: Ref) -> None:
    def body(r: Ref) -> list[BodyOp]:
        return [("op0", (("param", 0),), 2), ("op1", (), 1), ("op2", (("int", 1, 0), r), 1), ("op3", (), 1)]

    check_loop_switch(body(ref), body(changed_ref), threshold=3)


def test_long_loop_stream_is_found_once() -> None:
    # Throughput lives in the benchmark; here 100k ops only have to go through with one hot path found.
    body = [
        (f"op{p}", (("int", p - 1, 0), ("param", p % PARAMS)) if p else (("carry", 19, 0), ("data",)), 1)
        for p in range(20)
    ]
    detector = HotPathDetector()
    events = run(detector, [op for it in iterations(body, 5000, itertools.count()) for op in it])
    assert [(i, p.length) for i, p in events] == [(59, 20)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"threshold": 1}, "threshold must be >= 2"),
        ({"min_length": 0}, "min_length must be >= 1"),
        ({"min_length": 8, "max_length": 4}, "max_length must be >= min_length"),
        ({"window": 100, "threshold": 3, "max_length": 64}, "window must hold threshold"),
    ],
)
def test_bad_parameters_are_rejected(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HotPathDetector(**kwargs)


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
    with pytest.raises(ValueError, match="at least one op"):
        matcher.add(HotPath((), 0, ()))


def reference_matcher(paths: list[HotPath], stream: list[OpRecord]) -> list[tuple[str, tuple[OpRecord, ...]]]:
    """The `PathMatcher` contract straight from `signature`: prefixes compared whole, suffixes tried in order."""
    sigs = [p.signature for p in paths]

    def whole(ops: list[OpRecord]) -> bool:
        return signature(ops) in sigs

    def proper_prefix(ops: list[OpRecord]) -> bool:
        sig = signature(ops)
        return any(s[: len(sig)] == sig and len(s) > len(sig) for s in sigs)

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
    matcher = PathMatcher(paths)
    got = [(m.kind, m.ops) for m in (matcher.feed(op) for op in stream)]
    assert got == reference_matcher(paths, stream)


@given(loop_bodies(4, 12))
def test_detected_path_matches_the_following_iterations(body: list[BodyOp]) -> None:
    loop = iterations(body, 8, itertools.count())
    detector = HotPathDetector(window=36, threshold=3, min_length=4, max_length=12)
    events = run(detector, [op for it in loop[:3] for op in it])
    matcher = PathMatcher(detector.hot_paths)
    assert len(events) == 1
    for it in loop[3:]:
        results = [matcher.feed(op) for op in it]
        assert (results[-1].kind, list(results[-1].ops)) == ("complete", it)
