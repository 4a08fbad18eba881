"""The whole step of an LLM fine-tune, as users run it: `python -m benchmarks llm [--quick] [--compare DIR]`.

A randomly initialised Hugging Face `LlamaForCausalLM` (GQA, SwiGLU, RoPE; hidden 256, MLP 688, 4 heads with
2 KV heads, vocab 4096), bf16 autocast, one sequence whose last quarter is padding (attention mask 0, labels
-100), the step `model(input_ids, attention_mask, labels).loss.backward()`. Two workloads:

- llama-lora: LoRA r=8 on the q/v/up/down projections (PEFT), B initialised nonzero (as after some training:
  with PEFT's zero B every gradient of A is exactly zero and its error says nothing);
- llama-full: every parameter trained; its table adds the peak less the parameter gradients' bytes (which no
  checkpointing removes).

Rows, measured in the same process on the same weights and batch: plain; HF gradient checkpointing (torch's
non-reentrant checkpoint: the reference of the 'x HF GC' columns); HF GC with torch's selective checkpointing
(matmul and attention outputs saved); HF GC with a chunked loss written here (the head and cross entropy over
token chunks, each chunk checkpointed: what a user can do without fastckpt); on a GPU with liger-kernel
installed, HF GC with Liger Kernel's fused linear cross entropy (the GPU peer of the loss head); fastckpt's
recompute+int8 without fastckpt's whole-step options, recompute:int8+int8 with the loss head alone, and its
policies with the loss head and padded attention (`fastckpt.integrations.hf.enable(..., loss_head=True,
padded_attention=True)`: the head and loss a chunk of tokens at a time, attention without the [tokens x tokens]
mask); a plan (`fastckpt.plan` at the workload's target, both options on: LoRA 0.33 of HF GC's peak, the full
fine-tune 0.4 of HF GC's peak less the gradients). Gradient error: relative L2 over all trained parameters'
gradients against plain fp32 (no autocast), same weights and batch; 'x bf16' divides it by plain bf16 autocast's
own.

Then the scaling figure: the peak against sequence length and depth for plain, HF GC and fastckpt's best,
with the fitted bytes per token per layer. Last, packed sequences (llama-lora): one row of 4,096 tokens packed
from eight sequences of different lengths without padding (position ids start again at each, no attention
mask, no label across a boundary: what padding-free collators give), where HF builds a block-diagonal causal
mask; HF GC against fastckpt's `recompute+int8` with the loss head, without and with padded attention (which
runs attention per sequence without the mask).
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.utils.checkpoint as torch_checkpoint

from benchmarks.harness import error_line, median_times, peak_bytes, quiet_profiler_logs, write_csv
from benchmarks.steps import (
    HF_GC,
    PACKED_WEIGHTS,
    PLAIN,
    Row,
    fastckpt,
    fmt,
    gradients,
    hf_gc,
    hf_loss,
    padded_batch,
    relative_error,
    trained_bytes,
)
from benchmarks.steps import causal_lm as _causal_lm
from benchmarks.steps import packed_batch as _packed_batch
from benchmarks.steps import step as _step
from fastckpt import hybrid
from fastckpt.integrations import hf

HEADS, KV_HEADS = 4, 2
# (hidden, intermediate, vocabulary) per size: the smoke run checks that every row runs, at a quarter width
WIDTHS = {"full": (256, 688, 4096), "quick": (256, 688, 4096), "smoke": (64, 176, 512)}
VOCAB = WIDTHS["full"][2]
LORA_TARGETS = ["q_proj", "v_proj", "up_proj", "down_proj"]
# (layers, tokens, warm-up steps, timed rounds) per size; scaling: (lengths at SCALING_DEPTH, depths at 1024)
SIZES = {"full": (16, 1024, 0, 5), "quick": (8, 1024, 0, 3), "smoke": (2, 64, 0, 1)}  # the trial step warms up
SCALING = {"full": ((512, 1024, 2048, 4096), (8, 16, 24, 32)), "quick": ((512, 1024, 2048), (8, 16)),
           "smoke": ((32, 64), (1, 2))}  # fmt: skip
LONG_ROUNDS = 2  # timed rounds of HF GC and BEST at the scaling figure's largest length
SCALING_DEPTH = {"full": 16, "quick": 8, "smoke": 2}
SCALING_TOKENS = {"full": 1024, "quick": 1024, "smoke": 64}
# packed sequences: (layers, tokens, timed rounds) per size; the row's sequences' lengths are in these proportions
PACKED_SIZES = {"full": (16, 4096, 2), "quick": (8, 2048, 1), "smoke": (2, 64, 1)}
LOSS_CHUNKS = 8  # the chunked-loss reference row: the head and loss over this many token chunks
PLAN = "fastckpt plan + loss head + padded attention"
# The plan rows' budgets, the targets': LoRA 0.33 of HF GC's whole-step peak; the full fine-tune 0.4 of HF GC's
# peak less the parameter gradients (which no checkpointing removes), plus those gradients.
PLAN_FRACTION = {True: 0.33, False: 0.4}  # by `lora`
# The planner's bound (hf.PLAN_MAX_ERROR, enable(budget=)'s default): its error is the largest relative L2 error
# of one parameter's gradient against the plain bf16 step (not fp32); the int8 forms' (1.05-1.3x bf16's own error
# against fp32 in this table's measure) are within it, the int4 forms' (5-10x) are not.
PLAN_MAX_ERROR = hf.PLAN_MAX_ERROR


def _shifted(model: torch.nn.Module, batch: dict) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """The causal LM, its decoder's last hidden states [tokens - 1, hidden] and the labels they predict: the
    inputs of a loss computed outside HF's forward."""
    causal_lm = _causal_lm(model)
    hidden = causal_lm.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    hidden = hidden.last_hidden_state[:, :-1]
    return causal_lm, hidden.reshape(-1, hidden.shape[-1]), batch["labels"][:, 1:].reshape(-1)


def chunked_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The reference a user writes without fastckpt: the decoder's hidden states, then the head and the
    cross entropy per token chunk, each chunk checkpointed so that only one chunk's logits are alive."""
    causal_lm, hidden, labels = _shifted(model, batch)
    count = (labels != -100).sum()

    def chunk_loss(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = causal_lm.lm_head(h).float()
        return torch.nn.functional.cross_entropy(logits, y, ignore_index=-100, reduction="sum")

    total = sum(
        torch_checkpoint.checkpoint(chunk_loss, h, y, use_reentrant=False)
        for h, y in zip(hidden.chunk(LOSS_CHUNKS), labels.chunk(LOSS_CHUNKS), strict=True)
    )
    return total / count


def liger_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """Liger Kernel's fused linear cross entropy (Triton: GPU only) on the decoder's hidden states: the head's
    gradient computed in the forward, a chunk of logits at a time; the GPU peer of fastckpt's loss head."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    causal_lm, hidden, labels = _shifted(model, batch)
    return liger_fused_linear_cross_entropy(hidden.contiguous(), causal_lm.lm_head.weight, labels, ignore_index=-100)


LIGER = "HF GC + Liger fused linear cross entropy"


def liger_available(device: torch.device) -> str | None:
    """Why the Liger row is left out on `device`, or None when it runs."""
    if device.type != "cuda":
        return "Liger Kernel's Triton kernels need a GPU"
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed (pip install liger-kernel)"
    return None


def _sac(model: torch.nn.Module) -> None:
    ops = [packet.default for packet in hybrid.default_save_ops()]
    hf_gc(model, context_fn=functools.partial(torch_checkpoint.create_selective_checkpoint_contexts, ops))


POLICIES = ("recompute+int8", "recompute:int8+int8", "recompute+int4")
WHOLE_STEP = "loss head + padded attention"  # hf.enable(loss_head=True, padded_attention=True)
BEST = f"fastckpt recompute:int8+int8 + {WHOLE_STEP}"  # the tables' lowest peak: the scaling figure's row


def rows(liger: bool = False) -> list[Row]:
    """The table's configurations; `liger`: with the Liger peer row (where liger_available says it runs)."""
    found = [
        Row(PLAIN, lambda model: None),
        Row(HF_GC, hf_gc),
        Row("HF GC + torch SAC", _sac),
        Row("HF GC + chunked loss", hf_gc, chunked_loss),
    ]
    if liger:
        found.append(Row(LIGER, hf_gc, liger_loss))
    # Without the whole-step options only the policy whose time matches HF GC's (the others' peaks are the same
    # head), and the lowest-peak policy with the loss head alone (what padded attention adds).
    found.append(Row("fastckpt recompute+int8", fastckpt("recompute+int8", False)))
    found.append(Row("fastckpt recompute:int8+int8 + loss head", fastckpt("recompute:int8+int8", True)))
    for policy in ("recompute", *POLICIES):
        found.append(Row(f"fastckpt {policy} + {WHOLE_STEP}", fastckpt(policy, True, padded=True)))
    return found


def build(lora: bool, layers: int, tokens: int, device: torch.device, size: str) -> tuple[torch.nn.Module, dict]:
    """The model (seeded, at `size`'s widths) and its padded batch."""
    import peft
    import transformers

    hidden, intermediate, vocab = WIDTHS[size]
    config = transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, vocab_size=vocab, max_position_embeddings=tokens, pad_token_id=0,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    if lora:
        adapters = peft.LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS, init_lora_weights=False)
        model = peft.get_peft_model(model, adapters)
    model.to(device).train()
    return model, padded_batch(tokens, vocab, device, padding=tokens // 4)


def run_workload(lora: bool, size: str, device: torch.device) -> tuple[list[dict], dict[str, str]]:
    """The table of one workload (LoRA or full fine-tune), and the rows that failed."""
    layers, tokens, warmup, rounds = SIZES[size]
    base, batch = build(lora, layers, tokens, device, size)
    reference_model = copy.deepcopy(base)
    _step(reference_model, batch, hf_loss, autocast=False)
    reference = gradients(reference_model)
    del reference_model
    models, losses, failed = {}, {}, {}
    left_out = liger_available(device)
    for row in rows(liger=left_out is None):
        try:
            model = copy.deepcopy(base)
            row.prepare(model)
            models[row.name], losses[row.name] = model, row.loss or hf_loss
            _step(model, batch, losses[row.name])  # the trial step
            model.zero_grad(set_to_none=True)
        except Exception as err:  # reported in the table; the others go on
            failed[row.name] = error_line(err)
            models.pop(row.name, None)

    def timed(name: str) -> Callable[[], None]:
        def step() -> None:
            _step(models[name], batch, losses[name])
            models[name].zero_grad(set_to_none=True)

        return step

    results = {}

    def measure(name: str) -> None:
        """The peak of one step, and the error of the gradients that step left."""
        peak = peak_bytes(lambda: _step(models[name], batch, losses[name]), device)
        error = relative_error(gradients(models[name]), reference)
        models[name].zero_grad(set_to_none=True)
        results[name] = {"peak": peak, "error": error}

    for name in list(models):
        measure(name)
    notes = [] if left_out is None else [f"{LIGER}: left out ({left_out})"]
    if HF_GC in results:
        try:
            models[PLAN], note = _planned(base, batch, *_plan_budget(lora, results[HF_GC]["peak"], base))
            losses[PLAN] = hf_loss
            notes.append(f"{PLAN}: {note}")
            measure(PLAN)
        except Exception as err:
            failed[PLAN] = error_line(err)
            models.pop(PLAN, None)
    times, timing_failed = median_times({name: timed(name) for name in models}, device, warmup, rounds)
    failed.update(timing_failed)
    name = "llama-lora" if lora else "llama-full"
    heading = (f"{name}: {layers} layers, 1 x {tokens} tokens (last quarter padding), bf16 autocast, "
               f"{'LoRA r=8 on ' + '/'.join(LORA_TARGETS) if lora else 'full fine-tune'}")  # fmt: skip
    table = _table(name, heading, layers, tokens, results, times, failed, None if lora else trained_bytes(base))
    for note in notes:
        print(note)
    return table, failed


def _plan_budget(lora: bool, hf_gc_peak: int, base: torch.nn.Module) -> tuple[int, str]:
    """The plan row's budget in bytes (PLAN_FRACTION of the workload's target quantity), and how it was set."""
    fraction = PLAN_FRACTION[lora]
    if lora:
        return int(fraction * hf_gc_peak), f"{fraction:.0%} of HF GC's peak"
    grads = trained_bytes(base)
    return int(grads + fraction * (hf_gc_peak - grads)), f"the gradients + {fraction:.0%} of HF GC's peak less them"


def _planned(base: torch.nn.Module, batch: dict, budget: int, set_as: str) -> tuple[torch.nn.Module, str]:
    """The plan row: the loss head and padded attention on, the decoder layers and the loss head's chunk planned
    (hf.measure, then the plan) for `budget` bytes (`set_as` says how it was set; the smallest plan when it is
    infeasible), with PLAN_MAX_ERROR."""
    model = copy.deepcopy(base)
    hf.enable(model, loss_head=True, padded_attention=True)
    with quiet_profiler_logs():  # the planner's CPU memory trace runs the profiler
        measurements = hf.measure(model, batch, autocast=torch.bfloat16, repeats=1, max_error=PLAN_MAX_ERROR)
    try:
        plan = measurements.plan(budget)
        note = f"budget {budget / 2**20:.1f} MiB ({set_as})"
    except ValueError:
        plan = measurements.smallest_plan()
        note = f"{set_as} is infeasible; smallest plan {plan.budget / 2**20:.1f} MiB"
    note += f" (predicted {plan.predicted_peak / 2**20:.1f}, verified {plan.measured_peak / 2**20:.1f})"
    plan.apply()
    counts = {name: plan.policies.count(name) for name in dict.fromkeys(plan.policies)}
    note += "; layers: " + ", ".join(f"{count} x {name}" for name, count in counts.items())
    return model, note + (f"; {plan.tail.name}" if plan.tail is not None else "")  # the chunk the plan chose


def _table(workload, heading, layers, tokens, results, times, failed, trained_bytes=None) -> list[dict]:
    """Print and return the rows of one table ("== heading"); with `trained_bytes` (a full fine-tune), also the
    peak less the parameter gradients."""
    gc, plain = results[HF_GC], results[PLAIN]
    print(f"\n== {heading}")
    header = f"{'config':<62}{'peak MiB':>10}{'x HF GC':>9}{'ms/step':>10}{'x HF GC':>9}{'grad err':>10}{'x bf16':>8}"
    if trained_bytes is not None:
        header += f"{'peak-grads MiB':>16}{'x HF GC':>9}"
    print(header)
    table = []
    for config, r in results.items():
        row = {
            "workload": workload, "config": config, "layers": layers, "tokens": tokens,
            "peak_MiB": r["peak"] / 2**20, "peak_x_hf_gc": r["peak"] / gc["peak"],
            "ms_per_step": times[config] * 1e3 if config in times else None,
            "time_x_hf_gc": times[config] / times[HF_GC] if config in times and HF_GC in times else None,
            "grad_rel_l2": r["error"], "error_x_bf16": r["error"] / plain["error"],
        }  # fmt: skip
        if trained_bytes is not None:
            less = r["peak"] - trained_bytes
            row["peak_less_grads_MiB"] = less / 2**20
            row["less_grads_x_hf_gc"] = less / (gc["peak"] - trained_bytes)
        table.append(row)
        line = (f"{config:<62}{row['peak_MiB']:>10.1f}{row['peak_x_hf_gc']:>9.3f}"
                f"{fmt(row['ms_per_step'], '.0f'):>10}{fmt(row['time_x_hf_gc'], '.3f'):>9}"
                f"{row['grad_rel_l2']:>10.2e}{row['error_x_bf16']:>8.2f}")  # fmt: skip
        if trained_bytes is not None:
            line += f"{row['peak_less_grads_MiB']:>16.1f}{row['less_grads_x_hf_gc']:>9.3f}"
        print(line, flush=True)
    for config, error in failed.items():
        print(f"{config:<62}FAILED: {error}")
    return table


def scaling(size: str, device: torch.device, out: str | None) -> list[dict]:
    """Peak of plain, HF GC and fastckpt's best (BEST) against tokens and depth
    (llama-lora), and the fitted bytes per token per layer."""
    lengths, depths = SCALING[size]
    configs = {PLAIN: lambda m: None, HF_GC: hf_gc, BEST: fastckpt("recompute:int8+int8", True, padded=True)}
    points, peaks, longest = [], {}, None  # peaks: MiB by (layers, tokens, config); the axes share a size
    for axis, values in (("tokens", lengths), ("layers", depths)):
        for value in values:
            layers = value if axis == "layers" else SCALING_DEPTH[size]
            tokens = value if axis == "tokens" else SCALING_TOKENS[size]
            if (layers, tokens, PLAIN) not in peaks:
                is_longest = axis == "tokens" and value == lengths[-1]
                measured, at_length = _peaks(configs, layers, tokens, device, size, timed=is_longest)
                peaks.update(measured)
                if at_length is not None:
                    longest = at_length
            for config in configs:
                points.append({"axis": axis, "config": config, "layers": layers, "tokens": tokens,
                               "peak_MiB": peaks[layers, tokens, config]})  # fmt: skip
    print(f"\n== scaling (llama-lora): peak MiB vs tokens at {SCALING_DEPTH[size]} layers and vs layers at "
          f"{SCALING_TOKENS[size]} tokens")  # fmt: skip
    columns = "".join(f"{'T=' + str(v):>9}" for v in lengths) + "".join(f"{'L=' + str(v):>8}" for v in depths)
    print(f"{'config':<60}{columns}{'B/token/layer':>15}{'B/token':>10}")
    fits = []
    for config in configs:
        by_tokens = [p for p in points if p["config"] == config and p["axis"] == "tokens"]
        by_layers = [p for p in points if p["config"] == config and p["axis"] == "layers"]
        per_layer = _slope([p["layers"] for p in by_layers], [p["peak_MiB"] * 2**20 for p in by_layers])
        per_token = _slope([p["tokens"] for p in by_tokens], [p["peak_MiB"] * 2**20 for p in by_tokens])
        per_token_layer = per_layer / SCALING_TOKENS[size]
        fits.append({"config": config, "bytes_per_token_per_layer": per_token_layer, "bytes_per_token": per_token})
        cells = "".join(f"{p['peak_MiB']:>9.1f}" for p in by_tokens)
        cells += "".join(f"{p['peak_MiB']:>8.1f}" for p in by_layers)
        print(f"{config:<60}{cells}{per_token_layer:>15.0f}{per_token:>10.0f}")
    if longest is not None:
        layers, tokens = SCALING_DEPTH[size], lengths[-1]
        gc_s, best_s = longest.gc_seconds, longest.best_seconds
        ratio = peaks[layers, tokens, BEST] / peaks[layers, tokens, HF_GC]
        print(f"at {tokens} tokens, {layers} layers: {BEST} peak {ratio:.3f}x HF GC's, "
              f"time {best_s * 1e3:.0f} ms = {best_s / gc_s:.3f}x HF GC's {gc_s * 1e3:.0f} ms, "
              f"gradient error {longest.error_x_bf16:.2f}x bf16's own")  # fmt: skip
    if out:
        write_csv(points, out, "llm_scaling.csv")
        _plot(points, os.path.join(out, "llm_scaling.png"))
    return fits


@dataclass(frozen=True)
class Longest:
    """The scaling figure's longest length: HF GC's and BEST's median seconds per step (LONG_ROUNDS
    interleaved rounds) and BEST's gradient error against fp32 divided by plain bf16's."""

    gc_seconds: float
    best_seconds: float
    error_x_bf16: float


def _peaks(
    configs: dict, layers: int, tokens: int, device: torch.device, size: str, timed: bool = False
) -> tuple[dict[tuple, float], Longest | None]:
    """Whole-step peak MiB of each configuration on one size (by (layers, tokens, config)), after a trial
    step; with `timed`, also the Longest measurements there."""
    base, batch = build(True, layers, tokens, device, size)
    peaks, steps, models = {}, {}, {}
    for config, prepare in configs.items():
        model = models[config] = copy.deepcopy(base)
        prepare(model)

        def step(model=model) -> None:
            _step(model, batch, hf_loss)
            model.zero_grad(set_to_none=True)

        step()
        peaks[layers, tokens, config] = peak_bytes(step, device) / 2**20
        steps[config] = step
    if not timed:
        return peaks, None
    times = median_times({c: steps[c] for c in (HF_GC, BEST)}, device, 0, LONG_ROUNDS)[0]
    reference = copy.deepcopy(base)
    _step(reference, batch, hf_loss, autocast=False)
    expected = gradients(reference)
    del reference
    errors = {}
    for config in (PLAIN, BEST):  # the gradient error there, against fp32 (the error columns' measure)
        _step(models[config], batch, hf_loss)
        errors[config] = relative_error(gradients(models[config]), expected)
        models[config].zero_grad(set_to_none=True)
    return peaks, Longest(times[HF_GC], times[BEST], errors[BEST] / errors[PLAIN])


def _slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys against xs."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def _plot(points: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, axis, label in ((axes[0], "tokens", "sequence length (tokens)"), (axes[1], "layers", "decoder layers")):
        for config in dict.fromkeys(p["config"] for p in points):
            series = [p for p in points if p["config"] == config and p["axis"] == axis]
            ax.plot([p[axis] for p in series], [p["peak_MiB"] for p in series], marker="o", label=config)
        ax.set_xlabel(label)
        ax.set_ylabel("whole-step peak (MiB)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    figure.suptitle("Llama LoRA step, bf16 autocast: peak memory")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    print(f"wrote {path}")


SLOW_BF16 = 4.0  # a bf16 matmul this many times slower than fp32: the CPU has no native bf16 (warned)


def bf16_slowdown(size: int = 512) -> float:
    """How many times slower a [size x size] bf16 matmul runs than an fp32 one on the CPU (best of 3 each)."""
    times = []
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(size, size).to(dtype)
        runs = []
        for _ in range(3):
            start = time.perf_counter()
            a @ a
            runs.append(time.perf_counter() - start)
        times.append(min(runs))
    return times[1] / times[0]


def slow_bf16_warning(slowdown: float) -> str | None:
    if slowdown < SLOW_BF16:
        return None
    return (
        f"bf16 matmuls run {slowdown:.0f}x slower than fp32 here (no native bf16: AVX-512-BF16 or AMX on x86): "
        "this section's bf16 steps take about that much longer than on a CPU with it, and its times compare "
        "fallback kernels"
    )


def packed_batch(tokens: int, device: torch.device, vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    """steps.packed_batch at this section's vocabulary."""
    return _packed_batch(tokens, device, vocab)


PACKED_ROWS = {
    HF_GC: hf_gc,
    "fastckpt recompute+int8 + loss head": fastckpt("recompute+int8", True),
    f"fastckpt recompute+int8 + {WHOLE_STEP}": fastckpt("recompute+int8", True, padded=True),
}


def packed(size: str, device: torch.device, out: str | None) -> tuple[list[dict], dict[str, str]]:
    """HF GC and fastckpt on one row of packed sequences (llama-lora): the table (peak, time, gradient error)
    and the configurations whose timing failed."""
    layers, tokens, rounds = PACKED_SIZES[size]
    base, _ = build(True, layers, tokens, device, size)
    batch = packed_batch(tokens, device, WIDTHS[size][2])
    reference = copy.deepcopy(base)
    _step(reference, batch, hf_loss, autocast=False)
    expected = gradients(reference)
    del reference
    steps, results = {}, {}
    for config, prepare in {PLAIN: lambda m: None, **PACKED_ROWS}.items():
        model = copy.deepcopy(base)
        prepare(model)

        def step(model=model) -> None:
            _step(model, batch, hf_loss)
            model.zero_grad(set_to_none=True)

        step()  # the trial step
        peak = peak_bytes(lambda model=model: _step(model, batch, hf_loss), device)
        results[config] = {"peak": peak, "error": relative_error(gradients(model), expected)}
        model.zero_grad(set_to_none=True)
        steps[config] = step
    times, failed = median_times({c: steps[c] for c in PACKED_ROWS}, device, 0, rounds)
    heading = (f"packed sequences (llama-lora): {layers} layers, 1 x {tokens} tokens packed from "
               f"{len(PACKED_WEIGHTS)} sequences, bf16 autocast")  # fmt: skip
    table = _table("llama-lora-packed", heading, layers, tokens, results, times, failed)
    if out:
        write_csv(table, out, "llm_packed.csv")
    return table, failed


def main(device: str = "cpu", out: str | None = None, quick: bool = False, smoke: bool = False) -> list[dict]:
    size = "smoke" if smoke else "quick" if quick else "full"
    dev = torch.device(device)
    warning = slow_bf16_warning(bf16_slowdown()) if dev.type == "cpu" else None
    if warning:
        print(f"WARNING: {warning}", flush=True)
    lora, lora_failed = run_workload(True, size, dev)
    full, full_failed = run_workload(False, size, dev)
    if out:
        write_csv(lora, out, "llm_lora.csv")
        write_csv(full, out, "llm_full.csv")
    scaling(size, dev, out)
    packed_table, packed_failed = packed(size, dev, out)
    failed = {**lora_failed, **full_failed, **packed_failed}
    if failed:
        raise SystemExit(f"{len(failed)} configuration(s) of the llm section failed; see its tables")
    return lora + full + packed_table
