"""The text nccl-tests prints (``all_reduce_perf``, ``all_gather_perf``, ...) read as measured samples.

nccl-tests prints a header (``# nThread 1 nGpus 8 minBytes ...``, one ``#  Rank  r ... on HOST device d``
line per rank), a column header (``size count type redop root time algbw busbw #wrong`` twice: out-of-place,
then in-place; older versions have no ``root`` or ``redop`` column and an ``error`` column instead of
``#wrong``), one row per size, and ``# Avg bus bandwidth``. Its ``size`` is the whole buffer as simdist counts
it (the all-gather output, the reduce-scatter input); its ``time`` is in microseconds.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from simdist.calibrate.samples import CalibrationError, Sample

#: nccl-tests' binaries and the collective each measures
BINARIES = {
    "all_reduce_perf": "all_reduce",
    "all_gather_perf": "all_gather",
    "reduce_scatter_perf": "reduce_scatter",
    "broadcast_perf": "broadcast",
    "reduce_perf": "reduce",
    "alltoall_perf": "all_to_all",
    "sendrecv_perf": "sendrecv",
    "gather_perf": "gather",
    "scatter_perf": "scatter",
    "hypercube_perf": "hypercube",
}
_BINARY = re.compile(r"\b(" + "|".join(BINARIES) + r")(?:_mpi)?\b")
_RANK = re.compile(r"^#?\s*Rank\s+(\d+)\s+(?:Group\s+\d+\s+)?Pid\s+\d+\s+on\s+(\S+)\s+device", re.IGNORECASE)


@dataclass(frozen=True)
class Table:
    """One nccl-tests run: its collective, ranks, nodes and rows (size in bytes, out-of-place and in-place us)."""

    collective: str
    ranks: int
    nodes: int
    rows: tuple[tuple[int, float | None, float | None, int], ...]


def parse(text: str, source: str = "<text>", collective: str | None = None) -> Table:
    """The run printed in ``text``; ``collective`` names it where the text does not (``all_reduce_perf ...``)."""
    lines = text.splitlines()
    ranks: dict[int, str] = {}
    columns: list[str] | None = None
    rows: list[tuple[int, float | None, float | None, int]] = []
    for number, line in enumerate(lines, 1):
        if m := _RANK.match(line.strip()):
            rank, host = int(m.group(1)), m.group(2)
            if rank in ranks:
                raise CalibrationError(
                    f"{source}:{number}: rank {rank} is listed twice: this is the output of several separate "
                    f"runs (nccl-tests built without MPI, launched by mpirun?), each of its own ranks; give one run"
                )
            ranks[rank] = host
            continue
        stripped = line.strip()
        if stripped.startswith("#"):
            words = stripped.lstrip("#").split()
            if words[:2] == ["size", "count"]:
                columns = words
            continue
        if not stripped or columns is None:
            continue
        row = _row(stripped.split(), columns, f"{source}:{number}")
        if row is not None:
            rows.append(row)
    if columns is None or not rows:
        raise CalibrationError(
            f"{source}: not nccl-tests output: no '#  size  count  type ...' column header followed by rows "
            f"(run e.g. all_reduce_perf -b 8 -e 64M -f 2 -g 8 and give its standard output)"
        )
    if not ranks:
        raise CalibrationError(
            f"{source}: lists no '#  Rank  r ... on HOST device d' lines, so its world size is unknown; give the "
            f"whole output, header included"
        )
    found = sorted({BINARIES[m.group(1)] for m in _BINARY.finditer(text)})
    if collective is None:
        if len(found) != 1:
            raise CalibrationError(
                f"{source}: " + (f"names several nccl-tests ({', '.join(found)}): give one run per file"
                                 if found else "does not say which nccl-tests binary printed it; name the "
                                 "collective (--collective all_reduce, or collective= in Python)")
            )  # fmt: skip
        collective = found[0]
    if sorted(ranks) != list(range(len(ranks))):
        raise CalibrationError(
            f"{source}: its ranks are {sorted(ranks)}, not 0..{len(ranks) - 1}: a partial output?"
        )
    return Table(collective, len(ranks), len(set(ranks.values())), tuple(rows))


def _number(word: str) -> float | None:
    try:
        value = float(word)
    except ValueError:
        return None  # nccl-tests prints N/A where a test has no in-place variant
    return value if math.isfinite(value) else None


def _agrees(size: int, time_text: str, algbw: float) -> bool:
    """Whether ``algbw`` (GB/s) is ``size`` bytes over the time printed as ``time_text`` (us), to its rounding."""
    us = float(time_text)
    half = 0.5 * 10.0 ** -(len(time_text.partition(".")[2]))  # the time is printed rounded to its last digit
    low, high = size / (us + half) / 1e3, size / max(us - half, 1e-9) / 1e3
    return low * 0.99 - 0.01 <= algbw <= high * 1.01 + 0.01


def _row(
    words: list[str], columns: list[str], where: str
) -> tuple[int, float | None, float | None, int] | None:
    """(bytes, out-of-place us, in-place us, line) of a data row; None for a line that is not one."""
    if len(words) < 3 or not words[0].isdigit():
        return None  # an NCCL INFO or WARN line interleaved with the table
    if len(words) != len(columns):
        raise CalibrationError(
            f"{where}: {len(words)} columns where the header names {len(columns)} ({' '.join(columns)}); "
            f"the output is cut or two outputs are mixed"
        )
    times = [i for i, c in enumerate(columns) if c == "time"]
    if len(times) != 2:
        raise CalibrationError(f"{where}: the header names {len(times)} time columns; nccl-tests prints two")
    size = int(words[0])
    for t in times:
        us, algbw = _number(words[t]), _number(words[t + 1])
        # nccl-tests prints algbw = size / time (GB/s, 2 decimals): a row where it does not is not read right
        if us and algbw and algbw >= 0.1 and not _agrees(size, words[t], algbw):
            raise CalibrationError(
                f"{where}: size {size} B in {us} us is {size / us / 1e3:.3g} GB/s but the row's algbw is {algbw}; "
                f"the columns are not nccl-tests' size, time and algbw (an edited or foreign table?)"
            )
    line = int(where.rsplit(":", 1)[1])
    return size, _number(words[times[0]]), _number(words[times[1]]), line


def samples(table: Table, source: str, in_place: bool = False) -> list[Sample]:
    """The table's rows as samples (out-of-place times, or in-place with ``in_place``)."""
    out = []
    for size, oop, ip, line in table.rows:
        t = ip if in_place else oop
        if t is None:
            continue
        out.append(Sample(table.collective, size, table.ranks, t * 1e-6, f"{source}:{line}", table.nodes))
    return out


def read(
    text: str, source: str = "<text>", collective: str | None = None, in_place: bool = False
) -> list[Sample]:
    """The samples of the nccl-tests run printed in ``text``."""
    return samples(parse(text, source, collective), source, in_place)
