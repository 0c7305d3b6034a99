"""A perturbation: a small JSON value that changes the choices a run leaves open, and nothing else.

A run without one is exactly the unperturbed run. With one, these scheduling points are drawn from it:

- ``ties``: the order of events due at the same simulated time and simpy priority (message arrivals, work
  completions, ranks waking up): ``"fifo"`` keeps simpy's insertion order, ``"random"`` draws one,
  ``"pct"`` follows PCT's priorities (see :mod:`simdist.clock.schedule`), ``"choices"`` replays explicit
  decisions (an exhaustive search's, then insertion order; with ``wrap``, a choice past the tied agents counts
  round them, as a drawn schedule needs);
- ``latency``: every message's latency is stretched by a factor drawn from ``[1, 1 + latency]``;
- ``compute``: every op's compute time is stretched by a factor drawn from ``[1, 1 + compute]``;
- ``callbacks``: completions posted to a rank's ``then()`` callback thread at the same simulated time run
  in a drawn order (torch does not order callbacks of different futures).

gloo-like workers (``progress="gloo"``) are ordered through these: each operation's messages and completions
are events, so the tie order and the latency jitter decide how concurrent operations interleave.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any

from simdist.errors import RunArgumentError

#: how ties between events due at the same time are broken
TIE_MODES = ("fifo", "random", "pct", "choices")

#: the version of the JSON form :meth:`Perturbation.to_json` writes
FORMAT = 1


@dataclass(frozen=True)
class Perturbation:
    """The choices a perturbed run takes; every field is JSON-able. See the module's docstring."""

    #: the seed every draw of the run's perturbation derives from (independent of the run's own seed)
    seed: int = 0
    ties: str = "random"
    #: with ``ties="choices"``: the option taken at each tie with several agents (an index into the tied
    #: agents in insertion order); insertion order once they run out
    choices: tuple[int, ...] = ()
    #: with ``ties="choices"``: a choice past the agents tied at its decision counts round them (``c % agents``)
    #: instead of being an error; what a schedule drawn before the run (``simdist.testing.perturbations``) needs,
    #: since how many agents each decision has is only known as the run meets it
    wrap: bool = False
    #: with ``ties="pct"``: the bug depth d the run is drawn for (d - 1 priority change points)
    depth: int = 2
    #: with ``ties="pct"``: how many ties with several agents the run is expected to meet (PCT's k)
    steps: int = 1
    #: relative latency jitter: each message's latency times a factor from [1, 1 + latency]
    latency: float = 0.0
    #: relative compute jitter: each op's time times a factor from [1, 1 + compute]
    compute: float = 0.0
    #: draw the order of ``then()`` callbacks that become due together on one rank
    callbacks: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise RunArgumentError(f"perturbation seed must be an int, got {self.seed!r:.40}")
        if self.ties not in TIE_MODES:
            raise RunArgumentError(f"perturbation ties must be one of {TIE_MODES}, got {self.ties!r:.40}")
        choices = tuple(self.choices) if isinstance(self.choices, (list, tuple)) else None
        if choices is None or not all(
            isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in choices
        ):
            raise RunArgumentError(
                f"perturbation choices must be a list of whole numbers >= 0, got {self.choices!r:.60}"
            )
        object.__setattr__(self, "choices", choices)
        for name in ("depth", "steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise RunArgumentError(f"perturbation {name} must be an int >= 1, got {value!r:.40}")
        for name in ("latency", "compute"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not 0 <= value < float("inf")
            ):
                raise RunArgumentError(
                    f"perturbation {name} jitter must be a finite number >= 0 (0.2: up to 20% longer), got {value!r:.40}"
                )
            object.__setattr__(self, name, float(value))
        if not isinstance(self.wrap, bool):
            raise RunArgumentError(f"perturbation wrap must be True or False, got {self.wrap!r:.40}")
        if not isinstance(self.callbacks, bool):
            raise RunArgumentError(
                f"perturbation callbacks must be True or False, got {self.callbacks!r:.40}"
            )

    def rng(self, point: str) -> random.Random:
        """The generator of one scheduling point: each point draws from its own stream, so turning one point on
        or off leaves the others' draws as they were. String seeds hash the same in every process."""
        return random.Random(f"{self.seed}:{point}")

    def to_json(self) -> dict[str, Any]:
        """This perturbation as a JSON object (:meth:`from_json` reads it back)."""
        out = dataclasses.asdict(self)
        out["choices"] = list(self.choices)
        out["format"] = FORMAT
        return out

    @classmethod
    def from_json(cls, data: Any) -> Perturbation:
        """The perturbation :meth:`to_json` wrote; a clear error for anything else."""
        if not isinstance(data, dict):
            raise RunArgumentError(f"a perturbation is a JSON object, got {type(data).__name__}")
        data = dict(data)
        version = data.pop("format", FORMAT)
        if version != FORMAT:
            raise RunArgumentError(f"perturbation format {version!r} is not this simdist's ({FORMAT})")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise RunArgumentError(
                f"perturbation has unknown fields {unknown}; expected some of {sorted(names)}"
            )
        return cls(**data)
