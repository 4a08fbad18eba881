"""fastckpt.hybrid.selective: selective checkpointing whose saved op outputs go through a codec."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import fastckpt
from fastckpt import _compat, hybrid
from fastckpt.memory import peak_bytes
from tests.helpers import grads_of, max_rel_l2, needs_sac_hooks, run_blocks
from tests.models import TransformerBlock

aten = torch.ops.aten


class OpCounter(TorchDispatchMode):
    """Counts the aten ops (overload packets) run while active."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket] += 1
        return func(*args, **(kwargs or {}))


W1 = torch.randn(64, 128) / 8
W2 = torch.randn(128, 64) / 11


def chain(x: torch.Tensor) -> torch.Tensor:
    return (torch.mm(x, W1).sin().cos() @ W2).tanh()


def backward_ops(run) -> collections.Counter:
    x = torch.randn(256, 64, requires_grad=True)
    out = run(x)
    with OpCounter() as counter:
        out.sum().backward()
    return counter.counts


@needs_sac_hooks
def test_saved_outputs_are_stored_through_the_codec_and_not_recomputed():
    with fastckpt.track() as report:
        counts = backward_ops(lambda x: fastckpt.checkpoint(chain, x, context_fn=hybrid.selective([aten.mm])))
    (kept,) = [s for s in report.segments if s.policy == "selective:int8"]
    assert kept.tensors == 2 and kept.codecs == {"int8"}  # the two mm outputs
    assert kept.raw_bytes == 256 * (128 + 64) * 4
    assert 8 <= 8 * kept.device_bytes / kept.raw_elements <= 8.5
    stock = backward_ops(lambda x: fastckpt.checkpoint(chain, x))
    # Recomputation reruns the pointwise ops but takes the mm outputs from storage: only the backward's
    # own matmuls (2 per mm) run, where stock also reruns the forward's 2.
    assert counts[aten.sin] == stock[aten.sin] >= 1 and counts[aten.cos] == stock[aten.cos] >= 1
    assert counts[aten.mm] == stock[aten.mm] - 2


def _grads(model: nn.Module, x: torch.Tensor, segment) -> list[torch.Tensor]:
    # seed 7: the same dropout masks in every run
    return grads_of(model, lambda: run_blocks(model, x, segment), seed=7, loss=lambda h: h.pow(2).mean())


@pytest.fixture(scope="module")
def blocks():
    torch.manual_seed(0)
    model = nn.Sequential(TransformerBlock(dim=64, heads=4), TransformerBlock(dim=64, heads=4)).train()
    x = torch.randn(2, 128, 64)
    return model, x, _grads(model, x, lambda block, h: block(h))


@needs_sac_hooks
@pytest.mark.parametrize("policy", ["recompute", "recompute+int8", "recompute:int8"])
def test_gradients_on_a_transformer_block_are_within_int8_error(blocks, policy):
    model, x, plain = blocks
    context_fn = hybrid.selective(store="int8")
    with fastckpt.track() as report:
        ours = _grads(model, x, lambda block, h: fastckpt.checkpoint(block, h, policy=policy, context_fn=context_fn))
    assert 0 < max_rel_l2(ours, plain) <= 1e-2  # int8 noise present, and small
    labels = {s.policy for s in report.segments}
    assert "selective:int8" in labels
    if policy == "recompute:int8":
        assert "recompute:int8 (recomputed)" in labels


def test_store_save_is_torchs_selective_checkpointing_bit_for_bit(blocks):
    model, x, plain = blocks
    context_fn = hybrid.selective(store="save")
    ours = _grads(model, x, lambda block, h: fastckpt.checkpoint(block, h, context_fn=context_fn))
    assert all(torch.equal(g, r) for g, r in zip(ours, plain, strict=True))


@needs_sac_hooks
def test_torch_checkpoint_takes_it_too(blocks):
    model, x, plain = blocks
    context_fn = hybrid.selective(store="int8")
    with fastckpt.track() as report:
        ours = _grads(
            model, x, lambda block, h: torch_checkpoint.checkpoint(block, h, use_reentrant=False, context_fn=context_fn)
        )
    assert 0 < max_rel_l2(ours, plain) <= 1e-2
    assert [s.policy for s in report.segments] == ["selective:int8"] * 2


@needs_sac_hooks
def test_a_policy_function_and_op_overloads_select_what_is_saved():
    def only_first_mm(ctx, op, *args, **kwargs):
        chosen = op is aten.mm.default and args[1] is W1
        return CheckpointPolicy.MUST_SAVE if chosen else CheckpointPolicy.PREFER_RECOMPUTE

    for save in (only_first_mm, [aten.mm.default]):
        with fastckpt.track() as report:
            backward_ops(lambda x, save=save: fastckpt.checkpoint(chain, x, context_fn=hybrid.selective(save)))
        (kept,) = [s for s in report.segments if s.policy.startswith("selective")]
        assert kept.tensors == (1 if save is only_first_mm else 2)


@needs_sac_hooks
def test_kept_outputs_take_less_memory_than_torchs_selective_checkpointing():
    torch.manual_seed(0)
    model = nn.Sequential(*(TransformerBlock(dim=64, heads=4, dropout=0.0) for _ in range(3)))
    x = torch.randn(2, 256, 64, requires_grad=True)

    def step(context_fn):
        def run():
            h = x
            for block in model:
                h = fastckpt.checkpoint(block, h, context_fn=context_fn)
            h.pow(2).mean().backward()
            model.zero_grad(set_to_none=True)

        return run

    sac = peak_bytes(step(hybrid.selective(store="save")), "cpu")
    int8 = peak_bytes(step(hybrid.selective(store="int8")), "cpu")
    stock = peak_bytes(step(torch_checkpoint.noop_context_fn), "cpu")
    assert stock < int8 < sac
    assert sac - int8 > 0.5 * (sac - stock)  # most of what SAC keeps is gone


@needs_sac_hooks
def test_the_callers_hooks_see_the_inputs_only():
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(tuple(t.shape)) or t, lambda t: t):
        x = torch.randn(256, 64, requires_grad=True)
        out = fastckpt.checkpoint(chain, x, context_fn=hybrid.selective([aten.mm]))
    assert seen == [(256, 64)]
    out.sum().backward()  # and backward works after the caller's hooks are gone


def test_create_selective_checkpoint_contexts_works_with_input_storage():
    # torch's own SAC under a recompute policy that stores the inputs 8-bit: the exp is recomputed from them.
    leaf = torch.randn(256, 64, requires_grad=True)

    def fn(x):
        return (x.exp() @ W1).sin()

    (plain,) = torch.autograd.grad(fn(leaf * 1).sum(), leaf)
    out = fastckpt.checkpoint(
        fn,
        leaf * 1,  # not a leaf: stored through the codec (a leaf stays as it is, as parameters do)
        policy="recompute+int8",
        context_fn=lambda: create_selective_checkpoint_contexts([aten.mm.default]),
    )
    (ours,) = torch.autograd.grad(out.sum(), leaf)
    assert 0 < ((ours - plain).norm() / plain.norm()).item() <= 1e-2


@needs_sac_hooks
def test_wrap_keeps_the_state_dict_and_stores_through_the_codec():
    torch.manual_seed(0)
    block = TransformerBlock(dim=64, heads=4)
    keys = block.state_dict().keys()
    wrapped = hybrid.wrap(block, hybrid.selective(store="int8"), policy="recompute+int8")
    assert isinstance(wrapped, fastckpt.CheckpointWrapper) and wrapped.state_dict().keys() == keys
    with fastckpt.track() as report:
        wrapped(torch.randn(2, 64, 64, requires_grad=True)).sum().backward()
    assert {s.policy for s in report.segments} >= {"recompute+int8"} | (
        {"selective:int8"} if hybrid._sac_honours_hooks() else set()
    )
    assert all(p.grad is not None for p in block.parameters())


@needs_sac_hooks
def test_attention_only_keeps_the_attention_kernel_out_of_the_recomputation():
    torch.manual_seed(0)
    model = nn.Sequential(TransformerBlock(dim=64, heads=4, dropout=0.0))  # no dropout: the fused kernel runs
    x = torch.randn(2, 128, 64)
    plain = _grads(model, x, lambda block, h: block(h))
    context_fn = hybrid.selective(save=hybrid.attention_ops(), store="int8")
    assert str(context_fn) == "selective-attention:int8"
    sdpa = aten._scaled_dot_product_flash_attention_for_cpu

    x_in = x.clone().requires_grad_(True)
    with fastckpt.track() as report:
        out = fastckpt.checkpoint(model[0], x_in, context_fn=context_fn)
    with OpCounter() as counter:
        out.pow(2).mean().backward()
    assert counter.counts[sdpa] == 0 and counter.counts[aten.addmm] > 0  # projections rerun, attention not
    (kept,) = [s for s in report.segments if s.policy == "selective-attention:int8"]
    assert kept.codecs == {"int8"} and kept.raw_elements >= 2 * 128 * 64  # the attention output (and its lse)
    out = fastckpt.checkpoint(model[0], x_in)
    with OpCounter() as counter:
        out.pow(2).mean().backward()
    assert counter.counts[sdpa] == 1  # plain recomputation reruns the kernel
    ours = _grads(model, x, lambda block, h: fastckpt.checkpoint(block, h, context_fn=context_fn))
    assert 0 < max_rel_l2(ours, plain) <= 1e-2


def test_keep_attention_is_exact_and_recomputes_no_kernel_and_draws_nothing(blocks):
    model, x, plain = blocks  # attention and residual dropout 0.1: CPU dropout draws its masks with bernoulli_
    ours = _grads(model, x, lambda block, h: fastckpt.checkpoint(block, h, context_fn=hybrid.keep_attention("save")))
    assert all(torch.equal(g, r) for g, r in zip(ours, plain, strict=True))  # the same masks, taken back

    x_in = x.clone().requires_grad_(True)
    with fastckpt.track() as report:
        out = fastckpt.checkpoint(model[0], x_in, context_fn=hybrid.keep_attention("int8"))
    with OpCounter() as counter:
        out.pow(2).mean().backward()
    assert counter.counts[aten.bernoulli_] == 0 and counter.counts[aten.addmm] > 0  # no draw; projections rerun
    (kept,) = [s for s in report.segments if s.policy == "selective-attention:int8"]
    # Attention dropout sends SDPA down its math path (no fused kernel to keep): only the masks, 1 bit each.
    assert kept.codecs == {"mask"} and kept.tensors == 3
    out = fastckpt.checkpoint(model[0], x_in)
    with OpCounter() as counter:
        out.pow(2).mean().backward()
    assert counter.counts[aten.bernoulli_] == 3  # stock recomputation draws the three masks again


def test_keep_attention_finds_the_fused_kernel_called_directly_and_inside_multihead_attention():
    torch.manual_seed(0)
    block = TransformerBlock(dim=64, heads=4, dropout=0.0)  # no dropout: the fused kernel runs
    q = torch.randn(2, 4, 128, 16, requires_grad=True)
    sdpa = aten._scaled_dot_product_flash_attention_for_cpu
    for run, x in ((block, torch.randn(2, 128, 64, requires_grad=True)),
                   (lambda t: torch.nn.functional.scaled_dot_product_attention(t.sin(), t, t), q)):  # fmt: skip
        with fastckpt.track() as report:
            out = fastckpt.checkpoint(run, x, context_fn=hybrid.keep_attention("int8"))
        with OpCounter() as counter:
            out.pow(2).mean().backward()
        assert counter.counts[sdpa] == 0 and counter.counts[aten.sin] + counter.counts[aten.addmm] > 0
        (kept,) = [s for s in report.segments if s.policy == "selective-attention:int8"]
        assert kept.codecs == {"int8"} and kept.raw_elements >= 2 * 128 * 64  # output and logsumexp
        with torch.no_grad():
            torch.testing.assert_close(out, run(x))


def test_keep_attention_without_redispatch_runs_functional_code_whole_under_the_op_watch(blocks, monkeypatch):
    # A torch that cannot re-enter a function mode (no torch.overrides.redispatch_function): functions of
    # torch.nn.functional run whole under the dispatch mode, so nn.MultiheadAttention's inner SDPA is still kept.
    monkeypatch.setattr(_compat, "torch_function_redispatch", lambda: None)
    model, x, plain = blocks
    ours = _grads(model, x, lambda block, h: fastckpt.checkpoint(block, h, context_fn=hybrid.keep_attention("save")))
    assert all(torch.equal(g, r) for g, r in zip(ours, plain, strict=True))
    block = TransformerBlock(dim=64, heads=4, dropout=0.0)
    out = fastckpt.checkpoint(block, torch.randn(2, 128, 64, requires_grad=True), context_fn=hybrid.keep_attention())
    with OpCounter() as counter:
        out.pow(2).mean().backward()
    assert counter.counts[aten._scaled_dot_product_flash_attention_for_cpu] == 0 and counter.counts[aten.addmm] > 0


def test_a_kept_mask_leaves_the_generator_as_its_draw_did():
    # Random ops after a kept dropout mask (here one the watch does not keep) draw in the recomputation what
    # they drew in the forward: the generator is set to the state the mask's draw left.
    def fn(x):
        return torch.nn.functional.dropout(x, 0.5) * torch.rand_like(x)

    x = torch.randn(64, 64, requires_grad=True)
    grads = []
    for context_fn in (torch_checkpoint.noop_context_fn, hybrid.keep_attention("int8")):
        torch.manual_seed(3)
        fastckpt.checkpoint(fn, x, context_fn=context_fn).pow(2).sum().backward()
        grads.append(x.grad)
        x.grad = None
    torch.manual_seed(3)
    fn(x).pow(2).sum().backward()
    assert torch.equal(grads[0], x.grad) and torch.equal(grads[1], x.grad)


def test_keep_attention_nested_in_keep_attention_is_exact():
    torch.manual_seed(0)
    inner, outer = TransformerBlock(dim=32, heads=4), TransformerBlock(dim=32, heads=4)
    x = torch.randn(2, 16, 32, requires_grad=True)

    def nested(h):
        return outer(fastckpt.checkpoint(inner, h, context_fn=hybrid.keep_attention("save")))

    grads = []
    for run in (
        lambda h: outer(inner(h)),
        lambda h: fastckpt.checkpoint(nested, h, context_fn=hybrid.keep_attention("save")),
    ):
        torch.manual_seed(1)
        run(x).pow(2).sum().backward()
        grads.append(x.grad)
        x.grad = None
    assert torch.equal(grads[0], grads[1])


def test_within_refuses_a_recomputation_that_differs_or_a_second_backward():
    state = {"second": False}

    def fn(x):
        x = torch.nn.functional.dropout(x, 0.5)
        return torch.nn.functional.dropout(x, 0.5) if state["second"] else x

    context_fn = hybrid.selective([aten.bernoulli_], store="save", within=[torch.nn.functional.dropout])
    x = torch.randn(64, 64, requires_grad=True)
    out = fastckpt.checkpoint(fn, x, context_fn=context_fn, early_stop=False)  # else it stops before the extra call
    state["second"] = True
    with pytest.raises(torch_checkpoint.CheckpointError, match="ran aten.bernoulli_.* more often than the forward"):
        out.sum().backward()
    state["second"] = False
    out = fastckpt.checkpoint(fn, x, context_fn=context_fn)
    out.sum().backward(retain_graph=True)
    with pytest.raises(torch_checkpoint.CheckpointError, match="already used by an earlier backward"):
        out.sum().backward()


@pytest.mark.cuda
@pytest.mark.parametrize("form", ["torch SAC", "within"])
def test_attention_only_on_cuda_reruns_no_attention_kernel(form):
    torch.manual_seed(0)
    block = TransformerBlock(dim=64, heads=4, dropout=0.0).cuda()  # no dropout: a fused kernel runs
    x = torch.randn(2, 128, 64, device="cuda", requires_grad=True)
    store = "int8" if hybrid._sac_honours_hooks() or form == "within" else "save"  # older torch: SAC as it is
    context_fn = (
        hybrid.keep_attention(store) if form == "within" else hybrid.selective(save=hybrid.attention_ops(), store=store)
    )
    out = fastckpt.checkpoint(block, x, context_fn=context_fn)
    with OpCounter() as counter:
        out.pow(2).mean().backward()
    assert not any(counter.counts[op] for op in hybrid.attention_ops())  # kept, not recomputed
    assert counter.counts[aten.addmm] + counter.counts[aten.mm] > 0  # the projections are
    torch.testing.assert_close(out, block(x.detach()), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: hybrid.selective(store="recompute"), ValueError, "store='recompute' recomputes"),
        (lambda: hybrid.selective(store="int9"), ValueError, "store='int9'.*unknown token"),
        (lambda: hybrid.selective(["mm"]), TypeError, "`save` holds \\['mm'\\]"),
        (lambda: hybrid.selective(aten.mm.default.name()), TypeError, "`save` must be a list"),
        (lambda: hybrid.selective([]), ValueError, "`save` is empty"),
        (lambda: hybrid.selective([aten.bernoulli_]), ValueError, "in-place random fill.*pass `within`"),
        (lambda: hybrid.selective(within="dropout"), TypeError, "`within` must be a list of torch functions"),
        (lambda: hybrid.selective(within=[aten.mm]), TypeError, "`within` holds .*aten ops go in `save`"),
        (lambda: hybrid.selective(within=[aten.mm.default]), TypeError, "`within` holds .*aten ops go in `save`"),
        (lambda: hybrid.selective(within=[]), ValueError, "`within` is empty"),
        (lambda: hybrid.selective(lambda *a: True, within=[torch.relu]), TypeError, "not a policy function"),
        (lambda: hybrid.wrap(nn.Linear(2, 2), lambda: None), TypeError, "`context_fn` must be"),
        pytest.param(
            lambda: hybrid.wrap(nn.Linear(2, 2), hybrid.selective(), policy="int8"),  # selective(): store='int8'
            ValueError,
            "needs a recompute",
            marks=needs_sac_hooks,
        ),
    ],
)
def test_bad_arguments_are_named(call, error, message):
    with pytest.raises(error, match=message):
        call()


@needs_sac_hooks
def test_misuse_is_refused_with_the_argument_named():
    x = torch.randn(256, 64, requires_grad=True)
    context_fn = hybrid.selective([aten.mm])
    with pytest.raises(ValueError, match="only supported when use_reentrant=False"):
        fastckpt.checkpoint(chain, x, use_reentrant=True, context_fn=context_fn)
    with pytest.raises(ValueError, match="policy='int8' stores tensors instead of recomputing.*context_fn"):
        fastckpt.checkpoint(chain, x, policy="int8", context_fn=context_fn)
    with pytest.raises(ValueError, match="respect_saved_tensors_hooks=False"):
        fastckpt.checkpoint(chain, x, context_fn=context_fn, respect_saved_tensors_hooks=False)
    forward, _ = context_fn()
    with pytest.raises(RuntimeError, match="entered by a non-reentrant checkpoint"):
        with forward:
            chain(x)
