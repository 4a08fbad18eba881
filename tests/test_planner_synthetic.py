"""The planner's peak model and choice on synthetic measurements (random, in whole units of bytes): the smallest
peak and the fastest assignment within a budget are what brute force over every assignment finds, and plan()
chooses a loss head's tail option (TailOption) with the segments as brute force over both does."""

from __future__ import annotations

import itertools
import random

import pytest
from torch import nn

from fastckpt.planner import CandidateMeasurement, Measurements, SegmentCost
from fastckpt.planner.model import TailOption, fastest_within, predicted_peak, smallest_peak
from fastckpt.planner.segments import find_segments


def synthetic(n: int, names: list[str], seed: int, unit: int) -> dict[str, CandidateMeasurement]:
    """Random measurements whose byte values are multiples of `unit` (so discretisation is exact)."""
    rng = random.Random(seed)
    out = {}
    for name in names:
        segments = [
            SegmentCost(
                kept_bytes=unit * rng.randint(0, 40),
                forward_excess=unit * rng.randint(0, 60),
                backward_level=unit * rng.randint(-10, 60),
                seconds=rng.uniform(1, 3),
            )
            for _ in range(n)
        ]
        out[name] = CandidateMeasurement(
            name, segments, unit * 5, unit * 20, unit * 30, unit * rng.randint(0, 20), 0, 0.0, 1.0, float("nan")
        )
    return out


@pytest.mark.parametrize("seed", range(6))
def test_solver_matches_brute_force(seed):
    names = ["a", "b", "c"]
    n = 5
    measurements = synthetic(n, names, seed, unit=4099)
    assignments = list(itertools.product(names, repeat=n))
    peaks = {a: predicted_peak(measurements, list(a)) for a in assignments}
    smallest, largest = min(peaks.values()), max(peaks.values())
    assert predicted_peak(measurements, smallest_peak(measurements, names, n)) == smallest

    def seconds(a):
        return sum(measurements[p].segments[i].seconds for i, p in enumerate(a))

    for budget in (smallest - 1, smallest, (smallest + largest) // 2, largest):
        feasible = [a for a in assignments if peaks[a] <= budget]
        chosen = fastest_within(measurements, names, n, budget)
        if not feasible:
            assert chosen is None
            continue
        assert chosen is not None and predicted_peak(measurements, chosen) <= budget
        assert seconds(chosen) == pytest.approx(min(seconds(a) for a in feasible), abs=1e-12)


def test_tail_options_are_chosen_with_the_segments():
    # A loss head's chunk size (a TailOption) moves only the tail level and the time: plan() picks the
    # (assignment, tail) pair a brute force over both finds, and applying the plan puts the tail in place.
    names, n, unit = ["int8", "int4", "recompute"], 4, 4099
    by_policy = synthetic(n, names, seed=3, unit=unit)
    for m in by_policy.values():  # the loss and head about as large as a segment's levels
        m.tail_level += 60 * unit
    calls: list[str] = []
    tails = [
        TailOption(name, extra * unit, seconds, lambda name=name: calls.append(name), lambda: calls.append("removed"))
        for name, extra, seconds in (("small", -15, 0.9), ("as measured", 0, 0.0), ("large", 40, -0.8))
    ]
    model = nn.Sequential(*[nn.Linear(1, 1) for _ in range(n)])
    measurements = Measurements(model, find_segments(model, None), names, by_policy)
    measurements.tail_options = tails
    pairs = [(list(a), t) for a in itertools.product(names, repeat=n) for t in tails]
    peaks = [measurements.predict_peak(a, t) for a, t in pairs]
    by_assignment: dict[tuple, set] = {}
    for (a, _), peak in zip(pairs, peaks, strict=True):
        by_assignment.setdefault(tuple(a), set()).add(peak)
    assert any(len(p) == len(tails) for p in by_assignment.values())  # the tail can be the peak
    assert measurements.smallest_feasible_budget() == min(peaks)
    chosen_tails = set()
    for budget in sorted(set(peaks))[:: max(1, len(set(peaks)) // 12)]:
        plan = measurements.plan(budget, verify=False)
        fitting = [pair for pair, peak in zip(pairs, peaks, strict=True) if peak <= budget]
        best = min(measurements.predict_seconds(a, t) for a, t in fitting)
        assert plan.predicted_peak <= budget and plan.predicted_seconds == pytest.approx(best, abs=1e-12)
        assert plan.predicted_peak == measurements.predict_peak(plan.policies, plan.tail)
        chosen_tails.add(plan.tail.name)
    assert {"small", "large"} <= chosen_tails
    plan.apply()
    plan.remove()
    assert calls == [plan.tail.name, "removed"]
    assert plan.tail.name in plan.table() and "a choice of every plan" in measurements.table()
