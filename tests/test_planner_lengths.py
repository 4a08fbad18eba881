"""What fits: measurements at two lengths predict the peak at others, and the longest length a budget holds."""

from __future__ import annotations

import pytest
import torch

from fastckpt.memory import peak_bytes
from fastckpt.planner import measure_lengths
from tests.test_planner_defaults import AttentionBlock, AttentionNet

CANDIDATES = ["recompute", "none", "int8", "recompute+int8"]


@pytest.fixture(scope="module")
def lengths():
    torch.manual_seed(0)
    model = AttentionNet(layers=4, dim=64)

    def step_at(tokens: int):
        x = torch.randn(2, tokens, 64)
        return lambda: model(x).pow(2).mean().backward()

    measured = measure_lengths(
        model, step_at, (256, 512), lambda m: isinstance(m, AttentionBlock), CANDIDATES, repeats=1, progress=False
    )
    return model, step_at, measured


@pytest.mark.parametrize("policy", ["recompute", "int8", "none"])
def test_the_peak_at_a_longer_length_is_predicted_from_two(lengths, policy):
    model, step_at, measured = lengths
    at = measured.at(1024)  # twice the longest measured
    plan = at.plan(10**12, verify=False)
    plan.policies = [policy] * len(plan.policies)
    predicted = at.predict_peak(plan.policies)
    plan.apply()
    try:
        model.zero_grad()
        real = peak_bytes(step_at(1024))
    finally:
        plan.remove()
    assert abs(predicted - real) <= 0.01 * real  # measured: 0.0-0.5% at 2x and 4x


def test_the_longest_length_fits_its_budget_and_one_more_step_does_not(lengths):
    model, step_at, measured = lengths
    budget = 32 * 2**20
    fit = measured.longest(budget, multiple=64)
    assert fit.plan.measured_peak <= budget and fit.length % 64 == 0 and fit.length > 512
    longer = measured.at(fit.length + 64)
    assert longer.smallest_feasible_budget() > budget


def test_what_fits_refuses_what_it_cannot_answer(lengths):
    model, step_at, measured = lengths
    with pytest.raises(ValueError, match="share of stock checkpointing's peak grows with the length"):
        measured.longest("50%")
    with pytest.raises(ValueError, match="no plan fits"):
        measured.longest(1024, multiple=64)
    with pytest.raises(ValueError, match="`multiple` must be a positive integer"):
        measured.longest(2**30, multiple=0)
    with pytest.raises(ValueError, match="`lengths` must be two different positive integers"):
        measure_lengths(model, step_at, (256, 256, 512))


def test_what_fits_with_the_optimizer_stepped_in_the_backward():
    """Wide blocks: a device total of the weights, AdamW's state and half the gradients holds no length with
    the optimizer stepped after the backward, and the measured lengths and more with it stepped in the backward."""
    import fastckpt

    torch.manual_seed(0)
    model = AttentionNet(layers=4, dim=128)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    total = f"{weights * 3 + weights // 2}B"
    block = lambda m: isinstance(m, AttentionBlock)  # noqa: E731

    def lengths_with(optimizer, backward):
        def step_at(tokens: int):
            x = torch.randn(1, tokens, 128)
            return lambda: backward(model(x).pow(2).mean())

        return measure_lengths(model, step_at, (32, 64), block, ["recompute"], repeats=1, progress=False,
                               optimizer=optimizer)  # fmt: skip

    after = lengths_with(torch.optim.AdamW(model.parameters(), foreach=True), torch.Tensor.backward)
    with pytest.raises(ValueError, match="no plan fits"):
        after.longest(total, multiple=32)
    stepping = fastckpt.optimizer_in_backward(torch.optim.AdamW(model.parameters(), foreach=True))
    fit = lengths_with(stepping, stepping.backward).longest(total, multiple=32)
    stepping.remove()
    assert fit.length >= 64 and fit.plan.measured_peak <= fit.plan.budget
