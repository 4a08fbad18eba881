"""What the HF integration keeps about a model, in one place: one `ModelState` per transformers PreTrainedModel,
held in one attribute (`ATTRIBUTE`) of the model and read and written through this module only; and what it notes
about a tensor (an attention mask's recognised form), held beside the tensor, never on it.

The state lives on the model (not in a registry here) so that it follows the model: a deep copy of the model
copies it, and it goes when the model goes. `disable()` clears it (`forget`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.weak import WeakTensorKeyDictionary

ATTRIBUTE = "_fastckpt"


@dataclasses.dataclass
class ModelState:
    # enable(): its settings (policy, checkpoint keywords, budget); None: not enabled
    settings: Any = None
    # the loss head (loss_head.py): on; the instance-level forward it found at install (e.g. accelerate's); the
    # tokens per chunk a plan chose (None: linear_cross_entropy's default); while a list, each loss call's inputs
    # are appended to it (the planner's chunk options); the fallback warning given once
    loss_head: bool = False
    inner_forward: Callable[..., Any] | None = None
    loss_chunk: int | None = None
    loss_record: list | None = None
    loss_head_warned: bool = False
    # TRL's fused head served (trl_head.py): said once that it is, or why not; said once that mixed dtypes leave
    # it to TRL; this call's TiedGradient, from the backbone's pre-hook to the kernel; this call's mask of the
    # positions TRL scores, from the model's pre-hook to the kernel
    trl_said: bool = False
    trl_said_mixed: bool = False
    trl_tied: Any = None
    trl_scored: torch.Tensor | None = None
    # enable(budget=) (planning.py): the applied Plan; every plan kept, [(the planned call's tensor shapes by name,
    # Plan)]; the first-batch hook's handle; True while the planning steps run
    plan: Any = None
    plans: list = dataclasses.field(default_factory=list)
    plan_hook: Any = None
    planning: bool = False
    # enable(optimizer_in_backward=True) (trainer.py): {"hook": enable's hook, then what attaching added}; None: off
    step_in_backward: dict | None = None


def of(pretrained: torch.nn.Module) -> ModelState:
    """`pretrained`'s state, made on first use (`pretrained`: the PreTrainedModel, PEFT's unwrapped)."""
    found = pretrained.__dict__.get(ATTRIBUTE)
    if found is None:
        found = pretrained.__dict__[ATTRIBUTE] = ModelState()
    return found


def read(pretrained: torch.nn.Module) -> ModelState:
    """`pretrained`'s state for reading: a fresh default one (not kept) where it has none."""
    return pretrained.__dict__.get(ATTRIBUTE) or ModelState()


def forget(pretrained: torch.nn.Module) -> None:
    """Drop `pretrained`'s state (disable(): whatever it described has been removed)."""
    pretrained.__dict__.pop(ATTRIBUTE, None)


# What padded attention recognised in a mask (its version when seen, the verdict): all layers share one mask and
# recomputations pass it again. Weak: the entry goes with the mask.
mask_forms: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
