"""hf.enable(model, budget=...) and Trainer's gradient_checkpointing_kwargs={"budget": ...}: a plan made on the
first training batch (and again on a larger one), applied, and the step after it the one it would have been."""

from __future__ import annotations

import copy
import logging
import math
import re
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fastckpt  # noqa: E402
from fastckpt.integrations import hf  # noqa: E402
from fastckpt.integrations.hf import planning, state  # noqa: E402
from tests.helpers import trainer_step_peaks  # noqa: E402
from tests.integrations.test_hf import LAYERS, VOCAB, batch, tiny_llama  # noqa: E402

# Two candidates, one repeat, no progress bar: a plan in a few seconds. With "recompute" alone the plan is
# known (every layer recomputed), so the planned step can be compared with enable(policy="recompute").
FAST = {"candidates": ["recompute"], "repeats": 1, "progress": False, "max_error": None}


def sample() -> dict[str, torch.Tensor]:
    ids = batch()
    mask = torch.ones_like(ids)
    mask[1, 16:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def step(model: torch.nn.Module, inputs: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(5)  # attention dropout: the planning steps must not move the step's random stream
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_the_first_training_batch_plans_and_the_step_is_unchanged():
    torch.manual_seed(0)
    reference = hf.enable(tiny_llama(), policy="recompute").train()
    model = hf.enable(copy.deepcopy(reference), budget="100%", plan_options=FAST).train()
    for m in (model, reference):  # gradients from an earlier micro-batch are accumulated into, not lost
        for p in m.parameters():
            p.grad = torch.full_like(p, 0.5)
    with torch.no_grad():
        model(**sample())  # not training: no plan
    model.eval()
    model(**sample())  # not in training mode: no plan either
    model.train()
    assert hf.planned(model) is None and model.is_activation_checkpointing
    loss, grads = step(model, sample())
    plan = hf.planned(model)
    assert plan is not None and plan.applied and plan.policies == ["recompute"] * LAYERS
    assert plan.measured_peak <= plan.budget
    assert all(isinstance(layer, fastckpt.CheckpointWrapper) for layer in model.model.layers)
    assert hf.is_enabled(model) and not model.is_activation_checkpointing  # the plan checkpoints the layers
    expected_loss, expected_grads = step(reference, sample())
    assert torch.equal(loss, expected_loss)
    assert all(torch.equal(g, e) for g, e in zip(grads, expected_grads, strict=True))
    step(model, sample())  # later steps run the applied plan, without planning again
    assert hf.planned(model) is plan
    hf.disable(model)
    assert hf.planned(model) is None and not any(
        isinstance(layer, fastckpt.CheckpointWrapper) for layer in model.model.layers
    )


def test_a_larger_batch_than_the_planned_one_plans_again(caplog):
    """Dynamic padding: a longer batch would hold more than the plan predicted, so it is planned again before
    it runs (and the step is still the one it would have been); a batch no larger keeps the plan."""
    torch.manual_seed(0)
    reference = hf.enable(tiny_llama(), policy="recompute").train()
    model = hf.enable(copy.deepcopy(reference), budget="100%", plan_options=FAST).train()
    full = sample()
    short = {name: value[:, :12] for name, value in full.items()}
    step(model, short)
    first = hf.planned(model)
    step(model, {name: value[:, :8] for name, value in full.items()})  # shorter: the plan stays
    assert hf.planned(model) is first
    model.zero_grad(set_to_none=True)
    with caplog.at_level(logging.INFO, logger="fastckpt"):
        loss, grads = step(model, full)
    assert "larger than the planned one (input_ids 2x12 -> 2x24, attention_mask 2x12 -> 2x24, labels 2x12 -> 2x24)" in (
        caplog.text
    )
    again = hf.planned(model)
    assert again is not first and again.applied and not first.applied
    assert all(isinstance(layer, fastckpt.CheckpointWrapper) for layer in model.model.layers)
    expected_loss, expected_grads = step(reference, full)
    assert torch.equal(loss, expected_loss)
    assert all(torch.equal(g, e) for g, e in zip(grads, expected_grads, strict=True))
    step(model, short)
    assert hf.planned(model) is again


def test_an_optimizer_stepped_in_the_backward_steps_once_per_training_step():
    """PyTorch's optimizer-in-backward pattern (a post-accumulate-grad hook per parameter): planning on the first
    batch must not step it; the parameters after one planned step are those after one step of enable(policy=)."""

    def trained(model: torch.nn.Module) -> tuple[list[torch.Tensor], int]:
        steps = []

        def sgd(p: torch.Tensor) -> None:
            steps.append(1)
            with torch.no_grad():
                p.sub_(0.1 * p.grad)
            p.grad = None

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(sgd)
        torch.manual_seed(5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(**sample()).loss.backward()
        return [p.detach().clone() for p in model.parameters()], len(steps)

    torch.manual_seed(0)
    reference = hf.enable(tiny_llama(), policy="recompute").train()
    model = hf.enable(copy.deepcopy(reference), budget="100%", plan_options=FAST).train()
    planned, planned_steps = trained(model)
    expected, expected_steps = trained(reference)
    assert hf.planned(model).policies == ["recompute"] * LAYERS
    assert planned_steps == expected_steps == len(expected)
    assert all(torch.equal(a, b) for a, b in zip(planned, expected, strict=True))


def test_the_same_elements_in_longer_rows_plan_again_and_alternating_shapes_swap_plans(caplog):
    """A batch of no more elements in longer rows holds more (the T x T mask), so it is planned again; a plan
    made on shapes neither covers is kept, so returning to the earlier shape swaps back without planning, and a
    plan that a later, larger one covers is dropped."""
    torch.manual_seed(0)
    model = hf.enable(tiny_llama(), budget="100%", plan_options=FAST).train()
    full = sample()
    wide = {name: value[:, :12] for name, value in full.items()}  # 2 x 12
    long = {name: value[:1] for name, value in full.items()}  # 1 x 24: fewer elements, longer rows
    step(model, wide)
    first = hf.planned(model)
    with caplog.at_level(logging.INFO, logger="fastckpt"):
        step(model, long)
    assert "(input_ids 2x12 -> 1x24, attention_mask 2x12 -> 1x24, labels 2x12 -> 1x24); planning again" in caplog.text
    second = hf.planned(model)
    assert second is not first and second.applied and not first.applied
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fastckpt"):
        step(model, wide)
        assert hf.planned(model) is first and first.applied and not second.applied
        step(model, {name: value[:1, :20] for name, value in full.items()})  # covered by the second plan
        assert hf.planned(model) is second and second.applied and not first.applied
    assert "planning again" not in caplog.text
    step(model, full)  # 2 x 24 covers both earlier shapes: one plan is left
    third = hf.planned(model)
    assert state.read(model).plans == [(planning._FirstBatchPlan._shapes(full), third)]
    for smaller in (wide, long):
        step(model, smaller)
        assert hf.planned(model) is third


def test_a_larger_batch_that_does_not_fit_a_byte_budget_is_refused_naming_the_growth():
    """A budget in bytes is the same for a longer batch: where no plan of it fits, the step is refused (it would
    otherwise have run above the budget)."""
    torch.manual_seed(0)
    probe = hf.enable(tiny_llama(), budget="100%", plan_options=FAST).train()
    step(probe, sample())
    budget = hf.planned(probe).budget  # bytes: stock checkpointing's peak on the sample
    model = hf.enable(tiny_llama(), budget=budget, plan_options=FAST).train()
    step(model, sample())
    longer = {name: value.repeat(4, 2) for name, value in sample().items()}
    growth = r"input_ids 2x24 -> 8x48, attention_mask 2x24 -> 8x48, labels 2x24 -> 8x48"
    with pytest.raises(
        ValueError, match=rf"budget={budget}\): a training batch larger than the planned one \({growth}\)"
    ):
        step(model, longer)
    assert hf.planned(model).applied  # the model as it was before the refused call: the plan still applies
    step(model, sample())


def test_under_torch_distributed_a_larger_batch_warns_instead_of_planning(monkeypatch):
    """One rank planning alone would stall the others' collectives (FSDP, ZeRO-3): a warning, once per new
    largest size, and the plan stays."""
    torch.manual_seed(0)
    model = hf.enable(tiny_llama(), budget="100%", plan_options=FAST).train()
    short = {name: value[:, :12] for name, value in sample().items()}
    step(model, short)
    first = hf.planned(model)
    monkeypatch.setattr(planning, "_distributed", lambda: True)
    with pytest.warns(UserWarning, match=r"larger than the planned one \(input_ids 2x12 -> 2x24.*torch.distributed"):
        step(model, sample())
    assert hf.planned(model) is first and first.applied
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*larger than the planned one")  # the same size: no second
        step(model, sample())


def _distributed_planning(rank: int, world: int) -> dict:
    """Each rank: under DDP the first batch plans; planning an FSDP2-sharded model is refused; planning before
    fully_shard, then sharding the planned model, trains."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def sharded(model: torch.nn.Module) -> torch.nn.Module:
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    torch.manual_seed(0)
    ids = batch(seed=rank)
    inputs = {"input_ids": ids, "labels": ids}
    model = hf.enable(tiny_llama(), budget="100%", plan_options=FAST).train()
    torch.nn.parallel.DistributedDataParallel(model)(**inputs).loss.backward()
    ddp_planned = hf.planned(model) is not None and hf.planned(model).applied
    torch.manual_seed(0)
    model = hf.enable(tiny_llama(), budget="100%", plan_options=FAST).train()
    sharded(model)
    try:
        model(**inputs)
        refusal = None
    except ValueError as error:
        refusal = str(error)
    torch.manual_seed(0)
    model = tiny_llama().train()
    plan = hf.plan(model, inputs, "100%", **FAST)
    plan.apply()
    sharded(model)
    loss = model(**inputs, use_cache=False).loss
    loss.backward()
    return {
        "ddp_planned": ddp_planned,
        "refusal": refusal,
        "loss": float(loss),
        "wrapped": type(model.model.layers[0]).__name__,
    }


def test_ddp_plans_on_the_first_batch_fsdp2_refuses_and_a_model_planned_before_sharding_trains():
    fsdp = pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 (fully_shard) needs torch >= 2.6")
    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("FSDP2 (fully_shard) needs torch >= 2.6")
    from tests.multiprocess import run_in_processes

    for result in run_in_processes(_distributed_planning, world_size=2):
        assert result["ddp_planned"]
        assert result["refusal"] is not None and "`model` is sharded" in result["refusal"]
        assert "plan the model before sharding it" in result["refusal"]
        assert result["wrapped"].endswith("CheckpointWrapper") and math.isfinite(result["loss"])


def test_trainer_plans_from_its_checkpointing_kwargs(tmp_path):
    torch.manual_seed(0)
    model = hf.enable(tiny_llama())
    data = [sample() for _ in range(2)]
    data = [{k: v[i] for k, v in d.items()} for d in data for i in range(2)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=2,
        activation_checkpointing=True,
        activation_checkpointing_kwargs={"budget": "100%", "plan_options": FAST},
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
    )
    result = transformers.Trainer(model=model, args=args, train_dataset=data).train()
    plan = hf.planned(model)
    assert plan is not None and plan.applied and len(plan.policies) == LAYERS
    assert torch.isfinite(torch.tensor(result.training_loss))


def test_a_peft_model_plans_through_its_own_forward():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = hf.enable(peft.get_peft_model(tiny_llama(), config), budget="100%", plan_options=FAST).train()
    loss, _ = step_grads_of_adapters(model)
    assert hf.planned(model) is not None and torch.isfinite(loss)
    # the table's columns stay apart for PEFT's long layer names
    rows = [line for line in hf.planned(model).table().splitlines() if "layers." in line]
    assert len(rows) == LAYERS and all(re.search(r"layers\.\d+ +recompute ", row) for row in rows)


def step_grads_of_adapters(model: torch.nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**sample()).loss
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters() if p.requires_grad]


def test_a_deep_copy_plans_itself():
    torch.manual_seed(0)
    original = hf.enable(tiny_llama(), budget="100%", plan_options=FAST).train()
    clone = copy.deepcopy(original)
    step(clone, sample())
    assert hf.planned(clone) is not None and hf.planned(original) is None


def test_budget_arguments_are_named():
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="pass `budget` or `policy`, not both"):
        hf.enable(tiny_llama(), policy="int8", budget="50%")
    with pytest.raises(ValueError, match="is neither a percentage"):
        hf.enable(tiny_llama(), budget="half")
    with pytest.raises(TypeError, match=r"unknown plan_options \['repeat'\]"):
        hf.enable(tiny_llama(), budget="50%", plan_options={"repeat": 1})
    with pytest.raises(ValueError, match="`plan_options` without `budget`"):
        hf.enable(tiny_llama(), plan_options=FAST)
    model = hf.enable(tiny_llama(), budget="100%", plan_options=FAST).train()
    with pytest.raises(ValueError, match="the training forward to plan on has no `labels`"):
        model(input_ids=batch())
    with pytest.raises(ValueError, match="both `budget` and `policy`"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"budget": "50%", "policy": "int8"})


def head_llama() -> torch.nn.Module:
    """A Llama whose vocabulary is large next to its width: at 512 tokens the loss head's chunks decide the peak."""
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=2048,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(config)


def long_sample() -> dict[str, torch.Tensor]:
    ids = torch.randint(1, 2048, (1, 512), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[:, 384:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def loss_of(model: torch.nn.Module) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**long_sample(), use_cache=False).loss  # a planned layer recomputed must not cache twice
    loss.backward()
    model.zero_grad(set_to_none=True)
    return loss.detach()


def test_the_loss_head_chunk_is_a_plan_choice():
    torch.manual_seed(0)
    model = hf.enable(head_llama(), loss_head=True).train()
    expected = loss_of(model)
    measurements = hf.measure(model, long_sample(), autocast=torch.bfloat16, **FAST)
    chunks = [int(tail.name.split()[2]) for tail in measurements.tail_options]
    assert chunks == [64, 128, 256, 512]  # the default (256 at vocab 2048) / 4 ... x 2, capped at the 512 tokens
    layers = ["recompute"] * 2
    peaks = []
    for tail, chunk in zip(measurements.tail_options, chunks, strict=True):
        assert (tail.extra_bytes == 0) == (chunk == 256)
        predicted = measurements.predict_peak(layers, tail)
        plan = fastckpt.Plan(measurements, layers, predicted, predicted, 0.0, tail=tail)
        plan.apply()
        try:
            assert state.read(model).loss_chunk == chunk
            peaks.append(fastckpt.memory.peak_bytes(measurements.step))
        finally:
            plan.remove()
        assert state.read(model).loss_chunk is None
        assert peaks[-1] == predicted  # exact on CPU
    assert peaks[-1] > peaks[0]  # the largest chunk's logits are the step's peak
    plan = measurements.plan(peaks[-1] - 1)
    assert plan.tail is not None and int(plan.tail.name.split()[2]) < 512
    assert plan.measured_peak <= peaks[-1] - 1 and plan.tail.name in plan.table()
    plan.apply()
    assert state.read(model).loss_chunk == int(plan.tail.name.split()[2])
    torch.testing.assert_close(loss_of(model), expected, rtol=1e-3, atol=0)  # chunks change summation order only
    plan.remove()
    assert state.read(model).loss_chunk is None


def test_without_the_loss_head_there_is_no_tail_choice():
    torch.manual_seed(0)
    model = head_llama().train()
    assert hf.measure(model, long_sample(), autocast=torch.bfloat16, **FAST).tail_options == []


def test_a_budget_with_the_loss_head_plans_its_chunk_on_the_first_batch():
    torch.manual_seed(0)
    model = hf.enable(head_llama(), loss_head=True, budget="100%", plan_options=FAST).train()
    loss_of(model)
    plan = hf.planned(model)
    assert plan is not None and plan.tail is not None
    assert state.read(model).loss_chunk == int(plan.tail.name.split()[2])


@pytest.mark.parametrize("tuning", ["full", "lora"])
def test_trainers_steps_after_the_first_batch_plan_stay_within_its_budget(tmp_path, tuning):
    torch.manual_seed(0)
    model = tiny_llama()
    if tuning == "lora":
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    options = {**FAST, "candidates": ["recompute", "recompute+int8", "int8", "none"]}
    model = hf.enable(model, budget="100%", plan_options=options)
    data = [{k: v[i] for k, v in sample().items()} for _ in range(3) for i in range(2)]
    peaks = trainer_step_peaks(model, data, str(tmp_path), bf16=True)
    plan = hf.planned(model)
    # The first step planned (the planner's runs measure every candidate); the later ones run the plan.
    assert plan is not None and len(peaks) == 3 and max(peaks[1:]) <= plan.budget


class _IterationTotals(transformers.TrainerCallback):
    """Each Trainer iteration's device total after the first (planning) one: what is live at its start (the
    weights, the optimizer's state) plus the peak from its first forward to after its zero_grad, the optimizer's
    step and clipping included (fastckpt.memory's profiler replay, outside the planner)."""

    def __init__(self) -> None:
        self.totals: list[int] = []
        self.trace: fastckpt.memory.MemoryTrace | None = None
        self.live = 0

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if state.global_step == 0:
            return  # the first iteration plans
        tensors = [*model.parameters(), *(t for s in optimizer.state.values() for t in s.values())]
        self.live = sum(t.untyped_storage().nbytes() for t in tensors if isinstance(t, torch.Tensor))
        self.trace = fastckpt.memory.MemoryTrace("cpu").__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if self.trace is not None:
            self.trace.__exit__(None, None, None)
            self.totals.append(self.live + self.trace.peak)
            self.trace = None


def _full_finetune_trainer(tmp_path, budget: str, callbacks: list) -> transformers.Trainer:
    """A full fine-tune in fp32 under Trainer with AdamW (built by Trainer, after enable) and clipping at 1.0."""
    torch.manual_seed(0)
    options = {**FAST, "candidates": ["recompute", "none"]}
    model = hf.enable(tiny_llama(), loss_head=True, budget=budget, plan_options=options)
    data = [{k: v[i] for k, v in sample().items()} for _ in range(3) for i in range(2)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, use_cpu=True, report_to=[],
        save_strategy="no", disable_tqdm=True, max_grad_norm=1.0,
    )  # fmt: skip
    return transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)


def _weights_and_adamw_state() -> tuple[int, int]:
    weights = sum(p.numel() * p.element_size() for p in tiny_llama().parameters())
    return weights, 2 * weights


def test_a_device_total_under_trainer_counts_the_optimizer_trainer_builds(tmp_path):
    """Trainer builds its optimizer after enable(); the first-batch plan finds it, so a device total counts its
    state: a budget that the weights, AdamW's state and half the gradients fill is refused naming the state,
    where before it was planned as if the state did not exist and the loop ran far above it."""
    weights, state = _weights_and_adamw_state()
    budget = f"{weights + state + weights // 2}B"
    with pytest.raises(ValueError, match=r"optimizer state 1\.\d\d MiB"):
        _full_finetune_trainer(tmp_path, budget, []).train()


def test_the_loop_under_trainer_stays_within_a_device_total(tmp_path):
    """A total that fits stock checkpointing with AdamW's state counted, and 'no checkpointing' everywhere only
    without it: the loop's iterations stay within the total."""
    weights, state = _weights_and_adamw_state()
    probe = hf.enable(tiny_llama(), loss_head=True, policy="recompute").train()
    stock = fastckpt.memory.peak_bytes(lambda: probe(**sample()).loss.backward())
    budget = weights + state + int(stock * 1.2)
    measured = _IterationTotals()
    trainer = _full_finetune_trainer(tmp_path, f"{budget}B", [measured])
    trainer.train()
    assert len(measured.totals) == 2 and max(measured.totals) <= budget, (measured.totals, budget)


def wide_llama() -> torch.nn.Module:
    """Four layers wide next to the batch's few tokens: the gradients, not the activations, decide what fits."""
    config = transformers.LlamaConfig(
        hidden_size=192, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize(
    "candidates, requested", [(["recompute", "none"], False), (["recompute"], False), (["recompute"], True)]
)
def test_a_total_only_the_step_in_backward_holds_is_planned_with_it(tmp_path, candidates, requested):
    """Weights + AdamW's state + half the gradients: no plan fits with the gradients kept to the optimizer's step,
    so the first-batch plan steps Trainer's optimizer in the backward (a choice about the iteration, made with
    the per-layer candidates restricted too), and the loop stays within the total, clipping as Trainer asks.
    Asked for (`optimizer_in_backward=True`), the plan measures the loop with it from the start."""
    weights = sum(p.numel() * p.element_size() for p in wide_llama().parameters())
    budget = weights + 2 * weights + weights // 2
    model = hf.enable(wide_llama(), loss_head=True, budget=f"{budget}B", optimizer_in_backward=requested,
                      plan_options={**FAST, "candidates": candidates})  # fmt: skip
    data = [{k: v[i] for k, v in sample().items()} for _ in range(3) for i in range(2)]
    measured = _IterationTotals()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, use_cpu=True, report_to=[],
        save_strategy="no", disable_tqdm=True, max_grad_norm=1.0,
    )  # fmt: skip
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[measured])
    trainer.train()
    stepping = hf.trainer._StepInBackward.wrapper(model)
    assert stepping is not None and trainer.optimizer.optimizer is stepping and stepping.max_grad_norm == 1.0
    assert len(measured.totals) == 2 and max(measured.totals) <= budget, (measured.totals, budget)
