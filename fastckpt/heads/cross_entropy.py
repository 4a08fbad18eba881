"""`fastckpt.linear_cross_entropy`: the causal-LM loss head without the full logits.

`cross_entropy(hidden @ weight.T + bias, labels)` materialises tokens x vocab logits, in a Hugging Face
fine-tune three times over (the head's output, its fp32 upcast, the log-softmax autograd keeps) plus their
gradient: after activation checkpointing that is the peak of the step. Here the tokens go through the head
a chunk at a time, and the gradients with respect to `hidden`, `weight` and `bias` are computed chunk by
chunk in the forward itself (a fused linear cross entropy): at most one chunk's logits exist at a time,
nothing is recomputed, and backward only scales the stored gradients by the loss's incoming gradient. Within a
chunk the logits stay in the compute dtype, its one [tokens, vocab] buffer: the softmax's normaliser and the
gradient are computed over slices of the vocabulary in fp32 temporaries (SLICE_BYTES), the gradient written
back into the logits' buffer, so that the chunk can hold three times the tokens of one with a fp32 copy and
read the head's weight three times less often.

The dtype flow is autograd's for `F.linear(hidden, weight, bias).float()` + `F.cross_entropy`, so results
equal Hugging Face's `ForCausalLMLoss` up to summation order: the matmuls in the autocast dtype (or the
inputs' dtype), the softmax in fp32, the logits gradient computed in fp32 and cast back to the logits dtype
before the two gradient matmuls, the weight gradient accumulated over chunks in fp32.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.nn.functional as F

from fastckpt.heads.chunks import (
    Head,
    default_chunk_size,
    gradient_into_logits_,
    head_dtype,
    logits_of,
    normaliser,
    softmax_minus_one_hot,
    z_of,
)

_NAME = "fastckpt.linear_cross_entropy: "

# Backwards run twice through the same graph (fastckpt.optimizer_in_backward's norm pass, then its step pass).
# Within the first, the head hands out a copy of its input's gradient (kept for the second) but its trained leaf
# parameters' gradients themselves, once, recording those parameters in the set `backward_repeated()` yields: its
# owner keeps their gradients for the step, and the second backward hands them out no more. A copy of the weight's
# gradient would be a second [vocab, hidden] fp32 tensor beside it (1 GiB at Llama-3.2-1B's shape).
_handed_out: list[set[torch.Tensor]] = []  # one set per enclosing backward_repeated()


@contextlib.contextmanager
def backward_repeated() -> Any:
    """Within it, a backward through the loss head leaves the gradient of its input for one more backward and
    hands out its parameters' gradients once; yields the set of those parameters."""
    handed: set[torch.Tensor] = set()
    _handed_out.append(handed)
    try:
        yield handed
    finally:
        _handed_out.pop()


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch: torch.Tensor | int | None = None,
    softcap: float | None = None,
    logit_scale: float | None = None,
    chunk_size: int | None = None,
    shift_labels: bool = False,
) -> torch.Tensor:
    """The cross-entropy loss of the logits `hidden @ weight.T + bias` against `labels`, a chunk of tokens at a time.

    `hidden` is `[tokens, H]` or `[B, T, H]`, `weight` `[V, H]` (an `nn.Linear`'s), `labels` integer
    `hidden.shape[:-1]`; tokens labelled `ignore_index` count for nothing. The logits are multiplied by
    `logit_scale` in their own dtype (Cohere, Granite), then upcast to fp32 and soft-capped to
    `softcap * tanh(logits / softcap)` (Gemma 2/3). `reduction="mean"` divides the summed loss by the number
    of non-ignored tokens (NaN when there is none, as torch's `cross_entropy`), or by `num_items_in_batch`
    when given (Hugging Face Trainer's gradient-accumulation normaliser); `"sum"` does not divide.
    `shift_labels=True` does Hugging Face's causal shift: each position predicts the next label (labels moved
    left by one along the last dimension, `ignore_index` appended). `chunk_size` tokens go through the head
    at a time (default: `default_chunk_size`). Returns an fp32 scalar.

    Gradients reach `hidden`, `weight` and `bias` as far as they require them (a frozen weight costs no
    weight-gradient work; a weight tied to an embedding accumulates both gradients); they are computed during
    the forward when grad mode is on, so call it only for a loss you backpropagate. Under `torch.no_grad()`
    only the loss is computed. One backward per forward: double backward and a second backward through the
    same graph (`retain_graph=True`) raise.
    """
    head, hidden2d, labels1d, divisor = _check(
        hidden,
        weight,
        labels,
        bias,
        ignore_index,
        reduction,
        num_items_in_batch,
        softcap,
        logit_scale,
        chunk_size,
        shift_labels,
    )
    wants_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden2d, weight, bias))
    if not wants_grad:
        with torch.autocast(hidden.device.type, enabled=False):
            total = _loss_only(hidden2d, weight, bias, labels1d, head)
        return total if divisor is None else total / divisor
    return _LinearCrossEntropy.apply(hidden2d, weight, bias, labels1d, divisor, head)


def _check(
    hidden: Any,
    weight: Any,
    labels: Any,
    bias: Any,
    ignore_index: Any,
    reduction: Any,
    num_items_in_batch: Any,
    softcap: Any,
    logit_scale: Any,
    chunk_size: Any,
    shift_labels: Any,
) -> tuple[Head, torch.Tensor, torch.Tensor, torch.Tensor | int | None]:
    """Validate the arguments; return the settings, hidden as [N, H], labels as [N] and the loss divisor."""
    for name, value in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{_NAME}`{name}` must be a tensor, got {type(value).__name__}")
    if hidden.dim() < 2 or not hidden.is_floating_point():
        raise ValueError(
            f"{_NAME}`hidden` must be a floating-point tensor [tokens, hidden_size] or [batch, tokens, "
            f"hidden_size], got {hidden.dtype} of shape {tuple(hidden.shape)}"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"{_NAME}`weight` must be [vocab_size, hidden_size] with hidden_size = hidden.shape[-1] = "
            f"{hidden.shape[-1]} (an nn.Linear's weight, not its transpose), got shape {tuple(weight.shape)}"
        )
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(f"{_NAME}`labels` must hold integer class indices (e.g. torch.long), got {labels.dtype}")
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"{_NAME}`labels` must have hidden's shape without its last dimension, {tuple(hidden.shape[:-1])}, got "
            f"{tuple(labels.shape)}"
        )
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != weight.shape[:1]):
        shape = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(f"{_NAME}`bias` must be None or a tensor [vocab_size] = [{weight.shape[0]}], got {shape}")
    for name, value in (("weight", weight), ("bias", bias)):
        if value is not None and value.device != hidden.device:
            raise ValueError(
                f"{_NAME}`{name}` is on {value.device} and `hidden` on {hidden.device}; move them to one device"
            )
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise TypeError(f"{_NAME}`ignore_index` must be an int, got {ignore_index!r}")
    if reduction not in ("mean", "sum"):
        raise ValueError(
            f"{_NAME}`reduction` must be 'mean' or 'sum', got {reduction!r} (per-token losses, 'none', would "
            "need the full logits' gradient)"
        )
    if num_items_in_batch is not None and reduction != "mean":
        raise ValueError(
            f"{_NAME}`num_items_in_batch` is the divisor of reduction='mean'; with reduction='sum' leave it None"
        )
    if isinstance(num_items_in_batch, torch.Tensor) and num_items_in_batch.numel() != 1:
        raise ValueError(
            f"{_NAME}`num_items_in_batch` must be a number or a one-element tensor, got shape "
            f"{tuple(num_items_in_batch.shape)}"
        )
    for name, value in (("softcap", softcap), ("logit_scale", logit_scale)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0
        ):
            raise ValueError(f"{_NAME}`{name}` must be None or a finite number > 0, got {value!r}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1):
        raise ValueError(f"{_NAME}`chunk_size` must be None (the default) or an int >= 1, got {chunk_size!r}")
    if not isinstance(shift_labels, bool):
        raise TypeError(f"{_NAME}`shift_labels` must be a bool (HF's causal shift or none), got {shift_labels!r}")

    compute_dtype = head_dtype(hidden, weight, bias, _NAME)
    if shift_labels:
        labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    labels1d = labels.reshape(-1).to(hidden.device)
    divisor: torch.Tensor | int | None = None
    if num_items_in_batch is not None:
        divisor = num_items_in_batch
        if isinstance(divisor, torch.Tensor):
            divisor = divisor.reshape(()).to(hidden.device)
    elif reduction == "mean":
        divisor = (labels1d != ignore_index).sum()
    head = Head(
        compute_dtype=compute_dtype,
        ignore_index=ignore_index,
        softcap=None if softcap is None else float(softcap),
        logit_scale=None if logit_scale is None else float(logit_scale),
        chunk_size=chunk_size
        or default_chunk_size(weight.shape[0], weight.shape[1], torch.is_grad_enabled() and weight.requires_grad),
    )
    return head, hidden.reshape(-1, hidden.shape[-1]), labels1d, divisor


def _chunk_rows(labels: torch.Tensor, head: Head) -> list[slice | torch.Tensor]:
    """The rows of each chunk. Only tokens that count go through the head: ignored ones (padding, prompts under a
    completion-only loss, each sequence's last position) cost no head work. Slices while every token counts, else
    index tensors into the counted tokens (counting them is one host sync)."""
    counted = (labels != head.ignore_index).nonzero().squeeze(1)
    n, size = labels.numel(), head.chunk_size
    if counted.numel() == n:
        return [slice(start, min(start + size, n)) for start in range(0, n, size)]
    return list(counted.split(size)) if counted.numel() else []  # (an empty tensor splits into one empty piece)


def _loss_only(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor, head: Head
) -> torch.Tensor:
    """The summed loss, chunk by chunk, without gradients (fp32 scalar)."""
    dtype = head.compute_dtype
    weight, bias = weight.to(dtype), None if bias is None else bias.to(dtype)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for rows in _chunk_rows(labels, head):
        logits = logits_of(hidden[rows].to(dtype), weight, bias, head)
        top, log_sum = normaliser(logits, head)
        total -= z_of(logits.gather(1, labels[rows].unsqueeze(1)), head).sub_(top).sub_(log_sum).sum()
        del logits
    return total


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward: the summed loss (divided by the divisor) and, chunk by chunk, the gradients of the summed loss.
    Backward: those gradients times grad_output / divisor, handed out once."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        divisor: torch.Tensor | int | None,
        head: Head,
    ) -> torch.Tensor:
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.leaves = (None, *(p if p is not None and p.is_leaf else None for p in (weight, bias)))  # see _handed_out
        with torch.autocast(hidden.device.type, enabled=False):
            total, grads = _fused(hidden, weight, bias, labels, head, needs_hidden, needs_weight, needs_bias)
        ctx.grads = grads
        if divisor is None:
            ctx.scale = None
            return total
        # d(loss)/d(summed loss); 0 without tokens that count (whose gradients are 0), as cross_entropy's are
        divisor = torch.as_tensor(divisor, device=total.device)
        ctx.scale = torch.where(divisor == 0, 0.0, torch.reciprocal(divisor.to(torch.float32)))
        return total / divisor

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"{_NAME}double backward (create_graph=True through the loss head) is not supported: its gradients "
                "are computed in the forward, not as a differentiable graph; use F.linear + F.cross_entropy there"
            )
        if ctx.grads is None:
            raise RuntimeError(
                f"{_NAME}a second backward through the same loss (retain_graph=True) is not supported: the "
                "gradients computed in the forward are handed out, scaled in place, by the first; compute the "
                "loss again for another backward"
            )
        factor = grad_output if ctx.scale is None else grad_output * ctx.scale
        grads, out = list(ctx.grads), []
        for i, (grad, dtype, leaf) in enumerate(zip(grads, ctx.dtypes, ctx.leaves, strict=True)):
            copied = bool(_handed_out) and leaf is None  # another backward follows and needs it: a scaled copy
            out.append(None if grad is None else grad.to(dtype, copy=copied).mul_(factor))
            if grad is not None and not copied:  # released, so that autograd may take the tensor without a copy
                grads[i] = None
                if _handed_out:
                    _handed_out[-1].add(leaf)
        ctx.grads = grads if _handed_out else None  # what is left for the next backward: the kept copies' sources
        return (*out, None, None, None)


def _fused(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    head: Head,
    needs_hidden: bool,
    needs_weight: bool,
    needs_bias: bool,
) -> tuple[torch.Tensor, tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]]:
    """The summed loss and its gradients with respect to hidden, weight and bias (None where not needed).

    Per chunk: logits (compute dtype) -> the log-softmax's normaliser over vocabulary slices, the log-softmax at
    the targets -> the gradient (softmax, minus one at the targets, times the soft cap's derivative), slice by
    slice in fp32 and cast into the logits' buffer -> the two gradient matmuls: the logits are the chunk's only
    [tokens, vocab] buffer.
    Only the tokens that count go through the head (`_chunk_rows`); an ignored token's hidden gradient is 0. The
    uniform factor 1 / divisor is applied in backward, with grad_output."""
    dtype, device = head.compute_dtype, hidden.device
    weight_c = weight.to(dtype)
    bias_c = None if bias is None else bias.to(dtype)
    accumulate = torch.promote_types(weight.dtype, torch.float32)  # the weight gradient's sum over chunks
    chunks = _chunk_rows(labels, head)
    every_token = bool(chunks) and isinstance(chunks[0], slice)
    grad_hidden = None
    if needs_hidden:  # rows of ignored tokens are never written
        grad_hidden = (torch.empty if every_token else torch.zeros)(hidden.shape, dtype=dtype, device=device)
    grad_weight = torch.zeros(weight.shape, dtype=accumulate, device=device) if needs_weight else None
    grad_bias = torch.zeros(weight.shape[0], dtype=accumulate, device=device) if needs_bias else None
    total = torch.zeros((), dtype=torch.float32, device=device)
    for rows in chunks:
        hidden_c = hidden[rows].to(dtype)  # a slice of hidden in its dtype is a view, no copy
        targets = labels[rows].unsqueeze(1)
        logits = logits_of(hidden_c, weight_c, bias_c, head)
        top, log_sum = normaliser(logits, head)
        lse = top.add_(log_sum)  # log-sum-exp of z
        total -= z_of(logits.gather(1, targets), head).sub_(lse).sum()
        grad_logits = gradient_into_logits_(logits, head, 1.0, softmax_minus_one_hot(lse, targets))
        if grad_hidden is not None:
            if isinstance(rows, slice):
                torch.mm(grad_logits, weight_c, out=grad_hidden[rows])
            else:
                grad_hidden.index_copy_(0, rows, grad_logits @ weight_c)
        if grad_weight is not None:
            if grad_weight.dtype == dtype:
                grad_weight.addmm_(grad_logits.T, hidden_c)
            else:
                grad_weight += grad_logits.T @ hidden_c
        if grad_bias is not None:
            grad_bias += grad_logits.sum(dim=0, dtype=accumulate)
        del grad_logits, logits, lse, hidden_c
    if grad_weight is not None:
        grad_weight = grad_weight.to(weight.dtype)
    if grad_bias is not None:
        grad_bias = grad_bias.to(bias.dtype)
    return total, (grad_hidden, grad_weight, grad_bias)
