"""hf.enable(model, loss_head=True) where something wraps lm_head's call or distributes the model: hooks around
the call (DeepSpeed ZeRO-3's detached alias of the output, accelerate's hooks) see the logits call and the loss
call; and in 2 gloo processes, DDP over a tied embedding, FSDP2 with lm_head sharded on its own or not (HF's loss
and gradients), and a tensor-parallel lm_head (HF's loss, with a warning)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fastckpt.integrations import hf  # noqa: E402
from tests.integrations.test_hf_loss import (  # noqa: E402
    BATCH,
    FP32,
    SEQ,
    VOCAB,
    assert_same_step,
    build,
    padded_batch,
    step,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _ddp_tied_body(rank: int, world: int) -> list:
    """Each rank: DDP over a tied model, with HF's loss and with the loss head; the gradients after the all-reduce."""
    ids = torch.randint(4, VOCAB, (1, 6), generator=torch.Generator().manual_seed(rank))
    grads = []
    for loss_head in (False, True):
        model = build("llama-tied")
        model = torch.nn.parallel.DistributedDataParallel(hf.enable(model, loss_head=True) if loss_head else model)
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
    return grads


def test_ddp_reduces_a_tied_embeddings_gradient():
    """DDP (built while the embedding is not sparse) gets the tied weight's gradient dense and once, as HF's."""
    from tests.multiprocess import run_in_processes

    for plain, ours in run_in_processes(_ddp_tied_body):
        assert plain.keys() == ours.keys()
        for name, ref in plain.items():
            torch.testing.assert_close(ours[name], ref, **FP32, msg=name)


class _Alias(torch.autograd.Function):
    """What DeepSpeed ZeRO-3's forward hook makes of a module's output: a detached alias, in the graph."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def test_the_loss_is_computed_inside_lm_heads_own_call():
    """What acts around lm_head's call (ZeRO-3 gathers its weight there, and hands the output on as an alias)
    acts around the loss: its hooks see the logits call, then the loss call, and an alias is no post-processing."""
    plain = build("llama")
    ours = hf.enable(copy.deepcopy(plain), loss_head=True)
    calls = []
    ours.lm_head.register_forward_pre_hook(lambda module, args: calls.append(tuple(args[0].shape)))
    ours.lm_head.register_forward_hook(lambda module, args, output: _Alias.apply(output))
    batch = padded_batch()
    assert_same_step(step(ours, **batch), step(plain, **batch))
    hidden = ours.config.hidden_size
    assert calls == [(BATCH, SEQ, hidden), (BATCH * SEQ, hidden)]


def test_an_accelerate_hook_on_lm_head_runs_around_both_calls():
    """accelerate's hooks (device_map dispatch, offload) wrap the module's forward and call `_old_forward`: they
    still move the inputs and load the weight around the logits call and the loss call."""
    hooks = pytest.importorskip("accelerate.hooks")

    class Recording(hooks.ModelHook):
        def __init__(self) -> None:
            self.calls: list[tuple[int, ...]] = []

        def pre_forward(self, module, *args, **kwargs):
            self.calls.append(tuple(args[0].shape))
            return args, kwargs

    plain = build("llama")
    ours = hf.enable(copy.deepcopy(plain), loss_head=True)
    recording = Recording()
    hooks.add_hook_to_module(ours.lm_head, recording)
    batch = padded_batch()
    assert_same_step(step(ours, **batch), step(plain, **batch))
    hidden = ours.config.hidden_size
    assert recording.calls == [(BATCH, SEQ, hidden), (BATCH * SEQ, hidden)]
    hooks.remove_hook_from_module(ours.lm_head)  # what the hook wrapped is lm_head's own forward again
    assert_same_step(step(ours, **batch), step(plain, **batch))
    assert len(recording.calls) == 2


def _fsdp2_body(rank: int, world: int) -> dict:
    """Each rank: HF's loss and the loss head (with padded attention) under FSDP2, lm_head in the root's group
    or sharded on its own."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    results = {}
    for head_alone in (False, True):
        for loss_head in (False, True):
            plain = build("llama")
            # with the loss head, padded attention too (its mask form passes FSDP2's hooks on each layer)
            model = hf.enable(plain, policy="recompute", loss_head=True, padded_attention=True) if loss_head else plain
            mesh = init_device_mesh("cpu", (world,))
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            if head_alone:
                fully_shard(model.lm_head, mesh=mesh)  # a separate group, as torchtitan shards the output layer
            fully_shard(model, mesh=mesh)
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no fallback to HF's loss
                output, grads = step(model, **padded_batch(seed=rank))
            results[head_alone, loss_head] = output.loss.detach(), [g.full_tensor() for g in grads.values()]
    return results


def _tensor_parallel_body(rank: int, world: int) -> dict:
    """Each rank: HF's loss, and the loss head on a model whose lm_head is then made tensor parallel."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    results = {}
    for loss_head in (False, True):
        model = build("llama")
        if loss_head:
            hf.enable(model, loss_head=True)
        parallelize_module(
            model, init_device_mesh("cpu", (world,)), {"lm_head": ColwiseParallel(output_layouts=Replicate())}
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            output, _ = step(model, **padded_batch(seed=rank))
        results[loss_head] = output.loss.detach(), [str(w.message) for w in caught if "fastckpt" in str(w.message)]
    return results


def test_a_tensor_parallel_lm_head_falls_back_to_hfs_loss_with_a_warning():
    """A ColwiseParallel head's weight stays a DTensor in its call, which the loss head does not compute with
    (it failed with "'Tensor' object has no attribute 'placements'"): HF's loss, with a warning naming why."""
    from tests.multiprocess import run_in_processes

    for results in run_in_processes(_tensor_parallel_body):
        (loss, caught), (ref_loss, _) = results[True], results[False]
        assert torch.equal(loss, ref_loss)
        assert len(caught) == 1 and "falls back to HF's loss" in caught[0] and "tensor parallel" in caught[0]


def test_fsdp2_with_lm_head_sharded_or_not():
    """FSDP2 unshards lm_head's weight around its own call, where the loss is computed: the same step as HF's
    loss up to fp32 summation order, where lm_head was sharded on its own too (a class FSDP2 made: FSDPLinear)."""
    fsdp = pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 (fully_shard) needs torch >= 2.6")
    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("FSDP2 (fully_shard) needs torch >= 2.6")
    from tests.multiprocess import run_in_processes

    for results in run_in_processes(_fsdp2_body):
        for head_alone in (False, True):
            (loss, grads), (ref_loss, ref_grads) = results[head_alone, True], results[head_alone, False]
            torch.testing.assert_close(loss, ref_loss, **FP32)
            for got, expected in zip(grads, ref_grads, strict=True):
                torch.testing.assert_close(got, expected, **FP32)
