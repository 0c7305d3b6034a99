"""Models and rank functions for the data-parallel strategy tests, importable by real worker processes.

A model is described by a :class:`ModelSpec` (picklable, so hypothesis can draw it and ``real`` can send
it): an embedding, a few tanh Linear layers and an output projection, with optional ties (the output
projection reusing the embedding matrix, two Linear layers sharing one weight Parameter, a Linear applied
twice), a layer forward never uses, frozen parameters and a buffer. Every rank trains on its own shard; the oracle trains the same
model in one process on the concatenation of all shards.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from simdist.strategies import (
    BucketedDDP,
    FlatDDP,
    NaiveDDP,
    OverlapDDP,
    ReplicaMismatch,
    assert_replicas_equal,
    check_replicas,
)

LR = 0.1
WRAPPERS = {"naive": NaiveDDP, "flat": FlatDDP, "overlap": OverlapDDP, "bucketed": BucketedDDP}
#: the four strategies with their correct settings (bucketed with buckets small enough to be several)
CORRECT = [("naive", {}), ("flat", {}), ("overlap", {}), ("bucketed", {"bucket_cap_mb": 0.0002})]


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a small test model (see the module docstring)."""

    vocab: int = 5
    dim: int = 4
    layers: int = 2
    tie_out: bool = True  # output projection weight is the embedding matrix
    tie_hidden: bool = False  # hidden[1].weight is hidden[0].weight (needs layers >= 2)
    reuse_first: bool = False  # hidden[0] applied a second time
    unused: bool = False  # a Linear layer that forward never calls (its parameters get no gradient)
    frozen: int = 0  # bitmask over model.parameters() (the last one, the output bias, is never frozen)
    dtype: str = "float64"


class TiedNet(nn.Module):
    """The model a :class:`ModelSpec` describes."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab, spec.dim)
        self.hidden = nn.ModuleList(nn.Linear(spec.dim, spec.dim) for _ in range(spec.layers))
        self.unused = nn.Linear(spec.dim, spec.dim) if spec.unused else None
        self.out = nn.Linear(spec.dim, spec.vocab)
        if spec.tie_out:
            self.out.weight = self.embed.weight
        if spec.tie_hidden and spec.layers >= 2:
            self.hidden[1].weight = self.hidden[0].weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, spec.dim))
        params = list(self.parameters())
        for i, param in enumerate(params[:-1]):
            param.requires_grad_(not (spec.frozen >> i) & 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.hidden:
            h = torch.tanh(layer(h))
        if self.spec.reuse_first and self.spec.layers:
            h = torch.tanh(self.hidden[0](h))
        return self.out(h * self.scale)


def make_model(spec: ModelSpec, seed: int) -> TiedNet:
    """The model every replica starts from."""
    torch.manual_seed(seed)
    return TiedNet(spec).to(getattr(torch, spec.dtype))


def shard(
    spec: ModelSpec, seed: int, step: int, rank: int, micro: int, batch: int
) -> tuple[torch.Tensor, ...]:
    """Rank ``rank``'s (tokens, targets) for one micro-batch of one step."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank * 17 + micro)
    tokens = torch.randint(0, spec.vocab, (batch,), generator=g)
    return tokens, torch.randint(0, spec.vocab, (batch,), generator=g)


def perturb(model: nn.Module, rank: int) -> None:
    """Make this rank's copy differ, so only the broadcast at wrap time can make the replicas agree."""
    g = torch.Generator().manual_seed(5000 + rank)
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            t.add_(torch.randn(t.shape, generator=g, dtype=t.dtype))


def wrap(kind: str, model: nn.Module, group: Any = None, **options: Any) -> nn.Module:
    """One of the four strategies, or torch's own DistributedDataParallel (``kind="torch"``)."""
    if kind == "torch":
        return DistributedDataParallel(model, process_group=group, **options)
    return WRAPPERS[kind](model, group, **options)


def finish(ddp: nn.Module) -> None:
    """End a synchronising backward (torch's DDP finishes on its own)."""
    if hasattr(ddp, "finish_gradient_synchronization"):
        ddp.finish_gradient_synchronization()


def train_one(
    spec: ModelSpec,
    kind: str,
    options: dict[str, Any],
    steps: int,
    batch: int,
    seed: int,
    accumulate: bool = False,
    group: Any = None,
) -> dict[str, Any]:
    """Train one wrapped replica for ``steps`` SGD steps; its state dict after wrapping, final parameters.

    With ``accumulate`` each step is two micro-batches, the first one inside ``no_sync()``.
    """
    rank = dist.get_rank()
    model = make_model(spec, seed)
    if rank != 0:
        perturb(model, rank)
    ddp = wrap(kind, model, group, **options)
    initial = {key: value.clone() for key, value in model.state_dict().items()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=LR)
    for step in range(steps):
        micros = (0, 1) if accumulate else (0,)
        for micro in micros:
            tokens, targets = shard(spec, seed, step, rank, micro, batch)
            sync = micro == micros[-1]
            with contextlib.nullcontext() if sync else ddp.no_sync():
                loss = F.cross_entropy(ddp(tokens), targets) / len(micros)
                loss.backward()
        finish(ddp)
        optimizer.step()
        optimizer.zero_grad()
    return {"initial": initial, "final": [p.detach().clone() for p in model.parameters()]}


def train_variants(
    spec: ModelSpec,
    variants: list[tuple[str, dict[str, Any]]],
    steps: int,
    batch: int,
    seed: int,
    accumulate: bool = False,
) -> dict[str, list[torch.Tensor]]:
    """Rank function: every variant trained in turn; each variant's final parameters, keyed by index."""
    return {
        f"{i}:{kind}": train_one(spec, kind, options, steps, batch, seed, accumulate)["final"]
        for i, (kind, options) in enumerate(variants)
    }


def train_in_halves(spec: ModelSpec, kind: str, steps: int, batch: int, seed: int) -> dict[str, Any]:
    """Rank function: the world split into two groups (first half, second half), each training on its own."""
    n, rank = dist.get_world_size(), dist.get_rank()
    halves = [list(range(n // 2)), list(range(n // 2, n))]
    groups = [dist.new_group(ranks) for ranks in halves]  # every rank creates every group
    mine = groups[0] if rank in halves[0] else groups[1]
    return train_one(spec, kind, {}, steps, batch, seed, group=mine)


def single_process(
    spec: ModelSpec,
    steps: int,
    batch: int,
    seed: int,
    ranks: list[int],
    accumulate: bool = False,
    initial: dict[str, torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """The oracle: the same model trained in one process on the union of ``ranks``' shards.

    ``initial`` (a state dict) replaces the seeded initial state.
    """
    model = make_model(spec, seed)
    if initial is not None:
        model.load_state_dict(initial)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    micros = (0, 1) if accumulate else (0,)
    for step in range(steps):
        pieces = [shard(spec, seed, step, r, m, batch) for r in ranks for m in micros]
        tokens = torch.cat([p[0] for p in pieces])
        targets = torch.cat([p[1] for p in pieces])
        F.cross_entropy(model(tokens), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def one_step(spec: ModelSpec, kind: str, options: dict[str, Any], batch: int = 3) -> None:
    """Rank function: wrap and run one synchronising step (for counting collectives in the trace)."""
    train_one(spec, kind, options, steps=1, batch=batch, seed=0)


def step_then_check(spec: ModelSpec, kind: str, options: dict[str, Any]) -> dict[str, Any]:
    """Rank function: one step, then the replica check and the assertion's message (what a scenario shows)."""
    rank = dist.get_rank()
    model = make_model(spec, 0)
    ddp = wrap(kind, model, None, **options)
    tokens, targets = shard(spec, 0, 0, rank, 0, 4)
    F.cross_entropy(ddp(tokens), targets).backward()
    finish(ddp)
    torch.optim.SGD(model.parameters(), lr=LR).step()
    try:
        assert_replicas_equal(model)
        message = None
    except ReplicaMismatch as exc:
        message = str(exc)
    return {"divergences": check_replicas(model), "message": message}


def backward_in_no_sync(spec: ModelSpec, kind: str) -> None:
    """Rank function: a whole step inside ``no_sync()`` (it must issue no collective)."""
    ddp = wrap(kind, make_model(spec, 0))
    tokens, targets = shard(spec, 0, 0, dist.get_rank(), 0, 3)
    with ddp.no_sync():
        F.cross_entropy(ddp(tokens), targets).backward()
    finish(ddp)


def backward_twice(spec: ModelSpec, kind: str) -> None:
    """Rank function: two synchronising backward passes without a finish in between (an error)."""
    ddp = wrap(kind, make_model(spec, 0))
    for _ in range(2):
        tokens, targets = shard(spec, 0, 0, dist.get_rank(), 0, 3)
        F.cross_entropy(ddp(tokens), targets).backward()


def wrap_outside_group(kind: str) -> None:
    """Rank function: every rank wraps with a group holding only rank 0 (an error on the others)."""
    group = dist.new_group([0])
    wrap(kind, nn.Linear(2, 2), group)


def real_suite(spec: ModelSpec, steps: int, batch: int, seed: int) -> dict[str, Any]:
    """Rank function for one real launch: the four strategies, plain and with gradient accumulation."""
    return {
        "plain": train_variants(spec, CORRECT, steps, batch, seed),
        "accumulate": train_variants(spec, CORRECT, steps, batch, seed, accumulate=True),
    }


def grads_of(spec: ModelSpec, kind: str, options: dict[str, Any], batch: int) -> list[torch.Tensor]:
    """Rank function: the synchronised gradients of one forward/backward."""
    rank = dist.get_rank()
    model = make_model(spec, 0)
    ddp = wrap(kind, model, None, **options)
    tokens, targets = shard(spec, 0, 0, rank, 0, batch)
    F.cross_entropy(ddp(tokens), targets).backward()
    finish(ddp)
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def torch_and_bucketed_grads(
    spec: ModelSpec, bucket_cap_mb: float, batch: int
) -> dict[str, list[torch.Tensor]]:
    """Rank function: gradients from torch's DDP and from BucketedDDP with the same bucket cap."""
    return {
        kind: grads_of(spec, kind, {"bucket_cap_mb": bucket_cap_mb}, batch) for kind in ("torch", "bucketed")
    }


def single_process_grads(spec: ModelSpec, batch: int, ranks: list[int]) -> list[torch.Tensor]:
    """The oracle's gradients of one forward/backward on the union of ``ranks``' shards."""
    model = make_model(spec, 0)
    pieces = [shard(spec, 0, 0, r, 0, batch) for r in ranks]
    F.cross_entropy(model(torch.cat([p[0] for p in pieces])), torch.cat([p[1] for p in pieces])).backward()
    return [p.grad.clone() for p in model.parameters()]
