// CPU kernels of the quantize family. Work is split over blocks of consecutive groups (~kBlockElems
// elements, L1/L2-resident) and each block runs in phases, each a loop the compiler vectorizes:
// min/max per group; the parameters of all the block's groups at once (vectorized across groups:
// branch-free, so data-dependent rounding directions do not stall the pipeline); codes per group,
// into a block buffer that one loop then bit-packs (a group of 64 int2 codes is only 16 bytes, too
// short for a vector loop over bytes). Decoding mirrors this.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu_clones.h"
#include "quantize/quantize.h"

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define FASTCKPT_HAVE_F16C_PATH 1
#endif

// Codes must match the reference bit for bit, which rounds after every operation: no FMA contraction.
// Not trapping on FP exceptions (values are unchanged) lets GCC turn the codecs' selects into blends.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off", "no-trapping-math")
#endif

namespace fastckpt {
namespace {

using namespace quant;

constexpr int64_t kGrainElems = 1 << 16;   // elements per parallel task
constexpr int64_t kBlockElems = 1 << 13;   // elements per block (groups whose parameters are computed together)
constexpr int64_t kMaxBlockGroups = 256;  // bounds the per-block parameter arrays on the stack
constexpr int64_t kWidenElems = 1 << 10;  // fp16 elements converted to/from fp32 at a time (4 KB, L1-resident)

int64_t block_groups(int64_t group_size) {
  return std::clamp<int64_t>(kBlockElems / group_size, 1, kMaxBlockGroups);
}

// ---------------------------------------------------------------- fp16 <-> fp32 for whole blocks
// fp16 blocks are widened to fp32 before encoding and decoded through fp32. On x86 with F16C one
// instruction converts 8 values; the portable bit arithmetic costs ~15 integer operations per value
// and made fp16 the slowest input. Both give the same bits (NaN payloads kept as x86 keeps them).
FASTCKPT_CPU_CLONES void half_to_float_portable(const c10::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = half_bits_to_float(src[i].x);
}
FASTCKPT_CPU_CLONES void float_to_half_portable(const float* src, c10::Half* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = from_float<c10::Half>(src[i]);
}

#ifdef FASTCKPT_HAVE_F16C_PATH
__attribute__((target("avx,f16c"))) void half_to_float_f16c(const c10::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
  for (; i < n; ++i) dst[i] = _cvtsh_ss(src[i].x);
}
__attribute__((target("avx,f16c"))) void float_to_half_f16c(const float* src, c10::Half* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i halves = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), halves);
  }
  for (; i < n; ++i) {
    dst[i] = c10::Half(static_cast<uint16_t>(_cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT)), c10::Half::from_bits());
  }
}
#endif

// FASTCKPT_DISABLE_F16C=1 (read once) forces the portable path, so tests cover it on any machine.
bool cpu_has_f16c() {
#ifdef FASTCKPT_HAVE_F16C_PATH
  static const bool has = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c") &&
                          std::getenv("FASTCKPT_DISABLE_F16C") == nullptr;
  return has;
#else
  return false;
#endif
}

void half_to_float(const c10::Half* src, float* dst, int64_t n) {
#ifdef FASTCKPT_HAVE_F16C_PATH
  if (cpu_has_f16c()) return half_to_float_f16c(src, dst, n);
#endif
  half_to_float_portable(src, dst, n);
}
void float_to_half(const float* src, c10::Half* dst, int64_t n) {
#ifdef FASTCKPT_HAVE_F16C_PATH
  if (cpu_has_f16c()) return float_to_half_f16c(src, dst, n);
#endif
  float_to_half_portable(src, dst, n);
}

// Per-task buffers for one block: its one-per-byte codes, and (fp16 only) its values as fp32.
struct BlockScratch {
  std::vector<uint8_t> codes;
  std::vector<float> values;
  template <typename T>
  static BlockScratch make(int64_t group_size) {
    const int64_t elems = block_groups(group_size) * group_size;
    return {std::vector<uint8_t>(elems + 8), std::vector<float>(std::is_same_v<T, c10::Half> ? elems : 0)};
  }
};

// Order keys on the stored bits: 16-bit inputs reduce as int16 (twice the lanes of a float key).
template <typename T>
struct Keys;
template <>
struct Keys<float> {
  using Key = int32_t;
  FASTCKPT_HD static Key of(float v) { return order_key(v); }
  FASTCKPT_HD static float value(Key k) { return from_order_key(k); }
  static constexpr Key kPosInf = kKeyPosInf, kNegInf = kKeyNegInf;
};
template <typename T, uint16_t kInfBits>
struct Keys16 {
  using Key = int16_t;
  FASTCKPT_HD static Key of(T v) {
    const auto b = static_cast<int16_t>(v.x);
    return static_cast<Key>(b ^ ((b >> 15) & 0x7FFF));
  }
  FASTCKPT_HD static float value(Key k) {
    const auto bits = static_cast<uint16_t>(k ^ ((k >> 15) & 0x7FFF));
    return to_float(T(bits, T::from_bits()));
  }
  static constexpr Key kPosInf = static_cast<Key>(kInfBits);
  static constexpr Key kNegInf = static_cast<Key>((kInfBits | 0x8000) ^ 0x7FFF);
};
template <>
struct Keys<c10::Half> : Keys16<c10::Half, 0x7C00> {};
template <>
struct Keys<c10::BFloat16> : Keys16<c10::BFloat16, 0x7F80> {};

// Order keys of the min and max of src[0, n) (n >= 1). Turning keys into floats and finiteness is
// left to a loop over the block's groups, which vectorizes across groups.
template <typename T>
FASTCKPT_HD void group_range(const T* __restrict__ src, int64_t n, typename Keys<T>::Key& lo_key,
                             typename Keys<T>::Key& hi_key) {
  using K = Keys<T>;
  typename K::Key lo = std::numeric_limits<typename K::Key>::max();
  typename K::Key hi = std::numeric_limits<typename K::Key>::min();
  for (int64_t i = 0; i < n; ++i) {
    const auto k = K::of(src[i]);
    lo = k < lo ? k : lo;
    hi = k > hi ? k : hi;
  }
  lo_key = lo;
  hi_key = hi;
}

// Order keys of the min and max of src[0, n)'s finite elements (the keys of 0 when there are none): the
// range of a special group, which group_range found to hold NaN or +-Inf. Selects only, so it vectorizes.
template <typename T>
FASTCKPT_HD void finite_range(const T* __restrict__ src, int64_t n, typename Keys<T>::Key& lo_key,
                              typename Keys<T>::Key& hi_key) {
  using K = Keys<T>;
  using Key = typename K::Key;
  Key lo = std::numeric_limits<Key>::max();
  Key hi = std::numeric_limits<Key>::min();
  for (int64_t i = 0; i < n; ++i) {
    const Key k = K::of(src[i]);
    const bool finite = k > K::kNegInf && k < K::kPosInf;
    const Key low = finite ? k : std::numeric_limits<Key>::max(), high = finite ? k : std::numeric_limits<Key>::min();
    lo = low < lo ? low : lo;
    hi = high > hi ? high : hi;
  }
  const bool none = lo > hi;
  lo_key = none ? typename K::Key{0} : lo;  // key 0 is +0.0 for every key width
  hi_key = none ? typename K::Key{0} : hi;
}

// One code per byte for src[0, n) of a special group: reserved codes for NaN and +-Inf (selects only).
template <typename T, typename Codec, bool kStochastic>
FASTCKPT_HD void encode_special_group(const T* __restrict__ src, uint8_t* __restrict__ out, int64_t n,
                                      const GroupParams& p, uint32_t key) {
  for (int64_t i = 0; i < n; ++i) {
    const float u = kStochastic ? uniform01(key, static_cast<uint32_t>(i)) : 0.5f;
    out[i] = static_cast<uint8_t>(Codec::encode_special(p, to_float(src[i]), u, kStochastic));
  }
}

// One code per byte for src[0, n). kWide: the group is wide (rare; see AffineCodec).
template <typename T, typename Codec, bool kStochastic, bool kWide>
FASTCKPT_HD void encode_group(const T* __restrict__ src, uint8_t* __restrict__ out, int64_t n, const GroupParams& p,
                              uint32_t key) {
  for (int64_t i = 0; i < n; ++i) {
    const float u = kStochastic ? uniform01(key, static_cast<uint32_t>(i)) : 0.5f;
    const float x = to_float(src[i]);
    const uint32_t code = kStochastic ? Codec::encode_stochastic(p, x, u)
                          : kWide     ? Codec::encode_wide(p, x, u)
                                      : Codec::encode_narrow(p, x, u);
    out[i] = static_cast<uint8_t>(code);
  }
}

// The one-per-byte codes of one packed byte, read or written as a single 16/32-bit word: shifts and
// masks within a vector lane, where per-byte accesses would need byte shuffles.
template <int kBits>
using CodeWord = std::conditional_t<kBits == 4, uint16_t, uint32_t>;

// Packs one-per-byte codes (zero-padded to a whole byte) into `bytes` bytes, little-endian.
template <int kBits>
FASTCKPT_HD void pack_codes(const uint8_t* __restrict__ unpacked, uint8_t* __restrict__ packed, int64_t bytes) {
  constexpr int kPerByte = 8 / kBits;
  for (int64_t j = 0; j < bytes; ++j) {
    CodeWord<kBits> word;
    std::memcpy(&word, unpacked + j * kPerByte, sizeof(word));
    uint32_t byte = 0;
    for (int k = 0; k < kPerByte; ++k) {
      byte |= ((static_cast<uint32_t>(word) >> (8 * k)) & ((1u << kBits) - 1)) << (k * kBits);
    }
    packed[j] = static_cast<uint8_t>(byte);
  }
}

template <int kBits>
FASTCKPT_HD void unpack_codes(const uint8_t* __restrict__ packed, uint8_t* __restrict__ unpacked, int64_t bytes) {
  constexpr int kPerByte = 8 / kBits;
  for (int64_t j = 0; j < bytes; ++j) {
    const uint32_t byte = packed[j];
    uint32_t word = 0;
    for (int k = 0; k < kPerByte; ++k) word |= ((byte >> (k * kBits)) & ((1u << kBits) - 1)) << (8 * k);
    const auto narrow = static_cast<CodeWord<kBits>>(word);
    std::memcpy(unpacked + j * kPerByte, &narrow, sizeof(narrow));
  }
}

// fp16 blocks are encoded from, and decoded into, fp32 (BlockScratch::values).
template <typename T>
using BlockValue = std::conditional_t<std::is_same_v<T, c10::Half>, float, T>;

// The encode phase of one block: codes of groups [0, groups) of src (count elements) into unpacked
// (one per byte), from the parameters the block computed. kMayBeWide: some group of the block is wide.
template <typename T, typename Codec, bool kMayBeWide>
FASTCKPT_HD void encode_block(const T* src, uint8_t* unpacked, int64_t count, int64_t group_size, int64_t groups,
                              int64_t g0, const float* offsets, const float* inv_scales, const int32_t* special,
                              const int32_t* wide, const uint32_t* zero_codes, bool stochastic, uint32_t seed_key,
                              float* values) {
  int64_t widened_from = 0;  // fp16: values holds the block's elements from here on, as fp32
  for (int64_t b = 0; b < groups; ++b) {
    const int64_t at = b * group_size, n = std::min(group_size, count - at);
    const GroupParams p{offsets[b],     0.f, inv_scales[b], 0u, 0u, special[b] != 0, kMayBeWide && wide[b] != 0,
                        zero_codes[b]};
    const BlockValue<T>* encoded = nullptr;
    if constexpr (std::is_same_v<T, c10::Half>) {
      // widened a few groups at a time, so that they are still in L1 when encoded
      if (b == 0 || at - widened_from + n > kWidenElems) {
        widened_from = at;
        half_to_float(src + at, values, std::min(std::max(kWidenElems, n), count - at));
      }
      encoded = values + (at - widened_from);
    } else {
      encoded = src + at;
    }
    if (p.special) {
      if (stochastic) {
        encode_special_group<BlockValue<T>, Codec, true>(encoded, unpacked + at, n, p, group_key(seed_key, g0 + b));
      } else {
        encode_special_group<BlockValue<T>, Codec, false>(encoded, unpacked + at, n, p, 0);
      }
    } else if (kMayBeWide && p.wide) {
      if (stochastic) {
        encode_group<BlockValue<T>, Codec, true, true>(encoded, unpacked + at, n, p, group_key(seed_key, g0 + b));
      } else {
        encode_group<BlockValue<T>, Codec, false, true>(encoded, unpacked + at, n, p, 0);
      }
    } else if (stochastic) {
      encode_group<BlockValue<T>, Codec, true, false>(encoded, unpacked + at, n, p, group_key(seed_key, g0 + b));
    } else {
      encode_group<BlockValue<T>, Codec, false, false>(encoded, unpacked + at, n, p, 0);
    }
  }
}

// Groups [begin, end); scratch and values come from BlockScratch::make<T>.
template <typename T, typename Codec>
FASTCKPT_CPU_CLONES void quantize_groups(const T* x, uint8_t* codes, uint16_t* scale, uint16_t* offset, int64_t numel,
                                         int64_t group_size, int64_t begin, int64_t end, bool stochastic,
                                         uint32_t seed_key, uint8_t* scratch, float* values) {
  constexpr int kPerByte = 8 / Codec::kBits;
  // affine_param_dtype as a constant: a run-time choice inside the parameter loop blocks its vectorization
  constexpr bool kBf16Params = !std::is_same_v<T, c10::Half>;
  const int64_t block = block_groups(group_size);
  float lo[kMaxBlockGroups], hi[kMaxBlockGroups], offsets[kMaxBlockGroups], inv_scales[kMaxBlockGroups];
  // int32, not bool: keeps the parameter loop in one vector width
  int32_t special[kMaxBlockGroups], wide[kMaxBlockGroups];
  uint32_t zero_codes[kMaxBlockGroups];
  typename Keys<T>::Key lo_keys[kMaxBlockGroups], hi_keys[kMaxBlockGroups];
  for (int64_t g0 = begin; g0 < end; g0 += block) {
    const int64_t groups = std::min(block, end - g0);
    const int64_t first = g0 * group_size;
    const int64_t count = std::min(groups * group_size, numel - first);
    const T* src = x + first;
    for (int64_t b = 0; b < groups; ++b) {
      group_range(src + b * group_size, std::min(group_size, count - b * group_size), lo_keys[b], hi_keys[b]);
    }
    int32_t any_special = 0;
    for (int64_t b = 0; b < groups; ++b) {
      special[b] = !(lo_keys[b] > Keys<T>::kNegInf && hi_keys[b] < Keys<T>::kPosInf);
      any_special |= special[b];
    }
    if (any_special) {
      for (int64_t b = 0; b < groups; ++b) {
        if (special[b]) {
          finite_range(src + b * group_size, std::min(group_size, count - b * group_size), lo_keys[b], hi_keys[b]);
        }
      }
    }
    for (int64_t b = 0; b < groups; ++b) {
      lo[b] = Keys<T>::value(lo_keys[b]);
      hi[b] = Keys<T>::value(hi_keys[b]);
    }
    int32_t any_wide = 0;
    for (int64_t b = 0; b < groups; ++b) {
      const GroupParams p = Codec::make(lo[b], hi[b], special[b] != 0, kBf16Params);
      offsets[b] = p.offset;
      inv_scales[b] = p.inv_scale;
      zero_codes[b] = p.zero_code;
      wide[b] = p.wide;
      any_wide |= wide[b];
      scale[g0 + b] = static_cast<uint16_t>(p.scale_bits);
      if constexpr (Codec::kHasOffset) offset[g0 + b] = static_cast<uint16_t>(p.offset_bits);
    }
    uint8_t* dst = codes + first / kPerByte;  // groups start on whole bytes
    uint8_t* unpacked = kPerByte == 1 ? dst : scratch;
    // Wide groups (rare) get their own loop; a block without any runs the plain one and tests nothing per group.
    if (Codec::kCanBeWide && any_wide) {
      encode_block<T, Codec, true>(src, unpacked, count, group_size, groups, g0, offsets, inv_scales, special, wide,
                                   zero_codes, stochastic, seed_key, values);
    } else {
      encode_block<T, Codec, false>(src, unpacked, count, group_size, groups, g0, offsets, inv_scales, special, wide,
                                    zero_codes, stochastic, seed_key, values);
    }
    if constexpr (kPerByte > 1) {
      std::fill_n(scratch + count, kPerByte, uint8_t{0});  // zero bits after the tensor's last code
      pack_codes<Codec::kBits>(scratch, dst, (count + kPerByte - 1) / kPerByte);
    }
  }
}

// Groups [begin, end); scratch and values as for quantize_groups.
template <typename T, typename Codec>
FASTCKPT_CPU_CLONES void dequantize_groups(const uint8_t* codes, const uint16_t* scale, const uint16_t* offset,
                                           bool bf16_params, T* out, int64_t numel, int64_t group_size, int64_t begin,
                                           int64_t end, uint8_t* scratch, float* values) {
  constexpr int kPerByte = 8 / Codec::kBits;
  const float limit = finite_max<T>();
  const int64_t block = block_groups(group_size);
  float scales[kMaxBlockGroups], offsets[kMaxBlockGroups];
  int32_t in_range[kMaxBlockGroups];  // int32, not bool: keeps the loop that fills it in one vector width
  for (int64_t g0 = begin; g0 < end; g0 += block) {
    const int64_t groups = std::min(block, end - g0);
    const int64_t first = g0 * group_size;
    const int64_t count = std::min(groups * group_size, numel - first);
    for (int64_t b = 0; b < groups; ++b) {
      scales[b] = bf16_params ? bf16_bits_to_float(scale[g0 + b]) : half_bits_to_float(scale[g0 + b]);
    }
    if constexpr (Codec::kHasOffset) {
      for (int64_t b = 0; b < groups; ++b) {
        offsets[b] = bf16_params ? bf16_bits_to_float(offset[g0 + b]) : half_bits_to_float(offset[g0 + b]);
      }
    }
    // false for NaN/Inf parameters and special groups too: one test per group in the common case
    for (int64_t b = 0; b < groups; ++b) {
      in_range[b] = Codec::in_range(Codec::kHasOffset ? offsets[b] : 0.f, scales[b], limit);
    }
    const uint8_t* unpacked = codes + first / kPerByte;
    if constexpr (kPerByte > 1) {
      unpack_codes<Codec::kBits>(unpacked, scratch, (count + kPerByte - 1) / kPerByte);
      unpacked = scratch;
    }
    int64_t narrowed_to = 0;  // fp16: values holds decoded elements from here on, as fp32
    for (int64_t b = 0; b < groups; ++b) {
      const int64_t at = b * group_size, n = std::min(group_size, count - at);
      const float s = scales[b], o = Codec::kHasOffset ? offsets[b] : 0.f;
      const uint32_t zero = stored_zero_code<Codec>(o, s);
      const uint8_t* __restrict__ q = unpacked + at;
      BlockValue<T>* y = nullptr;
      if constexpr (std::is_same_v<T, c10::Half>) {
        // narrowed a few groups at a time, while they are still in L1
        if (at > narrowed_to && at + n - narrowed_to > kWidenElems) {
          float_to_half(values, out + first + narrowed_to, at - narrowed_to);
          narrowed_to = at;
        }
        y = values + (at - narrowed_to);
      } else {
        y = out + first + at;
      }
      if (!in_range[b]) {
        if (!is_finite_float(s) || !is_finite_float(o)) {
          // Non-finite parameters (only from foreign input): the canonical NaN, so that no loop rounds a
          // NaN (bf16 rounding then needs no NaN select, which cost 30% of its time).
          std::fill_n(y, n, from_float<BlockValue<T>>(float_from_bits(kFloatQuietNaN)));
        } else if (is_special_scale(s)) {
          // A group that held NaN or +-Inf: its reserved codes decode to them.
          for (int64_t i = 0; i < n; ++i) {
            y[i] = from_float<BlockValue<T>>(decode_special<Codec>(o, -s, q[i], limit, zero));
          }
        } else {
          // Some code would leave T's finite range (values near the dtype's maximum, or code * scale
          // beyond float32): clamped decoding. Rare; the loops below skip the clamp.
          for (int64_t i = 0; i < n; ++i) {
            y[i] = from_float<BlockValue<T>>(q[i] == zero ? 0.f : decode_saturated<Codec>(o, s, q[i], limit));
          }
        }
        continue;
      }
      // The zero code decodes to exactly 0 (fp8: none; a select the loop vectorizes).
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        for (int64_t i = 0; i < n; ++i) {
          const float v = q[i] == zero ? 0.f : Codec::decode(o, s, q[i]);
          y[i] = c10::BFloat16(static_cast<uint16_t>(non_nan_to_bf16_bits(v)), c10::BFloat16::from_bits());
        }
      } else {
        for (int64_t i = 0; i < n; ++i) y[i] = from_float<BlockValue<T>>(q[i] == zero ? 0.f : Codec::decode(o, s, q[i]));
      }
    }
    if constexpr (std::is_same_v<T, c10::Half>) float_to_half(values, out + first + narrowed_to, count - narrowed_to);
  }
}

int64_t grain_groups(int64_t group_size) { return std::max<int64_t>(1, kGrainElems / group_size); }

template <typename Codec>
void quantize_cpu_impl(const at::Tensor& src, at::Tensor& codes, at::Tensor& scale, at::Tensor* offset,
                       int64_t group_size, bool stochastic, int64_t seed) {
  const int64_t numel = src.numel();
  if (numel == 0) return;
  const uint32_t key = seed_key(seed);
  uint8_t* codes_ptr = static_cast<uint8_t*>(codes.data_ptr());
  auto* scale_ptr = static_cast<uint16_t*>(scale.data_ptr());
  auto* offset_ptr = offset ? static_cast<uint16_t*>(offset->data_ptr()) : nullptr;
  FASTCKPT_DISPATCH_FLOAT_TYPES(src.scalar_type(), "quantize_cpu", [&] {
    const scalar_t* x = src.const_data_ptr<scalar_t>();
    at::parallel_for(0, num_groups(numel, group_size), grain_groups(group_size), [&](int64_t begin, int64_t end) {
      auto scratch = BlockScratch::make<scalar_t>(group_size);
      quantize_groups<scalar_t, Codec>(x, codes_ptr, scale_ptr, offset_ptr, numel, group_size, begin, end, stochastic,
                                       key, scratch.codes.data(), scratch.values.data());
    });
  });
}

template <typename Codec>
at::Tensor dequantize_cpu_impl(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor* offset,
                               int64_t group_size, at::ScalarType dtype, at::IntArrayRef shape, int64_t numel) {
  auto out = at::empty(shape, codes.options().dtype(dtype));
  if (numel == 0) return out;
  const bool bf16_params = scale.scalar_type() == at::kBFloat16;
  const auto codes_c = codes.contiguous();
  const auto scale_c = scale.contiguous();
  const auto offset_c = offset ? offset->contiguous() : at::Tensor();
  const auto* codes_ptr = static_cast<const uint8_t*>(codes_c.const_data_ptr());
  const auto* scale_ptr = static_cast<const uint16_t*>(scale_c.const_data_ptr());
  const auto* offset_ptr = offset ? static_cast<const uint16_t*>(offset_c.const_data_ptr()) : nullptr;
  FASTCKPT_DISPATCH_FLOAT_TYPES(dtype, "dequantize_cpu", [&] {
    scalar_t* y = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, num_groups(numel, group_size), grain_groups(group_size), [&](int64_t begin, int64_t end) {
      auto scratch = BlockScratch::make<scalar_t>(group_size);
      dequantize_groups<scalar_t, Codec>(codes_ptr, scale_ptr, offset_ptr, bf16_params, y, numel, group_size, begin,
                                         end, scratch.codes.data(), scratch.values.data());
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_per_group_cpu(const at::Tensor& x, int64_t bits,
                                                                      int64_t group_size, bool stochastic,
                                                                      int64_t seed) {
  auto b = prepare_quantize_per_group(x, bits, group_size);
  const int64_t group = effective_group_size(b.src.numel(), group_size);
  dispatch_affine_bits(bits, [&](auto codec) {
    quantize_cpu_impl<decltype(codec)>(b.src, b.codes, b.scale, &b.offset, group, stochastic, seed);
  });
  return {b.codes, b.scale, b.offset};
}

at::Tensor dequantize_per_group_cpu(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset,
                                    int64_t bits, int64_t group_size, at::ScalarType dtype, at::IntArrayRef shape) {
  const int64_t numel = check_dequantize_per_group(codes, scale, offset, bits, group_size, dtype, shape);
  const int64_t group = effective_group_size(numel, group_size);
  at::Tensor out;
  dispatch_affine_bits(bits, [&](auto codec) {
    out = dequantize_cpu_impl<decltype(codec)>(codes, scale, &offset, group, dtype, shape, numel);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> quantize_fp8_per_group_cpu(const at::Tensor& x, int64_t group_size) {
  auto b = prepare_quantize_fp8(x, group_size);
  quantize_cpu_impl<Fp8Codec>(b.src, b.codes, b.scale, nullptr, effective_group_size(b.src.numel(), group_size),
                              false, 0);
  return {b.codes, b.scale};
}

at::Tensor dequantize_fp8_per_group_cpu(const at::Tensor& codes, const at::Tensor& scale, int64_t group_size,
                                        at::ScalarType dtype, at::IntArrayRef shape) {
  const int64_t numel = check_dequantize_fp8(codes, scale, group_size, dtype, shape);
  return dequantize_cpu_impl<Fp8Codec>(codes, scale, nullptr, effective_group_size(numel, group_size), dtype, shape,
                                       numel);
}

}  // namespace

TORCH_LIBRARY_IMPL(fastckpt, CPU, m) {
  m.impl("quantize_per_group", &quantize_per_group_cpu);
  m.impl("dequantize_per_group", &dequantize_per_group_cpu);
  m.impl("quantize_fp8_per_group", &quantize_fp8_per_group_cpu);
  m.impl("dequantize_fp8_per_group", &dequantize_fp8_per_group_cpu);
}

}  // namespace fastckpt
