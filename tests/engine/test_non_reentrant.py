"""Non-reentrant checkpoint behaviours (the drop-in contract: docs/policies.md), each checked against plain autograd."""

from __future__ import annotations

import functools
import gc
import weakref

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.utils.checkpoint import CheckpointError, CheckpointPolicy, create_selective_checkpoint_contexts

import fastckpt
from tests.models import pointwise_chain


def counted(fn):
    """fn wrapped so that every call (forward or recompute) is counted in .calls."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        wrapper.calls += 1
        return fn(*args, **kwargs)

    wrapper.calls = 0
    return wrapper


def test_default_is_non_reentrant_without_warning(recwarn):
    x = torch.randn(3, requires_grad=True)
    out = fastckpt.checkpoint(lambda x, *, k: x.sin() * k, x, k=2.0)  # kwargs: only non-reentrant takes them
    out.sum().backward()
    assert not [w for w in recwarn if "use_reentrant" in str(w.message)]
    assert torch.equal(x.grad, 2.0 * x.detach().cos())


def test_curried_form_and_method_decorator():
    x = torch.randn(3, requires_grad=True)
    fn = counted(pointwise_chain)
    out = fastckpt.checkpoint(use_reentrant=False)(fn)(x)
    out.sum().backward()
    assert fn.calls == 2 and torch.equal(out, pointwise_chain(x))

    class Layer(torch.nn.Module):
        @fastckpt.checkpoint(use_reentrant=False)
        def forward(self, x):
            return x.tanh() * 3

    y = Layer()(x)
    assert y.grad_fn is not None and torch.equal(y, x.tanh() * 3)


def test_one_forward_and_one_recompute_per_backward():
    x = torch.randn(5, requires_grad=True)
    fn = counted(pointwise_chain)
    out = fastckpt.checkpoint(fn, x)
    assert fn.calls == 1
    out.sum().backward(retain_graph=True)
    assert fn.calls == 2
    out.sum().backward()
    assert fn.calls == 3


def test_grad_disabled_is_a_plain_call():
    x = torch.randn(5, requires_grad=True)
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        with torch.no_grad():
            out = fastckpt.checkpoint(pointwise_chain, x)
    assert out.grad_fn is None and not seen and torch.equal(out, pointwise_chain(x))


def test_no_input_requires_grad_parameters_still_get_grads():
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    fastckpt.checkpoint(layer, x).sum().backward()
    expected = torch.autograd.grad(layer(x).sum(), layer.weight)[0]
    assert torch.equal(layer.weight.grad, expected)


def test_autograd_grad_and_backward_inputs():
    x, w = torch.randn(5, requires_grad=True), torch.randn(5, requires_grad=True)

    def fn(x, w):
        return (x * w).sin()

    (gx,) = torch.autograd.grad(fastckpt.checkpoint(fn, x, w).sum(), x)
    assert torch.equal(gx, torch.autograd.grad(fn(x, w).sum(), x)[0])
    fastckpt.checkpoint(fn, x, w).sum().backward(inputs=[w])
    assert x.grad is None and torch.equal(w.grad, torch.autograd.grad(fn(x, w).sum(), w)[0])


def test_higher_order_gradients():
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)

    def grads(forward):
        y = forward(x).sum()
        (g1,) = torch.autograd.grad(y, x, create_graph=True)
        (g2,) = torch.autograd.grad(g1.sum(), x, create_graph=True)
        (g3,) = torch.autograd.grad(g2.sum(), x)
        return g1, g2, g3

    ours_and_plain = zip(grads(lambda x: fastckpt.checkpoint(pointwise_chain, x)), grads(pointwise_chain), strict=True)
    for ours, plain in ours_and_plain:
        assert torch.equal(ours, plain)


def test_function_that_calls_autograd_inside():
    x = torch.randn(4, requires_grad=True)

    def fn(x):
        y = (x**3).sum()
        (g,) = torch.autograd.grad(y, x, create_graph=True)
        return g * x.sin()

    fastckpt.checkpoint(fn, x).sum().backward()
    ours, x.grad = x.grad, None
    fn(x).sum().backward()
    assert torch.equal(ours, x.grad)


def test_detached_tensors_and_no_grad_blocks_inside():
    x = torch.randn(4, requires_grad=True)

    def fn(x):
        with torch.no_grad():
            scale = x.abs().max()
        return x.sin() * scale + x.detach().cos()

    fastckpt.checkpoint(fn, x).sum().backward()
    ours, x.grad = x.grad, None
    fn(x).sum().backward()
    assert torch.equal(ours, x.grad)


def test_early_stop_and_its_global_override():
    x = torch.randn(4, requires_grad=True)
    tail_runs = []

    def fn(x):
        y = x.sin().cos()  # the last tensor saved for backward is saved here
        tail_runs.append(1)  # so an early-stopped recompute never gets here
        return y * 2

    fastckpt.checkpoint(fn, x).sum().backward()
    assert len(tail_runs) == 1
    tail_runs.clear()
    fastckpt.checkpoint(fn, x, early_stop=False).sum().backward()
    assert len(tail_runs) == 2
    tail_runs.clear()
    with torch_checkpoint.set_checkpoint_early_stop(False):
        fastckpt.checkpoint(fn, x).sum().backward()
    assert len(tail_runs) == 2


class _Probe(torch.autograd.Function):
    """Saves its input; its backward reads ctx.saved_tensors `reads` times and records the tensor."""

    seen: list = []
    reads = 1

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        for _ in range(_Probe.reads):
            (saved,) = ctx.saved_tensors
        _Probe.seen.append(weakref.ref(saved))
        return grad * 2


def test_recomputed_tensors_freed_on_use_even_with_retain_graph():
    x = torch.randn(1000, requires_grad=True)
    _Probe.seen, _Probe.reads = [], 1
    out = fastckpt.checkpoint(lambda x: _Probe.apply(x.sin()).sum(), x)
    out.backward(retain_graph=True)
    gc.collect()
    assert len(_Probe.seen) == 1 and _Probe.seen[0]() is None, "recomputed tensor outlived its use"
    out.backward()
    assert len(_Probe.seen) == 2


def test_unpacking_twice_in_one_backward_is_an_error():
    x = torch.randn(8, requires_grad=True)
    _Probe.reads = 2
    try:
        out = fastckpt.checkpoint(lambda x: _Probe.apply(x.sin()).sum(), x)
        with pytest.raises(CheckpointError, match="already unpacked"):
            out.backward()
    finally:
        _Probe.reads = 1


def test_inplace_modification_of_input_caught_at_backward():
    x = torch.randn(4, requires_grad=True)
    inp = x * 1
    out = fastckpt.checkpoint(pointwise_chain, inp)
    inp.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


class _Toggle:
    def __init__(self, forward_behaviour, recompute_behaviour):
        self.behaviours = [forward_behaviour, recompute_behaviour]

    def __call__(self, x):
        return self.behaviours.pop(0)(x)


@pytest.mark.parametrize(
    "recompute, message",
    [
        (lambda x: x.sin(), "different number of tensors"),  # fewer tensors saved in recompute
        (lambda x: x.sin().exp().exp(), "more tensors"),  # more tensors saved in recompute
        (lambda x: x[:2].sin().exp(), "different metadata"),  # other shapes
        (lambda x: x.double().sin().exp(), "different metadata"),  # other dtype
    ],
)
def test_determinism_check(recompute, message):
    x = torch.randn(4, requires_grad=True)
    fn = _Toggle(lambda x: x.sin().exp(), recompute)
    out = fastckpt.checkpoint(fn, x, early_stop=False)
    with pytest.raises(CheckpointError, match=message):
        out.sum().backward()


def test_determinism_check_none_skips_the_metadata_check():
    x = torch.randn(4, requires_grad=True)
    fn = _Toggle(lambda x: (x * 2).sin(), lambda x: (x * 2).double().sin())
    fastckpt.checkpoint(fn, x, determinism_check="none").sum().backward()
    assert x.grad is not None


@pytest.mark.parametrize("how", ["argument", "global"])
def test_debug_adds_the_operator_trace(how):
    x = torch.randn(4, requires_grad=True)
    fn = _Toggle(lambda x: x.sin().exp(), lambda x: x.sin())
    if how == "argument":
        out = fastckpt.checkpoint(fn, x, debug=True)
    else:
        with torch_checkpoint.set_checkpoint_debug_enabled(True):
            out = fastckpt.checkpoint(fn, x)
    with pytest.raises(CheckpointError, match=r"(?s)original forward.*aten\.exp.*recomputation.*aten\.sin"):
        out.sum().backward()


def test_debug_and_context_fn_together_are_refused():
    with pytest.raises(ValueError, match="debug=True is incompatible with non-default context_fn"):
        x = torch.randn(2, requires_grad=True)
        fastckpt.checkpoint(pointwise_chain, x, debug=True, context_fn=lambda: (None, None))


def test_no_reference_cycles_graph_freed_when_outputs_die():
    gc.collect()
    gc.disable()
    try:
        layer = torch.nn.Linear(8, 8)
        x = torch.randn(2, 8, requires_grad=True)
        inp = x * 2
        inp_ref, layer_ref = weakref.ref(inp), weakref.ref(layer)
        out = fastckpt.checkpoint(layer, inp)
        del inp, layer
        assert inp_ref() is not None  # kept for recompute while the graph lives
        del out
        assert inp_ref() is None and layer_ref() is None, "graph kept alive by a reference cycle"
    finally:
        gc.enable()


def test_selective_checkpoint_context_fn_saves_chosen_ops():
    x = torch.randn(6, 6, requires_grad=True)
    w = torch.randn(6, 6, requires_grad=True)

    def fn(x, w):
        return torch.sigmoid(torch.mm(torch.mm(x, w), w)).sum()

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    fastckpt.checkpoint(fn, x, w, context_fn=context_fn).backward()
    ours = (x.grad, w.grad)
    x.grad = w.grad = None
    fn(x, w).backward()
    assert torch.equal(ours[0], x.grad) and torch.equal(ours[1], w.grad)


def test_composes_with_save_on_cpu():
    x = torch.randn(8, requires_grad=True)
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t.shape) or t, lambda t: t):
        out = fastckpt.checkpoint(pointwise_chain, x)
    assert seen == [x.shape]  # the user's hooks see the segment input, nothing from inside
    with torch.autograd.graph.save_on_cpu():
        out = fastckpt.checkpoint(pointwise_chain, x)
    out.sum().backward()
    ours, x.grad = x.grad, None
    pointwise_chain(x).sum().backward()
    assert torch.equal(ours, x.grad)


def test_ambient_default_device_is_replayed():
    x = torch.randn(4, device="meta", requires_grad=True)
    with torch.device("meta"):
        out = fastckpt.checkpoint(lambda x: x * torch.ones(4), x)
    out.sum().backward()  # recompute outside the block still builds torch.ones on meta
    assert x.grad.device.type == "meta"


def test_preserve_rng_state_false_is_accepted():
    x = torch.randn(16, requires_grad=True)
    out = fastckpt.checkpoint(lambda x: torch.nn.functional.dropout(x, 0.5), x, preserve_rng_state=False)
    out.sum().backward()
    assert x.grad.shape == x.shape


def test_data_parallel_wrapper():
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4)
    model = torch.nn.DataParallel(layer)
    x = torch.randn(3, 4, requires_grad=True)
    fastckpt.checkpoint(model, x).sum().backward()
    ours = layer.weight.grad.clone()
    layer.weight.grad = None
    layer(x).sum().backward()
    assert torch.equal(ours, layer.weight.grad)


@pytest.mark.cuda
def test_device_initialised_inside_forward_is_refused():
    import subprocess
    import sys

    code = (
        "import torch, fastckpt\n"
        "x = torch.randn(3, requires_grad=True)\n"  # CUDA not initialised before the forward
        "try:\n"
        "    fastckpt.checkpoint(lambda x: x.cuda().sin().cpu(), x)\n"
        "except RuntimeError as err:\n"
        "    assert 'initialized in the forward pass' in str(err), err\n"
        "else:\n"
        "    raise AssertionError('no error')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("policy", ["recompute", "recompute+int8", "recompute:int8+int8"])
def test_a_tensor_passed_twice_comes_back_as_one_object_in_the_recomputation(policy):
    # MultiheadAttention takes its packed self-attention path only when `query is key is value`; inputs stored
    # through a codec used to come back as three tensors, the recomputation took the other path and its
    # saved tensors did not match the forward's.
    seen = []

    def fn(a, b):
        seen.append(a is b)
        return a.sin() * b.cos()

    x = torch.randn(64, 64, requires_grad=True) * 1
    fastckpt.checkpoint(fn, x, x, policy=policy).sum().backward()
    assert seen == [True, True]
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(64, 2, batch_first=True)
    h = torch.randn(2, 128, 64, requires_grad=True)
    (plain,) = torch.autograd.grad(mha(h, h, h, need_weights=False)[0].sum(), h)
    h2 = h * 1
    out = fastckpt.checkpoint(mha, h2, h2, h2, need_weights=False, policy=policy)[0]
    (ours,) = torch.autograd.grad(out.sum(), h)
    assert ((ours - plain).norm() / plain.norm()).item() <= 1e-2
