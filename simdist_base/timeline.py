"""A real run's timeline: each rank's collectives and sends/recvs with their times, put on one clock.

Rank processes write one file each (``rank<R>.timeline.json``, times in seconds of the host's monotonic clock,
``CLOCK_MONOTONIC``, which every process of one host shares); :func:`load` reads a directory of them and puts
every rank on one time scale whose zero is the moment the first rank entered its rank code (where a
simulated run's time 0 lies). Ranks on several hosts have no common monotonic clock: their times are then
converted to each host's wall clock (``CLOCK_REALTIME``, read beside the monotonic one when the rank code
began), which assumes the hosts' clocks are synchronised (NTP keeps them within about a millisecond, PTP
within microseconds); :attr:`Timeline.clock` says which was used.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from simdist_base.errors import SimdistError

#: the version of the file format below; a file of another version is refused
FORMAT = 1
#: the clocks a timeline can be on
SAME_HOST, WALL = "monotonic", "wall"
#: how a record's end was observed: the work's future completed (gloo's worker thread finished, or for CUDA
#: tensors the device reached the end of the op), a ``wait()`` on it returned (works without a future: gloo's
#: sends and receives), or never (the rank code ended without waiting)
BY_FUTURE, BY_WAIT, UNOBSERVED = "completed", "waited", "unobserved"


class TimelineError(SimdistError):
    """A timeline directory or file that cannot be read: missing, of another format, or inconsistent."""


@dataclass(frozen=True)
class CommRecord:
    """One collective or point-to-point operation one rank issued (times in seconds, sizes in bytes).

    ``op`` is the name simdist's trace gives it (``all_reduce``, ``all_gather_into_tensor``, ``send``, ...);
    ``index`` its place in the rank's issue order; ``group`` the process group's name and ``group_ranks`` its
    global ranks; ``peer`` the other global rank of a send or receive. ``start`` is when the rank's host issued
    it (or, for CUDA tensors, when the issuing stream reached it); ``end`` when it was seen complete, as
    ``completion`` says; None where it never was.
    """

    rank: int
    index: int
    op: str
    group: str
    group_ranks: tuple[int, ...]
    nbytes: int
    dtype: str
    site: str
    start: float
    end: float | None
    completion: str
    peer: int | None = None

    @property
    def duration(self) -> float | None:
        """Seconds from issue to completion, or None where the completion was not observed."""
        return None if self.end is None else self.end - self.start


@dataclass
class RankTimeline:
    """One rank's records as its process wrote them (times on its host's monotonic clock)."""

    rank: int
    host: str
    #: monotonic seconds when the rank code began, and the wall clock minus the monotonic one at that moment
    origin: float
    wall_offset: float
    records: list[CommRecord] = field(default_factory=list)
    #: the torch profiler trace (Kineto JSON) written beside it, if one was asked for
    profile: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The file's content."""
        return {
            "format": FORMAT, "rank": self.rank, "host": self.host, "origin": self.origin,
            "wall_offset": self.wall_offset, "profile": self.profile,
            "records": [asdict(r) for r in self.records],
        }  # fmt: skip

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str) -> RankTimeline:
        """A rank's timeline from its file's content; TimelineError naming ``where`` if it is not one."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise TimelineError(f"{where}: not a real timeline of format {FORMAT} (found format {found!r})")
        try:
            records = [CommRecord(**{**r, "group_ranks": tuple(r["group_ranks"])}) for r in data["records"]]
            return cls(int(data["rank"]), str(data["host"]), float(data["origin"]), float(data["wall_offset"]),
                       records, data.get("profile"))  # fmt: skip
        except (KeyError, TypeError, ValueError) as e:
            raise TimelineError(
                f"{where}: a real timeline file with a missing or malformed field ({e})"
            ) from e


def file_name(rank: int) -> str:
    """The name of ``rank``'s timeline file in a run's timeline directory."""
    return f"rank{rank}.timeline.json"


def write(timeline: RankTimeline, directory: str | Path) -> Path:
    """Write ``timeline`` to its file in ``directory`` (written whole, then renamed into place)."""
    path = Path(directory) / file_name(timeline.rank)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(timeline.to_json()))
    os.replace(tmp, path)
    return path


def clear(directory: str | Path) -> None:
    """Remove the timeline and profiler files an earlier run left in ``directory``, so a run with fewer ranks
    does not leave another's beside its own."""
    root = Path(directory)
    for pattern in ("rank*.timeline.json", "rank*.trace.json"):
        for path in root.glob(pattern):
            path.unlink(missing_ok=True)


@dataclass
class Timeline:
    """Every rank's records of one real run on one time scale: seconds since the first rank's code began."""

    records: dict[int, list[CommRecord]]
    #: :data:`SAME_HOST` (one host's monotonic clock) or :data:`WALL` (each host's wall clock)
    clock: str
    hosts: dict[int, str]
    #: each rank's profiler trace file, for the ranks that wrote one
    profiles: dict[int, str]
    directory: str = ""

    @property
    def ranks(self) -> list[int]:
        """The ranks that wrote a timeline, in order."""
        return sorted(self.records)

    def describe_clock(self) -> str:
        """What the time scale rests on, for a report."""
        if self.clock == SAME_HOST:
            return "one host's monotonic clock, shared by every rank process"
        return (f"the wall clocks of {len(set(self.hosts.values()))} hosts, assumed synchronised (NTP or PTP): "
                f"an offset between them shifts their ranks' records")  # fmt: skip


def load(directory: str | Path) -> Timeline:
    """Read every rank's timeline file in ``directory`` onto one time scale (see the module's description)."""
    root = Path(directory)
    if not root.is_dir():
        raise TimelineError(f"timeline directory {str(root)!r} does not exist (record one with "
                            f"real.run(..., timeline=DIR) or python -m real --timeline DIR)")  # fmt: skip
    ranks: list[RankTimeline] = []
    for path in sorted(root.glob("rank*.timeline.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise TimelineError(f"{path}: cannot be read as a real timeline ({e})") from e
        ranks.append(RankTimeline.from_json(data, str(path)))
    if not ranks:
        raise TimelineError(f"timeline directory {str(root)!r} holds no rank*.timeline.json file: was the run "
                            f"recorded with timeline=DIR / --timeline DIR, and did its ranks reach their code?")  # fmt: skip
    seen: dict[int, str] = {}
    for t in ranks:
        if t.rank in seen:
            raise TimelineError(f"{root}: rank {t.rank} has two timeline files")
        seen[t.rank] = t.host
    one_host = len(set(seen.values())) == 1
    # One host: the monotonic clock is common to its processes. Several: each host's wall clock.
    shift = {t.rank: (0.0 if one_host else t.wall_offset) for t in ranks}
    zero = min(t.origin + shift[t.rank] for t in ranks)
    records = {
        t.rank: [_shifted(r, shift[t.rank] - zero) for r in sorted(t.records, key=lambda r: r.index)]
        for t in ranks
    }
    profiles = {t.rank: str(root / t.profile) for t in ranks if t.profile}
    return Timeline(records, SAME_HOST if one_host else WALL, seen, profiles, str(root))


def _shifted(record: CommRecord, by: float) -> CommRecord:
    """``record`` with its times moved by ``by`` seconds."""
    end = None if record.end is None else record.end + by
    return CommRecord(**{**asdict(record), "group_ranks": record.group_ranks, "start": record.start + by,
                         "end": end})  # fmt: skip
