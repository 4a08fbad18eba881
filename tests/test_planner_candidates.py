"""The planner's candidate grammar (fastckpt.planner.candidates): strings parsed once into Candidates."""

import pytest
import torch

import fastckpt
from fastckpt import Policy, hybrid, tiling
from fastckpt.planner import DEFAULT_CANDIDATES, NONE, Candidate, extended_candidates, parse_candidate
from tests.helpers import needs_sac_hooks, output_and_grads, rel_l2
from tests.models import AttentionHalf

aten = torch.ops.aten


@needs_sac_hooks  # selective:<codec> candidates
def test_parse_candidate():
    assert str(parse_candidate("selective:int4")) == "selective:int4"
    attention = parse_candidate("selective-attention:int8")
    assert str(attention) == "selective-attention:int8"
    assert attention.selective.ops == (*hybrid.attention_ops(), aten.bernoulli_)  # hybrid.keep_attention
    assert attention.selective.within == {torch.nn.functional.scaled_dot_product_attention, torch.nn.functional.dropout}
    assert repr(attention.selective).endswith("store='int8', within=['dropout', 'scaled_dot_product_attention'])")
    assert str(attention.policy) == "recompute+int8" and str(attention.selective.store) == "int8"
    assert str(parse_candidate(" selective-attention: recompute+int8 ")) == "selective-attention:int8"
    compressed = parse_candidate("selective-attention:recompute:int8+int8")
    assert str(compressed) == "selective-attention:recompute:int8+int8"
    assert str(compressed.policy) == "recompute:int8+int8" and str(compressed.selective.store) == "int8"
    assert str(parse_candidate("selective:save").policy) == "recompute"  # torch's SAC, inputs plain
    with pytest.raises(ValueError, match="needs a codec for the kept outputs"):
        parse_candidate("selective:recompute")
    assert parse_candidate("recompute+int8").selective is None
    with pytest.raises(ValueError, match="name a storage policy"):
        parse_candidate("selective:")


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("batch2:recompute+int8", "batch2:recompute+int8"),
        (" batch4 : recompute ", "batch4:recompute"),
        ("batch2:recompute:int8+int8", "batch2:recompute:int8+int8"),
        ("batch2:selective-attention:int8", "batch2:selective-attention:int8"),
        ("batch2:int8", "batch2:int8"),
        ("recompute:int8", None),
        ("int8", None),
        pytest.param("selective:int8", None, marks=needs_sac_hooks),
    ],
)
def test_batch_candidates_parse(name, expected):
    parsed = parse_candidate(name)
    assert (None if parsed.batch_slices == 1 else str(parsed)) == expected


@pytest.mark.parametrize(
    ("name", "named"),
    [("batch1:recompute", "number of batch slices"), ("batchx:recompute", "number of batch slices"),
     ("batch2:int5", "int5"), ("batch2:selective:recompute", "needs a codec")],
)  # fmt: skip
def test_bad_batch_candidates_are_named(name, named):
    with pytest.raises(ValueError, match=named):
        parse_candidate(name)


def test_batch_slices_with_a_selective_candidate():
    candidate = parse_candidate("batch2:selective-attention:int8")
    assert str(candidate.policy) == "recompute+int8"
    assert str(candidate.selective) == "selective-attention:int8"
    module = candidate.wrap(AttentionHalf())
    assert isinstance(module, tiling.TiledWrapper) and (module.chunks, module.dim) == (2, 0)
    x = torch.randn(4, 40, 32)
    _, plain = output_and_grads(AttentionHalf(), x)
    with fastckpt.track() as report:
        _, got = output_and_grads(module, x)
    assert 0 < rel_l2(got, plain) <= 1e-2
    assert [s.policy for s in report.segments] == ["recompute+int8", "selective-attention:int8"] * 2  # per slice


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
    [("int8", fastckpt.CheckpointWrapper),
     pytest.param("selective:int8", hybrid.SelectiveWrapper, marks=needs_sac_hooks),
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
