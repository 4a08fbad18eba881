"""hf.enable(model, padded_attention=True): the mask recognisers and the mask function against transformers'
`sdpa_mask`, the mask form (CausalSegmentsMask) under torch ops, and tiny transformers models against their own
sdpa attention on right- and left-padded, packed and sliding-window batches (loss, every gradient, the hidden
states at padded positions), the architecture sweep, Trainer and generation, the calls that must fall back to
HF's sdpa (holes in the mask, dropout), and the refusals."""

from __future__ import annotations

import copy
import functools
import io
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


def _packed_rows(rows: tuple[tuple[int, ...], ...] = PACKED) -> tuple:
    """The segments (start, first real token, real end, end) the mask function gives for `packed_batch(rows)`."""
    result = []
    for lengths in rows:
        ends = [sum(lengths[: i + 1]) for i in range(len(lengths))]
        result.append(tuple((end - n, end - n, end, end) for n, end in zip(lengths, ends, strict=True)))
    return tuple(result)


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


# --------------------------------------------------------------------------------------------- recogniser


def _causal_right_padded(lengths: tuple[int, ...], tokens: int = SEQ, left: bool = False) -> torch.Tensor:
    positions = torch.arange(tokens)
    valid = positions[None, :] < torch.tensor(lengths)[:, None]
    valid = valid.flip(-1) if left else valid
    return (positions[None, :, None] >= positions[None, None, :]) & valid[:, None, :]


def test_recognises_causal_right_padding_per_row():
    mask = _causal_right_padded(LENGTHS)[:, None]
    assert hf_attention.padded_rows(mask, 3, SEQ) == tuple((0, n) for n in LENGTHS)
    assert hf_attention.padded_rows(mask[:1], 3, SEQ) == ((0, SEQ),)  # one row broadcast over the batch
    left = _causal_right_padded(LENGTHS, left=True)[:, None]  # the padding first: its queries see no key
    assert hf_attention.padded_rows(left, 3, SEQ) == tuple((SEQ - n, SEQ) for n in LENGTHS)


@pytest.mark.parametrize(
    "case", ["left-padding-seen", "sliding-window", "packed", "empty-row", "float", "other-shape", "not-causal"]
)
def test_other_masks_are_not_recognised(case):
    mask = _causal_right_padded(LENGTHS)[:, None]
    positions = torch.arange(SEQ)
    if case == "left-padding-seen":  # left padding whose queries see every key (HF's older masks): not causal
        mask = _causal_right_padded(LENGTHS, left=True)[:, None]
        mask = mask | ~mask.any(-1, keepdim=True)
    elif case == "sliding-window":
        mask = mask & (positions[:, None] - positions[None, :] < 4)
    elif case == "packed":  # two sequences in row 0: block-diagonal causal
        mask = mask.clone()
        mask[0, 0, 8:, :8] = False
    elif case == "empty-row":
        mask = _causal_right_padded((SEQ, 0, 5))[:, None]
    elif case == "float":
        mask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    elif case == "other-shape":
        mask = mask.expand(3, 2, SEQ, SEQ)
    elif case == "not-causal":
        mask = mask.clone()
        mask[2, 0, 0, 1] = True
    assert hf_attention.padded_rows(mask, 3, SEQ) is None


def test_an_in_place_change_of_the_mask_is_seen(monkeypatch):
    monkeypatch.setattr(hf_attention, "_CHECK_ELEMENTS", 64)  # several blocks of query rows
    mask = _causal_right_padded(LENGTHS)[:, None]
    assert hf_attention.padded_rows(mask, 3, SEQ) == tuple((0, n) for n in LENGTHS)
    mask[1, 0, 3, 9] = True  # a padding key made visible to one query
    assert hf_attention.padded_rows(mask, 3, SEQ) is None


# --------------------------------------------------------------------------------------------- mask function


def _padding(case: str) -> torch.Tensor:
    lengths = {"right": LENGTHS, "one-row": (9,), "none": (SEQ, SEQ, SEQ), "empty-row": (SEQ, 0, 5)}.get(case, LENGTHS)
    padding = padded_batch(lengths, left=case == "left")["attention_mask"]
    if case == "hole":
        padding[2, 3] = 0
    return padding if case == "integer" else padding.bool()  # the models hand the mask function a boolean one


_RIGHT_PADDED_ROWS = tuple(((0, 0, n, SEQ),) for n in LENGTHS)  # one segment per row


def _mask_arguments(padding: torch.Tensor, **overrides: Any) -> dict[str, Any]:
    batch, tokens = padding.shape
    arguments = {"batch_size": batch, "q_length": tokens, "kv_length": tokens, "attention_mask": padding}
    return arguments | overrides


@pytest.mark.parametrize("case", ["right", "one-row", "integer", "left", "hole", "none", "empty-row"])
@pytest.mark.parametrize("skip", [True, False], ids=["skip-allowed", "no-skip"])
def test_the_mask_function_gives_sdpas_mask(case, skip):
    """Same values as transformers' sdpa_mask, held as segments exactly for right padding."""
    from transformers.masking_utils import sdpa_mask

    arguments = _mask_arguments(_padding(case), allow_is_causal_skip=skip)
    ours, expected = hf_attention.mask(**arguments), sdpa_mask(**arguments)
    lazy = case in ("right", "one-row", "left") or (case == "none" and not skip)  # (built causal: one segment)
    assert isinstance(ours, hf_attention.CausalSegmentsMask) == lazy
    if expected is None:
        assert ours is None
        return
    full = ours.full() if lazy else ours
    assert type(full) is torch.Tensor and full.dtype == expected.dtype and torch.equal(full, expected)
    if lazy:
        assert ours.shape == expected.shape and ours.dtype == torch.bool
        real = [int(n) for n in _padding(case).sum(-1)]
        first = [SEQ - n if case == "left" else 0 for n in real]
        assert ours.rows == tuple(((0, f, f + n, SEQ),) for f, n in zip(first, real, strict=True))


@pytest.mark.parametrize("case", ["offset", "cache-offset-tensor", "longer-keys", "window-over-holes", "positional"])
def test_the_mask_function_leaves_other_masks_to_sdpa_mask(case):
    from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

    arguments = _mask_arguments(_padding("hole" if case == "window-over-holes" else "right"))
    if case == "offset":
        arguments |= {"q_offset": 2, "kv_offset": 2}
    elif case == "cache-offset-tensor":
        arguments |= {"q_offset": torch.tensor(0)}
    elif case == "longer-keys":  # a cache: fewer queries than keys
        arguments |= {"q_length": SEQ - 4}
    elif case == "window-over-holes":  # a sliding window over rows with a padding token inside
        arguments |= {"mask_function": sliding_window_causal_mask_function(4), "local_size": 4}
    if case == "positional":
        sizes = [arguments.pop(k) for k in ("batch_size", "q_length", "kv_length")]
        ours, expected = hf_attention.mask(*sizes, **arguments), sdpa_mask(*sizes, **arguments)
    else:
        ours, expected = hf_attention.mask(**arguments), sdpa_mask(**arguments)
    assert type(ours) is torch.Tensor and torch.equal(ours, expected)


@pytest.mark.parametrize("case", ["window-as-long-as-the-rows", "vmap", "chunks-longer-than-the-rows"])
def test_masks_sdpa_mask_builds_are_read_when_they_are_padded_causal(case):
    """Another mask function whose mask is causal over the padded rows (a window no shorter than the rows,
    a vmap-built one): HF builds it, and the mask function gives the segments instead."""
    from transformers.masking_utils import chunked_causal_mask_function, sdpa_mask, sliding_window_causal_mask_function

    padding = _padding("left")
    arguments = _mask_arguments(padding)
    if case == "window-as-long-as-the-rows":
        arguments |= {"mask_function": sliding_window_causal_mask_function(SEQ), "local_size": SEQ}
    elif case == "vmap":
        arguments |= {"use_vmap": True}
    else:
        arguments |= {"mask_function": chunked_causal_mask_function(SEQ, torch.zeros(3, dtype=torch.long))}
    ours, expected = hf_attention.mask(**arguments), sdpa_mask(**arguments)
    assert isinstance(ours, hf_attention.CausalSegmentsMask) and torch.equal(ours.full(), expected)
    assert ours.rows == tuple(((0, SEQ - n, SEQ, SEQ),) for n in LENGTHS)


@pytest.mark.parametrize("padding", ["right", "left", "none"])
def test_a_sliding_window_shorter_than_the_rows_is_read_with_its_window(padding):
    from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

    window = 5
    arguments = _mask_arguments(_padding(padding))
    arguments |= {"mask_function": sliding_window_causal_mask_function(window), "local_size": window}
    ours, expected = hf_attention.mask(**arguments), sdpa_mask(**arguments)
    assert isinstance(ours, hf_attention.CausalSegmentsMask) and ours.window == window
    assert torch.equal(ours.full(), expected)
    assert torch.equal(ours.detach().full(), expected) and copy.deepcopy(ours).window == window


def test_any_op_on_the_mask_sees_sdpas_mask():
    from transformers.masking_utils import sdpa_mask

    padding = _padding("right")
    ours, expected = hf_attention.mask(**_mask_arguments(padding)), sdpa_mask(**_mask_arguments(padding))
    detached = ours.detach()  # what checkpointing does with its arguments: still no elements
    assert isinstance(detached, hf_attention.CausalSegmentsMask) and detached.rows == _RIGHT_PADDED_ROWS
    assert torch.equal(ours[:, :, :, :9], expected[:, :, :, :9])  # HF's sdpa slices it to the keys' length
    scores = torch.randn(3, 2, SEQ, SEQ)
    bias = torch.zeros(scores.shape).masked_fill(~ours, float("-inf"))  # an eager attention's float mask
    assert torch.equal(bias, torch.zeros(scores.shape).masked_fill(~expected, float("-inf")))
    q, k, v = torch.randn(3, 3, 2, SEQ, 8).unbind(0)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    assert torch.equal(sdpa(q, k, v, attn_mask=ours), sdpa(q, k, v, attn_mask=expected))
    assert torch.equal(ours.clone(), expected) and type(ours.clone()) is torch.Tensor
    assert f"rows={_RIGHT_PADDED_ROWS}" in repr(ours)
    copied = copy.deepcopy(ours)
    assert isinstance(copied, hf_attention.CausalSegmentsMask) and torch.equal(copied.full(), expected)
    saved = io.BytesIO()
    torch.save(ours, saved)
    saved.seek(0)
    loaded = torch.load(saved)
    assert type(loaded) is torch.Tensor and torch.equal(loaded, expected)


def _block_causal(rows: tuple) -> torch.Tensor:
    return hf_attention.CausalSegmentsMask.of_rows(_packed_rows(rows), device=torch.device("cpu")).full()


def test_recognises_packed_sequences_per_row():
    assert hf_attention.packed_sequences(_block_causal(PACKED), SEQ) == _packed_rows(PACKED)


@pytest.mark.parametrize("case", ["padded", "sliding-window", "no-diagonal", "not-causal", "holes", "other-shape"])
def test_other_masks_are_not_packed_sequences(case):
    mask = _block_causal(PACKED)
    positions = torch.arange(SEQ)
    if case == "padded":  # packed sequences and padding at the end: HF builds it with an attention mask
        mask = mask & (positions < 14)
    elif case == "sliding-window":
        mask = mask & (positions[:, None] - positions[None, :] < 3)
    elif case == "no-diagonal":
        mask = mask.clone()
        mask[0, 0, 6, 6] = False
    elif case == "not-causal":
        mask = mask.clone()
        mask[1, 0, 2, 3] = True
    elif case == "holes":  # a key inside a sequence not seen by the queries after it
        mask = mask.clone()
        mask[2, 0, 8:, 5] = False
    elif case == "other-shape":
        mask = mask.expand(3, 2, SEQ, SEQ)
    assert hf_attention.packed_sequences(mask, SEQ) is None


def test_the_mask_function_gives_the_packed_sequences_of_sdpas_mask():
    from transformers.masking_utils import create_causal_mask

    model = build("llama")
    batch = packed_batch()
    embeds = model.get_input_embeddings()(batch["input_ids"])
    arguments = {"inputs_embeds": embeds, "attention_mask": None, "past_key_values": None}
    arguments["position_ids"] = batch["position_ids"]
    expected = create_causal_mask(config=model.config, **arguments)
    hf_attention.register()
    model.config._attn_implementation = hf_attention.NAME
    ours = create_causal_mask(config=model.config, **arguments)
    assert isinstance(ours, hf_attention.CausalSegmentsMask) and ours.rows == _packed_rows()
    assert torch.equal(ours.full(), expected)


def test_reading_packed_sequences_never_builds_the_whole_mask(monkeypatch):
    """Packed sequences are read from HF's mask function a block of queries at a time: the mask function's peak
    is a few blocks, not HF's [tokens x tokens] mask (and the temporaries of building it)."""
    from transformers.masking_utils import create_causal_mask

    from fastckpt import memory

    monkeypatch.setattr(hf_attention, "_CHECK_ELEMENTS", 1 << 14)
    tokens = 1024
    model = build("llama")
    positions = torch.cat([torch.arange(n) for n in (300, 500, 224)])[None]
    arguments = {"inputs_embeds": torch.zeros(1, tokens, 1), "attention_mask": None, "past_key_values": None}
    arguments["position_ids"] = positions
    hf_attention.register()
    peaks, masks = {}, {}
    for implementation in ("sdpa", hf_attention.NAME):
        model.config._attn_implementation = implementation

        def create(implementation: str = implementation) -> None:
            masks[implementation] = create_causal_mask(config=model.config, **arguments)

        peaks[implementation] = memory.peak_bytes(create, torch.device("cpu"))
    assert isinstance(masks[hf_attention.NAME], hf_attention.CausalSegmentsMask)
    assert peaks[hf_attention.NAME] <= tokens * tokens // 8 < peaks["sdpa"], peaks
    assert torch.equal(masks[hf_attention.NAME].full(), masks["sdpa"])


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("name", sorted(ARCHS))
def test_packed_sequences_give_hfs_sdpa_results(name, autocast):
    model = build(name)
    expected = step(copy.deepcopy(model), packed_batch(), autocast)
    hf.enable(model, padded_attention=True)
    assert_same(step(model, packed_batch(), autocast), expected, bf16=autocast)


@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position-ids", "with-flash-kwargs"])
def test_transformers_flattening_collator(flash_kwargs, monkeypatch):
    """transformers' padding-free collator (also with the varlen kwargs it makes for flash attention, which
    reach the attention as keywords): HF's sdpa results, one call per sequence."""
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    batch = collator([{"input_ids": list(range(5, 5 + n))} for n in (6, 3, 7)]) | {"use_cache": False}
    model = build("llama")
    expected = step(copy.deepcopy(model), batch)
    hf.enable(model, padded_attention=True)
    counter = _CountMaskedSdpa(monkeypatch)
    assert_same(step(model, batch), expected)
    assert counter.masked == 0 and counter.unmasked == 2 * 2 * 3


def test_trainer_with_the_flattening_collator(tmp_path, monkeypatch):
    """Trainer on packed batches (transformers' padding-free collator), the loss head and padded attention:
    every attention call gets the segments, and the logged losses are those of HF's own checkpointing."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, SEQ, (12,), generator=generator).tolist()
    data = [{"input_ids": torch.randint(4, VOCAB, (n,), generator=generator).tolist()} for n in lengths]

    def train(model: torch.nn.Module, folder: str) -> list[float]:
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / folder), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-3,
            activation_checkpointing=True, use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
            logging_steps=1, remove_unused_columns=False, seed=0,
        )  # fmt: skip
        collator = transformers.DataCollatorWithFlattening()
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data, data_collator=collator)
        trainer.train()
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    model = build("llama")
    expected = train(copy.deepcopy(model), "hf")
    hf.enable(model, loss_head=True, padded_attention=True)
    masks = []
    attention = hf_attention.attention

    def spy(module, query, key, value, attention_mask, **kwargs):
        masks.append(attention_mask)
        return attention(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, hf_attention.NAME, spy)
    losses = train(model, "fastckpt")
    assert len(losses) == len(expected) == 3
    torch.testing.assert_close(losses, expected, rtol=1e-4, atol=0)
    assert masks and all(isinstance(m, hf_attention.CausalSegmentsMask) and len(m.rows[0]) > 1 for m in masks)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["right-padded", "left-padded", "packed"])
def test_on_a_gpu_the_decomposed_attention_gives_hfs_sdpa_results(layout, dtype):
    """On CUDA (other SDPA kernels; the left-padded queries that see no key included): HF's sdpa results."""
    batch = packed_batch() if layout == "packed" else padded_batch(left=layout == "left-padded")
    batch = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    model = build("llama").cuda().to(dtype)
    expected = step(copy.deepcopy(model), batch)
    hf.enable(model, padded_attention=True)
    ours = step(model, batch)
    assert all(torch.isfinite(t).all() for t in (ours[0], ours[1], *ours[2].values()))
    if dtype == torch.bfloat16:
        assert_same(ours, expected, bf16=True)
        return
    assert ours[2].keys() == expected[2].keys()
    pairs = [(ours[0], expected[0]), (ours[1], expected[1])] + [(ours[2][k], v) for k, v in expected[2].items()]
    for got, reference in pairs:  # other kernels than the CPU's: other summation orders
        torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["mistral-sliding", "gemma3-mixed-layers"])
def test_packed_sequences_under_a_sliding_window_run_in_blocks(name, monkeypatch):
    """Window 6 over packed sequences of up to 13 tokens: each sequence in blocks with small masks, none of
    [tokens x tokens]; HF's results (the fp32 step; bf16 in the test above)."""
    model = build(name)
    expected = step(copy.deepcopy(model), packed_batch())
    hf.enable(model, padded_attention=True)
    counter = _CountMaskedSdpa(monkeypatch)
    assert_same(step(model, packed_batch()), expected)
    window = 6  # both models' sliding_window
    assert counter.masked > 0 and math.prod(counter.largest_mask) <= window * (2 * window - 1)


def test_packed_sequences_run_without_a_mask(monkeypatch):
    model = hf.enable(build("llama"), padded_attention=True)
    counter = _CountMaskedSdpa(monkeypatch)
    step(model, packed_batch())
    # forward and recomputation, 2 layers: a call per sequence
    assert counter.masked == 0 and counter.unmasked == 2 * 2 * sum(len(row) for row in PACKED)


def test_the_layers_get_the_lengths_and_no_mask_is_built(monkeypatch):
    """A padded step: every attention call receives the lengths, nothing computes the full mask, and the
    model's sdpa_mask is not called."""
    model = hf.enable(build("llama"), policy="recompute+int8", padded_attention=True)
    received, built = [], []
    attention = hf_attention.attention

    def spy(module, query, key, value, attention_mask, **kwargs):
        received.append(attention_mask)
        return attention(module, query, key, value, attention_mask, **kwargs)

    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, hf_attention.NAME, spy)
    monkeypatch.setattr(hf_attention.CausalSegmentsMask, "full", lambda self: built.append(self))
    monkeypatch.setattr("transformers.masking_utils.sdpa_mask", lambda *a, **k: built.append("sdpa_mask"))
    assert ALL_MASK_ATTENTION_FUNCTIONS[hf_attention.NAME] is hf_attention.mask
    step(model, padded_batch())
    assert len(received) == 2 * 2  # forward and recomputation, 2 layers
    assert all(isinstance(m, hf_attention.CausalSegmentsMask) and m.rows == _RIGHT_PADDED_ROWS for m in received)
    assert not built


def test_a_compiled_layer_given_the_lengths_equals_hfs_sdpa():
    """Layers compiled one by one get the mask from the uncompiled model: dynamo traces HF's sdpa on the full
    mask (the decomposition is not compiled), with HF's results."""
    model = build("llama")
    expected = step(copy.deepcopy(model), padded_batch())
    hf.enable(model, padded_attention=True)
    for layer in model.model.layers:
        layer.compile(backend="aot_eager")
    assert_same(step(model, padded_batch()), expected)


# --------------------------------------------------------------------------------------------- models


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
