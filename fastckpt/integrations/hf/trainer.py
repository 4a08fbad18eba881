"""What a training loop built around the model without telling fastckpt: the optimizer holding its parameters
(transformers' Trainer builds it after `enable`, inside `train()`) and the Trainer itself.

Neither is passed to the model's forward, where the first-batch plan runs, so both are found among the live
objects (`gc`), by identity: an optimizer whose parameter groups hold one of the model's trained parameters, a
Trainer whose `model` or `model_wrapped` is the model. accelerate's wrapper (`AcceleratedOptimizer`, what
Trainer's `self.optimizer` is) and fastckpt's own `OptimizerInBackward` are looked through to the optimizer that
owns the state.
"""

from __future__ import annotations

import gc
import warnings
from typing import Any

import torch


def _live(cls: type) -> list[Any]:
    """Every live instance of `cls` (unreachable ones collected first, so an earlier run's do not count)."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance() reads __class__, which some deprecated module objects warn on
        warnings.simplefilter("ignore")
        return [obj for obj in gc.get_objects() if isinstance(obj, cls)]


def innermost(optimizer: Any) -> Any:
    """The optimizer that owns the state, through wrappers that keep the optimizer they wrap as `.optimizer`."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def find_optimizer(model: torch.nn.Module, entry: str) -> torch.optim.Optimizer | None:
    """The one optimizer stepping `model`'s trained parameters, or None if there is none yet; ValueError (naming
    `entry` and the fix) when there are several."""
    trained = {id(p) for p in model.parameters() if p.requires_grad}
    found: dict[int, torch.optim.Optimizer] = {}
    for candidate in _live(torch.optim.Optimizer):
        owner = innermost(candidate)
        if any(id(p) in trained for group in owner.param_groups for p in group["params"]):
            found[id(owner)] = owner
    if len(found) > 1:
        names = ", ".join(sorted(type(o).__name__ for o in found.values()))
        raise ValueError(
            f"{entry}: {len(found)} optimizers hold the model's parameters ({names}); a device total counts one "
            "optimizer's state: pass the one your loop steps as plan_options={'optimizer': optimizer}"
        )
    return next(iter(found.values()), None)


def find_trainer(model: torch.nn.Module) -> Any:
    """The transformers Trainer training `model` (or the model wrapping it), or None."""
    import transformers

    for trainer in _live(transformers.Trainer):
        held = {id(getattr(trainer, name, None)) for name in ("model", "model_wrapped")}
        if id(model) in held:
            return trainer
    return None
