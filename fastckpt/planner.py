"""`fastckpt.plan`: choose a policy per segment so that a training step fits a memory budget, as fast as possible.

Measurement (a handful of step() runs). Every segment runs under one candidate at a time: one run under a
MemoryTrace (fastckpt.memory) with marks at each segment's forward start/end (module hooks) and at its
backward start/end (gradient hooks on its outputs/inputs), then `repeats` timed runs per candidate,
candidates interleaved round by round. From the marks, per candidate p and segment i:

    K_i(p)  kept bytes: live bytes added from segment i's start to segment i+1's start (the last one: to its
            end). What the segment keeps for backward, plus its output minus its input when nothing keeps
            the input; the sum over segments 1..i is what is live at segment i+1's start.
    F_i(p)  forward excess: peak during segment i's forward (up to segment i+1's start) above its start.
    X_i(p)  backward level: peak during segment i's backward above L0 + K_1(p) + ... + K_i(p).
    T(p)    tail level: peak between the last segment's forward and its backward (the loss, the head)
            above L0 + sum of all K (attributed to the last segment's policy).
    t_i(p)  seconds in segment i's forward and backward (its recomputation included): the fastest of its
            timed runs, then the median over segments that are the same block (see _segment_seconds).

L0 (live at the first segment's start), the peak before it and the peak after the first segment's backward
do not depend on the policies; the planner takes the largest value any candidate showed.

Peak model. For an assignment a (policy a_i on segment i), with S_i = K_1(a_1) + ... + K_i(a_i):

    peak(a) = max( pre, post,
                   max_i L0 + S_(i-1) + F_i(a_i),      (forward of segment i)
                   max_i L0 + S_i + X_i(a_i),          (backward of segment i: the segments before it are
                                                         still kept; those after it are freed)
                   L0 + S_n + T(a_n) )                 (loss and head, everything kept)

Every term depends only on the prefix sum S and on one segment's policy, so the problem is a knapsack over
segments: a dynamic programme over S, keeping for each S the fastest prefix. A prefix with a smaller S and
no more time dominates (every later constraint only grows with S), so only the Pareto front of (S, time) is
kept; it is exact while the front has at most _MAX_STATES states, and beyond that it is thinned to two
states per byte bin (the one with the most room left and the fastest), which may miss a plan but never
returns one above the budget. The same programme with "largest constraint so far" in place of time gives
the smallest budget any assignment fits. Predicted step time: the candidates' median time outside the
segments, plus the chosen t_i (each the fastest of its timed runs, then the median over segments that are
the same block).

Budget: bytes the step may allocate above what is live before it (the same quantity as
fastckpt.memory.peak_bytes), or a string "N%": N percent of the peak measured with every segment under
"recompute" (stock checkpointing, whose memory fastckpt's recompute matches).
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from fastckpt import hybrid, tiling
from fastckpt.api import CheckpointWrapper, wrap
from fastckpt.memory import MemoryTrace
from fastckpt.policies import Policy
from fastckpt.storage.accounting import track

NONE = "none"  # the candidate that leaves a segment as it is (plain autograd, no checkpoint)
REFERENCE = "recompute"  # stock checkpointing: what "N%" budgets are relative to
DEFAULT_CANDIDATES = (NONE, "recompute", "recompute+int8", "int8", "int4", "recompute:int8+int8", "recompute:int4+int4")
_MAX_STATES = 4096  # prefix states kept per segment by the dynamic programme before thinning

# What extended_candidates adds: the fused attention kept int8, and the forms a batch slice runs (those too).
_ATTENTION_CANDIDATES = ("selective-attention:int8", "selective-attention:recompute:int8+int8")
_SLICED = ("int8", "recompute", "recompute+int8", "recompute:int8+int8")


def extended_candidates(batch_slices: Iterable[int] = ()) -> list[str]:
    """DEFAULT_CANDIDATES, the fused attention (and dropout's masks) kept instead of recomputed
    ('selective-attention:...', hybrid.keep_attention), and for each N
    in `batch_slices` the segment on its batch in N slices ('batch<N>:...': only for segments that treat
    every sample alone)."""
    names = [*DEFAULT_CANDIDATES, *_ATTENTION_CANDIDATES]
    for count in batch_slices:
        if not (isinstance(count, int) and not isinstance(count, bool) and count >= 2):
            raise ValueError(f"extended_candidates: each batch slice count must be an integer >= 2, got {count!r}")
        names += [f"{tiling.BATCH_PREFIX}{count}:{form}" for form in (*_SLICED, *_ATTENTION_CANDIDATES)]
    return names


@dataclass(frozen=True)
class SegmentCost:
    """What one candidate costs on one segment, measured with every segment under that candidate."""

    kept_bytes: int
    forward_excess: int
    backward_level: int
    seconds: float


@dataclass
class CandidateMeasurement:
    """One candidate measured on every segment at once."""

    policy: str
    segments: list[SegmentCost]
    start_live: int  # L0
    pre_peak: int  # peak before the first segment starts
    post_peak: int  # peak after the first segment's backward (rest of the backward, optimizer, ...)
    tail_level: int  # T
    peak: int  # measured peak of the step
    step_seconds: float  # fastest step time of the timed runs
    outside_seconds: float  # fastest step time outside the segments
    bits_per_element: float  # stored bits per element kept after forward (nan: nothing stored through a codec)
    # Largest relative L2 error of a parameter's gradient against no checkpointing, every segment under this
    # candidate, same RNG seed (nan: not measured, i.e. no max_error given).
    grad_error: float = float("nan")


@dataclass(frozen=True)
class Segment:
    """One planned segment: where it sits in the model and the module itself."""

    name: str
    parent: nn.Module
    attribute: str
    module: nn.Module


class Measurements:
    """Every candidate measured on the segments of one model and step; plans for any budget come from it."""

    def __init__(
        self,
        model: nn.Module,
        segments: list[Segment],
        candidates: list[str],
        by_policy: dict[str, CandidateMeasurement],
        max_error: float | None = None,
        failed: dict[str, str] | None = None,
    ) -> None:
        self.model = model
        self.segments = segments
        self.by_policy = by_policy
        self.max_error = max_error
        self.failed = failed or {}  # candidates whose step raised on this model, with the error
        # What plans may choose (by_policy also holds the 'recompute' reference): the candidates that ran and,
        # with max_error, whose measured gradient error is within it.
        ran = [c for c in candidates if c in by_policy]
        self.candidates = [c for c in ran if max_error is None or _within(by_policy[c].grad_error, max_error)]
        self.excluded = [c for c in ran if c not in self.candidates]

    @property
    def reference_peak(self) -> int:
        """The measured peak with every segment under 'recompute' (stock checkpointing)."""
        return self.by_policy[REFERENCE].peak

    @property
    def reference_seconds(self) -> float:
        """The fastest timed step with every segment under 'recompute'."""
        return self.by_policy[REFERENCE].step_seconds

    def budget_bytes(self, budget: int | str) -> int:
        """`budget` in bytes ("N%" of the reference peak)."""
        _check_budget(budget)
        return _budget_bytes(budget, self.reference_peak)

    def plan(self, budget: int | str) -> Plan:
        """The fastest assignment predicted to fit `budget`; ValueError naming the smallest feasible budget if none."""
        budget_bytes = self.budget_bytes(budget)
        excluded = (
            f" ({self.excluded} left out: their gradient error exceeds max_error={self.max_error:g})"
            if self.excluded
            else ""
        ) + (
            f" ({list(self.failed)} left out: they failed on this model: "
            + "; ".join(f"{name!r}: {why}" for name, why in self.failed.items())
            + ")"
            if self.failed
            else ""
        )
        if not self.candidates:
            raise ValueError(f"plan: no candidate is left to assign to the segments{excluded}")
        policies = _fastest_within(self.by_policy, self.candidates, len(self.segments), budget_bytes)
        if policies is None:
            smallest = self.smallest_feasible_budget()
            raise ValueError(
                f"plan: no assignment of {self.candidates}{excluded} to the {len(self.segments)} segments fits a "
                f"budget of {budget_bytes} bytes ({budget_bytes / 2**20:.2f} MiB); the smallest feasible budget is "
                f"{smallest} bytes ({smallest / 2**20:.2f} MiB, {100 * smallest / self.reference_peak:.1f}% of stock "
                "checkpointing's peak)"
            )
        return Plan(
            measurements=self,
            policies=policies,
            budget=budget_bytes,
            predicted_peak=self.predict_peak(policies),
            predicted_seconds=self.predict_seconds(policies),
        )

    def smallest_feasible_budget(self) -> int:
        """The smallest budget (bytes) some assignment of the candidates is predicted to fit."""
        return self.predict_peak(_smallest_peak(self.by_policy, self.candidates, len(self.segments)))

    def predict_peak(self, policies: Sequence[str]) -> int:
        """The peak model's prediction (bytes above what is live before step()) for an assignment."""
        return _predicted_peak(self.by_policy, self._check(policies))

    def predict_seconds(self, policies: Sequence[str]) -> float:
        """The time model's prediction for an assignment."""
        return _predicted_seconds(self.by_policy, self._check(policies))

    def _check(self, policies: Sequence[str]) -> list[str]:
        policies = [_name(p) for p in policies]
        if len(policies) != len(self.segments):
            raise ValueError(f"{len(self.segments)} policies needed (one per segment), got {len(policies)}")
        unknown = sorted({p for p in policies if p not in self.by_policy})
        if unknown:
            raise ValueError(f"{unknown} not measured; measured: {list(self.by_policy)}")
        return policies

    def table(self) -> str:
        """Per candidate: measured peak and step time, and its per-segment kept bytes and time (mean)."""
        lines = [
            f"{'candidate':<24}{'peak MiB':>10}{'step ms':>10}{'kept MiB/seg':>14}{'bwd MiB/seg':>13}"
            f"{'ms/seg':>9}{'bits/elem':>11}{'grad err':>10}"
        ]
        for name, m in self.by_policy.items():
            n = len(m.segments)
            error = "" if math.isnan(m.grad_error) else f"{m.grad_error:.1e}"
            lines.append(
                f"{name:<24}{m.peak / 2**20:>10.2f}{m.step_seconds * 1e3:>10.1f}"
                f"{sum(c.kept_bytes for c in m.segments) / n / 2**20:>14.2f}"
                f"{sum(c.backward_level for c in m.segments) / n / 2**20:>13.2f}"
                f"{sum(c.seconds for c in m.segments) / n * 1e3:>9.1f}{_bits(m.bits_per_element):>11}{error:>10}"
                + ("  (left out: > max_error)" if name in self.excluded else "")
            )
        lines += [f"{name:<24}failed on this model, left out: {error}" for name, error in self.failed.items()]
        return "\n".join(lines)


@dataclass
class Plan:
    """A policy per segment (NONE: left as it is), its predicted peak and step time, and how to apply it."""

    measurements: Measurements
    policies: list[str]
    budget: int
    predicted_peak: int
    predicted_seconds: float
    applied: bool = field(default=False)

    @property
    def model(self) -> nn.Module:
        return self.measurements.model

    @property
    def segments(self) -> list[Segment]:
        return self.measurements.segments

    def apply(self) -> nn.Module:
        """Wrap each segment in place with its policy (fastckpt.wrap; state dict unchanged); returns the model."""
        if self.applied:
            raise RuntimeError("Plan.apply: this plan is already applied to the model")
        for segment in self.segments:
            if getattr(segment.parent, segment.attribute) is not segment.module:
                raise RuntimeError(
                    f"Plan.apply: segment {segment.name!r} is no longer the module the plan measured (another plan "
                    "applied, or the model changed); measure again"
                )
        for segment, policy in zip(self.segments, self.policies, strict=True):
            runner = _runner(segment.module, policy)
            if runner is not segment.module:
                setattr(segment.parent, segment.attribute, runner)
        self.applied = True
        return self.model

    def remove(self) -> nn.Module:
        """Undo `apply`: put the original segment modules back; returns the model."""
        if not self.applied:
            raise RuntimeError("Plan.remove: this plan is not applied")
        for segment in self.segments:
            setattr(segment.parent, segment.attribute, segment.module)
        self.applied = False
        return self.model

    def table(self) -> str:
        """One line per segment (policy, kept bytes, backward level, time), then the predicted totals."""
        lines = [f"{'segment':<24}{'policy':<22}{'kept MiB':>10}{'bwd MiB':>10}{'ms':>9}{'bits/elem':>11}"]
        for index, (segment, policy) in enumerate(zip(self.segments, self.policies, strict=True)):
            m = self.measurements.by_policy[policy]
            cost = m.segments[index]
            lines.append(
                f"{segment.name:<24}{policy:<22}{cost.kept_bytes / 2**20:>10.2f}{cost.backward_level / 2**20:>10.2f}"
                f"{cost.seconds * 1e3:>9.1f}{_bits(m.bits_per_element):>11}"
            )
        lines.append(
            f"predicted peak {self.predicted_peak / 2**20:.2f} MiB (budget {self.budget / 2**20:.2f} MiB, stock "
            f"checkpoint {self.measurements.reference_peak / 2**20:.2f} MiB); predicted step "
            f"{self.predicted_seconds * 1e3:.1f} ms (stock {self.measurements.reference_seconds * 1e3:.1f} ms)"
        )
        return "\n".join(lines)


def _within(error: float, max_error: float) -> bool:
    """A NaN or inf error is never within max_error (a comparison with NaN is False either way round)."""
    return math.isfinite(error) and error <= max_error


def _bits(bits: float) -> str:
    """Bits per element for a table: blank where nothing went through a codec."""
    return "" if math.isnan(bits) else f"{bits:.2f}"


def plan(
    model: nn.Module,
    step: Callable[[], Any],
    budget: int | str,
    check_fn: Callable[[nn.Module], bool] | None = None,
    candidates: Iterable[str | Policy | None] | None = None,
    *,
    repeats: int = 2,
    max_error: float | None = None,
) -> Plan:
    """The fastest assignment of candidate policies to the segments of `model` predicted to fit `budget`.

    `step()` runs one forward and backward of the training step; `budget` is bytes the step may allocate above
    what is live before it, or "N%" of stock checkpointing's peak; the segments are the submodules `check_fn`
    selects (default: the children of the largest nn.ModuleList/nn.Sequential of identical blocks); `candidates`
    are policy strings, 'none', 'selective:<spec>' (fastckpt.hybrid.selective: the outputs of matmuls and
    attention kept through <spec>'s codec, the rest recomputed, the inputs stored as <spec> says:
    'selective:int8', 'selective:recompute:int8+int8'), 'selective-attention:<spec>' (the same keeping only the
    fused attention's outputs and dropout's masks, hybrid.keep_attention) or 'batch<N>:<policy or selective
    candidate>' (fastckpt.tiled(segment, N, dim=0, ...): the segment's batch in N slices, each checkpointed, so
    its backward holds one slice's activations; for segments that treat every sample alone, which the planner
    checks: batch candidates are left out, with a warning, when changing the other samples moves a slice's
    output) (default: DEFAULT_CANDIDATES, which leaves out the selective ones, on CPU 'selective:int8' measured
    slower and larger than 'int8' and attention-only pays off where attention dominates, and batch slices;
    `extended_candidates` adds both). A candidate whose step raises on the model, or gives NaN/inf parameter
    gradients where the plain step's are finite, is left out with a warning (the reference 'recompute': the
    error is raised). `max_error`, when given, leaves out the candidates whose gradient error exceeds it (a NaN
    or inf error does) or ValueError if the reference's gradients are not finite: the largest relative L2
    error of a parameter's gradient against no checkpointing (a batch slice: against the same slices kept
    exactly, which draw random ops in the same order), measured with every segment under the candidate and the
    same RNG seed (a bound per candidate; a mix of candidates within it measured within it too in our runs, but
    that is not guaranteed). Runs step() 2 + len(candidates) * (1 + repeats) times, plus 1 + len(candidates)
    with max_error; batch candidates add one step (the sample check) and, with max_error, one per slice count
    (their reference). ValueError if no assignment fits, naming the smallest budget.
    """
    _check_budget(budget)
    return measure(model, step, check_fn, candidates, repeats=repeats, max_error=max_error).plan(budget)


def measure(
    model: nn.Module,
    step: Callable[[], Any],
    check_fn: Callable[[nn.Module], bool] | None = None,
    candidates: Iterable[str | Policy | None] | None = None,
    *,
    repeats: int = 2,
    max_error: float | None = None,
) -> Measurements:
    """Measure every candidate on the segments (what `plan` does before solving); plan any budget from it."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"plan: `model` must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(step):
        raise TypeError(f"plan: `step` must be a callable running one forward and backward, got {type(step).__name__}")
    if check_fn is not None and not callable(check_fn):
        raise TypeError(f"plan: `check_fn` must be callable (module -> bool), got {type(check_fn).__name__}")
    if not (isinstance(repeats, int) and not isinstance(repeats, bool) and repeats >= 1):
        raise ValueError(f"plan: `repeats` must be an integer >= 1, got {repeats!r}")
    if max_error is not None and not (
        isinstance(max_error, (int, float)) and not isinstance(max_error, bool) and max_error >= 0
    ):
        raise ValueError(f"plan: `max_error` must be a number >= 0 (a relative L2 error) or None, got {max_error!r}")
    names = _candidate_names(candidates)
    segments = _find_segments(model, check_fn)
    device = _device_of(model)
    measured = names if REFERENCE in names else [*names, REFERENCE]
    mixing = _samples_mixed(segments, step, device, names)
    if mixing:
        measured = [n for n in measured if tiling.parse_candidate(n) is None]
    by_policy, failed = _measure(model, segments, step, measured, device, repeats)
    for name in names:
        split = tiling.parse_candidate(name)
        if split is not None and split.chunks in mixing:
            failed[name] = mixing[split.chunks]
            warnings.warn(f"plan: candidate {name!r} left out: {failed[name]}", stacklevel=2)
    if max_error is not None:
        for name, error in _gradient_errors(model, segments, step, list(by_policy), device).items():
            by_policy[name].grad_error = error
    return Measurements(model, segments, names, by_policy, max_error, failed)


# ---- arguments -------------------------------------------------------------------------------------------


def _check_budget(budget: int | str) -> None:
    if isinstance(budget, bool) or not isinstance(budget, (int, str)):
        raise TypeError(f"plan: `budget` must be bytes (an int) or a string such as '50%', got {type(budget).__name__}")
    if isinstance(budget, int) and budget <= 0:
        raise ValueError(f"plan: `budget` must be a positive number of bytes, got {budget}")
    if isinstance(budget, str):
        _percent(budget)


def _percent(budget: str) -> float:
    text = budget.strip()
    try:
        value = float(text[:-1]) if text.endswith("%") else float("nan")
    except ValueError:
        value = float("nan")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(
            f"plan: budget {budget!r} is not a percentage such as '50%' (of stock checkpointing's peak) or bytes"
        )
    return value


def _budget_bytes(budget: int | str, reference_peak: int) -> int:
    if isinstance(budget, int):
        return budget
    return max(1, int(reference_peak * _percent(budget) / 100))


def _candidate_names(candidates: Iterable[str | Policy] | None) -> list[str]:
    if candidates is None:
        return list(DEFAULT_CANDIDATES)
    if isinstance(candidates, (str, Policy)):
        raise TypeError("plan: `candidates` must be a list of policies, e.g. ['none', 'recompute', 'int8']")
    names = []
    for candidate in candidates:
        try:
            name = _name(candidate)
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"plan: candidate {candidate!r}: {error} (or '{NONE}' for no checkpoint, "
                f"'{hybrid.PREFIX}<codec>' or '{hybrid.ATTENTION_PREFIX}<codec>' for selective checkpointing, "
                f"'{tiling.BATCH_PREFIX}<N>:<policy>' for batch slices)"
            ) from None
        if isinstance(candidate, Policy) and candidate.rule is not None:
            raise ValueError(f"plan: candidate {candidate!r} has a per-tensor rule; the planner takes policy strings")
        if name in names:
            raise ValueError(f"plan: candidate {candidate!r} is listed twice (as {name!r})")
        names.append(name)
    if not names:
        raise ValueError("plan: `candidates` is empty")
    return names


def _name(candidate: str | Policy | None) -> str:
    """A candidate's canonical name: 'none', a policy string, 'selective[-attention]:<spec>'
    (fastckpt.hybrid) or 'batch<N>:<inner>' (fastckpt.tiling)."""
    if candidate is None or candidate == NONE:
        return NONE
    special = _special(candidate)
    return str(special) if special is not None else str(Policy.parse(candidate))


def _special(name: object) -> hybrid.Candidate | tiling.BatchSplit | None:
    """A candidate that is more than a policy (selective checkpointing, batch slices); None for a policy."""
    return hybrid.parse_candidate(name) or tiling.parse_candidate(name)


def _runner(module: nn.Module, name: str) -> nn.Module:
    """`module` as candidate `name` runs it: itself ('none'), or wrapped by fastckpt."""
    if name == NONE:
        return module
    special = _special(name)
    return special.wrap(module) if special is not None else wrap(module, name)


def _find_segments(model: nn.Module, check_fn: Callable[[nn.Module], bool] | None) -> list[Segment]:
    if check_fn is None:
        segments = _default_segments(model)
    else:
        segments = []
        _collect(model, "", check_fn, segments)
        if not segments:
            raise ValueError("plan: `check_fn` selected no submodule of the model")
    wrapped = [s.name for s in segments if isinstance(s.module, CheckpointWrapper)]
    if wrapped:
        raise ValueError(f"plan: segments {wrapped} are already wrapped by fastckpt; plan the unwrapped model")
    if len({id(s.module) for s in segments}) != len(segments):
        raise ValueError("plan: the same module appears as several segments; the planner needs each to run once")
    return segments


def _collect(module: nn.Module, prefix: str, check_fn: Callable[[nn.Module], bool], out: list[Segment]) -> None:
    # As fastckpt.apply: children in order, a selected child is not searched further.
    for name, child in module.named_children():
        qualified = f"{prefix}{name}"
        if check_fn(child):
            out.append(Segment(qualified, module, name, child))
        else:
            _collect(child, qualified + ".", check_fn, out)


def _signature(module: nn.Module) -> tuple:
    return (type(module), tuple((n, tuple(p.shape)) for n, p in module.named_parameters()))


def _default_segments(model: nn.Module) -> list[Segment]:
    best: tuple[str, nn.Module] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
            continue
        if len({_signature(child) for child in module.children()}) != 1:
            continue
        if best is None or len(module) > len(best[1]):
            best = (name, module)
    if best is None:
        raise ValueError(
            "plan: the model has no nn.ModuleList/nn.Sequential of two or more identical blocks to plan; pass "
            "check_fn to choose the segments"
        )
    prefix = f"{best[0]}." if best[0] else ""
    return [Segment(f"{prefix}{name}", best[1], name, child) for name, child in best[1].named_children()]


def _device_of(model: nn.Module) -> torch.device:
    for tensor in [*model.parameters(), *model.buffers()]:
        return tensor.device
    return torch.device("cpu")


# ---- measurement -----------------------------------------------------------------------------------------


class _Recorder:
    """Marks of one run: their times, and their memory when a MemoryTrace is attached."""

    def __init__(self, device: torch.device, trace: MemoryTrace | None) -> None:
        self.device = device
        self.trace = trace
        self.keys: list[str] = []
        self.times: list[Any] = []

    def mark(self, key: str) -> None:
        self.keys.append(key)
        if self.trace is not None:
            self.trace.mark(key)
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


class _Instrumented:
    """The segments under one candidate, with hooks that mark their forward and backward boundaries."""

    def __init__(self, segments: list[Segment], policy: str, recorder: _Recorder) -> None:
        self.segments = segments
        self.recorder = recorder
        self.handles: list[Any] = []
        self.calls = [0] * len(segments)
        self.installed = []
        for index, segment in enumerate(segments):
            runner = _runner(segment.module, policy)
            if runner is not segment.module:
                setattr(segment.parent, segment.attribute, runner)
            self.installed.append(runner)
            self.handles.append(runner.register_forward_pre_hook(self._pre(index), with_kwargs=True))
            self.handles.append(runner.register_forward_hook(self._post(index)))

    def _pre(self, index: int) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self.calls[index] += 1
            self.recorder.mark(f"f{index}")
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    self.handles.append(t.register_hook(self._grad_mark(f"B{index}")))

        return hook

    def _post(self, index: int) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            self.recorder.mark(f"F{index}")
            for t in tree_leaves(output):
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


def _run(segments: list[Segment], step: Callable[[], Any], policy: str, recorder: _Recorder) -> None:
    instrumented = _Instrumented(segments, policy, recorder)
    try:
        recorder.mark("start")
        step()
        recorder.mark("end")
    finally:
        instrumented.remove()
    wrong = [(s.name, c) for s, c in zip(segments, instrumented.calls, strict=True) if c != 1]
    if wrong:
        raise ValueError(
            f"plan: each segment must run exactly once per step(); (segment, runs): {wrong}. The planner measures "
            "one forward and backward per segment"
        )
    missing = [s.name for i, s in enumerate(segments) if f"b{i}" not in recorder.keys]
    if missing:
        raise ValueError(
            f"plan: no gradient reached the outputs of segments {missing} in step(); step() must run the forward "
            "and the backward of the training step"
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
            "plan: the segments must run forward in model order and backward in reverse order (a stack of blocks); "
            f"marks seen: {[k for k in keys if k[0] in 'fFb']}"
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


def _memory_run(
    segments: list[Segment], step: Callable[[], Any], policy: str, device: torch.device
) -> tuple[list[int], list[int], list[int], int, int, int, int, int, float]:
    """K, F, X per segment and L0, pre, post, T, the peak and the kept bits/element, from one traced run."""
    n = len(segments)
    with track() as report, MemoryTrace(device) as trace:
        recorder = _Recorder(device, trace)
        _run(segments, step, policy, recorder)
    points = trace.points[: len(recorder.keys)]  # the trace's own final point is its exit
    spans = _intervals(recorder.keys, n)

    def live(index: int) -> int:
        return points[index].live

    def peak(span: tuple[int, int]) -> int:
        start, stop = span
        return max([live(start), *(points[k].peak_before for k in range(start + 1, stop + 1))])

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
    return kept, forward, backward, l0, peak(spans["pre"]), peak(spans["post"]), tail, trace.peak, bits


def _timed_run(segments: list[Segment], step: Callable[[], Any], policy: str, device: torch.device) -> list[float]:
    """Seconds per segment (its forward and backward intervals), then the whole step, from one untraced run."""
    n = len(segments)
    recorder = _Recorder(device, None)
    _run(segments, step, policy, recorder)
    at = recorder.elapsed()
    spans = _intervals(recorder.keys, n)

    def duration(name: str) -> float:
        start, stop = spans[name]
        return at[stop] - at[start]

    per_segment = [duration(f"fwd{i}") + duration(f"bwd{i}") for i in range(n)]
    return [*per_segment, at[recorder.keys.index("end")] - at[recorder.keys.index("start")]]


def _measure(
    model: nn.Module,
    segments: list[Segment],
    step: Callable[[], Any],
    names: list[str],
    device: torch.device,
    repeats: int,
) -> tuple[dict[str, CandidateMeasurement], dict[str, str]]:
    """Every candidate that runs on this model measured, and the error of each that raised or gave NaN/inf
    gradients where the plain step did not (left out with a warning; the reference, measured first, must run:
    its errors are the model's or the step's)."""
    with _NonFinite(model, segments) as plain:
        step()  # warm-up (the plain step): one-time allocations (gradients, optimizer state), lazy initialisation
    memory, failed = {}, {}
    for name in sorted(names, key=lambda n: n != REFERENCE):
        grads = [(p, p.grad) for p in model.parameters()]
        try:
            with _NonFinite(model, segments) as check:
                measured = _memory_run(segments, step, name, device)
            if check.found and not plain.found:  # a storage that breaks the gradients, not the model's own
                raise RuntimeError(f"plan: candidate {name!r} {check.found}, where the plain step's are finite")
            memory[name] = measured
        except Exception as error:
            if name == REFERENCE:
                raise
            for p, grad in grads:  # what the broken step accumulated must not skew the next runs
                p.grad = grad
            failed[name] = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
            warnings.warn(f"plan: candidate {name!r} failed on this model, left out ({failed[name]})", stacklevel=4)
    names = [name for name in names if name in memory]
    samples: dict[str, list[list[float]]] = {name: [] for name in names}
    for _ in range(repeats):  # interleaved, so drift of the machine's speed hits every candidate alike
        for name in names:
            samples[name].append(_timed_run(segments, step, name, device))
    pre = max(m[4] for m in memory.values())
    post = max(m[5] for m in memory.values())
    l0 = max(m[3] for m in memory.values())
    result = {}
    for name in names:
        kept, forward, backward, _, _, _, tail, peak, bits = memory[name]
        per_segment = _segment_seconds(segments, samples[name])
        total = min(run[-1] for run in samples[name])
        outside = min(run[-1] - sum(run[:-1]) for run in samples[name])
        result[name] = CandidateMeasurement(
            policy=name,
            segments=[SegmentCost(kept[i], forward[i], backward[i], per_segment[i]) for i in range(len(segments))],
            start_live=l0,
            pre_peak=pre,
            post_peak=post,
            tail_level=tail,
            peak=peak,
            step_seconds=total,
            outside_seconds=outside,
            bits_per_element=bits,
        )
    return result, failed


class _NonFinite:
    """Around one run: where parameters got a NaN/inf gradient (`found`, a phrase naming the segments; '')."""

    def __init__(self, model: nn.Module, segments: list[Segment]) -> None:
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        self.segments = segments
        self.bad: set[int] = set()
        self.handles: list[Any] = []
        self.found = ""

    def __enter__(self) -> _NonFinite:
        self.handles = [p.register_hook(self._hook(i)) for i, p in enumerate(self.parameters)]
        return self

    def _hook(self, index: int) -> Callable:
        def hook(grad: torch.Tensor) -> None:
            if not _finite(grad):
                self.bad.add(index)

        return hook

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()
        if not self.bad:
            return
        bad = {id(self.parameters[i]) for i in self.bad}
        names = [s.name for s in self.segments if any(id(p) in bad for p in s.module.parameters())]
        if not names:
            self.found = "gives NaN/inf gradients to parameters outside the segments"
        else:
            # The backward runs the segments last to first and a NaN spreads to those it reaches after.
            self.found = f"gives NaN/inf gradients from segment {names[-1]!r} on (segments {names} affected)"


def _finite(grad: torch.Tensor) -> bool:
    """No NaN/inf in `grad`; reduces to two scalars, so a traced run's memory is as without the check."""
    values = grad._values() if grad.is_sparse else grad
    if values.numel() == 0:
        return True
    if values.is_complex():
        values = torch.view_as_real(values)
    low, high = torch.aminmax(values)  # NaN propagates to both
    return math.isfinite(low.item()) and math.isfinite(high.item())


def _gradient_errors(
    model: nn.Module, segments: list[Segment], step: Callable[[], Any], names: list[str], device: torch.device
) -> dict[str, float]:
    """Per candidate, the largest relative L2 error of a parameter's gradient against 'none' (the project's
    gradient-error measure), each run from the same RNG seed (dropout draws the same masks); the caller's
    RNG state is restored after."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    devices = [device] if device.type == "cuda" else []

    def gradients(name: str) -> list[torch.Tensor | None]:
        captured: dict[int, torch.Tensor] = {}
        handles = [
            p.register_hook(lambda g, i=i: captured.__setitem__(i, captured.get(i, 0) + g.detach().float()))
            for i, p in enumerate(parameters)
        ]
        try:
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(0x5EED)
                _run(segments, step, name, _Recorder(device, None))
        finally:
            for handle in handles:
                handle.remove()
        return [captured.get(i) for i in range(len(parameters))]

    # A batch slice is compared with the same slices kept exactly ('batch<N>:save'): those draw random ops in
    # the slices' order, so the error is the policy's alone (_samples_mixed checked the slicing itself).
    references: dict[str, list[torch.Tensor | None]] = {}

    def reference(name: str) -> list[torch.Tensor | None]:
        split = tiling.parse_candidate(name)
        key = NONE if split is None else f"{tiling.BATCH_PREFIX}{split.chunks}:save"
        if key not in references:
            references[key] = gradients(key)
            if not all(g is None or _finite(g) for g in references[key]):
                raise ValueError(
                    f"plan: max_error: the gradients under {key!r} (the reference) hold NaN/inf, so no gradient "
                    "error can be measured against them; fix the step's gradients or pass max_error=None"
                )
        return references[key]

    return {name: 0.0 if name == NONE else max_relative_error(gradients(name), reference(name)) for name in names}


def _samples_mixed(
    segments: list[Segment], step: Callable[[], Any], device: torch.device, names: list[str]
) -> dict[int, str]:
    """For each slice count N of the batch candidates in `names`: why slicing the batch in N changes what a
    segment computes, if it does (absent: every segment treats its samples alone).

    One step() captures each segment's inputs; then, per segment, its forward runs twice from the same RNG
    seed (no grad, buffers restored after), the second time with the samples outside the first slice
    changed: the first slice's output must not move (BatchNorm in training, attention across the batch or
    a batch-wide statistic would move it)."""
    counts = sorted({split.chunks for split in map(tiling.parse_candidate, names) if split is not None})
    if not counts:
        return {}
    captured: dict[int, tuple] = {}
    handles = [
        segment.module.register_forward_pre_hook(
            lambda module, args, kwargs, i=i: captured.setdefault(i, _detached((args, kwargs))), with_kwargs=True
        )
        for i, segment in enumerate(segments)
    ]
    try:
        step()
    finally:
        for handle in handles:
            handle.remove()
    devices = [device] if device.type == "cuda" else []

    def forward(module: nn.Module, inputs: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        """The module's first output from a fixed seed, without grad, its buffers (BatchNorm's) put back."""
        buffers = {name: b.clone() for name, b in module.named_buffers()}
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=devices):
                torch.manual_seed(0x5A3)
                return _first_tensor(module(inputs, *args, **kwargs)).float()
        finally:
            with torch.no_grad():
                for name, b in module.named_buffers():
                    b.copy_(buffers[name])

    reasons: dict[int, str] = {}
    for i, segment in enumerate(segments):
        args, kwargs = captured.get(i, ((), {}))
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] < 2:
            continue  # nothing to slice here (tiled itself refuses a segment without a tensor first input)
        unchecked = [count for count in counts if count not in reasons]
        if not unchecked:
            break
        try:
            whole = forward(segment.module, x, args[1:], kwargs)
            for count in unchecked:
                first = x.chunk(count)[0].shape[0]
                changed = x.clone()
                changed[first:] = changed[first:] * 2 + 1
                moved = forward(segment.module, changed, args[1:], kwargs)[:first]
                if (whole[:first] - moved).norm() > 1e-4 * whole[:first].norm():
                    reasons[count] = (
                        f"segment {segment.name!r} mixes the samples of a batch (changing the samples outside the "
                        f"first of {count} slices changed that slice's output), so batch slices would change what it "
                        "computes"
                    )
        except Exception as error:
            why = f"segment {segment.name!r} could not be run alone to check batch slicing ({error})"
            for count in unchecked:
                reasons.setdefault(count, why)
    return reasons


def _detached(tree: Any) -> Any:
    return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, tree)


def _first_tensor(output: Any) -> torch.Tensor:
    return next(t for t in tree_leaves(output) if isinstance(t, torch.Tensor))


def max_relative_error(grads: Sequence[torch.Tensor | None], reference: Sequence[torch.Tensor | None]) -> float:
    """Largest relative L2 error over parameter gradients, paired in order (a gradient one side has and the
    other has not counts as error 1): the project's gradient-error measure."""
    errors = []
    for g, r in zip(grads, reference, strict=True):
        if g is None or r is None:
            errors.append(0.0 if g is None and r is None else 1.0)
        else:
            errors.append(((g - r).float().norm() / r.float().norm().clamp_min(1e-30)).item())
    # max() keeps a NaN only when it comes first (comparisons with NaN are False): make every non-finite one inf.
    return max((e if math.isfinite(e) else math.inf for e in errors), default=0.0)


def _segment_seconds(segments: list[Segment], runs: list[list[float]]) -> list[float]:
    """Each segment's time under one candidate, robust to a busy machine.

    Another process only ever adds time, so a segment's time is its fastest run. Segments that are the same
    block (same module type and parameter shapes) cost the same, so each gets the median over its kind: one
    slow interval then moves no segment's estimate, and the solver does not pick between identical blocks
    by noise.
    """
    fastest = [min(run[i] for run in runs) for i in range(len(segments))]
    kinds: dict[tuple, list[int]] = {}
    for i, segment in enumerate(segments):
        kinds.setdefault(_signature(segment.module), []).append(i)
    pooled = list(fastest)
    for members in kinds.values():
        typical = statistics.median(fastest[i] for i in members)
        for i in members:
            pooled[i] = typical
    return pooled


# ---- model and solver ------------------------------------------------------------------------------------


def _predicted_peak(measurements: dict[str, CandidateMeasurement], policies: list[str]) -> int:
    any_m = next(iter(measurements.values()))
    l0 = any_m.start_live
    peak = max(any_m.pre_peak, any_m.post_peak)
    prefix = 0
    for i, policy in enumerate(policies):
        cost = measurements[policy].segments[i]
        peak = max(peak, l0 + prefix + cost.forward_excess)
        prefix += cost.kept_bytes
        peak = max(peak, l0 + prefix + cost.backward_level)
    return max(peak, l0 + prefix + measurements[policies[-1]].tail_level)


def _predicted_seconds(measurements: dict[str, CandidateMeasurement], policies: list[str]) -> float:
    outside = statistics.median(m.outside_seconds for m in measurements.values())
    return outside + sum(measurements[p].segments[i].seconds for i, p in enumerate(policies))


def _levels(m: CandidateMeasurement, i: int, last: bool) -> tuple[int, int, int]:
    """(K, constraint before adding K, constraint after adding K) of candidate m on segment i, relative to L0."""
    cost = m.segments[i]
    after = cost.backward_level if not last else max(cost.backward_level, m.tail_level)
    return cost.kept_bytes, cost.forward_excess, after


def _pareto(states: dict[int, tuple[float, Any]]) -> list[tuple[int, float, Any]]:
    """(S, value, path) not dominated by a state with a smaller-or-equal S and a smaller-or-equal value, by S."""
    front, best = [], math.inf
    for s in sorted(states):
        value, path = states[s]
        if value < best:
            front.append((s, value, path))
            best = value
    return front


def _thin(front: list[tuple[int, float, Any]]) -> list[tuple[int, float, Any]]:
    """At most about 2 * _MAX_STATES states: per byte bin, its smallest S (the most room left) and its best value."""
    if len(front) <= _MAX_STATES:
        return front
    low, high = front[0][0], front[-1][0]
    width = (high - low) / _MAX_STATES
    kept: dict[int, list[tuple[int, float, Any]]] = {}
    for state in front:
        bin_states = kept.setdefault(int((state[0] - low) / width), [])
        if len(bin_states) < 2:
            bin_states.append(state)
        else:
            bin_states[1] = state  # along the front, a larger S has a smaller value
    return [state for states in kept.values() for state in states]


def _dynamic_programme(
    measurements: dict[str, CandidateMeasurement],
    names: list[str],
    n: int,
    limit: float,
    fold: Callable[[float, float, int, str], float],
) -> list[str] | None:
    """The best assignment by `fold` whose every constraint level stays within `limit` (None if there is none).

    States: exact prefix sums S -> (value, path), reduced to their Pareto front after each segment (and thinned
    per byte bin beyond _MAX_STATES states). `fold(value, level, i, name)` adds segment i under `name`, whose
    largest constraint level is `level`; the smallest final value wins.
    """
    l0 = max(m.start_live for m in measurements.values())
    floor = max(max(m.pre_peak, m.post_peak) for m in measurements.values())
    if floor > limit:
        return None
    front: list[tuple[int, float, Any]] = [(0, fold(0.0, floor, -1, ""), None)]
    for i in range(n):
        last = i == n - 1
        following: dict[int, tuple[float, Any]] = {}
        for s, value, path in front:
            for name in names:
                kept, before, after = _levels(measurements[name], i, last)
                level = max(l0 + s + before, l0 + s + kept + after)
                if level > limit:
                    continue
                new = fold(value, level, i, name)
                if s + kept not in following or new < following[s + kept][0]:
                    following[s + kept] = (new, (path, name))
        front = _thin(_pareto(following))
        if not front:
            return None
    _, _, path = min(front, key=lambda state: state[1])
    chosen: list[str] = []
    while path is not None:
        path, name = path
        chosen.append(name)
    return chosen[::-1]


def _fastest_within(
    measurements: dict[str, CandidateMeasurement], names: list[str], n: int, budget: int
) -> list[str] | None:
    """The assignment with the least predicted time whose predicted peak fits `budget`."""

    def add_time(value: float, level: float, i: int, name: str) -> float:
        return value + measurements[name].segments[i].seconds if i >= 0 else 0.0

    return _dynamic_programme(measurements, names, n, budget, add_time)


def _smallest_peak(measurements: dict[str, CandidateMeasurement], names: list[str], n: int) -> list[str]:
    """The assignment with the smallest predicted peak."""

    def largest_level(value: float, level: float, i: int, name: str) -> float:
        return max(value, level)

    found = _dynamic_programme(measurements, names, n, math.inf, largest_level)
    if found is None:  # cannot happen: without a limit every path is kept
        raise RuntimeError("fastckpt.plan internal error: no assignment without a limit")
    return found
