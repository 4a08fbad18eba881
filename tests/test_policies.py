"""Policy strings, Policy objects and the default-policy context."""

import pytest
import torch

import fastckpt
from fastckpt.policies import CODECS, Policy, current_policy


@pytest.mark.parametrize(
    "spec, recompute, codec, offload",
    [
        ("recompute", True, None, False),
        ("save", False, None, False),
        ("int4", False, "int4", False),
        ("int2", False, "int2", False),
        ("fp8", False, "fp8", False),
        ("offload", False, None, True),
        ("int4+offload", False, "int4", True),
        ("recompute+offload", True, None, True),
        ("recompute+int8", True, "int8", False),
        ("offload+int8+recompute", True, "int8", True),
    ],
)
def test_parse(spec, recompute, codec, offload):
    policy = Policy.parse(spec)
    assert (policy.recompute, policy.codec, policy.offload) == (recompute, codec, offload)
    assert Policy.parse(str(policy)) == policy


@pytest.mark.parametrize(
    "spec, message",
    [
        ("int3", "unknown token 'int3'.*valid tokens are"),
        ("recompute+zip", "unknown token 'zip'"),
        ("", "unknown token ''"),
        ("int4+int8", "at most one codec"),
        ("int4+int4", "repeated"),
        ("save+offload", "'save'.*cannot be combined"),
    ],
)
def test_bad_strings_name_the_token(spec, message):
    with pytest.raises(ValueError, match=message):
        Policy.parse(spec)


def test_bad_types_and_fields():
    with pytest.raises(TypeError, match="policy must be a string"):
        Policy.parse(4)
    with pytest.raises(ValueError, match="group_size"):
        Policy(group_size=0)
    with pytest.raises(ValueError, match="stochastic_rounding applies to the int8/int4/int2 codecs"):
        Policy(recompute=False, codec="fp8", stochastic_rounding=True)
    with pytest.raises(ValueError, match="codec='int5'"):
        Policy(codec="int5")
    assert set(CODECS) == {"int8", "fp8", "int4", "int2"}


def test_default_policy_context_nests_and_restores():
    assert current_policy() == Policy.parse("recompute")
    with fastckpt.policy("save") as outer:
        assert current_policy() is outer and not outer.recompute
        with fastckpt.policy(Policy(recompute=True, group_size=128)):
            assert current_policy().group_size == 128
        assert current_policy() == outer
    assert current_policy() == Policy.parse("recompute")


@pytest.mark.parametrize(
    "fields, error, message",
    [
        ({"group_size": 1.5}, ValueError, r"group_size must be an integer from 1 to \d+.*got 1.5"),
        ({"group_size": "64"}, ValueError, r"group_size must be an integer.*got '64'"),
        ({"group_size": True}, ValueError, "group_size must be an integer"),
        ({"group_size": 2**40}, ValueError, "group_size must be an integer from 1 to"),
        ({"min_tensor_bytes": 1.0}, ValueError, "min_tensor_bytes must be an integer >= 0"),
        ({"recompute_min_tensor_bytes": -1}, ValueError, "recompute_min_tensor_bytes must be an integer >= 0"),
        ({"recompute": "yes"}, TypeError, "recompute must be True or False"),
        ({"offload": 1}, TypeError, "offload must be True or False"),
        ({"rule": "int8"}, TypeError, "rule must be a callable"),
    ],
)
def test_fields_are_checked_at_the_call(fields, error, message):
    with pytest.raises(error, match=message):
        Policy(**fields)


def test_rule_may_return_a_policy_a_string_or_none():
    big = torch.zeros(4096)
    keeps = Policy(rule=lambda t: None)
    assert keeps.for_tensor(big) is keeps
    assert Policy(rule=lambda t: "int4").for_tensor(big) == Policy.parse("int4")
    assert Policy(rule=lambda t: Policy.parse("int8")).for_tensor(big).codec == "int8"
    with pytest.raises(TypeError, match="rule returned int 8; it must return a fastckpt.Policy, a policy string"):
        Policy(rule=lambda t: 8).for_tensor(big)
    with pytest.raises(ValueError, match="unknown token 'int3'"):
        Policy(rule=lambda t: "int3").for_tensor(big)


def test_rule_returning_a_string_stores_through_that_codec():
    x = torch.randn(64, 256, requires_grad=True)
    exact = Policy(recompute=False, rule=lambda t: "int8" if t.dim() == 2 else None)
    with fastckpt.track() as report:
        fastckpt.checkpoint(lambda t: t.tanh().exp(), x, policy=exact).sum().backward()
    assert report.segments[0].codecs == {"int8"}


def test_policy_module_is_not_shadowed_by_the_context_manager():
    import fastckpt.policies

    assert fastckpt.policies.Policy is fastckpt.Policy
    assert callable(fastckpt.policy) and fastckpt.policy is fastckpt.policies.policy
