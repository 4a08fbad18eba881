"""`fastckpt.tiled`: run a position-wise module (an MLP, say) on its input in chunks, each checkpointed.

A checkpointed segment's backward still holds all of its own activations and their gradients at once:
for a transformer MLP on a long sequence those are several (tokens x 4 hidden) tensors, more than the rest
of the step keeps. A module that treats every position alone gives the same output on slices of its
input, so running it chunk by chunk along the sequence, each chunk under `checkpoint`, leaves one chunk's
activations alive in backward instead of all of them. The wrapped module's parameters receive the sum of
the chunks' gradients (the same value as untiled, summed in another order).
"""

from __future__ import annotations

from typing import Any

import torch

from fastckpt.api import CheckpointWrapper, checkpoint
from fastckpt.policies import Policy


class TiledWrapper(CheckpointWrapper):
    """A module run chunk by chunk along `dim` of its first input, each chunk checkpointed with `policy`;
    its state dict is exactly the wrapped module's."""

    def __init__(self, module: torch.nn.Module, chunks: int, dim: int, policy: str | Policy | None) -> None:
        super().__init__(module, policy, use_reentrant=False)
        self.chunks = chunks
        self.dim = dim

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"fastckpt.tiled: the first input is split into chunks; it must be a tensor, got {type(x)}")
        # Each chunk under a non-reentrant checkpoint, shielded from outer saved-tensor hooks (a storage policy
        # around this module): nested under hooks that copy what they pack, the engine would see the chunk's
        # saves in another order when it recomputes (torch's checkpoint does too).
        with torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
            outputs = [
                checkpoint(self.checkpointed, piece, *args, use_reentrant=False, policy=self.policy, **kwargs)
                for piece in x.chunk(self.chunks, dim=self.dim)
            ]
        if not all(isinstance(out, torch.Tensor) for out in outputs):
            raise TypeError("fastckpt.tiled: the wrapped module must return one tensor (the chunks are concatenated)")
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=self.dim)

    def extra_repr(self) -> str:
        return f"chunks={self.chunks}, dim={self.dim}, policy={str(self.policy) if self.policy else None!r}"


def _keep(t: torch.Tensor) -> torch.Tensor:
    return t


def tiled(
    module: torch.nn.Module, chunks: int, *, dim: int = 1, policy: str | Policy | None = "recompute"
) -> TiledWrapper:
    """`module` run on `chunks` slices of its first input along `dim` (default 1: the tokens of a
    (batch, tokens, features) tensor), each slice checkpointed with `policy`, the outputs concatenated.

    Only for modules that treat every position along `dim` alone (a transformer MLP, a norm over features),
    whose output has that dimension at the same place: attention mixes positions and must not be tiled.
    Random ops (dropout) draw per chunk, so their masks differ from an untiled run's (same distribution).
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"fastckpt.tiled: `module` must be a torch.nn.Module, got {type(module)}")
    if isinstance(module, CheckpointWrapper):
        raise ValueError("fastckpt.tiled: `module` is already wrapped by fastckpt; tile the inner module")
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(f"fastckpt.tiled: `chunks` must be an integer >= 1, got {chunks!r}")
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"fastckpt.tiled: `dim` must be an integer, got {dim!r}")
    resolved = Policy.parse("recompute" if policy is None else policy)
    if not resolved.recompute:
        raise ValueError(
            f"fastckpt.tiled: policy={str(resolved)!r} stores every chunk's activations, so tiling saves nothing; "
            "use a recompute policy ('recompute', 'recompute+int8', ...)"
        )
    return TiledWrapper(module, chunks, dim, resolved)
