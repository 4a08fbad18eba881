"""fastckpt's compiled ops: typed wrappers (each with a fake kernel) and their pure-PyTorch references."""

from fastckpt.ops.bitpack import pack_bits, unpack_bits

__all__ = ["pack_bits", "unpack_bits"]
