"""fastckpt.tiled: a position-wise module run chunk by chunk, each chunk checkpointed."""

import pytest
import torch

import fastckpt
from fastckpt import hybrid
from fastckpt.memory import peak_bytes
from fastckpt.tiling import recompute_in_tiles
from tests.helpers import needs_sac_hooks, output_and_grads, rel_l2
from tests.models import AttentionHalf


def mlp(width: int = 32, dropout: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.LayerNorm(width),
        torch.nn.Linear(width, 4 * width),
        torch.nn.GELU(),
        torch.nn.Linear(4 * width, width),
        torch.nn.Dropout(dropout),
    )


@pytest.mark.parametrize(("chunks", "dim"), [(4, 1), (3, 1), (2, 0), (1, 1)])
def test_same_output_and_gradients_as_untiled(chunks, dim):
    x = torch.randn(4, 48, 32)
    y, grads = output_and_grads(mlp(), x)
    y_tiled, grads_tiled = output_and_grads(fastckpt.tiled(mlp(), chunks, dim=dim), x)
    torch.testing.assert_close(y_tiled, y, rtol=0, atol=0)  # each position computed alone, as untiled
    assert rel_l2(grads_tiled, grads) < 1e-6  # parameter gradients summed over chunks: another order


def test_backward_holds_one_chunk_of_activations():
    module, tiled = mlp(64), fastckpt.tiled(mlp(64), 8)
    x = torch.randn(2, 1024, 64, requires_grad=True)

    def step(run_module):
        return lambda: run_module(x).pow(2).mean().backward()

    whole = peak_bytes(step(lambda h: fastckpt.checkpoint(module, h)))
    chunked = peak_bytes(step(tiled))
    assert chunked < 0.5 * whole


def test_inside_outer_hooks_that_copy_what_they_pack():
    # A storage policy around the tiled module (or any hooks that copy what they pack); unshielded, the
    # chunks' own checkpoints saw their saves in another order at recompute (a metadata-mismatch error).
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Linear(512, 128))
    x = torch.randn(2, 256, 128)
    _, plain = output_and_grads(module, x)
    tiled = fastckpt.tiled(module, 4)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
        _, copied = output_and_grads(tiled, x)
    assert rel_l2(copied, plain) < 1e-6
    _, got = output_and_grads(tiled, x, policy="int8")
    assert 0 < rel_l2(got, plain) <= 1e-2


def test_chunk_policy_with_a_codec_on_the_inputs():
    x = torch.randn(2, 512, 32)
    _, plain = output_and_grads(mlp(), x)
    _, got = output_and_grads(fastckpt.tiled(mlp(), 4, policy="recompute+int8"), x)
    assert 0 < rel_l2(got, plain) <= 1e-2


def test_dropout_masks_are_replayed_per_chunk():
    module = fastckpt.tiled(mlp(dropout=0.5), 4)
    x = torch.randn(2, 64, 32)
    torch.manual_seed(3)
    first = output_and_grads(module, x)
    torch.manual_seed(3)
    again = output_and_grads(module, x)
    assert torch.equal(first[1], again[1])  # recomputation replays each chunk's RNG state


def test_state_dict_is_the_wrapped_modules_and_arguments_pass_through():
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)

        def forward(self, x, bias, *, scale=1.0):
            return self.linear(x) * scale + bias

    inner = Scaled()
    tiled = fastckpt.tiled(inner, 2)
    assert tiled.state_dict().keys() == inner.state_dict().keys()
    tiled.load_state_dict(inner.state_dict())
    x = torch.randn(3, 6, 8)
    torch.testing.assert_close(tiled(x, 1.0, scale=2.0), inner(x, 1.0, scale=2.0))
    assert "chunks=2, dim=1" in repr(tiled)


@pytest.mark.parametrize(
    ("kwargs", "error", "named"),
    [
        (dict(chunks=0), ValueError, "chunks"),
        (dict(chunks=True), ValueError, "chunks"),
        (dict(chunks=2.0), ValueError, "chunks"),
        (dict(chunks=2, dim="1"), TypeError, "dim"),
        (dict(chunks=2, policy="int8", context_fn=lambda: None), ValueError, "use a recompute policy"),
        (dict(chunks=2, context_fn=3), TypeError, "context_fn"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, named):
    with pytest.raises(error, match=named):
        fastckpt.tiled(mlp(), **kwargs)


def test_bad_modules_and_inputs_are_named():
    with pytest.raises(TypeError, match="module"):
        fastckpt.tiled(lambda x: x, 2)
    with pytest.raises(ValueError, match="already wrapped"):
        fastckpt.tiled(fastckpt.wrap(mlp()), 2)
    with pytest.raises(TypeError, match="first input"):
        fastckpt.tiled(mlp(), 2)([torch.randn(2, 4, 32)])


@pytest.mark.parametrize("chunks", [2, 3])
def test_attention_along_the_batch_gives_the_untiled_result(chunks):
    x = torch.randn(4, 40, 32)
    y, grads = output_and_grads(AttentionHalf(), x)
    y_tiled, grads_tiled = output_and_grads(fastckpt.tiled(AttentionHalf(), chunks, dim=0, policy="recompute"), x)
    torch.testing.assert_close(y_tiled, y, rtol=1e-6, atol=1e-6)  # each sample attends to its own tokens
    assert rel_l2(grads_tiled, grads) < 1e-5


def test_attention_along_the_batch_holds_one_slice_in_backward():
    module = AttentionHalf(64)
    x = torch.randn(4, 512, 64, requires_grad=True)

    def step(run_module):
        return lambda: run_module(x).pow(2).mean().backward()

    whole = peak_bytes(step(lambda h: fastckpt.checkpoint(module, h)))
    sliced = peak_bytes(step(fastckpt.tiled(module, 4, dim=0)))
    assert sliced < 0.6 * whole


def test_storage_policy_slices_keep_as_much_and_hold_one_slice_in_backward():
    module = AttentionHalf(64)
    x = torch.randn(4, 512, 64, requires_grad=True)

    def step(run_module):
        return lambda: run_module(x).pow(2).mean().backward()

    whole = peak_bytes(step(fastckpt.wrap(module, "int8")))
    sliced = peak_bytes(step(fastckpt.tiled(module, 4, dim=0, policy="int8")))
    assert sliced < 0.8 * whole  # same int8 bytes kept, a quarter of the decoded tensors and gradients
    _, plain = output_and_grads(AttentionHalf(64), x)
    with fastckpt.track() as report:
        _, got = output_and_grads(fastckpt.tiled(AttentionHalf(64), 4, dim=0, policy="int8"), x)
    assert 0 < rel_l2(got, plain) <= 1e-2
    assert [s.policy for s in report.segments] == ["int8"] * 4


def test_a_key_value_cache_argument_is_an_error():
    class Cache:  # as transformers' Cache classes: each layer call appends its keys and values
        def get_seq_length(self) -> int:
            return 0

    class Layer(torch.nn.Module):
        def forward(self, x, past_key_values=None, use_cache=False):
            return x * 2

    x = torch.randn(2, 4, 8)
    with pytest.raises(ValueError, match="argument 'past_key_values' is a key/value cache.*use_cache=False"):
        fastckpt.tiled(Layer(), 2, dim=0)(x, past_key_values=Cache(), use_cache=True)
    with pytest.raises(ValueError, match="argument 1 is a key/value cache"):
        fastckpt.tiled(Layer(), 2, dim=0)(x, Cache())
    torch.testing.assert_close(fastckpt.tiled(Layer(), 2, dim=0)(x, past_key_values=None), x * 2)


def test_an_unsplit_input_that_carries_the_split_dimension_is_an_error():
    class AddBias(torch.nn.Module):
        def forward(self, x, bias):
            return x + bias  # bias (batch, 1, features) broadcasts a batch slice back to the whole batch

    x, bias = torch.randn(2, 4, 8), torch.randn(2, 1, 8)
    with pytest.raises(ValueError, match="only the first input is split"):
        fastckpt.tiled(AddBias(), 2, dim=0)(x, bias)
    torch.testing.assert_close(fastckpt.tiled(AddBias(), 2, dim=0)(x, bias[:1]), x + bias[:1])


# ---- recompute_in_tiles: inside a segment, only the input kept


class Tiles(torch.nn.Module):
    """`module` through recompute_in_tiles (its trained parameters handed in)."""

    def __init__(self, module: torch.nn.Module, tile: int) -> None:
        super().__init__()
        self.module, self.tile = module, tile

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        trained = [p for p in self.module.parameters() if p.requires_grad]
        return recompute_in_tiles(self.module, x, self.tile, parameters=trained)


@pytest.mark.parametrize("tile", [16, 20, 48, 100])  # dividing the length, not, the whole length, past it
def test_recompute_in_tiles_gives_the_untiled_output_and_gradients(tile):
    x = torch.randn(2, 48, 32)
    y, grads = output_and_grads(mlp(), x)
    y_tiled, grads_tiled = output_and_grads(Tiles(mlp(), tile), x)
    torch.testing.assert_close(y_tiled, y, rtol=1e-6, atol=1e-6)
    assert rel_l2(grads_tiled, grads) < 1e-6


def test_recompute_in_tiles_hands_each_parameter_one_gradient():
    module = mlp()
    arrivals = []
    for p in module.parameters():
        p.register_post_accumulate_grad_hook(lambda p: arrivals.append(p))
    Tiles(module, 8)(torch.randn(2, 48, 32, requires_grad=True)).sum().backward()
    assert len(arrivals) == len(list(module.parameters()))  # the tiles' sum, accumulated once


def test_recompute_in_tiles_leaves_frozen_parameters_and_an_input_without_grad_alone():
    module = mlp()
    module[1].requires_grad_(False)
    x = torch.randn(2, 48, 32)  # no grad wanted for it
    Tiles(module, 16)(x).pow(2).sum().backward()
    assert module[1].weight.grad is None and x.grad is None
    assert module[3].weight.grad is not None


def test_recompute_in_tiles_restores_autocast_for_the_recomputation():
    x = torch.randn(2, 64, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, grads = output_and_grads(mlp(), x)
        y, grads_tiled = output_and_grads(Tiles(mlp(), 16), x)
    assert y.dtype == torch.bfloat16
    assert rel_l2(grads_tiled, grads) < 1e-2  # bf16 tiles against bf16 whole (fp32 recomputation: ~1e-1 off)


def test_recompute_in_tiles_replays_each_tiles_dropout():
    module, x = mlp(dropout=0.5).train(), torch.randn(2, 48, 32)
    xs = x.detach().requires_grad_(True)
    torch.manual_seed(7)  # the tiles run one after the other, plainly: the masks the tiled run must replay
    y = torch.cat([module(piece) for piece in xs.split(16, dim=1)], dim=1)
    y.pow(2).sum().backward()
    expected = torch.cat([xs.grad.flatten(), *(p.grad.flatten() for p in module.parameters())])
    torch.manual_seed(7)
    _, got = output_and_grads(Tiles(module, 16), x)
    assert rel_l2(got, expected) < 1e-6


def test_recompute_in_tiles_inside_a_recomputed_segment_holds_one_tile():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 64))
    x = torch.randn(1, 1024, 64, requires_grad=True)

    def step(inner):
        return lambda: fastckpt.checkpoint(inner, x, policy="recompute+int8").pow(2).mean().backward()

    whole = peak_bytes(step(module))
    tiles = peak_bytes(step(Tiles(module, 128)))
    assert tiles < 0.5 * whole


class Layer(torch.nn.Module):
    """A projection, then the MLP in tiles (its input the last tensor the layer saves), then, with `after`, an op
    that saves the MLP's output (a post-MLP norm's input)."""

    def __init__(self, after: bool) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.proj, self.tiles, self.after = torch.nn.Linear(32, 32), Tiles(mlp(), 16), after
        self.calls = []  # the positions each call of the MLP got
        self.tiles.module.register_forward_pre_hook(lambda module, args: self.calls.append(args[0].shape[1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tiles(self.proj(x))
        return torch.nn.functional.layer_norm(out, (32,)) if self.after else out


@pytest.mark.parametrize("after", [False, True])
@pytest.mark.parametrize("early_stop", [True, False])
def test_a_recomputation_that_stops_at_the_tiles_input_skips_their_forward(after, early_stop):
    layer, x = Layer(after), torch.randn(2, 48, 32)
    untiled = Layer(after)
    untiled.tiles = untiled.tiles.module
    expected = output_and_grads(untiled, x)
    got = output_and_grads(layer, x, policy="recompute", use_reentrant=False, early_stop=early_stop)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-6, atol=1e-6)
    assert rel_l2(got[1], expected[1]) < 1e-6
    skipped = early_stop and not after  # the MLP's output saved by nothing: the recomputation runs one position
    recomputation = [1] if skipped else [16] * 3
    assert layer.calls == [16] * 3 + recomputation + [16] * 3  # forward, recomputation, the tiles' backward


@needs_sac_hooks
def test_the_skipped_forward_runs_outside_a_selective_checkpoints_replay():
    """Under torch's selective checkpointing the recomputation replays the forward's ops: the position that stands
    for the output is computed outside it."""
    layer, x = Layer(after=False), torch.randn(2, 48, 32)
    untiled = Layer(after=False)
    untiled.tiles = untiled.tiles.module
    expected = output_and_grads(untiled, x)
    got = output_and_grads(layer, x, policy="recompute", use_reentrant=False, context_fn=hybrid.selective(store="save"))
    assert rel_l2(got[1], expected[1]) < 1e-6
    assert layer.calls == [16] * 3 + [1] + [16] * 3


def test_recompute_in_tiles_names_a_bad_tile():
    with pytest.raises(ValueError, match="`tile` must be an integer >= 1"):
        recompute_in_tiles(mlp(), torch.randn(2, 8, 32), 0)
