"""fastckpt.plan: segments, measurement, peak model, solver, apply, and argument errors."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fastckpt
from fastckpt import CheckpointWrapper, hybrid
from fastckpt.memory import MemoryTrace, peak_bytes
from fastckpt.planner import (
    DEFAULT_CANDIDATES,
    NONE,
    REFERENCE,
    Candidate,
    CandidateMeasurement,
    Measurements,
    Segment,
    SegmentCost,
    extended_candidates,
    max_relative_error,
    measure,
    parse_candidate,
)
from fastckpt.planner.checks import probe, samples_mixed
from fastckpt.planner.measurement import segment_seconds, timing_rounds
from fastckpt.planner.model import TailOption, fastest_within, predicted_peak, smallest_peak
from fastckpt.planner.segments import find_segments
from fastckpt.storage import codecs
from fastckpt.tiling import TiledWrapper
from tests.helpers import needs_sac_hooks


class Block(nn.Module):
    """Pre-LN MLP block; its activations (128-512 KiB) are all above the codecs' minimum size."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Net(nn.Module):
    def __init__(self, layers: int = 5, dim: int = 64) -> None:
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.side = nn.Sequential(nn.Linear(dim, dim), nn.ReLU())  # smaller, not identical blocks: not chosen
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make(layers: int = 5, net: Callable[[], nn.Module] | None = None):
    """A model (Net, or what `net` builds) seeded the same way, and a step on one fixed input."""
    torch.manual_seed(0)
    model = net() if net is not None else Net(layers)
    x = torch.randn(4, 256, 64)

    def step() -> None:
        model(x).pow(2).mean().backward()
        model.zero_grad(set_to_none=True)

    return model, step


CANDIDATES = [NONE, "recompute", "recompute+int8", "int8", "int4", "recompute:int4+int4"]


@pytest.fixture(scope="module")
def measured():
    model, step = make()
    return measure(model, step, candidates=CANDIDATES, repeats=1), step


def test_default_segments_are_the_largest_stack_of_identical_blocks(measured):
    measurements, _ = measured
    assert [s.name for s in measurements.segments] == [f"blocks.{i}" for i in range(5)]
    assert list(measurements.by_policy) == CANDIDATES
    assert "recompute:int8+int8" in DEFAULT_CANDIDATES and NONE in DEFAULT_CANDIDATES
    # what each candidate keeps per segment is ordered as its storage says
    kept = {p: sum(c.kept_bytes for c in m.segments) for p, m in measurements.by_policy.items()}
    assert kept["none"] > kept["int8"] > kept["int4"] > kept["recompute"] > kept["recompute+int8"]
    # int8 codes plus 32 bits of parameters per group: of 128 elements (the 256-wide MLP rows), or per 64-wide row
    assert 8.25 < measurements.by_policy["int8"].bits_per_element < 8.5


@pytest.mark.parametrize("budget", ["100%", "85%", "smallest", "plain"])
def test_plan_fits_its_budget_and_predicts_the_measured_peak(measured, budget):
    measurements, step = measured
    if budget == "smallest":
        budget = measurements.smallest_feasible_budget()
    elif budget == "plain":
        budget = measurements.by_policy[NONE].peak  # plenty: plain everywhere fits
    plan = measurements.plan(budget)
    assert plan.predicted_peak <= plan.budget
    plan.apply()
    try:
        step()
        measured_peak = peak_bytes(step)
    finally:
        plan.remove()
    assert measured_peak <= plan.budget * 1.01, (plan.policies, measured_peak, plan.budget)
    assert abs(plan.predicted_peak - measured_peak) <= 0.10 * measured_peak, (plan.policies, measured_peak)
    if budget == measurements.by_policy[NONE].peak:  # everything fits: the fastest by the time model
        assert all(plan.predicted_seconds <= measurements.predict_seconds([p] * 5) for p in CANDIDATES)


def test_peak_model_on_every_uniform_and_some_mixed_assignments(measured):
    measurements, step = measured
    for policy, m in measurements.by_policy.items():
        assert abs(measurements.predict_peak([policy] * 5) - m.peak) <= 0.02 * m.peak, policy
    random.seed(0)
    for _ in range(2):
        policies = [random.choice(CANDIDATES) for _ in range(5)]
        model = measurements.model
        for segment, policy in zip(measurements.segments, policies, strict=True):
            if policy != NONE:
                setattr(segment.parent, segment.attribute, fastckpt.wrap(segment.module, policy))
        try:
            step()
            actual = peak_bytes(step)
        finally:
            for segment in measurements.segments:
                setattr(segment.parent, segment.attribute, segment.module)
        assert abs(measurements.predict_peak(policies) - actual) <= 0.10 * actual, (policies, actual)
        assert all(isinstance(b, Block) for b in model.blocks)


def test_infeasible_budget_names_the_smallest_feasible_one(measured):
    measurements, _ = measured
    smallest = measurements.smallest_feasible_budget()
    assert smallest < measurements.reference_peak
    with pytest.raises(
        ValueError,
        match=rf"fits a budget of {smallest - 1} bytes.*smallest feasible budget is "
        rf"{smallest} bytes",
    ):
        measurements.plan(smallest - 1)
    with pytest.raises(ValueError, match="smallest feasible budget is"):
        measurements.plan("10%")
    assert measurements.plan(smallest).predicted_peak == smallest


def test_a_plan_is_verified_by_running_it(measured):
    measurements, step = measured
    calls = []
    measurements.step = lambda: (calls.append(1), step())[1]
    try:
        plan = measurements.plan("85%")
        assert len(calls) == 1 and not plan.applied  # run once with the plan applied, then removed
        assert plan.measured_peak is not None and plan.measured_peak <= plan.budget
        assert f"measured {plan.measured_peak / 2**20:.2f} MiB" in plan.table()
        unverified = measurements.plan("85%", verify=False)
        assert len(calls) == 1 and unverified.measured_peak is None and "measured" not in unverified.table()
    finally:
        measurements.step = step


def test_a_plan_measured_over_its_budget_is_planned_again(measured, monkeypatch):
    measurements, _ = measured
    budget = measurements.budget_bytes("85%")
    first = measurements.plan(budget, verify=False)
    missed = budget - first.predicted_peak + 1024  # what the model "misses" on every plan: the first is over
    measured_peaks = []

    def run(plan):
        measured_peaks.append(plan.predicted_peak + missed)
        return measured_peaks[-1]

    monkeypatch.setattr(measurements, "_measure", run)
    plan = measurements.plan(budget)
    assert plan.policies != first.policies and plan.measured_peak <= budget
    assert plan.predicted_peak <= budget - missed  # solved for the budget less what the first run missed
    assert measured_peaks[0] > budget and len(measured_peaks) >= 2


def test_no_verified_plan_names_the_smallest_verified_budget(measured, monkeypatch):
    measurements, _ = measured
    monkeypatch.setattr(measurements, "_measure", lambda plan: plan.budget + 2**20)  # always 1 MiB over
    budget = measurements.budget_bytes("100%")
    with pytest.raises(ValueError, match=r"no plan verified within the budget of .*smallest verified budget is") as e:
        measurements.plan(budget)
    smallest = budget + 2**20
    assert f"smallest verified budget is {smallest} bytes" in str(e.value)


def test_smallest_plan_is_the_smallest_predicted_assignment_with_its_measured_budget(measured):
    measurements, _ = measured
    unverified = measurements.smallest_plan(verify=False)
    assert unverified.predicted_peak == unverified.budget == measurements.smallest_feasible_budget()
    verified = measurements.smallest_plan()
    assert verified.policies == unverified.policies and verified.measured_peak is not None
    assert verified.budget == max(verified.predicted_peak, verified.measured_peak) and not verified.applied


def recorded_bars(monkeypatch) -> list:
    """The progress bars measure() makes from here on, as recorders of their totals and updates (tqdm's
    interface as measure() uses it)."""
    import tqdm.auto

    bars = []

    class Recorder:
        def __init__(self, total, disable, **kwargs):
            self.total, self.disable, self.n = total, disable, 0
            bars.append(self)

        def update(self, n=1):
            self.n += n

        def refresh(self):
            pass

        def close(self):
            self.closed = True

    monkeypatch.setattr(tqdm.auto, "tqdm", Recorder)
    return bars


@pytest.mark.parametrize("max_error", [None, 0.5])
def test_progress_bar_counts_every_step_run(max_error, monkeypatch, capsys):
    model, step = make(layers=2)
    measure(model, step, candidates=["recompute", "int8"], repeats=1, max_error=max_error)
    assert capsys.readouterr().err == ""  # the real bar: silent when stderr is not a terminal
    bars = recorded_bars(monkeypatch)
    measure(model, step, candidates=["recompute", "int8"], repeats=1, max_error=max_error)
    measure(model, step, candidates=["recompute", "int8"], repeats=1, progress=False)
    (shown, hidden) = bars
    assert shown.n == shown.total and shown.closed and shown.disable is None  # the count plan()'s docstring gives
    assert hidden.disable is True
    with pytest.raises(TypeError, match="`progress` must be True or False"):
        measure(model, step, progress="yes")


def test_verifying_needs_the_step():
    model, step = make(layers=2)
    measured = measure(model, step, candidates=["recompute", "int8"], repeats=1)
    bare = Measurements(model, measured.segments, ["recompute"], measured.by_policy)
    assert bare.plan("100%").measured_peak is None  # no step known: not verified by default
    with pytest.raises(ValueError, match="verify=True needs the step"):
        bare.plan("100%", verify=True)
    with pytest.raises(TypeError, match="`verify` must be True or False"):
        fastckpt.plan(model, step, "100%", verify="yes")


def test_apply_keeps_the_state_dict_and_remove_undoes_it(measured):
    measurements, step = measured
    model = measurements.model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = measurements.plan("85%")
    assert set(plan.policies) - {NONE}, "the budget needs some checkpointed segment"
    plan.apply()
    try:
        wrapped = [isinstance(b, CheckpointWrapper) for b in model.blocks]
        assert wrapped == [p != NONE for p in plan.policies]
        state = model.state_dict()
        assert list(state) == list(before) and all(torch.equal(state[k], before[k]) for k in before)
        model.load_state_dict(before)
        with pytest.raises(RuntimeError, match="already applied"):
            plan.apply()
        lines = plan.table().splitlines()
        assert len(lines) == 7 and all(p in plan.table() for p in plan.policies)
        assert "predicted peak" in lines[-1]
    finally:
        plan.remove()
    assert all(isinstance(b, Block) for b in model.blocks)


def test_fastckpt_plan_in_one_call():
    model, step = make(layers=3)
    plan = fastckpt.plan(model, step, "100%", candidates=["recompute", "int8", NONE], repeats=1)
    assert plan.predicted_peak <= plan.budget == plan.measurements.reference_peak
    assert len(plan.policies) == 3 and set(plan.policies) <= {"recompute", "int8", NONE}
    assert plan.predicted_seconds > 0
    assert not plan.applied and all(isinstance(b, Block) for b in model.blocks)  # measuring left the model as it was


def test_planning_steps_run_no_post_accumulate_grad_hook():
    """What a parameter's post-accumulate-grad hook does (ZeRO's gradient reduction, an optimizer stepped in the
    backward) belongs to training steps: the planner's steps and its verifying run leave it out, and the hooks
    are all there afterwards, in their order."""
    model, step = make(layers=3)
    before = [p.detach().clone() for p in model.parameters()]
    calls: list[str] = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: calls.append("first"))
        p.register_post_accumulate_grad_hook(lambda p: calls.append("second"))
    fastckpt.plan(model, step, "100%", candidates=["recompute", NONE], repeats=1)
    assert calls == []
    step()
    used = [name for name, _ in model.named_parameters() if not name.startswith("side.")]  # side: no gradient
    assert calls == ["first", "second"] * len(used)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


@needs_sac_hooks
def test_selective_candidate_is_measured_planned_and_applied():
    model, step = make(layers=3)
    measurements = measure(model, step, candidates=["recompute", "selective:int8", "int8"], repeats=1)
    selective, stock = measurements.by_policy["selective:int8"], measurements.by_policy["recompute"]
    # It keeps the two matmul outputs per block 8-bit (more than recompute's input, less than int8's four).
    assert 7.5 < selective.bits_per_element < 8.5
    assert all(s.kept_bytes > r.kept_bytes for s, r in zip(selective.segments, stock.segments, strict=True))
    assert measurements.predict_peak(["selective:int8"] * 3) == selective.peak
    plan = measurements.plan(selective.peak)
    forced = Measurements(model, measurements.segments, ["selective:int8"], measurements.by_policy).plan(selective.peak)
    forced.apply()
    try:
        assert all(isinstance(b, hybrid.SelectiveWrapper) for b in model.blocks)
        with fastckpt.track() as report:
            step()
        # Each block: its input stored int8 (the candidate's recompute+int8), the matmul outputs selective:int8.
        assert [s.policy for s in report.segments] == ["recompute+int8", "selective:int8"] * 3
        assert peak_bytes(step) == forced.predicted_peak
    finally:
        forced.remove()
    assert plan.predicted_peak <= selective.peak


def test_batch_slices_candidate_is_measured_planned_and_applied():
    model, step = make(layers=3)
    measurements = measure(model, step, candidates=["recompute", "batch4:recompute"], repeats=1)
    sliced, stock = measurements.by_policy["batch4:recompute"], measurements.by_policy["recompute"]
    # The same input kept per block (and each slice's small bookkeeping), a quarter of the recomputed
    # activations alive in each backward.
    for s, r in zip(sliced.segments, stock.segments, strict=True):
        assert r.kept_bytes <= s.kept_bytes < 1.1 * r.kept_bytes
        assert s.backward_level < 0.5 * r.backward_level
    plan = measurements.plan(sliced.peak)
    assert plan.policies == ["batch4:recompute"] * 3
    keys = list(model.state_dict())
    plan.apply()
    try:
        assert all(isinstance(b, TiledWrapper) and (b.chunks, b.dim) == (4, 0) for b in model.blocks)
        assert list(model.state_dict()) == keys
        assert peak_bytes(step) == plan.predicted_peak
    finally:
        plan.remove()


@pytest.mark.cuda
def test_batch_slices_plan_on_cuda_predicts_the_measured_peak():
    torch.manual_seed(0)
    model = Net(3).cuda()
    x = torch.randn(4, 256, 64, device="cuda")

    def step() -> None:
        model(x).pow(2).mean().backward()
        model.zero_grad(set_to_none=True)

    measurements = measure(model, step, candidates=["recompute", "int8", "batch4:recompute"], repeats=1)
    sliced, stock = measurements.by_policy["batch4:recompute"], measurements.by_policy["recompute"]
    assert all(s.backward_level < r.backward_level for s, r in zip(sliced.segments, stock.segments, strict=True))
    plan = measurements.plan(sliced.peak)
    plan.apply()
    try:
        step()
        measured_peak = peak_bytes(step, "cuda")
    finally:
        plan.remove()
    assert abs(plan.predicted_peak - measured_peak) <= 0.10 * measured_peak, (plan.policies, measured_peak)


class RefusingBlock(Block):
    """A block that raises `message` when `refuses(x)`, as a model that cannot take what a candidate (a slice
    of the batch, say, with batch-carrying side inputs) or the planner's checks give it."""

    def __init__(self, refuses, message: str) -> None:
        super().__init__()
        self.refuses, self.message = refuses, message

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.refuses(x):
            raise RuntimeError(self.message)
        return super().forward(x)


def test_a_candidate_that_fails_on_the_model_is_left_out_with_a_warning():
    model, step = make(layers=3)
    for i in range(3):
        model.blocks[i] = RefusingBlock(lambda x: x.shape[0] != 4, "this block needs the whole batch")
    with pytest.warns(UserWarning, match=r"candidate 'batch2:recompute' failed on this model, left out \(RuntimeError"):
        measurements = measure(model, step, candidates=["recompute", "batch2:recompute", "int8"], repeats=1)
    assert measurements.candidates == ["recompute", "int8"] and list(measurements.failed) == ["batch2:recompute"]
    assert "failed on this model, left out: RuntimeError: this block needs the whole batch" in measurements.table()
    assert all(p.grad is None for p in model.parameters())  # the broken step's partial gradients undone
    with pytest.raises(ValueError, match=r"\['batch2:recompute'\] left out: they failed on this model"):
        measurements.plan(1)
    for i in range(3):
        model.blocks[i] = Block()  # a model that fails under the reference too: its error is raised
    model.blocks[0].forward = lambda x: (_ for _ in ()).throw(RuntimeError("broken model"))
    with pytest.raises(RuntimeError, match="broken model"):
        measure(model, step, candidates=["recompute", "int8"], repeats=1)


class BatchNormBlock(Block):
    """Normalises over the batch in training: its samples are not independent."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__(dim)
        self.norm = nn.BatchNorm1d(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.norm(x.transpose(1, 2)).transpose(1, 2))


class TwoDropoutBlock(Block):
    """Two random ops per block: batch slices draw their masks in another order than the whole batch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(self.fc1(self.ln(x)), 0.2)
        return x + F.dropout(self.fc2(F.gelu(h)), 0.2)


def batchnorm_model():
    model, step = make(layers=3)
    torch.manual_seed(1)
    for i in range(3):
        model.blocks[i] = BatchNormBlock()
    return model, step


def test_batch_slices_of_blocks_that_mix_samples_are_left_out():
    model, step = batchnorm_model()
    with pytest.warns(UserWarning, match=r"'batch2:recompute' left out: segment 'blocks.0' mixes the samples"):
        measurements = measure(model, step, candidates=["recompute", "batch2:recompute"], repeats=1)
    assert measurements.candidates == ["recompute"] and "mixes the samples" in measurements.failed["batch2:recompute"]


def test_a_segment_the_sample_check_cannot_run_leaves_batch_slices_out():
    model, step = make(layers=2)
    for i in range(2):
        model.blocks[i] = RefusingBlock(lambda x: not torch.is_grad_enabled(), "runs with grad only")
    with pytest.warns(UserWarning, match=r"'batch2:recompute' left out: segment 'blocks.0' could not be run alone"):
        measurements = measure(model, step, candidates=["recompute", "batch2:recompute"], repeats=1)
    assert measurements.candidates == ["recompute"]


def test_the_sample_check_leaves_the_buffers_as_the_step_left_them():
    checked, step = batchnorm_model()
    twin, twin_step = batchnorm_model()
    segments = [Segment(f"blocks.{i}", checked.blocks, str(i), b) for i, b in enumerate(checked.blocks)]
    candidates = [parse_candidate("batch2:recompute"), parse_candidate("int8")]
    assert list(samples_mixed(segments, probe(segments, step), torch.device("cpu"), candidates)) == [2]
    twin_step()  # the probe ran one step, then the check its own forwards, whose running statistics it undid
    for b, t in zip(checked.blocks, twin.blocks, strict=True):
        torch.testing.assert_close(b.norm.running_mean, t.norm.running_mean, rtol=0, atol=0)
    assert samples_mixed(segments, probe(segments, lambda: None), torch.device("cpu"), candidates[:1]) == {}


def test_batch_slices_are_compared_with_the_same_slices_kept_exactly():
    model, step = make(layers=3)
    for i in range(3):
        model.blocks[i] = TwoDropoutBlock()
    measurements = measure(model, step, candidates=["recompute", "batch2:recompute", "batch2:int8"], max_error=5e-2)
    # Recomputing each slice replays its random draws: exact against the same slices stored plainly, though
    # the slices' masks differ from the whole batch's.
    assert measurements.by_policy["batch2:recompute"].grad_error < 1e-6
    assert 0 < measurements.by_policy["batch2:int8"].grad_error <= 1e-2
    assert measurements.candidates == ["recompute", "batch2:recompute", "batch2:int8"]


def test_extended_candidates_name_valid_distinct_candidates():
    names = extended_candidates(batch_slices=[2, 4])
    assert names[: len(DEFAULT_CANDIDATES)] == list(DEFAULT_CANDIDATES)
    assert len(set(names)) == len(names) and {"batch2:int8", "batch4:recompute:int8+int8"} <= set(names)
    assert [parse_candidate(n).name for n in names] == names  # each its own canonical name
    assert "selective-attention:int8" in names and "batch2:selective-attention:int8" in names
    assert extended_candidates() == [n for n in names if not n.startswith("batch")]
    with pytest.raises(ValueError, match="batch slice count must be an integer >= 2"):
        extended_candidates(batch_slices=[1])


def test_check_fn_chooses_the_segments():
    model, step = make(layers=2)
    measurements = measure(model, step, check_fn=lambda m: isinstance(m, Block), candidates=["recompute"], repeats=1)
    assert [s.name for s in measurements.segments] == ["blocks.0", "blocks.1"]
    assert measurements.candidates == ["recompute"]


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"model": "net"}, TypeError, "`model` must be a torch.nn.Module"),
        ({"step": 3}, TypeError, "`step` must be a callable"),
        (
            {"budget": "50"},
            ValueError,
            r"budget '50' is neither a percentage such as '50%'.* nor a device total such as '20GiB'",
        ),
        ({"budget": "abc%"}, ValueError, "is neither a percentage"),
        ({"budget": "-5%"}, ValueError, "is neither a percentage"),
        ({"budget": "20 gigs"}, ValueError, r"is neither a percentage.*units: B, KB, MB"),
        ({"budget": "0GiB"}, ValueError, "is neither a percentage"),
        ({"budget": -1}, ValueError, "must be a positive number of bytes"),
        ({"budget": 1.5}, TypeError, "must be bytes"),
        ({"budget": True}, TypeError, "must be bytes"),
        ({"candidates": ["int5"]}, ValueError, r"candidate 'int5'.*unknown token 'int5'.*or 'none'"),
        ({"candidates": ["selective:recompute"]}, ValueError, r"candidate 'selective:recompute'.*needs a codec"),
        ({"candidates": ["int8", "int8"]}, ValueError, "listed twice"),
        ({"candidates": ["batch0:int8"]}, ValueError, r"candidate 'batch0:int8'.*number of batch slices.*batch<N>"),
        ({"candidates": ["recompute", "recompute+"]}, ValueError, "unknown token ''"),
        ({"candidates": []}, ValueError, "`candidates` is empty"),
        ({"candidates": "int8"}, TypeError, "must be a list of policies"),
        ({"check_fn": lambda m: False}, ValueError, "selected no submodule"),
        ({"check_fn": 3}, TypeError, "`check_fn` must be callable"),
        ({"repeats": 0}, ValueError, "`repeats` must be an integer >= 1"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, message):
    model, step = make(layers=2)
    arguments = {"model": model, "step": step, "budget": "100%", **kwargs}
    with pytest.raises(error, match=message):
        fastckpt.plan(**arguments)


def test_models_the_planner_cannot_measure_are_refused():
    with pytest.raises(ValueError, match="no nn.ModuleList/nn.Sequential of two or more identical blocks"):
        fastckpt.plan(nn.Linear(4, 4), lambda: None, "100%")
    model, step = make(layers=2)
    fastckpt.apply(model, "recompute", check_fn=lambda m: isinstance(m, Block))
    with pytest.raises(ValueError, match="already wrapped by fastckpt"):
        fastckpt.plan(model, step, "100%", check_fn=lambda m: isinstance(m, CheckpointWrapper))

    model, _ = make(layers=2)
    x = torch.randn(2, 8, 64)

    def twice() -> None:
        model(model(x)).sum().backward()

    with pytest.raises(ValueError, match=r"each segment must run exactly once per step\(\)"):
        fastckpt.plan(model, twice, "100%", candidates=["recompute"])

    def forward_only() -> None:
        with torch.no_grad():
            model(x)

    with pytest.raises(ValueError, match="must run exactly once|no gradient reached"):
        fastckpt.plan(model, forward_only, "100%", candidates=[NONE])

    def no_backward() -> None:
        model(x)

    with pytest.raises(ValueError, match="no gradient reached the outputs of segments"):
        fastckpt.plan(model, no_backward, "100%", candidates=[NONE])
    assert all(isinstance(b, Block) for b in model.blocks)  # a failed measurement leaves the model as it was


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


def test_measurements_plan_every_budget_from_one_measurement(measured):
    measurements, _ = measured
    plans = [measurements.plan(b) for b in ("150%", "100%", "85%")]
    times = [p.predicted_seconds for p in plans]
    assert times == sorted(times), "a larger budget never gives a slower plan"
    assert all(isinstance(p, fastckpt.Plan) for p in plans)
    assert isinstance(measurements, Measurements) and "recompute" in measurements.table()
    with pytest.raises(ValueError, match="5 policies needed"):
        measurements.predict_peak(["int8"])
    with pytest.raises(ValueError, match=r"\['int2'\] not measured"):
        measurements.predict_peak(["int2"] * 5)


def test_memory_trace_counts_what_the_step_allocates():
    older = torch.empty(2**20)

    def step() -> None:
        nonlocal older
        a = torch.empty(2**20)  # 4 MiB
        b = torch.empty(2**21)  # 8 MiB
        del a, b
        older = None  # a block from before the trace: its free is not credited

    assert peak_bytes(step) == 12 * 2**20
    with MemoryTrace("cpu") as trace:
        trace.mark("a")
        kept = torch.empty(2**20)
        trace.mark("b")
        temp = torch.empty(2**21)
        del temp
        trace.mark("c")
    assert [(p.key, p.live, p.peak_before) for p in trace.points] == [
        ("a", 0, 0),
        ("b", 4 * 2**20, 4 * 2**20),
        ("c", 4 * 2**20, 12 * 2**20),
        ("end", 4 * 2**20, 4 * 2**20),
    ]
    assert trace.peak == 12 * 2**20 and kept.numel() == 2**20
    # lifetimes: (marks before the allocation, marks before the free or None, bytes, address)
    assert sorted(life[:3] for life in trace.lifetimes) == [(1, None, 4 * 2**20), (2, 2, 8 * 2**20)]
    # at_peak: the blocks live at the highest instant (temp's allocation), as (marks before, bytes)
    assert sorted(block[:2] for block in trace.at_peak) == [(1, 4 * 2**20), (2, 8 * 2**20)]
    with pytest.raises(ValueError, match="measures cpu and cuda devices, not 'meta'"):
        MemoryTrace("meta")


def test_segment_times_take_the_fastest_run_and_pool_identical_blocks():
    blocks = [Block(), Block(), Block(), nn.Linear(64, 64)]
    segments = [Segment(str(i), nn.Module(), str(i), b) for i, b in enumerate(blocks)]
    runs = [
        [1.0, 9.0, 1.2, 5.0, 0.0],  # the second block was slowed by another process in this run
        [1.1, 1.0, 3.0, 4.0, 0.0],
    ]
    # fastest runs: 1.0, 1.0, 1.2 for the identical blocks (median 1.0), 4.0 for the Linear of its own kind
    assert segment_seconds(segments, [["p"] * 4] * 2, runs) == {"p": [1.0, 1.0, 1.0, 4.0]}
    # mixed runs: each candidate's time from the segments of the kind that ran it, fastest per segment first
    mixed = segment_seconds(segments, [["p", "q", "p", "q"], ["q", "p", "q", "p"]], runs)
    # q ran blocks 1 (9.0, slowed), 0 (1.1) and 2 (3.0): the slow one moves its median to 3.0, not its mean to 4.4
    assert mixed == {"p": [1.0, 1.0, 1.0, 4.0], "q": [3.0, 3.0, 3.0, 5.0]}


@pytest.mark.parametrize("repeats", [1, 2, 3])
def test_timing_rounds_run_every_candidate_on_repeats_segments_of_each_kind(repeats):
    blocks = [Block(), nn.Linear(64, 64), Block(), Block(), nn.Linear(64, 64), Block(), Block()]
    segments = [Segment(str(i), nn.Module(), str(i), b) for i, b in enumerate(blocks)]
    candidates = [parse_candidate(name) for name in ["none", "recompute", "int8", "int4", "recompute+int8"]]
    rounds = timing_rounds(segments, candidates, repeats)
    # the Linear kind has 2 segments: ceil(repeats x 5 / 2) runs, instead of repeats x 5 uniform ones
    assert len(rounds) == -(-repeats * 5 // 2)
    for kind in ([0, 2, 3, 5, 6], [1, 4]):
        for candidate in candidates:
            runs_on_kind = sum(assignment[i] == candidate for assignment in rounds for i in kind)
            assert runs_on_kind >= repeats
    one_kind = [Segment(str(i), nn.Module(), str(i), Block()) for i in range(8)]
    assert len(timing_rounds(one_kind, candidates, repeats)) == -(-repeats * 5 // 8)


# ---- max_error: candidates whose measured gradient error exceeds it are left out ----


def test_max_error_leaves_out_the_candidates_above_it():
    model, step = make(layers=3)
    measurements = measure(model, step, candidates=[NONE, "recompute", "int8", "int4"], repeats=1, max_error=1.0)
    errors = {name: m.grad_error for name, m in measurements.by_policy.items()}
    assert errors[NONE] == 0 and errors["recompute"] == 0  # exact policies, same seed
    assert 0 < errors["int8"] < errors["int4"]
    bound = (errors["int8"] + errors["int4"]) / 2
    bounded = measure(model, step, candidates=[NONE, "recompute", "int8", "int4"], repeats=1, max_error=bound)
    assert bounded.candidates == [NONE, "recompute", "int8"] and bounded.excluded == ["int4"]
    for budget in ("100%", bounded.smallest_feasible_budget()):
        assert "int4" not in bounded.plan(budget).policies
    assert "left out: > max_error" in bounded.table()
    with pytest.raises(ValueError, match=r"\['int4'\] left out: their gradient error exceeds max_error"):
        bounded.plan(1)


def test_max_error_measures_with_the_same_dropout_masks():
    torch.manual_seed(0)
    blocks = nn.ModuleList(
        nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.5), nn.Linear(256, 64)) for _ in range(3)
    )
    x = torch.randn(4, 128, 64)

    def step() -> None:
        h = x
        for block in blocks:
            h = block(h)
        h.pow(2).mean().backward()
        blocks.zero_grad(set_to_none=True)

    measurements = measure(blocks, step, candidates=[NONE, "recompute", "int8"], repeats=1, max_error=0.05)
    assert measurements.by_policy["recompute"].grad_error == 0  # not the masks of another draw
    assert 0 < measurements.by_policy["int8"].grad_error <= 0.05


@pytest.mark.parametrize("max_error", [-0.1, "5%", True])
def test_bad_max_error_is_named(max_error):
    model, step = make(layers=2)
    with pytest.raises(ValueError, match="max_error"):
        fastckpt.plan(model, step, "100%", max_error=max_error)


# ---- non-finite gradients: a candidate whose storage breaks the gradients is never kept ----


@pytest.fixture
def int8_decodes_nan(monkeypatch):
    """A broken int8 storage: every tensor it gives back holds a NaN (as the codecs' decoding of a group holding
    an infinity once did)."""
    decode = codecs.decode

    def broken(encoded):
        tensor = decode(encoded)
        if encoded.codec == "int8":
            tensor = tensor.clone()
            tensor.view(-1)[0] = math.nan
        return tensor

    monkeypatch.setattr(codecs, "decode", broken)


class HeadFirstNet(nn.Module):
    """The head's parameters come first: their gradient is exact under any storage, so an error measure that
    loses a later NaN reports 0 for the whole model."""

    def __init__(self, block: type[nn.Module], layers: int = 3, dim: int = 64) -> None:
        super().__init__()
        self.head = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(block(dim) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_head_first(block: type[nn.Module]):
    return make(net=lambda: HeadFirstNet(block))


NAN_FROM_INT8 = (
    r"candidate 'int8' gives NaN/inf gradients from segment 'blocks.2' on .* where the plain step's are finite"
)


@pytest.mark.parametrize("max_error", [None, 0.5])
def test_a_candidate_whose_stored_form_gives_nan_gradients_is_never_kept(max_error, int8_decodes_nan):
    model, step = make_head_first(Block)
    with pytest.warns(UserWarning, match=NAN_FROM_INT8):
        measurements = measure(model, step, candidates=["recompute", "int8"], repeats=1, max_error=max_error)
    assert measurements.candidates == ["recompute"] and list(measurements.failed) == ["int8"]
    assert all(policy == "recompute" for policy in measurements.plan("100%").policies)
    with pytest.warns(UserWarning, match=NAN_FROM_INT8):
        alone = measure(model, step, candidates=["int8"], repeats=1, max_error=max_error)
    with pytest.raises(ValueError, match=NAN_FROM_INT8):  # nothing is left: the error says why int8 is out
        alone.plan("100%")


def test_the_reference_giving_nan_gradients_refuses_the_plan(monkeypatch, int8_decodes_nan):
    model, step = make_head_first(Block)
    wrap, int8 = Candidate.wrap, parse_candidate("int8")
    monkeypatch.setattr(Candidate, "wrap", lambda self, module: wrap(int8 if self.name == REFERENCE else self, module))
    with pytest.raises(RuntimeError, match="candidate 'recompute' gives NaN/inf gradients from segment 'blocks.2'"):
        fastckpt.plan(model, step, "100%", candidates=[NONE, "recompute"])


def test_a_nan_gradient_error_exceeds_max_error_wherever_it_is():
    finite, nan = torch.ones(3), torch.tensor([1.0, math.nan, 1.0])
    assert max_relative_error([finite, nan], [finite, finite]) == math.inf  # a NaN after a finite error counts
    assert max_relative_error([nan, finite], [finite, finite]) == math.inf
    assert max_relative_error([finite * math.inf], [finite]) == math.inf
    measurements = synthetic(2, ["a", "b", "c", "recompute"], seed=0, unit=4099)
    measurements["a"].grad_error, measurements["b"].grad_error = math.nan, math.inf
    measurements["c"].grad_error = measurements["recompute"].grad_error = 0.0
    kept = Measurements(nn.Linear(1, 1), [], ["a", "b", "c", "recompute"], measurements, max_error=1.0)
    assert kept.candidates == ["c", "recompute"] and kept.excluded == ["a", "b"]


class NaNBlock(Block):
    """Plain autograd's own gradients are NaN here (sqrt's backward at 0, times 0)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + (self.fc2(F.gelu(self.fc1(x))) * 0).abs().sqrt()


def test_gradient_error_against_a_non_finite_reference_is_refused():
    model, step = make_head_first(NaNBlock)
    measurements = measure(model, step, candidates=["recompute", "int8"], repeats=1)
    assert measurements.candidates == ["recompute", "int8"]  # NaN already without checkpointing: not int8's doing
    with pytest.raises(ValueError, match=r"max_error: the gradients under 'none' \(the reference\) hold NaN/inf"):
        measure(model, step, candidates=["recompute", "int8"], repeats=1, max_error=0.5)
