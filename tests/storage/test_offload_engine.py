"""The offload engine's logic on CPU tensors: arena reuse across steps, the in-flight bound, prefetch order,
pinning failure. (On CUDA the same code adds streams and events; see the cuda test at the end.)"""

from __future__ import annotations

import contextlib
import gc
import warnings

import pytest
import torch

import fastckpt
from fastckpt.storage import offload
from tests.models import TransformerBlock


class FakeEvent:
    """Completes only when synchronized; records the order in which that happened, and its stream."""

    log: list[FakeEvent] = []

    def __init__(self) -> None:
        self.done = False
        self.stream: FakeStream | None = None

    def record(self, stream) -> None:
        self.stream = stream

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True
        FakeEvent.log.append(self)


class FakeStream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append((self.name, "waits for stream", other.name))

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append((self.name, "waits for event on", event.stream.name))

    def __repr__(self) -> str:
        return self.name


class RecordingStreams:
    """offload.CudaStreams' stand-in: CPU tensors treated as on an asynchronous device; every wait, switch
    and keep-alive logged in order."""

    def __init__(self) -> None:
        self.log: list = []
        self.compute = FakeStream("compute", self.log)
        self._current = [self.compute]
        self.made = 0

    def applies(self, device) -> bool:
        return True

    def current(self, device) -> FakeStream:
        return self._current[-1]

    def new_stream(self, device) -> FakeStream:
        self.made += 1
        return FakeStream(f"side{self.made}", self.log)

    @contextlib.contextmanager
    def on(self, stream):
        self._current.append(stream)
        try:
            yield
        finally:
            self._current.pop()

    def new_event(self) -> FakeEvent:
        return FakeEvent()

    def keep_alive(self, tensor, stream) -> None:
        self.log.append(("keep alive on", stream.name))


def pageable(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def engine(**kwargs) -> offload.OffloadEngine:
    return offload.OffloadEngine(offload.HostArena(pageable), **kwargs)


def one_step(eng: offload.OffloadEngine, tensors_per_segment: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Forward: each segment's tensors to host; backward: segments in reverse, each entered then unpacked."""
    groups = [eng.group() for _ in tensors_per_segment]
    copies = [[eng.to_host(t, g) for t in ts] for g, ts in zip(groups, tensors_per_segment, strict=True)]
    back = []
    for group, segment in zip(reversed(groups), reversed(copies), strict=True):
        eng.entering(group)
        back += [eng.to_device(c) for c in segment]
    del copies, groups
    gc.collect()  # the stored tensors are gone: their buffers go back to the arena
    return back


def segments(seed: int) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    sizes = [[(64, 32), (16,)], [(8, 8, 8)], [(100,), (3, 5), (64, 32)]]
    return [[torch.randn(*s, generator=generator) for s in seg] for seg in sizes]


def test_values_come_back_exactly_and_unaliased():
    eng = engine()
    tensors = segments(0)
    back = one_step(eng, tensors)
    expected = [t for seg in reversed(tensors) for t in seg]
    assert all(torch.equal(b, e) for b, e in zip(back, expected, strict=True))
    one_step(eng, segments(1))  # reuses the buffers the first step's results came from
    assert all(torch.equal(b, e) for b, e in zip(back, expected, strict=True))


def test_the_arena_allocates_in_the_first_step_only():
    eng = engine()
    one_step(eng, segments(0))
    first = (eng.arena.allocations, eng.arena.allocated_bytes)
    assert first[0] == 6 and eng.arena.reuses == 0
    for seed in (1, 2):
        one_step(eng, segments(seed))
    assert (eng.arena.allocations, eng.arena.allocated_bytes) == first  # exact sizes: every buffer reused
    assert eng.arena.reuses == 12
    assert eng.arena.free_bytes == first[1]


def test_in_flight_copies_are_bounded_oldest_first():
    FakeEvent.log.clear()
    tensor = torch.randn(256)  # 1 KiB
    eng = engine(max_in_flight_bytes=3 * 1024, streams=RecordingStreams())
    copies = [eng.to_host(tensor) for _ in range(5)]
    assert eng.waits_for_bound == 2
    assert FakeEvent.log == [copies[0].copied, copies[1].copied]  # the oldest copies were waited for
    copies[2].copied.done = True  # finished copies leave the queue without a wait
    eng.to_host(tensor)
    assert eng.waits_for_bound == 2


def test_a_reused_buffer_waits_for_the_copy_that_last_read_it():
    streams = RecordingStreams()
    eng = engine(streams=streams)
    copy = eng.to_host(torch.randn(64))
    eng.to_device(copy)
    last_read = copy.last_read[0]
    assert isinstance(last_read, FakeEvent) and last_read.stream is streams.compute
    del copy
    gc.collect()
    streams.log.clear()
    eng.to_host(torch.randn(64))  # the same buffer: written only after the read on the compute stream
    assert ("side1", "waits for event on", "compute") in streams.log and eng.arena.reuses == 1


def test_copies_are_ordered_by_streams_and_events():
    streams = RecordingStreams()
    eng = engine(streams=streams)
    first, second = eng.group(), eng.group()
    x, y = torch.randn(64), torch.randn(32)
    cx, cy = eng.to_host(x, first), eng.to_host(y, second)
    # Forward: the copy stream waits for the stream that made the tensor, which stays alive on the copy stream.
    assert streams.log == [("side1", "waits for stream", "compute"), ("keep alive on", "side1")] * 2
    assert cx.copied.stream.name == "side1"
    streams.log.clear()
    eng.entering(second)  # prefetch `first` on its own stream, after its copy to host finished
    assert streams.log == [("side2", "waits for stream", "compute"), ("side2", "waits for event on", "side1")]
    streams.log.clear()
    back_y = eng.to_device(cy)  # not prefetched: the compute stream waits for the copy to host
    assert streams.log == [("compute", "waits for event on", "side1")]
    streams.log.clear()
    back_x = eng.to_device(cx)  # prefetched: wait for the prefetch, keep its memory alive on the compute stream
    assert streams.log == [("compute", "waits for event on", "side2"), ("keep alive on", "compute")]
    assert torch.equal(back_x, x) and torch.equal(back_y, y)


def test_entering_a_segment_prefetches_the_one_backward_runs_next():
    eng = engine()
    groups = [eng.group() for _ in range(3)]
    tensors = segments(0)
    copies = [[eng.to_host(t, g) for t in ts] for g, ts in zip(groups, tensors, strict=True)]
    eng.entering(groups[2])
    assert all(c.prefetched is not None for c in copies[1])
    assert all(c.prefetched is None for seg in (copies[0], copies[2]) for c in seg)
    assert eng.prefetched == 1
    back = [eng.to_device(c) for c in copies[1]]
    assert eng.prefetch_hits == 1 and torch.equal(back[0], tensors[1][0])
    assert copies[1][0].prefetched is None  # used once; a second unpack copies again
    torch.testing.assert_close(eng.to_device(copies[1][0]), tensors[1][0], rtol=0, atol=0)
    eng.entering(groups[1])
    assert all(c.prefetched is not None for c in copies[0]) and eng.prefetched == 3
    eng.entering(groups[1])  # entering again starts nothing new
    assert eng.prefetched == 3


def test_prefetch_stops_at_its_byte_bound():
    eng = engine(max_prefetch_bytes=9000)
    first, second = eng.group(), eng.group()
    copies = [eng.to_host(torch.randn(n), first) for n in (1024, 1024, 1024)]  # 4 KiB each
    eng.to_host(torch.randn(4), second)
    eng.entering(second)
    assert [c.prefetched is not None for c in copies] == [True, True, False]


def test_pinning_failure_warns_once_naming_host_memory(monkeypatch):
    real_empty = torch.empty

    def empty(*args, pin_memory=False, **kwargs):
        if pin_memory:
            raise RuntimeError("cudaHostAlloc failed: out of memory")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    arena = offload.HostArena()
    with pytest.warns(UserWarning, match="pinning 128 bytes of host memory failed.*pageable"):
        buffer, _ = arena.take(128)
    assert not buffer.is_pinned() and buffer.numel() == 128
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        arena.take(64)  # falls back without warning again


@pytest.mark.cuda
def test_cuda_steps_reuse_the_pinned_arena_and_prefetch():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(TransformerBlock(dim=64, dropout=0.0) for _ in range(3))).cuda()
    x = torch.randn(4, 128, 64, device="cuda")
    eng = offload.ENGINE

    def step():
        h = x
        for block in model:
            h = fastckpt.checkpoint(block, h, policy="int8+offload")
        h.pow(2).mean().backward()
        torch.cuda.synchronize()
        gc.collect()

    step()
    allocations, hits = eng.arena.allocations, eng.prefetch_hits
    step()
    assert eng.arena.allocations == allocations  # no pinned allocation after the first step
    assert eng.prefetch_hits > hits  # blocks 1 and 0 found their tensors already on the device


@pytest.mark.parametrize("policy", ["int8+offload", "offload"])
def test_an_offloaded_tensor_leaves_the_device_codec_payload_included(monkeypatch, policy):
    """What an offload policy keeps is its host copy alone: after the forward the device holds the output and
    nothing the segment saved (a codec's device payload was held beside its host copy)."""
    import numpy

    from fastckpt.memory import MemoryTrace

    # CPU tensors copied as a GPU's would be, into host buffers outside torch's allocator (as fastckpt.fits does)
    monkeypatch.setattr(offload.ENGINE, "copies_cpu_tensors", True)
    host = offload.HostArena(allocate=lambda nbytes: torch.from_numpy(numpy.empty(nbytes, dtype=numpy.uint8)))
    monkeypatch.setattr(offload.ENGINE, "arena", host)
    torch.manual_seed(0)
    layer = torch.nn.Linear(512, 512)
    x = torch.randn(256, 512, requires_grad=True)
    with MemoryTrace("cpu") as trace:
        y = fastckpt.checkpoint(lambda t: torch.tanh(layer(t)) * 2, x, policy=policy)
    live = sum(size for _, freed, size, _ in trace.lifetimes if freed is None)
    assert host.allocated_bytes > 0
    assert live <= 1.05 * y.nbytes, (live, y.nbytes)
    y.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
