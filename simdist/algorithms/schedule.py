"""A collective's schedule as data: which rank sends which element range to whom, at which step.

Like the action lists of ``torch.distributed.pipelining``, a schedule is a plain list of :class:`Msg` that
one function prints (:func:`format_schedule`) and another runs on the simulated network with real data
(``simdist.comm.messages``). Ranks are group-local indices 0..n-1; element offsets index each rank's flat
buffers. A rank issues its sends of step ``k`` as soon as every message addressed to it with a step below
``k`` has arrived, so a schedule runs asynchronously per rank, as on real hardware.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

#: pipelined ring broadcast/reduce split a buffer into at most this many pieces; NCCL pipelines in slices of
#: a few hundred KiB, and more pieces than this only add simulated events, not insight
MAX_PIPELINE_CHUNKS = 32
#: the size (bytes) of one piece of a pipelined ring broadcast/reduce, before the cap above
PIPELINE_CHUNK_BYTES = 256 * 1024


class Msg(NamedTuple):
    """One message: ``src`` sends ``src_buf[slo:shi]`` to ``dst`` at its step ``step``.

    On arrival the payload is reduced into (``kind == "reduce"``) or copied to (``"copy"``)
    ``dst_buf[dlo:dhi]``.
    """

    src: int
    dst: int
    step: int
    slo: int
    shi: int
    dlo: int
    dhi: int
    kind: str


def msg(src: int, dst: int, step: int, lo: int, hi: int, kind: str) -> Msg:
    """A message whose source and destination ranges are the same elements ``[lo, hi)``."""
    return Msg(src, dst, step, lo, hi, lo, hi, kind)


def split_offsets(numel: int, parts: int) -> list[int]:
    """Boundaries of ``parts`` nearly equal pieces of ``numel`` elements (the first ``numel % parts`` are larger)."""
    base, rem = divmod(numel, parts)
    offs = [0]
    for i in range(parts):
        offs.append(offs[-1] + base + (1 if i < rem else 0))
    return offs


def offsets_from_sizes(sizes: Sequence[int]) -> list[int]:
    """Prefix sums ``[0, s0, s0+s1, ...]``."""
    offs = [0]
    for s in sizes:
        offs.append(offs[-1] + s)
    return offs


def pipeline_chunks(nbytes: int, numel: int) -> int:
    """Number of pieces a pipelined ring broadcast/reduce splits an ``nbytes`` buffer of ``numel`` elements into."""
    want = max(1, math.ceil(nbytes / PIPELINE_CHUNK_BYTES))
    return max(1, min(MAX_PIPELINE_CHUNKS, want, numel))


class MsgTable(Sequence[Msg]):
    """A schedule built as arrays: one column per :class:`Msg` field (``red``: whether each reduces), read as
    :class:`Msg` one by one where a consumer wants them. Large ring schedules are millions of messages; as
    columns they cost a few array operations to build, and a batched run (``simdist.comm.batched``) reads them
    as they are."""

    def __init__(self, *columns: np.ndarray) -> None:
        self._cols = tuple(np.asarray(c) for c in columns)
        self._list: list[Msg] | None = None

    def columns(self) -> tuple[np.ndarray, ...]:
        """(src, dst, step, slo, shi, dlo, dhi, red) as arrays."""
        return self._cols

    def _msgs(self) -> list[Msg]:
        if self._list is None:
            src, dst, step, slo, shi, dlo, dhi, red = (c.tolist() for c in self._cols)
            kinds = ["reduce" if r else "copy" for r in red]
            self._list = list(map(Msg, src, dst, step, slo, shi, dlo, dhi, kinds))
        return self._list

    def __len__(self) -> int:
        return len(self._cols[0])

    def __getitem__(self, i):  # type: ignore[no-untyped-def,override]
        return self._msgs()[i]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._msgs())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __add__(self, other: Sequence[Msg]) -> MsgTable | list[Msg]:
        if isinstance(other, MsgTable):
            return MsgTable(*(np.concatenate([a, b]) for a, b in zip(self._cols, other._cols)))
        return [*self, *other]

    def __radd__(self, other: Sequence[Msg]) -> list[Msg]:
        return [*other, *self]

    def __repr__(self) -> str:
        return f"MsgTable({len(self)} messages)"


def steps(msgs: Sequence[Msg]) -> int:
    """The number of steps of a schedule (one more than its largest step)."""
    if isinstance(msgs, MsgTable):
        return 1 + int(msgs.columns()[2].max()) if len(msgs) else 0
    return 1 + max((m.step for m in msgs), default=-1)


def format_schedule(
    msgs: Sequence[Msg], n: int, *, done: Sequence[int] | None = None, max_ranks: int = 8
) -> str:
    """The schedule as a table: one row per step, one column per rank, what each rank sends in that step.

    A cell lists the rank's messages as ``->dst +[lo:hi]`` (the receiver reduces ``[lo:hi]`` into its buffer)
    or ``->dst =[lo:hi]`` (it copies them); a destination range that differs from the source range is shown
    after an arrow. ``done[r]``, when given, is the number of steps rank ``r`` has completed; its later cells
    are marked with ``*`` (what has not happened yet). Only the first ``max_ranks`` ranks are shown.
    """
    shown = list(range(min(n, max_ranks)))
    nsteps = steps(msgs)
    cells: dict[tuple[int, int], list[str]] = {}
    for m in msgs:
        if m.src not in shown:
            continue
        rng = f"[{m.slo}:{m.shi}]" + ("" if (m.dlo, m.dhi) == (m.slo, m.shi) else f"->[{m.dlo}:{m.dhi}]")
        cells.setdefault((m.step, m.src), []).append(f"->{m.dst} {'+' if m.kind == 'reduce' else '='}{rng}")
    header = ["step"] + [f"rank {r}" for r in shown]
    rows = [header]
    for k in range(nsteps):
        row = [str(k)]
        for r in shown:
            text = ", ".join(cells.get((k, r), [])) or "-"
            if done is not None and k >= done[r]:
                text += " *"
            row.append(text)
        rows.append(row)
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    if n > len(shown):
        lines.append(f"({n - len(shown)} more ranks not shown)")
    if done is not None:
        lines.append("* not yet done")
    return "\n".join(lines)
