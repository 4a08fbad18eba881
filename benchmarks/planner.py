"""`python -m benchmarks.planner [--device cpu|cuda] [--out DIR] [--quick] [--variants]`: fastckpt.plan against
stock checkpoint.

Also a section of `python -m benchmarks` (`--workloads planner` runs it alone, `--workloads planner-all` with
the variants), which appends its table to that run's results.md.

The workload: the long-context stack (8 pre-LN GPT-2-style blocks, hidden 128, 2 heads of 64, batch 2 x 2048
tokens, attention through the fused SDPA kernel); with `variants` (about three times as long in all), also that
stack planned per attention / MLP half ('long-context sublayers'), with its MLP halves tiled ('long-context
tiled'), and the GPT-2 stack of benchmarks/workloads.py ('gpt2'). For each, the planner measures its
candidates once (fastckpt.planner.measure, max_error=5e-2: candidates whose gradient error exceeds the target
are left out; the default candidates, DEFAULT_CANDIDATES: the whole-segment policies, the fused attention's
output kept int8, 'selective-attention:...', and batch slices 'batch2:<policy>'; GPT-2, whose batch is 4, also
'batch4:...'), then plans for budgets of 100%, 70%, 50% and 30% of stock torch.utils.checkpoint's peak measured here
(benchmarks.harness.peak_bytes). Each feasible plan is applied and measured like the baselines: peak
(harness.peak_bytes), median step time in interleaved rounds (harness.median_times), gradient error
against plain training from the same seed (largest relative L2 over the parameters, and over all
gradients at once). An infeasible budget's row says the smallest budget the planner found feasible.

Targets (reported, not asserted): at 50% of stock's peak the plan fits (measured peak <= the budget and
>= 0.95 x it) at <= 1.05 x stock's time with gradient error <= 5e-2; at 100%, <= 0.85 x stock's time; the
predicted peak within 3% of the measured one (before the planner's own verification).
"""

from __future__ import annotations

import argparse
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import fastckpt
from benchmarks.checkpoint import max_rel_l2
from benchmarks.harness import median_times, peak_bytes, quiet_profiler_logs, write_csv
from benchmarks.report import fmt, missing
from benchmarks.workloads import GPT2Block, GPT2Stack, StackShape, Workload, workloads
from fastckpt.planner import DEFAULT_CANDIDATES, Measurements, extended_candidates, measure

BUDGETS = (1.0, 0.7, 0.5, 0.3)  # fractions of stock checkpoint's measured peak
# The planner's defaults (None): the whole-segment policies, the fused attention's output kept int8 instead of
# recomputing the attention kernel (fastckpt.hybrid), and a segment on its batch in two slices
# (fastckpt.tiled(segment, 2, dim=0, policy)); the gradient-error bound checks the result.
CANDIDATES = None
# The GPT-2 stack's batch is 4: it may also run in four slices.
GPT2_CANDIDATES = tuple(extended_candidates(batch_slices=[2, 4]))
TARGETS = {"fit": 0.05, "half_time": 1.05, "half_error": 5e-2, "full_time": 0.85, "prediction": 0.03}

LONG_CONTEXT = {
    "full": StackShape(layers=8, dim=128, heads=2, batch=2, seq=2048),
    "quick": StackShape(layers=4, dim=128, heads=2, batch=2, seq=1024),
    "smoke": StackShape(layers=3, dim=32, heads=2, batch=1, seq=256),
}
# (timed samples per candidate and kind of block while measuring: measure's repeats, interleaved rounds timing
# the plans) per size
RUNS = {"full": (3, 3), "quick": (1, 2), "smoke": (1, 1)}


TILED_CHUNKS, TILED_POLICY = 8, "recompute+int8"  # the MLP halves of the 'long-context tiled' variant


def long_context(shape: StackShape, sublayers: bool = False, tiled: bool = False) -> Workload:
    """The issue's long-context stack: GPT-2-style blocks, attention dropout 0 so SDPA runs fused. With
    `sublayers`, the planner's segments are each block's attention and MLP halves (check_fn=is_sublayer).
    With `tiled`, each MLP half runs as fastckpt.tiled(half, TILED_CHUNKS, policy=TILED_POLICY) (position-wise:
    norm, MLP and residual treat every token alone) and the planner's segments are the attention halves
    (check_fn=is_attention_half); stock checkpointing still runs whole blocks."""

    def inputs(device: torch.device) -> tuple:
        generator = torch.Generator().manual_seed(1)
        return (torch.randn(shape.batch, shape.seq, shape.dim, generator=generator).to(device).requires_grad_(True),)

    def build(device: torch.device) -> nn.Module:
        if not (sublayers or tiled):
            return GPT2Stack(shape, attn_dropout=0.0).to(device)
        stack = SublayerStack(shape, attn_dropout=0.0)
        if tiled:
            for i, half in enumerate(stack.sublayers):
                if half.part == "mlp":
                    stack.sublayers[i] = fastckpt.tiled(half, TILED_CHUNKS, policy=TILED_POLICY)
        return stack.to(device)

    name, note = "long-context", ""
    if tiled:
        name, note = (
            "long-context tiled",
            f"; MLP halves tiled x{TILED_CHUNKS} ({TILED_POLICY}), attention halves planned",
        )
    elif sublayers:
        name, note = "long-context sublayers", "; planned per attention / MLP half"
    return Workload(
        name,
        f"GPT-2-style blocks, {shape} (head dim {shape.dim // shape.heads}), dropout 0.1, attention 0 (fused SDPA)"
        + note,
        build,
        inputs,
        lambda model, inputs: model(*inputs).float().pow(2).mean(),
    )


class Sublayer(nn.Module):
    """One residual half of a GPT2Block: x + attention(ln1(x)), or x + mlp(ln2(x))."""

    def __init__(self, block: GPT2Block, part: str) -> None:
        super().__init__()
        self.part = part
        if part == "attention":
            self.norm, self.attn = block.ln1, block.attn
        else:
            self.norm, self.mlp = block.ln2, block.mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        if self.part == "attention":
            return x + self.attn(h, h, h, need_weights=False, is_causal=False)[0]
        return x + self.mlp(h)


class SublayerStack(GPT2Stack):
    """GPT2Stack whose blocks run as their two residual halves (`sublayers`, the same weights), so the planner
    can give attention and MLP each its own policy; `segment`, when set, still checkpoints whole blocks (the
    stock baseline is the same as on the block-segmented stack)."""

    def __init__(self, shape: StackShape, attn_dropout: float = 0.1) -> None:
        super().__init__(shape, attn_dropout)
        self.sublayers = nn.ModuleList(Sublayer(b, part) for b in self.blocks for part in ("attention", "mlp"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.segment is not None:
            return super().forward(x)
        for sublayer in self.sublayers:
            x = sublayer(x)
        return x


def is_sublayer(module: nn.Module) -> bool:
    """check_fn of the sublayer-segmented long-context stack."""
    return isinstance(module, Sublayer)


def is_attention_half(module: nn.Module) -> bool:
    """check_fn of the tiled long-context stack (its MLP halves are tiled, not planned)."""
    return isinstance(module, Sublayer) and module.part == "attention"


@dataclass
class Row:
    """One configuration of one workload: a baseline, a plan, or an infeasible budget."""

    name: str
    step: Callable[[], None] | None = None
    budget: int | None = None
    policies: list[str] | None = None
    predicted_peak: int | None = None
    predicted_seconds: float | None = None
    note: str = ""


def _step(workload: Workload, model: torch.nn.Module, inputs: tuple, sink: list[list]) -> Callable[[], None]:
    """One forward and backward; gradients dropped after (as a training step's zero_grad would), copied to
    sink[-1] first while `sink` is not empty."""
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    parameters = list(model.parameters())

    def step() -> None:
        workload.loss(model, inputs).backward()
        if sink:
            sink[-1].extend(None if p.grad is None else p.grad.detach().clone() for p in parameters)
        model.zero_grad(set_to_none=True)
        for t in leaves:
            t.grad = None

    return step


def _with_segment(model: torch.nn.Module, segment: Callable | None, step: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        model.segment = segment
        try:
            step()
        finally:
            model.segment = None

    return run


def _with_plan(plan: fastckpt.Plan, step: Callable[[], None]) -> Callable[[], None]:
    # Applied around each call: every configuration shares the one model, so rounds can interleave them.
    def run() -> None:
        plan.apply()
        try:
            step()
        finally:
            plan.remove()

    return run


def _gradients(run: Callable[[], None], sink: list[list]) -> list:
    """Parameter gradients of one step from a fixed seed (same dropout masks for every configuration)."""
    sink.append([])
    torch.manual_seed(1234)
    try:
        run()
    finally:
        grads = sink.pop()
    return grads


def _overall_rel_l2(grads: list, reference: list) -> float:
    pairs = [(g, r) for g, r in zip(grads, reference, strict=True) if g is not None and r is not None]
    num = sum(((g - r).float().norm() ** 2).item() for g, r in pairs)
    den = sum((r.float().norm() ** 2).item() for _, r in pairs)
    return (num / den) ** 0.5 if den else 0.0


def _summary(policies: list[str]) -> str:
    """'3 x int8, recompute' style: each policy once with its count, in first-use order."""
    counts = Counter(policies)
    return ", ".join(f"{counts[p]} x {p}" if counts[p] > 1 else p for p in dict.fromkeys(policies))


def _plan_rows(measurements: Measurements, step: Callable[[], None], stock_peak: int) -> list[Row]:
    """A row per budget (a fraction of the stock peak): its plan's step, or why no plan fits it."""
    rows = []
    for fraction in BUDGETS:
        budget = int(fraction * stock_peak)
        name = f"plan {fraction:.0%}"
        try:
            plan = measurements.plan(budget)
        except ValueError:
            smallest = measurements.smallest_feasible_budget()
            rows.append(
                Row(
                    name,
                    budget=budget,
                    note=f"infeasible: smallest feasible {smallest / 2**20:.1f} MiB ({smallest / stock_peak:.0%})",
                )
            )
            continue
        rows.append(
            Row(
                name,
                _with_plan(plan, step),
                budget=budget,
                policies=plan.policies,
                predicted_peak=plan.predicted_peak,
                predicted_seconds=plan.predicted_seconds,
            )
        )
    return rows


def run_workload(
    workload: Workload,
    device: torch.device,
    candidates: list[str] | None,
    repeats: int,
    rounds: int,
    check_fn: Callable[[nn.Module], bool] | None = None,
) -> tuple[list[dict], Measurements]:
    """Measure, plan every budget, and measure the plans and the baselines on one workload (segments: those
    `check_fn` selects, default the planner's)."""
    model = workload.model(device)
    inputs = workload.inputs(device)
    sink: list[list] = []
    step = _step(workload, model, inputs, sink)
    stock_segment = lambda block, x: torch_checkpoint.checkpoint(block, x, use_reentrant=False)  # noqa: E731
    stock = _with_segment(model, stock_segment, step)
    step()  # warm-up before the stock peak: gradients and lazy initialisation
    stock_peak = peak_bytes(stock, device)

    start = time.perf_counter()
    with quiet_profiler_logs():
        measurements = measure(
            model, step, check_fn=check_fn, candidates=candidates, repeats=repeats, max_error=TARGETS["half_error"]
        )
    measure_seconds = time.perf_counter() - start

    rows = [Row("plain", step), Row("stock checkpoint", stock), *_plan_rows(measurements, step, stock_peak)]

    runnable = {r.name: r.step for r in rows if r.step is not None}
    times, failed = _median_times(runnable, device, rounds)
    if failed:
        raise RuntimeError(f"{workload.name}: {failed}")
    peaks = {name: peak_bytes(run, device) for name, run in runnable.items()}
    reference = _gradients(step, sink)
    out = []
    for r in rows:
        result = {
            "workload": workload.name,
            "config": r.name,
            "budget_MiB": r.budget / 2**20 if r.budget else float("nan"),
            "policies": _summary(r.policies) if r.policies else r.note,
            "peak_MiB": float("nan"),
            "predicted_MiB": r.predicted_peak / 2**20 if r.predicted_peak else float("nan"),
            "prediction_error": float("nan"),
            "peak_x_stock": float("nan"),
            "peak_x_budget": float("nan"),
            "ms": float("nan"),
            "predicted_ms": r.predicted_seconds * 1e3 if r.predicted_seconds else float("nan"),
            "x_stock": float("nan"),
            "x_plain": float("nan"),
            "grad_rel_l2_max": float("nan"),
            "grad_rel_l2_all": float("nan"),
        }
        if r.step is not None:
            grads = _gradients(r.step, sink)
            peak = peaks[r.name]
            result.update(
                peak_MiB=peak / 2**20,
                peak_x_stock=peak / stock_peak,
                ms=times[r.name] * 1e3,
                x_stock=times[r.name] / times["stock checkpoint"],
                x_plain=times[r.name] / times["plain"],
                grad_rel_l2_max=max_rel_l2(grads, reference),
                grad_rel_l2_all=_overall_rel_l2(grads, reference),
            )
            if r.budget:
                result.update(peak_x_budget=peak / r.budget)
            if r.predicted_peak:
                result.update(prediction_error=(r.predicted_peak - peak) / peak)
        out.append(result)
    out[0]["measure_s"] = measure_seconds
    return out, measurements


def _median_times(steps: dict, device: torch.device, rounds: int) -> tuple[dict, dict]:
    result = median_times(steps, device, 1, rounds)
    return result if isinstance(result, tuple) else (result, {})


def _print(workload: Workload, rows: list[dict], measurements: Measurements, measure_seconds: float) -> None:
    print(f"\n{workload.name}: {workload.description}")
    print(f"planner: {len(measurements.by_policy)} candidates measured in {measure_seconds:.1f} s")
    print(measurements.table())
    header = (
        f"{'config':<18}{'budget':>8}{'peak':>8}{'pred':>8}{'pred err':>9}{'x stock':>8}{'x budget':>9}"
        f"{'ms':>9}{'pred ms':>9}{'x stock':>8}{'x plain':>8}{'grad max':>10}{'grad all':>10}  policies"
    )
    print("MiB: budget, peak, pred; time: ms, x stock, x plain")
    print(header)
    columns = [("budget_MiB", 8, ".1f"), ("peak_MiB", 8, ".1f"), ("predicted_MiB", 8, ".1f"),
               ("prediction_error", 9, "+.3f"), ("peak_x_stock", 8, ".3f"), ("peak_x_budget", 9, ".3f"),
               ("ms", 9, ".1f"), ("predicted_ms", 9, ".1f"), ("x_stock", 8, ".3f"), ("x_plain", 8, ".3f"),
               ("grad_rel_l2_max", 10, ".2e"), ("grad_rel_l2_all", 10, ".2e")]  # fmt: skip
    for r in rows:  # blanks where a value does not apply (an infeasible budget's row)
        cells = "".join(f"{fmt(r[key], spec):>{width}}" for key, width, spec in columns)
        print(f"{r['config']:<18}{cells}  {r['policies']}")


def _targets(rows: list[dict]) -> list[str]:
    """The issue's targets, each met or not, for one workload's rows."""
    by_name = {r["config"]: r for r in rows}
    lines = []
    half, full = by_name.get("plan 50%"), by_name.get("plan 100%")
    if half and half["ms"] == half["ms"]:  # not NaN: the plan was feasible
        fits = 1 - TARGETS["fit"] <= half["peak_x_budget"] <= 1  # within the budget, and using it
        fast = half["x_stock"] <= TARGETS["half_time"]
        exact = half["grad_rel_l2_max"] <= TARGETS["half_error"]
        lines.append(
            f"50%: peak {half['peak_x_budget']:.3f} x budget ({'met' if fits else 'NOT met'}), time "
            f"{half['x_stock']:.3f} x stock ({'met' if fast else 'NOT met'}), grad {half['grad_rel_l2_max']:.1e} "
            f"({'met' if exact else 'NOT met'})"
        )
    elif half:
        lines.append(f"50%: NOT met ({half['policies']})")
    if full and full["ms"] == full["ms"]:
        fast = full["x_stock"] <= TARGETS["full_time"]
        lines.append(f"100%: time {full['x_stock']:.3f} x stock ({'met' if fast else 'NOT met'})")
    errors = [abs(r["prediction_error"]) for r in rows if r["prediction_error"] == r["prediction_error"]]
    if errors:
        worst = max(errors)
        lines.append(f"prediction: worst error {worst:.1%} ({'met' if worst <= TARGETS['prediction'] else 'NOT met'})")
    return lines


def markdown(rows: list[dict]) -> str:
    """The rows as a Markdown table, each workload's target lines after it."""
    lines = [
        "| workload | config | budget MiB | peak MiB (predicted) | x budget | x stock time | x plain time | grad "
        "relL2 | policies |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    by_workload: dict[str, list[dict]] = {}
    for r in rows:
        by_workload.setdefault(r["workload"], []).append(r)
        predicted = f" ({fmt(r['predicted_MiB'], '.1f')})" if not missing(r["predicted_MiB"]) else ""
        lines.append(
            f"| {r['workload']} | {r['config']} | {fmt(r['budget_MiB'], '.1f')} | {fmt(r['peak_MiB'], '.1f')}"
            f"{predicted} | {fmt(r['peak_x_budget'], '.3f')} | {fmt(r['x_stock'], '.3f')} | "
            f"{fmt(r['x_plain'], '.3f')} | {fmt(r['grad_rel_l2_max'], '.1e')} | {r['policies']} |"
        )
    for name, workload_rows in by_workload.items():
        lines += [""] + [f"- {name}: target {line}" for line in _targets(workload_rows)]
    return "\n".join(lines)


def main(
    device: str = "cpu",
    out: str | None = None,
    quick: bool = False,
    smoke: bool = False,
    results_md: str | None = None,
    variants: bool = False,
) -> list[dict]:
    """Plan and measure the workloads (with `variants`, the long-context stack's other two segmentations too) at
    every budget; print the tables, write CSV to `out` and append the table to the Markdown file `results_md`
    (created if missing) when given."""
    dev = torch.device(device)
    size = "smoke" if smoke else "quick" if quick else "full"
    shape = LONG_CONTEXT[size]
    chosen = [(long_context(shape), None, CANDIDATES)]
    if variants:
        chosen += [
            (long_context(shape, True), is_sublayer, CANDIDATES),
            (long_context(shape, tiled=True), is_attention_half, CANDIDATES),
            (workloads(dev, size)["gpt2"], None, GPT2_CANDIDATES),
        ]
    repeats, rounds = RUNS[size]
    threads = torch.get_num_threads() if dev.type == "cpu" else None
    print(f"fastckpt {fastckpt.__version__} planner, torch {torch.__version__} on {device}", end="")
    print(f" ({threads} threads)" if threads else f" ({torch.cuda.get_device_name(dev)})")
    print(f"candidates: the defaults, {', '.join(DEFAULT_CANDIDATES)} (GPT-2, batch 4: also batch4:...)")
    print(f"{repeats} timed sample(s) per candidate and kind of block, plans timed over {rounds} interleaved rounds;")
    print("budgets are fractions of stock torch.utils.checkpoint's measured peak")
    every = []
    for workload, check_fn, candidates in chosen:
        start = time.perf_counter()
        rows, measurements = run_workload(workload, dev, candidates and list(candidates), repeats, rounds, check_fn)
        _print(workload, rows, measurements, rows[0]["measure_s"])
        print(f"({workload.name}: {time.perf_counter() - start:.0f} s in all)")
        for line in _targets(rows):
            print(f"  target {line}")
        every += rows
    if out:
        for row in every:
            row.setdefault("measure_s", float("nan"))
        write_csv(every, out, f"planner_{dev.type}.csv")
    if results_md:
        start = "" if os.path.exists(results_md) else "# fastckpt benchmark\n"
        with open(results_md, "a") as f:
            f.write(
                f"{start}\n## planner: fastckpt.plan at fractions of stock checkpoint's peak\n\n{markdown(every)}\n"
            )
    return every


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.planner", description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--out", default=None, help="folder for planner_<device>.csv")
    parser.add_argument("--quick", action="store_true", help="smaller long-context stack, fewer runs")
    parser.add_argument("--variants", action="store_true", help="also the sublayer and tiled stacks and GPT-2")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is visible")
    return args


if __name__ == "__main__":
    arguments = parse_args()
    main(arguments.device, arguments.out, arguments.quick, variants=arguments.variants)
