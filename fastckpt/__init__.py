"""fastckpt: an activation-memory engine for PyTorch training (drop-in torch.utils.checkpoint)."""

from fastckpt import _extension  # noqa: F401  (loads fastckpt._C and registers its ops)

__version__ = "0.1.0"
