"""``simdist.explore`` and ``simdist.replay``."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from multiprocessing import get_context
from typing import Any

from simdist.clock.perturbation import Perturbation
from simdist.engine.runner import Observed, RunResult, run_observed
from simdist.explore import engines, exhaustive, token
from simdist.explore.errors import ExplorationError, ReplayWarning, SearchSpaceError
from simdist.explore.exploration import Exploration, Failure
from simdist.explore.program import Program, code_hash
from simdist.explore.progress import ProgressBar
from simdist.explore.runs import Outcome, Task, execute, run_task, verify
from simdist.explore.target import Target, fields_json, refuse
from simdist.network.cluster import Cluster
from simdist.options import RunOptions

#: the search strategies
STRATEGIES = ("random", "pct", "exhaustive")
#: the jitter keys (relative: 0.2 stretches each latency or op by up to 20%)
JITTER_KEYS = ("latency", "compute")


@dataclass(frozen=True)
class Settings:
    """How an exploration searches: :func:`explore`'s own keywords, checked once where they are made."""

    runs: int = 100
    strategy: str = "random"
    depth: int = 2
    seed: int = 0
    #: relative jitter per point (``latency``, ``compute``), every key filled in
    jitter: Mapping[str, float] = field(default_factory=dict)
    check: Callable[[RunResult], Any] | None = None
    workers: int = 1
    #: called with each run's outcome as it is found (in the order found), e.g. by a progress bar
    on_run: Callable[[Outcome], None] | None = None
    #: where the runs go: None (this process, or the local pool with ``workers > 1``), or a Dask or Ray cluster
    #: (see :mod:`simdist.explore.engines`)
    engine: Any = None
    #: show a progress bar: None shows it when standard error is a terminal
    progress_bar: bool | None = None

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ExplorationError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r:.40}")
        for name, least in (("runs", 1), ("depth", 1), ("workers", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ExplorationError(f"{name} must be an int >= {least}, got {value!r:.40}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ExplorationError(f"seed must be an int, got {self.seed!r:.40}")
        object.__setattr__(self, "jitter", _jitter(self.jitter))
        if self.strategy == "exhaustive" and any(self.jitter.values()):
            raise ExplorationError(
                f"exhaustive search enumerates tie orders and draws nothing: jitter={dict(self.jitter)} would make "
                "its runs random; leave jitter out, or use strategy='random' or 'pct'"
            )
        for name in ("check", "on_run"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise ExplorationError(
                    f"{name} must be a function of a run's result (or None), got {type(value).__name__}"
                )
        object.__setattr__(self, "engine", engines.resolve(self.engine))
        if self.progress_bar not in (None, True, False):
            raise ExplorationError(
                f"progress_bar must be True, False or None (on a terminal only), got {self.progress_bar!r:.40}"
            )

    @property
    def remote(self) -> bool:
        """Whether runs leave this process, so the program and the check must be loadable by name."""
        return self.workers > 1 or self.engine is not None


def explore(
    fn: Callable[..., Any] | Program | Target,
    cluster: Cluster | str | None = None,
    *,
    runs: int = 100,
    strategy: str = "random",
    depth: int = 2,
    seed: int = 0,
    jitter: Mapping[str, float] | None = None,
    faults: Sequence[Any] = (),
    check: Callable[[RunResult], Any] | None = None,
    workers: int = 1,
    on_run: Callable[[Outcome], None] | None = None,
    engine: Any = None,
    progress_bar: bool | None = None,
    **run_options: Any,
) -> Exploration:
    """Run ``fn`` on ``cluster`` up to ``runs`` times, each under another perturbation, and collect the failures.

    ``strategy``: ``"random"`` (each run's ties drawn from a seeded generator), ``"pct"`` (PCT for bugs of
    ``depth`` ordering constraints), ``"exhaustive"`` (every tie order, with partial-order reduction; a
    :class:`SearchSpaceError` when more than ``runs`` runs are needed). Run 0 of ``random`` and ``pct`` is the
    unperturbed run. ``jitter`` stretches message latencies and op times by random factors up to
    ``1 + jitter[...]`` (random and pct). A run fails when it raises or ``check(result)`` returns False or
    raises; each failure is replayed twice and its traces compared before it is reported. ``workers > 1`` runs
    on a local process pool (``fn`` and ``check`` must be importable by name). ``on_run(outcome)`` is called as
    each run ends. ``engine`` runs them on Dask or Ray instead: a ``distributed.Client``, a scheduler address
    ``"tcp://..."``, ``"ray"`` or ``"ray://..."`` (see :mod:`simdist.explore.engines`). ``progress_bar`` shows
    runs/s, failures and an ETA (default: when standard error is a terminal). ``run_options`` are
    :func:`simdist.run`'s. Ctrl-C returns what was found, marked
    ``interrupted``. ``fn`` may also be a :class:`Program` reference (a script, as ``simdist explore`` passes it),
    or a :class:`~simdist.explore.target.Target`, a simulation other than ``simdist.run`` (no cluster, no run
    options, strategy random; ``check`` receives its ``Ran.value``).
    """
    settings = Settings(
        runs, strategy, depth, seed, {} if jitter is None else jitter, check, workers, on_run,
        engine=engine, progress_bar=progress_bar,
    )
    if faults:
        run_options = {**run_options, "faults": faults}  # a run option: checked with the others, in every run
    if isinstance(fn, Target):
        refuse(fn, settings.strategy, cluster, run_options)
        return _explore(fn, _reference(fn, settings.remote), code_hash(type(fn)), None, settings, {})
    if isinstance(fn, Program):
        with fn.loaded() as (loaded, extra):
            return _explore(loaded, fn.to_json(), fn.code_hash(), cluster, settings, {**run_options, **extra})
    if not callable(fn):
        raise ExplorationError(
            f"explore needs a function every rank runs, got {type(fn).__name__} {fn!r:.60}"
        )
    program = _reference(fn, settings.remote)
    return _explore(fn, program, code_hash(fn), cluster, settings, run_options)


def _explore(
    fn: Callable[..., Any] | Target,
    program: dict[str, Any],
    code: str,
    cluster: Cluster | str | None,
    settings: Settings,
    run_options: dict[str, Any],
) -> Exploration:
    """:func:`explore` once ``fn`` is loaded and its reference and code hash known (a target has no cluster)."""
    if isinstance(cluster, str):
        cluster = Cluster.load(cluster)
    if not isinstance(cluster, Cluster) and not isinstance(fn, Target):
        raise ExplorationError(
            f"explore needs a simdist.Cluster, a preset name or a cluster file; got {type(cluster).__name__}"
        )
    options = RunOptions.from_keywords(**run_options)
    token.options_json(options)  # refuses, before any run, an option a token cannot hold
    check = settings.check
    check_ref = _reference(check, settings.remote) if check is not None else None
    if settings.engine is not None:
        engines.require(settings.engine)
    ex = Exploration(settings.strategy)
    bar = ProgressBar(settings.runs, settings.progress_bar)

    def found(outcome: Outcome) -> None:
        ex.outcomes.append(outcome)
        if outcome.kind is not None and outcome.error is not None:
            replay = token.make(
                perturbation=outcome.perturbation,
                strategy=settings.strategy,
                seed=settings.seed,
                run=outcome.index,
                cluster=cluster,
                options=options,
                faults=[token.fault_json(f) for f in options.faults],
                program=program,
                code=code,
            )
            ex.failures.append(
                Failure(outcome.index, outcome.kind, outcome.error, replay, outcome.trace_hash)
            )
        bar.update(outcome)
        if settings.on_run is not None:
            settings.on_run(outcome)

    try:
        if settings.strategy == "exhaustive":
            for outcome in _exhaustive(fn, cluster, options, check, settings.runs):
                found(outcome)
        else:
            base = _local(fn, cluster, options, check, 0, Perturbation(ties="fifo", callbacks=False))
            found(base)
            plan = [_perturbation(settings, i, base) for i in range(1, settings.runs)]
            if not settings.remote:
                for i, p in enumerate(plan, start=1):
                    found(_local(fn, cluster, options, check, i, p))
            else:
                config = cluster.to_config() if cluster is not None else {}
                tasks = [Task(i, program, check_ref, config, options, p) for i, p in enumerate(plan, 1)]
                if settings.engine is not None:
                    outcomes = engines.run(settings.engine, tasks)
                else:
                    outcomes = _pool(tasks, settings.workers)
                with contextlib.closing(outcomes):  # Ctrl-C cancels the runs still pending
                    for outcome in outcomes:
                        found(outcome)
    except KeyboardInterrupt:
        ex.interrupted = True
    except SearchSpaceError as e:
        e.exploration = ex  # type: ignore[attr-defined]
        raise
    finally:
        bar.close()
    ex.outcomes.sort(key=lambda o: o.index)
    ex.failures.sort(key=lambda f: f.run)
    return ex


def _jitter(jitter: Mapping[str, float] | None) -> dict[str, float]:
    """``jitter`` checked: known keys, finite values >= 0."""
    if jitter is None:
        return {k: 0.0 for k in JITTER_KEYS}
    if not isinstance(jitter, Mapping):
        raise ExplorationError(
            f"jitter must map {JITTER_KEYS} to relative amounts (0.2: up to 20% longer), got {jitter!r:.60}"
        )
    unknown = sorted(set(jitter) - set(JITTER_KEYS))
    if unknown:
        raise ExplorationError(f"jitter has unknown keys {unknown}; expected some of {JITTER_KEYS}")
    out = {}
    for k in JITTER_KEYS:
        v = jitter.get(k, 0.0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
            raise ExplorationError(
                f"jitter[{k!r}] must be a finite number >= 0 (0.2: up to 20% longer), got {v!r:.40}"
            )
        out[k] = float(v)
    return out


def _reference(fn: Callable[..., Any], required: bool) -> dict[str, Any]:
    """``fn``'s reference for tokens and workers: required with workers; else its name as far as it goes."""
    try:
        return Program.of(fn).to_json()
    except ExplorationError:
        if required:
            raise
        if isinstance(fn, Target):
            return {"module": type(fn).__module__, "name": type(fn).__qualname__, "fields": fields_json(fn)}
        return {"module": getattr(fn, "__module__", "") or "", "name": getattr(fn, "__qualname__", repr(fn))}


def _seed(seed: int, index: int) -> int:
    """Run ``index``'s perturbation seed: independent draws for every (seed, run)."""
    return int.from_bytes(hashlib.sha256(f"simdist-explore:{seed}:{index}".encode()).digest()[:8], "big")


def _perturbation(settings: Settings, index: int, base: Outcome) -> Perturbation:
    """Run ``index``'s perturbation; PCT's k is the number of decisions the unperturbed run met."""
    jitter = settings.jitter
    common = {"seed": _seed(settings.seed, index), "latency": jitter["latency"], "compute": jitter["compute"]}
    if settings.strategy == "pct":
        return Perturbation(ties="pct", depth=settings.depth, steps=max(len(base.decisions), 1), **common)
    return Perturbation(ties="random", **common)


def _local(
    fn: Callable[..., Any] | Target,
    cluster: Cluster | None,
    options: RunOptions,
    check: Any,
    index: int,
    p: Perturbation,
) -> Outcome:
    outcome = execute(fn, cluster, options, p, check, index)
    return verify(outcome, fn, cluster, options, check) if outcome.kind is not None else outcome


def _exhaustive(
    fn: Callable[..., Any], cluster: Cluster, options: RunOptions, check: Any, limit: int
) -> Iterator[Outcome]:
    base = Perturbation(ties="choices", callbacks=False)
    index = 0

    def one(chooser: exhaustive.Enumerator) -> Outcome:
        outcome = execute(fn, cluster, options, base, check, index, chooser, exhaustive.Pruned)
        return dataclasses.replace(
            outcome, perturbation=dataclasses.replace(base, choices=tuple(outcome.decisions))
        )

    for outcome in exhaustive.search(one, limit):
        if outcome.kind is not None:
            outcome = verify(outcome, fn, cluster, options, check)
        yield outcome
        index += 1


def _pool(tasks: list[Task], workers: int) -> Iterator[Outcome]:
    """Run ``tasks`` on ``workers`` processes; yields their outcomes as the runs end (so Ctrl-C keeps every run
    that ended).

    The workers fork from a forkserver, a fresh single-threaded process that imported simdist once (forking this
    process, whose rank threads and torch pools may hold locks, would not be safe; spawning imports torch per
    worker)."""
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    if main is not None and not os.path.isfile(main):
        # multiprocessing starts each worker by running __main__'s file again: '<stdin>' is none
        raise ExplorationError(
            f"this program's __main__ is {main!r}, not a file, so worker processes cannot start from it (multiprocessing "
            "runs __main__'s file again in each): save the program to a file and run that, or explore with workers=1"
        )
    context = get_context("forkserver")
    context.set_forkserver_preload(["simdist.explore.runs"])
    pool = ProcessPoolExecutor(max_workers=min(workers, len(tasks)) or 1, mp_context=context)
    try:
        futures = [pool.submit(run_task, t) for t in tasks]
        for fut in as_completed(futures):
            yield fut.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def replay(
    fn: Callable[..., Any] | Program | Target,
    cluster: Cluster | str | None = None,
    replay_token: str | dict[str, Any] | None = None,
    **run_options: Any,
) -> Any:
    """Run again the run ``replay_token`` records (``Exploration.failures[i].replay``) and return its result.

    The run raises what it raised when explored; the exception carries the trace's hash as ``trace_hash``. A
    :class:`ReplayWarning` names what changed since the token was written (the program's code, simdist or
    torch, the cluster). ``run_options`` override the token's (``watchdog=``, ``races=``, ...). ``fn`` may also be
    a :class:`Program` reference (a script), or a :class:`~simdist.explore.target.Target`:
    ``replay(target, token)`` returns its ``Ran`` (the token's fields differing from ``target``'s warn).
    """
    if isinstance(fn, Target):
        return _replay_target(fn, replay_token if replay_token is not None else cluster, run_options)
    if isinstance(fn, Program):
        with fn.loaded() as (loaded, _):
            return _replay(loaded, fn.code_hash(), cluster, replay_token, run_options)
    return _replay(fn, code_hash(fn), cluster, replay_token, run_options)


def _replay(
    fn: Callable[..., Any],
    code: str,
    cluster: Cluster | str,
    replay_token: str | dict[str, Any],
    run_options: dict[str, Any],
) -> RunResult:
    """:func:`replay` once ``fn`` is loaded."""
    data = token.read(replay_token)
    if isinstance(cluster, str):
        cluster = Cluster.load(cluster)
    if not isinstance(cluster, Cluster):
        raise ExplorationError(
            f"replay needs a simdist.Cluster, a preset name or a cluster file; got {type(cluster).__name__}"
        )
    _warn_changed(token.changes(data, code, cluster))
    options = token_options(data, run_options)
    observed = Observed()
    try:
        return run_observed(fn, cluster, options, data["perturbation"], observed)
    except Exception as e:
        e.trace_hash = observed.trace.hash() if observed.trace is not None else ""  # type: ignore[attr-defined]
        raise


def token_options(data: dict[str, Any], run_options: Mapping[str, Any]) -> RunOptions:
    """The run options of a token :func:`token.read` checked, its faults rebuilt, ``run_options`` over them."""
    options: RunOptions = data["options"]
    if data["faults"]:
        namespace = _faults_module()
        options = dataclasses.replace(
            options, faults=tuple(token.fault_from_json(f, namespace) for f in data["faults"])
        )
    if run_options:
        options = dataclasses.replace(options, **run_options)
    return options


def _replay_target(target: Target, replay_token: Any, run_options: dict[str, Any]) -> Any:
    """:func:`replay` of a target's run: the token's perturbation, on ``target``."""
    if run_options:
        raise ExplorationError(
            f"{type(target).__name__} is a Target: replay(target, token) takes no run options ({sorted(run_options)})"
        )
    data = token.read(replay_token)
    changed = token.changes(data, code_hash(type(target)), None)
    recorded = data["program"].get("fields")
    if recorded != fields_json(target):
        changed.append(f"the target's fields differ from the ones recorded ({recorded!r:.80})")
    _warn_changed(changed)
    return target.run(data["perturbation"])


def _faults_module() -> Any:
    try:
        return importlib.import_module("simdist.faults")
    except ImportError:
        raise ExplorationError(
            "the token holds faults, and this build of simdist has no simdist.faults"
        ) from None


def default_workers() -> int:
    """All the cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _warn_changed(changed: list[str]) -> None:
    """Warn the caller of replay (two frames up) that its token was recorded in the ``changed`` conditions."""
    if changed:
        warnings.warn(
            ReplayWarning(
                "replaying a token recorded in other conditions; the run may take other paths: " + "; ".join(changed)
            ),
            stacklevel=4,
        )
