"""`python -m benchmarks offload [--device cuda] [--out DIR] [--quick]`: how much of offload's copying is hidden.

CUDA only: offload keeps CPU tensors where they are, so on CPU this prints why and measures nothing.
On the GPT-2 stack (benchmarks/workloads.py 'gpt2', every block checkpointed), per offload policy P
(`offload`, `int8+offload`, `recompute+offload`) next to the same policy without offload (`save`, `int8`,
`recompute`), in interleaved rounds:

- bytes P moves to host per step (track()'s host_bytes) and the link's pinned bandwidth, each way
  (a 256 MiB copy timed with CUDA events);
- copy time: those bytes at the link's bandwidth, out and back (what the copies cost if nothing overlapped);
- exposed: P's median step time minus its base's; hidden = 1 - exposed / copy time (target >= 0.9);
- the engine's device-to-host bandwidth: fastckpt's to_host on the step's stored sizes, 8 MiB pieces, as a
  fraction of the link's (target >= 0.85);
- peak (max_memory_allocated) with and without P, and the arena's pinned allocations after the first step.
"""

from __future__ import annotations

import argparse
import gc

import torch

import fastckpt
from benchmarks.harness import median_times, peak_bytes, write_csv
from benchmarks.workloads import workloads
from fastckpt.storage import offload

PAIRS = (("offload", "save"), ("int8+offload", "int8"), ("recompute+offload", "recompute"))
TARGETS = {"hidden": 0.90, "bandwidth": 0.85}
LINK_BYTES = 256 * 2**20
PIECE_BYTES = 8 * 2**20


def link_bandwidth(device: torch.device) -> tuple[float, float]:
    """Pinned device-to-host and host-to-device bandwidth (bytes/s) of one LINK_BYTES copy each way."""
    dev = torch.empty(LINK_BYTES, dtype=torch.uint8, device=device)
    host = torch.empty(LINK_BYTES, dtype=torch.uint8, pin_memory=True)
    result = []
    for dst, src in ((host, dev), (dev, host)):
        dst.copy_(src, non_blocking=True)  # warm-up
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        stop.record()
        stop.synchronize()
        result.append(LINK_BYTES / (start.elapsed_time(stop) / 1e3))
    return result[0], result[1]


def engine_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of fastckpt's to_host copying `nbytes` in PIECE_BYTES pieces (arena warm: second run timed)."""
    pieces = [torch.empty(PIECE_BYTES, dtype=torch.uint8, device=device) for _ in range(max(1, nbytes // PIECE_BYTES))]
    seconds = 0.0
    for _ in range(2):
        gc.collect()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        copies = [offload.to_host(p) for p in pieces]
        for copy in copies:
            copy.copied.synchronize()
        stop.record()
        stop.synchronize()
        seconds = start.elapsed_time(stop) / 1e3
        del copies
    return len(pieces) * PIECE_BYTES / seconds


def hidden_fraction(exposed_seconds: float, copy_seconds: float) -> float:
    """The share of the copies' time that the step did not see (1: all overlapped; < 0: slower than serial)."""
    return 1.0 - exposed_seconds / copy_seconds if copy_seconds > 0 else float("nan")


def main(device: str = "cuda", out: str | None = None, quick: bool = False) -> list[dict]:
    dev = torch.device(device)
    if dev.type != "cuda":
        print("benchmarks offload: needs a CUDA GPU (offload keeps CPU tensors where they are); nothing measured")
        return []
    workload = workloads(dev, "quick" if quick else "full")["gpt2"]
    model, inputs = workload.model(dev), workload.inputs(dev)

    def step_with(policy: str):
        def step() -> None:
            model.segment = lambda block, x: fastckpt.checkpoint(block, x, policy=policy)
            try:
                workload.loss(model, inputs).backward()
            finally:
                model.segment = None
            model.zero_grad(set_to_none=True)

        return step

    steps = {policy: step_with(policy) for pair in PAIRS for policy in pair}
    for step in steps.values():
        step()
    allocations = offload.ENGINE.arena.allocations
    times, failed = median_times(steps, dev, 1, 3 if quick else 7)
    new_pinned = offload.ENGINE.arena.allocations - allocations
    d2h, h2d = link_bandwidth(dev)
    rows = []
    for policy, base in PAIRS:
        with fastckpt.track() as report:
            steps[policy]()
        moved = report.host_bytes
        copy_seconds = moved / d2h + moved / h2d
        exposed = times[policy] - times[base] if policy in times and base in times else float("nan")
        rows.append(
            {
                "policy": policy,
                "base": base,
                "host_MiB": moved / 2**20,
                "ms": times.get(policy, float("nan")) * 1e3,
                "base_ms": times.get(base, float("nan")) * 1e3,
                "copy_ms": copy_seconds * 1e3,
                "hidden": hidden_fraction(exposed, copy_seconds),
                "engine_d2h_x_link": engine_bandwidth(dev, moved) / d2h,
                "peak_MiB": peak_bytes(steps[policy], dev) / 2**20,
                "base_peak_MiB": peak_bytes(steps[base], dev) / 2**20,
                "error": failed.get(policy, ""),
            }
        )
    print(f"fastckpt offload on {torch.cuda.get_device_name(dev)}: {workload.description}")
    print(f"link: {d2h / 1e9:.1f} GB/s device-to-host, {h2d / 1e9:.1f} GB/s host-to-device (pinned, 256 MiB)")
    print(f"pinned allocations during the timed steps: {new_pinned} (arena: {offload.ENGINE.arena.allocations} in all)")
    print(f"{'policy':<20}{'host MiB':>9}{'ms':>8}{'base ms':>9}{'copy ms':>9}{'hidden':>8}{'engine/link':>12}"
          f"{'peak MiB':>10}{'base peak':>10}")  # fmt: skip
    for r in rows:
        print(
            f"{r['policy']:<20}{r['host_MiB']:>9.1f}{r['ms']:>8.1f}{r['base_ms']:>9.1f}{r['copy_ms']:>9.1f}"
            f"{r['hidden']:>8.2f}{r['engine_d2h_x_link']:>12.2f}{r['peak_MiB']:>10.1f}{r['base_peak_MiB']:>10.1f}"
            + (f"  {r['error']}" if r["error"] else "")
        )
    print(f"targets: hidden >= {TARGETS['hidden']}, engine bandwidth >= {TARGETS['bandwidth']} x link")
    if out:
        write_csv(rows, out, "offload_cuda.csv")
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m benchmarks.offload", description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true")
    arguments = parser.parse_args()
    main(arguments.device, arguments.out, arguments.quick)
