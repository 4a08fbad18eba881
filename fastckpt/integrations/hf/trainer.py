"""What a training loop built around the model without telling fastckpt: the optimizer holding its parameters
(transformers' Trainer builds it after `enable`, inside `train()`) and the Trainer itself.

Neither is passed to the model's forward, where the first-batch plan runs, so both are found among the live
objects (`gc`), by identity: an optimizer whose parameter groups hold one of the model's trained parameters, a
Trainer whose `model` or `model_wrapped` is the model. accelerate's wrapper (`AcceleratedOptimizer`, what
Trainer's `self.optimizer` is) and fastckpt's own `OptimizerInBackward` are looked through to the optimizer that
owns the state.
"""

from __future__ import annotations

import gc
import warnings
from typing import Any

import torch

from fastckpt.integrations.hf import state
from fastckpt.integrations.hf.patches import Patch, Settings


def _live(cls: type) -> list[Any]:
    """Every live instance of `cls` (unreachable ones collected first, so an earlier run's do not count)."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance() reads __class__, which some deprecated module objects warn on
        warnings.simplefilter("ignore")
        return [obj for obj in gc.get_objects() if isinstance(obj, cls)]


def innermost(optimizer: Any) -> Any:
    """The optimizer that owns the state, through wrappers that keep the optimizer they wrap as `.optimizer`."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def find_optimizer(model: torch.nn.Module, entry: str) -> torch.optim.Optimizer | None:
    """The one optimizer stepping `model`'s trained parameters, or None if there is none yet; ValueError (naming
    `entry` and the fix) when there are several."""
    trained = {id(p) for p in model.parameters() if p.requires_grad}
    found: dict[int, torch.optim.Optimizer] = {}
    for candidate in _live(torch.optim.Optimizer):
        owner = innermost(candidate)
        if any(id(p) in trained for group in owner.param_groups for p in group["params"]):
            found[id(owner)] = owner
    if len(found) > 1:
        names = ", ".join(sorted(type(o).__name__ for o in found.values()))
        raise ValueError(
            f"{entry}: {len(found)} optimizers hold the model's parameters ({names}); a device total counts one "
            "optimizer's state: pass the one your loop steps as plan_options={'optimizer': optimizer}"
        )
    return next(iter(found.values()), None)


def find_trainer(model: torch.nn.Module) -> Any:
    """The transformers Trainer training `model`, directly or through wrappers (a PEFT model TRL made from it,
    DDP's `.module`), or None."""
    import transformers

    for trainer in _live(transformers.Trainer):
        if any(id(model) in _wrapped(getattr(trainer, name, None)) for name in ("model", "model_wrapped")):
            return trainer
    return None


def _wrapped(model: Any) -> set[int]:
    """Ids of `model` and of the models it wraps (`.module`, PEFT's `get_base_model()`)."""
    ids = set()
    for _ in range(4):
        if model is None or id(model) in ids:
            break
        ids.add(id(model))
        inner = getattr(model, "module", None)
        if inner is None and callable(getattr(model, "get_base_model", None)):
            inner = model.get_base_model()
        model = inner
    return ids


class _StepInBackward(Patch):
    """`enable(model, optimizer_in_backward=True)`: the Trainer (or TRL trainer) training the model steps its
    optimizer in the backward (fastckpt.optimizer_in_backward) with its own settings: `max_grad_norm` (clipping,
    exact: the backward runs a norm pass first), `gradient_accumulation_steps`, its scheduler (which drives the
    optimizer's groups, shared). Found at the first training forward (a forward pre-hook, as the first-batch
    plan), where Trainer has built its optimizer; then three of accelerate's objects route through the wrapper:
    the accelerated optimizer's `.optimizer` (Trainer's `optimizer.step()`), the accelerator's `backward` (the norm
    pass) and its `clip_grad_norm_` (Trainer's clipping and its logged `grad_norm`, over gradients that no longer
    exist as `.grad`). fp16 (a GradScaler) and DeepSpeed are refused."""

    @classmethod
    def wanted(cls, settings: Settings) -> bool:
        return settings.optimizer_in_backward

    @classmethod
    def install(cls, pretrained: torch.nn.Module, settings: Settings) -> None:
        cls.remove(pretrained)
        hook = settings.entry(pretrained).register_forward_pre_hook(cls._training_forward)
        state.of(pretrained).step_in_backward = {"hook": hook}

    @classmethod
    def remove(cls, pretrained: torch.nn.Module) -> None:
        kept = state.read(pretrained).step_in_backward
        if kept is None:
            return
        state.of(pretrained).step_in_backward = None
        if "hook" in kept:
            kept["hook"].remove()
        if "handle" in kept:
            cls._detach(kept)

    @classmethod
    def requested(cls, pretrained: torch.nn.Module) -> bool:
        """Whether enable(optimizer_in_backward=True) asked for it (or a plan attached it)."""
        return state.read(pretrained).step_in_backward is not None

    @classmethod
    def wrapper(cls, pretrained: torch.nn.Module) -> Any:
        """The OptimizerInBackward stepping the model's Trainer's optimizer, or None before the first batch."""
        return (state.read(pretrained).step_in_backward or {}).get("handle")

    @classmethod
    def attach(cls, pretrained: torch.nn.Module, module: torch.nn.Module) -> Any:
        """The OptimizerInBackward stepping the optimizer of the Trainer training `module`, attached now if it is
        not yet (a plan that only fits with it attaches it too), or None where no Trainer with an optimizer
        trains the model."""
        model_state = state.of(pretrained)
        if model_state.step_in_backward is None:
            model_state.step_in_backward = {}
        kept = model_state.step_in_backward
        if "handle" not in kept:
            trainer = find_trainer(module)
            if trainer is None or getattr(trainer, "optimizer", None) is None:
                return None
            kept.update(cls._attach(trainer))
        return kept["handle"]

    @classmethod
    def _training_forward(cls, module: torch.nn.Module, args: tuple) -> None:
        from fastckpt.integrations.hf.pretrained import _pretrained_model

        if not (module.training and torch.is_grad_enabled()):
            return
        if cls.attach(_pretrained_model(module), module) is None:
            raise ValueError(
                "fastckpt.integrations.hf.enable(optimizer_in_backward=True): no transformers Trainer (or TRL "
                "trainer) with an optimizer is training this model; in your own loop wrap the optimizer instead: "
                "fastckpt.optimizer_in_backward(optimizer, max_grad_norm=..., accumulation_steps=...)"
            )

    @staticmethod
    def _attach(trainer: Any) -> dict[str, Any]:
        import functools

        from accelerate.utils import DistributedType

        from fastckpt.optimizer_in_backward import OptimizerInBackward

        accelerator, args = trainer.accelerator, trainer.args
        entry = "fastckpt.integrations.hf.enable(optimizer_in_backward=True)"
        if accelerator.scaler is not None:
            raise ValueError(
                f"{entry}: fp16 training (a GradScaler) cannot step in the backward: the parameters would be "
                "stepped with scaled gradients before the overflow check; use bf16=True"
            )
        if accelerator.distributed_type == DistributedType.DEEPSPEED:
            raise ValueError(f"{entry}: DeepSpeed steps its own optimizer on its partitioned gradients; not supported")
        inner = innermost(trainer.optimizer)
        owner = trainer  # the object whose .optimizer is `inner`: accelerate's wrapper, or the trainer
        while owner.optimizer is not inner:
            owner = owner.optimizer
        max_grad_norm = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None
        handle = OptimizerInBackward(
            inner, max_grad_norm=max_grad_norm, accumulation_steps=args.gradient_accumulation_steps
        )
        owner.optimizer = handle

        def backward(loss: torch.Tensor, **kwargs: Any) -> None:
            # accelerate's backward for a run without DeepSpeed, Megatron, a scaler or LOMO: the loss divided by
            # its own accumulation steps (1 under Trainer, which divides itself), then the backward
            handle.backward(loss / accelerator.gradient_accumulation_steps, **kwargs)

        accelerator.backward = backward
        accelerator.clip_grad_norm_ = functools.partial(_clip_grad_norm, handle)
        return {"handle": handle, "owner": owner, "inner": inner, "accelerator": accelerator}

    @staticmethod
    def _detach(attached: dict[str, Any]) -> None:
        attached["handle"].remove()
        if attached["owner"].optimizer is attached["handle"]:
            attached["owner"].optimizer = attached["inner"]
        for name in ("backward", "clip_grad_norm_"):
            attached["accelerator"].__dict__.pop(name, None)


def _clip_grad_norm(handle: Any, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """accelerate's `clip_grad_norm_(parameters, max_norm)` for the optimizer stepped in the backward (its own
    parameters: Trainer passes the model's)."""
    return handle.clip_grad_norm_(max_norm, norm_type)
