"""Budgets of the planner: bytes of the step, a share of stock checkpointing's peak, or the device's total."""

from __future__ import annotations

import pytest
import torch

import fastckpt
from fastckpt.planner import measure
from fastckpt.planner.budgets import Resident, is_total, step_bytes
from tests.test_planner import CANDIDATES, make


@pytest.mark.parametrize(
    "text, expected",
    [("20GiB", 20 * 2**30), ("1.5 GB", 1.5e9), ("800mib", 800 * 2**20), ("2e9B", 2e9), (" 64 KiB ", 64 * 2**10)],
)
def test_device_totals_are_read_in_binary_and_decimal_units(text, expected):
    assert is_total(text) and not is_total("50%") and not is_total(10)
    resident = Resident(parameters=1000)
    assert step_bytes(text, 1, resident) == int(expected) - 1000


def test_resident_counts_parameters_gradients_and_optimizer_state():
    model, step = make(layers=2)
    weights = sum(p.numel() * 4 for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters())
    before = Resident.measure(model, torch.device("cpu"), optimizer)
    # No gradient yet: the step's backward allocates them (in its peak); Adam's two moments are to come.
    assert (before.parameters, before.gradients, before.pending_gradients) == (weights, weights, weights)
    assert before.optimizer == 2 * weights and before.before_step == 3 * weights
    x = torch.randn(4, 256, 64)
    model(x).pow(2).mean().backward()
    optimizer.step()
    unused = sum(p.numel() * 4 for p in model.side.parameters())  # not in the forward: no gradient, no state
    stepped = sum(1 for p in model.parameters() if p.grad is not None)
    # A loop that sets the gradients to None before each step (the default): its step allocates all of them.
    after = Resident.measure(model, torch.device("cpu"), optimizer)
    assert (after.gradients, after.pending_gradients) == (weights, weights)
    # Allocated moments, a 4-byte step counter per stepped parameter, and the unused ones' moments to come.
    assert after.optimizer == 2 * weights + 4 * stepped
    assert after.before_step == before.before_step + 4 * stepped
    # A loop that keeps them: those that exist are live before the step.
    kept = Resident.measure(model, torch.device("cpu"), optimizer, gradients="kept")
    assert (kept.gradients, kept.pending_gradients) == (weights, unused)
    assert kept.before_step == before.before_step + (weights - unused) + 4 * stepped
    momentum = Resident.measure(model, torch.device("cpu"), torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert momentum.optimizer == weights
    assert Resident.measure(model, torch.device("cpu"), torch.optim.SGD(model.parameters(), lr=0.1)).optimizer == 0
    with pytest.raises(TypeError, match="`optimizer` must be a torch.optim.Optimizer"):
        Resident.measure(model, torch.device("cpu"), object())


@pytest.fixture(scope="module")
def measured():
    model, step = make()
    optimizer = torch.optim.Adam(model.parameters())
    return measure(model, step, candidates=CANDIDATES, repeats=1, progress=False, optimizer=optimizer)


def test_a_device_total_plans_the_step_for_what_is_left(measured):
    resident = measured.resident
    step_budget = measured.budget_bytes("90%")
    total = f"{resident.before_step + step_budget}B"
    plan = measured.plan(total)
    assert plan.budget == step_budget
    assert plan.policies == measured.plan(step_budget).policies
    assert plan.measured_peak <= step_budget


def test_an_infeasible_total_names_what_no_plan_removes(measured):
    resident = measured.resident
    with pytest.raises(ValueError, match=r"less than what is live before the step.*parameters and buffers .* MiB.*"
                                         r"optimizer state"):  # fmt: skip
        measured.plan(f"{resident.before_step // 2}B")
    smallest = measured.smallest_feasible_budget()
    total = resident.before_step + smallest // 2
    with pytest.raises(ValueError, match=r"smallest feasible budget.*as a device total: .* MiB, of which .* MiB is "
                                         r"live before the step and no plan removes it \(parameters"):  # fmt: skip
        measured.plan(f"{total}B")


def test_fastckpt_plan_takes_a_total_and_the_optimizer():
    model, step = make(layers=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    weights = sum(p.numel() * 4 for p in model.parameters())
    mib = 2 * weights // 2**20 + 64  # the parameters, the momentum, and 64 MiB or so for the step
    plan = fastckpt.plan(model, step, f"{mib}MiB", candidates=["recompute", "none"], repeats=1, progress=False,
                         optimizer=optimizer)  # fmt: skip
    resident = plan.measurements.resident
    assert (resident.parameters, resident.optimizer, resident.before_step) == (weights, weights, 2 * weights)
    assert plan.budget == mib * 2**20 - 2 * weights


@pytest.mark.cuda
def test_resident_on_cuda_counts_other_allocations():
    model, _ = make(layers=2)
    model.cuda()
    device = torch.device("cuda")
    base = Resident.measure(model, device, torch.optim.Adam(model.parameters()))
    extra = torch.empty(2**20, dtype=torch.uint8, device=device)  # 1 MiB nobody else counts
    with_extra = Resident.measure(model, device, torch.optim.Adam(model.parameters()))
    assert with_extra.other - base.other == extra.numel()
    assert with_extra.optimizer == 2 * with_extra.parameters  # to come, not in the allocator's count
