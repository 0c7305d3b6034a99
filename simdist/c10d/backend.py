"""The ``"simdist"`` backend inside a run: registration, per-thread worlds, and torch's functions that need it.

During a run, torch.distributed's world is per thread (:mod:`simdist.comm.thread_world`) and the C++
group-name registry is switched to thread isolation. ``init_process_group`` and ``destroy_process_group``
keep working so that rank code written for torchrun (which calls them itself) runs unchanged: where the rank's
default group already exists (a function run by :func:`simdist.run`) the call is checked and keeps it; where it
does not (a script run as torchrun runs it, or after ``destroy_process_group``) torch's own function makes it,
through a rendezvous that checks its arguments against the launch (:mod:`simdist.c10d.rendezvous`) and a group
helper that makes a simulated group, so a name bound before the run (``from torch.distributed import
init_process_group``) works too. ``torch.futures.wait_all`` / ``collect_all`` wait for simulated futures in
simulated time.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import _set_thread_isolation_mode

from simdist.c10d import funcol, rendezvous
from simdist.c10d.process_group import SimProcessGroup
from simdist.clock.baton import current_rank_state
from simdist.comm import thread_world
from simdist.comm.context import RunContext
from simdist.comm.thread_world import ThreadLocalWorld
from simdist.comm.work import _ThenFuture, sim_roots
from simdist.cudart.api import bind_group
from simdist.errors import InvalidArgumentError
from simdist.options import BACKEND_NAMES
from simdist.patching import replaced

#: the backend name rank code passes to ``init_process_group``
BACKEND = "simdist"


#: the run in progress in this process (at most one) and what installing it replaced
_active: dict[str, Any] = {
    "ctx": None, "identity": None, "name": BACKEND, "creating": None, "gloo_stand_in": None, "default_group": True,
    "pre_creating": False, "arrivals": None,
}
_orig: dict[str, Any] = {}


def active() -> RunContext | None:
    """The communication context of the run in progress in this process, or None."""
    return _active["ctx"]


def installed() -> bool:
    """Whether a simulated run is in progress in this process."""
    return _active["ctx"] is not None


def _presented(requested: Any) -> str | None:
    """The name a group created with backend ``requested`` shows rank code, or None if simdist cannot run it.

    Rank code written for a real cluster creates groups with the backends it knows (``new_group(backend=
    "gloo")`` next to an NCCL default group is common): inside a run they are simulated groups that
    present the requested name; ``"simdist"`` and no backend present the run's name.
    """
    text = str(requested).lower() if requested else ""
    if text in ("", "undefined", BACKEND, "cpu:" + BACKEND):
        return _active["name"]
    parts = [p.split(":")[-1] for p in text.split(",")]
    if all(p in BACKEND_NAMES for p in parts):
        return str(requested)
    return None


def _create_backend(opts: Any, backend_options: Any) -> dist.ProcessGroup:
    timeout = opts.timeout.total_seconds() if isinstance(opts.timeout, timedelta) else None
    return _sim_group(opts.group_id, opts.global_ranks_in_group, opts.group_size, opts.group_rank, timeout)


def _sim_group(
    group_id: str, global_ranks: Any, size: int, group_rank: int, timeout: float | None
) -> SimProcessGroup:
    """Rank ``group_rank``'s handle on the simulated group ``group_id`` of ``size`` ranks (``global_ranks``, or
    every rank for none); ``timeout`` in seconds, torch's default standing for none."""
    sim = _active["ctx"]
    if sim is None:
        raise RuntimeError(
            "the 'simdist' backend only exists inside simdist.run(); use 'gloo' or 'nccl' for real processes"
        )
    if timeout is not None and abs(timeout - c10d.default_pg_timeout.total_seconds()) < 1e-9:
        timeout = sim.default_timeout  # torch's default: no simulated timeout unless the user set one
    # Group names are the same on every member rank (torch derives them from a per-world counter or a hash
    # of the ranks), so the name alone finds the shared state; building the rank list once per group, not
    # once per member, keeps the default group O(n) rather than O(n^2) at thousands of ranks.
    state = sim.groups.get(group_id)
    if state is None:
        ranks = list(global_ranks) or list(range(size))
        state = sim.group_state(group_id, str(group_id), ranks, timeout)
    elif state.size != size:
        raise RuntimeError(
            f"process group {group_id!r} was created with {state.size} ranks on one rank and "
            f"{size} on another: every rank must create groups in the same order"
        )
    return SimProcessGroup(sim, state, group_rank, str(_active["creating"] or _active["name"]))


def _present(pg: dist.ProcessGroup, name: str) -> None:
    """Make torch's bookkeeping of ``pg`` (``get_backend``, ``get_backend_config``) show ``name``."""
    if name == BACKEND:
        return
    world = c10d._world
    backend = dist.Backend(name)
    _, store = world.pg_map[pg]
    world.pg_map[pg] = (backend, store)
    world.pg_backend_config[pg] = str(c10d.BackendConfig(backend))
    if isinstance(pg, SimProcessGroup):
        pg.present_devices(name)
    if "gloo" in [p.split(":")[-1] for p in name.lower().split(",")]:
        pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, _gloo_stand_in())


def _gloo_stand_in() -> Any:
    """A one-member real gloo backend, shared by the run's groups presented as ``"gloo"``; it runs nothing.

    torch's DDP reads the thread count of a group named "gloo" from the group's GLOO backend, cast in C++ to
    ``ProcessGroupGloo`` (``Logger::set_env_variables``): without a genuine one it fails ("Could not find backend
    type 1"), with another class in its place it would read foreign memory. Collectives never reach it: the
    simulated group's own methods serve them. No worker threads; bound to loopback, so no name lookup.
    """
    stand_in = _active["gloo_stand_in"]
    if stand_in is None:
        if not dist.is_gloo_available():
            raise InvalidArgumentError(
                "this torch build has no gloo: a run cannot present groups as 'gloo' (torch's DDP needs a real gloo "
                "backend behind that name); use backend_name='simdist' or 'nccl'"
            )
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        opts._threads = 0
        stand_in = _active["gloo_stand_in"] = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, opts)
    return stand_in


def _patched_new_process_group_helper(group_size: int, group_rank: int, global_ranks: Any, backend: Any, *args: Any, **kwargs: Any) -> Any:
    """Create a simulated group for a rank thread's ``new_group`` or default group, whatever real backend it names.

    A default group made from a store the program passed (not through simdist's rendezvous) is checked against
    the launch here: it is the one place both torch's ``init_process_group`` and simdist's own pass.
    """
    state = current_rank_state()
    if state is None:
        return _orig["new_process_group_helper"](group_size, group_rank, global_ranks, backend, *args, **kwargs)
    if kwargs.get("group_desc") == "default_pg":
        sim = _active["ctx"]
        # the call site (a walk up the stack) is for what a program's own init_process_group checks; every rank's
        # default group that simdist makes before the program starts needs none
        site = None
        if not rendezvous.take_rendezvous():
            site = str(sim.call_site())
            rendezvous.check_world(group_rank, group_size, state.rank, sim.world_size, site, "with a store")
            store = args[0] if args else kwargs.get("store")
            rendezvous.check_store(store, state.rank, site)
        world = thread_world.current()
        if world.premade:
            # torch's own init_process_group, bound before the run, in a function whose group simdist made
            world.premade = False
            world.group_count -= 1  # the name torch's function drew: the group has its name already
            _keep_default_group(backend, kwargs.get("timeout"))
            return world.default_pg, None
        if not _active["pre_creating"]:
            timeout = kwargs.get("timeout")
            seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else None
            if site is None:
                site = str(sim.call_site())
            _active["arrivals"].join(str(args[1] if len(args) > 1 else kwargs.get("group_name")), state.rank,
                                     group_size, seconds, site)
        thread_world.register(state.rank)
    name = _presented(backend)
    if name is None:
        raise InvalidArgumentError(
            f"new_group(backend={str(backend)!r}) inside simdist.run: simulated groups can present the backends "
            f"{BACKEND_NAMES}; pass one of those (or none, for the run's backend_name {_active['name']!r})"
        )
    _active["creating"] = name
    # A device bound to the default group (init_process_group(device_id=...)) makes torch connect the group's
    # backend for that device eagerly and split later groups from it, which a simulated group, a backend of its
    # own for every device, does neither of: the id is checked as torch checks it, and not bound
    device_id = kwargs.pop("device_id", None)
    if device_id is not None and (device_id.index is None or device_id.type == "cpu"):
        raise ValueError("init_process_group device_id parameter must be an accelerator with an index")
    try:
        pg, prefix_store = _orig["new_process_group_helper"](
            group_size, group_rank, global_ranks, dist.Backend(BACKEND), *args, **kwargs
        )
    finally:
        _active["creating"] = None
    if pg is not c10d.GroupMember.NON_GROUP_MEMBER:
        _present(pg, name)
    if kwargs.get("group_desc") == "default_pg":
        _active["name"] = name  # groups made later without a backend take the default group's, as in torch
    return pg, prefix_store


def _patched_monitored_barrier(group: Any = c10d.GroupMember.WORLD, timeout: Any = None, wait_all_ranks: bool = False) -> None:
    """``dist.monitored_barrier`` that also accepts groups presented as ``"simdist"`` (gloo's algorithm runs)."""
    if current_rank_state() is None or c10d._rank_not_in_group(group) or dist.get_backend(group) != BACKEND:
        return _orig["monitored_barrier"](group, timeout, wait_all_ranks)
    # the same argument handling as torch's, whose check for the "gloo" name this backend does not pass
    if timeout is None:
        timeout = c10d._get_default_timeout(dist.get_backend(group))
    elif isinstance(timeout, float):
        warnings.warn(
            f"Please specify timeout arg as a timedelta. Converting current value of {timeout} assuming it "
            f"represents seconds",
            stacklevel=2,
        )
        timeout = timedelta(seconds=timeout)
    c10d._check_valid_timeout(timeout)
    pg = c10d._get_default_group() if group is None else group
    return pg.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)


def _patched_init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: timedelta | None = None,
    world_size: int = -1,
    rank: int = -1,
    store: dist.Store | None = None,
    group_name: str = "",
    pg_options: Any | None = None,
    device_id: torch.device | int | None = None,
    _ranks: list[int] | None = None,
) -> None:
    """``init_process_group`` in a simulated rank: its arguments checked against the launch as a real one checks
    them; the default group kept where it exists, made by torch's own function where it does not."""
    state = current_rank_state()
    arguments = (backend, init_method, timeout, world_size, rank, store, group_name, pg_options, device_id, _ranks)
    if state is None:
        return _orig["init_process_group"](*arguments)
    bind_group(device_id)
    sim = _active["ctx"]
    if _active["default_group"]:
        _check_backend_of_made_group(backend)
    if thread_world.current().default_pg is None or not _active["default_group"]:
        # A script run as torchrun runs it, or a group initialised again after destroy_process_group(): torch's own
        # function, whose rendezvous and group helper are simdist's, so its checks come in its order (and a second
        # call in a script is refused as torch refuses it).
        return _orig["init_process_group"](*arguments)
    rendezvous.check_arguments(
        init_method, timeout, world_size, rank, store, device_id, state.rank, sim.world_size, str(sim.call_site())
    )
    thread_world.current().premade = False
    _keep_default_group(backend, timeout)
    return None


def _check_backend_of_made_group(backend: Any) -> str | None:
    """The backend an ``init_process_group`` asks for is one the group simdist made can present: the name it asks
    to be shown (on a GPU cluster), or None for the run's own."""
    name = _active["name"]
    sim = _active["ctx"]
    # On a GPU cluster the code may ask for the backends of a GPU machine ("nccl", "cpu:gloo,cuda:nccl", "gloo"):
    # the default group presents what it asked for. Elsewhere it must ask for the run's own.
    asked = _presented(backend) if sim.emulates_cuda and backend is not None else None
    text = str(backend).lower() if backend else ""
    if text not in ("", "undefined", BACKEND, "cpu:" + BACKEND) and text != name and asked is None:
        raise ValueError(
            f"init_process_group(backend={str(backend)!r}) inside simdist.run: the default group already exists "
            f"with the '{name}' backend (the name this run presents). Pass backend={name!r} (or none), or run with "
            f"simdist.run(..., backend_name=...) (simdist run --backend-name ...) set to the backend this code "
            f"asks for ({BACKEND_NAMES})"
            + ("" if sim.emulates_cuda else "; on a cluster with a GPU model, 'nccl' and 'cpu:gloo,cuda:nccl' are accepted too")
            + "."
        )
    return asked


def _keep_default_group(backend: Any, timeout: timedelta | None) -> None:
    """The rank's ``init_process_group`` finds the group simdist made: checked, its timeout applied to every group."""
    asked = _check_backend_of_made_group(backend)
    if asked is not None and asked != _active["name"]:
        _present(c10d._get_default_group(), asked)
        _active["name"] = asked  # groups made later without a backend take the default group's, as in torch
    if timeout is not None:
        seconds = timeout.total_seconds()
        _active["ctx"].default_timeout = seconds
        for pg in thread_world.current().pg_map:
            if hasattr(pg, "state"):
                pg.state.timeout = seconds


def init_default_group(rank: int, world_size: int, store: Any) -> None:
    """What ``init_process_group("simdist", rank=rank, world_size=world_size, store=store)`` does, for one rank.

    torch's own version builds a ``{rank: rank}`` map of the whole world for every rank: O(n^2) time and
    memory across n rank threads (1.6 GB at 4096 ranks). Here every rank thread shares one read-only map.
    """
    backend = dist.Backend(BACKEND)
    timeout = c10d._get_default_timeout(backend)
    if _BY_TORCH:
        group_name = c10d._process_group_name([], use_hashed_name=False)
        rendezvous.mark_rendezvous()
        _active["pre_creating"] = True  # every rank makes it before its program starts: nobody to wait for
        try:
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
        finally:
            _active["pre_creating"] = False
    else:
        pg = _made_default_group(rank, world_size, backend, store, timeout)
    c10d._update_default_pg(pg)
    identity = _active["identity"]
    if identity is None or len(identity) != world_size:
        identity = _active["identity"] = {i: i for i in range(world_size)}
    world = thread_world.current()
    world.pg_group_ranks[pg] = identity
    world.premade = True


#: make each rank's default group through torch's ``_new_process_group_helper`` (as a program's own
#: ``init_process_group`` does) instead of :func:`_made_default_group`; tests compare the two
_BY_TORCH = False


def _made_default_group(
    rank: int, world_size: int, backend: str, store: Any, timeout: timedelta
) -> SimProcessGroup:
    """The default group torch's ``_new_process_group_helper`` (through the patched helper above) makes for a rank
    thread, made directly: the same group, names, stores, and entries in the thread's world and torch's registry."""
    # torch's generic path parses the backend's configuration, makes a ProcessGroup it then drops and reaches every
    # field of the world through the thread-local world: about half of a rank's start-up at thousands of ranks
    world = thread_world.current()
    group_name = c10d.GroupName(str(world.group_count))  # torch's _process_group_name, unhashed
    world.group_count += 1
    c10d._check_valid_timeout(timeout)
    thread_world.register(rank)
    name = _presented(backend)
    _active["creating"] = name
    try:
        pg = _sim_group(group_name, [], world_size, rank, timeout.total_seconds())
    finally:
        _active["creating"] = None
    pg._set_group_name(group_name)
    pg._set_group_desc("default_pg")
    world.pg_map[pg] = (backend, c10d.PrefixStore(f"{group_name}/", c10d.PrefixStore("default_pg", store)))
    world.pg_names[pg] = group_name
    world.pg_backend_config[pg] = str(c10d.BackendConfig(backend))
    c10d._register_process_group(group_name, pg)
    tag = f"ptd:{group_name}"
    world.tags_to_pg.setdefault("", []).append(pg)
    world.tags_to_pg.setdefault(tag, []).append(pg)
    world.pg_to_tag[pg] = tag
    _present(pg, name)
    _active["name"] = name  # groups made later without a backend take the default group's, as in torch
    return pg


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


def _rank_or_none() -> int | None:
    """The calling rank, or None outside rank threads."""
    state = current_rank_state()
    return None if state is None else state.rank


#: the patches of simdist.patching.INVENTORY this module makes
_OWNER = "simdist.c10d.backend"


@contextlib.contextmanager
def running(ctx: RunContext) -> Iterator[None]:
    """During the block, torch.distributed's world is per thread and the ``simdist`` backend serves ``ctx``."""
    _orig.update(
        init_process_group=c10d.init_process_group,
        wait_all=torch.futures.wait_all,
        collect_all=torch.futures.collect_all,
        new_process_group_helper=c10d._new_process_group_helper,
        monitored_barrier=c10d.monitored_barrier,
        rendezvous=c10d.rendezvous,
    )
    patches = {
        "torch.distributed.distributed_c10d._world": ThreadLocalWorld(),
        "torch.distributed.distributed_c10d.init_process_group": _patched_init_process_group,
        "torch.distributed.init_process_group": _patched_init_process_group,
        # torch waits on these in C++, which a rank thread cannot do without stopping the simulation
        "torch.futures.wait_all": _patched_wait_all,
        "torch.futures.collect_all": _patched_collect_all,
        "torch.distributed.distributed_c10d._new_process_group_helper": _patched_new_process_group_helper,
        # what torch's own init_process_group sets in rank code (scripts run as torchrun runs them)
        "torch.distributed.distributed_c10d._backend": c10d._backend,
        "torch.distributed.distributed_c10d._default_pg_init_method": c10d._default_pg_init_method,
        "torch.distributed.distributed_c10d.rendezvous": rendezvous.rendezvous(
            c10d.rendezvous, _rank_or_none, ctx.world_size, ctx.store, lambda: str(ctx.call_site())
        ),
        "torch.distributed.distributed_c10d.monitored_barrier": _patched_monitored_barrier,
        "torch.distributed.monitored_barrier": _patched_monitored_barrier,
        # CPU builds of torch have no NCCL timeout and warn on every new_group of a group named "nccl"
        "torch.distributed.distributed_c10d.default_pg_nccl_timeout": c10d.default_pg_nccl_timeout
        or c10d.default_pg_timeout,
    }
    _active["ctx"] = ctx
    _active["name"] = ctx.backend_name
    _active["default_group"] = ctx.options.default_group
    _active["arrivals"] = rendezvous.Arrivals(ctx)
    try:
        with _registered(ctx.emulates_cuda), replaced(_OWNER, patches), _thread_isolation(), funcol.installed():
            multithreading = torch.autograd.set_multithreading_enabled(False)
            with multithreading:
                yield
    finally:
        _active["ctx"] = None
        _active["name"] = BACKEND
        _active["identity"] = None
        _active["gloo_stand_in"] = None
        _active["default_group"] = True
        _active["arrivals"] = None
        _orig.clear()
        thread_world.forget_all()


@contextlib.contextmanager
def _registered(cuda: bool) -> Iterator[None]:
    """The ``simdist`` backend registered in ``dist.Backend`` during the block (for CUDA tensors too when the run
    emulates CUDA), and what that changed undone."""
    cls = dist.Backend
    saved = (
        list(cls.backend_list),
        dict(cls.default_device_backend_map),
        dict(cls.backend_type_map),
        dict(cls.backend_capability),
        dict(cls._plugins),
        cls.__dict__.get(BACKEND.upper()),
    )
    cls.register_backend(BACKEND, _create_backend, extended_api=True, devices=["cpu", "cuda"] if cuda else ["cpu"])
    try:
        yield
    finally:
        cls.backend_list[:] = saved[0]
        for mapping, before in zip(
            (cls.default_device_backend_map, cls.backend_type_map, cls.backend_capability, cls._plugins), saved[1:5]
        ):
            mapping.clear()
            mapping.update(before)
        if saved[5] is None and BACKEND.upper() in cls.__dict__:
            delattr(cls, BACKEND.upper())


@contextlib.contextmanager
def _thread_isolation() -> Iterator[None]:
    """torch's C++ process-group registry resolves names per thread during the block."""
    _set_thread_isolation_mode(True)
    try:
        yield
    finally:
        _set_thread_isolation_mode(False)
