"""The default group simdist makes for each rank is the one torch's own group helper makes.

simdist makes each rank's default group directly (``simdist.c10d.backend._made_default_group``); torch's
``_new_process_group_helper``, which a program's own ``init_process_group`` runs, is the oracle: every entry of
the rank's torch.distributed world, torch's group registry, the group's stores and what a program then does
with the group must be the same either way.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import simdist
from simdist.c10d import backend


def _world_view() -> dict[str, Any]:
    """The calling rank's torch.distributed world, with groups named by what they are rather than by identity."""
    world = c10d._world
    pg = world.default_pg
    name = lambda p: "default" if p is pg else f"group {getattr(p, 'group_name', p)}"
    backend_name, store = world.pg_map[pg]
    rank = dist.get_rank()
    store.set(f"probe{rank}", f"from {rank}")
    base = backend.active().store
    return {
        "type": type(pg).__name__,
        "rank, size": (pg.rank(), pg.size(), dist.get_rank(), dist.get_world_size()),
        "group name, desc": (pg.group_name, pg.group_desc, c10d._get_process_group_name(pg)),
        "backend": (type(backend_name).__name__, str(backend_name), dist.get_backend(), pg.name()),
        "config": (dist.get_backend_config(), [(name(k), v) for k, v in world.pg_backend_config.items()]),
        "pg_map": [(name(k), str(b), type(s).__name__) for k, (b, s) in world.pg_map.items()],
        "pg_names": [(name(k), v) for k, v in world.pg_names.items()],
        "pg_group_ranks": [
            (name(k), len(v), all(g == r for g, r in v.items())) for k, v in world.pg_group_ranks.items()
        ],
        "group_count": world.group_count,
        "tags_to_pg": {t: [name(p) for p in ps] for t, ps in world.tags_to_pg.items()},
        "pg_to_tag": [(name(k), v) for k, v in world.pg_to_tag.items()],
        "registry": c10d._resolve_process_group(pg.group_name) is pg,
        "store": (
            store.get(f"probe{rank}"),
            base.check([f"default_pg/{pg.group_name}//probe{rank}"]),
            base.check([f"default_pg/{pg.group_name}/probe{rank}"]),
        ),
        "initialized": dist.is_initialized(),
    }


def _program() -> dict[str, Any]:
    """What a rank sees of its default group before and after using it as programs do."""
    before = _world_view()
    # the program's own call keeps the group
    dist.init_process_group("nccl" if torch.cuda.is_available() else None)
    claimed = _world_view()
    sub = dist.new_group([0, 1])
    t = torch.full((4,), float(dist.get_rank() + 1), device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(t)
    after = _world_view()
    if dist.get_rank() < 2:
        dist.all_reduce(t, group=sub)
        after["sub"] = (
            sub.group_name,
            dist.get_backend(sub),
            c10d._resolve_process_group(sub.group_name) is sub,
        )
    dist.destroy_process_group()
    return {
        "before": before,
        "claimed": claimed,
        "after": after,
        "sum": t.tolist(),
        "gone": dist.is_initialized(),
    }


@pytest.mark.parametrize(
    "cluster, backend_name",
    [
        (lambda: simdist.Cluster.switch(3, device="cpu"), "simdist"),
        (lambda: simdist.Cluster.switch(3, device="cpu"), "gloo"),
        (lambda: simdist.Cluster.preset("dgx-h100", world_size=3), "nccl"),
    ],
    ids=["cpu-simdist", "cpu-gloo", "gpu-nccl"],
)
def test_each_rank_default_group_is_the_one_torch_helper_makes(
    cluster: Any, backend_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = simdist.run(_program, cluster(), backend_name=backend_name)
    monkeypatch.setattr(backend, "_BY_TORCH", True)
    by_torch = simdist.run(_program, cluster(), backend_name=backend_name)
    assert made.returns == by_torch.returns
    assert made.trace_hash == by_torch.trace_hash
    assert made.sim_time == by_torch.sim_time
    view = made.returns[1]["before"]
    assert view["registry"] and view["initialized"] and view["rank, size"] == (1, 3, 1, 3)
    assert view["backend"][2] == backend_name
