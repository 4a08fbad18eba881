"""`fastckpt.linear_log_probs`: each token's log-probability of its label under `hidden @ weight.T + bias`, and
the distribution's entropy, without the full logits.

Preference and RL losses (DPO, KTO, GRPO) and TRL's SFT weight each token's log-probability by something known
only after the forward, so the loss head's trick (the gradients of a summed loss, computed in the forward:
fastckpt.linear_cross_entropy) does not apply as is. Two facts make most of it apply again:

- a token's log-probability depends on its own hidden row only, so its gradient with respect to that row,
  `(one_hot - p) @ weight` ([tokens, hidden]), can be computed in the forward and scaled by each token's incoming
  gradient in backward: a frozen head (LoRA) then costs two matmuls per chunk, not three (logits, and in backward
  the logits again and their gradient's product);
- the weight's gradient sums over tokens with those incoming factors, so a trained head (or an entropy that
  gets a gradient) recomputes each chunk's logits in backward, one chunk at a time as in the forward.

Per chunk its logits in the compute dtype are the only [tokens, vocab] buffer, as in linear_cross_entropy: the
normaliser, the entropy and the rest, and the gradient run over vocabulary slices in fp32 temporaries of
chunks.SLICE_BYTES, the gradient written back into the logits' buffer. The logits are
transformed as `z = softcap * tanh(logit_scale * logits / softcap) / temperature` (each step only where given);
the probabilities, entropy and the rest are those of `softmax(z)`, in fp32.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from fastckpt.heads.chunks import (
    Head,
    add_at_targets_,
    default_chunk_size,
    gradient_into_logits_,
    head_dtype,
    logits_of,
    normaliser,
    softmax_minus_one_hot,
    z_of,
)

_NAME = "fastckpt.linear_log_probs: "
OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


class TokenLogProbs(NamedTuple):
    """Per-token results of `linear_log_probs`, each of the labels' shape (None where not asked for)."""

    log_probs: torch.Tensor  # log p(label); differentiable
    entropy: torch.Tensor | None  # -sum_v p_v log p_v; differentiable
    log_sum_sq_probs: torch.Tensor | None  # log sum_v p_v^2; no gradient
    mean_logits: torch.Tensor | None  # the mean over the vocabulary of z; no gradient
    is_top1: torch.Tensor | None  # bool: the label is the first most likely token


def linear_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
    logit_scale: float | None = None,
    chunk_size: int | None = None,
    outputs: tuple[str, ...] = ("log_probs",),
) -> TokenLogProbs:
    """Per-token `log_softmax(z)[label]` (and what `outputs` names of OUTPUTS) for `z` the transformed logits of
    `hidden @ weight.T + bias`, `chunk_size` tokens at a time (default: `fastckpt.heads.default_chunk_size`).

    `hidden` is `[..., H]`, `weight` `[V, H]`, `labels` integer `hidden.shape[:-1]` with values in `[0, V)` (mask
    ignored positions yourself: every position is scored). The head's matmuls run in autocast's dtype (or the
    inputs'), everything after them in fp32; results are fp32 (`is_top1` bool). Gradients reach `hidden`,
    `weight` and `bias` through `log_probs` and `entropy`.
    """
    if not all(isinstance(t, torch.Tensor) for t in (hidden, weight, labels)):
        raise TypeError(f"{_NAME}`hidden`, `weight` and `labels` must be tensors")
    if hidden.dim() < 1 or not hidden.is_floating_point() or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"{_NAME}`hidden` must be floating point [..., H] and `weight` [V, H] with the same H, got "
            f"{tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if labels.shape != hidden.shape[:-1] or labels.is_floating_point() or labels.dtype == torch.bool:
        raise ValueError(
            f"{_NAME}`labels` must be integer class indices of shape {tuple(hidden.shape[:-1])}, got {labels.dtype} "
            f"{tuple(labels.shape)}"
        )
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"{_NAME}`bias` must be None or [V] = [{weight.shape[0]}], got {tuple(bias.shape)}")
    unknown = [name for name in outputs if name not in OUTPUTS]
    if unknown:
        raise ValueError(f"{_NAME}unknown `outputs` {unknown}; choose among {OUTPUTS}")
    for name, value in (("temperature", temperature), ("softcap", softcap), ("logit_scale", logit_scale)):
        if value is not None and (isinstance(value, bool) or not math.isfinite(value) or value <= 0):
            raise ValueError(f"{_NAME}`{name}` must be a finite number > 0, got {value!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"{_NAME}`chunk_size` must be None (the default) or an int >= 1, got {chunk_size!r}")
    trained = torch.is_grad_enabled() and (weight.requires_grad or (bias is not None and bias.requires_grad))
    try:
        compute_dtype = head_dtype(hidden, weight, bias, _NAME)
    except TypeError as error:  # worded for linear_cross_entropy, whose dtype rule this is
        raise TypeError(str(error).replace("fastckpt.linear_cross_entropy: ", _NAME)) from None
    head = Head(
        compute_dtype=compute_dtype,
        ignore_index=-1,  # unused: every position is scored
        softcap=None if softcap is None else float(softcap),
        logit_scale=None if logit_scale in (None, 1.0) else float(logit_scale),
        chunk_size=chunk_size or default_chunk_size(weight.shape[0], weight.shape[1], trained),
    )
    wanted = frozenset(outputs) | {"log_probs"}
    results = _LinearLogProbs.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, bias, labels.reshape(-1), head, float(temperature), wanted
    )
    return TokenLogProbs(*(None if r is None else r.view(labels.shape) for r in results))


class _Statistics:
    """What `linear_log_probs` reads off a chunk's softmax besides the log-probabilities, summed per row over the
    vocabulary slices `normaliser` passes (`shifted` = z - max z, `e` = exp(shifted))."""

    def __init__(self, wanted: frozenset[str], rows: int, device: torch.device) -> None:
        def zeros() -> torch.Tensor:
            return torch.zeros(rows, 1, dtype=torch.float32, device=device)

        self.e_shifted = zeros() if "entropy" in wanted else None  # sum e * shifted
        self.e_squared = zeros() if "log_sum_sq_probs" in wanted else None  # sum e^2
        self.shifted = zeros() if "mean_logits" in wanted else None  # sum shifted
        self.needed = any(x is not None for x in (self.e_shifted, self.e_squared, self.shifted))

    def each(self, shifted: torch.Tensor, e: torch.Tensor) -> None:
        if self.shifted is not None:
            self.shifted += shifted.sum(dim=1, keepdim=True)
        if self.e_squared is not None:
            self.e_squared += _rowdot(e, e).unsqueeze(1)
        if self.e_shifted is not None:
            self.e_shifted += _rowdot(e, shifted).unsqueeze(1)


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum(a * b, dim=1) without the [n, V] product."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def _times(dz: Callable, factor: torch.Tensor) -> Callable:
    """`dz` (of `gradient_into_logits_`) scaled per row."""
    return lambda cols, z: dz(cols, z).mul_(factor)


def _with_entropy(
    lse: torch.Tensor, targets: torch.Tensor, g_lp: torch.Tensor | None, g_ent: torch.Tensor, entropy: torch.Tensor
) -> Callable:
    """dz of g_lp * log p(label) + g_ent * entropy: g_lp * (one_hot - p) - g_ent * p * (log p + entropy)."""
    g_lp = torch.zeros_like(lse) if g_lp is None else g_lp

    def dz(cols: slice, z: torch.Tensor) -> torch.Tensor:
        log_p = z.sub_(lse)
        p = log_p.exp()
        grad = log_p.add_(entropy).mul_(g_ent).add_(g_lp).mul_(p).neg_()  # -p * (g_lp + g_ent * (log p + H))
        add_at_targets_(grad, cols, targets, g_lp)
        return grad

    return dz


class _LinearLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        head: Head,
        temperature: float,
        wanted: frozenset[str],
    ) -> tuple[torch.Tensor | None, ...]:
        ctx.set_materialize_grads(False)
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        # A frozen head: each token's gradient with respect to its hidden row, now (see the module's docstring).
        per_row = needs_hidden and not (needs_weight or needs_bias)
        n, device, dtype = hidden.shape[0], hidden.device, head.compute_dtype
        with torch.autocast(device.type, enabled=False):
            weight_c, bias_c = weight.to(dtype), None if bias is None else bias.to(dtype)
            out = {name: torch.empty(n, dtype=torch.float32, device=device) for name in wanted if name != "is_top1"}
            if "is_top1" in wanted:
                out["is_top1"] = torch.empty(n, dtype=torch.bool, device=device)
            d_rows = torch.empty(n, hidden.shape[1], dtype=dtype, device=device) if per_row else None
            # hidden is needed again only to recompute: a trained head, or an entropy that may get a gradient; the
            # recomputation reuses each token's log-sum-exp rather than a second pass over the vocabulary
            recompute = not per_row or "entropy" in wanted
            saved_lse = torch.empty(n, 1, dtype=torch.float32, device=device) if recompute else None
            for start in range(0, n, head.chunk_size):
                stop = min(start + head.chunk_size, n)
                rows, targets = slice(start, stop), labels[start:stop].unsqueeze(1)
                # each chunk's rows in the compute dtype (a view where hidden has it), as linear_cross_entropy's
                logits = logits_of(hidden[rows].to(dtype), weight_c, bias_c, head)
                stats = _Statistics(wanted, stop - start, device)
                top, log_sum = normaliser(logits, head, temperature, stats.each if stats.needed else None)
                lse = top + log_sum
                if saved_lse is not None:
                    saved_lse[rows] = lse
                out["log_probs"][rows] = (z_of(logits.gather(1, targets), head, temperature) - lse).squeeze(1)
                if "is_top1" in wanted:  # the transform is increasing: z's argmax is the logits'
                    out["is_top1"][rows] = logits.argmax(dim=1) == targets.squeeze(1)
                if "mean_logits" in wanted:
                    out["mean_logits"][rows] = (stats.shifted / logits.shape[1] + top).squeeze(1)
                if "entropy" in wanted:  # -sum p log p = log_sum - sum(e * shifted) / sum(e)
                    out["entropy"][rows] = (log_sum - stats.e_shifted * torch.exp(-log_sum)).squeeze(1)
                if "log_sum_sq_probs" in wanted:  # sum p^2 = sum e^2 / sum(e)^2
                    out["log_sum_sq_probs"][rows] = (stats.e_squared.log() - 2 * log_sum).squeeze(1)
                if per_row:  # (p - one_hot(label)) @ weight = -(d log p(label) / d hidden): negated in backward
                    gradient_into_logits_(logits, head, temperature, softmax_minus_one_hot(lse, targets))
                    torch.mm(logits, weight_c, out=d_rows[rows])
                del logits, lse  # before the next chunk's
        ctx.save_for_backward(hidden if recompute else None, weight, bias, labels, out.get("entropy"), saved_lse)
        ctx.d_rows, ctx.head, ctx.temperature, ctx.hidden_dtype = d_rows, head, temperature, hidden.dtype
        ctx.mark_non_differentiable(
            *(out[name] for name in ("log_sum_sq_probs", "mean_logits", "is_top1") if name in out)
        )
        return tuple(out.get(name) for name in OUTPUTS)

    @staticmethod
    def backward(ctx: Any, grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None, *_: Any):
        hidden, weight, bias, labels, entropy, saved_lse = ctx.saved_tensors
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        head, temperature, d_rows = ctx.head, ctx.temperature, ctx.d_rows
        grad_hidden = None
        if d_rows is not None and grad_log_probs is not None:
            grad_hidden = (d_rows.float() * grad_log_probs.neg().unsqueeze(1)).to(ctx.hidden_dtype)
            grad_log_probs = None  # accounted for
        if grad_log_probs is None and grad_entropy is None:
            return grad_hidden, None, None, None, None, None, None
        # Recompute chunk by chunk: d(loss)/dz = g_lp * (one_hot - p) - g_ent * p * (log p + entropy)
        n, device, dtype = hidden.shape[0], hidden.device, head.compute_dtype
        with torch.autocast(device.type, enabled=False):
            weight_c, bias_c = weight.to(dtype), None if bias is None else bias.to(dtype)
            recomputed = torch.empty(n, hidden.shape[1], dtype=dtype, device=device) if needs_hidden else None
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=device) if needs_weight else None
            grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=device) if needs_bias else None
            for start in range(0, n, head.chunk_size):
                stop = min(start + head.chunk_size, n)
                rows, targets = slice(start, stop), labels[start:stop].unsqueeze(1)
                hidden_c = hidden[rows].to(dtype)
                logits, lse = logits_of(hidden_c, weight_c, bias_c, head), saved_lse[rows]
                g = None if grad_log_probs is None else grad_log_probs[rows].unsqueeze(1)
                if grad_entropy is None:
                    dz = _times(softmax_minus_one_hot(lse, targets), -g)
                else:
                    dz = _with_entropy(lse, targets, g, grad_entropy[rows].unsqueeze(1), entropy[rows].unsqueeze(1))
                grad_logits = gradient_into_logits_(logits, head, temperature, dz)
                if recomputed is not None:
                    torch.mm(grad_logits, weight_c, out=recomputed[rows])
                if grad_weight is not None:  # summed over chunks in fp32, as linear_cross_entropy's
                    if dtype == torch.float32:
                        grad_weight.addmm_(grad_logits.T, hidden_c)
                    else:
                        grad_weight += grad_logits.T @ hidden_c
                if grad_bias is not None:
                    grad_bias += grad_logits.sum(dim=0, dtype=torch.float32)
                del logits, lse, grad_logits, hidden_c
        if recomputed is not None:
            recomputed = recomputed.to(hidden.dtype)
            grad_hidden = recomputed if grad_hidden is None else grad_hidden.add_(recomputed)
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None,
            None,
            None,
            None,
        )
