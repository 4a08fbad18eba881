"""The public entry points: checkpoint and checkpoint_sequential (drop-ins for torch.utils.checkpoint)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.checkpoint import noop_context_fn

from fastckpt.compiled import checkpoint_in_graph
from fastckpt.engine.options import CheckpointOptions
from fastckpt.engine.strategy import Strategy, run_segment
from fastckpt.policies import Policy


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
        return checkpoint_in_graph(function, args, kwargs, options, policy)
    return run_segment(function, args, kwargs, options, policy)


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
        raise TypeError(f"fastckpt.checkpoint_sequential: `segments` must be an int, got {type(segments)}")
    if not 1 <= segments <= len(functions):
        raise ValueError(
            "fastckpt.checkpoint_sequential: `segments` must be between 1 and the number of modules "
            f"({len(functions)}), got {segments}"
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
    if Strategy.of(policy).recompute:
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
        raise TypeError(f"fastckpt.wrap: `module` must be a torch.nn.Module, got {type(module)}")
    if isinstance(module, CheckpointWrapper):
        raise ValueError("fastckpt.wrap: `module` is already wrapped by fastckpt; wrap the inner module once")
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
        raise TypeError(f"fastckpt.apply: `model` must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(check_fn):
        raise TypeError(f"fastckpt.apply: `check_fn` must be callable (module -> bool), got {type(check_fn)}")
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
