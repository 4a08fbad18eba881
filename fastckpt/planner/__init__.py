"""`fastckpt.plan`: choose a policy per segment so that a training step fits a memory budget, as fast as possible.

    plan = fastckpt.plan(model, step, "50%")    # or fastckpt.planner.measure(...), then .plan(budget) per budget
    plan.apply()

measure() runs step() a handful of times: per candidate once with every segment under it, then timed runs that
mix the candidates over identical segments (measurement),
plan(budget) predicts each assignment's peak and time from those runs (model) and picks the fastest that fits
(solver). Candidates are strings, parsed once (candidates); the segments are found and the arguments checked
in segments, the runs checked for what would make a candidate wrong (checks).

Budget: bytes the step may allocate above what is live before it (the same quantity as
fastckpt.memory.peak_bytes), or a string "N%": N percent of the peak measured with every segment under
"recompute" (stock checkpointing, whose memory fastckpt's recompute matches), or a device total ("20GiB").
Every run is an iteration of the user's loop (iteration): gradients set to None before it, the optimizer's
step when given. What fits at other sequence lengths: measure_lengths (lengths).
"""

from fastckpt.planner import solver
from fastckpt.planner.candidates import (
    DEFAULT_CANDIDATES,
    NONE,
    OFFLOAD_CANDIDATES,
    POLICY_CANDIDATES,
    REFERENCE,
    Candidate,
    extended_candidates,
    parse_candidate,
)
from fastckpt.planner.checks import max_relative_error
from fastckpt.planner.lengths import Fit, LengthMeasurements, measure_lengths
from fastckpt.planner.model import CandidateMeasurement, SegmentCost
from fastckpt.planner.plans import Measurements, Plan, measure, plan
from fastckpt.planner.segments import Segment

__all__ = [
    "DEFAULT_CANDIDATES",
    "NONE",
    "OFFLOAD_CANDIDATES",
    "POLICY_CANDIDATES",
    "REFERENCE",
    "Candidate",
    "CandidateMeasurement",
    "Fit",
    "LengthMeasurements",
    "Measurements",
    "Plan",
    "Segment",
    "SegmentCost",
    "extended_candidates",
    "max_relative_error",
    "measure",
    "measure_lengths",
    "parse_candidate",
    "plan",
    "solver",
]
