"""torch.distributed's world made per thread, so each rank thread has its own default group, group map and names.

torch.distributed keeps its world (default group, group maps, counters) in ``distributed_c10d._world``; during a
run that object is replaced by :class:`ThreadLocalWorld` (as torch's own threaded test backend does).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
from collections.abc import Iterator

import torch.distributed.distributed_c10d as c10d

_tls = threading.local()
#: torch's own ``init_process_group`` (under its logging decorators): the code whose first check, "a default group
#: exists already", must not see a group that simdist made before the program ran (see :attr:`_WorldData.premade`)
_TORCH_INIT_CODE = inspect.unwrap(c10d.init_process_group).__code__
#: each rank's world, by global rank (what :func:`acting_as` switches to)
_worlds: dict[int, _WorldData] = {}


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
        #: the default group is the one simdist made before the rank's function ran, and the function's own
        #: ``init_process_group`` has not claimed it yet. A name bound before the run (``from torch.distributed
        #: import init_process_group``) is torch's own function, which would refuse it as made twice: until it is
        #: claimed, that function's check does not see it, and simdist's group helper hands it back instead.
        self.premade = False


def current() -> _WorldData:
    """The calling thread's world (created empty on first use)."""
    w = getattr(_tls, "world", None)
    if w is None:
        w = _tls.world = _WorldData()
    return w


def _field(name: str) -> property:
    def get(self: object) -> object:
        return getattr(current(), name)

    def put(self: object, value: object) -> None:
        setattr(current(), name, value)

    return property(get, put)


def _default_pg() -> property:
    def get(self: object) -> object:
        world = current()
        # the caller of GroupMember.WORLD's getter (frame 1) is frame 2
        if world.premade and sys._getframe(2).f_code is _TORCH_INIT_CODE:
            return None
        return world.default_pg

    def put(self: object, value: object) -> None:
        world = current()
        world.default_pg = value
        if value is None:  # destroyed: the next group is the program's own
            world.premade = False

    return property(get, put)


class ThreadLocalWorld(c10d._World):
    """``distributed_c10d._World`` whose every field is per thread."""

    default_pg = _default_pg()
    pg_map = _field("pg_map")
    pg_names = _field("pg_names")
    pg_group_ranks = _field("pg_group_ranks")
    pg_backend_config = _field("pg_backend_config")
    group_count = _field("group_count")
    tags_to_pg = _field("tags_to_pg")
    pg_to_tag = _field("pg_to_tag")
    pg_coalesce_state = _field("pg_coalesce_state")
    comms = _field("comms")


def register(rank: int) -> None:
    """Remember the calling thread's world as ``rank``'s."""
    _worlds[rank] = current()


def forget_all() -> None:
    """Forget every rank's world (the run is over)."""
    _worlds.clear()


def forget_thread() -> None:
    """Drop the calling rank thread's groups (its world dies with the thread)."""
    c10d._unregister_all_process_groups()
    _tls.world = None


@contextlib.contextmanager
def acting_as(rank: int) -> Iterator[None]:
    """Let the calling (simulator) thread see ``rank``'s torch.distributed world.

    A future's callbacks run where the future completes: on real hardware in the rank's own process (a
    backend thread), here in the simulator's thread. Seeing the rank's world there makes
    ``dist.get_world_size()`` and friends inside a callback (e.g. a DDP comm hook's ``then``) answer as the
    rank would.
    """
    mine = getattr(_tls, "world", None)
    _tls.world = _worlds.get(rank, mine)
    try:
        yield
    finally:
        _tls.world = mine
