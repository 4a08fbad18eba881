"""The decoder layers' position-wise parts computed in tiles of tokens (`TiledMLPs`, a patch `enable` installs:
patches.py): the MLPs, and the norms before them and before the attention's projections.

At long lengths a recomputed layer's largest working set is its MLP: several [tokens x intermediate] tensors
alive at once in its recomputation and backward (at Llama-3.2-1B's shape, 4x the layer's input per tensor).
Computed `tile` tokens at a time, with only its input kept and each tile recomputed in backward
(`fastckpt.tiling.recompute_in_tiles`), that working set stops growing with the length, for one more forward of
the MLP. Next come the full-length tensors the layer keeps for its backward: a norm's output is one of them,
saved by every module it feeds (the attention's q/k/v projections, the MLP), beside the norm's input, which the
norm saves too. So a position-wise module handed a norm's output (recognised at run time, `_NormOutputs`: no
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


class _NormOutputs:
    """A forward hook on each norm of one decoder layer (its children whose class name ends in "Norm"): the last
    output each made and the input it was made from, both held weakly (the layer's forward holds them while the
    modules the norm feeds run)."""

    def __init__(self, norms: list[torch.nn.Module]) -> None:
        # norm -> (its output, its input, their versions): a tensor changed in place since is no longer the pair
        self.made: dict[torch.nn.Module, tuple[weakref.ref, weakref.ref, tuple[int, int]]] = {}
        self.handles = [norm.register_forward_hook(self._note) for norm in norms]

    def _note(self, norm: torch.nn.Module, args: tuple, output: Any) -> None:
        self.made.pop(norm, None)
        if len(args) == 1 and isinstance(args[0], torch.Tensor) and isinstance(output, torch.Tensor):
            if output.shape == args[0].shape:
                versions = (output._version, args[0]._version)
                self.made[norm] = (weakref.ref(output), weakref.ref(args[0]), versions)

    def source(self, x: torch.Tensor) -> tuple[torch.nn.Module, torch.Tensor] | None:
        """(the norm, its input) when `x` is a norm's last output, else None."""
        for norm, (output, given, versions) in self.made.items():
            made_from = given()
            if output() is x and made_from is not None and (x._version, made_from._version) == versions:
                return norm, made_from
        return None

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.made.clear()


def _trained(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


class _Tiled:
    """Stands in for a position-wise module's `forward` (an instance attribute): on an input longer than `tile`
    tokens in a training forward, `recompute_in_tiles` runs it, from the norm's input together with the norm
    where the input is a norm's output (`norms`). `whole`: tile the module even when its input is no norm's
    output (an MLP: its own activations are the memory); a projection alone keeps only its input anyway, so it
    is tiled only with its norm. Anything else is the module's own forward."""

    def __init__(self, module: torch.nn.Module, tile: int, norms: _NormOutputs, whole: bool) -> None:
        self.module = module  # held, not weakly referenced: copy.deepcopy maps it to the copy's module
        self.tile, self.norms, self.whole = tile, norms, whole

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        own = type(self.module).forward.__get__(self.module)
        if args or kwargs or not torch.is_grad_enabled() or not isinstance(x, torch.Tensor) or x.dim() < 2:
            return own(x, *args, **kwargs)
        if x.shape[-2] <= self.tile:
            return own(x)
        source = self.norms.source(x)
        if source is None and not self.whole:
            return own(x)
        if source is None:
            function, given, trained = own, x, _trained(self.module)
        else:
            norm, given = source

            def function(piece: torch.Tensor) -> torch.Tensor:
                return own(norm.forward(piece))  # the norm's forward without its hooks: a tile is no layer output

            trained = _trained(self.module) + _trained(norm)
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
        if child is mlp or type(child).__name__.endswith("Norm"):
            continue
        for module in child.children():
            if isinstance(module, torch.nn.Linear) or isinstance(getattr(module, "base_layer", None), torch.nn.Linear):
                found.append((module, False))
    return found


class TiledMLPs(Patch):
    """Each checkpointing decoder layer's MLP and attention projections' `forward` replaced by a `_Tiled` of
    `settings.tile_mlp` tokens, its norms watched by a `_NormOutputs`."""

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
                norms = _NormOutputs([m for m in layer.children() if type(m).__name__.endswith("Norm")])
                for module, whole in modules:
                    module.forward = _Tiled(module, settings.tile_mlp, norms, whole)

    @classmethod
    def remove(cls, pretrained: torch.nn.Module) -> None:
        for module in pretrained.modules():
            tiled = module.__dict__.get("forward")
            if isinstance(tiled, _Tiled):
                tiled.norms.remove()
                del module.forward

    @staticmethod
    def tiles(model: torch.nn.Module) -> list[int]:
        """The tile of each MLP tiled in `model` (for tests and the report)."""
        forwards = [m.__dict__.get("forward") for m in model.modules()]
        return [forward.tile for forward in forwards if isinstance(forward, _Tiled) and forward.whole]
