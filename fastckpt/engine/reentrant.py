"""Python side of the reentrant checkpoint; the autograd node itself is C++ (fastckpt._reentrant, csrc/autograd/)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import torch

from fastckpt._extension import REENTRANT, extension
from fastckpt.engine.flat_tree import FlatTree
from fastckpt.engine.replay import ForwardState


class _Segment:
    """What the C++ node calls: the forward (grad off) and the recompute (grad on, state replayed)."""

    def __init__(self, function: Callable[..., Any], inputs: FlatTree, preserve_rng_state: bool) -> None:
        self.function = function
        self.inputs = inputs
        self.preserve_rng_state = preserve_rng_state
        self.outputs: FlatTree | None = None
        self.state: ForwardState | None = None
        self.count = 0  # tensors in the output
        self.node_positions: list[int] = []  # the output tensors the node owns (the rest pass through)
        self.passed: dict[int, torch.Tensor] = {}

    def forward(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        self.state = ForwardState.capture(tensors, self.preserve_rng_state)
        self.outputs = FlatTree(self.function(*self.inputs.rebuild(tensors)))
        self.inputs.tensors = []  # the node's SavedVariables own the inputs from here on
        inputs = {id(t) for t in tensors}
        self.count = len(self.outputs.tensors)
        aliases: dict[int, torch.Tensor] = {}  # one alias per tensor: one returned twice stays one object
        node_outputs = []
        for position, t in enumerate(self.outputs.tensors):
            if id(t) in inputs:
                # An argument returned: the C++ Function already hands out a view of it, as torch's does.
                node_outputs.append(t)
            elif t.requires_grad and (t.grad_fn is not None or not t._is_view()):
                # Grad is off here, so this tensor existed before the call (closed over, module-level); only a
                # view taken here of a tensor that requires grad also requires grad (without a grad_fn). Made a
                # node output, it would get the node as grad_fn, and the recompute, returning it again, would
                # re-enter the node: a hang. It passes through untouched, as torch passes nested outputs.
                self.passed[position] = t
                continue
            else:
                if id(t) not in aliases:
                    aliases[id(t)] = _alias(t)
                node_outputs.append(aliases[id(t)])
            self.node_positions.append(position)
        self.outputs.tensors = []
        return node_outputs

    def recompute(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        with self.state.replay(), torch.enable_grad():
            outputs = FlatTree(self.function(*self.inputs.rebuild(tensors)))
        if len(outputs.tensors) != self.count:
            raise RuntimeError(
                f"fastckpt.checkpoint: the recomputation returned {len(outputs.tensors)} tensors but the forward "
                f"returned {self.count}; the checkpointed function must return the same structure every call"
            )
        # Passed-through tensors are no backward roots: their gradient reaches them directly.
        return [outputs.tensors[position] for position in self.node_positions]

    def rebuild(self, node_outputs: list[torch.Tensor]) -> Any:
        """The function's output structure: the node's outputs and the passed-through tensors in place."""
        tensors: list[torch.Tensor | None] = [None] * self.count
        for position, t in zip(self.node_positions, node_outputs, strict=True):
            tensors[position] = t
        for position, t in self.passed.items():
            tensors[position] = t
        self.passed = {}  # the segment keeps only non-tensor leaves and positions
        return self.outputs.rebuild(tensors)


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A new tensor object for the node to own, sharing `t`'s storage and version counter.

    A returned tensor without autograd history may still be the caller's (module-level, closed over), and
    the node would set its grad_fn: an alias leaves the caller's object as it was (at the cost of identity
    with what the function built). Views stay views of the same base, so torch's checks on in-place changes
    of a custom Function's view outputs still apply. Integer and bool tensors are left alone: the node never
    attaches to them.
    """
    if not (t.is_floating_point() or t.is_complex()):
        return t
    return t.view_as(t) if t._is_view() else t.detach()


def checkpoint_reentrant(
    function: Callable[..., Any],
    args: tuple,
    *,
    preserve_rng_state: bool,
    input_hooks: Callable[[], Any] | None = None,
) -> Any:
    """Run `function(*args)` without grad as one C++ autograd node that recomputes it in backward."""
    native = extension(REENTRANT)  # before running anything: ImportError with the rebuild command
    inputs = FlatTree(args)
    if not any(t.requires_grad for t in inputs.tensors):
        warnings.warn("None of the inputs have requires_grad=True. Gradients will be None", stacklevel=4)
    segment = _Segment(function, inputs, preserve_rng_state)
    with input_hooks() if input_hooks is not None else contextlib.nullcontext():
        outputs = native.reentrant_checkpoint(segment, inputs.tensors)
    return segment.rebuild(outputs)
