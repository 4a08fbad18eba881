"""hf.enable(model, loss_head=True) against the unpatched transformers model: tiny random causal LMs, padded
batches with -100 labels, losses and every gradient (fp32 tight, bf16 autocast loose), Trainer's
num_items_in_batch, shift_labels, logits_to_keep, logit soft caps and scales, a tied embedding's gradient, PEFT
LoRA, vision-language models with images, one Trainer run with gradient accumulation, and the refusals. Hooks
around lm_head's call, DDP, FSDP2 and tensor parallelism: test_hf_loss_distributed.py."""

from __future__ import annotations

import copy
import inspect
import warnings
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fastckpt import linear_cross_entropy  # noqa: E402
from fastckpt.integrations import hf  # noqa: E402
from fastckpt.integrations.hf import loss_head as hf_loss_head  # noqa: E402
from fastckpt.memory import peak_bytes  # noqa: E402
from tests.helpers import TINY_DECODER, TINY_MAMBA2, tiny_decoder_config  # noqa: E402

VOCAB = 256
BATCH, SEQ, SHORT = 2, 12, 7
FP32 = {"rtol": 1e-5, "atol": 1e-6}  # fp32: the head's summation order, carried through two layers


pytestmark = pytest.mark.usefixtures("one_thread")


def _decoder(config_class: str, **overrides: Any):
    return tiny_decoder_config(config_class, VOCAB, **overrides)


GEMMA = {"head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": 8}
MOE = {"num_local_experts": 4, "num_experts_per_tok": 2}
GEMMA4 = {  # Gemma 4's text model (and its unified one), soft-capped
    "final_logit_softcapping": 3.0,
    "layer_types": ["sliding_attention", "full_attention"],
    "head_dim": 8,
    "sliding_window": 8,
    "num_kv_shared_layers": 0,
}
ARCHS = {
    "llama": ("LlamaForCausalLM", _decoder("LlamaConfig")),
    "llama-tied": ("LlamaForCausalLM", _decoder("LlamaConfig", tie_word_embeddings=True)),
    "qwen2": ("Qwen2ForCausalLM", _decoder("Qwen2Config")),
    "mistral": ("MistralForCausalLM", _decoder("MistralConfig", sliding_window=8)),
    "phi3": ("Phi3ForCausalLM", _decoder("Phi3Config")),
    "gemma2-softcap": ("Gemma2ForCausalLM", _decoder("Gemma2Config", final_logit_softcapping=3.0, **GEMMA)),
    "gemma3": (
        "Gemma3ForCausalLM",
        _decoder("Gemma3TextConfig", layer_types=["sliding_attention", "full_attention"], **GEMMA),
    ),
    "cohere-scale": ("CohereForCausalLM", _decoder("CohereConfig", logit_scale=0.5)),
    "cohere2-scale": (
        "Cohere2ForCausalLM",
        _decoder(
            "Cohere2Config", logit_scale=0.5, sliding_window=8, layer_types=["sliding_attention", "full_attention"]
        ),
    ),
    "granite-scaling": ("GraniteForCausalLM", _decoder("GraniteConfig", logits_scaling=4.0)),
    "granitemoe-scaling": (
        "GraniteMoeForCausalLM",
        _decoder("GraniteMoeConfig", logits_scaling=4.0, **MOE),
    ),
    "mixtral-aux-loss": (
        "MixtralForCausalLM",
        _decoder("MixtralConfig", **MOE, output_router_logits=True),
    ),
    # the other classes whose forward soft-caps or scales the logits (hf/families.py's _HEAD_POSTPROCESSING)
    "gemma3n-softcap": (
        "Gemma3nForCausalLM",
        _decoder(
            "Gemma3nTextConfig",
            final_logit_softcapping=3.0,
            layer_types=["sliding_attention", "full_attention"],
            head_dim=8,
            sliding_window=8,
            intermediate_size=[64, 64],
            vocab_size_per_layer_input=VOCAB,
            hidden_size_per_layer_input=8,
            laurel_rank=4,
            altup_num_inputs=2,
            num_kv_shared_layers=0,
            activation_sparsity_pattern=[0.0, 0.0],
        ),
    ),
    "gemma4-softcap": (
        "Gemma4ForCausalLM",
        _decoder("Gemma4TextConfig", **GEMMA4, hidden_size_per_layer_input=0),
    ),
    "gemma4-unified-softcap": (
        "Gemma4UnifiedForCausalLM",
        _decoder("Gemma4UnifiedTextConfig", **GEMMA4),
    ),
    "vaultgemma-softcap": (
        "VaultGemmaForCausalLM",
        _decoder(
            "VaultGemmaConfig",
            final_logit_softcapping=3.0,
            layer_types=["sliding_attention", "full_attention"],
            **GEMMA,
        ),
    ),
    "nanochat-softcap": ("NanoChatForCausalLM", _decoder("NanoChatConfig", final_logit_softcapping=3.0)),
    "beam-softcap": (
        "BeamForCausalLM",
        _decoder(
            "BeamConfig",
            final_logit_softcapping=3.0,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_group=1,
            topk_group=1,
        ),
    ),
    "recurrent-gemma-softcap": (
        "RecurrentGemmaForCausalLM",
        _decoder(
            "RecurrentGemmaConfig", logits_soft_cap=3.0, num_hidden_layers=3, lru_width=32, attention_window_size=8
        ),
    ),
    "cohere2-moe-scale": (
        "Cohere2MoeForCausalLM",
        _decoder(
            "Cohere2MoeConfig",
            logit_scale=0.5,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    "granite-swa-scaling": (
        "GraniteSWAForCausalLM",
        _decoder("GraniteSWAConfig", logits_scaling=4.0, sliding_window=8),
    ),
    "granitemoe-swa-scaling": (
        "GraniteMoeSWAForCausalLM",
        _decoder("GraniteMoeSWAConfig", logits_scaling=4.0, **MOE, sliding_window=8),
    ),
    "granitemoeshared-scaling": (
        "GraniteMoeSharedForCausalLM",
        _decoder("GraniteMoeSharedConfig", logits_scaling=4.0, **MOE, shared_intermediate_size=32),
    ),
    "granitemoehybrid-scaling": (  # Granite 4.0: Mamba-2 and attention layers
        "GraniteMoeHybridForCausalLM",
        _decoder(
            "GraniteMoeHybridConfig",
            logits_scaling=4.0,
            **MOE,
            shared_intermediate_size=32,
            layer_types=["mamba", "attention"],
            **{**TINY_MAMBA2, "mamba_d_head": 16},  # its mixer is 2 x hidden wide: 4 heads of 16
        ),
    ),
    "falcon-h1-multiplier": (
        "FalconH1ForCausalLM",
        _decoder("FalconH1Config", lm_head_multiplier=0.5, head_dim=8, mamba_d_ssm=32, **TINY_MAMBA2),
    ),
}
GEMMA4_TEXT = {**TINY_DECODER, "vocab_size": VOCAB, **GEMMA4}
# the vision-language classes, text only (no vision tower configured): their cap is the text config's
ARCHS["gemma4-vlm-softcap"] = (
    "Gemma4ForConditionalGeneration",
    lambda: transformers.Gemma4Config(
        text_config={**GEMMA4_TEXT, "model_type": "gemma4_text", "hidden_size_per_layer_input": 0}
    ),
)
ARCHS["gemma4-unified-vlm-softcap"] = (
    "Gemma4UnifiedForConditionalGeneration",
    lambda: transformers.Gemma4UnifiedConfig(text_config={**GEMMA4_TEXT, "model_type": "gemma4_unified_text"}),
)
# Gemma 4's (and its unified text model's) own fp32 step is 1.3e-5 (relative L2) from the float64 step on the
# tied embedding's gradient, the loss head's 1.2e-5: elements differ from HF's fp32 by up to 3.5e-6 near 1.
FP32_OF = dict.fromkeys([name for name in ARCHS if name.startswith("gemma4")], {"rtol": 1e-4, "atol": 1e-5})


def build(name: str) -> torch.nn.Module:
    model_class, config = ARCHS[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config())
    if name == "llama-tied":
        assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def padded_batch(seed: int = 1) -> dict[str, torch.Tensor]:
    ids = torch.randint(4, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, SHORT:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def step(model: torch.nn.Module, autocast: bool = False, **inputs: Any):
    """One train-mode forward/backward: the output, and every parameter's gradient."""
    model.train()
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        output = model(**inputs)
    output.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return output, grads


def assert_same_step(ours, expected, bf16: bool = False, fp32: dict[str, float] = FP32) -> None:
    (output, grads), (ref_output, ref_grads) = ours, expected
    assert grads.keys() == ref_grads.keys() and grads
    if bf16:
        torch.testing.assert_close(output.loss, ref_output.loss, rtol=1e-2, atol=1e-2)
    else:
        torch.testing.assert_close(output.loss, ref_output.loss, **fp32)
    for name, ref in ref_grads.items():
        if bf16:  # bf16 rounding of activations and the head's gradients, through the layers
            tolerance = 3e-2 * float(ref.abs().max())
            torch.testing.assert_close(grads[name], ref, rtol=3e-2, atol=tolerance, msg=name)
        else:
            torch.testing.assert_close(grads[name], ref, **fp32, msg=name)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("name", sorted(ARCHS))
def test_loss_and_gradients_equal_hf(name, autocast):
    plain = build(name)
    ours = hf.enable(copy.deepcopy(plain), loss_head=True)
    assert hf.loss_head_enabled(ours) and not hf.loss_head_enabled(plain)
    batch = padded_batch()
    result, expected = step(ours, autocast, **batch), step(plain, autocast, **batch)
    assert_same_step(result, expected, bf16=autocast, fp32=FP32_OF.get(name, FP32))
    # no position's logits were computed; the dtype is what HF's are
    assert result[0].logits.shape == (BATCH, 0, VOCAB) and result[0].logits.dtype == expected[0].logits.dtype
    if name == "mixtral-aux-loss":
        assert result[0].aux_loss is not None


def test_num_items_in_batch_and_shift_labels_kwargs():
    plain = build("llama")
    ours = hf.enable(copy.deepcopy(plain), loss_head=True)
    batch = padded_batch()
    for extra in (
        {"num_items_in_batch": torch.tensor(31)},
        {"num_items_in_batch": 9},
        {"shift_labels": torch.roll(batch["labels"], -2, dims=1)},
        {"ignore_index": 0, "labels": batch["input_ids"]},  # the pad id as ignore_index
    ):
        inputs = {**batch, **extra}
        assert_same_step(step(ours, **inputs), step(plain, **inputs))


def test_logits_to_keep():
    plain = build("llama")
    ours = hf.enable(copy.deepcopy(plain), loss_head=True)
    batch = padded_batch()
    inputs = {**batch, "labels": batch["labels"][:, -5:], "logits_to_keep": 5}  # HF: labels for the kept positions
    assert_same_step(step(ours, **inputs), step(plain, **inputs))
    with pytest.raises(ValueError, match="10 positions have logits but there are 24 labels"):
        step(ours, **{**batch, "logits_to_keep": 5})


def test_without_labels_or_grad_the_forward_is_hfs():
    plain = build("gemma2-softcap")
    ours = hf.enable(copy.deepcopy(plain), loss_head=True)
    batch = padded_batch()
    ours.eval(), plain.eval()
    no_labels = {k: v for k, v in batch.items() if k != "labels"}
    assert torch.equal(ours(**no_labels).logits, plain(**no_labels).logits)
    with torch.no_grad():  # evaluation: HF's loss and full logits (metrics read them)
        output, expected = ours(**batch), plain(**batch)
    assert torch.equal(output.logits, expected.logits) and torch.equal(output.loss, expected.loss)


def test_trainer_sees_the_models_signature():
    ours = hf.enable(build("llama"), loss_head=True)
    assert inspect.signature(ours.forward) == inspect.signature(type(ours).forward.__get__(ours))
    assert "forward" in vars(ours)


def test_disable_restores_hfs_forward():
    plain = build("llama")
    ours = hf.enable(copy.deepcopy(plain), loss_head=True)
    clone = copy.deepcopy(ours)
    assert clone.forward.__self__ is clone and hf.loss_head_enabled(clone)
    hf.disable(ours)
    assert "forward" not in vars(ours) and not hf.loss_head_enabled(ours)
    batch = padded_batch()
    output, grads = step(ours, **batch)
    expected, expected_grads = step(plain, **batch)
    assert output.logits.shape == (BATCH, SEQ, VOCAB) and torch.equal(output.loss, expected.loss)
    assert all(torch.equal(grads[k], expected_grads[k]) for k in expected_grads)
    hf.enable(clone, loss_head=False)  # enable without loss_head hands the loss back too
    assert not hf.loss_head_enabled(clone) and "forward" not in vars(clone)
    assert step(clone, **batch)[0].logits.shape == (BATCH, SEQ, VOCAB)


def test_a_tied_embedding_adds_its_gradient_into_the_heads(monkeypatch):
    """A full fine-tune of a model whose embedding is its head: the embedding's gradient is made sparse and added
    into the head's, so no second [vocab, hidden] gradient exists at the end of the backward; the weight's
    gradient is HF's, dense, and the embedding is left as it was."""
    plain = build("llama-tied")
    # few tokens, a vocabulary that outweighs the layers: the step's peak is at the embedding's backward
    plain.resize_token_embeddings(8192)
    ours = hf.enable(copy.deepcopy(plain), loss_head=True)
    ids = torch.randint(4, 8192, (1, 6), generator=torch.Generator().manual_seed(3))

    def profiled(model):
        with torch.profiler.profile(profile_memory=True) as prof:
            result = step(model, input_ids=ids, labels=ids)
        return result, {event.key for event in prof.key_averages()}

    result, ops = profiled(ours)
    expected, plain_ops = profiled(plain)
    assert_same_step(result, expected, fp32={"rtol": 1e-4, "atol": 1e-5})  # vocab 8192: the head's summation order
    assert "aten::embedding_dense_backward" in plain_ops and "aten::embedding_dense_backward" not in ops
    assert "aten::embedding_sparse_backward" in ops and "aten::to_dense" not in ops  # added into the head's
    weight = ours.model.embed_tokens.weight
    assert weight.grad.layout == torch.strided and not ours.model.embed_tokens.sparse
    for model in (ours, plain):  # a second micro-batch accumulates into the gradients
        model(input_ids=ids.flip(1), labels=ids.flip(1)).loss.backward()
    torch.testing.assert_close(weight.grad, plain.model.embed_tokens.weight.grad, rtol=1e-4, atol=1e-5)

    def backward() -> None:
        ours.zero_grad(set_to_none=True)
        ours(input_ids=ids, labels=ids).loss.backward()

    peak = peak_bytes(backward)
    monkeypatch.setattr(hf_loss_head, "_tied_embedding", lambda model, head: None)  # the embedding's dense gradient
    dense_peak = peak_bytes(backward)
    # never two gradients of the weight's size at once (the layers' gradients and the head's chunk are small)
    assert peak < 2 * weight.numel() * weight.element_size() <= dense_peak


def test_peft_lora():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    plain = peft.get_peft_model(build("llama"), config)
    ours = hf.enable(copy.deepcopy(plain), loss_head=True)
    batch = padded_batch()
    result = step(ours, **batch)
    assert result[1] and all("lora_" in name for name in result[1])
    assert_same_step(result, step(plain, **batch))
    assert result[0].logits.shape[1] == 0


_TEXT = {**TINY_DECODER, "vocab_size": VOCAB}
_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
IMAGE, BOI, EOI = 5, 6, 7  # token ids


def _llava():
    return transformers.LlavaConfig(
        text_config=transformers.LlamaConfig(**_TEXT),
        vision_config=transformers.CLIPVisionConfig(**_VISION, image_size=16, patch_size=4),
        image_token_id=IMAGE,
        vision_feature_layer=-1,
    )


def _gemma3_vision():
    return transformers.Gemma3Config(
        text_config={**_TEXT, "model_type": "gemma3_text", **GEMMA, "layer_types": ["sliding_attention"] * 2},
        vision_config={**_VISION, "model_type": "siglip_vision_model", "image_size": 16, "patch_size": 4},
        mm_tokens_per_image=4,
        image_token_index=IMAGE,
        boi_token_index=BOI,
        eoi_token_index=EOI,
    )


# image tokens each image takes in the text: Llava's 16 patches, Gemma 3's pooled 4 between its markers
VISION_LANGUAGE = {
    "llava": ("LlavaForConditionalGeneration", _llava, [IMAGE] * 16),
    "gemma3-vision": ("Gemma3ForConditionalGeneration", _gemma3_vision, [BOI] + [IMAGE] * 4 + [EOI]),
}


@pytest.mark.parametrize("name", sorted(VISION_LANGUAGE))
def test_vision_language_models_with_images(name):
    """The loss head on a VLM whose loss is ForCausalLMLoss: right-padded rows that start with an image, labels
    -100 on the image tokens and the padding (Gemma 3 also gets token_type_ids: bidirectional image blocks)."""
    model_class, config, image = VISION_LANGUAGE[name]
    torch.manual_seed(0)
    plain = getattr(transformers, model_class)(config())
    ours = hf.enable(copy.deepcopy(plain), loss_head=True)
    text = padded_batch()
    pairs = zip(text["input_ids"], text["attention_mask"], strict=True)
    rows = [image + ids[mask.bool()].clamp_min(EOI + 1).tolist() for ids, mask in pairs]  # no marker in the text
    ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    for row, tokens in enumerate(rows):
        ids[row, : len(tokens)] = torch.tensor(tokens)
    mask = (torch.arange(ids.shape[1]) < torch.tensor([len(r) for r in rows])[:, None]).long()
    labels = ids.masked_fill((mask == 0) | (ids == IMAGE) | (ids == BOI) | (ids == EOI), -100)
    pixels = torch.randn(len(rows), 3, 16, 16, generator=torch.Generator().manual_seed(2))
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels, "pixel_values": pixels}
    if name == "gemma3-vision":
        batch["token_type_ids"] = (ids == IMAGE).long()
    (output, grads), (ref_output, ref_grads) = step(ours, **batch), step(plain, **batch)
    assert output.logits.shape[1] == 0
    assert grads.keys() == ref_grads.keys() and any("vision" in n for n in grads)  # the image path trains too
    torch.testing.assert_close(output.loss, ref_output.loss, **FP32)
    for param, ref in ref_grads.items():  # relative L2: Gemma 3's projector gradient is ~800 (elementwise atol)
        assert float((grads[param] - ref).norm()) <= 1e-5 * float(ref.norm()) + 1e-9, param


def test_lora_on_lm_head_is_refused():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"])
    model = peft.get_peft_model(build("llama"), config)
    with pytest.raises(ValueError, match=r"loss_head=True\): LlamaForCausalLM.lm_head is Linear, not a plain"):
        hf.enable(model, loss_head=True)
    assert not hf.is_enabled(model)  # refused before the model was changed


def test_head_replaced_after_enable_falls_back_with_a_warning():
    plain = build("llama")
    ours = hf.enable(copy.deepcopy(plain), loss_head=True)
    ours.lm_head = torch.nn.Sequential(ours.lm_head)
    batch = padded_batch()
    with pytest.warns(UserWarning, match="loss_head falls back to HF's loss .*Sequential"):
        output, _ = step(ours, **batch)
    assert output.logits.shape == (BATCH, SEQ, VOCAB)
    torch.testing.assert_close(output.loss, step(plain, **batch)[0].loss, **FP32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(ours, **batch)  # once per model


class _ScaledLlama(transformers.LlamaForCausalLM):
    """A forward that post-processes the logits in a way fastckpt does not know."""

    in_place = False

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        logits = self.lm_head(hidden)
        logits = logits.mul_(2.0) if self.in_place else logits * 2.0
        loss = self.loss_function(logits, labels, self.vocab_size, **kwargs) if labels is not None else None
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


@pytest.mark.parametrize("in_place", [False, True])
def test_unknown_logit_post_processing_is_refused(in_place):
    torch.manual_seed(0)
    model = _ScaledLlama(ARCHS["llama"][1]())
    model.in_place = in_place
    hf.enable(model, loss_head=True)
    with pytest.raises(RuntimeError, match="_ScaledLlama.forward changes the lm_head output before its loss"):
        step(model, **padded_batch())


def test_models_without_a_causal_lm_head_are_refused():
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    with pytest.raises(ValueError, match="BertForMaskedLM.lm_head is NoneType, not a plain torch.nn.Linear"):
        hf.enable(transformers.BertForMaskedLM(config), loss_head=True)
    model = build("llama")
    model.loss_function = lambda *args, **kwargs: torch.zeros(())
    with pytest.raises(ValueError, match="loss_function is not transformers' ForCausalLMLoss"):
        hf.enable(model, loss_head=True)
    with pytest.raises(TypeError, match="`loss_head` must be True or False"):
        hf.enable(build("llama"), loss_head="yes")


def _train(model: torch.nn.Module, tmp_path, name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    rows = [padded_batch(seed) for seed in range(4)]
    data = [{key: value[i] for key, value in row.items()} for row in rows for i in range(BATCH)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / name),
        max_steps=2,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        logging_steps=1,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_trainer_with_gradient_accumulation(tmp_path, monkeypatch):
    """Trainer passes num_items_in_batch (the tokens of both micro-batches) through the forward's kwargs."""
    plain = build("llama")
    ours = hf.enable(copy.deepcopy(plain), loss_head=True)
    divisors = []

    def counted(*args, **kwargs):
        divisors.append(kwargs["num_items_in_batch"])
        return linear_cross_entropy(*args, **kwargs)

    monkeypatch.setattr(hf_loss_head, "linear_cross_entropy", counted)
    losses, weights = _train(ours, tmp_path, "ours")
    monkeypatch.undo()
    # 2 optimizer steps x 2 micro-batches, each normalised by the tokens of its step's two micro-batches
    assert len(divisors) == 4 and all(torch.is_tensor(d) for d in divisors)
    assert divisors[0] == divisors[1] and divisors[0] < 4 * SEQ
    expected_losses, expected_weights = _train(plain, tmp_path, "plain")
    assert len(losses) == 2
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), **FP32)
    for key, value in expected_weights.items():
        torch.testing.assert_close(weights[key], value, rtol=1e-4, atol=1e-5, msg=key)
