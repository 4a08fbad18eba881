"""The public entry points: checkpoint and checkpoint_sequential (drop-ins for torch.utils.checkpoint)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.checkpoint import noop_context_fn

from fastckpt.compiled import checkpoint_in_graph
from fastckpt.engine.non_reentrant import DETERMINISM_CHECKS, checkpoint_non_reentrant
from fastckpt.engine.options import CheckpointOptions
from fastckpt.engine.reentrant import checkpoint_reentrant
from fastckpt.policies import Policy, resolve
from fastckpt.storage.packer import SegmentStorage


def checkpoint(
    function: Callable[..., Any] | None = None,
    *args: Any,
    use_reentrant: bool | None = None,
    preserve_rng_state: bool = True,
    context_fn: Callable[[], tuple[Any, Any]] = noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    respect_saved_tensors_hooks: bool | None = None,
    policy: str | Policy | None = None,
    **kwargs: Any,
) -> Any:
    """Checkpoint `function(*args, **kwargs)`; torch.utils.checkpoint.checkpoint's contract plus `policy`.

    use_reentrant=None means non-reentrant (no warning). Called without a function, returns a
    decorator: `checkpoint(use_reentrant=False, policy="int8")(fn)(*args)`.
    """
    options = CheckpointOptions(
        use_reentrant=use_reentrant,
        preserve_rng_state=preserve_rng_state,
        context_fn=context_fn,
        determinism_check=determinism_check,
        debug=debug,
        early_stop=early_stop,
        respect_saved_tensors_hooks=respect_saved_tensors_hooks,
    )
    if function is None and not args:
        if kwargs:
            raise ValueError("Unexpected keyword arguments: " + ",".join(kwargs))
        return lambda fn: _Checkpointed(fn, options, policy)
    return _dispatch(function, args, kwargs, options, policy)


class _Checkpointed:
    """The curried form: a callable (and method decorator) that checkpoints each call."""

    def __init__(self, function: Callable[..., Any], options: CheckpointOptions, policy: str | Policy | None) -> None:
        self.function = function
        self.options = options
        self.policy = policy
        functools.update_wrapper(self, function, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _dispatch(self.function, args, kwargs, self.options, self.policy)

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        bind = getattr(self.function, "__get__", None)
        if instance is None or bind is None:
            return self
        return _Checkpointed(bind(instance, owner), self.options, self.policy)


def _dispatch(
    function: Callable[..., Any], args: tuple, kwargs: dict, options: CheckpointOptions, policy: str | Policy | None
) -> Any:
    if torch.compiler.is_compiling():  # dynamo is tracing: into the graph where fastckpt.compiled can
        return checkpoint_in_graph(function, args, kwargs, options, policy, run_eagerly=_run)
    return _run(function, args, kwargs, options, policy)


# Eager: dynamo never traces the engine (it would trace the forward but not the recompute, and the two would
# save different tensors); under torch.compile a segment gets here only through a graph break.
@torch.compiler.disable
def _run(
    function: Callable[..., Any], args: tuple, kwargs: dict, options: CheckpointOptions, policy: str | Policy | None
) -> Any:
    if not callable(function):
        raise TypeError(f"checkpoint: `function` must be callable (a module or function), got {type(function)}")
    if options.determinism_check not in DETERMINISM_CHECKS:
        raise ValueError(
            f"determinism_check should be one of {list(DETERMINISM_CHECKS)}, but got {options.determinism_check}"
        )
    resolved = resolve(policy)
    if not resolved.recompute:
        if options.has_recompute_only_options:
            raise ValueError(
                f"policy={str(resolved)!r} stores tensors instead of recomputing, so `context_fn`, `debug` and "
                "`respect_saved_tensors_hooks` (which act on the recomputation) do not apply; drop them or use a "
                "policy with 'recompute'"
            )
        return _run_stored(function, args, kwargs, resolved)
    input_hooks = _input_hooks(resolved)
    recompute_storage = _recompute_storage(resolved)
    if options.use_reentrant:
        if kwargs:
            raise ValueError("Unexpected keyword arguments: " + ",".join(kwargs))
        if options.has_recompute_only_options:
            raise ValueError(
                "Passing `context_fn`, `debug`, or `respect_saved_tensors_hooks` is only supported when "
                "use_reentrant=False."
            )
        if recompute_storage is not None:
            function = _recompute_through(function, recompute_storage)
        return checkpoint_reentrant(
            function, args, preserve_rng_state=options.preserve_rng_state, input_hooks=input_hooks
        )
    return checkpoint_non_reentrant(
        function, args, kwargs, options, input_hooks=input_hooks, recompute_storage=recompute_storage
    )


def _input_hooks(policy: Policy) -> Callable[[], Any] | None:
    """Saved-tensor hooks through which a recompute policy stores the segment's inputs (None: plainly)."""
    if not policy.stores_inputs:
        return None
    return SegmentStorage(policy).hooks


def _recompute_storage(policy: Policy) -> Callable[[], SegmentStorage] | None:
    """A factory of the storage that keeps one recomputation's saved tensors (None: plain, as stock)."""
    storage_policy = policy.recomputed_storage()
    if storage_policy is None:
        return None
    label = f"{policy} (recomputed)"
    return lambda: SegmentStorage(storage_policy, label=label)


def _recompute_through(function: Callable[..., Any], storage: Callable[[], SegmentStorage]) -> Callable[..., Any]:
    """`function`, saving through a fresh `storage()` when it runs with grad: the reentrant engine runs the
    forward without grad (nothing saved) and the recomputation with it, whose saved tensors then go through
    the storage until the engine's inner backward uses them."""

    def run(*args: Any) -> Any:
        if not torch.is_grad_enabled():
            return function(*args)
        with storage().hooks():
            return function(*args)

    return run


def _run_stored(function: Callable[..., Any], args: tuple, kwargs: dict, policy: Policy) -> Any:
    """A storage policy: no recompute; every tensor saved for backward goes through the policy's storage."""
    with SegmentStorage(policy).hooks():
        return function(*args, **kwargs)


def checkpoint_sequential(
    functions: torch.nn.Sequential | Iterable[Callable[[Any], Any]],
    segments: int,
    input: Any,
    use_reentrant: bool | None = None,
    policy: str | Policy | None = None,
    **kwargs: Any,
) -> Any:
    """Split `functions` into `segments` chunks and checkpoint them: all but the last for recompute policies
    (torch's layout), all of them for storage policies."""
    preserve_rng_state = kwargs.pop("preserve_rng_state", True)
    if kwargs:
        raise ValueError("Unexpected keyword arguments: " + ",".join(kwargs))
    if isinstance(functions, torch.nn.Sequential):
        functions = list(functions.children())
    else:
        functions = list(functions)
    if not isinstance(segments, int) or isinstance(segments, bool):
        raise TypeError(f"checkpoint_sequential: `segments` must be an int, got {type(segments)}")
    if not 1 <= segments <= len(functions):
        raise ValueError(
            f"checkpoint_sequential: `segments` must be between 1 and the number of modules ({len(functions)}), "
            f"got {segments}"
        )

    def run(start: int, end: int) -> Callable[[Any], Any]:
        def forward(x: Any) -> Any:
            for j in range(start, end):
                x = functions[j](x)
            return x

        return forward

    size = len(functions) // segments
    for start in range(0, size * (segments - 1), size):
        input = checkpoint(
            run(start, start + size),
            input,
            use_reentrant=use_reentrant,
            preserve_rng_state=preserve_rng_state,
            policy=policy,
        )
    last = run(size * (segments - 1), len(functions))
    if resolve(policy).recompute:
        return last(input)  # as torch: recomputing the last segment right after its forward gains nothing
    return checkpoint(last, input, use_reentrant=use_reentrant, policy=policy)  # stored policies save here too


class CheckpointWrapper(torch.nn.Module):
    """A module whose forward is checkpointed; its state dict is exactly the wrapped module's."""

    _PREFIX = "checkpointed."

    def __init__(self, module: torch.nn.Module, policy: str | Policy | None, use_reentrant: bool | None) -> None:
        super().__init__()
        self.checkpointed = module
        self.policy = None if policy is None else Policy.parse(policy)
        self.use_reentrant = use_reentrant
        self._register_state_dict_hook(_strip_prefix)
        self._register_load_state_dict_pre_hook(_add_prefix, with_module=True)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self.checkpointed, *args, use_reentrant=self.use_reentrant, policy=self.policy, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.checkpointed, name)


def _strip_prefix(module: CheckpointWrapper, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    for key in [k for k in state_dict if k.startswith(prefix + CheckpointWrapper._PREFIX)]:
        state_dict[prefix + key[len(prefix + CheckpointWrapper._PREFIX) :]] = state_dict.pop(key)


def _add_prefix(module: CheckpointWrapper, state_dict: dict, prefix: str, *args: Any) -> None:
    # Every key under `prefix` is the wrapped module's (state_dict() strips the prefix from all of them), so
    # every one gets it back, even one that already starts with it: the wrapped module may have a child
    # named like the prefix.
    for key in [k for k in state_dict if k.startswith(prefix)]:
        state_dict[prefix + module._PREFIX + key[len(prefix) :]] = state_dict.pop(key)


def wrap(
    module: torch.nn.Module, policy: str | Policy | None = None, *, use_reentrant: bool | None = None
) -> CheckpointWrapper:
    """Wrap `module` so each call is checkpointed with `policy`; state-dict keys stay those of `module`."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"wrap: `module` must be a torch.nn.Module, got {type(module)}")
    if isinstance(module, CheckpointWrapper):
        raise ValueError("wrap: `module` is already wrapped by fastckpt; wrap the inner module once")
    return CheckpointWrapper(module, policy, use_reentrant)


def apply(
    model: torch.nn.Module,
    policy: str | Policy | None = None,
    check_fn: Callable[[torch.nn.Module], bool] = lambda module: True,
    *,
    use_reentrant: bool | None = None,
) -> torch.nn.Module:
    """Replace, in place, every submodule of `model` for which `check_fn` is true by `wrap(submodule)`.

    Matching submodules are not searched further. Returns `model`.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"apply: `model` must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(check_fn):
        raise TypeError(f"apply: `check_fn` must be callable (module -> bool), got {type(check_fn)}")
    if policy is not None:
        Policy.parse(policy)  # fail before changing the model
    for name, child in list(model.named_children()):
        if isinstance(child, CheckpointWrapper):
            continue
        if check_fn(child):
            setattr(model, name, wrap(child, policy, use_reentrant=use_reentrant))
        else:
            apply(child, policy, check_fn, use_reentrant=use_reentrant)
    return model
