"""Per-op hybrids: selective checkpointing whose saved op outputs are kept through a codec.

    context_fn = fastckpt.hybrid.selective(save=[torch.ops.aten.mm, ...], store="int8")
    y = fastckpt.checkpoint(block, x, context_fn=context_fn)             # or policy="recompute+int8", ...
    fastckpt.hybrid.wrap(block, context_fn)                              # a module whose calls do that

This is torch's selective activation checkpointing (SAC, `create_selective_checkpoint_contexts`): in the
forward, the outputs of the ops `save` names (an op list, or a policy function returning a
`torch.utils.checkpoint.CheckpointPolicy`) are kept; every other op is recomputed in backward, and the
recomputation takes the kept outputs instead of running those ops again. What fastckpt adds is `store`: the
kept outputs go through a fastckpt storage policy (a codec, offload) instead of staying in full precision,
and each is decoded when the recomputation reaches its op, then dropped. The checkpoint call's own `policy`
still applies to the segment's inputs and to what the recomputation saves ('recompute+int8',
'recompute:int8', ...). `track()` lists the kept outputs as a segment labelled 'selective:<store>'.

How the outputs reach the codec: torch 2.14's SAC routes what it caches through the saved-tensor hooks the
checkpoint sees as the user's (`respect_saved_tensors_hooks`), found by walking past checkpoint-internal
hooks (`_checkpoint_internal`, `_user_hooks`: torch's convention, which fastckpt's engine follows too).
While the segment's forward runs, this module's forward context points that walk at a fastckpt storage,
for this segment only: the segment's inputs, the tensors outside the segment and the hooks of the caller
(save_on_cpu, say) are untouched, and the hooks of the caller do not see the kept outputs (pass
store='int8+offload' to move them to host memory).

With `within=[functions]` the ops are looked for only inside calls of those Python-level torch functions,
and fastckpt keeps and hands back their outputs itself (fastckpt.engine.kept_ops): a function mode watches the
segment's few Python-level calls instead of a dispatch mode seeing every op, which saves tens of microseconds
per op in the forward and again in the recomputation; it also keeps in-place random fills (`bernoulli_`,
the mask CPU dropout draws), which torch's SAC cannot. `keep_attention(store)` is that form for the fused
attention and dropout's masks: the recomputation reruns projections, norms and the MLP, but neither the
attention kernel nor a random draw.

Non-reentrant checkpointing only (fastckpt.checkpoint or torch.utils.checkpoint.checkpoint with
use_reentrant=False), in eager mode; without `within`, torch 2.14 or later when `store` changes how outputs
are kept.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from fastckpt import _compat
from fastckpt.api import CheckpointWrapper, checkpoint
from fastckpt.engine import kept_ops
from fastckpt.policies import Policy, error_reason
from fastckpt.storage.packer import SegmentStorage

PREFIX = "selective:"  # labels: 'selective:int8' is selective(store='int8')
# ... and 'selective-attention:int8' is keep_attention(store='int8'): only the fused attention (and dropout's masks)
# kept, so a recomputation reruns the cheap projections and pointwise ops but not the attention kernel.
ATTENTION_PREFIX = "selective-attention:"

# What `save` defaults to: matrix products, convolutions and fused attention, the ops whose outputs are
# costly to recompute and whose neighbours (norms, activations, dropout, residual adds) are cheap.
_ATTENTION_NAMES = (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
)  # fmt: skip
_DEFAULT_SAVE_NAMES = ("mm", "addmm", "bmm", "baddbmm", "convolution", *_ATTENTION_NAMES)

OpSelection = Iterable[Any] | Callable[..., Any]


def default_save_ops() -> tuple[torch._ops.OpOverloadPacket, ...]:
    """The ops `selective()` saves by default (those this torch has): matmuls, convolution, fused attention."""
    return tuple(getattr(torch.ops.aten, name) for name in _DEFAULT_SAVE_NAMES if hasattr(torch.ops.aten, name))


def attention_ops() -> tuple[torch._ops.OpOverloadPacket, ...]:
    """The fused attention kernels of `default_save_ops()` (those this torch has), for `save=`."""
    return tuple(getattr(torch.ops.aten, name) for name in _ATTENTION_NAMES if hasattr(torch.ops.aten, name))


def keep_attention(store: str | Policy | None = "int8") -> Selective:
    """A context_fn keeping the fused attention's outputs through `store` and dropout's masks (CPU dropout's
    `bernoulli_` fills, exact), watched inside `F.scaled_dot_product_attention` and `F.dropout` calls only
    (`within`): the recomputation reruns everything else, but neither the attention kernel nor a random draw."""
    return Selective(
        save=(*attention_ops(), *kept_ops.RANDOM_FILLS),
        store=store,
        within=(torch.nn.functional.scaled_dot_product_attention, torch.nn.functional.dropout),
    )


def _sac_honours_hooks() -> bool:
    """True when this torch's SAC can route what it caches through saved-tensor hooks (torch >= 2.14), and
    fastckpt can find the hooks it routes them to."""
    if _compat.current_user_saved_tensors_hooks() is None:
        return False
    if _compat.top_saved_tensors_default_hooks() is None:
        _compat.warn_missing("top_saved_tensors_default_hooks")
        return False
    return True


class Selective:
    """A context_fn for a non-reentrant checkpoint: SAC saving `save`'s outputs through `store`.

    Build it with `selective()`. Calling it returns (forward context, recomputation context), as
    `create_selective_checkpoint_contexts` does; each call is one segment's storage.
    """

    def __init__(
        self, save: OpSelection | None = None, store: str | Policy | None = "int8", within: Iterable[Any] | None = None
    ) -> None:
        self.store = _storage_policy(store)
        self.within = _functions(within)
        if save is None:
            save = default_save_ops()
        if callable(save) and not isinstance(save, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            if self.within is not None:
                raise TypeError(
                    "fastckpt.hybrid.selective: with `within`, `save` must be a list of aten ops, not a policy function"
                )
            self._policy_fn = save
            self.ops: tuple = ()
        else:
            self.ops = _op_list(save)
            overloads = frozenset(op for op in self.ops if isinstance(op, torch._ops.OpOverload))
            packets = frozenset(op for op in self.ops if isinstance(op, torch._ops.OpOverloadPacket))

            def chosen(op: Any) -> bool:
                return op in overloads or getattr(op, "overloadpacket", None) in packets

            def policy_fn(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
                return CheckpointPolicy.MUST_SAVE if chosen(op) else CheckpointPolicy.PREFER_RECOMPUTE

            self._chosen = chosen
            self._policy_fn = policy_fn
        fills = [op for op in self.ops if getattr(op, "overloadpacket", op) in kept_ops.RANDOM_FILLS]
        if fills and self.within is None:
            raise ValueError(
                f"fastckpt.hybrid.selective: `save` holds {fills}, an in-place random fill, which torch's selective "
                "checkpointing cannot keep; pass `within` (e.g. within=[torch.nn.functional.dropout]) so that "
                "fastckpt keeps it"
            )
        if self.within is not None:
            return  # fastckpt keeps the outputs itself: torch's SAC is not used
        if not _plain(self.store) and not _sac_honours_hooks():
            raise RuntimeError(
                f"fastckpt.hybrid.selective: store={str(self.store)!r} needs selective checkpointing to route what it "
                f"saves through saved-tensor hooks, which torch {torch.__version__} cannot (torch 2.14 or later); "
                "use store='save' to keep the saved outputs in full precision"
            )

    def __call__(self) -> tuple[Any, Any]:
        if self.within is not None:
            return kept_ops.contexts(SegmentStorage(self.store, label=str(self)), str(self), self.within, self._chosen)
        forward, recompute = create_selective_checkpoint_contexts(self._policy_fn)
        if _plain(self.store):
            return forward, recompute  # torch's SAC as it is
        return _SelectiveForward(forward, self.store, str(self)), recompute

    @property
    def prefix(self) -> str:
        """How labels name it: 'selective-attention:' for the attention ops alone (and dropout's masks)."""
        attention, fills = set(attention_ops()), set(kept_ops.RANDOM_FILLS)
        ops = set(self.ops)
        return ATTENTION_PREFIX if ops & attention and ops <= attention | fills else PREFIX

    def __str__(self) -> str:
        return f"{self.prefix}{self.store}"

    def __repr__(self) -> str:
        save = [str(op) for op in self.ops] if self.ops else getattr(self._policy_fn, "__name__", "policy_fn")
        names = sorted(getattr(f, "__name__", repr(f)) for f in self.within or ())
        within = "" if self.within is None else f", within={names}"
        return f"fastckpt.hybrid.selective(save={save}, store={str(self.store)!r}{within})"


def selective(
    save: OpSelection | None = None, store: str | Policy | None = "int8", within: Iterable[Any] | None = None
) -> Selective:
    """A context_fn for fastckpt.checkpoint: keep the outputs of the ops in `save` through `store`, recompute
    every other op in backward.

    save: aten ops (`torch.ops.aten.mm` matches every overload, `torch.ops.aten.mm.default` only that one),
        or a policy function `(ctx, op, *args, **kwargs) -> CheckpointPolicy` (or bool) as torch's
        `create_selective_checkpoint_contexts` takes; default: `default_save_ops()` (matmuls, convolution and
        fused attention).
    store: how the saved outputs are kept until the recomputation takes them: a storage policy string
        ('int8', 'fp8', 'int4', 'int2', optionally '+offload'), a fastckpt.Policy with recompute=False
        (for group size, min_tensor_bytes, a per-tensor rule), or 'save'/None to keep them in full precision
        (torch's SAC). Tensors a codec does not store (integer, small, parameters) stay as they are.
    within: Python-level torch functions (e.g. `torch.nn.functional.scaled_dot_product_attention`,
        `torch.nn.functional.dropout`) inside whose calls alone `save`'s ops are looked for; fastckpt then keeps
        their outputs itself, without torch's SAC and its per-op cost, and may keep `torch.ops.aten.bernoulli_`
        fills (dropout's masks on CPU) too. An op of `save` run outside those calls is recomputed. None: every
        op of the segment is looked at (torch's SAC).

    Use: `fastckpt.checkpoint(fn, *args, context_fn=selective(...), policy=...)` with a recompute policy
    (the default). Non-reentrant only; `respect_saved_tensors_hooks` may be None or True.
    """
    return Selective(save, store, within)


def wrap(module: torch.nn.Module, context_fn: Selective, policy: str | Policy | None = None) -> SelectiveWrapper:
    """`module` with each call checkpointed under `context_fn` (a `selective()`) and `policy`; state-dict keys
    stay those of `module` (a fastckpt.CheckpointWrapper)."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"fastckpt.hybrid.wrap: `module` must be a torch.nn.Module, got {type(module)}")
    if isinstance(module, CheckpointWrapper):
        raise ValueError("fastckpt.hybrid.wrap: `module` is already wrapped by fastckpt; wrap the inner module once")
    if not isinstance(context_fn, Selective):
        raise TypeError(
            "fastckpt.hybrid.wrap: `context_fn` must be a fastckpt.hybrid.selective(...), got "
            f"{type(context_fn).__name__}"
        )
    if policy is not None and not Policy.parse(policy).recompute:
        raise ValueError(_needs_recompute(policy))
    return SelectiveWrapper(module, context_fn, policy)


class SelectiveWrapper(CheckpointWrapper):
    """A CheckpointWrapper whose calls pass a selective context_fn."""

    def __init__(self, module: torch.nn.Module, context_fn: Selective, policy: str | Policy | None) -> None:
        super().__init__(module, policy, use_reentrant=False)
        self.selective = context_fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(
            self.checkpointed, *args, use_reentrant=False, policy=self.policy, context_fn=self.selective, **kwargs
        )


# ---- internals -------------------------------------------------------------------------------------------


def _needs_recompute(policy: Any) -> str:
    return (
        f"selective checkpointing recomputes the ops it does not save, so it needs a recompute policy; "
        f"policy={str(policy)!r} stores tensors instead (use 'recompute', 'recompute+int8', 'recompute:int8', ...)"
    )


def _storage_policy(store: str | Policy | None) -> Policy:
    if store is None:
        store = "save"
    try:
        policy = Policy.parse(store)
    except (TypeError, ValueError) as error:
        raise ValueError(f"fastckpt.hybrid.selective: store={store!r}: {error_reason(error)}") from None
    if policy.recompute:
        raise ValueError(
            f"fastckpt.hybrid.selective: store={str(policy)!r} recomputes; `store` is how the saved op outputs are "
            "kept: a storage policy such as 'int8', 'int4+offload' or 'save' (the recomputation is the checkpoint "
            "call's `policy`)"
        )
    return policy


def _functions(within: Iterable[Any] | None) -> frozenset | None:
    if within is None:
        return None
    if isinstance(within, (str, bytes)) or not isinstance(within, Iterable):
        raise TypeError(
            "fastckpt.hybrid.selective: `within` must be a list of torch functions (e.g. "
            f"[torch.nn.functional.scaled_dot_product_attention]) or None, got {type(within).__name__}"
        )
    functions = frozenset(within)
    aten_ops = (torch._ops.OpOverload, torch._ops.OpOverloadPacket)
    wrong = [f for f in functions if not callable(f) or isinstance(f, aten_ops)]
    if wrong:
        raise TypeError(
            f"fastckpt.hybrid.selective: `within` holds {wrong!r}; name Python-level torch functions such as "
            "torch.nn.functional.scaled_dot_product_attention (the aten ops go in `save`)"
        )
    if not functions:
        raise ValueError("fastckpt.hybrid.selective: `within` is empty (None looks at every op)")
    return functions


def _op_list(save: Iterable[Any]) -> tuple:
    if isinstance(save, (str, bytes)) or not isinstance(save, Iterable):
        raise TypeError(
            "fastckpt.hybrid.selective: `save` must be a list of aten ops (e.g. [torch.ops.aten.mm]) or a policy "
            f"function (ctx, op, *args, **kwargs) -> CheckpointPolicy, got {type(save).__name__}"
        )
    ops = tuple(save)
    wrong = [op for op in ops if not isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))]
    if wrong:
        raise TypeError(
            f"fastckpt.hybrid.selective: `save` holds {wrong!r}, which are not aten ops; name them as "
            "torch.ops.aten.mm (every overload) or torch.ops.aten.mm.default"
        )
    if not ops:
        raise ValueError("fastckpt.hybrid.selective: `save` is empty (that is plain recomputation: drop context_fn)")
    return ops


def _plain(policy: Policy) -> bool:
    """True when a storage policy keeps tensors as they are (no codec, no offload): SAC's own behaviour."""
    return policy.codec is None and not policy.offload and policy.rule is None


class _SelectiveForward:
    """SAC's forward (caching) mode, entered with a fastckpt storage as the hooks SAC sees as the user's."""

    def __init__(self, caching_mode: Any, store: Policy, label: str) -> None:
        self.caching_mode = caching_mode
        self.store = store
        self.label = label
        # The checkpoint call's respect_saved_tensors_hooks (its engine sets it here, as on SAC's own mode).
        self.respect_saved_tensors_hooks: bool | None = None
        self._internal_hook: Any = None
        self._outer_user_hooks: Any = None

    def __enter__(self) -> _SelectiveForward:
        if self.respect_saved_tensors_hooks is False:
            raise ValueError(
                "fastckpt.checkpoint: respect_saved_tensors_hooks=False keeps what selective checkpointing saves away "
                f"from saved-tensor hooks, so {self.label!r} cannot store it; pass True or leave it None"
            )
        top = _compat.require("top_saved_tensors_default_hooks")(False)
        if top is None or not getattr(top[0], "_checkpoint_internal", False):
            raise RuntimeError(
                f"fastckpt.hybrid.selective ({self.label}): its contexts must be entered by a non-reentrant "
                "checkpoint (pass it as context_fn to fastckpt.checkpoint, or to torch.utils.checkpoint.checkpoint "
                "with use_reentrant=False)"
            )
        storage = SegmentStorage(self.store, label=self.label)
        self._internal_hook = top[0]
        self._outer_user_hooks = getattr(top[0], "_user_hooks", None)
        top[0]._user_hooks = (storage.pack, storage.unpack)
        self.caching_mode.respect_saved_tensors_hooks = True
        try:
            self.caching_mode.__enter__()
        except BaseException:
            self._restore()
            raise
        return self

    def __exit__(self, *exc: Any) -> Any:
        try:
            return self.caching_mode.__exit__(*exc)
        finally:
            self._restore()

    def _restore(self) -> None:
        self._internal_hook._user_hooks = self._outer_user_hooks
        self._internal_hook = self._outer_user_hooks = None  # no lasting reference from here to the graph
