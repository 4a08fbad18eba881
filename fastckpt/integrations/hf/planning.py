"""`plan(model, batch, budget)` / `measure(model, batch)`: fastckpt's planner on a training step built from a
batch; `enable(model, budget=...)`'s plan on the first training batch (`_FirstBatchPlan`), which `planned`
returns.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import statistics
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from fastckpt.heads import default_chunk_size, linear_cross_entropy
from fastckpt.integrations.hf import state
from fastckpt.integrations.hf.loss_head import loss_head_enabled
from fastckpt.integrations.hf.patches import Patch, Settings
from fastckpt.integrations.hf.pretrained import _pretrained_model
from fastckpt.integrations.hf.trainer import _StepInBackward, find_optimizer
from fastckpt.optimizer_in_backward import OptimizerInBackward

if TYPE_CHECKING:
    from fastckpt.planner.model import TailOption

_logger = logging.getLogger("fastckpt")


def plan(
    model: Any,
    batch: dict[str, Any],
    budget: int | str,
    *,
    autocast: torch.dtype | None = None,
    verify: bool = True,
    **measure_kwargs: Any,
) -> Any:
    """`fastckpt.plan` for a transformers model, the step built from a sample batch (see `measure`); returns
    the Plan, verified unless `verify=False` (not applied: `plan.apply()` wraps the layers)."""
    from fastckpt.planner.budgets import check_budget

    check_budget(budget)
    if not isinstance(verify, bool):
        raise TypeError(f"fastckpt.integrations.hf.plan: `verify` must be True or False, got {verify!r}")
    return measure(model, batch, autocast=autocast, **measure_kwargs).plan(budget, verify=verify)


def measure(model: Any, batch: dict[str, Any], *, autocast: torch.dtype | None = None, **measure_kwargs: Any) -> Any:
    """`fastckpt.planner.measure` for a transformers model (plans for any budget come from its result).

    The step is one training step on `batch` (keyword arguments of the model's forward, with `labels`):
    forward (`use_cache=False` unless the batch says otherwise; under `torch.autocast(device, autocast)` when
    `autocast` is a dtype) and `loss.backward()`, each run starting with the gradients set to None, as
    Trainer's loop leaves them (it calls `model.zero_grad()`, torch's `set_to_none=True`, before the first step
    and after each optimizer step: the first micro-step of an accumulation allocates the gradients), which is
    the planner's default (`gradients=`, fastckpt.planner.iteration). The segments are the layers HF
    checkpoints (its `GradientCheckpointingLayer`s); HF's own checkpointing of them is turned off here, since a
    plan checkpoints them itself (the loss head and padded attention of an earlier `enable` stay).
    `measure_kwargs` go to `fastckpt.planner.measure` (candidates, repeats, max_error, progress, optimizer,
    gradients). With the loss head on, its tokens per chunk are a choice of every plan too
    (`Measurements.tail_options`, `loss_chunk_options`).
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    from fastckpt import planner

    pretrained = _pretrained_model(model)
    if not isinstance(batch, dict) or "labels" not in batch:
        raise ValueError(
            "fastckpt.integrations.hf.plan: `batch` must be a dict of the model's forward arguments with "
            "`labels` (the step's loss is the model's own), e.g. {'input_ids': ..., 'attention_mask': ..., "
            "'labels': ...}"
        )
    if autocast is not None and not (isinstance(autocast, torch.dtype) and autocast.is_floating_point):
        raise TypeError(f"fastckpt.integrations.hf.plan: `autocast` must be a float dtype or None, got {autocast!r}")
    device = next(pretrained.parameters()).device
    # No KV cache, as in training (HF turns it off under its checkpointing, which the plan replaces).
    inputs = {"use_cache": False, **batch} if _takes_use_cache(type(pretrained)) else dict(batch)

    def forward() -> Any:
        with torch.autocast(device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            return model(**inputs)

    stepping = measure_kwargs.get("optimizer")
    backward = stepping.backward if isinstance(stepping, OptimizerInBackward) else torch.Tensor.backward

    def step() -> None:
        # As Trainer's training_step: its compute_loss keeps the loss alone (the outputs, logits among them, are
        # freed before the backward) and divides it by the accumulation steps (a scalar more during the backward).
        # An optimizer stepped in the backward runs its own backward (the norm pass when it clips).
        loss = forward().loss
        backward(loss / 1)

    if pretrained.is_activation_checkpointing:
        pretrained.activation_checkpointing_disable()
    check_fn = lambda m: isinstance(m, GradientCheckpointingLayer)  # noqa: E731
    measurements = planner.measure(model, step, check_fn, **measure_kwargs)
    if loss_head_enabled(pretrained):  # its chunk size is the plan's to choose too
        repeats = measure_kwargs.get("repeats", inspect.signature(planner.measure).parameters["repeats"].default)
        measurements.tail_options = loss_chunk_options(pretrained, forward, autocast, repeats)
    return measurements


def _distributed() -> bool:
    """Whether this process is one of several ranks of an initialized torch.distributed group."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@functools.cache
def _takes_use_cache(model_class: type) -> bool:
    """Whether the class's forward has a `use_cache` argument (read once per class: the hook asks every step)."""
    return "use_cache" in inspect.signature(model_class.forward).parameters


def planned(model: Any) -> Any:
    """The plan `enable(model, budget=...)` applied on the first training batch (a fastckpt.planner.Plan), or None
    before that batch or without a budget."""
    return state.read(_pretrained_model(model)).plan


# enable(budget=)'s default max_error: on bf16 LLM fine-tunes the int8 forms' gradients differ from the plain
# step's by 2.4-6.0e-2 (largest relative L2 over the parameters), the int4 forms' by 0.6-0.7 (benchmarks/llm.py).
PLAN_MAX_ERROR = 8e-2
# what plan_options may hold
_PLAN_OPTIONS = ("candidates", "repeats", "max_error", "progress", "optimizer", "gradients", "offload")


class _FirstBatchPlan(Patch):
    """`enable(model, budget=...)`: a forward pre-hook on the model enable() was given (a PEFT model's own
    forward calls the base model's `forward` directly, past its hooks). At the first forward in training mode
    with grad enabled it plans on that call's arguments and applies the plan; at that and every later training
    forward it passes `use_cache=False`, as HF's checkpointing does (a layer recomputed in the backward would
    write its keys and values to the cache a second time). A later training forward with a tensor argument
    larger in some dimension than the planned call's (dynamic padding: a longer batch) would hold more than the
    plan predicted, so it plans again, on its own arguments, before it runs (under torch.distributed it warns
    instead); see `_cover`."""

    @classmethod
    def wanted(cls, settings: Settings) -> bool:
        return settings.budget is not None

    @classmethod
    def check(cls, pretrained: torch.nn.Module, settings: Settings) -> None:
        cls.check_options(settings.budget, settings.plan_options)

    @staticmethod
    def check_options(budget: Any, plan_options: Any) -> None:
        from fastckpt.planner.budgets import check_budget

        check_budget(budget)
        if not isinstance(plan_options, dict):
            raise TypeError(
                f"fastckpt.integrations.hf: `plan_options` must be a dict of measure() keywords, got "
                f"{type(plan_options).__name__}"
            )
        unknown = sorted(set(plan_options) - set(_PLAN_OPTIONS))
        if unknown:
            raise TypeError(f"fastckpt.integrations.hf: unknown plan_options {unknown}; known: {list(_PLAN_OPTIONS)}")

    @classmethod
    def install(cls, pretrained: torch.nn.Module, settings: Settings) -> None:
        cls.remove(pretrained)
        # The hook closes over no model: a deep copy of the model plans itself.
        options = {"max_error": PLAN_MAX_ERROR, **settings.plan_options}
        hook = functools.partial(cls._training_forward, settings.budget, options)
        state.of(pretrained).plan_hook = settings.entry(pretrained).register_forward_pre_hook(hook, with_kwargs=True)

    @classmethod
    def remove(cls, pretrained: torch.nn.Module) -> None:
        """Remove the hook and take off an applied plan."""
        kept = state.read(pretrained)
        handle, plan = kept.plan_hook, kept.plan
        kept.plan_hook, kept.plans, kept.plan = None, [], None
        if handle is not None:
            handle.remove()
        if plan is not None and plan.applied:
            plan.remove()

    @classmethod
    def _training_forward(
        cls, budget: Any, options: dict, module: torch.nn.Module, args: tuple, kwargs: dict
    ) -> tuple[tuple, dict] | None:
        if not (module.training and torch.is_grad_enabled()):
            return None
        pretrained = _pretrained_model(module)
        kept = state.of(pretrained)
        if kept.planning:
            return None  # one of the planning steps (hf.measure passes use_cache=False itself)
        batch = _forward_arguments(module, args, kwargs)
        if kept.plan is None:
            cls._plan(budget, options, module, pretrained, batch)
        else:
            cls._cover(budget, options, module, pretrained, batch)
        if _takes_use_cache(type(pretrained)):
            return args, {**kwargs, "use_cache": False}
        return None

    @classmethod
    def _cover(cls, budget: Any, options: dict, module: torch.nn.Module, pretrained: torch.nn.Module, batch: dict):
        """Apply a plan made on a call no smaller than this one in any dimension of any tensor argument.

        The number of elements alone is not enough: a batch of the same elements in longer rows holds more (the
        T x T attention mask; measured: 1 x 2048 tokens at 1.33x a byte budget planned on 8 x 256). Plans made
        on shapes neither covers (a short last batch of longer rows) are kept, so alternating shapes swap plans
        instead of planning again; a plan whose shape a newer one covers is dropped."""
        shapes = cls._shapes(batch)
        kept = state.of(pretrained)
        current, plans = kept.plan, kept.plans
        covering = [(planned, plan) for planned, plan in plans if _covers(planned, shapes)]
        if any(plan is current for _, plan in covering):
            return
        if covering:
            _, plan = min(covering, key=lambda entry: sum(map(math.prod, entry[0].values())))
            current.remove()
            plan.apply()
            kept.plan = plan
            return
        index = next(i for i, (_, plan) in enumerate(plans) if plan is current)
        planned = plans[index][0]
        growth = ", ".join(
            f"{name} {_shape_text(planned.get(name))} -> {_shape_text(shape)}"
            for name, shape in shapes.items()
            if not _covers({name: planned.get(name)}, {name: shape})
        )
        if _distributed():
            cls._warn_unplanned(budget, growth)
            plans[index] = ({**planned, **_envelope(planned, shapes)}, current)  # warned once per new shape
            return
        _logger.info(
            "fastckpt.integrations.hf: a training batch larger than the planned one (%s); planning again", growth
        )
        current.remove()
        try:
            cls._plan(budget, options, module, pretrained, batch)
        except BaseException as error:
            current.apply()  # the model as it was: the failed call changed nothing
            if not isinstance(error, ValueError):
                raise
            raise ValueError(
                f"fastckpt.integrations.hf.enable(budget={budget!r}): a training batch larger than the planned one "
                f"({growth}) does not fit the budget: {error}. Pad every batch to the longest length (the plan is "
                "then made once, for it) or give a larger budget"
            ) from error

    @staticmethod
    def _warn_unplanned(budget: Any, growth: str) -> None:
        # Planning runs steps of this rank alone; under FSDP or ZeRO-3 their collectives would wait for ranks
        # that are not planning. Say so once per new largest shape instead.
        warnings.warn(
            f"fastckpt.integrations.hf.enable(budget={budget!r}): a training batch larger than the planned one "
            f"({growth}) may exceed the budget; under torch.distributed fastckpt does not plan again (one rank's "
            "planning steps would stall the others' collectives): pad every batch to the longest length so that "
            "the first batch is planned for it",
            stacklevel=4,
        )

    @staticmethod
    def _shapes(batch: dict) -> dict[str, tuple[int, ...]]:
        """A call's tensor arguments: name -> shape."""
        return {name: tuple(value.shape) for name, value in batch.items() if isinstance(value, torch.Tensor)}

    @classmethod
    def _plan(cls, budget: Any, options: dict, module: torch.nn.Module, pretrained: torch.nn.Module, batch: dict):
        if batch.get("labels") is None:
            raise ValueError(
                "fastckpt.integrations.hf.enable(budget=...): the training forward to plan on has no `labels`, and the "
                "planner's step is the model's own loss; pass labels, or plan yourself with "
                "fastckpt.integrations.hf.plan / fastckpt.plan and a step of your own"
            )
        device = next(pretrained.parameters()).device
        autocast = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
        options = cls._with_optimizer(budget, options, module, pretrained)
        # The step after planning computes what it would have: the planner's runs leave the gradients as they
        # found them (fastckpt.planner.iteration) and the RNG state is forked.
        kept = state.of(pretrained)
        kept.planning = True
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                try:
                    plan = measure(module, batch, autocast=autocast, **options).plan(budget)
                except ValueError:
                    stepping = cls._in_backward(budget, options, module, pretrained)
                    if stepping is None:
                        raise
                    plan = cls._plan_in_backward(budget, options, module, pretrained, batch, autocast, stepping)
        finally:
            kept.planning = False
        plan.apply()
        shapes = cls._shapes(batch)
        others = [(planned, old) for planned, old in kept.plans if not _covers(shapes, planned)]
        kept.plans, kept.plan = [*others, (shapes, plan)], plan
        _logger.info("fastckpt.integrations.hf: planned for budget %r:\n%s", budget, plan.table())

    @staticmethod
    def _with_optimizer(budget: Any, options: dict, module: torch.nn.Module, pretrained: torch.nn.Module) -> dict:
        """`options` with the loop's optimizer for a device total: its state and its step's temporaries count.
        Trainer builds the optimizer after `enable`, so unless plan_options names one it is found (the one
        holding the model's parameters; with enable(optimizer_in_backward=True), the Trainer's stepped in the
        backward); without one the total counts no optimizer, which is said once."""
        from fastckpt.planner.budgets import is_total

        if not is_total(budget) or options.get("optimizer") is not None:
            return options
        entry = f"fastckpt.integrations.hf.enable(budget={budget!r})"
        stepping = _StepInBackward.attach(pretrained, module) if _StepInBackward.requested(pretrained) else None
        optimizer = stepping or find_optimizer(module, entry)
        if optimizer is None:
            warnings.warn(
                f"{entry}: no optimizer holds the model's parameters at its first training batch, so the device "
                "total counts no optimizer state; build the optimizer before the first forward, or pass it as "
                "plan_options={'optimizer': optimizer}",
                stacklevel=5,
            )
            return options
        return {**options, "optimizer": optimizer}

    @staticmethod
    def _in_backward(budget: Any, options: dict, module: torch.nn.Module, pretrained: torch.nn.Module) -> Any:
        """Where no plan fits a device total with the optimizer Trainer steps after the backward, the same
        optimizer stepped in the backward (its gradients never all live): the OptimizerInBackward, attached to
        the Trainer, or None (not a total, no Trainer, or already stepped in the backward)."""
        from fastckpt.planner.budgets import is_total

        optimizer = options.get("optimizer")
        if not is_total(budget) or optimizer is None or isinstance(optimizer, OptimizerInBackward):
            return None
        if _StepInBackward.requested(pretrained):
            return None
        stepping = _StepInBackward.attach(pretrained, module)
        if stepping is None or stepping.optimizer is not optimizer:
            _StepInBackward.remove(pretrained)
            return None
        return stepping

    @staticmethod
    def _plan_in_backward(
        budget: Any, options: dict, module: torch.nn.Module, pretrained: torch.nn.Module, batch: dict,
        autocast: torch.dtype | None, stepping: OptimizerInBackward,
    ) -> Any:  # fmt: skip
        """The plan with the optimizer stepped in the backward, which stays attached if one fits (else it is
        detached, and the error says what that loop would need)."""
        try:
            plan = measure(module, batch, autocast=autocast, **{**options, "optimizer": stepping}).plan(budget)
        except BaseException:
            _StepInBackward.remove(pretrained)
            raise
        _logger.info(
            "fastckpt.integrations.hf: no plan fits %r with the optimizer stepped after the backward; Trainer's "
            "optimizer now steps in the backward (fastckpt.optimizer_in_backward: each gradient freed once "
            "stepped; clipping at %s exact, by a norm pass)", budget, stepping.max_grad_norm,
        )  # fmt: skip
        return plan


def _covers(planned: dict[str, tuple[int, ...] | None], shapes: dict[str, tuple[int, ...]]) -> bool:
    """Every tensor argument of `shapes` no larger in any dimension than `planned`'s of that name."""
    return all(
        planned.get(name) is not None
        and len(planned[name]) == len(shape)
        and all(size <= limit for size, limit in zip(shape, planned[name], strict=True))
        for name, shape in shapes.items()
    )


def _envelope(planned: dict[str, tuple[int, ...]], shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The dimension-wise largest of the two shapes of each argument (`shapes`' alone where they differ in rank)."""
    return {
        name: tuple(map(max, shape, planned[name])) if name in planned and len(planned[name]) == len(shape) else shape
        for name, shape in shapes.items()
    }


def _shape_text(shape: tuple[int, ...] | None) -> str:
    return "none" if shape is None else "x".join(map(str, shape)) or "scalar"


def _forward_arguments(module: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """A forward call's arguments by name (what measure's batch is)."""
    signature = inspect.signature(module.forward)
    bound = signature.bind_partial(*args, **kwargs)
    arguments: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            arguments.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                raise ValueError(
                    "fastckpt.integrations.hf.enable(budget=...): the first training forward has positional "
                    f"arguments beyond {type(module).__name__}.forward's named ones; pass them by keyword"
                )
        else:
            arguments[name] = value
    return arguments


LOSS_CHUNK_FACTORS = (0.25, 0.5, 1, 2, 4, 8)  # the loss head's chunk sizes a plan may choose, times the default


def loss_chunk_options(
    pretrained: torch.nn.Module, step_forward: Callable[[], Any], autocast: torch.dtype | None, repeats: int
) -> list[TailOption]:
    """The loss head's chunk sizes as a plan's tail options (`measure`): one forward (`step_forward`) records the
    head's inputs, then the head alone (forward and backward, under `autocast` as the step) runs at each chunk
    size for its peak and median time (`repeats` timed runs, interleaved), relative to the chunk the measured
    steps used."""
    from fastckpt.planner.iteration import grad_hooks_suspended
    from fastckpt.planner.model import TailOption

    kept = state.of(pretrained)
    record = kept.loss_record = []
    try:
        step_forward()
    finally:
        kept.loss_record = None
    if len(record) != 1:
        return []  # no loss through the head (or several): nothing to choose
    hidden, needs_grad, targets, options = record[0]
    weight = pretrained.lm_head.weight
    tokens = hidden.shape[0]
    default = default_chunk_size(*weight.shape, weight.requires_grad)
    measured = min(tokens, kept.loss_chunk or default)
    chunks = sorted({min(tokens, max(1, round(default * f))) for f in LOSS_CHUNK_FACTORS} | {measured})
    trained = [p for p in (weight, options["bias"]) if p is not None and p.requires_grad]

    def run(chunk: int) -> None:
        for p in trained:  # as the planner's runs: no gradient before the step (fastckpt.planner.iteration)
            p.grad = None
        with torch.autocast(hidden.device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = linear_cross_entropy(
                hidden.detach().requires_grad_(needs_grad), weight, targets, chunk_size=chunk, **options
            )
        if loss.requires_grad:
            loss.backward()
        for p in trained:
            p.grad = None

    grads = [(p, p.grad) for p in trained]
    try:
        with grad_hooks_suspended(pretrained):  # as the planner's steps
            peaks, seconds = _peaks_and_times(run, chunks, repeats, hidden.device)
    finally:
        for p, grad in grads:
            p.grad = grad
    before = kept.loss_chunk

    def setter(chunk: int | None) -> Callable[[], None]:
        def put() -> None:
            state.of(pretrained).loss_chunk = chunk

        return put

    return [
        TailOption(
            f"loss head: {chunk} tokens per chunk",
            peaks[chunk] - peaks[measured],
            seconds[chunk] - seconds[measured],
            apply=setter(chunk),
            remove=setter(before),
        )
        for chunk in chunks
    ]


def _peaks_and_times(
    run: Callable[[int], None], chunks: list[int], repeats: int, device: torch.device
) -> tuple[dict[int, int], dict[int, float]]:
    """`run(chunk)`'s peak bytes and median seconds for each chunk (`repeats` timed runs, interleaved)."""
    from fastckpt.memory import peak_bytes

    peaks = {chunk: peak_bytes(functools.partial(run, chunk), device) for chunk in chunks}
    samples: dict[int, list[float]] = {chunk: [] for chunk in chunks}
    for _ in range(repeats):
        for chunk in chunks:
            _synchronize(device)
            start = time.perf_counter()
            run(chunk)
            _synchronize(device)
            samples[chunk].append(time.perf_counter() - start)
    return peaks, {chunk: statistics.median(times) for chunk, times in samples.items()}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
