"""Reentrant checkpoint (the C++ autograd Function) keeps torch's reentrant behaviours."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

import fastckpt
from tests.models import pointwise_chain


def reentrant(fn, *args, **kwargs):
    return fastckpt.checkpoint(fn, *args, use_reentrant=True, **kwargs)


def test_gradient_flows_through_the_cpp_node():
    x = torch.randn(5, requires_grad=True)
    out = reentrant(pointwise_chain, x)
    assert type(out.grad_fn).__name__ != "SinBackward0"  # one node for the whole segment
    out.sum().backward()
    ours, x.grad = x.grad, None
    pointwise_chain(x).sum().backward()
    assert torch.equal(ours, x.grad)


def test_warns_when_no_input_requires_grad():
    layer = torch.nn.Linear(3, 3)
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True"):
        out = reentrant(layer, torch.randn(2, 3))
    assert not out.requires_grad  # as in torch: reentrant cannot reach the parameters then


def test_error_at_backward_when_no_output_requires_grad():
    x = torch.randn(3, requires_grad=True)
    out = reentrant(lambda x: (x.detach() * 2, x.detach().exp()), x)
    with pytest.raises(RuntimeError, match="none of output has requires_grad=True"):
        out[0].sum().backward()


@pytest.mark.parametrize("how", ["grad", "inputs"])
def test_error_under_autograd_grad_and_inputs_then_flag_resets(how):
    x = torch.randn(3, requires_grad=True)
    out = reentrant(pointwise_chain, x)
    with pytest.raises(RuntimeError, match="incompatible with .grad\\(\\) or passing an `inputs` parameter"):
        if how == "grad":
            torch.autograd.grad(out.sum(), x)
        else:
            out.sum().backward(inputs=[x])
    reentrant(pointwise_chain, x).sum().backward()  # a plain backward afterwards works again
    assert x.grad is not None


def test_rejects_kwargs_context_fn_and_debug_with_torch_texts():
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(ValueError, match="Unexpected keyword arguments: scale"):
        reentrant(pointwise_chain, x, scale=2)
    with pytest.raises(ValueError, match="only supported when use_reentrant=False"):
        reentrant(pointwise_chain, x, debug=True)
    with pytest.raises(ValueError, match="only supported when use_reentrant=False"):
        reentrant(pointwise_chain, x, context_fn=lambda: (None, None))


def test_non_tensor_and_nested_inputs_and_outputs():
    x, y = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)

    def fn(pair, scale, name):
        a, b = pair
        return {"sum": (a * b).sin() * scale, "name": name, "parts": [a.exp(), 7]}

    out = reentrant(fn, (x, y), 2.0, "seg")
    assert out["name"] == "seg" and out["parts"][1] == 7
    (out["sum"].sum() + out["parts"][0].sum()).backward()
    ours = (x.grad, y.grad)
    x.grad = y.grad = None
    plain = fn((x, y), 2.0, "seg")
    (plain["sum"].sum() + plain["parts"][0].sum()).backward()
    assert torch.equal(ours[0], x.grad) and torch.equal(ours[1], y.grad)


def test_integer_outputs_pass_through_without_grad():
    x = torch.randn(4, requires_grad=True)
    values, indices = reentrant(lambda x: x.exp().max(dim=0), x)
    assert indices.dtype == torch.int64 and not indices.requires_grad
    values.backward()
    assert x.grad is not None


def test_one_recompute_per_backward_and_caller_rng_undisturbed():
    x = torch.randn(64, requires_grad=True)
    calls = []

    def fn(x):
        calls.append(1)
        return torch.nn.functional.dropout(x, 0.5).sin()

    torch.manual_seed(3)
    out = reentrant(fn, x)
    out.sum().backward()
    after_ours = torch.rand(3)
    ours, x.grad = x.grad, None
    torch.manual_seed(3)
    fn(x).sum().backward()
    after_plain = torch.rand(3)
    assert len(calls) == 3  # forward, recompute, plain reference
    assert torch.equal(ours, x.grad) and torch.equal(after_ours, after_plain)


def test_inplace_modification_of_input_caught_at_backward():
    x = torch.randn(4, requires_grad=True)
    inp = x * 1
    out = reentrant(pointwise_chain, inp)
    inp.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_exception_type_from_recompute_survives_the_engine():
    class Boom(Exception):
        pass

    runs = []

    def fn(x):
        runs.append(1)
        if len(runs) > 1:
            raise Boom("from recompute")
        return x.sin()

    out = reentrant(fn, torch.randn(3, requires_grad=True))
    with pytest.raises(Boom, match="from recompute"):
        out.sum().backward()


def test_no_reference_cycles():
    gc.collect()
    gc.disable()
    try:
        layer = torch.nn.Linear(8, 8)
        inp = torch.randn(2, 8, requires_grad=True) * 2
        inp_ref, layer_ref = weakref.ref(inp), weakref.ref(layer)
        out = reentrant(layer, inp)
        del inp, layer
        assert inp_ref() is not None
        del out
        assert inp_ref() is None and layer_ref() is None, "graph kept alive by a reference cycle"
    finally:
        gc.enable()


# A tensor the function returns but did not create: torch's reentrant checkpoint passes nested ones through
# untouched; a top-level one it makes its node's output (mutating the caller's tensor) and then hangs in
# backward. fastckpt must leave the caller's tensor as it was, never hang, and give torch's gradients.

MODULE_LEVEL = torch.arange(6.0).view(2, 3) / 7

HANG_LIMIT_S = 60  # far above the milliseconds these take: only a hang reaches it


def within_limit(work):
    """Run `work()` in a daemon thread: a hang fails the test instead of blocking the run."""
    result, errors = [], []

    def run():
        try:
            result.append(work())
        except BaseException as error:  # handed to the test thread below
            errors.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=HANG_LIMIT_S)
    assert not thread.is_alive(), "checkpoint's backward hung"
    if errors:
        raise errors[0]
    return result[0]


WRAP = {
    "top": (lambda t: t, lambda o: o),
    "tuple": (lambda t: (None, True, t), lambda o: o[2]),
    "list": (lambda t: [t, 3], lambda o: o[0]),
    "dict": (lambda t: {"bias": t, "name": "b"}, lambda o: o["bias"]),
}


def state(t):
    return t.requires_grad, t.grad_fn, t.is_leaf


def grads_of_returned_tensor_run(checkpoint, how, where, extra, lin, x):
    """Checkpoint a layer returning `extra` (as `how` gets it) at `where`; backward through both outputs."""
    wrap, unwrap = WRAP[where]
    before = state(extra)
    if how == "argument":
        out = checkpoint(lambda x, e: (lin(x), wrap(e)), x, extra)
    elif how == "closure":
        out = checkpoint(lambda x: (lin(x), wrap(extra)), x)
    else:  # a module-level tensor
        out = checkpoint(lambda x: (lin(x), wrap(MODULE_LEVEL)), x)
    assert state(extra) == before  # the caller's tensor is not made an output of the node
    returned = unwrap(out[1])
    loss = out[0].square().sum()
    if returned.requires_grad:
        loss = loss + (returned * torch.arange(6.0).view(2, 3)).sum()
    loss.backward()
    assert state(extra) == before
    grads = [t.grad for t in (x, lin.weight, lin.bias, extra)]
    for t in (x, lin.weight, lin.bias, extra):
        t.grad = None
    return grads


FORMS = [(how, where, grad) for how in ("argument", "closure") for where in WRAP for grad in (False, True)]
FORMS += [("module", where, False) for where in WRAP]  # MODULE_LEVEL does not require grad


@pytest.mark.parametrize(("how", "where", "requires_grad"), FORMS)
def test_returned_tensor_it_did_not_create(how, where, requires_grad):
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    extra = MODULE_LEVEL if how == "module" else torch.randn(2, 3, requires_grad=requires_grad)
    ours = within_limit(lambda: grads_of_returned_tensor_run(reentrant, how, where, extra, lin, x))

    def torch_reentrant(fn, *args):
        if how == "argument" or where != "top":
            return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=True)

        # torch hangs on a closed-over tensor returned at the top level: its gradients are those of the
        # same tensor returned nested, which torch handles.
        def nested(*inputs):
            out, returned = fn(*inputs)
            return out, (returned,)

        out, (returned,) = torch.utils.checkpoint.checkpoint(nested, *args, use_reentrant=True)
        return out, returned

    theirs = within_limit(lambda: grads_of_returned_tensor_run(torch_reentrant, how, where, extra, lin, x))
    assert ours[0] is not None and ours[1] is not None
    for mine, reference in zip(ours, theirs, strict=True):
        assert (mine is None and reference is None) or torch.equal(mine, reference)
    if requires_grad:
        assert ours[3] is not None  # the returned tensor's gradient reached it


def test_returned_tensor_that_requires_grad_passes_through_as_itself():
    x = torch.randn(3, requires_grad=True)
    bias = torch.randn(3, requires_grad=True)
    out, same = reentrant(lambda x: (x.sin(), bias), x)
    assert same is bias and bias.is_leaf and bias.grad_fn is None


def test_output_returned_twice_stays_one_tensor():
    x = torch.randn(3, requires_grad=True)
    first, second = reentrant(lambda x: (lambda y: (y, y))(x.sin()), x)
    assert first is second
    (first.sum() + 2 * second.sum()).backward()
    assert torch.equal(x.grad, 3 * x.detach().cos())


def test_in_place_on_outputs_as_in_torch():
    x = torch.randn(3, 3, requires_grad=True)
    out = reentrant(lambda x: x.sin(), x)
    out.mul_(2)  # a plain output: in place is fine and differentiated through
    out.sum().backward()
    assert torch.equal(x.grad, 2 * x.detach().cos())
    view = reentrant(lambda x: x.sin()[0], x)
    with pytest.raises(RuntimeError, match="is a view and is being modified inplace"):
        view.mul_(2)  # torch refuses in-place changes of a view a custom Function returned; so must we
