"""fastckpt.integrations.deepspeed against the real DeepSpeed package (CPU accelerator) in 2 gloo processes:
partition_activations (each rank keeps its half of every block input; the same losses and gradients, and
DeepSpeed's model-parallel seeding with our configure's mpu), a real DeepSpeed engine under ZeRO 1 and 2, and
Hugging Face models in the engine (the loss head under ZeRO-3, a budget planned under ZeRO-2, Trainer with a
ZeRO-3 config)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

os.environ.setdefault("DS_ACCELERATOR", "cpu")
deepspeed = pytest.importorskip("deepspeed")
from deepspeed import checkpointing as ds_checkpointing  # noqa: E402  (`import deepspeed.checkpointing` fails)

import fastckpt  # noqa: E402
import fastckpt.integrations.deepspeed as ckpt  # noqa: E402
from tests.helpers import max_rel_l2  # noqa: E402
from tests.integrations.test_deepspeed import (  # noqa: E402
    TRACKER,
    clean_state,  # noqa: F401 (an autouse fixture)
)
from tests.models import TransformerBlock  # noqa: E402
from tests.multiprocess import run_in_processes  # noqa: E402

# 1. partition_activations across 2 processes.

DIM = 33  # odd: the (ROWS, DIM) activations have an odd number of elements
ROWS = 65


class WorldModelParallel:
    """The 2-process world as the model-parallel group (Megatron's tensor-parallel naming)."""

    def get_tensor_model_parallel_rank(self):
        return torch.distributed.get_rank()

    def get_tensor_model_parallel_world_size(self):
        return torch.distributed.get_world_size()

    def get_tensor_model_parallel_group(self):
        return torch.distributed.group.WORLD

    def get_data_parallel_rank(self):  # DeepSpeed's model_parallel_cuda_manual_seed logs it
        return 0


class MLPBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 64)
        self.fc2 = nn.Linear(64, DIM)

    def forward(self, x: torch.Tensor, memory: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        h = nn.functional.dropout(nn.functional.gelu(self.fc1(self.ln(x))), 0.2, training=True)
        return x + self.fc2(h) + memory.mean(0) * steps.float().mean()


def _partition_run(policy: str | None, partition: bool, use_reentrant: bool = False) -> dict:
    mpu = WorldModelParallel()
    ckpt.configure(mpu, partition_activations=partition, policy=policy, use_reentrant=use_reentrant)
    torch.manual_seed(0)  # the same model, inputs and dropout on both ranks: activations are replicated
    embed = nn.Linear(DIM, DIM)
    blocks = nn.ModuleList(MLPBlock() for _ in range(3))
    x = torch.randn(ROWS, DIM, requires_grad=True)
    memory = embed(torch.randn(8, DIM))  # (8, DIM): an even number of elements
    steps = torch.arange(3)  # an integer tensor: never partitioned
    h = embed(x)
    inputs = []
    with fastckpt.track() as report:
        for block in blocks:
            inputs.append(StorageWeakRef(h.untyped_storage()))  # the memory, not the Python object
            h = ckpt.checkpoint(block, h, memory, steps)
        alive = sum(not ref.expired() for ref in inputs)  # block inputs whose memory is still held
        loss = h.pow(2).mean()
        loss.backward()
    grads = [p.grad for p in [*embed.parameters(), *blocks.parameters()]] + [x.grad]
    records = [(s.policy, s.raw_bytes, s.stored_bytes) for s in report.segments]
    return dict(loss=loss.detach(), grads=grads, alive=alive, records=records)


def _partition_body(rank: int, world_size: int) -> dict:
    deepspeed.init_distributed(dist_backend="gloo")  # sees the group tests/multiprocess made
    results = {
        (policy, partition): _partition_run(policy, partition)
        for policy in (None, "recompute+offload")
        for partition in (False, True)
    }
    results[("reentrant", True)] = _partition_run(None, True, use_reentrant=True)
    # model_parallel_cuda_manual_seed is DeepSpeed's, run with the mpu given to our configure: the
    # tracker ends as DeepSpeed's own configure + seed leave it.
    ckpt.configure(WorldModelParallel())
    ckpt.model_parallel_cuda_manual_seed(1234)
    ours = ckpt.get_cuda_rng_tracker().get_states()[TRACKER]
    ds_checkpointing.configure(WorldModelParallel())
    ds_checkpointing.model_parallel_cuda_manual_seed(1234)
    theirs = ds_checkpointing.get_cuda_rng_tracker().get_states()[TRACKER]
    results["tracker"] = (ours, theirs)
    return results


def test_partition_activations_two_processes():
    ranks = run_in_processes(_partition_body)
    element = torch.finfo(torch.float32).bits // 8
    # Per block the floating inputs are h (ROWS x DIM, odd) and memory (8 x DIM, even); `steps` is integer.
    per_block = (ROWS * DIM + 8 * DIM) * element
    half = (-(-ROWS * DIM // 2) + -(-8 * DIM // 2)) * element  # each rank keeps ceil(n / 2) of each
    for rank, results in enumerate(ranks):
        for policy in (None, "recompute+offload"):
            plain, partitioned = results[(policy, False)], results[(policy, True)]
            assert torch.equal(partitioned["loss"], plain["loss"]), rank
            for index, (a, b) in enumerate(zip(partitioned["grads"], plain["grads"], strict=True)):
                assert torch.equal(a, b), f"rank {rank} policy {policy}: gradient {index} differs"
            # Unpartitioned, the graph holds every block input; partitioned, only the shards (and the
            # caller's `memory`/last h): the full block inputs are freed after the forward.
            assert plain["alive"] == 3 and partitioned["alive"] == 0, (plain["alive"], partitioned["alive"])
            name = str(fastckpt.Policy.parse(policy or "recompute"))
            assert [r[0] for r in partitioned["records"]] == [f"{name} (1/2 kept)"] * 3
            for _, raw, stored in partitioned["records"]:
                assert (raw, stored) == (per_block, half), (raw, stored, per_block, half)
        reentrant = results[("reentrant", True)]  # the reentrant engine saves its inputs through the same hooks
        assert torch.equal(reentrant["loss"], results[(None, False)]["loss"])
        assert all(torch.equal(a, b) for a, b in zip(reentrant["grads"], results[(None, False)]["grads"], strict=True))
        assert reentrant["alive"] == 0 and reentrant["records"] == [("recompute (1/2 kept)", per_block, half)] * 3
        ours, theirs = results["tracker"]
        assert torch.equal(ours, theirs)
    assert not torch.equal(ranks[0]["tracker"][0], ranks[1]["tracker"][0])  # one model-parallel stream per rank


# 2. A real DeepSpeed engine (ZeRO 1 and 2, 2 processes): checkpointed training = plain training.


class Net(nn.Module):
    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        self.embed = nn.Linear(16, 32)
        self.blocks = nn.ModuleList(TransformerBlock(32, heads=4, dropout=0.1) for _ in range(2))
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = ckpt.checkpoint(block, h) if self.checkpointed else block(h)
        return self.head(h).pow(2).mean()


STEPS = 4


def _engine_body(rank: int, world_size: int, stage: int) -> dict:
    deepspeed.init_distributed(dist_backend="gloo")
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False},
    }
    ckpt.configure(None, deepspeed_config=config)  # the engine's own config file
    results = {}
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = Net(checkpointed)
        initial = [p.detach().clone() for p in model.parameters()]
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        data = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
        torch.manual_seed(10 + rank)  # and its own dropout stream, the same in both runs
        losses = []
        for _ in range(STEPS):
            loss = engine(torch.randn(4, 8, 16, generator=data))
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
        params = [p.detach().clone() for p in model.parameters()]
        results[checkpointed] = dict(losses=torch.stack(losses), initial=initial, params=params)
    return results


@pytest.mark.parametrize("stage", [1, 2])
def test_deepspeed_engine_zero(stage):
    ranks = run_in_processes(_engine_body, stage)
    for rank, results in enumerate(ranks):
        plain, checkpointed = results[False], results[True]
        assert torch.equal(checkpointed["losses"], plain["losses"]), (rank, checkpointed["losses"], plain["losses"])
        assert all(not torch.equal(a, b) for a, b in zip(plain["params"], plain["initial"], strict=True))  # trained
        for a, b in zip(checkpointed["params"], plain["params"], strict=True):
            assert torch.equal(a, b)
    for a, b in zip(ranks[0][True]["params"], ranks[1][True]["params"], strict=True):
        assert torch.equal(a, b)  # data parallel: the ranks' parameters agree after every step


# 3. Hugging Face models in the engine (2 processes): the loss head under ZeRO-3, where lm_head's weight is
# gathered only around lm_head's own call, and planning on the first batch under ZeRO-2, whose gradient hooks
# must not see the planner's steps (each would reduce a gradient again).

HF_STEPS = 3


def _tiny_llama_config():
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
    )


def _hf_engine_run(rank: int, stage: int, **enable: object) -> dict:
    transformers = pytest.importorskip("transformers")
    from deepspeed.utils import safe_get_full_fp32_param

    from fastckpt.integrations import hf

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
    }
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_tiny_llama_config())
    hf.enable(model, **enable)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), config=config
    )  # SGD: the parameters move by their gradients, so the parameters compare as the gradients do
    initial = safe_get_full_fp32_param(model.lm_head.weight).clone()
    data = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(HF_STEPS):
        ids = torch.randint(1, 128, (2, 24), generator=data)
        mask = torch.ones_like(ids)
        mask[1, 16:] = 0
        loss = engine(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    moved = safe_get_full_fp32_param(model.lm_head.weight) - initial
    plan = hf.planned(model)
    return dict(losses=torch.stack(losses), moved=moved, policies=None if plan is None else plan.policies)


def _hf_engine_body(rank: int, world_size: int) -> dict:
    deepspeed.init_distributed(dist_backend="gloo")
    fast = {"candidates": ["recompute"], "repeats": 1, "progress": False, "max_error": None}
    results = {
        "zero3 hf loss": _hf_engine_run(rank, 3, policy="recompute"),
        "zero3 loss head": _hf_engine_run(rank, 3, policy="recompute", loss_head=True),
        "zero2 policy": _hf_engine_run(rank, 2, policy="recompute", loss_head=True),
        "zero2 budget": _hf_engine_run(rank, 2, budget="100%", plan_options=fast, loss_head=True),
    }
    try:
        _hf_engine_run(rank, 3, budget="100%", plan_options=fast)
    except ValueError as error:
        results["zero3 budget"] = str(error)
    return results


def test_hf_models_in_the_engine_loss_head_under_zero3_and_a_budget_under_zero2():
    ranks = run_in_processes(_hf_engine_body)
    for results in ranks:
        # The loss head: HF's loss and training up to fp32 summation order.
        theirs, ours = results["zero3 hf loss"], results["zero3 loss head"]
        torch.testing.assert_close(ours["losses"], theirs["losses"], rtol=1e-5, atol=0)
        assert theirs["moved"].norm() > 0 and max_rel_l2([ours["moved"]], [theirs["moved"]]) < 1e-5
        # The planned step (every layer recomputed: the only candidate) is the one enable(policy=...) takes.
        planned, by_hand = results["zero2 budget"], results["zero2 policy"]
        assert planned["policies"] == ["recompute"] * 2
        assert torch.equal(planned["losses"], by_hand["losses"]) and torch.equal(planned["moved"], by_hand["moved"])
        assert "is partitioned by DeepSpeed ZeRO-3" in results["zero3 budget"]
        assert "plan the model before sharding it" in results["zero3 budget"]


def _trainer_zero3_body(rank: int, world_size: int, path: str, out: str) -> dict:
    """Trainer with a ZeRO-3 config: from_pretrained partitions the model as it loads (zero.Init), then
    hf.enable, then Trainer trains it in DeepSpeed's engine, two micro-batches per step."""
    transformers = pytest.importorskip("transformers")
    from fastckpt.integrations import hf

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
    }
    data = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(16):
        ids = torch.randint(1, 128, (int(torch.randint(8, 24, (1,), generator=data)),), generator=data)
        rows.append(ids)

    def collate(features: list[torch.Tensor]) -> dict:  # dynamic right padding, as DataCollatorForSeq2Seq
        longest = max(len(f) for f in features)
        mask = torch.stack([torch.arange(longest) < len(f) for f in features]).long()
        ids = torch.stack([torch.nn.functional.pad(f, (0, longest - len(f))) for f in features])
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    results = {}
    for loss_head in (False, True):
        args = transformers.TrainingArguments(
            output_dir=f"{out}/{loss_head}",
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            max_steps=3,
            learning_rate=1e-2,
            logging_steps=1,
            report_to=[],
            deepspeed=config,
            gradient_checkpointing=True,
            use_cpu=True,
            save_strategy="no",
        )
        model = transformers.LlamaForCausalLM.from_pretrained(path, attn_implementation="sdpa")
        partitioned = all(hasattr(p, "ds_id") for p in model.parameters())
        hf.enable(model, policy="recompute+int8", loss_head=loss_head, padded_attention=loss_head)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=rows, data_collator=collate)
        trainer.train()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        results[loss_head] = {"partitioned": partitioned, "losses": losses}
    return results


def test_trainer_with_zero3_trains_with_the_loss_head_and_padded_attention(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(_tiny_llama_config()).save_pretrained(tmp_path / "model")
    for results in run_in_processes(_trainer_zero3_body, str(tmp_path / "model"), str(tmp_path / "out")):
        assert results[False]["partitioned"] and results[True]["partitioned"]  # zero.Init at load
        assert len(results[True]["losses"]) == 3
        torch.testing.assert_close(results[True]["losses"], results[False]["losses"], rtol=1e-5, atol=0)
