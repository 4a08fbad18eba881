// The one place where fastckpt's operator schemas are defined.
// Kernels live in csrc/<family>/<family>_{cpu.cpp,cuda.cu} and register themselves
// per dispatch key with TORCH_LIBRARY_IMPL; fake (meta) kernels live in fastckpt/ops/.
#include <torch/library.h>

TORCH_LIBRARY(fastckpt, m) {
  // ---- bitpack: exact 1-bit storage of masks ----
  // Packs the nonzero pattern of `mask` (bool, or fp32/fp16/bf16 where x != 0 counts as set;
  // NaN counts as set) into uint8, little-endian bit order: bit i of byte j is element 8*j+i
  // of the row-major flattened tensor. Returns a 1-D uint8 tensor of ceil(numel / 8) bytes.
  m.def("pack_bits(Tensor mask) -> Tensor");
  // Inverse of pack_bits: a bool tensor of `shape`; packed must hold at least ceil(prod(shape)/8) bytes.
  m.def("unpack_bits(Tensor packed, SymInt[] shape) -> Tensor");

  // ---- quantize: lossy per-group storage of activations (layout and rounding: csrc/quantize/quantize.h) ----
  // x (float32/float16/bfloat16, any shape and strides) is flattened row-major and cut into groups of
  // group_size elements (the last may be shorter). Each group stores offset = its min rounded down
  // and scale = (max - offset) / (2^bits - 1) rounded up, both as float16 for float16 inputs and
  // bfloat16 otherwise, plus one code per element in [0, 2^bits - 1], x ~= offset + code * scale.
  // Codes are bit-packed densely into a 1-D uint8 tensor of ceil(numel * bits / 8) bytes, little-endian
  // (element i at bit (i % (8/bits)) * bits of byte i*bits/8). bits is 8, 4 or 2; group_size a positive
  // multiple of 8/bits. Rounding is to nearest (error <= scale/2), or with stochastic=True unbiased
  // stochastic rounding driven by a counter-based hash of (seed, group, index): same seed, same codes,
  // on every device. A group holding NaN or Inf stores NaN scale and offset: it decodes to all-NaN.
  // Returns (codes, scale, offset); scale and offset are 1-D with ceil(numel / group_size) entries.
  m.def(
      "quantize_per_group(Tensor x, int bits, int group_size, bool stochastic=False, int seed=0) -> "
      "(Tensor codes, Tensor scale, Tensor offset)");
  // Inverse of quantize_per_group: a contiguous tensor of `shape` and `dtype` (float32/float16/bfloat16),
  // element = offset + code * scale computed in float32, then rounded to dtype.
  m.def(
      "dequantize_per_group(Tensor codes, Tensor scale, Tensor offset, int bits, int group_size, ScalarType dtype, "
      "SymInt[] shape) -> Tensor");
  // fp8 storage: codes are float8_e4m3fn bit patterns, one byte per element in a 1-D uint8 tensor (uint8
  // like all codes, so storage and opcheck treat them as plain bytes; .view(torch.float8_e4m3fn) reads
  // them). Each group of group_size elements has a power-of-two scale 2^e, stored exactly as bfloat16: the
  // smallest with max|x| / 2^e <= 448; code = x / 2^e rounded to nearest even. A group holding NaN or Inf
  // stores a NaN scale and decodes to all-NaN. Returns (codes, scale); scale has one entry per group.
  m.def("quantize_fp8_per_group(Tensor x, int group_size) -> (Tensor codes, Tensor scale)");
  // Inverse of quantize_fp8_per_group: code * scale in float32, rounded to dtype, as a tensor of `shape`.
  m.def(
      "dequantize_fp8_per_group(Tensor codes, Tensor scale, int group_size, ScalarType dtype, SymInt[] shape) "
      "-> Tensor");
}
