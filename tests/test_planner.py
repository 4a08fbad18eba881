"""fastckpt.plan: segments, measurement (the memory trace, segment times, timing rounds), the peak model against
measured peaks, verifying runs, apply, and argument errors; and the helpers the other planner tests import
(Block, Net, make, CANDIDATES, RefusingBlock, recorded_bars)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fastckpt
from fastckpt import CheckpointWrapper
from fastckpt.memory import MemoryTrace, peak_bytes
from fastckpt.planner import DEFAULT_CANDIDATES, NONE, Measurements, Segment, measure, parse_candidate
from fastckpt.planner.measurement import segment_seconds, timing_rounds


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
