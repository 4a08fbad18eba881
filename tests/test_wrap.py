"""fastckpt.wrap / fastckpt.apply: checkpointed modules that stay state-dict transparent."""

import pytest
import torch
from torch import nn

import fastckpt


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.2), nn.GELU()), nn.Linear(8, 2))


def grads(model, x):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    out = model(x)
    out.sum().backward()
    return [out.detach()] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_apply_wraps_matching_modules_and_keeps_results(use_reentrant):
    x = torch.randn(3, 4, requires_grad=True)
    plain = make_model()
    expected = grads(plain, x)
    model = fastckpt.apply(
        make_model(), check_fn=lambda m: isinstance(m, nn.Sequential) and len(m) == 3 and m is not None
    )
    assert isinstance(model, nn.Sequential)  # the root itself is never replaced
    wrapped = fastckpt.apply(make_model(), check_fn=lambda m: isinstance(m, nn.Linear), use_reentrant=use_reentrant)
    assert isinstance(wrapped, nn.Sequential)  # changed in place; the root itself is never replaced
    assert [type(m).__name__ for m in wrapped] == ["CheckpointWrapper", "Sequential", "CheckpointWrapper"]
    assert isinstance(wrapped[1][0], fastckpt.CheckpointWrapper)
    for got, want in zip(grads(wrapped, x), expected, strict=True):
        assert torch.equal(got, want)


def test_state_dict_is_transparent_both_ways():
    plain, wrapped = make_model(), fastckpt.apply(make_model(), check_fn=lambda m: isinstance(m, nn.Linear))
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(1)
    wrapped.load_state_dict(plain.state_dict())
    for key, value in plain.state_dict().items():
        assert torch.equal(wrapped.state_dict()[key], value)
    plain.load_state_dict(wrapped.state_dict())


def test_wrap_policy_and_attribute_passthrough():
    layer = nn.Linear(4, 4)
    calls = []
    layer.register_forward_pre_hook(lambda *_: calls.append(1))  # pre: early-stopped recompute still counts
    wrapped = fastckpt.wrap(layer, policy="save")
    assert wrapped.in_features == 4 and wrapped.policy == fastckpt.Policy.parse("save")
    x = torch.randn(2, 4, requires_grad=True)
    wrapped(x).sum().backward()
    assert len(calls) == 1  # stored, no recompute
    fastckpt.wrap(layer)(x).sum().backward()
    assert len(calls) == 3  # forward + recompute


def test_bad_arguments():
    with pytest.raises(TypeError, match="`module` must be a torch.nn.Module"):
        fastckpt.wrap(lambda x: x)
    with pytest.raises(ValueError, match="already wrapped"):
        fastckpt.wrap(fastckpt.wrap(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="unknown token 'int9'"):
        fastckpt.apply(make_model(), policy="int9")
    with pytest.raises(TypeError, match="`check_fn` must be callable"):
        fastckpt.apply(make_model(), check_fn=3)


class _HasCheckpointedChild(nn.Module):
    """A module whose own child is named like the wrapper's attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.checkpointed = nn.Linear(3, 3)
        self.other = nn.Linear(3, 3)

    def forward(self, x):
        return self.other(self.checkpointed(x))


@pytest.mark.parametrize("strict", [True, False])
def test_state_dict_keys_unambiguous_for_a_child_named_checkpointed(strict):
    torch.manual_seed(0)
    source = _HasCheckpointedChild()
    wrapped = fastckpt.wrap(_HasCheckpointedChild())
    assert wrapped.state_dict().keys() == source.state_dict().keys()
    result = wrapped.load_state_dict(source.state_dict(), strict=strict)
    assert not result.missing_keys and not result.unexpected_keys
    for key, value in source.state_dict().items():
        assert torch.equal(wrapped.state_dict()[key], value), key
    # And the round trip through the wrapper itself, nested inside another wrapped module.
    outer = fastckpt.wrap(nn.Sequential(fastckpt.wrap(_HasCheckpointedChild())))
    reference = nn.Sequential(_HasCheckpointedChild())
    assert outer.state_dict().keys() == reference.state_dict().keys()
    outer.load_state_dict(reference.state_dict(), strict=strict)
    assert all(torch.equal(outer.state_dict()[k], v) for k, v in reference.state_dict().items())


def test_apply_rejects_a_non_module():
    with pytest.raises(TypeError, match="apply: `model` must be a torch.nn.Module, got int"):
        fastckpt.apply(5)
