"""Moving saved tensors to host memory in forward and back in backward.

Device-to-host copies run on a side stream, ordered after the producing stream with an event;
the device tensor is kept alive (record_stream) until its copy finishes. Host buffers are pinned,
from torch's caching host allocator, so steady-state steps reuse the same pinned blocks; if
pinning fails the copy falls back to pageable memory once, with a warning naming host memory.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

_side_streams: dict[torch.device, torch.cuda.Stream] = {}
_pinning_failed = False


@dataclass
class HostCopy:
    """A tensor's bytes in host memory, with the event that marks its copy complete."""

    tensor: torch.Tensor
    device: torch.device
    copied: torch.cuda.Event | None


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


def _host_buffer(like: torch.Tensor) -> torch.Tensor:
    global _pinning_failed
    if not _pinning_failed:
        try:
            return torch.empty(like.shape, dtype=like.dtype, pin_memory=True)
        except RuntimeError as err:
            _pinning_failed = True
            warnings.warn(
                f"fastckpt offload: pinning {like.numel() * like.element_size()} bytes of host memory failed ({err}); "
                "falling back to pageable host memory, which makes copies synchronous and slower. Free host memory "
                "or raise the locked-memory limit (ulimit -l) to get pinned copies back.",
                stacklevel=3,
            )
    return torch.empty(like.shape, dtype=like.dtype)


def to_host(t: torch.Tensor) -> HostCopy:
    """Start copying `t` (a CUDA tensor) to host memory; returns at once."""
    host = _host_buffer(t)
    stream = _side_stream(t.device)
    stream.wait_stream(torch.cuda.current_stream(t.device))
    with torch.cuda.stream(stream):
        host.copy_(t, non_blocking=host.is_pinned())
        copied = torch.cuda.Event()
        copied.record(stream)
    t.record_stream(stream)  # the caching allocator must not reuse t's memory before the copy ran
    return HostCopy(host, t.device, copied)


def to_device(copy: HostCopy) -> torch.Tensor:
    """Bring a host copy back to its device on the current stream."""
    current = torch.cuda.current_stream(copy.device)
    if copy.copied is not None:
        current.wait_event(copy.copied)
    return copy.tensor.to(copy.device, non_blocking=copy.tensor.is_pinned())
