"""The planner's peak model on mixes of candidates: random assignments measured against their prediction, to the
byte, on block types whose segments share tensors in different ways (CPU)."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from fastckpt.memory import peak_bytes
from fastckpt.planner import POLICY_CANDIDATES, Measurements, measure
from tests.test_planner import make

transformers = pytest.importorskip("transformers")

from fastckpt.integrations import hf  # noqa: E402

MIXES = 8  # random assignments per model, besides every uniform one


def measured_peak(measurements: Measurements, policies: list[str]) -> int:
    """The step's peak with `policies` applied, one per segment (then removed)."""
    for segment, policy in zip(measurements.segments, policies, strict=True):
        setattr(segment.parent, segment.attribute, measurements._candidate(policy).wrap(segment.module))
    try:
        return peak_bytes(measurements.step)
    finally:
        for segment in measurements.segments:
            setattr(segment.parent, segment.attribute, segment.module)


def check_mixes(measurements: Measurements, seed: int) -> None:
    """Every uniform assignment and MIXES random ones predicted to the byte."""
    n = len(measurements.segments)
    for name, m in measurements.by_policy.items():
        assert measurements.predict_peak([name] * n) == m.peak, name
    rng = random.Random(seed)
    for _ in range(MIXES):
        policies = [rng.choice(measurements.candidates) for _ in range(n)]
        assert measurements.predict_peak(policies) == measured_peak(measurements, policies), policies


class Rotary(nn.Module):
    """Blocks that all take two tensors the model makes before them, as HF decoders take position embeddings:
    multiplied in (autograd saves them), and kept by the model until its forward returns."""

    def __init__(self, layers: int = 4, dim: int = 64) -> None:
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(RotaryBlock(dim) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        embedded = self.embed(x)
        positions = torch.arange(x.shape[1], dtype=x.dtype)[:, None] / 100 * torch.arange(1, x.shape[2] + 1)
        cos, sin = positions.cos(), positions.sin()
        hidden = embedded
        for block in self.blocks:
            hidden = block(hidden, cos=cos, sin=sin)
        return hidden


class RotaryBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        h = h * cos + h.flip(-1) * sin
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(h)))


CANDIDATES = [*POLICY_CANDIDATES, "batch2:int8", "batch2:recompute:int8+int8"]


def test_blocks_whose_input_the_model_frees_in_the_forward():
    model, step = make(layers=5)
    check_mixes(measure(model, step, candidates=CANDIDATES, repeats=1, progress=False), seed=0)


def test_blocks_sharing_tensors_the_model_keeps_through_the_forward():
    torch.manual_seed(0)
    model = Rotary()
    x = torch.randn(2, 256, 64)

    def step() -> None:
        model(x).pow(2).mean().backward()
        model.zero_grad(set_to_none=True)

    measurements = measure(model, step, candidates=CANDIDATES, repeats=1, progress=False)
    # the position tensors are stored once by the first segment storing them, and freed after the forward
    # unless a segment holds them: what mixes of these candidates differ in
    assert any(cost.made for cost in measurements.by_policy["recompute+int8"].segments)
    assert measurements.by_policy["int8"].dropped
    check_mixes(measurements, seed=1)


def _measured_on_a_padded_batch(model_class: str, config) -> Measurements:
    """hf.measure in bf16 on two rows of 192 tokens, one padded from 128, with the loss head and padded attention."""
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).train()
    ids = torch.randint(1, 256, (2, 192), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 128:] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    hf.enable(model, loss_head=True, padded_attention=True)
    return hf.measure(model, batch, autocast=torch.bfloat16, repeats=1, progress=False)


def test_hugging_face_llama_padded_in_bf16():
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, max_position_embeddings=256, pad_token_id=0, attn_implementation="sdpa",
    )  # fmt: skip
    measurements = _measured_on_a_padded_batch("LlamaForCausalLM", config)
    # what these layers share: position embeddings and the mask (stored once, held by some candidates);
    # autocast's casts of the weights are freed inside each segment (its forward runs with the cast cache off),
    # so none outlives its segment until the forward's end
    assert not any(cost.transient for cost in measurements.by_policy["int8"].segments)
    check_mixes(measurements, seed=2)


def test_hugging_face_gemma3_sliding_windows_padded_in_bf16():
    # padded attention's windowed layers (window 48 over rows of 192: blocks with small masks of their own)
    # beside a full-attention one, the loss head, and the mask form every layer shares
    config = transformers.Gemma3TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, query_pre_attn_scalar=16, sliding_window=48, vocab_size=256, max_position_embeddings=256,
        layer_types=["sliding_attention"] * 3 + ["full_attention"], pad_token_id=0, attn_implementation="sdpa",
    )  # fmt: skip
    check_mixes(_measured_on_a_padded_batch("Gemma3ForCausalLM", config), seed=2)
