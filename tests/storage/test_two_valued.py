"""Float tensors of at most two values (additive attention masks, constants) are stored exactly at 1 bit each."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import fastckpt
from fastckpt import Policy
from fastckpt.storage import codecs
from fastckpt.storage.packer import SegmentStorage
from tests.helpers import every_size

# Every kind of policy with a codec: stored, offloaded, the inputs of a recompute policy, the recomputed tensors.
CODEC_POLICIES = ["int8", "fp8", "int4", "int2", "int4+offload", "recompute+int8", "recompute:int2"]
FLOATS = [torch.float32, torch.float16, torch.bfloat16]
SAME_WIDTH_INT = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
NAN_BITS = {torch.float32: (0x7FC00001, -0x003FFFFF), torch.float16: (0x7E01, -0x01FF), torch.bfloat16: (0x7FC1, -0x3F)}


def from_bits(bits: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(bits, dtype=SAME_WIDTH_INT[dtype]).view(dtype)


def value_pair(kind: str, dtype: torch.dtype) -> torch.Tensor:
    if kind == "zero/-inf":
        return torch.tensor([0.0, -math.inf], dtype=dtype)
    if kind == "zero/finfo.min":
        return torch.tensor([0.0, torch.finfo(dtype).min], dtype=dtype)
    if kind == "-0.0/0.0":  # equal as floats, different bits
        return torch.tensor([-0.0, 0.0], dtype=dtype)
    if kind == "nan payloads":  # two NaNs that differ only in sign and payload
        return from_bits(NAN_BITS[dtype], dtype)
    if kind == "random":
        return torch.randn(2).to(dtype)
    assert kind == "constant"
    return torch.tensor([1.5, 1.5], dtype=dtype)


def two_valued_tensor(values: torch.Tensor, shape=(64, 96), p=0.3) -> torch.Tensor:
    return torch.where(torch.rand(shape) < p, values[1], values[0])


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(SAME_WIDTH_INT[a.dtype]), b.view(SAME_WIDTH_INT[b.dtype]))


def store(t: torch.Tensor, policy: str) -> tuple[torch.Tensor, SegmentStorage]:
    """`t` packed and unpacked through the segment storage `policy` keeps it in (for 'recompute:<codec>', that
    of the recomputed tensors), as autograd would hand it back."""
    parsed = every_size(policy)
    storage = SegmentStorage(parsed.recomputed_storage() or parsed if parsed.codec is None else parsed)
    return storage.unpack(storage.pack(t)), storage


def two_valued_bytes(t: torch.Tensor) -> int:
    return (t.numel() + 7) // 8 + 2 * t.element_size()


@pytest.mark.parametrize("kind", ["zero/-inf", "zero/finfo.min", "-0.0/0.0", "nan payloads", "random", "constant"])
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("policy", CODEC_POLICIES)
def test_round_trip_is_bit_exact_at_one_bit_per_element(kind, dtype, policy):
    torch.manual_seed(0)
    t = two_valued_tensor(value_pair(kind, dtype))
    back, storage = store(t, policy)
    assert_bitwise_equal(back, t)
    if kind not in ("-0.0/0.0", "nan payloads"):
        assert torch.equal(back, t)
    record = storage.record
    assert record.codecs == {"two-valued"}
    assert record.stored_bytes == two_valued_bytes(t)
    assert record.bits_per_element == 8 * two_valued_bytes(t) / t.numel()  # ~1 bit, plus the two values


@pytest.mark.parametrize(
    "make",
    [
        lambda m: m.t(),  # a permuted dense tensor: encoded in memory order
        lambda m: m[:1].expand(64, 96),  # a broadcast mask (stride 0)
        lambda m: m[:, :48],  # not dense
    ],
    ids=["transposed", "expanded", "sliced"],
)
@pytest.mark.parametrize("policy", ["int8", "fp8", "recompute+int4"])
def test_non_contiguous_tensor_comes_back_with_the_layout_the_codecs_give(make, policy):
    torch.manual_seed(0)
    t = make(two_valued_tensor(value_pair("zero/-inf", torch.float32)))
    back, storage = store(t, policy)
    assert storage.record.codecs == {"two-valued"}
    assert_bitwise_equal(back, t)
    ordinary, _ = store(make(torch.randn(64, 96)), policy)  # the policy's codec on a tensor of the same layout
    assert back.stride() == ordinary.stride()


def test_two_values_the_sample_does_not_see_are_still_found():
    t = torch.zeros(64, 1024)
    outside = sorted(set(range(t.numel())) - set(codecs.sample_index(t.numel(), t.device).tolist()))
    t.view(-1)[outside[::1000]] = -math.inf  # a few masked positions, all between the sampled ones
    back, storage = store(t, "int8")
    assert storage.record.codecs == {"two-valued"}
    assert torch.equal(back, t)


@pytest.mark.parametrize("where", ["outside the sample", "in the sample"])
def test_a_third_value_takes_the_policy_codec(where):
    t = two_valued_tensor(value_pair("zero/finfo.min", torch.float32), shape=(64, 1024))
    sampled = codecs.sample_index(t.numel(), t.device)
    if where == "outside the sample":
        position = next(i for i in range(t.numel()) if i not in set(sampled.tolist()))
        assert len(set(t.view(-1)[sampled].tolist())) == 2  # the sample alone would say two-valued
    else:
        position = sampled[len(sampled) // 2].item()
    t.view(-1)[position] = 1.0
    _, storage = store(t, "int8")
    assert storage.record.codecs == {"int8"}


@pytest.mark.parametrize(
    "tensor, policy, reason",
    [
        (torch.nn.Parameter(torch.zeros(64, 64)), "int8", "parameter"),
        (torch.zeros(16), "int8", "small"),
        (torch.zeros(64, 64, dtype=torch.float64), "int8", "float64"),
    ],
)
def test_tensors_kept_plain_stay_plain(tensor, policy, reason):
    back, storage = store(tensor, policy)
    assert storage.record.kept_plain == {reason: 1} and not storage.record.codecs
    assert back is not tensor and back.data_ptr() == tensor.data_ptr()


@pytest.mark.parametrize("policy", ["save", "offload", "recompute+offload"])
def test_policies_without_a_codec_store_plainly(policy):
    t = torch.zeros(64, 64)
    back, storage = store(t, policy)
    assert not storage.record.codecs and back.data_ptr() == t.data_ptr()


B, H, T, D = 2, 2, 64, 16
LENGTHS = (64, 40)  # the second sequence is padded: its keys from 40 on are masked, no query row is fully masked
# Relative L2 gradient error of the whole attention step; its other saved tensors still go through the codec.
GRAD_TOLERANCE = {"int8": 0.03, "fp8": 0.1, "int4": 0.4, "int2": 1.5}


def padding_mask(fill: float, dtype: torch.dtype) -> torch.Tensor:
    """An additive mask as Hugging Face models hand to sdpa for a padded batch: (batch, 1, query, key)."""
    mask = torch.zeros(B, 1, T, T, dtype=dtype)
    for b, length in enumerate(LENGTHS):
        mask[b, ..., length:] = fill
    return mask


def attention_step(policy: str | None, mask: torch.Tensor, dtype: torch.dtype):
    """Gradients of a one-layer attention with `mask`, checkpointed under `policy` (None: plain autograd)."""
    torch.manual_seed(0)
    x = torch.randn(B, T, H * D, dtype=dtype, requires_grad=True)
    w = (torch.randn(H * D, 3 * H * D) / (H * D) ** 0.5).to(dtype).requires_grad_(True)

    def fn(x, mask):
        q, k, v = (x @ w).view(B, T, 3, H, D).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # saves the mask (CPU, no dropout)
        return out.transpose(1, 2).reshape(B, T, H * D)

    with fastckpt.track() as report:
        out = fastckpt.checkpoint(fn, x, mask, policy=every_size(policy)) if policy else fn(x, mask)
        out.float().pow(2).sum().backward()
    return torch.cat([x.grad.flatten(), w.grad.flatten()]).float(), report


@pytest.mark.parametrize("fill", [-math.inf, "finfo.min"])
@pytest.mark.parametrize("policy", CODEC_POLICIES)
def test_sdpa_padding_mask_is_stored_two_valued(policy, fill, monkeypatch):
    dtype = torch.float32
    mask = padding_mask(torch.finfo(dtype).min if fill == "finfo.min" else fill, dtype)
    plain, _ = attention_step(None, mask, dtype)
    ours, report = attention_step(policy, mask, dtype)
    assert all("two-valued" in s.codecs for s in report.segments if s.codecs)
    assert any(s.codecs for s in report.segments)
    # Without the two-valued path the mask goes through the codec: it accounts for the whole difference.
    monkeypatch.setattr(codecs, "two_valued", lambda t: None)
    _, lossy = attention_step(policy, mask, dtype)
    codec = Policy.parse(policy).codec or Policy.parse(policy).recompute_codec
    mask_bytes = sum(x.numel() * x.element_size() for x in codecs.encode(mask, codec, None, False).payload)
    assert lossy.raw_bytes == report.raw_bytes
    assert lossy.device_bytes - report.device_bytes == mask_bytes - two_valued_bytes(mask)
    assert ours.isfinite().all()
    error = ((ours - plain).norm() / plain.norm()).item()
    assert error <= GRAD_TOLERANCE[codec], error
    if policy == "recompute+int8":  # the mask is the only stored input: the recomputation is exact
        assert torch.equal(ours, plain)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sdpa_padding_mask_in_half_precision(dtype):
    mask = padding_mask(torch.finfo(dtype).min, dtype)
    plain, _ = attention_step(None, mask, dtype)
    ours, report = attention_step("int8", mask, dtype)
    (segment,) = report.segments
    assert segment.codecs == {"int8", "two-valued"}
    assert ours.isfinite().all() and ((ours - plain).norm() / plain.norm()).item() <= 0.05


@pytest.mark.cuda
def test_cuda_offloaded_mask_is_exact_and_on_host():
    t = padding_mask(-math.inf, torch.bfloat16).cuda()
    back, storage = store(t, "int4+offload")
    assert storage.record.codecs == {"two-valued"} and storage.record.host_bytes == two_valued_bytes(t)
    assert back.is_cuda and torch.equal(back, t)


def test_a_broadcast_tensor_is_kept_as_its_small_storage():
    # [B, 1, T, T] expanded over heads (as an attention mask is): its memory is far below one bit per element
    # of the view, so keeping it plain beats any codec; mul saves it for x's gradient
    weight = torch.randn(2, 1, 64, 64)
    x = torch.randn(2, 8, 64, 64, requires_grad=True)
    with fastckpt.track() as report:
        y = fastckpt.checkpoint(lambda a, w: a * w, x, weight.expand(2, 8, 64, 64), policy="int8")
        y.sum().backward()
    assert report.segments[0].kept_plain == {"expanded": 1}
    assert torch.equal(x.grad, weight.expand(2, 8, 64, 64))
