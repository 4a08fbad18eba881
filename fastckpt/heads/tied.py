"""A weight the head and the input embedding share (tied): the embedding's gradient added in place into the
head's, so that the backward never holds a second dense [vocab, hidden] gradient beside it."""

from __future__ import annotations

from typing import Any

import torch

from fastckpt import _compat


class TiedGradient:
    """The embedding's gradient added in place into the head's, for a weight they share.

    Autograd sums a leaf's incoming gradients before accumulating them. For a tied weight the head's, dense,
    arrives first; the embedding's usual gradient is a second dense [vocab, hidden] tensor, and with it the sum
    is one more: at the end of the backward, where every other gradient is live (Llama-3.2-1B's full
    fine-tune: 1 GiB over 4.6 GiB of gradients). Here, between `begin` and `end` (one forward), the lookup runs
    with `sparse=True` (its gradient is [tokens, hidden]); `keep_head_gradient_of` hooks the head's node to keep
    its gradient of the weight, and the lookup's node adds the sparse gradient into it in place and hands
    autograd no second gradient. The weight's gradient is the same sum, dense, accumulated once (optimizers, DDP
    and gradient hooks see what they would; DDP, built while `sparse` is False, expects a dense one). Without the
    head's gradient in this backward the lookup's is summed with the weight's others by autograd, and the
    weight's gradient made dense if it ended sparse."""

    HEAD_NODES = ("_LinearCrossEntropyBackward", "_LinearLogProbsBackward")  # the weight is their second input

    def __init__(self, embedding: torch.nn.Embedding) -> None:
        self.embedding = embedding
        self.head_grad: torch.Tensor | None = None
        self.task = None  # the backward the head's gradient belongs to
        self.lookup_hook: Any = None

    def begin(self) -> None:
        self.embedding.sparse = True
        self.lookup_hook = self.embedding.register_forward_hook(self.hook_lookup)

    def end(self) -> None:
        self.embedding.sparse = False
        if self.lookup_hook is not None:
            self.lookup_hook.remove()
            self.lookup_hook = None

    def keep_head_gradient_of(self, output: torch.Tensor) -> None:
        """Hook the node of the head's Function that made `output` (through views)."""
        node = output.grad_fn
        for _ in range(4):
            if node is None or type(node).__name__ in self.HEAD_NODES:
                break
            node = node.next_functions[0][0] if node.next_functions else None
        if node is not None and type(node).__name__ in self.HEAD_NODES:
            node.register_hook(self.keep_head_gradient)

    def keep_head_gradient(self, grad_inputs: tuple, grad_outputs: tuple) -> None:
        self.head_grad, self.task = grad_inputs[1], _compat.require("current_graph_task_id")()

    def hook_lookup(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        if output.grad_fn is not None:
            output.grad_fn.register_hook(self.add_into_head_gradient)

    def add_into_head_gradient(self, grad_inputs: tuple, grad_outputs: tuple) -> tuple:
        """Post-hook of the lookup's node: its one gradient, the weight's (sparse)."""
        (sparse,) = grad_inputs
        head_grad, self.head_grad = self.head_grad, None  # no reference left: autograd may take it as .grad
        if sparse is None:
            return grad_inputs
        same_backward = self.task == _compat.require("current_graph_task_id")()
        if head_grad is None or not same_backward or head_grad.shape != sparse.shape:
            self.densify_after_accumulation()
            return grad_inputs  # autograd adds it to the weight's other gradients, if any
        head_grad.add_(sparse.to(head_grad.dtype))
        return (None,)

    def densify_after_accumulation(self) -> None:
        """Without the head's gradient the weight's could end sparse: made dense once accumulated (a hook may not
        change a gradient's layout)."""

        def densify(weight: torch.Tensor) -> None:
            handle.remove()
            if weight.grad is not None and weight.grad.is_sparse:
                weight.grad = weight.grad.to_dense()

        handle = self.embedding.weight.register_post_accumulate_grad_hook(densify)
