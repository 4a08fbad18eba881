"""The planner's peak and time model: what the measurements predict for an assignment of candidates.

Per candidate p and segment i (fastckpt.planner.measurement defines them): K_i(p) kept bytes, F_i(p) forward
excess, X_i(p) backward level, T(p) tail level, t_i(p) seconds. For an assignment a (candidate a_i on segment
i), with S_i = K_1(a_1) + ... + K_i(a_i):

    peak(a) = max( pre, post,
                   max_i L0 + S_(i-1) + F_i(a_i),      (forward of segment i)
                   max_i L0 + S_i + X_i(a_i),          (backward of segment i: the segments before it are
                                                         still kept; those after it are freed)
                   L0 + S_n + T(a_n) )                 (loss and head, everything kept)

which is fastckpt.planner.solver's peak (T(a_n) as the last segment's tail), plus what the segments share,
which a run with every segment under one candidate hides (mixes on a Hugging Face Llama missed by up to 9%
without it; with it they are predicted to the byte on CPU):

- a stored form of a tensor several segments take (an int8 copy of the position embeddings) is made once, by
  the first segment whose candidate stores it so, and lives until that segment's backward: measured per
  segment (which forms its forward used and which it made), K_i and F_i here exclude the forms segment i
  made, and the solver adds each form once, from its first user on;
- a tensor from before the first segment (the embedding output, the position embeddings) is freed after the
  forward unless a segment holds it (a recomputing one keeps its inputs), and then lives until the backward of
  the first segment holding it: X_i and T here are the levels as if nobody held it, and the solver adds it
  while a segment at or before i holds it;
- what a segment's forward makes and something outside it keeps until the forward ends (autocast caches its
  casts of the weights for the whole autocast region) is freed then unless the segment saved it (plain
  autograd saves the casts): measured per segment (CPU: MemoryTrace.lifetimes), it stays in K_i for the
  forward levels and the solver takes it off the backward levels;
- a segment whose inputs are offloaded to host memory has them brought back (prefetched) when the backward of
  the next segment begins, or of the next offloading segment with other candidates between them: live there
  and until its own backward. X_i here are the levels without the previous segment's prefetched copies, and
  the solver adds those of the nearest offloading segment before i (whether or not a later one triggers it).

Predicted step time: the candidates' median time outside the segments, plus the chosen t_i.

A TailOption (a loss head's chunk size) changes only what the loss and head reach: its bytes go to the T term,
its seconds to the time.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Hashable, Mapping
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
    transient: int = 0  # of kept_bytes, those freed once the forward ends (model docstring)
    prefetched: int = 0  # bytes of its host copies (offload) brought back ahead of its backward (model docstring)


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
    step_seconds: float  # its step's time: outside_seconds plus its segments' (the timed runs mix candidates)
    outside_seconds: float  # fastest step time outside the segments
    bits_per_element: float  # stored bits per element kept after forward (nan: nothing stored through a codec)
    # Largest relative L2 error of a parameter's gradient against no checkpointing, every segment under this
    # candidate, same RNG seed (nan: not measured, i.e. no max_error given).
    grad_error: float = float("nan")
    held_bytes: Mapping[Hashable, int] = field(default_factory=dict)  # the bytes of the segments' `held` tensors
    dropped: frozenset = frozenset()  # those of them freed between the forward and the backward (none held them)


ByPolicy = dict[str, CandidateMeasurement]


@dataclass(frozen=True)
class TailOption:
    """A choice outside the segments that changes only the tail level (what the loss and head reach with every
    segment's activations kept) and the step's time: a loss head's tokens per chunk. `extra_bytes` and
    `extra_seconds` are relative to the measured step; `apply` puts the choice in place, `remove` undoes it."""

    name: str
    extra_bytes: int
    extra_seconds: float
    apply: Callable[[], None]
    remove: Callable[[], None]


def predicted_peak(measurements: ByPolicy, policies: list[str], tail: TailOption | None = None) -> int:
    """The peak model's prediction (bytes above what is live before step()) for one policy name per segment."""
    options, base, floor, sizes = _options(measurements, [[p] for p in policies], _tail_bytes(tail))
    return solver.peak(options, [0] * len(policies), base, floor, sizes)


def predicted_seconds(measurements: ByPolicy, policies: list[str], tail: TailOption | None = None) -> float:
    """The time model's prediction for one policy name per segment."""
    outside = statistics.median(m.outside_seconds for m in measurements.values())
    extra = 0.0 if tail is None else tail.extra_seconds
    return outside + extra + sum(measurements[p].segments[i].seconds for i, p in enumerate(policies))


def fastest_within(
    measurements: ByPolicy, names: list[str], n: int, budget: int, tail: TailOption | None = None
) -> list[str] | None:
    """The assignment of `names` with the least predicted time whose predicted peak fits `budget` (None: none)."""
    options, base, floor, sizes = _options(measurements, [names] * n, _tail_bytes(tail))
    found = solver.fastest_within(options, budget, base, floor, sizes)
    return None if found is None else [names[j] for j in found]


def smallest_peak(measurements: ByPolicy, names: list[str], n: int, tail: TailOption | None = None) -> list[str]:
    """The assignment of `names` with the smallest predicted peak."""
    options, base, floor, sizes = _options(measurements, [names] * n, _tail_bytes(tail))
    return [names[j] for j in solver.smallest_peak(options, base, floor, sizes)]


def _tail_bytes(tail: TailOption | None) -> int:
    return 0 if tail is None else tail.extra_bytes


def _option(m: CandidateMeasurement, i: int, last: bool, dropped: frozenset, tail_bytes: int = 0) -> solver.Option:
    """Candidate m on segment i as the solver's option: its levels without what it shares (model docstring).
    `dropped`: the tensors some candidate's run freed between the forward and the backward (others freed in
    the forward, when no segment holds them, are in the kept bytes); `tail_bytes`: a TailOption's."""
    cost = m.segments[i]
    made = sum(cost.shared[form] for form in cost.made)
    # Under m everywhere, the held tensors live in segment i's backward are those of the segments up to i.
    held = dropped.intersection(set().union(*(c.held for c in m.segments[: i + 1])))
    # ... and the transient bytes already freed are those of the segments up to i
    transient = sum(c.transient for c in m.segments[: i + 1])
    held_bytes = sum(m.held_bytes[name] for name in held)
    # Under m everywhere, segment i's backward brought back segment i-1's host copies: the solver adds those of
    # whichever offloading segment precedes i in the assignment.
    prefetched = m.segments[i - 1].prefetched if i > 0 else 0
    return solver.Option(
        cost.kept_bytes - made,
        cost.forward_excess - made,
        cost.backward_level - held_bytes + transient - prefetched,
        cost.seconds,
        transient=cost.transient,
        prefetched=cost.prefetched,
        # the loss and head may run before the transient bytes are freed: the tail keeps them
        tail=m.tail_level - held_bytes + tail_bytes if last else None,
        shared=frozenset(("form", form) for form in cost.shared),
        held=frozenset(("held", name) for name in cost.held & dropped),
    )


def _options(
    measurements: ByPolicy, names: list[list[str]], tail_bytes: int = 0
) -> tuple[list[list[solver.Option]], int, int, dict[Hashable, int]]:
    """The solver's options (names[i][j] on segment i), base (L0) and floor (pre, post): the largest any
    candidate showed (measure() gives every candidate the same), and the bytes of the shared forms and held
    tensors the options name (the same in every candidate's run)."""
    dropped = frozenset().union(*(m.dropped for m in measurements.values()))
    n = len(names)
    options = [[_option(measurements[name], i, i == n - 1, dropped, tail_bytes) for name in names[i]] for i in range(n)]
    base = max(m.start_live for m in measurements.values())
    floor = max(max(m.pre_peak, m.post_peak) for m in measurements.values())
    sizes: dict[Hashable, int] = {}
    for m in measurements.values():
        for cost in m.segments:
            sizes.update((("form", form), size) for form, size in cost.shared.items())
        sizes.update((("held", name), size) for name, size in m.held_bytes.items())
    return options, base, floor, sizes
