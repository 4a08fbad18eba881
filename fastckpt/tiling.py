"""`fastckpt.tiled`: run a module on its input in chunks, each checkpointed.

A checkpointed segment's backward still holds all of its own activations and their gradients at once:
for a transformer MLP on a long sequence those are several (tokens x 4 hidden) tensors, for attention the
projections, their gradients and the kernel's buffers, more than the rest of the step keeps. A module that
treats every position along a dimension alone gives the same output on slices of its input, so running it
chunk by chunk, each chunk under `checkpoint`, leaves one chunk's activations alive in backward instead of
all of them: along the tokens for position-wise modules (an MLP), along the batch for any module that
treats every sample alone (attention, a whole transformer block). The wrapped module's parameters receive
the sum of the chunks' gradients (the same value as untiled, summed in another order).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from fastckpt import _compat
from fastckpt.api import CheckpointWrapper, checkpoint
from fastckpt.engine.non_reentrant import saves_left_to_recompute
from fastckpt.engine.replay import ForwardState
from fastckpt.policies import Policy


class TiledWrapper(CheckpointWrapper):
    """A module run chunk by chunk along `dim` of its first input, each chunk checkpointed with `policy`;
    its state dict is exactly the wrapped module's."""

    def __init__(
        self,
        module: torch.nn.Module,
        chunks: int,
        dim: int,
        policy: str | Policy | None,
        context_fn: Callable[[], Any] | None = None,
    ) -> None:
        super().__init__(module, policy, use_reentrant=False)
        self.chunks = chunks
        self.dim = dim
        self.context_fn = context_fn

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"fastckpt.tiled: the first input is split into chunks; it must be a tensor, got {type(x)}")
        # Each chunk under a non-reentrant checkpoint, shielded from outer saved-tensor hooks (a storage policy
        # around this module): nested under hooks that copy what they pack, the engine would see the chunk's
        # saves in another order when it recomputes (torch's checkpoint does too).
        caches = [name for name, value in (*enumerate(args, 1), *kwargs.items()) if _is_kv_cache(value)]
        if caches:
            # Every slice would append its keys to the one cache, and the later slices attend to the earlier
            # slices' keys: wrong results of the right shape.
            raise ValueError(
                f"fastckpt.tiled: argument {caches[0]!r} is a key/value cache, which the slices would share; train "
                "without one (use_cache=False, model.config.use_cache = False), as checkpointing requires anyway"
            )
        options: dict[str, Any] = {"use_reentrant": False, "policy": self.policy}
        if self.context_fn is not None:
            options["context_fn"] = self.context_fn
        pieces = x.chunk(self.chunks, dim=self.dim)
        with torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
            outputs = [checkpoint(self.checkpointed, piece, *args, **options, **kwargs) for piece in pieces]
        if not all(isinstance(out, torch.Tensor) for out in outputs):
            raise TypeError("fastckpt.tiled: the wrapped module must return one tensor (the chunks are concatenated)")
        for piece, out in zip(pieces, outputs, strict=True):
            # A slice that comes back another size along `dim` was broadcast against, or mixed with, something
            # unsplit (another input that carries the batch, say): concatenating would silently be wrong.
            if out.dim() != piece.dim() or out.shape[self.dim] != piece.shape[self.dim]:
                raise ValueError(
                    f"fastckpt.tiled: a slice of size {piece.shape[self.dim]} along dim={self.dim} gave an output of "
                    f"shape {tuple(out.shape)}; the module must keep that dimension where it is, and only the first "
                    "input is split (other inputs reach every slice whole, so none may carry that dimension)"
                )
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=self.dim)

    def extra_repr(self) -> str:
        return f"chunks={self.chunks}, dim={self.dim}, policy={str(self.policy) if self.policy else None!r}"


class _RecomputedInTiles(torch.autograd.Function):
    """`function` on `x` tile by tile along `dim`, keeping only `x` for backward: the backward recomputes one tile
    at a time and hands back `x`'s gradient and the sum of the tiles' gradients of `parameters`."""

    @staticmethod
    def forward(ctx: Any, function: Callable, tile: int, dim: int, x: torch.Tensor, *parameters: torch.Tensor) -> Any:
        ctx.function, ctx.tile, ctx.dim, ctx.parameters = function, tile, dim, parameters
        ctx.save_for_backward(x)  # through the enclosing segment's policy: dropped by a recompute, or stored
        if saves_left_to_recompute() == 1 and (modes_off := _compat.disable_current_modes()) is not None:
            # The segment's recomputation, and `x` is the last tensor it remakes (a decoder layer's MLP): it stops
            # at `x`, so one position's output, of the right shape, stands for all. Spares the forward that the
            # tiles' backward runs again anyway. Outside the recomputation's dispatch modes: a selective
            # checkpoint's replay expects the forward's ops, which this one position is not.
            with modes_off(), torch.no_grad():
                one = function(x.narrow(dim, 0, 1))
                return one.expand(*one.shape[:dim], x.shape[dim], *one.shape[dim + 1 :])
        ctx.states, outputs = [], []
        for piece in x.split(tile, dim):
            # each tile's recomputation runs under its forward's RNG (dropout draws its masks again) and autocast
            ctx.states.append(ForwardState.capture([piece], preserve_rng_state=True))
            outputs.append(function(piece))
        return torch.cat(outputs, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        (x,) = ctx.saved_tensors
        wanted = [p for p, needed in zip(ctx.parameters, ctx.needs_input_grad[4:], strict=True) if needed]
        sums: list[torch.Tensor | None] = [None] * len(wanted)
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[3] else None
        if grad_x is None and not wanted:
            return (None,) * (4 + len(ctx.parameters))
        length = x.shape[ctx.dim]
        for start, state in zip(range(0, length, ctx.tile), ctx.states, strict=True):
            size = min(ctx.tile, length - start)
            piece = x.narrow(ctx.dim, start, size).detach().requires_grad_(grad_x is not None)
            with state.replay(), torch.enable_grad():
                out = ctx.function(piece)
            inputs = ([piece] if grad_x is not None else []) + wanted
            grads = list(torch.autograd.grad(out, inputs, grad.narrow(ctx.dim, start, size), allow_unused=True))
            del out  # this tile's graph, before the next tile's
            if grad_x is not None:
                grad_x.narrow(ctx.dim, start, size).copy_(grads.pop(0))
            for i, g in enumerate(grads):
                if g is not None:
                    sums[i] = g if sums[i] is None else sums[i].add_(g)
        given = iter(sums)
        return (None, None, None, grad_x, *(next(given) if needed else None for needed in ctx.needs_input_grad[4:]))


def recompute_in_tiles(
    function: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    tile: int,
    *,
    dim: int = -2,
    parameters: Sequence[torch.Tensor] = (),
) -> torch.Tensor:
    """`function(x)` computed `tile` positions along `dim` at a time, keeping only `x` for backward, where each
    tile is recomputed and differentiated alone: one tile's activations are alive at a time, in the forward and
    in the backward. For position-wise functions (a transformer MLP along the tokens), inside a checkpointed
    segment: unlike `tiled`, which checkpoints each slice itself, `x` is saved as the segment saves everything
    (dropped by a recompute policy and remade by its recomputation, or stored through its codec).

    `parameters`: the tensors requiring grad that `function` uses (a module's trained parameters); each gets the
    sum of the tiles' gradients, once. Autocast and the RNG state are restored for each tile's recomputation, so
    dropout draws the forward's masks (per tile: not an untiled run's masks, the same distribution). The function
    runs once more than untiled (its recomputation in backward), except where a segment's recomputation (with
    early stop) would end at `x`: there one position stands for the output (engine.saves_left_to_recompute).
    """
    if not isinstance(tile, int) or isinstance(tile, bool) or tile < 1:
        raise ValueError(f"fastckpt.tiling.recompute_in_tiles: `tile` must be an integer >= 1, got {tile!r}")
    dim = dim % x.dim()
    return _RecomputedInTiles.apply(function, tile, dim, x, *parameters)


def _keep(t: torch.Tensor) -> torch.Tensor:
    return t


def _is_kv_cache(value: object) -> bool:
    """A Hugging Face key/value cache (transformers' Cache classes): each layer call writes to it."""
    return not isinstance(value, torch.Tensor) and callable(getattr(value, "get_seq_length", None))


def tiled(
    module: torch.nn.Module,
    chunks: int,
    *,
    dim: int = 1,
    policy: str | Policy | None = "recompute",
    context_fn: Callable[[], Any] | None = None,
) -> TiledWrapper:
    """`module` run on `chunks` slices of its first input along `dim` (default 1: the tokens of a
    (batch, tokens, features) tensor), each slice checkpointed with `policy`, the outputs concatenated.

    With a recompute policy each slice is recomputed in backward, so the backward holds one slice's
    activations and gradients. With a storage policy ('int8', 'save', ...) every slice keeps what it saves
    (as many bytes as untiled), but the slices' backwards still run one after the other: the backward holds
    one slice's decoded tensors and gradients, not the whole module's.

    Only for modules that treat every position along `dim` alone, whose output has that dimension at the
    same place: along the tokens (dim=1) a transformer MLP or a norm over features, never attention (it
    mixes tokens); along the batch (dim=0) any module that treats every sample alone, attention and whole
    transformer blocks included, not BatchNorm. Only the first input is split; other inputs reach every
    slice whole, so none may carry the split dimension (an output of the wrong size raises an error).
    Random ops (dropout) draw per chunk, so their masks differ from an untiled run's (same distribution).
    `context_fn` is passed to every chunk's checkpoint (a fastckpt.hybrid.selective, say).
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
    if context_fn is not None and not callable(context_fn):
        raise TypeError(f"fastckpt.tiled: `context_fn` must be callable (a checkpoint context_fn), got {context_fn!r}")
    if context_fn is not None and not resolved.recompute:
        raise ValueError(
            f"fastckpt.tiled: a context_fn selects what a recomputation reruns; policy={str(resolved)!r} stores "
            "instead of recomputing (use a recompute policy, or drop context_fn)"
        )
    return TiledWrapper(module, chunks, dim, resolved, context_fn)
