"""The one door to other libraries' internals that the HF integration reaches (torch's own symbols go through
fastckpt._compat): transformers', PEFT's, TRL's and accelerate's private attributes and code, and torch
`Module`'s hook dictionaries. Each is an entry in `INTERNALS`: what it reaches, the versions it was checked on,
the feature that needs it and what the integration does without it; `python -m fastckpt.info` lists them. A new
release that renames one breaks only the function here that names it (tests/integrations/test_hf_state.py scans
the other modules for these names).

Checked on the versions in CHECKED (CI's pins).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

CHECKED = {
    "transformers": "5.23.0",
    "peft": "0.21.2",
    "trl": "1.16.0",
    "accelerate": "1.15.0",
    "torch": "2.14.1",
}


@dataclass(frozen=True)
class Internal:
    """One internal of another library the integration uses."""

    name: str  # the function here that reaches it
    library: str
    reaches: str  # the attribute, name or code it touches
    feature: str  # what needs it
    without: str  # what the integration does where a release lacks it


INTERNALS: dict[str, Internal] = {}


def _internal(library: str, reaches: str, feature: str, without: str) -> Callable[[Callable], Callable]:
    def register(function: Callable) -> Callable:
        INTERNALS[function.__name__] = Internal(function.__name__, library, reaches, feature, without)
        return function

    return register


def report() -> list[str]:
    """One line per internal, for `python -m fastckpt.info`."""
    return [
        f"{i.library} {CHECKED[i.library]}: {i.reaches} ({i.feature}; without it: {i.without})"
        for i in INTERNALS.values()
    ]


# --- torch Module's hook dictionaries ----------------------------------------------------------------------------


@_internal("torch", "Module._forward_hooks, _forward_hooks_with_kwargs, _forward_hooks_always_called",
           "enable() removes transformers'/PEFT's input-embedding hooks whose handles transformers dropped",
           "those hooks stay (the embeddings' output requires grad: a leaf held all step)")  # fmt: skip
def forward_hooks(module: torch.nn.Module) -> Iterator[tuple[int, Callable, Callable[[], None]]]:
    """(key, hook, remove) for each forward hook of `module`; `remove()` unregisters it."""
    hooks = getattr(module, "_forward_hooks", {})

    def remover(key: int) -> Callable[[], None]:
        def remove() -> None:
            for name in ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
                getattr(module, name, {}).pop(key, None)

        return remove

    for key, hook in list(hooks.items()):
        yield key, hook, remover(key)


@_internal("torch", "Module._forward_pre_hooks, _forward_pre_hooks_with_kwargs",
           "TrlHead.remove() finds and removes the hooks its install() registered without keeping their handles "
           "(a handle would not follow copy.deepcopy of the model)",
           "RuntimeError at disable() naming this torch")  # fmt: skip
def forward_pre_hooks(module: torch.nn.Module) -> Iterator[tuple[int, Callable, Callable[[], None]]]:
    """(key, hook, remove) for each forward pre-hook of `module`; `remove()` unregisters it."""
    hooks = getattr(module, "_forward_pre_hooks", None)
    if hooks is None:
        raise RuntimeError(
            f"fastckpt.integrations.hf: this torch ({torch.__version__}) keeps no Module._forward_pre_hooks; the TRL "
            f"head cannot be removed (checked on torch {CHECKED['torch']})"
        )

    def remover(key: int) -> Callable[[], None]:
        def remove() -> None:
            for name in ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs"):
                getattr(module, name, {}).pop(key, None)

        return remove

    for key, hook in list(hooks.items()):
        yield key, hook, remover(key)


# --- transformers ------------------------------------------------------------------------------------------------


@_internal("transformers", "PreTrainedModel._set_gradient_checkpointing (class attribute)",
           "telling a PreTrainedModel from a PEFT wrapper or another module", "TypeError: not a PreTrainedModel")
def is_pretrained_model(model: Any) -> bool:
    return isinstance(model, torch.nn.Module) and hasattr(type(model), "_set_gradient_checkpointing")


@_internal("transformers", "<layer>._gradient_checkpointing_func",
           "checkpointing the layers transformers selects through fastckpt.checkpoint",
           "no layer is checkpointed through fastckpt (is_enabled() says False)")  # fmt: skip
def set_checkpoint_function(model: torch.nn.Module, function: Callable) -> None:
    """Make every checkpointing layer of `model` call `function` as transformers' checkpoint."""
    for module in model.modules():
        if hasattr(module, "_gradient_checkpointing_func"):
            module._gradient_checkpointing_func = function


def checkpoint_functions(model: torch.nn.Module) -> Iterator[Any]:
    """The checkpoint function each checkpointing layer of `model` calls (see set_checkpoint_function)."""
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False):
            yield getattr(module, "_gradient_checkpointing_func", None)


@_internal("transformers", "PretrainedConfig._attn_implementation",
           "padded attention: which attention a model (and each sub-model) uses",
           "ValueError at enable(padded_attention=True): the implementation cannot be read")  # fmt: skip
def attention_configs(model: torch.nn.Module) -> dict[int, Any]:
    """{id: config} of `model`'s and its sub-models' configs that name an attention implementation."""
    configs = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            configs[id(config)] = config
    return configs


def attention_implementations(model: torch.nn.Module) -> set[str]:
    """The attention implementations `model`'s configs name (see attention_configs)."""
    return {config._attn_implementation for config in attention_configs(model).values()}


@_internal("transformers", "PreTrainedModel._can_set_attn_implementation (a classmethod)",
           "padded attention: refusing, before anything changes, a model whose attention cannot be switched",
           "install() switches and checks after, switching back where it did not take")  # fmt: skip
def attention_switchable(module: torch.nn.Module) -> bool:
    """False for a transformers model whose attention implementation cannot be set after loading."""
    can_set = getattr(type(module), "_can_set_attn_implementation", None)
    if not hasattr(module, "set_attn_implementation") or not callable(can_set):
        return True  # not a transformers model, or a release without the check
    return bool(can_set())


@_internal("transformers", "PreTrainedModel._loss_function (instance attribute read by the loss_function property)",
           "the loss head: the model's loss call, replaced for one forward",
           "the loss head cannot run: enable(loss_head=True) refuses ForCausalLM classes without it")  # fmt: skip
def loss_function_slot(model: torch.nn.Module) -> tuple[Any, str]:
    """(object, attribute) to set for `model`'s loss_function to call something else for one forward."""
    return model, "_loss_function"


@_internal("transformers", "source of <Model>ForCausalLM.forward: 'self.lm_head(' and 'self.loss_function('",
           "the loss head checks that the forward computes its loss from lm_head's output",
           "enable(loss_head=True) refuses the model, naming why")  # fmt: skip
def forward_computes_loss_from_head(forward: Callable) -> bool:
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):
        return False
    return "self.lm_head(" in source and "self.loss_function(" in source


# --- accelerate --------------------------------------------------------------------------------------------------


@_internal("accelerate", "<module>._hf_hook, <module>._old_forward",
           "the loss head under device_map dispatch/offload: the head's call replaced inside accelerate's wrapper",
           "the head's `forward` is replaced instead (accelerate's hook then does not run around it)")  # fmt: skip
def head_forward_slot(head: torch.nn.Module) -> tuple[Any, str]:
    """(object, attribute) to set for `head`'s call to run something else, inside accelerate's hook if any."""
    accelerated = getattr(head, "_hf_hook", None) is not None and "_old_forward" in head.__dict__
    return head, "_old_forward" if accelerated else "forward"


# --- PEFT --------------------------------------------------------------------------------------------------------


@_internal("peft", "peft.tuners.lora.layer.Linear.cast_input_dtype_enabled (an instance flag, replaced by an "
           "object with __bool__)", "LoRA adapters' input casts skipped where autocast casts anyway",
           "the adapters cast their inputs as PEFT does (a copy of each adapter's input per call)")  # fmt: skip
def adapter_input_cast(module: torch.nn.Module) -> Any:
    """PEFT's per-layer input-cast flag as set on the instance (None: not set there)."""
    return module.__dict__.get("cast_input_dtype_enabled")


def set_adapter_input_cast(module: torch.nn.Module, value: Any) -> None:
    module.cast_input_dtype_enabled = value


# --- TRL ---------------------------------------------------------------------------------------------------------

TRL_UTILS = "trl.trainer.utils"
TRL_KERNEL = "_ChunkedLogProbFunction"  # the name TRL's patched forward calls `.apply` on
TRL_FUSED_FORWARD = "_fused_forward"  # inside add_fused_lm_head


@_internal("trl", f"{TRL_UTILS}.add_fused_lm_head's inner function {TRL_FUSED_FORWARD} (by its code name)",
           "finding TRL's fused-head forward on a model", "TRL's head computes (a warning says so)")  # fmt: skip
def is_trl_fused_forward(function: Any) -> bool:
    code = getattr(function, "__code__", None)
    return (
        code is not None
        and code.co_name == TRL_FUSED_FORWARD
        and getattr(function, "__globals__", {}).get("__name__") == TRL_UTILS
    )


@_internal("trl", f"{TRL_UTILS}.{TRL_KERNEL} (a module global, replaced while a model is served)",
           "serving TRL's fused head through fastckpt.linear_log_probs",
           "TRL's head computes (a warning says so)")  # fmt: skip
def trl_kernel() -> Any:
    """TRL's kernel class as the fused forward looks it up now (None: this TRL has none)."""
    utils = sys.modules.get(TRL_UTILS)
    return None if utils is None else getattr(utils, TRL_KERNEL, None)


def set_trl_kernel(kernel: Any) -> None:
    setattr(sys.modules[TRL_UTILS], TRL_KERNEL, kernel)
