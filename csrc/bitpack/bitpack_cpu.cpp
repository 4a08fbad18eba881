// CPU kernels of the bitpack family: one pass, parallel over 64-element words.
//
// Eight 0/1 flag bytes become one packed byte with a multiply: for w = sum_i f_i << 8i (f_i in {0,1}),
// w * 0x0102040810204080 gathers bit 8i of w into bit 56+i, so (w * magic) >> 56 is the packed byte.
// Unpacking spreads each byte over 8 lanes of a 64-bit word (spread_bits). Nonzero tests look at the
// bits (sign masked off), so -0 counts as zero and NaN as set without any float conversion.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#include "bitpack/bitpack.h"
#include "cpu_clones.h"

namespace fastckpt {
namespace {

constexpr int64_t kGrainWords = 1 << 11;  // 64 elements per word
constexpr uint64_t kGatherBits = 0x0102040810204080ull;

// An unsigned integer type of T's width, and the mask of its non-sign bits.
template <typename T>
struct Bits;
template <>
struct Bits<float> {
  using type = uint32_t;
  static constexpr type kMagnitude = 0x7FFFFFFFu;
};
template <>
struct Bits<c10::Half> {
  using type = uint16_t;
  static constexpr type kMagnitude = 0x7FFFu;
};
template <>
struct Bits<c10::BFloat16> {
  using type = uint16_t;
  static constexpr type kMagnitude = 0x7FFFu;
};
template <>
struct Bits<bool> {
  using type = uint8_t;
  static constexpr type kMagnitude = 0xFFu;
};

template <typename T>
inline __attribute__((always_inline)) uint8_t pack_flags(const uint8_t* flags) {
  uint64_t w;
  std::memcpy(&w, flags, 8);
  return static_cast<uint8_t>(((w & 0x0101010101010101ull) * kGatherBits) >> 56);
}

// Words [begin, end) of 64 elements: flag bytes for a word (a vector compare), then 8 multiplies
// (one vector multiply where AVX-512 has 64-bit lanes).
template <typename T>
FASTCKPT_CPU_CLONES void pack_words(const typename Bits<T>::type* __restrict__ src, uint8_t* __restrict__ dst,
                                    int64_t begin, int64_t end) {
  alignas(64) uint8_t flags[64];
  for (int64_t w = begin; w < end; ++w) {
    const auto* s = src + w * 64;
    for (int i = 0; i < 64; ++i) flags[i] = (s[i] & Bits<T>::kMagnitude) != 0;
    for (int b = 0; b < 8; ++b) dst[w * 8 + b] = pack_flags<T>(flags + 8 * b);
  }
}

template <typename T>
void pack_bits_kernel(const T* src_t, uint8_t* dst, int64_t numel) {
  using U = typename Bits<T>::type;
  const U* src = reinterpret_cast<const U*>(src_t);
  const int64_t words = numel / 64;
  at::parallel_for(0, words, kGrainWords, [&](int64_t begin, int64_t end) { pack_words<T>(src, dst, begin, end); });
  for (int64_t i = words * 64; i < numel; i += 8) {  // the tail: whole bytes, the last one partial
    uint8_t flags[8] = {0};
    for (int64_t k = 0; k < 8 && i + k < numel; ++k) flags[k] = (src[i + k] & Bits<T>::kMagnitude) != 0;
    dst[i / 8] = pack_flags<T>(flags);
  }
}

at::Tensor pack_bits_cpu(const at::Tensor& mask) {
  check_pack_bits_input(mask);
  const auto src = mask.contiguous();
  const int64_t numel = src.numel();
  auto out = at::empty({(numel + 7) / 8}, mask.options().dtype(at::kByte));
  if (numel == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND3(at::kBool, at::kHalf, at::kBFloat16, src.scalar_type(), "pack_bits_cpu", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "pack_bits: float64 masks are not supported");  // rejected by the check above
    } else {
      pack_bits_kernel<scalar_t>(src.const_data_ptr<scalar_t>(), out.mutable_data_ptr<uint8_t>(), numel);
    }
  });
  return out;
}

// The 8 flag bytes (0 or 1) of `byte`, lowest bit first, in arithmetic that vectorizes (a table
// lookup per byte does not): broadcast the byte to 8 lanes, keep bit i in lane i, then turn each
// nonzero lane into 1 by adding 0x7F (no lane carries: lanes hold at most 0x80) and taking bit 7.
inline __attribute__((always_inline)) uint64_t spread_bits(uint8_t byte) {
  const uint64_t lanes = (byte * 0x0101010101010101ull) & 0x8040201008040201ull;
  return ((lanes + 0x7F7F7F7F7F7F7F7Full) >> 7) & 0x0101010101010101ull;
}

FASTCKPT_CPU_CLONES void unpack_bytes(const uint8_t* __restrict__ src, uint8_t* __restrict__ dst, int64_t begin,
                                      int64_t end) {
  for (int64_t b = begin; b < end; ++b) {
    const uint64_t w = spread_bits(src[b]);
    std::memcpy(dst + b * 8, &w, 8);
  }
}

at::Tensor unpack_bits_cpu(const at::Tensor& packed, at::IntArrayRef shape) {
  const int64_t numel = check_unpack_bits_input(packed, shape);
  auto out = at::empty(shape, packed.options().dtype(at::kBool));
  if (numel == 0) return out;
  const uint8_t* src = packed.const_data_ptr<uint8_t>();
  uint8_t* dst = reinterpret_cast<uint8_t*>(out.mutable_data_ptr<bool>());
  const int64_t full_bytes = numel / 8;
  at::parallel_for(0, full_bytes, kGrainWords * 8, [&](int64_t begin, int64_t end) {
    unpack_bytes(src, dst, begin, end);
  });
  if (numel % 8) {
    const uint64_t w = spread_bits(src[full_bytes]);
    std::memcpy(dst + full_bytes * 8, &w, numel % 8);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(fastckpt, CPU, m) {
  m.impl("pack_bits", &pack_bits_cpu);
  m.impl("unpack_bits", &unpack_bits_cpu);
}

}  // namespace fastckpt
