"""Localisation: rerun one optimizer step with per-op recording and name the first op whose output diverges.

The parallel program runs again on its cluster and the reference on a one-rank cluster of the same device,
both with the same seed, each rank under a :class:`~simdist.oracle.record.Recorder` for step ``step``. The
reference's ops are aligned with every rank's (:mod:`simdist.oracle.align`) and visited in the reference's
order; the first aligned op whose outputs no combination rule reconciles with the reference's is the
divergence. If its inputs matched, that op is the answer. If they did not, the divergence entered before it
through something no aligned op accounts for. First the writes on the input's way from the op that made it
(ops only the parallel program runs, all-reduces) are replayed, and the one after which the value stopped
matching is named (:mod:`simdist.oracle.lineage`: a second division by the world size, a scaling on one rank).
Failing that, the input's origin is named: an op only the parallel program runs (a slice of the batch), a
collective's output, a gradient as backward and its synchronisation left it, a parameter as the step found it,
or the data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from simdist.compute.devices import DeviceSpec
from simdist.engine.runner import run
from simdist.network.cluster import Cluster
from simdist.oracle.align import Match, Verdict, align, combine
from simdist.oracle.lineage import first_spoiling_write, lineage
from simdist.oracle.names import NameMap
from simdist.oracle.record import OpRecord, Recorder, Source, Stream, recording, wrap
from simdist.oracle.tolerance import Difference, Tolerance
from simdist.ranks import format_ranks

#: ops whose outputs hold whatever memory they got: never compared, nor is what they made when read
UNINITIALISED = frozenset(
    {"aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty", "aten.new_empty_strided"}
)


@dataclass(frozen=True)
class Localization:
    """The first op of the parallel program whose output diverges from the reference's (or where it entered)."""

    op: str
    site: str
    ranks: tuple[int, ...]
    module: str | None
    phase: str
    difference: Difference | None
    inputs_matched: bool
    last_collective: str | None
    note: str
    #: how the text names the op when it is a collective: with the group's call number (``all_reduce #3 on group 0``)
    label: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-able fields, the text included."""
        d = dataclasses.asdict(self)
        d["ranks"] = list(self.ranks)
        d["text"] = str(self)
        return d

    def __str__(self) -> str:
        where = f" in module {self.module!r}" if self.module else ""
        text = f"first divergent op: {self.label or self.op} at {self.site} ({self.phase}{where}, {format_ranks(self.ranks)})"
        text += "; inputs matched the reference" if self.inputs_matched else "; its inputs already differed"
        if self.difference is not None:
            text += f"; {self.difference}"
        if self.last_collective:
            text += f"; last collective before it: {self.last_collective}"
        return f"{text}\n  {self.note}"


def single_rank(cluster: Cluster) -> Cluster:
    """A one-rank cluster with ``cluster``'s device, where the reference runs."""
    device = cluster.device
    return Cluster.switch(1, device=device.name if isinstance(device, DeviceSpec) else device)


def localize(
    parallel: Callable[..., Any],
    reference: Callable[..., Any],
    cluster: Cluster | str,
    step: int,
    *,
    seed: int = 0,
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,
    reference_args: tuple | None = None,
    reference_kwargs: dict[str, Any] | None = None,
    names: NameMap | None = None,
    exact: bool = False,
    tolerances: dict[torch.dtype, Tolerance] | None = None,
    run_options: Mapping[str, Any] | None = None,
) -> Localization | None:
    """Rerun optimizer step ``step`` (0-based) of both programs op by op; the first divergent op, or None.

    None also when either program never completes step ``step``. ``run_options`` go to ``simdist.run`` for
    both runs (``compute``, ``progress``, ...).
    """
    if isinstance(cluster, str):
        cluster = Cluster.load(cluster)
    options = dict(run_options or {})
    ref_cluster = single_rank(cluster)
    ranks = _recorded(parallel, cluster, step, seed, args, kwargs, options)
    (ref,) = _recorded(
        reference, ref_cluster, step, seed, args if reference_args is None else reference_args,
        kwargs if reference_kwargs is None else reference_kwargs, options,
    )
    if not ref.ops or not all(s.ops for s in ranks):
        return None
    # small tensors, many ops: intra-op threads cost more than they save (simulated runs use one thread too)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return first_divergence(ref, ranks, names or NameMap(), exact, tolerances)
    finally:
        torch.set_num_threads(threads)


def _recorded(
    fn: Callable[..., Any], cluster: Cluster, step: int, seed: int, args: tuple, kwargs: dict[str, Any] | None,
    options: dict[str, Any],
) -> list[Stream]:
    """Run ``fn`` on ``cluster`` with every rank recording step ``step``; the ranks' streams."""
    recorders: dict[int, Recorder] = {}
    with recording():
        run(wrap(fn, step, recorders, dist.get_rank), cluster, args=args, kwargs=kwargs, seed=seed, **options)
    return [recorders[r].stream for r in range(cluster.world_size)]


def first_divergence(
    ref: Stream, ranks: list[Stream], names: NameMap, exact: bool, tolerances: dict[torch.dtype, Tolerance] | None
) -> Localization | None:
    """The first aligned op, in the reference's order, whose outputs diverge; explained (see the module's text)."""
    streams = {s.rank: s for s in ranks}
    matches = align(ref, ranks, names)
    aligned = {id(op) for m in matches for _, _, op in m.pieces}
    for m in matches:
        if not m.pieces or m.ref.op in UNINITIALISED:
            continue
        verdict = _outputs(m, exact, tolerances)
        if verdict is None or verdict.ok:
            continue
        position, in_verdict = _inputs(m, ref, streams, exact, tolerances)
        rank = min(verdict.ranks) if verdict.ranks else m.pieces[0][0]
        piece = next(op for r, _, op in m.pieces if r == rank)
        if in_verdict is None:
            rules = "; ".join(sorted({_input_rule(m, ref, streams, exact, tolerances)}))
            return Localization(
                piece.op, piece.site, verdict.ranks, piece.module, piece.phase, verdict.difference, True,
                str(piece.collective) if piece.collective else None,
                f"no rule reconciles its output with the reference's (closest: {verdict.closest or 'none fits'}); "
                f"its inputs matched ({rules}), so a non-tensor argument (a learning rate, a scale, a seed) or the "
                "op itself differs",
            )
        return _entry(m, position, in_verdict, ref, streams, aligned, exact, tolerances)
    return None


def _compare_rule(m: Match) -> bool:
    """Whether only "replicated" and "concatenated" apply (optimizer state is never a partial sum)."""
    return m.ref.phase == "optimizer"


def _outputs(
    m: Match, exact: bool, tolerances: dict[torch.dtype, Tolerance] | None
) -> Verdict | None:
    """The verdict on the first output that no rule reconciles, else that of the last output; None: nothing to compare."""
    last = None
    for i, value in enumerate(m.ref.outputs):
        if value is None:
            continue
        pieces = [(r, j, op.outputs[i]) for r, j, op in m.pieces if i < len(op.outputs) and op.outputs[i] is not None]
        if not pieces:
            continue
        last = combine(value, pieces, exact, tolerances, _compare_rule(m))
        if not last.ok:
            return last
    return last


def _input_values(
    m: Match, i: int, ref: Stream, streams: dict[int, Stream]
) -> tuple[torch.Tensor | None, list[tuple[int, int, torch.Tensor]]]:
    """The reference's input ``i`` of the matched op and the ranks' (skipping uninitialised memory)."""
    item = m.ref.inputs[i]
    if isinstance(item[0], int) and ref.ops[item[0]].op in UNINITIALISED:
        return None, []
    value = ref.input_value(item)
    pieces = []
    for r, j, op in m.pieces:
        if i < len(op.inputs):
            it = op.inputs[i]
            if isinstance(it[0], int) and streams[r].ops[it[0]].op in UNINITIALISED:
                continue
            v = streams[r].input_value(it)
            if v is not None:
                pieces.append((r, j, v))
    return value, pieces


def _inputs(
    m: Match, ref: Stream, streams: dict[int, Stream], exact: bool,
    tolerances: dict[torch.dtype, Tolerance] | None,
) -> tuple[int, Verdict | None]:
    """(position, verdict) of the first input no rule reconciles; (-1, None) when every input matched."""
    for i in range(len(m.ref.inputs)):
        value, pieces = _input_values(m, i, ref, streams)
        if value is None or not pieces:
            continue
        v = combine(value, pieces, exact, tolerances, _compare_rule(m))
        if not v.ok:
            return i, v
    return -1, None


def _input_rule(
    m: Match, ref: Stream, streams: dict[int, Stream], exact: bool,
    tolerances: dict[torch.dtype, Tolerance] | None,
) -> str:
    """How the matched op's inputs compared, as text."""
    rules = []
    for i in range(len(m.ref.inputs)):
        value, pieces = _input_values(m, i, ref, streams)
        if value is not None and pieces:
            rules.append(f"input {i}: {combine(value, pieces, exact, tolerances, _compare_rule(m)).rule}")
    return ", ".join(rules) if rules else "no tensor inputs"


def _entry(
    m: Match, position: int, in_verdict: Verdict, ref: Stream, streams: dict[int, Stream], aligned: set[int],
    exact: bool, tolerances: dict[torch.dtype, Tolerance] | None,
) -> Localization:
    """Where a divergence whose first aligned op already had differing inputs entered the parallel program."""
    spoiled = _spoiled(m, position, ref, streams, aligned, exact, tolerances)
    if spoiled is not None:
        return spoiled
    bad = in_verdict.ranks or tuple(sorted({r for r, _, _ in m.pieces}))
    # explain through the rank whose input an op of its own (one the reference lacks) made, if any: under a
    # sum or mean rule every rank is suspect, while the odd rank out is the one that ran something extra
    rank = min(bad, key=lambda r: (_input_kind(m, r, position, streams, aligned), r))
    consumer = next(op for r, _, op in m.pieces if r == rank)
    stream = streams[rank]
    item = consumer.inputs[position] if position < len(consumer.inputs) else None
    reads = f"{consumer.op} at {consumer.site} reads it as input {position}"
    expected = f"compared as {in_verdict.closest or 'no rule fits its shapes'}"
    collective = str(consumer.collective) if consumer.collective else None
    # a gradient the optimizer reads, last written by an op only the parallel program runs (an accumulation, a
    # copy out of a bucket) that spoiled nothing by itself: explained below as a gradient, not by that op
    gradient = consumer.gradients.get(position)
    linked = item is not None and isinstance(item[0], int)
    if linked and (gradient is None or id(stream.ops[item[0]]) in aligned):
        producer = stream.ops[item[0]]
        same = _same_producers(m, position, producer, streams, bad)
        if id(producer) not in aligned:
            return Localization(
                producer.op, producer.site, same, producer.module, producer.phase, in_verdict.difference, True,
                str(producer.collective) if producer.collective else None,
                f"only the parallel program runs this op (no reference op aligns with it) and its output is the "
                f"first value that differs: {reads}, which differs from the reference's input ({expected}); every "
                "aligned op before it matched",
            )
        return Localization(
            consumer.op, consumer.site, bad, consumer.module, consumer.phase, in_verdict.difference, False, collective,
            f"input {position} comes from {producer.op} at {producer.site}, whose output matched the reference, "
            f"but not as this op uses it ({expected}): the ranks' parts are combined differently between the two "
            "ops (a missing or wrong synchronisation)",
        )
    source = item[1] if item is not None and isinstance(item[1], Source) else Source(gradient=gradient)
    if source.collective is not None:
        c = source.collective
        return Localization(
            c.name, c.site, bad, c.module, c.phase, in_verdict.difference, True,
            str(stream.collectives[c.number - 2]) if c.number > 1 else None,
            f"its output is the first value that differs: {reads}, which differs from the reference's input "
            f"({expected}); every aligned op before it matched",
            c.label,
        )
    return Localization(
        consumer.op, consumer.site, bad, consumer.module, consumer.phase, in_verdict.difference, False, collective,
        f"input {position} is {source}, and it already differs from the reference's ({expected})"
        + (_gradient_hint(m, position, ref, streams, exact, tolerances, in_verdict.difference)
           if source.gradient else
           ": the divergence entered with it, not through an op of this step"),
    )


def _spoiled(
    m: Match, position: int, ref: Stream, streams: dict[int, Stream], aligned: set[int], exact: bool,
    tolerances: dict[torch.dtype, Tolerance] | None,
) -> Localization | None:
    """The op or collective after which the value of input ``position`` stopped matching the reference's on its way
    from the op that made it (:mod:`simdist.oracle.lineage`), if the ranks wrote it on the way; else None."""
    value, _ = _input_values(m, position, ref, streams)
    if value is None:
        return None
    lineages = []
    for r, j, op in m.pieces:
        if position >= len(op.inputs):
            return None
        item = op.inputs[position]
        if isinstance(item[0], int) and streams[r].ops[item[0]].op in UNINITIALISED:
            return None
        lineages.append(lineage(streams[r], item, aligned, r, j))
    found = first_spoiling_write(value, lineages, exact, tolerances)
    if found is None:
        return None
    reader = m.pieces[0][2]
    closest = found.after.closest or "no rule fits its shapes"
    reads = f"{reader.op} at {reader.site} reads it as input {position}"
    w = found.write
    if w.op is not None:
        op = w.op
        return Localization(
            op.op, op.site, found.ranks, op.module, op.phase, found.after.difference, True,
            str(op.collective) if op.collective else None,
            "only the parallel program runs this op (no reference op aligns with it); the value it writes matched "
            f"the reference's before it ({found.before}), not after it (closest: {closest}); {reads}",
        )
    c = w.collective
    assert c is not None
    previous = streams[found.rank].collectives[c.number - 2] if c.number > 1 else None
    return Localization(
        c.name, c.site, found.ranks, c.module, c.phase, found.after.difference, True,
        str(previous) if previous else None,
        f"the value it reduces matched the reference's ({found.before}), its result does not (closest: {closest}); "
        f"{reads}",
        c.label,
    )


def _gradient_hint(
    m: Match, position: int, ref: Stream, streams: dict[int, Stream], exact: bool,
    tolerances: dict[torch.dtype, Tolerance] | None, difference: Difference | None,
) -> str:
    """What a gradient the optimizer reads says about its synchronisation: the ranks' sum or mean would match,
    or it is a multiple of the reference's."""
    value, pieces = _input_values(m, position, ref, streams)
    if value is not None and pieces:
        v = combine(value, pieces, exact, tolerances)
        if v.ok:
            return (f"; it would match as {v.rule}: the gradient was not (or not fully) synchronised across ranks "
                    "before the step")
    if difference is not None and difference.scale is not None:
        return (f"; it is {difference.scale:.4g} x the reference's: a loss or gradient scaled by a wrong factor "
                "(a world size, a number of micro-steps)")
    return ""


def _input_kind(m: Match, rank: int, position: int, streams: dict[int, Stream], aligned: set[int]) -> int:
    """0 if ``rank``'s input ``position`` of the matched op comes from an unaligned op, 1 from a collective, else 2."""
    op = next(op for r, _, op in m.pieces if r == rank)
    item = op.inputs[position] if position < len(op.inputs) else None
    if item is None:
        return 2
    if isinstance(item[0], int):
        return 0 if id(streams[rank].ops[item[0]]) not in aligned else 2
    return 1 if isinstance(item[1], Source) and item[1].collective is not None else 2


def _same_producers(
    m: Match, position: int, producer: OpRecord, streams: dict[int, Stream], bad: tuple[int, ...]
) -> tuple[int, ...]:
    """The ranks among ``bad`` whose input ``position`` comes from an op at the same site as ``producer``."""
    out = []
    for r, _, op in m.pieces:
        item = op.inputs[position] if position < len(op.inputs) else None
        if r in bad and item is not None and isinstance(item[0], int):
            p = streams[r].ops[item[0]]
            if p.site == producer.site and p.op == producer.op:
                out.append(r)
    return tuple(sorted(set(out))) or bad
