"""Measuring: median step time over interleaved rounds, and peak memory by an independent method.

GPU peak: torch.cuda.max_memory_allocated after a reset, minus what was allocated before the step.
CPU peak: the allocation records of torch.profiler (profile_memory=True), replayed in time order; see
`peak_bytes` for the exact definition. fastckpt.memory drops the lines kineto writes to the process's stderr
file descriptor as the profiler starts and stops; the CPU allocator's warning while the step runs (`Memory block
of unknown size ...`, a free the profiler cannot size) is caught here and dropped, while anything else written
meanwhile is passed on.
"""

from __future__ import annotations

import contextlib
import csv
import math
import os
import re
import statistics
import time
from collections.abc import Callable

import torch

from fastckpt import memory


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_times(
    steps: dict[str, Callable[[], None]],
    device: torch.device,
    warmup: int,
    rounds: int,
    tick: Callable[[], None] = lambda: None,
) -> tuple[dict[str, float], dict[str, str]]:
    """Median seconds per call of each step, and the error of each step that raised.

    Configurations alternate within each round, so drift (other processes, clock, memory state) hits
    all of them alike. A step that raises is dropped from the later rounds and reported; the others
    go on. `tick` is called after every call (a progress bar). On CPU a line says when other processes took
    CPU time meanwhile (`OtherProcesses`).
    """
    failed: dict[str, str] = {}

    def call(name: str, step: Callable[[], None]) -> float | None:
        try:
            synchronize(device)
            start = time.perf_counter()
            step()
            synchronize(device)
            return time.perf_counter() - start
        except Exception as err:
            failed[name] = error_line(err)
            return None
        finally:
            tick()

    for name, step in steps.items():
        for _ in range(warmup):
            if name in failed:
                tick()
            else:
                call(name, step)
    samples: dict[str, list[float]] = {name: [] for name in steps}
    with OtherProcesses() as others:
        for _ in range(rounds):
            for name, step in steps.items():
                if name in failed:
                    tick()
                    continue
                seconds = call(name, step)
                if seconds is not None:
                    samples[name].append(seconds)
    note = others.note()
    if device.type == "cpu" and note:
        print(note, flush=True)
    times = {name: statistics.median(values) for name, values in samples.items() if values and name not in failed}
    return times, failed


class OtherProcesses:
    """The CPU time that other processes took while the block ran, in cores on average (`cores`; None where
    /proc/stat is missing): the machine's busy time less this process's. On a 2-core machine a torch process
    runs 2 threads, so another busy process makes every step 2-30x slower, by amounts that differ from step to
    step, and time ratios measured then are noise."""

    NOISY = 0.25  # cores: above this, say so beside the times

    def __init__(self) -> None:
        self.cores: float | None = None

    def __enter__(self) -> OtherProcesses:
        self._start = (time.perf_counter(), time.process_time(), _busy_cpu_seconds())
        return self

    def __exit__(self, *exc: object) -> None:
        wall, own, busy = time.perf_counter(), time.process_time(), _busy_cpu_seconds()
        if busy is not None and self._start[2] is not None and wall > self._start[0]:
            others = (busy - self._start[2]) - (own - self._start[1])
            self.cores = max(0.0, others / (wall - self._start[0]))

    def note(self) -> str | None:
        """A line for the table, when other processes took more than NOISY cores."""
        if self.cores is None or self.cores <= self.NOISY:
            return None
        return (
            f"(timing: other processes used {self.cores:.1f} of this machine's {os.cpu_count()} cores meanwhile; "
            "the times and their ratios are noisy, rerun on an idle machine)"
        )


def _busy_cpu_seconds() -> float | None:
    """Seconds of CPU time every core of the machine spent busy since boot (Linux: /proc/stat), else None."""
    try:
        with open("/proc/stat") as stat:
            lines = stat.read().splitlines()
        fields = [int(x) for x in lines[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    if sum(re.match(r"cpu\d", line) is not None for line in lines) != os.cpu_count():
        return None  # a container that sees the host's cores: their time is not this machine's
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


# The profiler's own lines on fd 2: a C++ log prefix ("USDT:2026-...", "ERROR:2026-...", "[W1201 ...")
# mentioning the profiler, kineto, the CPU allocator's profiling or the device query kineto makes.
_LOG_PREFIX = re.compile(r"^(?:[A-Z]+:\d{4}-\d\d-\d\d |\[[WIEF]\d{4} )")
_PROFILER_WORDS = re.compile(
    r"profiler|Profiler|kineto|Kineto|USDT|CPUAllocator|Memory block of unknown size|DeviceProperties|"
    r"gpuGetDeviceCount|cupti|CUPTI"
)


def is_profiler_noise(line: str) -> bool:
    """True for a log line that torch.profiler's C++ side writes on starting, stopping or allocating."""
    return bool(_LOG_PREFIX.match(line)) and bool(_PROFILER_WORDS.search(line))


def quiet_profiler_logs() -> contextlib.AbstractContextManager[None]:
    """Catch what is written to file descriptor 2 inside the block; afterwards pass on every line but the
    profiler's own (so a Python warning or a traceback printed meanwhile still shows, just later)."""
    return memory.stderr_without(is_profiler_noise)


def peak_bytes(step: Callable[[], None], device: torch.device) -> int:
    """Peak of the memory one call of `step` allocated above what was live before it.

    CPU: the running maximum, over the step's allocation records in time order, of the bytes that the
    step allocated and had not yet freed. Frees of blocks allocated before the step are ignored (the
    profiler knows the size of such a block only if an earlier profiled call allocated it, which would
    make the result depend on history), so a step that frees older memory is not credited for it.
    GPU: max_memory_allocated during the step minus memory_allocated before it (there, frees of older
    memory do count). The step runs under the profiler, whose log lines are kept out of the output.
    """
    # The same measurement as fastckpt.plan's (fastckpt.memory), here with the profiler's log lines kept quiet.
    with quiet_profiler_logs():
        return memory.peak_bytes(step, device)


def cell(value: object) -> str:
    """A value as a CSV cell: blank for missing or NaN."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return str(value)


def write_csv(rows: list[dict], folder: str, name: str, quiet: bool = False) -> str:
    """Write result rows (dicts with the same keys) to folder/name, missing values blank; return the path."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows({key: cell(value) for key, value in row.items()} for row in rows)
    if not quiet:
        print(f"wrote {path}")
    return path


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
