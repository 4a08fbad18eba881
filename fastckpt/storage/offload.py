"""Moving saved tensors to host memory in forward and back in backward: the offload engine.

Forward: each device-to-host copy runs on a side stream, ordered after the producing stream with an
event, into a host buffer from `HostArena`; the device tensor stays alive (record_stream) until its copy
ran. At most `max_in_flight_bytes` of copies are queued: past that, forward waits for the oldest, so
device memory held by unfinished copies stays bounded.

Arena: host buffers are pinned (page-locked, so copies are asynchronous) and kept by exact size: a
buffer freed in one step serves the same-size tensor of the next, so steady-state steps pin nothing new.
A buffer returns to the arena when the stored tensor is gone, and is reused only after the copy that last
read it finished. If pinning fails, the arena warns once (naming host memory) and falls back to pageable
buffers.

Backward: tensors come back on the current stream. When a segment's first tensor is unpacked, the engine
prefetches the tensors of the segment packed before it (the one backward runs next) on another side
stream, up to `max_prefetch_bytes`, so its copies overlap this segment's backward.

The logic (arena reuse, the in-flight bound, prefetch order, which stream waits for what) does not depend on
CUDA: on CPU tensors the engine copies synchronously, and tests substitute recording streams and events
(`CudaStreams` is the one place that calls torch.cuda) and their own allocator.
"""

from __future__ import annotations

import collections
import contextlib
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

DEFAULT_MAX_IN_FLIGHT_BYTES = 256 * 2**20  # queued device-to-host copies before forward waits for the oldest
DEFAULT_MAX_PREFETCH_BYTES = 256 * 2**20  # host-to-device copies started ahead of backward


class HostArena:
    """Exact-size host buffers (uint8), reused across steps.

    `allocate(nbytes)` makes a new buffer (default: pinned host memory, pageable after a failed pin).
    `allocations`/`allocated_bytes` count buffers made, `reuses` buffers handed out again.
    """

    def __init__(self, allocate: Callable[[int], torch.Tensor] | None = None) -> None:
        self._allocate = allocate or self._pinned
        self._free: dict[int, list[tuple[torch.Tensor, Any]]] = {}
        self._pinning_failed = False
        self.allocations = 0
        self.allocated_bytes = 0
        self.reuses = 0

    def take(self, nbytes: int) -> tuple[torch.Tensor, Any]:
        """A buffer of exactly `nbytes`, and the event after which it may be written (None: at once)."""
        free = self._free.get(nbytes)
        if free:
            self.reuses += 1
            return free.pop()
        self.allocations += 1
        self.allocated_bytes += nbytes
        return self._allocate(nbytes), None

    def give_back(self, buffer: torch.Tensor, last_read: list) -> None:
        """Return `buffer`; `last_read[0]` is the event of the copy that last read it (or None)."""
        self._free.setdefault(buffer.numel(), []).append((buffer, last_read[0] if last_read else None))

    @property
    def free_bytes(self) -> int:
        return sum(size * len(buffers) for size, buffers in self._free.items())

    def _pinned(self, nbytes: int) -> torch.Tensor:
        if not self._pinning_failed:
            try:
                return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            except RuntimeError as err:
                self._pinning_failed = True
                warnings.warn(
                    f"fastckpt.checkpoint (offload): pinning {nbytes} bytes of host memory failed ({err}); falling "
                    "back to pageable host memory, which makes copies synchronous and slower. Free host memory or "
                    "raise the locked-memory limit (ulimit -l) to get pinned copies back.",
                    stacklevel=4,
                )
        return torch.empty(nbytes, dtype=torch.uint8)


class HostCopy:
    """A tensor's bytes in host memory: the view `tensor` of an arena buffer, the event marking the copy
    complete, and a prefetched device tensor while one waits to be used."""

    __slots__ = ("tensor", "device", "copied", "prefetched", "last_read", "__weakref__")

    def __init__(self, tensor: torch.Tensor, device: torch.device, copied: Any) -> None:
        self.tensor = tensor
        self.device = device
        self.copied = copied
        self.prefetched: tuple[torch.Tensor, Any] | None = None
        self.last_read: list = [None]  # shared with the arena's finalizer: the last copy out of the buffer


class OffloadGroup:
    """The host copies of one segment, in pack order; the engine prefetches a group as a whole."""

    def __init__(self) -> None:
        self.copies: list[weakref.ref] = []
        self.prefetch_started = False


class CudaStreams:
    """The streams and events that order the engine's copies of CUDA tensors (other devices: none, copies
    are synchronous). Tests substitute a recording stand-in to check the ordering without a GPU."""

    def applies(self, device: torch.device) -> bool:
        return device.type == "cuda"

    def current(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)

    def on(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def new_event(self) -> Any:
        return torch.cuda.Event()

    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
        """`tensor`'s memory is not reused before what `stream` has enqueued so far ran."""
        tensor.record_stream(stream)


class OffloadEngine:
    """Device-to-host copies in forward, host-to-device copies (and prefetch) in backward, ordered by
    `streams` (CudaStreams)."""

    def __init__(
        self,
        arena: HostArena | None = None,
        max_in_flight_bytes: int = DEFAULT_MAX_IN_FLIGHT_BYTES,
        max_prefetch_bytes: int = DEFAULT_MAX_PREFETCH_BYTES,
        streams: Any = None,
    ) -> None:
        self.arena = arena or HostArena()
        self.max_in_flight_bytes = max_in_flight_bytes
        self.max_prefetch_bytes = max_prefetch_bytes
        self.streams = streams or CudaStreams()
        self._in_flight: collections.deque[tuple[Any, int]] = collections.deque()
        self._groups: list[weakref.ref] = []  # in forward (pack) order
        self._streams: dict[tuple[torch.device, str], Any] = {}
        # False: tensors already in host memory (a CPU step's) are kept as they are. True: copied into the arena
        # like a GPU's (fastckpt.fits measures on a CPU what a GPU would keep on its device).
        self.copies_cpu_tensors = False
        self.waits_for_bound = 0  # times forward waited for a queued copy to finish
        self.sent_bytes = 0  # bytes copied to host memory so far (the planner reads each segment's share)
        self.prefetched = 0  # tensors copied back ahead of their use
        self.prefetch_hits = 0  # tensors whose unpack found them already prefetched

    # ---- forward ---------------------------------------------------------------------------------------

    def group(self) -> OffloadGroup:
        """A new group (one segment's copies), after every group made before it."""
        group = OffloadGroup()
        self._groups = [g for g in self._groups if g() is not None]
        self._groups.append(weakref.ref(group))
        return group

    def to_host(self, t: torch.Tensor, group: OffloadGroup | None = None) -> HostCopy:
        """Start copying `t` to host memory; returns at once (CUDA) or after the copy (CPU)."""
        nbytes = t.nbytes
        self.sent_bytes += nbytes
        self._bound_in_flight(nbytes)
        buffer, writable = self.arena.take(nbytes)
        host = buffer.view(t.dtype).view(t.shape) if nbytes else torch.empty(t.shape, dtype=t.dtype)
        stream = self._stream(t.device, "d2h")
        producer = self.streams.current(t.device) if stream is not None else None  # before switching to `stream`
        with self._on(stream):
            if stream is not None:
                stream.wait_stream(producer)  # t is complete
                if writable is not None:
                    stream.wait_event(writable)  # the buffer's last host-to-device copy has read it
            elif writable is not None:
                writable.synchronize()
            host.copy_(t, non_blocking=stream is not None and host.is_pinned())
            copied = self._event(stream)
        if stream is not None:
            self.streams.keep_alive(t, stream)  # the allocator must not reuse t's memory before the copy ran
        if copied is not None:
            self._in_flight.append((copied, nbytes))
        copy = HostCopy(host, t.device, copied)
        if nbytes:
            weakref.finalize(copy, self.arena.give_back, buffer, copy.last_read)
        if group is not None:
            group.copies.append(weakref.ref(copy))
        return copy

    def _bound_in_flight(self, nbytes: int) -> None:
        while self._in_flight and self._in_flight[0][0].query():
            self._in_flight.popleft()
        queued = sum(n for _, n in self._in_flight)
        while self._in_flight and queued + nbytes > self.max_in_flight_bytes:
            event, n = self._in_flight.popleft()
            event.synchronize()
            queued -= n
            self.waits_for_bound += 1

    # ---- backward --------------------------------------------------------------------------------------

    def to_device(self, copy: HostCopy) -> torch.Tensor:
        """`copy` back on its device, on the current stream (the prefetched tensor if there is one)."""
        if copy.prefetched is not None:
            tensor, ready = copy.prefetched
            copy.prefetched = None
            self.prefetch_hits += 1
            if ready is not None:
                current = self.streams.current(copy.device)
                current.wait_event(ready)
                self.streams.keep_alive(tensor, current)  # made on the prefetch stream, used (and freed) here
            return tensor
        current = self.streams.current(copy.device) if self.streams.applies(copy.device) else None
        if current is not None and copy.copied is not None:
            current.wait_event(copy.copied)
        tensor = copy.tensor.to(copy.device, non_blocking=current is not None and copy.tensor.is_pinned(), copy=True)
        copy.last_read[0] = self._event(current)
        return tensor

    def entering(self, group: OffloadGroup) -> None:
        """`group`'s backward begins: prefetch the group packed before it (the next one backward needs)."""
        groups = [g() for g in self._groups]
        if group not in groups:
            return
        earlier = [g for g in groups[: groups.index(group)] if g is not None]
        if earlier and not earlier[-1].prefetch_started:
            self._prefetch(earlier[-1])

    def _prefetch(self, group: OffloadGroup) -> None:
        group.prefetch_started = True
        budget = self.max_prefetch_bytes
        for ref in group.copies:
            copy = ref()
            if copy is None or copy.prefetched is not None:
                continue
            nbytes = copy.tensor.nbytes
            if nbytes > budget:
                break
            budget -= nbytes
            stream = self._stream(copy.device, "h2d")
            compute = self.streams.current(copy.device) if stream is not None else None
            with self._on(stream):
                if stream is not None:
                    stream.wait_stream(compute)  # after what backward has enqueued so far
                    if copy.copied is not None:
                        stream.wait_event(copy.copied)
                pinned = stream is not None and copy.tensor.is_pinned()
                tensor = copy.tensor.to(copy.device, non_blocking=pinned, copy=True)
                ready = self._event(stream)
            copy.prefetched = (tensor, ready)
            copy.last_read[0] = ready
            self.prefetched += 1

    # ---- streams and events ----------------------------------------------------------------------------

    def _stream(self, device: torch.device, purpose: str) -> Any:
        """The side stream for `purpose` on `device`; None where copies are synchronous."""
        if not self.streams.applies(device):
            return None
        key = (device, purpose)
        if key not in self._streams:
            self._streams[key] = self.streams.new_stream(device)
        return self._streams[key]

    def _on(self, stream: Any) -> contextlib.AbstractContextManager:
        return self.streams.on(stream) if stream is not None else contextlib.nullcontext()

    def _event(self, stream: Any) -> Any:
        """An event recorded on `stream` now; None where copies are synchronous (no stream)."""
        if stream is None:
            return None
        event = self.streams.new_event()
        event.record(stream)
        return event


ENGINE = OffloadEngine()  # the process's engine: one arena, one in-flight bound, one prefetch order


def to_host(t: torch.Tensor, group: OffloadGroup | None = None) -> HostCopy:
    """Start copying `t` (a CUDA tensor) to host memory with the process's engine; returns at once."""
    return ENGINE.to_host(t, group)


def to_device(copy: HostCopy) -> torch.Tensor:
    """Bring a host copy back to its device on the current stream."""
    return ENGINE.to_device(copy)


@contextlib.contextmanager
def copies_apart(device: torch.device) -> Iterator[HostArena]:
    """The engine's host buffers counted apart from the device's memory, in a new arena (its `allocated_bytes`).
    On a CPU the engine then copies the step's tensors as it would a GPU's, into buffers from numpy, outside
    torch's allocator and so outside a measured peak: what a GPU's device would keep (fastckpt.fits, and the
    planner's offload candidates tested on a CPU)."""
    import numpy

    on_cpu = device.type == "cpu"
    if on_cpu:
        arena = HostArena(allocate=lambda nbytes: torch.from_numpy(numpy.empty(nbytes, dtype=numpy.uint8)))
    else:
        arena = HostArena()
    saved = ENGINE.arena, ENGINE.copies_cpu_tensors
    ENGINE.arena, ENGINE.copies_cpu_tensors = arena, on_cpu
    try:
        yield arena
    finally:
        ENGINE.arena, ENGINE.copies_cpu_tensors = saved
