"""Argument errors of the public API, and the default policy reaching checkpoint calls."""

import pytest
import torch

import fastckpt


def test_non_callable_function():
    with pytest.raises(TypeError, match="`function` must be callable"):
        fastckpt.checkpoint(torch.randn(2), torch.randn(2))


@pytest.mark.parametrize("segments", [0, -1, 4])
def test_segments_out_of_range(segments):
    seq = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"`segments` must be between 1 and the number of modules \(3\)"):
        fastckpt.checkpoint_sequential(seq, segments, torch.randn(1, 2))


def test_segments_wrong_type_and_unexpected_kwargs():
    seq = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="`segments` must be an int"):
        fastckpt.checkpoint_sequential(seq, 1.0, torch.randn(1, 2))
    with pytest.raises(ValueError, match="Unexpected keyword arguments: bogus"):
        fastckpt.checkpoint_sequential(seq, 1, torch.randn(1, 2), bogus=1)


def test_unknown_policy_token():
    with pytest.raises(ValueError, match="unknown token 'int3'"):
        fastckpt.checkpoint(torch.sin, torch.randn(2, requires_grad=True), policy="int3")


def test_determinism_check_values():
    x = torch.randn(2, requires_grad=True)
    with pytest.raises(ValueError, match=r"determinism_check should be one of \['default', 'none'\]"):
        fastckpt.checkpoint(torch.sin, x, determinism_check="strict")
    fastckpt.checkpoint(torch.sin, x, determinism_check="none").sum().backward()


def test_curried_form_rejects_stray_kwargs():
    with pytest.raises(ValueError, match="Unexpected keyword arguments: foo"):
        fastckpt.checkpoint(foo=1)


def test_default_policy_reaches_calls():
    calls = []

    def fn(x):
        calls.append(1)
        return x.sin().exp()

    x = torch.randn(3, requires_grad=True)
    with fastckpt.policy("save"):
        fastckpt.checkpoint(fn, x).sum().backward()
    assert len(calls) == 1  # stored, not recomputed
    fastckpt.checkpoint(fn, x).sum().backward()
    assert len(calls) == 3  # default recompute again outside the block


@pytest.mark.parametrize("policy, stored_segments", [("recompute+int8", 2), ("int8", 3)])
def test_checkpoint_sequential_applies_storage_policies_to_every_segment(policy, stored_segments):
    seq = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(6)])
    x = torch.randn(32, 64, requires_grad=True) * 1
    with fastckpt.track() as report:
        fastckpt.checkpoint_sequential(seq, 3, x, policy=policy).sum().backward()
    assert len(report.segments) == stored_segments


def test_recompute_only_options_are_refused_for_storage_policies():
    x = torch.randn(3, requires_grad=True)
    refused = "`context_fn`, `debug` and `respect_saved_tensors_hooks`.*do not apply"
    with pytest.raises(ValueError, match=refused):
        fastckpt.checkpoint(torch.sin, x, policy="int8", debug=True)
    with pytest.raises(ValueError, match=refused):
        fastckpt.checkpoint(torch.sin, x, policy="save", context_fn=lambda: (None, None))
    with pytest.raises(ValueError, match=refused):
        fastckpt.checkpoint(torch.sin, x, policy="int4", respect_saved_tensors_hooks=True)
