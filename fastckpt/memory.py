"""Peak memory of a step, and live/peak bytes between named instants of it (what the planner measures).

Bytes are those allocated since the trace started and not yet freed. CUDA: torch.cuda.memory_allocated /
max_memory_allocated relative to the start, the peak counter reset at each mark (frees of older blocks
count there). CPU: there is no allocator counter, so the step runs under torch.profiler with
profile_memory=True; every allocation and free is a record with its address, and each mark is a
zero-length profiler range. Replaying the records in time order gives the live bytes at each mark and the
peak between marks. Frees of blocks allocated before the trace are ignored: the profiler reports one only
when an earlier profiled run allocated it, which would make the numbers depend on history. The lines the
profiler's C++ side (kineto) writes to stderr as it starts and stops are dropped (`stderr_without`).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from fastckpt import _compat

_MARK = "fastckpt.memory.mark:"
# What kineto writes to file descriptor 2 at every start and stop of the profiler, whatever it profiles: its trace
# points ("USDT:<date> ... profiler_start", "profiler_stop") and, on a CUDA build without a GPU, the device count
# it asks for ("ERROR:<date> ... DeviceProperties.cpp:56] gpuGetDeviceCount failed with code 35"). Only
# KINETO_LOG_LEVEL=6 would keep them unwritten, read once at the process's first profile and hiding kineto's real
# errors too (torch 2.14.1: USDT is level 5, ERROR 4).
_KINETO_NOISE = re.compile(r"(?:USDT:\d{4}-\d\d-\d\d |ERROR:\d{4}-\d\d-\d\d .*\] gpuGetDeviceCount failed)")


@dataclass(frozen=True)
class Point:
    """One mark: live bytes at it, and the peak since the previous mark (or the trace's start)."""

    key: str
    live: int
    peak_before: int


class MemoryTrace:
    """Context manager recording live and peak bytes at `mark(key)` calls, relative to its entry."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"fastckpt.memory: measures cpu and cuda devices, not {self.device.type!r}")
        self.points: list[Point] = []
        # CPU: every block allocated inside the trace as (marks made before its allocation, marks made before
        # its free or None if still live at the end, bytes, address); None on CUDA (no allocation records).
        self.lifetimes: list[tuple[int, int | None, int, int]] | None = None
        # CPU: the blocks live at the trace's highest instant (`peak`) as (marks made before their allocation,
        # bytes, address): what the peak is made of; None on CUDA.
        self.at_peak: list[tuple[int, int, int]] | None = None
        self._keys: list[str] = []
        self._profiler: torch.profiler.profile | None = None
        self._base = 0

    def __enter__(self) -> MemoryTrace:
        self.points, self._keys = [], []
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            # Checked before the step runs: a torch without these cannot replay what the profiler recorded.
            _compat.require("profiler_allocation_fields")
            _compat.require("profiler_event_tree")
            self._profiler = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
            )
            with stderr_without(_KINETO_NOISE.match):
                self._profiler.__enter__()
        return self

    def mark(self, key: str) -> None:
        """Record this instant under `key` (called from hooks too, forward or backward)."""
        if self.device.type == "cuda":
            # The caching allocator's counters are host-side and updated as ops are enqueued: no sync needed.
            live = torch.cuda.memory_allocated(self.device) - self._base
            peak = torch.cuda.max_memory_allocated(self.device) - self._base
            torch.cuda.reset_peak_memory_stats(self.device)
            self.points.append(Point(key, live, peak))
        else:
            with torch.profiler.record_function(f"{_MARK}{len(self._keys)}"):
                pass
            self._keys.append(key)

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.mark("end")
            return
        self._keys.append("end")
        with stderr_without(_KINETO_NOISE.match):
            self._profiler.__exit__(*exc)
        if exc[0] is None:
            self.points, self.lifetimes, self.at_peak = _replay(self._profiler, self._keys)
        self._profiler = None

    @property
    def peak(self) -> int:
        """The highest live bytes anywhere in the trace (0 if nothing above the start was allocated)."""
        return max([0, *(p.peak_before for p in self.points), *(p.live for p in self.points)])


def _replay(
    profiler: torch.profiler.profile, keys: list[str]
) -> tuple[list[Point], list[tuple[int, int | None, int, int]], list[tuple[int, int, int]]]:
    """Points (in mark order) from the profiler's allocation records and mark ranges, replayed in time order,
    the blocks' lifetimes (MemoryTrace.lifetimes) and the blocks live at the highest instant (MemoryTrace.at_peak)."""
    allocation = _compat.require("profiler_allocation_fields")
    events = []  # (time ns, kind: 0 mark / 1 allocation record, mark index or (address, bytes))
    stack = list(profiler.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        fields = event.extra_fields
        if isinstance(fields, allocation):
            if fields.device.type == "cpu":
                events.append((event.start_time_ns, 1, (fields.ptr, fields.alloc_size)))
        elif event.name.startswith(_MARK):
            events.append((event.start_time_ns, 0, int(event.name[len(_MARK) :])))
    delivered = {value for _, kind, value in events if kind == 0}
    last = max((t for t, _, _ in events), default=0)
    for index in range(len(keys)):
        if index not in delivered:  # the final mark is made after the profiler stopped: it sits at the end
            events.append((last + 1 + index, 0, index))
    # At equal times a mark comes before the allocation: records are stamped when the op starts.
    events.sort(key=lambda e: (e[0], e[1]))
    points: list[Point | None] = [None] * len(keys)
    blocks: dict[int, int] = {}
    born: dict[int, int] = {}  # per live block: marks made before its allocation
    lifetimes = []
    live = peak = marks = top = 0
    top_at: int | None = None  # the event at which live bytes were highest
    for index, (_, kind, value) in enumerate(events):
        if kind == 0:
            points[value] = Point(keys[value], live, peak)
            peak = live
            marks += 1
            continue
        address, delta = value
        if delta > 0:
            blocks[address] = blocks.get(address, 0) + delta
            born.setdefault(address, marks)
            live += delta
            peak = max(peak, live)
            if live > top:
                top, top_at = live, index
        elif address in blocks:  # a free of a block allocated inside the trace
            size = blocks.pop(address)
            lifetimes.append((born.pop(address), marks, size, address))
            live -= size
    lifetimes += [(born[address], None, size, address) for address, size in blocks.items()]
    return points, lifetimes, _live_at(events[: 0 if top_at is None else top_at + 1])


def _live_at(events: list[tuple[int, int, Any]]) -> list[tuple[int, int, int]]:
    """The blocks live after `events` (sorted marks and allocation records) as (marks before their allocation,
    bytes, address)."""
    blocks: dict[int, list[int]] = {}  # address: [marks before its allocation, bytes]
    marks = 0
    for _, kind, value in events:
        if kind == 0:
            marks += 1
            continue
        address, delta = value
        if delta > 0:
            blocks.setdefault(address, [marks, 0])[1] += delta
        else:
            blocks.pop(address, None)
    return [(born, size, address) for address, (born, size) in blocks.items()]


def peak_bytes(step: Callable[[], object], device: torch.device | str = "cpu") -> int:
    """Peak bytes allocated during one call of `step`, above what was live before it."""
    with MemoryTrace(device) as trace:
        step()
    return trace.peak


@contextlib.contextmanager
def stderr_without(noise: Callable[[str], object]) -> Iterator[None]:
    """Catch what is written to file descriptor 2 inside the block (C++ code's lines too); afterwards pass on every
    line but those `noise` is true for (so a Python warning or a traceback printed meanwhile still shows, later)."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no fd 2 (an embedded interpreter): nothing to drop
        yield
        return
    with tempfile.TemporaryFile(mode="w+b") as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            lines = caught.read().decode(errors="replace").splitlines(keepends=True)
            kept = [line for line in lines if not noise(line)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()
