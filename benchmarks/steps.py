"""What the whole-step LLM benchmarks share (benchmarks/llm.py's toy Llama, benchmarks/real_shapes.py's real
model shapes): a row (a configuration of a Hugging Face causal LM), the step under bf16 autocast, the gradients'
relative error, the padded and packed batches, and a copy of a model that shares its parameters.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fastckpt.integrations import hf

HF_GC = "HF GC"
PLAIN = "plain"
# packed sequences: the row's sequences' lengths are in these proportions
PACKED_WEIGHTS = (5, 3, 8, 2, 6, 4, 7, 1)


@dataclass(frozen=True)
class Row:
    """One configuration: `prepare(model)` sets it up on a fresh copy; `loss(model, batch)` runs the forward."""

    name: str
    prepare: Callable[[torch.nn.Module], None]
    loss: Callable[[torch.nn.Module, dict], torch.Tensor] | None = None


def hf_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    return model(**batch, use_cache=False).loss


def causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def hf_gc(model: torch.nn.Module, **kwargs) -> None:
    """HF gradient checkpointing as users turn it on (torch's non-reentrant checkpoint)."""
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False, **kwargs})


def fastckpt(policy: str, loss_head: bool, padded: bool = False, **options: Any) -> Callable[[torch.nn.Module], None]:
    """`prepare` of a fastckpt row: `hf.enable(model, policy=..., loss_head=..., padded_attention=..., **options)`."""
    return functools.partial(hf.enable, policy=policy, loss_head=loss_head, padded_attention=padded, **options)


def step(model: torch.nn.Module, batch: dict, loss: Callable = hf_loss, autocast: bool = True) -> None:
    """One forward and backward, under bf16 autocast unless `autocast=False` (the fp32 reference)."""
    device = batch["input_ids"].device.type
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        value = loss(model, batch)
    value.backward()


def gradients(model: torch.nn.Module) -> list[torch.Tensor]:
    """The trained parameters' gradients, as fp32 copies."""
    return [p.grad.detach().float().clone() for p in model.parameters() if p.requires_grad]


def relative_error(got: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """Relative L2 error of all gradients together."""
    num = sum(float((a - b).pow(2).sum()) for a, b in zip(got, reference, strict=True))
    return (num / sum(float(b.pow(2).sum()) for b in reference)) ** 0.5


def trained_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def sharing_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of `model` whose parameters are the original's own (the modules, buffers and settings are
    copied): a row's changes (checkpointing, the loss head, the attention) stay on its copy while the weights
    exist once. Gradients land on the shared parameters, so steps of two copies must not overlap (run a step,
    read its gradients, zero them)."""
    return copy.deepcopy(model, memo={id(p): p for p in model.parameters()})


def padded_batch(
    tokens: int, vocab: int, device: torch.device, padding: int, left: bool = False, seed: int = 1
) -> dict[str, torch.Tensor]:
    """One row of `tokens` token ids, its last (or with `left`, first) `padding` positions padding: attention
    mask 0 and label -100 there."""
    ids = torch.randint(1, vocab, (1, tokens), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    if padding:
        if left:
            mask[:, :padding] = 0
        else:
            mask[:, tokens - padding :] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    return {key: value.to(device) for key, value in batch.items()}


def packed_batch(tokens: int, device: torch.device, vocab: int) -> dict[str, torch.Tensor]:
    """One row of sequences packed without padding: lengths in PACKED_WEIGHTS' proportions, position ids
    starting again at each sequence, no attention mask, no label at a sequence's first token."""
    lengths = [tokens * weight // sum(PACKED_WEIGHTS) for weight in PACKED_WEIGHTS]
    lengths[-1] += tokens - sum(lengths)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    ids = torch.randint(1, vocab, (1, tokens), generator=torch.Generator().manual_seed(3))
    batch = {"input_ids": ids, "position_ids": positions, "labels": ids.masked_fill(positions == 0, -100)}
    return {key: value.to(device) for key, value in batch.items()}


def fmt(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)
