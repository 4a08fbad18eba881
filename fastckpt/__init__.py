"""fastckpt: an activation-memory engine for PyTorch training (drop-in torch.utils.checkpoint)."""

from fastckpt import _extension  # noqa: F401  (loads fastckpt._C and registers its ops)
from fastckpt.api import CheckpointWrapper, apply, checkpoint, checkpoint_sequential, wrap
from fastckpt.planner import Plan, plan
from fastckpt.policies import Policy, current_policy, policy
from fastckpt.storage.accounting import track

__version__ = "0.1.0"
__all__ = [
    "CheckpointWrapper",
    "Plan",
    "Policy",
    "apply",
    "checkpoint",
    "checkpoint_sequential",
    "current_policy",
    "plan",
    "policy",
    "track",
    "wrap",
]
