"""One step of TRL's SFTTrainer (or DPO, GRPO, KTO) at a real model shape: `python -m benchmarks trl [--quick]`
(`python -m benchmarks.trl --trainer dpo|grpo|kto` for the others).

TRL 1.16's SFTTrainer computes the loss through its own fused LM head (per-token log-probabilities in tiles, no
full logits) and turns on HF gradient checkpointing by default; the rows are what a user can set around it:
TRL as it comes (HF GC, TRL's head: the reference), with TRL's `activation_offloading`, and with fastckpt
(`hf.enable(model, ...)` before the trainer is built): `recompute` alone (TRL's head), and the storage policies
with `loss_head=True` (fastckpt's head serves TRL's fused-head calls) and padded attention.

The model: Qwen2.5-0.5B's shape (random weights, bf16, LoRA r=16 on all seven projections, as a PEFT model;
`python -m benchmarks.trl --shape llama-3.2-1b` for another of benchmarks/real_shapes.py's shapes), a batch of
two examples of 1,024 and 896 tokens (`--quick`: 512 and 448) that TRL's collator pads on the right, bf16
autocast (`bf16=True`; `--compute fp32`: an fp32 model without autocast, for a CPU where bf16 is emulated),
learning rate 0 so that every row steps from the same weights. DPO: one preference pair,
a prompt of 512 tokens, chosen 512 and rejected 384 (`--quick`: half), so the two sequences are SFT's lengths
and half their tokens are prompt (no loss there); its reference is the same PEFT model with the adapters off
(TRL's default with PEFT), a no-grad forward of both sequences each step. GRPO: one prompt of 1,536 tokens
(`--quick`: 256), two completions generated inside the step (16 tokens each: the training step's length is the
prompt's, generation is what a CPU cannot afford at length), a reward of the completions' length, TRL's default
beta 0 (no reference model). KTO: two examples (one desirable, one not) of a 512-token prompt and a 512-token
completion (`--quick`: half), its reference the adapters off. Each row: the trainer
is built and trains one step (`train()`: what turns checkpointing on, and the warm-up), then `training_step`
on the same batch is timed (median of the rounds) and its peak measured (the profiler's allocation records on
CPU).

Liger Kernel's fused cross entropy is not a row: TRL's SFTTrainer and DPOTrainer refuse it (it would replace the
fused head), and it runs only on GPUs (Triton).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.harness import error_line, median_times, peak_bytes, quiet_profiler_logs, write_csv
from benchmarks.real_shapes import SHAPES, build
from benchmarks.steps import fmt
from fastckpt.integrations import hf

REFERENCE = "TRL + HF GC (TRL's fused head)"
LENGTHS = (1024, 896)  # the batch's two examples, in tokens
# (shape, lengths, timed rounds) per trainer and size. SFT: each example's tokens; DPO: one preference pair's
# prompt, chosen and rejected tokens. Qwen2.5-0.5B: a real vocabulary (151,936) at a step that `make bench` can
# afford on a 2-core CPU
SIZES = {
    "sft": {
        "full": ("qwen2.5-0.5b", LENGTHS, 2),
        "quick": ("qwen2.5-0.5b", (512, 448), 1),
        "smoke": ("smoke", (64, 48), 1),
    },
    "dpo": {
        "full": ("qwen2.5-0.5b", (512, 512, 384), 2),
        "quick": ("qwen2.5-0.5b", (256, 256, 192), 1),
        "smoke": ("smoke", (32, 32, 16), 1),
    },
    "grpo": {  # one prompt's tokens, each generated completion's
        "full": ("qwen2.5-0.5b", (1536, 16), 1),
        "quick": ("qwen2.5-0.5b", (256, 16), 1),
        "smoke": ("smoke", (32, 8), 1),
    },
    "kto": {  # each example's prompt and completion tokens
        "full": ("qwen2.5-0.5b", (512, 512), 1),
        "quick": ("qwen2.5-0.5b", (256, 256), 1),
        "smoke": ("smoke", (32, 16), 1),
    },
}
COMPLETIONS = 2  # GRPO: completions generated per prompt (its group)


@dataclass(frozen=True)
class Setup:
    name: str
    enable: dict | None = None  # hf.enable's arguments, or None
    config: dict | None = None  # SFTConfig's further arguments


SETUPS = (
    Setup(REFERENCE),
    Setup("TRL + HF GC + activation_offloading", config={"activation_offloading": True}),
    Setup("TRL + fastckpt recompute (TRL's head)", enable={"policy": "recompute"}),
    Setup(
        "TRL + fastckpt recompute+int8 + loss head + padded attention",
        enable={"policy": "recompute+int8", "loss_head": True, "padded_attention": True},
    ),
    Setup(
        "TRL + fastckpt recompute:int8+int8 + loss head + padded attention",
        enable={"policy": "recompute:int8+int8", "loss_head": True, "padded_attention": True},
    ),
)


def tokenizer(vocab: int):
    """A word-level tokenizer over `vocab` tokens, built here (no download): the examples come tokenized."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t0")


def words(generator: torch.Generator, vocab: int, n: int) -> str:
    """n random words of `tokenizer(vocab)` (not its pad or EOS), each followed by a space (one before the EOS
    TRL appends)."""
    return "".join(f"t{i} " for i in torch.randint(2, vocab, (n,), generator=generator).tolist())


def _dataset(trainer_name: str, vocab: int, lengths: tuple[int, ...]) -> Any:
    """SFT: tokenized examples of `lengths` tokens; DPO: one pair of the tokenizer's words (prompt, chosen,
    rejected lengths; TRL tokenizes them and appends EOS); GRPO: prompts; KTO: a desirable and an undesirable
    example (prompt, completion)."""
    import datasets

    generator = torch.Generator().manual_seed(1)
    if trainer_name == "sft":
        ids = [torch.randint(2, vocab, (n,), generator=generator).tolist() for n in lengths]
        return datasets.Dataset.from_list([{"input_ids": row} for row in ids])
    if trainer_name == "grpo":
        return datasets.Dataset.from_list([{"prompt": words(generator, vocab, lengths[0])} for _ in range(4)])
    if trainer_name == "kto":
        return datasets.Dataset.from_list([
            {"prompt": words(generator, vocab, lengths[0]), "completion": words(generator, vocab, lengths[1]),
             "label": label} for label in (True, False)
        ])  # fmt: skip
    prompt, chosen, rejected = (words(generator, vocab, n) for n in lengths)
    return datasets.Dataset.from_list([{"prompt": prompt, "chosen": chosen, "rejected": rejected}])


def _completion_length_reward(completions: list, **kwargs: Any) -> list[float]:
    """GRPO's reward: any function of the completions serves (its value does not change the step's cost)."""
    return [len(str(c)) / 100.0 for c in completions]


def _trainer_kind(trainer_name: str, lengths: tuple[int, ...]) -> tuple[Any, Any, dict, dict, int]:
    """(config class, trainer class, the config's and the trainer's further arguments, the longest sequence)."""
    import trl

    if trainer_name == "sft":
        return trl.SFTConfig, trl.SFTTrainer, {"per_device_train_batch_size": len(lengths),
                                               "max_length": max(lengths)}, {}, max(lengths)  # fmt: skip
    if trainer_name == "dpo":
        longest = lengths[0] + max(lengths[1:]) + 1  # prompt + completion + EOS
        return trl.DPOConfig, trl.DPOTrainer, {"per_device_train_batch_size": 1, "max_length": longest}, {}, longest
    if trainer_name == "kto":
        longest = sum(lengths) + 1
        return trl.KTOConfig, trl.KTOTrainer, {"per_device_train_batch_size": 2, "max_length": longest}, {}, longest
    grpo = {"per_device_train_batch_size": COMPLETIONS, "num_generations": COMPLETIONS,
            "max_completion_length": lengths[1]}  # fmt: skip
    return trl.GRPOConfig, trl.GRPOTrainer, grpo, {"reward_funcs": _completion_length_reward}, sum(lengths) + 1


def trainer_step(
    shape_name: str, lengths: tuple[int, ...], setup: Setup, out: str, trainer_name: str = "sft", bf16: bool = True
) -> Callable[[], float]:
    """A callable running `training_step` of `setup`'s trainer (`trainer_name`: one of SIZES), after its first
    step, on the batch; it returns the loss (GRPO: generation included)."""
    shape = SHAPES[shape_name]
    config_class, trainer_class, arguments, extra, longest = _trainer_kind(trainer_name, lengths)
    model = build(shape, lora=True, tokens=longest, dtype=torch.bfloat16 if bf16 else torch.float32)
    if setup.enable is not None:
        hf.enable(model, **setup.enable)
    config = config_class(
        output_dir=os.path.join(out, "trl"),
        max_steps=1,
        learning_rate=0.0,
        **arguments,
        bf16=bf16,
        use_cpu=not torch.cuda.is_available(),
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        **(setup.config or {}),
    )
    trainer = trainer_class(
        model=model,
        args=config,
        train_dataset=_dataset(trainer_name, shape.vocab, lengths),
        processing_class=tokenizer(shape.vocab),
        **extra,
    )
    trainer.train()
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.current_gradient_accumulation_steps = 1

    def run() -> float:
        loss = trainer.training_step(trainer.model, batch, None)
        trainer.model.zero_grad(set_to_none=True)
        return float(loss)

    return run


def _built(
    shape_name: str, lengths: Any, out: str, trainer: str, compute: str, device: str
) -> tuple[dict[str, Callable[[], float]], dict[str, str]]:
    """Each setup's trainer built and stepped once (a warm-up): ({name: one step}, {name: why it did not run})."""
    runs: dict[str, Callable[[], float]] = {}
    failed: dict[str, str] = {}
    for setup in SETUPS:
        if (setup.config or {}).get("activation_offloading") and device == "cpu":
            failed[setup.name] = (
                "not run on CPU: TRL's activation offloading moves the saved activations from an accelerator to host "
                "memory (on this CUDA build without a GPU it raises), and on CPU they are host memory already"
            )
            continue
        started = time.perf_counter()
        try:
            with quiet_profiler_logs():
                runs[setup.name] = trainer_step(shape_name, lengths, setup, out, trainer, compute == "bf16")
        except Exception as err:
            failed[setup.name] = f"FAILED: {error_line(err)}"
        print(f"  {setup.name}: built and one step in {time.perf_counter() - started:.0f} s", flush=True)
    return runs, failed


def main(
    device: str = "cpu",
    out: str | None = None,
    quick: bool = False,
    smoke: bool = False,
    shape: str | None = None,
    trainer: str = "sft",
    compute: str = "bf16",
) -> list[dict]:
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        print("trl: not installed (pip install trl==1.16.0 datasets==4.8.5); skipped")
        return []
    if trainer not in SIZES:
        raise ValueError(f"benchmarks trl: `trainer` must be one of {sorted(SIZES)}, got {trainer!r}")
    shape_name, lengths, rounds = SIZES[trainer]["smoke" if smoke else "quick" if quick else "full"]
    shape_name = shape or shape_name
    out = out or "bench-results/trl"
    batch = {
        "sft": f"{len(lengths)} examples of {lengths} tokens (right padding)",
        "dpo": f"one preference pair: prompt, chosen, rejected of {lengths} tokens",
        "grpo": f"one prompt of {lengths[0]} tokens, {COMPLETIONS} completions of {lengths[1]} generated in the step",
        "kto": f"two examples (desirable, undesirable): prompt, completion of {lengths} tokens",
    }[trainer]
    print(f"TRL {trainer.upper()}Trainer, one step: {shape_name} LoRA r=16, {compute}, {batch}, {device}", flush=True)
    results: dict[str, dict] = {}
    losses: dict[str, float] = {}
    runs, failed = _built(shape_name, lengths, out, trainer, compute, device)

    def recording(name: str, run: Callable[[], float]) -> Callable[[], None]:
        return lambda: losses.setdefault(name, run())  # the first timed step's loss

    # The rows alternate within each round (all trainers are built first), so drift hits them alike.
    with quiet_profiler_logs():
        seconds, step_failed = median_times(
            {name: recording(name, run) for name, run in runs.items()}, torch.device(device), 0, rounds
        )
    failed.update({name: f"FAILED: {error}" for name, error in step_failed.items()})
    for name, run in runs.items():
        if name not in failed:
            peak = peak_bytes(run, torch.device(device))
            results[name] = {"peak": peak, "time": seconds[name], "loss": losses[name]}
    reference = results.get(REFERENCE)
    rows = []
    width = max(len(s.name) for s in SETUPS) + 2
    print(f"{'':<{width}}{'peak MiB':>10}{'x ref':>8}{'step s':>9}{'x ref':>8}{'loss':>10}")
    for setup in SETUPS:
        if setup.name in failed:
            print(f"{setup.name:<{width}}{failed[setup.name]}")
            continue
        r = results[setup.name]
        peak_x = r["peak"] / reference["peak"] if reference else None
        time_x = r["time"] / reference["time"] if reference else None
        print(
            f"{setup.name:<{width}}{r['peak'] / 2**20:>10.1f}{fmt(peak_x, '.3f'):>8}{r['time']:>9.2f}"
            f"{fmt(time_x, '.2f'):>8}{r['loss']:>10.5f}"
        )
        rows.append({"trainer": trainer, "row": setup.name, "shape": shape_name, "tokens": sum(lengths),
                     "compute": compute, "peak_bytes": r["peak"], "peak_x_ref": peak_x, "seconds": r["time"],
                     "time_x_ref": time_x, "loss": r["loss"]})  # fmt: skip
    print(
        "Liger Kernel's fused linear cross entropy: no row (TRL's SFT and DPO trainers refuse it beside their fused "
        "head, and it needs a GPU: Triton)"
    )
    if out and rows:
        write_csv(rows, out, "trl.csv" if trainer == "sft" else f"trl_{trainer}.csv")
    return rows


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.trl", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), help="a real-shape model (default: qwen2.5-0.5b)")
    parser.add_argument("--trainer", choices=sorted(SIZES), default="sft", help="which TRL trainer (default sft)")
    parser.add_argument("--quick", action="store_true", help="512 and 448 tokens, one round")
    parser.add_argument("--compute", choices=["bf16", "fp32"], default="bf16", help="fp32: where bf16 is emulated")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    main(out=args.out, quick=args.quick, shape=args.shape, trainer=args.trainer, compute=args.compute)
