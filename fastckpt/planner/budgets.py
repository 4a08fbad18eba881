"""Budgets: the three ways to say how much memory a step may use, each converted to bytes of the step.

- an int: bytes the step may allocate above what is live before it (the quantity fastckpt.memory.peak_bytes
  measures);
- "N%": N percent of the step's peak with every segment under 'recompute' (stock checkpointing);
- "20GiB", "1.5 GB", "800MiB", "2e9B": the device's total, what is live before the step (parameters, buffers,
  gradients kept between steps when the loop keeps them, optimizer state, anything else allocated) plus the
  step's peak. What is live before the step is measured once, by `Resident.measure`, before measure() runs its
  first step; the optimizer's state again once the planner's runs have stepped it (`Resident.with_state_of`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fastckpt.optimizer_in_backward import OptimizerInBackward

UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_UNIT_NAMES = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"  # case does not matter
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]+)\s*$", re.IGNORECASE)

# Optimizer state tensors per parameter (each the parameter's size) that the first optimizer.step() allocates,
# for the optimizers whose state a total budget can count before that step: exp_avg and exp_avg_sq (plus
# max_exp_avg_sq with amsgrad); SGD's momentum buffer.
_STATE_SLOTS = {"Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adagrad": 1, "RMSprop": 1}


@dataclass(frozen=True)
class Resident:
    """What is live on the model's device before the step, which no plan removes (bytes).

    parameters: the model's parameters and buffers. gradients: the parameters' gradients, those that exist
    before the step and those its backward allocates (already in the step's peak: `pending_gradients`; all of
    them in a loop that sets them to None before each step).
    optimizer: the optimizer's state, allocated or (before its first step, for the optimizers of _STATE_SLOTS)
    what its first step allocates. other: anything else the device's allocator holds (CUDA); on CPU there is no
    allocator count and only the model's and the optimizer's tensors are known, so it is 0.
    """

    parameters: int = 0
    gradients: int = 0
    pending_gradients: int = 0
    optimizer: int = 0
    other: int = 0

    @property
    def before_step(self) -> int:
        """Bytes that a total budget takes off before the step's own: all of it but the gradients the step
        allocates (those are in the step's peak)."""
        return self.parameters + self.gradients - self.pending_gradients + self.optimizer + self.other

    def describe(self) -> str:
        parts = [
            f"parameters and buffers {format_bytes(self.parameters)}",
            f"gradients {format_bytes(self.gradients)}"
            + (
                f" ({format_bytes(self.pending_gradients)} of them allocated by the step)"
                if self.pending_gradients
                else ""
            ),
            f"optimizer state {format_bytes(self.optimizer)}",
        ]
        if self.other:
            parts.append(f"other allocated tensors {format_bytes(self.other)}")
        return ", ".join(parts)

    def with_state_of(self, optimizer: Any, device: torch.device) -> Resident:
        """This, with the optimizer's state as allocated now (after a step) where that is more than was counted."""
        allocated = _nbytes((t for s in optimizer.state.values() for t in s.values()), device, set())
        return dataclasses.replace(self, optimizer=max(self.optimizer, allocated))

    @classmethod
    def measure(
        cls, model: nn.Module, device: torch.device, optimizer: Any = None, gradients: str = "set_to_none"
    ) -> Resident:
        """What is live on `device` now for `model` (and `optimizer`, whose not yet allocated state is estimated),
        before a step of a loop that leaves the gradients as `gradients` says (fastckpt.planner.iteration):
        'set_to_none', the step allocates all of them; 'kept', they exist before it, but for those that do not
        exist yet, which the step allocates."""
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                "fastckpt.plan: `optimizer` must be a torch.optim.Optimizer (its state counts towards a total "
                f"budget), got {type(optimizer).__name__}"
            )
        seen: set[int] = set()
        parameters = list(model.parameters())
        weights = _nbytes([*parameters, *model.buffers()], device, seen)
        existing = _nbytes((p.grad for p in parameters), device, seen)
        trained = [p for p in parameters if p.requires_grad and p.device == device]
        every = sum(p.numel() * p.element_size() for p in trained)
        # The gradients the step allocates (in its peak, not before it): all of them when the loop sets them to
        # None before each step, else those that do not exist yet.
        pending = every if gradients == "set_to_none" else sum(p.numel() * p.element_size() for p in trained
                                                                if p.grad is None)  # fmt: skip
        state = pending_state = 0
        if optimizer is not None:
            state = _nbytes((t for s in optimizer.state.values() for t in s.values()), device, seen)
            pending_state = _pending_state(optimizer, device)
        other = 0
        if device.type == "cuda":  # what the allocator holds besides the tensors counted (allocated ones only)
            other = max(0, torch.cuda.memory_allocated(device) - weights - existing - state)
        gradients_bytes = every if gradients == "set_to_none" else existing + pending
        return cls(weights, gradients_bytes, pending, state + pending_state, other)


def _nbytes(tensors: Any, device: torch.device, seen: set[int]) -> int:
    """Bytes of the storages of `tensors` on `device`, each counted once (`seen`: storages already counted); a
    wrapper subclass (torchao's 8-bit and 4-bit optimizer states, DTensor) by the tensors it holds."""
    total = 0
    for tensor in _plain_tensors(tensors):
        if tensor.device != device:
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def _plain_tensors(tensors: Any) -> Any:
    """The tensors among `tensors`, a wrapper subclass replaced by its inner tensors (`__tensor_flatten__`)."""
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            continue
        flatten = getattr(type(tensor), "__tensor_flatten__", None)
        if flatten is None:
            yield tensor
        else:
            yield from _plain_tensors(getattr(tensor, name) for name in tensor.__tensor_flatten__()[0])


def _pending_state(optimizer: Any, device: torch.device) -> int:
    """Bytes the first step of `optimizer` allocates for the parameters that have no state yet (0 if unknown)."""
    if isinstance(optimizer, OptimizerInBackward):  # its state is the wrapped optimizer's
        optimizer = optimizer.optimizer
    total = 0
    for group in optimizer.param_groups:
        slots = _STATE_SLOTS.get(type(optimizer).__name__, 0)
        if type(optimizer).__name__ in ("Adam", "AdamW") and group.get("amsgrad"):
            slots += 1
        if isinstance(optimizer, torch.optim.SGD) and group.get("momentum", 0):
            slots = 1
        for p in group["params"]:
            if p.requires_grad and p.device == device and not optimizer.state.get(p):
                total += slots * p.numel() * p.element_size()
    return total


def check_budget(budget: int | str) -> None:
    """`budget` is one of the three forms (TypeError/ValueError naming it otherwise)."""
    if isinstance(budget, bool) or not isinstance(budget, (int, str)):
        raise TypeError(
            "fastckpt.plan: `budget` must be bytes of the step (an int), a share of stock checkpointing's peak "
            f"('50%') or the device's total ('20GiB'), got {type(budget).__name__}"
        )
    if isinstance(budget, int) and budget <= 0:
        raise ValueError(f"fastckpt.plan: `budget` must be a positive number of bytes, got {budget}")
    if isinstance(budget, str):
        _parse(budget)


def is_total(budget: int | str) -> bool:
    """True for a budget of the device's total ('20GiB')."""
    return isinstance(budget, str) and _parse(budget)[0] == "total"


def total_bytes(size: str) -> int:
    """A device total ('20GiB', '80 GB') in bytes; ValueError for anything else."""
    kind, value = _parse(size)
    if kind != "total":
        raise ValueError(f"fastckpt: {size!r} is not a memory size such as '20GiB'")
    return int(value)


def _parse(budget: str) -> tuple[str, float]:
    """('percent', N) or ('total', bytes) for a budget string."""
    text = budget.strip()
    value, kind = float("nan"), "percent"
    if text.endswith("%"):
        try:
            value = float(text[:-1])
        except ValueError:
            pass
    else:
        match = _SIZE.match(text)
        if match and match.group(2).lower() in UNITS:
            kind, value = "total", float(match.group(1)) * UNITS[match.group(2).lower()]
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(
            f"fastckpt.plan: budget {budget!r} is neither a percentage such as '50%' (of stock checkpointing's "
            f"peak) nor a device total such as '20GiB' (units: {_UNIT_NAMES}); an int is bytes of the step"
        )
    return kind, value


def step_bytes(budget: int | str, reference_peak: int, resident: Resident | None) -> int:
    """A checked budget as bytes of the step: "N%" of `reference_peak`; a total less `resident.before_step`
    (ValueError when that leaves nothing, naming what is live)."""
    check_budget(budget)
    if isinstance(budget, int):
        return budget
    kind, value = _parse(budget)
    if kind == "percent":
        return max(1, int(reference_peak * value / 100))
    if resident is None:
        raise ValueError(
            f"fastckpt.plan: a device total ({budget!r}) needs what is live before the step, which these "
            "Measurements were built without; use fastckpt.planner.measure, or a budget in bytes of the step or '%'"
        )
    left = int(value) - resident.before_step
    if left <= 0:
        raise ValueError(
            f"fastckpt.plan: the total {budget!r} ({format_bytes(int(value))}) is less than what is live before the "
            f"step and no plan removes: {resident.describe()} ({format_bytes(resident.before_step)} besides the "
            f"step's own gradients); the step needs about {format_bytes(reference_peak)} under stock checkpointing "
            "on top"
        )
    return left


def format_bytes(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"
