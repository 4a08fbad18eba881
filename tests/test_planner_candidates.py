"""The planner's candidate grammar (fastckpt.planner.candidates): strings parsed once into Candidates."""

import pytest
import torch

import fastckpt
from fastckpt import hybrid, tiling
from fastckpt.planner import DEFAULT_CANDIDATES, NONE, Candidate, extended_candidates, parse_candidate
from fastckpt.policies import Policy
from tests.test_tiling import AttentionHalf


def test_candidates_are_immutable_and_equal_by_name():
    a, b = parse_candidate(" recompute + int8 "), parse_candidate("recompute+int8")
    assert a == b and hash(a) == hash(b) and a.name == "recompute+int8" and a is not b
    assert parse_candidate(a) is a  # a Candidate passes through
    with pytest.raises(AttributeError):
        a.name = "int8"
    assert parse_candidate(None) == parse_candidate(NONE) == Candidate(NONE)
    assert parse_candidate(NONE).policy is None
    module = torch.nn.Linear(2, 2)
    assert parse_candidate(NONE).wrap(module) is module
    # A Policy object is planned by its name, as a string would be (tuning its string does not carry is dropped).
    tuned = parse_candidate(Policy(recompute=False, codec="int8", group_size=32))
    assert tuned.name == "int8" and tuned.policy == Policy.parse("int8")
    assert [parse_candidate(n).name for n in DEFAULT_CANDIDATES] == list(DEFAULT_CANDIDATES)


@pytest.mark.parametrize(
    ("name", "kind"),
    [("int8", fastckpt.CheckpointWrapper), ("selective:int8", hybrid.SelectiveWrapper),
     ("batch2:recompute", tiling.TiledWrapper)],
)  # fmt: skip
def test_a_candidate_wraps_a_module_as_its_grammar_says(name, kind):
    module = parse_candidate(name).wrap(AttentionHalf())
    assert type(module) is kind and str(module.policy) == str(parse_candidate(name).policy)


def test_extended_candidates_parse_to_their_own_names():
    names = extended_candidates(batch_slices=[2])
    parsed = [parse_candidate(n) for n in names]
    assert [c.name for c in parsed] == names and len(set(parsed)) == len(names)
    assert {c.batch_slices for c in parsed} == {1, 2}
