"""debug=True: record the operators run in forward and in recompute, and show both when they disagree."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import NoReturn

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointError


class _OpRecorder(TorchDispatchMode):
    """Logs each aten op with the user-code frame that issued it."""

    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frames = [
            f for f in traceback.extract_stack()[:-1] if "torch/" not in f.filename and "fastckpt/" not in f.filename
        ]
        where = f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else "<unknown>"
        self.log.append(f"{func}    ({where})")
        return func(*args, **(kwargs or {}))


class OpTrace:
    """A context_fn pair that records forward and recompute op logs, and an error callback that prints them."""

    def __init__(self) -> None:
        self.forward_ops: list[str] = []
        self.recompute_ops: list[str] = []

    def context_fn(self) -> tuple[_OpRecorder, _OpRecorder]:
        """The (forward, recompute) contexts to pass where a context_fn result is expected."""
        self.recompute_ops.clear()
        return _OpRecorder(self.forward_ops), _OpRecorder(self.recompute_ops)

    def raise_with_trace(self, error: CheckpointError) -> NoReturn:
        """Re-raise a determinism error with both op logs attached."""

        def numbered(ops: list[str]) -> str:
            return "\n".join(f"  {i + 1:>4}. {op}" for i, op in enumerate(ops)) or "  (none)"

        problem = str(error).split("\nTip:")[0]  # the tip says to pass debug=True: already done
        raise CheckpointError(
            "An error happened while unpacking tensors; dumping logs of latest computation\n"
            "because you passed `debug=True` to `fastckpt.checkpoint()` (or enabled checkpoint debugging).\n"
            f"{problem}\n\nOperators in the original forward:\n"
            f"{numbered(self.forward_ops)}\n\nOperators in the recomputation:\n{numbered(self.recompute_ops)}\n\n"
            # torch's closing paragraph, word for word: tests written against torch match it.
            f"{_TORCH_CLOSING}\n"
            "The first line where the two lists differ is where forward and recompute diverged."
        ) from error


_TORCH_CLOSING = (
    "ERROR: Detected non-determinism while running activation checkpointing\n\n"
    "You are seeing this error because you passed `debug=True` to checkpoint and\n"
    "tensors to be saved during the original forward and differ between those saved\n"
    "during recomputation. This can happen if different operators were ran in the\n"
    "original forward and in the recomputation.\n"
)


UnpackErrorCallback = Callable[[CheckpointError], NoReturn]
