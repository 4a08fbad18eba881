"""Small models shared by the tests: each exercises a different part of the checkpoint contract."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(16, width), nn.GELU(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 8)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Dropout2d(0.2),
            nn.Conv2d(8, 8, 3, padding=1),
            nn.ReLU(),
            nn.Dropout(0.3),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).mean(dim=(2, 3))


class TransformerBlock(nn.Module):
    """GPT-2 style pre-LN block with attention and residual dropout."""

    def __init__(self, dim: int = 32, heads: int = 4, dropout: float = 0.1) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.drop(self.attn(h, h, h, need_weights=False)[0])
        return x + self.mlp(self.ln2(x))


class KwargsModel(nn.Module):
    """Takes keyword arguments and a nested input, returns a dict with tensors and non-tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, extras: dict, *, scale: float = 1.0, bias: torch.Tensor | None = None) -> dict:
        y = torch.relu(self.proj(x)) * scale + extras["shift"][0]
        if bias is not None:
            y = y + bias
        return {"y": y, "norm": y.norm(), "label": extras["label"], "count": int(y.shape[0])}


class AttentionHalf(torch.nn.Module):
    """x + attention(norm(x)): mixes the tokens of a sample, never two samples."""

    def __init__(self, width: int = 32, heads: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = torch.nn.LayerNorm(width)
        self.attn = torch.nn.MultiheadAttention(width, heads, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.attn(h, h, h, need_weights=False)[0]


def pointwise_chain(x: torch.Tensor) -> torch.Tensor:
    """The engine tests' smallest segment: three pointwise ops, each saving a tensor for backward."""
    return x.sin().exp().cos()


def seeded(model_cls: type[nn.Module], seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    """`model_cls()` in train mode and an input for it (make_input), both drawn from RNG seed `seed`."""
    torch.manual_seed(seed)
    model = model_cls().train()
    return model, make_input(model)


def make_input(model: nn.Module, batch: int = 4) -> torch.Tensor:
    if isinstance(model, SmallCNN):
        return torch.randn(batch, 3, 8, 8)
    if isinstance(model, TransformerBlock):
        return torch.randn(batch, 6, 32)
    return torch.randn(batch, 16)
