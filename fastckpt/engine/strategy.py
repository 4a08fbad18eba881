"""How one checkpointed segment runs: its Policy, interpreted in this one place.

A Strategy says whether the segment recomputes, what it stores and through which storage (its inputs
under a recompute policy, every tensor it saves without one), and through which storage each recomputation
keeps what it saves. Eager checkpoint runs a segment through `run`; the compiled path asks `stores` which
segments' saved tensors its graph storage encodes and falls back to `run`; DeepSpeed hands `run` its
partitioning as the storage; the planner's candidates reach it through `fastckpt.wrap`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fastckpt.engine.non_reentrant import DETERMINISM_CHECKS, checkpoint_non_reentrant
from fastckpt.engine.options import CheckpointOptions
from fastckpt.engine.reentrant import checkpoint_reentrant
from fastckpt.policies import Policy, resolve
from fastckpt.storage.accounting import SegmentRecord
from fastckpt.storage.packer import SegmentStorage


class Storage(Protocol):
    """What keeps a segment's stored tensors: saved-tensor hooks and the track() record they fill."""

    record: SegmentRecord

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks: ...


_OWN = object()  # run(storage=...) default: the policy's own storage


@dataclass(frozen=True)
class Strategy:
    """One segment's policy, read as what the engines do with it."""

    policy: Policy

    @classmethod
    def of(cls, policy: str | Policy | None) -> Strategy:
        """The strategy of a call's `policy` argument (None: the current default, see fastckpt.policy)."""
        return cls(resolve(policy))

    @property
    def recompute(self) -> bool:
        """True when the segment runs again in backward (only its inputs are kept from the forward)."""
        return self.policy.recompute

    @property
    def stores(self) -> bool:
        """True when what the segment keeps goes through a storage: its inputs under a recompute policy with
        a codec or offload, every tensor it saves under a storage policy."""
        return not self.policy.recompute or self.policy.stores_inputs

    def storage(self) -> SegmentStorage | None:
        """A new storage for what one call keeps (None: kept as autograd keeps it)."""
        return SegmentStorage(self.policy) if self.stores else None

    def recompute_storage(self) -> Callable[[], SegmentStorage] | None:
        """A factory of the storage one recomputation keeps its saved tensors in (None: plain, as stock)."""
        storage_policy = self.policy.recomputed_storage()
        if storage_policy is None:
            return None
        label = f"{self.policy} (recomputed)"
        return lambda: SegmentStorage(storage_policy, label=label)

    def check(self, options: CheckpointOptions, kwargs: dict) -> None:
        """Refuse what this policy cannot do with these options, before anything runs."""
        if not self.recompute:
            if options.has_recompute_only_options:
                raise ValueError(
                    f"fastckpt.checkpoint: policy={str(self.policy)!r} stores tensors instead of recomputing, so "
                    "`context_fn`, `debug` and `respect_saved_tensors_hooks` (which act on the recomputation) do not "
                    "apply; drop them or use a policy with 'recompute'"
                )
            return
        if options.use_reentrant:
            if kwargs:
                raise ValueError("Unexpected keyword arguments: " + ",".join(kwargs))
            if options.has_recompute_only_options:
                raise ValueError(
                    "Passing `context_fn`, `debug`, or `respect_saved_tensors_hooks` is only supported when "
                    "use_reentrant=False."
                )

    def run(
        self,
        function: Callable[..., Any],
        args: tuple,
        kwargs: dict,
        options: CheckpointOptions,
        storage: Storage | None | object = _OWN,
    ) -> Any:
        """Run `function(*args, **kwargs)` as a checkpointed segment.

        `storage` keeps what the segment stores (its inputs under recompute, everything it saves without);
        by default the policy's own (`storage()`); a caller that shards or moves tensors itself passes its
        own, or None to keep them plainly.
        """
        check_call(function, options)
        return self._run(function, args, kwargs, options, storage)

    def _run(
        self, function: Callable[..., Any], args: tuple, kwargs: dict, options: CheckpointOptions, storage: Any
    ) -> Any:
        self.check(options, kwargs)
        with _casts_not_cached():
            return self._run_segment(function, args, kwargs, options, storage)

    def _run_segment(
        self, function: Callable[..., Any], args: tuple, kwargs: dict, options: CheckpointOptions, storage: Any
    ) -> Any:
        if storage is _OWN:
            storage = self.storage()
        input_hooks = storage.hooks if storage is not None else None
        if not self.recompute:
            if input_hooks is None:
                return function(*args, **kwargs)
            with input_hooks():  # every tensor the segment saves goes through the storage
                return function(*args, **kwargs)
        recompute_storage = self.recompute_storage()
        if options.use_reentrant:
            if recompute_storage is not None:
                function = _saving_through(function, recompute_storage)
            return checkpoint_reentrant(
                function, args, preserve_rng_state=options.preserve_rng_state, input_hooks=input_hooks
            )
        return checkpoint_non_reentrant(
            function, args, kwargs, options, input_hooks=input_hooks, recompute_storage=recompute_storage
        )


_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")


def _casts_not_cached() -> contextlib.AbstractContextManager:
    """Autocast's cast cache off while a segment's forward runs (inside the caller's autocast region).

    Under autocast, each fp32 weight a product takes is cast to the low-precision dtype once and the copy is
    cached until the outermost autocast region ends: a bf16 copy of every weight the forward used, alive through
    the rest of the forward and the loss (in a mixed-precision full fine-tune of Llama-3.2-1B, 1.6 GB at the
    loss head). A checkpointed segment's backward does not use them: the recomputation casts again, and a
    stored segment keeps its weights by reference (`roles.ParameterCast`). Without the cache each copy is freed
    once its product is done; a weight used twice in a segment is cast twice. The values are the same."""
    if not torch.is_autocast_cache_enabled():
        return contextlib.nullcontext()
    if not any(torch.amp.is_autocast_available(d) and torch.is_autocast_enabled(d) for d in _AUTOCAST_DEVICES):
        return contextlib.nullcontext()
    # The switch is global (every device type's casts): one nested region with each setting kept but the cache
    return torch.autocast(
        "cpu", dtype=torch.get_autocast_dtype("cpu"), enabled=torch.is_autocast_enabled("cpu"), cache_enabled=False
    )


def check_call(function: Any, options: CheckpointOptions) -> None:
    """Refuse a call no policy can run (checked before the policy is read, as torch checks them first)."""
    if not callable(function):
        raise TypeError(
            f"fastckpt.checkpoint: `function` must be callable (a module or function), got {type(function)}"
        )
    if options.determinism_check not in DETERMINISM_CHECKS:
        raise ValueError(
            f"determinism_check should be one of {list(DETERMINISM_CHECKS)}, but got {options.determinism_check}"
        )


def _saving_through(function: Callable[..., Any], storage: Callable[[], SegmentStorage]) -> Callable[..., Any]:
    """`function`, saving through a fresh `storage()` when it runs with grad: the reentrant engine runs the
    forward without grad (nothing saved) and the recomputation with it, whose saved tensors then go through
    the storage until the engine's inner backward uses them."""

    def run(*args: Any) -> Any:
        if not torch.is_grad_enabled():
            return function(*args)
        with storage().hooks():
            return function(*args)

    return run


# Eager: dynamo never traces the engine (it would trace the forward but not the recompute, and the two would
# save different tensors); under torch.compile a segment gets here only through a graph break.
@torch.compiler.disable
def run_segment(
    function: Callable[..., Any], args: tuple, kwargs: dict, options: CheckpointOptions, policy: str | Policy | None
) -> Any:
    """One eager checkpointed call under `policy` (None: the current default)."""
    check_call(function, options)
    return Strategy.of(policy)._run(function, args, kwargs, options, _OWN)
