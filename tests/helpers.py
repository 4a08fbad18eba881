"""What several test files share beyond models (tests/models.py) and process groups (tests/multiprocess.py):
skips for features newer than the torch floor, gradient errors, seeded gradient runs, thread settings."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch

import fastckpt
from fastckpt import compiled, hybrid

# ---- features newer than the torch floor (fastckpt._compat): their tests skip on older releases

needs_sac_hooks = pytest.mark.skipif(
    not hybrid._sac_honours_hooks(), reason="SAC routes saved outputs through hooks from torch 2.14"
)
# Storage inside compiled graphs is trusted on the torch release it was checked with (fastckpt.compiled).
needs_in_graph_storage = pytest.mark.skipif(
    not compiled.IN_GRAPH_STORAGE, reason=f"storage inside compiled graphs needs torch >= {compiled.TORCH_NEEDED}"
)
# torch.compile traces fastckpt.checkpoint without a graph break from 2.14: before, dynamo cannot call
# ContextVar.get (the default policy, fastckpt.policies.current_policy), checked on 2.5.1 and 2.13.0.
needs_traced_checkpoint = pytest.mark.skipif(
    torch.torch_version.TorchVersion(torch.__version__) < "2.14",
    reason="dynamo traces fastckpt.checkpoint (its default policy is a ContextVar) from torch 2.14",
)


# ---- gradient errors


def every_size(policy: str | fastckpt.Policy | None) -> fastckpt.Policy | None:
    """`policy` with its recomputation's codec applied to tensors of any size: tests' tensors are smaller than
    the default fastckpt.policies.RECOMPUTED_MIN_BYTES, under which a recomputed tensor stays plain."""
    if policy is None:
        return None
    return dataclasses.replace(fastckpt.Policy.parse(policy), recompute_min_tensor_bytes=0)


def rel_l2(got: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative L2 error of `got` against `expected`."""
    return ((got - expected).norm() / expected.norm()).item()


def max_rel_l2(got: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> float:
    """Largest relative L2 error over pairs of tensors (the worst parameter gradient)."""
    return max(rel_l2(a, b) for a, b in zip(got, expected, strict=True))


# ---- seeded gradient runs


def run_step(model, x, forward, seed=1234):
    """One forward+backward from a fixed RNG seed; returns outputs, grads and the caller's next random number."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    torch.manual_seed(seed)
    out = forward(x)
    out.float().pow(2).sum().backward()
    after = torch.rand(4)  # the caller's RNG stream must not be disturbed by recompute
    return [out.detach(), x.grad, after] + [p.grad for p in model.parameters()]


def assert_all_equal(got, expected):
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(a, b), f"tensor {i} differs (max abs diff {(a.float() - b.float()).abs().max()})"


def output_and_grads(module, x, **checkpoint_kwargs):
    """Output and (input, parameter) gradients of sum(module(x)^2); checkpointed when given checkpoint options."""
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    y = fastckpt.checkpoint(module, x, **checkpoint_kwargs) if checkpoint_kwargs else module(x)
    y.pow(2).sum().backward()
    return y.detach(), torch.cat([x.grad.flatten(), *(p.grad.flatten() for p in module.parameters())])


def grads_of(
    model: torch.nn.Module,
    run: Callable[[], torch.Tensor],
    seed: int = 0,
    loss: Callable[[torch.Tensor], torch.Tensor] = torch.sum,
) -> list[torch.Tensor]:
    """The parameter gradients of `loss(run())`, run from RNG seed `seed` (the same dropout masks every time)
    after clearing `model`'s gradients."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss(run()).backward()
    return [p.grad.clone() for p in model.parameters()]


def run_blocks(blocks: torch.nn.Module, x: torch.Tensor, segment: Callable[..., torch.Tensor]) -> torch.Tensor:
    """`x` through each block in turn, each called as `segment(block, h)` (a checkpoint, or plainly)."""
    h = x
    for block in blocks:
        h = segment(block, h)
    return h


# ---- threads


@contextlib.contextmanager
def num_threads(threads: int | None = None) -> Iterator[None]:
    """torch's intra-op thread count set to `threads` (None: left as it is) inside, and restored after."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# A tiny transformers decoder (2 layers, hidden 32, 4 heads / 2 KV), without its vocabulary size.
TINY_DECODER = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# Mamba-2 mixer sizes for TINY_DECODER's hybrids: 4 heads of 8 (Falcon-H1 with mamba_d_ssm=32), chunks of 8.
TINY_MAMBA2 = {"mamba_n_heads": 4, "mamba_d_head": 8, "mamba_d_state": 4, "mamba_n_groups": 1, "mamba_chunk_size": 8}


def tiny_decoder_config(config_class: str, vocab_size: int, **overrides: Any) -> Callable[[], Any]:
    """A TINY_DECODER transformers config, `overrides` on top, as a factory:
    `tiny_decoder_config("LlamaConfig", 96)()`."""
    import transformers

    base = {**TINY_DECODER, "vocab_size": vocab_size}
    return functools.partial(getattr(transformers, config_class), **{**base, **overrides})


def trainer_step_peaks(model: torch.nn.Module, dataset: list, output_dir: str, **arguments: Any) -> list[int]:
    """Train `model` on `dataset` with transformers' Trainer (3 steps of 2 rows, CPU, `arguments` on top of those
    TrainingArguments) and return each training_step's peak (its forward and backward, after Trainer's zero_grad),
    measured outside the planner (fastckpt.memory.peak_bytes)."""
    import transformers

    from fastckpt.memory import peak_bytes

    peaks = []

    class Measured(transformers.Trainer):
        def training_step(self, *args: Any, **kwargs: Any) -> Any:
            result = []
            peaks.append(peak_bytes(lambda: result.append(super(Measured, self).training_step(*args, **kwargs))))
            return result[0]

    settings = {"max_steps": 3, "per_device_train_batch_size": 2, "use_cpu": True, "report_to": [],
                "save_strategy": "no", "disable_tqdm": True, **arguments}  # fmt: skip
    args = transformers.TrainingArguments(output_dir=output_dir, **settings)
    Measured(model=model, args=args, train_dataset=dataset).train()
    return peaks
