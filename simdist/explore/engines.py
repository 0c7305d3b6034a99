"""Explorations on a cluster engine: Dask distributed or Ray, for explorations that outgrow one machine.

``simdist.explore(..., engine=E)`` maps :func:`simdist.explore.runs.run_task` over the exploration's tasks on
``E``. A task holds JSON values only (the program by reference, the cluster's config, the options, the
perturbation) and ``run_task`` is a module-level function, so both travel by name: every worker must be able to
import simdist and the program's module, as it must for any Dask or Ray function. What a worker sends back is an
:class:`~simdist.explore.runs.Outcome` whose error survives pickling (``run_task`` makes it so).

What ``engine`` may be, as each library's users hold it:

- a ``distributed.Client`` (used as it is, left open);
- a Dask scheduler's address, ``"tcp://host:8786"`` (any ``scheme://`` but ``ray://``): a client is opened on it
  for the exploration and closed after;
- ``"ray"``: the Ray cluster this process is connected to (``ray.init()`` done by the caller), else the one
  ``ray.init()`` finds or starts (``RAY_ADDRESS``, or a local one), shut down after if explore started it;
- ``"ray://host:10001"``: a Ray cluster through Ray Client.

Outcomes come back in the order runs end; ``explore`` sorts them, so what it finds is the same on every engine.
On Ctrl-C (or any exception in the consumer) the runs not yet finished are cancelled.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from simdist.explore.errors import ExplorationError
from simdist.explore.runs import Outcome, Task, run_task

#: what ``engine=`` accepts, for error messages
ACCEPTED = (
    "a distributed.Client, a Dask scheduler address such as 'tcp://host:8786', 'ray' (the Ray cluster ray.init() "
    "connects to) or a Ray Client address 'ray://host:10001'"
)


@dataclass(frozen=True)
class Engine:
    """A resolved ``engine=`` argument: which library, and the client or address it names."""

    #: "dask" or "ray"
    kind: str
    #: a ``distributed.Client``, an address string, or None (Ray: the cluster ``ray.init()`` finds)
    target: Any = None


def resolve(engine: Any) -> Engine | None:
    """``engine`` checked and named (None: none, the local pool); a clear error for anything else."""
    if engine is None or isinstance(engine, Engine):
        return engine
    distributed = sys.modules.get("distributed")
    if distributed is not None and isinstance(engine, distributed.Client):
        return Engine("dask", engine)
    if isinstance(engine, str):
        if engine == "ray" or engine.startswith("ray://"):
            return Engine("ray", None if engine == "ray" else engine)
        if "://" in engine and engine.split("://", 1)[1]:
            return Engine("dask", engine)
    raise ExplorationError(f"engine must be {ACCEPTED}; got {type(engine).__name__} {engine!r:.60}")


def require(engine: Engine) -> None:
    """A clear error, before any run, if ``engine``'s library is not installed."""
    if engine.kind == "dask":
        _library("distributed", "dask")
    else:
        _library("ray", "ray")


def run(engine: Engine, tasks: list[Task]) -> Iterator[Outcome]:
    """Run ``tasks`` on ``engine``; yields each outcome as its run ends."""
    if engine.kind == "dask":
        return _dask(engine.target, tasks)
    return _ray(engine.target, tasks)


def _library(name: str, extra: str) -> Any:
    """The optional library ``name``, or an error saying how to install it."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise ExplorationError(
            f"engine needs {name}, which is not installed: pip install 'simdist[{extra}]'"
        ) from None


def _dask(target: Any, tasks: list[Task]) -> Iterator[Outcome]:
    distributed = _library("distributed", "dask")
    client = distributed.Client(target) if isinstance(target, str) else target
    # pure=False: two tasks are never the same computation to Dask, even if their values compared equal
    futures = client.map(run_task, tasks, pure=False)
    try:
        for future in distributed.as_completed(futures):
            yield future.result()
    finally:
        client.cancel(futures)
        if client is not target:
            client.close()


def _ray(address: str | None, tasks: list[Task]) -> Iterator[Outcome]:
    ray = _library("ray", "ray")
    started = not ray.is_initialized()
    if started:
        ray.init(address=address, log_to_driver=False)
    remote = ray.remote(num_cpus=1)(run_task)
    pending = [remote.remote(t) for t in tasks]
    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            yield ray.get(done[0])
    finally:
        for ref in pending:
            ray.cancel(ref, force=True)
        if started:
            ray.shutdown()
