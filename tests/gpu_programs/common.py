"""What every program of the suite does the same way: pick its device as a GPU script does, and report."""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch
import torch.distributed as dist


def device(kind: str) -> torch.device:
    """The rank's device: its local GPU made current first, as GPU scripts do (``kind="cuda"``), or the CPU."""
    if kind == "cuda":
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def init(kind: str) -> None:
    """``init_process_group`` as a script written for ``kind`` calls it: NCCL on GPUs, gloo on CPUs."""
    dist.init_process_group("nccl" if kind == "cuda" else "gloo")


def host(value: Any) -> Any:
    """``value`` with every tensor copied to the host (what a rank returns and prints)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(host(v) for v in value)
    return value


def digest(value: Any) -> str:
    """A short hash of every tensor's bytes and every other value's text: what ``__main__`` prints, so that two
    launches can be compared bit for bit from their output."""
    h = hashlib.sha256()

    def feed(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            t = v.detach().cpu().contiguous().reshape(-1)
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(v, dict):
            for k in sorted(v):
                h.update(str(k).encode())
                feed(v[k])
        elif isinstance(v, (list, tuple)):
            for item in v:
                feed(item)
        else:
            h.update(repr(v).encode())

    feed(value)
    return h.hexdigest()[:16]


def report(name: str, value: Any) -> None:
    """Print the program's digest line (``name rank digest``) as the script's output."""
    print(
        f"{name} rank {dist.get_rank() if dist.is_initialized() else os.environ.get('RANK')} {digest(value)}"
    )
