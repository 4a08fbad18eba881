"""Pure-PyTorch references for every fastckpt op: the test oracle, and runnable on any device."""

from __future__ import annotations

import torch


def pack_bits_ref(mask: torch.Tensor) -> torch.Tensor:
    """Reference of fastckpt::pack_bits: little-endian bits of the nonzero pattern, uint8."""
    bits = (mask.reshape(-1) != 0).to(torch.uint8)
    pad = (-bits.numel()) % 8
    bits = torch.nn.functional.pad(bits, (0, pad)).view(-1, 8)
    weights = (2 ** torch.arange(8, device=mask.device, dtype=torch.int32)).to(torch.uint8)
    return (bits * weights).sum(dim=1, dtype=torch.int32).to(torch.uint8)


def unpack_bits_ref(packed: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """Reference of fastckpt::unpack_bits."""
    numel = 1
    for s in shape:
        numel *= s
    shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
    bits = (packed.view(-1, 1) >> shifts) & 1
    return bits.reshape(-1)[:numel].to(torch.bool).view(shape)


# ---- quantize family: the arithmetic of csrc/quantize/quantize.h, op by op in float32 ----

_KEY_POS_INF = 0x7F800000  # order key of +Inf; keys above it are NaN
_KEY_NEG_INF = -0x7F800001  # order key of -Inf; keys below it are NaN
_MIN_NORMAL = 2.0**-126
# The canonical quiet NaN of each output dtype, as bits (torch's own conversions vary: bf16 gives 0xFFFF).
_QUIET_NAN = {torch.float32: 0x7FC00000, torch.float16: 0x7E00, torch.bfloat16: 0x7FC0}


def _order_keys(x: torch.Tensor) -> torch.Tensor:
    """int32 keys ordered like the float32 values of x (NaNs beyond +-Inf)."""
    bits = x.float().contiguous().view(torch.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _from_order_keys(keys: torch.Tensor) -> torch.Tensor:
    return (keys ^ ((keys >> 31) & 0x7FFFFFFF)).view(torch.float32)


def _grouped(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x flattened as float32 [groups, group_size] (zero padded), the min and max of each group's finite
    elements (0 where it has none), and which groups are special (hold NaN or +-Inf)."""
    flat = x.reshape(-1).float()
    groups = (flat.numel() + group_size - 1) // group_size
    pad = groups * group_size - flat.numel()
    values = torch.nn.functional.pad(flat, (0, pad)).view(groups, group_size)
    valid = torch.nn.functional.pad(torch.ones_like(flat, dtype=torch.bool), (0, pad)).view(groups, group_size)
    keys = _order_keys(values)
    finite = (keys > _KEY_NEG_INF) & (keys < _KEY_POS_INF)
    special = (valid & ~finite).any(dim=1)
    valid = valid & finite
    lo = torch.where(valid, keys, torch.iinfo(torch.int32).max).amin(dim=1)
    hi = torch.where(valid, keys, torch.iinfo(torch.int32).min).amax(dim=1)
    none = lo > hi
    lo, hi = torch.where(none, 0, lo), torch.where(none, 0, hi)
    return values, _from_order_keys(lo), _from_order_keys(hi), special


def _special_codes(values: torch.Tensor, codes: torch.Tensor, nan: int, pos_inf: int, neg_inf: int) -> torch.Tensor:
    """codes with the reserved codes of NaN and +-Inf put in (only special groups hold such values)."""
    codes = torch.where(values == float("inf"), pos_inf, codes)
    codes = torch.where(values == float("-inf"), neg_inf, codes)
    return torch.where(torch.isnan(values), nan, codes)


_NO_ZERO_CODE = 0x100  # quantize.h's kNoZeroCode: no code of the group decodes to exactly 0


def _zero_codes(offset: torch.Tensor, scale: torch.Tensor, special: torch.Tensor, max_code: int) -> torch.Tensor:
    """Per group (float32 offset, positive float32 scale): the code that decodes to exactly 0, the one 0 rounds
    to (-offset * (1/scale) to nearest), where the grid reaches 0; _NO_ZERO_CODE elsewhere."""
    top = torch.where(special, max_code - 3, max_code)
    nearest = torch.clamp(torch.clamp(-offset * (1.0 / scale), min=0.0) + 0.5, max=float(max_code)).to(torch.int32)
    nearest = torch.minimum(nearest, top)
    product = top.float() * scale
    halves = (offset * 0.5 + top.float() * (scale * 0.5)) * 2.0
    top_value = torch.where(torch.isfinite(product), offset + product, halves)
    reaches = (offset <= 0) & (top_value >= 0) & torch.isfinite(offset) & torch.isfinite(scale)
    return torch.where(reaches, nearest, _NO_ZERO_CODE)


def _stochastic_near_zero(
    codes: torch.Tensor,
    t: torch.Tensor,
    u: torch.Tensor,
    offset: torch.Tensor,
    scale: torch.Tensor,
    inv_scale: torch.Tensor,
    special: torch.Tensor,
    max_code: int,
) -> torch.Tensor:
    """Stochastic codes corrected between the zero code's neighbours, where 0 sits at t0 = -offset / scale
    instead of at the zero code's index (quantize.h's encode_stochastic), so rounding stays unbiased."""
    zero = _zero_codes(offset, scale, special, max_code)
    k0, top = zero[:, None], torch.where(special, max_code - 3, max_code)[:, None]
    k = k0.float()
    t0 = (-offset * inv_scale)[:, None]
    below = t < t0
    a, b = torch.where(below, k - 1.0, t0), torch.where(below, t0, k + 1.0)
    up = (t - a) / (b - a) + u >= 1.0
    near = torch.where(below, torch.where(up, k0, k0 - 1), torch.where(up, k0 + 1, k0))
    near = torch.where((below & (k0 == 0)) | (~below & (k0 == top)), k0, near)
    inside = (t > k - 1.0) & (t < k + 1.0) & (k0 != _NO_ZERO_CODE)
    return torch.where(inside, near, codes)


def _flagged(scale: torch.Tensor, special: torch.Tensor) -> torch.Tensor:
    """16-bit scales with the sign bit set on special groups (quantize.h's kSpecialFlag)."""
    return torch.where(special, -scale, scale)


def _bits16_to(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int32 bit patterns in [0, 65536) as a float16/bfloat16 tensor."""
    return torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16).view(dtype)


def _round_to_param(v: torch.Tensor, dtype: torch.dtype, up: bool) -> torch.Tensor:
    """v (finite float32) rounded down (up=False) or up (up=True) to a value of dtype."""
    nearest = v.to(dtype)
    bits = nearest.view(torch.int16).to(torch.int32) & 0xFFFF
    negative = (bits & 0x8000) != 0
    if up:
        wrong = nearest.float() < v
        stepped = torch.where(bits == 0x8000, 1, torch.where(negative, bits - 1, bits + 1))
    else:
        wrong = nearest.float() > v
        stepped = torch.where(bits == 0, 0x8001, torch.where(negative, bits + 1, bits - 1))
    return _bits16_to(torch.where(wrong, stepped, bits), dtype)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32), without overflowing int64."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """The lowbias32 integer hash on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _uniform01(seed: int, groups: int, group_size: int, device: torch.device) -> torch.Tensor:
    """The counter-based uniforms u(seed, group, index) in [0, 1), shape [groups, group_size]."""
    s = seed & 0xFFFFFFFFFFFFFFFF

    def mix(v: int) -> int:
        return int(_mix32(torch.tensor([v], dtype=torch.int64))[0])

    seed_key = mix((s & 0xFFFFFFFF) ^ mix((s >> 32) ^ 0x9E3779B9))
    g = torch.arange(groups, device=device, dtype=torch.int64)
    group_key = _mix32((g & 0xFFFFFFFF) ^ _mix32((g >> 32) ^ seed_key))
    index = torch.arange(group_size, device=device, dtype=torch.int64)
    hashed = _mix32((group_key[:, None] + index[None, :]) & 0xFFFFFFFF)
    return (hashed >> 8).to(torch.float32) * 2.0**-24


def _pack_codes(codes: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    per_byte = 8 // bits
    flat = codes.reshape(-1)[:numel].to(torch.int32)
    flat = torch.nn.functional.pad(flat, (0, (-numel) % per_byte)).view(-1, per_byte)
    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32) * bits
    return (flat << shifts).sum(dim=1).to(torch.uint8)


def _unpack_codes(codes: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32) * bits
    return ((codes.to(torch.int32)[:, None] >> shifts) & ((1 << bits) - 1)).reshape(-1)[:numel]


def _per_element(params: torch.Tensor, group_size: int, numel: int) -> torch.Tensor:
    return params.float().repeat_interleave(group_size)[:numel]


def effective_group_size(numel: int, group_size: int) -> int:
    """group_size cut to numel rounded up to 16 (quantize.h's effective_group_size): the same layout."""
    whole = (numel + 15) // 16 * 16
    return whole if 0 < whole < group_size else group_size


def _saturated(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 values clamped to dtype's finite range (NaN stays NaN)."""
    limit = torch.finfo(dtype).max
    return torch.where(values > limit, limit, torch.where(values < -limit, -limit, values))


def _to_output(
    values: torch.Tensor,
    params_ok: torch.Tensor,
    dtype: torch.dtype,
    shape: list[int],
    specials: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Decoded float32 values rounded to dtype after the clamp to its finite range; elements whose group
    has non-finite parameters become dtype's canonical quiet NaN. `specials`: masks of the elements that
    decode to NaN, +Inf and -Inf (a special group's reserved codes)."""
    out = _saturated(values, dtype).to(dtype)
    nan_bits = torch.tensor(_QUIET_NAN[dtype], dtype=torch.int64)
    if dtype == torch.float32:
        nan = nan_bits.to(torch.int32).view(torch.float32)
    else:
        nan = _bits16_to(nan_bits, dtype)
    nan = nan.to(values.device)
    if specials is not None:
        is_nan, is_pos_inf, is_neg_inf = specials
        out = torch.where(is_pos_inf, float("inf"), torch.where(is_neg_inf, float("-inf"), out))
        params_ok = params_ok & ~is_nan
    return torch.where(params_ok, out, nan).view(shape)


def quantize_per_group_ref(
    x: torch.Tensor, bits: int, group_size: int, stochastic: bool = False, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference of fastckpt::quantize_per_group: (packed uint8 codes, scale, offset)."""
    max_code = (1 << bits) - 1
    param_dtype = torch.float16 if x.dtype == torch.float16 else torch.bfloat16
    group_size = effective_group_size(x.numel(), group_size)
    values, lo, hi, special = _grouped(x, group_size)
    # a special group's grid is three codes shorter (at least one step); the top three are reserved
    finite_max_code = max_code - 3
    steps = torch.where(special, float(max(finite_max_code, 1)), float(max_code))
    # the offset saturates at the format's lowest (fp32 below bf16's lowest -3.3895e38)
    offset = _round_to_param(torch.clamp(lo, min=torch.finfo(param_dtype).min), param_dtype, up=False)
    o = offset.float()
    # a group spanning more than float32's range ("wide") takes its step, and its codes, from halves
    wide = ~torch.isfinite(hi - o)
    step = torch.where(wide, (hi * 0.5 - o * 0.5) / steps * 2.0, (hi - o) / steps)
    scale = _round_to_param(torch.clamp(step, min=_MIN_NORMAL), param_dtype, up=True)  # finite: step <= 2.26e38
    inv_scale = 1.0 / scale.float()
    pre = torch.where(wide, 0.5, 1.0)[:, None]
    enc_offset = torch.where(wide, o * 0.5, o)[:, None]
    enc_inv_scale = torch.where(wide, inv_scale * 2.0, inv_scale)[:, None]
    t = (values * pre - enc_offset) * enc_inv_scale
    t_raw = t
    t = torch.where(t < 0, 0.0, t)
    t = torch.where(t < max_code, t, float(max_code))
    u = _uniform01(seed, values.shape[0], group_size, x.device) if stochastic else 0.5
    codes = torch.clamp((t + u).to(torch.int32), max=max_code)
    if not stochastic:  # a zero code at an end of the grid holds exact zeros only (quantize.h's keep_sign)
        zero = _zero_codes(o, scale.float(), special, max_code)[:, None]
        top = torch.where(special, finite_max_code, max_code)[:, None]
        positive_end = (zero == 0) & (values > 0) & (top > 0)
        negative_end = (zero == top) & (values < 0) & (top > 0)
        moved = (codes == zero) & (positive_end | negative_end)
        codes = torch.where(moved, torch.where(positive_end, 1, top - 1), codes)
    codes = torch.where(special[:, None], torch.clamp(codes, max=finite_max_code), codes)
    if stochastic:
        codes = _stochastic_near_zero(codes, t_raw, u, o, scale.float(), inv_scale, special, max_code)
    codes = _special_codes(values, codes, max_code, max_code - 1, max_code - 2)
    return _pack_codes(codes, bits, x.numel()), _flagged(scale, special), offset


def dequantize_per_group_ref(
    codes: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    bits: int,
    group_size: int,
    dtype: torch.dtype,
    shape: list[int],
) -> torch.Tensor:
    """Reference of fastckpt::dequantize_per_group: offset + code * scale rounded once to float32 (the
    product is exact; taken on halves where it overflows), clamped to dtype's finite range, rounded to
    dtype; all-NaN where the group's parameters are not finite."""
    numel = 1
    for s in shape:
        numel *= s
    group_size = effective_group_size(numel, group_size)
    max_code = (1 << bits) - 1
    q = _unpack_codes(codes, bits, numel)
    o, s = _per_element(offset, group_size, numel), _per_element(scale, group_size, numel)
    special = s < 0
    s = torch.where(special, -s, s)
    product = q.float() * s
    values = torch.where(torch.isfinite(product), o + product, (o * 0.5 + q.float() * (s * 0.5)) * 2.0)
    magnitude = scale.float().abs()
    zero = _zero_codes(offset.float(), magnitude, scale.float() < 0, max_code)
    values = torch.where(q == _per_element(zero, group_size, numel).to(torch.int32), 0.0, values)
    specials = (special & (q == max_code), special & (q == max_code - 1), special & (q == max_code - 2))
    return _to_output(values, torch.isfinite(o) & torch.isfinite(s), dtype, shape, specials)


def quantize_fp8_per_group_ref(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of fastckpt::quantize_fp8_per_group: (e4m3 codes as uint8, power-of-two bf16 scale)."""
    values, lo, hi, special = _grouped(x, effective_group_size(x.numel(), group_size))
    amax = torch.maximum(lo.view(torch.int32) & 0x7FFFFFFF, hi.view(torch.int32) & 0x7FFFFFFF)
    # the smallest e with amax / 2^e <= 448 = 1.75 * 2^8 (special groups: 416 = 1.625 * 2^8, below the
    # reserved codes), read off amax's exponent and mantissa bits
    e = (amax >> 23) - torch.where((amax & 0x7FFFFF) <= torch.where(special, 0x500000, 0x600000), 135, 134)
    e = torch.clamp(e, min=-126).to(torch.int32)
    inv_scale = ((127 - e) << 23).view(torch.float32)
    scale = ((127 + e) << 23).view(torch.float32).to(torch.bfloat16)
    finite_values = torch.where(torch.isfinite(values), values, 0.0)
    codes = (finite_values * inv_scale[:, None]).to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int32)
    codes = _special_codes(values, codes, 0x7F, 0x7E, 0xFE).to(torch.uint8)
    return codes.reshape(-1)[: x.numel()], _flagged(scale, special)


def dequantize_fp8_per_group_ref(
    codes: torch.Tensor, scale: torch.Tensor, group_size: int, dtype: torch.dtype, shape: list[int]
) -> torch.Tensor:
    """Reference of fastckpt::dequantize_fp8_per_group: code * scale in float32 (exact, or Inf), clamped
    to dtype's finite range, rounded to dtype; all-NaN where the group's scale is not finite."""
    s = _per_element(scale, effective_group_size(codes.numel(), group_size), codes.numel())
    special = s < 0
    values = codes.view(torch.float8_e4m3fn).float() * torch.where(special, -s, s)
    q = codes.to(torch.int32)
    specials = (special & ((q & 0x7F) == 0x7F), special & (q == 0x7E), special & (q == 0xFE))
    return _to_output(values, torch.isfinite(s), dtype, shape, specials)
