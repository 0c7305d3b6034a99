"""The faults a run can meet, as data: frozen records whose fields are JSON values.

A fault is ``{"type": class name, **fields}`` in JSON and ``getattr(simdist.faults, type)(**fields)`` back, so a
replay token or a command line can hold it. Each record checks its own fields (types, signs, windows) where it
is made; what depends on the cluster (a rank, a link, a node) is checked when a run starts.

Times are simulated seconds from the start of the run; a window ``(start, end)`` holds ``start <= t < end``
(``end`` may be ``inf``).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass
from typing import Any, ClassVar

from simdist.errors import FaultSpecError

#: a directed link by its id (``Cluster.links`` index), or a cable by its two ends (ranks are ints, switches
#: names): ``[src, dst]`` names both directions that join them
LinkRef = int | tuple[int | str, int | str]


def _whole(fault: str, name: str, value: Any, low: int = 0) -> int:
    """``value`` as an int of at least ``low``, or a :class:`FaultSpecError` naming the field."""
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        raise FaultSpecError(
            f"{fault}: {name} must be a whole number, got {type(value).__name__} {value!r:.40}"
        ) from None
    if number < low:
        raise FaultSpecError(f"{fault}: {name} must be at least {low}, got {number}")
    return number


def _seconds(fault: str, name: str, value: Any, *, positive: bool = False, infinite: bool = False) -> float:
    """``value`` as simulated seconds (>= 0, or > 0 with ``positive``; ``inf`` only with ``infinite``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FaultSpecError(
            f"{fault}: {name} must be a number of simulated seconds, got {type(value).__name__} {value!r:.40}"
        )
    seconds = float(value)
    if (
        math.isnan(seconds)
        or seconds < 0
        or (positive and seconds == 0)
        or (math.isinf(seconds) and not infinite)
    ):
        expected = "a positive" if positive else "a non-negative"
        raise FaultSpecError(
            f"{fault}: {name} must be {expected} finite number of simulated seconds, got {value!r}"
        )
    return seconds


def _factor(fault: str, name: str, value: Any, *, at_least_one: bool = False) -> float:
    """``value`` as a positive finite factor (at least 1 with ``at_least_one``)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise FaultSpecError(f"{fault}: {name} must be a positive finite number, got {value!r:.40}")
    if at_least_one and value < 1:
        raise FaultSpecError(
            f"{fault}: {name} must be at least 1 (a slowdown of {value} would speed the rank up), got {value!r}"
        )
    return float(value)


def _window(fault: str, value: Any) -> tuple[float, float] | None:
    """``value`` as a window ``(start, end)`` with ``0 <= start < end`` (``end`` may be inf), or None."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or len(value) != 2:
        raise FaultSpecError(
            f"{fault}: window must be (start, end) in simulated seconds, or None for the whole run; got {value!r:.60}"
        )
    start = _seconds(fault, "window start", value[0])
    end = _seconds(fault, "window end", value[1], infinite=True)
    if end <= start:
        raise FaultSpecError(f"{fault}: window {value!r} ends before it starts: expected start < end")
    return (start, end)


def _ranks(fault: str, name: str, value: Any) -> tuple[int, ...]:
    """One rank or a list of ranks, as a sorted tuple of distinct ranks (at least one)."""
    items = value if isinstance(value, (list, tuple)) else [value]
    if not items:
        raise FaultSpecError(f"{fault}: {name} must name at least one rank")
    return tuple(sorted({_whole(fault, name, r) for r in items}))


def _link(fault: str, value: Any) -> LinkRef:
    """A link id, or a cable's two ends."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or not all(isinstance(v, (int, str)) and not isinstance(v, bool) for v in value):
            raise FaultSpecError(
                f"{fault}: link must be a link id (int) or the two ends of a cable [src, dst] (ranks as ints, "
                f"switches by name), got {value!r:.60}"
            )
        return (value[0], value[1])
    return _whole(fault, "link", value)


def in_window(window: tuple[float, float] | None, t: float) -> bool:
    """Whether simulated time ``t`` lies in ``window`` (None: the whole run)."""
    return window is None or window[0] <= t < window[1]


class Fault:
    """What every fault record shares: its JSON form."""

    #: the class names a replay token may hold, and their classes (the records below; a subclass made
    #: elsewhere is not among them: the simulator would not know what it does)
    TYPES: ClassVar[dict[str, type[Fault]]] = {}

    def to_json(self) -> dict[str, Any]:
        """``{"type": class name, **fields}``, with tuples as lists (what ``json.dumps`` writes)."""
        out: dict[str, Any] = {"type": type(self).__name__}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            out[f.name] = _plain(getattr(self, f.name))
        return out


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def from_json(data: Any) -> Fault:
    """The fault ``data`` (``{"type": ..., **fields}``, as :meth:`Fault.to_json` writes it) describes."""
    if not isinstance(data, dict) or not isinstance(data.get("type"), str):
        raise FaultSpecError(f"a fault must be a mapping with a 'type' naming its class, got {data!r:.80}")
    cls = Fault.TYPES.get(data["type"])
    if cls is None:
        raise FaultSpecError(
            f"unknown fault type {data['type']!r}; the faults are {', '.join(sorted(Fault.TYPES))}"
        )
    fields = {k: v for k, v in data.items() if k != "type"}
    try:
        return cls(**fields)
    except TypeError as e:
        names = ", ".join(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]
        raise FaultSpecError(f"{data['type']}: {e}; its fields are {names}") from None


@dataclass(frozen=True, repr=False)
class Crash(Fault):
    """Rank ``rank``'s process dies: at simulated time ``at``, or as it issues its ``collective``-th collective
    (counting from 1, over all its groups). Exactly one of the two is given."""

    rank: int
    at: float | None = None
    collective: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "rank", _whole("Crash", "rank", self.rank))
        if (self.at is None) == (self.collective is None):
            raise FaultSpecError(
                f"Crash(rank={self.rank}): give exactly one of at= (simulated seconds) or collective= (its k-th "
                f"collective, from 1); got at={self.at!r}, collective={self.collective!r}"
            )
        if self.at is not None:
            object.__setattr__(self, "at", _seconds("Crash", "at", self.at))
        if self.collective is not None:
            object.__setattr__(self, "collective", _whole("Crash", "collective", self.collective, low=1))

    def __repr__(self) -> str:
        when = f"at={self.at!r}" if self.at is not None else f"collective={self.collective!r}"
        return f"Crash(rank={self.rank!r}, {when})"


@dataclass(frozen=True)
class Straggler(Fault):
    """The compute of ``rank`` (one rank or a list) takes ``slowdown`` times as long, for ops that start inside
    ``window`` (None: the whole run)."""

    rank: int | tuple[int, ...]
    slowdown: float
    window: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "rank", _ranks("Straggler", "rank", self.rank))
        object.__setattr__(
            self, "slowdown", _factor("Straggler", "slowdown", self.slowdown, at_least_one=True)
        )
        object.__setattr__(self, "window", _window("Straggler", self.window))


@dataclass(frozen=True)
class SlowLink(Fault):
    """``link`` carries ``bandwidth_factor`` times its bandwidth and adds ``latency`` seconds, for transfers that
    start inside ``window``."""

    link: LinkRef
    bandwidth_factor: float = 1.0
    latency: float = 0.0
    window: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "link", _link("SlowLink", self.link))
        object.__setattr__(
            self, "bandwidth_factor", _factor("SlowLink", "bandwidth_factor", self.bandwidth_factor)
        )
        object.__setattr__(self, "latency", _seconds("SlowLink", "latency", self.latency))
        object.__setattr__(self, "window", _window("SlowLink", self.window))


@dataclass(frozen=True)
class FlappingLink(Fault):
    """``link`` goes down for ``down`` seconds at the start of every ``period`` inside ``window``: a transfer that
    would start while it is down waits until it is up again (the link's retries)."""

    link: LinkRef
    period: float
    down: float
    window: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "link", _link("FlappingLink", self.link))
        object.__setattr__(self, "period", _seconds("FlappingLink", "period", self.period, positive=True))
        object.__setattr__(self, "down", _seconds("FlappingLink", "down", self.down, positive=True))
        if self.down >= self.period:
            raise FaultSpecError(
                f"FlappingLink: down {self.down!r} s must be shorter than period {self.period!r} s (a link down for a "
                f"whole period never comes up: use LinkDown)"
            )
        object.__setattr__(self, "window", _window("FlappingLink", self.window))

    def up_at(self, t: float) -> float:
        """The first simulated time at or after ``t`` at which the link is up."""
        if not in_window(self.window, t):
            return t
        origin = self.window[0] if self.window is not None else 0.0
        phase = (t - origin) % self.period
        if phase >= self.down:
            return t
        up = t - phase + self.down
        return up if self.window is None else min(up, self.window[1])


@dataclass(frozen=True)
class MessageDelay(Fault):
    """Messages from ``src`` ranks to ``dst`` ranks sent inside ``window`` arrive ``delay`` seconds later."""

    src: int | tuple[int, ...]
    dst: int | tuple[int, ...]
    delay: float
    window: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "src", _ranks("MessageDelay", "src", self.src))
        object.__setattr__(self, "dst", _ranks("MessageDelay", "dst", self.dst))
        object.__setattr__(self, "delay", _seconds("MessageDelay", "delay", self.delay, positive=True))
        object.__setattr__(self, "window", _window("MessageDelay", self.window))


@dataclass(frozen=True)
class LinkDown(Fault):
    """``link`` fails at simulated time ``at`` and stays down: later transfers route around it where the
    cluster has another route, else the operation sending over it fails."""

    link: LinkRef
    at: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "link", _link("LinkDown", self.link))
        object.__setattr__(self, "at", _seconds("LinkDown", "at", self.at))


@dataclass(frozen=True)
class NodeLoss(Fault):
    """Node ``node`` (ranks ``node x ranks_per_node ...``) is lost at simulated time ``at``: every rank of it
    crashes and every link to or from it (its ranks and its switches) goes down."""

    node: int
    at: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "node", _whole("NodeLoss", "node", self.node))
        object.__setattr__(self, "at", _seconds("NodeLoss", "at", self.at))


Fault.TYPES.update(
    {cls.__name__: cls for cls in (Crash, Straggler, SlowLink, FlappingLink, MessageDelay, LinkDown, NodeLoss)}
)
