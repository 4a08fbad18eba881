// CUDA kernels of the bitpack family. Each thread owns 16 consecutive elements (two output
// bytes): 16-byte vector loads when the block is whole and aligned, scalar loads at the tail.
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "bitpack/bitpack.h"

namespace fastckpt {
namespace {

constexpr int kElemsPerThread = 16;
constexpr int kThreads = 256;

template <typename T>
__device__ __forceinline__ bool is_set(T v) {
  return static_cast<float>(v) != 0.0f;
}
template <>
__device__ __forceinline__ bool is_set<bool>(bool v) {
  return v;
}

template <typename T>
__global__ void pack_bits_kernel(const T* __restrict__ src, uint8_t* __restrict__ dst, int64_t numel, bool aligned) {
  const int64_t nthreads = (numel + kElemsPerThread - 1) / kElemsPerThread;
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < nthreads; t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t base = t * kElemsPerThread;
    uint32_t bits = 0;
    if (aligned && base + kElemsPerThread <= numel) {
      constexpr int kVecs = kElemsPerThread * sizeof(T) / sizeof(uint4);
      uint4 vec[kVecs];
      const uint4* s = reinterpret_cast<const uint4*>(src + base);
#pragma unroll
      for (int v = 0; v < kVecs; ++v) vec[v] = s[v];
      const T* vals = reinterpret_cast<const T*>(vec);
#pragma unroll
      for (int i = 0; i < kElemsPerThread; ++i) bits |= uint32_t(is_set(vals[i])) << i;
    } else {
      for (int i = 0; i < kElemsPerThread && base + i < numel; ++i) bits |= uint32_t(is_set(src[base + i])) << i;
    }
    const int64_t byte = base / 8;
    dst[byte] = static_cast<uint8_t>(bits);
    if (base + 8 < numel) dst[byte + 1] = static_cast<uint8_t>(bits >> 8);
  }
}

__global__ void unpack_bits_kernel(const uint8_t* __restrict__ src, bool* __restrict__ dst, int64_t numel, bool aligned) {
  const int64_t nthreads = (numel + kElemsPerThread - 1) / kElemsPerThread;
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < nthreads; t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t base = t * kElemsPerThread;
    const uint32_t lo = src[base / 8];
    const uint32_t bits = base + 8 < numel ? lo | (uint32_t(src[base / 8 + 1]) << 8) : lo;
    if (aligned && base + kElemsPerThread <= numel) {
      uint4 vec;
      uint8_t* out = reinterpret_cast<uint8_t*>(&vec);
#pragma unroll
      for (int i = 0; i < kElemsPerThread; ++i) out[i] = (bits >> i) & 1;
      *reinterpret_cast<uint4*>(dst + base) = vec;
    } else {
      for (int i = 0; i < kElemsPerThread && base + i < numel; ++i) dst[base + i] = (bits >> i) & 1;
    }
  }
}

int grid_for(int64_t numel) {
  const int64_t threads_needed = (numel + kElemsPerThread - 1) / kElemsPerThread;
  return static_cast<int>(std::min<int64_t>((threads_needed + kThreads - 1) / kThreads, 65535));
}

bool is_aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

at::Tensor pack_bits_cuda(const at::Tensor& mask) {
  check_pack_bits_input(mask);
  c10::cuda::CUDAGuard guard(mask.device());
  const auto src = mask.contiguous();
  const int64_t numel = src.numel();
  auto out = at::empty({(numel + 7) / 8}, mask.options().dtype(at::kByte));
  if (numel == 0) return out;
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND3(at::kBool, at::kHalf, at::kBFloat16, src.scalar_type(), "pack_bits_cuda", [&] {
    const auto* ptr = src.const_data_ptr<scalar_t>();
    pack_bits_kernel<scalar_t><<<grid_for(numel), kThreads, 0, stream>>>(ptr, out.mutable_data_ptr<uint8_t>(), numel,
                                                                        is_aligned16(ptr));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor unpack_bits_cuda(const at::Tensor& packed, at::IntArrayRef shape) {
  const int64_t numel = check_unpack_bits_input(packed, shape);
  c10::cuda::CUDAGuard guard(packed.device());
  auto out = at::empty(shape, packed.options().dtype(at::kBool));
  if (numel == 0) return out;
  bool* dst = out.mutable_data_ptr<bool>();
  unpack_bits_kernel<<<grid_for(numel), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      packed.const_data_ptr<uint8_t>(), dst, numel, is_aligned16(dst));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(fastckpt, CUDA, m) {
  m.impl("pack_bits", &pack_bits_cuda);
  m.impl("unpack_bits", &unpack_bits_cuda);
}

}  // namespace fastckpt
