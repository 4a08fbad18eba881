"""The planner's peak and time model: what the measurements predict for an assignment of candidates.

Per candidate p and segment i (fastckpt.planner.measurement defines them): K_i(p) kept bytes, F_i(p) forward
excess, X_i(p) backward level, T(p) tail level, t_i(p) seconds. For an assignment a (candidate a_i on segment
i), with S_i = K_1(a_1) + ... + K_i(a_i):

    peak(a) = max( pre, post,
                   max_i L0 + S_(i-1) + F_i(a_i),      (forward of segment i)
                   max_i L0 + S_i + X_i(a_i),          (backward of segment i: the segments before it are
                                                         still kept; those after it are freed)
                   L0 + S_n + T(a_n) )                 (loss and head, everything kept)

which is fastckpt.planner.solver's peak with X_n(a_n) raised to T(a_n), plus what the segments share, which
a run with every segment under one candidate hides (measured to the byte: mixes on a Hugging Face Llama missed
by up to 9% without it):

- a stored form of a tensor several segments take (an int8 copy of the position embeddings) is made once, by
  the first segment whose candidate stores it so, and lives until that segment's backward: measured per
  segment (which forms its forward used and which it made), K_i and F_i here exclude the forms segment i
  made, and the solver adds each form once, from its first user on;
- a tensor from before the first segment (the embedding output, the position embeddings) is freed after the
  forward unless a segment holds it (a recomputing one keeps its inputs), and then lives until the backward of
  the first segment holding it: X_i and T here are the levels as if nobody held it, and the solver adds it
  while a segment at or before i holds it.

Predicted step time: the candidates' median time outside the segments, plus the chosen t_i.
"""

from __future__ import annotations

import statistics
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

from fastckpt.planner import solver


@dataclass(frozen=True)
class SegmentCost:
    """What one candidate costs on one segment, measured with every segment under that candidate."""

    kept_bytes: int
    forward_excess: int
    backward_level: int
    seconds: float
    shared: Mapping[Hashable, int] = field(default_factory=dict)  # shared forms its forward used: their bytes
    made: frozenset = frozenset()  # those of them it made (the first segment using them)
    held: frozenset = frozenset()  # tensors from before the segments it holds past the forward (model docstring)


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
    held_bytes: Mapping[Hashable, int] = field(default_factory=dict)  # the bytes of the segments' `held` tensors
    dropped: frozenset = frozenset()  # those of them freed between the forward and the backward (none held them)


ByPolicy = dict[str, CandidateMeasurement]


def predicted_peak(measurements: ByPolicy, policies: list[str]) -> int:
    """The peak model's prediction (bytes above what is live before step()) for one policy name per segment."""
    first = next(iter(measurements.values()))
    dropped = _dropped(measurements)
    options = [[_option(measurements[p], i, i == len(policies) - 1, dropped)] for i, p in enumerate(policies)]
    floor = max(first.pre_peak, first.post_peak)
    return solver.peak(options, [0] * len(policies), first.start_live, floor, _shared_bytes(measurements))


def predicted_seconds(measurements: ByPolicy, policies: list[str]) -> float:
    """The time model's prediction for one policy name per segment."""
    outside = statistics.median(m.outside_seconds for m in measurements.values())
    return outside + sum(measurements[p].segments[i].seconds for i, p in enumerate(policies))


def fastest_within(measurements: ByPolicy, names: list[str], n: int, budget: int) -> list[str] | None:
    """The assignment of `names` with the least predicted time whose predicted peak fits `budget` (None: none)."""
    options, base, floor = _options(measurements, names, n)
    found = solver.fastest_within(options, budget, base, floor, _shared_bytes(measurements))
    return None if found is None else [names[j] for j in found]


def smallest_peak(measurements: ByPolicy, names: list[str], n: int) -> list[str]:
    """The assignment of `names` with the smallest predicted peak."""
    options, base, floor = _options(measurements, names, n)
    return [names[j] for j in solver.smallest_peak(options, base, floor, _shared_bytes(measurements))]


def _option(m: CandidateMeasurement, i: int, last: bool, dropped: frozenset) -> solver.Option:
    """Candidate m on segment i as the solver's option: its levels without what it shares (model docstring).
    `dropped`: the tensors some candidate's run freed between the forward and the backward (others freed in
    the forward, when no segment holds them, are in the kept bytes)."""
    cost = m.segments[i]
    made = sum(cost.shared[form] for form in cost.made)
    # Under m everywhere, the held tensors live in segment i's backward are those of the segments up to i.
    held = dropped.intersection(set().union(*(c.held for c in m.segments[: i + 1])))
    after = cost.backward_level if not last else max(cost.backward_level, m.tail_level)
    return solver.Option(
        cost.kept_bytes - made,
        cost.forward_excess - made,
        after - sum(m.held_bytes[name] for name in held),
        cost.seconds,
        shared=frozenset(("form", form) for form in cost.shared),
        held=frozenset(("held", name) for name in cost.held & dropped),
    )


def _dropped(measurements: ByPolicy) -> frozenset:
    return frozenset().union(*(m.dropped for m in measurements.values()))


def _shared_bytes(measurements: ByPolicy) -> dict[Hashable, int]:
    """The bytes of every shared form and held tensor the options name (the same in every candidate's run)."""
    found: dict[Hashable, int] = {}
    for m in measurements.values():
        for cost in m.segments:
            found.update((("form", form), size) for form, size in cost.shared.items())
        found.update((("held", name), size) for name, size in m.held_bytes.items())
    return found


def _options(measurements: ByPolicy, names: list[str], n: int) -> tuple[list[list[solver.Option]], int, int]:
    """The solver's options (names[j] on segment i), base (L0) and floor (pre, post): the largest any candidate
    showed (measure() gives every candidate the same)."""
    dropped = _dropped(measurements)
    options = [[_option(measurements[name], i, i == n - 1, dropped) for name in names] for i in range(n)]
    base = max(m.start_live for m in measurements.values())
    floor = max(max(m.pre_peak, m.post_peak) for m in measurements.values())
    return options, base, floor
