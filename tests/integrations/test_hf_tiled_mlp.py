"""enable(tile_mlp=...): the decoder layers' MLPs computed in tiles of tokens inside the recomputed layers."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fastckpt.integrations import hf  # noqa: E402
from fastckpt.integrations.hf.tiled_mlp import MIN_TILE, TiledMLPs, _NotedNorm  # noqa: E402
from fastckpt.memory import peak_bytes  # noqa: E402
from tests.helpers import max_rel_l2, tiny_decoder_config  # noqa: E402

VOCAB = 96
LAYERS = 2


def llama(intermediate: int = 64) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(tiny_decoder_config("LlamaConfig", VOCAB, intermediate_size=intermediate)())


def lora(model: torch.nn.Module) -> torch.nn.Module:
    peft = pytest.importorskip("peft")
    targets = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=targets, init_lora_weights=False))


def loss_and_grads(model: torch.nn.Module, tokens: int = 64) -> tuple[torch.Tensor, list[torch.Tensor]]:
    ids = torch.randint(1, VOCAB, (2, tokens), generator=torch.Generator().manual_seed(tokens))
    model.train().zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("adapters", [False, True], ids=["full", "lora"])
def test_tiled_mlps_give_the_untiled_loss_and_gradients(adapters):
    wrap = lora if adapters else (lambda m: m)
    plain = hf.enable(wrap(llama()), "recompute", tile_mlp=False)
    loss, grads = loss_and_grads(plain)
    tiled = hf.enable(wrap(llama()), "recompute", tile_mlp=24)  # tiles of 24, 24 and 16 tokens
    assert TiledMLPs.tiles(tiled) == [24] * LAYERS
    tiled_loss, tiled_grads = loss_and_grads(tiled)
    torch.testing.assert_close(tiled_loss, loss, rtol=1e-6, atol=1e-6)
    assert max_rel_l2(tiled_grads, grads) < 1e-5


def test_tiles_are_on_by_default_under_a_recompute_policy_and_undone_by_disable():
    model = llama()
    hf.enable(model, "recompute+int8")
    assert TiledMLPs.tiles(model) == [MIN_TILE] * LAYERS  # hidden 32 < MIN_TILE
    hf.enable(model, "int8")  # a storage policy keeps the MLP's saves: no extra forward unless asked
    assert TiledMLPs.tiles(model) == []
    hf.enable(model, "int8", tile_mlp=True)
    assert TiledMLPs.tiles(model) == [MIN_TILE] * LAYERS
    hf.disable(model)
    assert TiledMLPs.tiles(model) == [] and all("forward" not in m.__dict__ for m in model.modules())


def test_a_long_rows_recomputed_layer_holds_one_tile_of_its_mlp():
    ids = torch.randint(1, VOCAB, (1, 512), generator=torch.Generator().manual_seed(0))

    def peak(tile_mlp):
        model = hf.enable(llama(intermediate=1024), "recompute+int8", loss_head=True, tile_mlp=tile_mlp).train()

        def step():
            model(input_ids=ids, labels=ids).loss.backward()

        step()  # gradients allocated once
        return peak_bytes(step)

    whole, tiled = peak(False), peak(64)
    assert tiled < 0.6 * whole


@pytest.mark.parametrize("adapters", [False, True], ids=["full", "lora"])
def test_a_norms_output_is_not_kept_by_the_modules_it_feeds(adapters):
    # Layer 0 run without its checkpoint, so that what its forward saves for backward is seen: its norms' outputs
    # feed the q/k/v projections and the MLP, which keep them untiled; tiled, each computes the norm in its tiles.
    ids = torch.randint(1, VOCAB, (1, 64), generator=torch.Generator().manual_seed(1))

    def norm_outputs_saved(tile_mlp):
        model = hf.enable((lora if adapters else (lambda m: m))(llama()), "recompute", tile_mlp=tile_mlp).train()
        layer = model.get_base_model().model.layers[0] if adapters else model.model.layers[0]
        layer.gradient_checkpointing = False
        outputs = []  # held: no other tensor reuses their memory
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.register_forward_hook(lambda module, args, out: outputs.append(out))
        saved = set()
        note = lambda t: saved.add(t.untyped_storage().data_ptr()) or t  # noqa: E731
        with torch.autograd.graph.saved_tensors_hooks(note, lambda t: t):
            loss = model(input_ids=ids, labels=ids).loss
        assert len(outputs) == 2
        kept = sum(out.untyped_storage().data_ptr() in saved for out in outputs)
        loss.backward()
        return kept

    assert norm_outputs_saved(False) == 2
    assert norm_outputs_saved(24) == 0


def test_a_norm_output_changed_in_place_is_not_recomputed_from_the_norm():
    norm = torch.nn.LayerNorm(8)
    noted = _NotedNorm(norm)
    given = torch.randn(2, 8)
    out = noted(given)
    torch.testing.assert_close(out, norm(given))
    assert noted.input_of(out) is given and noted.input_of(given) is None
    with torch.no_grad():
        out.mul_(2)
    assert noted.input_of(out) is None


@pytest.mark.parametrize("value", [0, -3, 2.5, "yes"])
def test_a_bad_tile_is_named(value):
    with pytest.raises(ValueError, match="`tile_mlp` must be None"):
        hf.enable(llama(), "recompute", tile_mlp=value)


FAMILIES = {  # causal LMs whose decoder layers hold a position-wise `mlp` (config class, model class, attention)
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "sdpa"),
    "mistral": ("MistralConfig", "MistralForCausalLM", "sdpa"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", "sdpa"),  # one fused gate_up projection
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", "eager"),  # soft caps, eager attention
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_other_families_tile_their_mlps_to_the_same_gradients(family):
    config_class, model_class, attention = FAMILIES[family]

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        config = tiny_decoder_config(config_class, VOCAB)()
        config._attn_implementation = attention
        return getattr(transformers, model_class)(config)

    loss, grads = loss_and_grads(hf.enable(model(), "recompute", tile_mlp=False), tokens=40)
    tiled = hf.enable(model(), "recompute", tile_mlp=16)
    assert len(TiledMLPs.tiles(tiled)) == LAYERS
    tiled_loss, tiled_grads = loss_and_grads(tiled, tokens=40)
    torch.testing.assert_close(tiled_loss, loss, rtol=1e-6, atol=1e-6)
    assert max_rel_l2(tiled_grads, grads) < 1e-5
