"""Measuring candidates: a handful of step() runs, and what they give per candidate and segment.

Memory: every segment under one candidate at a time, one run per candidate under a MemoryTrace
(fastckpt.memory) with marks at each segment's forward start/end (module hooks) and at its backward start/end
(gradient hooks on its outputs/inputs). Time: untimed by the trace, runs that mix the candidates, each segment
under another (timing_rounds), so that one run times as many candidates as there are segments of a kind. From
the marks, per candidate p and segment i:

    K_i(p)  kept bytes: live bytes added from segment i's start to segment i+1's start (the last one: to its
            end). What the segment keeps for backward, plus its output minus its input when nothing keeps
            the input; the sum over segments 1..i is what is live at segment i+1's start.
    F_i(p)  forward excess: peak during segment i's forward (up to segment i+1's start) above its start.
    X_i(p)  backward level: peak during segment i's backward above L0 + K_1(p) + ... + K_i(p).
    T(p)    tail level: peak between the last segment's forward and its backward (the loss, the head)
            above L0 + sum of all K (attributed to the last segment's policy).
    t_i(p)  seconds in segment i's forward and backward (its recomputation included): per segment the fastest
            of p's runs on it, then the median over the segments of its kind that ran p (segment_seconds).

L0 (live at the first segment's start), the peak before it and the peak after the first segment's backward
do not depend on the policies; the planner takes the largest value any candidate showed.

The traced run also records what the segments share, which a mix of candidates changes (_Sharing; the peak
model in fastckpt.planner.model says how it is used): the stored forms each segment's forward made or reused,
the tensors from before the first segment each holds past the forward, and (CPU) its transient bytes.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from fastckpt.memory import MemoryTrace
from fastckpt.planner.candidates import BATCH_PREFIX, NONE, REFERENCE, Candidate, parse_candidate
from fastckpt.planner.checks import NonFinite, finite, max_relative_error
from fastckpt.planner.model import CandidateMeasurement, SegmentCost
from fastckpt.planner.segments import Segment, signature
from fastckpt.storage import offload
from fastckpt.storage.accounting import nbytes, track
from fastckpt.storage.packer import observe_shared


class _Recorder:
    """Marks of one run: their times, and their memory when a MemoryTrace is attached."""

    def __init__(self, device: torch.device, trace: MemoryTrace | None) -> None:
        self.device = device
        self.trace = trace
        self.keys: list[str] = []
        self.times: list[Any] = []
        self.sharing = _Sharing() if trace is not None else None
        self.sent: list[int] = []  # per mark: the bytes the offload engine had copied to host memory

    def mark(self, key: str) -> None:
        self.keys.append(key)
        self.sent.append(offload.ENGINE.sent_bytes)
        if self.trace is not None:
            self.trace.mark(key)
            self.sharing.check(len(self.keys) - 1)
        elif self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)  # no synchronization inside the step
            event.record()
            self.times.append(event)
        else:
            self.times.append(time.perf_counter())

    def elapsed(self) -> list[float]:
        """Seconds from the first mark to each mark."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return [self.times[0].elapsed_time(e) / 1e3 for e in self.times]
        return [t - self.times[0] for t in self.times]


@dataclass
class _Input:
    """A tensor the segments take that no segment made (the embedding output, the position embeddings...)."""

    name: tuple[int, int]  # (first segment taking it, position among that call's tensors): the same every run
    nbytes: int
    storage: StorageWeakRef
    receivers: list[int]
    freed_at: int | None = None  # the first mark at which its storage was found freed


def _dense(t: Any) -> bool:
    """A tensor with a storage of its own to follow (not sparse, nested or a subclass without one)."""
    return type(t) in (torch.Tensor, nn.Parameter) and t.layout == torch.strided and not t.is_nested


def _held_tensors(leaves: list[Any]) -> list[torch.Tensor]:
    """The dense tensors among `leaves`, a wrapper subclass (e.g. hf.attention's CausalSegmentsMask) standing
    for the tensors it holds (torch's `__tensor_flatten__`)."""
    tensors = []
    for t in leaves:
        if _dense(t):
            tensors.append(t)
        elif isinstance(t, torch.Tensor) and hasattr(t, "__tensor_flatten__"):
            names, _ = t.__tensor_flatten__()
            tensors += _held_tensors([getattr(t, name) for name in names])
    return tensors


class _Sharing:
    """What the segments of one traced run share, for mixes of candidates (fastckpt.planner.model): the tensors
    they take from before the first segment, which the model frees after the forward unless a segment holds
    them, and the forms the storage made of those once and reused in later segments (storage.packer)."""

    def __init__(self) -> None:
        self.inputs: dict[int, _Input] = {}  # by storage address
        self.outputs: dict[int, set[int]] = {}  # per segment: the storage addresses of its outputs
        self.current: int | None = None  # the segment whose forward runs
        self.forms: dict[int, dict[tuple, int]] = {}  # per segment: the shared forms its forward used, their bytes
        self.made: dict[int, set[tuple]] = {}  # per segment: those it made
        self.unshared: set[tuple] = set()  # forms made by more than one segment

    def entering(self, index: int, leaves: list[Any]) -> None:
        """Segment `index`'s forward starts with these leaves of its arguments."""
        self.current = index
        for position, t in enumerate(_held_tensors(leaves)):
            storage = t.untyped_storage()
            address = storage.data_ptr()
            made_by_a_segment = any(address in made for made in self.outputs.values())
            if address == 0 or made_by_a_segment or (t.is_leaf and t.requires_grad):
                continue  # another segment's output (the model's peak terms), or alive for the whole step
            if address not in self.inputs or self.inputs[address].storage.expired():  # (an address reused)
                self.inputs[address] = _Input((index, position), storage.nbytes(), StorageWeakRef(storage), [])
            if index not in self.inputs[address].receivers:
                self.inputs[address].receivers.append(index)

    def left(self, index: int, leaves: list[Any]) -> None:
        """Segment `index`'s forward ended with these leaves of its output."""
        self.current = None
        for t in _held_tensors(leaves):
            self.outputs.setdefault(index, set()).add(t.untyped_storage().data_ptr())

    def stored(self, key: tuple, stored: Any, made: bool) -> None:
        """packer.observe_shared's callback: a form of a segment input, made or reused in a forward."""
        source = self.inputs.get(key[0])
        if self.current is None or source is None or key[-1] is not None:  # backward, internal, or on host
            return
        form = (source.name, *key[1:])
        self.forms.setdefault(self.current, {})[form] = sum(nbytes(x) for x in stored.tensors)
        if made:
            if any(form in forms for forms in self.made.values()):
                self.unshared.add(form)  # made again: the first form died with the view it was made from
            self.made.setdefault(self.current, set()).add(form)

    def used(self, index: int) -> dict[tuple, int]:
        """The shared forms segment `index`'s forward used, and their bytes (those made in every segment that
        uses them are its own: its kept bytes have them)."""
        return {form: size for form, size in self.forms.get(index, {}).items() if form not in self.unshared}

    def check(self, mark: int) -> None:
        for source in self.inputs.values():
            if source.freed_at is None and source.storage.expired():
                source.freed_at = mark

    def held(self, spans: dict[str, tuple[int, int]], n: int) -> dict[tuple[int, int], tuple[int, int, list[int]]]:
        """Per input freed after the forward: (its bytes, h, the segments taking it), h the segment whose backward
        freed it, i.e. the first segment holding it (those after it that take it are taken to hold it too), or
        h = n when it was freed between the forward and the backward (none holds it). Inputs freed in the
        forward (the kept bytes have them) or never (kept outside the step) are left out. `spans`: _intervals'."""
        forward_end, backward_start = spans["tail"]
        found = {}
        for source in self.inputs.values():
            at = source.freed_at
            if at is None or at <= forward_end:
                continue
            # backward runs from the last segment to the first; segment i's starts at mark spans["bwd<i>"][0]
            h = n if at <= backward_start else min(i for i in range(n) if spans[f"bwd{i}"][0] < at)
            found[source.name] = (source.nbytes, h, source.receivers)
        return found


class _Instrumented:
    """The segments, each under its candidate, with hooks that mark their forward and backward boundaries."""

    def __init__(self, segments: list[Segment], assignment: list[Candidate], recorder: _Recorder) -> None:
        self.segments = segments
        self.recorder = recorder
        self.handles: list[Any] = []
        self.calls = [0] * len(segments)
        self.installed = []
        for index, (segment, candidate) in enumerate(zip(segments, assignment, strict=True)):
            runner = candidate.wrap(segment.module)
            if runner is not segment.module:
                setattr(segment.parent, segment.attribute, runner)
            self.installed.append(runner)
            self.handles.append(runner.register_forward_pre_hook(self._pre(index), with_kwargs=True))
            self.handles.append(runner.register_forward_hook(self._post(index)))

    def _pre(self, index: int) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self.calls[index] += 1
            self.recorder.mark(f"f{index}")
            leaves = tree_leaves((args, kwargs))
            if self.recorder.sharing is not None:
                self.recorder.sharing.entering(index, leaves)
            for t in leaves:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    self.handles.append(t.register_hook(self._grad_mark(f"B{index}")))

        return hook

    def _post(self, index: int) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            self.recorder.mark(f"F{index}")
            leaves = tree_leaves(output)
            if self.recorder.sharing is not None:
                self.recorder.sharing.left(index, leaves)
            for t in leaves:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    self.handles.append(t.register_hook(self._grad_mark(f"b{index}")))

        return hook

    def _grad_mark(self, key: str) -> Callable:
        def hook(grad: torch.Tensor) -> None:
            self.recorder.mark(key)

        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        for segment in self.segments:
            setattr(segment.parent, segment.attribute, segment.module)


def _run(
    segments: list[Segment], step: Callable[[], Any], candidate: Candidate | list[Candidate], recorder: _Recorder
) -> None:
    """One step() with every segment run as `candidate` (a list: one per segment), its boundaries marked on
    `recorder`; the model is left as it was."""
    assignment = candidate if isinstance(candidate, list) else [candidate] * len(segments)
    instrumented = _Instrumented(segments, assignment, recorder)
    try:
        recorder.mark("start")
        step()
        recorder.mark("end")
    finally:
        instrumented.remove()
    wrong = [(s.name, c) for s, c in zip(segments, instrumented.calls, strict=True) if c != 1]
    if wrong:
        raise ValueError(
            f"fastckpt.plan: each segment must run exactly once per step(); (segment, runs): {wrong}. The planner "
            "measures one forward and backward per segment"
        )
    missing = [s.name for i, s in enumerate(segments) if f"b{i}" not in recorder.keys]
    if missing:
        raise ValueError(
            f"fastckpt.plan: no gradient reached the outputs of segments {missing} in step(); step() must run the "
            "forward and the backward of the training step"
        )


def _boundaries(keys: list[str], n: int) -> list[str]:
    """The marks that delimit the intervals of the model, in the order the run must have made them."""
    order = ["start"] + [f"f{i}" for i in range(n)] + [f"F{n - 1}"] + [f"b{i}" for i in reversed(range(n))]
    position = {}
    for index, key in enumerate(keys):
        position.setdefault(key, index)
    positions = [position[k] for k in order]
    if positions != sorted(positions):
        raise ValueError(
            "fastckpt.plan: the segments must run forward in model order and backward in reverse order (a stack of "
            f"blocks); marks seen: {[k for k in keys if k[0] in 'fFb']}"
        )
    return order


def _intervals(keys: list[str], n: int) -> dict[str, tuple[int, int]]:
    """Mark index ranges [from, to] of every interval of the model (indices into the run's marks)."""
    _boundaries(keys, n)
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for index, key in enumerate(keys):
        first.setdefault(key, index)
        last[key] = index
    end = first["end"]
    b1_end = last["B0"] if "B0" in last else end
    spans = {"pre": (first["start"], first["f0"]), "tail": (first[f"F{n - 1}"], first[f"b{n - 1}"])}
    for i in range(n):
        spans[f"fwd{i}"] = (first[f"f{i}"], first[f"f{i + 1}"] if i + 1 < n else first[f"F{n - 1}"])
        spans[f"bwd{i}"] = (first[f"b{i}"], first[f"b{i - 1}"] if i > 0 else b1_end)
    spans["post"] = (b1_end, end)
    return spans


@dataclass
class _Traced:
    """What one traced run gives (the module docstring's quantities, and what the segments share)."""

    kept: list[int]
    forward: list[int]
    backward: list[int]
    start_live: int
    pre_peak: int
    post_peak: int
    tail: int
    peak: int
    bits: float
    shared: list[dict[tuple, int]]  # per segment: the shared forms its forward used, their bytes
    made: list[frozenset]  # per segment: those it made
    held: list[frozenset]  # per segment: the inputs from before the segments it holds past the forward
    held_bytes: dict[tuple, int]  # their bytes
    dropped: frozenset  # those freed between the forward and the backward: no segment held them
    transient: list[int]  # per segment: bytes its forward made that live until the forward's end, then freed
    prefetched: list[int]  # per segment: bytes of its host copies the engine brings back ahead of its backward


def _memory_run(
    segments: list[Segment], step: Callable[[], Any], candidate: Candidate, device: torch.device
) -> _Traced:
    """K, F, X per segment and L0, pre, post, T, the peak, the kept bits/element and the sharing, from one run."""
    n = len(segments)
    with track() as report, MemoryTrace(device) as trace:
        recorder = _Recorder(device, trace)
        with observe_shared(recorder.sharing.stored):
            _run(segments, step, candidate, recorder)
    points = trace.points[: len(recorder.keys)]  # the trace's own final point is its exit
    spans = _intervals(recorder.keys, n)

    def live(index: int) -> int:
        return points[index].live

    def peak(span: tuple[int, int]) -> int:
        start, stop = span
        return max([live(start), *(points[k].peak_before for k in range(start + 1, stop + 1))])

    def sent(span: tuple[int, int]) -> int:  # bytes copied to host memory in the span
        return recorder.sent[span[1]] - recorder.sent[span[0]]

    starts = [spans[f"fwd{i}"][0] for i in range(n)]
    l0 = live(starts[0])
    kept = [live(spans[f"fwd{i}"][1]) - live(starts[i]) for i in range(n)]
    forward = [peak(spans[f"fwd{i}"]) - live(starts[i]) for i in range(n)]
    prefix = 0
    backward = []
    for i in range(n):
        prefix += kept[i]
        backward.append(peak(spans[f"bwd{i}"]) - l0 - prefix)
    tail = peak(spans["tail"]) - l0 - prefix
    stored = [s for s in report.segments if not s.policy.endswith("(recomputed)")]
    elements = sum(s.raw_elements for s in stored)
    bits = 8 * sum(s.stored_bytes for s in stored) / elements if elements else float("nan")
    sharing = recorder.sharing
    held = sharing.held(spans, n)
    return _Traced(
        kept, forward, backward, l0, peak(spans["pre"]), peak(spans["post"]), tail, trace.peak, bits,
        shared=[sharing.used(i) for i in range(n)],
        made=[frozenset(sharing.made.get(i, set()) - sharing.unshared) for i in range(n)],
        held=[frozenset(name for name, (_, h, takers) in held.items() if h <= i and i in takers) for i in range(n)],
        held_bytes={name: size for name, (size, _, _) in held.items()},
        dropped=frozenset(name for name, (_, h, _) in held.items() if h == n),
        transient=_transient(trace.lifetimes, spans, n, sharing.outputs),
        # the engine prefetches up to its bound of a segment's copies (offload.OffloadEngine._prefetch)
        prefetched=[min(sent(spans[f"fwd{i}"]), offload.ENGINE.max_prefetch_bytes) for i in range(n)],
    )  # fmt: skip


def _transient(
    lifetimes: list[tuple[int, int | None, int, int]] | None, spans: dict, n: int, outputs: dict[int, set[int]]
) -> list[int]:
    """Per segment: bytes allocated in its forward, live at the forward's end and freed between the forward and
    the backward, unless the segment saved them (autocast's casts of the weights, cached until the autocast
    region ends): in K_i, but not in the backward levels. Its outputs (`outputs[i]`: their addresses) are left
    out: whether they live on depends on the next segment. Zeros where the trace has no block records (CUDA)."""
    if lifetimes is None:
        return [0] * n
    tail_start, tail_stop = spans["tail"]
    forward_of = {mark: i for i in range(n) for mark in range(*spans[f"fwd{i}"])}  # mark index -> segment
    found = [0] * n
    for born, died, size, address in lifetimes:
        # `born`/`died`: marks made before the allocation/free, so the last mark before it has index born - 1
        if died is None or not tail_start <= died - 1 < tail_stop:
            continue
        i = forward_of.get(born - 1)
        if i is not None and address not in outputs.get(i, ()):
            found[i] += size
    return found


def _timed_run(
    segments: list[Segment], step: Callable[[], Any], assignment: list[Candidate], device: torch.device
) -> list[float]:
    """Seconds per segment (its forward and backward intervals), then the whole step, from one untraced run
    with segment i under assignment[i]."""
    n = len(segments)
    recorder = _Recorder(device, None)
    _run(segments, step, assignment, recorder)
    at = recorder.elapsed()
    spans = _intervals(recorder.keys, n)

    def duration(name: str) -> float:
        start, stop = spans[name]
        return at[stop] - at[start]

    per_segment = [duration(f"fwd{i}") + duration(f"bwd{i}") for i in range(n)]
    return [*per_segment, at[recorder.keys.index("end")] - at[recorder.keys.index("start")]]


def measure_candidates(
    model: nn.Module,
    segments: list[Segment],
    step: Callable[[], Any],
    candidates: list[Candidate],
    device: torch.device,
    repeats: int,
    *,
    quiet: set[str] = frozenset(),
    on_traced: Callable[[list[Candidate]], None] | None = None,
) -> tuple[dict[str, CandidateMeasurement], dict[str, str]]:
    """Every candidate that runs on this model measured, and the error of each that raised or gave NaN/inf
    gradients where the plain step did not (left out with a warning unless its name is in `quiet`; the
    reference, measured first, must run: its errors are the model's or the step's). `on_traced` is called with
    the candidates that ran once their traced runs are done (before the timed ones)."""
    with NonFinite(model, segments) as plain:
        step()  # warm-up (the plain step): one-time allocations (gradients, optimizer state), lazy initialisation
    memory, failed = {}, {}
    for candidate in sorted(candidates, key=lambda c: c.name != REFERENCE):
        name = candidate.name
        grads = [(p, p.grad) for p in model.parameters()]
        try:
            with NonFinite(model, segments) as check:
                measured = _memory_run(segments, step, candidate, device)
            if check.found and not plain.found:  # a storage that breaks the gradients, not the model's own
                raise RuntimeError(
                    f"fastckpt.plan: candidate {name!r} {check.found}, where the plain step's are finite"
                )
            memory[name] = measured
        except Exception as error:
            if name == REFERENCE:
                raise
            for p, grad in grads:  # what the broken step accumulated must not skew the next runs
                p.grad = grad
            failed[name] = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
            if name not in quiet:
                warnings.warn(
                    f"fastckpt.plan: candidate {name!r} failed on this model, left out ({failed[name]})", stacklevel=4
                )
    ran = [candidate for candidate in candidates if candidate.name in memory]
    if on_traced is not None:
        on_traced(ran)
    rounds = timing_rounds(segments, ran, repeats)
    runs = [_timed_run(segments, step, assignment, device) for assignment in rounds]
    seconds = segment_seconds(segments, [[c.name for c in assignment] for assignment in rounds], runs)
    outside = min(run[-1] - sum(run[:-1]) for run in runs)  # the loss, the head, the optimizer: any candidate's
    pre = max(m.pre_peak for m in memory.values())
    post = max(m.post_peak for m in memory.values())
    l0 = max(m.start_live for m in memory.values())
    result = {}
    for name in seconds:
        traced = memory[name]
        per_segment = seconds[name]
        costs = [
            SegmentCost(
                traced.kept[i],
                traced.forward[i],
                traced.backward[i],
                per_segment[i],
                shared=traced.shared[i],
                made=traced.made[i],
                held=traced.held[i],
                transient=traced.transient[i],
                prefetched=traced.prefetched[i],
            )
            for i in range(len(segments))
        ]
        result[name] = CandidateMeasurement(
            policy=name,
            segments=costs,
            start_live=l0,
            pre_peak=pre,
            post_peak=post,
            tail_level=traced.tail,
            peak=traced.peak,
            step_seconds=outside + sum(per_segment),
            outside_seconds=outside,
            bits_per_element=traced.bits,
            held_bytes=traced.held_bytes,
            dropped=traced.dropped,
        )
    return result, failed


def _kinds(segments: list[Segment]) -> list[list[int]]:
    """The segments grouped by kind (the same block: signature), as index lists in model order."""
    kinds: dict[tuple, list[int]] = {}
    for i, segment in enumerate(segments):
        kinds.setdefault(signature(segment.module), []).append(i)
    return list(kinds.values())


def timing_rounds(segments: list[Segment], candidates: list[Candidate], repeats: int) -> list[list[Candidate]]:
    """The assignments of the timed runs: in each kind of segment (the same block: signature), its segments take
    the candidates in turn, so that each candidate runs on at least `repeats` segments of every kind. Segments
    that are the same block cost the same (a candidate's time is a property of the block), so a run times as
    many candidates as a kind has segments: ceil(repeats x candidates / segments of the smallest kind) runs
    instead of repeats x candidates, and a candidate's samples come from several runs and positions."""
    kinds = _kinds(segments)
    m = len(candidates)
    count = max(math.ceil(repeats * m / len(members)) for members in kinds)
    rounds = [[candidates[0]] * len(segments) for _ in range(count)]
    for members in kinds:
        for r in range(count):
            for j, i in enumerate(members):
                rounds[r][i] = candidates[(r * len(members) + j) % m]
    return rounds


def segment_seconds(
    segments: list[Segment], assignments: list[list[str]], runs: list[list[float]]
) -> dict[str, list[float]]:
    """Per candidate, each segment's time, robust to a busy machine, from the timed runs (`runs[r][i]`: segment
    i's seconds in run r, under the candidate named `assignments[r][i]`).

    Another process only ever adds time, so a candidate's time on a segment is its fastest run there. Segments
    that are the same block (same module type and parameter shapes) cost the same, so every segment of a kind
    gets the median over the kind's segments that ran the candidate: one slow interval then moves no
    estimate much, and the solver does not pick between identical blocks by noise.
    """
    fastest: dict[tuple[str, int], float] = {}
    for assignment, run in zip(assignments, runs, strict=True):
        for i, name in enumerate(assignment):
            fastest[name, i] = min(run[i], fastest.get((name, i), math.inf))
    kinds = _kinds(segments)
    result: dict[str, list[float]] = {}
    for name in dict.fromkeys(name for assignment in assignments for name in assignment):
        seconds = [math.nan] * len(segments)
        for members in kinds:
            timed = [fastest[name, i] for i in members if (name, i) in fastest]
            typical = statistics.median(timed) if timed else math.nan
            for i in members:
                seconds[i] = typical
        result[name] = seconds
    return result


def gradient_errors(
    model: nn.Module,
    segments: list[Segment],
    step: Callable[[], Any],
    candidates: list[Candidate],
    device: torch.device,
) -> dict[str, float]:
    """Per candidate, the largest relative L2 error of a parameter's gradient against 'none' (the project's
    gradient-error measure), each run from the same RNG seed (dropout draws the same masks); the caller's
    RNG state is restored after."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    devices = [device] if device.type == "cuda" else []

    def gradients(candidate: Candidate) -> list[torch.Tensor | None]:
        captured: dict[int, torch.Tensor] = {}

        def add(index: int, grad: torch.Tensor | None) -> None:
            if grad is not None:  # None: handed out in an earlier pass (checks.NonFinite says where)
                captured[index] = captured.get(index, 0) + grad.detach().float()

        handles = [p.register_hook(lambda g, i=i: add(i, g)) for i, p in enumerate(parameters)]
        try:
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(0x5EED)
                _run(segments, step, candidate, _Recorder(device, None))
        finally:
            for handle in handles:
                handle.remove()
        return [captured.get(i) for i in range(len(parameters))]

    # A batch slice is compared with the same slices kept exactly ('batch<N>:save'): those draw random ops in
    # the slices' order, so the error is the policy's alone (checks.samples_mixed checked the slicing itself).
    references: dict[str, list[torch.Tensor | None]] = {}

    def reference(candidate: Candidate) -> list[torch.Tensor | None]:
        key = NONE if candidate.batch_slices == 1 else f"{BATCH_PREFIX}{candidate.batch_slices}:save"
        if key not in references:
            references[key] = gradients(parse_candidate(key))
            if not all(g is None or finite(g) for g in references[key]):
                raise ValueError(
                    f"fastckpt.plan: max_error: the gradients under {key!r} (the reference) hold NaN/inf, so no "
                    "gradient error can be measured against them; fix the step's gradients or pass max_error=None"
                )
        return references[key]

    return {c.name: 0.0 if c.name == NONE else max_relative_error(gradients(c), reference(c)) for c in candidates}
