"""Planner candidates that change how a block runs, and the checks that leave a candidate out: selective storage
and batch slices measured, planned and applied (batch slices on CUDA too); a candidate that fails on the model,
blocks that mix the samples or that the sample check cannot run alone; batch slices compared with the same slices
kept exactly; and the names extended_candidates gives."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fastckpt
from fastckpt import hybrid
from fastckpt.memory import peak_bytes
from fastckpt.planner import DEFAULT_CANDIDATES, Measurements, Segment, extended_candidates, measure, parse_candidate
from fastckpt.planner.checks import probe, samples_mixed
from fastckpt.tiling import TiledWrapper
from tests.helpers import needs_sac_hooks
from tests.test_planner import Block, Net, RefusingBlock, make


@needs_sac_hooks
def test_selective_candidate_is_measured_planned_and_applied():
    model, step = make(layers=3)
    measurements = measure(model, step, candidates=["recompute", "selective:int8", "int8"], repeats=1)
    selective, stock = measurements.by_policy["selective:int8"], measurements.by_policy["recompute"]
    # It keeps the two matmul outputs per block 8-bit (more than recompute's input, less than int8's four).
    assert 7.5 < selective.bits_per_element < 8.5
    assert all(s.kept_bytes > r.kept_bytes for s, r in zip(selective.segments, stock.segments, strict=True))
    assert measurements.predict_peak(["selective:int8"] * 3) == selective.peak
    plan = measurements.plan(selective.peak)
    forced = Measurements(model, measurements.segments, ["selective:int8"], measurements.by_policy).plan(selective.peak)
    forced.apply()
    try:
        assert all(isinstance(b, hybrid.SelectiveWrapper) for b in model.blocks)
        with fastckpt.track() as report:
            step()
        # Each block: its input stored int8 (the candidate's recompute+int8), the matmul outputs selective:int8.
        assert [s.policy for s in report.segments] == ["recompute+int8", "selective:int8"] * 3
        assert peak_bytes(step) == forced.predicted_peak
    finally:
        forced.remove()
    assert plan.predicted_peak <= selective.peak


def test_batch_slices_candidate_is_measured_planned_and_applied():
    model, step = make(layers=3)
    measurements = measure(model, step, candidates=["recompute", "batch4:recompute"], repeats=1)
    sliced, stock = measurements.by_policy["batch4:recompute"], measurements.by_policy["recompute"]
    # The same input kept per block (and each slice's small bookkeeping), a quarter of the recomputed
    # activations alive in each backward.
    for s, r in zip(sliced.segments, stock.segments, strict=True):
        assert r.kept_bytes <= s.kept_bytes < 1.1 * r.kept_bytes
        assert s.backward_level < 0.5 * r.backward_level
    plan = measurements.plan(sliced.peak)
    assert plan.policies == ["batch4:recompute"] * 3
    keys = list(model.state_dict())
    plan.apply()
    try:
        assert all(isinstance(b, TiledWrapper) and (b.chunks, b.dim) == (4, 0) for b in model.blocks)
        assert list(model.state_dict()) == keys
        assert peak_bytes(step) == plan.predicted_peak
    finally:
        plan.remove()


@pytest.mark.cuda
def test_batch_slices_plan_on_cuda_predicts_the_measured_peak():
    torch.manual_seed(0)
    model = Net(3).cuda()
    x = torch.randn(4, 256, 64, device="cuda")

    def step() -> None:
        model(x).pow(2).mean().backward()
        model.zero_grad(set_to_none=True)

    measurements = measure(model, step, candidates=["recompute", "int8", "batch4:recompute"], repeats=1)
    sliced, stock = measurements.by_policy["batch4:recompute"], measurements.by_policy["recompute"]
    assert all(s.backward_level < r.backward_level for s, r in zip(sliced.segments, stock.segments, strict=True))
    plan = measurements.plan(sliced.peak)
    plan.apply()
    try:
        step()
        measured_peak = peak_bytes(step, "cuda")
    finally:
        plan.remove()
    assert abs(plan.predicted_peak - measured_peak) <= 0.10 * measured_peak, (plan.policies, measured_peak)


def test_a_candidate_that_fails_on_the_model_is_left_out_with_a_warning():
    model, step = make(layers=3)
    for i in range(3):
        model.blocks[i] = RefusingBlock(lambda x: x.shape[0] != 4, "this block needs the whole batch")
    with pytest.warns(UserWarning, match=r"candidate 'batch2:recompute' failed on this model, left out \(RuntimeError"):
        measurements = measure(model, step, candidates=["recompute", "batch2:recompute", "int8"], repeats=1)
    assert measurements.candidates == ["recompute", "int8"] and list(measurements.failed) == ["batch2:recompute"]
    assert "failed on this model, left out: RuntimeError: this block needs the whole batch" in measurements.table()
    assert all(p.grad is None for p in model.parameters())  # the broken step's partial gradients undone
    with pytest.raises(ValueError, match=r"\['batch2:recompute'\] left out: they failed on this model"):
        measurements.plan(1)
    for i in range(3):
        model.blocks[i] = Block()  # a model that fails under the reference too: its error is raised
    model.blocks[0].forward = lambda x: (_ for _ in ()).throw(RuntimeError("broken model"))
    with pytest.raises(RuntimeError, match="broken model"):
        measure(model, step, candidates=["recompute", "int8"], repeats=1)


class BatchNormBlock(Block):
    """Normalises over the batch in training: its samples are not independent."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__(dim)
        self.norm = nn.BatchNorm1d(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.norm(x.transpose(1, 2)).transpose(1, 2))


class TwoDropoutBlock(Block):
    """Two random ops per block: batch slices draw their masks in another order than the whole batch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(self.fc1(self.ln(x)), 0.2)
        return x + F.dropout(self.fc2(F.gelu(h)), 0.2)


def batchnorm_model():
    model, step = make(layers=3)
    torch.manual_seed(1)
    for i in range(3):
        model.blocks[i] = BatchNormBlock()
    return model, step


def test_batch_slices_of_blocks_that_mix_samples_are_left_out():
    model, step = batchnorm_model()
    with pytest.warns(UserWarning, match=r"'batch2:recompute' left out: segment 'blocks.0' mixes the samples"):
        measurements = measure(model, step, candidates=["recompute", "batch2:recompute"], repeats=1)
    assert measurements.candidates == ["recompute"] and "mixes the samples" in measurements.failed["batch2:recompute"]


def test_a_segment_the_sample_check_cannot_run_leaves_batch_slices_out():
    model, step = make(layers=2)
    for i in range(2):
        model.blocks[i] = RefusingBlock(lambda x: not torch.is_grad_enabled(), "runs with grad only")
    with pytest.warns(UserWarning, match=r"'batch2:recompute' left out: segment 'blocks.0' could not be run alone"):
        measurements = measure(model, step, candidates=["recompute", "batch2:recompute"], repeats=1)
    assert measurements.candidates == ["recompute"]


def test_the_sample_check_leaves_the_buffers_as_the_step_left_them():
    checked, step = batchnorm_model()
    twin, twin_step = batchnorm_model()
    segments = [Segment(f"blocks.{i}", checked.blocks, str(i), b) for i, b in enumerate(checked.blocks)]
    candidates = [parse_candidate("batch2:recompute"), parse_candidate("int8")]
    assert list(samples_mixed(segments, probe(segments, step), torch.device("cpu"), candidates)) == [2]
    twin_step()  # the probe ran one step, then the check its own forwards, whose running statistics it undid
    for b, t in zip(checked.blocks, twin.blocks, strict=True):
        torch.testing.assert_close(b.norm.running_mean, t.norm.running_mean, rtol=0, atol=0)
    assert samples_mixed(segments, probe(segments, lambda: None), torch.device("cpu"), candidates[:1]) == {}


def test_batch_slices_are_compared_with_the_same_slices_kept_exactly():
    model, step = make(layers=3)
    for i in range(3):
        model.blocks[i] = TwoDropoutBlock()
    measurements = measure(model, step, candidates=["recompute", "batch2:recompute", "batch2:int8"], max_error=5e-2)
    # Recomputing each slice replays its random draws: exact against the same slices stored plainly, though
    # the slices' masks differ from the whole batch's.
    assert measurements.by_policy["batch2:recompute"].grad_error < 1e-6
    assert 0 < measurements.by_policy["batch2:int8"].grad_error <= 1e-2
    assert measurements.candidates == ["recompute", "batch2:recompute", "batch2:int8"]


def test_extended_candidates_name_valid_distinct_candidates():
    names = extended_candidates(batch_slices=[2, 4])
    assert names[: len(DEFAULT_CANDIDATES)] == list(DEFAULT_CANDIDATES)
    assert len(set(names)) == len(names) and {"batch2:int8", "batch4:recompute:int8+int8"} <= set(names)
    assert [parse_candidate(n).name for n in names] == names  # each its own canonical name
    assert "selective-attention:int8" in names and "batch2:selective-attention:int8" in names
    assert extended_candidates() == [n for n in names if not n.startswith("batch")]
    with pytest.raises(ValueError, match="batch slice count must be an integer >= 2"):
        extended_candidates(batch_slices=[1])
