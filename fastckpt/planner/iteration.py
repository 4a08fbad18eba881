"""Every planner run as an iteration of the loop the user runs: the gradients as the loop leaves them before its
step, the optimizer's step when one is given, and everything the run changed put back afterwards.

A training loop calls `optimizer.zero_grad()` (`Trainer` and torch's default: `set_to_none=True`) before its
step, so the step's backward allocates the gradients: they are part of the step's peak. A run that starts with
gradients that already exist accumulates into them and misses those bytes; its measured peak is below the
loop's. So by default (`gradients="set_to_none"`) every run starts with the parameters' gradients set to None and
the caller's gradients are put back after it. `gradients="kept"` is the other convention (gradients kept and
accumulated into: `zero_grad(set_to_none=False)`, the later micro-steps of gradient accumulation): the runs
accumulate into gradients of the planner's own, which the first run of a session allocates (the caller's are
not touched). With gradient accumulation under `set_to_none`, the first micro-step is the one that allocates the
gradients, and it is the step the planner measures: the later micro-steps peak lower.

With an `optimizer`, every run is the whole iteration: the step, then `optimizer.step()` (its temporaries,
`foreach` buffers). A fastckpt.OptimizerInBackward keeps its hooks: the runs step each parameter in the
backward, as the loop will (the step should then call its `backward(loss)`, which clips exactly). The
parameters are put back after each run (a host copy taken when a session starts), and the optimizer's state as
it was when the session ends (state the session allocated is dropped), so planning neither trains the model nor
moves the optimizer.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from fastckpt.optimizer_in_backward import OptimizerInBackward

GRADIENT_CONVENTIONS = ("set_to_none", "kept")


def check_gradients(gradients: Any) -> None:
    """`gradients` names one of GRADIENT_CONVENTIONS (ValueError naming the argument otherwise)."""
    if gradients not in GRADIENT_CONVENTIONS:
        raise ValueError(
            f"fastckpt.plan: `gradients` must be 'set_to_none' (the loop calls zero_grad() before each step, torch's "
            "and Trainer's default: the step allocates the gradients) or 'kept' (the gradients exist before the step "
            f"and it accumulates into them), got {gradients!r}"
        )


@contextlib.contextmanager
def grad_hooks_suspended(model: nn.Module, keep: Any = None) -> Iterator[None]:
    """The parameters' post-accumulate-grad hooks taken off for the duration: what runs there (DeepSpeed ZeRO's
    gradient reduction, an optimizer stepped in the backward) belongs to training steps, not to the planner's
    (a planning step would reduce a gradient twice, or move the parameters). The hooks of `keep` (methods of
    that object: the planner's own fastckpt.OptimizerInBackward, whose steps the runs measure) stay."""
    suspended = []
    for p in model.parameters():
        hooks = getattr(p, "_post_accumulate_grad_hooks", None)  # the dict autograd reads: emptied, refilled
        if hooks:
            suspended.append((hooks, dict(hooks)))
            kept = {key: hook for key, hook in hooks.items() if keep is not None and getattr(hook, "__self__", None)
                    is keep}  # fmt: skip
            hooks.clear()
            hooks.update(kept)
    try:
        yield
    finally:
        for hooks, saved in suspended:
            added = {key: hook for key, hook in hooks.items() if key not in saved}  # registered meanwhile: kept
            hooks.clear()
            hooks.update(saved)
            hooks.update(added)


class Iteration:
    """The user's `step` as each planner run calls it (the module docstring). Runs happen inside `session()`."""

    def __init__(
        self, model: nn.Module, step: Callable[[], Any], gradients: str = "set_to_none", optimizer: Any = None
    ) -> None:
        check_gradients(gradients)
        self.model = model
        self.step = step
        self.gradients = gradients
        self.optimizer = optimizer
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        self._own: list[torch.Tensor | None] = [None] * len(self.parameters)  # "kept": the planner's gradients
        self._weights: list[torch.Tensor] | None = None  # host copies of the parameters while a session runs
        self._state: dict[Any, dict[str, Any]] | None = None  # the optimizer's state when the session began
        self._depth = 0

    @property
    def warm_up_needed(self) -> bool:
        """Whether a session's first run makes what later runs must find existing (the planner's own gradients,
        the optimizer's state), so that a measured run must not be the first."""
        return self.gradients == "kept" or self.optimizer is not None

    def __call__(self) -> Any:
        stepping = self.optimizer if isinstance(self.optimizer, OptimizerInBackward) else None
        with grad_hooks_suspended(self.model, keep=stepping):
            callers = [p.grad for p in self.parameters]
            for p, own in zip(self.parameters, self._own, strict=True):
                p.grad = own
            try:
                result = self.step()
                if self.optimizer is not None:
                    self.optimizer.step()
            finally:
                if self.gradients == "kept":
                    self._own = [p.grad for p in self.parameters]
                for p, grad in zip(self.parameters, callers, strict=True):
                    p.grad = grad
                if self._weights is not None:
                    with torch.no_grad():
                        for p, saved in zip(self.parameters, self._weights, strict=True):
                            p.copy_(saved)
        return result

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """Runs that share what the first made; on exit the planner's gradients are dropped and the optimizer's
        state is put back as it was (nested sessions are one)."""
        self._depth += 1
        if self._depth == 1 and self.optimizer is not None:
            self._weights = [p.detach().to("cpu", copy=True) for p in self.parameters]
            self._state = {p: _host_copy(s) for p, s in self.optimizer.state.items()}
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._own = [None] * len(self.parameters)
                if self.optimizer is not None:
                    _restore_state(self.optimizer, self._state)
                    self._weights = self._state = None


def _host_copy(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state's values, tensors as (a host copy, their device)."""
    return {
        k: (v.detach().to("cpu", copy=True), v.device) if isinstance(v, torch.Tensor) else copy.deepcopy(v)
        for k, v in state.items()
    }


def _restore_state(optimizer: Any, saved: dict[Any, dict[str, Any]]) -> None:
    """The optimizer's state as `saved` holds it: values copied back into the tensors, state the session added
    dropped."""
    for p in list(optimizer.state):
        if p not in saved:
            del optimizer.state[p]
            continue
        state = optimizer.state[p]
        for key in [k for k in state if k not in saved[p]]:
            del state[key]
        for key, value in saved[p].items():
            if not isinstance(value, tuple) or not isinstance(value[0], torch.Tensor):
                state[key] = value
                continue
            host, device = value
            current = state.get(key)
            if isinstance(current, torch.Tensor) and current.shape == host.shape and current.device == device:
                with torch.no_grad():
                    current.copy_(host)
            else:
                state[key] = host.to(device)
