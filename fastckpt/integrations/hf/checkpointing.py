"""`enable` / `disable` / `is_enabled`: gradient checkpointing of a transformers model through fastckpt, with
HF's own layer selection.

`enable(model, policy="int8")` turns on the model's activation checkpointing as
`model.activation_checkpointing_enable()` does (same layers, `every_n_layers`, `use_cache` handling;
the input embeddings' output made to require grad only for `use_reentrant=True`, which needs it),
then points every checkpointing layer at `fastckpt.checkpoint` instead of torch's. It also replaces
the model's own `activation_checkpointing_enable` on this instance, so that a later call of it
(which is what `transformers.Trainer` does for `gradient_checkpointing=True`) keeps using fastckpt
instead of silently switching back to torch's function.

`enable` also switches on or off what the other files of this package hold, each a `Patch` (patches.py) in
PATCHES: padded attention (attention.py), the loss head (loss_head.py) and TRL's (trl_head.py), LoRA's input
casts (adapters.py), the tiled MLPs (tiled_mlp.py), the optimizer step in the backward (trainer.py); and the
first-batch plan (planning.py), which the checkpointing switch itself installs (Trainer calls it again).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from typing import Any

import torch

from fastckpt.api import checkpoint
from fastckpt.integrations.hf import gateway, state
from fastckpt.integrations.hf.adapters import AdapterInputCasts
from fastckpt.integrations.hf.attention import PaddedAttention
from fastckpt.integrations.hf.loss_head import LossHead
from fastckpt.integrations.hf.patches import Settings
from fastckpt.integrations.hf.planning import _FirstBatchPlan
from fastckpt.integrations.hf.pretrained import _pretrained_model
from fastckpt.integrations.hf.tiled_mlp import TiledMLPs, default_tile
from fastckpt.integrations.hf.trainer import _StepInBackward
from fastckpt.integrations.hf.trl_head import TrlHead
from fastckpt.policies import Policy

# The keywords fastckpt.checkpoint takes besides the function and its arguments.
_CHECKPOINT_OPTIONS = frozenset(
    name for name, p in inspect.signature(checkpoint).parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY
)


# enable()'s patches, in the order installed: padded attention first, so that a model whose attention turns out
# not to switch is refused before anything else changed (disable() removes them in reverse, the plan first).
PATCHES = (PaddedAttention, LossHead, TrlHead, AdapterInputCasts, TiledMLPs, _StepInBackward)


# Keywords of HF's checkpointing kwargs (Trainer's gradient_checkpointing_kwargs) that ask for a plan instead.
_PLAN_KEYWORDS = ("budget", "plan_options")


def _checkpoint_function(settings: Settings, hf_kwargs: dict[str, Any] | None, offload: bool) -> functools.partial:
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
        for _, hook, remove in gateway.forward_hooks(module):
            package = (getattr(hook, "__module__", None) or "").partition(".")[0]
            name = getattr(hook, "__name__", None)
            if package in ("transformers", "peft") and name in _REQUIRE_GRADS_HOOK_NAMES:
                remove()


def _enable_through_fastckpt(
    model: torch.nn.Module,
    activation_checkpointing_kwargs: dict[str, Any] | None = None,
    every_n_layers: int = 1,
    offload: bool = False,
) -> None:
    """Stands in for the model's own `activation_checkpointing_enable`: HF selects the layers, fastckpt
    checkpoints them."""
    settings = state.of(model).settings
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
        _FirstBatchPlan.check_options(budget, plan_options)
    _FirstBatchPlan.remove(model)
    type(model).activation_checkpointing_enable(model, every_n_layers=every_n_layers)
    if not function.keywords.get("use_reentrant") and hasattr(model, "disable_input_require_grads"):
        # HF's enable makes the input embeddings' output require grad, which reentrant checkpointing needs (a
        # segment input that does); the non-reentrant one does not. With frozen embeddings (LoRA) that output is
        # then a leaf: held all step by its gradient accumulator, given a gradient nobody reads, and kept plain
        # by a storage policy (a leaf that requires grad is kept as a parameter is).
        model.disable_input_require_grads()
        _remove_orphaned_require_grads_hooks(model)
    gateway.set_checkpoint_function(model, function)
    if budget is not None:
        _FirstBatchPlan.install(model, dataclasses.replace(settings, budget=budget, plan_options=plan_options))


def enable(
    model: Any,
    policy: str | Policy = "recompute",
    *,
    every_n_layers: int = 1,
    loss_head: bool = False,
    padded_attention: bool = False,
    budget: int | str | None = None,
    plan_options: dict[str, Any] | None = None,
    optimizer_in_backward: bool = False,
    tile_mlp: bool | int | None = None,
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
    Under TRL's fused LM head (TRL's trainers call `model(..., fused_lm_head=True)` for per-token
    log-probabilities), `loss_head=True` computes those through `fastckpt.linear_log_probs` (trl_head.py).

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

    `optimizer_in_backward=True`: the transformers Trainer (or TRL trainer) training the model steps its
    optimizer during the backward, each parameter as its gradient completes, freeing the gradient
    (fastckpt.optimizer_in_backward, found at the first training batch): Trainer's `max_grad_norm` clips exactly
    (a norm pass first: one more backward), `gradient_accumulation_steps` and its scheduler are honoured, and
    the logged `grad_norm` is the gradients'. fp16 (GradScaler), DeepSpeed and several ranks are refused.

    `tile_mlp`: the decoder layers' MLPs (Llama's, Qwen's, Gemma's, ... position-wise `*MLP` modules) computed a
    tile of tokens at a time on inputs longer than the tile, keeping only their input and recomputing each tile
    in backward (tiled_mlp.py): a long sequence's recomputed layer then holds one tile's MLP activations, not the
    whole length's (the layer's recomputation stops at the MLP's input, the tiles are recomputed instead); a norm
    whose output feeds the MLP or the attention's projections is computed in their tiles (its full-length output
    not kept). None (default): on under a
    recompute policy, with tiles of `max(1024, hidden_size)` tokens; True: on under any policy or budget; an int:
    on, with tiles of that many tokens; False: off.
    """
    pretrained = _pretrained_model(model)
    if not isinstance(every_n_layers, int) or isinstance(every_n_layers, bool) or every_n_layers < 1:
        raise ValueError(
            f"fastckpt.integrations.hf.enable: `every_n_layers` must be an int >= 1, got {every_n_layers!r}"
        )
    if not isinstance(loss_head, bool):
        raise TypeError(f"fastckpt.integrations.hf.enable: `loss_head` must be True or False, got {loss_head!r}")
    if not isinstance(optimizer_in_backward, bool):
        raise TypeError(
            "fastckpt.integrations.hf.enable: `optimizer_in_backward` must be True or False, got "
            f"{optimizer_in_backward!r}"
        )
    if not isinstance(padded_attention, bool):
        raise TypeError(
            f"fastckpt.integrations.hf.enable: `padded_attention` must be True or False, got {padded_attention!r}"
        )
    if tile_mlp is not None and (not isinstance(tile_mlp, (bool, int)) or (type(tile_mlp) is int and tile_mlp < 1)):
        raise ValueError(
            "fastckpt.integrations.hf.enable: `tile_mlp` must be None (on under a recompute policy), True, False or "
            f"a number of tokens per tile >= 1, got {tile_mlp!r}"
        )
    parsed = Policy.parse(policy)
    if budget is not None and parsed != Policy.parse("recompute"):
        raise ValueError(
            f"fastckpt.integrations.hf.enable: pass `budget` or `policy`, not both (got policy={policy!r}): a "
            "budget plans a policy per layer"
        )
    if budget is None and plan_options is not None:
        raise ValueError("fastckpt.integrations.hf.enable: `plan_options` without `budget`; pass a budget to plan")
    if tile_mlp is None:
        tile_mlp = budget is None and parsed.recompute
    settings = Settings(
        parsed, dict(checkpoint_kwargs), budget, plan_options or {},
        outer=None if model is pretrained else model, loss_head=loss_head, padded_attention=padded_attention,
        tile_mlp=(default_tile(pretrained.config) if tile_mlp is True else tile_mlp) or None,
        optimizer_in_backward=optimizer_in_backward,
    )  # fmt: skip
    # Refuse bad settings before anything changes.
    _checkpoint_function(settings, None, offload=False)
    for patch in (_FirstBatchPlan, *PATCHES):
        if patch.wanted(settings):
            patch.check(pretrained, settings)
    settings = dataclasses.replace(settings, plan_options=dict(settings.plan_options))  # checked: a dict, copied
    for patch in PATCHES:
        if patch.wanted(settings):
            patch.install(pretrained, settings)
        else:
            patch.remove(pretrained)
    state.of(pretrained).settings = settings
    # An instance attribute shadows the class's method, so Trainer's later call (and the deprecated
    # gradient_checkpointing_enable, which forwards to it) lands here too. A bound method, not a
    # closure, so that copy.deepcopy binds the copy's to the copy.
    pretrained.activation_checkpointing_enable = types.MethodType(_enable_through_fastckpt, pretrained)
    _enable_through_fastckpt(pretrained, every_n_layers=every_n_layers)
    return model


def disable(model: Any) -> Any:
    """Turn gradient checkpointing and the loss head off, give the model back its own enable method and
    forward; returns `model`."""
    pretrained = _pretrained_model(model)
    for patch in reversed((_FirstBatchPlan, *PATCHES)):
        patch.remove(pretrained)
    pretrained.__dict__.pop("activation_checkpointing_enable", None)
    state.forget(pretrained)
    pretrained.activation_checkpointing_disable()
    return model


def is_enabled(model: Any) -> bool:
    """True when some layer of `model` is checkpointed through fastckpt (by enable, or by a plan applied)."""
    pretrained = _pretrained_model(model)
    return state.read(pretrained).plan is not None or any(
        getattr(function, "func", None) is checkpoint for function in gateway.checkpoint_functions(pretrained)
    )
