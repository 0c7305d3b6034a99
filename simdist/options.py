"""A run's options, validated once: the vocabularies every layer, the command line and ``real`` share.

``simdist.run(fn, cluster, **options)`` keeps its keywords; they become one frozen :class:`RunOptions` that the
runner, the communication layer, the oracle and the command line read. Each field is checked for its type
and range where the options are made, so a wrong value is refused with a message naming the option, never
taken for something else (``memory="off"`` is not true).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from simdist.compute.profile import Profile
from simdist.errors import RunArgumentError
from simdist.faults.plan import as_faults
from simdist.faults.specs import Fault

#: backend progress semantics: "nccl" runs a group's collectives one after another on one stream per
#: (rank, group); "gloo" runs them on a pool of threads per (rank, group), so independent async
#: operations overlap (ProcessGroupGloo's default pool has 2 threads)
PROGRESS_MODES = ("nccl", "gloo")
#: how collectives are timed: "alpha-beta" prices each message of the algorithm's schedule on the links it
#: crosses; "nccl" times the whole call as NCCL's tuner predicts it (simdist.algorithms.nccl); "gloo" prices
#: messages as "alpha-beta" does, with the algorithms torch's gloo backend runs (simdist.comm.selection)
COLLECTIVE_MODELS = ("alpha-beta", "nccl", "gloo")
#: the in-flight buffer race detector: raise at the first race, warn about each distinct race, check nothing
RACE_MODES = ("error", "warn", "off")
#: the names a run may present to rank code as its backend (``dist.get_backend()``)
BACKEND_NAMES = ("simdist", "gloo", "nccl")
#: ``"messages"`` records every message; ``"collectives"`` only compute spans and collectives
TRACE_LEVELS = ("messages", "collectives")
#: what tensors on the simulated GPUs hold: "real" values, or "fake" (shapes and dtypes only: a timing-only run,
#: collectives timed but carrying nothing, memory accounted by size, no check that reads values)
TENSOR_MODES = ("real", "fake")
#: how the backward roots of all ranks combine into a step's loss in the equivalence oracle (None: not compared)
LOSS_MODES = ("mean", "sum", "accumulated", None)

#: the seeds torch.manual_seed accepts (negative ones are taken modulo 2**64)
SEEDS = range(-(2**63), 2**64)
#: threads per (rank, group) under gloo-like progress
GLOO_THREADS = range(1, 1025)

#: watchdog defaults (wall-clock seconds one rank may run without communicating): under pytest a stuck test
#: should fail well before pytest-timeout's 300 s; interactively, long CPU work (loading data) is legitimate
WATCHDOG_PYTEST = 60.0
WATCHDOG_INTERACTIVE = 600.0


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _one_of(name: str, value: Any, choices: Sequence[Any]) -> None:
    # `in` would accept 1 for True and equal objects of other types: compare types too
    if not any(type(value) is type(c) and value == c for c in choices):
        raise RunArgumentError(f"{name} must be one of {tuple(choices)}, got {value!r:.60}")


def _flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise RunArgumentError(f"{name} must be True or False, got {type(value).__name__} {value!r:.60}")


@dataclass(frozen=True)
class RunOptions:
    """What ``simdist.run`` does besides running the function: the keywords of :func:`simdist.run`.

    ``races=None`` and ``watchdog=None`` mean "the environment's default"; :meth:`resolved` fills them in.
    """

    seed: int = 0
    progress: str = "nccl"
    gloo_threads: int = 2
    races: str | None = None
    race_waivers: tuple[str, ...] = ()
    trace: str = "messages"
    #: charge tensor ops simulated time (False: none); a :class:`~simdist.compute.profile.Profile` charges its
    #: measured durations, the model pricing what it does not hold
    compute: bool | Profile = True
    copy_args: bool = True
    watchdog: float | None = None
    backend_name: str = "simdist"
    memory: bool = False
    #: what ``sys.argv`` reads in rank code, each rank its own list (None: the process's own, shared)
    argv: tuple[str, ...] | None = None
    #: each rank starts with the default process group made (False: rank code makes it with
    #: ``init_process_group``, as a process torchrun starts does)
    default_group: bool = True
    #: each line rank code writes to ``sys.stdout`` or ``sys.stderr`` starts with ``[rankN]:``, as torch prefixes a rank's traceback
    prefix_output: bool = False
    #: the local ranks whose ``sys.stdout`` and ``sys.stderr`` are shown (torchrun's ``--local-ranks-filter``;
    #: None: every rank's)
    local_ranks_filter: tuple[int, ...] | None = None
    #: the faults the run meets (``simdist.faults``); empty: none, exactly the run without the option
    faults: tuple[Fault, ...] = ()
    #: every rank runs the same program on same-shaped data: simulate a few ranks and price collectives for the
    #: whole world (``simdist.comm.symmetry``; docs/symmetry.md states when that is sound)
    symmetric: bool = False
    #: what tensors on the simulated GPUs hold (``TENSOR_MODES``)
    tensors: str = "real"

    def __post_init__(self) -> None:
        if not _is_int(self.seed) or self.seed not in SEEDS:
            raise RunArgumentError(
                f"seed must be an int from -2**63 to 2**64 - 1 (what torch.manual_seed accepts), got {self.seed!r:.40}"
            )
        _one_of("progress", self.progress, PROGRESS_MODES)
        if not _is_int(self.gloo_threads) or self.gloo_threads not in GLOO_THREADS:
            raise RunArgumentError(
                f"gloo_threads must be an int from 1 to 1024 (gloo threads per process group), got {self.gloo_threads!r:.40}"
            )
        if self.races is not None:
            _one_of("races", self.races, RACE_MODES)
        object.__setattr__(self, "race_waivers", _waiver_texts(self.race_waivers))
        _one_of("trace", self.trace, TRACE_LEVELS)
        if not isinstance(self.compute, (bool, Profile)):
            raise RunArgumentError(
                f"compute must be True, False or simdist.profile(PATH), got {type(self.compute).__name__} "
                f"{self.compute!r:.60}"
            )
        _flag("copy_args", self.copy_args)
        if self.watchdog is not None:
            object.__setattr__(self, "watchdog", _positive_seconds("watchdog", self.watchdog))
        _one_of("backend_name", self.backend_name, BACKEND_NAMES)
        _flag("memory", self.memory)
        if self.argv is not None:
            object.__setattr__(self, "argv", _argv(self.argv))
        _flag("default_group", self.default_group)
        _flag("prefix_output", self.prefix_output)
        if self.local_ranks_filter is not None:
            object.__setattr__(self, "local_ranks_filter", _local_ranks(self.local_ranks_filter))
        object.__setattr__(self, "faults", as_faults(self.faults))
        _flag("symmetric", self.symmetric)
        _one_of("tensors", self.tensors, TENSOR_MODES)
        if self.tensors == "fake" and self.races not in (None, "off"):
            raise RunArgumentError(
                f'races={self.races!r} with tensors="fake": the race detector watches the memory of buffers in flight, '
                'and a timing-only run\'s tensors have none; leave races unset (it is off in this mode) or pass "off"'
            )

    @classmethod
    def from_keywords(
        cls, race_waivers: Sequence[str] | None = None, faults: Sequence[Any] | None = None, **options: Any
    ) -> RunOptions:
        """The options of ``simdist.run(..., **options)`` (``race_waivers=None`` and ``faults=None`` are none)."""
        return cls(
            race_waivers=() if race_waivers is None else race_waivers,  # type: ignore[arg-type]
            faults=as_faults(faults),
            **options,
        )

    def resolved(self) -> RunOptions:
        """These options with the environment's defaults filled in (``races``, ``watchdog``)."""
        races = self.races or ("off" if self.tensors == "fake" else default_race_mode())
        return dataclasses.replace(self, races=races, watchdog=watchdog_limit(self.watchdog))

    def keywords(self) -> dict[str, Any]:
        """The ``simdist.run`` keywords that give these options."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def _waiver_texts(waivers: Any) -> tuple[str, ...]:
    """``race_waivers`` as a tuple of pattern strings (their syntax is checked where they are parsed, at the run)."""
    if isinstance(waivers, str):
        raise RunArgumentError(
            f"race_waivers must be a list of site patterns, got the string {waivers!r}; write race_waivers=[{waivers!r}]"
        )
    if not isinstance(waivers, (list, tuple)):
        raise RunArgumentError(
            f"race_waivers must be a list of site patterns (strings), got {type(waivers).__name__}"
        )
    for i, w in enumerate(waivers):
        if not isinstance(w, str):
            raise RunArgumentError(
                f"race_waivers[{i}] must be a site pattern string (PATH[:LINE][:FUNCTION]), got {type(w).__name__} "
                f"{w!r:.60}"
            )
    return tuple(waivers)


def _argv(argv: Any) -> tuple[str, ...]:
    """``argv`` as a tuple of strings, as ``sys.argv`` holds them."""
    if isinstance(argv, (str, bytes)) or not isinstance(argv, (list, tuple)):
        raise RunArgumentError(
            f"argv must be a list of strings (what sys.argv reads in rank code, the program's name first), got "
            f"{type(argv).__name__} {argv!r:.60}"
        )
    for i, a in enumerate(argv):
        if not isinstance(a, str):
            raise RunArgumentError(
                f"argv[{i}] must be a string, as every item of sys.argv is; got {type(a).__name__} {a!r:.60}"
            )
    return tuple(argv)


def _local_ranks(ranks: Any) -> tuple[int, ...]:
    """``local_ranks_filter`` as sorted distinct local ranks (whole numbers >= 0; none: no rank's output shown)."""
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, (list, tuple, set, frozenset)):
        raise RunArgumentError(
            f"local_ranks_filter must be a list of local ranks (whole numbers >= 0) whose output is shown, or None for "
            f"every rank's; got {type(ranks).__name__} {ranks!r:.60}"
        )
    if not all(_is_int(r) and r >= 0 for r in ranks):
        raise RunArgumentError(
            f"local_ranks_filter must name local ranks, each a whole number >= 0 (an empty list hides every rank's "
            f"output); got {sorted(ranks, key=repr)!r:.60}"
        )
    return tuple(sorted(set(ranks)))


def _positive_seconds(source: str, value: Any) -> float:
    try:
        limit = float(value)
    except (TypeError, ValueError):
        limit = math.nan
    if isinstance(value, bool) or not limit > 0:
        raise RunArgumentError(
            f"{source}={value!r:.60}: expected a positive number of wall-clock seconds (or inf to turn it off)"
        )
    return limit


def under_pytest() -> bool:
    """Whether this process is inside a pytest test (stricter defaults: errors, short watchdog)."""
    return "PYTEST_CURRENT_TEST" in os.environ


def default_race_mode() -> str:
    """``$SIMDIST_RACES`` if set, else ``"error"`` inside a pytest test, else ``"warn"``."""
    mode = os.environ.get("SIMDIST_RACES")
    if mode:
        if mode not in RACE_MODES:
            raise RunArgumentError(f"$SIMDIST_RACES must be one of {RACE_MODES}, got {mode!r:.60}")
        return mode
    return "error" if under_pytest() else "warn"


def watchdog_limit(watchdog: float | None) -> float:
    """The watchdog limit in wall-clock seconds: ``watchdog``, else ``$SIMDIST_WATCHDOG``, else the default."""
    if watchdog is not None:
        return _positive_seconds("watchdog", watchdog)
    if os.environ.get("SIMDIST_WATCHDOG"):
        return _positive_seconds("$SIMDIST_WATCHDOG", os.environ["SIMDIST_WATCHDOG"])
    return WATCHDOG_PYTEST if under_pytest() else WATCHDOG_INTERACTIVE


#: how hand-written shards of a plain tensor are laid out: (dim, holders per shard group or None for all)
ShardSpec = tuple[int, "int | None"]


@dataclass(frozen=True)
class OracleOptions:
    """How the equivalence oracle compares a parallel run with its reference (see ``simdist.check_equivalence``).

    ``simdist.check_equivalence`` and ``real.oracle.check_final_state`` take these as keywords; both build one
    and refuse the same wrong values with the same messages.
    """

    steps: int | None = None
    exact: bool = False
    #: torch dtype -> ``simdist.oracle.Tolerance`` overriding the default tolerance of that dtype
    tolerances: Mapping[Any, Any] = dataclasses.field(default_factory=dict)
    #: parallel name -> reference name (fnmatch patterns), or a function mapping one name (None: leave it out)
    names: Mapping[str, str] | Callable[[str], str | None] | None = None
    ignore: tuple[str, ...] = ()
    #: pattern -> dim, or (dim, ranks per shard group); normalised to (dim, size or None)
    shards: Mapping[str, ShardSpec] = dataclasses.field(default_factory=dict)
    loss: str | None = "mean"
    localize: bool = True

    def __post_init__(self) -> None:
        if self.steps is not None and (not _is_int(self.steps) or self.steps < 1):
            raise RunArgumentError(
                f"steps must be a positive int (or None for every step), got {self.steps!r:.60}"
            )
        _flag("exact", self.exact)
        _flag("localize", self.localize)
        _one_of("loss", self.loss, LOSS_MODES)
        tolerances = {} if self.tolerances is None else self.tolerances
        if not isinstance(tolerances, Mapping) or not all(isinstance(k, torch.dtype) for k in tolerances):
            raise RunArgumentError(
                f"tolerances must map torch dtypes to simdist.oracle.Tolerance, got {tolerances!r:.80}"
            )
        object.__setattr__(self, "tolerances", dict(tolerances))
        if self.names is not None and not isinstance(self.names, Mapping) and not callable(self.names):
            raise RunArgumentError(
                f"names must map parallel names to reference names (a dict of fnmatch patterns) or be a function of a "
                f"name, got {type(self.names).__name__}"
            )
        ignore = self.ignore
        if (
            isinstance(ignore, str)
            or not isinstance(ignore, (list, tuple))
            or not all(isinstance(p, str) for p in ignore)
        ):
            raise RunArgumentError(f"ignore must be a list of fnmatch patterns (strings), got {ignore!r:.60}")
        object.__setattr__(self, "ignore", tuple(ignore))
        object.__setattr__(self, "shards", _shard_specs(self.shards))


def _shard_specs(shards: Any) -> dict[str, ShardSpec]:
    """``shards`` as the comparison uses it: pattern -> (dim, group size or None), with an error for a bad entry."""
    if shards is None:
        return {}
    if not isinstance(shards, Mapping):
        raise RunArgumentError(
            f"shards must map name patterns to a dim or (dim, ranks per shard group), got {shards!r:.60}"
        )
    out: dict[str, ShardSpec] = {}
    for pattern, spec in shards.items():
        if _is_int(spec):
            out[pattern] = (spec, None)
        elif (
            isinstance(spec, tuple)
            and len(spec) == 2
            and _is_int(spec[0])
            and (spec[1] is None or _is_int(spec[1]) and spec[1] >= 1)
        ):
            out[pattern] = (spec[0], spec[1])
        else:
            raise RunArgumentError(
                f"shards[{pattern!r}] must be a dim (int) or (dim, ranks per shard group), got {spec!r}"
            )
    return out
