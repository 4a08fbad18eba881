// Float format conversions shared by the quantize family's CPU and CUDA kernels: float32 bit casts,
// branch-free fp16/bf16 <-> float32 conversions (round to nearest even) and directed rounding to a
// 16-bit format chosen at run time (a group's scale/offset). Host and device give identical bits.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

// Always inlined: the CPU kernels are compiled per instruction set (target clones), and a helper
// left out of line would run as baseline scalar code inside the vectorized loops.
#if defined(__CUDACC__)
#define FASTCKPT_HD __host__ __device__ __forceinline__
#elif defined(__GNUC__)
#define FASTCKPT_HD inline __attribute__((always_inline))
#else
#define FASTCKPT_HD inline
#endif

namespace fastckpt {
namespace quant {

FASTCKPT_HD uint32_t float_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}
FASTCKPT_HD float float_from_bits(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// ---------------------------------------------------------------- 16-bit float conversions
// Branch-free bit arithmetic (selects only), so CPU loops vectorize; round to nearest even.
FASTCKPT_HD float half_bits_to_float(uint32_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t mag = h & 0x7FFFu;
  // Normal numbers move exponent+mantissa into place and rebias 15 -> 127; Inf/NaN map 31 -> 255.
  const uint32_t widened = (mag << 13) + (mag >= 0x7C00u ? (224u << 23) : (112u << 23));
  // Subnormals are mag * 2^-24: put mag in the mantissa of 0.5 (whose ulp is 2^-24), subtract 0.5.
  const float subnormal = float_from_bits(0x3F000000u | mag) - 0.5f;
  return float_from_bits(sign | (mag < 0x400u ? float_bits(subnormal) : widened));
}

FASTCKPT_HD uint32_t float_to_half_bits(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  // Rebias 127 -> 15 (subtract 112 << 23), then round the 13 dropped bits to nearest even.
  const uint32_t normal = (a - (112u << 23) + 0xFFFu + ((a >> 13) & 1u)) >> 13;
  // Below 2^-14: adding 0.5 (ulp 2^-24, the fp16 subnormal step) rounds |f| to that step.
  const uint32_t subnormal = float_bits(float_from_bits(a) + 0.5f) - 0x3F000000u;
  uint32_t mag = a < 0x38800000u ? subnormal : normal;
  mag = a >= 0x477FF000u ? 0x7C00u : mag;  // 65520 and above round to Inf
  mag = a > 0x7F800000u ? 0x7E00u | ((a >> 13) & 0x3FFu) : mag;  // NaN stays (quiet) NaN, payload kept as x86 does
  return sign | mag;
}

FASTCKPT_HD float bf16_bits_to_float(uint32_t b) { return float_from_bits(b << 16); }

// Round to nearest even for every non-NaN float (Inf and overflow to Inf included).
FASTCKPT_HD uint32_t non_nan_to_bf16_bits(float f) {
  const uint32_t u = float_bits(f);
  return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}

FASTCKPT_HD uint32_t float_to_bf16_bits(float f) {
  const uint32_t u = float_bits(f);
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? ((u >> 16) | 0x40u) : non_nan_to_bf16_bits(f);
}

FASTCKPT_HD float to_float(float v) { return v; }
FASTCKPT_HD float to_float(c10::Half v) {
#ifdef __CUDA_ARCH__
  return static_cast<float>(v);
#else
  return half_bits_to_float(v.x);
#endif
}
FASTCKPT_HD float to_float(c10::BFloat16 v) { return bf16_bits_to_float(v.x); }

template <typename T>
FASTCKPT_HD T from_float(float v);
template <>
FASTCKPT_HD float from_float<float>(float v) {
  return v;
}
template <>
FASTCKPT_HD c10::Half from_float<c10::Half>(float v) {
#ifdef __CUDA_ARCH__
  return c10::Half(v);
#else
  return c10::Half(static_cast<uint16_t>(float_to_half_bits(v)), c10::Half::from_bits());
#endif
}
template <>
FASTCKPT_HD c10::BFloat16 from_float<c10::BFloat16>(float v) {
#ifdef __CUDA_ARCH__
  return c10::BFloat16(v);
#else
  return c10::BFloat16(static_cast<uint16_t>(float_to_bf16_bits(v)), c10::BFloat16::from_bits());
#endif
}

// A 16-bit scale/offset (fp16 or bf16, chosen at run time per tensor) and directed rounding to it.
FASTCKPT_HD float param_to_float(uint32_t bits, bool bf16) {
  return bf16 ? bf16_bits_to_float(bits) : half_bits_to_float(bits);
}
// Neighbours of a 16-bit float toward -Inf / +Inf, as arithmetic (the rounding direction is data
// dependent: branches here mispredict half the time and serialize the CPU kernels).
FASTCKPT_HD uint32_t param_next_down(uint32_t b) { return b == 0u ? 0x8001u : b - 1u + ((b >> 15) << 1); }
FASTCKPT_HD uint32_t param_next_up(uint32_t b) { return b == 0x8000u ? 0x0001u : b + 1u - ((b >> 15) << 1); }
// Largest 16-bit value <= v (v finite; may give -Inf when v is below the format's range).
FASTCKPT_HD uint32_t param_round_down(float v, bool bf16) {
  const uint32_t b = bf16 ? float_to_bf16_bits(v) : float_to_half_bits(v);
  return param_to_float(b, bf16) > v ? param_next_down(b) : b;
}
// Smallest 16-bit value >= v (v finite; may give +Inf when v is above the format's range).
FASTCKPT_HD uint32_t param_round_up(float v, bool bf16) {
  const uint32_t b = bf16 ? float_to_bf16_bits(v) : float_to_half_bits(v);
  return param_to_float(b, bf16) < v ? param_next_up(b) : b;
}
FASTCKPT_HD bool is_finite_float(float v) { return (float_bits(v) & 0x7F800000u) != 0x7F800000u; }
// The format's lowest finite value (bf16: -3.3895e38, fp16: -65504).
FASTCKPT_HD uint32_t param_lowest_bits(bool bf16) { return bf16 ? 0xFF7Fu : 0xFBFFu; }

}  // namespace quant
}  // namespace fastckpt
