"""The transformers PreTrainedModel behind the model a user passes (a PEFT model unwrapped), checked for what
this package needs."""

from __future__ import annotations

from typing import Any

import torch

from fastckpt.integrations.hf import gateway


def _pretrained_model(model: Any) -> torch.nn.Module:
    """The transformers PreTrainedModel behind `model` (a PEFT model is unwrapped)."""
    if hasattr(model, "get_base_model") and not gateway.is_pretrained_model(model):
        model = model.get_base_model()  # peft.PeftModel
    if not gateway.is_pretrained_model(model):
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
