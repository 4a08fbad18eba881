"""The main benchmark: fastckpt.checkpoint vs stock torch.utils.checkpoint on a GPT-2-style stack.

Every configuration runs in the same process, interleaved; times are medians after warm-up and
reported as ratios to plain training and to stock checkpoint in the same mode.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Callable

import torch
import torch.utils.checkpoint as torch_checkpoint

import fastckpt
from benchmarks.harness import median_times, peak_bytes
from benchmarks.workloads import DEFAULT_SHAPES, StackShape, gpt2_input, gpt2_stack

# name -> (how each block is run, the stock configuration it is compared with)
CONFIGS: dict[str, tuple[Callable, str | None]] = {
    "plain": (lambda block, x: block(x), None),
    "torch non-reentrant": (lambda block, x: torch_checkpoint.checkpoint(block, x, use_reentrant=False), None),
    "torch reentrant": (lambda block, x: torch_checkpoint.checkpoint(block, x, use_reentrant=True), None),
    "fastckpt recompute": (lambda block, x: fastckpt.checkpoint(block, x), "torch non-reentrant"),
    "fastckpt recompute reentrant": (
        lambda block, x: fastckpt.checkpoint(block, x, use_reentrant=True),
        "torch reentrant",
    ),
    "fastckpt save": (lambda block, x: fastckpt.checkpoint(block, x, policy="save"), None),
}


def make_step(blocks: torch.nn.ModuleList, x: torch.Tensor, run_block: Callable) -> Callable[[], None]:
    def step() -> None:
        h = x
        for block in blocks:
            h = run_block(block, h)
        h.float().pow(2).mean().backward()
        blocks.zero_grad(set_to_none=True)

    return step


def main(device: str = "cpu", out: str | None = None, quick: bool = False) -> list[dict]:
    """Run every configuration on the default workload of `device`; print the table, write CSV to `out`."""
    dev = torch.device(device)
    shape: StackShape = DEFAULT_SHAPES[dev.type]
    if quick:
        shape = StackShape(shape.layers // 2, shape.dim, shape.heads, shape.batch // 2, shape.seq)
    blocks = gpt2_stack(shape, dev)
    x = gpt2_input(shape, dev).requires_grad_(True)
    steps = {name: make_step(blocks, x, run) for name, (run, _) in CONFIGS.items()}
    warmup, rounds = (2, 5) if quick else (3, 15)
    times = median_times(steps, dev, warmup, rounds)
    peaks = {name: peak_bytes(step, dev) for name, step in steps.items()}

    rows = []
    for name, (_, stock) in CONFIGS.items():
        rows.append(
            {
                "config": name,
                "median_ms": times[name] * 1e3,
                "x_plain": times[name] / times["plain"],
                "x_stock": times[name] / times[stock] if stock else float("nan"),
                "peak_MiB": peaks[name] / 2**20,
                "peak_x_stock": peaks[name] / peaks[stock] if stock else float("nan"),
            }
        )
    threads = torch.get_num_threads() if dev.type == "cpu" else None
    print(f"fastckpt {fastckpt.__version__} vs torch {torch.__version__} on {device}", end="")
    print(f" ({threads} threads)" if threads else f" ({torch.cuda.get_device_name(dev)})")
    print(f"workload: GPT-2-style stack, {shape}; median of {rounds} interleaved rounds after {warmup} warm-up")
    print(f"{'config':<30}{'ms/step':>10}{'x plain':>9}{'x stock':>9}{'peak MiB':>10}{'peak x stock':>14}")
    for r in rows:
        print(
            f"{r['config']:<30}{r['median_ms']:>10.1f}{r['x_plain']:>9.3f}{r['x_stock']:>9.3f}"
            f"{r['peak_MiB']:>10.1f}{r['peak_x_stock']:>14.3f}"
        )
    if out:
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, f"checkpoint_{dev.type}.csv")
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        print(f"wrote {path}")
    return rows
