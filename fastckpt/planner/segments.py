"""The segments a plan assigns candidates to, and the checks of plan()'s other arguments."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fastckpt.api import CheckpointWrapper


@dataclass(frozen=True)
class Segment:
    """One planned segment: where it sits in the model and the module itself."""

    name: str
    parent: nn.Module
    attribute: str
    module: nn.Module


def find_segments(model: nn.Module, check_fn: Callable[[nn.Module], bool] | None) -> list[Segment]:
    """The submodules `check_fn` selects, or by default the children of the largest stack of identical blocks."""
    if check_fn is None:
        segments = _default_segments(model)
    else:
        segments = []
        _collect(model, "", check_fn, segments)
        if not segments:
            raise ValueError("fastckpt.plan: `check_fn` selected no submodule of the model")
    wrapped = [s.name for s in segments if isinstance(s.module, CheckpointWrapper)]
    if wrapped:
        raise ValueError(f"fastckpt.plan: segments {wrapped} are already wrapped by fastckpt; plan the unwrapped model")
    if len({id(s.module) for s in segments}) != len(segments):
        raise ValueError(
            "fastckpt.plan: the same module appears as several segments; the planner needs each to run once"
        )
    return segments


def _collect(module: nn.Module, prefix: str, check_fn: Callable[[nn.Module], bool], out: list[Segment]) -> None:
    # As fastckpt.apply: children in order, a selected child is not searched further.
    for name, child in module.named_children():
        qualified = f"{prefix}{name}"
        if check_fn(child):
            out.append(Segment(qualified, module, name, child))
        else:
            _collect(child, qualified + ".", check_fn, out)


def signature(module: nn.Module) -> tuple:
    """What makes two blocks the same: module type and parameter names and shapes."""
    return (type(module), tuple((n, tuple(p.shape)) for n, p in module.named_parameters()))


def _default_segments(model: nn.Module) -> list[Segment]:
    best: tuple[str, nn.Module] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
            continue
        if len({signature(child) for child in module.children()}) != 1:
            continue
        if best is None or len(module) > len(best[1]):
            best = (name, module)
    if best is None:
        raise ValueError(
            "fastckpt.plan: the model has no nn.ModuleList/nn.Sequential of two or more identical blocks to plan; "
            "pass check_fn to choose the segments"
        )
    prefix = f"{best[0]}." if best[0] else ""
    return [Segment(f"{prefix}{name}", best[1], name, child) for name, child in best[1].named_children()]


def device_of(model: nn.Module) -> torch.device:
    for tensor in [*model.parameters(), *model.buffers()]:
        return tensor.device
    return torch.device("cpu")


# ---- arguments -------------------------------------------------------------------------------------------


def _sharded_parameter(model: nn.Module) -> str | None:
    """A parameter of `model` that this process does not hold whole, named with what sharded it, or None."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        DTensor = ()  # noqa: N806 - no parameter is one
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            return f"parameter {name!r} is a DTensor, e.g. after FSDP2's fully_shard"
        if hasattr(p, "ds_id"):
            return f"parameter {name!r} is partitioned by DeepSpeed ZeRO-3 (deepspeed.initialize or zero.Init)"
    return None


def check_arguments(model: Any, step: Any, check_fn: Any, repeats: Any, max_error: Any) -> None:
    """measure()'s arguments other than the candidates, each named when wrong."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"fastckpt.plan: `model` must be a torch.nn.Module, got {type(model).__name__}")
    sharded = _sharded_parameter(model)
    if sharded is not None:
        # The planner's steps and byte counts assume tensors this process holds whole.
        raise ValueError(
            f"fastckpt.plan: `model` is sharded ({sharded}); plan the model before sharding it (fastckpt.plan or "
            "fastckpt.integrations.hf.plan, then plan.apply()) and shard the planned model (fully_shard, "
            "deepspeed.initialize), or give a policy instead of a budget"
        )
    if not callable(step):
        raise TypeError(
            f"fastckpt.plan: `step` must be a callable running one forward and backward, got {type(step).__name__}"
        )
    if check_fn is not None and not callable(check_fn):
        raise TypeError(f"fastckpt.plan: `check_fn` must be callable (module -> bool), got {type(check_fn).__name__}")
    if not (isinstance(repeats, int) and not isinstance(repeats, bool) and repeats >= 1):
        raise ValueError(f"fastckpt.plan: `repeats` must be an integer >= 1, got {repeats!r}")
    if max_error is not None and not (
        isinstance(max_error, (int, float)) and not isinstance(max_error, bool) and max_error >= 0
    ):
        raise ValueError(
            f"fastckpt.plan: `max_error` must be a number >= 0 (a relative L2 error) or None, got {max_error!r}"
        )
