// CPU kernels of the bitpack family: one pass, parallel over output bytes.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "bitpack/bitpack.h"

namespace fastckpt {
namespace {

constexpr int64_t kGrainBytes = 1 << 14;

template <typename T>
void pack_bits_kernel(const T* src, uint8_t* dst, int64_t numel) {
  const int64_t full_bytes = numel / 8;
  at::parallel_for(0, full_bytes, kGrainBytes, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const T* s = src + b * 8;
      uint8_t byte = 0;
      for (int i = 0; i < 8; ++i) byte |= static_cast<uint8_t>(s[i] != T(0)) << i;
      dst[b] = byte;
    }
  });
  if (numel % 8) {  // the partial last byte, its unused high bits zero
    uint8_t byte = 0;
    for (int64_t i = full_bytes * 8; i < numel; ++i) byte |= static_cast<uint8_t>(src[i] != T(0)) << (i % 8);
    dst[full_bytes] = byte;
  }
}

at::Tensor pack_bits_cpu(const at::Tensor& mask) {
  check_pack_bits_input(mask);
  const auto src = mask.contiguous();
  const int64_t numel = src.numel();
  auto out = at::empty({(numel + 7) / 8}, mask.options().dtype(at::kByte));
  if (numel == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND3(at::kBool, at::kHalf, at::kBFloat16, src.scalar_type(), "pack_bits_cpu", [&] {
    pack_bits_kernel<scalar_t>(src.const_data_ptr<scalar_t>(), out.mutable_data_ptr<uint8_t>(), numel);
  });
  return out;
}

at::Tensor unpack_bits_cpu(const at::Tensor& packed, at::IntArrayRef shape) {
  const int64_t numel = check_unpack_bits_input(packed, shape);
  auto out = at::empty(shape, packed.options().dtype(at::kBool));
  if (numel == 0) return out;
  const uint8_t* src = packed.const_data_ptr<uint8_t>();
  bool* dst = out.mutable_data_ptr<bool>();
  at::parallel_for(0, (numel + 7) / 8, kGrainBytes, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const uint8_t byte = src[b];
      const int n = static_cast<int>(std::min<int64_t>(8, numel - b * 8));
      for (int i = 0; i < n; ++i) dst[b * 8 + i] = (byte >> i) & 1;
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(fastckpt, CPU, m) {
  m.impl("pack_bits", &pack_bits_cpu);
  m.impl("unpack_bits", &unpack_bits_cpu);
}

}  // namespace fastckpt
