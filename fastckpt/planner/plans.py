"""Measurements of a model's candidates, the plans solved from them, and the entry points measure() and plan()."""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from fastckpt.planner import model as peak_model
from fastckpt.planner.budgets import Resident, check_budget, format_bytes, is_total, step_bytes
from fastckpt.planner.candidates import NONE, REFERENCE, Candidate, parse_candidate, parse_candidates
from fastckpt.planner.checks import probe, samples_mixed
from fastckpt.planner.iteration import Iteration, check_gradients
from fastckpt.planner.measurement import gradient_errors, measure_candidates, timing_rounds
from fastckpt.planner.model import CandidateMeasurement, TailOption
from fastckpt.planner.segments import Segment, check_arguments, device_of, find_segments
from fastckpt.policies import Policy
from fastckpt.storage import offload as offload_engine

VERIFY_ATTEMPTS = 4  # plans a verifying plan() runs before it gives up on a budget


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
        parsed: Iterable[Candidate] = (),
        step: Callable[[], Any] | Iteration | None = None,
        resident: Resident | None = None,
        skipped: dict[str, str] | None = None,
    ) -> None:
        self.model = model
        # The measured step, as the planner ran it (an Iteration: fastckpt.planner.iteration): plans are verified by
        # running it (None: they cannot be).
        self.step = step
        self.resident = resident  # what was live before the step (device-total budgets); None: not known
        self.segments = segments
        self.by_policy = by_policy
        self.max_error = max_error
        self.failed = failed or {}  # candidates whose step raised on this model, with the error
        # default candidates not measured or left out without a warning (the same as another here, or refused by
        # the planner's checks, or failed: a batch slice of a segment that takes other batched inputs), and why
        self.skipped = skipped or {}
        # What plans may choose (by_policy also holds the 'recompute' reference): the candidates that ran and,
        # with max_error, whose measured gradient error is within it.
        ran = [c for c in candidates if c in by_policy]
        self.candidates = [c for c in ran if max_error is None or _within(by_policy[c].grad_error, max_error)]
        self.excluded = [c for c in ran if c not in self.candidates]
        self._parsed = {candidate.name: candidate for candidate in parsed}  # what measure() parsed, by name
        # Choices outside the segments a plan also makes (TailOption: fastckpt.integrations.hf.measure gives a loss
        # head's chunk sizes); empty: the tail as measured.
        self.tail_options: list[TailOption] = []

    @property
    def reference_peak(self) -> int:
        """The measured peak with every segment under 'recompute' (stock checkpointing)."""
        return self.by_policy[REFERENCE].peak

    @property
    def reference_seconds(self) -> float:
        """The step's time with every segment under 'recompute' (CandidateMeasurement.step_seconds)."""
        return self.by_policy[REFERENCE].step_seconds

    @property
    def parsed(self) -> list[Candidate]:
        """The candidates as measure() parsed them."""
        return list(self._parsed.values())

    def budget_bytes(self, budget: int | str) -> int:
        """`budget` in bytes of the step ("N%" of the reference peak, a device total less what is live before
        the step: fastckpt.planner.budgets)."""
        return step_bytes(budget, self.reference_peak, self.resident)

    def plan(self, budget: int | str, *, verify: bool | None = None) -> Plan:
        """The fastest assignment predicted to fit `budget`; ValueError naming the smallest feasible budget if none.

        `verify` (default: whenever the step is known, i.e. for measure()'s Measurements) runs the step once
        with the chosen plan applied and measures its peak. If that is over the budget, the plan is solved
        again for a budget lowered by the overshoot the model missed, and verified again, up to
        VERIFY_ATTEMPTS plans; when none fits, ValueError names the smallest peak a verified plan measured.
        The returned plan's `measured_peak` is the verified peak (None without verification).
        """
        limit = self.budget_bytes(budget)
        total = is_total(budget)
        verify = self.step is not None if verify is None else verify
        if verify and self.step is None:
            raise ValueError(
                "fastckpt.Measurements.plan: verify=True needs the step; these Measurements were built without one "
                "(fastckpt.planner.measure keeps it), or pass verify=False"
            )
        target, verified = limit, []
        for _ in range(VERIFY_ATTEMPTS if verify else 1):
            try:
                plan = self._solve(target, limit, total)
            except ValueError as infeasible:
                if not verified:
                    raise
                raise self._over_budget(limit, verified, total) from infeasible
            if not verify:
                return plan
            plan.measured_peak = self._measure(plan)
            if plan.measured_peak <= limit:
                return plan
            verified.append(plan)
            # What the model missed on this plan, assumed again on the next: solve for that much less.
            target = min(target - 1, limit - (plan.measured_peak - plan.predicted_peak))
        raise self._over_budget(limit, verified, total)

    def _solve(self, target: int, limit: int, total: bool = False) -> Plan:
        """The fastest assignment predicted to fit `target` bytes, as a Plan for the budget `limit`."""
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
            raise ValueError(f"fastckpt.plan: no candidate is left to assign to the segments{excluded}")
        best: tuple[float, list[str], TailOption | None] | None = None
        for tail in self._tails():
            policies = peak_model.fastest_within(self.by_policy, self.candidates, len(self.segments), target, tail)
            if policies is not None:
                seconds = peak_model.predicted_seconds(self.by_policy, policies, tail)
                if best is None or seconds < best[0]:
                    best = (seconds, policies, tail)
        if best is None:
            smallest = self.smallest_feasible_budget()
            raise ValueError(
                f"fastckpt.plan: no assignment of {self.candidates}{excluded} to the {len(self.segments)} segments "
                f"fits a budget of {target} bytes ({target / 2**20:.2f} MiB); the smallest feasible budget is "
                f"{smallest} bytes ({smallest / 2**20:.2f} MiB, {100 * smallest / self.reference_peak:.1f}% of "
                f"stock checkpointing's peak){self._as_total(smallest, total)}"
            )
        seconds, policies, tail = best
        return Plan(
            measurements=self,
            policies=policies,
            budget=limit,
            predicted_peak=peak_model.predicted_peak(self.by_policy, policies, tail),
            predicted_seconds=seconds,
            tail=tail,
        )

    def _tails(self) -> list[TailOption | None]:
        """The tail choices a plan may make (None: the tail as measured)."""
        return list(self.tail_options) or [None]

    def _smallest(self) -> tuple[list[str], TailOption | None, int]:
        """The assignment and tail choice of the smallest predicted peak, and that peak."""
        found = []
        for tail in self._tails():
            policies = peak_model.smallest_peak(self.by_policy, self.candidates, len(self.segments), tail)
            found.append((peak_model.predicted_peak(self.by_policy, policies, tail), policies, tail))
        peak, policies, tail = min(found, key=lambda item: item[0])
        return policies, tail, peak

    def _measure(self, plan: Plan) -> int:
        """The peak of one step with `plan` applied (then removed again)."""
        from fastckpt.memory import peak_bytes

        iteration = self.step if isinstance(self.step, Iteration) else None
        plan.apply()
        try:
            if iteration is None:
                return peak_bytes(self.step, device_of(self.model))
            with iteration.session():
                if iteration.warm_up_needed:  # the planner's own gradients or the optimizer's state: not in the step
                    iteration()
                return peak_bytes(iteration, device_of(self.model))
        finally:
            plan.remove()

    def _as_total(self, step_peak: int, total: bool) -> str:
        """For a device-total budget's error: the smallest total, and what is live before the step."""
        if not total:
            return ""
        before = self.resident.before_step
        return (
            f"; as a device total: {format_bytes(step_peak + before)}, of which {format_bytes(before)} is live before "
            f"the step and no plan removes it ({self.resident.describe()})"
        )

    def _over_budget(self, limit: int, verified: list[Plan], total: bool = False) -> ValueError:
        smallest = min(p.measured_peak for p in verified)
        tried = "; ".join(
            f"{p.predicted_peak / 2**20:.2f} predicted, {p.measured_peak / 2**20:.2f} measured" for p in verified
        )
        return ValueError(
            f"fastckpt.plan: no plan verified within the budget of {limit} bytes ({limit / 2**20:.2f} MiB): the "
            f"plans run measured over it (MiB: {tried}); the smallest verified budget is {smallest} bytes "
            f"({smallest / 2**20:.2f} MiB, {100 * smallest / self.reference_peak:.1f}% of stock checkpointing's peak)"
            f"{self._as_total(smallest, total)}; smallest_plan() gives the assignment of the smallest predicted peak "
            "with its measured budget"
        )

    def smallest_plan(self, *, verify: bool | None = None) -> Plan:
        """The assignment the model predicts the smallest peak for (the fallback when a budget is infeasible).
        Verified as `plan` verifies (default: whenever the step is known), its budget is the larger of the
        predicted and the measured peak: a budget it is known to meet."""
        verify = self.step is not None if verify is None else verify
        if verify and self.step is None:
            raise ValueError("fastckpt.Measurements.smallest_plan: verify=True needs the step; pass verify=False")
        if not self.candidates:
            raise ValueError("fastckpt.plan: no candidate is left to assign to the segments")
        policies, tail, predicted = self._smallest()
        seconds = peak_model.predicted_seconds(self.by_policy, policies, tail)
        plan = Plan(self, policies, predicted, predicted, seconds, tail=tail)
        if verify:
            plan.measured_peak = self._measure(plan)
            plan.budget = max(predicted, plan.measured_peak)
        return plan

    def smallest_feasible_budget(self) -> int:
        """The smallest budget (bytes) some assignment of the candidates is predicted to fit."""
        return self._smallest()[2]

    def predict_peak(self, policies: Sequence[str], tail: TailOption | None = None) -> int:
        """The peak model's prediction (bytes above what is live before step()) for an assignment (and one of
        `tail_options`; None: the tail as measured)."""
        return peak_model.predicted_peak(self.by_policy, self._check(policies), tail)

    def predict_seconds(self, policies: Sequence[str], tail: TailOption | None = None) -> float:
        """The time model's prediction for an assignment (and a tail option, as predict_peak)."""
        return peak_model.predicted_seconds(self.by_policy, self._check(policies), tail)

    def _check(self, policies: Sequence[str]) -> list[str]:
        policies = [parse_candidate(p).name for p in policies]
        if len(policies) != len(self.segments):
            raise ValueError(
                f"fastckpt.Measurements: {len(self.segments)} policies needed (one per segment), got {len(policies)}"
            )
        unknown = sorted({p for p in policies if p not in self.by_policy})
        if unknown:
            raise ValueError(f"fastckpt.Measurements: {unknown} not measured; measured: {list(self.by_policy)}")
        return policies

    def _candidate(self, name: str) -> Candidate:
        """Candidate `name` as measure() parsed it (parsed here for Measurements built otherwise)."""
        if name not in self._parsed:
            self._parsed[name] = parse_candidate(name)
        return self._parsed[name]

    def table(self) -> str:
        """Per candidate: measured peak and step time, and its per-segment kept bytes and time (mean); then the
        candidates left out, and why."""
        width = max(24, *(len(name) + 2 for name in self.by_policy))
        lines = [
            f"{'candidate':<{width}}{'peak MiB':>10}{'step ms':>10}{'kept MiB/seg':>14}{'bwd MiB/seg':>13}"
            f"{'ms/seg':>9}{'bits/elem':>11}{'grad err':>10}"
        ]
        for name, m in self.by_policy.items():
            n = len(m.segments)
            error = "" if math.isnan(m.grad_error) else f"{m.grad_error:.1e}"
            lines.append(
                f"{name:<{width}}{m.peak / 2**20:>10.2f}{m.step_seconds * 1e3:>10.1f}"
                f"{sum(c.kept_bytes for c in m.segments) / n / 2**20:>14.2f}"
                f"{sum(c.backward_level for c in m.segments) / n / 2**20:>13.2f}"
                f"{sum(c.seconds for c in m.segments) / n * 1e3:>9.1f}{_bits(m.bits_per_element):>11}{error:>10}"
                + ("  (left out: > max_error)" if name in self.excluded else "")
            )
        lines += [f"{name}: failed on this model, left out: {error}" for name, error in self.failed.items()]
        lines += [f"{name}: not used on this model: {why}" for name, why in self.skipped.items()]
        lines += [f"{_tail_line(tail)}, a choice of every plan" for tail in self.tail_options]
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
    measured_peak: int | None = None  # the peak of one step with the plan applied, when plan() verified it
    tail: TailOption | None = None  # the choice outside the segments (a loss head's chunk), None: as measured

    @property
    def model(self) -> nn.Module:
        return self.measurements.model

    @property
    def segments(self) -> list[Segment]:
        return self.measurements.segments

    def apply(self) -> nn.Module:
        """Wrap each segment in place with its policy (fastckpt.wrap; state dict unchanged); returns the model."""
        if self.applied:
            raise RuntimeError("fastckpt.Plan.apply: this plan is already applied to the model")
        for segment in self.segments:
            if getattr(segment.parent, segment.attribute) is not segment.module:
                raise RuntimeError(
                    f"fastckpt.Plan.apply: segment {segment.name!r} is no longer the module the plan measured (another "
                    "plan applied, or the model changed); measure again"
                )
        for segment, policy in zip(self.segments, self.policies, strict=True):
            runner = self.measurements._candidate(policy).wrap(segment.module)
            if runner is not segment.module:
                setattr(segment.parent, segment.attribute, runner)
        if self.tail is not None:
            self.tail.apply()
        self.applied = True
        return self.model

    def remove(self) -> nn.Module:
        """Undo `apply`: put the original segment modules back; returns the model."""
        if not self.applied:
            raise RuntimeError("fastckpt.Plan.remove: this plan is not applied")
        for segment in self.segments:
            setattr(segment.parent, segment.attribute, segment.module)
        if self.tail is not None:
            self.tail.remove()
        self.applied = False
        return self.model

    def table(self) -> str:
        """One line per segment (policy, kept bytes, backward level, time), then the predicted totals."""
        width = max(22, *(len(policy) + 2 for policy in self.policies))
        names = max(24, *(len(segment.name) + 2 for segment in self.segments))  # a PEFT model's names are long
        lines = [f"{'segment':<{names}}{'policy':<{width}}{'kept MiB':>10}{'bwd MiB':>10}{'ms':>9}{'bits/elem':>11}"]
        for index, (segment, policy) in enumerate(zip(self.segments, self.policies, strict=True)):
            m = self.measurements.by_policy[policy]
            cost = m.segments[index]
            lines.append(
                f"{segment.name:<{names}}{policy:<{width}}{cost.kept_bytes / 2**20:>10.2f}"
                f"{cost.backward_level / 2**20:>10.2f}{cost.seconds * 1e3:>9.1f}{_bits(m.bits_per_element):>11}"
            )
        if self.tail is not None:
            lines.append(_tail_line(self.tail))
        measured = "" if self.measured_peak is None else f", measured {self.measured_peak / 2**20:.2f} MiB"
        lines.append(
            f"predicted peak {self.predicted_peak / 2**20:.2f} MiB{measured} (budget {self.budget / 2**20:.2f} MiB, "
            f"stock checkpoint {self.measurements.reference_peak / 2**20:.2f} MiB); predicted step "
            f"{self.predicted_seconds * 1e3:.1f} ms (stock {self.measurements.reference_seconds * 1e3:.1f} ms)"
        )
        return "\n".join(lines)


def _within(error: float, max_error: float) -> bool:
    """A NaN or inf error is never within max_error (a comparison with NaN is False either way round)."""
    return math.isfinite(error) and error <= max_error


def _tail_line(tail: TailOption) -> str:
    change = f"{tail.extra_bytes / 2**20:+.2f} MiB, {tail.extra_seconds * 1e3:+.1f} ms"
    return f"{tail.name}: {change} against the measured step"


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
    repeats: int = 3,
    max_error: float | None = None,
    verify: bool = True,
    progress: bool = True,
    optimizer: Any = None,
    gradients: str = "set_to_none",
    offload: bool = False,
) -> Plan:
    """The fastest assignment of candidate policies to the segments of `model` predicted to fit `budget`.

    `step()` runs one forward and backward of the training step; `budget` is bytes the step may allocate above what
    is live before it, "N%" of stock checkpointing's peak, or the device's total ("20GiB", "1.5GB": what is live
    before the step, i.e. parameters, buffers, gradients, the state of `optimizer` when given, on CUDA everything
    allocated, plus the step's peak); the segments are the submodules `check_fn` selects (default: the children of
    the largest nn.ModuleList/nn.Sequential of identical blocks); `candidates` are policy strings, 'none',
    'selective:<spec>' (fastckpt.hybrid.selective: the outputs of matmuls and attention kept through <spec>'s codec,
    the rest recomputed, the inputs stored as <spec> says: 'selective:int8', 'selective:recompute:int8+int8'),
    'selective-attention:<spec>' (the same keeping only the fused attention's outputs and dropout's masks,
    hybrid.keep_attention) or 'batch<N>:<policy or selective candidate>' (fastckpt.tiled(segment, N, dim=0, ...):
    the segment's batch in N slices, each checkpointed, so its backward holds one slice's activations; for segments
    that treat every sample alone, which the planner checks: batch candidates are left out, with a warning, when
    changing the other samples moves a slice's output or the batch has fewer samples than slices) (default:
    DEFAULT_CANDIDATES, the whole-segment policies, the fused attention kept and batches in two slices;
    'selective:...' is not among them, on CPU 'selective:int8' measured slower and larger than 'int8'; defaults the
    model cannot use are left out without a warning and listed in Measurements.table(): kept-attention ones where no
    segment calls F.scaled_dot_product_attention or F.dropout, batch slices the checks refuse or that fail on the
    model, a segment taking other batched inputs). A candidate whose step raises on the model, or gives NaN/inf
    parameter gradients where the plain step's are finite, is left out with a warning (the reference 'recompute':
    the error is raised). `max_error`, when given, leaves out the candidates whose gradient error exceeds it (a NaN
    or inf error does) or ValueError if the reference's gradients are not finite: the largest relative L2 error of a
    parameter's gradient against no checkpointing (a batch slice: against the same slices kept exactly, which draw
    random ops in the same order), measured with every segment under the candidate and the same RNG seed (a bound
    per candidate; a mix of candidates within it measured within it too in our runs, but that is not guaranteed).
    `repeats`: timed samples of each candidate on each kind of segment (identical blocks are one kind); the timed
    runs mix the candidates, one per segment. Runs step() 1 + n + r times (n: the candidates, 'recompute' among
    them; r = ceil(repeats x n / k), k the segments of the smallest kind: one traced run per candidate, r timed
    runs), plus, with max_error, one per candidate but 'none' and one for the reference; batch or kept-attention
    candidates add one step (the probe) and, with max_error, one per slice count (their reference). ValueError if no
    assignment fits, naming the smallest budget. `verify` (default True) runs the chosen plan once and plans again
    while it measures over the budget (Measurements.plan). `progress` shows a progress bar with the remaining time
    while it measures (tqdm, on a terminal only). `optimizer` and `gradients`: each run as the user's loop runs it
    (measure()). `offload=True` adds OFFLOAD_CANDIDATES, the segment's inputs kept in host memory (pinned,
    prefetched a segment ahead in the backward), as they are or int8: the budget counts the device's bytes, not the
    host's; on a CPU, where host memory is the device's, they would keep what they keep without offload, so they
    are left out there with a warning (fastckpt.storage.offload.copies_apart emulates a GPU's there).
    """
    check_budget(budget)
    if not isinstance(verify, bool):
        raise TypeError(f"fastckpt.plan: `verify` must be True or False, got {verify!r}")
    measured = measure(
        model,
        step,
        check_fn,
        candidates,
        repeats=repeats,
        max_error=max_error,
        progress=progress,
        optimizer=optimizer,
        gradients=gradients,
        offload=offload,
    )
    return measured.plan(budget, verify=verify)


def measure(
    model: nn.Module,
    step: Callable[[], Any],
    check_fn: Callable[[nn.Module], bool] | None = None,
    candidates: Iterable[str | Policy | None] | None = None,
    *,
    repeats: int = 3,
    max_error: float | None = None,
    progress: bool = True,
    optimizer: Any = None,
    gradients: str = "set_to_none",
    offload: bool = False,
) -> Measurements:
    """Measure every candidate on the segments (what `plan` does before solving); plan any budget from it.
    `progress`: a progress bar of the step() runs with the remaining time (tqdm, on a terminal only).
    `optimizer`: every run is the whole iteration, step() then `optimizer.step()` (its temporaries are in the
    peak), and its state counts towards device-total budgets: what its first step allocates, measured (at least,
    before its first step, Adam-like optimizers' and SGD momentum's state); the parameters and the optimizer's
    state are put back after the runs. `gradients`: what the loop does with the gradients before each step,
    'set_to_none' (default: `zero_grad()`, torch's and Trainer's default; every run starts with no gradients, so
    the peak has those backward allocates) or 'kept' (accumulated into, as with `zero_grad(set_to_none=False)`);
    the caller's gradients are left as they are (fastckpt.planner.iteration)."""
    check_arguments(model, step, check_fn, repeats, max_error)
    check_gradients(gradients)
    if not isinstance(progress, bool):
        raise TypeError(f"fastckpt.plan: `progress` must be True or False, got {progress!r}")
    parsed = parse_candidates(candidates, offload)
    segments = find_segments(model, check_fn)
    device = device_of(model)
    # Candidates the probe shows to be wrong or the same as another here. Left out with a warning when the
    # user named them, silently (listed in table()) when they are defaults: a batch slice needs segments that
    # take nothing else batched, and the kept attention needs attention. Offload ones the user asked for.
    refused = _offload_moving_nothing(parsed, device)
    asked = {c.name for c in parsed if candidates is not None or (c.policy is not None and c.policy.offload)}
    parsed = [c for c in parsed if c.name not in refused]
    resident = Resident.measure(model, device, optimizer, gradients)  # before any step of ours
    names = [candidate.name for candidate in parsed]
    measured = parsed if REFERENCE in names else [*parsed, parse_candidate(REFERENCE)]
    watched = frozenset().union(*(c.selective.within or () for c in parsed if c.selective is not None))
    probing = bool(watched) or any(c.batch_slices > 1 for c in parsed)
    bar = _progress_bar(
        int(probing) + 1 + len(measured) + _after_tracing(segments, measured, repeats, max_error), progress
    )
    iteration = Iteration(model, step, gradients, optimizer)  # every run of the user's step (the verifying one too)

    def step() -> Any:
        result = iteration()
        bar.update()
        return result

    with iteration.session(), contextlib.closing(bar):
        if probing:
            probed = probe(segments, step, watched)
            slicing = samples_mixed(segments, probed, device, parsed)
            for candidate in parsed:
                within = candidate.selective.within if candidate.selective is not None else None
                if candidate.batch_slices in slicing:
                    refused[candidate.name] = slicing[candidate.batch_slices]
                elif within and not within & probed.called:
                    functions = ", ".join(sorted(f"torch.nn.functional.{f.__name__}" for f in within))
                    refused[candidate.name] = (
                        f"no segment calls {functions}, so it keeps nothing: it runs as its policy '{candidate.policy}'"
                    )
            measured = [c for c in measured if c.name not in refused]
            _recount(bar, 1 + len(measured) + _after_tracing(segments, measured, repeats, max_error))
        quiet = {c.name for c in parsed if c.batch_slices > 1} if candidates is None else set()
        by_policy, failed = measure_candidates(
            model,
            segments,
            step,
            measured,
            device,
            repeats,
            quiet=quiet,
            on_traced=lambda ran: _recount(bar, _after_tracing(segments, ran, repeats, max_error)),
        )
        if optimizer is not None:  # the runs stepped it: what its first step allocates, measured
            resident = resident.with_state_of(optimizer, device)
        if max_error is not None:
            ran = [c for c in measured if c.name in by_policy]
            for name, error in gradient_errors(model, segments, step, ran, device).items():
                by_policy[name].grad_error = error
    skipped = {name: failed.pop(name) for name in quiet if name in failed}
    for name, why in refused.items():
        if name not in asked:
            skipped[name] = why
        else:
            failed[name] = why
            warnings.warn(f"fastckpt.plan: candidate {name!r} left out: {why}", stacklevel=2)
    return Measurements(
        model,
        segments,
        names,
        by_policy,
        max_error,
        failed,
        parsed=measured,
        step=iteration,
        resident=resident,
        skipped=skipped,
    )


def _offload_moving_nothing(candidates: list[Candidate], device: Any) -> dict[str, str]:
    """The offload candidates, with why, where host memory is the device's (a CPU, unless the engine copies as
    on a GPU: offload.copies_apart)."""
    if device.type != "cpu" or offload_engine.ENGINE.copies_cpu_tensors:
        return {}
    why = "on a CPU host memory is the device's: offload moves nothing there"
    return {c.name: why for c in candidates if c.policy is not None and c.policy.offload}


def _after_tracing(segments: list[Segment], ran: list[Candidate], repeats: int, max_error: float | None) -> int:
    """The step() runs measure() makes after the traced ones (plan()'s docstring gives the whole count)."""
    count = len(timing_rounds(segments, ran, repeats))
    if max_error is not None:
        # the reference (no checkpoint) and each candidate but 'none', plus each slice count's own reference
        count += 1 + sum(c.name != NONE for c in ran) + len({c.batch_slices for c in ran if c.batch_slices > 1})
    return count


def _recount(bar: Any, remaining: int) -> None:
    """The progress bar's total once the runs still to come are known (a probe or a failure drops some)."""
    bar.total = bar.n + remaining
    bar.refresh()


def _progress_bar(total: int, enabled: bool) -> Any:
    """tqdm over `total` step() runs; silent when not enabled or when stderr is not a terminal (tqdm's
    disable=None)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="fastckpt.plan: measuring", unit="step", disable=None if enabled else True)
