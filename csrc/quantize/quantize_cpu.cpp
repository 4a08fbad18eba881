// CPU kernels of the quantize family: parallel over groups; per group one min/max loop and one
// encode loop over data that is still in L1, both written for the compiler to vectorize.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <tuple>

#include "quantize/quantize.h"

// Codes must match the reference bit for bit, which rounds after every operation: no FMA contraction.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

// The hot loops are built for baseline x86-64, AVX2 (x86-64-v3) and AVX-512 (x86-64-v4); the
// dynamic loader picks the best one for the machine (GNU ifunc), the extension's flags stay portable.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define FASTCKPT_CPU_CLONES __attribute__((target_clones("default", "arch=x86-64-v3", "arch=x86-64-v4")))
#else
#define FASTCKPT_CPU_CLONES
#endif

namespace fastckpt {
namespace {

using namespace quant;

constexpr int64_t kGrainElems = 1 << 15;  // elements per parallel task, ~L2-sized for fp32

// Order keys on the stored bits: 16-bit inputs reduce as int16 (twice the lanes of a float key).
template <typename T>
struct Keys;
template <>
struct Keys<float> {
  using Key = int32_t;
  static Key of(float v) { return order_key(v); }
  static float value(Key k) { return from_order_key(k); }
  static constexpr Key kPosInf = kKeyPosInf, kNegInf = kKeyNegInf;
};
template <typename T, uint16_t kInfBits>
struct Keys16 {
  using Key = int16_t;
  static Key of(T v) {
    const auto b = static_cast<int16_t>(v.x);
    return static_cast<Key>(b ^ ((b >> 15) & 0x7FFF));
  }
  static float value(Key k) {
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

struct GroupRange {
  float lo, hi;
  bool finite;
};

template <typename T>
inline GroupRange group_range(const T* src, int64_t n) {
  using K = Keys<T>;
  typename K::Key lo = std::numeric_limits<typename K::Key>::max(), hi = std::numeric_limits<typename K::Key>::min();
  for (int64_t i = 0; i < n; ++i) {
    const auto k = K::of(src[i]);
    lo = k < lo ? k : lo;
    hi = k > hi ? k : hi;
  }
  return {K::value(lo), K::value(hi), lo > K::kNegInf && hi < K::kPosInf};
}

// Codes of n elements packed into ceil(n * bits / 8) bytes (the last byte's unused bits zero).
template <typename T, typename Codec, bool kStochastic>
inline void encode_group(const T* src, uint8_t* dst, int64_t n, const typename Codec::Params& p, uint32_t key) {
  constexpr int kPerByte = 8 / Codec::kBits;
  const int64_t whole = n / kPerByte;
  for (int64_t j = 0; j < whole; ++j) {
    uint32_t byte = 0;
    for (int k = 0; k < kPerByte; ++k) {
      const int64_t i = j * kPerByte + k;
      const float u = kStochastic ? uniform01(key, static_cast<uint32_t>(i)) : 0.5f;
      byte |= Codec::encode(p, to_float(src[i]), u) << (k * Codec::kBits);
    }
    dst[j] = static_cast<uint8_t>(byte);
  }
  if (whole * kPerByte < n) {
    uint32_t byte = 0;
    for (int64_t i = whole * kPerByte; i < n; ++i) {
      const float u = kStochastic ? uniform01(key, static_cast<uint32_t>(i)) : 0.5f;
      byte |= Codec::encode(p, to_float(src[i]), u) << ((i % kPerByte) * Codec::kBits);
    }
    dst[whole] = static_cast<uint8_t>(byte);
  }
}

template <typename T, typename Codec>
FASTCKPT_CPU_CLONES void quantize_groups(const T* x, uint8_t* codes, uint16_t* scale, uint16_t* offset, int64_t numel,
                                         int64_t group_size, int64_t begin, int64_t end, bool bf16_params,
                                         bool stochastic, uint32_t seed_key) {
  constexpr int kPerByte = 8 / Codec::kBits;
  for (int64_t g = begin; g < end; ++g) {
    const int64_t start = g * group_size;
    const int64_t n = std::min(group_size, numel - start);
    const T* src = x + start;
    uint8_t* dst = codes + start / kPerByte;
    const GroupRange range = group_range(src, n);
    const auto p = Codec::make(range.lo, range.hi, range.finite, bf16_params);
    scale[g] = static_cast<uint16_t>(p.scale_bits);
    if constexpr (Codec::kHasOffset) offset[g] = static_cast<uint16_t>(p.offset_bits);
    if (!p.finite) {  // the group decodes to NaN through its parameters
      std::fill_n(dst, (n + kPerByte - 1) / kPerByte, uint8_t{0});
    } else if (stochastic) {
      encode_group<T, Codec, true>(src, dst, n, p, group_key(seed_key, g));
    } else {
      encode_group<T, Codec, false>(src, dst, n, p, 0);
    }
  }
}

template <typename T, typename Codec>
FASTCKPT_CPU_CLONES void dequantize_groups(const uint8_t* codes, const uint16_t* scale, const uint16_t* offset,
                                           bool bf16_params, T* out, int64_t numel, int64_t group_size, int64_t begin,
                                           int64_t end) {
  constexpr int kPerByte = 8 / Codec::kBits;
  constexpr uint32_t kMask = (1u << Codec::kBits) - 1;
  for (int64_t g = begin; g < end; ++g) {
    const int64_t start = g * group_size;
    const int64_t n = std::min(group_size, numel - start);
    const uint8_t* src = codes + start / kPerByte;
    T* dst = out + start;
    const float s = param_to_float(scale[g], bf16_params);
    const float o = Codec::kHasOffset ? param_to_float(offset[g], bf16_params) : 0.f;
    const int64_t whole = n / kPerByte;
    for (int64_t j = 0; j < whole; ++j) {
      const uint32_t byte = src[j];
      for (int k = 0; k < kPerByte; ++k) {
        dst[j * kPerByte + k] = from_float<T>(Codec::decode(o, s, (byte >> (k * Codec::kBits)) & kMask));
      }
    }
    for (int64_t i = whole * kPerByte; i < n; ++i) {
      dst[i] = from_float<T>(Codec::decode(o, s, (src[whole] >> ((i % kPerByte) * Codec::kBits)) & kMask));
    }
  }
}

int64_t grain_groups(int64_t group_size) { return std::max<int64_t>(1, kGrainElems / group_size); }

template <typename Codec>
void quantize_cpu_impl(const at::Tensor& src, at::Tensor& codes, at::Tensor& scale, at::Tensor* offset,
                       int64_t group_size, bool stochastic, int64_t seed) {
  const int64_t numel = src.numel();
  if (numel == 0) return;
  const bool bf16_params = scale.scalar_type() == at::kBFloat16;
  const uint32_t key = seed_key(seed);
  uint8_t* codes_ptr = static_cast<uint8_t*>(codes.data_ptr());
  auto* scale_ptr = static_cast<uint16_t*>(scale.data_ptr());
  auto* offset_ptr = offset ? static_cast<uint16_t*>(offset->data_ptr()) : nullptr;
  FASTCKPT_DISPATCH_FLOAT_TYPES(src.scalar_type(), "quantize_cpu", [&] {
    const scalar_t* x = src.const_data_ptr<scalar_t>();
    at::parallel_for(0, num_groups(numel, group_size), grain_groups(group_size), [&](int64_t begin, int64_t end) {
      quantize_groups<scalar_t, Codec>(x, codes_ptr, scale_ptr, offset_ptr, numel, group_size, begin, end, bf16_params,
                                       stochastic, key);
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
      dequantize_groups<scalar_t, Codec>(codes_ptr, scale_ptr, offset_ptr, bf16_params, y, numel, group_size, begin,
                                         end);
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_per_group_cpu(const at::Tensor& x, int64_t bits,
                                                                      int64_t group_size, bool stochastic,
                                                                      int64_t seed) {
  auto b = prepare_quantize_per_group(x, bits, group_size);
  dispatch_affine_bits(bits, [&](auto codec) {
    quantize_cpu_impl<decltype(codec)>(b.src, b.codes, b.scale, &b.offset, group_size, stochastic, seed);
  });
  return {b.codes, b.scale, b.offset};
}

at::Tensor dequantize_per_group_cpu(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset,
                                    int64_t bits, int64_t group_size, at::ScalarType dtype, at::IntArrayRef shape) {
  const int64_t numel = check_dequantize_per_group(codes, scale, offset, bits, group_size, dtype, shape);
  at::Tensor out;
  dispatch_affine_bits(bits, [&](auto codec) {
    out = dequantize_cpu_impl<decltype(codec)>(codes, scale, &offset, group_size, dtype, shape, numel);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> quantize_fp8_per_group_cpu(const at::Tensor& x, int64_t group_size) {
  auto b = prepare_quantize_fp8(x, group_size);
  quantize_cpu_impl<Fp8Codec>(b.src, b.codes, b.scale, nullptr, group_size, false, 0);
  return {b.codes, b.scale};
}

at::Tensor dequantize_fp8_per_group_cpu(const at::Tensor& codes, const at::Tensor& scale, int64_t group_size,
                                        at::ScalarType dtype, at::IntArrayRef shape) {
  const int64_t numel = check_dequantize_fp8(codes, scale, group_size, dtype, shape);
  return dequantize_cpu_impl<Fp8Codec>(codes, scale, nullptr, group_size, dtype, shape, numel);
}

}  // namespace

TORCH_LIBRARY_IMPL(fastckpt, CPU, m) {
  m.impl("quantize_per_group", &quantize_per_group_cpu);
  m.impl("dequantize_per_group", &dequantize_per_group_cpu);
  m.impl("quantize_fp8_per_group", &quantize_fp8_per_group_cpu);
  m.impl("dequantize_fp8_per_group", &dequantize_fp8_per_group_cpu);
}

}  // namespace fastckpt
