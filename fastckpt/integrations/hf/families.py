"""What each model family's forward does to its logits between lm_head and loss_function (soft caps, scales), as
fastckpt.linear_cross_entropy options; the loss head (loss_head.py) reads them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _read(model: Any, path: str) -> Any:
    """The attribute at dotted `path` on `model` ("config.logits_scaling", "model.lm_head_multiplier"); None
    when a step of it is missing."""
    for name in path.split("."):
        model = getattr(model, name, None)
    return model


def _scale_of(path: str, invert: bool = False) -> Callable[[Any], dict[str, Any]]:
    def options(model: Any) -> dict[str, Any]:
        value = _read(model, path)
        if value is None:
            return {}
        value = float(value)
        return {"logit_scale": 1.0 / value if invert else value}

    return options


def _softcap_of(path: str) -> Callable[[Any], dict[str, Any]]:
    def options(model: Any) -> dict[str, Any]:
        value = _read(model, path)
        return {} if value is None else {"softcap": float(value)}

    return options


# What the forward of these transformers classes does to the logits between lm_head and loss_function, as
# linear_cross_entropy options read from the attribute the forward reads (each class's forward in transformers
# 5.23; tested: tests/integrations/test_hf_loss.py). The soft caps are computed in fp32 here, where most Gemma
# forwards cap in the logits' dtype (under bf16 autocast the results differ by bf16 rounding). Any other class
# whose forward changes the lm_head output before loss_function is refused at its first forward (see
# _LossCall.loss).
_GEMMA_SOFTCAP = (
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3nForCausalLM",
    "Gemma4ForCausalLM",
    "Gemma4UnifiedForCausalLM",
    "VaultGemmaForCausalLM",
    "NanoChatForCausalLM",
    "BeamForCausalLM",
)
_GRANITE_SCALING = (
    "GraniteForCausalLM",
    "GraniteSWAForCausalLM",
    "GraniteMoeForCausalLM",
    "GraniteMoeSWAForCausalLM",
    "GraniteMoeSharedForCausalLM",
    "GraniteMoeHybridForCausalLM",
)
_HEAD_POSTPROCESSING: dict[str, Callable[[Any], dict[str, Any]]] = {
    **dict.fromkeys(_GEMMA_SOFTCAP, _softcap_of("config.final_logit_softcapping")),
    "RecurrentGemmaForCausalLM": _softcap_of("config.logits_soft_cap"),
    # vision-language models: the text model's cap (their forward reads config.get_text_config())
    **dict.fromkeys(
        ("Gemma4ForConditionalGeneration", "Gemma4UnifiedForConditionalGeneration"),
        _softcap_of("config.text_config.final_logit_softcapping"),
    ),
    **dict.fromkeys(("CohereForCausalLM", "Cohere2ForCausalLM", "Cohere2MoeForCausalLM"), _scale_of("logit_scale")),
    **dict.fromkeys(_GRANITE_SCALING, _scale_of("config.logits_scaling", invert=True)),
    "FalconH1ForCausalLM": _scale_of("model.lm_head_multiplier"),
}
