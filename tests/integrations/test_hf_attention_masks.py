"""The mask side of hf.enable(model, padded_attention=True): the recognisers of padded rows and of packed
sequences, the mask function against transformers' `sdpa_mask` (and the masks it leaves to it), the mask form
(CausalSegmentsMask) under torch ops, reading packed sequences without building the whole mask, and the layers of
a padded step getting the lengths with no mask built."""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fastckpt.integrations import hf  # noqa: E402
from fastckpt.integrations.hf import attention as hf_attention  # noqa: E402
from tests.integrations.test_hf_attention import (  # noqa: E402
    LENGTHS,
    PACKED,
    SEQ,
    _decompose_short_rows,  # noqa: F401 (an autouse fixture)
    build,
    packed_batch,
    padded_batch,
    step,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _packed_rows(rows: tuple[tuple[int, ...], ...] = PACKED) -> tuple:
    """The segments (start, first real token, real end, end) the mask function gives for `packed_batch(rows)`."""
    result = []
    for lengths in rows:
        ends = [sum(lengths[: i + 1]) for i in range(len(lengths))]
        result.append(tuple((end - n, end - n, end, end) for n, end in zip(lengths, ends, strict=True)))
    return tuple(result)


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
