"""fastckpt.linear_log_probs against the full logits: per-token log-probabilities, entropy and the rest, and the
gradients through log_probs and entropy, for a frozen head (gradients per row, in the forward) and a trained one
(recomputed in backward), with a soft cap, a temperature, a logit scale and a bias."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastckpt import linear_log_probs
from fastckpt.heads import chunks as head_chunks
from fastckpt.memory import peak_bytes

V, H = 101, 16


def _reference(hidden, weight, bias, labels, temperature, softcap, scale):
    z = F.linear(hidden, weight, bias)
    z = (z if scale is None else z * scale).float()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    logp = z.log_softmax(-1)
    p = logp.exp()
    return (
        logp.gather(-1, labels[..., None])[..., 0],
        -(p * logp).sum(-1),
        (p * p).sum(-1).log(),
        z.mean(-1),
        z.argmax(-1) == labels,
    )


@pytest.mark.parametrize("trained", [False, True], ids=["frozen", "trained"])
@pytest.mark.parametrize("transform", [None, (0.7, 30.0, 0.5)], ids=["plain", "temperature-softcap-scale"])
@pytest.mark.parametrize("entropy_grad", [False, True], ids=["logp-grad", "logp-entropy-grad"])
@pytest.mark.parametrize("sliced", [False, True], ids=["one-slice", "slices"])
def test_matches_the_full_logits(monkeypatch, trained, transform, entropy_grad, sliced):
    if sliced:  # the passes over vocabulary slices in pieces of 7 columns (101 = 14 x 7 + 3) for 10-token chunks
        monkeypatch.setattr(head_chunks, "SLICE_BYTES", 4 * 10 * 7)
    torch.manual_seed(0)
    temperature, softcap, scale = transform or (1.0, None, None)
    hidden = torch.randn(2, 37, H, requires_grad=True)
    weight = torch.randn(V, H, requires_grad=trained)
    bias = torch.randn(V, requires_grad=trained) if transform else None
    labels = torch.randint(0, V, (2, 37))
    factors = torch.randn(2, 2, 37)
    results = []
    for ours in (False, True):
        for t in (hidden, weight, bias):
            if t is not None:
                t.grad = None
        if ours:
            out = linear_log_probs(
                hidden,
                weight,
                labels,
                bias=bias,
                temperature=temperature,
                softcap=softcap,
                logit_scale=scale,
                chunk_size=10,  # four chunks, the last one short
                outputs=("entropy", "log_sum_sq_probs", "mean_logits", "is_top1"),
            )
        else:
            out = _reference(hidden, weight, bias, labels, temperature, softcap, scale)
        loss = (out[0] * factors[0]).sum() + ((out[1] * factors[1]).sum() if entropy_grad else 0)
        loss.backward()
        results.append((out, [None if t is None else t.grad for t in (hidden, weight, bias)]))
    (want, want_grads), (got, got_grads) = results
    for w, g in zip(want, got, strict=True):
        if w.dtype == torch.bool:
            assert torch.equal(w, g)
        else:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    for w, g in zip(want_grads, got_grads, strict=True):
        assert (w is None) == (g is None)
        if w is not None:
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_bf16_autocast_is_as_close_as_the_full_logits_in_bf16():
    """Under autocast the head's matmuls run in bf16, the rest in fp32, as F.linear + log_softmax's upcast."""
    torch.manual_seed(0)
    hidden, weight, labels = torch.randn(64, H, requires_grad=True), torch.randn(V, H), torch.randint(0, V, (64,))
    grads = []
    for ours in (False, True):
        hidden.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if ours:
                log_probs = linear_log_probs(hidden, weight, labels, chunk_size=16).log_probs
            else:
                log_probs = _reference(hidden, weight, None, labels, 1.0, None, None)[0]
        assert log_probs.dtype == torch.float32
        log_probs.sum().backward()
        grads.append(hidden.grad)
    assert (grads[1] - grads[0]).norm() / grads[0].norm() < 1e-2


@pytest.mark.parametrize("softcap", [None, 30.0], ids=["plain", "softcap"])
def test_the_logits_are_the_chunks_one_buffer(monkeypatch, softcap):
    """A chunk's working memory is its logits in the compute dtype and fp32 temporaries of a vocabulary slice (the
    normaliser, the entropy, the gradient and the soft cap's derivative, slice by slice), in the forward and in
    backward's recomputation: no fp32 copy of the chunk's logits, no log-softmax beside it."""
    monkeypatch.setattr(head_chunks, "SLICE_BYTES", 2**20)
    tokens, chunk, vocab, hidden_size = 256, 64, 32768, 32
    hidden = torch.randn(tokens, hidden_size, requires_grad=True)
    weight, labels = torch.randn(vocab, hidden_size), torch.randint(0, vocab, (tokens,))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = linear_log_probs(hidden, weight, labels, softcap=softcap, chunk_size=chunk, outputs=("entropy",))
        (out.log_probs.sum() + out.entropy.sum()).backward()

    peak = peak_bytes(step)
    logits_bf16, logits_fp32 = chunk * vocab * 2, chunk * vocab * 4
    others = vocab * hidden_size * 2 + 4 * tokens * hidden_size * 4  # the bf16 weight; rows, gradients and outputs
    # What the host's bf16 matmul allocates beside its output (AMX hosts: a packed copy of the weight; 0 on others)
    rows, weights = torch.randn(chunk, hidden_size, dtype=torch.bfloat16), weight.to(torch.bfloat16)
    workspace = peak_bytes(lambda: rows @ weights.T) - logits_bf16
    bound = logits_bf16 + 3 * head_chunks.SLICE_BYTES + others + workspace
    assert peak <= bound < logits_bf16 + logits_fp32, (peak, bound)


def test_no_grad_computes_no_gradient():
    hidden = torch.randn(8, H, requires_grad=True)
    with torch.no_grad():
        out = linear_log_probs(hidden, torch.randn(V, H), torch.randint(0, V, (8,)), outputs=("entropy",))
    assert not out.log_probs.requires_grad and out.is_top1 is None


def test_bad_arguments_are_named():
    hidden, weight = torch.randn(4, 8), torch.randn(16, 8)
    with pytest.raises(ValueError, match="`outputs`"):
        linear_log_probs(hidden, weight, torch.zeros(4, dtype=torch.long), outputs=("logits",))
    with pytest.raises(ValueError, match="`labels`"):
        linear_log_probs(hidden, weight, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="`temperature`"):
        linear_log_probs(hidden, weight, torch.zeros(4, dtype=torch.long), temperature=0.0)
    with pytest.raises(TypeError, match="linear_log_probs: the head's inputs have different dtypes"):
        linear_log_probs(hidden, weight.bfloat16(), torch.zeros(4, dtype=torch.long))
