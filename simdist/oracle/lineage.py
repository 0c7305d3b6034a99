"""The lineage of a value through what only the parallel program does to it, and the write that spoiled it.

A data-parallel program changes a gradient between the backward op that made it and the optimizer that reads
it in ways the reference never does: it scales it (``div_`` by the world size), all-reduces it, copies it.
When the optimizer's input differs from the reference's, the op to blame is among those writes. Each rank's
value is traced back from the reader through ops no reference op aligns with and through in-place reductions
(all-reduces), to the aligned op that made it or to where the recording lost it: its :func:`lineage`.

:func:`first_spoiling_write` replays the writes of every rank in program order and compares the ranks' value
after each with the reference's by the combination rules (:func:`~simdist.oracle.align.combine`): a value may
legitimately pass through forms that are not the reference's (a sum over ranks not yet divided), so the write to
blame is the one after the last form that matched. A form every rank holds alike is a replica and is compared
as one (the same on every rank); a sum of replicas means nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from simdist.oracle.align import Verdict, combine
from simdist.oracle.record import Collective, OpRecord, Source, Stream
from simdist.oracle.tolerance import Tolerance

#: ops whose output does not depend on the value they overwrite: a lineage ends there
_OVERWRITE = frozenset(
    {
        "aten.zero_",
        "aten.fill_",
        "aten.uniform_",
        "aten.normal_",
        "aten.random_",
        "aten.bernoulli_",
        "aten.exponential_",
        "aten.geometric_",
        "aten.log_normal_",
        "aten.cauchy_",
    }
)
#: how far back a lineage is followed (each step is one write; programs write a gradient a handful of times)
_LONGEST = 64


@dataclass(frozen=True)
class Write:
    """One write on a value's way to its reader: an op only the parallel program runs, or an in-place reduction."""

    #: what the write is, the same on every rank that runs it: (name, site, its occurrence in the lineage)
    label: tuple[str, str, int]
    value: torch.Tensor
    op: OpRecord | None = None
    collective: Collective | None = None


@dataclass(frozen=True)
class Lineage:
    """One rank's value as an aligned op made it (or as it was first seen), and the writes after it, in order."""

    rank: int
    microbatch: int
    base: torch.Tensor | None
    writes: tuple[Write, ...]


@dataclass(frozen=True)
class Spoiled:
    """The write after which the ranks' value no longer matches the reference's, and how the value compared."""

    write: Write
    #: the rank whose lineage ``write`` is taken from
    rank: int
    #: the ranks that ran that write
    ranks: tuple[int, ...]
    #: the ranks' value after the write, against the reference's
    after: Verdict
    #: the rule under which it matched before the write
    before: str


def lineage(stream: Stream, item: tuple, aligned: set[int], rank: int, microbatch: int) -> Lineage:
    """The lineage of the recorded input ``item`` on ``stream``; ``aligned`` holds the ids of the aligned ops."""
    writes: list[tuple[str, str, OpRecord | None, Collective | None, torch.Tensor]] = []
    base: torch.Tensor | None = None
    for _ in range(_LONGEST):
        first, second = item
        if isinstance(first, int):
            op = stream.ops[first]
            value = op.outputs[second]
            if value is None:
                break
            if id(op) in aligned:
                base = value
                break
            writes.append((op.op, op.site, op, None, value))
            source = _source_input(stream, op, second)
            if source is None:
                break
            item = op.inputs[source]
            continue
        value, source = first, second
        if not isinstance(source, Source) or source.collective is None:
            # a value from outside the step (the backward's gradient, a parameter): as first seen
            base = value
            break
        c = source.collective
        writes.append((c.name, str(c.site), None, c, value))
        if source.previous is None:
            break
        item = source.previous
    writes.reverse()
    seen: dict[tuple[str, str], int] = {}
    out = []
    for name, site, op, c, value in writes:
        n = seen[(name, site)] = seen.get((name, site), -1) + 1
        out.append(Write((name, site, n), value, op, c))
    return Lineage(rank, microbatch, base, tuple(out))


def _source_input(stream: Stream, op: OpRecord, output: int) -> int | None:
    """Which input of ``op`` its output ``output`` carries on: a copy's source, an in-place op's own tensor, else
    the first input of the output's shape; None where the output carries no input's value on."""
    value = op.outputs[output]
    if op.op in _OVERWRITE or value is None or not op.inputs:
        return None
    if op.op == "aten.copy_":
        return 1 if len(op.inputs) > 1 else None
    if op.op.endswith("_"):
        return 0
    for i, item in enumerate(op.inputs):
        given = stream.input_value(item)
        if given is not None and given.shape == value.shape:
            return i
    return None


def first_spoiling_write(
    reference: torch.Tensor,
    lineages: Sequence[Lineage],
    exact: bool,
    tolerances: dict[torch.dtype, Tolerance] | None,
) -> Spoiled | None:
    """The write after which the ranks' value stops matching ``reference`` for good, or None.

    None when no rank's value was written on the way, when the value read matches under some rule (it is then
    combined wrongly by its reader, not spoiled), or when no form of it on the way matched.
    """
    if not any(ln.writes for ln in lineages):
        return None
    order = _merged([[w.label for w in ln.writes] for ln in lineages])
    done = [0] * len(lineages)
    states: list[tuple[Verdict | None, tuple[int, ...]]] = [
        (_compare(reference, lineages, done, exact, tolerances), ())
    ]
    for label in order:
        ran = []
        for i, ln in enumerate(lineages):
            if done[i] < len(ln.writes) and ln.writes[done[i]].label == label:
                done[i] += 1
                ran.append(ln.rank)
        states.append((_compare(reference, lineages, done, exact, tolerances), tuple(sorted(set(ran)))))
    final = states[-1][0]
    if final is None or final.ok:
        return None
    last_ok = max((k for k, (v, _) in enumerate(states) if v is not None and v.ok), default=None)
    if last_ok is None:
        return None
    after, ran = states[last_ok + 1]
    label = order[last_ok]
    rank, write = next((ln.rank, w) for ln in lineages for w in ln.writes if w.label == label)
    if after is None:  # some rank's value unknown right after it: judge by what the ranks that ran it hold
        after = Verdict(None, None, ran)
    before = states[last_ok][0]
    assert before is not None and before.rule is not None
    return Spoiled(write, rank, tuple(r for r in after.ranks if r in ran) or ran, after, before.rule)


def _compare(
    reference: torch.Tensor,
    lineages: Sequence[Lineage],
    done: list[int],
    exact: bool,
    tolerances: dict[torch.dtype, Tolerance] | None,
) -> Verdict | None:
    """The ranks' value after their first ``done[i]`` writes against ``reference``; None if some rank's is unknown."""
    pieces = []
    for ln, k in zip(lineages, done):
        value = ln.writes[k - 1].value if k else ln.base
        if value is None:
            return None
        pieces.append((ln.rank, ln.microbatch, value))
    first = pieces[0][2]
    replicas = len(pieces) > 1 and all(
        v.shape == first.shape and v.dtype == first.dtype and torch.equal(v, first) for _, _, v in pieces
    )
    return combine(reference, pieces, exact, tolerances, replicas)


def _merged(sequences: list[list[tuple[str, str, int]]]) -> list[tuple[str, str, int]]:
    """One order of every label that keeps each sequence's order (ranks skip writes others run, never reorder)."""
    pos = [0] * len(sequences)
    out: list[tuple[str, str, int]] = []
    while True:
        heads = [s[pos[i]] for i, s in enumerate(sequences) if pos[i] < len(s)]
        if not heads:
            return out
        later = {x for i, s in enumerate(sequences) for x in s[pos[i] + 1 :]}
        pick = next((h for h in heads if h not in later), heads[0])
        out.append(pick)
        for i, s in enumerate(sequences):
            if pos[i] < len(s) and s[pos[i]] == pick:
                pos[i] += 1
