"""fastckpt: an activation-memory engine for PyTorch training (drop-in torch.utils.checkpoint)."""

from fastckpt import _extension

if _extension.load_error(_extension.OPS) is None:
    # The ops' fake kernels register on import: torch.compile traces graphs that call torch.ops.fastckpt.*.
    from fastckpt import ops  # noqa: F401
from fastckpt.api import CheckpointWrapper, apply, checkpoint, checkpoint_sequential, wrap
from fastckpt.compiled import compile
from fastckpt.heads import linear_cross_entropy, linear_log_probs
from fastckpt.hybrid import selective
from fastckpt.optimizer_in_backward import OptimizerInBackward, optimizer_in_backward
from fastckpt.planner import Plan, plan
from fastckpt.policies import Policy, current_policy, policy
from fastckpt.storage.accounting import track
from fastckpt.tiling import tiled

__version__ = "0.1.0"
__all__ = [
    "CheckpointWrapper",
    "OptimizerInBackward",
    "Plan",
    "Policy",
    "apply",
    "checkpoint",
    "checkpoint_sequential",
    "compile",
    "current_policy",
    "linear_cross_entropy",
    "linear_log_probs",
    "optimizer_in_backward",
    "plan",
    "policy",
    "selective",
    "tiled",
    "track",
    "wrap",
]
