"""CIFAR-10 CNN: memory of a training step, plain vs torch.utils.checkpoint vs fastckpt policies.

The classic Keras-style CIFAR-10 CNN, RMSprop lr 1e-4, batch 32; its two conv blocks are the
checkpointed segments. Every mode trains the same steps from the same seed, weights and batches and
measures its last step: on a GPU the four torch.cuda memory numbers, on the CPU the peak replayed from
the profiler's allocation records. CIFAR-10 is read from --data when torchvision's files are there
(never downloaded), else synthetic 3x32x32 images with 10 classes are used. From a source checkout:

    python examples/cifar10_cnn.py --mode plain --mode torch --mode fastckpt:int8 --steps 50 --device cpu
    python examples/cifar10_cnn.py --mode plain --mode fastckpt:int4+offload --device cuda --data ~/data

Modes: plain, torch (torch.utils.checkpoint, non-reentrant), fastckpt:POLICY for any fastckpt policy.
Measured on the CPU: checkpointing cuts what a step keeps after forward ~10x (26.2 -> 2.7 MB), but the peak
comes in the first block's backward (its activations, their gradients, the weight gradients): only -5%.
"""

import argparse
import functools
import gc
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # fastckpt and benchmarks from this checkout
import fastckpt  # noqa: E402
from benchmarks.harness import peak_bytes  # noqa: E402
from fastckpt.policies import TOKENS  # noqa: E402

MB = 2**20
WRITEUP_MAX_ALLOCATED_MB = {"plain": 69.58, "checkpointed": 40.80}  # the write-up's GPU figures, not ours
VALID_MODES = f"plain, torch, fastckpt:POLICY (POLICY: '+'-joined tokens of {', '.join(TOKENS)})"
CUDA_STATS = ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved")


def conv_block(cin: int, mid: int, cout: int) -> nn.Sequential:
    conv1, conv2 = nn.Conv2d(cin, mid, 3, padding=1), nn.Conv2d(mid, cout, 3, padding=1)
    return nn.Sequential(conv1, nn.ReLU(), conv2, nn.ReLU(), nn.MaxPool2d(2), nn.Dropout(0.25))


class CifarCNN(nn.Module):
    """`segment(block, x)` runs each conv block (a checkpoint function); None runs them plainly."""

    def __init__(self, segment=None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([conv_block(3, 32, 64), conv_block(64, 64, 64)])
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(4096, 512), nn.ReLU(), nn.Dropout(0.5), nn.Linear(512, 10)
        )
        self.segment = segment

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x) if self.segment is None else self.segment(block, x)
        return self.classifier(x)


def parse_mode(text: str) -> str:
    """argparse type of --mode: the mode itself, or an error that names the valid ones."""
    if text in ("plain", "torch"):
        return text
    problem = "unknown mode"
    if text.startswith("fastckpt:"):
        try:
            fastckpt.Policy.parse(text.removeprefix("fastckpt:"))
            return text
        except ValueError as err:
            problem = str(err)
    raise argparse.ArgumentTypeError(f"{text!r}: {problem}; valid modes: {VALID_MODES}")


def segment_fn(mode: str):
    if mode == "plain":
        return None
    if mode == "torch":
        return functools.partial(torch_checkpoint, use_reentrant=False)
    return functools.partial(fastckpt.checkpoint, policy=mode.removeprefix("fastckpt:"))


def load_batches(data_dir: str, steps: int, batch: int = 32, seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    g, n = torch.Generator().manual_seed(seed), steps * batch
    try:
        from torchvision.datasets import CIFAR10

        data = CIFAR10(data_dir, train=True, download=False)
        index = torch.randperm(len(data.data), generator=g).repeat(n // len(data.data) + 1)[:n]
        x = torch.from_numpy(data.data[index.numpy()]).permute(0, 3, 1, 2).float() / 255
        y = torch.tensor(data.targets)[index]
        print(f"data: CIFAR-10 training images from {data_dir}")
    except (ImportError, RuntimeError):  # no torchvision, or "Dataset not found or corrupted"
        y, patterns = torch.randint(10, (n,), generator=g), torch.rand(10, 3, 32, 32, generator=g)
        x = (patterns[y] + torch.rand(n, 3, 32, 32, generator=g)) / 2  # learnable: one pattern per class
        print(f"data: synthetic 3x32x32 images, 10 classes (no CIFAR-10 under {data_dir!r}; nothing downloaded)")
    return list(zip(x.split(batch), y.split(batch), strict=True))


def train(mode: str, batches: list, device: torch.device, seed: int = 0) -> dict:
    """Train on `batches`: every step but the last is timed, the last one is measured for memory."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # every mode starts from an empty cache: comparable memory_reserved
    torch.manual_seed(seed)  # the same weights and dropout masks in every mode
    model = CifarCNN(segment_fn(mode)).to(device)
    optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-4, weight_decay=1e-6)
    losses, seconds = [], []

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())  # synchronizes a GPU

    for x, y in batches[:-1]:
        start = time.perf_counter()
        step(x, y)
        seconds.append(time.perf_counter() - start)
    x, y = batches[-1]
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step(x, y)
        memory = {name: getattr(torch.cuda, name)() / MB for name in CUDA_STATS}
    else:
        memory = {"cpu_peak": peak_bytes(lambda: step(x, y), device) / MB}
    step_s = statistics.median(seconds[1:] or seconds) if seconds else float("nan")  # the first one warms up
    grads = [p.grad.detach().cpu() for p in model.parameters()]  # of the last step; the model itself is freed
    return {"mode": mode, "losses": losses, "grads": grads, "step_s": step_s, "memory": memory}


def report(results: list[dict], device: torch.device) -> None:
    key = "max_memory_allocated" if device.type == "cuda" else "cpu_peak"
    columns = CUDA_STATS if device.type == "cuda" else (key,)
    print(f"{'mode':<24}{'final loss':>11}{'ms/step':>9}" + "".join(f"{c + ' MB':>23}" for c in columns))
    for r in results:
        cells = "".join(f"{r['memory'][c]:>23.2f}" for c in columns)
        print(f"{r['mode']:<24}{r['losses'][-1]:>11.4f}{r['step_s'] * 1e3:>9.1f}{cells}")
    if device.type == "cpu":
        print("cpu_peak: peak of the memory the last step allocated, from the profiler's allocation records")
    plain, ckpt = WRITEUP_MAX_ALLOCATED_MB["plain"], WRITEUP_MAX_ALLOCATED_MB["checkpointed"]
    print(f"the write-up's figure (GPU max_memory_allocated): plain {plain:.2f} -> checkpointed {ckpt:.2f} MB")
    base = next((r["memory"][key] for r in results if r["mode"] == "plain"), None)
    for mode, ours in [(r["mode"], r["memory"][key]) for r in results if base and r["mode"] != "plain"]:
        print(f"ours ({key}): plain {base:.2f} -> {mode} {ours:.2f} MB ({ours / base:.2f}x)")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", action="append", type=parse_mode, help=f"repeatable; {VALID_MODES}")
    parser.add_argument("--steps", type=int, default=50, help="training steps per mode")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--data", default="data", help="the folder holding torchvision's cifar-10-batches-py")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    device = torch.device(args.device)
    batches = load_batches(args.data, args.steps, seed=args.seed)
    modes = args.mode or ["plain", "torch", "fastckpt:recompute", "fastckpt:int8"]
    results = [train(mode, batches, device, args.seed) for mode in modes]
    report(results, device)
    return results


if __name__ == "__main__":
    main()
