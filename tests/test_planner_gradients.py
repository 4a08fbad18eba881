"""The planner's gradient checks: max_error leaves out the candidates whose measured gradient error exceeds it
(measured with the same dropout masks), and a candidate whose stored form gives NaN/inf gradients is never kept,
while a reference (plain autograd) that gives them already is refused."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fastckpt
from fastckpt.planner import NONE, REFERENCE, Candidate, Measurements, max_relative_error, measure, parse_candidate
from fastckpt.storage import codecs
from tests.test_planner import Block, make
from tests.test_planner_synthetic import synthetic

# ---- max_error: candidates whose measured gradient error exceeds it are left out ----


def test_max_error_leaves_out_the_candidates_above_it():
    model, step = make(layers=3)
    measurements = measure(model, step, candidates=[NONE, "recompute", "int8", "int4"], repeats=1, max_error=1.0)
    errors = {name: m.grad_error for name, m in measurements.by_policy.items()}
    assert errors[NONE] == 0 and errors["recompute"] == 0  # exact policies, same seed
    assert 0 < errors["int8"] < errors["int4"]
    bound = (errors["int8"] + errors["int4"]) / 2
    bounded = measure(model, step, candidates=[NONE, "recompute", "int8", "int4"], repeats=1, max_error=bound)
    assert bounded.candidates == [NONE, "recompute", "int8"] and bounded.excluded == ["int4"]
    for budget in ("100%", bounded.smallest_feasible_budget()):
        assert "int4" not in bounded.plan(budget).policies
    assert "left out: > max_error" in bounded.table()
    with pytest.raises(ValueError, match=r"\['int4'\] left out: their gradient error exceeds max_error"):
        bounded.plan(1)


def test_max_error_measures_with_the_same_dropout_masks():
    torch.manual_seed(0)
    blocks = nn.ModuleList(
        nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.5), nn.Linear(256, 64)) for _ in range(3)
    )
    x = torch.randn(4, 128, 64)

    def step() -> None:
        h = x
        for block in blocks:
            h = block(h)
        h.pow(2).mean().backward()
        blocks.zero_grad(set_to_none=True)

    measurements = measure(blocks, step, candidates=[NONE, "recompute", "int8"], repeats=1, max_error=0.05)
    assert measurements.by_policy["recompute"].grad_error == 0  # not the masks of another draw
    assert 0 < measurements.by_policy["int8"].grad_error <= 0.05


@pytest.mark.parametrize("max_error", [-0.1, "5%", True])
def test_bad_max_error_is_named(max_error):
    model, step = make(layers=2)
    with pytest.raises(ValueError, match="max_error"):
        fastckpt.plan(model, step, "100%", max_error=max_error)


# ---- non-finite gradients: a candidate whose storage breaks the gradients is never kept ----


@pytest.fixture
def int8_decodes_nan(monkeypatch):
    """A broken int8 storage: every tensor it gives back holds a NaN (as the codecs' decoding of a group holding
    an infinity once did)."""
    decode = codecs.decode

    def broken(encoded):
        tensor = decode(encoded)
        if encoded.codec == "int8":
            tensor = tensor.clone()
            tensor.view(-1)[0] = math.nan
        return tensor

    monkeypatch.setattr(codecs, "decode", broken)


class HeadFirstNet(nn.Module):
    """The head's parameters come first: their gradient is exact under any storage, so an error measure that
    loses a later NaN reports 0 for the whole model."""

    def __init__(self, block: type[nn.Module], layers: int = 3, dim: int = 64) -> None:
        super().__init__()
        self.head = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(block(dim) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_head_first(block: type[nn.Module]):
    return make(net=lambda: HeadFirstNet(block))


NAN_FROM_INT8 = (
    r"candidate 'int8' gives NaN/inf gradients from segment 'blocks.2' on .* where the plain step's are finite"
)


@pytest.mark.parametrize("max_error", [None, 0.5])
def test_a_candidate_whose_stored_form_gives_nan_gradients_is_never_kept(max_error, int8_decodes_nan):
    model, step = make_head_first(Block)
    with pytest.warns(UserWarning, match=NAN_FROM_INT8):
        measurements = measure(model, step, candidates=["recompute", "int8"], repeats=1, max_error=max_error)
    assert measurements.candidates == ["recompute"] and list(measurements.failed) == ["int8"]
    assert all(policy == "recompute" for policy in measurements.plan("100%").policies)
    with pytest.warns(UserWarning, match=NAN_FROM_INT8):
        alone = measure(model, step, candidates=["int8"], repeats=1, max_error=max_error)
    with pytest.raises(ValueError, match=NAN_FROM_INT8):  # nothing is left: the error says why int8 is out
        alone.plan("100%")


def test_the_reference_giving_nan_gradients_refuses_the_plan(monkeypatch, int8_decodes_nan):
    model, step = make_head_first(Block)
    wrap, int8 = Candidate.wrap, parse_candidate("int8")
    monkeypatch.setattr(Candidate, "wrap", lambda self, module: wrap(int8 if self.name == REFERENCE else self, module))
    with pytest.raises(RuntimeError, match="candidate 'recompute' gives NaN/inf gradients from segment 'blocks.2'"):
        fastckpt.plan(model, step, "100%", candidates=[NONE, "recompute"])


def test_a_nan_gradient_error_exceeds_max_error_wherever_it_is():
    finite, nan = torch.ones(3), torch.tensor([1.0, math.nan, 1.0])
    assert max_relative_error([finite, nan], [finite, finite]) == math.inf  # a NaN after a finite error counts
    assert max_relative_error([nan, finite], [finite, finite]) == math.inf
    assert max_relative_error([finite * math.inf], [finite]) == math.inf
    measurements = synthetic(2, ["a", "b", "c", "recompute"], seed=0, unit=4099)
    measurements["a"].grad_error, measurements["b"].grad_error = math.nan, math.inf
    measurements["c"].grad_error = measurements["recompute"].grad_error = 0.0
    kept = Measurements(nn.Linear(1, 1), [], ["a", "b", "c", "recompute"], measurements, max_error=1.0)
    assert kept.candidates == ["c", "recompute"] and kept.excluded == ["a", "b"]


class NaNBlock(Block):
    """Plain autograd's own gradients are NaN here (sqrt's backward at 0, times 0)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + (self.fc2(F.gelu(self.fc1(x))) * 0).abs().sqrt()


def test_gradient_error_against_a_non_finite_reference_is_refused():
    model, step = make_head_first(NaNBlock)
    measurements = measure(model, step, candidates=["recompute", "int8"], repeats=1)
    assert measurements.candidates == ["recompute", "int8"]  # NaN already without checkpointing: not int8's doing
    with pytest.raises(ValueError, match=r"max_error: the gradients under 'none' \(the reference\) hold NaN/inf"):
        measure(model, step, candidates=["recompute", "int8"], repeats=1, max_error=0.5)
