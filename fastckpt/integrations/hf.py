"""Hugging Face transformers: gradient checkpointing through fastckpt, with HF's own layer selection.

`enable(model, policy="int8")` turns on the model's activation checkpointing as
`model.activation_checkpointing_enable()` does (same layers, `every_n_layers`, `use_cache` handling;
the input embeddings' output made to require grad only for `use_reentrant=True`, which needs it),
then points every checkpointing layer at `fastckpt.checkpoint` instead of torch's. It also replaces
the model's own `activation_checkpointing_enable` on this instance, so that a later call of it
(which is what `transformers.Trainer` does for `gradient_checkpointing=True`) keeps using fastckpt
instead of silently switching back to torch's function.

`enable(model, loss_head=True)` also computes a causal LM's training loss through
`fastckpt.linear_cross_entropy` (the LM head and cross entropy a chunk of tokens at a time, no full
logits); see `_LossHead` for how the model's own forward is kept. `enable(model, padded_attention=True)`
runs SDPA attention on padded or packed batches without the [tokens x tokens] mask (hf_attention.py). On a
PEFT model, `enable` also drops LoRA's input casts that autocast undoes (`_AdapterInputCasts`).
`plan(model, batch, budget)` / `measure(model, batch)` run fastckpt's planner on a step built from a batch.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import math
import statistics
import time
import types
import warnings
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from fastckpt.api import checkpoint
from fastckpt.integrations import hf_attention
from fastckpt.loss import default_chunk_size, linear_cross_entropy
from fastckpt.policies import Policy

if TYPE_CHECKING:
    from fastckpt.planner.model import TailOption

_logger = logging.getLogger("fastckpt")

# The keywords fastckpt.checkpoint takes besides the function and its arguments.
_CHECKPOINT_OPTIONS = frozenset(
    name for name, p in inspect.signature(checkpoint).parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY
)


@dataclasses.dataclass(frozen=True)
class _Settings:
    """What `enable` was called with; kept on the model so later enable calls reuse it."""

    policy: Policy
    checkpoint_kwargs: dict[str, Any]
    budget: int | str | None = None  # plan on the first training batch for this budget (_FirstBatchPlan)
    plan_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    # The model enable() was given when it wraps the PreTrainedModel (a PEFT model: its forward is the entry
    # point). Held, not weakly referenced, so that copy.deepcopy maps it to the copy's.
    outer: Any = None


def _pretrained_model(model: Any) -> torch.nn.Module:
    """The transformers PreTrainedModel behind `model` (a PEFT model is unwrapped)."""
    if hasattr(model, "get_base_model") and not hasattr(type(model), "_set_gradient_checkpointing"):
        model = model.get_base_model()  # peft.PeftModel
    if not isinstance(model, torch.nn.Module) or not hasattr(type(model), "_set_gradient_checkpointing"):
        raise TypeError(
            f"fastckpt.integrations.hf: `model` must be a transformers PreTrainedModel (or a PEFT model wrapping "
            f"one), got {type(model).__name__}; for other modules use fastckpt.apply or fastckpt.wrap"
        )
    if not hasattr(type(model), "activation_checkpointing_enable"):
        raise RuntimeError(
            "fastckpt.integrations.hf needs a transformers release with "
            "PreTrainedModel.activation_checkpointing_enable "
            "(tested with 5.23); upgrade transformers"
        )
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"fastckpt.integrations.hf: {type(model).__name__} does not support gradient checkpointing in "
            "transformers; wrap its blocks with fastckpt.apply(model, check_fn=...) instead"
        )
    return model


# Keywords of HF's checkpointing kwargs (Trainer's gradient_checkpointing_kwargs) that ask for a plan instead.
_PLAN_KEYWORDS = ("budget", "plan_options")


def _checkpoint_function(settings: _Settings, hf_kwargs: dict[str, Any] | None, offload: bool) -> functools.partial:
    """fastckpt.checkpoint bound to the settings; keywords HF passes along (e.g. from Trainer) take precedence."""
    kwargs = {k: v for k, v in {**settings.checkpoint_kwargs, **(hf_kwargs or {})}.items() if k not in _PLAN_KEYWORDS}
    policy = Policy.parse(kwargs.pop("policy", settings.policy))
    if offload and not policy.offload:  # HF's `offload=True`: what the layers keep goes to host memory
        policy = dataclasses.replace(policy, offload=True)
    _check_options(kwargs)
    return functools.partial(checkpoint, policy=policy, **kwargs)


def _check_options(kwargs: dict[str, Any]) -> None:
    unknown = sorted(set(kwargs) - _CHECKPOINT_OPTIONS)
    if unknown:
        raise TypeError(
            f"fastckpt.integrations.hf: unknown checkpoint keyword(s) {unknown}; fastckpt.checkpoint accepts "
            f"{sorted(_CHECKPOINT_OPTIONS)}"
        )


_REQUIRE_GRADS_HOOK_NAMES = ("make_inputs_require_grads", "make_inputs_require_grad")  # transformers', PEFT's


def _remove_orphaned_require_grads_hooks(model: torch.nn.Module) -> None:
    """Remove the input-embedding hooks that make the output require grad which transformers no longer holds
    the handles of: each call of its `enable_input_require_grads` (made by its checkpointing enable, PEFT's
    get_peft_model on a model with checkpointing on, `prepare_model_for_kbit_training`) registers one more and
    keeps only the newest handles, so `disable_input_require_grads` leaves the earlier ones. PEFT registers its
    own where the model has no such method. Recognised by the defining package and the function's name."""
    for module in model.modules():
        for key, hook in list(module._forward_hooks.items()):
            package = (getattr(hook, "__module__", None) or "").partition(".")[0]
            name = getattr(hook, "__name__", None)
            if package in ("transformers", "peft") and name in _REQUIRE_GRADS_HOOK_NAMES:
                del module._forward_hooks[key]
                module._forward_hooks_with_kwargs.pop(key, None)
                module._forward_hooks_always_called.pop(key, None)


def _enable_through_fastckpt(
    model: torch.nn.Module,
    activation_checkpointing_kwargs: dict[str, Any] | None = None,
    every_n_layers: int = 1,
    offload: bool = False,
) -> None:
    """Stands in for the model's own `activation_checkpointing_enable`: HF selects the layers, fastckpt
    checkpoints them."""
    settings = model._fastckpt_settings
    function = _checkpoint_function(settings, activation_checkpointing_kwargs, offload)
    hf_kwargs = activation_checkpointing_kwargs or {}
    budget = hf_kwargs.get("budget", settings.budget)
    plan_options = {**settings.plan_options, **(hf_kwargs.get("plan_options") or {})}
    if budget is not None:
        if "budget" in hf_kwargs and "policy" in hf_kwargs:
            raise ValueError(
                "fastckpt.integrations.hf: gradient_checkpointing_kwargs has both `budget` and `policy`; a budget "
                "plans a policy per layer, pass one of them"
            )
        _FirstBatchPlan.check(budget, plan_options)
    _FirstBatchPlan.remove(model)
    type(model).activation_checkpointing_enable(model, every_n_layers=every_n_layers)
    if not function.keywords.get("use_reentrant") and hasattr(model, "disable_input_require_grads"):
        # HF's enable makes the input embeddings' output require grad, which reentrant checkpointing needs (a
        # segment input that does); the non-reentrant one does not. With frozen embeddings (LoRA) that output is
        # then a leaf: held all step by its gradient accumulator, given a gradient nobody reads, and kept plain
        # by a storage policy (a leaf that requires grad is kept as a parameter is).
        model.disable_input_require_grads()
        _remove_orphaned_require_grads_hooks(model)
    for module in model.modules():
        if hasattr(module, "_gradient_checkpointing_func"):
            module._gradient_checkpointing_func = function
    if budget is not None:
        _FirstBatchPlan.install(model, model if settings.outer is None else settings.outer, budget, plan_options)


def enable(
    model: Any,
    policy: str | Policy = "recompute",
    *,
    every_n_layers: int = 1,
    loss_head: bool = False,
    padded_attention: bool = False,
    budget: int | str | None = None,
    plan_options: dict[str, Any] | None = None,
    **checkpoint_kwargs: Any,
) -> Any:
    """Turn on gradient checkpointing of a transformers model through fastckpt; returns `model`.

    The layers are those HF checkpoints (`every_n_layers` as in `activation_checkpointing_enable`);
    `checkpoint_kwargs` go to `fastckpt.checkpoint` (e.g. `use_reentrant=True`). Keywords that
    `transformers.Trainer` passes later (`gradient_checkpointing_kwargs`, which may include `policy`)
    are merged over these.

    `loss_head=True` (a causal LM: `*ForCausalLM`, or a VLM with its loss) computes the loss of every forward
    that gets `labels` with grad mode on through `fastckpt.linear_cross_entropy`, a chunk of tokens at a time:
    no full logits, the same loss and gradients as HF's `ForCausalLMLoss` up to summation order (Trainer's
    `num_items_in_batch`, `ignore_index`, `shift_labels`, `logits_to_keep` and the known logit soft caps and
    scales included). Such a forward returns `logits` of shape [batch, 0, vocab] (no position's logits were
    computed); forwards without labels or under `torch.no_grad()` (evaluation, generation) are HF's own.
    `loss_head=False` (the default) leaves the loss to HF, or hands it back after an earlier `loss_head=True`.

    `padded_attention=True` (a model loaded with attn_implementation="sdpa") computes attention whose mask is
    causal over padded rows (each row's real tokens one block, padding before or after), or over packed
    sequences (position ids that start again, no attention mask), as dense SDPA calls per sequence instead
    of one masked call: no [tokens x tokens] mask is kept, and the kernel skips the masked blocks (about
    half the attention's time on padded rows, more on packed ones). Sliding-window layers run in blocks of
    the window's length, each with a small mask. The loss and gradients are the same up to the kernels'
    summation order; any other mask (holes in a row), dropout or a KV cache runs HF's sdpa unchanged.

    `budget` (bytes of the step, "N%" of stock checkpointing's peak or a device total such as "20GiB"; instead
    of `policy`) plans a policy per layer on the first training batch: the first forward in training mode
    with grad enabled and `labels` runs `plan(model, batch, budget, **plan_options)` on that batch first
    (autocast as the call's), applies the plan (`planned(model)` returns it) and then runs as usual; the
    gradients it found and the RNG state are restored, so that step computes what it would have. Trainer:
    `gradient_checkpointing_kwargs={"budget": "40%"}` after `enable(model)`. `plan_options` go to `measure`
    (default max_error=PLAN_MAX_ERROR: the forms whose gradients differ from the plain step's by more are
    left out). With `loss_head=True` the plan also chooses the loss head's tokens per chunk.
    """
    pretrained = _pretrained_model(model)
    if not isinstance(every_n_layers, int) or isinstance(every_n_layers, bool) or every_n_layers < 1:
        raise ValueError(
            f"fastckpt.integrations.hf.enable: `every_n_layers` must be an int >= 1, got {every_n_layers!r}"
        )
    if not isinstance(loss_head, bool):
        raise TypeError(f"fastckpt.integrations.hf.enable: `loss_head` must be True or False, got {loss_head!r}")
    if not isinstance(padded_attention, bool):
        raise TypeError(
            f"fastckpt.integrations.hf.enable: `padded_attention` must be True or False, got {padded_attention!r}"
        )
    if budget is not None:
        if Policy.parse(policy) != Policy.parse("recompute"):
            raise ValueError(
                f"fastckpt.integrations.hf.enable: pass `budget` or `policy`, not both (got policy={policy!r}): a "
                "budget plans a policy per layer"
            )
        _FirstBatchPlan.check(budget, plan_options or {})
    elif plan_options is not None:
        raise ValueError("fastckpt.integrations.hf.enable: `plan_options` without `budget`; pass a budget to plan")
    outer = None if model is pretrained else model
    settings = _Settings(Policy.parse(policy), dict(checkpoint_kwargs), budget, dict(plan_options or {}), outer)
    _checkpoint_function(settings, None, offload=False)  # reject bad keywords before changing the model
    if loss_head:
        _LossHead.check(pretrained)  # likewise
    # The attention switch first: a model that turns out not to switch is refused before anything else changed.
    if padded_attention:
        hf_attention.install(pretrained)
    else:
        hf_attention.remove(pretrained)
    pretrained._fastckpt_settings = settings
    # An instance attribute shadows the class's method, so Trainer's later call (and the deprecated
    # gradient_checkpointing_enable, which forwards to it) lands here too. A bound method, not a
    # closure, so that copy.deepcopy binds the copy's to the copy.
    pretrained.activation_checkpointing_enable = types.MethodType(_enable_through_fastckpt, pretrained)
    _enable_through_fastckpt(pretrained, every_n_layers=every_n_layers)
    if loss_head:
        _LossHead.install(pretrained)
    else:
        _LossHead.remove(pretrained)
    _AdapterInputCasts.install(pretrained)
    return model


def disable(model: Any) -> Any:
    """Turn gradient checkpointing and the loss head off, give the model back its own enable method and
    forward; returns `model`."""
    pretrained = _pretrained_model(model)
    _FirstBatchPlan.remove(pretrained)
    _LossHead.remove(pretrained)
    hf_attention.remove(pretrained)
    _AdapterInputCasts.remove(pretrained)
    pretrained.__dict__.pop("activation_checkpointing_enable", None)
    pretrained.__dict__.pop("_fastckpt_settings", None)
    pretrained.activation_checkpointing_disable()
    return model


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
    `autocast` is a dtype), `loss.backward()`, then the gradients set to None, as a training loop's
    `zero_grad` leaves them. The segments are the layers HF checkpoints (its `GradientCheckpointingLayer`s);
    HF's own checkpointing of them is turned off here, since a plan checkpoints them itself (the loss head and
    padded attention of an earlier `enable` stay). `measure_kwargs` go to `fastckpt.planner.measure`
    (candidates, repeats, max_error, progress). With the loss head on, its tokens per chunk are a choice of
    every plan too (`Measurements.tail_options`, `_LossHead.chunk_options`).
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

    def step() -> None:
        forward().loss.backward()
        model.zero_grad(set_to_none=True)

    if pretrained.is_activation_checkpointing:
        pretrained.activation_checkpointing_disable()
    check_fn = lambda m: isinstance(m, GradientCheckpointingLayer)  # noqa: E731
    measurements = planner.measure(model, step, check_fn, **measure_kwargs)
    if loss_head_enabled(pretrained):  # its chunk size is the plan's to choose too
        repeats = measure_kwargs.get("repeats", inspect.signature(planner.measure).parameters["repeats"].default)
        measurements.tail_options = _LossHead.chunk_options(pretrained, forward, autocast, repeats)
    return measurements


def _distributed() -> bool:
    """Whether this process is one of several ranks of an initialized torch.distributed group."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@functools.cache
def _takes_use_cache(model_class: type) -> bool:
    """Whether the class's forward has a `use_cache` argument (read once per class: the hook asks every step)."""
    return "use_cache" in inspect.signature(model_class.forward).parameters


def is_enabled(model: Any) -> bool:
    """True when some layer of `model` is checkpointed through fastckpt (by enable, or by a plan applied)."""
    pretrained = _pretrained_model(model)
    return pretrained.__dict__.get(_FirstBatchPlan.PLAN) is not None or any(
        getattr(module, "gradient_checkpointing", False)
        and getattr(getattr(module, "_gradient_checkpointing_func", None), "func", None) is checkpoint
        for module in pretrained.modules()
    )


def planned(model: Any) -> Any:
    """The plan `enable(model, budget=...)` applied on the first training batch (a fastckpt.planner.Plan), or None
    before that batch or without a budget."""
    return _pretrained_model(model).__dict__.get(_FirstBatchPlan.PLAN)


def loss_head_enabled(model: Any) -> bool:
    """True when `model`'s training loss goes through fastckpt.linear_cross_entropy (`enable(loss_head=True)`)."""
    return bool(_pretrained_model(model).__dict__.get(_LossHead.ON, False))


# enable(budget=)'s default max_error: on bf16 LLM fine-tunes the int8 forms' gradients differ from the plain
# step's by 2.4-6.0e-2 (largest relative L2 over the parameters), the int4 forms' by 0.6-0.7 (benchmarks/llm.py).
PLAN_MAX_ERROR = 8e-2
_PLAN_OPTIONS = ("candidates", "repeats", "max_error", "progress", "optimizer")  # what plan_options may hold


class _FirstBatchPlan:
    """`enable(model, budget=...)`: a forward pre-hook on the model enable() was given (a PEFT model's own
    forward calls the base model's `forward` directly, past its hooks). At the first forward in training mode
    with grad enabled it plans on that call's arguments and applies the plan; at that and every later training
    forward it passes `use_cache=False`, as HF's checkpointing does (a layer recomputed in the backward would
    write its keys and values to the cache a second time). A later training forward with a tensor argument
    larger in some dimension than the planned call's (dynamic padding: a longer batch) would hold more than the
    plan predicted, so it plans again, on its own arguments, before it runs (under torch.distributed it warns
    instead); see `_cover`."""

    PLAN = "_fastckpt_plan"  # the applied Plan, on the PreTrainedModel
    PLANS = "_fastckpt_plans"  # every plan kept: [(the planned call's tensor shapes by name, Plan)]
    HOOK = "_fastckpt_plan_hook"  # the hook's handle, likewise
    PLANNING = "_fastckpt_planning"  # set while the planning steps run

    @staticmethod
    def check(budget: Any, plan_options: Any) -> None:
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
    def install(cls, pretrained: torch.nn.Module, outer: torch.nn.Module, budget: Any, options: dict) -> None:
        # The hook closes over no model: a deep copy of the model plans itself.
        hook = functools.partial(cls._training_forward, budget, {"max_error": PLAN_MAX_ERROR, **options})
        pretrained.__dict__[cls.HOOK] = outer.register_forward_pre_hook(hook, with_kwargs=True)

    @classmethod
    def remove(cls, pretrained: torch.nn.Module) -> None:
        """Remove the hook and take off an applied plan."""
        handle = pretrained.__dict__.pop(cls.HOOK, None)
        if handle is not None:
            handle.remove()
        pretrained.__dict__.pop(cls.PLANS, None)
        plan = pretrained.__dict__.pop(cls.PLAN, None)
        if plan is not None and plan.applied:
            plan.remove()

    @classmethod
    def _training_forward(
        cls, budget: Any, options: dict, module: torch.nn.Module, args: tuple, kwargs: dict
    ) -> tuple[tuple, dict] | None:
        if not (module.training and torch.is_grad_enabled()):
            return None
        pretrained = _pretrained_model(module)
        if pretrained.__dict__.get(cls.PLANNING):
            return None  # one of the planning steps (hf.measure passes use_cache=False itself)
        batch = _forward_arguments(module, args, kwargs)
        if pretrained.__dict__.get(cls.PLAN) is None:
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
        current, plans = pretrained.__dict__[cls.PLAN], pretrained.__dict__[cls.PLANS]
        covering = [(planned, plan) for planned, plan in plans if _covers(planned, shapes)]
        if any(plan is current for _, plan in covering):
            return
        if covering:
            _, plan = min(covering, key=lambda entry: sum(map(math.prod, entry[0].values())))
            current.remove()
            plan.apply()
            pretrained.__dict__[cls.PLAN] = plan
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
        # The step after planning computes what it would have: the gradients it found, and the RNG state.
        gradients = [(p, p.grad) for p in module.parameters()]
        for p, _ in gradients:
            p.grad = None
        pretrained.__dict__[cls.PLANNING] = True
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                plan = measure(module, batch, autocast=autocast, **options).plan(budget)
        finally:
            del pretrained.__dict__[cls.PLANNING]
            for p, grad in gradients:
                p.grad = grad
        plan.apply()
        shapes = cls._shapes(batch)
        kept = [
            (planned, old) for planned, old in pretrained.__dict__.get(cls.PLANS, []) if not _covers(shapes, planned)
        ]
        pretrained.__dict__[cls.PLANS] = [*kept, (shapes, plan)]
        pretrained.__dict__[cls.PLAN] = plan
        _logger.info("fastckpt.integrations.hf: planned for budget %r:\n%s", budget, plan.table())


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


class _AdapterInputCasts:
    """PEFT's `cast_input_dtype_enabled` of a vanilla LoRA `Linear` (no dropout, no DoRA-like variant), made
    false while autocast runs on the adapter's device.

    PEFT casts the layer's input to the adapter weights' dtype (a bf16 activation to fp32), and autocast casts
    it straight back to bf16 for lora_A's matmul: an activation-sized fp32 copy in the forward and an fp32
    gradient in the backward (the largest transient of a LoRA step's backward), and no value changes (both
    casts are exact, both ways), so the step is bit for bit the same without them. Without autocast the cast
    is what makes a bf16 input meet fp32 weights, so it stays. The flag is read at every forward; PEFT's own
    `disable_input_dtype_casting` still overrides it.
    """

    def __init__(self, layer: torch.nn.Module) -> None:
        self._layer = weakref.ref(layer)

    def __bool__(self) -> bool:
        layer = self._layer()
        if layer is None:
            return True
        device = next(iter(layer.lora_A.values())).weight.device.type
        return not torch.is_autocast_enabled(device)

    @staticmethod
    def _eligible(module: torch.nn.Module) -> bool:
        try:
            from peft.tuners.lora.layer import Linear
        except ImportError:
            return False
        return (
            isinstance(module, Linear)
            and module.__dict__.get("cast_input_dtype_enabled") is True
            and not module.lora_variant
            and len(module.lora_A) > 0
            and all(isinstance(d, torch.nn.Identity) for d in module.lora_dropout.values())
        )

    @classmethod
    def install(cls, model: torch.nn.Module) -> None:
        for module in model.modules():
            if cls._eligible(module):
                module.cast_input_dtype_enabled = cls(module)

    @staticmethod
    def remove(model: torch.nn.Module) -> None:
        for module in model.modules():
            if isinstance(module.__dict__.get("cast_input_dtype_enabled"), _AdapterInputCasts):
                module.cast_input_dtype_enabled = True


def _tensor_parallel(model: torch.nn.Module, head: torch.nn.Module) -> bool:
    """Whether `head`'s weight is distributed by something other than FSDP2 (whose DTensors are made whole
    around the module's call, where the loss is computed): torch's tensor parallelism."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(head.weight, DTensor) and not any(isinstance(m, FSDPModule) for m in (model, head))


def _unsharded_class(module: Any) -> type:
    """The module's class, or the one FSDP2's `fully_shard` subclassed (FSDPLinear: FSDPModule and Linear)."""
    cls = type(module)
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return cls
    if FSDPModule in cls.__bases__ and len(cls.__bases__) == 2:
        return next(base for base in cls.__bases__ if base is not FSDPModule)
    return cls


def _read(model: Any, path: str) -> Any:
    """The attribute at dotted `path` on `model` ("config.logits_scaling", "model.lm_head_multiplier"); None
    when a step of it is missing."""
    for name in path.split("."):
        model = getattr(model, name, None)
    return model


def _scale_of(path: str, invert: bool = False) -> Callable[[Any], dict[str, Any]]:
    def options(model: Any) -> dict[str, Any]:
        value = _read(model, path)
        if value is None:
            return {}
        value = float(value)
        return {"logit_scale": 1.0 / value if invert else value}

    return options


def _softcap_of(path: str) -> Callable[[Any], dict[str, Any]]:
    def options(model: Any) -> dict[str, Any]:
        value = _read(model, path)
        return {} if value is None else {"softcap": float(value)}

    return options


# What the forward of these transformers classes does to the logits between lm_head and loss_function, as
# linear_cross_entropy options read from the attribute the forward reads (each class's forward in transformers
# 5.23; tested: tests/integrations/test_hf_loss.py). The soft caps are computed in fp32 here, where most Gemma
# forwards cap in the logits' dtype (under bf16 autocast the results differ by bf16 rounding). Any other class
# whose forward changes the lm_head output before loss_function is refused at its first forward (see
# _LossHead.loss).
_GEMMA_SOFTCAP = (
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3nForCausalLM",
    "Gemma4ForCausalLM",
    "Gemma4UnifiedForCausalLM",
    "VaultGemmaForCausalLM",
    "NanoChatForCausalLM",
    "BeamForCausalLM",
)
_GRANITE_SCALING = (
    "GraniteForCausalLM",
    "GraniteSWAForCausalLM",
    "GraniteMoeForCausalLM",
    "GraniteMoeSWAForCausalLM",
    "GraniteMoeSharedForCausalLM",
    "GraniteMoeHybridForCausalLM",
)
_HEAD_POSTPROCESSING: dict[str, Callable[[Any], dict[str, Any]]] = {
    **dict.fromkeys(_GEMMA_SOFTCAP, _softcap_of("config.final_logit_softcapping")),
    "RecurrentGemmaForCausalLM": _softcap_of("config.logits_soft_cap"),
    # vision-language models: the text model's cap (their forward reads config.get_text_config())
    **dict.fromkeys(
        ("Gemma4ForConditionalGeneration", "Gemma4UnifiedForConditionalGeneration"),
        _softcap_of("config.text_config.final_logit_softcapping"),
    ),
    **dict.fromkeys(("CohereForCausalLM", "Cohere2ForCausalLM", "Cohere2MoeForCausalLM"), _scale_of("logit_scale")),
    **dict.fromkeys(_GRANITE_SCALING, _scale_of("config.logits_scaling", invert=True)),
    "FalconH1ForCausalLM": _scale_of("model.lm_head_multiplier"),
}


def _wraps_loss_head(function: Any) -> bool:
    """True when `function` is the loss head's forward or wraps it (through __wrapped__ / __func__)."""
    for _ in range(32):
        if function is None:
            return False
        if getattr(function, "_fastckpt_loss_head", False):
            return True
        function = getattr(function, "__func__", None) or getattr(function, "__wrapped__", None)
    return False


def _forward_owner(model: torch.nn.Module) -> type:
    """The class whose `forward` the model runs."""
    return next(cls for cls in type(model).__mro__ if "forward" in cls.__dict__)


class _LossHead:
    """The model's own forward, with its `lm_head` and `loss_function` replaced during the call.

    Installed as an instance `forward` that wraps the class's (with its signature, which Trainer reads to
    decide whether to pass `num_items_in_batch`). For a call with `labels` under grad mode it replaces, for
    that call only, `lm_head.forward` by `head_forward` below, which keeps the hidden states and returns
    empty logits (no tokens: the model's logit post-processing runs on an empty tensor), and the instance's
    `loss_function` by `loss` below, which calls lm_head again on the kept hidden states, and that call
    computes the loss from them and the head's weight and bias (inside the head's own call, where DeepSpeed
    ZeRO-3, FSDP2 and accelerate's hooks make the weight whole and present). Everything else in the forward
    (the base model, `logits_to_keep`, MoE auxiliary losses added to the loss) is the model's own code.
    """

    ON = "_fastckpt_loss_head"
    INNER = "_fastckpt_inner_forward"  # an instance-level forward found at install time (e.g. accelerate's)
    CHUNK = "_fastckpt_loss_chunk"  # tokens per chunk a plan chose (absent: linear_cross_entropy's default)
    RECORD = "_fastckpt_loss_record"  # while set (a list): each loss call's inputs are appended to it
    CHUNK_FACTORS = (0.25, 0.5, 1, 2, 4, 8)  # the chunk sizes a plan may choose, times the default
    _forwards: dict[type, Callable[..., Any]] = {}

    @staticmethod
    def unsupported(model: torch.nn.Module) -> str | None:
        """Why the loss head cannot run on `model` (None: it can)."""
        name = type(model).__name__
        head = getattr(model, "lm_head", None)
        if _unsharded_class(head) is not torch.nn.Linear:
            return (
                f"{name}.lm_head is {type(head).__name__}, not a plain torch.nn.Linear (a LoRA or quantized head, "
                "PEFT's modules_to_save); fastckpt reads its weight and bias directly"
            )
        if _tensor_parallel(model, head):
            return (
                f"{name}.lm_head's weight is a DTensor outside FSDP2 (tensor parallel, e.g. ColwiseParallel); the "
                "loss head computes with the whole weight on each rank"
            )
        try:
            from transformers.loss.loss_utils import ForCausalLMLoss
        except ImportError:  # pragma: no cover - transformers without its loss module
            return "this transformers release has no transformers.loss.loss_utils.ForCausalLMLoss"
        if type(model).loss_function.fget(model) is not ForCausalLMLoss:
            return f"{name}.loss_function is not transformers' ForCausalLMLoss (a custom or non-causal loss)"
        return None

    @classmethod
    def check(cls, model: torch.nn.Module) -> None:
        reason = cls.unsupported(model)
        if reason is None:
            try:
                source = inspect.getsource(_forward_owner(model).forward)
            except (OSError, TypeError):
                source = ""
            if "self.lm_head(" not in source or "self.loss_function(" not in source:
                reason = (
                    f"{_forward_owner(model).__name__}.forward does not compute its loss as "
                    "self.loss_function(self.lm_head(...), labels, ...)"
                )
        if reason is not None:
            raise ValueError(f"fastckpt.integrations.hf.enable(loss_head=True): {reason}; enable without loss_head")

    @classmethod
    def install(cls, model: torch.nn.Module) -> None:
        model.__dict__[cls.ON] = True
        current = model.__dict__.get("forward")
        if current is not None and _wraps_loss_head(current):
            return  # installed already (possibly inside a wrapper installed since, e.g. accelerate's autocast)
        if current is not None:
            model.__dict__[cls.INNER] = current
        model.forward = types.MethodType(cls._forward_of(type(model)), model)

    @classmethod
    def remove(cls, model: torch.nn.Module) -> None:
        if not model.__dict__.pop(cls.ON, False):
            return
        current = model.__dict__.get("forward")
        if getattr(current, "_fastckpt_loss_head", False):  # ours on top: put back what was there
            inner = model.__dict__.pop(cls.INNER, None)
            if inner is None:
                del model.__dict__["forward"]
            else:
                model.__dict__["forward"] = inner
        # else something wrapped ours since (accelerate): ours stays inside it, switched off

    @classmethod
    def _forward_of(cls, model_class: type) -> Callable[..., Any]:
        if model_class not in cls._forwards:
            class_forward = model_class.forward
            parameters = list(inspect.signature(class_forward).parameters)
            labels_at = parameters.index("labels") - 1 if "labels" in parameters else None  # without self

            @functools.wraps(class_forward)
            def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
                inner = self.__dict__.get(cls.INNER) or types.MethodType(class_forward, self)
                labels = kwargs.get("labels")
                if labels is None and labels_at is not None and len(args) > labels_at:
                    labels = args[labels_at]
                if labels is None or not self.__dict__.get(cls.ON) or not torch.is_grad_enabled():
                    return inner(*args, **kwargs)
                reason = cls.unsupported(self)
                if reason is not None:
                    if not self.__dict__.get("_fastckpt_loss_head_warned"):
                        self.__dict__["_fastckpt_loss_head_warned"] = True
                        warnings.warn(
                            f"fastckpt.integrations.hf: loss_head falls back to HF's loss (full logits): {reason}",
                            stacklevel=2,
                        )
                    return inner(*args, **kwargs)
                return cls(self).run(inner, args, kwargs)

            forward._fastckpt_loss_head = True
            cls._forwards[model_class] = forward
        return cls._forwards[model_class]

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.hidden: torch.Tensor | None = None
        self.placeholder: torch.Tensor | None = None
        self.version = 0
        self.losses = 0
        self.pending: tuple[torch.Tensor, dict] | None = None  # the loss's labels and options, for head_forward

    def run(self, inner: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        model = self.model
        head = model.lm_head
        # Under an accelerate hook (device_map dispatch, offload) the hook's wrapper calls `_old_forward`: that
        # is replaced, so the hook still moves the inputs and the weight around both of the head's calls.
        accelerated = getattr(head, "_hf_hook", None) is not None and "_old_forward" in head.__dict__
        replaced = ((head, "_old_forward" if accelerated else "forward"), (model, "_loss_function"))
        saved = {name: obj.__dict__[name] for obj, name in replaced if name in obj.__dict__}
        setattr(head, replaced[0][1], self.head_forward)
        model._loss_function = self.loss
        try:
            output = inner(*args, **kwargs)
        finally:
            for obj, name in replaced:
                if name in saved:
                    obj.__dict__[name] = saved[name]
                else:
                    obj.__dict__.pop(name, None)
        if self.losses != 1:
            raise RuntimeError(
                f"fastckpt.integrations.hf (loss_head): {type(model).__name__}.forward called its loss_function "
                f"{self.losses} times with labels given (expected once); enable without loss_head"
            )
        return output

    def head_forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Stands in for lm_head.forward during the call: keeps the hidden states, returns empty logits; called
        again by `loss`, computes the loss."""
        head = self.model.lm_head
        if self.pending is not None:
            (targets, options), self.pending = self.pending, None
            chunk_size = self.model.__dict__.get(self.CHUNK)
            return linear_cross_entropy(args[0], head.weight, targets, bias=head.bias, chunk_size=chunk_size, **options)
        if self.hidden is not None:
            raise RuntimeError(
                f"fastckpt.integrations.hf (loss_head): {type(self.model).__name__}.forward calls lm_head more "
                "than once; enable without loss_head"
            )
        if kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor) or args[0].dim() < 2:
            raise RuntimeError(
                "fastckpt.integrations.hf (loss_head): lm_head was called with other than one hidden-states tensor "
                "[..., tokens, hidden]; enable without loss_head"
            )
        hidden = self.hidden = args[0]
        # The dtype lm_head's output would have (autocast's or the weight's), no tokens, and no weight cast:
        # the model's logit post-processing runs on this empty tensor.
        dtype = torch.result_type(hidden[..., :0, :1], head.weight[:0, :1])
        device_type = hidden.device.type
        if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
        shape = (*hidden.shape[:-2], 0, head.out_features)
        # No elements, on a storage of its own (one element): a detached alias of it (DeepSpeed ZeRO-3's forward
        # hook hands module outputs on so) is the same logits, a new tensor (post-processing) is not.
        storage = torch.empty(1, dtype=dtype, device=hidden.device)
        self.placeholder = storage.as_strided(shape, (0,) * len(shape))
        self.version = self.placeholder._version
        return self.placeholder

    def loss(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Stands in for ForCausalLMLoss (same arguments) during the forward."""
        model, head = self.model, self.model.lm_head
        self.losses += 1
        name = type(model).__name__
        if self.hidden is None:
            raise RuntimeError(
                f"fastckpt.integrations.hf (loss_head): {name}.forward computed logits without calling lm_head; "
                "enable without loss_head"
            )
        owner = _forward_owner(model)
        known = owner.__module__.startswith("transformers.") and owner.__name__ in _HEAD_POSTPROCESSING
        options = _HEAD_POSTPROCESSING[owner.__name__](model) if known else {}
        same_storage = logits.untyped_storage().data_ptr() == self.placeholder.untyped_storage().data_ptr()
        changed = not same_storage or logits._version != self.version
        if changed != bool(options):
            what = "changes the lm_head output before its loss" if changed else "does not post-process the logits"
            raise RuntimeError(
                f"fastckpt.integrations.hf (loss_head): {name}.forward {what}, which fastckpt does not know how to "
                f"compute (known: {sorted(_HEAD_POSTPROCESSING)} and models without post-processing); enable "
                "without loss_head"
            )
        if vocab_size != head.out_features:
            raise RuntimeError(
                f"fastckpt.integrations.hf (loss_head): vocab_size {vocab_size} differs from lm_head.out_features "
                f"{head.out_features}; enable without loss_head"
            )
        # ForCausalLMLoss: labels shifted left by one along their last dimension, ignore_index appended, then
        # logits and labels flattened.
        if shift_labels is None:
            shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        hidden = self.hidden.reshape(-1, self.hidden.shape[-1])
        targets = shift_labels.reshape(-1)
        if targets.numel() != hidden.shape[0]:
            raise ValueError(
                f"fastckpt.integrations.hf (loss_head): {hidden.shape[0]} positions have logits but there are "
                f"{targets.numel()} labels (logits_to_keep keeps positions, the labels must match them)"
            )
        options.update(ignore_index=ignore_index, num_items_in_batch=num_items_in_batch)
        record = model.__dict__.get(self.RECORD)
        if record is not None:
            record.append((hidden.detach(), hidden.requires_grad, targets, {**options, "bias": head.bias}))
        # Through lm_head's own call: what gathers its parameters around its forward and backward (DeepSpeed
        # ZeRO-3, FSDP) sees the loss as the head's output.
        self.pending = (targets, options)
        return head(hidden)

    @classmethod
    def chunk_options(
        cls, pretrained: torch.nn.Module, step_forward: Callable[[], Any], autocast: torch.dtype | None, repeats: int
    ) -> list[TailOption]:
        """The loss head's chunk sizes as a plan's tail options (hf.measure): one forward (`step_forward`) records
        the head's inputs, then the head alone (forward and backward, under `autocast` as the step) runs at each
        chunk size for its peak and median time (`repeats` timed runs, interleaved), relative to the chunk the
        measured steps used."""
        record = pretrained.__dict__[cls.RECORD] = []
        try:
            step_forward()
        finally:
            del pretrained.__dict__[cls.RECORD]
        if len(record) != 1:
            return []  # no loss through the head (or several): nothing to choose
        hidden, needs_grad, targets, options = record[0]
        weight = pretrained.lm_head.weight
        trained = [p for p in (weight, options["bias"]) if p is not None and p.requires_grad]

        def run(chunk: int) -> None:
            with torch.autocast(hidden.device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                loss = linear_cross_entropy(
                    hidden.detach().requires_grad_(needs_grad), weight, targets, chunk_size=chunk, **options
                )
            if loss.requires_grad:
                loss.backward()
            for p in trained:
                p.grad = None

        from fastckpt.memory import peak_bytes
        from fastckpt.planner.measurement import grad_hooks_suspended
        from fastckpt.planner.model import TailOption

        tokens = hidden.shape[0]
        measured = pretrained.__dict__.get(cls.CHUNK) or default_chunk_size(*weight.shape, weight.requires_grad)
        default = default_chunk_size(*weight.shape, weight.requires_grad)
        chunks = sorted({min(tokens, max(1, round(default * f))) for f in cls.CHUNK_FACTORS} | {min(tokens, measured)})
        grads = [(p, p.grad) for p in trained]
        try:
            with grad_hooks_suspended(pretrained):  # as the planner's steps
                peaks = {chunk: peak_bytes(functools.partial(run, chunk), hidden.device) for chunk in chunks}
                samples: dict[int, list[float]] = {chunk: [] for chunk in chunks}
                for _ in range(repeats):
                    for chunk in chunks:
                        _synchronize(hidden.device)
                        start = time.perf_counter()
                        run(chunk)
                        _synchronize(hidden.device)
                        samples[chunk].append(time.perf_counter() - start)
        finally:
            for p, grad in grads:
                p.grad = grad
        seconds = {chunk: statistics.median(times) for chunk, times in samples.items()}
        reference = min(tokens, measured)
        before = pretrained.__dict__.get(cls.CHUNK)

        def setter(chunk: int | None) -> Callable[[], None]:
            def put() -> None:
                if chunk is None:
                    pretrained.__dict__.pop(cls.CHUNK, None)
                else:
                    pretrained.__dict__[cls.CHUNK] = chunk

            return put

        return [
            TailOption(
                f"loss head: {chunk} tokens per chunk",
                peaks[chunk] - peaks[reference],
                seconds[chunk] - seconds[reference],
                apply=setter(chunk),
                remove=setter(before),
            )
            for chunk in chunks
        ]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
