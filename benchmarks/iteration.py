"""The whole iteration of a full fine-tune at real model shapes: `python -m benchmarks iteration [--smoke]`.

A full fine-tune's memory is its weights, the optimizer's state and the gradients; after checkpointing the
activations are the small part. Each row here is one iteration of the loop users run (Trainer's): forward (the
loss), backward, clipping by the global norm at 1.0 where the row says so, AdamW's step (`foreach`, torch's
default on GPUs) and `zero_grad()`. fp32 weights (mixed precision), tied embeddings, one padded row (the first
eighth left padding), the models of benchmarks/real_shapes.py (random weights at the configurations).

Rows: HF gradient checkpointing with AdamW stepped after the backward, clipped (the reference of the 'x HF GC'
columns) and not; fastckpt (`hf.enable(policy="recompute+int8", loss_head=True, padded_attention=True)`) with
AdamW stepped after the backward, clipped; fastckpt with AdamW stepped in the backward
(`fastckpt.optimizer_in_backward`), unclipped and clipped exactly (its norm pass: one more backward); and the
last with bitsandbytes' 8-bit AdamW (its state 2 bytes per parameter where AdamW's is 8).

Columns: the device total (what is live before the iteration, the weights and AdamW's state, plus the
iteration's peak: `fastckpt.memory`'s profiler replay on CPU, max_memory_allocated on CUDA), the peak above the
weights and the state, and the seconds per iteration (the median of the timed iterations, one warm-up first),
each also as a ratio to HF GC + AdamW's, clipped or not as the row.

Compute dtype: bf16 autocast on CUDA and on CPUs with AMX (bf16 matrix units); elsewhere bf16 is emulated (an
iteration of one Llama-3.2-1B layer took many minutes), so the rows run in fp32 there, and say so. Depth: on a
CPU each row runs at 1 and at 2 layers and its bytes are extrapolated linearly to the model's depth (the
weights, the state, the gradients and the stored layer inputs grow by the layer; the head and embeddings do
not): exact for the memory terms that grow by the layer. Seconds are the deeper depth's, where the head and
the embeddings weigh more than at the model's depth. `--full-depth` runs the model's own depth instead (CUDA,
or a CPU with the memory and hours for it).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import fastckpt
from benchmarks.harness import quiet_profiler_logs, write_csv
from benchmarks.real_shapes import SHAPES, Workload, batch_of, build
from benchmarks.report import cpu_flags
from benchmarks.steps import HF_GC, fmt, hf_gc, hf_loss
from benchmarks.steps import fastckpt as fastckpt_row
from fastckpt.fits import native_bf16
from fastckpt.memory import MemoryTrace

CLIP = 1.0
POLICY = "recompute+int8"
WORKLOADS = (Workload("llama-3.2-1b", 1024, False, "padded"), Workload("qwen2.5-0.5b", 2048, False, "padded"))
SMOKE = (Workload("smoke", 64, False, "padded"),)
DEPTHS = (1, 2)  # CPU: measured at these depths, extrapolated to the model's


@dataclass(frozen=True)
class Config:
    """One row: how the model is checkpointed, whether AdamW steps in the backward, whether it clips."""

    name: str
    prepare: Callable[[torch.nn.Module], None]
    in_backward: bool
    clip: bool
    eight_bit: bool = False  # bitsandbytes' AdamW8bit (2 bytes of state per parameter) instead of torch's AdamW

    @property
    def reference(self) -> str:
        """The HF GC row this row's ratios are taken against (the same clipping)."""
        return CONFIGS[0].name if self.clip else CONFIGS[1].name


FASTCKPT = f"fastckpt {POLICY} + loss head + padded attention"
CONFIGS = (
    Config(f"{HF_GC} + AdamW, clip {CLIP}", hf_gc, False, True),
    Config(f"{HF_GC} + AdamW", hf_gc, False, False),
    Config(f"{FASTCKPT} + AdamW, clip {CLIP}", fastckpt_row(POLICY, True, padded=True), False, True),
    Config(f"{FASTCKPT} + AdamW in backward", fastckpt_row(POLICY, True, padded=True), True, False),
    Config(f"{FASTCKPT} + AdamW in backward, clip {CLIP}", fastckpt_row(POLICY, True, padded=True), True, True),
    Config(f"{FASTCKPT} + 8-bit AdamW in backward, clip {CLIP}", fastckpt_row(POLICY, True, padded=True), True, True,
           eight_bit=True),
)  # fmt: skip


@dataclass
class Measured:
    """One row at one depth: bytes live before the iteration, its peak above them per phase of the iteration
    (forward, backward, clip, step, zero_grad), seconds per iteration, and the process's largest resident set
    (host memory, every copy and allocator cache included; 0 where not measured)."""

    resident: int
    phases: dict[str, int]
    seconds: float
    max_rss: int = 0

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    @property
    def total(self) -> int:
        return self.resident + self.peak


def iteration(config: Config, model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict,
              autocast: bool, mark: Callable[[str], None] = lambda phase: None) -> None:  # fmt: skip
    """One iteration of the loop, as Trainer runs it; `mark(phase)` after each phase."""
    with torch.autocast(batch["input_ids"].device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = hf_loss(model, batch)
    mark("forward")
    if config.in_backward:
        optimizer.backward(loss)  # the steps (and the norm pass) are in the backward's phase
        mark("backward")
    else:
        loss.backward()
        mark("backward")
        if config.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            mark("clip")
    optimizer.step()
    mark("step")
    optimizer.zero_grad(set_to_none=True)
    mark("zero_grad")


def _resident(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    tensors = [*model.parameters(), *model.buffers(), *(t for s in optimizer.state.values() for t in s.values())]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if torch.is_tensor(t)}
    return sum(storages.values())


def measure(config: Config, workload: Workload, layers: int, device: torch.device, autocast: bool,
            timed: int, isolated: bool = True) -> Measured:  # fmt: skip
    """The row at `layers` layers, `isolated` in a process of its own (spawned: each row starts from an empty heap,
    and one that runs out of memory fails alone), else in this one (--smoke)."""
    if not isolated:
        return _measure_here(CONFIGS.index(config), workload, layers, str(device), autocast, timed)
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        index = CONFIGS.index(config)
        return pool.submit(_measure_here, index, workload, layers, str(device), autocast, timed).result()


def _measure_here(index: int, workload: Workload, layers: int, device_name: str, autocast: bool,
                  timed: int) -> Measured:  # fmt: skip
    """The row at `layers` layers: a warm-up iteration (AdamW's state allocated), one traced, `timed` timed."""
    from benchmarks.ops import _reuse_freed_host_memory

    config, device = CONFIGS[index], torch.device(device_name)
    if device.type == "cpu" and multiprocessing.parent_process() is not None:  # a row's own process
        _reuse_freed_host_memory()  # as the other sections: freed blocks reused, not paged in afresh
    shape = dataclasses.replace(SHAPES[workload.shape], layers=layers)
    model = build(shape, False, workload.tokens).to(device)
    batch = batch_of(workload, shape.vocab, device)
    config.prepare(model)
    if config.eight_bit:
        import bitsandbytes

        optimizer = bitsandbytes.optim.AdamW8bit(model.parameters(), lr=1e-5)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    if config.in_backward:
        optimizer = fastckpt.optimizer_in_backward(optimizer, max_grad_norm=CLIP if config.clip else None)
    iteration(config, model, optimizer, batch, autocast)
    resident = _resident(model, optimizer)
    with quiet_profiler_logs(), MemoryTrace(device) as trace:
        iteration(config, model, optimizer, batch, autocast, trace.mark)
    seconds = []
    for _ in range(timed):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        iteration(config, model, optimizer, batch, autocast)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    phases = {point.key: point.peak_before for point in trace.points}
    return Measured(resident, phases, sorted(seconds)[len(seconds) // 2], max_rss)


def extrapolated(at: dict[int, Measured], layers: int) -> Measured:
    """The row at the model's `layers`: each phase's peak (and what is live before) on the line through the two
    depths measured (or the one, if it is that), so that the iteration's peak is the highest phase at that depth
    (HF GC's moves from the loss at 1-2 layers to AdamW's step at 16); its seconds the deeper depth's (a line
    through two single timings, seconds apart on a noisy host, can even fall)."""
    if layers in at:
        return at[layers]
    (d1, m1), (d2, m2) = sorted(at.items())

    def line(a: float, b: float) -> int:
        return int(b + (b - a) / (d2 - d1) * (layers - d2))

    phases = {phase: line(m1.phases[phase], m2.phases[phase]) for phase in m2.phases}
    return Measured(line(m1.resident, m2.resident), phases, m2.seconds, m2.max_rss)


def run(workload: Workload, device: torch.device, full_depth: bool, timed: int, isolated: bool = True,
        configs: tuple[Config, ...] = CONFIGS) -> list[dict]:  # fmt: skip
    shape = SHAPES[workload.shape]
    autocast = native_bf16(device)
    depths = (shape.layers,) if full_depth or device.type == "cuda" else DEPTHS
    started = time.perf_counter()
    results: dict[str, Measured] = {}
    failed: dict[str, str] = {}
    for config in configs:
        try:
            at = {}
            for layers in depths:
                at[layers] = m = measure(config, workload, layers, device, autocast, timed, isolated)
                phases = ", ".join(f"{phase} {peak / 2**20:.0f}" for phase, peak in m.phases.items())
                print(f"({config.name}, {layers} layers: total {m.total / 2**20:.0f} MiB, above it by phase {phases} "
                      f"MiB, {m.seconds:.1f} s, host RSS {m.max_rss / 2**30:.1f} GiB)", flush=True)  # fmt: skip
            results[config.name] = extrapolated(at, shape.layers)
        except Exception as err:  # reported in the table; the others go on
            failed[config.name] = f"{type(err).__name__}: {err}".splitlines()[0]
    depth_note = (f"measured at {' and '.join(map(str, depths))} layers, bytes extrapolated linearly to "
                  f"{shape.layers}, seconds at {depths[-1]}" if depths != (shape.layers,)
                  else f"{shape.layers} layers")  # fmt: skip
    print(
        f"\n== {workload.name} iteration: {depth_note}, hidden {shape.hidden}, vocab {shape.vocab:,}, 1 x "
        f"{workload.tokens} tokens (first eighth left padding), fp32 weights, "
        f"{'bf16 autocast' if autocast else 'fp32 compute (no AMX: bf16 would be emulated)'}, AdamW (foreach)"
    )
    print(f"CPU flags: {' '.join(cpu_flags()) or 'none of avx2/avx512f/avx512_bf16/amx_bf16'}"
          if device.type == "cpu" else f"device: {torch.cuda.get_device_name(device)}")  # fmt: skip
    print(f"{'config':<80}{'total MiB':>10}{'x HF GC':>9}{'above MiB':>10}{'x HF GC':>9}{'s/iter':>8}{'x HF GC':>9}")
    table = []
    for config in configs:
        if config.name not in results:
            print(f"{config.name:<80}FAILED: {failed[config.name]}")
            continue
        m, ref = results[config.name], results.get(config.reference)
        row = {
            "workload": workload.name, "config": config.name, "layers": shape.layers, "measured_depths": depths,
            "autocast_bf16": autocast, "total_MiB": m.total / 2**20, "resident_MiB": m.resident / 2**20,
            "above_MiB": m.peak / 2**20, "peak_phase": max(m.phases, key=m.phases.get), "s_per_iter": m.seconds,
            "total_x_hf_gc": m.total / ref.total if ref else None,
            "above_x_hf_gc": m.peak / ref.peak if ref else None,
            "time_x_hf_gc": m.seconds / ref.seconds if ref else None,
        }  # fmt: skip
        table.append(row)
        print(f"{config.name:<80}{row['total_MiB']:>10.1f}{fmt(row['total_x_hf_gc'], '.3f'):>9}"
              f"{row['above_MiB']:>10.1f}{fmt(row['above_x_hf_gc'], '.3f'):>9}{m.seconds:>8.1f}"
              f"{fmt(row['time_x_hf_gc'], '.3f'):>9}", flush=True)  # fmt: skip
    print(f"(live before each iteration: weights and AdamW's state, {results[CONFIGS[0].name].resident / 2**20:.0f} "
          f"MiB; ratios against the HF GC row with the same clipping; {time.perf_counter() - started:.0f} s)"
          if CONFIGS[0].name in results else "")  # fmt: skip
    if failed:
        raise SystemExit(f"{len(failed)} configuration(s) of the iteration benchmark failed; see its table")
    return table


def main(device: str = "cpu", out: str | None = None, quick: bool = False, smoke: bool = False,
         full_depth: bool = False, in_backward_only: bool = False) -> list[dict]:  # fmt: skip
    """Every workload's table (SMOKE: a tiny Llama, its numbers meaning nothing); `quick`: one timed iteration;
    `in_backward_only`: the rows stepping in the backward alone (the others hold every gradient: at full depth
    on a CPU host, more than its memory), their ratios left blank."""
    dev = torch.device(device)
    configs = tuple(c for c in CONFIGS if c.in_backward or not in_backward_only)
    table = []
    for workload in SMOKE if smoke else WORKLOADS:
        timed = 1 if quick or smoke else 2
        table += run(workload, dev, full_depth, timed, isolated=not smoke, configs=configs)
    if out:
        write_csv(table, out, "iteration.csv")
    return table


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.iteration", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--smoke", action="store_true", help="a tiny Llama, once")
    parser.add_argument("--quick", action="store_true", help="one timed iteration per row")
    parser.add_argument("--full-depth", action="store_true", help="the model's own depth, not 1 and 2 layers")
    parser.add_argument("--in-backward-only", action="store_true", help="the rows stepping in the backward alone")
    parser.add_argument("--workload", choices=[w.shape for w in WORKLOADS], default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.workload:
        WORKLOADS = tuple(w for w in WORKLOADS if w.shape == args.workload)
    main(args.device, args.out, args.quick, args.smoke, args.full_depth, args.in_backward_only)
