"""What `enable` puts on a model and `disable` takes off, behind one interface.

Each of the integration's patches (padded attention, the loss head, TRL's fused head, LoRA's input casts, the
tiled MLPs, the optimizer step in the backward, the first-batch plan) is a `Patch` subclass, holding no state of
its own (what it installed is in the model's state, state.py, or found on the model):

- `wanted(settings)`: whether `enable`'s arguments ask for it;
- `check(pretrained, settings)`: refuse, with the argument and the fix named, before anything is changed;
- `install(pretrained, settings)`: put it on the PreTrainedModel (again: replaces the earlier one);
- `remove(pretrained)`: take it off, giving back what it replaced (nothing where it is not on).

`enable` checks every wanted patch, then installs the wanted ones and removes the others, in
checkpointing.PATCHES' order; `disable` removes them all in reverse.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from fastckpt.policies import Policy


@dataclasses.dataclass(frozen=True)
class Settings:
    """What `enable` was called with; kept on the model (its state) so that later enable calls reuse it."""

    policy: Policy
    checkpoint_kwargs: dict[str, Any]
    budget: int | str | None = None  # plan on the first training batch for this budget (_FirstBatchPlan)
    plan_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    # The model enable() was given when it wraps the PreTrainedModel (a PEFT model: its forward is the entry
    # point). Held, not weakly referenced, so that copy.deepcopy maps it to the copy's.
    outer: Any = None
    loss_head: bool = False
    padded_attention: bool = False
    tile_mlp: int | None = None  # tokens per MLP tile; None: MLPs untiled
    optimizer_in_backward: bool = False

    def entry(self, pretrained: torch.nn.Module) -> torch.nn.Module:
        """The module whose forward a training step calls (hooks that must see each step go there)."""
        return pretrained if self.outer is None else self.outer


class Patch:
    """One thing `enable` installs on a PreTrainedModel; see the module's docstring. Used as a class (its methods
    are classmethods): a patch keeps no state of its own. A subclass defines `wanted`, `install` and `remove`
    (checked when the class is defined); `check` has a default, nothing to check."""

    REQUIRED = ("wanted", "install", "remove")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        missing = [name for name in Patch.REQUIRED if not callable(getattr(cls, name, None))]
        if missing:
            raise TypeError(f"{cls.__name__} is a Patch without {', '.join(missing)} (see fastckpt.integrations.hf"
                            ".patches)")  # fmt: skip

    @classmethod
    def check(cls, pretrained: torch.nn.Module, settings: Settings) -> None:
        """Raise where `settings` cannot be installed on `pretrained` (default: nothing to check)."""
