"""The transformer block and the small language model the GPU measurements and their simulated twins share.

A pre-norm block as GPT-style models write it: layer norm, fused QKV projection, scaled-dot-product attention,
output projection, residual; layer norm, MLP (4x, GELU), residual. Plain torch: the same module runs on a GPU,
on a CPU, on the meta device (simdist's memory and time estimates) and inside a simulated run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class BlockShape:
    """A block's width and the activations it sees: ``batch`` sequences of ``seq`` tokens of ``d_model``."""

    d_model: int
    heads: int
    batch: int
    seq: int

    @property
    def label(self) -> str:
        """The shape in one line, e.g. "d1024 h16 b8 s1024"."""
        return f"d{self.d_model} h{self.heads} b{self.batch} s{self.seq}"


class Block(nn.Module):
    """One pre-norm transformer block (attention and a 4x GELU MLP), bias everywhere as GPT-2 has it."""

    def __init__(self, d_model: int, heads: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d_model, dtype=dtype)
        self.qkv = nn.Linear(d_model, 3 * d_model, dtype=dtype)
        self.proj = nn.Linear(d_model, d_model, dtype=dtype)
        self.norm2 = nn.LayerNorm(d_model, dtype=dtype)
        self.up = nn.Linear(d_model, 4 * d_model, dtype=dtype)
        self.down = nn.Linear(4 * d_model, d_model, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyGPT(nn.Module):
    """Token embedding, learned positions, ``layers`` blocks, a final norm and an untied vocabulary head."""

    def __init__(self, vocab: int, d_model: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(seq, d_model))
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def block(shape: BlockShape, dtype: torch.dtype, device: torch.device | str, seed: int = 0) -> Block:
    """A block of ``shape`` built and initialised on ``device`` itself, in ``dtype``, from ``seed``."""
    torch.manual_seed(seed)  # seeds every device's generator
    with torch.device(device):
        return Block(shape.d_model, shape.heads, dtype)


def block_input(
    shape: BlockShape, dtype: torch.dtype, device: torch.device | str, seed: int = 1
) -> torch.Tensor:
    """The activations a block of ``shape`` takes: (batch, seq, d_model), drawn on ``device`` from ``seed``."""
    size = (shape.batch, shape.seq, shape.d_model)
    if torch.device(device).type == "meta":
        return torch.empty(size, dtype=dtype, device="meta")
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(size, generator=gen, device=device, dtype=dtype)
