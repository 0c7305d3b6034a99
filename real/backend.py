"""Choosing and checking the torch.distributed backend of a real run, before any process starts."""

from __future__ import annotations

import torch
import torch.distributed as dist

from real.errors import RealConfigError

BACKENDS = ("gloo", "nccl", "auto")


def resolve_backend(backend: str | None, nproc: int) -> str:
    """The backend to use ("gloo" or "nccl"); "auto"/None picks nccl when there is a GPU per process."""
    if backend is None or backend == "auto":
        return "nccl" if _gpu_count() >= nproc and dist.is_nccl_available() else "gloo"
    if backend == "gloo":
        if not dist.is_gloo_available():
            raise RealConfigError("backend 'gloo' is not available in this torch build; use 'nccl' or 'auto'")
        return "gloo"
    if backend == "nccl":
        _check_nccl(nproc)
        return "nccl"
    raise RealConfigError(f"backend {backend!r} is not supported; expected one of {', '.join(BACKENDS)}")


def emulated_backend(backend: str | None) -> str:
    """The backend real creates around a function on emulated CUDA devices: ``"nccl"`` (a gloo group presenting
    it) where the code asks for NCCL or leaves the choice (a GPU machine's), else gloo."""
    if backend is None or backend in ("auto", "nccl"):
        return "nccl"
    if backend == "gloo":
        return "gloo"
    raise RealConfigError(f"backend {backend!r} is not supported; expected one of {', '.join(BACKENDS)}")


def _check_nccl(nproc: int) -> None:
    """Raise unless this machine can give each of ``nproc`` processes its own CUDA device for NCCL."""
    if not torch.cuda.is_available():
        raise RealConfigError(
            f"backend 'nccl' needs CUDA GPUs, but torch.cuda.is_available() is False on this machine "
            f"(torch {torch.__version__}); use backend='gloo' for CPU processes, or 'auto' to pick one"
        )
    count = torch.cuda.device_count()
    if nproc > count:
        raise RealConfigError(
            f"backend 'nccl' gives each process its own GPU, but nproc={nproc} > {count} visible CUDA "
            f"device(s); lower nproc to at most {count} or use backend='gloo'"
        )
    if not dist.is_nccl_available():
        raise RealConfigError(
            f"backend 'nccl' is not built into this torch ({torch.__version__}); use backend='gloo'"
        )


def _gpu_count() -> int:
    """Visible CUDA devices, 0 without CUDA."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0
