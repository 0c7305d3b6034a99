"""Per-thread torch.distributed state, so each rank thread has its own default group, group map and names.

torch.distributed keeps its world (default group, group maps, counters) in ``distributed_c10d._world``; during a
run that object is replaced by :class:`ThreadLocalWorld` (as torch's own threaded test backend does) and the
C++ group-name registry is switched to thread isolation. ``init_process_group`` and ``destroy_process_group``
are wrapped so that rank code written for torchrun (which calls them itself) runs unchanged.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import _set_thread_isolation_mode

BACKEND = "simdist"

_tls = threading.local()
_state: dict[str, Any] = {"sim": None}


class _WorldData:
    def __init__(self) -> None:
        self.default_pg = None
        self.pg_map: dict = {}
        self.pg_names: dict = {}
        self.pg_group_ranks: dict = {}
        self.pg_backend_config: dict = {}
        self.group_count = 0
        self.tags_to_pg: dict = {}
        self.pg_to_tag: dict = {}
        self.pg_coalesce_state: dict = {}
        self.comms: list = []


def _data() -> _WorldData:
    w = getattr(_tls, "world", None)
    if w is None:
        w = _tls.world = _WorldData()
    return w


def _field(name: str) -> property:
    def get(self: Any) -> Any:
        return getattr(_data(), name)

    def put(self: Any, value: Any) -> None:
        setattr(_data(), name, value)

    return property(get, put)


class ThreadLocalWorld(c10d._World):
    """``distributed_c10d._World`` whose every field is per thread."""

    default_pg = _field("default_pg")
    pg_map = _field("pg_map")
    pg_names = _field("pg_names")
    pg_group_ranks = _field("pg_group_ranks")
    pg_backend_config = _field("pg_backend_config")
    group_count = _field("group_count")
    tags_to_pg = _field("tags_to_pg")
    pg_to_tag = _field("pg_to_tag")
    pg_coalesce_state = _field("pg_coalesce_state")
    comms = _field("comms")


def _create_backend(opts: Any, backend_options: Any) -> dist.ProcessGroup:
    from simdist.comm.process_group import SimProcessGroup

    sim = _state["sim"]
    if sim is None:
        raise RuntimeError(
            "the 'simdist' backend only exists inside simdist.run(); use 'gloo' or 'nccl' for real processes"
        )
    timeout = opts.timeout.total_seconds() if isinstance(opts.timeout, timedelta) else None
    if timeout is not None and abs(timeout - c10d.default_pg_timeout.total_seconds()) < 1e-9:
        timeout = sim.default_timeout  # torch's default: no simulated timeout unless the user set one
    # Group names are the same on every member rank (torch derives them from a per-world counter or a hash
    # of the ranks), so the name alone finds the shared state; building the rank list once per group, not
    # once per member, keeps the default group O(n) rather than O(n^2) at thousands of ranks.
    state = sim.groups.get(opts.group_id)
    if state is None:
        ranks = list(opts.global_ranks_in_group) or list(range(opts.group_size))
        state = sim.group_state(opts.group_id, str(opts.group_id), ranks, timeout)
    elif state.size != opts.group_size:
        raise RuntimeError(
            f"process group {opts.group_id!r} was created with {state.size} ranks on one rank and "
            f"{opts.group_size} on another: every rank must create groups in the same order"
        )
    return SimProcessGroup(sim, state, opts.group_rank)


_orig: dict[str, Any] = {}


def _patched_init_process_group(backend: str | None = None, *args: Any, timeout: timedelta | None = None, **kwargs: Any) -> None:
    """Accept the user's own ``init_process_group`` call: the group already exists in a simulated rank."""
    from simdist.engine.baton import current_rank_state

    state = current_rank_state()
    if state is None:
        return _orig["init_process_group"](backend, *args, timeout=timeout, **kwargs)
    if backend not in (None, BACKEND, "cpu:" + BACKEND):
        raise ValueError(
            f"init_process_group(backend={backend!r}) inside simdist.run: the default group already exists with "
            f"the '{BACKEND}' backend. Call init_process_group only in real runs (real.run does it for you), or "
            f"pass backend='{BACKEND}'."
        )
    sim = _state["sim"]
    if _data().default_pg is None:  # initialised again after destroy_process_group()
        init_default_group(state.rank, sim.world_size, sim.store)
    if timeout is not None:
        seconds = timeout.total_seconds()
        sim.default_timeout = seconds
        for pg in _data().pg_map:
            if hasattr(pg, "state"):
                pg.state.timeout = seconds
    return None


def init_default_group(rank: int, world_size: int, store: Any) -> None:
    """What ``init_process_group("simdist", rank=rank, world_size=world_size, store=store)`` does, for one rank.

    torch's own version builds a ``{rank: rank}`` map of the whole world for every rank: O(n^2) time and
    memory across n rank threads (1.6 GB at 4096 ranks). Here every rank thread shares one read-only map.
    """
    backend = dist.Backend(BACKEND)
    timeout = c10d._get_default_timeout(backend)
    group_name = c10d._process_group_name([], use_hashed_name=False)
    pg, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        backend,
        c10d.PrefixStore("default_pg", store),
        group_name,
        timeout=timeout,
        group_desc="default_pg",
    )
    c10d._update_default_pg(pg)
    _state.setdefault("worlds", {})[rank] = _data()
    identity = _state.get("identity")
    if identity is None or len(identity) != world_size:
        identity = _state["identity"] = {i: i for i in range(world_size)}
    _data().pg_group_ranks[pg] = identity


def _block_on_sim_futures(futures: Any) -> None:
    from simdist.comm.work import sim_roots

    for root in sim_roots(futures):
        root._block()


def _patched_wait_all(futures: Any) -> Any:
    """``torch.futures.wait_all`` that first waits for simdist futures in simulated time."""
    _block_on_sim_futures(futures)
    return _orig["wait_all"](futures)


def _patched_collect_all(futures: Any) -> Any:
    """``torch.futures.collect_all`` whose result waits for simdist futures in simulated time when waited on."""
    from simdist.comm.work import _ThenFuture, sim_roots

    roots = sim_roots(futures)
    inner = _orig["collect_all"](futures)
    return _ThenFuture(roots, inner) if roots else inner


def install(sim: Any) -> None:
    """Make torch.distributed's world per-thread and route the ``simdist`` backend to ``sim``."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create_backend, extended_api=True, devices=["cpu"])
    _state["sim"] = sim
    _orig["world"] = c10d._world
    c10d._world = ThreadLocalWorld()
    _set_thread_isolation_mode(True)
    _orig["multithreading"] = torch.autograd.set_multithreading_enabled(False)
    _orig["init_process_group"] = c10d.init_process_group
    c10d.init_process_group = _patched_init_process_group
    dist.init_process_group = _patched_init_process_group
    # torch waits on these in C++, which a rank thread cannot do without stopping the simulation
    _orig["wait_all"], _orig["collect_all"] = torch.futures.wait_all, torch.futures.collect_all
    torch.futures.wait_all, torch.futures.collect_all = _patched_wait_all, _patched_collect_all


def uninstall() -> None:
    """Restore torch.distributed's process-wide world."""
    c10d._world = _orig.pop("world")
    _set_thread_isolation_mode(False)
    _orig.pop("multithreading").__exit__(None, None, None)
    init = _orig.pop("init_process_group")
    c10d.init_process_group = init
    dist.init_process_group = init
    torch.futures.wait_all, torch.futures.collect_all = _orig.pop("wait_all"), _orig.pop("collect_all")
    _state["sim"] = None
    _state.pop("identity", None)
    _state.pop("worlds", None)


@contextlib.contextmanager
def acting_as(rank: int) -> Iterator[None]:
    """Let the calling (simulator) thread see ``rank``'s torch.distributed world.

    A future's callbacks run where the future completes: on real hardware in the rank's own process (a
    backend thread), here in the simulator's thread. Seeing the rank's world there makes
    ``dist.get_world_size()`` and friends inside a callback (e.g. a DDP comm hook's ``then``) answer as the
    rank would.
    """
    mine = getattr(_tls, "world", None)
    _tls.world = _state.get("worlds", {}).get(rank, mine)
    try:
        yield
    finally:
        _tls.world = mine


def installed() -> bool:
    """Whether a simulated run is in progress in this process."""
    return _state["sim"] is not None


def forget_thread_world() -> None:
    """Drop the calling rank thread's groups (its world dies with the thread)."""
    c10d._unregister_all_process_groups()
    _tls.world = None
