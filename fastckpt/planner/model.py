"""The planner's peak and time model: what the measurements predict for an assignment of candidates.

Per candidate p and segment i (fastckpt.planner.measurement defines them): K_i(p) kept bytes, F_i(p) forward
excess, X_i(p) backward level, T(p) tail level, t_i(p) seconds. For an assignment a (candidate a_i on segment
i), with S_i = K_1(a_1) + ... + K_i(a_i):

    peak(a) = max( pre, post,
                   max_i L0 + S_(i-1) + F_i(a_i),      (forward of segment i)
                   max_i L0 + S_i + X_i(a_i),          (backward of segment i: the segments before it are
                                                         still kept; those after it are freed)
                   L0 + S_n + T(a_n) )                 (loss and head, everything kept)

which is fastckpt.planner.solver's peak with X_n(a_n) raised to T(a_n). Predicted step time: the candidates'
median time outside the segments, plus the chosen t_i.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from fastckpt.planner import solver


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


ByPolicy = dict[str, CandidateMeasurement]


def predicted_peak(measurements: ByPolicy, policies: list[str]) -> int:
    """The peak model's prediction (bytes above what is live before step()) for one policy name per segment."""
    first = next(iter(measurements.values()))
    options = [[_option(measurements[p], i, i == len(policies) - 1)] for i, p in enumerate(policies)]
    return solver.peak(options, [0] * len(policies), first.start_live, max(first.pre_peak, first.post_peak))


def predicted_seconds(measurements: ByPolicy, policies: list[str]) -> float:
    """The time model's prediction for one policy name per segment."""
    outside = statistics.median(m.outside_seconds for m in measurements.values())
    return outside + sum(measurements[p].segments[i].seconds for i, p in enumerate(policies))


def fastest_within(measurements: ByPolicy, names: list[str], n: int, budget: int) -> list[str] | None:
    """The assignment of `names` with the least predicted time whose predicted peak fits `budget` (None: none)."""
    options, base, floor = _options(measurements, names, n)
    found = solver.fastest_within(options, budget, base, floor)
    return None if found is None else [names[j] for j in found]


def smallest_peak(measurements: ByPolicy, names: list[str], n: int) -> list[str]:
    """The assignment of `names` with the smallest predicted peak."""
    options, base, floor = _options(measurements, names, n)
    return [names[j] for j in solver.smallest_peak(options, base, floor)]


def _option(m: CandidateMeasurement, i: int, last: bool) -> solver.Option:
    cost = m.segments[i]
    after = cost.backward_level if not last else max(cost.backward_level, m.tail_level)
    return solver.Option(cost.kept_bytes, cost.forward_excess, after, cost.seconds)


def _options(measurements: ByPolicy, names: list[str], n: int) -> tuple[list[list[solver.Option]], int, int]:
    """The solver's options (names[j] on segment i), base (L0) and floor (pre, post): the largest any candidate
    showed (measure() gives every candidate the same)."""
    options = [[_option(measurements[name], i, i == n - 1) for name in names] for i in range(n)]
    base = max(m.start_live for m in measurements.values())
    floor = max(max(m.pre_peak, m.post_peak) for m in measurements.values())
    return options, base, floor
