"""fastckpt.linear_cross_entropy against the plain computation (F.linear -> .float() -> F.cross_entropy, as
Hugging Face's ForCausalLMLoss): losses and gradients in fp32 (tight) and bf16 (bf16 tolerances), the
options, frozen / tied / non-leaf weights, no_grad, the refused backward modes, memory and errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fastckpt
from fastckpt.heads import default_chunk_size
from fastckpt.memory import peak_bytes

FP32 = {"rtol": 1e-5, "atol": 1e-6}  # fp32: only the summation order differs


pytestmark = pytest.mark.usefixtures("one_thread")


def reference(
    hidden,
    weight,
    labels,
    *,
    bias=None,
    ignore_index=-100,
    reduction="mean",
    num_items_in_batch=None,
    softcap=None,
    logit_scale=None,
    shift_labels=False,
    chunk_size=None,
):
    """What the plain head + loss computes (chunk_size is the fused head's only)."""
    logits = F.linear(hidden, weight, bias)
    if logit_scale is not None:
        logits = logits * logit_scale
    logits = logits.float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if shift_labels:
        labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    logits, labels = logits.reshape(-1, weight.shape[0]), labels.reshape(-1)
    if num_items_in_batch is not None:
        return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum") / num_items_in_batch
    return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction=reduction)


def make(tokens=(50,), hidden_size=16, vocab=96, bias=False, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*tokens, hidden_size, generator=generator).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=generator) * 0.5).to(dtype).requires_grad_()
    b = torch.randn(vocab, generator=generator).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(0, vocab, tokens, generator=generator)
    labels.view(-1)[::5] = -100
    return hidden, weight, b, labels


def run(loss_fn, hidden, weight, bias, labels, grad_scale=1.0, autocast=False, **options):
    """The loss and the gradients of every input that requires grad."""
    inputs = [t for t in (hidden, weight, bias) if t is not None and t.requires_grad]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = loss_fn(hidden, weight, labels, bias=bias, **options)
    grads = torch.autograd.grad(loss * grad_scale, inputs) if inputs else ()
    return loss.detach(), grads


def assert_same(actual, expected, bf16=False):
    (loss, grads), (ref_loss, ref_grads) = actual, expected
    assert loss.dtype == ref_loss.dtype == torch.float32
    assert len(grads) == len(ref_grads)
    if not bf16:
        torch.testing.assert_close(loss, ref_loss, **FP32)
        for grad, ref in zip(grads, ref_grads, strict=True):
            assert grad.dtype == ref.dtype and grad.shape == ref.shape
            torch.testing.assert_close(grad, ref, **FP32)
        return
    torch.testing.assert_close(loss, ref_loss, rtol=1e-3, atol=1e-3)
    for grad, ref in zip(grads, ref_grads, strict=True):
        assert grad.dtype == ref.dtype and grad.shape == ref.shape
        # bf16 rounding of the logits and their gradient (one rounding per chunk of the weight gradient)
        torch.testing.assert_close(grad, ref, rtol=1.6e-2, atol=1.6e-2 * float(ref.abs().max()))


CASES = {
    "default": {},
    "bias": {"bias": True},
    "softcap": {"softcap": 2.0},
    "logit_scale": {"logit_scale": 0.25},
    "num_items_tensor": {"num_items_in_batch": torch.tensor(57)},
    "num_items_int": {"num_items_in_batch": 123},
    "sum": {"reduction": "sum"},
    "ignore_index": {"ignore_index": 3},
    "shift_3d": {"shift_labels": True, "tokens": (3, 17)},
    "3d": {"tokens": (2, 25)},
    "everything": {
        "bias": True,
        "softcap": 1.5,
        "logit_scale": 2.0,
        "num_items_in_batch": torch.tensor(40.0),
        "shift_labels": True,
        "tokens": (4, 13),
        "chunk_size": 5,
    },
}


def _case(name):
    options = dict(CASES[name])
    shape = {"tokens": options.pop("tokens", (50,)), "bias": options.pop("bias", False)}
    options.setdefault("chunk_size", 16)  # 50 tokens: 3 full chunks and a partial one
    return shape, options


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast"])
def test_equals_plain_head(name, precision):
    shape, options = _case(name)
    hidden, weight, bias, labels = make(**shape)
    labels[labels == -100] = options.get("ignore_index", -100)
    autocast = precision == "bf16-autocast"
    ours = run(fastckpt.linear_cross_entropy, hidden, weight, bias, labels, autocast=autocast, **options)
    expected = run(reference, hidden, weight, bias, labels, autocast=autocast, **options)
    assert_same(ours, expected, bf16=autocast)


def test_equals_transformers_causal_lm_loss():
    loss_utils = pytest.importorskip("transformers.loss.loss_utils")
    hidden, weight, _, labels = make(tokens=(3, 20), vocab=64)
    for num_items in (None, torch.tensor(31)):

        def hf(hidden, weight, labels, bias=None, num_items=num_items):
            return loss_utils.ForCausalLMLoss(F.linear(hidden, weight), labels, 64, num_items_in_batch=num_items)

        ours = run(
            fastckpt.linear_cross_entropy,
            hidden,
            weight,
            None,
            labels,
            shift_labels=True,
            num_items_in_batch=num_items,
            chunk_size=7,
        )
        assert_same(ours, run(hf, hidden, weight, None, labels))


@pytest.mark.parametrize("chunk_size", [1, 7, 49, 50, 51, 1000, None])
def test_any_chunk_size(chunk_size):
    hidden, weight, bias, labels = make(bias=True)
    ours = run(fastckpt.linear_cross_entropy, hidden, weight, bias, labels, chunk_size=chunk_size)
    assert_same(ours, run(reference, hidden, weight, bias, labels))


def test_pure_bf16_inputs_give_bf16_gradients():
    hidden, weight, bias, labels = make(bias=True, dtype=torch.bfloat16)
    ours = run(fastckpt.linear_cross_entropy, hidden, weight, bias, labels, chunk_size=16)
    assert all(g.dtype == torch.bfloat16 for g in ours[1])
    assert_same(ours, run(reference, hidden, weight, bias, labels), bf16=True)


def test_grad_output_other_than_one():
    hidden, weight, bias, labels = make(bias=True)
    ours = run(fastckpt.linear_cross_entropy, hidden, weight, bias, labels, grad_scale=-3.5, chunk_size=16)
    assert_same(ours, run(reference, hidden, weight, bias, labels, grad_scale=-3.5))


def test_non_contiguous_hidden():
    base = torch.randn(16, 3, 40, requires_grad=True)
    hidden = base.transpose(0, 1)[..., :16]  # [3, 16, 16], neither contiguous nor a plain row block
    _, weight, _, labels = make(tokens=(3, 16))
    ours = run(fastckpt.linear_cross_entropy, hidden, weight, None, labels, chunk_size=5)
    assert_same(ours, run(reference, hidden, weight, None, labels))
    loss = fastckpt.linear_cross_entropy(hidden, weight, labels, chunk_size=5)
    (grad,) = torch.autograd.grad(loss, base)
    (expected,) = torch.autograd.grad(reference(hidden, weight, labels), base)
    torch.testing.assert_close(grad, expected, **FP32)


@pytest.mark.parametrize("autocast", [False, True])
def test_ignored_chunks_and_all_ignored(autocast):
    hidden, weight, bias, labels = make(bias=True)
    labels[:20] = -100  # whole chunks without a counted token
    ours = run(fastckpt.linear_cross_entropy, hidden, weight, bias, labels, autocast=autocast, chunk_size=8)
    assert_same(ours, run(reference, hidden, weight, bias, labels, autocast=autocast), bf16=autocast)
    labels[:] = -100
    for options in ({}, {"num_items_in_batch": torch.tensor(7)}, {"reduction": "sum"}):
        loss, grads = run(fastckpt.linear_cross_entropy, hidden, weight, bias, labels, chunk_size=8, **options)
        ref_loss, ref_grads = run(reference, hidden, weight, bias, labels, **options)
        # torch: a mean over no items is NaN (0 / 0); its gradients are zero, as are ours
        torch.testing.assert_close(loss, ref_loss, equal_nan=True)
        assert torch.isnan(loss).item() == (options == {})
        for grad, ref in zip(grads, ref_grads, strict=True):
            assert torch.equal(ref, torch.zeros_like(ref)) and torch.equal(grad, ref)


def _matmuls(fn):
    with torch.profiler.profile() as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key in ("aten::mm", "aten::addmm", "aten::addmm_"))


@pytest.mark.parametrize("autocast", [False, True])
def test_frozen_weight_does_no_weight_gradient_work(autocast):
    hidden, weight, _, labels = make()
    weight.requires_grad_(False)  # LoRA: the head frozen
    ours = run(fastckpt.linear_cross_entropy, hidden, weight, None, labels, autocast=autocast, chunk_size=10)
    assert_same(ours, run(reference, hidden, weight, None, labels, autocast=autocast), bf16=autocast)
    # the 40 counted tokens of 50 (ignored ones skip the head) in 4 chunks: the logits and the hidden gradient,
    # nothing for the weight
    assert _matmuls(lambda: run(fastckpt.linear_cross_entropy, hidden, weight, None, labels, chunk_size=10)) == 8
    weight.requires_grad_(True)
    assert _matmuls(lambda: run(fastckpt.linear_cross_entropy, hidden, weight, None, labels, chunk_size=10)) == 12
    labels[:] = -100  # nothing counts: no head work at all
    assert _matmuls(lambda: run(fastckpt.linear_cross_entropy, hidden, weight, None, labels, chunk_size=10)) == 0


def test_hidden_without_grad():
    hidden, weight, bias, labels = make(bias=True)
    hidden.requires_grad_(False)
    ours = run(fastckpt.linear_cross_entropy, hidden, weight, bias, labels, chunk_size=16)
    assert len(ours[1]) == 2
    assert_same(ours, run(reference, hidden, weight, bias, labels))


@pytest.mark.parametrize("autocast", [False, True])
def test_tied_weight_accumulates_both_gradients(autocast):
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(96, 16)
    ids = torch.randint(0, 96, (2, 20))
    labels = torch.randint(0, 96, (2, 20))
    grads = []
    for loss_fn in (fastckpt.linear_cross_entropy, reference):
        embedding.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            hidden = torch.tanh(embedding(ids))
            loss = loss_fn(hidden, embedding.weight, labels, shift_labels=True)
        loss.backward()
        grads.append(embedding.weight.grad)
    if autocast:
        torch.testing.assert_close(grads[0], grads[1], rtol=1.6e-2, atol=1.6e-2 * float(grads[1].abs().max()))
    else:
        torch.testing.assert_close(grads[0], grads[1], **FP32)


def test_non_leaf_weight():
    hidden, weight, _, labels = make()
    scale = torch.tensor(1.5, requires_grad=True)
    ours = torch.autograd.grad(fastckpt.linear_cross_entropy(hidden, weight * scale, labels, chunk_size=9), scale)
    expected = torch.autograd.grad(reference(hidden, weight * scale, labels), scale)
    torch.testing.assert_close(ours, expected, **FP32)


@pytest.mark.parametrize("autocast", [False, True])
def test_no_grad_computes_the_loss_only(autocast):
    hidden, weight, bias, labels = make(bias=True)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = fastckpt.linear_cross_entropy(hidden, weight, labels, bias=bias, softcap=3.0, chunk_size=7)
        expected = reference(hidden, weight, labels, bias=bias, softcap=3.0)
    assert loss.grad_fn is None and not loss.requires_grad
    torch.testing.assert_close(loss, expected, **FP32)  # the same bf16 logits, upcast: fp32 from there
    with torch.no_grad():  # the 40 counted tokens of 50 in 4 chunks
        assert _matmuls(lambda: fastckpt.linear_cross_entropy(hidden, weight, labels, chunk_size=10)) == 4


def test_double_backward_and_second_backward_raise():
    hidden, weight, _, labels = make()
    loss = fastckpt.linear_cross_entropy(hidden, weight, labels)
    with pytest.raises(RuntimeError, match=r"^fastckpt.linear_cross_entropy: double backward \(create_graph=True"):
        torch.autograd.grad(loss, hidden, create_graph=True)
    loss = fastckpt.linear_cross_entropy(hidden, weight, labels)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"^fastckpt.linear_cross_entropy: a second backward .*retain_graph"):
        loss.backward()


def test_default_chunk_size():
    # The rule is bytes at large vocabularies: at most 64 MiB of the chunk's logits in bf16, its one [tokens,
    # vocab] buffer (was 48 MiB of fp32 logits with an fp32 copy beside the logits; before, 128 tokens whatever
    # the vocabulary, most of a real-shape LoRA step's peak; benchmarks/real_shapes.py).
    assert default_chunk_size(4096) == 128 and default_chunk_size(2048) == 256  # 2 MiB of fp32 logits
    assert default_chunk_size(32000) == 256  # a large vocabulary: 256 tokens (fewer reads of the weight)
    assert default_chunk_size(128256) == 256 and default_chunk_size(151936) == 208  # at most 64 MiB of bf16 logits
    assert default_chunk_size(256000) == 128 and default_chunk_size(10**7) == 32  # the 32-token floor
    assert default_chunk_size(128256, 4096, weight_grad=True) == 2048  # hidden / 2 with a weight gradient
    assert default_chunk_size(128256, 4096, weight_grad=False) == 256
    assert default_chunk_size(151936, 3584, weight_grad=True) == 1792
    assert all(
        default_chunk_size(v, h, t) % 16 == 0 for v in (7, 1000, 50257, 262144) for h in (10, 100, 1000) for t in (0, 1)
    )
    assert all(default_chunk_size(v) * v * 2 <= 64 * 2**20 for v in (4096, 128256, 151936, 256000))


@pytest.mark.parametrize("autocast", [False, True])
def test_peak_memory_well_below_plain(autocast):
    """2048 tokens x vocab 4096: the plain step holds several [tokens, vocab] fp32 tensors (32 MiB each)."""
    hidden, weight, _, labels = make(tokens=(2048,), hidden_size=64, vocab=4096)

    def step(loss_fn):
        def run_step():
            hidden.grad = weight.grad = None
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = loss_fn(hidden, weight, labels)
            loss.backward()

        return run_step

    plain, fused = peak_bytes(step(reference)), peak_bytes(step(fastckpt.linear_cross_entropy))
    logits_fp32 = 2048 * 4096 * 4
    assert plain > 2.5 * logits_fp32
    print(f"peak: plain {plain / 2**20:.1f} MiB, fused {fused / 2**20:.1f} MiB")
    assert fused < 0.5 * plain and fused < logits_fp32, (fused, plain)


BAD = [
    ({"hidden": [1.0]}, TypeError, "`hidden` must be a tensor"),
    ({"hidden": torch.randn(16)}, ValueError, r"`hidden` must be a floating-point tensor \[tokens, hidden_size\]"),
    ({"hidden": torch.ones(4, 16, dtype=torch.long)}, ValueError, "`hidden` must be a floating-point"),
    ({"weight": torch.randn(16, 96)}, ValueError, r"`weight` must be \[vocab_size, hidden_size\].*not its transpose"),
    ({"labels": torch.zeros(4, 3)}, TypeError, "`labels` must hold integer class indices"),
    ({"labels": torch.zeros(5, dtype=torch.long)}, ValueError, r"`labels` must have hidden's shape .*\(4,\)"),
    ({"bias": torch.zeros(3)}, ValueError, r"`bias` must be None or a tensor \[vocab_size\] = \[96\]"),
    ({"reduction": "none"}, ValueError, "`reduction` must be 'mean' or 'sum'"),
    ({"reduction": "sum", "num_items_in_batch": 3}, ValueError, "`num_items_in_batch` is the divisor"),
    ({"num_items_in_batch": torch.ones(2)}, ValueError, "`num_items_in_batch` must be a number or a one-element"),
    ({"softcap": 0.0}, ValueError, "`softcap` must be None or a finite number > 0"),
    ({"logit_scale": float("inf")}, ValueError, "`logit_scale` must be None or a finite number > 0"),
    ({"chunk_size": 0}, ValueError, r"`chunk_size` must be None \(the default\) or an int >= 1"),
    ({"ignore_index": 1.5}, TypeError, "`ignore_index` must be an int"),
    ({"shift_labels": 1}, TypeError, "`shift_labels` must be a bool"),
    ({"weight": torch.randn(96, 16, dtype=torch.float64)}, TypeError, "the head.s inputs have different dtypes"),
]


@pytest.mark.parametrize(("change", "error", "message"), BAD, ids=[m[:30] for _, _, m in BAD])
def test_bad_arguments_name_the_argument(change, error, message):
    arguments = {
        "hidden": torch.randn(4, 16),
        "weight": torch.randn(96, 16),
        "labels": torch.zeros(4, dtype=torch.long),
    }
    options = {k: v for k, v in change.items() if k not in arguments}
    arguments.update({k: v for k, v in change.items() if k in arguments})
    with pytest.raises(error, match="^fastckpt.linear_cross_entropy: " + message):
        fastckpt.linear_cross_entropy(arguments["hidden"], arguments["weight"], arguments["labels"], **options)


def test_benchmark_rows():
    from benchmarks import loss_head

    rows = loss_head.measure(shapes=[(96, 16, 256, 1 / 8)], warmup=0, rounds=1)
    assert [r["config"] for r in rows] == [loss_head.PLAIN, loss_head.RECOMPUTE, loss_head.FUSED]
    assert all(r["peak_mib"] > 0 and r["time_ms"] > 0 for r in rows)
    assert all(float(r["max_error"]) < 2e-2 for r in rows)
