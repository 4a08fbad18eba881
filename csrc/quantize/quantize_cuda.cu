// CUDA kernels of the quantize family, with the codec math of quantize.h (bit-identical to the CPU).
//
// Quantize, one pass over the input: a team of lanes (a power of two <= 32, inside one warp) owns a
// group. Each lane loads up to kRegisterChunks 16-byte chunks of the group into registers (several
// independent loads in flight per lane keep HBM busy), the team reduces min/max with butterfly
// shuffles, then each lane encodes its chunks from registers and stores their packed codes (1-8
// bytes each; the team's lanes are adjacent in memory). Groups wider than 32 lanes x kRegisterChunks
// chunks re-read the remainder, which the first phase has just brought into L1/L2.
// Dequantize: each thread rebuilds kDequantChunks 16-byte chunks of output from their packed codes.
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <climits>
#include <tuple>

#include "quantize/quantize.h"

namespace fastckpt {
namespace {

using namespace quant;

constexpr int kThreads = 256;
constexpr int kRegisterChunks = 4;
constexpr int kDequantChunks = 2;
constexpr int64_t kMaxBlocks = 65535;

template <typename T>
constexpr int chunk_elems() {
  return 16 / sizeof(T);  // elements per 16-byte load
}

// Loads chunk [c, c + V) of a group of n elements as floats (zeros past n).
template <typename T, int V>
__device__ __forceinline__ void load_chunk(const T* __restrict__ src, int64_t c, int64_t n, bool vector,
                                           float (&out)[V]) {
  if (vector && c + V <= n) {
    const uint4 raw = *reinterpret_cast<const uint4*>(src + c);
    const T* vals = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int v = 0; v < V; ++v) out[v] = to_float(vals[v]);
  } else {
#pragma unroll
    for (int v = 0; v < V; ++v) out[v] = c + v < n ? to_float(src[c + v]) : 0.f;
  }
}

// Min and max order keys of the finite elements; `special` is set by any NaN or +-Inf.
template <int V>
__device__ __forceinline__ void reduce_keys(const float (&vals)[V], int64_t c, int64_t n, int32_t& lo, int32_t& hi,
                                            int32_t& special) {
#pragma unroll
  for (int v = 0; v < V; ++v) {
    if (c + v < n) {
      const int32_t k = order_key(vals[v]);
      const bool finite = key_finite(k);
      special |= !finite;
      lo = min(lo, finite ? k : INT_MAX);
      hi = max(hi, finite ? k : INT_MIN);
    }
  }
}

template <int kBytes>
__device__ __forceinline__ void store_bytes(uint8_t* dst, uint64_t v) {
  if constexpr (kBytes == 8) *reinterpret_cast<uint64_t*>(dst) = v;
  if constexpr (kBytes == 4) *reinterpret_cast<uint32_t*>(dst) = static_cast<uint32_t>(v);
  if constexpr (kBytes == 2) *reinterpret_cast<uint16_t*>(dst) = static_cast<uint16_t>(v);
  if constexpr (kBytes == 1) *dst = static_cast<uint8_t>(v);
}

template <int kBytes>
__device__ __forceinline__ uint64_t load_bytes(const uint8_t* src) {
  if constexpr (kBytes == 8) return *reinterpret_cast<const uint64_t*>(src);
  if constexpr (kBytes == 4) return *reinterpret_cast<const uint32_t*>(src);
  if constexpr (kBytes == 2) return *reinterpret_cast<const uint16_t*>(src);
  return *src;
}

// Encodes chunk [c, c + V) of a group and stores its packed codes at dst (the group's first byte).
template <typename Codec, int V>
__device__ __forceinline__ void encode_chunk(const float (&vals)[V], uint8_t* __restrict__ dst, int64_t c, int64_t n,
                                             const typename Codec::Params& p, uint32_t key, bool stochastic,
                                             bool vector) {
  uint64_t packed = 0;
#pragma unroll
  for (int v = 0; v < V; ++v) {
    if (c + v < n) {
      const float u = stochastic ? uniform01(key, static_cast<uint32_t>(c + v)) : 0.5f;
      // a special group's NaN and +-Inf take reserved codes
      const uint32_t code = p.special   ? Codec::encode_special(p, vals[v], u, stochastic)
                            : stochastic ? Codec::encode_stochastic(p, vals[v], u)
                                         : Codec::encode(p, vals[v], u);
      packed |= static_cast<uint64_t>(code) << (v * Codec::kBits);
    }
  }
  uint8_t* out = dst + c * Codec::kBits / 8;
  constexpr int kBytes = V * Codec::kBits / 8;
  if (vector && c + V <= n) {
    store_bytes<kBytes>(out, packed);
  } else {
    const int64_t elems = n - c < V ? n - c : V;
    const int bytes = static_cast<int>((elems * Codec::kBits + 7) / 8);
    for (int b = 0; b < bytes; ++b) out[b] = static_cast<uint8_t>(packed >> (8 * b));
  }
}

template <typename T, typename Codec>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(const T* __restrict__ x, uint8_t* __restrict__ codes, uint16_t* __restrict__ scale,
                    uint16_t* __restrict__ offset, int64_t numel, int64_t group_size, int64_t groups, int team_log2,
                    bool vector, bool bf16_params, bool stochastic, uint32_t seed_key) {
  constexpr int V = chunk_elems<T>();
  const int lane = threadIdx.x & 31;
  const int team = 1 << team_log2;
  const int rank = lane & (team - 1);
  const int64_t groups_per_warp = 32 >> team_log2;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  // The trip count is the same for the whole warp, so every lane reaches the shuffles.
  for (int64_t first = warp * groups_per_warp; first < groups; first += warps * groups_per_warp) {
    const int64_t g = first + (lane >> team_log2);
    const int64_t start = g * group_size;
    const int64_t n = g < groups ? min(group_size, numel - start) : 0;
    const T* src = x + (g < groups ? start : 0);

    float vals[kRegisterChunks][V];
    int32_t lo = INT_MAX, hi = INT_MIN, special = 0;
#pragma unroll
    for (int it = 0; it < kRegisterChunks; ++it) {
      const int64_t c = (static_cast<int64_t>(it) * team + rank) * V;
      load_chunk(src, c, n, vector, vals[it]);
      reduce_keys(vals[it], c, n, lo, hi, special);
    }
    const int64_t lane_stride = static_cast<int64_t>(team) * V;
    for (int64_t c = (static_cast<int64_t>(kRegisterChunks) * team + rank) * V; c < n; c += lane_stride) {
      float more[V];
      load_chunk(src, c, n, vector, more);
      reduce_keys(more, c, n, lo, hi, special);
    }
    for (int lanes = team >> 1; lanes > 0; lanes >>= 1) {
      lo = min(lo, __shfl_xor_sync(0xFFFFFFFFu, lo, lanes));
      hi = max(hi, __shfl_xor_sync(0xFFFFFFFFu, hi, lanes));
      special |= __shfl_xor_sync(0xFFFFFFFFu, special, lanes);
    }
    if (n == 0) continue;
    if (lo > hi) lo = hi = 0;  // no finite element: the range of +0.0, as on the CPU

    const auto p = Codec::make(from_order_key(lo), from_order_key(hi), special != 0, bf16_params);
    if (rank == 0) {
      scale[g] = static_cast<uint16_t>(p.scale_bits);
      if constexpr (Codec::kHasOffset) offset[g] = static_cast<uint16_t>(p.offset_bits);
    }
    const uint32_t key = stochastic ? group_key(seed_key, g) : 0u;
    uint8_t* dst = codes + start * Codec::kBits / 8;
#pragma unroll
    for (int it = 0; it < kRegisterChunks; ++it) {
      const int64_t c = (static_cast<int64_t>(it) * team + rank) * V;
      if (c < n) encode_chunk<Codec>(vals[it], dst, c, n, p, key, stochastic, vector);
    }
    for (int64_t c = (static_cast<int64_t>(kRegisterChunks) * team + rank) * V; c < n; c += lane_stride) {
      float more[V];
      load_chunk(src, c, n, vector, more);
      encode_chunk<Codec>(more, dst, c, n, p, key, stochastic, vector);
    }
  }
}

// 64-bit division costs far more than 32-bit on the GPU; chunk indices fit 32 bits below 64 GiB.
__device__ __forceinline__ int64_t group_of_chunk(int64_t chunk, int64_t chunks_per_group) {
  if ((chunk | chunks_per_group) <= INT_MAX) {
    return static_cast<uint32_t>(chunk) / static_cast<uint32_t>(chunks_per_group);
  }
  return chunk / chunks_per_group;
}

// One decoded element as T, bit-identical to the CPU kernels: clamped to T's finite range, a special
// group's reserved codes as NaN and +-Inf, and the canonical NaN for NaN (a device conversion of a NaN
// could give other bits) and for non-finite parameters.
template <typename T, typename Codec>
__device__ __forceinline__ T decode_to(float o, float s, uint32_t zero, uint32_t code) {
  const bool special = is_special_scale(s);
  const float y = special ? decode_special<Codec>(o, -s, code, finite_max<T>(), zero)
                  : code == zero ? 0.f
                                 : decode_saturated<Codec>(o, s, code, finite_max<T>());
  return is_finite_float(o) && is_finite_float(s) && (float_bits(y) & 0x7FFFFFFFu) <= 0x7F800000u ? from_float<T>(y)
                                                                                                 : quiet_nan<T>();
}

// Rebuilds output elements [base, base + V) one by one: chunks that straddle groups or the end.
template <typename T, typename Codec>
__device__ __forceinline__ void dequantize_elements(const uint8_t* __restrict__ codes,
                                                    const uint16_t* __restrict__ scale,
                                                    const uint16_t* __restrict__ offset, T* __restrict__ out,
                                                    int64_t base, int64_t numel, int64_t group_size, bool bf16_params) {
  constexpr int kBits = Codec::kBits;
  for (int64_t i = base; i < base + chunk_elems<T>() && i < numel; ++i) {
    const int64_t g = i / group_size;
    const float s = param_to_float(scale[g], bf16_params);
    const float o = Codec::kHasOffset ? param_to_float(offset[g], bf16_params) : 0.f;
    const uint32_t code = (codes[i * kBits / 8] >> ((i % (8 / kBits)) * kBits)) & ((1u << kBits) - 1);
    out[i] = decode_to<T, Codec>(o, s, stored_zero_code<Codec>(o, s), code);
  }
}

template <typename T, typename Codec>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const uint8_t* __restrict__ codes, const uint16_t* __restrict__ scale,
                      const uint16_t* __restrict__ offset, T* __restrict__ out, int64_t numel, int64_t group_size,
                      bool vector, bool bf16_params) {
  constexpr int V = chunk_elems<T>();
  constexpr int kBits = Codec::kBits;
  constexpr int kBytes = V * kBits / 8;
  constexpr uint32_t kMask = (1u << kBits) - 1;
  const int64_t chunks = (numel + V - 1) / V;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; first < chunks;
       first += threads * kDequantChunks) {
    // Issue all code loads before decoding, so each thread keeps kDequantChunks loads in flight.
    uint64_t packed[kDequantChunks];
#pragma unroll
    for (int k = 0; k < kDequantChunks; ++k) {
      const int64_t t = first + k * threads;
      packed[k] = vector && (t + 1) * V <= numel ? load_bytes<kBytes>(codes + t * kBytes) : 0;
    }
#pragma unroll
    for (int k = 0; k < kDequantChunks; ++k) {
      const int64_t t = first + k * threads;
      if (t >= chunks) break;
      if (!(vector && (t + 1) * V <= numel)) {
        dequantize_elements<T, Codec>(codes, scale, offset, out, t * V, numel, group_size, bf16_params);
        continue;
      }
      const int64_t g = group_of_chunk(t, group_size / V);  // one group per chunk: group_size % V == 0
      const float s = param_to_float(scale[g], bf16_params);
      const float o = Codec::kHasOffset ? param_to_float(offset[g], bf16_params) : 0.f;
      const uint32_t zero = stored_zero_code<Codec>(o, s);
      uint4 raw;
      T* vals = reinterpret_cast<T*>(&raw);
#pragma unroll
      for (int v = 0; v < V; ++v) {
        vals[v] = decode_to<T, Codec>(o, s, zero, static_cast<uint32_t>(packed[k] >> (v * kBits)) & kMask);
      }
      *reinterpret_cast<uint4*>(out + t * V) = raw;
    }
  }
}

bool aligned(const void* p, int64_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

int blocks_for(int64_t threads) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((threads + kThreads - 1) / kThreads, kMaxBlocks)));
}

template <typename Codec>
void quantize_cuda_impl(const QuantizeBuffers& b, int64_t group_size, bool stochastic, int64_t seed) {
  const int64_t numel = b.src.numel();
  if (numel == 0) return;
  const int64_t groups = num_groups(numel, group_size);
  auto stream = c10::cuda::getCurrentCUDAStream();
  FASTCKPT_DISPATCH_FLOAT_TYPES(b.src.scalar_type(), "quantize_cuda", [&] {
    constexpr int V = chunk_elems<scalar_t>();
    const scalar_t* x = b.src.const_data_ptr<scalar_t>();
    // Lanes per group: enough that each lane holds at most kRegisterChunks chunks, at most a warp.
    const int64_t lane_chunks = ((group_size + V - 1) / V + kRegisterChunks - 1) / kRegisterChunks;
    int team_log2 = 0;
    while (team_log2 < 5 && (int64_t{1} << team_log2) < lane_chunks) ++team_log2;
    const int64_t warps = (groups + (32 >> team_log2) - 1) / (32 >> team_log2);
    const bool vector = group_size % V == 0 && aligned(x, 16);
    quantize_kernel<scalar_t, Codec><<<blocks_for(warps * 32), kThreads, 0, stream>>>(
        x, static_cast<uint8_t*>(b.codes.data_ptr()), static_cast<uint16_t*>(b.scale.data_ptr()),
        b.offset.defined() ? static_cast<uint16_t*>(b.offset.data_ptr()) : nullptr, numel, group_size, groups,
        team_log2, vector, b.scale.scalar_type() == at::kBFloat16, stochastic, seed_key(seed));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

template <typename Codec>
at::Tensor dequantize_cuda_impl(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor* offset,
                                int64_t group_size, at::ScalarType dtype, at::IntArrayRef shape, int64_t numel) {
  auto out = at::empty(shape, codes.options().dtype(dtype));
  if (numel == 0) return out;
  const auto codes_c = codes.contiguous();
  const auto scale_c = scale.contiguous();
  const auto offset_c = offset ? offset->contiguous() : at::Tensor();
  const auto* codes_ptr = static_cast<const uint8_t*>(codes_c.const_data_ptr());
  auto stream = c10::cuda::getCurrentCUDAStream();
  FASTCKPT_DISPATCH_FLOAT_TYPES(dtype, "dequantize_cuda", [&] {
    constexpr int V = chunk_elems<scalar_t>();
    scalar_t* y = out.mutable_data_ptr<scalar_t>();
    const bool vector = group_size % V == 0 && aligned(codes_ptr, V * Codec::kBits / 8) && aligned(y, 16);
    const int blocks = blocks_for(((numel + V - 1) / V + kDequantChunks - 1) / kDequantChunks);
    dequantize_kernel<scalar_t, Codec><<<blocks, kThreads, 0, stream>>>(
        codes_ptr, static_cast<const uint16_t*>(scale_c.const_data_ptr()),
        offset ? static_cast<const uint16_t*>(offset_c.const_data_ptr()) : nullptr, y, numel, group_size, vector,
        scale.scalar_type() == at::kBFloat16);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_per_group_cuda(const at::Tensor& x, int64_t bits,
                                                                       int64_t group_size, bool stochastic,
                                                                       int64_t seed) {
  c10::cuda::CUDAGuard guard(x.device());
  auto b = prepare_quantize_per_group(x, bits, group_size);
  const int64_t group = effective_group_size(b.src.numel(), group_size);
  dispatch_affine_bits(bits, [&](auto codec) { quantize_cuda_impl<decltype(codec)>(b, group, stochastic, seed); });
  return {b.codes, b.scale, b.offset};
}

at::Tensor dequantize_per_group_cuda(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset,
                                     int64_t bits, int64_t group_size, at::ScalarType dtype, at::IntArrayRef shape) {
  const int64_t numel = check_dequantize_per_group(codes, scale, offset, bits, group_size, dtype, shape);
  c10::cuda::CUDAGuard guard(codes.device());
  const int64_t group = effective_group_size(numel, group_size);
  at::Tensor out;
  dispatch_affine_bits(bits, [&](auto codec) {
    out = dequantize_cuda_impl<decltype(codec)>(codes, scale, &offset, group, dtype, shape, numel);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> quantize_fp8_per_group_cuda(const at::Tensor& x, int64_t group_size) {
  c10::cuda::CUDAGuard guard(x.device());
  auto b = prepare_quantize_fp8(x, group_size);
  quantize_cuda_impl<Fp8Codec>(b, effective_group_size(b.src.numel(), group_size), false, 0);
  return {b.codes, b.scale};
}

at::Tensor dequantize_fp8_per_group_cuda(const at::Tensor& codes, const at::Tensor& scale, int64_t group_size,
                                         at::ScalarType dtype, at::IntArrayRef shape) {
  const int64_t numel = check_dequantize_fp8(codes, scale, group_size, dtype, shape);
  c10::cuda::CUDAGuard guard(codes.device());
  return dequantize_cuda_impl<Fp8Codec>(codes, scale, nullptr, effective_group_size(numel, group_size), dtype,
                                        shape, numel);
}

}  // namespace

TORCH_LIBRARY_IMPL(fastckpt, CUDA, m) {
  m.impl("quantize_per_group", &quantize_per_group_cuda);
  m.impl("dequantize_per_group", &dequantize_per_group_cuda);
  m.impl("quantize_fp8_per_group", &quantize_fp8_per_group_cuda);
  m.impl("dequantize_fp8_per_group", &dequantize_fp8_per_group_cuda);
}

}  // namespace fastckpt
