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

Per chunk at most the chunk's logits (compute dtype) and two fp32 buffers of the same shape exist (three with a
soft cap). The logits are transformed as `z = softcap * tanh(logit_scale * logits / softcap) / temperature`
(each step only where given); the probabilities, entropy and the rest are those of `softmax(z)`, in fp32.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from fastckpt.loss import _chunks, _compute_dtype, _Head, _logits, default_chunk_size

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
    `hidden @ weight.T + bias`, `chunk_size` tokens at a time (default: `fastckpt.loss.default_chunk_size`).

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
        compute_dtype = _compute_dtype(hidden, weight, bias)
    except TypeError as error:  # worded for linear_cross_entropy, whose dtype rule this is
        raise TypeError(str(error).replace("fastckpt.linear_cross_entropy: ", _NAME)) from None
    head = _Head(
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


class _Chunk:
    """One chunk's fp32 transformed logits z, log-softmax and softmax; `tanh` kept for the soft cap's
    derivative."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, head: _Head, t: float):
        self.logits = _logits(hidden, weight, bias, head)  # compute dtype; its buffer is reused for the gradient
        z = self.logits.float() if self.logits.dtype != torch.float32 else self.logits.clone()
        self.tanh = None
        if head.softcap is not None:
            self.tanh = z.div_(head.softcap).tanh_()
            z = self.tanh * head.softcap
        if t != 1.0:
            z.div_(t)
        self.z = z
        self.logp = F.log_softmax(z, dim=1)

    def probs(self) -> torch.Tensor:
        """softmax(z), into z's buffer (z is not needed after)."""
        return torch.exp(self.logp, out=self.z)

    def logits_gradient(self, grad_z: torch.Tensor, head: _Head, t: float) -> torch.Tensor:
        """d(loss)/d(logits) in the compute dtype, from d(loss)/dz (whose buffer is used up)."""
        if t != 1.0:
            grad_z.div_(t)
        if self.tanh is not None:  # d(cap * tanh(x / cap)) / dx = 1 - tanh^2
            grad_z.addcmul_(grad_z, self.tanh.square_(), value=-1)
        grad = grad_z if self.logits.dtype == torch.float32 else self.logits.copy_(grad_z)
        if head.logit_scale is not None:
            grad.mul_(head.logit_scale)
        return grad


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum(a * b, dim=1) without the [n, V] product."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def _one_hot_minus(p: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """one_hot(targets) - p, in p's buffer: d log p(target) / dz."""
    return p.neg_().scatter_add_(1, targets, torch.ones_like(targets, dtype=p.dtype))


class _LinearLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        head: _Head,
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
            hidden_c = hidden.to(dtype)
            out = {name: torch.empty(n, dtype=torch.float32, device=device) for name in wanted if name != "is_top1"}
            if "is_top1" in wanted:
                out["is_top1"] = torch.empty(n, dtype=torch.bool, device=device)
            d_rows = torch.empty(n, hidden.shape[1], dtype=dtype, device=device) if per_row else None
            for start in _chunks(n, head.chunk_size):
                stop = min(start + head.chunk_size, n)
                rows, targets = slice(start, stop), labels[start:stop].unsqueeze(1)
                chunk = _Chunk(hidden_c[rows], weight_c, bias_c, head, temperature)
                out["log_probs"][rows] = chunk.logp.gather(1, targets).squeeze(1)
                if "is_top1" in wanted:
                    out["is_top1"][rows] = chunk.z.argmax(dim=1) == targets.squeeze(1)
                if "mean_logits" in wanted:
                    out["mean_logits"][rows] = chunk.z.mean(dim=1)
                p = chunk.probs()
                if "entropy" in wanted:
                    out["entropy"][rows] = -_rowdot(p, chunk.logp)
                if "log_sum_sq_probs" in wanted:
                    out["log_sum_sq_probs"][rows] = _rowdot(p, p).log_()
                if per_row:  # d log p(label) / dz = one_hot(label) - p
                    grad_z = _one_hot_minus(p, targets)
                    torch.mm(chunk.logits_gradient(grad_z, head, temperature), weight_c, out=d_rows[rows])
                del chunk, p
        # hidden is needed again only to recompute: a trained head, or an entropy that may get a gradient
        recompute = not per_row or "entropy" in wanted
        ctx.save_for_backward(hidden if recompute else None, weight, bias, labels, out.get("entropy"))
        ctx.d_rows, ctx.head, ctx.temperature, ctx.hidden_dtype = d_rows, head, temperature, hidden.dtype
        ctx.mark_non_differentiable(
            *(out[name] for name in ("log_sum_sq_probs", "mean_logits", "is_top1") if name in out)
        )
        return tuple(out.get(name) for name in OUTPUTS)

    @staticmethod
    def backward(ctx: Any, grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None, *_: Any):
        hidden, weight, bias, labels, entropy = ctx.saved_tensors
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        head, temperature, d_rows = ctx.head, ctx.temperature, ctx.d_rows
        grad_hidden = None
        if d_rows is not None and grad_log_probs is not None:
            grad_hidden = (d_rows.float() * grad_log_probs.unsqueeze(1)).to(ctx.hidden_dtype)
            grad_log_probs = None  # accounted for
        if grad_log_probs is None and grad_entropy is None:
            return grad_hidden, None, None, None, None, None, None
        # Recompute chunk by chunk: d(loss)/dz = g_lp * (one_hot - p) - g_ent * p * (log p + entropy)
        n, device, dtype = hidden.shape[0], hidden.device, head.compute_dtype
        with torch.autocast(device.type, enabled=False):
            weight_c, bias_c = weight.to(dtype), None if bias is None else bias.to(dtype)
            hidden_c = hidden.to(dtype)
            recomputed = torch.empty(n, hidden.shape[1], dtype=dtype, device=device) if needs_hidden else None
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=device) if needs_weight else None
            grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=device) if needs_bias else None
            for start in _chunks(n, head.chunk_size):
                stop = min(start + head.chunk_size, n)
                rows, targets = slice(start, stop), labels[start:stop].unsqueeze(1)
                chunk = _Chunk(hidden_c[rows], weight_c, bias_c, head, temperature)
                p = chunk.probs()
                grad_z = None
                if grad_entropy is not None:  # into the log-softmax's buffer
                    grad_z = chunk.logp.add_(entropy[rows].unsqueeze(1)).mul_(p).mul_(-grad_entropy[rows].unsqueeze(1))
                if grad_log_probs is not None:
                    g = grad_log_probs[rows].unsqueeze(1)
                    one_hot_minus_p = _one_hot_minus(p, targets)
                    grad_z = one_hot_minus_p.mul_(g) if grad_z is None else grad_z.addcmul_(one_hot_minus_p, g)
                grad_logits = chunk.logits_gradient(grad_z, head, temperature)
                if recomputed is not None:
                    torch.mm(grad_logits, weight_c, out=recomputed[rows])
                if grad_weight is not None:  # summed over chunks in fp32, as linear_cross_entropy's
                    if dtype == torch.float32:
                        grad_weight.addmm_(grad_logits.T, hidden_c[rows])
                    else:
                        grad_weight += grad_logits.T @ hidden_c[rows]
                if grad_bias is not None:
                    grad_bias += grad_logits.sum(dim=0, dtype=torch.float32)
                del chunk, p, grad_z, grad_logits
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
