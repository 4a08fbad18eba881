"""Packed sequences (rows of several sequences, no padding, as padding-free collators give them) under
hf.enable(model, padded_attention=True): tiny transformers models against their own sdpa attention, transformers'
flattening collator and Trainer on it, sliding windows over packed sequences, a call per sequence without a mask;
and on a GPU, the decomposed attention on padded and packed batches against HF's sdpa."""

from __future__ import annotations

import copy
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fastckpt.integrations import hf  # noqa: E402
from fastckpt.integrations.hf import attention as hf_attention  # noqa: E402
from tests.integrations.test_hf_attention import (  # noqa: E402
    ARCHS,
    PACKED,
    SEQ,
    VOCAB,
    _CountMaskedSdpa,
    _decompose_short_rows,  # noqa: F401 (an autouse fixture)
    assert_same,
    build,
    packed_batch,
    padded_batch,
    step,
)

pytestmark = pytest.mark.usefixtures("one_thread")


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
