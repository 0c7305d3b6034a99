"""Aligning the parallel ranks' recorded ops with the reference's, and the rules that make their outputs comparable.

A parallel program computes the reference's values in pieces: a data-parallel rank holds some rows of each
activation, a column-parallel matmul some columns, a rank's loss is a mean over its rows only, a gradient is a
partial sum until it is all-reduced. Alignment works in two levels:

1. **By module invocation.** Each op belongs to a block: (phase, innermost module's qualified name without
   wrappers' prefixes, the invocation's number within the step); backward ops belong to the invocation whose
   forward created their autograd node; forward and backward ops outside every module are blocked by how many
   outermost module invocations began before them (a microbatch's loss follows its forward), the other ops
   outside modules form one block per phase ("other", "optimizer"). A reference block
   is paired with the block of the same key on every rank. When a rank invokes a module ``m`` times as often
   as the reference (microbatches), the reference's invocation ``k`` of ``c`` is paired with the rank's
   invocations ``k, k + c, ..., k + (m-1)c`` (microbatch-major order, as a gradient-accumulation loop runs).
2. **By op sequence inside a block** (``difflib.SequenceMatcher`` over the op's name, its outputs' numbers of
   dimensions and, for optimizer ops, the parameter they work for): ops the parallel program adds
   (collectives' copies, slices of the batch, casts, a division by the world size) or leaves out are skipped.
   Where the reference runs a rank's data ops once per rank, the rank's align with its own repetition.

An aligned op's outputs are combined across ranks by the first rule that matches the reference's output
(:func:`combine`) over the ranks that run it: the same value on every rank; concatenated along a dimension in
rank order (microbatches of a rank in order), possibly divided by the number of pieces (the gradient of a
per-rank mean loss); summed; or averaged. In the optimizer phase only the first two apply: parameters and optimizer state are replicated or
sharded, never partial sums, so a rank updating with its local gradient does not pass as "the mean is right".
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from simdist.oracle.names import NameMap
from simdist.oracle.record import OpRecord, Stream
from simdist.oracle.tolerance import Difference, Tolerance, compare, tolerance_for
from simdist.ranks import format_ranks

#: (rank, microbatch, the rank's op) aligned with one reference op
Piece = tuple[int, int, OpRecord]
#: (phase, module name or None, invocation number)
BlockKey = tuple[str, str | None, int]


@dataclass
class Match:
    """A reference op and the parallel ranks' ops aligned with it (none: the parallel program lacks it)."""

    ref: OpRecord
    pieces: list[Piece]


@dataclass(frozen=True)
class Verdict:
    """How an aligned value compares: the rule that matched, or the closest rule and its difference."""

    rule: str | None
    difference: Difference | None
    #: ranks whose part differs under the closest rule (every rank of the pieces for sums and means)
    ranks: tuple[int, ...]
    #: the rule that came closest, when none matched
    closest: str | None = None

    @property
    def ok(self) -> bool:
        """Whether some rule matched."""
        return self.rule is not None


def _blocks(stream: Stream, names: NameMap | None) -> dict[BlockKey, list[OpRecord]]:
    """The stream's ops grouped by block, each block in the rank's order."""
    out: dict[BlockKey, list[OpRecord]] = {}
    for op in stream.ops:
        if op.invocation is None:
            # forward and backward ops outside modules follow their microbatch; the rest form one block per phase
            key: BlockKey = (op.phase, None, op.segment if op.phase in ("forward", "backward") else 0)
        else:
            name, n = op.invocation
            if names is not None and name:
                mapped = names.reference_name(name)
                if mapped is None:
                    continue
                name = mapped
            key = (op.phase, name, n)
        out.setdefault(key, []).append(op)
    return out


def _invocations(blocks: dict[BlockKey, list[OpRecord]]) -> dict[tuple[str, str | None], list[int]]:
    """(phase, module) -> its invocation numbers that have ops, in order."""
    out: dict[tuple[str, str | None], list[int]] = {}
    for phase, module, n in blocks:
        out.setdefault((phase, module), []).append(n)
    return {k: sorted(v) for k, v in out.items()}


def align(reference: Stream, ranks: Sequence[Stream], names: NameMap | None = None) -> list[Match]:
    """Every reference op with the ranks' ops aligned with it, in the reference's order."""
    ref_blocks = _blocks(reference, None)
    ref_invs = _invocations(ref_blocks)
    ref_tags = _parameter_tags(reference, None)
    matches = {id(op): Match(op, []) for op in reference.ops}
    for stream in ranks:
        blocks = _blocks(stream, names)
        invs = _invocations(blocks)
        tags = _parameter_tags(stream, names)
        for (phase, module), ref_ns in ref_invs.items():
            mine = invs.get((phase, module), [])
            c = len(ref_ns)
            per = len(mine) // c if c and len(mine) % c == 0 and mine else 1
            for k, ref_n in enumerate(ref_ns):
                ref_ops = ref_blocks[(phase, module, ref_n)]
                for j in range(per):
                    pos = j * c + k
                    if pos >= len(mine):
                        break
                    ops = blocks[(phase, module, mine[pos])]
                    rep = _repetition(ref_ops, ops) if module is None and phase == "other" else None
                    # (reference range, rank range) pairs aligned op by op
                    spans = [((0, len(ref_ops)), (0, len(ops)))] if rep is None else [
                        ((0, rep[2]), (0, rep[0])), ((rep[1], len(ref_ops)), (rep[0], len(ops)))]
                    for (ra, rb), (oa, ob) in spans:
                        sm = difflib.SequenceMatcher(None, [(*_shape_key(o), ref_tags.get(o.index)) for o in ref_ops[ra:rb]],
                                                     [(*_shape_key(o), tags.get(o.index)) for o in ops[oa:ob]],
                                                     autojunk=False)
                        for a, b, size in sm.get_matching_blocks():
                            for i in range(size):
                                matches[id(ref_ops[ra + a + i])].pieces.append((stream.rank, j, ops[oa + b + i]))
    return [matches[id(op)] for op in reference.ops]


def _parameter_tags(stream: Stream, names: NameMap | None) -> dict[int, str]:
    """The parameter each optimizer op works for (by op index), as the reference names it.

    An op is tagged with the first of its inputs that is a parameter or a parameter's gradient (whoever wrote
    it), else with the tag of an op whose output it reads (momentum and Adam's moments follow their gradient). Optimizer
    ops align only with ops of the same parameter: a pipeline stage updates only its own, and the first update
    of a stage's parameters is not the reference's first.
    """
    tags: dict[int, str] = {}
    for op in stream.ops:
        if op.phase != "optimizer":
            continue
        tag = op.parameter
        if tag is None:
            tag = next((tags[a] for a, _ in op.inputs if isinstance(a, int) and a in tags), None)
        elif names is not None:
            tag = names.reference_name(tag)
        if tag is not None:
            tags[op.index] = tag
    return tags


def _shape_key(op: OpRecord) -> tuple:
    """What two ops must share to align: the op, and the number of dimensions of each output.

    Sharding and microbatches change sizes, never the number of dimensions; without it a rank's ``clone`` of
    an activation could align with the reference's ``clone`` of a flattened target.
    """
    return (op.op, *(None if o is None else o.dim() for o in op.outputs))


def _repetition(ref_ops: list[OpRecord], ops: list[OpRecord]) -> tuple[int, int, int] | None:
    """(rank position, reference position, skipped) when the reference repeats the rank's data ops once per rank.

    A reference commonly builds its batch from every rank's shard in turn (``torch.cat([batch(r) for r in
    ranks])``): it runs the rank's data ops once per rank, and rank ``r``'s belong with repetition ``r``, not the
    first. The repetition is found by value: the first op of the rank, of a kind the reference runs more often,
    whose output differs from the reference's op in the same position but equals a later one of the same kind.
    The rank's ops from there on align from that later op on; those before it align with the reference's before
    the skipped position. None when no op needs it (rank 0, or no repetition).
    """
    counts: dict[tuple, int] = {}
    for o in ops:
        counts[_shape_key(o)] = counts.get(_shape_key(o), 0) + 1
    starts: dict[tuple, list[int]] = {}
    for i, o in enumerate(ref_ops):
        starts.setdefault(_shape_key(o), []).append(i)
    seen: dict[tuple, int] = {}
    for b, op in enumerate(ops):
        key = _shape_key(op)
        k = seen[key] = seen.get(key, -1) + 1
        theirs = starts.get(key, [])
        if len(theirs) <= counts[key] or k >= len(theirs) or not op.outputs or op.outputs[0] is None:
            continue
        value = op.outputs[0]
        if _equal(ref_ops[theirs[k]], value):
            continue
        later = next((i for i in theirs[k + 1 :] if _equal(ref_ops[i], value)), None)
        if later is not None:
            return b, later, theirs[k]
    return None


def _equal(op: OpRecord, value: torch.Tensor) -> bool:
    """Whether ``op``'s first output is bitwise ``value``."""
    other = op.outputs[0] if op.outputs else None
    return other is not None and other.shape == value.shape and other.dtype == value.dtype and torch.equal(other, value)


def combine(
    reference: torch.Tensor,
    pieces: Sequence[tuple[int, int, torch.Tensor]],
    exact: bool,
    tolerances: dict[torch.dtype, Tolerance] | None,
    sharded_or_replicated: bool = False,
) -> Verdict:
    """Compare the (rank, microbatch, value) ``pieces`` with ``reference`` under the first rule that fits.

    ``sharded_or_replicated`` allows only "the same on every rank" and concatenation (optimizer state).
    """
    ranks = sorted({r for r, _, _ in pieces})
    closest: tuple[tuple[int, int, float], Difference, tuple[int, ...], str] | None = None

    def consider(diff: Difference, bad: tuple[int, ...], text: str) -> None:
        # the closest rule leaves the fewest elements, then the fewest ranks, different: a bug usually spoils
        # one rank's part, and the rule that isolates it names the rank
        nonlocal closest
        score = (diff.count, len(bad) or len(ranks), diff.rel)
        if closest is None or score < closest[0]:
            closest = (score, diff, bad, text)

    # the same value on every rank that has the op
    same = [v for _, _, v in pieces if v.shape == reference.shape]
    if len(same) == len(pieces):
        if all(_close(v, reference, exact, tolerances) for v in same):
            return Verdict(f"the same on {format_ranks(ranks)}", None, ())
        diffs = [(r, compare(v, reference, exact, tolerances)) for r, _, v in pieces]
        bad = tuple(sorted({r for r, d in diffs if d is not None}))
        worst = max((d for _, d in diffs if d is not None), key=lambda d: d.rel)
        consider(worst, bad, f"the same on {format_ranks(ranks)}")
    # the candidate values of the rules that fit the shapes: their differences are computed only if none matches
    tried: list[tuple[torch.Tensor, str, int | None]] = []

    def _closest(candidates: list[tuple[torch.Tensor, str, int | None]]) -> Verdict:
        for value, text, d in candidates:
            diff = compare(value, reference, exact, tolerances)
            if diff is not None:
                bad = tuple(ranks) if d is None else _bad_slices(value, reference, ordered, pieces, d, exact, tolerances)
                consider(diff, bad, text)
        return _diverged(closest, ranks)

    if len(pieces) < 2:
        return _diverged(closest, ranks)
    # the ranks that run the op may be a subset of the world (a pipeline stage's data-parallel group): the
    # rules combine their pieces alone
    ordered = [v for _, _, v in sorted(pieces, key=lambda p: (p[0], p[1]))]
    n_pieces, holders = len(ordered), len(ranks)
    per_rank = n_pieces // holders
    micro = f", {per_rank} microbatches per rank" if per_rank > 1 and n_pieces % holders == 0 else ""
    divisors = sorted({1, n_pieces, holders})
    for d in range(reference.dim()):
        if not all(v.dim() == reference.dim() for v in ordered):
            break
        if sum(v.shape[d] for v in ordered) != reference.shape[d]:
            continue
        if any(v.shape[:d] != reference.shape[:d] or v.shape[d + 1 :] != reference.shape[d + 1 :] for v in ordered):
            continue
        cat = torch.cat(ordered, d)
        for k in divisors:
            value = cat if k == 1 else cat / k
            text = f"{format_ranks(ranks)} concatenated along dim {d}{micro}" + (f", divided by {k}" if k > 1 else "")
            if _close(value, reference, exact, tolerances):
                return Verdict(text, None, ())
            tried.append((value, text, d))
    if sharded_or_replicated:
        return _closest(tried)
    if all(v.shape == reference.shape for v in ordered):
        total = torch.stack([v.to(torch.float64) if v.is_floating_point() else v for v in ordered]).sum(0)
        for k in divisors:
            value = (total if k == 1 else total / k).to(reference.dtype)
            what = "summed" if k == 1 else "averaged" if k == n_pieces else f"summed and divided by {k}"
            text = f"{format_ranks(ranks)} {what}{micro}"
            if _close(value, reference, exact, tolerances):
                return Verdict(text, None, ())
            tried.append((value, text, None))
    return _closest(tried)


def _close(value: torch.Tensor, reference: torch.Tensor, exact: bool, tolerances: dict[torch.dtype, Tolerance] | None) -> bool:
    """Whether ``value`` equals ``reference`` as :func:`compare` decides, decided cheaply where the answer is clear.

    Most aligned values match, and :func:`compare` works in float64 with NaN bookkeeping; here a bitwise test
    and the criterion in the tensors' own dtype settle all but the values near the tolerance's edge.
    """
    if value.shape != reference.shape:
        return False
    if value.dtype == reference.dtype and torch.equal(value, reference):
        return True
    tol = tolerance_for(reference.dtype, tolerances)
    if exact or tol is None or not reference.is_floating_point() or reference.numel() == 0:
        return compare(value, reference, exact, tolerances) is None
    diff = (value.to(reference.dtype) - reference).abs().max().item()
    bound = tol.atol + tol.rtol * reference.abs().max().item()
    if diff <= 0.5 * bound:
        return True
    if diff > 2 * bound or math.isnan(diff):  # NaN: compare() knows where NaN equals NaN
        return compare(value, reference, exact, tolerances) is None if math.isnan(diff) else False
    return compare(value, reference, exact, tolerances) is None


def _diverged(closest: tuple[tuple[int, int, float], Difference, tuple[int, ...], str] | None, ranks: list[int]) -> Verdict:
    if closest is None:  # no rule fits the shapes: every rank's part is suspect
        return Verdict(None, None, tuple(ranks), None)
    return Verdict(None, closest[1], closest[2] or tuple(ranks), closest[3])


def _bad_slices(
    value: torch.Tensor,
    reference: torch.Tensor,
    ordered: list[torch.Tensor],
    pieces: Sequence[tuple[int, int, torch.Tensor]],
    dim: int,
    exact: bool,
    tolerances: dict[torch.dtype, Tolerance] | None,
) -> tuple[int, ...]:
    """The ranks whose slice of a concatenation differs from the reference's slice."""
    ranks_in_order = [r for r, _ in sorted((p[0], p[1]) for p in pieces)]
    bad: set[int] = set()
    start = 0
    for r, v in zip(ranks_in_order, ordered):
        size = v.shape[dim]
        if compare(value.narrow(dim, start, size), reference.narrow(dim, start, size), exact, tolerances) is not None:
            bad.add(r)
        start += size
    return tuple(sorted(bad))
