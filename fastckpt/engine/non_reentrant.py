"""Non-reentrant checkpoint on saved-tensor hooks.

Forward runs under pack hooks that replace every saved tensor by a small `_Holder`. The first
unpack in a backward (one graph task) re-runs the segment under recompute hooks that fill the
holders, in save order, with the recomputed tensors; each is handed out once and then dropped.
With early stop the recompute is cut off as soon as every live holder is filled.

Under a policy with a recompute codec ('recompute:int4'), the recompute hooks store each recomputed
tensor through a SegmentStorage (compressed, or plain where keep_plain_reason says so) and the holder
gets it decoded when its node unpacks it: the recomputed segment's activations are never all live in
full precision at once.
"""

from __future__ import annotations

import contextlib
import uuid
import weakref
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.utils.checkpoint import CheckpointError

from fastckpt import _compat
from fastckpt.engine.debug import OpTrace, UnpackErrorCallback
from fastckpt.engine.flat_tree import FlatTree
from fastckpt.engine.options import CheckpointOptions
from fastckpt.engine.replay import ForwardState
from fastckpt.storage.packer import SegmentStorage, _Stored
from fastckpt.storage.roles import ParameterCast

DETERMINISM_CHECKS: dict[str, Callable[[torch.Tensor], Any]] = {
    "default": lambda x: {"shape": x.shape, "dtype": x.dtype, "device": x.device},
    "none": lambda x: None,
}

_DEBUG_TIP = (
    "Tip: pass debug=True to fastckpt.checkpoint (or use torch.utils.checkpoint.set_checkpoint_debug_enabled(True)) "
    "to see the operators run in forward and in recompute."
)


class _Handle:
    """Key of one recomputed tensor; weakly held so a freed holder frees its tensor."""


class _Holder:
    """Stands in for one saved tensor; maps graph-task id to the handle of its recomputed value."""

    def __init__(self) -> None:
        self.handles: dict[Any, _Handle | None] = {}


class _StoredRecomputed:
    """A recomputed tensor kept by a recompute codec, with the metadata the determinism check compares."""

    __slots__ = ("storage", "stored", "metadata")

    def __init__(self, storage: SegmentStorage, stored: _Stored, metadata: Any) -> None:
        self.storage = storage
        self.stored = stored
        self.metadata = metadata

    def value(self) -> torch.Tensor:
        return self.storage.unpack(self.stored)


class _StopRecompute(Exception):
    """Raised from the recompute pack hook once every holder is filled (early stop)."""


class _SaveInputs(torch.autograd.Function):
    """Saves the segment's tensor inputs as autograd SavedVariables.

    That gives them what any saved tensor gets: version-counter checks at unpack, and the
    saved-tensor hooks active around the call (save_on_cpu, or a fastckpt storage policy).
    """

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*tensors)
        return anchor.new_empty(0)

    @staticmethod
    def backward(ctx, *grads):  # never reached: the anchor output is not used by anything
        raise RuntimeError("fastckpt internal error: the input-saving node was differentiated")


class _Frame:
    """Everything one checkpointed call needs to recompute, per graph task."""

    def __init__(
        self,
        recompute_fn: Callable[..., Any],
        early_stop: bool,
        metadata_fn,
        on_unpack_error,
        recompute_storage: Callable[[], SegmentStorage] | None = None,
    ) -> None:
        self.recompute_fn = recompute_fn
        self.recompute_storage = recompute_storage  # a new storage per recomputation, or None: plain
        self.early_stop = early_stop
        self.metadata_fn = metadata_fn
        self.on_unpack_error: UnpackErrorCallback | None = on_unpack_error
        self.input_tree: FlatTree | None = None
        self.input_saver: Any = None
        self.input_index: list[int] = []  # per tensor input: its position among the distinct saved tensors
        self.input_saver_output: torch.Tensor | None = None
        self.weak_holders: list[weakref.ref[_Holder]] = []
        self.forward_metadata: list[Any] = []
        self.recomputed: defaultdict[Any, weakref.WeakKeyDictionary] = defaultdict(weakref.WeakKeyDictionary)
        self.recompute_count: defaultdict[Any, int] = defaultdict(int)
        self.is_recomputed: defaultdict[Any, bool] = defaultdict(bool)
        self.forward_completed = False
        self.ignore_count_mismatch = False

    def save_inputs(self, inputs: FlatTree) -> None:
        self.input_tree = inputs
        # Each distinct tensor is saved once and handed back at every position it held: a tensor passed
        # twice (attention's query, key and value) must come back as one object, or the recomputation may
        # take another path than the forward did (MultiheadAttention checks `query is key`) whenever the
        # saved inputs are unpacked as new tensors (stored through a codec).
        first: dict[int, int] = {}
        self.input_index = [first.setdefault(id(t), len(first)) for t in inputs.tensors]
        unique = list({id(t): t for t in inputs.tensors}.values())
        anchor = torch.empty(0, requires_grad=True)
        # Keep the node's (empty) output: some torch releases (2.11) free a custom Function's saved
        # tensors as soon as all its outputs are gone.
        self.input_saver_output = _SaveInputs.apply(anchor, *unique)
        self.input_saver = self.input_saver_output.grad_fn
        self.input_tree.tensors = []  # the saver node's SavedVariables own them from here on

    def inputs(self) -> tuple[tuple, dict]:
        saved = self.input_saver.saved_tensors
        return self.input_tree.rebuild([saved[i] for i in self.input_index])

    def check_recomputed(self, gid: Any) -> None:
        if self.ignore_count_mismatch:
            return
        if len(self.weak_holders) != self.recompute_count[gid]:
            raise CheckpointError(
                "fastckpt.checkpoint: A different number of tensors was saved during the original forward and "
                f"recomputation.\nNumber of tensors saved during forward: {len(self.weak_holders)}\n"
                f"Number of tensors saved during recomputation: {self.recompute_count[gid]}.\n{_DEBUG_TIP}"
            )
        mismatches = []
        for index, weak_holder in enumerate(self.weak_holders):
            holder = weak_holder()
            if holder is None:
                continue
            value = self.recomputed[gid][holder.handles[gid]]
            if isinstance(value, _StoredRecomputed):
                recomputed = value.metadata
            else:
                recomputed = self.metadata_fn(value)
            if recomputed != self.forward_metadata[index]:
                mismatches.append(
                    f"tensor at position {index}:\nsaved metadata: {self.forward_metadata[index]}\n"
                    f"recomputed metadata: {recomputed}\n"
                )
        if mismatches:
            raise CheckpointError(
                "fastckpt.checkpoint: Recomputed values for the following tensors have different metadata than "
                f"during the forward pass.\n{''.join(mismatches)}.\n{_DEBUG_TIP}"
            )


def _graph_exec_group() -> Any:
    get_group = _compat.graph_exec_group()
    if get_group is None:
        _compat.warn_missing("graph_exec_group")
        return None
    return get_group()


def _overlap_hint() -> str:
    if _graph_exec_group() is None:
        return ""
    return (
        "Performing two backward calls that overlap (i.e. require the same saved activation in order to compute "
        "gradients) is not allowed while under the torch.utils.checkpoint.GraphExecGroup context. "
    )


def _graph_task_id() -> Any:
    group = _graph_exec_group()
    if group is not None:
        return group
    gid = _compat.require("current_graph_task_id")()
    return gid if gid != -1 else uuid.uuid4().int  # unpacked outside backward (e.g. grad_fn._saved_*)


class _InternalHooks(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks marked as checkpoint-internal, so selective-checkpoint contexts and nested
    checkpoints look past them to the user's own hooks (torch's convention for these attributes)."""

    def __init__(self, pack_hook, unpack_hook) -> None:
        pack_hook._checkpoint_internal = True
        super().__init__(pack_hook, unpack_hook)

    def __enter__(self):
        self.pack_hook._user_hooks = _user_hooks_in_scope()
        return super().__enter__()

    def __exit__(self, *exc):
        del self.pack_hook._user_hooks  # a lasting reference would tie user hooks to the graph
        return super().__exit__(*exc)


def _innermost_hooks() -> tuple[Any, Any] | None:
    """The innermost saved-tensor hooks (pack, unpack) in scope, or None (none, or this torch cannot tell)."""
    top = _compat.top_saved_tensors_default_hooks()
    return top(False) if top is not None else None


def _user_hooks_in_scope():
    if not _compat.available("top_saved_tensors_default_hooks"):
        _compat.warn_missing("top_saved_tensors_default_hooks")
    hooks = _innermost_hooks()
    while hooks is not None and getattr(hooks[0], "_checkpoint_internal", False):
        hooks = getattr(hooks[0], "_user_hooks", None)
    return hooks


def _forward_hooks(frame: _Frame) -> _InternalHooks:
    def pack(x: torch.Tensor) -> _Holder:
        holder = _Holder()
        frame.weak_holders.append(weakref.ref(holder))
        with torch.no_grad():
            frame.forward_metadata.append(frame.metadata_fn(x))
        return holder

    def unpack(holder: _Holder) -> torch.Tensor:
        gid = _graph_task_id()
        if not frame.is_recomputed[gid]:
            args, kwargs = frame.inputs()
            storage = frame.recompute_storage() if frame.recompute_storage is not None else None
            try:
                watching = storage.watching() if storage is not None else contextlib.nullcontext()
                with _recompute_hooks(frame, gid, storage), torch.enable_grad(), watching:
                    frame.recompute_fn(*args, **kwargs)
            except _StopRecompute:
                pass
            frame.is_recomputed[gid] = True
            frame.check_recomputed(gid)
        handle = holder.handles.get(gid)
        if handle is None:
            raise CheckpointError(
                "fastckpt.checkpoint: Unpack is being triggered for a tensor that was already unpacked once. "
                f"{_overlap_hint()}If you are calling ctx.saved_tensors in backward, make sure to do so only once. "
                "Otherwise please open an issue with details on your use case."
            )
        holder.handles[gid] = None
        value = frame.recomputed[gid].pop(handle)  # free on use
        return value.value() if isinstance(value, _StoredRecomputed) else value

    if frame.on_unpack_error is not None:
        plain_unpack = unpack

        def unpack(holder: _Holder) -> torch.Tensor:
            try:
                return plain_unpack(holder)
            except CheckpointError as error:
                frame.on_unpack_error(error)

    return _InternalHooks(pack, unpack)


def _recompute_hooks(frame: _Frame, gid: Any, storage: SegmentStorage | None = None) -> _InternalHooks:
    """Hooks that hand each tensor the recomputation saves to its holder (through `storage` when given)."""
    disable_current_modes = _compat.require("disable_current_modes") if storage is not None else None

    def pack(saved: torch.Tensor) -> Any:
        x = saved.detach() if saved.requires_grad else saved  # the recompute graph itself is never differentiated
        index = frame.recompute_count[gid]
        frame.recompute_count[gid] += 1
        if index >= len(frame.weak_holders):
            if not frame.forward_completed:  # backward inside the forward: the forward is still growing
                frame.ignore_count_mismatch = True
                return x
            raise CheckpointError(
                "fastckpt.checkpoint: trying to save more tensors during recomputation than during the original "
                f"forward pass.\n{_DEBUG_TIP}"
            )
        holder = frame.weak_holders[index]()
        packed: Any = x
        if holder is not None:  # None: its graph was already freed, nobody will unpack it
            handle = _Handle()
            holder.handles[gid] = handle
            if storage is None:
                frame.recomputed[gid][handle] = x
            else:
                with torch.no_grad():
                    metadata = frame.metadata_fn(x)
                # The codec's own ops run outside the recomputation's dispatch modes: a selective-checkpoint
                # context_fn replays only the forward's ops, and debug=True traces only the segment's.
                with disable_current_modes():
                    packed = storage.pack(saved)  # the saved tensor itself: its identity dedups repeated saves
                frame.recomputed[gid][handle] = _StoredRecomputed(storage, packed, metadata)
        if frame.early_stop and frame.recompute_count[gid] == len(frame.weak_holders):
            raise _StopRecompute
        # With a storage, the recompute graph keeps the stored form too: returning x would keep every
        # full-precision activation alive for as long as the recomputation runs (its graph holds them).
        return packed

    def unpack(packed: Any) -> torch.Tensor:
        # Reached only by a backward run inside the recomputation itself (torch.autograd.grad in the
        # segment): it gets the stored tensors decoded.
        if not isinstance(packed, (_Stored, ParameterCast)):
            return packed
        with disable_current_modes():
            return storage.unpack(packed)

    if frame.early_stop:  # (saves_left_to_recompute) without it, what runs after the last save reads the outputs
        pack.saves_left = lambda: len(frame.weak_holders) - frame.recompute_count[gid]
    return _InternalHooks(pack, unpack)


def saves_left_to_recompute() -> int | None:
    """Inside a recomputation with early stop whose hooks are the innermost saved-tensor hooks: how many of the
    tensors the forward saved it has yet to remake; None anywhere else. A function whose own saves are the last
    ones can skip computing its output there: the recomputation stops at them, and nothing reads the output
    (fastckpt.tiling.recompute_in_tiles does)."""
    hooks = _innermost_hooks()
    saves_left = getattr(hooks[0], "saves_left", None) if hooks is not None else None
    return saves_left() if saves_left is not None else None


def _resolve_debug(debug: bool) -> bool:
    globally = _compat.checkpoint_debug_enabled()
    if globally is None and not _compat.available("checkpoint_debug_enabled"):
        _compat.warn_missing("checkpoint_debug_enabled")
    return debug if globally is None else globally


def _resolve_early_stop(early_stop: bool) -> bool:
    globally = _compat.checkpoint_early_stop()
    if globally is None and not _compat.available("checkpoint_early_stop"):
        _compat.warn_missing("checkpoint_early_stop")
    return early_stop if globally is None else globally


def checkpoint_non_reentrant(
    function: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    options: CheckpointOptions,
    input_hooks: Callable[[], Any] | None = None,
    recompute_storage: Callable[[], SegmentStorage] | None = None,
) -> Any:
    """Run `function` now, keep only its inputs, and recompute it in backward.

    `input_hooks`, when given, returns a saved-tensor-hooks context through which the inputs are
    stored (a storage policy such as recompute+offload). `recompute_storage`, when given, returns a
    fresh SegmentStorage per recomputation, through which the recomputed tensors are kept until used.
    """
    context_fn, on_unpack_error = options.context_fn, None
    if _resolve_debug(options.debug):
        if context_fn is not torch_checkpoint.noop_context_fn:
            raise ValueError("debug=True is incompatible with non-default context_fn")
        trace = OpTrace()
        context_fn, on_unpack_error = trace.context_fn, trace.raise_with_trace
    metadata_fn = DETERMINISM_CHECKS[options.determinism_check]
    forward_context, recompute_context = context_fn()
    # Selective checkpointing's caching mode reads this to decide whether the tensors it caches go
    # through the user's saved-tensor hooks (torch sets it the same way).
    if hasattr(forward_context, "respect_saved_tensors_hooks"):
        forward_context.respect_saved_tensors_hooks = options.respect_saved_tensors_hooks
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    _compat.require("current_graph_task_id")  # raise now rather than in the backward
    if recompute_storage is not None:
        _compat.require("disable_current_modes")

    inputs = FlatTree((args, kwargs))
    state = ForwardState.capture(inputs.tensors, options.preserve_rng_state)

    def recompute_fn(*re_args: Any, **re_kwargs: Any) -> None:
        with state.replay(), recompute_context:
            function(*re_args, **re_kwargs)

    frame = _Frame(
        recompute_fn, _resolve_early_stop(options.early_stop), metadata_fn, on_unpack_error, recompute_storage
    )
    with input_hooks() if input_hooks is not None else contextlib.nullcontext():
        frame.save_inputs(inputs)

    completed = False
    with _forward_hooks(frame), forward_context:
        output = function(*args, **kwargs)
        completed = True
    if not completed:
        raise RuntimeError(
            "fastckpt.checkpoint: the forward context provided by context_fn suppressed an exception raised during "
            "the checkpointed forward. This is not supported because checkpoint cannot return a value for a failed "
            "forward."
        )
    frame.forward_completed = True
    state.check_device_not_initialised_in_forward()
    return output
