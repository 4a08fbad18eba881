"""Measuring: median step time over interleaved rounds, and peak memory by an independent method.

GPU peak: torch.cuda.max_memory_allocated after a reset. CPU peak: the allocation records of
torch.profiler (profile_memory=True) replayed in time order, running maximum of live bytes.
"""

from __future__ import annotations

import csv
import os
import statistics
import time
from collections.abc import Callable

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_times(steps: dict[str, Callable[[], None]], device: torch.device, warmup: int, rounds: int) -> dict:
    """Median seconds per call for each step; configurations alternate each round so drift hits all alike."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    synchronize(device)
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            synchronize(device)
            start = time.perf_counter()
            step()
            synchronize(device)
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def peak_bytes(step: Callable[[], None], device: torch.device) -> int:
    """Peak bytes allocated during one call of `step`, above what was live before it."""
    synchronize(device)
    if device.type == "cuda":
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    # Every allocation and free is a "[memory]" record in the raw results (the aggregated
    # FunctionEvents fold most of them into their ops).
    records = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    )
    live = peak = 0
    for _, delta in records:
        live += delta
        peak = max(peak, live)
    return peak


def write_csv(rows: list[dict], folder: str, name: str) -> None:
    """Write result rows (dicts with the same keys) to folder/name and say where."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")


def error_line(err: Exception) -> str:
    """An exception as one line, for a table row."""
    return f"{type(err).__name__}: {err}".splitlines()[0]


def finish(rows: list[dict], failed: dict[str, str], width: int, out: str | None, name: str) -> list[dict]:
    """Print a FAILED row per failed configuration (name column `width` wide), write the measured rows
    to out/name when out is given, then exit with status 1 if anything failed; else return the rows."""
    for config, error in failed.items():
        print(f"{config:<{width}}FAILED: {error}")
    if out:
        write_csv(rows, out, name)
    if failed:
        raise SystemExit(f"{len(failed)} configuration(s) failed; the others are reported above")
    return rows
