"""Per-rank memory and step time of data-parallel variants on one transformer-like model, beside the ZeRO formulas.

Prints figures; it is not a test. Usage: ``python benchmarks/fsdp_bench.py [--quick] [--json PATH]
[--ranks 8] [--steps 3]``.

The model (:class:`TinyGPT`) is an embedding, ``layers`` pre-norm blocks of causal self-attention and a 4x MLP
(``nn.Linear``, ``nn.LayerNorm``) and an untied output projection: every parameter is float32 (the master
copy), and the forward runs in bfloat16 (``torch.autocast`` for DDP and ZeRO-1, FSDP2's ``param_dtype``).
The optimizer is Adam in float32. It trains ``--steps`` steps under ``simdist.run(..., memory=True)`` on the
``dgx-h100`` preset (8 H100s, NVLink through NVSwitch) with the compute model on.

Each variant in :data:`VARIANTS` builds the wrapped model and its optimizer from the plain model; adding a
strategy is adding an entry. Per variant the table gives, for the rank with the most of each:
- the most bytes each category (``parameters``, ``gradients``, ``optimizer_state``, ``activations``) held at
  any moment of the last step (the maxima of simdist's memory counter track, :func:`step_maxima`), and the
  most live bytes of all categories together in that step (``peak``);
- what the variant's own precision predicts for the model states (``expected``), and the ZeRO paper's
  mixed-precision formula (Rajbhandari et al. 2020, section 5.1): DDP 16 Psi, ZeRO-1 4 Psi + 12 Psi / N,
  ZeRO-3 (FSDP) 16 Psi / N bytes per rank, Psi = the number of parameter elements;
- the simulated time of the last step: from the moment every rank starts it (after a barrier and a device
  synchronize) until the last rank's device finishes it.

Precision: the paper keeps fp16 parameters and gradients (2 + 2 bytes) beside an fp32 master copy, momentum and
variance (12 bytes). Here the model's own parameters are the fp32 master (4 bytes) and their gradients are
fp32 (4 bytes); Adam keeps momentum and variance (8 bytes) and a 4-byte step counter per parameter tensor. The
bf16 copies of the weights exist only while a forward or backward uses them (autocast's casts, FSDP2's
all-gathered units). So DDP holds 4 + 4 + 8 = 16 Psi as in the paper, ZeRO-1 4 Psi + 4 Psi + 8 Psi / N (the
fp32 parameters cannot be sharded, since the model computes with them), FSDP 16 Psi / N.
"""

from __future__ import annotations

import argparse
import json
import platform
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

import simdist
from simdist.strategies import ShardedOptimizer
from simdist.strategies.fsdp import FSDP, chunk_size, is_linear_or_embedding
from simdist.strategies.zero import partition_parameters

#: memory categories the table reports (simdist's names, docs/memory.md)
CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations")
#: Adam as every variant uses it, with ``foreach=True``: torch's default on CUDA (on CPU it would step one
#: tensor at a time, and the simulated H100 would pay a kernel launch per op per parameter)
LR = 1e-3


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of :class:`TinyGPT` and its batch (per rank)."""

    dim: int = 512
    layers: int = 4
    heads: int = 8
    vocab: int = 8192
    seq: int = 128
    batch: int = 2


FULL = ModelConfig()
QUICK = ModelConfig(dim=256, layers=2, heads=4, vocab=4096, seq=64, batch=2)


class Block(nn.Module):
    """Pre-norm causal self-attention and a 4x GELU MLP, each with a residual."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(attn)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    """Token embedding, ``layers`` blocks, a final LayerNorm and an untied output projection."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg.dim, cfg.heads) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


# ------------------------------------------------------------------------------------ variants


@dataclass
class Wrapped:
    """A variant's training objects: the model to call, its optimizer, and what runs between backward and step."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    #: run the forward under bf16 autocast (variants whose wrapper does not cast the parameters itself)
    autocast: bool = False
    finish: Callable[[], None] | None = None


#: (Psi, N, parameter tensors P) -> bytes per rank of (parameters, gradients, optimizer state) this run's
#: precision predicts, for a rank holding an equal share
Expected = Callable[[int, int, int], tuple[float, float, float]]


@dataclass(frozen=True)
class Variant:
    """How to wrap the plain model, and what the formulas say about it."""

    build: Callable[[nn.Module], Wrapped]
    #: model-state bytes per rank in this run's precision (fp32 master, fp32 gradients, Adam in fp32)
    expected: Expected
    #: the ZeRO paper's mixed-precision bytes per rank, (Psi, N) -> bytes
    paper: Callable[[int, int], float]
    note: str = ""
    #: for a variant whose split is not even: (the plain model, N) -> bytes per rank, used instead of ``expected``
    expected_for: Callable[[nn.Module, int], tuple[float, float, float]] | None = None


def adam(params: object) -> torch.optim.Optimizer:
    """Adam over ``params`` (a model's parameters), fp32 state."""
    return torch.optim.Adam(params, lr=LR, foreach=True)  # type: ignore[arg-type]


def ddp(net: nn.Module) -> Wrapped:
    """torch DDP, gradients as views of its buckets (one gradient copy), Adam on every rank."""
    model = DistributedDataParallel(net, gradient_as_bucket_view=True)
    return Wrapped(model, adam(model.parameters()), autocast=True)


def ddp_default(net: nn.Module) -> Wrapped:
    """torch DDP with its defaults: buckets beside the gradients."""
    model = DistributedDataParallel(net)
    return Wrapped(model, adam(model.parameters()), autocast=True)


def zero1(net: nn.Module) -> Wrapped:
    """torch DDP (gradients as bucket views) and simdist's ShardedOptimizer over Adam: ZeRO stage 1."""
    model = DistributedDataParallel(net, gradient_as_bucket_view=True)
    return Wrapped(model, ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=LR, foreach=True), autocast=True)


def fsdp2(reshard_after_forward: bool) -> Callable[[nn.Module], Wrapped]:
    """torch's FSDP2: each block one unit, the rest (embedding, norm, head) the root unit; bf16 compute, fp32 reduce."""

    def build(net: nn.Module) -> Wrapped:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in net.blocks:  # type: ignore[union-attr]
            fully_shard(block, mp_policy=mp, reshard_after_forward=reshard_after_forward)
        fully_shard(net, mp_policy=mp, reshard_after_forward=reshard_after_forward)
        return Wrapped(net, adam(net.parameters()))

    return build


def project_fsdp(reshard_after_forward: bool) -> Callable[[nn.Module], Wrapped]:
    """simdist's FSDP: every Linear and Embedding weight its own unit, the rest replicated; bf16 compute."""

    def build(net: nn.Module) -> Wrapped:
        model = FSDP(net, compute_dtype=torch.bfloat16, reshard_after_forward=reshard_after_forward)
        return Wrapped(model, adam(model.parameters()), finish=model.finish_gradient_synchronization)

    return build


def project_fsdp_states(net: nn.Module, n: int) -> tuple[float, float, float]:
    """simdist's FSDP: a sharded weight's chunk is ceil(numel / N) (the last padded), the other parameters are
    replicated; fp32 masters and gradients, Adam's moments for each, one step counter per parameter tensor."""
    held = 0
    tensors = 0
    for module in net.modules():
        for name, param in module.named_parameters(recurse=False):
            tensors += 1
            sharded = name == "weight" and is_linear_or_embedding(module)
            held += chunk_size(param.numel(), n) if sharded else param.numel()
    return 4 * held, 4 * held, 8 * held + 4 * tensors


def replicated_states(psi: int, n: int, p: int) -> tuple[float, float, float]:
    """DDP: fp32 parameters, fp32 gradients, Adam's two moments and step counters, all replicated."""
    return 4 * psi, 4 * psi, 8 * psi + 4 * p


def zero1_states(psi: int, n: int, p: int) -> tuple[float, float, float]:
    """ZeRO-1: parameters and gradients replicated, Adam's state for 1/N of them."""
    return 4 * psi, 4 * psi, (8 * psi + 4 * p) / n


def sharded_states(psi: int, n: int, p: int) -> tuple[float, float, float]:
    """ZeRO-3 / FSDP: everything sharded (FSDP2 keeps a step counter per parameter on every rank)."""
    return 4 * psi / n, 4 * psi / n, 8 * psi / n + 4 * p


VARIANTS: dict[str, Variant] = {
    "torch DDP": Variant(ddp, replicated_states, lambda psi, n: 16 * psi, "gradient_as_bucket_view=True"),
    "torch DDP (default)": Variant(ddp_default, replicated_states, lambda psi, n: 16 * psi,
                                   "buckets are a second gradient copy"),
    "ZeRO-1": Variant(zero1, zero1_states, lambda psi, n: 4 * psi + 12 * psi / n, "DDP + ShardedOptimizer"),
    "torch FSDP2": Variant(fsdp2(True), sharded_states, lambda psi, n: 16 * psi / n, "reshard_after_forward=True"),
    "torch FSDP2 (no reshard)": Variant(fsdp2(False), sharded_states, lambda psi, n: 16 * psi / n,
                                        "reshard_after_forward=False"),
    "FSDP": Variant(project_fsdp(True), sharded_states, lambda psi, n: 16 * psi / n,
                    "simdist.strategies.fsdp, reshard_after_forward=True", project_fsdp_states),
    "FSDP (no reshard)": Variant(project_fsdp(False), sharded_states, lambda psi, n: 16 * psi / n,
                                 "simdist.strategies.fsdp, reshard_after_forward=False", project_fsdp_states),
}


# ------------------------------------------------------------------------------------ measuring


def train(name: str, cfg: ModelConfig, steps: int) -> tuple[float, float]:
    """Rank code: ``steps`` steps of variant ``name``; the last step's (start, end) in simulated seconds."""
    torch.manual_seed(0)
    wrapped = VARIANTS[name].build(TinyGPT(cfg))
    g = torch.Generator().manual_seed(dist.get_rank())
    span = (0.0, 0.0)
    for _ in range(steps):
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=g)
        dist.barrier()
        simdist.synchronize()  # every rank starts the step together, its device drained
        start = simdist.now()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=wrapped.autocast):
            logits = wrapped.model(tokens[:, :-1])
        F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
        if wrapped.finish is not None:
            wrapped.finish()
        wrapped.optimizer.step()
        wrapped.optimizer.zero_grad()
        simdist.synchronize()
        span = (start, simdist.now())
    return span


def step_maxima(res: simdist.RunResult, rank: int, start: float, end: float) -> dict[str, float]:
    """The most bytes each memory category (and ``"total"``, all categories) held on ``rank`` in [start, end].

    The window is one training step: building and wrapping the model (every rank holds the full fp32 model
    before FSDP2 shards it) comes before it and is not what the formulas describe.
    """
    track = [c for c in res.trace.counters if c.rank == rank and c.name == "memory"]
    before = [c for c in track if c.time <= start]
    samples = before[-1:] + [c for c in track if start < c.time <= end]
    out = {k: max(c.values.get(k, 0.0) for c in samples) for k in CATEGORIES}
    out["total"] = max(sum(c.values.values()) for c in samples)
    return out


@dataclass
class Row:
    """One variant's figures over the last step: bytes per rank (the rank with the most of each), seconds."""

    name: str
    ranks: int
    psi: int
    tensors: int
    measured: dict[str, float] = field(default_factory=dict)
    per_rank_state: list[float] = field(default_factory=list)
    peak: int = 0
    step: float = 0.0
    expected: tuple[float, float, float] = (0.0, 0.0, 0.0)
    paper: float = 0.0
    note: str = ""

    @property
    def model_states(self) -> float:
        """Measured parameters + gradients + optimizer state (bytes)."""
        return sum(self.measured[k] for k in ("parameters", "gradients", "optimizer_state"))


def measure(name: str, cfg: ModelConfig, ranks: int = 8, steps: int = 3, device: str = "H100") -> Row:
    """Run variant ``name`` on ``ranks`` GPUs of the dgx-h100 preset and collect its row."""
    cluster = simdist.Cluster.preset("dgx-h100", gpus_per_node=ranks, device=device)
    res = simdist.run(train, cluster, args=(name, cfg, steps), memory=True)
    plain = TinyGPT(cfg)
    psi, tensors = sum(p.numel() for p in plain.parameters()), len(list(plain.parameters()))
    starts, ends = zip(*res.returns)
    maxima = [step_maxima(res, r, starts[r], ends[r]) for r in range(ranks)]
    variant = VARIANTS[name]
    return Row(
        name=name, ranks=ranks, psi=psi, tensors=tensors,
        measured={k: max(m[k] for m in maxima) for k in CATEGORIES},
        per_rank_state=[m["optimizer_state"] for m in maxima],
        peak=max(m["total"] for m in maxima),
        step=max(ends) - min(starts),
        expected=variant.expected_for(plain, ranks) if variant.expected_for else variant.expected(psi, ranks, tensors),
        paper=variant.paper(psi, ranks), note=variant.note,
    )


def zero1_shares(cfg: ModelConfig, ranks: int) -> list[tuple[int, int]]:
    """(elements, parameter tensors) each rank of ``ranks`` owns under ShardedOptimizer's partition."""
    numels = [p.numel() for p in TinyGPT(cfg).parameters()]
    owners = partition_parameters(numels, ranks)
    return [(sum(n for n, o in zip(numels, owners) if o == r), owners.count(r)) for r in range(ranks)]


def mib(x: float) -> str:
    """Bytes as MiB with one decimal."""
    return f"{x / 2**20:.1f}"


def table(rows: list[Row]) -> str:
    """The markdown table docs/fsdp.md shows."""
    head = ("| variant | params | grads | optim state | activations | model states (measured) | expected "
            "(this precision) | paper (mixed precision) | peak | step (ms) |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        lines.append(
            f"| {r.name} | {mib(r.measured['parameters'])} | {mib(r.measured['gradients'])} | "
            f"{mib(r.measured['optimizer_state'])} | {mib(r.measured['activations'])} | {mib(r.model_states)} | "
            f"{mib(sum(r.expected))} | {mib(r.paper)} | {mib(r.peak)} | {r.step * 1e3:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model (about 2.4M parameters)")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    cfg = QUICK if args.quick else FULL
    rows = []
    for name in VARIANTS:
        rows.append(measure(name, cfg, args.ranks, args.steps))
        print(f"measured {name}", flush=True)
    r0 = rows[0]
    print(f"\nTinyGPT {cfg}: Psi = {r0.psi:,} parameter elements in {r0.tensors} tensors "
          f"({mib(4 * r0.psi)} MiB fp32); {args.ranks} x H100 (dgx-h100 preset), Adam, bf16 compute, "
          f"{args.steps} steps; MiB per rank (the rank with the most of each); machine {platform.machine()}")
    print(table(rows))
    shares = zero1_shares(cfg, args.ranks)
    zero = next(r for r in rows if r.name == "ZeRO-1")
    print(f"ZeRO-1 shares (elements, tensors) per rank: {shares}")
    print("ZeRO-1 optimizer state per rank, measured vs 8 x elements + 4 x tensors: "
          + ", ".join(f"{mib(m)}/{mib(8 * e + 4 * t)}" for m, (e, t) in zip(zero.per_rank_state, shares)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": asdict(cfg), "rows": [asdict(r) for r in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
