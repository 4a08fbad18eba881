"""A drop-in raises torch's own sentences: every error (and warning) torch.utils.checkpoint raises, triggered
the same way through both, must carry torch's text (without its "torch.utils.checkpoint: " prefix) in ours."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.utils.checkpoint import CheckpointError

import fastckpt

TORCH_PREFIX = "torch.utils.checkpoint: "
# The sentences are torch 2.14's (CI's pin). Older releases word some differently and raise other types
# (2.11 lets a context_fn suppress a forward exception): the comparison only holds from 2.14 on.
TORCH_HAS_RESPECT_HOOKS = "respect_saved_tensors_hooks" in inspect.signature(torch_checkpoint.checkpoint).parameters
pytestmark = pytest.mark.skipif(not TORCH_HAS_RESPECT_HOOKS, reason="the reference sentences are torch 2.14's")


def _fewer_in_recompute(checkpoint):
    calls = []

    def fn(x):
        calls.append(1)
        return x.sin().exp() if len(calls) == 1 else x.sin()

    x = torch.randn(4, requires_grad=True)
    checkpoint(fn, x, use_reentrant=False).sum().backward()


def _more_in_recompute(checkpoint):
    calls = []

    def fn(x):
        calls.append(1)
        return x.sin() if len(calls) == 1 else x.sin().exp().cos()

    x = torch.randn(4, requires_grad=True)
    checkpoint(fn, x, use_reentrant=False, early_stop=False).sum().backward()  # early stop would cut it short


def _other_shape_in_recompute(checkpoint):
    calls = []

    def fn(x):
        calls.append(1)
        return x.sin().exp() if len(calls) == 1 else x[:2].sin().exp()

    x = torch.randn(4, requires_grad=True)
    checkpoint(fn, x, use_reentrant=False).sum().backward()


def _unpacked_twice(checkpoint):
    class ReadsTwice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            ctx.saved_tensors  # noqa: B018
            (x,) = ctx.saved_tensors
            return grad * x

    x = torch.randn(4, requires_grad=True)
    checkpoint(lambda t: ReadsTwice.apply(t.sin()), x, use_reentrant=False).sum().backward()


def _suppressing_context(checkpoint):
    import contextlib

    def context_fn():
        return contextlib.suppress(ZeroDivisionError), contextlib.nullcontext()

    def fn(x):
        raise ZeroDivisionError

    checkpoint(fn, torch.randn(2, requires_grad=True), use_reentrant=False, context_fn=context_fn)


def _debug_with_context_fn(checkpoint):
    import contextlib

    context_fn = lambda: (contextlib.nullcontext(), contextlib.nullcontext())  # noqa: E731
    checkpoint(torch.sin, torch.randn(2, requires_grad=True), use_reentrant=False, debug=True, context_fn=context_fn)


def _bad_determinism_check(checkpoint):
    checkpoint(torch.sin, torch.randn(2, requires_grad=True), use_reentrant=False, determinism_check="strict")


def _reentrant_with_debug(checkpoint):
    checkpoint(torch.sin, torch.randn(2, requires_grad=True), use_reentrant=True, debug=True)


def _reentrant_with_respect_hooks(checkpoint):
    checkpoint(torch.sin, torch.randn(2, requires_grad=True), use_reentrant=True, respect_saved_tensors_hooks=True)


def _reentrant_with_kwargs(checkpoint):
    checkpoint(torch.sin, torch.randn(2, requires_grad=True), use_reentrant=True, out=None)


def _reentrant_under_grad(checkpoint):
    x = torch.randn(2, requires_grad=True)
    torch.autograd.grad(checkpoint(torch.sin, x, use_reentrant=True).sum(), x)


def _reentrant_no_output_requires_grad(checkpoint):
    x = torch.randn(2, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = checkpoint(lambda t: t.detach().sin(), x, use_reentrant=True)
    (out + x).sum().backward()


def _curried_with_unknown_keyword(checkpoint):
    checkpoint(use_reentrant=False, bogus=1)


def _sequential_with_unknown_keyword(checkpoint):
    seq = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh())
    ours = checkpoint is fastckpt.checkpoint
    sequential = fastckpt.checkpoint_sequential if ours else torch_checkpoint.checkpoint_sequential
    sequential(seq, 1, torch.randn(1, 2), use_reentrant=False, bogus=1)


ERROR_CASES = [
    _fewer_in_recompute,
    _more_in_recompute,
    _other_shape_in_recompute,
    _unpacked_twice,
    _suppressing_context,
    _debug_with_context_fn,
    _bad_determinism_check,
    _reentrant_with_debug,
    _reentrant_with_respect_hooks,
    _reentrant_with_kwargs,
    _reentrant_under_grad,
    _reentrant_no_output_requires_grad,
    _curried_with_unknown_keyword,
    _sequential_with_unknown_keyword,
]


def _raised(case, checkpoint) -> BaseException:
    with pytest.raises(Exception) as info:
        case(checkpoint)
    return info.value


def _first_sentences(message: str) -> list[str]:
    """torch's message without its prefix, cut into lines; per-line text up to torch's debug tip."""
    message = message.removeprefix(TORCH_PREFIX).split("\nTip:")[0]
    return [line for line in message.splitlines() if line.strip()]


@pytest.mark.parametrize("case", ERROR_CASES, ids=lambda case: case.__name__.strip("_"))
def test_errors_carry_torchs_sentences(case):
    expected = _raised(case, torch_checkpoint.checkpoint)
    got = _raised(case, fastckpt.checkpoint)
    assert isinstance(got, type(expected)), (type(got), type(expected))
    for line in _first_sentences(str(expected)):
        assert line in str(got), f"torch says {line!r}; fastckpt said:\n{got}"


def test_debug_trace_opens_with_torchs_sentence():
    def fewer_with_debug(checkpoint):
        with torch_checkpoint.set_checkpoint_debug_enabled(True):
            _fewer_in_recompute(checkpoint)

    expected = _raised(fewer_with_debug, torch_checkpoint.checkpoint)
    got = _raised(fewer_with_debug, fastckpt.checkpoint)
    assert isinstance(got, CheckpointError) and isinstance(expected, CheckpointError)
    first_line = str(expected).strip().splitlines()[0]
    assert first_line.startswith("An error happened while unpacking tensors")
    assert first_line in str(got)
    assert "A different number of tensors was saved" in str(got)  # and what went wrong


def test_checkpoint_errors_are_checkpoint_errors():
    assert isinstance(_raised(_fewer_in_recompute, fastckpt.checkpoint), CheckpointError)
    assert isinstance(_raised(_unpacked_twice, fastckpt.checkpoint), CheckpointError)


def test_reentrant_warning_matches_torch():
    x = torch.randn(2)  # no input requires grad
    with pytest.warns(UserWarning) as expected:
        torch_checkpoint.checkpoint(torch.sin, x, use_reentrant=True)
    with pytest.warns(UserWarning) as got:
        fastckpt.checkpoint(torch.sin, x, use_reentrant=True)
    torch_texts = {str(w.message) for w in expected if "requires_grad" in str(w.message)}
    assert torch_texts and torch_texts <= {str(w.message) for w in got}


def test_respect_saved_tensors_hooks_reaches_selective_checkpointing():
    """The option torch 2.14 added for SAC: with True, what SAC caches goes through the user's hooks."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy_fn(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    packed = []

    def pack(t):
        packed.append(t.shape)
        return t

    a = torch.randn(8, 8, requires_grad=True)
    b = torch.randn(8, 8)
    for respect in (False, True):
        packed.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fastckpt.checkpoint(
                lambda x: (x @ b).sin(),
                a,
                context_fn=lambda: create_selective_checkpoint_contexts(policy_fn),
                respect_saved_tensors_hooks=respect,
            )
        out.sum().backward()
        saw_cached_mm = torch.Size([8, 8]) in packed[1:]  # packed[0] is the segment input
        assert saw_cached_mm is respect


# ---- the sentences torch's own checkpoint tests match (assertRaisesRegex), raised by ours with our inputs ----


def _shape_changes_in_recompute():
    calls = []

    def fn(t):
        calls.append(1)
        return t.cos().exp() if len(calls) == 1 else t[1:].cos().exp()

    return fn


def _debug_true():
    x = torch.randn(3, requires_grad=True)
    fastckpt.checkpoint(_shape_changes_in_recompute(), x, use_reentrant=False, debug=True).sum().backward()


def _debug_enabled_globally():
    x = torch.randn(3, requires_grad=True)
    with torch_checkpoint.set_checkpoint_debug_enabled(True):
        fastckpt.checkpoint(_shape_changes_in_recompute(), x, use_reentrant=False).sum().backward()


def _debug_disabled_globally():  # the global switch wins over debug=True, as in torch
    x = torch.randn(3, requires_grad=True)
    with torch_checkpoint.set_checkpoint_debug_enabled(False):
        fastckpt.checkpoint(_shape_changes_in_recompute(), x, use_reentrant=False, debug=True).sum().backward()


def _returned_input_backward_twice():
    w, x = torch.randn(5, requires_grad=True), torch.randn(5, requires_grad=True)
    out = fastckpt.checkpoint(lambda w, x: ((w * x).tanh(), x), w, x, use_reentrant=True)
    out[1].sum().backward()
    out[1].sum().backward()


def _saved_result_after_backward():
    x = torch.randn(4, requires_grad=True)
    out = fastckpt.checkpoint(torch.tanh, x, use_reentrant=False)
    out.sum().backward()
    out.grad_fn._saved_result  # noqa: B018


def _overlapping_backwards_in_exec_group():
    x = torch.randn(4, requires_grad=True)
    out = fastckpt.checkpoint(lambda t: t.tanh().exp(), x, use_reentrant=False)
    with torch_checkpoint.GraphExecGroup():
        out.sum().backward(retain_graph=True)
        out.sum().backward()


def _selective(fn, x, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.tanh.default else CheckpointPolicy.PREFER_RECOMPUTE

    return fastckpt.checkpoint(
        fn, x, use_reentrant=False, context_fn=lambda: create_selective_checkpoint_contexts(policy, **kwargs)
    )


def _selective_cache_mutated():
    _selective(lambda t: t.tanh().mul_(3).exp(), torch.randn(4, requires_grad=True)).sum().backward()


def _selective_backward_twice():
    out = _selective(lambda t: t.tanh().exp(), torch.randn(4, requires_grad=True))
    out.sum().backward(retain_graph=True)
    out.sum().backward(retain_graph=True)


VALUE_ERRORS = {
    "debug=True is incompatible with non-default context_fn",
    "determinism_check should be one of",
    "only supported when use_reentrant=False",
}
TORCH_TEST_SENTENCES = [
    (_debug_true, "You are seeing this error because you passed `debug=True` to checkpoint"),
    (_debug_enabled_globally, "You are seeing this error because you passed `debug=True` to checkpoint"),
    (_debug_disabled_globally, "Recomputed values for the following tensors have different"),
    (lambda: _fewer_in_recompute(fastckpt.checkpoint), "A different number of tensors was saved"),
    (lambda: _more_in_recompute(fastckpt.checkpoint), "trying to save more tensors during recomputation"),
    (lambda: _other_shape_in_recompute(fastckpt.checkpoint), "tensors have different metadata"),
    (
        lambda: _unpacked_twice(fastckpt.checkpoint),
        "Unpack is being triggered for a tensor that was already unpacked once",
    ),
    (_saved_result_after_backward, "or directly access saved tensors after they have already been freed"),
    (_overlapping_backwards_in_exec_group, "Performing two backward calls that overlap"),
    (_selective_cache_mutated, "has been mutated"),
    (_selective_backward_twice, "Trying to backward an extra time"),
    (lambda: _debug_with_context_fn(fastckpt.checkpoint), "debug=True is incompatible with non-default context_fn"),
    (lambda: _bad_determinism_check(fastckpt.checkpoint), "determinism_check should be one of"),
    (lambda: _reentrant_with_debug(fastckpt.checkpoint), "only supported when use_reentrant=False"),
    (lambda: _reentrant_under_grad(fastckpt.checkpoint), "torch.utils.checkpoint is incompatible"),
    (
        lambda: _reentrant_no_output_requires_grad(fastckpt.checkpoint),
        r"none of output has requires_grad=True, this checkpoint\(\) is not necessary",
    ),
    (_returned_input_backward_twice, "Trying to backward through the graph a second time"),
]


@pytest.mark.parametrize(("case", "sentence"), TORCH_TEST_SENTENCES, ids=[s for _, s in TORCH_TEST_SENTENCES])
def test_sentences_torchs_own_tests_match(case, sentence):
    with pytest.raises(ValueError if sentence in VALUE_ERRORS else RuntimeError, match=sentence):
        case()


def test_debug_error_carries_torchs_closing_paragraph():
    def debug_true(checkpoint):
        x = torch.randn(3, requires_grad=True)
        checkpoint(_shape_changes_in_recompute(), x, use_reentrant=False, debug=True).sum().backward()

    expected = str(_raised(debug_true, torch_checkpoint.checkpoint))
    got = str(_raised(debug_true, fastckpt.checkpoint))
    closing = expected[expected.index("ERROR: Detected non-determinism") :].split("\n\n To identify")[0]
    for line in closing.splitlines():
        assert line.strip() in got, f"torch says {line.strip()!r}; fastckpt said:\n{got}"
    assert "Tip: pass debug=True" not in got  # the advice to do what was done is dropped


def test_debug_disabled_globally_gives_the_plain_error():
    with pytest.raises(CheckpointError) as info:
        _debug_disabled_globally()
    got = str(info.value)
    assert "You are seeing this error" not in got and "Operators in the original forward" not in got
