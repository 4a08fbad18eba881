"""A plan's budget holds in the loop the user runs: gradients set to None before each step (torch's and
Trainer's `zero_grad()`), or kept and accumulated into; with an optimizer, the whole iteration, its step included,
within a device total. Each loop's peak is measured outside the planner (profiler allocation records)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fastckpt.memory import peak_bytes
from fastckpt.planner import measure
from tests.helpers import trainer_step_peaks
from tests.models import TransformerBlock

CANDIDATES = ["recompute", "batch2:recompute", "none", "int8"]  # batch2 reaches below stock checkpointing here


class UserModel(nn.Module):
    """What a user writes: GPT-2 style blocks in a forward of their own, then a head."""

    def __init__(self, layers: int = 4, dim: int = 64) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(TransformerBlock(dim, 4, 0.0) for _ in range(layers))
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def user_model(dim: int = 64, tokens: int = 512):
    torch.manual_seed(0)
    model = UserModel(dim=dim)
    x = torch.randn(2, tokens, dim)

    def step() -> None:  # forward and backward only: the loop around it does the rest
        model(x).pow(2).mean().backward()

    return model, step


def is_block(module: nn.Module) -> bool:
    return isinstance(module, TransformerBlock)


def loop_peaks(step, before_step, rounds: int = 2) -> list[int]:
    """The peak of each of `rounds` loop steps, `before_step()` (the loop's zero_grad) called before each."""
    peaks = []
    for _ in range(rounds):
        before_step()
        peaks.append(peak_bytes(step))
    return peaks


def test_a_plan_holds_in_a_loop_that_sets_gradients_to_none():
    # Wide blocks on few tokens: the gradients (allocated in the loop's backward) are a large share of the peak.
    model, step = user_model(dim=128, tokens=256)
    model(torch.randn(2, 256, 128)).sum().backward()  # gradients exist when planning starts, as after a step
    callers = {name: p.grad for name, p in model.named_parameters()}
    measured = measure(model, step, is_block, CANDIDATES, repeats=1, progress=False)
    assert all(p.grad is callers[name] for name, p in model.named_parameters())  # the caller's, untouched
    plan = measured.plan("80%")  # the gradients are 40% of stock checkpointing's peak
    plan.apply()
    for peak in loop_peaks(step, model.zero_grad):
        assert peak <= plan.budget
        assert abs(peak - plan.measured_peak) <= 0.03 * peak
        assert abs(peak - plan.predicted_peak) <= 0.03 * peak


def test_the_kept_convention_plans_a_loop_that_accumulates():
    model, step = user_model()
    measured = measure(model, step, is_block, CANDIDATES, repeats=1, progress=False, gradients="kept")
    assert all(p.grad is None for p in model.parameters())  # the planner's gradients were its own
    plan = measured.plan("70%")
    plan.apply()
    step()  # the first micro-step allocates the gradients; the later ones accumulate
    for peak in loop_peaks(step, lambda: model.zero_grad(set_to_none=False)):
        assert peak <= plan.budget
        assert abs(peak - plan.predicted_peak) <= 0.03 * peak


OPTIMIZERS = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam-for-loop": lambda ps: torch.optim.Adam(ps, foreach=False),
    "adam-foreach": lambda ps: torch.optim.Adam(ps, foreach=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, fused=True),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_an_iteration_with_the_optimizer_step_holds_a_device_total(name):
    model, step = user_model()
    optimizer = OPTIMIZERS[name](model.parameters())
    weights = [p.detach().clone() for p in model.parameters()]
    measured = measure(model, step, is_block, CANDIDATES, repeats=1, progress=False, optimizer=optimizer)
    # Planning neither trained the model nor moved the optimizer.
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))
    assert not optimizer.state
    resident = measured.resident
    total = resident.before_step + measured.budget_bytes("70%")
    plan = measured.plan(f"{total}B")
    plan.apply()

    def iteration() -> None:
        step()
        optimizer.step()

    model.zero_grad()
    iteration()  # the first iteration allocates the optimizer's state, counted before the step from then on
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values())
    assert state <= resident.optimizer
    for peak in loop_peaks(iteration, model.zero_grad):
        assert resident.parameters + state + peak <= total


class LossModel(UserModel):
    """The user's module as Trainer takes it: keyword inputs, a dict with the loss."""

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": super().forward(x).pow(2).mean()}


def test_a_plan_holds_in_trainers_loop(tmp_path):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = LossModel(dim=128)
    rows = [{"x": torch.randn(256, 128)} for _ in range(6)]

    def step() -> None:
        model(torch.stack([rows[0]["x"], rows[1]["x"]]))["loss"].backward()

    plan = measure(model, step, is_block, CANDIDATES, repeats=1, progress=False).plan("80%")
    plan.apply()
    peaks = trainer_step_peaks(model, rows, str(tmp_path))
    assert len(peaks) == 3 and max(peaks) <= plan.budget
