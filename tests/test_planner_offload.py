"""Offload as a planner choice: plan(offload=True) measures the segments' inputs kept in host memory, as they are or
int8, beside the other candidates, and picks them where the budget needs them. On a CPU host memory is the
device's; the tests run the engine as on a GPU (fastckpt.storage.offload.copies_apart: the host copies outside the
measured peak), the same code path."""

from __future__ import annotations

import random

import pytest
import torch

from fastckpt.planner import DEFAULT_CANDIDATES, OFFLOAD_CANDIDATES, extended_candidates, measure
from fastckpt.planner.candidates import parse_candidates
from fastckpt.storage import offload
from tests.test_planner import make
from tests.test_planner_mixes import measured_peak

PLAIN = ["recompute", "recompute+int8"]


def test_offload_candidates_are_asked_for_not_defaults():
    assert not set(OFFLOAD_CANDIDATES) & set(DEFAULT_CANDIDATES)
    assert set(extended_candidates([2], offload=True)) == {*extended_candidates([2]), *OFFLOAD_CANDIDATES}
    assert [c.name for c in parse_candidates(PLAIN, offload=True)] == [*PLAIN, *OFFLOAD_CANDIDATES]
    named = parse_candidates(["recompute+offload"], offload=True)  # named and asked for: measured once
    assert [c.name for c in named] == list(OFFLOAD_CANDIDATES)
    with pytest.raises(TypeError, match="`offload` must be True or False"):
        parse_candidates(None, offload="yes")


def test_on_a_cpu_offload_moves_nothing_and_is_left_out_with_a_warning():
    model, step = make(layers=2)
    with pytest.warns(UserWarning, match="offload' left out: on a CPU host memory is the device's"):
        measured = measure(model, step, candidates=PLAIN, offload=True, repeats=1, progress=False)
    assert set(measured.failed) == set(OFFLOAD_CANDIDATES)
    assert measured.candidates == PLAIN


@pytest.fixture(scope="module")
def as_on_a_gpu():
    """The two measurements, with and without the offload candidates, with the host copies counted apart."""
    with offload.copies_apart(torch.device("cpu")) as arena:
        model, step = make()
        kept = measure(model, step, candidates=PLAIN, repeats=1, progress=False)
        offloading = measure(model, step, candidates=PLAIN, offload=True, repeats=1, progress=False)
        yield model, step, kept, offloading, arena


def test_offloaded_inputs_leave_the_device(as_on_a_gpu):
    _, _, _, measured, arena = as_on_a_gpu
    costs = {name: measured.by_policy[name].segments for name in measured.candidates}
    for plain, offloaded in zip(PLAIN, OFFLOAD_CANDIDATES, strict=True):
        # each segment keeps its input on the host, not on the device (the last one's kept bytes are its output)
        kept = zip(costs[plain][:-1], costs[offloaded][:-1], strict=True)
        assert all(o.kept_bytes < p.kept_bytes / 10 for p, o in kept)
    assert arena.allocated_bytes > 0


def test_a_budget_only_offload_meets_is_planned_and_verified(as_on_a_gpu):
    model, step, kept, offloading, _ = as_on_a_gpu
    smallest = kept.smallest_feasible_budget()
    assert offloading.smallest_feasible_budget() < smallest
    with pytest.raises(ValueError, match="smallest feasible budget"):
        kept.plan(smallest - 1)
    plan = offloading.plan(smallest - 1)
    assert set(plan.policies) & set(OFFLOAD_CANDIDATES)
    assert plan.measured_peak <= smallest - 1
    # the plan trains: the same gradients as without it, to int8's error where it stores int8
    plan.apply()
    step_inputs = torch.randn(2, 64, 64)
    model(step_inputs).pow(2).mean().backward()
    planned = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    plan.remove()
    model.zero_grad(set_to_none=True)
    model(step_inputs).pow(2).mean().backward()
    plain = [p.grad for p in model.parameters() if p.grad is not None]
    assert max((a - b).norm() / b.norm() for a, b in zip(planned, plain, strict=True)) < 2e-2


def test_mixes_with_offloading_segments_are_predicted(as_on_a_gpu):
    """A segment's copies come back in the backward of the next offloading segment, whichever lies between:
    predicted to the byte, or above it where no later offloading segment brings them back early."""
    _, _, _, measured, _ = as_on_a_gpu
    rng = random.Random(0)
    for _ in range(6):
        policies = [rng.choice(measured.candidates) for _ in measured.segments]
        predicted, peak = measured.predict_peak(policies), measured_peak(measured, policies)
        assert 0 <= predicted - peak <= 0.01 * peak, policies
