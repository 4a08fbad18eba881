"""The decoder layers' MLPs computed in tiles of tokens (`TiledMLPs`, a patch `enable` installs: patches.py).

At long lengths a recomputed layer's largest working set is its MLP: several [tokens x intermediate] tensors
alive at once in its recomputation and backward (at Llama-3.2-1B's shape, 4x the layer's input per tensor).
Computed `tile` tokens at a time, with only its input kept and each tile recomputed in backward
(`fastckpt.tiling.recompute_in_tiles`), that working set stops growing with the length, for one more forward of
the MLP. An MLP is position-wise: the loss and gradients are the same up to the summation order of the tiles'
parameter gradients.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from fastckpt.integrations.hf.patches import Patch, Settings
from fastckpt.tiling import recompute_in_tiles

MIN_TILE = 1024  # tokens: below this the extra forward costs more than the tile's memory is worth


def default_tile(config: Any) -> int:
    """Tokens per tile: the hidden size (a tile's [tile x intermediate] activation then about the size of the MLP's
    own weight matrix), at least MIN_TILE."""
    return max(MIN_TILE, int(getattr(config, "hidden_size", 0) or 0))


class _TiledMLP:
    """Stands in for an MLP's `forward` (an instance attribute): inputs longer than `tile` tokens in a training
    forward go through `recompute_in_tiles`; anything else is the MLP's own forward."""

    def __init__(self, mlp: torch.nn.Module, tile: int) -> None:
        self.mlp = mlp  # held, not weakly referenced: copy.deepcopy maps it to the copy's module
        self.tile = tile

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        own = type(self.mlp).forward.__get__(self.mlp)
        if args or kwargs or not torch.is_grad_enabled() or not isinstance(x, torch.Tensor) or x.dim() < 2:
            return own(x, *args, **kwargs)
        if x.shape[-2] <= self.tile:
            return own(x)
        trained = [p for p in self.mlp.parameters() if p.requires_grad]
        if not trained and not x.requires_grad:
            return own(x)
        return recompute_in_tiles(own, x, self.tile, dim=-2, parameters=trained)


class TiledMLPs(Patch):
    """The decoder layers' MLPs' `forward` replaced by a `_TiledMLP` of `settings.tile_mlp` tokens."""

    @classmethod
    def wanted(cls, settings: Settings) -> bool:
        return settings.tile_mlp is not None

    @staticmethod
    def _mlps(model: torch.nn.Module) -> list[torch.nn.Module]:
        """The decoder layers' position-wise MLPs: a checkpointing layer's `mlp` of a class named *MLP whose
        forward takes the hidden states alone (mixtures of experts and anything else are left as they are)."""
        found = []
        for layer in model.modules():
            mlp = getattr(layer, "mlp", None)
            if not hasattr(layer, "gradient_checkpointing") or not isinstance(mlp, torch.nn.Module):
                continue
            parameters = list(inspect.signature(type(mlp).forward).parameters.values())[1:]
            if type(mlp).__name__.endswith("MLP") and len(parameters) == 1:
                found.append(mlp)
        return found

    @classmethod
    def install(cls, pretrained: torch.nn.Module, settings: Settings) -> None:
        cls.remove(pretrained)
        for mlp in cls._mlps(pretrained):
            mlp.forward = _TiledMLP(mlp, settings.tile_mlp)

    @classmethod
    def remove(cls, pretrained: torch.nn.Module) -> None:
        for mlp in pretrained.modules():
            if isinstance(mlp.__dict__.get("forward"), _TiledMLP):
                del mlp.forward

    @staticmethod
    def tiles(model: torch.nn.Module) -> list[int]:
        """The tile of each MLP tiled in `model` (for tests and the report)."""
        forwards = [m.__dict__.get("forward") for m in model.modules()]
        return [forward.tile for forward in forwards if isinstance(forward, _TiledMLP)]
