"""The planner's solver, pure: the fastest choice of one option per segment whose peak fits a budget.

Input: `options[i][j]`, option j on segment i (the planner's: candidate j on segment i), as an Option: `kept`
bytes it adds to what stays live until segment i's backward, the `before` and `after` levels its own forward
and backward reach, its `seconds`, two sets of things segments share, whose bytes `shared_bytes` gives:

- `shared`: stored forms several segments may use (a codec's copy of the position embeddings every layer
  takes, made once): live from the forward of the first segment whose option uses it to that segment's
  backward (the last to release it);
- `held`: tensors live before the first segment (the model's own, e.g. the embedding output) that are freed
  after the forward unless an option holds them: then live until the backward of the first segment holding
  them. The forward levels count them in `base` already; `after` is the level as if none were held;

`transient`, the part of `kept` freed once the forward ends, and `prefetched`, an offloading option's bytes
brought back to the device from the backward of the next segment on. With S_i = kept of segments 1..i (each
under its chosen option), D_i their transient bytes, U_i the shared forms used by segments 1..i, H_i the
tensors held by them and P_i the prefetched bytes of the last offloading segment before i (0: none), the peak
of a choice is

    peak = max( floor,
                max_i base + S_(i-1) + bytes(U_i) + before_i,                        (segment i's forward)
                max_i base + S_i - D_i + bytes(U_i) + bytes(H_i) + after_i + P_i,    (its backward)
                base + S_n + bytes(U_n) + bytes(H_n) + tail_n )                      (the last one's `tail`)

and its time is the sum of the chosen `seconds`. `base` is what is live before the first segment, `floor`
the peak outside every segment.

Every term depends only on the prefix (S, D, U, H, P) and one segment's option, so this is a knapsack over
segments: a dynamic programme over prefixes keeping, for each (S, D, U, H, P), the best one. Among prefixes of
the same D, U, H and P a smaller S with no worse value dominates (every later level only grows with S), so only
that Pareto front is kept; it is exact while a front has at most MAX_STATES states, and beyond that it is
thinned to two states per byte bin (the one with the most room left and the best value), which may miss a
choice but never returns one above the budget. Ties go to the earlier option and the earlier prefix.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

MAX_STATES = 4096  # prefix states kept per segment (and per set of shared things) before thinning


@dataclass(frozen=True)
class Option:
    """One option on one segment."""

    kept: int  # bytes it leaves live for the later segments' forward and its own backward (K)
    before: int  # level its forward reaches above the level at its start, before `kept` is added (F)
    after: int  # level its backward reaches above the level once `kept` is added (X)
    seconds: float
    shared: frozenset[Hashable] = field(default_factory=frozenset)  # stored forms it uses (made by the first)
    held: frozenset[Hashable] = field(default_factory=frozenset)  # tensors from before the segments it holds
    transient: int = 0  # of `kept`, the bytes freed once the forward ends (live in the forward levels only)
    tail: int | None = None  # the last segment's: the level between the forward and its backward, as `after`
    # but with the transient bytes still live (what the loss and the head reach before the forward has ended)
    prefetched: int = 0  # offload: bytes of its host copies back on the device from the next one's backward on


Options = Sequence[Sequence[Option]]
# (U, H, D, P): shared forms used, tensors held, transient bytes so far, the last offloading segment's prefetch
Prefix = tuple[frozenset, frozenset, int, int]


class _Levels:
    """The two levels of an option after a prefix, with the bytes of the shared things."""

    def __init__(self, base: int, shared_bytes: Mapping[Hashable, int]) -> None:
        self.base = base
        self.shared_bytes = shared_bytes

    def bytes(self, things: frozenset) -> int:
        return sum(self.shared_bytes[t] for t in things)

    def step(self, s: int, prefix: Prefix, option: Option) -> tuple[int, Prefix, int]:
        """(largest level of `option` after prefix (s, prefix), the prefix after it, its S)."""
        used, held, transient, prefetch = prefix
        used_after = used | option.shared if option.shared else used
        held_after = held | option.held if option.held else held
        transient += option.transient
        shared = self.bytes(used_after)
        forward = self.base + s + shared + option.before
        after = self.base + s + option.kept + shared + self.bytes(held_after)
        backward = after - transient + option.after + prefetch
        if option.tail is not None:
            backward = max(backward, after + option.tail)
        prefetch = option.prefetched or prefetch
        return max(forward, backward), (used_after, held_after, transient, prefetch), s + option.kept


EMPTY: Prefix = (frozenset(), frozenset(), 0, 0)
NOTHING_SHARED: Mapping[Hashable, int] = MappingProxyType({})


def peak(
    options: Options,
    choice: Sequence[int],
    base: int = 0,
    floor: int = 0,
    shared_bytes: Mapping[Hashable, int] = NOTHING_SHARED,
) -> int:
    """The peak of `choice` (choice[i]: the option index on segment i)."""
    levels = _Levels(base, shared_bytes)
    level, s, prefix = floor, 0, EMPTY
    for i, j in enumerate(choice):
        reached, prefix, s = levels.step(s, prefix, options[i][j])
        level = max(level, reached)
    return level


def seconds(options: Options, choice: Sequence[int]) -> float:
    """The time of `choice`: its options' seconds summed in segment order."""
    return sum(options[i][j].seconds for i, j in enumerate(choice))


def fastest_within(
    options: Options,
    budget: float,
    base: int = 0,
    floor: int = 0,
    shared_bytes: Mapping[Hashable, int] = NOTHING_SHARED,
) -> list[int] | None:
    """The choice with the least time whose peak is at most `budget`; None when no choice fits."""

    def add_time(value: float, level: float, option: Option | None) -> float:
        return value + option.seconds if option is not None else 0.0

    return _dynamic_programme(options, budget, _Levels(base, shared_bytes), floor, add_time)


def smallest_peak(
    options: Options, base: int = 0, floor: int = 0, shared_bytes: Mapping[Hashable, int] = NOTHING_SHARED
) -> list[int]:
    """The choice with the smallest peak."""

    def largest_level(value: float, level: float, option: Option | None) -> float:
        return max(value, level)

    found = _dynamic_programme(options, math.inf, _Levels(base, shared_bytes), floor, largest_level)
    if found is None:  # cannot happen: without a limit every prefix is kept
        raise RuntimeError("fastckpt.plan internal error: no assignment without a limit")
    return found


# ---- the dynamic programme --------------------------------------------------------------------------------

State = tuple[int, float, Any]  # (S, value, path: (previous path, option index) or None)


def _dynamic_programme(
    options: Options, limit: float, levels: _Levels, floor: int, fold: Callable[[float, float, Option | None], float]
) -> list[int] | None:
    """The best choice by `fold` whose every level stays within `limit` (None if there is none).

    `fold(value, level, option)` adds a segment under `option`, whose largest level is `level` (None: the
    empty prefix, at `floor`); the smallest final value wins.
    """
    if floor > limit:
        return None
    fronts: dict[Prefix, list[State]] = {EMPTY: [(0, fold(0.0, floor, None), None)]}
    for segment in options:
        following: dict[Prefix, dict[int, tuple[float, Any]]] = {}
        for prefix, front in fronts.items():
            for s, value, path in front:
                for j, option in enumerate(segment):
                    level, prefix_after, kept = levels.step(s, prefix, option)
                    if level > limit:
                        continue
                    new = fold(value, level, option)
                    states = following.setdefault(prefix_after, {})
                    if kept not in states or new < states[kept][0]:
                        states[kept] = (new, (path, j))
        fronts = {prefix: _thin(_pareto(states)) for prefix, states in following.items()}
        if not fronts:
            return None
    _, _, path = min((state for front in fronts.values() for state in front), key=lambda state: state[1])
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
