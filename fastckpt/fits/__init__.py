"""What fits: the longest sequence, and the largest batch at a given length, that a fine-tune of a transformers
model holds in a memory size, under HF gradient checkpointing and under fastckpt, answered before the run.

    python -m fastckpt.fits llama-3.2-1b --lora 16 --memory 24GiB,80GiB --batch-at 4096
    python -m fastckpt.fits path/to/config.json --full --memory 80GiB --verify 2048

    report = fastckpt.fits.what_fits("qwen2.5-0.5b", lora=16, memory=["24GiB", "80GiB"])
    print(report.table())

How. The model is built from its configuration with random weights at two and at three layers, and its training
step (one row of tokens: forward with the loss, backward) is measured on this machine at two lengths for each
method, in phases (each decoder layer's parts, forward and recomputed). Each phase's peak above what was live
before the step is a line in the tokens; the step's peak at a length is the highest of them there
(`prediction.Peak`), carried linearly in the layers to the model's depth (the layer inputs the backward needs grow
with both).
The device total adds what is live before the step at the model's depth, counted on the meta device without
allocating it: the weights and AdamW's state of the trained parameters (two fp32 tensors each); for a full
fine-tune, whose AdamW step (`foreach`) holds every gradient and temporaries of their size, that step too. The
longest length is where that total reaches the memory size; a batch of B rows of N tokens is taken as B x N tokens
(true of the activations; attention's working set is per row, and memory-efficient attention keeps it linear).

What a run on a CPU does not see of a GPU (the report says it): the attention kernel (CUDA's flash and
memory-efficient SDPA kernels are linear in the length like the CPU's; an eager or math attention is quadratic), the
CUDA caching allocator's reserve above what is allocated, and the CUDA context and library workspaces (some hundreds
of MiB, outside any tensor). bf16 autocast on a CPU without AMX is emulated and slow: `compute="fp32"` measures in
fp32 there, whose activations are twice bf16's (the report says which was measured).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from fastckpt.fits.prediction import HF_GC, Method, Report
from fastckpt.heads import default_chunk_size
from fastckpt.integrations.hf.tiled_mlp import default_tile
from fastckpt.memory import MemoryTrace
from fastckpt.planner.budgets import total_bytes
from fastckpt.policies import Policy
from fastckpt.storage import offload

_NAME = "fastckpt.fits"
# The two depths measured. At one layer the only layer is also the last, whose backward starts beside what the
# loss's backward leaves (the gradient into it, its dequantized input): Llama-3.2-1B LoRA under recompute+int8 at
# 4,096 tokens (fp32) peaked at 687, 727 and 735 MiB at 1, 2 and 3 layers, so 1 -> 2 layers carried 40 MiB a layer
# to the model's depth where each layer adds 8 (its stored input). An offload policy's backward also holds the
# layer it runs and the one it prefetches: from two layers on each layer adds what it keeps on the device.
DEPTHS = (2, 3)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAM_STATE_BYTES = 8  # AdamW's two fp32 tensors per trained element

# Configurations of models users fine-tune (random weights: nothing is downloaded); a path to a config.json (or a
# directory holding one) works for any other.
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {
        "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "rope_theta": 500000.0,
        "tie_word_embeddings": True,
    },
    "llama-3.1-8b": {
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "rope_theta": 500000.0,
        "tie_word_embeddings": False,
    },
    "qwen2.5-0.5b": {
        "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936, "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
    },
    "tiny-llama": {  # for tests and a first try: seconds on any machine
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024, "rope_theta": 500000.0,
        "tie_word_embeddings": True,
    },
}  # fmt: skip


def parse_memory(text: str | int) -> int:
    """'24GiB', '80 GB', 2**30 -> bytes."""
    if isinstance(text, int) and not isinstance(text, bool) and text > 0:
        return text
    try:
        return total_bytes(str(text))
    except ValueError:
        raise ValueError(
            f"{_NAME}: `memory` must be a size such as '24GiB' or '80GB' (or bytes), got {text!r}"
        ) from None


def load_config(model: str | dict[str, Any]) -> Any:
    """A transformers config from a known shape's name, a config.json path (or its directory), or a dict."""
    import transformers

    if isinstance(model, dict):
        values = dict(model)
    elif model in SHAPES:
        values = dict(SHAPES[model])
    else:
        path = os.path.join(model, "config.json") if os.path.isdir(model) else model
        if not os.path.isfile(path):
            raise ValueError(
                f"{_NAME}: `model` must be one of {', '.join(SHAPES)}, a config.json or a directory holding one; "
                f"got {model!r}"
            )
        with open(path) as f:
            values = json.load(f)
    if "model_type" not in values:
        raise ValueError(f"{_NAME}: the configuration has no 'model_type' (which transformers model is it?)")
    model_type = values.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, **values)
    config.pad_token_id = config.pad_token_id if config.pad_token_id is not None else 0
    return config


def at_depth(config: Any, layers: int) -> Any:
    """A copy of `config` with `layers` decoder layers (per-layer lists cut to them)."""
    config = type(config).from_dict(config.to_dict())
    config.num_hidden_layers = layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:layers]
    return config


def build(config: Any, lora: int | None, dtype: torch.dtype, device: torch.device | str = "cpu") -> Any:
    """The causal LM at `config` (seeded random weights): frozen weights in `dtype` with LoRA adapters of rank
    `lora` (fp32) on the attention and MLP projections, or all weights trained (fp32: mixed precision)."""
    import transformers

    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype if lora else torch.float32)
    if lora:
        import peft

        targets = [t for t in LORA_TARGETS if any(name.endswith(t) for name, _ in model.named_modules())]
        adapters = peft.LoraConfig(r=lora, lora_alpha=2 * lora, target_modules=targets, init_lora_weights=False)
        model = peft.get_peft_model(model, adapters)
    return model.train()


def live_before_step(config: Any, lora: int | None, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes of the weights and AdamW's state, bytes of the trained parameters) at `config`'s depth, counted on
    the meta device."""
    model = build(config, lora, dtype, "meta")
    unique = {id(p): p for p in model.parameters()}.values()
    weights = sum(p.numel() * p.element_size() for p in unique)
    trained = sum(p.numel() for p in unique if p.requires_grad)
    return weights + ADAM_STATE_BYTES * trained, trained * 4


def _step(model: Any, tokens: int, vocab: int, device: torch.device, autocast: bool,
          backward_starts: Callable[[], object] = lambda: None) -> Callable[[], None]:  # fmt: skip
    generator = torch.Generator().manual_seed(tokens)
    ids = torch.randint(1, vocab, (1, tokens), generator=generator).to(device)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        backward_starts()
        loss.backward()
        for p in model.parameters():
            p.grad = None

    return step


@contextlib.contextmanager
def _phases(model: Any, trace: MemoryTrace) -> Iterator[Callable[[], None]]:
    """Mark the trace where each decoder layer (transformers' GradientCheckpointingLayer) and each of its
    children starts and ends, forward or in the backward (recomputed), so its points are the step's phases; yields
    what the step calls as its backward starts. A phase run several times (a tiled MLP's tiles) is one key."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    backward = [False]

    def marker(key: str) -> Callable[..., None]:
        return lambda *args: trace.mark(("B " if backward[0] else "F ") + key)

    handles = []
    layers = [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]
    for i, layer in enumerate(layers):
        for name, module in [("", layer), *layer.named_children()]:
            key = f"{i}.{name}" if name else str(i)
            handles += [module.register_forward_pre_hook(marker(key + " in")),
                        module.register_forward_hook(marker(key + " out"))]  # fmt: skip

    def backward_starts() -> None:
        trace.mark("backward")
        backward[0] = True

    try:
        yield backward_starts
    finally:
        for handle in handles:
            handle.remove()


def _prepare(model: Any, policy: str | None) -> None:  # policy None: HF GC
    if policy is None:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        from fastckpt.integrations import hf
        from fastckpt.integrations.hf import gateway

        padded = gateway.attention_implementations(model) == {"sdpa"}
        hf.enable(model, policy=policy, loss_head=True, padded_attention=padded)


def measure_steps(config: Any, policy: str | None, lora: int | None, dtype: torch.dtype, layers: int,
                  lengths: Sequence[int], device: torch.device,
                  autocast: bool) -> dict[int, tuple[dict[str, int], int]]:  # fmt: skip
    """Per length, the peak of each phase of the step above what was live before it (`_phases`; their largest is
    the step's peak) and the host bytes its offloaded tensors took: fastckpt's `policy` (None: HF GC) on the model
    at `layers`, one row."""
    model = build(at_depth(config, layers), lora, dtype, device)
    _prepare(model, policy)
    measured = {}
    for tokens in lengths:
        _step(model, tokens, config.vocab_size, device, autocast)()  # warm-up: what is allocated once is not the step's
        with offload.copies_apart(device) as arena, MemoryTrace(device) as trace, _phases(model, trace) as starts:
            _step(model, tokens, config.vocab_size, device, autocast, starts)()
        phases: dict[str, int] = {}
        for point in trace.points:
            phases[point.key] = max(phases.get(point.key, 0), point.peak_before)
        measured[tokens] = (phases, arena.allocated_bytes)
    return measured


def what_fits(
    model: str | dict[str, Any],
    *,
    lora: int | None = 16,
    memory: Sequence[str | int] | str | int = ("24GiB", "80GiB"),
    policy: str | Sequence[str] = "recompute+int8",
    dtype: str = "bf16",
    compute: str | None = None,
    lengths: tuple[int, int] | None = None,
    layers: tuple[int, int] | None = None,
    batch_at: int | None = None,
    verify: int | None = None,
    device: str = "cpu",
    log: Callable[[str], object] = lambda message: None,
) -> Report:
    """The longest sequence (and the largest batch at `batch_at` tokens) that fits each `memory` size, under HF
    gradient checkpointing and under fastckpt's `policy` (`hf.enable(model, policy, loss_head=True,
    padded_attention=True)`; several policies: a row each), for the model at `model` (a name in SHAPES, a
    config.json path, or a dict).

    Args:
        lora: LoRA rank on the attention and MLP projections (the frozen weights in `dtype`); None: a full
            fine-tune (fp32 weights, AdamW stepped after the backward).
        dtype: the frozen weights' dtype under LoRA, "bf16" or "fp32" (what is counted live before the step).
        compute: "bf16" (autocast) or "fp32" (the steps measured on an fp32 model); default bf16 where it is
            native (a GPU, a CPU with AMX), else fp32.
        lengths, layers: the two lengths and the two depths measured (default 2 and 3: see DEPTHS); by default
            (`default_lengths`) the lengths are long enough that the loss head's chunk and the MLP's tile stop
            growing with them, per method: from two shorter lengths the line would carry the growth of a
            whole-length chunk or tile. An offload policy's host copies are counted apart (host memory on a
            GPU; on a CPU measured outside the peak).
        verify: also run the step at this many tokens (at the deeper depth measured) and report the prediction's
            error there.
        log: called with a line before each measurement (the command line prints them: a real shape takes minutes).
    """
    memories = [parse_memory(m) for m in ([memory] if isinstance(memory, (str, int)) else memory)]
    if not memories:
        raise ValueError(f"{_NAME}: `memory` names no size")
    config = load_config(model)
    policies = [policy] if isinstance(policy, str) else list(policy)
    for each in policies:
        Policy.parse(each)  # a bad policy fails here, not after minutes of measuring
    layers = layers or (DEPTHS if config.num_hidden_layers >= DEPTHS[1] else (1, 2))
    _check(lora, dtype, compute, lengths, layers, batch_at, verify)
    dev = torch.device(device)
    compute = compute or ("bf16" if native_bf16(dev) else "fp32")
    weights_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    resident, trained_bytes = live_before_step(config, lora, weights_dtype)
    # fp32 compute measures an fp32 model (bf16 frozen weights without autocast would compute in bf16)
    measured_dtype = torch.float32 if compute == "fp32" else weights_dtype
    # a full fine-tune's AdamW (foreach) step: every gradient and as many bytes of temporaries
    optimizer_step = 0 if lora else 2 * trained_bytes
    methods = []
    for name, each in [(HF_GC, None), *((f"fastckpt {each}", each) for each in policies)]:
        at = lengths or default_lengths(config, tiled=each is not None)
        phases, host = {}, {}
        for depth in layers:
            log(f"{_NAME}: {name} at {depth} layer(s), {at[0]:,} and {at[1]:,} tokens ({compute})")
            steps = measure_steps(config, each, lora, measured_dtype, depth, at, dev, compute == "bf16")
            phases.update({(depth, tokens): peaks for tokens, (peaks, _) in steps.items()})
            host.update({(depth, tokens): offloaded for tokens, (_, offloaded) in steps.items()})
        methods.append(Method(name, phases, config.num_hidden_layers, resident, optimizer_step, host, each))
    label = model if isinstance(model, str) else config.model_type
    what = f"LoRA r={lora}, frozen weights {dtype}" if lora else "full fine-tune, fp32 weights"
    description = (f"{config.model_type}, {config.num_hidden_layers} layers, hidden {config.hidden_size}, vocab "
                   f"{config.vocab_size:,}; {what}, AdamW; one row of tokens")  # fmt: skip
    on = f"{dev.type}" + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else "")
    report = Report(str(label), description, memories, methods, batch_at, on, compute, tuple(layers))
    if verify:
        free = free_memory(dev)
        for method in methods:
            predicted = int(dataclasses.replace(method, depth=layers[1]).peak().at(verify))
            if predicted > free:  # it would be killed for memory (or swap for hours): said, not run
                report.unverified[method.name] = (verify, predicted, free)
                continue
            log(f"{_NAME}: {method.name} at {layers[1]} layers, {verify:,} tokens (the check)")
            ((peaks, _),) = measure_steps(
                config, method.policy, lora, measured_dtype, layers[1], [verify], dev, compute == "bf16"
            ).values()
            report.verified[method.name] = (verify, max(peaks.values()), predicted)
    return report


def free_memory(device: torch.device) -> int:
    """Bytes a step may still take here: CUDA's free memory, or the host's available memory less a fifth (what a
    process's own copies and the allocator's slack take beside the step's tensors)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return 2**62  # unknown: try it
    return int(0.8 * available)


def default_lengths(config: Any, tiled: bool = True) -> tuple[int, int]:
    """Two lengths, the second twice the first, where neither the loss head's chunk nor (`tiled`: fastckpt's
    steps) the MLP's tile grows any more with the length: at least four chunks and one tile, and 512 tokens, in
    multiples of 256. Below them a line through two lengths would carry the growth of a whole-length chunk or
    tile on. HF GC's step is linear in the length from any length (whole logits, whole MLP)."""
    first = max(512, 4 * default_chunk_size(config.vocab_size), default_tile(config) if tiled else 0)
    first = -(-first // 256) * 256
    return first, 2 * first


def native_bf16(device: torch.device) -> bool:
    """Whether bf16 matmuls run natively on `device`: a GPU, or a CPU with AMX (elsewhere a CPU emulates them, many
    times slower than fp32)."""
    if device.type == "cuda":
        return True
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_bf16" in f.read()
    except OSError:
        return False


def _check(lora: Any, dtype: Any, compute: Any, lengths: Any, layers: Any, batch_at: Any, verify: Any) -> None:
    def positive_int(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1

    if lora is not None and not positive_int(lora):
        raise ValueError(f"{_NAME}: `lora` must be a rank >= 1 or None (a full fine-tune), got {lora!r}")
    if dtype not in ("bf16", "fp32"):
        raise ValueError(f"{_NAME}: `dtype` must be 'bf16' or 'fp32', got {dtype!r}")
    if compute not in (None, "bf16", "fp32"):
        raise ValueError(f"{_NAME}: `compute` must be 'bf16', 'fp32' or None, got {compute!r}")
    for name, pair in (("lengths", lengths or (1, 2)), ("layers", layers)):
        if len(pair) != 2 or not all(positive_int(v) for v in pair) or pair[0] >= pair[1]:
            raise ValueError(f"{_NAME}: `{name}` must be two increasing positive integers, got {pair!r}")
    for name, value in (("batch_at", batch_at), ("verify", verify)):
        if value is not None and not positive_int(value):
            raise ValueError(f"{_NAME}: `{name}` must be a positive number of tokens or None, got {value!r}")


def main(argv: Sequence[str] | None = None) -> Report:
    parser = argparse.ArgumentParser(prog=f"python -m {_NAME}", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help=f"one of {', '.join(SHAPES)}, a config.json, or a directory holding one")
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--lora", type=int, default=16, help="LoRA rank (default 16)")
    kind.add_argument("--full", action="store_true", help="a full fine-tune instead of LoRA")
    parser.add_argument("--memory", default="24GiB,80GiB", help="memory sizes, comma-separated (default 24GiB,80GiB)")
    parser.add_argument("--policy", default="recompute+int8",
                        help="fastckpt's policy, or several comma-separated (default recompute+int8)")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="LoRA's frozen weights")
    parser.add_argument("--compute", default=None, choices=["bf16", "fp32"], help="default: bf16 where native")
    parser.add_argument("--lengths", default=None, help="the two lengths measured (default: past the head's chunk)")
    parser.add_argument("--layers", default=None, help="the two depths measured (default 2,3)")
    parser.add_argument("--batch-at", type=int, default=None, help="also the largest batch of rows this long")
    parser.add_argument("--verify", type=int, default=None, help="run the step at this length to check the line")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    report = what_fits(
        args.model, lora=None if args.full else args.lora, memory=args.memory.split(","), policy=args.policy.split(","),
        dtype=args.dtype, compute=args.compute, lengths=args.lengths and _pair(args.lengths, "--lengths"),
        layers=args.layers and _pair(args.layers, "--layers"), batch_at=args.batch_at, verify=args.verify,
        device=args.device,
        log=lambda message: print(message, file=sys.stderr, flush=True),
    )  # fmt: skip
    print(report.table())
    return report


def _pair(text: str, flag: str) -> tuple[int, int]:  # "512,1024" -> (512, 1024)
    try:
        first, second = (int(v) for v in text.split(","))
    except ValueError:
        raise SystemExit(f"{_NAME}: {flag} takes two integers separated by a comma, got {text!r}") from None
    return first, second

