"""Validity checks of a measurement: non-finite gradients, a probe of the segments before measuring (batch
slicing that changes what a segment computes, functions a kept-attention candidate watches that never run),
and the gradient-error measure."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from fastckpt.engine.kept_ops import WatchCalls
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
        def hook(grad: torch.Tensor | None) -> None:
            # None: a loss head that handed this gradient out in an earlier pass (optimizer_in_backward's norm pass)
            if grad is not None and not finite(grad):
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


@dataclass
class Probe:
    """One step() as the segments see it, before measuring: each segment's arguments (detached, from its first
    call) and which of the watched functions ran inside a segment."""

    inputs: dict[int, tuple]
    called: frozenset


def probe(segments: list[Segment], step: Callable[[], Any], watched: frozenset = frozenset()) -> Probe:
    """Run step() once with the segments watched (Probe): what the batch and kept-attention checks read."""
    captured: dict[int, tuple] = {}
    called: set = set()
    inside = [0]  # segments whose forward is running (nested segments count once each)

    def entering(module: nn.Module, args: tuple, kwargs: dict, i: int) -> None:
        captured.setdefault(i, _detached((args, kwargs)))
        inside[0] += 1

    def leaving(module: nn.Module, args: tuple, output: Any) -> None:
        inside[0] -= 1

    def around(func: Any) -> contextlib.AbstractContextManager:
        if inside[0]:
            called.update(watched if func is None else (func,))  # None: it may have called any of them
        return contextlib.nullcontext()

    handles = []
    for i, segment in enumerate(segments):
        handles.append(
            segment.module.register_forward_pre_hook(
                lambda module, args, kwargs, i=i: entering(module, args, kwargs, i), with_kwargs=True
            )
        )
        handles.append(segment.module.register_forward_hook(leaving))
    try:
        with WatchCalls(watched, around) if watched else contextlib.nullcontext():
            step()
    finally:
        for handle in handles:
            handle.remove()
    return Probe(captured, frozenset(called))


def samples_mixed(
    segments: list[Segment], probed: Probe, device: torch.device, candidates: list[Candidate]
) -> dict[int, str]:
    """For each slice count N of the batch candidates among `candidates`: why slicing the batch in N changes what a
    segment computes, or cannot be done, if so (absent: every segment treats its samples alone).

    From the segments' inputs in `probed`, per segment, its forward runs twice from the same RNG seed (no grad,
    buffers restored after), the second time with the samples outside the first slice changed: the first
    slice's output must not move (BatchNorm in training, attention across the batch or a batch-wide statistic
    would move it). A batch of fewer than N samples cannot be cut in N slices."""
    counts = sorted({c.batch_slices for c in candidates if c.batch_slices > 1})
    if not counts:
        return {}
    captured = probed.inputs
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
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            continue  # nothing to slice here (tiled itself refuses a segment without a tensor first input)
        for count in counts:
            if x.shape[0] < count and count not in reasons:
                reasons[count] = (
                    f"segment {segment.name!r} takes a batch of {x.shape[0]}, which cannot be cut in {count} slices"
                )
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
