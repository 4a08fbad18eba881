"""`enable(model, loss_head=True)`: a causal LM's training loss through `fastckpt.linear_cross_entropy` (the LM
head and cross entropy a chunk of tokens at a time, no full logits): `LossHead`, the patch on the model, and
`_LossCall`, one training call through it, for how the model's own forward is kept. What each model family's
forward does to the logits on the way is in families.py.
"""

from __future__ import annotations

import functools
import inspect
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch

from fastckpt.heads import TiedGradient, linear_cross_entropy
from fastckpt.integrations.hf import gateway, state
from fastckpt.integrations.hf.families import _HEAD_POSTPROCESSING
from fastckpt.integrations.hf.patches import Patch, Settings
from fastckpt.integrations.hf.pretrained import _pretrained_model


def loss_head_enabled(model: Any) -> bool:
    """True when `model`'s training loss goes through fastckpt.linear_cross_entropy (`enable(loss_head=True)`)."""
    return state.read(_pretrained_model(model)).loss_head


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


def _wraps_loss_head(function: Any) -> bool:
    """True when `function` is the loss head's forward or wraps it (through __wrapped__ / __func__)."""
    for _ in range(32):
        if function is None:
            return False
        if LossHead.is_ours(function):
            return True
        function = getattr(function, "__func__", None) or getattr(function, "__wrapped__", None)
    return False


def _tied_embedding(model: torch.nn.Module, head: torch.nn.Module) -> torch.nn.Embedding | None:
    """The input embedding whose trained weight is `head`'s (tied), when `TiedGradient` may apply: a plain
    nn.Embedding (its output's grad_fn is the lookup's), the weight not sharded by FSDP2 (a DTensor) or DeepSpeed
    ZeRO-3 (whose gradient hooks would see a changed path)."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if not isinstance(embedding, torch.nn.Embedding) or type(embedding).forward is not torch.nn.Embedding.forward:
        return None
    weight = head.weight
    if embedding.sparse or embedding.weight is not weight or not weight.requires_grad:
        return None
    if hasattr(weight, "ds_id") or type(weight.data) is not torch.Tensor:
        return None
    return embedding


def _forward_owner(model: torch.nn.Module) -> type:
    """The class whose `forward` the model runs."""
    return next(cls for cls in type(model).__mro__ if "forward" in cls.__dict__)


class LossHead(Patch):
    """`enable(loss_head=True)`: the model's own forward, with its `lm_head` and `loss_function` replaced during
    each training call (`_LossCall`).

    Installed as an instance `forward` that wraps the class's (with its signature, which Trainer reads to
    decide whether to pass `num_items_in_batch`); the forward found on the instance before (accelerate's, say)
    is kept as the inner one and put back by `remove`.
    """

    _forwards: dict[type, Callable[..., Any]] = {}  # per model class, the forward installed on its instances

    @classmethod
    def is_ours(cls, function: Any) -> bool:
        return any(function is forward for forward in cls._forwards.values())

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
    def wanted(cls, settings: Settings) -> bool:
        return settings.loss_head

    @classmethod
    def check(cls, model: torch.nn.Module, settings: Settings) -> None:
        reason = cls.unsupported(model)
        if reason is None:
            if not gateway.forward_computes_loss_from_head(_forward_owner(model).forward):
                reason = (
                    f"{_forward_owner(model).__name__}.forward does not compute its loss as "
                    "self.loss_function(self.lm_head(...), labels, ...)"
                )
        if reason is not None:
            raise ValueError(f"fastckpt.integrations.hf.enable(loss_head=True): {reason}; enable without loss_head")

    @classmethod
    def install(cls, model: torch.nn.Module, settings: Settings) -> None:
        kept = state.of(model)
        kept.loss_head = True
        current = model.__dict__.get("forward")
        if current is not None and _wraps_loss_head(current):
            return  # installed already (possibly inside a wrapper installed since, e.g. accelerate's autocast)
        if current is not None:
            kept.inner_forward = current
        model.forward = types.MethodType(cls._forward_of(type(model)), model)

    @classmethod
    def remove(cls, model: torch.nn.Module) -> None:
        kept = state.read(model)
        if not kept.loss_head:
            return
        kept.loss_head = False
        current = model.__dict__.get("forward")
        if cls.is_ours(getattr(current, "__func__", None)):  # ours on top: put back what was there
            inner, kept.inner_forward = kept.inner_forward, None
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
                kept = state.read(self)
                inner = kept.inner_forward or types.MethodType(class_forward, self)
                labels = kwargs.get("labels")
                if labels is None and labels_at is not None and len(args) > labels_at:
                    labels = args[labels_at]
                # TRL's fused-head calls (fused_lm_head=True) go to TRL's forward below: trl_head.py serves them
                fused = kwargs.get("fused_lm_head", False)
                if labels is None or fused or not kept.loss_head or not torch.is_grad_enabled():
                    return inner(*args, **kwargs)
                reason = cls.unsupported(self)
                if reason is not None:
                    if not kept.loss_head_warned:
                        kept.loss_head_warned = True
                        warnings.warn(
                            f"fastckpt.integrations.hf: loss_head falls back to HF's loss (full logits): {reason}",
                            stacklevel=2,
                        )
                    return inner(*args, **kwargs)
                return _LossCall(self).run(inner, args, kwargs)

            cls._forwards[model_class] = forward
        return cls._forwards[model_class]



class _LossCall:
    """One training call of the model under the loss head: for that call only, `lm_head.forward` is replaced by
    `head_forward`, which keeps the hidden states and returns empty logits (no tokens: the model's logit
    post-processing runs on an empty tensor), and the instance's `loss_function` by `loss`, which calls lm_head
    again on the kept hidden states, and that call computes the loss from them and the head's weight and bias
    (inside the head's own call, where DeepSpeed ZeRO-3, FSDP2 and accelerate's hooks make the weight whole and
    present). Everything else in the forward (the base model, `logits_to_keep`, MoE auxiliary losses added to
    the loss) is the model's own code."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.hidden: torch.Tensor | None = None
        self.placeholder: torch.Tensor | None = None
        self.version = 0
        self.losses = 0
        self.pending: tuple[torch.Tensor, dict] | None = None  # the loss's labels and options, for head_forward
        self.tied: TiedGradient | None = None  # for a head whose weight is the input embedding's

    def run(self, inner: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        model = self.model
        head = model.lm_head
        # Under an accelerate hook (device_map dispatch, offload) the hook's wrapper calls `_old_forward`: that
        # is replaced, so the hook still moves the inputs and the weight around both of the head's calls.
        replaced = (gateway.head_forward_slot(head), gateway.loss_function_slot(model))
        saved = {name: obj.__dict__[name] for obj, name in replaced if name in obj.__dict__}
        for (obj, name), stand_in in zip(replaced, (self.head_forward, self.loss), strict=True):
            setattr(obj, name, stand_in)
        embedding = _tied_embedding(model, head)
        if embedding is not None:
            self.tied = TiedGradient(embedding)
            self.tied.begin()
        try:
            output = inner(*args, **kwargs)
        finally:
            for obj, name in replaced:
                if name in saved:
                    obj.__dict__[name] = saved[name]
                else:
                    obj.__dict__.pop(name, None)
            if self.tied is not None:
                self.tied.end()
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
            chunk_size = state.read(self.model).loss_chunk
            loss = linear_cross_entropy(args[0], head.weight, targets, bias=head.bias, chunk_size=chunk_size, **options)
            if self.tied is not None:
                self.tied.keep_head_gradient_of(loss)
            return loss
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
        record = state.read(model).loss_record
        if record is not None:
            record.append((hidden.detach(), hidden.requires_grad, targets, {**options, "bias": head.bias}))
        # Through lm_head's own call: what gathers its parameters around its forward and backward (DeepSpeed
        # ZeRO-3, FSDP) sees the loss as the head's output.
        self.pending = (targets, options)
        return head(hidden)
