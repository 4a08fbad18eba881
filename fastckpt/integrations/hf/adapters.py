"""PEFT LoRA's input casts that autocast undoes, switched off while it runs (`AdapterInputCasts`, a patch
`enable` installs: patches.py)."""

from __future__ import annotations

import weakref

import torch

from fastckpt.integrations.hf import gateway
from fastckpt.integrations.hf.patches import Patch, Settings


class _CastUnlessAutocast:
    """PEFT's `cast_input_dtype_enabled` of a vanilla LoRA `Linear` (no dropout, no DoRA-like variant), made
    false while autocast runs on the adapter's device.

    PEFT casts the layer's input to the adapter weights' dtype (a bf16 activation to fp32), and autocast casts
    it straight back to bf16 for lora_A's matmul: an activation-sized fp32 copy in the forward and an fp32
    gradient in the backward (the largest transient of a LoRA step's backward), and no value changes (both
    casts are exact, both ways), so the step is bit for bit the same without them. Without autocast the cast
    is what makes a bf16 input meet fp32 weights, so it stays. The flag is read at every forward; PEFT's own
    `disable_input_dtype_casting` still overrides it.
    """

    def __init__(self, layer: torch.nn.Module) -> None:
        self._layer = weakref.ref(layer)

    def __bool__(self) -> bool:
        layer = self._layer()
        if layer is None:
            return True
        device = next(iter(layer.lora_A.values())).weight.device.type
        return not torch.is_autocast_enabled(device)

    @staticmethod
    def _eligible(module: torch.nn.Module) -> bool:
        try:
            from peft.tuners.lora.layer import Linear
        except ImportError:
            return False
        return (
            isinstance(module, Linear)
            and gateway.adapter_input_cast(module) is True
            and not module.lora_variant
            and len(module.lora_A) > 0
            and all(isinstance(d, torch.nn.Identity) for d in module.lora_dropout.values())
        )


class AdapterInputCasts(Patch):
    """Every eligible LoRA layer's input-cast flag replaced by a `_CastUnlessAutocast` (always wanted)."""

    @classmethod
    def wanted(cls, settings: Settings) -> bool:
        return True

    @classmethod
    def install(cls, pretrained: torch.nn.Module, settings: Settings) -> None:
        for module in pretrained.modules():
            if _CastUnlessAutocast._eligible(module):
                gateway.set_adapter_input_cast(module, _CastUnlessAutocast(module))

    @classmethod
    def remove(cls, pretrained: torch.nn.Module) -> None:
        for module in pretrained.modules():
            if isinstance(gateway.adapter_input_cast(module), _CastUnlessAutocast):
                gateway.set_adapter_input_cast(module, True)
