"""The architectures of the Hugging Face sweep (test_hf_zoo.py; test_hf_attention.py runs padded attention over
them too): for each decoder, encoder, encoder-decoder, vision and speech model, its transformers class, a tiny
config (the sweep sets its dropouts) and the batch it trains on, padded wherever the model takes an attention
mask (the second sample shorter: attention_mask 0 and labels -100 on its padding). A helper module, not a test
file."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.helpers import tiny_decoder_config  # noqa: E402

VOCAB = 96
BATCH = 2
# 24 tokens, not fewer: the additive float mask CPU sdpa saves for backward (2 x 1 x 24 x 24 x 4 bytes) must be
# at least fastckpt's min_tensor_bytes (4096) for the codecs to store it; a smaller one is kept plain.
SEQ = 24
SHORT = 15  # length of the second, padded sample

# --------------------------------------------------------------------------------------------- inputs


def _generator(seed: int = 1) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _padding_mask(length: int = SEQ, short: int = SHORT) -> torch.Tensor:
    mask = torch.ones(BATCH, length, dtype=torch.long)
    mask[1, short:] = 0
    return mask


def _tokens(config: Any, length: int = SEQ, short: int = SHORT, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids above the special ids, padded (right) with the pad id, and the padding mask."""
    ids = torch.randint(4, config.vocab_size, (BATCH, length), generator=_generator(seed))
    mask = _padding_mask(length, short)
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    return ids.masked_fill(mask == 0, pad), mask


def causal_lm_inputs(config: Any) -> dict[str, torch.Tensor]:
    ids, mask = _tokens(config)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def seq2seq_inputs(config: Any) -> dict[str, torch.Tensor]:
    ids, mask = _tokens(config)
    target, target_mask = _tokens(config, length=12, short=7, seed=2)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": target.masked_fill(target_mask == 0, -100),
        "decoder_attention_mask": target_mask,
    }


def image_classification_inputs(config: Any) -> dict[str, torch.Tensor]:
    pixels = torch.randn(BATCH, config.num_channels, config.image_size, config.image_size, generator=_generator())
    return {"pixel_values": pixels, "labels": torch.tensor([0, 2])}


def image_pretraining_inputs(config: Any) -> dict[str, torch.Tensor]:
    pixels = torch.randn(BATCH, config.num_channels, config.image_size, config.image_size, generator=_generator())
    return {"pixel_values": pixels}


def whisper_inputs(config: Any) -> dict[str, torch.Tensor]:
    """Log-mel features (the encoder takes no mask); the decoder side is padded."""
    features = torch.randn(BATCH, config.num_mel_bins, 2 * config.max_source_positions, generator=_generator())
    target, target_mask = _tokens(config, length=12, short=7, seed=2)
    return {
        "input_features": features,
        "labels": target.masked_fill(target_mask == 0, -100),
        "decoder_attention_mask": target_mask,
    }


def ctc_inputs(config: Any) -> dict[str, torch.Tensor]:
    samples, short = 400, 280
    values = torch.randn(BATCH, samples, generator=_generator())
    mask = _padding_mask(samples, short)
    labels = torch.randint(3, config.vocab_size, (BATCH, 8), generator=_generator(2))
    labels[1, 5:] = -100
    return {"input_values": values * mask, "attention_mask": mask, "labels": labels}


# --------------------------------------------------------------------------------------------- registry


@dataclasses.dataclass(frozen=True)
class Arch:
    name: str
    model_class: str  # attribute of the transformers package
    config: Callable[[], Any]  # a tiny config; the sweep sets its dropouts
    inputs: Callable[[Any], dict[str, torch.Tensor]]
    masked: bool = True  # takes an attention mask: the batch is padded
    fast: bool = False  # in the default (not slow) part of the sweep
    # Why HF's own reentrant checkpointing cannot be the reference for use_reentrant=True (it hangs): then
    # fastckpt's reentrant recompute is compared with HF's non-reentrant checkpointing, which torch documents
    # to give the same results.
    hf_reentrant_hangs: str | None = None


def _decoder(config_class: str, **overrides: Any) -> Callable[[], Any]:
    return tiny_decoder_config(config_class, VOCAB, **overrides)


def _config(config_class: str, **kwargs: Any) -> Callable[[], Any]:
    return functools.partial(getattr(transformers, config_class), **kwargs)


_BERT_LIKE = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
}
_VIT_LIKE = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "image_size": 16,
    "patch_size": 4,
    "num_channels": 3,
}

ARCHS = [
    # decoders
    Arch("llama", "LlamaForCausalLM", _decoder("LlamaConfig"), causal_lm_inputs, fast=True),
    Arch("mistral", "MistralForCausalLM", _decoder("MistralConfig", sliding_window=8), causal_lm_inputs),
    Arch(
        "mixtral",
        "MixtralForCausalLM",
        _decoder("MixtralConfig", num_local_experts=4, num_experts_per_tok=2),
        causal_lm_inputs,
    ),
    Arch("qwen2", "Qwen2ForCausalLM", _decoder("Qwen2Config"), causal_lm_inputs),
    Arch("qwen3", "Qwen3ForCausalLM", _decoder("Qwen3Config", head_dim=8), causal_lm_inputs),
    Arch(
        "qwen2_moe",
        "Qwen2MoeForCausalLM",
        _decoder(
            "Qwen2MoeConfig",
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
        ),
        causal_lm_inputs,
    ),
    Arch(
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        _decoder("Qwen3MoeConfig", head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
        causal_lm_inputs,
    ),
    Arch("gemma", "GemmaForCausalLM", _decoder("GemmaConfig", head_dim=8), causal_lm_inputs),
    Arch(
        "gemma2",
        "Gemma2ForCausalLM",
        _decoder("Gemma2Config", head_dim=8, query_pre_attn_scalar=8, sliding_window=8),
        causal_lm_inputs,
    ),
    Arch(
        "gemma3_text",
        "Gemma3ForCausalLM",
        _decoder(
            "Gemma3TextConfig",
            head_dim=8,
            query_pre_attn_scalar=8,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
        ),
        causal_lm_inputs,
    ),
    Arch("phi3", "Phi3ForCausalLM", _decoder("Phi3Config"), causal_lm_inputs),
    Arch(
        "falcon",
        "FalconForCausalLM",
        _config(
            "FalconConfig",
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_kv_heads=2,
            new_decoder_architecture=True,
            ffn_hidden_size=64,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
        causal_lm_inputs,
    ),
    Arch(
        "gpt2",
        "GPT2LMHeadModel",
        _config(
            "GPT2Config",
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=64,
            bos_token_id=1,
            eos_token_id=2,
        ),
        causal_lm_inputs,
        fast=True,
    ),
    Arch(
        "gpt_neox",
        "GPTNeoXForCausalLM",
        _config(
            "GPTNeoXConfig",
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=64,
            pad_token_id=0,
        ),
        causal_lm_inputs,
    ),
    Arch(
        "opt",
        "OPTForCausalLM",
        _config(
            "OPTConfig",
            vocab_size=VOCAB,
            hidden_size=32,
            word_embed_proj_dim=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            ffn_dim=64,
            max_position_embeddings=64,
        ),
        causal_lm_inputs,
    ),
    Arch(
        "bloom",
        "BloomForCausalLM",
        _config("BloomConfig", vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, pad_token_id=0),
        causal_lm_inputs,
    ),
    Arch("olmo2", "Olmo2ForCausalLM", _decoder("Olmo2Config"), causal_lm_inputs),
    Arch(
        "deepseek_v3",
        "DeepseekV3ForCausalLM",
        _decoder(
            "DeepseekV3Config",
            num_key_value_heads=4,
            moe_intermediate_size=16,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,  # layer 0 dense, layer 1 mixture of experts
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
        ),
        causal_lm_inputs,
    ),
    # encoders
    Arch("bert", "BertForMaskedLM", _config("BertConfig", **_BERT_LIKE, pad_token_id=0), causal_lm_inputs, fast=True),
    Arch(
        "roberta",
        "RobertaForMaskedLM",
        _config("RobertaConfig", **{**_BERT_LIKE, "max_position_embeddings": 66}, pad_token_id=1),
        causal_lm_inputs,
    ),
    Arch(
        "deberta_v2",
        "DebertaV2ForMaskedLM",
        _config(
            "DebertaV2Config",
            **_BERT_LIKE,
            relative_attention=True,
            position_buckets=16,
            pos_att_type=["p2c", "c2p"],
            share_att_key=True,
            norm_rel_ebd="layer_norm",
            position_biased_input=False,
            pad_token_id=0,
        ),
        causal_lm_inputs,
    ),
    Arch(
        "modernbert",
        "ModernBertForMaskedLM",
        _config(
            "ModernBertConfig",
            **_BERT_LIKE,
            layer_types=["full_attention", "sliding_attention"],
            local_attention=8,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            cls_token_id=1,
            sep_token_id=2,
        ),
        causal_lm_inputs,
    ),
    # encoder-decoders
    Arch(
        "t5",
        "T5ForConditionalGeneration",
        _config(
            "T5Config",
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
        ),
        seq2seq_inputs,
        fast=True,
    ),
    Arch(
        "bart",
        "BartForConditionalGeneration",
        _config(
            "BartConfig",
            vocab_size=VOCAB,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=64,
        ),
        seq2seq_inputs,
    ),
    # vision and audio
    Arch(
        "vit",
        "ViTForImageClassification",
        _config("ViTConfig", **_VIT_LIKE, num_labels=3),
        image_classification_inputs,
        masked=False,
        fast=True,
    ),
    Arch(
        "beit",
        "BeitForImageClassification",
        _config("BeitConfig", **_VIT_LIKE, use_relative_position_bias=True, num_labels=3),
        image_classification_inputs,
        masked=False,
    ),
    Arch(
        "vit_mae",
        "ViTMAEForPreTraining",
        _config(
            "ViTMAEConfig",
            **_VIT_LIKE,
            decoder_hidden_size=32,
            decoder_num_hidden_layers=2,
            decoder_num_attention_heads=4,
            decoder_intermediate_size=64,
        ),
        image_pretraining_inputs,
        masked=False,
    ),
    Arch(
        "whisper",
        "WhisperForConditionalGeneration",
        _config(
            "WhisperConfig",
            vocab_size=VOCAB,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            num_mel_bins=8,
            max_source_positions=16,
            max_target_positions=32,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=3,
            begin_suppress_tokens=None,
            suppress_tokens=None,
        ),
        whisper_inputs,
    ),
    Arch(
        "wavlm",
        "WavLMForCTC",
        _config(
            "WavLMConfig",
            vocab_size=32,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            conv_dim=(16, 16),
            conv_stride=(5, 2),
            conv_kernel=(10, 3),
            num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=2,
            num_buckets=16,
            max_bucket_distance=32,
            feat_extract_norm="layer",  # the variant that takes an attention mask
            do_stable_layer_norm=True,
            apply_spec_augment=False,
        ),
        ctc_inputs,
        hf_reentrant_hangs=(
            "torch.utils.checkpoint(use_reentrant=True) hangs on WavLM (each layer gets, as a keyword, and returns "
            "the position_bias the first layer made; the nested backward re-enters the checkpoint without end): "
            "measured on torch 2.14.1 + transformers 5.23"
        ),
    ),
]
BY_NAME = {arch.name: arch for arch in ARCHS}
assert len(BY_NAME) == len(ARCHS)
