"""GPU code on real processes without GPUs: each rank process emulates its node's CUDA devices (``--emulate-cuda``).

A script written for GPUs (``init_process_group("nccl")``, ``torch.cuda.set_device(LOCAL_RANK)``,
``model.to("cuda")``) then runs on gloo processes of a machine without GPUs, with simdist's simulated CUDA device
in each process (:mod:`simdist.cudart.process`): tensors on ``cuda:i`` compute on the CPU with the CPU kernels, so
the results are those of the same file under ``simdist.run``. Groups asked for with NCCL are gloo groups that
present the name asked for (``dist.get_backend()`` answers ``"nccl"``), as in a simulated run.

simdist is imported here only when a launch asks for the emulation: ``real`` itself needs torch alone.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from real import init_guard
from real.errors import RealConfigError

#: the GPU model emulated unless the launch names another (simdist's device presets)
DEFAULT_MODEL = "H100"


@dataclass(frozen=True)
class EmulatedCuda:
    """The simulated CUDA devices each rank process has: ``devices`` per node (None: one per local rank, as a
    GPU node gives torchrun's processes), of the GPU model ``model`` (a simdist device preset: its name,
    memory and properties)."""

    devices: int | None = None
    model: str = DEFAULT_MODEL

    def __post_init__(self) -> None:
        devices = self.devices
        if devices is not None and (isinstance(devices, bool) or not isinstance(devices, int) or devices < 1):
            raise RealConfigError(
                f"the emulated CUDA devices per node must be a positive int (or None: one per local rank); got "
                f"{devices!r}"
            )
        if not isinstance(self.model, str) or not self.model:
            raise RealConfigError(
                f"the emulated GPU model must be a device preset's name, e.g. 'H100'; got {self.model!r}"
            )

    def check(self, nproc: int) -> None:
        """Refuse, before any process starts, an emulation this machine cannot run: simdist missing, a torch whose
        native layout it does not know, a model that is not a GPU, fewer devices than local ranks."""
        try:
            from simdist.compute.devices import get_device
            from simdist.cuda import native
        except ImportError as exc:
            raise RealConfigError(
                f"--emulate-cuda runs each process on simdist's simulated CUDA device, but simdist cannot be imported "
                f"here ({exc}); install simdist with its dependencies (pip install -e . in its repository), or run "
                f"the script without --emulate-cuda (on GPUs, or written for the CPU)"
            ) from exc
        problems = native.problems()
        if problems:
            raise RealConfigError(f"--emulate-cuda cannot run in this process: {'; '.join(problems)}")
        try:
            spec = get_device(self.model)
        except (KeyError, ValueError) as exc:
            raise RealConfigError(f"--emulate-cuda: no GPU model named {self.model!r} ({exc})") from exc
        if not spec.is_gpu:
            raise RealConfigError(
                f"--emulate-cuda: {self.model!r} is not a GPU model; name one such as 'H100'"
            )
        if self.devices is not None and self.devices < nproc:
            raise RealConfigError(
                f"{nproc} processes on this node but {self.devices} emulated CUDA "
                f"{'device' if self.devices == 1 else 'devices'} per node: each local rank "
                f"needs its own device, as under torchrun on a GPU node; give at least {nproc} devices or leave the "
                f"count out (one per local rank)"
            )


@contextlib.contextmanager
def emulating(emulation: EmulatedCuda) -> Iterator[None]:
    """This rank process runs the block on its simulated CUDA devices, with NCCL groups made over gloo."""
    from simdist.cudart.process import emulated_process

    devices = emulation.devices or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    with emulated_process(devices, rank=int(os.environ["RANK"]), device=emulation.model), nccl_over_gloo():
        yield


def over_gloo(backend: Any) -> tuple[str, str] | None:
    """(the gloo backend to create, the name to present) for a backend naming NCCL (or none: a GPU machine's
    default is ``"cpu:gloo,cuda:nccl"``); None where the backend names no NCCL."""
    if backend is None or str(backend).lower() in ("", "undefined"):
        return "gloo", "cpu:gloo,cuda:nccl"
    if "nccl" not in init_guard.backends_named(backend):
        return None
    return "gloo", str(backend)


def _present(pg: dist.ProcessGroup, name: str) -> None:
    """Make torch's bookkeeping of ``pg`` (``get_backend``, ``get_backend_config``) show ``name``."""
    world = c10d._world
    if pg not in world.pg_map:
        return
    backend = dist.Backend(name)
    _, store = world.pg_map[pg]
    world.pg_map[pg] = (backend, store)
    world.pg_backend_config[pg] = str(c10d.BackendConfig(backend))


def _translated_init(init: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``init_process_group`` asking for NCCL: a gloo group presenting the name asked for."""
    try:
        call = inspect.signature(init).bind(*args, **kwargs).arguments
    except TypeError:
        return init(*args, **kwargs)  # torch's own error for arguments it does not take
    from simdist.cudart.api import bind_group  # only a process emulating CUDA imports simdist

    bind_group(call.get("device_id"))
    plan = over_gloo(call.get("backend"))
    if plan is None:
        return init(*args, **kwargs)
    call["backend"] = plan[0]
    result = init(**call)
    _present(c10d._get_default_group(), plan[1])
    return result


@contextlib.contextmanager
def nccl_over_gloo() -> Iterator[None]:
    """``init_process_group`` and ``new_group`` asking for NCCL make gloo groups that present the name asked for."""
    helper = c10d._new_process_group_helper

    def new_group_helper(
        group_size: int, group_rank: int, global_ranks: Any, backend: Any, *args: Any, **kwargs: Any
    ) -> Any:
        plan = over_gloo(backend)
        if plan is None:
            return helper(group_size, group_rank, global_ranks, backend, *args, **kwargs)
        pg, store = helper(group_size, group_rank, global_ranks, dist.Backend(plan[0]), *args, **kwargs)
        if pg is not c10d.GroupMember.NON_GROUP_MEMBER:
            _present(pg, plan[1])
        return pg, store

    # a CPU build has no NCCL timeout, and torch warns at every new group named "nccl" without one
    nccl_timeout = c10d.default_pg_nccl_timeout
    c10d._new_process_group_helper = new_group_helper
    c10d.default_pg_nccl_timeout = nccl_timeout or c10d.default_pg_timeout
    try:
        with init_guard.intercepted(_translated_init):
            yield
    finally:
        c10d._new_process_group_helper = helper
        c10d.default_pg_nccl_timeout = nccl_timeout
