"""`python -m benchmarks [checkpoint|ops|train] [--device cpu|cuda] [--out DIR] [--quick]`.

checkpoint (default): fastckpt vs stock torch.utils.checkpoint on the embedded GPT-2-style workload.
ops: throughput of each compiled op as a fraction of memcpy bandwidth (η).
train: final loss of a small GPT trained on real text, per storage policy, against plain training.
"""

from __future__ import annotations

import argparse
import importlib
import os

os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # keep the CPU memory profiler quiet
import torch  # noqa: E402

MODES = {"checkpoint": "benchmarks.checkpoint", "ops": "benchmarks.ops", "train": "benchmarks.train"}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", default="checkpoint", choices=sorted(MODES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--out", default=None, help="folder for CSV results")
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is visible")
    importlib.import_module(MODES[args.mode]).main(device=args.device, out=args.out, quick=args.quick)


if __name__ == "__main__":
    main()
