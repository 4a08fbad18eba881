"""`python -m benchmarks loss [--device cpu|cuda] [--out DIR] [--quick]`: the causal-LM loss head.

One step: forward and backward of the loss of hidden states [tokens, hidden] (fp32, requiring grad)
through an fp32 head weight [vocab, hidden] under bf16 autocast, Llama-like shapes, the first eighth of the
tokens ignored (label -100: padding, a prompt) or, in a completion-only batch, the first half. Rows:

- plain: `F.cross_entropy(F.linear(hidden, weight).float(), labels)`, what Hugging Face's ForCausalLMLoss
  does: full logits, their fp32 upcast, the log-softmax autograd keeps and their gradients;
- chunked recompute: the tokens in chunks, each chunk's head + cross entropy under torch's checkpoint (its
  logits recomputed in backward), the same chunk size as fastckpt's;
- fastckpt fused: `fastckpt.linear_cross_entropy`, the gradients computed chunk by chunk in the forward.

Per shape and row: the step's peak bytes above what was live before it (benchmarks.harness.peak_bytes:
the CPU profiler's allocation records, or max_memory_allocated on CUDA), the median step time over
interleaved rounds, each as x plain, and the largest relative L2 error of the loss and the two gradients
against plain (bf16 rounding: ~3e-3). On CPU, glibc malloc is first set to reuse freed memory (as the
checkpoint benchmark does), so that neither row is timed paging in fresh buffers.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import fastckpt
from benchmarks.harness import median_times, peak_bytes, write_csv
from benchmarks.ops import _reuse_freed_host_memory
from fastckpt.heads import default_chunk_size

SHAPES = ((2048, 256, 4096, 1 / 8), (2048, 256, 32000, 1 / 8), (2048, 256, 32000, 1 / 2))  # (tokens, hidden,
# vocab, the fraction of tokens ignored)
QUICK_SHAPES = ((1024, 256, 4096, 1 / 8), (1024, 256, 32000, 1 / 8), (1024, 256, 32000, 1 / 2))
PLAIN, RECOMPUTE, FUSED = "plain", "chunked recompute", "fastckpt fused"


def plain(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(hidden, weight).float(), labels)


def _summed(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(hidden, weight).float(), labels, reduction="sum")


def chunked_recompute(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
    """The other way to keep one chunk of logits: each chunk checkpointed, recomputed in backward."""
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk):
        stop = start + chunk
        total = total + checkpoint(_summed, hidden[start:stop], weight, labels[start:stop], use_reentrant=False)
    return total / (labels != -100).sum()


def _relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    value, reference = value.double(), reference.double()
    return float((value - reference).norm() / reference.norm().clamp_min(1e-30))


def _measure_shape(
    tokens: int, hidden_size: int, vocab: int, ignored: float, device: torch.device, warmup: int, rounds: int
):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=generator).to(device).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=generator) * hidden_size**-0.5).to(device).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=generator).to(device)
    labels[: round(tokens * ignored)] = -100  # a prompt, or padding
    chunk = default_chunk_size(vocab, hidden_size, weight_grad=True)
    losses = {
        PLAIN: lambda: plain(hidden, weight, labels),
        RECOMPUTE: lambda: chunked_recompute(hidden, weight, labels, chunk),
        FUSED: lambda: fastckpt.linear_cross_entropy(hidden, weight, labels),
    }

    def step(name: str) -> tuple[torch.Tensor, ...]:
        hidden.grad = weight.grad = None
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = losses[name]()
        loss.backward()
        return loss.detach(), hidden.grad, weight.grad

    results, peaks = {}, {}
    for name in losses:  # the first step of each: its peak, its results, and a warm-up
        peaks[name] = peak_bytes(lambda name=name: results.__setitem__(name, step(name)), device)
    steps = {name: (lambda name=name: step(name)) for name in losses}
    times, failed = median_times(steps, device, warmup=warmup, rounds=rounds)
    if failed:
        raise RuntimeError(f"benchmarks loss: {failed}")
    rows = []
    for name in losses:
        error = max(_relative_error(a, b) for a, b in zip(results[name], results[PLAIN], strict=True))
        rows.append(
            {
                "shape": f"{tokens}x{hidden_size}x{vocab}",
                "ignored": f"{ignored:.3g}",
                "config": name,
                "chunk": "" if name == PLAIN else chunk,
                "peak_mib": round(peaks[name] / 2**20, 1),
                "peak_x_plain": round(peaks[name] / peaks[PLAIN], 3),
                "time_ms": round(times[name] * 1e3, 1),
                "time_x_plain": round(times[name] / times[PLAIN], 3),
                "max_error": f"{error:.1e}",
                "device": device.type,
                "threads": torch.get_num_threads(),
            }
        )
    return rows


def measure(shapes=SHAPES, device: torch.device | str = "cpu", warmup: int = 1, rounds: int = 3) -> list[dict]:
    """One row per (shape, configuration); shapes are (tokens, hidden, vocab, the fraction of tokens ignored)."""
    rows = []
    for tokens, hidden_size, vocab, ignored in shapes:
        rows += _measure_shape(tokens, hidden_size, vocab, ignored, torch.device(device), warmup, rounds)
    return rows


def table(rows: list[dict]) -> str:
    header = f"{'shape (tokens x hidden x vocab)':<32}{'ignored':>8}  {'config':<20}{'chunk':>6}{'peak MiB':>10}"
    header += f"{'x plain':>9}"
    header += f"{'step ms':>10}{'x plain':>9}{'max error':>11}"
    lines = [header]
    for r in rows:
        lines.append(
            f"{r['shape']:<32}{r['ignored']:>8}  {r['config']:<20}{r['chunk']!s:>6}{r['peak_mib']:>10.1f}"
            f"{r['peak_x_plain']:>9.3f}"
            f"{r['time_ms']:>10.1f}{r['time_x_plain']:>9.3f}{r['max_error']:>11}"
        )
    return "\n".join(lines)


SWEEP_SHAPE = (1024, 2048, 128256)  # (tokens, hidden, vocab): Llama-3.2-1B's head at 1,024 tokens
SWEEP_CHUNKS = (16, 32, 64, 128, 256, 512, 1024)


def sweep(
    shape: tuple[int, int, int] = SWEEP_SHAPE,
    chunks: tuple[int, ...] = SWEEP_CHUNKS,
    device: str = "cpu",
    rounds: int = 3,
) -> list[dict]:
    """fastckpt.linear_cross_entropy's step (forward and backward, bf16 autocast) against its chunk size: a frozen
    bf16 weight (LoRA: no weight gradient) and a trained fp32 one (full fine-tune: the weight gradient summed over
    chunks); per chunk its fp32 logits' MiB, the peak and the median time of interleaved rounds, and the time
    as x the fastest chunk's. What default_chunk_size's rule is chosen from."""
    tokens, hidden_size, vocab = shape
    dev = torch.device(device)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=generator).to(dev, torch.bfloat16).requires_grad_()
    base = torch.randn(vocab, hidden_size, generator=generator) * hidden_size**-0.5
    labels = torch.randint(0, vocab, (tokens,), generator=generator).to(dev)
    rows = []
    for trained, weight in ((False, base.to(dev, torch.bfloat16)), (True, base.to(dev).requires_grad_())):

        def step(chunk: int, weight: torch.Tensor = weight) -> None:
            hidden.grad = weight.grad = None
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                loss = fastckpt.linear_cross_entropy(hidden, weight, labels, chunk_size=chunk)
            loss.backward()
            hidden.grad = weight.grad = None

        sizes = [chunk for chunk in chunks if chunk <= tokens]
        peaks = {chunk: peak_bytes(lambda chunk=chunk: step(chunk), dev) for chunk in sizes}
        times, _ = median_times({chunk: (lambda chunk=chunk: step(chunk)) for chunk in sizes}, dev, 0, rounds)
        best = min(times.values())
        for chunk in sizes:
            rows.append({"weight": "trained fp32" if trained else "frozen bf16", "chunk": chunk,
                         "logits_fp32_mib": chunk * vocab * 4 / 2**20, "peak_mib": peaks[chunk] / 2**20,
                         "time_ms": times[chunk] * 1e3, "time_x_best": times[chunk] / best})  # fmt: skip
            print(f"{rows[-1]['weight']:<14}{chunk:>7}{rows[-1]['logits_fp32_mib']:>10.1f}{rows[-1]['peak_mib']:>10.1f}"
                  f"{rows[-1]['time_ms']:>10.0f}{rows[-1]['time_x_best']:>8.3f}", flush=True)  # fmt: skip
    return rows


def main(device: str = "cpu", out: str | None = None, quick: bool = False) -> list[dict]:
    if device == "cpu" and _reuse_freed_host_memory():
        # As the checkpoint benchmark does: freed blocks are reused, as by torch's CUDA caching allocator,
        # instead of every large buffer being fresh memory that page-faults on first touch (which slows the
        # plain step, whose buffers are all large, about twice).
        print("(CPU: glibc malloc set to reuse freed memory)")
    print(
        f"== loss head: plain head + cross entropy vs chunked recompute vs fastckpt.linear_cross_entropy "
        f"({device}, bf16 autocast, {torch.get_num_threads()} threads)",
        flush=True,
    )
    rows = measure(QUICK_SHAPES if quick else SHAPES, device, warmup=0, rounds=2 if quick else 3)
    print(table(rows))
    if out:
        write_csv(rows, out, "loss_head.csv")
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m benchmarks.loss_head")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="the step against the chunk size at SWEEP_SHAPE")
    args = parser.parse_args()
    if args.sweep:
        print(f"== loss head vs chunk size, tokens x hidden x vocab {SWEEP_SHAPE}, bf16 autocast")
        print(f"{'weight':<14}{'chunk':>7}{'fp32 MiB':>10}{'peak MiB':>10}{'ms':>10}{'x best':>8}")
        sweep(device=args.device)
    else:
        main(args.device, args.out, args.quick)
