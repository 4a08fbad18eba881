"""The decoder layers' position-wise parts computed in tiles of tokens (`TiledMLPs`, a patch `enable` installs:
patches.py): the MLPs, and the norms before them and before the attention's projections.

At long lengths a recomputed layer's largest working set is its MLP: several [tokens x intermediate] tensors
alive at once in its recomputation and backward (at Llama-3.2-1B's shape, 4x the layer's input per tensor).
Computed `tile` tokens at a time, with only its input kept and each tile recomputed in backward
(`fastckpt.tiling.recompute_in_tiles`), that working set stops growing with the length; the layer's
recomputation stops at the MLP's input, its last saved tensor, so the MLP runs no more often than untiled.
Next come the full-length tensors the layer keeps for its backward: a norm's output is one of them,
saved by every module it feeds (the attention's q/k/v projections, the MLP), beside the norm's input, which the
norm saves too. So a position-wise module handed a norm's output (recognised at run time, `_NotedNorm`: no
model's code is read) computes the norm and itself together, tile by tile, from the norm's input: the norm's
full-length output is then not kept, one [tokens x hidden] tensor less per norm and recomputed layer, for one
more norm (and, for a projection, one more projection) per tile in backward. Everything tiled here is
position-wise: the loss and gradients are the same up to the summation order of the tiles' parameter gradients.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch

from fastckpt.integrations.hf.patches import Patch, Settings
from fastckpt.tiling import recompute_in_tiles

MIN_TILE = 1024  # tokens: below this the extra forward costs more than the tile's memory is worth


def default_tile(config: Any) -> int:
    """Tokens per tile: the hidden size (a tile's [tile x intermediate] activation then about the size of the MLP's
    own weight matrix), at least MIN_TILE."""
    return max(MIN_TILE, int(getattr(config, "hidden_size", 0) or 0))


class _NotedNorm:
    """Stands in for a decoder layer's norm's `forward` (an instance attribute): the norm's own, noting the last
    output it made and the input it made it from, both held weakly (the layer's forward holds them while the
    modules the norm feeds run), with their versions (a tensor changed in place since is no longer the pair)."""

    def __init__(self, norm: torch.nn.Module) -> None:
        self.norm = norm  # held, not weakly referenced: copy.deepcopy maps it to the copy's module
        self.made: tuple[weakref.ref, weakref.ref, tuple[int, int]] | None = None

    def own(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """The norm's class forward (a tile's output is noted nowhere)."""
        return type(self.norm).forward(self.norm, x, *args, **kwargs)

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = self.own(x, *args, **kwargs)
        self.made = None
        if not args and not kwargs and isinstance(x, torch.Tensor) and isinstance(out, torch.Tensor):
            if out.shape == x.shape:
                self.made = (weakref.ref(out), weakref.ref(x), (out._version, x._version))
        return out

    def input_of(self, x: torch.Tensor) -> torch.Tensor | None:
        """The input this norm made `x` from, when `x` is its last output (unchanged since), else None."""
        if self.made is None:
            return None
        output, given, versions = self.made[0](), self.made[1](), self.made[2]
        if output is x and given is not None and (x._version, given._version) == versions:
            return given
        return None


def _is_norm(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("Norm")


def _trained(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


class _Tiled:
    """Stands in for a position-wise module's `forward` (an instance attribute): on an input longer than `tile`
    tokens in a training forward, `recompute_in_tiles` runs it, together with the norm from the norm's input
    where the input is the output of one of its layer's `norms`. `whole`: tile the module even when its input
    is no norm's output (an MLP: its own activations are the memory); a projection alone keeps only its input
    anyway, so it is tiled only with its norm. Anything else is the module's own forward."""

    def __init__(self, module: torch.nn.Module, tile: int, norms: list[_NotedNorm], whole: bool) -> None:
        self.module = module  # held, not weakly referenced: copy.deepcopy maps it to the copy's module
        self.tile, self.norms, self.whole = tile, norms, whole

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        own = type(self.module).forward.__get__(self.module)
        if args or kwargs or not torch.is_grad_enabled() or not isinstance(x, torch.Tensor) or x.dim() < 2:
            return own(x, *args, **kwargs)
        if x.shape[-2] <= self.tile:
            return own(x)
        noted, given = None, x
        for norm in self.norms:
            made_from = norm.input_of(x)
            if made_from is not None:
                noted, given = norm, made_from
                break
        if noted is None and not self.whole:
            return own(x)
        if noted is None:
            function, trained = own, _trained(self.module)
        else:

            def function(piece: torch.Tensor) -> torch.Tensor:
                return own(noted.own(piece))

            trained = _trained(self.module) + _trained(noted.norm)
        if not trained and not given.requires_grad:
            return own(x)
        return recompute_in_tiles(function, given, self.tile, dim=-2, parameters=trained)


def _position_wise(layer: torch.nn.Module) -> list[tuple[torch.nn.Module, bool]]:
    """A decoder layer's position-wise modules, each with whether it is tiled whole (see _Tiled): its `mlp`, if
    of a class named *MLP whose forward takes the hidden states alone (mixtures of experts and anything else are
    left as they are), and the linear projections (nn.Linear, or a PEFT layer over one) that are direct children
    of its other children (the attention's q/k/v/o projections: only those a norm feeds are ever tiled)."""
    found = []
    mlp = getattr(layer, "mlp", None)
    if isinstance(mlp, torch.nn.Module):
        parameters = list(inspect.signature(type(mlp).forward).parameters.values())[1:]
        if type(mlp).__name__.endswith("MLP") and len(parameters) == 1:
            found.append((mlp, True))
    for child in layer.children():
        if child is mlp or _is_norm(child):
            continue
        for module in child.children():
            if isinstance(module, torch.nn.Linear) or isinstance(getattr(module, "base_layer", None), torch.nn.Linear):
                found.append((module, False))
    return found


class TiledMLPs(Patch):
    """Each checkpointing decoder layer's MLP and attention projections' `forward` replaced by a `_Tiled` of
    `settings.tile_mlp` tokens, and its norms' by a `_NotedNorm`."""

    @classmethod
    def wanted(cls, settings: Settings) -> bool:
        return settings.tile_mlp is not None

    @classmethod
    def install(cls, pretrained: torch.nn.Module, settings: Settings) -> None:
        cls.remove(pretrained)
        for layer in pretrained.modules():
            if not hasattr(layer, "gradient_checkpointing"):
                continue
            modules = _position_wise(layer)
            if modules:
                norms = [_NotedNorm(m) for m in layer.children() if _is_norm(m)]
                for noted in norms:
                    noted.norm.forward = noted
                for module, whole in modules:
                    module.forward = _Tiled(module, settings.tile_mlp, norms, whole)

    @classmethod
    def remove(cls, pretrained: torch.nn.Module) -> None:
        for module in pretrained.modules():
            if isinstance(module.__dict__.get("forward"), (_Tiled, _NotedNorm)):
                del module.forward

    @staticmethod
    def tiles(model: torch.nn.Module) -> list[int]:
        """The tile of each MLP tiled in `model` (for tests and the report)."""
        forwards = [m.__dict__.get("forward") for m in model.modules()]
        return [forward.tile for forward in forwards if isinstance(forward, _Tiled) and forward.whole]
