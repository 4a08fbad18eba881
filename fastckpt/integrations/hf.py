"""Hugging Face transformers: gradient checkpointing through fastckpt, with HF's own layer selection.

`enable(model, policy="int8")` turns on the model's activation checkpointing exactly as
`model.activation_checkpointing_enable()` does (same layers, `every_n_layers`, `use_cache`
handling, input-embedding grads for adapters), then points every checkpointing layer at
`fastckpt.checkpoint` instead of torch's. It also replaces the model's own
`activation_checkpointing_enable` on this instance, so that a later call of it (which is what
`transformers.Trainer` does for `gradient_checkpointing=True`) keeps using fastckpt instead of
silently switching back to torch's function.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from typing import Any

import torch

from fastckpt.api import checkpoint
from fastckpt.policies import Policy

# The keywords fastckpt.checkpoint takes besides the function and its arguments.
_CHECKPOINT_OPTIONS = frozenset(
    name for name, p in inspect.signature(checkpoint).parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY
)


@dataclasses.dataclass(frozen=True)
class _Settings:
    """What `enable` was called with; kept on the model so later enable calls reuse it."""

    policy: Policy
    checkpoint_kwargs: dict[str, Any]


def _pretrained_model(model: Any) -> torch.nn.Module:
    """The transformers PreTrainedModel behind `model` (a PEFT model is unwrapped)."""
    if hasattr(model, "get_base_model") and not hasattr(type(model), "_set_gradient_checkpointing"):
        model = model.get_base_model()  # peft.PeftModel
    if not isinstance(model, torch.nn.Module) or not hasattr(type(model), "_set_gradient_checkpointing"):
        raise TypeError(
            f"fastckpt.integrations.hf: `model` must be a transformers PreTrainedModel (or a PEFT model wrapping "
            f"one), got {type(model).__name__}; for other modules use fastckpt.apply or fastckpt.wrap"
        )
    if not hasattr(type(model), "activation_checkpointing_enable"):
        raise RuntimeError(
            "fastckpt.integrations.hf needs a transformers release with "
            "PreTrainedModel.activation_checkpointing_enable "
            "(tested with 5.23); upgrade transformers"
        )
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"fastckpt.integrations.hf: {type(model).__name__} does not support gradient checkpointing in "
            "transformers; wrap its blocks with fastckpt.apply(model, check_fn=...) instead"
        )
    return model


def _checkpoint_function(settings: _Settings, hf_kwargs: dict[str, Any] | None, offload: bool) -> functools.partial:
    """fastckpt.checkpoint bound to the settings; keywords HF passes along (e.g. from Trainer) take precedence."""
    kwargs = {**settings.checkpoint_kwargs, **(hf_kwargs or {})}
    policy = Policy.parse(kwargs.pop("policy", settings.policy))
    if offload and not policy.offload:  # HF's `offload=True`: what the layers keep goes to host memory
        policy = dataclasses.replace(policy, offload=True)
    _check_options(kwargs)
    return functools.partial(checkpoint, policy=policy, **kwargs)


def _check_options(kwargs: dict[str, Any]) -> None:
    unknown = sorted(set(kwargs) - _CHECKPOINT_OPTIONS)
    if unknown:
        raise TypeError(
            f"fastckpt.integrations.hf: unknown checkpoint keyword(s) {unknown}; fastckpt.checkpoint accepts "
            f"{sorted(_CHECKPOINT_OPTIONS)}"
        )


def _enable_through_fastckpt(
    model: torch.nn.Module,
    activation_checkpointing_kwargs: dict[str, Any] | None = None,
    every_n_layers: int = 1,
    offload: bool = False,
) -> None:
    """Stands in for the model's own `activation_checkpointing_enable`: HF selects the layers, fastckpt
    checkpoints them."""
    function = _checkpoint_function(model._fastckpt_settings, activation_checkpointing_kwargs, offload)
    type(model).activation_checkpointing_enable(model, every_n_layers=every_n_layers)
    for module in model.modules():
        if hasattr(module, "_gradient_checkpointing_func"):
            module._gradient_checkpointing_func = function


def enable(model: Any, policy: str | Policy = "recompute", *, every_n_layers: int = 1, **checkpoint_kwargs: Any) -> Any:
    """Turn on gradient checkpointing of a transformers model through fastckpt; returns `model`.

    The layers are those HF checkpoints (`every_n_layers` as in `activation_checkpointing_enable`);
    `checkpoint_kwargs` go to `fastckpt.checkpoint` (e.g. `use_reentrant=True`). Keywords that
    `transformers.Trainer` passes later (`gradient_checkpointing_kwargs`, which may include `policy`)
    are merged over these.
    """
    pretrained = _pretrained_model(model)
    if not isinstance(every_n_layers, int) or isinstance(every_n_layers, bool) or every_n_layers < 1:
        raise ValueError(
            f"fastckpt.integrations.hf.enable: `every_n_layers` must be an int >= 1, got {every_n_layers!r}"
        )
    settings = _Settings(Policy.parse(policy), dict(checkpoint_kwargs))
    _checkpoint_function(settings, None, offload=False)  # reject bad keywords before changing the model
    pretrained._fastckpt_settings = settings
    # An instance attribute shadows the class's method, so Trainer's later call (and the deprecated
    # gradient_checkpointing_enable, which forwards to it) lands here too. A bound method, not a
    # closure, so that copy.deepcopy binds the copy's to the copy.
    pretrained.activation_checkpointing_enable = types.MethodType(_enable_through_fastckpt, pretrained)
    _enable_through_fastckpt(pretrained, every_n_layers=every_n_layers)
    return model


def disable(model: Any) -> Any:
    """Turn gradient checkpointing off and give the model back its own enable method; returns `model`."""
    pretrained = _pretrained_model(model)
    pretrained.__dict__.pop("activation_checkpointing_enable", None)
    pretrained.__dict__.pop("_fastckpt_settings", None)
    pretrained.activation_checkpointing_disable()
    return model


def is_enabled(model: Any) -> bool:
    """True when some layer of `model` is checkpointed through fastckpt."""
    return any(
        getattr(module, "gradient_checkpointing", False)
        and getattr(getattr(module, "_gradient_checkpointing_func", None), "func", None) is checkpoint
        for module in _pretrained_model(model).modules()
    )
