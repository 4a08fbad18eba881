"""fastckpt.plan with default candidates: batch slices and the kept attention are measured where they can
help and left out, silently, where the model cannot use them; the timed runs mix the candidates."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fastckpt.planner import DEFAULT_CANDIDATES, POLICY_CANDIDATES, Segment, measure
from fastckpt.planner.checks import probe
from tests.test_planner import Block, RefusingBlock, make, recorded_bars


class AttentionBlock(nn.Module):
    """Pre-LN attention + MLP block with dropout, through the fused SDPA kernel: what the kept attention and
    batch slices are for."""

    def __init__(self, dim: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(attention)
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))), 0.1, self.training)


class AttentionNet(nn.Module):
    def __init__(self, layers: int = 3, dim: int = 32) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(AttentionBlock(dim) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def attention_model(batch: int = 2):
    torch.manual_seed(0)
    model = AttentionNet()
    x = torch.randn(batch, 512, 32)

    def step() -> None:
        model(x).float().pow(2).mean().backward()
        model.zero_grad(set_to_none=True)

    return model, step


def test_default_candidates_reach_below_the_whole_segment_policies():
    model, step = attention_model()
    defaults = measure(model, step, repeats=1, progress=False)
    assert defaults.candidates == list(DEFAULT_CANDIDATES) and not defaults.skipped and not defaults.failed
    policies_only = measure(model, step, candidates=POLICY_CANDIDATES, repeats=1, progress=False)
    # batch slices hold one slice's backward, the kept attention is not recomputed: smaller plans exist
    assert defaults.smallest_feasible_budget() < 0.9 * policies_only.smallest_feasible_budget()
    plan = defaults.plan(defaults.smallest_feasible_budget())
    assert plan.measured_peak == plan.predicted_peak
    assert any(p.startswith(("batch2:", "selective-attention:")) for p in plan.policies)


def test_defaults_that_keep_nothing_or_cannot_slice_are_left_out_silently():
    torch.manual_seed(0)
    model, _ = make(layers=3)  # MLP blocks: no attention, no dropout
    x = torch.randn(1, 256, 64)  # a batch of one sample

    def step() -> None:
        model(x).pow(2).mean().backward()
        model.zero_grad(set_to_none=True)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the defaults left out are not warned about
        measurements = measure(model, step, repeats=1, progress=False)
    assert measurements.candidates == list(POLICY_CANDIDATES) and not measurements.failed
    assert set(measurements.skipped) == set(DEFAULT_CANDIDATES) - set(POLICY_CANDIDATES)
    assert "takes a batch of 1, which cannot be cut in 2 slices" in measurements.skipped["batch2:int8"]
    kept = measurements.skipped["selective-attention:int8"]
    assert "no segment calls torch.nn.functional.dropout, torch.nn.functional.scaled_dot_product_attention" in kept
    assert "runs as its policy 'recompute+int8'" in kept
    assert "selective-attention:int8: not used on this model: no segment calls" in measurements.table()


def test_named_candidates_the_checks_refuse_are_left_out_with_a_warning():
    model, step = make(layers=2)
    with pytest.warns(UserWarning, match=r"'selective-attention:int8' left out: no segment calls"):
        measurements = measure(model, step, candidates=["recompute", "selective-attention:int8"], repeats=1)
    assert (
        measurements.candidates == ["recompute"] and "keeps nothing" in measurements.failed["selective-attention:int8"]
    )
    torch.manual_seed(0)
    x = torch.randn(1, 256, 64)
    with pytest.warns(UserWarning, match=r"'batch2:int8' left out: segment 'blocks.0' takes a batch of 1"):
        measure(model, lambda: model(x).sum().backward(), candidates=["recompute", "batch2:int8"], repeats=1)


def test_default_batch_slices_that_fail_on_the_model_are_left_out_silently(monkeypatch):
    bars = recorded_bars(monkeypatch)
    model, step = make(layers=3)
    for i in range(3):  # as a block whose other inputs carry the whole batch (a padding mask) fails on a slice
        model.blocks[i] = RefusingBlock(lambda x: x.shape[0] != 4, "this block needs the whole batch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the defaults that failed are not warned about
        measurements = measure(model, step, repeats=1, max_error=1.0)
    batch = [name for name in DEFAULT_CANDIDATES if name.startswith("batch")]
    assert set(batch) <= set(measurements.skipped) and not measurements.failed
    assert "RuntimeError: this block needs the whole batch" in measurements.skipped["batch2:int8"]
    (bar,) = bars
    assert bar.n == bar.total  # the count follows what the probe and the failures left to run
    assert all(isinstance(b, Block) for b in model.blocks)


class MultiheadBlock(nn.Module):
    """Attention through nn.MultiheadAttention: F.multi_head_attention_forward calls the fused kernel inside."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        return x + self.attn(h, h, h, need_weights=False)[0]


def test_the_probe_sees_attention_called_inside_other_functional_code():
    torch.manual_seed(0)
    blocks = nn.Sequential(MultiheadBlock(), MultiheadBlock())
    x = torch.randn(2, 64, 32)
    segments = [Segment(str(i), blocks, str(i), b) for i, b in enumerate(blocks)]
    watched = frozenset({F.scaled_dot_product_attention, F.dropout})
    probed = probe(segments, lambda: blocks(x).sum().backward(), watched)
    assert F.scaled_dot_product_attention in probed.called and set(probed.inputs) == {0, 1}
    # outside a segment it does not count
    assert not probe(segments[:0], lambda: blocks(x).sum().backward(), watched).called
    measurements = measure(
        blocks, lambda: blocks(x).sum().backward(), candidates=["recompute", "selective-attention:int8"], repeats=1
    )
    assert measurements.candidates == ["recompute", "selective-attention:int8"]
