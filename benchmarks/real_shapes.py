"""The whole step at real model shapes: `python -m benchmarks real [--all] [--smoke]`.

Randomly initialised Hugging Face models at the configurations of Llama-3.2-1B (hidden 2048, 16 layers, 32 heads
/ 8 KV heads, MLP 8192, vocab 128,256, tied embeddings, rope theta 500,000), Qwen2.5-0.5B (hidden 896, 24 layers,
14 / 2 heads, MLP 4864, vocab 151,936, tied) and Gemma-2-2B (hidden 2304, 26 layers, 8 / 4 heads of 256, MLP
9216, vocab 256,000, final logit soft cap 30, attention soft cap 50, sliding window 4096): no download. bf16
autocast; LoRA (r=16 on all seven projections, B nonzero as in benchmarks/llm.py; the frozen weights in bf16 as
users load them, the adapters fp32) or the full fine-tune (fp32 weights: mixed precision); one row of padded
tokens (the first eighth left padding: attention mask 0, labels -100) or of packed sequences (position ids
starting again, as benchmarks/llm.py's packed section).

Rows: HF gradient checkpointing (the reference of the 'x HF GC' columns) and fastckpt's `recompute+int8` and
`recompute:int8+int8` with the loss head and padded attention (`hf.enable(model, policy=..., loss_head=True,
padded_attention=True)`); Gemma 2 runs in eager attention (transformers 5.23 has no sdpa path for its attention
soft cap), where padded attention does not apply: its fastckpt rows have the loss head alone. The gradient
error (relative L2 of the trained parameters' gradients against an fp32 step on an fp32 copy of the same weights,
divided by plain bf16 autocast's own) only where the workload says so: it needs the fp32 copy and a plain step,
which at these shapes cost more memory and time than the rows measured.

Each row's peak is measured on one step traced with `fastckpt.memory.MemoryTrace`, marks made by hooks on the
decoder layers, their attention and the final norm (forward, recompute in backward, and the layer's backward
after it): every block live at the peak is attributed to the phase that allocated it (`breakdown`), next to the
floor (`floor_bytes`: what must be live at the peak whatever the policy, the parameter gradients included).

By default (`make bench`) one workload: Llama-3.2-1B, 1,024 tokens, LoRA, padded, with the error columns (7-9
minutes on a 2-core CPU); `--all` adds the others (ALL: 6-16 minutes each there, the 4,096-token ones longer; some
two hours in all; Llama-3.2-1B's full fine-tune needs some 20 GB of memory); `--smoke` runs a tiny Llama once
(checks that everything runs; its numbers mean nothing).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from benchmarks.harness import median_times, quiet_profiler_logs, write_csv
from benchmarks.ops import _reuse_freed_host_memory
from benchmarks.steps import (
    HF_GC,
    PLAIN,
    Row,
    causal_lm,
    fastckpt,
    fmt,
    gradients,
    hf_gc,
    hf_loss,
    packed_batch,
    padded_batch,
    relative_error,
    sharing_copy,
    step,
)
from fastckpt.fits import LORA_TARGETS  # all seven projections, as fastckpt.fits measures them
from fastckpt.memory import MemoryTrace

WHOLE_STEP = "loss head + padded attention"


@dataclass(frozen=True)
class Shape:
    """A model's configuration: its transformers class family and the sizes that matter here."""

    family: str  # "llama", "qwen2" or "gemma2"
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    head_dim: int | None = None
    extra: dict = field(default_factory=dict)  # further config keywords
    attention: str = "sdpa"  # transformers 5.23 runs Gemma 2 (attention soft cap) in eager attention only


SHAPES = {
    "llama-3.2-1b": Shape("llama", 2048, 16, 32, 8, 8192, 128256, extra={"rope_theta": 500000.0}),
    "qwen2.5-0.5b": Shape("qwen2", 896, 24, 14, 2, 4864, 151936, extra={"rope_theta": 1000000.0}),
    "gemma-2-2b": Shape(
        "gemma2",
        2304,
        26,
        8,
        4,
        9216,
        256000,
        head_dim=256,
        extra={"final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0, "sliding_window": 4096},
        attention="eager",
    ),  # fmt: skip
    "smoke": Shape("llama", 64, 2, 4, 2, 160, 1024, extra={"rope_theta": 500000.0}),
}
CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "gemma2": "Gemma2ForCausalLM"}
CONFIGS = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "gemma2": "Gemma2Config"}


@dataclass(frozen=True)
class Workload:
    shape: str
    tokens: int
    lora: bool
    batch: str  # "padded" or "packed"
    error: bool = False  # with the gradient error columns (an fp32 copy and a plain step)
    rounds: int = 1  # timed rounds (interleaved)

    @property
    def name(self) -> str:
        return f"{self.shape} {self.tokens} {'LoRA' if self.lora else 'full'} {self.batch}"


DEFAULT = (Workload("llama-3.2-1b", 1024, True, "padded", error=True, rounds=2),)
# Gemma-2-2B's full fine-tune is left out: 2.6B fp32 weights and their gradients are 21 GB, more than this
# 24 GiB machine holds beside the rows' copies and the step.
ALL = (
    *DEFAULT,
    Workload("llama-3.2-1b", 1024, False, "padded"),
    Workload("llama-3.2-1b", 4096, True, "padded"),
    Workload("llama-3.2-1b", 4096, True, "packed"),
    Workload("qwen2.5-0.5b", 2048, True, "padded"),
    Workload("qwen2.5-0.5b", 2048, False, "padded"),
    Workload("qwen2.5-0.5b", 4096, True, "packed"),
    Workload("gemma-2-2b", 1024, True, "padded"),
    Workload("gemma-2-2b", 4096, True, "packed"),
)
SMOKE = (Workload("smoke", 64, True, "padded", error=True), Workload("smoke", 64, False, "packed"))


def rows(padded: bool = True) -> list[Row]:
    """HF GC and fastckpt's rows; `padded=False` (a model not in sdpa attention, which padded attention
    replaces): the fastckpt rows with the loss head alone."""
    options = WHOLE_STEP if padded else "loss head"
    return [
        Row(HF_GC, hf_gc),
        Row(f"fastckpt recompute+int8 + {options}", fastckpt("recompute+int8", True, padded=padded)),
        Row(f"fastckpt recompute:int8+int8 + {options}", fastckpt("recompute:int8+int8", True, padded=padded)),
    ]


def build(shape: Shape, lora: bool, tokens: int, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """The model (seeded) at `shape`: LoRA with frozen weights in `dtype` and fp32 adapters, or fp32 for a full
    fine-tune."""
    import peft
    import transformers

    config = getattr(transformers, CONFIGS[shape.family])(
        hidden_size=shape.hidden, intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab,
        tie_word_embeddings=True, max_position_embeddings=max(tokens, 8192), pad_token_id=0,
        **({} if shape.head_dim is None else {"head_dim": shape.head_dim}), **shape.extra,
    )  # fmt: skip
    config._attn_implementation = shape.attention
    torch.manual_seed(0)
    model = getattr(transformers, CLASSES[shape.family])._from_config(
        config, dtype=dtype if lora else torch.float32
    )
    if lora:
        adapters = peft.LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS, init_lora_weights=False)
        model = peft.get_peft_model(model, adapters)
    return model.train()


def batch_of(workload: Workload, vocab: int, device: torch.device) -> dict[str, torch.Tensor]:
    if workload.batch == "packed":
        return packed_batch(workload.tokens, device, vocab)
    return padded_batch(workload.tokens, vocab, device, padding=workload.tokens // 8, left=True)


# --- where the peak is -------------------------------------------------------------------------------------------

# The breakdown's columns: what the forward kept (the layers' stored inputs, the embeddings' output), the layer
# being recomputed, attention (forward or recompute), the loss head (its forward: the chunk, the gradients it
# computes there; its backward), a layer's backward after its recomputation (activation gradients, temporaries),
# the parameters' gradients (found by address at the step's end), anything else.
STORED = "stored"
RECOMPUTED = "recomputed"
ATTENTION = "attention"
HEAD = "loss head"
BACKWARD = "layer bwd"
GRADS = "param grads"
OTHER = "other"
CATEGORIES = (STORED, RECOMPUTED, ATTENTION, HEAD, BACKWARD, GRADS, OTHER)
# What each phase's allocations are (the phase's mark: hooks' keys' first letters, see traced_step):
# F forward of a layer (what it keeps: its output is the next layer's input, a checkpoint's stored form),
# FA / RA attention in forward / recompute, R a layer's recomputation, B its backward after it, head the final
# norm, LM head and loss in forward, backward the loss's backward before the last layer's, start the embeddings.
_PHASES = {"F": STORED, "FA": ATTENTION, "RA": ATTENTION, "R": RECOMPUTED, "B": BACKWARD, "head": HEAD,
           "backward": HEAD, "start": STORED}  # fmt: skip


def _phase(key: str) -> str:
    return key.rstrip("0123456789")


@dataclass
class Traced:
    """One traced step: its peak, the bytes live at the peak by category, and the phase the peak was in."""

    peak: int
    parts: dict[str, int]
    at: str


def traced_step(
    model: torch.nn.Module, batch: dict, loss: Callable, device: torch.device, autocast: bool = True
) -> Traced:
    """One step (bf16 autocast unless `autocast=False`) under MemoryTrace, marks from hooks; the blocks live at
    its peak by category."""
    base = causal_lm(model).model
    state = {"backward": False}
    trace = MemoryTrace(device)

    def mark(forward: str, backward: str | None = None) -> Callable:
        def hook(*args) -> None:
            key = backward if state["backward"] else forward
            if key is not None:
                trace.mark(key)

        return hook

    handles = [base.norm.register_forward_pre_hook(mark("head", None))]
    for i, layer in enumerate(base.layers):
        handles += [
            layer.register_forward_pre_hook(mark(f"F{i}", f"R{i}")),
            layer.register_forward_hook(mark(f"F{i}", f"B{i}")),  # forward: the next pre-hook marks anyway
            layer.self_attn.register_forward_pre_hook(mark(f"FA{i}", f"RA{i}")),
            layer.self_attn.register_forward_hook(mark(f"F{i}", f"R{i}")),
        ]
    try:
        with quiet_profiler_logs(), trace:
            trace.mark("start")
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                value = loss(model, batch)
            trace.mark("backward")
            state["backward"] = True
            value.backward()
    finally:
        for handle in handles:
            handle.remove()
    # a parameter's gradient: a block alive to the end at the address of a .grad (not one freed meanwhile whose
    # address a gradient reused)
    grads = {p.grad.data_ptr() for p in model.parameters() if p.grad is not None}
    kept = {(born, address) for born, freed, _, address in trace.lifetimes or [] if freed is None}
    keys = ["start", *(p.key for p in trace.points)]  # a block's phase: the key of the last mark before it
    parts = dict.fromkeys(CATEGORIES, 0)
    latest = 0
    for born, size, address in trace.at_peak or []:
        category = GRADS if address in grads and (born, address) in kept else _PHASES.get(_phase(keys[born]), OTHER)
        parts[category] += size
        latest = max(latest, born)
    return Traced(trace.peak, parts, keys[latest])


def floor_bytes(model: torch.nn.Module, shape: Shape, tokens: int) -> int:
    """What must be live at the peak whatever the policy (bf16 compute), at its largest over the backward: while
    layer i's backward runs, the inputs of layers 0..i at their smallest stored form (int8: a byte per element),
    the gradient of layer i's output (bf16), the widest activation the layer's gradients need (the MLP's [tokens,
    intermediate] input of its down projection) as int8 and its bf16 gradient, and the parameter gradients made
    so far (the layers after i, and the head's and embeddings' where they are trained). The loss head's chunk is
    left out: it can be made as small as one wants, at a cost in time."""
    layers = causal_lm(model).model.layers
    per_layer = [sum(p.numel() * p.element_size() for p in layer.parameters() if p.requires_grad) for layer in layers]
    outside = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) - sum(per_layer)
    working = tokens * shape.hidden * 2 + tokens * shape.intermediate * (1 + 2)
    return max(
        (i + 1) * tokens * shape.hidden + working + outside + sum(per_layer[i + 1 :]) for i in range(len(per_layer))
    )


# --- the table ---------------------------------------------------------------------------------------------------


def run(workload: Workload, device: torch.device) -> tuple[list[dict], dict[str, str]]:
    """One workload's rows (printed, with the peak's breakdown) and the rows that failed."""
    shape = SHAPES[workload.shape]
    started = time.perf_counter()
    base = build(shape, workload.lora, workload.tokens).to(device)
    batch = batch_of(workload, shape.vocab, device)
    reference = None
    measured: list[Row] = rows(padded=shape.attention == "sdpa")
    if workload.error:
        fp32 = copy.deepcopy(base).float()
        step(fp32, batch, autocast=False)
        reference = gradients(fp32)
        del fp32
        measured.insert(0, Row(PLAIN, lambda model: None))
    results, models, failed = {}, {}, {}
    for row in measured:
        try:
            model = sharing_copy(base)
            row.prepare(model)
            loss = row.loss or hf_loss
            if row.name != PLAIN:
                step(model, batch, loss)  # the trial step
                model.zero_grad(set_to_none=True)
            traced = traced_step(model, batch, loss, device)
            error = None if reference is None else relative_error(gradients(model), reference)
            model.zero_grad(set_to_none=True)
            results[row.name] = {"traced": traced, "error": error}
            if row.name != PLAIN:
                models[row.name] = (model, loss)
        except Exception as err:  # reported in the table; the others go on
            failed[row.name] = f"{type(err).__name__}: {err}".splitlines()[0]

    def timed(model: torch.nn.Module, loss: Callable) -> Callable[[], None]:
        def once() -> None:
            step(model, batch, loss)
            model.zero_grad(set_to_none=True)

        return once

    steps = {name: timed(*pair) for name, pair in models.items()}
    times, timing_failed = median_times(steps, device, 0, workload.rounds)
    failed.update(timing_failed)
    table = _table(workload, shape, base, results, times, failed)
    print(f"({workload.name}: {time.perf_counter() - started:.0f} s)", flush=True)
    return table, failed


def _table(
    workload: Workload, shape: Shape, model: torch.nn.Module, results: dict, times: dict, failed: dict
) -> list[dict]:
    tokens = workload.tokens
    print(f"\n== {workload.name}: {shape.layers} layers, hidden {shape.hidden}, vocab {shape.vocab:,}, 1 x {tokens} "
          f"tokens ({'first eighth left padding' if workload.batch == 'padded' else 'packed sequences'}), bf16 "
          f"autocast, {'LoRA r=16 on all seven projections' if workload.lora else 'full fine-tune'}")  # fmt: skip
    print(f"{'config':<62}{'peak MiB':>10}{'x HF GC':>9}{'s/step':>8}{'x HF GC':>9}{'grad err':>10}{'x bf16':>8}")
    gc = results.get(HF_GC)
    plain_error = results.get(PLAIN, {}).get("error")
    floor = floor_bytes(model, shape, tokens)
    table = []
    for config, r in results.items():
        peak = r["traced"].peak
        row = {
            "workload": workload.name, "config": config, "layers": shape.layers, "tokens": tokens,
            "peak_MiB": peak / 2**20, "peak_x_hf_gc": peak / gc["traced"].peak if gc else None,
            "s_per_step": times.get(config),
            "time_x_hf_gc": times[config] / times[HF_GC] if config in times and HF_GC in times else None,
            "grad_rel_l2": r["error"],
            "error_x_bf16": r["error"] / plain_error if r["error"] is not None and plain_error else None,
            "floor_MiB": floor / 2**20,
            **{f"at_peak_{name}_MiB": size / 2**20 for name, size in r["traced"].parts.items()},
            "peak_in": r["traced"].at,
        }  # fmt: skip
        table.append(row)
        print(f"{config:<62}{row['peak_MiB']:>10.1f}{fmt(row['peak_x_hf_gc'], '.3f'):>9}"
              f"{fmt(row['s_per_step'], '.1f'):>8}{fmt(row['time_x_hf_gc'], '.3f'):>9}"
              f"{fmt(row['grad_rel_l2'], '.2e'):>10}{fmt(row['error_x_bf16'], '.2f'):>8}", flush=True)  # fmt: skip
    for config, error in failed.items():
        print(f"{config:<62}FAILED: {error}")
    print(f"floor (during a layer's backward: the inputs still stored as int8, the gradients made so far, its "
          f"output's gradient, its MLP activation as int8 and that one's gradient): {floor / 2**20:.1f} MiB"
          + (f" = {floor / gc['traced'].peak:.3f}x HF GC" if gc else ""))  # fmt: skip
    print(f"live at the peak, MiB: {'config':<52}" + "".join(f"{name:>12}" for name in CATEGORIES) + "  peak in")
    for config, r in results.items():
        cells = "".join(f"{size / 2**20:>12.1f}" for size in r["traced"].parts.values())
        print(f"{'':<23}{config:<52}{cells}  {r['traced'].at}")
    return table


def main(device: str = "cpu", out: str | None = None, every: bool = False, smoke: bool = False) -> list[dict]:
    dev = torch.device(device)
    if dev.type == "cpu" and _reuse_freed_host_memory():
        # As the checkpoint and loss benchmarks (and `make bench` before this section): freed blocks are reused, as
        # by torch's CUDA caching allocator, rather than every large buffer paging in fresh memory.
        print("(CPU: glibc malloc set to reuse freed memory)")
    table, failed = [], {}
    for workload in SMOKE if smoke else ALL if every else DEFAULT:
        rows_, failed_ = run(workload, dev)
        table += rows_
        failed.update({f"{workload.name}: {name}": error for name, error in failed_.items()})
    if out:
        write_csv(table, out, "real_shapes.csv")
    if failed:
        raise SystemExit(f"{len(failed)} configuration(s) of the real-shapes section failed; see its tables")
    return table


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.real_shapes", description=__doc__.split("\n\n")[0])
    parser.add_argument("--all", action="store_true", help="every workload (ALL), not only the default one")
    parser.add_argument("--smoke", action="store_true", help="a tiny Llama, once")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    main(out=args.out, every=args.all, smoke=args.smoke)
