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
}
