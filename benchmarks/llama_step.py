"""A Llama-style training step written as GPU code, timed and sized without data: simdist.run(..., tensors="fake").

The model is Llama's shape (RMSNorm, causal self-attention, SwiGLU MLP, untied embedding and output head);
``--preset 7b`` is Llama 2 7B's (32 layers, hidden 4096, 32 heads, MLP 11008, vocabulary 32000: 6.74e9 parameters).
The step is plain torch: the model made on the rank's GPU, wrapped with FSDP2 (``fully_shard`` per block, bf16
parameters with fp32 reduction, fp32 AdamW state) or DDP (bf16 parameters, gradients and AdamW state), one
forward, backward and optimizer step. Prints the simulated step time and the peak device memory per rank,
with the wall time each run took. Figures and the machine: docs/performance.md.

    python3 benchmarks/llama_step.py                    # 7B: FSDP2 on 64 ranks, DDP on 512 ranks
    python3 benchmarks/llama_step.py --preset tiny --real   # a small size, fake beside real data
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Config:
    """A Llama-style model's shape and one step's batch (per rank)."""

    layers: int
    hidden: int
    heads: int
    mlp: int
    vocab: int
    batch: int
    seq: int


PRESETS = {
    "7b": Config(layers=32, hidden=4096, heads=32, mlp=11008, vocab=32000, batch=1, seq=2048),
    "tiny": Config(layers=2, hidden=64, heads=4, mlp=176, vocab=256, batch=2, seq=32),
}


class RMSNorm(nn.Module):
    """Llama's normalisation: x / rms(x), scaled per channel."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` normalised over its last dimension."""
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Block(nn.Module):
    """One transformer block: causal self-attention and a SwiGLU MLP, each after an RMSNorm, with residuals."""

    def __init__(self, c: Config) -> None:
        super().__init__()
        self.heads = c.heads
        self.attn_norm = RMSNorm(c.hidden)
        self.qkv = nn.Linear(c.hidden, 3 * c.hidden, bias=False)
        self.out = nn.Linear(c.hidden, c.hidden, bias=False)
        self.mlp_norm = RMSNorm(c.hidden)
        self.gate = nn.Linear(c.hidden, c.mlp, bias=False)
        self.up = nn.Linear(c.hidden, c.mlp, bias=False)
        self.down = nn.Linear(c.mlp, c.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block applied to ``x`` of shape (batch, seq, hidden)."""
        b, s, h = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.out(a.transpose(1, 2).reshape(b, s, h))
        y = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class Llama(nn.Module):
    """Embedding, ``layers`` blocks, a final norm and the output head."""

    def __init__(self, c: Config) -> None:
        super().__init__()
        self.embed = nn.Embedding(c.vocab, c.hidden)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.hidden)
        self.head = nn.Linear(c.hidden, c.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of shape (batch, seq, vocab)."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def parameters(c: Config) -> int:
    """The model's parameter count."""
    block = 2 * c.hidden + 4 * c.hidden * c.hidden + 3 * c.hidden * c.mlp
    return c.layers * block + 2 * c.vocab * c.hidden + c.hidden


def train_step(strategy: str, c: Config, steps: int = 1) -> None:
    """Rank code: build the model on this rank's GPU, wrap it with ``strategy`` ("fsdp2" or "ddp"), train ``steps``
    steps on random tokens. Plain torch: it runs unchanged under torchrun on GPUs."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    torch.manual_seed(0)
    if strategy == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        with dev:
            model = Llama(c)
        mesh = init_device_mesh("cuda", (dist.get_world_size(),))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        wrapped = fully_shard(model, mesh=mesh, mp_policy=mp)
    elif strategy == "ddp":
        with dev:
            model = Llama(c).to(torch.bfloat16)
        wrapped = nn.parallel.DistributedDataParallel(model, device_ids=[local])
    else:
        raise ValueError(f"strategy must be 'fsdp2' or 'ddp', got {strategy!r}")
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-4, foreach=True)
    gen = torch.Generator(device=dev).manual_seed(dist.get_rank())
    for _ in range(steps):
        tokens = torch.randint(c.vocab, (c.batch, c.seq + 1), device=dev, generator=gen)
        logits = wrapped(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def measure(
    strategy: str,
    c: Config,
    world: int,
    tensors: str,
    steps: int = 1,
    cluster: str = "dgx-h100",
    device: str | None = None,
    symmetric: bool = False,
) -> dict:
    """One simulated run: its simulated time (s), the largest per-rank peak memory (bytes), its wall time (s)."""
    import simdist

    t0 = time.perf_counter()
    res = simdist.run(
        train_step,
        simdist.Cluster.preset(cluster, world_size=world, **({"device": device} if device else {})),
        args=(strategy, c, steps),
        memory=True,
        trace="collectives",
        tensors=tensors,
        watchdog=math.inf,
        symmetric=symmetric,
    )
    wall = time.perf_counter() - t0
    return {
        "sim_time": res.sim_time,
        "peak": max(m.peak_bytes for m in res.memory),
        "wall": wall,
        "messages": res.messages,
    }


def main(argv: list[str] | None = None) -> None:
    """Time and size the step of each (strategy, world size) asked for (``argv``: the command line's arguments)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="7b")
    p.add_argument("--layers", type=int, default=None, help="override the preset's number of blocks")
    p.add_argument(
        "--run",
        action="append",
        default=None,
        metavar="STRATEGY:RANKS",
        help="e.g. fsdp2:64 (repeatable; default: fsdp2:64 and ddp:512)",
    )
    p.add_argument("--cluster", default="dgx-h100", help="the cluster preset (default dgx-h100)")
    p.add_argument("--device", default=None, help="the preset's GPU model instead of its own (e.g. H200)")
    p.add_argument("--real", action="store_true", help="also run with real data (small sizes only)")
    p.add_argument(
        "--symmetric",
        action="store_true",
        help="simulate a few sampled ranks op by op and time collectives in closed form (docs/symmetry.md)",
    )
    p.add_argument(
        "--nccl-algo",
        default=None,
        metavar="ALGO",
        help="NCCL_ALGO for the runs (e.g. Tree: a 512-rank ring all-reduce is 2 x 511 x 512 simulated "
        "messages, a tree's about 1,000)",
    )
    args = p.parse_args(argv)
    if args.nccl_algo:
        os.environ["NCCL_ALGO"] = args.nccl_algo  # each rank reads the process's environment, as NCCL does
    c = PRESETS[args.preset]
    if args.layers is not None:
        c = dataclasses.replace(c, layers=args.layers)
    algo = f"; NCCL_ALGO={args.nccl_algo}" if args.nccl_algo else ""
    algo += "; symmetric" if args.symmetric else ""
    print(
        f"model: {parameters(c) / 1e9:.2f}e9 parameters ({c}); cluster {args.cluster} of {args.device or 'its own'} GPUs"
        f"{algo}; torch {torch.__version__}"
    )
    for item in args.run or ["fsdp2:64", "ddp:512"]:
        strategy, ranks = item.split(":")
        for tensors in ("fake", "real") if args.real else ("fake",):
            m = measure(
                strategy,
                c,
                int(ranks),
                tensors,
                cluster=args.cluster,
                device=args.device,
                symmetric=args.symmetric,
            )
            print(
                f"{strategy:6} {int(ranks):4} ranks {tensors:4}: step {m['sim_time'] * 1e3:9.2f} ms simulated, peak "
                f"{m['peak'] / 2**30:7.2f} GiB per rank, {m['messages']} messages, {m['wall']:7.1f} s wall",
                flush=True,
            )


if __name__ == "__main__":
    main()
