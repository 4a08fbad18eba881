"""Benchmark workloads: a GPT-2-style stack of pre-LN transformer blocks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


class GPT2Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False, is_causal=False)[0]
        return x + self.mlp(self.ln2(x))


@dataclass(frozen=True)
class StackShape:
    layers: int
    dim: int
    heads: int
    batch: int
    seq: int

    def __str__(self) -> str:
        return f"{self.layers} layers, dim {self.dim}, {self.heads} heads, batch {self.batch} x seq {self.seq}"


# The embedded default workloads, sized so one step is tens of milliseconds on each device kind.
DEFAULT_SHAPES = {
    "cpu": StackShape(layers=6, dim=256, heads=4, batch=8, seq=128),
    "cuda": StackShape(layers=12, dim=1024, heads=16, batch=4, seq=1024),
}


def gpt2_stack(shape: StackShape, device: torch.device) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(GPT2Block(shape.dim, shape.heads) for _ in range(shape.layers)).to(device)


def gpt2_input(shape: StackShape, device: torch.device) -> torch.Tensor:
    return torch.randn(shape.batch, shape.seq, shape.dim, device=device)
