"""The main benchmark: fastckpt.checkpoint vs stock torch.utils.checkpoint on a GPT-2-style stack.

Every configuration runs in the same process, interleaved; times are medians after warm-up and
reported as ratios to plain training and to stock checkpoint in the same mode. Each configuration
also reports its peak memory, the stored bits per saved element (fastckpt.track) and the largest
relative L2 gradient error over the parameters, against plain training from the same seed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.utils.checkpoint as torch_checkpoint

import fastckpt
from benchmarks.harness import error_line, finish, median_times, peak_bytes
from benchmarks.workloads import DEFAULT_SHAPES, StackShape, gpt2_input, gpt2_stack


@dataclass(frozen=True)
class Config:
    name: str
    run_block: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
    stock: str | None = None  # the stock configuration this one is compared with
    uses_fastckpt: bool = True


def _ours(policy: str, use_reentrant: bool = False) -> Callable:
    return lambda block, x: fastckpt.checkpoint(block, x, use_reentrant=use_reentrant, policy=policy)


def _torch(use_reentrant: bool) -> Callable:
    return lambda block, x: torch_checkpoint.checkpoint(block, x, use_reentrant=use_reentrant)


STOCK = "torch non-reentrant"


def configs(device: torch.device) -> list[Config]:
    """The configurations measured on `device` (offload only where there is a device to offload from)."""
    result = [
        Config("plain", lambda block, x: block(x), uses_fastckpt=False),
        Config(STOCK, _torch(False), uses_fastckpt=False),
        Config("torch reentrant", _torch(True), uses_fastckpt=False),
        Config("fastckpt recompute", _ours("recompute"), STOCK),
        Config("fastckpt recompute reentrant", _ours("recompute", True), "torch reentrant"),
        Config("fastckpt save", _ours("save"), STOCK),
    ]
    policies = ["int8", "fp8", "int4", "int2", "recompute+int8"]
    if device.type == "cuda":
        policies += ["offload", "int4+offload", "recompute+offload"]
    return result + [Config(f"fastckpt {p}", _ours(p), STOCK) for p in policies]


def make_step(blocks: torch.nn.ModuleList, x: torch.Tensor, run_block: Callable) -> Callable[[], None]:
    def step() -> None:
        h = x
        for block in blocks:
            h = run_block(block, h)
        h.float().pow(2).mean().backward()
        blocks.zero_grad(set_to_none=True)

    return step


def gradients(blocks: torch.nn.ModuleList, x: torch.Tensor, run_block: Callable) -> list[torch.Tensor]:
    """Parameter gradients of one step from a fixed seed (dropout masks equal across configurations)."""
    blocks.zero_grad(set_to_none=True)
    torch.manual_seed(1234)
    h = x
    for block in blocks:
        h = run_block(block, h)
    h.float().pow(2).mean().backward()
    grads = [p.grad.detach().clone() for p in blocks.parameters()]
    blocks.zero_grad(set_to_none=True)
    return grads


def max_rel_l2(grads: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    return max(
        ((g - r).float().norm() / r.float().norm().clamp_min(1e-30)).item()
        for g, r in zip(grads, reference, strict=True)
    )


def _runnable(
    candidates: list[Config], blocks: torch.nn.ModuleList, x: torch.Tensor
) -> tuple[list[Config], dict[str, str]]:
    """The configurations whose trial step runs, and the error of each fastckpt one that does not.

    A fastckpt configuration that fails (a path run on a device for the first time, say) is reported
    instead of costing every other number of the run; a failing baseline still stops the benchmark.
    """
    runnable, failed = [], {}
    for c in candidates:
        try:
            make_step(blocks, x, c.run_block)()
            runnable.append(c)
        except Exception as err:
            if not c.uses_fastckpt:
                raise
            failed[c.name] = error_line(err)
    return runnable, failed


def main(device: str = "cpu", out: str | None = None, quick: bool = False) -> list[dict]:
    """Run every configuration on the default workload of `device`; print the table, write CSV to `out`."""
    dev = torch.device(device)
    shape: StackShape = DEFAULT_SHAPES[dev.type]
    if quick:
        shape = StackShape(shape.layers // 2, shape.dim, shape.heads, shape.batch // 2, shape.seq)
    blocks = gpt2_stack(shape, dev)
    x = gpt2_input(shape, dev).requires_grad_(True)
    measured, failed = _runnable(configs(dev), blocks, x)
    steps = {c.name: make_step(blocks, x, c.run_block) for c in measured}
    warmup, rounds = (2, 5) if quick else (3, 15)
    times = median_times(steps, dev, warmup, rounds)
    peaks = {name: peak_bytes(step, dev) for name, step in steps.items()}
    reference = gradients(blocks, x, measured[0].run_block)

    rows = []
    for c in measured:
        with fastckpt.track() as report:
            grads = gradients(blocks, x, c.run_block)
        rows.append(
            {
                "config": c.name,
                "median_ms": times[c.name] * 1e3,
                "x_plain": times[c.name] / times["plain"],
                "x_stock": times[c.name] / times[c.stock] if c.stock else float("nan"),
                "peak_MiB": peaks[c.name] / 2**20,
                "peak_x_stock": peaks[c.name] / peaks[c.stock] if c.stock else float("nan"),
                "bits_per_element": report.bits_per_element if c.uses_fastckpt else float("nan"),
                "grad_rel_l2": max_rel_l2(grads, reference),
            }
        )
    threads = torch.get_num_threads() if dev.type == "cpu" else None
    print(f"fastckpt {fastckpt.__version__} vs torch {torch.__version__} on {device}", end="")
    print(f" ({threads} threads)" if threads else f" ({torch.cuda.get_device_name(dev)})")
    print(f"workload: GPT-2-style stack, {shape}; median of {rounds} interleaved rounds after {warmup} warm-up")
    print(f"'x stock' compares with torch.utils.checkpoint ({STOCK} unless the name says reentrant)")
    header = f"{'config':<30}{'ms/step':>9}{'x plain':>9}{'x stock':>9}{'peak MiB':>10}{'peak x stock':>13}"
    print(header + f"{'bits/elem':>11}{'grad relL2':>12}")
    for r in rows:
        print(
            f"{r['config']:<30}{r['median_ms']:>9.1f}{r['x_plain']:>9.3f}{r['x_stock']:>9.3f}"
            f"{r['peak_MiB']:>10.1f}{r['peak_x_stock']:>13.3f}{r['bits_per_element']:>11.2f}{r['grad_rel_l2']:>12.2e}"
        )
    return finish(rows, failed, 30, out, f"checkpoint_{dev.type}.csv")
