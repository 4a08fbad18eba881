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
  // group_size elements (the last may be shorter; a group_size of numel or more means one group).
  // Each group stores offset = its min rounded down and scale = (max - offset) / (2^bits - 1) rounded up,
  // both as float16 for float16 inputs and bfloat16 otherwise, plus one code per element in
  // [0, 2^bits - 1], x ~= offset + code * scale.
  // Codes are bit-packed densely into a 1-D uint8 tensor of ceil(numel * bits / 8) bytes, little-endian
  // (element i at bit (i % (8/bits)) * bits of byte i*bits/8). bits is 8, 4 or 2; group_size a positive
  // multiple of 8/bits, at most 2^31 - 1. Rounding is to nearest, or with stochastic=True unbiased stochastic
  // rounding driven by a counter-based hash of (seed, group, index): same seed, same codes, on every device.
  // Zero is exact: where the grid reaches 0, the code 0 rounds to (the zero code, -offset / scale to nearest,
  // found from the stored parameters alone) decodes to exactly 0; it errs by at most one scale, and stochastic
  // rounding next to it picks between the neighbouring values so that it stays unbiased (at most 1.5 scales
  // away). A constant group is exact for 16-bit inputs (offset = the value).
  // Error bound (round to nearest), with scale and offset as stored: |x - decoded| <= scale / 2, plus a few
  // float32 ulps of |offset| + (2^bits - 1) * scale, plus the rounding of the decoded value to its dtype.
  // It holds up to each dtype's maximum: finite groups always get finite parameters and decode to finite
  // values (max - offset beyond FLT_MAX is computed on halves; the offset saturates at the 16-bit
  // format's lowest; the scale then always fits: at most 2.26e38 for bf16, 43669 for fp16). One
  // exception: float32 values below bfloat16's lowest (-3.3895e38) decode to it (the group's offset
  // saturates there), an error below 2^120 (~1.33e36, bf16's ulp there).
  // Non-finite values survive: a group holding NaN or +-Inf ("special") takes offset and scale from its
  // finite elements, stores its scale negated (the flag; other scales are positive), and gives NaN, +Inf
  // and -Inf the reserved codes 2^bits - 1, 2^bits - 2 and 2^bits - 3; its finite elements use the codes
  // below (a grid of 2^bits - 4 steps; int2: a single code, their minimum rounded down), with the bound
  // above for that grid's scale. Detected in the same min/max pass, at no extra pass over the data.
  // Returns (codes, scale, offset); scale and offset are 1-D with ceil(numel / group_size) entries.
  m.def(
      "quantize_per_group(Tensor x, int bits, int group_size, bool stochastic=False, int seed=0) -> "
      "(Tensor codes, Tensor scale, Tensor offset)");
  // Inverse of quantize_per_group: a contiguous tensor of `shape` and `dtype` (float32/float16/bfloat16),
  // element = offset + code * scale rounded once to float32 (exactly 0 for the zero code; the product is
  // exact; where it overflows float32 the sum is taken on halves), clamped to dtype's finite range, then
  // rounded to dtype: finite
  // parameters never decode to Inf, and the clamp only moves values toward the original. A group whose
  // scale or offset is NaN or Inf decodes to dtype's canonical quiet NaN (0x7FC00000, 0x7E00, 0x7FC0). In a
  // group whose scale is negative (special), the reserved codes decode to +Inf, -Inf and the canonical NaN
  // (a NaN's sign and payload are not kept), the others as above with the scale's magnitude.
  m.def(
      "dequantize_per_group(Tensor codes, Tensor scale, Tensor offset, int bits, int group_size, ScalarType dtype, "
      "SymInt[] shape) -> Tensor");
  // fp8 storage: codes are float8_e4m3fn bit patterns, one byte per element in a 1-D uint8 tensor (uint8
  // like all codes, so storage and opcheck treat them as plain bytes; .view(torch.float8_e4m3fn) reads
  // them). Each group of group_size elements (1 to 2^31 - 1) has a power-of-two scale 2^e, stored exactly as
  // bfloat16: the smallest with max|x| / 2^e <= 448; code = x / 2^e rounded to nearest even. Error bound:
  // half an e4m3 step of x / 2^e, times 2^e, plus the rounding of the decoded value to its dtype; it holds
  // up to each dtype's maximum (decoding clamps, see below). A group holding NaN or +-Inf (special) takes its
  // scale from its finite elements, scaled to at most 416 so that no finite element gets e4m3's 448, stores it
  // negated, and codes NaN, +Inf, -Inf as 0x7F, 0x7E (+448), 0xFE (-448). Returns (codes, scale); scale has
  // one entry per group.
  m.def("quantize_fp8_per_group(Tensor x, int group_size) -> (Tensor codes, Tensor scale)");
  // Inverse of quantize_fp8_per_group: code * scale in float32 (exact, or Inf where it overflows), clamped
  // to dtype's finite range, rounded to dtype, as a tensor of `shape`. e4m3 rounding can carry the top
  // ~3% of a binade (1.9375 * 2^k and up) to 2^(k+1) whatever the exponent, past the dtype's maximum for
  // its top binade; the clamp brings such values back, closer to the original. A NaN or Inf scale decodes
  // to all-NaN (dtype's canonical quiet NaN). A negative scale (special group): 0x7E and 0xFE decode to
  // +Inf and -Inf, e4m3's NaN codes to the canonical NaN, the others with the scale's magnitude.
  m.def(
      "dequantize_fp8_per_group(Tensor codes, Tensor scale, int group_size, ScalarType dtype, SymInt[] shape) "
      "-> Tensor");
}
