"""The main benchmark: fastckpt's policies next to every alternative a user has today, on four workloads.

Rows (configurations), all measured in the same process on the same weights and batch:
plain (no checkpointing); torch.utils.checkpoint non-reentrant and reentrant; torch selective activation
checkpointing (matmul, convolution and attention outputs saved, the rest recomputed); torch
`save_on_cpu` around plain training (every saved tensor copied to host memory); DeepSpeed's
`deepspeed.checkpointing.checkpoint` when installed; then fastckpt's policies. More rows (a planner's,
say) come from the providers in `EXTRA_ROWS`.

Per workload, every configuration first runs one trial step (a failure there is reported as a FAILED row
and the others go on), then warm-up steps, then rounds in which the configurations take turns (so drift
hits all alike): the step time is the median over the rounds. Last, one step from a fixed seed under
`fastckpt.track()` and the memory measurement gives the peak memory, the stored bits per saved element
and the parameter gradients, compared with plain's (largest relative L2 error over the parameters).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import gc
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.utils.checkpoint as torch_checkpoint

import fastckpt
from benchmarks import report
from benchmarks.harness import error_line, median_times, peak_bytes, synchronize, write_csv
from benchmarks.workloads import WORKLOAD_NAMES, Workload, copy_model, transformers_missing, workloads
from fastckpt import hybrid
from fastckpt.planner import max_relative_error as max_rel_l2  # one measure for the planner and the tables

STOCK = "torch non-reentrant"
STOCK_REENTRANT = "torch reentrant"
# (warm-up steps after the trial step, timed rounds) per size; sized with the shapes in workloads.py.
ROUNDS = {"full": (1, 5), "quick": (0, 3), "smoke": (0, 1)}
DEFAULT_OUT = "bench-results"


@dataclass(frozen=True)
class Config:
    """One row. `checkpoint(fn, *args)` runs each segment (torch.utils.checkpoint's signature; None runs
    the segments plainly); `context()`, when given, is entered around forward and backward; `compile`, when
    given, compiles the loss function (e.g. torch.compile) once per row."""

    name: str
    checkpoint: Callable | None
    stock: str | None = STOCK  # the stock row its 'x stock' columns compare with
    family: str = "fastckpt"  # plot colour: plain, torch, deepspeed, fastckpt, or any other name
    policy: str | None = None  # a fastckpt policy (the HF workload enables it through integrations.hf)
    use_reentrant: bool = False
    context: Callable[[], contextlib.AbstractContextManager] | None = None
    compile: Callable[[Callable], Callable] | None = None


@dataclass(frozen=True)
class Skipped:
    """A row that cannot run here (its package is missing), with the reason."""

    name: str
    reason: str


# Providers of more rows: each is called with (workload, device) and returns Configs (or Skipped).
EXTRA_ROWS: list[Callable[[Workload, torch.device], list[Config | Skipped]]] = []


def _fastckpt(policy: str, use_reentrant: bool = False, stock: str = STOCK) -> Config:
    name = f"fastckpt {policy}" + (" reentrant" if use_reentrant else "")
    function = functools.partial(fastckpt.checkpoint, policy=policy, use_reentrant=use_reentrant)
    return Config(name, function, stock, "fastckpt", policy, use_reentrant)


def _fastckpt_selective(store: str) -> Config | Skipped:
    """fastckpt.hybrid.selective: torch's selective checkpointing (same ops as its row) with the saved
    outputs kept through `store`, the rest recomputed."""
    if not hybrid._sac_honours_hooks():
        return Skipped(f"fastckpt selective:{store}", f"torch {torch.__version__}'s SAC bypasses saved-tensor hooks")
    context_fn = hybrid.selective(_selective_ops(), store=store)
    return Config(f"fastckpt {context_fn}", functools.partial(fastckpt.checkpoint, context_fn=context_fn))


def _fastckpt_keep_attention(store: str) -> Config:
    """fastckpt.hybrid.keep_attention: the fused attention's outputs kept through `store` and dropout's masks
    kept (watched inside those calls only), the rest recomputed; the inputs kept plain, as stock."""
    context_fn = hybrid.keep_attention(store)
    return Config(f"fastckpt keep_attention:{store}", functools.partial(fastckpt.checkpoint, context_fn=context_fn))


def _selective_ops() -> list:
    """What torch SAC saves here: the outputs of matmuls, convolutions and fused attention (the same ops as
    fastckpt.hybrid.selective's default)."""
    return [packet.default for packet in hybrid.default_save_ops()]


def _selective_context():
    return torch_checkpoint.create_selective_checkpoint_contexts(_selective_ops())


def _deepspeed(device: torch.device) -> Config | Skipped:
    name = "deepspeed"
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # else DeepSpeed looks for a GPU accelerator
    try:
        from deepspeed import checkpointing  # `import deepspeed.checkpointing` fails: it is an attribute
    except ImportError as err:
        return Skipped(name, f"deepspeed not importable ({error_line(err)})")
    # Unconfigured (no partitioning, no CPU checkpointing, no mpu): its reentrant CheckpointFunction;
    # it needs no torch.distributed process group for that.
    return Config(name, checkpointing.checkpoint, STOCK, "deepspeed")


def configs(device: torch.device, workload: Workload | None = None) -> list[Config | Skipped]:
    """The rows measured on `device`: peers first, then fastckpt's policies, then EXTRA_ROWS' rows."""
    rows: list[Config | Skipped] = [
        Config("plain", None, None, "plain"),
        Config(STOCK, functools.partial(torch_checkpoint.checkpoint, use_reentrant=False), None, "torch"),
        Config(STOCK_REENTRANT, functools.partial(torch_checkpoint.checkpoint, use_reentrant=True), None, "torch"),
        Config(
            "torch selective",
            functools.partial(torch_checkpoint.checkpoint, use_reentrant=False, context_fn=_selective_context),
            family="torch",
        ),
        Config(
            "torch save_on_cpu",
            None,
            family="torch",
            context=lambda: torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda"),
        ),
        _deepspeed(device),
        _fastckpt("recompute"),
        _fastckpt("recompute", use_reentrant=True, stock=STOCK_REENTRANT),
    ]
    policies = ["int8", "fp8", "int4", "int2", "recompute+int8", "recompute:int8"]
    if device.type == "cuda":
        policies += ["offload", "int4+offload", "recompute+offload"]
    rows += [_fastckpt(p) for p in policies]
    rows.append(_fastckpt_selective("int8"))
    rows.append(_fastckpt_keep_attention("int8"))
    for provider in EXTRA_ROWS:
        rows += provider(workload, device)
    return rows


def make_step(
    workload: Workload, model: torch.nn.Module, inputs: tuple, config: Config, keep_grads: list | None = None
) -> Callable[[], None]:
    """One forward and backward of `config` on `model`; gradients are dropped after (or handed to
    `keep_grads`, one per parameter, so that they are freed only after a measured step)."""
    parameters = list(model.parameters())
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    loss = config.compile(workload.loss) if config.compile else workload.loss

    def step() -> None:
        with config.context() if config.context else contextlib.nullcontext():
            loss(model, inputs).backward()
        if keep_grads is not None:
            keep_grads.extend(p.grad for p in parameters)
        model.zero_grad(set_to_none=True)
        for t in leaves:
            t.grad = None

    return step


@dataclass
class Measured:
    """One configuration's step time, peak, bits and gradients, or its error."""

    config: Config
    seconds: float | None = None
    peak: int | None = None
    bits: float | None = None
    grads: list | None = None
    error: str | None = None


def _trial(
    candidates: list[Config], make: Callable[[Config], Callable[[], None]], tick=lambda: None
) -> tuple[dict[str, Callable[[], None]], dict[str, str]]:
    """Each configuration's step, built and run once (also its first warm-up), and the error of each
    one that fails: it is reported while the others are still measured."""
    steps, failed = {}, {}
    for c in candidates:
        try:
            step = make(c)
            step()
            steps[c.name] = step
        except Exception as err:
            failed[c.name] = error_line(err)
        finally:
            tick()
    return steps, failed


def measure_workload(
    workload: Workload, device: torch.device, candidates: list[Config], warmup: int, rounds: int, tick=lambda: None
) -> list[Measured]:
    """Measure every configuration on `workload`; returns one Measured per configuration, in order."""
    base = workload.model(device)
    inputs = workload.inputs(device)
    models: dict[str, torch.nn.Module] = {}

    def make(c: Config) -> Callable[[], None]:
        model = models[c.name] = copy_model(base)
        workload.prepare(model, c)
        return make_step(workload, model, inputs, c)

    steps, failed = _trial(candidates, make, tick)
    times, timing_failed = median_times(steps, device, warmup, rounds, tick)
    failed.update(timing_failed)
    results = []
    for c in candidates:
        result = Measured(c, seconds=times.get(c.name), error=failed.get(c.name))
        if result.error is None:
            grads: list = []
            step = make_step(workload, models[c.name], inputs, c, keep_grads=grads)

            def seeded(step=step) -> None:
                torch.manual_seed(1234)  # the same dropout masks in every configuration
                step()

            try:
                with fastckpt.track() as tracked:
                    result.peak = peak_bytes(seeded, device)
                result.grads = grads
                result.bits = tracked.bits_per_element if c.family == "fastckpt" and tracked.segments else None
            except Exception as err:
                result.error = error_line(err)
        results.append(result)
        tick()
    models.clear()
    gc.collect()
    synchronize(device)
    return results


def rows_of(workload: Workload, results: list[Measured]) -> list[dict]:
    """Table/CSV rows: absolute numbers, ratios to plain and to the stock row, blanks where none apply."""
    by_name = {r.config.name: r for r in results if r.error is None}
    plain = by_name.get("plain")

    def ratio(a, b):
        return a / b if a is not None and b else None

    rows = []
    for r in results:
        stock = by_name.get(r.config.stock) if r.config.stock else None
        rows.append(
            {
                "workload": workload.name,
                "config": r.config.name,
                "family": r.config.family,
                "ms_per_step": r.seconds * 1e3 if r.seconds is not None else None,
                "x_plain": ratio(r.seconds, plain.seconds) if plain and r.config.name != "plain" else None,
                "x_stock": ratio(r.seconds, stock.seconds) if stock else None,
                "peak_MiB": r.peak / 2**20 if r.peak is not None else None,
                "peak_x_plain": ratio(r.peak, plain.peak) if plain and r.config.name != "plain" else None,
                "peak_x_stock": ratio(r.peak, stock.peak) if stock else None,
                "bits_per_element": r.bits,
                "grad_rel_l2": max_rel_l2(r.grads, plain.grads) if plain and r.grads is not None else None,
                "stock": r.config.stock if stock else None,
                "error": r.error,
            }
        )
    front = report.pareto(rows)
    for row in rows:
        row["pareto"] = row["config"] in front if row["error"] is None else None
    return rows


def _progress(total: int, desc: str):
    """A tqdm bar on stderr (shown on a terminal only); a no-op when tqdm is missing."""
    try:
        from tqdm import tqdm
    except ImportError:
        return contextlib.nullcontext(None)
    bar_format = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} steps [{elapsed}<{remaining}]"
    return tqdm(total=total, desc=desc, leave=False, file=sys.stderr, disable=None, bar_format=bar_format)


def _reuse_freed_host_memory() -> bool:
    """glibc keeps freed memory for reuse (no trimming, no fresh mappings; True when it applied). Without it
    the interleaved rows leave the allocator in each other's state: on the quiet 2-core machine gpt2's plain
    step took 285-290 ms interleaved against 252-258 ms run alone, and 255-262 ms interleaved with it."""
    from benchmarks.ops import _reuse_freed_host_memory

    return _reuse_freed_host_memory()


def _proc_stat() -> tuple[int, int] | None:
    """(total, idle) CPU ticks of all CPUs since boot, from /proc/stat; None where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return sum(fields), fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    except (OSError, ValueError, IndexError):
        return None


def _others_busy(since: tuple[tuple[int, int], float] | None) -> float | None:
    """Fraction of all CPUs' time that other processes used since `since` (a _proc_stat() sample and this
    process's CPU seconds then): the machine's busy time minus this process's own."""
    now = _proc_stat()
    if since is None or since[0] is None or now is None or now[0] <= since[0][0]:
        return None
    (total0, idle0), own0 = since
    total, idle = now[0] - total0, now[1] - idle0
    own = (time.process_time() - own0) * os.sysconf("SC_CLK_TCK")
    return min(max((total - idle - own) / total, 0.0), 1.0)


def _cpu_busy(seconds: float = 1.0) -> float | None:
    """Fraction of all CPUs' time other processes used over the next `seconds` (this one sleeps)."""
    since = (_proc_stat(), time.process_time())
    time.sleep(seconds)
    return _others_busy(since)


def _busy_warning(busy: float | None) -> str | None:
    """A warning when other processes kept the CPUs busy just before the run, else None."""
    if busy is None or busy <= 0.25:
        return None
    return (
        f"other processes kept the CPUs {busy:.0%} busy just before the run: times will be longer and noisier "
        "than on a quiet machine (torch's threads wait for each other when one is descheduled)"
    )


def default_out() -> str:
    return os.path.join(DEFAULT_OUT, datetime.datetime.now().strftime("%Y-%m-%d_%H%M%S"))


def _header(dev: torch.device, warmup: int, rounds: int, tuned: bool) -> tuple[dict, list[str]]:
    """The run's environment and notes, printed; (the environment, the header lines for results.md)."""
    env = report.environment(dev)
    method = (
        "torch.cuda.max_memory_allocated"
        if dev.type == "cuda"
        else "replayed torch.profiler allocation records: the most the step had allocated and not freed"
    )
    notes = [
        f"times: median of {rounds} interleaved rounds after {1 + warmup} warm-up step(s) per configuration"
        + (
            "; glibc malloc keeps freed memory for reuse, so rows do not inherit each other's allocator state"
            if tuned
            else ""
        ),
        f"peak: {method}",
        f"'x stock': vs {STOCK} ('fastckpt recompute reentrant': vs {STOCK_REENTRANT}); "
        f"* marks the Pareto front: no other row both faster and smaller (rows with grad relL2 > "
        f"{report.GRAD_ERROR_LIMIT:g} left out)",
    ]
    busy = _cpu_busy()
    if busy is not None:
        env["CPU busy before the run"] = f"{busy:.0%} (other processes, over 1 s)"
    header = [f"{key}: {value}" for key, value in env.items()] + notes
    print("fastckpt benchmark: activation checkpointing alternatives, step time vs peak memory")
    print("\n".join("  " + line for line in header))
    warning = _busy_warning(busy)
    if warning:
        print(f"  WARNING: {warning}")
        header.append(f"WARNING: {warning}")
    return env, header


def main(
    device: str = "cpu",
    out: str | None = None,
    quick: bool = False,
    selected: list[str] | None = None,
    smoke: bool = False,
    tune_malloc: bool = True,
) -> list[dict]:
    """Measure the selected workloads (all by default); print the header, a table per workload, write a CSV
    and a PNG per workload and results.md to `out` (default bench-results/<timestamp>/). Exits with status
    1 after everything is written if a configuration failed."""
    dev = torch.device(device)
    size = "smoke" if smoke else "quick" if quick else "full"
    selected = list(selected or WORKLOAD_NAMES)
    unknown = [name for name in selected if name not in WORKLOAD_NAMES]
    if unknown:
        raise ValueError(f"unknown workload(s) {', '.join(unknown)}; valid: {', '.join(WORKLOAD_NAMES)}")
    out = out or default_out()
    warmup, rounds = ROUNDS[size]
    tuned = dev.type == "cpu" and tune_malloc and _reuse_freed_host_memory()

    env, header = _header(dev, warmup, rounds, tuned)
    print(f"results folder: {out}", flush=True)
    run_start = time.perf_counter()
    run_cpu = (_proc_stat(), time.process_time())

    all_rows: list[dict] = []
    markdown = ["# fastckpt benchmark", "", *[f"- {line}" for line in header], ""]
    failures = 0
    catalogue = workloads(dev, size)
    for name in selected:
        workload = catalogue[name]
        print(f"\n== {name}: {workload.description}", flush=True)
        if workload.rounds_factor != 1:
            print(f"(median of {rounds * workload.rounds_factor} rounds, not {rounds}: its steps are short)")
        if name == "llama" and transformers_missing():
            print(f"skipped: {transformers_missing()}")
            continue
        rows_here = configs(dev, workload)
        candidates = [c for c in rows_here if isinstance(c, Config)]
        skipped = [c for c in rows_here if isinstance(c, Skipped)]
        workload_rounds = rounds * workload.rounds_factor
        total = len(candidates) * (2 + warmup + workload_rounds)
        start = time.perf_counter()
        with _progress(total, f"measuring {name}") as bar:
            tick = (lambda: bar.update(1)) if bar is not None else (lambda: None)
            results = measure_workload(workload, dev, candidates, warmup, workload_rounds, tick)
        rows = rows_of(workload, results)
        print(report.text_table(rows))
        for s in skipped:
            print(f"skipped {s.name}: {s.reason}")
        failures += sum(1 for r in rows if r["error"])
        all_rows += rows
        os.makedirs(out, exist_ok=True)
        write_csv(rows, out, f"{name}.csv", quiet=True)
        title = f"{name}: {workload.description}"
        subtitle = f"{env['device']}, torch {torch.__version__}, fastckpt {env['fastckpt']}, {env['date']}"
        png = report.plot(rows, title, subtitle, os.path.join(out, f"{name}.png"))
        seconds = time.perf_counter() - start
        print(f"measured in {seconds:.0f} s; wrote {os.path.join(out, name + '.csv')} and {png}", flush=True)
        rounds_note = f" Median of {workload_rounds} rounds." if workload.rounds_factor != 1 else ""
        markdown += [f"## {name}", "", workload.description + "." + rounds_note, "", report.markdown_table(rows), ""]
        markdown += [f"Skipped {s.name}: {s.reason}" for s in skipped]
    if all_rows:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "unknown"
        others = _others_busy(run_cpu)
        ending = f"{time.perf_counter() - run_start:.0f} s in all; load average at the end {load}" + (
            f"; other processes used {others:.0%} of the CPUs meanwhile" if others is not None else ""
        )
        markdown.append(f"Measured in {ending}.")
        with open(os.path.join(out, "results.md"), "w") as f:
            f.write("\n".join(markdown) + "\n")
        print(f"\nwrote {os.path.join(out, 'results.md')} ({ending})")
    if failures:
        raise SystemExit(f"{failures} configuration(s) failed; the others are reported above")
    return all_rows
