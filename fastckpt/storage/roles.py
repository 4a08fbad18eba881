"""Parameter casts: a saved tensor that is a low-precision copy of a parameter is kept as the parameter.

Under autocast, `F.linear(x, weight)` runs on a bf16 copy of the weight, and autograd saves that copy for the
input's gradient (grad_x = grad_y @ weight). Stored through a codec, the weight's quantization error reaches
every input gradient of the model: on a bf16 LoRA Llama step it was most of int8 storage's gradient error
(1.6x bf16 autocast's own against fp32, 1.0x with the copies kept exact). Kept plain, each layer's copy stays
alive until backward, though the parameter it came from is alive anyway. So a storage keeps such a tensor as a
reference to the parameter and casts it again when backward needs it: exact, and no bytes of its own.

A tensor is recognised as a cast of a parameter only while a torch function that received the parameter runs
(`ParameterWatch`, a function mode a storage enters around its segment under autocast): inside that call, a
saved tensor whose base has the parameter's shape, device and layout but another floating dtype, the autocast
dtype, is that call's cast of it, unless another tensor argument of the call has the same shape (then the
tensor is stored as any other). Not under torch.distributed (see `casts_recognised`).
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

_AUTOCAST_DEVICES = ("cuda", "cpu")


class ParameterCast:
    """A saved tensor as a view of `parameter` cast to `dtype`: cast again (and viewed) at unpack."""

    __slots__ = ("parameter", "dtype", "size", "stride", "offset", "version", "__weakref__")

    def __init__(self, parameter: torch.nn.Parameter, saved: torch.Tensor) -> None:
        self.parameter = parameter
        self.dtype = saved.dtype
        self.size, self.stride, self.offset = saved.size(), saved.stride(), saved.storage_offset()
        self.version = parameter._version

    def value(self) -> torch.Tensor:
        if self.parameter._version != self.version:
            p = self.parameter
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"[{p.type()} [{', '.join(map(str, p.shape))}]] is at version {p._version}; expected version "
                f"{self.version} instead. Hint: fastckpt keeps this parameter's {str(self.dtype)[6:]} copy by "
                "reference to the parameter; do not modify the parameter in place before backward."
            )
        cast = self.parameter.detach().to(self.dtype)
        return cast.as_strided(self.size, self.stride, self.offset)


class ParameterWatch(TorchFunctionMode):
    """Notes the parameters each running torch function received, innermost call last."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[tuple[torch.nn.Parameter, ...], tuple[torch.Tensor, ...]]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's signature)
        kwargs = kwargs or {}
        tensors = tuple(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
        parameters = tuple(t for t in tensors if isinstance(t, torch.nn.Parameter))
        if not parameters:
            return func(*args, **kwargs)
        self.calls.append((parameters, tensors))
        try:
            return func(*args, **kwargs)
        finally:
            self.calls.pop()

    def cast_of(self, saved: torch.Tensor) -> ParameterCast | None:
        """`saved` as a cast of a parameter of the innermost watched call, or None when it is not one."""
        if not self.calls or not saved.is_floating_point():
            return None
        parameters, tensors = self.calls[-1]
        base = saved._base if saved._base is not None else saved
        for parameter in parameters:
            if (
                base.shape == parameter.shape
                and base.dtype != parameter.dtype
                and base.device == parameter.device
                and base.stride() == parameter.stride()
                and base.storage_offset() == 0
                and base.device.type in _AUTOCAST_DEVICES
                and base.dtype == torch.get_autocast_dtype(base.device.type)
                and sum(t.shape == parameter.shape for t in tensors) == 1  # no other argument could be its source
            ):
                return ParameterCast(parameter, saved)
        return None


def casts_recognised() -> bool:
    """False under torch.distributed: there a parameter may be freed after the forward and gathered again for
    the backward (FSDP, DeepSpeed ZeRO-3), and the gather rewrites it in place, which a cast's version check
    cannot tell from a user's change; its copies are then stored as any other tensor."""
    return not (torch.distributed.is_available() and torch.distributed.is_initialized())


def autocast_enabled() -> bool:
    """True when autocast is on for a device whose casts a watch can recognise (and casts_recognised())."""
    return casts_recognised() and any(torch.is_autocast_enabled(device) for device in _AUTOCAST_DEVICES)
