"""Split arguments/outputs (any pytree) into tensor leaves and the rest, and rebuild them."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


class FlatTree:
    """A pytree split into its tensor leaves and everything else, to be rebuilt with new tensors."""

    def __init__(self, tree: Any) -> None:
        leaves, self.spec = tree_flatten(tree)
        self.positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        self.tensors: list[torch.Tensor] = [leaves[i] for i in self.positions]
        self.others = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]

    def rebuild(self, tensors: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> Any:
        """The same tree with `tensors` in place of the original tensor leaves."""
        if len(tensors) != len(self.positions):
            raise RuntimeError(
                f"fastckpt.checkpoint: expected {len(self.positions)} tensors to rebuild the arguments/outputs, "
                f"got {len(tensors)}; the checkpointed function must return the same structure every call"
            )
        leaves = list(self.others)
        for position, tensor in zip(self.positions, tensors, strict=True):
            leaves[position] = tensor
        return tree_unflatten(leaves, self.spec)
