"""Checkpoint composes with DDP and FSDP2 in 2 real processes (gloo on CPU), and with torch's checkpoint_wrapper.

Each rank takes its half of one global batch. What the ranks end with (DDP's averaged gradients,
FSDP2's full_tensor() of the reduce-scattered shards) is compared with two references, both
computed in the worker processes (one thread each, as the runs under test):

- "sharded": the plain model (no DDP/FSDP, no checkpoint) on this rank's half, its gradients
  summed over the ranks with all_reduce and divided by 2. That is exactly the arithmetic DDP
  and FSDP2 do (a sum of two values is commutative and dividing by 2 is exact, before or after
  the sum), so here recompute must be bit-identical.
- "full": the unsharded, uncheckpointed model on the whole global batch in one process. For a
  mean loss this is mathematically the same gradient, but the batch reduction inside each
  weight-gradient matmul is summed in another order (one 16-row reduction against two 8-row
  ones added afterwards), so it can differ in the last bits: compared at relative L2 2e-6
  (float32 eps is 1.2e-7).

Two spawns in all (about 4 s each): one for DDP, one for FSDP2, each running every configuration.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import fastckpt
from tests.helpers import rel_l2
from tests.multiprocess import run_in_processes

WORLD = 2
GLOBAL_BATCH, IN, HIDDEN, CLASSES = 16, 32, 256, 8
# Every activation a block saves is (GLOBAL_BATCH / WORLD) x HIDDEN float32 = 8 KiB per rank, above
# Policy.min_tensor_bytes (4096), so a codec policy really encodes them (asserted through track()).
ACTIVATION_BYTES = GLOBAL_BATCH // WORLD * HIDDEN * 4
assert ACTIVATION_BYTES >= fastckpt.Policy().min_tensor_bytes
FULL_BATCH_REL_L2 = 2e-6  # summation order only (see the module docstring; 4.1e-7 measured here)
INT8_REL_L2 = 1e-2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(HIDDEN, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class Net(nn.Module):
    """stem -> 2 blocks (the checkpointed segments; their input requires grad, as reentrant needs) -> head."""

    def __init__(self, segment=None) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same weights in every process and configuration
        self.stem = nn.Linear(IN, HIDDEN)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(HIDDEN, CLASSES)
        self.segment = segment  # segment(block, h) -> output, e.g. a checkpoint; None: call the block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(h) if self.segment is None else self.segment(block, h)
        return self.head(h)


def global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(GLOBAL_BATCH, IN, generator=g), torch.randint(CLASSES, (GLOBAL_BATCH,), generator=g)


def shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return t.chunk(world)[rank]


def step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss.detach()


def averaged(t: torch.Tensor, world: int) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t)
    return t / world


def with_wrapper(wrapper_fn) -> Net:
    """Net whose blocks are wrapped by torch's apply_activation_checkpointing with `wrapper_fn`."""
    net = Net()
    apply_activation_checkpointing(net, checkpoint_wrapper_fn=wrapper_fn, check_fn=lambda m: isinstance(m, Block))
    assert sum(type(m).__name__ == "CheckpointWrapper" for m in net.modules()) == 2
    return net


# name -> a function building the (unwrapped by DDP/FSDP) model of that configuration
CONFIGS = {
    "plain": lambda: Net(),
    "recompute": lambda: Net(functools.partial(fastckpt.checkpoint, policy="recompute")),
    "recompute reentrant": lambda: Net(functools.partial(fastckpt.checkpoint, use_reentrant=True)),
    "int8": lambda: Net(functools.partial(fastckpt.checkpoint, policy="int8")),
    "torch wrapper": lambda: with_wrapper(checkpoint_wrapper),
    "fastckpt wrapper": lambda: with_wrapper(functools.partial(checkpoint_wrapper, checkpoint_fn=fastckpt.checkpoint)),
    "torch wrapper reentrant": lambda: with_wrapper(
        functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.REENTRANT)
    ),
    "fastckpt wrapper reentrant": lambda: with_wrapper(
        functools.partial(checkpoint_wrapper, checkpoint_fn=functools.partial(fastckpt.checkpoint, use_reentrant=True))
    ),
    # policy through checkpoint_wrapper's **checkpoint_fn_kwargs
    "fastckpt wrapper int8": lambda: with_wrapper(
        functools.partial(checkpoint_wrapper, checkpoint_fn=fastckpt.checkpoint, policy="int8")
    ),
}
DDP_CONFIGS = list(CONFIGS)
FSDP_CONFIGS = ["plain", "recompute", "int8", "torch wrapper", "fastckpt wrapper", "fastckpt wrapper int8"]


def _references(rank: int, world: int) -> dict:
    x, y = global_batch()
    full = Net()
    full_loss = step(full, x, y)
    sharded = Net()
    sharded_loss = step(sharded, shard(x, rank, world), shard(y, rank, world))
    return {
        "full": {"loss": full_loss, "grads": [p.grad for p in full.parameters()]},
        "sharded": {
            "loss": averaged(sharded_loss, world),
            "grads": [averaged(p.grad, world) for p in sharded.parameters()],
        },
    }


def _segments(report) -> list[tuple]:
    return [(s.policy, sorted(s.codecs), s.raw_bytes, s.device_bytes) for s in report.segments]


def _ddp_body(rank: int, world: int) -> dict:
    x, y = global_batch()
    x, y = shard(x, rank, world), shard(y, rank, world)
    results = _references(rank, world)
    for name in DDP_CONFIGS:
        model = nn.parallel.DistributedDataParallel(CONFIGS[name]())
        with fastckpt.track() as report:
            loss = step(model, x, y)
        results[name] = {
            "loss": averaged(loss, world),
            "grads": [p.grad for p in model.module.parameters()],
            "segments": _segments(report),
        }
    return results


def _fsdp_body(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    x, y = global_batch()
    x, y = shard(x, rank, world), shard(y, rank, world)
    results = _references(rank, world)
    for name in FSDP_CONFIGS:
        model = CONFIGS[name]()
        for block in model.blocks:  # the (possibly CheckpointWrapper-wrapped) blocks, as torchtitan shards them
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        with fastckpt.track() as report:
            loss = step(model, x, y)
        grads = [p.grad.full_tensor() for p in model.parameters()]  # a collective: every rank calls it
        results[name] = {"loss": averaged(loss, world), "grads": grads, "segments": _segments(report)}
    return results


@pytest.fixture(scope="module")
def ddp_results() -> list[dict]:
    return run_in_processes(_ddp_body, world_size=WORLD)


@pytest.fixture(scope="module")
def fsdp_results() -> list[dict]:
    fsdp = pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 (fully_shard) needs torch >= 2.6")
    if not hasattr(fsdp, "fully_shard"):  # torch < 2.6 has the module, without fully_shard
        pytest.skip("FSDP2 (fully_shard) needs torch >= 2.6")
    return run_in_processes(_fsdp_body, world_size=WORLD)


def assert_same_on_all_ranks(results: list[dict], name: str) -> dict:
    """The ranks agree bit for bit on the averaged loss and the synchronized gradients; rank 0's result."""
    first = results[0][name]
    for other in results[1:]:
        assert torch.equal(other[name]["loss"], first["loss"]), name
        for got, want in zip(other[name]["grads"], first["grads"], strict=True):
            assert torch.equal(got, want), name
    return first


def assert_exact(got: dict, want: dict) -> None:
    assert torch.equal(got["loss"], want["loss"])
    for index, (g, w) in enumerate(zip(got["grads"], want["grads"], strict=True)):
        assert torch.equal(g, w), f"parameter {index}: max |diff| {(g - w).abs().max().item():.3g}"


def assert_full_batch_close(got: dict, full: dict, bound: float) -> None:
    torch.testing.assert_close(got["loss"], full["loss"], rtol=1e-6, atol=0)
    for index, (g, w) in enumerate(zip(got["grads"], full["grads"], strict=True)):
        assert rel_l2(g, w) <= bound, f"parameter {index}: relative L2 {rel_l2(g, w):.3g} > {bound}"


def assert_codec_used(got: dict, codec: str) -> None:
    """Both segments encoded their activations with `codec` (well under a third of the raw bytes for int8)."""
    assert len(got["segments"]) == 2, got["segments"]
    for policy, codecs, raw_bytes, device_bytes in got["segments"]:
        assert policy == codec and codecs == [codec]
        assert raw_bytes >= 3 * ACTIVATION_BYTES  # block input, fc1 output, gelu output
        assert device_bytes < 0.3 * raw_bytes


def assert_lossy_close(got: dict, refs: dict) -> None:
    assert torch.equal(got["loss"], refs["sharded"]["loss"])  # a storage policy leaves the forward untouched
    errors = [rel_l2(g, w) for g, w in zip(got["grads"], refs["full"]["grads"], strict=True)]
    assert max(errors) <= INT8_REL_L2, errors
    assert max(errors) > FULL_BATCH_REL_L2  # lossy for real: the codec, not plain storage, was used


def test_references_agree(ddp_results):
    """The exact (sharded) reference is itself within summation-order noise of the full-batch run."""
    refs = ddp_results[0]
    assert_full_batch_close(refs["sharded"], refs["full"], FULL_BATCH_REL_L2)


@pytest.mark.parametrize("name", ["plain", "recompute", "recompute reentrant"])
def test_ddp_recompute_is_exact(ddp_results, name):
    got = assert_same_on_all_ranks(ddp_results, name)
    refs = ddp_results[0]
    assert_exact(got, refs["sharded"])
    assert_full_batch_close(got, refs["full"], FULL_BATCH_REL_L2)
    assert got["segments"] == []  # plain recompute stores nothing through the storage engine


def test_ddp_int8(ddp_results):
    got = assert_same_on_all_ranks(ddp_results, "int8")
    assert_lossy_close(got, ddp_results[0])
    assert_codec_used(got, "int8")


@pytest.mark.parametrize("name", ["plain", "recompute"])
def test_fsdp2_recompute_is_exact(fsdp_results, name):
    got = assert_same_on_all_ranks(fsdp_results, name)
    refs = fsdp_results[0]
    assert_exact(got, refs["sharded"])
    assert_full_batch_close(got, refs["full"], FULL_BATCH_REL_L2)


def test_fsdp2_int8(fsdp_results):
    got = assert_same_on_all_ranks(fsdp_results, "int8")
    assert_lossy_close(got, fsdp_results[0])
    assert_codec_used(got, "int8")


@pytest.mark.parametrize("results", ["ddp_results", "fsdp_results"])
def test_checkpoint_wrapper_accepts_fastckpt(request, results):
    """torch's checkpoint_wrapper / apply_activation_checkpointing with checkpoint_fn=fastckpt.checkpoint:
    bit-identical to torch's own wrapper for recompute, and a policy passed through really reaches fastckpt."""
    results = request.getfixturevalue(results)
    refs = results[0]
    pairs = [("fastckpt wrapper", "torch wrapper"), ("fastckpt wrapper reentrant", "torch wrapper reentrant")]
    for ours, stock in pairs:
        if ours in refs:
            assert_exact(assert_same_on_all_ranks(results, ours), assert_same_on_all_ranks(results, stock))
            assert_exact(refs[ours], refs["sharded"])
    got = assert_same_on_all_ranks(results, "fastckpt wrapper int8")
    assert_codec_used(got, "int8")
    assert_lossy_close(got, refs)
    assert_exact(got, refs["int8"])  # the same computation as calling fastckpt.checkpoint(policy="int8") directly


def test_checkpoint_wrapper_single_process():
    """The same wrapper parity without any process group (default thread count)."""
    x, y = global_batch()

    def run(net):
        loss = step(net, x, y)
        return {"loss": loss, "grads": [p.grad for p in net.parameters()]}

    assert_exact(run(CONFIGS["fastckpt wrapper"]()), run(CONFIGS["torch wrapper"]()))
    assert_exact(run(CONFIGS["fastckpt wrapper reentrant"]()), run(CONFIGS["torch wrapper reentrant"]()))
    stock = run(Net(functools.partial(torch_checkpoint, use_reentrant=False)))
    assert_exact(run(CONFIGS["recompute"]()), stock)
