"""Benchmark workloads, all built in code (nothing is downloaded).

- `seed-cnn`: the CIFAR-10 CNN of examples/cifar10_cnn.py (imported from there), batch 32, its two conv
  blocks are the checkpointed segments.
- `gpt2`: a stack of GPT-2-style pre-LN transformer blocks (head dim 64, MLP 4x), short context.
- `gpt2-long`: the same blocks at 2048 tokens.
- `llama`: a small randomly initialised Hugging Face `LlamaForCausalLM` (GQA, SwiGLU, RoPE), checkpointed
  through transformers' own gradient checkpointing (fastckpt's rows through `fastckpt.integrations.hf`).

A step is one forward and backward of a loss (no optimizer); each workload says how a configuration's
checkpoint function reaches its segments (`Workload.prepare`).
"""

from __future__ import annotations

import copy
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = ("full", "quick", "smoke")  # `make bench`, `--quick`, `--smoke` (tiny: checks that every row runs)


class GPT2Block(nn.Module):
    """Pre-LN transformer block; `attn_dropout` (default: `dropout`) 0 lets attention use the fused kernel."""

    def __init__(self, dim: int, heads: int, dropout: float = 0.1, attn_dropout: float | None = None) -> None:
        super().__init__()
        attn_dropout = dropout if attn_dropout is None else attn_dropout
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=attn_dropout, batch_first=True)
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


class GPT2Stack(nn.Module):
    """GPT-2-style blocks; `segment(block, x)` runs each block (a checkpoint function), None runs them plainly."""

    def __init__(self, shape: StackShape, attn_dropout: float = 0.1) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            GPT2Block(shape.dim, shape.heads, attn_dropout=attn_dropout) for _ in range(shape.layers)
        )
        self.segment: Callable | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x) if self.segment is None else self.segment(block, x)
        return x


def _cifar10_example():
    """examples/cifar10_cnn.py as a module (examples/ is not a package)."""
    name = "fastckpt_examples_cifar10_cnn"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples", "cifar10_cnn.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@dataclass
class Workload:
    """One model and batch. `build` makes the model (same weights every call) and `inputs` the batch;
    `loss(model, inputs)` is what a step differentiates; `prepare(model, config)` points the model's
    segments at the configuration's checkpoint function."""

    name: str
    description: str
    build: Callable[[torch.device], nn.Module]
    inputs: Callable[[torch.device], tuple]
    loss: Callable[[nn.Module, tuple], torch.Tensor]
    prepare: Callable[[nn.Module, object], None] = field(default=lambda model, config: _set_segment(model, config))
    rounds_factor: int = 1  # a short step gets more rounds (its median is noisier) for little extra time

    def model(self, device: torch.device) -> nn.Module:
        torch.manual_seed(0)
        return self.build(device).train()


def _set_segment(model: nn.Module, config) -> None:
    model.segment = config.checkpoint  # None: plain


def _squared_mean(model: nn.Module, inputs: tuple) -> torch.Tensor:
    return model(*inputs).float().pow(2).mean()


def _gpt2(name: str, shape: StackShape, attn_dropout: float) -> Workload:
    def inputs(device: torch.device) -> tuple:
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(shape.batch, shape.seq, shape.dim, generator=generator).to(device)
        return (x.requires_grad_(True),)  # as an embedding output would: reentrant checkpoints need it

    return Workload(
        name,
        f"GPT-2-style blocks, {shape} (head dim {shape.dim // shape.heads}), dropout 0.1"
        + (" (attention: unfused, as torch runs it with dropout)" if attn_dropout else ", attention 0 (fused SDPA)"),
        lambda device: GPT2Stack(shape, attn_dropout).to(device),
        inputs,
        _squared_mean,
    )


def _seed_cnn(batch: int) -> Workload:
    def inputs(device: torch.device) -> tuple:
        generator = torch.Generator().manual_seed(1)
        x = torch.rand(batch, 3, 32, 32, generator=generator).to(device)
        y = torch.randint(10, (batch,), generator=generator).to(device)
        return x.requires_grad_(True), y  # reentrant checkpoints give the first block no grads otherwise

    def loss(model: nn.Module, inputs: tuple) -> torch.Tensor:
        x, y = inputs
        return nn.functional.cross_entropy(model(x), y)

    return Workload(
        "seed-cnn",
        f"examples/cifar10_cnn.py CifarCNN (2 conv blocks checkpointed), batch {batch} x 3x32x32, cross-entropy",
        lambda device: _cifar10_example().CifarCNN().to(device),
        inputs,
        loss,
        rounds_factor=3,  # ~70 ms steps on 2 CPU cores, against 150-450 ms for the other workloads
    )


@dataclass(frozen=True)
class LlamaShape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    batch: int
    seq: int

    def __str__(self) -> str:
        return (
            f"{self.layers} layers, hidden {self.hidden}, MLP {self.intermediate}, {self.heads} heads "
            f"({self.kv_heads} KV), vocab {self.vocab}, batch {self.batch} x seq {self.seq}"
        )


def _llama(shape: LlamaShape) -> Workload:
    def build(device: torch.device) -> nn.Module:
        import transformers

        config = transformers.LlamaConfig(
            hidden_size=shape.hidden,
            intermediate_size=shape.intermediate,
            num_hidden_layers=shape.layers,
            num_attention_heads=shape.heads,
            num_key_value_heads=shape.kv_heads,
            vocab_size=shape.vocab,
            max_position_embeddings=shape.seq,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
            attn_implementation="sdpa",
        )
        return transformers.LlamaForCausalLM(config).to(device)

    def inputs(device: torch.device) -> tuple:
        generator = torch.Generator().manual_seed(1)
        return (torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=generator).to(device),)

    def loss(model: nn.Module, inputs: tuple) -> torch.Tensor:
        (ids,) = inputs
        return model(input_ids=ids, labels=ids, use_cache=False).loss

    return Workload(
        "llama",
        f"Hugging Face LlamaForCausalLM, random init, {shape}, LM loss",
        build,
        inputs,
        loss,
        prepare=_prepare_hf,
    )


def _prepare_hf(model: nn.Module, config) -> None:
    """HF's own gradient checkpointing picks the layers; fastckpt's rows go through fastckpt.integrations.hf,
    the others replace the function HF calls (what `gradient_checkpointing_kwargs` would bind)."""
    from fastckpt.integrations import hf

    if config.checkpoint is None:
        return
    if config.policy is not None:
        hf.enable(model, policy=config.policy, use_reentrant=config.use_reentrant)
        return
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    for module in model.modules():
        if hasattr(module, "_gradient_checkpointing_func"):
            module._gradient_checkpointing_func = config.checkpoint


def transformers_missing() -> str | None:
    """Why the llama workload cannot run here, or None."""
    if importlib.util.find_spec("transformers") is None:
        return "transformers is not installed (pip install transformers)"
    return None


# Sized so that `make bench` (all four, every configuration) stays under 5 minutes on 2 CPU cores and
# `--quick` under 90 s; CUDA gets the larger shapes a GPU needs to be busy.
_SHAPES = {
    ("cpu", "full"): dict(
        cnn=32,
        gpt2=StackShape(6, 256, 4, 4, 256),
        gpt2_long=StackShape(3, 256, 4, 1, 2048),
        llama=LlamaShape(4, 256, 688, 4, 2, 4096, 4, 256),
    ),
    ("cpu", "quick"): dict(
        cnn=32,
        gpt2=StackShape(2, 256, 4, 2, 256),
        gpt2_long=StackShape(1, 256, 4, 1, 2048),
        llama=LlamaShape(2, 256, 688, 4, 2, 4096, 2, 256),
    ),
    ("cuda", "full"): dict(
        cnn=32,
        gpt2=StackShape(12, 768, 12, 8, 1024),
        gpt2_long=StackShape(12, 768, 12, 1, 8192),
        llama=LlamaShape(8, 1024, 2816, 16, 4, 32000, 4, 2048),
    ),
    ("cuda", "quick"): dict(
        cnn=32,
        gpt2=StackShape(6, 768, 12, 4, 1024),
        gpt2_long=StackShape(6, 768, 12, 1, 4096),
        llama=LlamaShape(4, 1024, 2816, 16, 4, 32000, 2, 1024),
    ),
}
_SMOKE = dict(
    cnn=4,
    gpt2=StackShape(2, 32, 2, 2, 16),
    gpt2_long=StackShape(1, 32, 2, 1, 2048),
    llama=LlamaShape(2, 32, 64, 4, 2, 64, 2, 16),
)

WORKLOAD_NAMES = ("seed-cnn", "gpt2", "gpt2-long", "llama")


def workloads(device: torch.device, size: str = "full") -> dict[str, Workload]:
    """Every workload, sized for `device` and `size` (one of SIZES)."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    shapes = _SMOKE if size == "smoke" else _SHAPES[(device.type, size)]
    return {
        "seed-cnn": _seed_cnn(shapes["cnn"]),
        "gpt2": _gpt2("gpt2", shapes["gpt2"], attn_dropout=0.1),
        "gpt2-long": _gpt2("gpt2-long", shapes["gpt2_long"], attn_dropout=0.0),
        "llama": _llama(shapes["llama"]),
    }


def copy_model(model: nn.Module) -> nn.Module:
    """An independent model with the same weights (one per configuration, so each is prepared once)."""
    return copy.deepcopy(model)
