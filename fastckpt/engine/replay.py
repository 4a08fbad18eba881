"""Capture, at forward, the ambient state a recompute must see again: RNG, autocast, default device."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import DefaultDeviceType

from fastckpt import _compat


def infer_device_type(tensors: Sequence[torch.Tensor]) -> str:
    """The accelerator type whose RNG/autocast state matters: 'cuda' if any input is there."""
    types = [t.device.type for t in tensors if t.device.type != "cpu"]
    if not types:
        return DefaultDeviceType.get_device_type()
    return "cuda" if "cuda" in types else types[0]


def _device_module(device_type: str) -> Any:
    return getattr(torch, device_type, None)


def _ambient_default_device() -> torch.device | None:
    """The device of an active `with torch.device(...)` block, if any."""
    mode_stack, device_context = _compat.function_mode_stack(), _compat.device_context()
    if mode_stack is None or device_context is None:
        _compat.warn_missing("function_mode_stack" if mode_stack is None else "device_context")
        return None
    for mode in reversed(mode_stack()):
        if isinstance(mode, device_context):
            return mode.device
    return None


@dataclass
class ForwardState:
    """What the forward saw; `replay()` reinstates it around a recompute and restores the caller's after."""

    device_type: str
    preserve_rng_state: bool
    cpu_rng: torch.Tensor | None
    device_ids: list[int]
    device_rngs: list[torch.Tensor]
    had_device_in_forward: bool
    device_autocast: dict[str, Any] | None
    cpu_autocast: dict[str, Any]
    default_device: torch.device | None

    @classmethod
    def capture(cls, tensors: Sequence[torch.Tensor], preserve_rng_state: bool) -> ForwardState:
        """Snapshot the state before the segment's forward runs (never initialises CUDA)."""
        device_type = infer_device_type(tensors)
        module = _device_module(device_type)
        # Only read device RNG if the device is already initialised: reading would initialise it.
        had_device = preserve_rng_state and _compat.device_initialized(module)
        device_ids = sorted({t.get_device() for t in tensors if t.device.type == device_type}) if had_device else []
        device_rngs = []
        for index in device_ids:
            with module.device(index):
                device_rngs.append(module.get_rng_state())
        device_autocast = None
        if torch.amp.is_autocast_available(device_type):
            device_autocast = {
                "enabled": torch.is_autocast_enabled(device_type),
                "dtype": torch.get_autocast_dtype(device_type),
                "cache_enabled": torch.is_autocast_cache_enabled(),
            }
        return cls(
            device_type=device_type,
            preserve_rng_state=preserve_rng_state,
            cpu_rng=torch.get_rng_state() if preserve_rng_state else None,
            device_ids=device_ids,
            device_rngs=device_rngs,
            had_device_in_forward=had_device,
            device_autocast=device_autocast,
            cpu_autocast={
                "enabled": torch.is_autocast_enabled("cpu"),
                "dtype": torch.get_autocast_dtype("cpu"),
                "cache_enabled": torch.is_autocast_cache_enabled(),
            },
            default_device=_ambient_default_device(),
        )

    def check_device_not_initialised_in_forward(self) -> None:
        """A forward that initialised the device has RNG state we never captured: refuse, as torch does."""
        module = _device_module(self.device_type)
        if self.preserve_rng_state and not self.had_device_in_forward and _compat.device_initialized(module):
            raise RuntimeError(
                "PyTorch's device state was initialized in the forward pass of a Checkpoint, which is not allowed. "
                "Initialise the device before the checkpointed call, or pass preserve_rng_state=False."
            )

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Run the block under the forward's RNG, autocast and default device; restore the caller's RNG after."""
        rng_devices = self.device_ids if self.had_device_in_forward else []
        with torch.random.fork_rng(devices=rng_devices, enabled=self.preserve_rng_state, device_type=self.device_type):
            if self.preserve_rng_state:
                torch.set_rng_state(self.cpu_rng)
                module = _device_module(self.device_type)
                for index, state in zip(self.device_ids, self.device_rngs, strict=True):
                    with module.device(index):
                        module.set_rng_state(state)
            device_autocast = (
                torch.amp.autocast(self.device_type, **self.device_autocast)
                if self.device_autocast is not None
                else contextlib.nullcontext()
            )
            # A fresh device context: re-entering the forward's instance on another thread would corrupt it.
            device_ctx = torch.device(self.default_device) if self.default_device else contextlib.nullcontext()
            with device_autocast, torch.amp.autocast("cpu", **self.cpu_autocast), device_ctx:
                yield
