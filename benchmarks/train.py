"""Training on real data: does storing activations compressed change where training ends up?

A small character-level GPT learns Python source text (the standard library's own modules, read
from this interpreter's installation, so it needs no download). Every configuration starts from
the same initial weights and sees the same batches; the report is the final training loss (mean
of the last steps) and the held-out loss, each against plain training.

Then the optimizer stepped in the backward (fastckpt.optimizer_in_backward) on the same GPT with clipping at 1.0,
against the plain loop with the same clipping: the final losses should agree (the updates are the same up to
the clipping's summation order).

Then the LLM job: LoRA (PEFT, r=8 on q/v/up/down) on a small Hugging Face Llama over the same text, bf16
autocast, 300 AdamW steps, plain bf16 against HF gradient checkpointing and fastckpt's whole-step
configurations (a policy with the loss head): the final loss of each against plain bf16's.
"""

from __future__ import annotations

import sysconfig
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import fastckpt
import fastckpt.planner
from benchmarks.harness import error_line, finish, quiet_profiler_logs
from benchmarks.workloads import GPT2Block

CORPUS_FILES = ["argparse.py", "ast.py", "dataclasses.py", "enum.py", "functools.py", "inspect.py", "pathlib.py",
                "subprocess.py", "typing.py", "threading.py"]  # fmt: skip
PLAN_BUDGET = 0.5  # the planned row: fastckpt.plan at this fraction of stock checkpoint's peak
# The policies it may choose from: the defaults, the attention kept int8, and (batches of 16) batch slices.
PLAN_CANDIDATES = tuple(fastckpt.planner.extended_candidates(batch_slices=[2, 4]))
PLAN_MAX_ERROR = 5e-2  # and the gradient error each may show (the bound; without it int4 plans lost 1.5%)


@dataclass(frozen=True)
class Planned:
    """A row whose blocks get the policies fastckpt.plan chooses for `fraction` of stock checkpoint's peak (or
    for the smallest feasible budget, when that fraction is infeasible)."""

    fraction: float

    def __str__(self) -> str:
        return f"plan {self.fraction:.0%}"


POLICIES = [None, "recompute", "int8", "fp8", "int4", "int2", Planned(PLAN_BUDGET)]


def corpus(device: torch.device) -> torch.Tensor:
    """The training text as a uint8 tensor of bytes."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = b"".join((stdlib / name).read_bytes() for name in CORPUS_FILES if (stdlib / name).exists())
    if len(text) < 200_000:
        raise RuntimeError(f"benchmarks.train: found only {len(text)} bytes of stdlib source under {stdlib}")
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).to(device)


class CharGPT(nn.Module):
    def __init__(self, dim: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        self.position = nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.ModuleList(GPT2Block(dim, heads, dropout=0.0) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 256)

    def forward(self, tokens: torch.Tensor, policy: str | None) -> torch.Tensor:
        h = self.embed(tokens) + self.position
        for block in self.blocks:
            h = block(h) if policy is None else fastckpt.checkpoint(block, h, policy=policy)
        return self.head(self.norm(h))


def batches(data: torch.Tensor, steps: int, batch: int, seq: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - seq - 1, (steps, batch), generator=generator)
    return [torch.stack([data[s : s + seq + 1] for s in row.tolist()]).long() for row in starts]


def _loss(model: CharGPT, tokens: torch.Tensor, policy: str | None) -> torch.Tensor:
    logits = model(tokens[:, :-1], policy)
    return nn.functional.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))


def apply_plan(model: CharGPT, tokens: torch.Tensor, fraction: float) -> tuple[str, str]:
    """Plan the model's blocks for `fraction` of stock checkpoint's peak on a training step of `tokens`
    (the smallest plan if that one is infeasible) and apply the plan; returns (budget, policies)."""

    def step() -> None:
        _loss(model, tokens, None).backward()
        model.zero_grad(set_to_none=True)

    with quiet_profiler_logs():  # the planner's CPU memory trace runs the profiler
        measurements = fastckpt.planner.measure(
            model, step, candidates=PLAN_CANDIDATES, repeats=1, max_error=PLAN_MAX_ERROR
        )
    try:
        plan = measurements.plan(f"{100 * fraction:g}%")
        budget = f"{fraction:.0%} of stock's peak"
    except ValueError:
        plan = measurements.smallest_plan()
        budget = f"{plan.budget / measurements.reference_peak:.0%} of stock's peak ({fraction:.0%} is infeasible)"
    plan.apply()
    return budget, ", ".join(plan.policies)


def train(
    policy: str | Planned | None, data: torch.Tensor, val: list[torch.Tensor], steps: int, device: torch.device,
    clip: float | None = None, in_backward: bool = False, name: str | None = None,
) -> dict:  # fmt: skip
    dim, layers, heads, seq, batch = (256, 4, 4, 128, 32) if device.type == "cuda" else (128, 4, 4, 64, 16)
    torch.manual_seed(0)
    model = CharGPT(dim, layers, heads, seq).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    if in_backward:
        optimizer = fastckpt.optimizer_in_backward(optimizer, max_grad_norm=clip)
    training = batches(data, steps, batch, seq, seed=1)
    note = ""
    if isinstance(policy, Planned):  # measured on the first batch; no dropout, so no RNG is consumed
        budget, chosen = apply_plan(model, training[0].to(device), policy.fraction)
        note = f"{policy}: budget {budget}; blocks: {chosen}"
    per_call = None if isinstance(policy, Planned) else policy
    losses = []
    start = time.perf_counter()
    for tokens in training:
        loss = _loss(model, tokens, per_call)
        optimizer.zero_grad(set_to_none=True)
        if in_backward:
            optimizer.backward(loss)  # with clipping: a norm pass, then the step pass
        else:
            loss.backward()
            if clip is not None:
                nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        losses.append(loss.item())
    seconds = time.perf_counter() - start
    with torch.no_grad():
        val_loss = sum(
            nn.functional.cross_entropy(model(t[:, :-1], None).reshape(-1, 256), t[:, 1:].reshape(-1)).item()
            for t in val
        ) / len(val)
    tail = losses[-max(steps // 10, 1) :]
    return {"policy": name or str(policy or "plain"), "final_train_loss": sum(tail) / len(tail), "val_loss": val_loss,
            "seconds": seconds, "note": note}  # fmt: skip


# The optimizer in the backward: name -> (policy, stepped in the backward), all clipping at 1.0.
CLIPPED = {
    "plain, clip 1.0": (None, False),
    "AdamW in backward, clip 1.0": (None, True),
    "recompute+int8 + AdamW in backward, clip 1.0": ("recompute+int8", True),
}

LORA_TARGETS = ["q_proj", "v_proj", "up_proj", "down_proj"]
# The LoRA job's configurations: None is plain bf16, "HF GC" HF's checkpointing, else (policy, loss head).
LORA_CONFIGS = {
    "plain bf16": None,
    "HF GC": "HF GC",
    "fastckpt recompute+int8 + loss head + padded attention": "recompute+int8",
    "fastckpt recompute:int8+int8 + loss head + padded attention": "recompute:int8+int8",
}


def padded(tokens: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The batch as a padded one: each row keeps its first half to all of its tokens (right padding: attention
    mask 0, labels -100 after them)."""
    seq = tokens.shape[1]
    lengths = torch.randint(seq // 2, seq + 1, (tokens.shape[0], 1), generator=generator)
    mask = (torch.arange(seq)[None, :] < lengths).long()
    return {"input_ids": tokens, "attention_mask": mask, "labels": tokens.masked_fill(mask == 0, -100)}


def train_lora(name: str, data: torch.Tensor, val: list[torch.Tensor], steps: int, device: torch.device) -> dict:
    """LoRA on a small random-init Llama over the byte text, bf16 autocast, padded batches (`padded`); the same
    weights and batches for all."""
    import peft
    import transformers

    from fastckpt.integrations import hf

    layers, hidden, seq, batch = (4, 256, 256, 16) if device.type == "cuda" else (4, 128, 128, 8)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq + 1, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    adapters = peft.LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS, lora_dropout=0.0)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(config), adapters).to(device).train()
    setting = LORA_CONFIGS[name]
    if setting == "HF GC":
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    elif setting is not None:
        hf.enable(model, policy=setting, loss_head=True, padded_attention=True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    start = time.perf_counter()
    lengths = torch.Generator().manual_seed(2)
    for tokens in batches(data, steps, batch, seq, seed=1):
        inputs = {key: value.to(device) for key, value in padded(tokens, lengths).items()}
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(**inputs, use_cache=False).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    seconds = time.perf_counter() - start
    model.eval()
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        val_loss = sum(model(input_ids=t.to(device), labels=t.to(device)).loss.item() for t in val) / len(val)
    tail = losses[-max(steps // 10, 1) :]
    return {"policy": name, "final_train_loss": sum(tail) / len(tail), "val_loss": val_loss, "seconds": seconds,
            "note": ""}  # fmt: skip


def _print_losses(rows: list[dict], width: int) -> None:
    plain = rows[0]
    print(f"{'configuration':<{width}}{'train loss':>12}{'vs plain':>10}{'val loss':>10}{'vs plain':>10}{'seconds':>9}")
    for r in rows:
        r["train_vs_plain"] = r["final_train_loss"] / plain["final_train_loss"] - 1
        r["val_vs_plain"] = r["val_loss"] / plain["val_loss"] - 1
        print(
            f"{r['policy']:<{width}}{r['final_train_loss']:>12.4f}{r['train_vs_plain']:>+10.2%}"
            f"{r['val_loss']:>10.4f}{r['val_vs_plain']:>+10.2%}{r['seconds']:>9.1f}"
        )


def _each(configs: Iterable[Any], run: Callable[[Any], dict], failed: dict[str, str]) -> list[dict]:
    """`run(config)` for each config; a failure is noted in `failed` (reported below), except the first
    config's (the plain reference): that one stops the benchmark."""
    rows = []
    for config in configs:
        try:
            rows.append(run(config))
        except Exception as err:
            if not rows:
                raise
            failed[str(config)] = error_line(err)
    return rows


SECTIONS = ("policies", "in-backward", "lora")  # the storage policies, the optimizer in the backward, the LoRA job


def main(device: str = "cpu", out: str | None = None, quick: bool = False,
         sections: Iterable[str] = SECTIONS) -> list[dict]:  # fmt: skip
    """Train once per policy, then with the optimizer in the backward, then the LoRA job once per configuration
    (each of `sections`); print final losses against plain."""
    dev = torch.device(device)
    text = corpus(dev)
    split = int(len(text) * 0.9)
    steps = 60 if quick else 300
    seq = 128 if dev.type == "cuda" else 64
    val = batches(text[split:], 8, 16, seq, seed=2)
    failed: dict[str, str] = {}
    rows, clipped, lora_rows = [], [], []
    if "policies" in sections:
        rows = _each(POLICIES, lambda policy: train(policy, text[:split], val, steps, dev), failed)
        print(f"char-level GPT on {len(text) / 1e6:.2f} MB of Python stdlib source, {steps} AdamW steps, "
              f"device {device}")  # fmt: skip
        _print_losses(rows, 12)
        for r in rows:
            if r["note"]:
                print(r["note"])
    if "in-backward" in sections:
        clipped = _each(
            CLIPPED, lambda name: train(CLIPPED[name][0], text[:split], val, steps, dev, 1.0, CLIPPED[name][1], name),
            failed,
        )  # fmt: skip
        print(f"\nThe char-level GPT, AdamW stepped after or in the backward (fastckpt.optimizer_in_backward), "
              f"clipping at 1.0, {steps} steps, device {device}")  # fmt: skip
        _print_losses(clipped, 48)
    if "lora" in sections:
        lora_rows = _each(LORA_CONFIGS, lambda name: train_lora(name, text[:split], val, steps, dev), failed)
        print(f"\nLoRA r=8 on a 4-layer random-init Llama over the same text, bf16 autocast, padded batches, {steps} "
              "AdamW steps")  # fmt: skip
        _print_losses(lora_rows, 64)
    return finish(rows + clipped + lora_rows, failed, 64, out, f"train_{dev.type}.csv")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="60 steps instead of 300")
    parser.add_argument("--section", choices=SECTIONS, action="append", help="one section (repeatable); default all")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    main(args.device, args.out, args.quick, args.section or SECTIONS)
