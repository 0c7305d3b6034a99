"""What ``init_process_group`` in rank code is checked against: the launch, as a real rendezvous would find it.

A real launch's ``init_process_group`` meets its peers through a rendezvous (``env://``, ``tcp://``, ``file://``
or a store): the process learns its rank and the world size, then gloo connects every pair. simdist makes no
rendezvous (the ranks are threads of one launch), so it reads what the real one would have read and refuses, with
torch's or gloo's words first, what a real launch refuses or where it would hang:

- what torch's front end refuses, with its exception and message: a rank or world size that is not an integer,
  an ``init_method`` with no handler, ``env://`` without its variables, ``tcp://`` or ``file://`` without rank or
  world size, both ``init_method`` and ``store``, a port outside 0..65535;
- a world size other than the launch's: too large, every process waits for peers that never come (gloo's
  ``DistStoreError: wait timeout`` after the timeout); too small, the processes disagree on the world;
- a rank outside the world (gloo: ``rank < size`` / ``rank >= 0`` enforced), and a rank other than the one the
  process was launched as (two processes claiming one rank wait until the timeout; a permutation works on real
  gloo, but each simulated rank runs as the rank it was launched as);
- a ``file://`` store in a directory that does not exist (``FileStore`` retries forever) and a ``HashStore``,
  which lives in one process's memory (each process would rendezvous with itself: ``Wait timeout``).

The address of ``tcp://``/``env://`` and the file of ``file://`` are never contacted or created.
"""

from __future__ import annotations

import importlib
import numbers
import os
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

import simpy
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from simdist.comm.context import RunContext
from simdist.errors import InvalidArgumentError, RendezvousTimeoutError
from simdist.ranks import format_ranks

#: torch's rendezvous module (``torch.distributed.rendezvous`` names its function, not the module)
_TORCH_RENDEZVOUS = importlib.import_module("torch.distributed.rendezvous")
_tls = threading.local()


def launched_world(url: Any, rank: Any, world_size: Any) -> tuple[int, int]:
    """The (rank, world size) a real ``rendezvous(url, rank, world_size)`` would give, refusing what torch refuses.

    As ``torch.distributed.rendezvous``: ``rank`` and ``world_size`` (-1: not given) override what the URL and the
    environment (``os.environ``, the rank's own view) say.
    """
    # torch's own types and words (a RuntimeError, not a TypeError), so that code catching them behaves alike
    if not isinstance(url, (str, bytes)):
        raise RuntimeError(f"`url` must be a string. {type(url)}: {url}")  # noqa: TRY004
    if not isinstance(rank, numbers.Integral):
        raise RuntimeError(f"`rank` must be an integer. {rank}")  # noqa: TRY004
    if not isinstance(world_size, numbers.Integral):
        raise RuntimeError(f"`world_size` must be an integer. {world_size}")  # noqa: TRY004
    url = url.decode() if isinstance(url, bytes) else url
    parsed = urlparse(url)
    query = dict(pair.split("=", 1) for pair in filter(None, parsed.query.split("&")) if "=" in pair)
    if rank != -1 or world_size != -1:
        if "rank" in query or "world_size" in query:
            raise AssertionError(f"The url: {url} has node-specific arguments(rank, world_size) already.")
        if rank != -1:
            query["rank"] = str(rank)
        if world_size != -1:
            query["world_size"] = str(world_size)
    scheme = parsed.scheme
    if scheme not in _TORCH_RENDEZVOUS._rendezvous_handlers:
        raise RuntimeError(f"No rendezvous handler for {scheme}://")

    def error(msg: str) -> ValueError:
        return ValueError(f"Error initializing torch.distributed using {scheme}:// rendezvous: {msg}")

    def value(key: str, variable: str | None = None) -> int:
        text = query.get(key)
        if text is None and variable is not None:
            text = os.environ.get(variable)
            if not text:
                raise error(f"environment variable {variable} expected, but not set")
        if text is None:
            raise error(f"{key.replace('_', ' ')} parameter missing")
        return int(text)

    if scheme == "env":
        found = value("rank", "RANK"), value("world_size", "WORLD_SIZE")
        for variable in ("MASTER_ADDR", "MASTER_PORT"):
            if not os.environ.get(variable):
                raise error(f"environment variable {variable} expected, but not set")
        _check_port(int(os.environ["MASTER_PORT"]))
        return found
    if scheme == "tcp":
        if parsed.port is None:
            raise error("port number missing")
        found = value("rank"), value("world_size")
        _check_port(parsed.port)
        return found
    if scheme == "file":
        if not parsed.path:
            raise error("path missing")
        found = value("rank"), value("world_size")
        directory = os.path.dirname(parsed.path) or "."
        if not os.path.isdir(directory):
            raise InvalidArgumentError(
                f"init_process_group(init_method={url!r}): the directory {directory!r} does not exist: a real "
                f"launch's FileStore waits for the file forever; create the directory or choose a file in one that exists"
            )
        return found
    # a handler the program registered itself: the URL's values, else the launch's
    return int(query.get("rank", os.environ["RANK"])), int(query.get("world_size", os.environ["WORLD_SIZE"]))


def _check_port(port: int) -> None:
    if not 0 <= port < 2**16:
        raise ValueError(f"port must have value from 0 to 65535 but was {port}.")


def check_world(
    rank: int, world_size: int, launched_rank: int, launched_size: int, site: str, how: str
) -> None:
    """The group ``init_process_group`` asked for is the launch's: ``world_size`` ranks, this one ``rank``.

    ``how`` says where the values came from (the arguments, the URL, the environment), for the message.
    """
    where = f"rank {launched_rank} at {site}"
    if world_size != launched_size:
        if world_size <= 0:
            real = "a real launch refuses it" + (
                " (TCPStore world size cannot be 0)" if world_size == 0 else ""
            )
        elif world_size > launched_size:
            real = (
                f"on a real launch its {launched_size} processes wait for {world_size} until the timeout (gloo: "
                "DistStoreError 'wait timeout')"
            )
        else:
            real = "on a real launch its processes disagree on the world and wait for one another until the timeout"
        raise InvalidArgumentError(
            f"init_process_group: world_size {world_size} ({how}) on {where}, but this launch has {launched_size} ranks "
            f"(WORLD_SIZE={launched_size}): {real}. Leave world_size out (env:// reads WORLD_SIZE) or pass "
            f"world_size=int(os.environ['WORLD_SIZE'])"
        )
    if not 0 <= rank < world_size:
        check = f"rank < size. {rank} vs {world_size}" if rank >= 0 else f"rank >= 0. {rank} vs 0"
        raise InvalidArgumentError(
            f"[enforce fail at gloo/context.cc] {check} (gloo): init_process_group: rank {rank} ({how}) on {where} is "
            f"not a rank of a world of {world_size}; expected 0..{world_size - 1}, this process's RANK {launched_rank}"
        )
    if rank != launched_rank:
        raise InvalidArgumentError(
            f"init_process_group: rank {rank} ({how}) on {where}, launched as RANK={launched_rank}: simdist runs each "
            f"rank's program as the rank it was launched as (on a real launch, two processes claiming one rank wait "
            f"until the timeout, gloo's DistStoreError 'wait timeout'; a permutation of the ranks works there). Leave "
            f"rank out (env:// reads RANK) or pass rank=int(os.environ['RANK'])"
        )


def check_store(store: Any, launched_rank: int, site: str) -> None:
    """A store passed to ``init_process_group`` is one every process of a real launch could reach."""
    inner = store
    while isinstance(inner, dist.PrefixStore):
        inner = inner.underlying_store
    if isinstance(inner, dist.HashStore):
        raise InvalidArgumentError(
            f"init_process_group(store=HashStore()) on rank {launched_rank} at {site}: a HashStore lives in one "
            f"process's memory, so each process of a real launch has its own and gloo's rendezvous through it waits "
            f"until the timeout (DistStoreError 'Wait timeout'); pass a FileStore or TCPStore every rank reaches, or "
            f"init_method='env://'"
        )


def rendezvous(
    orig: Callable[..., Any],
    rank_of: Callable[[], int | None],
    size: int,
    store: dist.Store,
    site: Callable[[], str],
) -> Callable[..., Any]:
    """``torch.distributed.distributed_c10d.rendezvous`` for rank threads: the launch's values after the checks
    above, and the run's store (nothing is contacted); ``orig`` elsewhere. ``rank_of()`` is the calling rank."""

    def simulated_rendezvous(url: Any, rank: int = -1, world_size: int = -1, **kwargs: Any) -> Any:
        me = rank_of()
        if me is None:
            return orig(url, rank, world_size, **kwargs)
        found_rank, found_size = launched_world(url, rank, world_size)
        given = " and ".join(f"{k}={v}" for k, v in (("rank", rank), ("world_size", world_size)) if v != -1)
        check_world(found_rank, found_size, me, size, site(), _how(url, given))
        mark_rendezvous()
        return iter([(store, found_rank, found_size)])

    return simulated_rendezvous


def take_rendezvous() -> bool:
    """Whether the calling thread's default group comes from :func:`rendezvous` (else from a store it was given)."""
    done = getattr(_tls, "rendezvoused", False)
    _tls.rendezvoused = False
    return done


def mark_rendezvous() -> None:
    """The calling thread's next default group comes from simdist's own rendezvous (not from a user's store)."""
    _tls.rendezvoused = True


def check_device_id(device_id: Any) -> None:
    """``device_id`` as torch's ``init_process_group`` and its group helper check it, with their messages."""
    if device_id is None:
        return
    acc = torch.accelerator.current_accelerator()
    if isinstance(device_id, int) and not isinstance(device_id, bool):
        if acc is None:
            raise ValueError(
                "device_id is an int, but no accelerator support is found from the current compilation. "
                "Please use a different compiled version that supports your accelerator."
            )
        device_id = torch.device(acc.type, device_id)
    if not isinstance(device_id, torch.device):
        raise TypeError(
            f"init_process_group: device_id must be a torch.device with an index (or an int, the index on the "
            f"accelerator), got {type(device_id).__name__} {device_id!r:.40}"
        )
    if device_id.type != "cpu":
        if acc is None or device_id.type != acc.type:
            raise ValueError(
                f"device_id {device_id} does not match the current compilation's accelerator support: {acc}. "
                "Please use a different compiled version that supports your accelerator."
            )
        if device_id.index is None:
            raise ValueError("Please use a device_id with index.")
        count = torch.accelerator.device_count()
        if device_id.index >= count:
            raise ValueError(
                f"device_id {device_id} is out of range. Please use a device index less than the number of "
                f"accelerators available: {count}."
            )
    if device_id.index is None or device_id.type == "cpu":
        raise ValueError("init_process_group device_id parameter must be an accelerator with an index")


def check_arguments(
    init_method: Any,
    timeout: Any,
    world_size: Any,
    rank: Any,
    store: Any,
    device_id: Any,
    launched_rank: int,
    launched_size: int,
    site: str,
) -> None:
    """``init_process_group``'s arguments checked as torch's front end, its rendezvous and gloo check them, in
    their order, against the launch (``launched_rank`` of ``launched_size``) without creating anything."""
    if store is not None and init_method is not None:
        raise AssertionError("Cannot specify both init_method and store.")
    if store is not None:
        if not world_size > 0:
            raise AssertionError("world_size must be positive if using store")
        if not rank >= 0:
            raise AssertionError("rank must be non-negative if using store")
    check_device_id(device_id)
    if timeout is not None:
        c10d._check_valid_timeout(timeout)
    if store is not None:
        check_world(rank, world_size, launched_rank, launched_size, site, "with a store")
        check_store(store, launched_rank, site)
        return
    url = init_method if init_method is not None else "env://"
    found_rank, found_size = launched_world(url, rank, world_size)
    given = " and ".join(f"{k}={v}" for k, v in (("rank", rank), ("world_size", world_size)) if v != -1)
    check_world(found_rank, found_size, launched_rank, launched_size, site, _how(url, given))


def _how(url: Any, given: str) -> str:
    """Where a rank and world size came from, for a message."""
    return f"from init_method {url!r}" + (f" with {given}" if given else "")


class Arrivals:
    """Where each default group's ranks meet, as a real rendezvous makes them meet: a rank's
    ``init_process_group`` returns once every rank of the world has reached it with the same group, or raises a
    :class:`RendezvousTimeoutError` after its timeout (simulated seconds), naming the ranks that never came."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        #: group name -> (the event that fires when the last rank arrives, the ranks arrived so far)
        self._groups: dict[str, tuple[simpy.Event, set[int]]] = {}

    def join(self, name: str, rank: int, size: int, timeout: float | None, site: str) -> None:
        """``rank`` reached the rendezvous of default group ``name`` of ``size`` ranks: wait for the others."""
        env = self.ctx.env
        complete, arrived = self._groups.setdefault(name, (env.event(), set()))
        arrived.add(rank)
        simulated = self.ctx.simulated  # a symmetric run: the ranks that run stand for the rest
        expected = size if simulated is None else sum(1 for r in simulated if r < size)
        if len(arrived) == expected and not complete.triggered:
            complete.succeed()
        if complete.triggered:
            return
        self.ctx.settle()
        waits = [complete] if timeout is None else [complete, env.timeout(timeout)]
        self.ctx.baton.block(
            env.any_of(waits),
            f"rank {rank} in init_process_group at {site}, waiting for {_missing(arrived, size)} to join",
        )
        if not complete.triggered:
            raise RendezvousTimeoutError(
                f"wait timeout after {timeout:g} s of simulated time (gloo: DistStoreError 'wait timeout'): "
                f"init_process_group on rank {rank} at {site} waited for {_missing(arrived, size)} to join the default "
                f"group, which did not (it raised, ended, or initialised another group meanwhile); every rank of the "
                f"world must call init_process_group with the same world"
            )


def _missing(arrived: set[int], size: int) -> str:
    return format_ranks([r for r in range(size) if r not in arrived])
