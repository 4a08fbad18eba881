"""Validity checks of a measurement: non-finite gradients, batch slicing that changes what a segment computes,
and the gradient-error measure."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from fastckpt.planner.candidates import Candidate
from fastckpt.planner.segments import Segment


class NonFinite:
    """Around one run: where parameters got a NaN/inf gradient (`found`, a phrase naming the segments; '')."""

    def __init__(self, model: nn.Module, segments: list[Segment]) -> None:
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        self.segments = segments
        self.bad: set[int] = set()
        self.handles: list[Any] = []
        self.found = ""

    def __enter__(self) -> NonFinite:
        self.handles = [p.register_hook(self._hook(i)) for i, p in enumerate(self.parameters)]
        return self

    def _hook(self, index: int) -> Callable:
        def hook(grad: torch.Tensor) -> None:
            if not finite(grad):
                self.bad.add(index)

        return hook

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()
        if not self.bad:
            return
        bad = {id(self.parameters[i]) for i in self.bad}
        names = [s.name for s in self.segments if any(id(p) in bad for p in s.module.parameters())]
        if not names:
            self.found = "gives NaN/inf gradients to parameters outside the segments"
        else:
            # The backward runs the segments last to first and a NaN spreads to those it reaches after.
            self.found = f"gives NaN/inf gradients from segment {names[-1]!r} on (segments {names} affected)"


def finite(grad: torch.Tensor) -> bool:
    """No NaN/inf in `grad`; reduces to two scalars, so a traced run's memory is as without the check."""
    values = grad._values() if grad.is_sparse else grad
    if values.numel() == 0:
        return True
    if values.is_complex():
        values = torch.view_as_real(values)
    low, high = torch.aminmax(values)  # NaN propagates to both
    return math.isfinite(low.item()) and math.isfinite(high.item())


def samples_mixed(
    segments: list[Segment], step: Callable[[], Any], device: torch.device, candidates: list[Candidate]
) -> dict[int, str]:
    """For each slice count N of the batch candidates among `candidates`: why slicing the batch in N changes what a
    segment computes, if it does (absent: every segment treats its samples alone).

    One step() captures each segment's inputs; then, per segment, its forward runs twice from the same RNG
    seed (no grad, buffers restored after), the second time with the samples outside the first slice
    changed: the first slice's output must not move (BatchNorm in training, attention across the batch or
    a batch-wide statistic would move it)."""
    counts = sorted({c.batch_slices for c in candidates if c.batch_slices > 1})
    if not counts:
        return {}
    captured: dict[int, tuple] = {}
    handles = [
        segment.module.register_forward_pre_hook(
            lambda module, args, kwargs, i=i: captured.setdefault(i, _detached((args, kwargs))), with_kwargs=True
        )
        for i, segment in enumerate(segments)
    ]
    try:
        step()
    finally:
        for handle in handles:
            handle.remove()
    devices = [device] if device.type == "cuda" else []

    def forward(module: nn.Module, inputs: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        """The module's first output from a fixed seed, without grad, its buffers (BatchNorm's) put back."""
        buffers = {name: b.clone() for name, b in module.named_buffers()}
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=devices):
                torch.manual_seed(0x5A3)
                return _first_tensor(module(inputs, *args, **kwargs)).float()
        finally:
            with torch.no_grad():
                for name, b in module.named_buffers():
                    b.copy_(buffers[name])

    reasons: dict[int, str] = {}
    for i, segment in enumerate(segments):
        args, kwargs = captured.get(i, ((), {}))
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] < 2:
            continue  # nothing to slice here (tiled itself refuses a segment without a tensor first input)
        unchecked = [count for count in counts if count not in reasons]
        if not unchecked:
            break
        try:
            whole = forward(segment.module, x, args[1:], kwargs)
            for count in unchecked:
                first = x.chunk(count)[0].shape[0]
                changed = x.clone()
                changed[first:] = changed[first:] * 2 + 1
                moved = forward(segment.module, changed, args[1:], kwargs)[:first]
                if (whole[:first] - moved).norm() > 1e-4 * whole[:first].norm():
                    reasons[count] = (
                        f"segment {segment.name!r} mixes the samples of a batch (changing the samples outside the "
                        f"first of {count} slices changed that slice's output), so batch slices would change what it "
                        "computes"
                    )
        except Exception as error:
            why = f"segment {segment.name!r} could not be run alone to check batch slicing ({error})"
            for count in unchecked:
                reasons.setdefault(count, why)
    return reasons


def _detached(tree: Any) -> Any:
    return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, tree)


def _first_tensor(output: Any) -> torch.Tensor:
    return next(t for t in tree_leaves(output) if isinstance(t, torch.Tensor))


def max_relative_error(grads: Sequence[torch.Tensor | None], reference: Sequence[torch.Tensor | None]) -> float:
    """Largest relative L2 error over parameter gradients, paired in order (a gradient one side has and the
    other has not counts as error 1): the project's gradient-error measure."""
    errors = []
    for g, r in zip(grads, reference, strict=True):
        if g is None or r is None:
            errors.append(0.0 if g is None and r is None else 1.0)
        else:
            errors.append(((g - r).float().norm() / r.float().norm().clamp_min(1e-30)).item())
    # max() keeps a NaN only when it comes first (comparisons with NaN are False): make every non-finite one inf.
    return max((e if math.isfinite(e) else math.inf for e in errors), default=0.0)
