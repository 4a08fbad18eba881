// The quantize family's shared half: argument checks, storage layout, the counter-based RNG and
// the per-group codec math. CPU kernels, CUDA kernels and the pure-PyTorch reference
// (fastckpt/ops/reference.py) implement exactly this arithmetic, so all three give identical codes.
//
// Layout of a quantized tensor x with N elements and group size G (row-major flattened order):
//   groups      ceil(N / G); group g holds elements [g*G, min((g+1)*G, N)). A G of N or more means one
//               group; the kernels then work with G cut to N (rounded up to 16), which is the same
//               layout, so no buffer ever scales with a G beyond the tensor. G is at most 2^31 - 1.
//   codes       uint8, ceil(N * bits / 8) bytes; element i lives in byte i*bits/8 at bit offset
//               (i % (8/bits)) * bits (little-endian, as pack_bits). G is a multiple of 8/bits, so
//               every group starts on a byte boundary. fp8 codes are float8_e4m3fn bit patterns, one byte each.
//   scale/offset one 16-bit float per group (affine: fp16 for fp16 inputs, bf16 otherwise; fp8: a
//               power-of-two scale in bf16). x ~= offset + code * scale (affine), code * scale (fp8).
//   A "special" group, one holding NaN or +-Inf, takes its parameters from its finite elements only
//   and stores its scale negated (the sign bit flags it; every other scale is positive). Its
//   non-finite elements get reserved codes that decode to themselves: affine codes 2^bits - 1 = NaN,
//   2^bits - 2 = +Inf, 2^bits - 3 = -Inf, its finite elements the codes below on a grid three codes
//   shorter (int2 has one code left: its finite elements decode to their minimum rounded down);
//   fp8 codes 0x7F = NaN, 0x7E = +Inf, 0xFE = -Inf, its finite elements scaled to at most 416 (code
//   0x7D). NaN decodes to the output dtype's canonical quiet NaN (its payload and sign are not kept).
//   Found by the same min/max pass that sizes the group: no extra pass over finite data.
//
// Finite groups always get finite parameters, and decode to finite values (no overflow anywhere):
//   - the offset saturates at the 16-bit format's lowest value (only fp32 inputs below bf16's lowest,
//     -3.3895e38, reach it; they decode to that value, an error below 2^120, bf16's ulp there);
//   - max - offset is computed on halves when it overflows float32 ("wide" groups, spanning more than
//     FLT_MAX), and such groups also encode from halves (x/2 - offset/2) * (2/scale);
//   - decoding computes offset + code * scale exactly rounded to float32 (the product is exact; when
//     it overflows, the sum is taken on halves), then clamps to the output dtype's finite range before
//     rounding to it. The clamp only ever moves a value toward the original (which was in range), so
//     the error bound (scale/2 for round to nearest) holds; fp8 likewise (e4m3 rounding can carry a
//     value to the next power of two, past the dtype's maximum, whatever exponent the group has).
//   Decoding parameters that are not finite (only from foreign input) gives all-NaN groups, with the
//   canonical quiet NaN of the output dtype.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include <cstdint>
#include "quantize/float_conversions.h"  // FASTCKPT_HD, float bit casts, fp16/bf16 conversions

namespace fastckpt {
namespace quant {

// ---------------------------------------------------------------- arithmetic rounded op by op
// The reference rounds after every operation; an FMA would round once and change codes in rare
// ties. CUDA contracts a*b+c by default, so device code spells the rounding out (the CPU file is
// compiled with fp-contract off).
FASTCKPT_HD float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
FASTCKPT_HD float sub_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
FASTCKPT_HD float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
FASTCKPT_HD float div_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// ---------------------------------------------------------------- output dtypes: finite range and NaN
constexpr float kFloatMax = 3.40282347e38f;       // FLT_MAX
constexpr float kHalfMax = 65504.0f;              // fp16's largest finite value
constexpr float kBf16Max = 3.38953139e38f;        // bf16's largest finite value, 0x7F7F0000 as float32
constexpr uint32_t kFloatQuietNaN = 0x7FC00000u;  // the canonical quiet NaN; 0x7E00 in fp16, 0x7FC0 in bf16
template <typename T>
FASTCKPT_HD float finite_max();
template <>
FASTCKPT_HD float finite_max<float>() {
  return kFloatMax;
}
template <>
FASTCKPT_HD float finite_max<c10::Half>() {
  return kHalfMax;
}
template <>
FASTCKPT_HD float finite_max<c10::BFloat16>() {
  return kBf16Max;
}
// The canonical quiet NaN of T as bits (device conversions of a NaN may give other payloads).
template <typename T>
FASTCKPT_HD T quiet_nan();
template <>
FASTCKPT_HD float quiet_nan<float>() {
  return float_from_bits(kFloatQuietNaN);
}
template <>
FASTCKPT_HD c10::Half quiet_nan<c10::Half>() {
  return c10::Half(static_cast<uint16_t>(0x7E00u), c10::Half::from_bits());
}
template <>
FASTCKPT_HD c10::BFloat16 quiet_nan<c10::BFloat16>() {
  return c10::BFloat16(static_cast<uint16_t>(0x7FC0u), c10::BFloat16::from_bits());
}
// v clamped to [-limit, limit]; NaN stays NaN (selects on comparisons, which are false for NaN).
FASTCKPT_HD float saturate(float v, float limit) {
  v = v > limit ? limit : v;
  return v < -limit ? -limit : v;
}

// ---------------------------------------------------------------- fp8 e4m3 (finite, no Inf)
// For finite |y| <= 448, which the group scale guarantees (a special group's non-finite elements take
// their own codes): no saturation or NaN selects, they cost ~15% of the fp8 encode loop.
FASTCKPT_HD uint32_t float_to_e4m3_bits(float y) {
  const uint32_t u = float_bits(y);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7FFFFFFFu;
  // Normal: keep 3 mantissa bits (round to nearest even), rebias 127 -> 7 (subtract 120 << 3).
  const uint32_t normal = ((a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20) - (120u << 3);
  // Below 2^-6: adding 2^14 (ulp 2^-9, the e4m3 subnormal step) rounds |y| to that step.
  const uint32_t subnormal = float_bits(add_rn(float_from_bits(a), 16384.0f)) - 0x46800000u;
  return sign | (a < 0x3C800000u ? subnormal : normal);
}

FASTCKPT_HD float e4m3_bits_to_float(uint32_t b) {
  const uint32_t sign = (b & 0x80u) << 24;
  const uint32_t mag = b & 0x7Fu;
  const uint32_t normal = (mag << 20) + (120u << 23);
  const float subnormal = mul_rn(static_cast<float>(static_cast<int32_t>(mag)), 0.001953125f);  // mag * 2^-9
  uint32_t out = mag < 8u ? float_bits(subnormal) : normal;
  out = mag == 0x7Fu ? 0x7FC00000u : out;
  return float_from_bits(sign | out);
}

// ---------------------------------------------------------------- order keys for min/max
// Signed integers ordered like the floats they encode: -NaN < -Inf < ... < -0 < +0 < ... < +Inf < +NaN.
// Integer min/max reduce exactly (and vectorize without fast-math); NaN/Inf show up at the ends.
FASTCKPT_HD int32_t order_key(float v) {
  const int32_t b = static_cast<int32_t>(float_bits(v));
  return b ^ ((b >> 31) & 0x7FFFFFFF);
}
FASTCKPT_HD float from_order_key(int32_t k) {
  return float_from_bits(static_cast<uint32_t>(k ^ ((k >> 31) & 0x7FFFFFFF)));
}
constexpr int32_t kKeyPosInf = 0x7F800000;
constexpr int32_t kKeyNegInf = static_cast<int32_t>(0xFF800000u ^ 0x7FFFFFFFu);
FASTCKPT_HD bool key_finite(int32_t k) { return k > kKeyNegInf && k < kKeyPosInf; }

// ---------------------------------------------------------------- counter-based RNG
// u(seed, g, i) for element i of group g: a stateless hash, identical on every device and
// independent of how the work is split. mix32 is the "lowbias32" integer hash (C. Wellons).
FASTCKPT_HD uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}
inline uint32_t seed_key(int64_t seed) {
  const uint64_t s = static_cast<uint64_t>(seed);
  return mix32(static_cast<uint32_t>(s) ^ mix32(static_cast<uint32_t>(s >> 32) ^ 0x9E3779B9u));
}
FASTCKPT_HD uint32_t group_key(uint32_t seed_key, int64_t group) {
  const uint64_t g = static_cast<uint64_t>(group);
  return mix32(static_cast<uint32_t>(g) ^ mix32(static_cast<uint32_t>(g >> 32) ^ seed_key));
}
// Uniform in [0, 1) on a 2^-24 grid (exact in fp32).
FASTCKPT_HD float uniform01(uint32_t group_key, uint32_t index_in_group) {
  return static_cast<float>(static_cast<int32_t>(mix32(group_key + index_in_group) >> 8)) * 5.9604644775390625e-08f;
}

// ---------------------------------------------------------------- codecs
// Each codec turns a group's min/max into parameters (make), a float into a code (encode, with u
// the rounding offset: 0.5 for round-to-nearest, uniform [0,1) for stochastic rounding), and a
// code back into a float (decode). Both share one interface so that every kernel serves both.

// A group's parameters; encode reads only offset, inv_scale = 1 / scale and wide (fp8: offset 0,
// offset_bits unused, never wide). scale is positive; scale_bits, as stored, is negated for special groups.
// zero_code: the code that decodes to exactly 0 (kNoZeroCode when the grid does not reach 0).
struct GroupParams {
  float offset, scale, inv_scale;
  uint32_t offset_bits, scale_bits;  // as stored: 16-bit float patterns
  bool special, wide;
  uint32_t zero_code;
};

// No code decodes to exactly 0 specially (a code never reaches 256).
constexpr uint32_t kNoZeroCode = 0x100u;

// The sign bit of a stored 16-bit scale (bf16 and fp16 alike): set for special groups.
constexpr uint32_t kSpecialFlag = 0x8000u;

// Asymmetric per-group integer codes: x ~= offset + code * scale, code in [0, 2^bits - 1].
// Offset is rounded down and scale up to the stored 16-bit format, and codes are computed from the
// stored values, so the grid covers [min, max] and round-to-nearest errs by at most scale / 2.
// Zero is exact: where the grid reaches 0, the code nearest 0 (the one 0 encodes to) decodes to exactly
// 0 instead of its grid value, which is within scale / 2 of it, so that code errs by at most one scale.
// (An activation's exact zeros, e.g. a LayerNorm input's all-zero rows, where the norm's backward
// multiplies any error by its 1/std, stay zero.) A constant group is exact for 16-bit inputs (offset =
// the value, code 0); float32 inputs round it to the 16-bit offset's grid, as any value.
// Nothing overflows for finite data: the offset saturates at the format's lowest value (fp32 values
// below bf16's lowest then decode to it), and a group whose max - offset exceeds float32's range
// ("wide") computes its step, and its codes, from halves of the values (exact: such values are large).
// The scale then always fits its format (see make).
template <int kBitsArg>
struct AffineCodec {
  static constexpr int kBits = kBitsArg;
  static constexpr bool kHasOffset = true;
  static constexpr bool kCanBeWide = true;
  static constexpr int kMaxCode = (1 << kBits) - 1;
  using Params = GroupParams;

  // Reserved codes of a special group's non-finite elements; its finite ones use [0, kFiniteMaxCode].
  static constexpr uint32_t kNaNCode = kMaxCode, kPosInfCode = kMaxCode - 1, kNegInfCode = kMaxCode - 2;
  static constexpr int kFiniteMaxCode = kMaxCode - 3;

  // lo, hi: the min and max of the group's finite elements. Branch-free (selects only), so that groups
  // overlap in the CPU's pipeline.
  FASTCKPT_HD static Params make(float lo, float hi, bool special, bool bf16) {
    // The offset saturates at the format's lowest: min rounded down, from no lower than that value.
    const float lowest = param_to_float(param_lowest_bits(bf16), bf16);
    const uint32_t offset_bits = param_round_down(lo > lowest ? lo : lowest, bf16);
    const float offset = param_to_float(offset_bits, bf16);
    const float range = sub_rn(hi, offset);
    // Wide: max - offset overflows; halving is exact there (both are beyond 2^100 in magnitude).
    const bool wide = !is_finite_float(range);
    // A special group's grid is kFiniteMaxCode steps (at least one: int2 keeps a single finite code).
    const float steps = static_cast<float>(special ? (kFiniteMaxCode > 0 ? kFiniteMaxCode : 1) : kMaxCode);
    const float quotient = div_rn(wide ? sub_rn(mul_rn(hi, 0.5f), mul_rn(offset, 0.5f)) : range, steps);
    const float step = wide ? mul_rn(quotient, 2.0f) : quotient;
    // A floor of 2^-126 keeps 1/scale finite (constant groups decode exactly through code 0). No
    // saturation needed: the step is at most (FLT_MAX + 3.39e38) / 3 = 2.26e38 (bf16 params, whose
    // max is 3.39e38) or 131008 / 3 = 43669 (fp16 params, fp16 inputs only; max 65504), so rounding
    // it up stays finite.
    const uint32_t scale_bits = param_round_up(step > 1.17549435e-38f ? step : 1.17549435e-38f, bf16);
    const float scale = param_to_float(scale_bits, bf16);
    const float inv_scale = div_rn(1.0f, scale);
    return Params{offset,  scale, inv_scale, offset_bits, scale_bits | (special ? kSpecialFlag : 0u),
                  special, wide,  zero_code(offset, scale, inv_scale, special)};
  }

  // The code 0 encodes to when the grid [offset, offset + top code * scale] holds 0 (kNoZeroCode otherwise),
  // from the stored parameters alone, so that encoder and decoder agree: -offset * (1/scale) rounded to
  // nearest, as encode rounds 0 on either of its paths (halving both factors changes no rounding).
  FASTCKPT_HD static uint32_t zero_code(float offset, float scale, float inv_scale, bool special) {
    const uint32_t top = special ? kFiniteMaxCode : kMaxCode;
    const uint32_t nearest = code_of(mul_rn(-offset, inv_scale), 0.5f);
    const bool reaches = offset <= 0.f && decode_any(offset, scale, top) >= 0.f;
    return reaches ? (nearest < top ? nearest : top) : kNoZeroCode;
  }

  // Any group.
  FASTCKPT_HD static uint32_t encode(const Params& p, float x, float u) {
    return p.wide ? encode_wide(p, x, u) : encode_narrow(p, x, u);
  }

  // Stochastic rounding (u uniform in [0, 1)): floor(t + u) on the grid, except between the zero code's
  // neighbours, where the zero code's value (0) sits at t0 = -offset / scale instead of at its index:
  // there x rounds to one of the two values around it with the probabilities that keep it unbiased.
  FASTCKPT_HD static uint32_t encode_stochastic(const Params& p, float x, float u) {
    const float t = p.wide ? position_wide(p, x) : position_narrow(p, x);
    const uint32_t uniform = code_of(t, u);
    if (p.zero_code == kNoZeroCode) return uniform;
    const uint32_t k0 = p.zero_code, top = p.special ? kFiniteMaxCode : kMaxCode;
    const float k = static_cast<float>(static_cast<int32_t>(k0));
    const float t0 = mul_rn(-p.offset, p.inv_scale);  // where 0 is; within half a step of k
    const bool below = t < t0;
    const float a = below ? sub_rn(k, 1.0f) : t0, b = below ? t0 : add_rn(k, 1.0f);  // b - a >= 1/2
    const bool up = add_rn(div_rn(sub_rn(t, a), sub_rn(b, a)), u) >= 1.0f;
    uint32_t near = below ? (up ? k0 : k0 - 1u) : (up ? k0 + 1u : k0);
    near = (below && k0 == 0u) || (!below && k0 == top) ? k0 : near;  // no value beyond the grid's end
    const bool inside = t > sub_rn(k, 1.0f) && t < add_rn(k, 1.0f);
    return inside ? near : uniform;
  }

  // Wide groups: (x/2 - offset/2) * (2/scale), where x - offset could overflow.
  FASTCKPT_HD static uint32_t encode_wide(const Params& p, float x, float u) {
    return keep_sign(p, x, code_of(position_wide(p, x), u));
  }

  // All other groups: (x - offset) * (1/scale).
  FASTCKPT_HD static uint32_t encode_narrow(const Params& p, float x, float u) {
    return keep_sign(p, x, code_of(position_narrow(p, x), u));
  }

  // Where x falls on the grid, in steps from the offset (both encoders and stochastic rounding read it).
  FASTCKPT_HD static float position_wide(const Params& p, float x) {
    return mul_rn(sub_rn(mul_rn(x, 0.5f), mul_rn(p.offset, 0.5f)), mul_rn(p.inv_scale, 2.0f));
  }
  FASTCKPT_HD static float position_narrow(const Params& p, float x) {
    return mul_rn(sub_rn(x, p.offset), p.inv_scale);
  }

  // Rounding to nearest keeps the signs of a group whose zero code is an end of its grid (ReLU outputs:
  // min 0): only an exact 0 takes the zero code, a nonzero value rounding to it takes the next code, within
  // 1.5 scales. ReLU's backward reads `result > 0` from its saved output, so a small positive decoded as 0
  // would lose its whole gradient. Groups of both signs keep nearest rounding (moving their many near-zero
  // values off 0 cost int4 40% more gradient error on a Llama).
  // As min/max with per-group bounds (loop-invariant), so that the encode loops stay vector loops.
  FASTCKPT_HD static uint32_t keep_sign(const Params& p, float x, uint32_t code) {
    const uint32_t z = p.zero_code, top = p.special ? kFiniteMaxCode : kMaxCode;
    const uint32_t lowest_positive = z == 0u && top > 0u ? 1u : 0u;           // positives stay above code 0
    const uint32_t highest_negative = z == top && top > 0u ? top - 1u : top;  // negatives stay below the top
    code = x > 0.f && code < lowest_positive ? lowest_positive : code;
    return x < 0.f && code > highest_negative ? highest_negative : code;
  }

  // t = (x - offset) / scale, rounded with offset u.
  FASTCKPT_HD static uint32_t code_of(float t, float u) {
    // NaN (only in special groups, whose non-finite elements take reserved codes) becomes 0 here, so it never
    // reaches the float-to-int conversion. Above, t is at most kMaxCode plus a few ulp (x <= max,
    // offset <= min, scale rounded up; wide groups on halves, so x/2 - offset/2 cannot overflow), so
    // the clamp can wait for the integer: one float select and one integer min, where clamping both
    // ends in float made GCC emit a chain of mask operations that cost 2.4x the whole encode loop.
    // Values below a saturated offset give t < 0: code 0.
    t = t > 0.f ? t : 0.f;
    const int32_t q = static_cast<int32_t>(add_rn(t, u));  // t + u >= 0: truncation is floor
    return static_cast<uint32_t>(q < kMaxCode ? q : kMaxCode);
  }

  // offset + code * scale for groups where no code leaves [-limit, limit] (in_range): the product is
  // exact (at most 8 + 11 significant bits), so this is the exact value rounded once to float32.
  FASTCKPT_HD static float decode(float offset, float scale, uint32_t code) {
    return add_rn(offset, mul_rn(static_cast<float>(static_cast<int32_t>(code)), scale));
  }

  // The same value for finite parameters and any code, without overflowing on the way: when code * scale
  // overflows, the sum is taken on halves (exact: the offset is then large, or the sum overflows anyway).
  // May give +-Inf (the exact value is beyond float32), which decode_saturated clamps.
  FASTCKPT_HD static float decode_any(float offset, float scale, uint32_t code) {
    const float c = static_cast<float>(static_cast<int32_t>(code));
    const float product = mul_rn(c, scale);
    const float halves = mul_rn(add_rn(mul_rn(offset, 0.5f), mul_rn(c, mul_rn(scale, 0.5f))), 2.0f);
    return is_finite_float(product) ? add_rn(offset, product) : halves;
  }

  // Whether decode (no clamp) keeps every code of a group within [-limit, limit]: both ends of its grid
  // are (decode is monotonic in the code). False for non-finite parameters and special groups (scale < 0).
  FASTCKPT_HD static bool in_range(float offset, float scale, float limit) {
    const float top = decode(offset, scale, kMaxCode);
    return scale > 0.f && offset >= -limit && offset <= limit && top >= -limit && top <= limit;
  }

  // The code of x in a special group: reserved codes for NaN and +-Inf, the grid's for the rest.
  FASTCKPT_HD static uint32_t encode_special(const Params& p, float x, float u, bool stochastic) {
    const uint32_t bits = float_bits(x) & 0x7FFFFFFFu;
    const uint32_t code = stochastic ? encode_stochastic(p, x, u) : encode(p, x, u);
    const uint32_t finite_code = code < static_cast<uint32_t>(kFiniteMaxCode) ? code : kFiniteMaxCode;
    const uint32_t inf_code = float_bits(x) >> 31 ? kNegInfCode : kPosInfCode;
    return bits > 0x7F800000u ? kNaNCode : bits == 0x7F800000u ? inf_code : finite_code;
  }
};

// fp8 e4m3 codes with a power-of-two group scale 2^e, e the smallest with max|x| / 2^e <= 448:
// scaling is exact, so each element rounds once, to e4m3's nearest (even). Stored as bf16, which
// holds every 2^e exactly. Rounding may carry a value up to the next power of two (1.9375 * 2^k and
// above round to 2^(k+1) at any e), beyond the input dtype's maximum when k is its top binade: decoding
// clamps to the output dtype's range, which only brings such values closer to the original.
struct Fp8Codec {
  static constexpr int kBits = 8;
  static constexpr bool kHasOffset = false;
  static constexpr bool kCanBeWide = false;
  static constexpr int kMinExponent = -126;  // keeps 2^e and 2^-e normal floats
  static constexpr float kMaxCode = 448.0f;  // e4m3's largest finite magnitude
  // Reserved codes of a special group's non-finite elements (e4m3's NaN, +448, -448); its finite elements
  // are scaled to at most 416 (0x7D), so that none rounds to 448.
  static constexpr uint32_t kNaNCode = 0x7Fu, kPosInfCode = 0x7Eu, kNegInfCode = 0xFEu;
  using Params = GroupParams;

  // lo, hi: the min and max of the group's finite elements.
  FASTCKPT_HD static Params make(float lo, float hi, bool special, bool /*bf16: always*/) {
    const uint32_t lo_abs = float_bits(lo) & 0x7FFFFFFFu, hi_abs = float_bits(hi) & 0x7FFFFFFFu;
    const uint32_t amax = lo_abs > hi_abs ? lo_abs : hi_abs;
    // amax = 1.m * 2^(E-127); 1.m <= 1.75 fits 448 = 1.75 * 2^8 at e = E-135, otherwise e = E-134
    // (special groups: 1.m <= 1.625 fits 416 = 1.625 * 2^8).
    const int32_t biased = static_cast<int32_t>(amax >> 23);
    int32_t e = biased - ((amax & 0x7FFFFFu) <= (special ? 0x500000u : 0x600000u) ? 135 : 134);
    e = e > kMinExponent ? e : kMinExponent;
    const float inv_scale = float_from_bits(static_cast<uint32_t>(127 - e) << 23);
    const float scale = float_from_bits(static_cast<uint32_t>(127 + e) << 23);
    const uint32_t scale_bits = (static_cast<uint32_t>(127 + e) << 7) | (special ? kSpecialFlag : 0u);
    return Params{0.f, scale, inv_scale, 0u, scale_bits, special, false, kNoZeroCode};  // 0 is code 0 already
  }

  FASTCKPT_HD static uint32_t encode(const Params& p, float x, float /*u*/) {
    return float_to_e4m3_bits(mul_rn(x, p.inv_scale));
  }
  FASTCKPT_HD static uint32_t encode_narrow(const Params& p, float x, float u) { return encode(p, x, u); }
  FASTCKPT_HD static uint32_t encode_wide(const Params& p, float x, float u) { return encode(p, x, u); }

  // code * scale: exact (a power-of-two scale) unless it overflows to Inf, which decode_saturated clamps.
  FASTCKPT_HD static float decode(float /*offset*/, float scale, uint32_t code) {
    return mul_rn(e4m3_bits_to_float(code), scale);
  }
  FASTCKPT_HD static float decode_any(float offset, float scale, uint32_t code) { return decode(offset, scale, code); }

  FASTCKPT_HD static bool in_range(float /*offset*/, float scale, float limit) {
    const float top = mul_rn(kMaxCode, scale);
    return scale > 0.f && top <= limit;
  }

  FASTCKPT_HD static uint32_t encode_stochastic(const Params& p, float x, float u) { return encode(p, x, u); }

  FASTCKPT_HD static uint32_t encode_special(const Params& p, float x, float u, bool /*stochastic: never*/) {
    const uint32_t bits = float_bits(x) & 0x7FFFFFFFu;
    const uint32_t inf_code = float_bits(x) >> 31 ? kNegInfCode : kPosInfCode;
    return bits > 0x7F800000u ? kNaNCode : bits == 0x7F800000u ? inf_code : encode(p, x, u);
  }
};

// The decoded value of one code, in float32, for output limit finite_max<T>(): the exact value rounded
// to float32, clamped to [-limit, limit] (then rounding to T cannot overflow); NaN when the group's
// parameters are not finite. Equal to Codec::decode for groups that are in_range.
template <typename Codec>
FASTCKPT_HD float decode_saturated(float offset, float scale, uint32_t code, float limit) {
  const bool ok = is_finite_float(offset) && is_finite_float(scale);
  return ok ? saturate(Codec::decode_any(offset, scale, code), limit) : float_from_bits(kFloatQuietNaN);
}

// The decoded value of one code of a special group (abs_scale: its scale without the flag), in float32:
// its reserved codes give NaN and +-Inf, the others decode_saturated (zero: the group's zero code).
template <typename Codec>
FASTCKPT_HD float decode_special(float offset, float abs_scale, uint32_t code, float limit, uint32_t zero) {
  const float inf = float_from_bits(0x7F800000u);
  const float value = code == zero ? 0.f : decode_saturated<Codec>(offset, abs_scale, code, limit);
  const bool nan = code == Codec::kNaNCode || (!Codec::kHasOffset && (code & 0x7Fu) == 0x7Fu);  // e4m3: both NaNs
  const float special = code == Codec::kPosInfCode ? inf : code == Codec::kNegInfCode ? -inf : value;
  return nan ? float_from_bits(kFloatQuietNaN) : special;
}

// Whether a group's stored scale flags it special (a negative scale; NaN parameters are not special).
FASTCKPT_HD bool is_special_scale(float scale) { return scale < 0.f; }

// The zero code of a group as the decoder sees it: from its stored offset and scale (negative: special).
template <typename Codec>
FASTCKPT_HD uint32_t stored_zero_code(float offset, float scale) {
  if constexpr (Codec::kHasOffset) {
    const float magnitude = scale < 0.f ? -scale : scale;
    const bool ok = is_finite_float(offset) && is_finite_float(scale);
    return ok ? Codec::zero_code(offset, magnitude, div_rn(1.0f, magnitude), scale < 0.f) : kNoZeroCode;
  } else {
    return kNoZeroCode;
  }
}

// Runs `body` with scalar_t bound to the input's C++ type (float32, float16, bfloat16 only).
#define FASTCKPT_DISPATCH_FLOAT_TYPES(TYPE, NAME, ...)                                                   \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__) \
                                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

// Runs `body(codec)` with the AffineCodec for `bits` (validated before).
template <typename Body>
void dispatch_affine_bits(int64_t bits, Body&& body) {
  switch (bits) {
    case 8: body(AffineCodec<8>{}); break;
    case 4: body(AffineCodec<4>{}); break;
    default: body(AffineCodec<2>{}); break;
  }
}

// ---------------------------------------------------------------- layout and argument checks
inline int64_t num_groups(int64_t numel, int64_t group_size) { return (numel + group_size - 1) / group_size; }
inline int64_t code_bytes(int64_t numel, int64_t bits) { return (numel * bits + 7) / 8; }

// fp16 inputs keep fp16 parameters (their range always fits, with 3 more mantissa bits than bf16);
// bf16 and fp32 inputs get bf16 parameters, whose range covers fp32's, so no group can overflow them.
inline at::ScalarType affine_param_dtype(at::ScalarType input) {
  return input == at::kHalf ? at::kHalf : at::kBFloat16;
}

inline void check_float_input(const char* op, const char* name, const at::Tensor& t) {
  const auto dtype = t.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, op, ": ", name, " has dtype ", dtype,
              "; supported: float32, float16, bfloat16");
  TORCH_CHECK(t.layout() == at::kStrided, op, ": ", name, " must be a strided (dense) tensor, got layout ", t.layout());
}

inline void check_output_dtype(const char* op, at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, op, ": dtype ", dtype,
              " is not supported; supported: float32, float16, bfloat16");
}

// Group sizes beyond 2^31 - 1 (INT32_MAX, as fastckpt.Policy allows) are rejected: a group never needs
// more elements than its tensor, and indices within a group stay 32-bit (the RNG's counter).
constexpr int64_t kMaxGroupSize = 2147483647;

inline void check_bits_and_group(const char* op, int64_t bits, int64_t group_size) {
  TORCH_CHECK(bits == 8 || bits == 4 || bits == 2, op, ": bits must be 8, 4 or 2, got ", bits);
  const int64_t per_byte = 8 / bits;
  TORCH_CHECK(group_size > 0 && group_size <= kMaxGroupSize && group_size % per_byte == 0, op,
              ": group_size must be a positive multiple of ", per_byte, " for bits=", bits,
              " (so that every group starts on a byte) and at most ", kMaxGroupSize, " (2^31 - 1), got ", group_size);
}

inline void check_group_size(const char* op, int64_t group_size) {
  TORCH_CHECK(group_size > 0 && group_size <= kMaxGroupSize, op,
              ": group_size must be positive and at most ", kMaxGroupSize, " (2^31 - 1), got ", group_size);
}

// The group size kernels work with: group_size cut to numel rounded up to 16 (a multiple of every
// 8/bits and of the CUDA kernels' vector widths, so a vector path stays a vector path). Same layout (one
// group whenever group_size >= numel), so encode and decode agree whichever of the two they are given,
// and no buffer scales with a group_size beyond the tensor.
inline int64_t effective_group_size(int64_t numel, int64_t group_size) {
  const int64_t whole = (numel + 15) / 16 * 16;
  return whole > 0 && whole < group_size ? whole : group_size;
}

inline int64_t shape_numel(const char* op, at::IntArrayRef shape) {
  int64_t numel = 1;
  for (auto s : shape) {
    TORCH_CHECK(s >= 0, op, ": shape has a negative size ", s);
    numel *= s;
  }
  return numel;
}

inline void check_params(const char* op, const char* name, const at::Tensor& param, int64_t groups,
                         const at::Tensor& codes) {
  TORCH_CHECK(param.scalar_type() == at::kHalf || param.scalar_type() == at::kBFloat16, op, ": ", name, " has dtype ",
              param.scalar_type(), "; expected float16 or bfloat16 as returned by the quantize op");
  TORCH_CHECK(param.dim() == 1 && param.numel() == groups, op, ": ", name, " must be 1-D with one entry per group (",
              groups, "), got shape ", param.sizes());
  TORCH_CHECK(param.device() == codes.device(), op, ": ", name, " is on ", param.device(), " but codes are on ",
              codes.device());
}

inline void check_codes(const char* op, const at::Tensor& codes, at::ScalarType expected, int64_t bytes,
                        at::IntArrayRef shape, int64_t bits) {
  TORCH_CHECK(codes.scalar_type() == expected, op, ": codes have dtype ", codes.scalar_type(), "; expected ", expected,
              " as returned by the quantize op");
  TORCH_CHECK(codes.dim() == 1 && codes.numel() == bytes, op, ": codes must be 1-D with ", bytes,
              " entries for shape ", shape, " at ", bits, " bits, got shape ", codes.sizes());
}

// Validated contiguous input and freshly allocated outputs of a quantize op, the same on every device.
struct QuantizeBuffers {
  at::Tensor src, codes, scale, offset;  // offset stays undefined for fp8
};

inline QuantizeBuffers prepare_quantize_per_group(const at::Tensor& x, int64_t bits, int64_t group_size) {
  constexpr const char* op = "quantize_per_group";
  check_float_input(op, "x", x);
  check_bits_and_group(op, bits, group_size);
  QuantizeBuffers b;
  b.src = x.contiguous();
  b.codes = at::empty({code_bytes(b.src.numel(), bits)}, x.options().dtype(at::kByte));
  b.scale = at::empty({num_groups(b.src.numel(), group_size)}, x.options().dtype(affine_param_dtype(x.scalar_type())));
  b.offset = at::empty_like(b.scale);
  return b;
}

inline QuantizeBuffers prepare_quantize_fp8(const at::Tensor& x, int64_t group_size) {
  constexpr const char* op = "quantize_fp8_per_group";
  check_float_input(op, "x", x);
  check_group_size(op, group_size);
  QuantizeBuffers b;
  b.src = x.contiguous();
  b.codes = at::empty({b.src.numel()}, x.options().dtype(at::kByte));
  b.scale = at::empty({num_groups(b.src.numel(), group_size)}, x.options().dtype(at::kBFloat16));
  return b;
}

// Validates dequantize_per_group's arguments; returns the number of elements to rebuild.
inline int64_t check_dequantize_per_group(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset,
                                          int64_t bits, int64_t group_size, at::ScalarType dtype,
                                          at::IntArrayRef shape) {
  constexpr const char* op = "dequantize_per_group";
  check_bits_and_group(op, bits, group_size);
  check_output_dtype(op, dtype);
  const int64_t numel = shape_numel(op, shape);
  check_codes(op, codes, at::kByte, code_bytes(numel, bits), shape, bits);
  check_params(op, "scale", scale, num_groups(numel, group_size), codes);
  check_params(op, "offset", offset, num_groups(numel, group_size), codes);
  TORCH_CHECK(scale.scalar_type() == offset.scalar_type(), op, ": scale (", scale.scalar_type(), ") and offset (",
              offset.scalar_type(), ") must have the same dtype");
  return numel;
}

// Validates dequantize_fp8_per_group's arguments; returns the number of elements to rebuild.
inline int64_t check_dequantize_fp8(const at::Tensor& codes, const at::Tensor& scale, int64_t group_size,
                                    at::ScalarType dtype, at::IntArrayRef shape) {
  constexpr const char* op = "dequantize_fp8_per_group";
  check_group_size(op, group_size);
  check_output_dtype(op, dtype);
  const int64_t numel = shape_numel(op, shape);
  check_codes(op, codes, at::kByte, numel, shape, 8);
  check_params(op, "scale", scale, num_groups(numel, group_size), codes);
  return numel;
}

}  // namespace quant
}  // namespace fastckpt
