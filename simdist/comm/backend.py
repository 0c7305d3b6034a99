"""The ``"simdist"`` backend inside a run: registration, per-thread worlds, and torch's functions that need it.

During a run, torch.distributed's world is per thread (:mod:`simdist.comm.thread_world`) and the C++
group-name registry is switched to thread isolation. ``init_process_group`` and ``destroy_process_group``
keep working so that rank code written for torchrun (which calls them itself) runs unchanged, and
``torch.futures.wait_all`` / ``collect_all`` wait for simulated futures in simulated time.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import _set_thread_isolation_mode

from simdist.clock.baton import current_rank_state
from simdist.comm import thread_world
from simdist.comm.context import RunContext
from simdist.comm.process_group import SimProcessGroup
from simdist.comm.thread_world import ThreadLocalWorld
from simdist.comm.work import _ThenFuture, sim_roots

#: the backend name rank code passes to ``init_process_group``
BACKEND = "simdist"

#: the run in progress in this process (at most one) and what installing it replaced
_active: dict[str, Any] = {"ctx": None, "identity": None}
_orig: dict[str, Any] = {}


def active() -> RunContext | None:
    """The communication context of the run in progress in this process, or None."""
    return _active["ctx"]


def installed() -> bool:
    """Whether a simulated run is in progress in this process."""
    return _active["ctx"] is not None


def _create_backend(opts: Any, backend_options: Any) -> dist.ProcessGroup:
    sim = _active["ctx"]
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


def _patched_init_process_group(backend: str | None = None, *args: Any, timeout: timedelta | None = None, **kwargs: Any) -> None:
    """Accept the user's own ``init_process_group`` call: the group already exists in a simulated rank."""
    state = current_rank_state()
    if state is None:
        return _orig["init_process_group"](backend, *args, timeout=timeout, **kwargs)
    if backend not in (None, BACKEND, "cpu:" + BACKEND):
        raise ValueError(
            f"init_process_group(backend={backend!r}) inside simdist.run: the default group already exists with "
            f"the '{BACKEND}' backend. Call init_process_group only in real runs (real.run does it for you), or "
            f"pass backend='{BACKEND}'."
        )
    sim = _active["ctx"]
    if thread_world.current().default_pg is None:  # initialised again after destroy_process_group()
        init_default_group(state.rank, sim.world_size, sim.store)
    if timeout is not None:
        seconds = timeout.total_seconds()
        sim.default_timeout = seconds
        for pg in thread_world.current().pg_map:
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
    thread_world.register(rank)
    identity = _active["identity"]
    if identity is None or len(identity) != world_size:
        identity = _active["identity"] = {i: i for i in range(world_size)}
    thread_world.current().pg_group_ranks[pg] = identity


def _patched_wait_all(futures: Any) -> Any:
    """``torch.futures.wait_all`` that first waits for simdist futures in simulated time."""
    for root in sim_roots(futures):
        root._block()
    return _orig["wait_all"](futures)


def _patched_collect_all(futures: Any) -> Any:
    """``torch.futures.collect_all`` whose result waits for simdist futures in simulated time when waited on."""
    roots = sim_roots(futures)
    inner = _orig["collect_all"](futures)
    return _ThenFuture(roots, inner) if roots else inner


def install(ctx: RunContext) -> None:
    """Make torch.distributed's world per-thread and route the ``simdist`` backend to ``ctx``."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create_backend, extended_api=True, devices=["cpu"])
    _active["ctx"] = ctx
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
    _active["ctx"] = None
    _active["identity"] = None
    thread_world.forget_all()
