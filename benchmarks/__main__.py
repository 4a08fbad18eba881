"""`python -m benchmarks [checkpoint|llm|real|long|iteration|trl|planner|compile|ops|train|offload|loss]
[--device cpu|cuda] [--out DIR] [--quick] [--all]`.

checkpoint (default): fastckpt's policies next to plain training, torch's checkpoint (non-reentrant,
  reentrant, selective), torch's save_on_cpu and DeepSpeed's checkpoint, on the seed CNN, GPT-2-style
  stacks (short and 2048-token context) and a small Hugging Face Llama; a table, a CSV and a plot per
  workload in --out (default bench-results/<timestamp>/). Then the planner section: fastckpt.plan at
  100/70/50/30% of stock checkpoint's peak on a long-context stack (its table goes to results.md too;
  'planner-all', not in the default run, adds that stack's sublayer and tiled segmentations and GPT-2).
  Then the compile section: torch.compile of the GPT-2 stack, plain, with torch's checkpoint and with
  fastckpt's policies (fastckpt.compile). Then the llm section: the whole step of a bf16 Llama fine-tune
  (LoRA and full) against HF gradient checkpointing, and the peak's scaling with length and depth. Then the real
  section: the whole step at a real model's shape (Llama-3.2-1B, 1,024 tokens, LoRA, padded; 7-9 minutes
  on a 2-core CPU) with where its peak is ('real-all', not in the default run, adds Llama-3.2-1B's full
  fine-tune and 4,096 tokens, Qwen2.5-0.5B and Gemma-2-2B: some two hours there).
  Then the trl section: one step of TRL's SFTTrainer at Qwen2.5-0.5B's shape, TRL as it comes (HF GC, TRL's
  fused LM head) against TRL with fastckpt.
  --workloads picks some (of the workloads, 'planner', 'planner-all', 'compile', 'llm', 'real', 'real-all' and
  'trl'), --smoke runs tiny shapes once (checks that every row runs; its numbers mean nothing).
  --compare DIR prints every row's measured columns as new / old against an earlier results folder.
llm: the llm section alone (as `python -m benchmarks.llm`).
real: the real-shapes section alone (as `python -m benchmarks.real_shapes`); --all: every real-shape workload.
long: one row of 8K and 16K packed tokens through a LoRA fine-tune at Llama-3.2-1B's shape, HF GC (predicted
  where it outgrows the memory free) against fastckpt with the MLP untiled and tiled, and where the peak is (as
  `python -m benchmarks.long_context`, which also takes --shape, --lengths, --layers, --batch; not in the
  default run: on a 2-core CPU without AMX some 40 minutes at 2 layers in fp32).
iteration: the whole iteration of a full fine-tune (forward, backward, AdamW's step) at Llama-3.2-1B's and
  Qwen2.5-0.5B's shapes: HF GC against fastckpt with AdamW stepped after and in the backward (as
  `python -m benchmarks.iteration`, which also takes --full-depth; not in the default run).
trl: the TRL section alone (as `python -m benchmarks.trl`, which also takes --shape).
planner: the planner section alone (as `python -m benchmarks.planner`).
compile: the compile section alone (as `python -m benchmarks.compiled`).
ops: throughput of each compiled op as a fraction of memcpy bandwidth (η).
train: final loss of a small GPT trained on real text, per storage policy, against plain training.
offload (CUDA): how much of the offload engine's copying the step hides, and its bandwidth vs the link's.
loss: the causal-LM loss head, plain head + cross entropy vs chunked recompute vs fastckpt.linear_cross_entropy.
"""

from __future__ import annotations

import argparse
import importlib
import os

import torch

from benchmarks.workloads import WORKLOAD_NAMES

MODES = {
    "checkpoint": "benchmarks.checkpoint",
    "llm": "benchmarks.llm",
    "real": "benchmarks.real_shapes",
    "long": "benchmarks.long_context",
    "iteration": "benchmarks.iteration",
    "trl": "benchmarks.trl",
    "planner": "benchmarks.planner",
    "compile": "benchmarks.compiled",
    "ops": "benchmarks.ops",
    "train": "benchmarks.train",
    "offload": "benchmarks.offload",
    "loss": "benchmarks.loss_head",
}
PLANNER = "planner"  # the planner section of the checkpoint benchmark, selectable like a workload
PLANNER_ALL = "planner-all"  # the planner section with its variants (not in the default run: 3x as long)
COMPILE = "compile"  # the torch.compile section, likewise
LLM = "llm"  # the whole-step LLM section, likewise
REAL = "real"  # the whole step at a real model shape (one workload), likewise
REAL_ALL = "real-all"  # every real-shape workload (not in the default run: about six times as long)
TRL = "trl"  # one step of TRL's SFTTrainer at a real model shape, likewise
DEFAULT_SECTIONS = (*WORKLOAD_NAMES, PLANNER, COMPILE, LLM, REAL, TRL)
SECTIONS = (*DEFAULT_SECTIONS, PLANNER_ALL, REAL_ALL)


SMOKE_MODES = ("checkpoint", "llm", "real", "iteration", "trl")


def _workload_list(text: str) -> list[str]:
    """argparse type of --workloads: comma-separated names, each one of SECTIONS (workloads, planner)."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"no workload named; valid: {', '.join(SECTIONS)}")
    unknown = [name for name in names if name not in SECTIONS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown workload {', '.join(map(repr, unknown))}; valid: {', '.join(SECTIONS)}"
        )
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__.split("\n\n", 1)[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("mode", nargs="?", default="checkpoint", choices=sorted(MODES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--out", default=None, help="results folder (checkpoint: default bench-results/<timestamp>)")
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer rounds")
    parser.add_argument(
        "--workloads",
        type=_workload_list,
        action="extend",
        metavar="NAME[,NAME...]",
        help=f"checkpoint only: which workloads, of {', '.join(SECTIONS)} (default: all)",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="checkpoint, llm, real, iteration and trl: tiny shapes, one round"
    )
    parser.add_argument("--all", action="store_true", help="real only: every real-shape workload")
    parser.add_argument("--compare", metavar="DIR", help="an earlier results folder: print each row as new / old")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is visible")
    if (args.mode != "checkpoint" and args.workloads) or (args.smoke and args.mode not in SMOKE_MODES):
        parser.error(
            f"--workloads and --smoke apply to the checkpoint benchmark, not to {args.mode!r} (--smoke also to 'llm' "
            "'real', 'iteration' and 'trl')"
        )
    if args.all and args.mode != "real":
        parser.error(f"--all applies to 'real', not to {args.mode!r} (the checkpoint benchmark: --workloads real-all)")
    if args.compare is not None and not os.path.isdir(args.compare):
        parser.error(f"--compare {args.compare!r} is not a results folder")
    if args.quick and args.smoke:
        parser.error("--quick and --smoke exclude each other (--smoke is the smaller)")
    if args.out is not None and os.path.exists(args.out) and not os.path.isdir(args.out):
        parser.error(f"--out {args.out!r} exists and is not a folder")
    if args.workloads:
        args.workloads = list(dict.fromkeys(args.workloads))  # each once, in the order given
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.compare is not None and args.out is None:
        args.out = importlib.import_module(MODES["checkpoint"]).default_out()  # somewhere to compare from
    rows = _run(args)
    if args.compare is not None:
        importlib.import_module("benchmarks.compare").compare(args.out, args.compare)
    return rows


def _run(args: argparse.Namespace) -> list[dict]:
    module = importlib.import_module(MODES[args.mode])
    if args.mode in ("llm", "trl", "iteration"):
        return module.main(device=args.device, out=args.out, quick=args.quick, smoke=args.smoke)
    if args.mode == "real":
        return module.main(device=args.device, out=args.out, every=args.all, smoke=args.smoke)
    if args.mode == "long":
        return module.main(["--device", args.device, *(["--out", args.out] if args.out else [])])
    if args.mode != "checkpoint":
        return module.main(device=args.device, out=args.out, quick=args.quick)
    selected = args.workloads or list(DEFAULT_SECTIONS)
    sections = (PLANNER, PLANNER_ALL, COMPILE, LLM, REAL, REAL_ALL, TRL)
    workload_names = [name for name in selected if name not in sections]
    out = args.out or module.default_out()
    rows: list[dict] = []
    failed: SystemExit | None = None
    if workload_names:
        try:
            rows = module.main(device=args.device, out=out, quick=args.quick, selected=workload_names, smoke=args.smoke)
        except SystemExit as exit_status:  # failed rows: reported, and the planner section still runs
            failed = exit_status
    if PLANNER in selected or PLANNER_ALL in selected:
        planner = importlib.import_module(MODES[PLANNER])
        print(f"\n== {PLANNER}: fastckpt.plan at fractions of stock checkpoint's peak", flush=True)
        results_md = os.path.join(out, "results.md")
        variants = PLANNER_ALL in selected
        rows += planner.main(
            args.device, out, quick=args.quick, smoke=args.smoke, results_md=results_md, variants=variants
        )
    if COMPILE in selected:
        compiled = importlib.import_module(MODES[COMPILE])
        print(f"\n== {COMPILE}: torch.compile on the GPT-2 stack", flush=True)
        results_md = os.path.join(out, "results.md")
        compile_rows = compiled.main(args.device, out, quick=args.quick, smoke=args.smoke, results_md=results_md)
        broken = sum(1 for row in compile_rows if row["error"])
        if broken and failed is None:
            failed = SystemExit(f"{broken} configuration(s) of the compile section failed; see its table")
        rows += compile_rows
    if LLM in selected:
        llm = importlib.import_module(MODES[LLM])
        print(f"\n== {LLM}: the whole step of a bf16 Llama fine-tune", flush=True)
        rows += llm.main(args.device, out, quick=args.quick, smoke=args.smoke)
    if REAL in selected or REAL_ALL in selected:
        real = importlib.import_module(MODES[REAL])
        print(f"\n== {REAL}: the whole step at real model shapes", flush=True)
        try:
            rows += real.main(args.device, out, every=REAL_ALL in selected, smoke=args.smoke)
        except SystemExit as exit_status:
            failed = failed or exit_status
    if TRL in selected:
        trl = importlib.import_module(MODES[TRL])
        print(f"\n== {TRL}: one step of TRL's SFTTrainer at a real model shape", flush=True)
        rows += trl.main(args.device, out, quick=args.quick, smoke=args.smoke)
    if failed is not None:
        raise failed
    return rows


if __name__ == "__main__":
    main()
