"""hf.enable(model, padded_attention=True) on tiny transformers models against their own sdpa attention on
right-padded, left-padded and sliding-window batches (loss, every gradient, the hidden states at padded
positions), the SDPA calls and masks each layout takes, the architecture sweep, compiled layers, generation, a
storage policy with the loss head, PEFT, the calls that must fall back to HF's sdpa (holes in the mask, dropout),
and the refusals. The helpers here (models, batches, the step and its comparison) are shared with
test_hf_attention_masks.py (recognisers, the mask function and its mask form) and test_hf_attention_packed.py
(packed sequences)."""

from __future__ import annotations

import copy
import functools
import math
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fastckpt.integrations import hf  # noqa: E402
from fastckpt.integrations.hf import attention as hf_attention  # noqa: E402
from tests.helpers import TINY_MAMBA2, tiny_decoder_config  # noqa: E402
from tests.integrations import test_hf_zoo  # noqa: E402

VOCAB = 128
SEQ = 16
LENGTHS = (SEQ, 7, 11)  # real tokens per row: one row without padding
FP32 = {"rtol": 1e-5, "atol": 1e-6}  # the kernels' summation order, through two layers


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _decompose_short_rows(monkeypatch):
    """These rows are short: rows of different lengths would all run as one masked call (_SHORT_ROWS), so
    the decomposition is exercised as for long rows, except where a test sets the threshold back."""
    monkeypatch.setattr(hf_attention, "_SHORT_ROWS", 0)


def _decoder(config_class: str, **overrides: Any):
    return tiny_decoder_config(config_class, VOCAB, attn_implementation="sdpa", **overrides)


def _zoo(name: str, **overrides: Any):
    """The config factory of test_hf_zoo's architecture `name`, with this file's vocabulary and sdpa."""
    config = next(arch.config for arch in test_hf_zoo.ARCHS if arch.name == name)
    return functools.partial(config, vocab_size=VOCAB, attn_implementation="sdpa", **overrides)


GEMMA = {"head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": 6}
ARCHS = {
    "llama": ("LlamaForCausalLM", _decoder("LlamaConfig")),
    "qwen2": ("Qwen2ForCausalLM", _decoder("Qwen2Config")),
    "mistral-sliding": ("MistralForCausalLM", _decoder("MistralConfig", sliding_window=6)),
    "phi3": ("Phi3ForCausalLM", _decoder("Phi3Config")),
    "gemma3-mixed-layers": (
        "Gemma3ForCausalLM",
        _decoder("Gemma3TextConfig", layer_types=["sliding_attention", "full_attention"], **GEMMA),
    ),
    "granite": ("GraniteForCausalLM", _decoder("GraniteConfig")),
    "mixtral": ("MixtralForCausalLM", _decoder("MixtralConfig", num_local_experts=4, num_experts_per_tok=2)),
    "olmo2": ("Olmo2ForCausalLM", _decoder("Olmo2Config")),
    # from the architecture sweep's registry, dropouts 0 (a dropout call runs HF's sdpa, and the steps compare)
    "gpt2": ("GPT2LMHeadModel", _zoo("gpt2", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "gpt-neox": ("GPTNeoXForCausalLM", _zoo("gpt_neox")),
    # the key bias's gradient is zero in exact arithmetic (~1e-10 here, within FP32's atol; bf16: assert_same)
    "opt": ("OPTForCausalLM", _zoo("opt", dropout=0.0)),
    # multi-head latent attention: values narrower than queries and keys
    "deepseek-v3-mla": ("DeepseekV3ForCausalLM", _zoo("deepseek_v3")),
    # chunked attention (Llama 4's local layers: not causal, HF's sdpa runs them) next to full layers
    "llama4-chunked": (
        "Llama4ForCausalLM",
        _decoder(
            "Llama4TextConfig",
            head_dim=8,
            num_local_experts=2,
            num_experts_per_tok=1,
            intermediate_size_mlp=64,
            attention_chunk_size=8,
        ),
    ),
    # Mamba-2 layers beside the attention (the hybrids' own padding handling)
    "falcon-h1-hybrid": (
        "FalconH1ForCausalLM",
        _decoder("FalconH1Config", head_dim=8, mamba_d_ssm=32, **TINY_MAMBA2),
    ),
}


def build(name: str) -> torch.nn.Module:
    model_class, config = ARCHS[name]
    torch.manual_seed(0)
    return getattr(transformers, model_class)(config())


def padded_batch(lengths: tuple[int, ...] = LENGTHS, left: bool = False) -> dict[str, torch.Tensor]:
    ids = torch.randint(4, VOCAB, (len(lengths), SEQ), generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(len(lengths), SEQ, dtype=torch.long)
    for row, length in enumerate(lengths):
        if left:
            mask[row, SEQ - length :] = 1
        else:
            mask[row, :length] = 1
    ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


PACKED = ((5, 7, 4), (SEQ,), (3, 13))  # per row, the lengths of the sequences packed into it


def packed_batch(rows: tuple[tuple[int, ...], ...] = PACKED) -> dict[str, torch.Tensor]:
    """Sequences packed into rows without padding (as padding-free collators give them): position ids start
    again at each sequence, no attention mask, and no label across a boundary."""
    ids = torch.randint(4, VOCAB, (len(rows), SEQ), generator=torch.Generator().manual_seed(2))
    positions = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in rows])
    labels = ids.masked_fill(positions == 0, -100)
    # use_cache=False: with a cache (a model's default in train mode without checkpointing) HF does not look for
    # packed sequences and attends across them
    return {"input_ids": ids, "position_ids": positions, "labels": labels, "use_cache": False}


def step(model: torch.nn.Module, batch: dict, autocast: bool = False):
    """One train-mode step: loss, last hidden states (every position), every parameter's gradient."""
    model.train()
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        output = model(**batch, output_hidden_states=True)
    output.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return output.loss.detach(), output.hidden_states[-1].detach(), grads


def assert_same(ours, expected, bf16: bool = False) -> None:
    (loss, hidden, grads), (ref_loss, ref_hidden, ref_grads) = ours, expected
    assert grads.keys() == ref_grads.keys() and grads
    tolerance = {"rtol": 2e-2, "atol": 2e-2} if bf16 else FP32
    torch.testing.assert_close(loss, ref_loss, **tolerance)
    # padded positions included; bf16: to 2% of the hidden states' scale (kernels that split the keys otherwise
    # round otherwise: one element of Gemma 3's windowed padding queries differed by 0.026 on a scale of ~3)
    hidden_atol = 2e-2 * float(ref_hidden.abs().max()) if bf16 and ref_hidden.numel() else FP32["atol"]
    torch.testing.assert_close(hidden, ref_hidden, rtol=tolerance["rtol"], atol=hidden_atol)
    # bf16: each gradient to 3% of its own scale, but at least to 1e-5 of the largest one's (a gradient zero in
    # exact arithmetic, OPT's key bias: softmax ignores a shift of all scores, is bf16's rounding noise: 2.5e-11
    # in fp32, 8e-7 in HF's bf16 step, 5e-7 in ours, of a largest gradient of 0.28). 3%: Gemma 3's packed
    # windowed layers differed by 2.5% in one element of a k_proj gradient whose own bf16 error against fp32
    # is 2.7% (relative L2; ours 2.3%, closer to fp32 than HF's bf16 step).
    floor = 1e-5 * max(float(ref.abs().max()) for ref in ref_grads.values())
    for name, ref in ref_grads.items():
        atol = max(3e-2 * float(ref.abs().max()), floor) if bf16 else FP32["atol"]
        torch.testing.assert_close(grads[name], ref, rtol=tolerance["rtol"], atol=atol, msg=name)


class _CountMaskedSdpa:
    """Counts torch SDPA calls by whether they got a mask."""

    def __init__(self, monkeypatch) -> None:
        self.masked = self.unmasked = 0
        self.largest_mask = None  # the shape of the mask with the most elements
        self.mask_shapes: list[tuple[int, ...]] = []
        original = torch.nn.functional.scaled_dot_product_attention

        def counted(*args, **kwargs):
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            if mask is None:
                self.unmasked += 1
            else:
                self.masked += 1
                self.mask_shapes.append(tuple(mask.shape))
                if self.largest_mask is None or mask.numel() > math.prod(self.largest_mask):
                    self.largest_mask = tuple(mask.shape)
            return original(*args, **kwargs)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)


# --------------------------------------------------------------------------------------------- models


def test_a_compiled_layer_given_the_lengths_equals_hfs_sdpa():
    """Layers compiled one by one get the mask from the uncompiled model: dynamo traces HF's sdpa on the full
    mask (the decomposition is not compiled), with HF's results."""
    model = build("llama")
    expected = step(copy.deepcopy(model), padded_batch())
    hf.enable(model, padded_attention=True)
    for layer in model.model.layers:
        layer.compile(backend="aot_eager")
    assert_same(step(model, padded_batch()), expected)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("name", sorted(ARCHS))
def test_loss_gradients_and_hidden_states_equal_hfs_sdpa(name, autocast, side):
    model = build(name)
    batch = padded_batch(left=side == "left")
    expected = step(copy.deepcopy(model), batch, autocast)
    hf.enable(model, padded_attention=True)
    assert hf_attention.installed(model)
    assert_same(step(model, batch, autocast), expected, bf16=autocast)


@pytest.mark.parametrize("name", [arch.name for arch in test_hf_zoo.ARCHS])
def test_every_architecture_of_the_sweep_gives_hfs_sdpa_results_or_is_refused(name):
    """The architecture sweep's models (decoders, encoders, encoder-decoders, vision, speech) on their padded
    batches: with padded attention, the checkpointed step's loss and gradients are those of the model's own
    sdpa without checkpointing (within float32 summation order), or enable refuses, naming the option."""
    arch = test_hf_zoo.BY_NAME[name]
    reason = test_hf_zoo._supports(arch, "sdpa")
    if reason:
        pytest.skip(reason)
    model = test_hf_zoo.model_copy(name, "sdpa", 0.0)
    try:
        hf.enable(model, padded_attention=True)
    except ValueError as refusal:
        assert "padded_attention=True" in str(refusal) and "enable without padded_attention" in str(refusal)
        assert not hf.is_enabled(model) and model.config._attn_implementation == "sdpa"
        return
    ours = test_hf_zoo.train_step(model, test_hf_zoo.inputs_of(name), f"{name} padded attention")
    expected = test_hf_zoo.plain_step(name, "sdpa", 0.0)
    torch.testing.assert_close(ours.loss, expected.loss, rtol=1e-6, atol=0)
    total, worst, worst_name = test_hf_zoo.relative_errors(ours.grads, expected.grads)
    assert total <= 1e-5 and worst <= 1e-5, (total, worst, worst_name)


def test_right_padded_attention_runs_without_a_mask(monkeypatch):
    model = hf.enable(build("llama"), padded_attention=True)
    counter = _CountMaskedSdpa(monkeypatch)
    step(model, padded_batch((11, 11, 11)))
    # forward and recomputation, 2 layers: the real queries causally, the padding queries over the real keys
    assert counter.masked == 0 and counter.unmasked == 2 * 2 * 2


def test_rows_of_different_lengths_take_two_calls_and_a_mask_for_the_queries_past_the_shortest(monkeypatch):
    """A call per row costs more than the mask saves when rows are many and short (16 rows of 256 tokens: 1.2x
    HF GC's step time): the queries before the shortest row's end causally for the whole batch, the rest with
    their rows of the mask."""
    model = hf.enable(build("llama"), padded_attention=True)
    counter = _CountMaskedSdpa(monkeypatch)
    step(model, padded_batch())
    assert counter.masked == counter.unmasked == 2 * 2
    assert counter.largest_mask == (len(LENGTHS), 1, SEQ - min(LENGTHS), SEQ)


@pytest.mark.parametrize(
    "config",
    [
        ("MistralForCausalLM", _decoder("MistralConfig", sliding_window=SEQ)),
        ("Gemma3ForCausalLM", _decoder("Gemma3TextConfig", layer_types=["sliding_attention", "full_attention"],
                                       **(GEMMA | {"sliding_window": SEQ}))),
    ],
    ids=["mistral", "gemma3-mixed-layers"],
)  # fmt: skip
def test_sliding_windows_as_long_as_the_rows_run_without_a_mask(config, monkeypatch):
    """A sliding window no shorter than the rows is causal attention: HF builds its mask, the mask function
    reads it, and every layer runs without one, with HF's results."""
    model_class, make = config
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(make())
    expected = step(copy.deepcopy(model), padded_batch())
    hf.enable(model, padded_attention=True)
    counter = _CountMaskedSdpa(monkeypatch)
    assert_same(step(model, padded_batch()), expected)
    assert counter.masked == counter.unmasked == 2 * 2  # as without a window (rows of different lengths)


@pytest.mark.parametrize("name", ["mistral-sliding", "gemma3-mixed-layers"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_sliding_windows_shorter_than_the_rows_run_in_blocks_of_the_window(name, side, monkeypatch):
    """Window 6 over rows of 16: blocks of 6 queries over the at most 11 keys their windows reach, each with
    its own small mask for every row, and HF's results."""
    model = build(name)
    batch = padded_batch(left=side == "left")
    expected = step(copy.deepcopy(model), batch)
    hf.enable(model, padded_attention=True)
    counter = _CountMaskedSdpa(monkeypatch)
    assert_same(step(model, batch), expected)
    window = 6  # both models' sliding_window
    blocks = [shape for shape in counter.mask_shapes if shape[-1] < SEQ]  # Gemma 3's full layer: [.., SEQ]
    assert blocks and all(math.prod(shape) <= len(LENGTHS) * window * (2 * window - 1) for shape in blocks)
    if side == "right":  # the full layer's masked call: the queries past the shortest row (left: all of them)
        assert all(shape[-2] <= SEQ - min(LENGTHS) for shape in counter.mask_shapes if shape[-1] == SEQ)


def test_short_rows_of_different_lengths_take_one_masked_call_on_the_mask_made_for_it(monkeypatch):
    """Below _SHORT_ROWS tokens, rows of different lengths run as HF's one masked call (faster on CPU than
    several calls), on the full mask computed for the call: HF's results, nothing held between calls."""
    monkeypatch.setattr(hf_attention, "_SHORT_ROWS", SEQ + 1)
    model = build("llama")
    expected = step(copy.deepcopy(model), padded_batch())
    hf.enable(model, padded_attention=True)
    counter = _CountMaskedSdpa(monkeypatch)
    ours = step(model, padded_batch())
    assert counter.unmasked == 0 and counter.masked == 2 * 2 and counter.largest_mask == (3, 1, SEQ, SEQ)
    assert torch.equal(ours[0], expected[0]) and all(torch.equal(ours[2][k], v) for k, v in expected[2].items())
    step(model, padded_batch((11, 11, 11)))  # rows of one length: decomposed whatever their length
    assert counter.unmasked == 2 * 2 * 2


def test_left_padded_attention_masks_only_the_queries_that_see_no_key(monkeypatch):
    model = hf.enable(build("llama"), padded_attention=True)
    counter = _CountMaskedSdpa(monkeypatch)
    step(model, padded_batch((9, 9), left=True))
    # one call over the real tokens and one [padding x 1 key] masked call: the kernel's output for a query
    # that sees nothing (zeros), as HF's full masked call gives it
    assert counter.unmasked == 2 * 2 and counter.masked == 2 * 2
    assert counter.largest_mask == (1, 1, SEQ - 9, 1)


@pytest.mark.parametrize("case", ["holes", "dropout"])
def test_other_calls_are_hfs_sdpa_exactly(case, monkeypatch):
    name = "llama"
    model = build(name)
    if case == "dropout":
        for module in model.modules():
            if hasattr(module, "attention_dropout"):
                module.attention_dropout = 0.1
    batch = padded_batch()
    if case == "holes":  # a padding token inside a row: HF's mask, not one of the decomposed forms
        batch["attention_mask"][2, 4] = 0
    torch.manual_seed(5)
    expected = step(copy.deepcopy(model), batch)
    hf.enable(model, padded_attention=True)
    counter = _CountMaskedSdpa(monkeypatch)
    torch.manual_seed(5)
    loss, hidden, grads = step(model, batch)
    assert counter.unmasked == 0 and counter.masked > 0
    assert torch.equal(loss, expected[0]) and torch.equal(hidden, expected[1])
    assert all(torch.equal(grads[k], v) for k, v in expected[2].items())


def test_with_a_storage_policy_and_the_loss_head():
    model = build("llama")
    reference = copy.deepcopy(model)
    hf.enable(reference, policy="recompute+int8", loss_head=True)
    expected = step(reference, padded_batch(), autocast=True)
    hf.enable(model, policy="recompute+int8", loss_head=True, padded_attention=True)
    ours = step(model, padded_batch(), autocast=True)
    assert_same(ours[:1] + (ours[1][:, :0],) + ours[2:], expected[:1] + (expected[1][:, :0],) + expected[2:], True)


def test_peft_lora():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(build("llama"), config)
    expected = step(copy.deepcopy(model), padded_batch())
    hf.enable(model, padded_attention=True)
    assert_same(step(model, padded_batch()), expected)


@pytest.mark.parametrize("name", ["llama", "gemma3-mixed-layers", "qwen2"])
def test_generation_from_left_padded_prompts_is_hfs(name):
    """Batched generation pads prompts on the left: the prefill's mask is one of the decomposed forms (its
    padding queries see no key), the decoding steps' are not (one query, a cache). Greedy tokens and the
    prefill's logits are HF's."""
    model = build(name).eval()
    reference = copy.deepcopy(model)
    hf.enable(model, padded_attention=True)
    batch = padded_batch((SEQ, 9, 12), left=True)
    prompts = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        ours = model.generate(**prompts, max_new_tokens=5, do_sample=False, output_logits=True,
                              return_dict_in_generate=True)  # fmt: skip
        theirs = reference.generate(**prompts, max_new_tokens=5, do_sample=False, output_logits=True,
                                    return_dict_in_generate=True)  # fmt: skip
    assert torch.equal(ours.sequences, theirs.sequences)
    torch.testing.assert_close(ours.logits[0], theirs.logits[0], **FP32)


def test_disable_and_enable_without_it_restore_sdpa(tmp_path):
    model = hf.enable(build("llama"), padded_attention=True)
    assert model.config._attn_implementation == hf_attention.NAME
    model.save_pretrained(tmp_path)  # the switch is not saved: a loaded model is HF's
    assert "fastckpt" not in (tmp_path / "config.json").read_text()
    hf.enable(model)
    assert model.config._attn_implementation == "sdpa" and not hf_attention.installed(model)
    hf.enable(model, padded_attention=True)
    hf.disable(model)
    assert model.config._attn_implementation == "sdpa"


def test_refusals():
    torch.manual_seed(0)
    eager = transformers.LlamaForCausalLM(tiny_decoder_config("LlamaConfig", VOCAB, attn_implementation="eager")())
    with pytest.raises(ValueError, match=r"padded_attention=True.*'eager'.*attn_implementation='sdpa'"):
        hf.enable(eager, padded_attention=True)
    assert not hf.is_enabled(eager)  # refused before the model was changed
    with pytest.raises(TypeError, match="`padded_attention` must be True or False"):
        hf.enable(build("llama"), padded_attention="yes")


def test_a_model_that_cannot_switch_its_attention_is_refused_unchanged():
    """Falcon keeps its own SDPA code (transformers only logs that it cannot switch it): a clear error, and the
    model is left as it was."""
    model = transformers.FalconForCausalLM(_zoo("falcon")())
    refusal = r"padded_attention=True\): the attention implementation of FalconForCausalLM, FalconModel cannot"
    with pytest.raises(ValueError, match=refusal):
        hf.enable(model, padded_attention=True, loss_head=True)
    assert not hf.is_enabled(model) and not hf.loss_head_enabled(model)
    assert model.config._attn_implementation == "sdpa"


def test_a_model_found_not_to_switch_after_trying_is_refused_unchanged(monkeypatch):
    """Where a model says it can switch but its configs keep their implementation (the check after trying),
    the refusal comes before checkpointing or the loss head are turned on."""
    model = build("llama")
    monkeypatch.setattr(type(model), "set_attn_implementation", lambda self, implementation: None)
    with pytest.raises(ValueError, match=r"LlamaForCausalLM did not switch its attention implementation"):
        hf.enable(model, padded_attention=True, loss_head=True)
    assert not hf.is_enabled(model) and not hf.loss_head_enabled(model)
    assert not model.is_activation_checkpointing


def test_a_model_without_sdpa_attention_is_refused_without_suggesting_sdpa():
    """Mamba has no attention (and no sdpa to load it with): the refusal says so instead of naming
    attn_implementation='sdpa' as the fix."""
    config = transformers.MambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=4)
    model = transformers.MambaForCausalLM(config)
    with pytest.raises(
        ValueError,
        match=r"padded_attention=True\): transformers has no sdpa attention for MambaForCausalLM, MambaModel",
    ) as info:
        hf.enable(model, padded_attention=True)
    assert "attn_implementation='sdpa'" not in str(info.value)
    assert not hf.is_enabled(model)
