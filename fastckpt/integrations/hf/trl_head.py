"""TRL's fused LM head, computed by fastckpt when `enable(model, loss_head=True)`.

TRL (1.16 on) patches the model it trains with `add_fused_lm_head`: `model(..., labels=labels,
fused_lm_head=True)` runs the backbone and returns per-token log-probabilities (and entropy, top-1, ...) instead of
logits; SFT, DPO, KTO, GRPO and RLOO all compute their losses from them. That forward never calls `lm_head` or
`loss_function`, so the loss head of loss_head.py would not run, and the peak would be TRL's head: on devices
without Triton it folds [4096 tokens x 32768 vocab] fp32 tiles in torch (several at once).

One head per model, never two: for a model whose loss head is on, TRL's per-token kernel (its module-level
`_ChunkedLogProbFunction`, which the patched forward looks up at each call) is replaced by
`fastckpt.linear_log_probs`, with TRL's temperature, soft cap and logit scale. Everything else in TRL's forward
(the backbone call, MoE auxiliary losses, the outputs it assembles) stays TRL's; where TRL hands the kernel every
position (no Triton: CPU, MPS) only the counted ones go through fastckpt's head (`_scored_rows`, from the labels
the model is called with). The replacement dispatches on the head's weight: other models (a reference model,
models without `loss_head=True`) get TRL's own kernel unchanged. It is installed by a forward pre-hook on the
model's backbone, which runs inside TRL's forward before the kernel is looked up, so the order of `enable` and
the trainer's construction does not matter. It says so once per model (logging, `fastckpt` logger). A TRL whose patched
forward does not call that kernel, and a head whose weight is a DTensor (FSDP2, tensor parallel: TRL gathers it
into a new tensor, which the dispatch does not recognise) and TRL's `cast_lm_head_to_fp32=True` on a head of
another dtype (fp32 hidden states outside autocast) are reported with a warning, once: TRL's head computes there.
"""

from __future__ import annotations

import logging
import types
import warnings
import weakref
from typing import Any

import torch

from fastckpt.heads import TiedGradient, linear_log_probs
from fastckpt.integrations.hf import gateway, state
from fastckpt.integrations.hf.loss_head import _tied_embedding, loss_head_enabled
from fastckpt.integrations.hf.patches import Patch, Settings

_LOG = logging.getLogger("fastckpt")
_served: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # the PreTrainedModels whose head fastckpt serves


def trl_forward(model: torch.nn.Module) -> Any:
    """TRL's fused-head forward installed on `model`, else None; found under wrappers installed since (fastckpt's
    loss head, accelerate's fp32 output conversion) through `__func__` / `__wrapped__` and the loss head's inner
    forward."""
    for forward in (model.__dict__.get("forward"), state.read(model).inner_forward):
        for _ in range(32):
            if forward is None:
                break
            if gateway.is_trl_fused_forward(forward):  # functools.wraps gave it the model class's forward's names
                return forward
            forward = getattr(forward, "__func__", None) or getattr(forward, "__wrapped__", None)
    return None


class _ServedKernel:
    """Stands in for TRL's `_ChunkedLogProbFunction` (same `apply` arguments and results)."""

    trl_kernel: Any = None  # TRL's own, for the heads fastckpt does not serve

    @classmethod
    def apply(
        cls,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: float,
        chunk_size: int,
        final_logit_softcapping: float | None,
        logit_scale: float,
        outputs: tuple[str, ...],
    ) -> tuple[torch.Tensor | None, ...]:
        model = next((m for m in list(_served) if m.get_output_embeddings().weight is weight), None)
        if model is not None and _mixed_dtypes(hidden, weight, bias):
            # TRL's cast_lm_head_to_fp32=True: fp32 hidden states, autocast off, a bf16 head. TRL casts the weight
            # a tile at a time; fastckpt's head computes in one dtype, and a cast of the whole weight would cost
            # its size again.
            _left_to_trl(
                model,
                "trl_said_mixed",
                f"TRL's fused LM head on {type(model).__name__} gets {hidden.dtype} hidden states for a {weight.dtype} "
                "head outside autocast (cast_lm_head_to_fp32=True)",
            )
            model = None
        if model is None or not loss_head_enabled(model):
            return cls.trl_kernel.apply(
                hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping, logit_scale, outputs
            )
        rows = _scored_rows(state.read(model).trl_scored, hidden)
        # TRL's chunk_size counts vocabulary columns per tile; fastckpt's chunks are of tokens (a plan's, or the
        # default).
        per_token = linear_log_probs(
            hidden if rows is None else hidden.index_select(0, rows),
            weight,
            targets if rows is None else targets.index_select(0, rows),
            bias=bias,
            temperature=temperature,
            softcap=final_logit_softcapping,
            logit_scale=logit_scale,
            chunk_size=state.read(model).loss_chunk,
            outputs=tuple(outputs),
        )
        kept = state.read(model)
        tied, kept.trl_tied = kept.trl_tied, None
        if tied is not None:
            tied.keep_head_gradient_of(per_token.log_probs)
        if rows is None:
            return tuple(per_token)
        # TRL zeroes the unscored positions (masked_fill) after the kernel: zeros there already
        return tuple(None if x is None else x.new_zeros(hidden.shape[0]).index_copy(0, rows, x) for x in per_token)


def _scored_rows(mask: torch.Tensor | None, hidden: torch.Tensor) -> torch.Tensor | None:
    """The positions TRL's forward (the kernel's caller) counts, when it passed every position.

    Without Triton (CPU, MPS) TRL hands the kernel every position, labels -100 clamped to 0, and zeroes the
    ignored ones afterwards; their head work (padding, prompts, each sequence's last position) is wasted. The
    kernel's arguments cannot tell an ignored position from a label 0: `mask` is TRL's label mask, derived from the
    labels of this model call (`_note_scored`). The indices of its true positions, else None (no mask: the model's
    forward was called without its hooks; TRL passed only the counted positions; all are counted)."""
    if mask is None or hidden.device.type not in ("cpu", "cuda", "mps"):  # XLA: a shape per batch recompiles
        return None
    if mask.numel() != hidden.shape[0]:  # TRL passed the counted positions only (Triton)
        return None
    rows = mask.to(hidden.device).reshape(-1).nonzero().squeeze(1)
    return None if rows.numel() == hidden.shape[0] else rows


def _note_scored(model: torch.nn.Module, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """The model's forward pre-hook (with keyword arguments): for a call of TRL's fused head, note which positions
    it scores. TRL documents them (`add_fused_lm_head`): those whose next-token label is not -100, the labels
    shifted by one (`labels[:, 1:]`) unless the caller passes them pre-shifted as `shift_labels`; the mask below is
    TRL's own (`labels != -100` on the shifted labels), so no frame of TRL's is read."""
    labels, shifted = kwargs.get("labels"), kwargs.get("shift_labels")
    if not kwargs.get("fused_lm_head"):
        mask = None
    elif isinstance(shifted, torch.Tensor):
        mask = shifted != -100
    elif isinstance(labels, torch.Tensor) and labels.dim() == 2:
        mask = labels[:, 1:] != -100
    else:  # TRL refuses such a call itself
        mask = None
    state.of(model).trl_scored = mask


def _forget_scored(model: torch.nn.Module, module: torch.nn.Module, args: tuple, output: Any) -> None:
    """The model's forward hook (always called): the mask is this call's only, so that a later call of the
    model's `forward` without its hooks finds none rather than a stale one."""
    state.of(model).trl_scored = None


def _before_backbone(model: torch.nn.Module, backbone: torch.nn.Module, args: tuple) -> None:
    """The backbone's forward pre-hook (bound to the model: a deep copy's is bound to the copy): under TRL's
    fused forward, make its kernel lookup find fastckpt's."""
    forward = trl_forward(model)
    if forward is None or not loss_head_enabled(model):
        return
    kernel = gateway.trl_kernel()
    if gateway.TRL_KERNEL not in forward.__code__.co_names or kernel is None:
        _left_to_trl(
            model,
            "trl_said",
            f"TRL's fused LM head on {type(model).__name__} does not call {gateway.TRL_UTILS}.{gateway.TRL_KERNEL} "
            "in this TRL release",
        )
        return
    if _is_dtensor(model.get_output_embeddings().weight):
        _left_to_trl(
            model,
            "trl_said",
            f"{type(model).__name__}.lm_head's weight is a DTensor (FSDP2, tensor parallel), which TRL gathers into a "
            "new tensor for its head",
        )
        return
    _served.add(model)
    embedding = _tied_embedding(model, model.get_output_embeddings())
    if embedding is not None and torch.is_grad_enabled():  # a trained tied head: see TiedGradient
        tied = state.of(model).trl_tied = TiedGradient(embedding)
        tied.begin()

        def end(*_: Any) -> None:  # after the backbone's forward, even one that raised
            tied.end()
            done.remove()

        done = backbone.register_forward_hook(end, always_call=True)
    if kernel is not _ServedKernel:
        _ServedKernel.trl_kernel = kernel
        gateway.set_trl_kernel(_ServedKernel)
    kept = state.of(model)
    if not kept.trl_said:
        kept.trl_said = True
        _LOG.info(
            "fastckpt: TRL's fused LM head on %s computes through fastckpt.linear_log_probs (loss_head=True)",
            type(model).__name__,
        )


def _left_to_trl(model: torch.nn.Module, said: str, why: str) -> None:
    """Warn, once per model and case (`said`: the ModelState field that records it), that TRL's head computes for
    it, and why."""
    kept = state.of(model)
    if not getattr(kept, said):
        setattr(kept, said, True)
        warnings.warn(
            f"fastckpt.integrations.hf: {why}; TRL's head computes the log-probabilities, fastckpt's loss head "
            "does not",
            stacklevel=4,
        )


def _mixed_dtypes(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the head would compute in more than one dtype (no autocast to cast them to its dtype)."""
    if torch.is_autocast_enabled(hidden.device.type):
        return False
    return len({t.dtype for t in (hidden, weight, bias) if t is not None}) > 1


def _is_dtensor(tensor: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(tensor, DTensor)


_HOOKS = (  # what TrlHead.install registers: (the module it is on, the torch hook kind, the function)
    (lambda model: model.base_model, gateway.forward_pre_hooks, _before_backbone),
    (lambda model: model, gateway.forward_pre_hooks, _note_scored),
    (lambda model: model, gateway.forward_hooks, _forget_scored),
)


def _registered(model: torch.nn.Module) -> list[Any]:
    """The `remove()`s of the hooks TrlHead.install registered on `model` (found by their function: bound to the model,
    they follow a deep copy of it, which a handle would not)."""
    return [
        remove
        for module_of, hooks, function in _HOOKS
        for _, hook, remove in hooks(module_of(model))
        if getattr(hook, "__func__", None) is function
    ]


class TrlHead(Patch):
    """`enable(loss_head=True)` under TRL: TRL's fused head served for the model whenever TRL installs one."""

    @classmethod
    def wanted(cls, settings: Settings) -> bool:
        return settings.loss_head

    @classmethod
    def install(cls, pretrained: torch.nn.Module, settings: Settings) -> None:
        if _registered(pretrained):
            return
        pretrained.base_model.register_forward_pre_hook(types.MethodType(_before_backbone, pretrained))
        pretrained.register_forward_pre_hook(types.MethodType(_note_scored, pretrained), with_kwargs=True)
        pretrained.register_forward_hook(types.MethodType(_forget_scored, pretrained), always_call=True)

    @classmethod
    def remove(cls, pretrained: torch.nn.Module) -> None:
        """Leave TRL's fused head of `pretrained` to TRL again; TRL's kernel back when no model is served."""
        for remove in _registered(pretrained):
            remove()
        _served.discard(pretrained)
        if not _served and gateway.trl_kernel() is _ServedKernel:
            gateway.set_trl_kernel(_ServedKernel.trl_kernel)
        kept = state.read(pretrained)
        kept.trl_said = kept.trl_said_mixed = False
        kept.trl_scored = None
