"""Check that the replicas of a data-parallel model hold the same values on every rank of a group.

Each rank fingerprints every parameter and buffer (a hash of its bytes, shape and dtype), the group
all-gathers the fingerprints, and every rank learns which tensors differ from the group's first rank and
on which ranks. Plain torch.distributed: it runs unchanged under simdist and under ``real``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class Divergence:
    """A tensor of the model whose value on ``ranks`` (global ranks) differs from the group's first rank."""

    name: str
    ranks: tuple[int, ...]


class ReplicaMismatch(AssertionError):
    """Replicas differ; ``name`` is the first differing tensor and ``ranks`` the ranks that differ on it."""

    def __init__(self, divergences: list[Divergence], first_rank: int) -> None:
        self.divergences = divergences
        self.name = divergences[0].name
        self.ranks = divergences[0].ranks
        others = [d.name for d in divergences[1:]]
        more = f"; {len(others)} more differ: {', '.join(others[:5])}{', ...' if len(others) > 5 else ''}"
        super().__init__(
            f"replicas diverge at {self.name!r}: ranks {list(self.ranks)} hold values other than rank "
            f"{first_rank}'s{more if others else ''}"
        )


def fingerprint(tensor: torch.Tensor) -> int:
    """A 64-bit signed hash of ``tensor``'s dtype, shape and bytes (equal exactly when bitwise equal)."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
    digest = hashlib.blake2b(data, digest_size=8)
    digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    return int.from_bytes(digest.digest(), "little", signed=True)


def check_replicas(
    module: nn.Module, group: dist.ProcessGroup | None = None, *, buffers: bool = True
) -> list[Divergence]:
    """Every parameter (and buffer) whose value differs across ``group``, in ``named_parameters`` order.

    Collective: every rank of the group must call it, with the same architecture. Returns the same list on
    every rank; an empty list means the replicas are bitwise identical.
    """
    named = list(module.named_parameters())
    if buffers:
        named += list(module.named_buffers())
    device = named[0][1].device if named else torch.device("cpu")
    mine = torch.tensor([fingerprint(t) for _, t in named], dtype=torch.int64, device=device)
    size = dist.get_world_size(group)
    gathered = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(gathered, mine, group=group)
    global_rank = [r if group is None else dist.get_global_rank(group, r) for r in range(size)]
    divergences = []
    for index, (name, _) in enumerate(named):
        differ = tuple(global_rank[r] for r in range(1, size) if gathered[r][index] != gathered[0][index])
        if differ:
            divergences.append(Divergence(name, differ))
    return divergences


def assert_replicas_equal(
    module: nn.Module, group: dist.ProcessGroup | None = None, *, buffers: bool = True
) -> None:
    """Raise :class:`ReplicaMismatch` naming the first differing tensor if the replicas are not identical."""
    divergences = check_replicas(module, group, buffers=buffers)
    if divergences:
        first = 0 if group is None else dist.get_global_rank(group, 0)
        raise ReplicaMismatch(divergences, first)
