"""Python side of the reentrant checkpoint; the autograd node itself is C++ (csrc/autograd/)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import torch

from fastckpt._extension import extension
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

    def forward(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        self.state = ForwardState.capture(tensors, self.preserve_rng_state)
        self.outputs = FlatTree(self.function(*self.inputs.rebuild(tensors)))
        self.inputs.tensors = []  # the node's SavedVariables own the inputs from here on
        return self.outputs.tensors

    def recompute(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        with self.state.replay(), torch.enable_grad():
            outputs = FlatTree(self.function(*self.inputs.rebuild(tensors)))
        return outputs.tensors


def checkpoint_reentrant(
    function: Callable[..., Any],
    args: tuple,
    *,
    preserve_rng_state: bool,
    input_hooks: Callable[[], Any] | None = None,
) -> Any:
    """Run `function(*args)` without grad as one C++ autograd node that recomputes it in backward."""
    inputs = FlatTree(args)
    if not any(t.requires_grad for t in inputs.tensors):
        warnings.warn("None of the inputs have requires_grad=True. Gradients will be None", stacklevel=4)
    segment = _Segment(function, inputs, preserve_rng_state)
    with input_hooks() if input_hooks is not None else contextlib.nullcontext():
        outputs = extension().reentrant_checkpoint(segment, inputs.tensors)
    # The segment keeps only non-tensor leaves; the outputs' tensors are dropped from it.
    result = segment.outputs.rebuild(outputs)
    segment.outputs.tensors = []
    return result
