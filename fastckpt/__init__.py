"""fastckpt: an activation-memory engine for PyTorch training (drop-in torch.utils.checkpoint)."""

from fastckpt import _extension  # noqa: F401  (loads fastckpt._C and registers its ops)
from fastckpt.api import checkpoint, checkpoint_sequential
from fastckpt.policy import Policy, current_policy, policy

__version__ = "0.1.0"
__all__ = ["Policy", "checkpoint", "checkpoint_sequential", "current_policy", "policy"]
