"""What checkpoint keeps alive after forward: only the segment inputs (counted through saved-tensor hooks)."""

import pytest
import torch

import fastckpt
from tests.models import TransformerBlock


def saved_bytes(forward, x, params):
    """Bytes of the distinct tensors handed to saved-tensor hooks during `forward(x)`, parameters excluded."""
    param_ptrs = {p.data_ptr() for p in params}
    seen = {}

    def pack(t):
        if t.data_ptr() not in param_ptrs:
            seen[t.data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward(x)
    return sum(seen.values()), out


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_only_segment_inputs_are_kept(use_reentrant):
    torch.manual_seed(0)
    block = TransformerBlock(dim=64)
    x = torch.randn(8, 32, 64, requires_grad=True)
    plain_bytes, _ = saved_bytes(block, x, block.parameters())
    ours, out = saved_bytes(lambda x: fastckpt.checkpoint(block, x, use_reentrant=use_reentrant), x, block.parameters())
    assert ours == x.numel() * x.element_size()
    assert plain_bytes > 10 * ours  # the block's own activations, which checkpoint avoids
    out.sum().backward()
