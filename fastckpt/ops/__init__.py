"""fastckpt's compiled ops: typed wrappers (each with a fake kernel) and their pure-PyTorch references."""

from fastckpt.ops.bitpack import pack_bits, unpack_bits
from fastckpt.ops.quantize import (
    DEFAULT_GROUP_SIZE,
    FP8_DEFAULT_GROUP_SIZE,
    MAX_GROUP_SIZE,
    dequantize_fp8_per_group,
    dequantize_per_group,
    quantize_fp8_per_group,
    quantize_per_group,
)

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "FP8_DEFAULT_GROUP_SIZE",
    "MAX_GROUP_SIZE",
    "dequantize_fp8_per_group",
    "dequantize_per_group",
    "pack_bits",
    "quantize_fp8_per_group",
    "quantize_per_group",
    "unpack_bits",
]
