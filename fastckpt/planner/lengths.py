"""What fits: the planner's measurements at two sequence lengths or batch sizes, carried to any length.

    lengths = fastckpt.planner.measure_lengths(model, step_at, (1024, 2048))   # step_at(n): the step at length n
    lengths.predict_peak(["recompute"] * 16, 8192)     # bytes, from the peak model at 8,192
    fit = lengths.longest("16GiB")                     # the longest length whose verified plan fits
    fit.length, fit.plan.measured_peak

Every quantity the peak model reads (fastckpt.planner.model: kept bytes, forward and backward levels, the tail,
what is shared and held, seconds) is measured at each length and, per candidate and segment, taken to another
length by the line through the two measured points: activations, the head's inputs and memory-efficient
attention (SDPA's fused kernels, fastckpt's padded attention) grow linearly with the tokens; the parameters'
gradients and what is live before the step do not depend on the length and come out constant. Attention that
materialises a [tokens x tokens] matrix grows faster: the prediction is low there, and verification (which runs
the step at the length found) measures it. (A parabola through three lengths was tried: extrapolated far, the
int8 codec's rounding bent it down, 13% low at 4x the longest measured length where the line was 0.5% low.)

`LengthMeasurements.at(length)` is an ordinary Measurements: any budget is planned at any length from it, and
verified when the step at that length is run (`step_at`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from fastckpt.planner.budgets import is_total
from fastckpt.planner.iteration import Iteration
from fastckpt.planner.model import CandidateMeasurement, SegmentCost
from fastckpt.planner.plans import VERIFY_ATTEMPTS, Measurements, Plan, measure


@dataclass
class Fit:
    """The longest length found to fit a budget, and its plan (verified there when the step could be run)."""

    length: int
    plan: Plan
    predicted_peak: int  # the plan's predicted peak at `length` (bytes of the step)


class LengthMeasurements:
    """Measurements of one model at several lengths (`measure_lengths`); plans at any length come from them."""

    def __init__(
        self,
        measured: Mapping[int, Measurements],
        step_at: Callable[[int], Callable[[], Any]] | None = None,
        gradients: str = "set_to_none",
        optimizer: Any = None,
    ) -> None:
        if len(measured) != 2:
            raise ValueError(f"fastckpt.planner: `lengths` must be two lengths, got {sorted(measured)}")
        self.measured = dict(sorted(measured.items()))
        self.step_at = step_at
        self.gradients = gradients
        self.optimizer = optimizer
        first = next(iter(self.measured.values()))
        # What every length measured (a candidate that failed at one length is left out at all)
        self.candidates = [
            name for name in first.candidates if all(name in m.candidates for m in self.measured.values())
        ]

    @property
    def lengths(self) -> list[int]:
        return list(self.measured)

    def at(self, length: int) -> Measurements:
        """Measurements at `length`: the measured ones at a measured length, else carried there (module docstring);
        their plans are verified when `step_at` was given."""
        return self._carried(length, with_step=self.step_at is not None)

    def _carried(self, length: int, with_step: bool) -> Measurements:
        if not isinstance(length, int) or isinstance(length, bool) or length < 1:
            raise ValueError(f"fastckpt.planner: `length` must be a positive integer, got {length!r}")
        if length in self.measured:
            return self.measured[length]
        reference = self.measured[self.lengths[-1]]
        everywhere = [name for name in reference.by_policy if all(name in m.by_policy for m in self.measured.values())]
        by_policy = {
            name: _carried([m.by_policy[name] for m in self.measured.values()], self.lengths, length)
            for name in everywhere
        }
        step = None  # made only to verify: step_at(length) may allocate the batch
        if with_step:
            step = Iteration(reference.model, self.step_at(length), self.gradients, self.optimizer)
        return Measurements(
            reference.model,
            reference.segments,
            self.candidates,
            by_policy,
            reference.max_error,
            parsed=reference.parsed,
            step=step,
            resident=reference.resident,
        )

    def predict_peak(self, policies: Sequence[str], length: int) -> int:
        """The peak model's prediction at `length` for one policy per segment (bytes above what is live before
        the step)."""
        return self._carried(length, with_step=False).predict_peak(policies)  # no batch made to predict

    def longest(self, budget: int | str, *, up_to: int = 2**20, multiple: int = 1, verify: bool = True) -> Fit:
        """The longest length (a multiple of `multiple`, at most `up_to`) at which some plan is predicted to fit
        `budget` (bytes of the step or a device total such as '16GiB'; a share of stock's peak, 'N%', depends on
        the length itself and is refused), and that plan; with `verify` (needs `step_at`), the plan is run at
        that length, and a shorter length tried while it measures over the budget. ValueError if none fits."""
        if isinstance(budget, str) and not is_total(budget):
            raise ValueError(
                f"fastckpt.planner: longest() needs a budget in bytes or a device total ('16GiB'), got {budget!r}: a "
                "share of stock checkpointing's peak grows with the length"
            )
        if verify and self.step_at is None:
            raise ValueError("fastckpt.planner: longest(verify=True) needs `step_at`; pass verify=False")
        for name, value in (("multiple", multiple), ("up_to", up_to)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"fastckpt.planner: longest(): `{name}` must be a positive integer, got {value!r}")

        def fits(units: int) -> bool:
            measured = self._carried(units * multiple, with_step=False)
            return measured.smallest_feasible_budget() <= measured.budget_bytes(budget)

        low, high = 0, max(1, up_to // multiple)  # fits(low) assumed (nothing), the largest fitting count found
        if not fits(1):
            raise ValueError(self._none_fits(budget, multiple))
        low = 1
        while low < high:
            middle = (low + high + 1) // 2
            if fits(middle):
                low = middle
            else:
                high = middle - 1
        for _ in range(VERIFY_ATTEMPTS):
            length = low * multiple
            try:
                plan = self._carried(length, with_step=verify).plan(budget, verify=verify)
            except ValueError:
                if not verify or low == 1:
                    raise
                low -= max(1, low // 32)  # measured over the budget at this length: a little shorter
                continue
            return Fit(length, plan, plan.predicted_peak)
        raise ValueError(
            f"fastckpt.planner: the plans verified at lengths down to {low * multiple} all measured over {budget!r}"
        )

    def _none_fits(self, budget: int | str, multiple: int) -> str:
        smallest = self._carried(multiple, with_step=False).smallest_feasible_budget()
        return (
            f"fastckpt.planner: no plan fits {budget!r} even at length {multiple}: the smallest predicted peak there "
            f"is {smallest / 2**20:.2f} MiB above what is live before the step"
        )


def measure_lengths(
    model: nn.Module,
    step_at: Callable[[int], Callable[[], Any]],
    lengths: Iterable[int],
    check_fn: Callable[[nn.Module], bool] | None = None,
    candidates: Iterable[Any] | None = None,
    *,
    gradients: str = "set_to_none",
    optimizer: Any = None,
    **measure_kwargs: Any,
) -> LengthMeasurements:
    """fastckpt.planner.measure at each of two lengths (`step_at(length)` returns the step at that length:
    a batch of that many tokens, or rows), for plans at any length (LengthMeasurements)."""
    given = list(lengths)
    lengths = sorted(set(given))
    if (
        len(given) != 2
        or len(lengths) != 2
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in lengths)
    ):
        raise ValueError(f"fastckpt.planner: `lengths` must be two different positive integers, got {given}")
    if not callable(step_at):
        raise TypeError(f"fastckpt.planner: `step_at` must be callable (length -> step), got {type(step_at).__name__}")
    candidates = None if candidates is None else list(candidates)
    measured = {
        n: measure(model, step_at(n), check_fn, candidates, gradients=gradients, optimizer=optimizer, **measure_kwargs)
        for n in lengths
    }
    return LengthMeasurements(measured, step_at, gradients, optimizer)


def _through(xs: Sequence[int], ys: Sequence[float], x: int) -> float:
    """The line through the two points (xs, ys), at x."""
    (x0, x1), (y0, y1) = xs, ys
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _carried(measured: list[CandidateMeasurement], xs: list[int], x: int) -> CandidateMeasurement:
    """One candidate's measurements at lengths `xs`, carried to `x`: numbers through the line, bytes rounded,
    sets (which forms a segment made, which tensors it holds) as the longest length measured them."""

    def number(values: list[float], integral: bool) -> float:
        value = _through(xs, values, x)
        return round(value) if integral else max(0.0, value)

    def mapping(values: list[Mapping[Hashable, int]]) -> dict[Hashable, int]:
        keys = values[-1].keys()
        return {k: max(0, number([v.get(k, values[-1][k]) for v in values], True)) for k in keys}

    def fields(objects: list[Any], exclude: set[str]) -> dict[str, Any]:
        found = {}
        for f in dataclasses.fields(objects[-1]):
            values = [getattr(o, f.name) for o in objects]
            if f.name in exclude:
                continue
            if isinstance(values[-1], bool) or isinstance(values[-1], (frozenset, str)):
                found[f.name] = values[-1]
            elif isinstance(values[-1], int):
                found[f.name] = number(values, True)
            elif f.name == "grad_error":  # the largest measured (NaN: not measured)
                found[f.name] = max(values, key=lambda e: -1.0 if e != e else e)
            elif f.name == "bits_per_element":
                found[f.name] = values[-1]
            elif isinstance(values[-1], float):
                found[f.name] = number(values, False)
            elif isinstance(values[-1], Mapping):
                found[f.name] = mapping(values)
            else:
                found[f.name] = values[-1]
        return found

    segments = [
        SegmentCost(**fields([m.segments[i] for m in measured], set())) for i in range(len(measured[-1].segments))
    ]
    return CandidateMeasurement(segments=segments, **fields(measured, {"segments"}))
