"""The planner's solver, pure: the fastest choice of one option per segment whose peak fits a budget.

Input: `options[i][j]`, option j on segment i (the planner's: candidate j on segment i), as four numbers
(an Option): `kept` bytes it adds to what stays live until segment i's backward, the `before` and `after`
levels its own forward and backward reach, and its `seconds`. With S_i = kept of segments 1..i (each under
its chosen option) the peak of a choice is

    peak = max( floor,
                max_i base + S_(i-1) + before_i,      (segment i's forward: the segments before it kept)
                max_i base + S_i + after_i )          (segment i's backward: the segments after it freed)

and its time is the sum of the chosen `seconds`. `base` is what is live before the first segment, `floor`
the peak outside every segment.

Every term depends only on the prefix sum S and one segment's option, so this is a knapsack over segments:
a dynamic programme over S keeping, for each S, the best prefix. A prefix with a smaller S and no worse
value dominates (every later level only grows with S), so only the Pareto front of (S, value) is kept; it
is exact while the front has at most MAX_STATES states, and beyond that it is thinned to two states per
byte bin (the one with the most room left and the best value), which may miss a choice but never returns
one above the budget. Ties go to the earlier option and the earlier prefix.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

MAX_STATES = 4096  # prefix states kept per segment before thinning


@dataclass(frozen=True)
class Option:
    """One option on one segment."""

    kept: int  # bytes it leaves live for the later segments' forward and its own backward (K)
    before: int  # level its forward reaches above the level at its start, before `kept` is added (F)
    after: int  # level its backward reaches above the level once `kept` is added (X; the last segment: or tail)
    seconds: float


Options = Sequence[Sequence[Option]]


def peak(options: Options, choice: Sequence[int], base: int = 0, floor: int = 0) -> int:
    """The peak of `choice` (choice[i]: the option index on segment i)."""
    level, prefix = floor, 0
    for i, j in enumerate(choice):
        option = options[i][j]
        level = max(level, base + prefix + option.before)
        prefix += option.kept
        level = max(level, base + prefix + option.after)
    return level


def seconds(options: Options, choice: Sequence[int]) -> float:
    """The time of `choice`: its options' seconds summed in segment order."""
    return sum(options[i][j].seconds for i, j in enumerate(choice))


def fastest_within(options: Options, budget: float, base: int = 0, floor: int = 0) -> list[int] | None:
    """The choice with the least time whose peak is at most `budget`; None when no choice fits."""

    def add_time(value: float, level: float, option: Option | None) -> float:
        return value + option.seconds if option is not None else 0.0

    return _dynamic_programme(options, budget, base, floor, add_time)


def smallest_peak(options: Options, base: int = 0, floor: int = 0) -> list[int]:
    """The choice with the smallest peak."""

    def largest_level(value: float, level: float, option: Option | None) -> float:
        return max(value, level)

    found = _dynamic_programme(options, math.inf, base, floor, largest_level)
    if found is None:  # cannot happen: without a limit every prefix is kept
        raise RuntimeError("fastckpt.plan internal error: no assignment without a limit")
    return found


# ---- the dynamic programme --------------------------------------------------------------------------------

State = tuple[int, float, Any]  # (S, value, path: (previous path, option index) or None)


def _dynamic_programme(
    options: Options, limit: float, base: int, floor: int, fold: Callable[[float, float, Option | None], float]
) -> list[int] | None:
    """The best choice by `fold` whose every level stays within `limit` (None if there is none).

    `fold(value, level, option)` adds a segment under `option`, whose largest level is `level` (None: the
    empty prefix, at `floor`); the smallest final value wins.
    """
    if floor > limit:
        return None
    front: list[State] = [(0, fold(0.0, floor, None), None)]
    for segment in options:
        following: dict[int, tuple[float, Any]] = {}
        for s, value, path in front:
            for j, option in enumerate(segment):
                level = max(base + s + option.before, base + s + option.kept + option.after)
                if level > limit:
                    continue
                new = fold(value, level, option)
                kept = s + option.kept
                if kept not in following or new < following[kept][0]:
                    following[kept] = (new, (path, j))
        front = _thin(_pareto(following))
        if not front:
            return None
    _, _, path = min(front, key=lambda state: state[1])
    chosen: list[int] = []
    while path is not None:
        path, j = path
        chosen.append(j)
    return chosen[::-1]


def _pareto(states: dict[int, tuple[float, Any]]) -> list[State]:
    """(S, value, path) not dominated by a state with a smaller-or-equal S and a smaller-or-equal value, by S."""
    front, best = [], math.inf
    for s in sorted(states):
        value, path = states[s]
        if value < best:
            front.append((s, value, path))
            best = value
    return front


def _thin(front: list[State]) -> list[State]:
    """At most about 2 * MAX_STATES states: per byte bin, its smallest S (the most room left) and its best value."""
    if len(front) <= MAX_STATES:
        return front
    low, high = front[0][0], front[-1][0]
    width = (high - low) / MAX_STATES
    kept: dict[int, list[State]] = {}
    for state in front:
        bin_states = kept.setdefault(int((state[0] - low) / width), [])
        if len(bin_states) < 2:
            bin_states.append(state)
        else:
            bin_states[1] = state  # along the front, a larger S has a smaller value
    return [state for states in kept.values() for state in states]
