"""``check_equivalence``: run a parallel training program and its single-process reference, compare them step by step."""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from simdist.engine.runner import run
from simdist.errors import RunArgumentError, SymmetryError
from simdist.network.cluster import Cluster, load_cluster
from simdist.options import OracleOptions
from simdist.oracle.assemble import AssemblyError, ShardSpec, assemble
from simdist.oracle.capture import Capture, Piece, RankStep
from simdist.oracle.localize import localize as localize_step
from simdist.oracle.localize import single_rank
from simdist.oracle.names import NameMap
from simdist.oracle.report import (
    HISTORY_KINDS,
    KINDS,
    Divergence,
    EquivalenceReport,
    StepDifference,
    label,
    plural,
)
from simdist.oracle.tolerance import Difference, Tolerance, difference, differing, tolerance_for
from simdist.ranks import ranges


def check_equivalence(
    parallel: Callable[..., Any],
    reference: Callable[..., Any],
    cluster: Cluster | str,
    *,
    steps: int | None = None,
    seed: int = 0,
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,
    reference_args: tuple | None = None,
    reference_kwargs: dict[str, Any] | None = None,
    exact: bool = False,
    tolerances: Mapping[torch.dtype, Tolerance] | None = None,
    names: Mapping[str, str] | Callable[[str], str | None] | None = None,
    ignore: tuple[str, ...] | list[str] = (),
    shards: Mapping[str, int | tuple[int, int]] | None = None,
    loss: str | None = "mean",
    localize: bool = True,
    **run_options: Any,
) -> EquivalenceReport:
    """Run ``parallel`` on every rank of ``cluster`` and ``reference`` on one rank; compare them at each optimizer step.

    Both are ordinary training functions: nothing in them is instrumented. At each optimizer step of each rank the
    oracle captures the parameters, their (synchronised) gradients, the optimizer's state and the modules'
    buffers, assembles sharded tensors into full ones from all ranks' memory, and compares them with the
    reference's by qualified name (wrappers' prefixes removed; ``names`` maps the rest, ``ignore`` leaves
    tensors out). The step's loss combines every scalar tensor ``backward()`` was called on, over all ranks, as
    ``loss`` says: "mean", "sum", "accumulated" (each rank's sum, averaged over the ranks: gradient accumulation
    with ``(loss / n).backward()`` per micro-step), or ``None`` (not compared). Replicas (plain tensors several ranks hold, replicated
    DTensor placements) must be bitwise equal. ``exact=True`` compares bitwise, otherwise within the per-dtype
    tolerances of :mod:`simdist.oracle.tolerance` (``tolerances`` overrides them per dtype). ``shards`` describes
    hand-written sharding of plain tensors: ``{"pattern": dim}`` concatenates the pieces of all ranks holding a
    tensor along ``dim`` in rank order; ``(dim, size)`` does so within each ``size`` consecutive holders.

    ``steps`` limits the comparison to the first steps (the programs still run to their end). The reference runs
    on a one-rank cluster of the same device, with the same ``seed``, with ``reference_args`` and
    ``reference_kwargs`` (default: ``args`` and ``kwargs``); ``run_options`` (``progress``, ``races``,
    ``compute``, ...) are passed to :func:`simdist.run` for the parallel run.

    With ``localize`` (the default), a divergence makes both programs run again with every op of the first
    divergent step recorded on every rank, and the report names the first op whose output diverges while its
    inputs matched (:mod:`simdist.oracle.localize`).
    """
    if run_options.get("tensors", "real") == "fake":
        raise RunArgumentError(
            'check_equivalence(..., tensors="fake"): the oracle compares values (losses, gradients, parameters) with '
            "its reference's, and a timing-only run computes none; check equivalence with tensors=\"real\" at a size "
            'that fits, and time the full size with simdist.run(..., tensors="fake")'
        )
    opts = OracleOptions(
        steps=steps, exact=exact, tolerances=tolerances, names=names, ignore=ignore, shards=shards, loss=loss,
        localize=localize,
    )
    if isinstance(cluster, str):
        cluster = load_cluster(cluster)
    if run_options.get("symmetric"):
        raise SymmetryError(
            "check_equivalence compares every rank's state with the single-process reference, and a symmetric run "
            "(symmetric=True) has the state of its few simulated ranks only; check equivalence on a world small "
            "enough to run whole, without symmetric=True"
        )
    name_map = NameMap(opts.names, opts.ignore)
    par_capture, ref_capture = Capture(opts.steps), Capture(opts.steps)
    # each capture sees its own run's ranks alone: checks and plain runs in other threads stay out of it
    with par_capture.installed(everywhere=False):
        par = run(par_capture.bind(parallel), cluster, args=args, kwargs=kwargs, seed=seed, **run_options)
    # the reference's timing is of no interest: it runs without the cost model
    ref_run_options = {k: v for k, v in run_options.items() if k in ("watchdog", "copy_args")}
    with ref_capture.installed(everywhere=False):
        ref = run(
            ref_capture.bind(reference),
            single_rank(cluster),
            args=args if reference_args is None else reference_args,
            kwargs=kwargs if reference_kwargs is None else reference_kwargs,
            seed=seed,
            races="off",
            compute=False,
            **ref_run_options,
        )
    comparison = Comparison.of(opts, name_map)
    # many small element-wise passes: a thread pool costs more than it saves, and far more on a loaded machine
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        divergences, compared_steps = comparison.run(par_capture.ranks, ref_capture.ranks.get(0, []))
    finally:
        torch.set_num_threads(threads)
    found, note = None, ""
    first = divergences[0] if divergences else None
    if first is not None and not opts.localize:
        note = "localisation is off (localize=False)"
    elif first is not None and first.kind in ("steps", "structure"):
        note = "not localised: the programs differ in structure, not in values"
    elif first is not None:
        found = localize_step(
            parallel, reference, cluster, first.step, seed=seed, args=args, kwargs=kwargs,
            reference_args=reference_args, reference_kwargs=reference_kwargs, names=name_map, exact=opts.exact,
            tolerances=opts.tolerances, run_options=run_options,
        )
        if found is None:
            note = f"localisation found no op of step {first.step} whose output diverges"
    return EquivalenceReport(
        steps=compared_steps,
        divergences=divergences,
        localization=found,
        localization_note=note,
        history=comparison.history,
        parallel=par,
        reference=ref,
        world_size=cluster.world_size,
        exact=opts.exact,
        compared=comparison.counts,
        parallel_name=_name_of(parallel),
        reference_name=_name_of(reference),
    )


def _name_of(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


class Comparison:
    """Compares the captured steps of a parallel run with the reference's: every divergence of the first divergent
    step, and the largest difference per kind at every step both runs have."""

    def __init__(
        self,
        names: NameMap,
        shards: dict[str, ShardSpec],
        exact: bool,
        tolerances: dict[torch.dtype, Tolerance],
        loss: str | None,
    ) -> None:
        self.names, self.shards, self.exact, self.tolerances, self.loss = names, shards, exact, tolerances, loss
        #: tensors compared per kind at each step
        self.counts: dict[str, int] = {}
        #: the largest difference per kind at each step :meth:`run` measured (every step both runs have)
        self.history: list[StepDifference] = []
        # the largest |parallel - reference| per kind so far in the step being compared
        self._worst: dict[str, float] = {}
        # past the first divergent step only differences are measured: no divergences, no tolerance tests
        self._measuring = False
        # the difference :meth:`_note` measured last
        self._last = 0.0

    @classmethod
    def of(cls, options: OracleOptions, names: NameMap | None = None) -> Comparison:
        """The comparison ``options`` describe (``names``: their name map, if already built)."""
        names = names if names is not None else NameMap(options.names, options.ignore)
        return cls(names, dict(options.shards), options.exact, dict(options.tolerances), options.loss)

    def run(self, parallel: dict[int, list[RankStep]], reference: list[RankStep]) -> tuple[list[Divergence], int]:
        """The divergences of the first divergent step, and the number of steps compared (up to and including it).

        :attr:`history` gets one entry per step both runs have, past the first divergent step too: those later
        steps are only measured, and a step whose tensors cannot be assembled ends the history there.
        """
        stepping = {r: s for r, s in sorted(parallel.items()) if s}
        counts = {r: len(s) for r, s in stepping.items()}
        n_par = min(counts.values(), default=0)
        n = min(n_par, len(reference))
        self.history = []
        for k in range(n):
            found = self.step(k, {r: s[k] for r, s in stepping.items()}, reference[k])
            self.history.append(self._measured(k))
            if found:
                self._measure_rest(k + 1, n, stepping, reference)
                return found, k + 1
        if len(set(counts.values())) > 1 or n_par != len(reference) or not stepping:
            return [Divergence(n, "steps", "steps", (), None, _steps_text(counts, len(reference)))], n
        return [], n

    def _measure_rest(self, start: int, n: int, stepping: dict[int, list[RankStep]], reference: list[RankStep]) -> None:
        """Append the differences of steps ``start`` to ``n - 1`` to :attr:`history`, stopping at one that fails."""
        self._measuring = True
        try:
            for k in range(start, n):
                try:
                    self.step(k, {r: s[k] for r, s in stepping.items()}, reference[k])
                except AssemblyError:
                    # a later step may be malformed in ways the divergent step was not (pieces that no longer
                    # fit together); the verdict is already known, so the history just ends before it
                    return
                self.history.append(self._measured(k))
        finally:
            self._measuring = False

    def _measured(self, k: int) -> StepDifference:
        """The differences recorded while comparing step ``k``."""
        return StepDifference(k, **{kind: self._worst.get(kind) for kind in HISTORY_KINDS})

    def _note(self, kind: str, value: torch.Tensor, expected: torch.Tensor) -> None:
        """Record ``max|value - expected|`` (same shapes) under ``kind`` for the step being compared."""
        d = self._last = max_abs_difference(value, expected)
        self._worst[kind] = max(d, self._worst.get(kind, 0.0))

    def _differing(self, kind: str, value: torch.Tensor, expected: torch.Tensor) -> torch.Tensor | None:
        """:func:`~simdist.oracle.tolerance.differing`'s verdict on ``value``, with its largest difference recorded
        under ``kind`` for the step's history."""
        if self.exact:
            bad = differing(value, expected, True, self.tolerances)
            if bad is None:
                self._worst.setdefault(kind, 0.0)  # bitwise equal: nothing to measure
            else:
                self._note(kind, value, expected)
            return bad
        self._note(kind, value, expected)
        # ``differing`` first tests max|value - expected| <= atol + rtol * max|expected| on finite tensors; with that
        # maximum just measured, a tensor that passes the same test skips a second pass over the data (the history
        # would otherwise double the comparison's cost on an equivalent run)
        tol = tolerance_for(expected.dtype, self.tolerances)
        floating = value.dtype.is_floating_point and expected.dtype.is_floating_point
        if tol is not None and floating and expected.numel() and math.isfinite(self._last):
            low, high = torch.aminmax(expected.detach())
            scale = max(-low.item(), high.item())
            if math.isfinite(scale) and self._last <= tol.atol + tol.rtol * scale:
                return None
        return differing(value, expected, False, self.tolerances)

    def step(self, k: int, ranks: dict[int, RankStep], ref: RankStep) -> list[Divergence]:
        """Every divergence at step ``k``, in :data:`KINDS` order."""
        self._worst = {}
        found: list[Divergence] = []
        found += self._loss(k, ranks, ref)
        order = list(dict.fromkeys(n for s in ranks.values() for n in s.order))
        position = {n: i for i, n in enumerate(order)}
        # gradients in the order backward computes them (last layer first), the rest in module order
        for kind, key, reverse in (("grad", "grads", True), ("param", "params", False), ("optimizer", "optim", False),
                                   ("buffer", "buffers", False)):
            found += self._tensors(k, kind, ranks, getattr(ref, key), key, position, reverse)
        found.sort(key=lambda d: KINDS.index(d.kind))
        return found

    def _loss(self, k: int, ranks: dict[int, RankStep], ref: RankStep) -> list[Divergence]:
        if self.loss is None:
            return []
        mine = [s.losses for s in ranks.values() if s.losses]
        theirs = ref.losses
        if not mine or not theirs:
            return []
        value, expected = _combine(mine, self.loss), _combine([theirs], self.loss)
        if self._measuring:
            self._note("loss", value, expected)
            return []
        self.counts["loss"] = 1
        bad = self._differing("loss", value, expected)
        if bad is None:
            return []
        roots = sum(len(x) for x in mine)
        how = f"{self.loss} of {roots} backward roots" if self.loss != "accumulated" else (
            f"each rank's sum of its backward roots, averaged over {len(mine)} {plural('rank', len(mine))}")
        detail = f"parallel {value.item():.6g} ({how}), reference {expected.item():.6g}"
        return [Divergence(k, "loss", "loss", tuple(r for r, s in ranks.items() if s.losses),
                           difference(value, expected, bad), detail)]

    def _tensors(
        self,
        k: int,
        kind: str,
        ranks: dict[int, RankStep],
        ref_table: dict[str, Piece | None],
        key: str,
        position: dict[str, int],
        reverse: bool,
    ) -> list[Divergence]:
        held: dict[str, list[Piece]] = {}
        without: dict[str, list[int]] = {}
        for r, s in ranks.items():
            for name, piece in getattr(s, key).items():
                if piece is None:
                    without.setdefault(name, []).append(r)
                else:
                    held.setdefault(name, []).append(piece)
        names = sorted(set(held) | set(without), key=lambda n: _sort_key(n, position, reverse))
        found: list[Divergence] = []
        matched_ref: set[str] = set()
        compared = 0
        for name in names:
            ref_name = self.names.reference_name(name)
            if ref_name is None:
                continue
            matched_ref.add(ref_name)
            if ref_name not in ref_table:
                found.append(Divergence(k, "structure", name, (), None,
                                        f"{label(kind, name)} of the parallel program has no counterpart "
                                        f"{ref_name!r} in the reference (map names with names=..., or ignore=...)"))
                continue
            ref_piece = ref_table[ref_name]
            if name in without or ref_piece is None:
                if ref_piece is not None or name in held:
                    missing = without.get(name, [])
                    text = (f"ranks {ranges(missing)} have no gradient for {name!r}, the reference has one"
                            if ref_piece is not None else f"the reference has no gradient for {ref_name!r}, "
                            f"ranks {ranges([p.rank for p in held.get(name, [])])} have one")
                    found.append(Divergence(k, kind, name, tuple(missing), None, text))
                if name not in held or ref_piece is None:
                    continue
            compared += 1
            found += self._one(k, kind, name, held[name], ref_piece)
        if kind != "buffer":
            for ref_name in ref_table:
                if ref_name not in matched_ref and not self.names.ignored(ref_name):
                    found.append(Divergence(k, "structure", ref_name, (), None,
                                            f"the reference's {label(kind, ref_name)} is held by no rank of the "
                                            "parallel program (map names with names=..., or ignore=...)"))
        if not self._measuring:
            self.counts[plural(kind, 2)] = compared
        return found

    def _one(self, k: int, kind: str, name: str, pieces: list[Piece], ref_piece: Piece) -> list[Divergence]:
        mine = assemble(name, pieces, self._shard(name))
        full = mine.full
        expected = ref_piece.value if ref_piece.layout is None else assemble(name, [ref_piece]).full
        if self._measuring:
            if tuple(full.shape) == tuple(expected.shape):
                self._note(kind, full, expected)
            if mine.how == "replicated":
                # copies bitwise equal to the first holder's have its difference; only the odd ones need measuring
                for p in pieces:
                    if p.rank in mine.replica_ranks and p.value.shape == expected.shape:
                        self._note(kind, p.value, expected)
            return []
        found: list[Divergence] = []
        if mine.replica_ranks:
            holders = pieces[0].rank
            found.append(Divergence(k, "replica", name, mine.replica_ranks, None,
                                    mine.note or f"{'differs' if len(mine.replica_ranks) == 1 else 'differ'} bitwise from rank {holders}'s copy", of=kind))
        if tuple(full.shape) != tuple(expected.shape):
            found.append(Divergence(k, "structure", name, tuple(p.rank for p in pieces), None,
                                    f"{label(kind, name)} has shape {tuple(full.shape)} ({mine.how or 'as held'}), "
                                    f"the reference's {tuple(expected.shape)}" + (
                                        "; if the ranks hold shards of it, describe them with shards={name: dim}"
                                        if mine.how == "replicated" else "")))
            return found
        if mine.how == "replicated":
            found += self._replicas(k, kind, name, pieces, expected, set(mine.replica_ranks))
            return found
        bad = self._differing(kind, full, expected)
        if bad is not None:
            ranks = tuple(r for r, region in sorted(mine.regions.items()) if bool(bad[region].any()))
            found.append(Divergence(k, kind, name, ranks, difference(full, expected, bad)))
        return found

    def _replicas(
        self, k: int, kind: str, name: str, pieces: list[Piece], expected: torch.Tensor, odd: set[int]
    ) -> list[Divergence]:
        """Each replica against the reference: the first holder's copy stands for every copy bitwise equal to it."""

        def verdict(value: torch.Tensor) -> Difference | str | None:
            if value.shape != expected.shape:
                return f"shape {tuple(value.shape)}"
            bad = self._differing(kind, value, expected)
            return None if bad is None else difference(value, expected, bad)

        first = pieces[0].rank
        own = {p.rank: verdict(p.value) for p in pieces if p.rank == first or p.rank in odd}
        ranks = tuple(p.rank for p in pieces if own.get(p.rank, own[first]) is not None)
        if not ranks:
            return []
        diffs = [d for d in own.values() if isinstance(d, Difference)]
        return [Divergence(k, kind, name, ranks, max(diffs, key=lambda d: d.max_abs) if diffs else None)]

    def _shard(self, name: str) -> ShardSpec | None:
        return next((spec for pattern, spec in self.shards.items() if fnmatch.fnmatchcase(name, pattern)), None)


def max_abs_difference(value: torch.Tensor, expected: torch.Tensor) -> float:
    """``max|value - expected|`` over all elements (0.0 for none), computed in ``expected``'s dtype; NaN against NaN
    and an infinity against the same infinity count as equal (0), as :func:`~simdist.oracle.tolerance.differing`
    has it, and any other NaN as an infinite difference."""
    a, b = value.detach(), expected.detach()
    if a.numel() == 0:
        return 0.0
    if a.dtype != b.dtype:
        a = a.to(b.dtype)
    if not (b.dtype.is_floating_point or b.dtype.is_complex):
        # integers subtract in float64 (bool has no subtraction; int64 differences may overflow)
        a, b = a.double(), b.double()
    diff = torch.sub(a, b)
    d = (diff.abs() if diff.is_complex() else diff.abs_()).max().item()  # complex has no in-place abs
    if not math.isnan(d):
        return d
    same = (a.isnan() & b.isnan()) | ((a == b) & a.isinf())
    diff = torch.sub(a, b).abs_().masked_fill_(same, 0.0)
    return float(torch.nan_to_num(diff, nan=math.inf, posinf=math.inf).max().item())


def _combine(per_rank: list[list[torch.Tensor]], how: str) -> torch.Tensor:
    """One step's loss from each rank's backward roots (see :data:`simdist.options.LOSS_MODES`)."""
    dtype = per_rank[0][0].dtype
    if how == "accumulated":
        return torch.stack([torch.stack([v.to(dtype) for v in vs]).sum() for vs in per_rank]).mean()
    stacked = torch.stack([v.to(dtype) for vs in per_rank for v in vs])
    return stacked.mean() if how == "mean" else stacked.sum()


def _sort_key(name: str, position: dict[str, int], reverse: bool) -> tuple:
    base = name.split(":", 1)[0]
    pos = position.get(base, len(position))
    return (-pos if reverse else pos, name)


def _steps_text(counts: dict[int, int], ref: int) -> str:
    if not counts:
        return f"no rank of the parallel program stepped an optimizer; the reference stepped {ref} times"
    by_count: dict[int, list[int]] = {}
    for r, c in counts.items():
        by_count.setdefault(c, []).append(r)
    parts = "; ".join(f"ranks {ranges(rs)} stepped {c} times" for c, rs in sorted(by_count.items()))
    return f"the optimizer steps differ: {parts}; the reference stepped {ref} times"

