"""Models and rank functions for the FSDP tests, importable by real worker processes.

A model is described by a :class:`NetSpec` (picklable, so hypothesis can draw it and ``real`` can send it):
an embedding, a few tanh Linear layers (with biases, widths that rarely divide by the world size) and an
output projection, with optional ties (output projection = embedding matrix), a layer forward never uses and
frozen parameters. Every rank trains on its own shard of each step's batch; the reference trains the same
model in one process on the concatenation of all shards, with the same mixed precision: fp32 master
parameters, the forward run on copies cast to the compute dtype (``torch.func.functional_call``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from simdist.strategies.fsdp import FSDP, GradientAccumulator, Hazards

LR = 0.1


@dataclass(frozen=True)
class NetSpec:
    """The shape of a small test model (see the module docstring)."""

    vocab: int = 7
    dim: int = 5
    layers: int = 2
    tie_out: bool = True
    unused: bool = False
    #: bitmask over the model's parameters in order (the last one, the output bias, is never frozen)
    frozen: int = 0
    dtype: str = "float32"
    compute: str | None = None  # "bfloat16", "float16" or None
    adam: bool = False


class Net(nn.Module):
    """The model a :class:`NetSpec` describes."""

    def __init__(self, spec: NetSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab, spec.dim)
        self.hidden = nn.ModuleList(nn.Linear(spec.dim, spec.dim + i) for i in range(spec.layers))
        spec_in = spec.dim + spec.layers - 1 if spec.layers else spec.dim
        self.proj = nn.Linear(spec_in, spec.dim, bias=False)
        self.unused = nn.Linear(spec.dim, 3) if spec.unused else None
        self.out = nn.Linear(spec.dim, spec.vocab)
        if spec.tie_out:
            self.out.weight = self.embed.weight
        params = list(self.parameters())
        for i, param in enumerate(params[:-1]):
            param.requires_grad_(not (spec.frozen >> i) & 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.hidden:
            h = torch.tanh(layer(h))
            h = h[..., : self.spec.dim] if h.shape[-1] > self.spec.dim else h
        return self.out(torch.tanh(self.proj(torch.cat([h, h], -1)[..., : self.proj.in_features])))


def make_net(spec: NetSpec, seed: int) -> Net:
    """The model every rank starts from."""
    torch.manual_seed(seed)
    return Net(spec).to(getattr(torch, spec.dtype))


def batch(spec: NetSpec, seed: int, step: int, rank: int, micro: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s (tokens, targets) of one micro-batch of one step."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank * 17 + micro)
    return torch.randint(0, spec.vocab, (size,), generator=g), torch.randint(0, spec.vocab, (size,), generator=g)


def full_batch(spec: NetSpec, seed: int, step: int, world: int, micro: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The concatenation of every rank's micro-batch: what the single process trains on."""
    parts = [batch(spec, seed, step, r, micro, size) for r in range(world)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def optimizer_for(spec: NetSpec, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """SGD with momentum, or Adam: a state that a wrong gradient changes visibly."""
    trainable = [p for p in params if p.requires_grad]
    if spec.adam:
        return torch.optim.Adam(trainable, lr=0.01)
    return torch.optim.SGD(trainable, lr=LR, momentum=0.9)


def fsdp_train(
    spec: NetSpec,
    steps: int = 2,
    size: int = 3,
    seed: int = 0,
    micro: int = 1,
    accumulate: str = "no_sync",
    reshard: bool = True,
    hazards: Hazards | None = None,
) -> dict[str, torch.Tensor]:
    """Train with FSDP for ``steps`` optimizer steps of ``micro`` micro-batches; the final full parameters.

    ``accumulate="no_sync"`` runs every micro-batch but the last inside ``no_sync()``; ``"sync"`` reduces each
    micro-batch and sums the shards' gradients (torch semantics: ``.grad`` accumulates).
    """
    rank = dist.get_rank()
    compute = getattr(torch, spec.compute) if spec.compute else None
    model = FSDP(make_net(spec, seed), compute, reshard_after_forward=reshard, hazards=hazards)
    optimizer = optimizer_for(spec, list(model.parameters()))
    for step in range(steps):
        for m in range(micro):
            tokens, targets = batch(spec, seed, step, rank, m, size)
            last = m == micro - 1
            with contextlib.nullcontext() if last or accumulate == "sync" else model.no_sync():
                loss = F.cross_entropy(model(tokens).float(), targets) / micro
                loss.backward()
            if accumulate == "sync" or last:
                model.finish_gradient_synchronization()
        optimizer.step()
        optimizer.zero_grad()
    return model.gather_full_params()


def reference_train(
    spec: NetSpec,
    steps: int = 2,
    size: int = 3,
    seed: int = 0,
    micro: int = 1,
    world: int = 1,
    merged: bool = False,
    **_: Any,
) -> dict[str, torch.Tensor]:
    """The single-process model on every rank's data at once, with the same mixed precision as FSDP.

    ``merged``: each step is one backward on all ``micro`` micro-batches concatenated (the k-times larger
    batch), instead of ``micro`` accumulated backwards. A trainable parameter forward never used gets a zero
    gradient before the step, as FSDP gives it (every rank takes part in every reduction).
    """
    net = make_net(spec, seed)
    compute = getattr(torch, spec.compute) if spec.compute else None
    optimizer = optimizer_for(spec, list(net.parameters()))
    for step in range(steps):
        parts = [full_batch(spec, seed, step, world, m, size) for m in range(micro)]
        if merged:
            parts = [(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))]
        for tokens, targets in parts:
            if compute is None:
                logits = net(tokens)
            else:
                cast = {n: p.to(compute) for n, p in net.named_parameters()}
                logits = functional_call(net, cast, (tokens,), tie_weights=True)
            (F.cross_entropy(logits.float(), targets) / len(parts)).backward()
        for p in net.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def accumulator_train(spec: NetSpec, steps: int = 2, size: int = 3, seed: int = 0, micro: int = 2) -> dict[str, torch.Tensor]:
    """Accumulate ``micro`` synchronised micro-batches' shard gradients in a GradientAccumulator, then step."""
    rank = dist.get_rank()
    model = FSDP(make_net(spec, seed))
    optimizer = optimizer_for(spec, list(model.parameters()))
    acc = GradientAccumulator(micro)
    names = dict(model.named_parameters())
    for step in range(steps):
        for m in range(micro):
            tokens, targets = batch(spec, seed, step, rank, m, size)
            (F.cross_entropy(model(tokens), targets) / micro).backward()
            model.finish_gradient_synchronization()
            acc.add_gradients({n: p.grad for n, p in names.items()})
            optimizer.zero_grad()
        assert acc.is_complete
        for n, g in acc.get_and_clear_gradients().items():
            names[n].grad = g
        optimizer.step()
        optimizer.zero_grad()
    return model.gather_full_params()


def real_compare(spec: NetSpec, steps: int, size: int, seed: int) -> dict[str, float]:
    """On a real process group: FSDP's final parameters against the single-process model (max |diff| by name)."""
    ours = fsdp_train(spec, steps, size, seed)
    ref = reference_train(spec, steps, size, seed, world=dist.get_world_size())
    return {n: float((ours[n] - ref[n]).abs().max()) for n in ref}


class FunctionallyTied(nn.Module):
    """An embedding whose weight the output projection reads directly (``h @ embed.weight.T``): a weight used
    outside the module that owns it, as models that tie their head by function do."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 5)
        self.mid = nn.Linear(5, 5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.mid(self.embed(tokens))) @ self.embed.weight.T


def tied_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s (tokens, targets) of one step for :class:`FunctionallyTied`."""
    g = torch.Generator().manual_seed(step * 101 + rank)
    return torch.randint(0, 7, (3,), generator=g), torch.randint(0, 7, (3,), generator=g)


def tied_fsdp_train(reshard: bool, steps: int = 2) -> dict[str, torch.Tensor]:
    """:class:`FunctionallyTied` trained under FSDP; the final full parameters."""
    torch.manual_seed(0)
    model = FSDP(FunctionallyTied(), reshard_after_forward=reshard)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for step in range(steps):
        tokens, targets = tied_batch(step, dist.get_rank())
        F.cross_entropy(model(tokens), targets).backward()
        model.finish_gradient_synchronization()
        optimizer.step()
        optimizer.zero_grad()
    return model.gather_full_params()


def tied_reference_train(reshard: bool, steps: int = 2, world: int = 1) -> dict[str, torch.Tensor]:
    """:class:`FunctionallyTied` in one process on every rank's batch at once."""
    torch.manual_seed(0)
    net = FunctionallyTied()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    for step in range(steps):
        parts = [tied_batch(step, r) for r in range(world)]
        tokens, targets = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        F.cross_entropy(net(tokens), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def reference_by_rank(
    spec: NetSpec, steps: int = 2, size: int = 3, seed: int = 0, world: int = 2
) -> dict[str, torch.Tensor]:
    """The single-process model with data parallelism's arithmetic: each rank's batch is its own backward of
    ``loss / world``, so autograd adds the ranks' gradients, each summed over its own batch, as a reduction of
    ``world`` partial gradients does. (One backward on the concatenated batch sums in another order.)"""
    net = make_net(spec, seed)
    optimizer = optimizer_for(spec, list(net.parameters()))
    for step in range(steps):
        for rank in range(world):
            tokens, targets = batch(spec, seed, step, rank, 0, size)
            (F.cross_entropy(net(tokens), targets) / world).backward()
        for p in net.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in net.named_parameters()}
