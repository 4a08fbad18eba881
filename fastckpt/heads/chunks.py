"""What the loss heads share: the chunk of tokens and the slices of the vocabulary they compute over, the head's
dtype, and the per-chunk softmax arithmetic over vocabulary slices in fp32 temporaries.

A head (fastckpt.linear_cross_entropy, fastckpt.linear_log_probs) takes the tokens a chunk at a time
(`default_chunk_size`); within a chunk its logits in the compute dtype are the only [tokens, vocab] buffer, and the
normaliser and the gradient run over vocabulary slices (`slices`, SLICE_BYTES) in fp32, the gradient written back
into the logits' buffer (`gradient_into_logits_`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# The default chunk (default_chunk_size says why): about CHUNK_BYTES of fp32 logits and at least MIN_CHUNK tokens
# (FAST_CHUNK where MIN_CHUNK's are more than CHUNK_BYTES), but at most MAX_CHUNK_BYTES of bf16 logits (the
# chunk's one [tokens, vocab] buffer) and never fewer than FEWEST_TOKENS; when the weight gradient is computed at
# least hidden_size / 2 tokens; a multiple of CHUNK_MULTIPLE tokens.
CHUNK_BYTES = 2 * 2**20
MIN_CHUNK = 128
FAST_CHUNK = 256
MAX_CHUNK_BYTES = 64 * 2**20
FEWEST_TOKENS = 32
CHUNK_MULTIPLE = 16


def default_chunk_size(vocab_size: int, hidden_size: int = 0, weight_grad: bool = False) -> int:
    """Tokens per chunk when `chunk_size` is not given.

    About CHUNK_BYTES (2 MiB) of fp32 logits, at least MIN_CHUNK (128) tokens (vocab 4096: 128 tokens, 2048:
    256), and FAST_CHUNK (256) where MIN_CHUNK's tokens hold more than CHUNK_BYTES (vocab 32,000: 256), but at
    most MAX_CHUNK_BYTES (64 MiB) of the logits in bf16 (rounded down to a multiple of CHUNK_MULTIPLE: 256 tokens
    at vocab 128,256, 208 at 151,936, 128 at 256,000), never fewer than FEWEST_TOKENS (32), and, when the weight
    gradient is computed, at least hidden_size / 2 tokens.

    After checkpointing the chunk is much of the step's peak: its logits in the compute dtype are its one
    [tokens, vocab] buffer (the softmax runs over vocabulary slices in fp32 temporaries of SLICE_BYTES), against,
    at Llama-3.2-1B's shape (1,024 tokens, LoRA), some 60 MiB for everything else. The token bounds are time:
    every chunk reads the whole head weight twice (the logits, the hidden states' gradient), so few tokens per
    chunk are slow whatever the vocabulary. Measured on CPU (`python -m benchmarks.loss_head --sweep`: 1,024
    tokens, hidden 2048, vocab 128,256, bf16 autocast, 2 threads), the head's step as x its fastest chunk: a
    frozen bf16 weight (LoRA) 3.6x at 16 tokens, 2.3x at 32, 1.54x at 64, 1.16x at 128, 1.0x at 256 to 1,024; a
    trained fp32 weight, which also adds a [vocab, hidden] product into the fp32 weight-gradient sum per chunk,
    3.4x at 64, 2.08x at 128, 1.46x at 256, 1.16x at 512, 1.0x at 1,024 (its chunk is a small part of a full
    fine-tune's peak: the weight gradient's sum alone is 1 GiB there).
    At vocab 4096 (2048-4096 tokens) the fastest chunks held 8-64 MiB of fp32 logits (128-512 tokens), and 128
    tokens gave the lowest peak of a bf16 Llama LoRA step (16 layers, 1024 tokens: 23.0 MiB against 32.2 with 512).
    """
    vocab_size = max(1, vocab_size)
    tokens = max(-(-CHUNK_BYTES // (4 * vocab_size) // CHUNK_MULTIPLE) * CHUNK_MULTIPLE, MIN_CHUNK)
    capped = MAX_CHUNK_BYTES // (2 * vocab_size) // CHUNK_MULTIPLE * CHUNK_MULTIPLE  # bf16 logits
    if tokens * 4 * vocab_size > CHUNK_BYTES:  # a large vocabulary: fewer reads of its large weight
        tokens = max(tokens, min(capped, FAST_CHUNK))
    tokens = max(min(tokens, capped), FEWEST_TOKENS)
    if weight_grad:
        tokens = max(tokens, -(-(hidden_size // 2) // CHUNK_MULTIPLE) * CHUNK_MULTIPLE)
    return tokens


@dataclass(frozen=True)
class Head:
    """What every chunk needs besides its tokens."""

    compute_dtype: torch.dtype
    ignore_index: int
    softcap: float | None
    logit_scale: float | None
    chunk_size: int


def head_dtype(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, name: str) -> torch.dtype:
    """The head matmul's dtype: autocast's where it would cast (as for F.linear), else the inputs' common dtype
    (`name`: the calling function's, for its errors)."""
    device = hidden.device.type
    eligible = (torch.float32, torch.float16, torch.bfloat16)
    tensors = [t for t in (hidden, weight, bias) if t is not None]
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        if all(t.dtype in eligible for t in tensors):
            return torch.get_autocast_dtype(device)
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        names = ", ".join(
            f"{n} {t.dtype}"
            for n, t in zip(("hidden", "weight", "bias"), (hidden, weight, bias), strict=True)
            if t is not None
        )
        raise TypeError(
            f"{name}the head's inputs have different dtypes ({names}); cast them to one dtype, or run under "
            "torch.autocast (which computes the head in its dtype)"
        )
    if not weight.is_floating_point():
        raise TypeError(f"{name}`weight` must be floating point, got {weight.dtype}")
    return hidden.dtype


def logits_of(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, head: Head) -> torch.Tensor:
    """One chunk's logits in the compute dtype, scaled by logit_scale (a fresh tensor: callers may reuse it)."""
    logits = hidden @ weight.T if bias is None else torch.addmm(bias, hidden, weight.T)
    if head.logit_scale is not None:
        logits.mul_(head.logit_scale)
    return logits


# A chunk's softmax runs over slices of its vocabulary, in fp32 temporaries of about SLICE_BYTES: the chunk's
# logits stay in the compute dtype, the only [tokens, vocab] buffer (no fp32 copy of them), so a chunk of a given
# size in bytes holds three times the tokens under bf16, and the head's weight is read three times less often.
SLICE_BYTES = 8 * 2**20


def slices(logits: torch.Tensor) -> list[slice]:
    """The vocabulary columns of a chunk's logits in pieces whose fp32 copies hold about SLICE_BYTES."""
    rows, columns = logits.shape
    width = max(1, SLICE_BYTES // (4 * max(1, rows)))
    return [slice(start, min(start + width, columns)) for start in range(0, columns, width)]


def z_of(logits: torch.Tensor, head: Head, temperature: float = 1.0) -> torch.Tensor:
    """The transformed logits `softcap * tanh(logits / softcap) / temperature` of a slice, a new fp32 tensor."""
    z = logits.to(torch.float32, copy=True)
    if head.softcap is not None:
        z.div_(head.softcap).tanh_().mul_(head.softcap)
    if temperature != 1.0:
        z.div_(temperature)
    return z


def normaliser(
    logits: torch.Tensor,
    head: Head,
    temperature: float = 1.0,
    each: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row `top = max(z)` and `log_sum = log(sum(exp(z - top)))` ([rows, 1] fp32; log softmax = z - top -
    log_sum), a vocabulary slice at a time; `each(shifted, e)` is given every slice's `z - top` and its exp."""
    top = z_of(logits.amax(dim=1, keepdim=True), head, temperature)  # the transform is increasing
    sums = torch.zeros_like(top)
    for cols in slices(logits):
        shifted = z_of(logits[:, cols], head, temperature).sub_(top)
        e = shifted.exp()
        sums += e.sum(dim=1, keepdim=True)
        if each is not None:
            each(shifted, e)
        del shifted, e  # before the next slice's
    return top, sums.log_()


def add_at_targets_(grad: torch.Tensor, cols: slice, targets: torch.Tensor, values: torch.Tensor) -> None:
    """grad[row, targets[row] - cols.start] += values[row] for the rows whose target is in the slice `cols`."""
    inside = (targets >= cols.start) & (targets < cols.stop)
    index = (targets - cols.start).clamp_(0, grad.shape[1] - 1)
    grad.scatter_add_(1, index, torch.where(inside, values, 0.0))


def gradient_into_logits_(
    logits: torch.Tensor,
    head: Head,
    temperature: float,
    dz: Callable[[slice, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """d(loss)/d(logits) into the logits' own buffer, a vocabulary slice at a time: `dz(cols, z)` is d(loss)/dz
    for the slice's transformed logits z (fp32; it may return z's buffer); then the transform's derivative."""
    for cols in slices(logits):
        z = z_of(logits[:, cols], head, temperature)
        # d(cap * tanh(x / cap)) / dx = 1 - tanh^2, and tanh = z * temperature / cap (before dz may reuse z)
        tanh_squared = None if head.softcap is None else (z * (temperature / head.softcap)).square_()
        grad = dz(cols, z)
        if temperature != 1.0:
            grad.div_(temperature)
        if tanh_squared is not None:
            grad.addcmul_(grad, tanh_squared, value=-1)
        logits[:, cols] = grad
        del z, grad, tanh_squared
    if head.logit_scale is not None:
        logits.mul_(head.logit_scale)
    return logits


def softmax_minus_one_hot(lse: torch.Tensor, targets: torch.Tensor) -> Callable[[slice, torch.Tensor], torch.Tensor]:
    """dz for `gradient_into_logits_` of -log softmax(z)[target]: softmax(z) - one_hot(target)."""
    minus_one = torch.full_like(lse, -1.0)

    def dz(cols: slice, z: torch.Tensor) -> torch.Tensor:
        p = z.sub_(lse).exp_()
        add_at_targets_(p, cols, targets, minus_one)
        return p

    return dz
