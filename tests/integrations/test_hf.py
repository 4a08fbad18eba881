"""fastckpt.integrations.hf against the real transformers package: tiny GPT-2 and Llama built in code."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fastckpt  # noqa: E402
from fastckpt.integrations import hf  # noqa: E402
from fastckpt.planner import measure  # noqa: E402

VOCAB = 128
LAYERS = 4


def tiny_gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(
        n_layer=LAYERS, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)  # dropout 0.1 in attention, residuals and embeddings


def tiny_llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        attention_dropout=0.1,  # so that recompute must replay the RNG
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(config)


MODELS = {"gpt2": tiny_gpt2, "llama": tiny_llama}


@pytest.fixture(params=sorted(MODELS))
def model(request) -> torch.nn.Module:
    torch.manual_seed(0)
    return MODELS[request.param]()


def batch(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(seed))


def train_step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward/backward in train mode from a fixed RNG state; returns the loss and the gradients."""
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(123)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def hf_own(model: torch.nn.Module, **kwargs) -> torch.nn.Module:
    """A copy with HF's own gradient checkpointing (torch.utils.checkpoint)."""
    reference = copy.deepcopy(model)
    reference.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None)
    return reference


def rel_l2(grads: dict, expected: dict) -> float:
    """Relative L2 error of all parameter gradients together (per tensor, the query/key projections of a
    freshly initialised model have near-zero gradients whose relative error is all noise)."""
    assert grads.keys() == expected.keys()
    error = torch.cat([(grads[k] - expected[k]).flatten() for k in expected])
    return (error.norm() / torch.cat([expected[k].flatten() for k in expected]).norm()).item()


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_recompute_bit_identical_to_hf_checkpointing(model, use_reentrant):
    reference = hf_own(model, use_reentrant=use_reentrant)
    ours = hf.enable(copy.deepcopy(model), use_reentrant=use_reentrant)
    assert hf.is_enabled(ours) and not hf.is_enabled(reference)
    ids = batch()
    loss, grads = train_step(ours, ids)
    expected_loss, expected_grads = train_step(reference, ids)
    plain_loss, plain_grads = train_step(copy.deepcopy(model), ids)
    assert torch.equal(loss, expected_loss) and torch.equal(loss, plain_loss)
    assert grads.keys() == expected_grads.keys()
    for name in expected_grads:
        assert torch.equal(grads[name], expected_grads[name]), name
        assert torch.equal(grads[name], plain_grads[name]), name


# int8's bound is the project's target; int4's target (5e-2) is not met by the int4 codec on these
# models at initialisation (measured 0.060 and 0.063), so its bound here only guards against regressions.
@pytest.mark.parametrize(("policy", "bound"), [("int8", 1e-2), ("recompute+int8", 1e-2), ("int4", 0.1)])
def test_lossy_policies_within_gradient_bounds(model, policy, bound):
    ours = hf.enable(copy.deepcopy(model), policy=policy)
    ids = batch()
    with fastckpt.track() as report:
        loss, grads = train_step(ours, ids)
    expected_loss, expected_grads = train_step(copy.deepcopy(model), ids)
    assert len(report.segments) == LAYERS  # one record per checkpointed layer
    assert report.raw_bytes > 0 and report.bits_per_element < 9  # the codec really stored the tensors
    assert abs(loss.item() - expected_loss.item()) < bound * abs(expected_loss.item())
    assert rel_l2(grads, expected_grads) <= bound


def test_every_n_layers_uses_hf_layer_selection(model):
    ours = hf.enable(copy.deepcopy(model), policy="int8", every_n_layers=2)
    reference = copy.deepcopy(model)
    reference.activation_checkpointing_enable(every_n_layers=2)
    flags = [getattr(m, "gradient_checkpointing", None) for m in ours.modules()]
    assert flags == [getattr(m, "gradient_checkpointing", None) for m in reference.modules()]
    with fastckpt.track() as report:
        train_step(ours, batch())
    assert len(report.segments) == LAYERS // 2


def test_use_cache_handled_as_hf_does(model):
    ours = hf.enable(copy.deepcopy(model))
    reference = hf_own(model)
    ids = batch()
    for m in (ours, reference):
        m.train()
    torch.manual_seed(5)
    out = ours(input_ids=ids, use_cache=True)
    torch.manual_seed(5)
    expected = reference(input_ids=ids, use_cache=True)
    assert (out.past_key_values is None) == (expected.past_key_values is None)
    assert torch.equal(out.logits, expected.logits)
    # In eval mode checkpointing is off and the cache works: generation is unchanged.
    for m in (ours, reference):
        m.eval()
    generated = ours.generate(ids[:1, :8], max_new_tokens=4, do_sample=False)
    assert torch.equal(generated, reference.generate(ids[:1, :8], max_new_tokens=4, do_sample=False))


def test_trainer_keeps_fastckpt(tmp_path):
    """Trainer(activation_checkpointing=True) calls the model's enable method again: it must stay fastckpt,
    and the keywords it passes (here use_reentrant and a policy) reach fastckpt.checkpoint."""
    torch.manual_seed(0)
    model = hf.enable(tiny_gpt2(), policy="int8")
    data = [{"input_ids": ids, "labels": ids} for ids in batch(7).repeat(4, 1)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=2,
        activation_checkpointing=True,  # the deprecated alias gradient_checkpointing=True is the same
        activation_checkpointing_kwargs={"use_reentrant": True, "policy": "recompute+int8"},
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    with fastckpt.track() as report:
        result = trainer.train()
    assert hf.is_enabled(model)
    functions = {m._gradient_checkpointing_func for m in model.modules() if hasattr(m, "_gradient_checkpointing_func")}
    assert len(functions) == 1
    (function,) = functions
    assert function.keywords["use_reentrant"] is True
    assert str(function.keywords["policy"]) == "recompute+int8"
    assert report.segments and all(s.policy == "recompute+int8" for s in report.segments)
    assert torch.isfinite(torch.tensor(result.training_loss))


def test_peft_lora_frozen_base_gets_adapter_grads(model):
    peft = pytest.importorskip("peft")
    targets = ["c_attn"] if isinstance(model, transformers.GPT2LMHeadModel) else ["q_proj", "v_proj"]
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, init_lora_weights=False)
    plain = peft.get_peft_model(model, config)
    lora = hf.enable(copy.deepcopy(plain), use_reentrant=True)
    assert hf.is_enabled(lora)
    ids = batch()
    loss, grads = train_step(lora, ids)
    expected_loss, expected_grads = train_step(plain, ids)
    # Reentrant checkpointing of a frozen base: without input grads, the adapters would get no gradient.
    assert grads and all("lora_" in name for name in grads)
    assert grads.keys() == expected_grads.keys()
    assert all(g.abs().sum() > 0 for g in grads.values())
    assert torch.equal(loss, expected_loss)
    for name in expected_grads:
        assert torch.equal(grads[name], expected_grads[name]), name


def test_non_reentrant_lora_leaves_the_embeddings_output_out_of_autograd():
    # HF's enable makes the frozen embeddings' output require grad (reentrant checkpointing needs it): a leaf then,
    # held by its gradient accumulator for the whole step and kept plain by storage policies. Non-reentrant
    # checkpointing does not need it: enable removes it, and the step is the same bit for bit.
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    plain = peft.get_peft_model(tiny_llama(), config)
    ids = batch()
    outputs = {}
    for name, kwargs in {"non-reentrant": {}, "reentrant": {"use_reentrant": True}}.items():
        outputs[name], loss, grads = _embeddings_output_and_step(hf.enable(copy.deepcopy(plain), **kwargs), ids)
        expected_loss, expected_grads = train_step(hf_own(plain, **kwargs), ids)
        assert torch.equal(loss, expected_loss) and grads.keys() == expected_grads.keys()
        assert all(torch.equal(grads[k], expected_grads[k]) for k in expected_grads)
    assert not outputs["non-reentrant"].requires_grad
    assert outputs["reentrant"].requires_grad and outputs["reentrant"].is_leaf  # its segments need an input that does


@pytest.mark.parametrize("before", ["hf-checkpointing-before-peft", "prepare-model-for-kbit-training"])
def test_require_grads_hooks_registered_before_enable_are_removed_too(before):
    # Each enable_input_require_grads registers one more hook and transformers keeps only the newest handles:
    # HF's checkpointing turned on before get_peft_model (PEFT calls it again), or PEFT's kbit preparation,
    # leave hooks that disable_input_require_grads does not reach.
    peft = pytest.importorskip("peft")
    base = tiny_llama()
    if before == "prepare-model-for-kbit-training":
        base = peft.prepare_model_for_kbit_training(base, use_gradient_checkpointing=True)
    else:
        base.activation_checkpointing_enable()
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(base, config)
    ids = batch()
    expected_loss, expected_grads = train_step(hf_own(copy.deepcopy(model), use_reentrant=False), ids)
    output, loss, grads = _embeddings_output_and_step(hf.enable(model), ids)
    assert not output.requires_grad
    assert torch.equal(loss, expected_loss) and all(torch.equal(grads[k], v) for k, v in expected_grads.items())
    hf.enable(model, use_reentrant=True)  # which needs the output to require grad: HF's enable adds it back
    assert _embeddings_output_and_step(model, ids)[0].requires_grad


def _embeddings_output_and_step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A PEFT model's input embeddings' output in a train_step, and that step's loss and gradients."""
    seen = []
    hook = model.get_base_model().get_input_embeddings().register_forward_hook(lambda m, args, out: seen.append(out))
    loss, grads = train_step(model, ids)
    hook.remove()
    return seen[0], loss, grads


def test_lora_input_casts_that_autocast_undoes_are_dropped_bit_for_bit():
    # PEFT casts a LoRA layer's bf16 input to its fp32 weights' dtype and autocast casts it back: enable drops
    # that cast under autocast (no fp32 copy of the activation, no fp32 gradient), with the same step bit for bit.
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    plain = peft.get_peft_model(tiny_llama(), config)
    ours = hf.enable(copy.deepcopy(plain))
    theirs = hf_own(copy.deepcopy(plain), use_reentrant=False)
    seen = []
    for module in ours.modules():
        if isinstance(module, peft.tuners.lora.layer.Linear):
            module.lora_A["default"].register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    ids = batch()
    for autocast in (True, False):
        seen.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss, grads = train_step(ours, ids)
            expected_loss, expected_grads = train_step(theirs, ids)
        # down_proj's input is a bf16 matmul output under autocast: it reaches lora_A as bf16, not cast to fp32
        assert (torch.bfloat16 in seen) == autocast and torch.float32 in seen
        assert torch.equal(loss, expected_loss)
        assert grads.keys() == expected_grads.keys()
        assert all(torch.equal(grads[k], expected_grads[k]) for k in expected_grads)
    hf.disable(ours)
    assert all(m.cast_input_dtype_enabled is True for m in ours.modules() if hasattr(m, "cast_input_dtype_enabled"))


def test_save_pretrained_round_trip(model, tmp_path):
    ours = hf.enable(copy.deepcopy(model), policy="int4")
    train_step(ours, batch())
    ours.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path)
    assert not hf.is_enabled(loaded)  # HF does not persist checkpointing either
    assert ours.state_dict().keys() == loaded.state_dict().keys()
    for key, value in ours.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key]), key
    assert "fastckpt" not in (tmp_path / "config.json").read_text()


def test_disable_restores_plain_model(model):
    ours = hf.enable(copy.deepcopy(model), policy="int4")
    hf.disable(ours)
    assert not hf.is_enabled(ours) and not ours.is_activation_checkpointing
    assert "activation_checkpointing_enable" not in vars(ours)
    ids = batch()
    loss, grads = train_step(ours, ids)
    expected_loss, expected_grads = train_step(copy.deepcopy(model), ids)
    assert torch.equal(loss, expected_loss)
    assert all(torch.equal(grads[k], expected_grads[k]) for k in expected_grads)
    ours.activation_checkpointing_enable()  # HF's own method again
    assert ours.is_activation_checkpointing and not hf.is_enabled(ours)


def test_deepcopy_of_enabled_model_binds_to_the_copy():
    torch.manual_seed(0)
    original = hf.enable(tiny_gpt2(), policy="int8")
    clone = copy.deepcopy(original)
    assert clone.activation_checkpointing_enable.__self__ is clone
    hf.disable(original)
    assert hf.is_enabled(clone) and not hf.is_enabled(original)


def test_bad_arguments_are_named():
    torch.manual_seed(0)
    with pytest.raises(TypeError, match="PreTrainedModel"):
        hf.enable(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="unknown token 'int3'"):
        hf.enable(tiny_gpt2(), policy="int3")
    with pytest.raises(TypeError, match=r"unknown checkpoint keyword\(s\) \['use_reentrnt'\]"):
        hf.enable(tiny_gpt2(), use_reentrnt=False)
    with pytest.raises(ValueError, match="every_n_layers"):
        hf.enable(tiny_gpt2(), every_n_layers=0)
    model = tiny_gpt2()
    with pytest.raises(TypeError, match="unknown checkpoint keyword"):
        hf.enable(model, bogus=1)
    assert not model.is_activation_checkpointing  # rejected before the model was changed


def test_planner_with_batch_slices_and_attention_kept():
    torch.manual_seed(0)
    model = tiny_llama().train()
    ids = batch()

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    candidates = ["recompute", "batch2:recompute", "selective-attention:int8"]
    model.config.use_cache = False  # as for any checkpointing
    measurements = measure(model, step, candidates=candidates, repeats=1, max_error=5e-2)
    assert measurements.candidates == candidates and not measurements.failed
    assert measurements.by_policy["batch2:recompute"].grad_error < 1e-5  # one random op per layer: same masks
    model.config.use_cache = True  # every layer call writes to the cache: the slices would share it
    with pytest.warns(UserWarning, match="'batch2:recompute' failed on this model.*key/value cache"):
        measurements = measure(model, step, candidates=["recompute", "batch2:recompute"], repeats=1)
    assert measurements.candidates == ["recompute"]


def test_plan_from_a_sample_batch():
    # hf.plan builds the step from a batch (forward with labels, backward), plans HF's checkpointing layers
    # (HF's own checkpointing turned off) and returns a verified plan that apply() puts on the layers.
    model = hf.enable(tiny_llama(), policy="recompute", loss_head=True, padded_attention=True)
    ids = batch()
    mask = torch.ones_like(ids)
    mask[1, 16:] = 0
    sample = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    plan = hf.plan(model, sample, "100%", autocast=torch.bfloat16, candidates=["recompute", "recompute+int8"],
                   repeats=1, progress=False)  # fmt: skip
    assert not model.is_activation_checkpointing and not hf.is_enabled(model)
    assert len(plan.policies) == LAYERS and plan.measured_peak is not None and plan.measured_peak <= plan.budget
    layers = model.model.layers
    plan.apply()
    assert all(isinstance(layer, fastckpt.CheckpointWrapper) for layer in layers)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**sample, use_cache=False).loss
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters() if p.requires_grad)
    with pytest.raises(ValueError, match="`batch` must be a dict of the model's forward arguments with `labels`"):
        hf.plan(model, {"input_ids": ids}, "100%")
    with pytest.raises(TypeError, match="`autocast` must be a float dtype or None"):
        hf.plan(model, sample, "100%", autocast="bf16")
