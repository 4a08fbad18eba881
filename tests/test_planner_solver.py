"""fastckpt.planner.solver alone: on small random instances it finds what brute force over every choice finds."""

import dataclasses
import itertools
import random

import pytest

from fastckpt.planner import solver
from fastckpt.planner.solver import Option


def instance(seed: int, n: int, k: int, unit: int = 4099):
    """n segments of k random options (byte values multiples of `unit`), a random base and floor."""
    rng = random.Random(seed)
    options = [
        [
            Option(
                kept=unit * rng.randint(0, 40),
                before=unit * rng.randint(0, 60),
                after=unit * rng.randint(-10, 60),
                seconds=rng.uniform(1, 3),
            )
            for _ in range(k)
        ]
        for _ in range(n)
    ]
    return options, unit * rng.randint(0, 10), unit * rng.randint(0, 50)


def levels_peak(options, choice, base, floor) -> int:
    """The peak as the list of levels the model names: each segment's forward and backward, and the floor."""
    levels = [floor]
    for i, j in enumerate(choice):
        kept_before = sum(options[m][choice[m]].kept for m in range(i))
        levels.append(base + kept_before + options[i][j].before)
        levels.append(base + kept_before + options[i][j].kept + options[i][j].after)
    return max(levels)


def every_choice(options):
    return list(itertools.product(*(range(len(segment)) for segment in options)))


CASES = [(seed, n, k) for seed in range(8) for n, k in ((1, 3), (3, 2), (4, 3), (5, 3), (3, 4))]


@pytest.mark.parametrize(("seed", "n", "k"), CASES)
def test_peak_and_seconds_are_the_models(seed, n, k):
    options, base, floor = instance(seed, n, k)
    for choice in every_choice(options):
        assert solver.peak(options, choice, base, floor) == levels_peak(options, choice, base, floor)
        assert solver.seconds(options, choice) == sum(options[i][j].seconds for i, j in enumerate(choice))


@pytest.mark.parametrize(("seed", "n", "k"), CASES)
def test_fastest_within_and_smallest_peak_match_brute_force(seed, n, k):
    options, base, floor = instance(seed, n, k)
    choices = every_choice(options)
    peaks = {c: levels_peak(options, c, base, floor) for c in choices}
    smallest, largest = min(peaks.values()), max(peaks.values())
    assert levels_peak(options, solver.smallest_peak(options, base, floor), base, floor) == smallest
    rng = random.Random(seed)
    for budget in (smallest - 1, smallest, (smallest + largest) // 2, rng.randint(smallest, largest), largest):
        feasible = [c for c in choices if peaks[c] <= budget]
        chosen = solver.fastest_within(options, budget, base, floor)
        if not feasible:
            assert chosen is None
            continue
        assert chosen is not None and len(chosen) == n and levels_peak(options, chosen, base, floor) <= budget
        fastest = min(solver.seconds(options, c) for c in feasible)
        assert solver.seconds(options, chosen) == pytest.approx(fastest, abs=1e-12)


def with_sharing(options, seed: int, unit: int = 4099):
    """The options with random shared forms, held tensors, transient bytes and (the last segment's) tail
    levels, and the shared things' bytes."""
    rng = random.Random(seed + 1000)
    sizes = {thing: unit * rng.randint(1, 30) for thing in ("form a", "form b", "held x", "held y")}
    forms, held = [t for t in sizes if t.startswith("form")], [t for t in sizes if t.startswith("held")]
    shared = [
        [
            dataclasses.replace(
                option,
                shared=frozenset(t for t in forms if rng.random() < 0.5),
                held=frozenset(t for t in held if rng.random() < 0.4),
                transient=rng.randint(0, option.kept),
                tail=unit * rng.randint(-10, 60) if i == len(options) - 1 else None,
            )
            for option in segment
        ]
        for i, segment in enumerate(options)
    ]
    return shared, sizes


def sharing_peak(options, choice, base, floor, sizes) -> int:
    """The peak by the rules the solver's docstring states: a form is live from the forward of its first user
    to that one's backward, a held tensor (in `base` during the forward) in the backward of segments at or
    after its first holder, transient bytes until the forward's end (the last segment's tail included)."""
    chosen = [options[i][j] for i, j in enumerate(choice)]
    levels = [floor]
    for i, option in enumerate(chosen):
        upto = chosen[: i + 1]
        forms = sum(sizes[t] for t in set().union(*(o.shared for o in upto)))
        held = sum(sizes[t] for t in set().union(*(o.held for o in upto)))
        kept = sum(o.kept for o in upto)
        transient = sum(o.transient for o in upto)
        levels.append(base + kept - option.kept + forms + option.before)
        levels.append(base + kept - transient + forms + held + option.after)
        if option.tail is not None:
            levels.append(base + kept + forms + held + option.tail)
    return max(levels)


@pytest.mark.parametrize(("seed", "n", "k"), CASES)
def test_shared_forms_and_held_tensors_match_brute_force(seed, n, k):
    plain, base, floor = instance(seed, n, k)
    options, sizes = with_sharing(plain, seed)
    choices = every_choice(options)
    peaks = {c: sharing_peak(options, c, base, floor, sizes) for c in choices}
    assert all(solver.peak(options, c, base, floor, sizes) == peaks[c] for c in choices)
    smallest = min(peaks.values())
    assert peaks[tuple(solver.smallest_peak(options, base, floor, sizes))] == smallest
    for budget in (smallest - 1, smallest, max(peaks.values())):
        feasible = [c for c in choices if peaks[c] <= budget]
        chosen = solver.fastest_within(options, budget, base, floor, sizes)
        if not feasible:
            assert chosen is None
            continue
        assert peaks[tuple(chosen)] <= budget
        fastest = min(solver.seconds(options, c) for c in feasible)
        assert solver.seconds(options, chosen) == pytest.approx(fastest, abs=1e-12)


def test_edges_floor_above_the_budget_no_segments_and_ties():
    options, base, floor = instance(0, 3, 2)
    assert solver.fastest_within(options, floor - 1, base, floor) is None  # outside the segments already too much
    assert solver.fastest_within([], 10, 0, 10) == [] and solver.smallest_peak([], 0, 10) == []
    same = Option(kept=4, before=1, after=2, seconds=1.0)
    assert solver.fastest_within([[same, same, same]] * 4, 100) == [0] * 4  # ties go to the earlier option
    assert solver.fastest_within([[same]] * 4, 100, floor=0) == [0] * 4


@pytest.mark.parametrize("seed", range(6))
def test_a_thinned_front_never_exceeds_the_budget(seed, monkeypatch):
    options, base, floor = instance(seed, 9, 3, unit=1)
    exact = {}
    peaks = [levels_peak(options, c, base, floor) for c in every_choice(options)]
    budgets = sorted({min(peaks), (min(peaks) + max(peaks)) // 2, max(peaks)})
    for budget in budgets:
        exact[budget] = solver.fastest_within(options, budget, base, floor)
    monkeypatch.setattr(solver, "MAX_STATES", 4)  # thinned after most segments
    for budget in budgets:
        chosen = solver.fastest_within(options, budget, base, floor)
        if chosen is None:
            continue  # thinning may miss a choice, never return one above the budget
        assert levels_peak(options, chosen, base, floor) <= budget
        assert solver.seconds(options, chosen) >= solver.seconds(options, exact[budget]) - 1e-12
    assert levels_peak(options, solver.smallest_peak(options, base, floor), base, floor) >= min(peaks)
