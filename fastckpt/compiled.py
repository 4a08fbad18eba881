"""fastckpt under torch.compile: checkpointed segments inside the graph, and `fastckpt.compile`.

Two mechanisms of torch carry it:

- dynamo traces torch.utils.checkpoint.checkpoint as a higher-order op: the segment's ops are tagged for
  recomputation and the compiler recomputes them in the backward graph. A recompute segment goes there.
- AOTAutograd inlines saved-tensor hooks around a compiled call into the graphs (fastckpt.storage.graph):
  `compile` installs such hooks, whose pack hook runs fastckpt's codec ops, so the compiled graph stores the
  activations encoded.

Under compile, `fastckpt.checkpoint(fn, x, policy=...)` annotates the ops it traces with its policy when the
policy stores tensors (`Strategy.stores`): a storage segment stores what its ops save through its codec; a
recompute segment that stores its inputs through a codec ('recompute+int8') has the tensors its ops read
from outside stored through that codec; tensors no segment claims follow `compile`'s `policy` (None: plain).
Parameters, graph inputs, small and non-float tensors stay plain, as in eager.

Pieces that need eager execution fall back to it (a graph break, one warning each): storage policies outside
`fastckpt.compile` (no hooks to inline), offload, a recomputation's own codec ('recompute:int8'), and policies
with tuning the graph annotations cannot carry (group_size, rule, stochastic rounding, min_tensor_bytes).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

from fastckpt import _compat
from fastckpt.engine.options import CheckpointOptions
from fastckpt.engine.strategy import Strategy, run_segment
from fastckpt.policies import Policy
from fastckpt.storage import graph
from fastckpt.storage.graph import GraphStorage

TORCH_NEEDED = "2.14"  # the release in which the pieces below were checked
# Only the release checked is trusted: the pieces (fastckpt._compat's fx_annotate, saved_tensor_hook_context,
# autograd_cache_off) are private enough to change between releases. `compile` resolves them.
IN_GRAPH_STORAGE = torch.torch_version.TorchVersion(torch.__version__) >= TORCH_NEEDED
_annotate: Callable[[dict], Any] | None = None  # torch.fx.traceback.annotate, once `compile` resolved it

# Inside a `compile` call (read while dynamo traces, so it is guarded: the same compiled function traced
# inside and outside `compile` gets two graphs).
_region_depth = 0
_TUNING = ("group_size", "rule", "stochastic_rounding", "min_tensor_bytes")
_DEFAULTS = Policy()
_warned: set[str] = set()


def checkpoint_in_graph(
    function: Callable[..., Any], args: tuple, kwargs: dict, options: CheckpointOptions, policy: str | Policy | None
) -> Any:
    """fastckpt.checkpoint while dynamo traces: in the graph when the policy allows, else eagerly."""
    strategy = Strategy.of(policy)
    if options.has_recompute_only_options and not strategy.recompute:
        return run_segment(function, args, kwargs, options, policy)  # (not traced) raises the eager message
    reason = _eager_reason(strategy.policy)
    if reason is not None:
        return _eager_with_warning(reason, function, args, kwargs, options, policy)
    if not strategy.stores:  # stock recompute: torch's checkpoint op as it is
        return _torch_checkpoint(function, args, kwargs, options)
    with _annotate({graph.ANNOTATION: str(strategy.policy)}):  # resolved: inside a compile region (_region_depth)
        if strategy.recompute:
            return _torch_checkpoint(function, args, kwargs, options)
        return function(*args, **kwargs)


def _torch_checkpoint(function: Callable[..., Any], args: tuple, kwargs: dict, options: CheckpointOptions) -> Any:
    # Only the options given: dynamo's checkpoint op takes a context_fn only when it is the user's, and torch
    # releases before 2.14 have no respect_saved_tensors_hooks.
    return torch_checkpoint.checkpoint(
        function, *args, use_reentrant=bool(options.use_reentrant), **options.given_torch_keywords(), **kwargs
    )


def _eager_reason(policy: Policy) -> str | None:
    """Why a segment under `policy` cannot be traced into the graph (None: it can)."""
    if policy.is_stock:
        return None
    reason = _not_in_graph(policy)
    if reason is None and _region_depth == 0:
        return (
            f"policy {str(policy)!r} stores tensors, which inside torch.compile needs the saved-tensor hooks "
            "that fastckpt.compile installs; compile with fastckpt.compile(fn_or_module, ...) instead of "
            "torch.compile to keep the segment in the graph"
        )
    return reason


def _not_in_graph(policy: Policy) -> str | None:
    """What of `policy` the compiled-graph storage cannot do (None: all of it)."""
    if not IN_GRAPH_STORAGE:
        return (
            f"policy {str(policy)!r} inside torch.compile needs torch >= {TORCH_NEEDED} (saved-tensor hooks inlined "
            f"into compiled graphs, torch.fx.traceback.annotate); this is torch {torch.__version__}"
        )
    if policy.offload:
        return f"policy {str(policy)!r}: offload is not done inside compiled graphs"
    if policy.recompute_codec is not None:
        return (
            f"policy {str(policy)!r}: the recomputation's codec acts on eager recomputation (inside a compiled "
            "graph the compiler schedules the recomputed tensors itself)"
        )
    tuned = [name for name in _TUNING if getattr(policy, name) != getattr(_DEFAULTS, name)]
    if tuned:
        return f"policy {policy!r}: {', '.join(tuned)} cannot be carried by graph annotations"
    return None


@torch.compiler.disable
def _eager_with_warning(reason: str, *call: Any) -> Any:
    # Eager (dynamo skips this frame): a graph break, with one warning per reason.
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"fastckpt.checkpoint runs eagerly under torch.compile (a graph break): {reason}", stacklevel=3)
    return run_segment(*call)


def compile(fn_or_module: Any, policy: str | Policy | None = None, **torch_compile_kwargs: Any) -> Any:
    """torch.compile(fn_or_module, **torch_compile_kwargs), with what the compiled graphs save for backward
    stored by fastckpt: segments checkpointed inside with fastckpt.checkpoint(..., policy=...) stay in the
    graph (no graph break) with their policy; every other saved activation follows `policy` (a storage policy
    such as 'int8', or None to keep them as the compiler does).

    Returns the compiled function (or module, as torch.compile does: an OptimizedModule); its
    `fastckpt_storage.table()` lists every saved tensor of the compiled graphs and how it is kept.
    """
    region = None if policy is None else Policy.parse(policy)
    if region is not None and (region.recompute or region.codec is None):
        raise ValueError(
            f"fastckpt.compile: policy={str(region)!r}: the region policy stores what the compiled graphs save "
            "through a codec ('int8', 'fp8', 'int4', 'int2'), or is None; to recompute, checkpoint segments "
            "inside with fastckpt.checkpoint(..., policy='recompute')"
        )
    if region is not None and IN_GRAPH_STORAGE and _not_in_graph(region):
        raise ValueError(f"fastckpt.compile: {_not_in_graph(region)}; use a policy string such as 'int8'")
    if not IN_GRAPH_STORAGE:
        raise RuntimeError(
            f"fastckpt.compile needs torch >= {TORCH_NEEDED} (saved-tensor hooks inlined into compiled graphs); this "
            f"is torch {torch.__version__}. Use torch.compile: fastckpt.checkpoint segments then run eagerly"
        )
    global _annotate
    _annotate = _compat.require("fx_annotate")  # resolved here, never while dynamo traces
    storage = GraphStorage(region)
    if torch_compile_kwargs.get("backend", "inductor") == "inductor":
        # Inductor's locality reordering pulls the decoded activations of several layers ahead to where it
        # groups the weight-gradient kernels, holding them in full precision together (measured: the peak of
        # an int8 stack returns to the uncompressed one); its peak-memory reordering alone keeps them apart.
        options = {"reorder_for_locality": False, **(torch_compile_kwargs.get("options") or {})}
        torch_compile_kwargs = {**torch_compile_kwargs, "options": options}
    compiled = torch.compile(fn_or_module, **torch_compile_kwargs)
    if isinstance(compiled, torch.nn.Module):
        compiled.forward = _in_region(storage, compiled.forward)
        object.__setattr__(compiled, "fastckpt_storage", storage)  # on the compiled module, not the user's
        return compiled
    wrapped = _in_region(storage, compiled)
    wrapped.fastckpt_storage = storage
    return wrapped


def _in_region(storage: GraphStorage, call: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(call)
    def run(*args: Any, **kwargs: Any) -> Any:
        global _region_depth
        _region_depth += 1
        try:
            # No AOTAutograd cache: its key hashes the hook graphs (empty: the hooks are Python) and not the
            # policy annotations, so a graph compiled under 'int8' would be served for the same graph under
            # 'int4' (measured). Inductor's own cache keys the graphs after inlining, encode ops included.
            with _compat.autograd_cache_off(), storage.hooks():
                return call(*args, **kwargs)
        finally:
            _region_depth -= 1

    return run
