"""Long sequences at real model shapes: `python -m benchmarks long [--shape S] [--lengths 8192,16384] [--layers N]
[--batch packed|padded] [--compute bf16|fp32] [--configs untiled,tiled,offload]`.

One row of 8K-32K tokens through a LoRA fine-tune (r=16 on all seven projections) of a real model's shape
(benchmarks/real_shapes.py's SHAPES, random weights): HF gradient checkpointing against fastckpt's
`recompute+int8` with the loss head and padded attention, with the decoder layers' MLPs untiled
(`tile_mlp=False`) and tiled (`hf.enable`'s default under a recompute policy: tiles of max(1024, hidden) tokens),
and with `--configs ...,offload` `recompute+int8+offload` tiled (the int8 layer inputs in host memory, counted
apart from the device's peak; on a CPU copied as a GPU's would be: `fastckpt.storage.offload.copies_apart`).
Each row: one step timed (s/step), then one step traced (`real_shapes.traced_step`: the peak and what is live
at it, by the phase that allocated it).

HF GC's full [tokens x vocab] logits outgrow this machine's memory at these lengths (Llama-3.2-1B: about 1.5 MiB
a token): its peak is measured at 2,048 and 4,096 tokens and carried along the line through them (the loss head
and the stored layer inputs are linear in the length), and it is run at a long length only where that line says
the step fits the memory free here (on a CPU twice the predicted peak: CPU_HEADROOM); a predicted row says so.

On a CPU without AMX (bf16 emulated: hours a step at these lengths) the steps run in fp32 (`--compute fp32`, the
default there: an fp32 model, activations twice bf16's) at `--layers` decoder layers (default 2 there, the
model's depth elsewhere); `python -m fastckpt.fits` carries such measurements to the model's depth.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import time

import torch

from benchmarks.harness import quiet_profiler_logs, write_csv
from benchmarks.ops import _reuse_freed_host_memory
from benchmarks.real_shapes import CATEGORIES, SHAPES, Workload, batch_of, build, traced_step
from benchmarks.report import cpu_flags
from benchmarks.steps import HF_GC, Row, fastckpt, fmt, hf_gc, hf_loss, sharing_copy, step
from fastckpt.fits import free_memory, native_bf16
from fastckpt.storage import offload

SHORT = (2048, 4096)  # where HF GC's line is measured
# On a CPU HF GC runs at a long length where twice its predicted peak is free: the traced step's process holds
# about that (the model, the profiler's records; 24.3 GB resident at a predicted 12.6 GB peak, bf16 8K tokens).
CPU_HEADROOM = 2
UNTILED = "fastckpt recompute+int8, MLP untiled"
TILED = "fastckpt recompute+int8, MLP tiled"
OFFLOADED = "fastckpt recompute+int8+offload, MLP tiled"
CONFIGS = {"untiled": UNTILED, "tiled": TILED, "offload": OFFLOADED}  # --configs


def rows(configs: tuple[str, ...] = ("untiled", "tiled")) -> list[Row]:
    """HF GC's row, then fastckpt's named in `configs` (CONFIGS' keys)."""
    ours = {
        UNTILED: Row(UNTILED, fastckpt("recompute+int8", True, padded=True, tile_mlp=False)),
        TILED: Row(TILED, fastckpt("recompute+int8", True, padded=True)),  # tile_mlp: hf.enable's default
        OFFLOADED: Row(OFFLOADED, fastckpt("recompute+int8+offload", True, padded=True)),
    }
    return [Row(HF_GC, hf_gc), *(ours[CONFIGS[name]] for name in configs)]


def run(shape_name: str, lengths: list[int], layers: int, batch: str, compute: str, device: torch.device,
        short: tuple[int, int] = SHORT, configs: tuple[str, ...] = ("untiled", "tiled")) -> list[dict]:  # fmt: skip
    """The rows at each of `lengths` (printed), HF GC's line measured at the `short` lengths. The offload row's
    host copies are counted apart from the device's peak (on a CPU as a GPU would hold them: copies_apart)."""
    shape = dataclasses.replace(SHAPES[shape_name], layers=layers)
    autocast = compute == "bf16"
    base = build(shape, True, max(lengths), torch.bfloat16 if autocast else torch.float32).to(device)

    def measure(row: Row, tokens: int, timed: bool) -> dict:
        model = sharing_copy(base)
        row.prepare(model)
        inputs = batch_of(Workload(shape_name, tokens, True, batch), shape.vocab, device)
        host = offload.copies_apart(device) if row.name == OFFLOADED else contextlib.nullcontext()
        with host:
            start = time.perf_counter()
            step(model, inputs, hf_loss, autocast=autocast)  # timed, and what is allocated once
            seconds = time.perf_counter() - start
            model.zero_grad(set_to_none=True)
            with quiet_profiler_logs():
                traced = traced_step(model, inputs, hf_loss, device, autocast=autocast)
        model.zero_grad(set_to_none=True)
        return {"peak": traced.peak, "parts": traced.parts, "at": traced.at, "seconds": seconds if timed else None}

    gc_row, *ours = rows(configs)
    (n1, n2), short = short, {tokens: measure(gc_row, tokens, False)["peak"] for tokens in short}
    slope = (short[n2] - short[n1]) / (n2 - n1)

    def gc_line(tokens: int) -> float:
        return short[n1] + slope * (tokens - n1)

    print(f"\n== {shape_name} at {layers} layers, LoRA r=16, one row of {batch} tokens, {compute} compute; "
          f"HF GC measured {short[n1] / 2**20:,.0f} / {short[n2] / 2**20:,.0f} MiB at "
          f"{n1:,} / {n2:,} tokens ({slope * 1024 / 2**20:,.1f} MiB per 1K tokens)",
          flush=True)  # fmt: skip
    table = []
    for tokens in lengths:
        results = {}
        # where its line was measured it ran already; longer, where the line says it fits
        if tokens <= n2 or gc_line(tokens) * (CPU_HEADROOM if device.type == "cpu" else 1) <= free_memory(device):
            results[HF_GC] = measure(gc_row, tokens, True)
        for row in ours:
            results[row.name] = measure(row, tokens, True)
        gc = results.get(HF_GC)
        gc_peak = gc["peak"] if gc else gc_line(tokens)
        for name, r in results.items():
            table.append({
                "shape": shape_name, "layers": layers, "tokens": tokens, "batch": batch, "compute": compute,
                "config": name, "peak_MiB": r["peak"] / 2**20, "peak_x_hf_gc": r["peak"] / gc_peak,
                "hf_gc_predicted": gc is None, "s_per_step": r["seconds"],
                "time_x_hf_gc": r["seconds"] / gc["seconds"] if gc else None, "peak_in": r["at"],
                **{f"at_peak_{part}_MiB": size / 2**20 for part, size in r["parts"].items()},
            })  # fmt: skip
        if gc is None:
            table.append({"shape": shape_name, "layers": layers, "tokens": tokens, "batch": batch, "compute": compute,
                          "config": f"{HF_GC} (predicted: more than the memory free here)",
                          "peak_MiB": gc_peak / 2**20, "peak_x_hf_gc": 1.0, "hf_gc_predicted": True})  # fmt: skip
    _print(table)
    return table


def _print(table: list[dict]) -> None:
    print(f"{'tokens':>8}  {'config':<52}{'peak MiB':>11}{'x HF GC':>9}{'s/step':>9}{'x HF GC':>9}  "
          + "".join(f"{c:>12}" for c in CATEGORIES) + "  peak in")  # fmt: skip
    for r in table:
        parts = "".join(f"{r.get(f'at_peak_{c}_MiB', 0):>12.1f}" for c in CATEGORIES) if "peak_in" in r else ""
        print(f"{r['tokens']:>8,}  {r['config']:<52}{r['peak_MiB']:>11,.1f}{fmt(r['peak_x_hf_gc'], '.3f'):>9}"
              f"{fmt(r.get('s_per_step'), '.1f'):>9}{fmt(r.get('time_x_hf_gc'), '.3f'):>9}  {parts}"
              f"  {r.get('peak_in', '')}", flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.long_context", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-3.2-1b", choices=[s for s in SHAPES if s != "gemma-2-2b"])
    parser.add_argument("--lengths", default="8192,16384", help="comma-separated token counts")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: 2 in fp32, else all)")
    parser.add_argument("--batch", default="packed", choices=["packed", "padded"])
    parser.add_argument("--compute", default=None, choices=["bf16", "fp32"], help="default: bf16 where native")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--configs", default="untiled,tiled", help=f"fastckpt's rows, of {','.join(CONFIGS)}")
    parser.add_argument("--out", default=None, help="a folder for long_context.csv")
    parser.add_argument("--return-freed-memory", action="store_true",
                        help="CPU: leave glibc returning freed blocks (32K tokens at 16 layers grew past 22 GB "
                             "resident with them kept); the times then include first-touch page faults")  # fmt: skip
    args = parser.parse_args(argv)
    configs = tuple(args.configs.split(","))
    if not set(configs) <= set(CONFIGS):
        parser.error(f"--configs: each of {', '.join(CONFIGS)}, got {args.configs!r}")
    device = torch.device(args.device)
    flags = cpu_flags()
    compute = args.compute or ("bf16" if native_bf16(device) else "fp32")
    layers = args.layers or (2 if compute == "fp32" else SHAPES[args.shape].layers)
    if device.type == "cpu" and not args.return_freed_memory and _reuse_freed_host_memory():
        print("(CPU: glibc malloc set to reuse freed memory)")
    print(f"host CPU flags: {' '.join(flags) or 'none of the matrix flags'}; torch {torch.__version__}")
    lengths = [int(n) for n in args.lengths.split(",")]
    table = run(args.shape, lengths, layers, args.batch, compute, device, configs=configs)
    if args.out:
        write_csv(table, args.out, "long_context.csv")
    return table


if __name__ == "__main__":
    main()
