"""Policy strings, Policy objects and the default-policy context."""

import pytest

import fastckpt
from fastckpt.policy import CODECS, Policy, current_policy


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
