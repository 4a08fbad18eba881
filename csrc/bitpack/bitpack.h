// Shared argument checks for the bitpack family (CPU and CUDA kernels agree on them).
#pragma once
#include <ATen/ATen.h>

namespace fastckpt {

inline void check_pack_bits_input(const at::Tensor& mask) {
  const auto dtype = mask.scalar_type();
  TORCH_CHECK(dtype == at::kBool || dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
              "pack_bits: mask has dtype ", dtype,
              "; expected bool, or float32/float16/bfloat16 (whose nonzero pattern is packed)");
  TORCH_CHECK(mask.layout() == at::kStrided, "pack_bits: mask must be a strided (dense) tensor, got layout ",
              mask.layout());
}

inline int64_t check_unpack_bits_input(const at::Tensor& packed, at::IntArrayRef shape) {
  TORCH_CHECK(packed.scalar_type() == at::kByte, "unpack_bits: packed has dtype ", packed.scalar_type(),
              "; expected uint8 as returned by pack_bits");
  TORCH_CHECK(packed.dim() == 1 && packed.is_contiguous(),
              "unpack_bits: packed must be the contiguous 1-D tensor returned by pack_bits");
  int64_t numel = 1;
  for (auto s : shape) {
    TORCH_CHECK(s >= 0, "unpack_bits: shape has a negative size ", s);
    numel *= s;
  }
  TORCH_CHECK(packed.numel() * 8 >= numel, "unpack_bits: packed holds ", packed.numel(), " bytes but shape ",
              shape, " needs ", (numel + 7) / 8);
  return numel;
}

}  // namespace fastckpt
