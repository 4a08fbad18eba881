"""The one door to torch's private symbols: each behind a named probe, resolved on first use.

fastckpt builds on pieces of torch that are private (an underscore in their path) or too new to count on:
the graph-task id that tells one backward from another, the profiler's allocation records, torch's global
checkpoint switches, the compiler hooks `fastckpt.compile` inlines. A torch release may rename any of them.
Here each one is a probe: a function named after what it finds, returning the symbol (or, for a live
global, its current value), or None where this torch lacks it. Nothing is looked up at import: `import
fastckpt` works whatever torch renamed, and a missing symbol disables only the feature that needs it:

- `require(name)`: the symbol, or RuntimeError naming the feature, the symbol and the torch it needs (the
  feature cannot run without it: non-reentrant checkpointing, CPU memory measurement, ...);
- `warn_missing(name)`: one warning, when this torch is at or after the release the probe was found in (so
  it was renamed): the feature falls back (the global `set_checkpoint_debug_enabled` switch ignored, say)
  as fastckpt did on torch releases from before the symbol. Before that release it falls back silently.

`PROBES` holds every probe's facts: where torch keeps the symbol, `since` (the first release found to have
it; `FLOOR` where every release fastckpt supports has it), the feature and what fastckpt loses without it.
The comment above each probe says where it was looked for: in the sources of the latest patch release of
each of torch 2.4 to 2.14 (2.4.1, 2.5.1, 2.6.0, 2.7.1, 2.8.0, 2.9.1, 2.10.0, 2.11.0, 2.12.0, 2.13.0,
2.14.1); tests/test_compat.py, which resolves every probe and makes each fail in turn, passed on 2.14.1
(CI's pin), 2.13.0 and 2.9.1, and the probes resolved as listed on 2.4.1. The GPU image's 2.11.0 has not
run this module (no GPU since it exists); its sources are among those looked at.

Left as direct imports, at import: `torch.utils._pytree` (tree_flatten, tree_map, ...) and
`torch.utils._python_dispatch.TorchDispatchMode`, torch's extension points in practice (its public modules,
torch.utils.checkpoint among them, import both). No feature could fall back without them: every checkpoint
call flattens its arguments, and fastckpt's dispatch modes subclass TorchDispatchMode where they are defined.
Tensor attributes torch's own autograd code relies on (`_version`, `_base`, `_is_view()`, an op's `_schema`)
stay as they are, and `torch._ops` types appear only in annotations and isinstance checks.
"""

from __future__ import annotations

import contextlib
import importlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# pyproject.toml's torch floor, the oldest release the suite passes on (2.14-only features skipped): 2.9.1.
# Before it, torch.utils.checkpoint's global early-stop switch is True unless set (None from 2.9), so it
# overrode fastckpt.checkpoint's early_stop=False (2.5.1: two tests fail, and a recomputation on the meta
# device cannot fork its RNG); 2.4.1 cannot even `import fastckpt` (no public selective-checkpoint API).
FLOOR = "2.9"


@dataclass(frozen=True)
class Probe:
    """Where torch keeps one symbol, from which release, and what fastckpt does with and without it."""

    name: str  # the probe function in this module
    path: str  # as written in torch: "torch._C._current_graph_task_id"
    since: str  # the oldest release it is known in (FLOOR: every release fastckpt supports)
    feature: str  # what needs it
    without: str  # what fastckpt does without it
    live: bool = False  # a module global read at each call (its value changes), not a function or class


PROBES: dict[str, Probe] = {}
_MISSING = object()  # what a probe resolves to where torch lacks the symbol (cached like a found one)
_UNRESOLVED = object()
_cache: dict[str, Any] = {}  # resolved owners and symbols (or _MISSING), per probe name
_expected: dict[str, bool] = {}
_warned: set[str] = set()


def _resolve(path: str) -> Any:
    """The object at a dotted path under torch, importing submodules it needs; _MISSING when any part is."""
    parts = path.split(".")
    obj: Any = torch
    for index, part in enumerate(parts[1:], start=2):
        try:
            obj = getattr(obj, part)
            continue
        except Exception:  # AttributeError, or what a lazy module attribute's import raises
            pass
        try:  # a submodule torch does not import by itself (torch._functorch.config)
            obj = importlib.import_module(".".join(parts[:index]))
        except Exception:  # ImportError, or anything a renamed module's import raises
            return _MISSING
    return obj


def _value(name: str) -> Any:
    """The probe's symbol (a live global: its current value), or _MISSING; owners and symbols are cached."""
    probe = PROBES[name]
    if not probe.live:
        value = _cache.get(name, _UNRESOLVED)
        if value is _UNRESOLVED:
            value = _cache[name] = _resolve(probe.path)
        return value
    owner_path, _, attribute = probe.path.rpartition(".")
    owner = _cache.get(name, _UNRESOLVED)
    if owner is _UNRESOLVED:
        owner = _cache[name] = _resolve(owner_path)
    return _MISSING if owner is _MISSING else getattr(owner, attribute, _MISSING)


def _lookup(name: str) -> Any:
    value = _value(name)
    return None if value is _MISSING else value


def _probe(path: str, *, since: str, feature: str, without: str, live: bool = False) -> Callable[..., Any]:
    def define(fn: Callable[[], Any]) -> Callable[[], Any]:
        PROBES[fn.__name__] = Probe(fn.__name__, path, since, feature, without, live)

        def probe() -> Any:
            return _lookup(fn.__name__)

        probe.__name__ = probe.__qualname__ = fn.__name__
        probe.__doc__ = fn.__doc__
        return probe

    return define


def available(name: str) -> bool:
    """Whether this torch has the probe's symbol (a live global may hold None and still be there)."""
    if not PROBES[name].live:
        return globals()[name]() is not None  # the probe function, so that a test may replace it
    return _value(name) is not _MISSING


def expected(name: str) -> bool:
    """Whether this torch is at or after the release the probe's symbol is known from."""
    known = _expected.get(name)
    if known is None:
        known = _expected[name] = torch.torch_version.TorchVersion(torch.__version__) >= PROBES[name].since
    return known


def message(name: str) -> str:
    """Why the probe's feature is unavailable: the feature, the symbol, the torch it needs, what still works."""
    probe = PROBES[name]
    if expected(name):
        why = f"torch {torch.__version__} does not have it (renamed or removed after torch {probe.since})"
    else:
        why = f"it is in torch {probe.since} and later; this is torch {torch.__version__}"
    return f"fastckpt: {probe.feature} needs torch's {probe.path}: {why}. {probe.without}"


def require(name: str) -> Any:
    """The probe's symbol; RuntimeError with `message(name)` when this torch lacks it."""
    value = globals()[name]()
    if value is None and not available(name):
        raise RuntimeError(message(name))
    return value


def warn_missing(name: str) -> None:
    """Warn once that the probe's feature falls back, when this torch should have had the symbol."""
    if name in _warned or not expected(name):
        return
    _warned.add(name)
    warnings.warn(message(name), RuntimeWarning, stacklevel=3)


def missing() -> list[str]:
    """The probes this torch lacks."""
    return [name for name in PROBES if not available(name)]


def forget() -> None:
    """Drop what was resolved (tests that remove a symbol from torch, and put it back)."""
    _cache.clear()
    _expected.clear()
    _warned.clear()


# ---- the checkpoint engine (fastckpt/engine/non_reentrant.py) -------------------------------------------


# In every release looked at (2.4.1 to 2.14.1); the suite used it unguarded when it passed on 2.11.0.
@_probe(
    "torch._C._current_graph_task_id",
    since=FLOOR,
    feature="non-reentrant checkpointing (fastckpt.checkpoint, use_reentrant=False)",
    without="It tells one backward from another, so that each recomputes once: without it non-reentrant "
    "checkpoint calls raise; use_reentrant=True still works.",
)
def current_graph_task_id() -> Any:
    """torch._C._current_graph_task_id: the id of the running backward (-1 outside one)."""


# From 2.10.0 (with GraphExecGroup); not in 2.4.1-2.9.1.
@_probe(
    "torch._C._get_graph_exec_group",
    since="2.10",
    feature="overlapping backwards under torch.utils.checkpoint.GraphExecGroup",
    without="Without it each backward recomputes on its own, as before torch had GraphExecGroup.",
)
def graph_exec_group() -> Any:
    """torch._C._get_graph_exec_group: the active GraphExecGroup, whose backwards share one recomputation."""


# From 2.8.0; not in 2.4.1-2.7.1.
@_probe(
    "torch._C._autograd._top_saved_tensors_default_hooks",
    since=FLOOR,
    feature="seeing the caller's saved-tensor hooks from inside a checkpoint (selective checkpointing's "
    "respect_saved_tensors_hooks, hybrid.selective with a codec store)",
    without="Without it the hooks around a checkpoint are not found past its own (torch < 2.14 behaviour), "
    "and hybrid.selective stores only with store='save' or with `within`.",
)
def top_saved_tensors_default_hooks() -> Any:
    """torch._C._autograd._top_saved_tensors_default_hooks: the innermost (pack, unpack) hooks, or None."""


# In every release looked at (2.4.1 to 2.14.1).
@_probe(
    "torch.utils.checkpoint._checkpoint_debug_enabled",
    since=FLOOR,
    live=True,
    feature="torch.utils.checkpoint.set_checkpoint_debug_enabled(...) applying to fastckpt.checkpoint",
    without="Without it only fastckpt.checkpoint's debug= argument counts.",
)
def checkpoint_debug_enabled() -> Any:
    """torch.utils.checkpoint._checkpoint_debug_enabled: the global debug switch (None: not set)."""


# In every release looked at (2.4.1 to 2.14.1); None unless set from 2.9.1 on, True before (see FLOOR).
@_probe(
    "torch.utils.checkpoint._enable_checkpoint_early_stop",
    since=FLOOR,
    live=True,
    feature="torch.utils.checkpoint.set_checkpoint_early_stop(...) applying to fastckpt.checkpoint",
    without="Without it only fastckpt.checkpoint's early_stop= argument counts.",
)
def checkpoint_early_stop() -> Any:
    """torch.utils.checkpoint._enable_checkpoint_early_stop: the global early-stop switch (None: not set)."""


# In every release looked at (2.4.1 to 2.14.1).
@_probe(
    "torch.utils._python_dispatch._disable_current_modes",
    since=FLOOR,
    feature="compressed recomputation ('recompute:<codec>' policies); recompute_in_tiles skipping its forward "
    "where a recomputation ends at its input",
    without="It runs the codec outside the recomputation's dispatch modes (a selective-checkpoint context, "
    "debug=True): without it those policies raise; 'recompute', 'recompute+<codec>' and the storage policies "
    "still work, and tiles in a recomputation run their forward.",
)
def disable_current_modes() -> Any:
    """torch.utils._python_dispatch._disable_current_modes: a context leaving every active dispatch mode."""


# ---- state replay (fastckpt/engine/replay.py) -----------------------------------------------------------


_DEVICE_REPLAY = "replaying the forward's `with torch.device(...)` default device in the recomputation"
_DEVICE_REPLAY_LOST = "Without it a recomputation runs under the default device active at backward."


# In every release looked at (2.4.1 to 2.14.1).
@_probe("torch.overrides._get_current_function_mode_stack", since=FLOOR, feature=_DEVICE_REPLAY,
        without=_DEVICE_REPLAY_LOST)  # fmt: skip
def function_mode_stack() -> Any:
    """torch.overrides._get_current_function_mode_stack: the active function modes, innermost last."""


# In every release looked at (2.4.1 to 2.14.1).
@_probe("torch.utils._device.DeviceContext", since=FLOOR, feature=_DEVICE_REPLAY, without=_DEVICE_REPLAY_LOST)
def device_context() -> Any:
    """torch.utils._device.DeviceContext: the function mode a `with torch.device(...)` block enters."""


# Resolved on 2.4.1, 2.13.0 and 2.14.1 (torch.utils.checkpoint reads it the same way).
@_probe(
    "torch.cuda._initialized",
    since=FLOOR,
    live=True,
    feature="reading whether CUDA is initialised without initialising it (the device RNG state a "
    "recomputation restores; the 'device initialized in the forward' check)",
    without="Without it CUDA counts as not initialised: its RNG state is not captured, so CUDA dropout in a "
    "recomputation draws other masks.",
)
def cuda_initialized() -> Any:
    """torch.cuda._initialized: whether CUDA was initialised (torch.cuda.is_initialized() also checks forks)."""


def device_initialized(module: Any) -> bool:
    """Whether the device module (torch.cuda, torch.xpu, ...) is initialised, as torch's checkpoint reads it."""
    if module is torch.cuda:
        value = cuda_initialized()
        if value is None:
            warn_missing("cuda_initialized")
        return bool(value)
    return bool(getattr(module, "_initialized", False))


# ---- kept ops (fastckpt/engine/kept_ops.py) -------------------------------------------------------------


_REDISPATCH = (
    "hybrid.selective(within=...) finding watched calls inside torch.nn.functional's Python code "
    "(nn.MultiheadAttention's attention inside F.multi_head_attention_forward)"
)
_REDISPATCH_LOST = "Without it such functions run whole under the dispatch mode: the same ops kept, at more cost."


# From 2.13.0; not in 2.4.1-2.12.0.
@_probe("torch.overrides.redispatch_function", since="2.13", feature=_REDISPATCH, without=_REDISPATCH_LOST)
def redispatch_function() -> Any:
    """torch.overrides.redispatch_function: call a function again past the current function mode."""


# From 2.13.0; not in 2.4.1-2.12.0.
@_probe("torch._C._skip_one_hop_torch_function", since="2.13", feature=_REDISPATCH, without=_REDISPATCH_LOST)
def skip_one_hop_torch_function() -> Any:
    """torch._C._skip_one_hop_torch_function: what redispatch_function calls (the older spelling)."""


def torch_function_redispatch() -> Callable[..., Any] | None:
    """redispatch_function, else skip_one_hop_torch_function, else None (warning once where expected)."""
    found = redispatch_function() or skip_one_hop_torch_function()
    if found is None:
        warn_missing("redispatch_function")
    return found


# ---- hybrids (fastckpt/hybrid.py) -----------------------------------------------------------------------


# In 2.14.1; not in 2.4.1-2.13.0 (the suite's codec-store tests skip on the GPU image's 2.11.0).
@_probe(
    "torch.utils.checkpoint._current_user_saved_tensors_hooks",
    since="2.14",
    feature="hybrid.selective with a codec store and no `within` (torch's selective checkpointing saving "
    "through saved-tensor hooks)",
    without="Without it such a store raises; store='save', or `within=[...]`, still work.",
)
def current_user_saved_tensors_hooks() -> Any:
    """torch.utils.checkpoint._current_user_saved_tensors_hooks: where SAC finds the hooks it honours."""


# ---- memory measurement (fastckpt/memory.py) ------------------------------------------------------------


_CPU_MEMORY = "measuring CPU memory (fastckpt.memory: peak_bytes, MemoryTrace; fastckpt.plan on CPU)"
_CPU_MEMORY_LOST = "Without it CPU memory cannot be measured; CUDA memory still can."


# In every release looked at (2.4.1 to 2.14.1).
@_probe("torch._C._profiler._ExtraFields_Allocation", since=FLOOR, feature=_CPU_MEMORY, without=_CPU_MEMORY_LOST)
def profiler_allocation_fields() -> Any:
    """torch._C._profiler._ExtraFields_Allocation: the type of a profiler event's allocation record."""


# Resolved on 2.4.1, 2.13.0 and 2.14.1.
@_probe(
    "torch._C._autograd._ProfilerResult.experimental_event_tree",
    since=FLOOR,
    feature=_CPU_MEMORY,
    without=_CPU_MEMORY_LOST,
)
def profiler_event_tree() -> Any:
    """torch._C._autograd._ProfilerResult.experimental_event_tree: a profile's events, with allocations."""


# ---- padded attention (fastckpt/integrations/hf/attention.py) -------------------------------------------


# Resolved on 2.14.1, where torch's own Tensor.__torch_function__ (torch/_tensor.py) enters it; the name since
# torch 2.0 (1.13 had it as DisableTorchFunction), so every release from the floor has it. Not looked for in the
# other releases' sources.
@_probe(
    "torch._C.DisableTorchFunctionSubclass",
    since=FLOOR,
    feature="padded attention's mask form (hf.enable(padded_attention=True): CausalSegmentsMask)",
    without="Without it padded attention is refused; enable without padded_attention still works.",
)
def disable_torch_function_subclass() -> Any:
    """torch._C.DisableTorchFunctionSubclass: a context in which ops skip tensor subclasses' __torch_function__."""


# ---- fastckpt.info ------------------------------------------------------------------------------------


_OP_TABLE = "`python -m fastckpt.info`'s table of kernels per op"
_OP_TABLE_LOST = "Without it the table is left out; the rest of the report is printed."


# In every release looked at (2.4.1 to 2.14.1).
@_probe("torch._C._dispatch_get_all_op_names", since=FLOOR, feature=_OP_TABLE, without=_OP_TABLE_LOST)
def dispatch_get_all_op_names() -> Any:
    """torch._C._dispatch_get_all_op_names: the names of every registered operator."""


# In every release looked at (2.4.1 to 2.14.1).
@_probe("torch._C._dispatch_has_kernel_for_dispatch_key", since=FLOOR, feature=_OP_TABLE, without=_OP_TABLE_LOST)
def dispatch_has_kernel_for_dispatch_key() -> Any:
    """torch._C._dispatch_has_kernel_for_dispatch_key: whether an op has a kernel for a dispatch key."""


# ---- fastckpt.compile (fastckpt/compiled.py) ------------------------------------------------------------
# compiled.py imports its pieces itself (and trusts in-graph storage on torch >= 2.14 only); these probes are
# here for it to switch to.

_COMPILE = "storage policies inside compiled graphs (fastckpt.compile)"
_COMPILE_LOST = "Without it fastckpt.compile raises and storage segments under torch.compile run eagerly."


# From 2.10.0; not in 2.4.1-2.9.1.
@_probe(
    "torch._functorch._aot_autograd.graph_compile._get_saved_tensor_hook_context",
    since="2.10",
    feature=_COMPILE,
    without=_COMPILE_LOST,
)
def saved_tensor_hook_context() -> Any:
    """_get_saved_tensor_hook_context: AOTAutograd's context for saved-tensor hooks inlined into graphs."""


# From 2.10.0; not in 2.4.1-2.9.1.
@_probe("torch.fx.traceback.annotate", since="2.10", feature=_COMPILE, without=_COMPILE_LOST)
def fx_annotate() -> Any:
    """torch.fx.traceback.annotate: a context tagging the traced nodes (a segment's policy) in node.meta."""


# In every release looked at (2.4.1 to 2.14.1).
@_probe(
    "torch._prims.rng_prims.run_and_save_rng_state",
    since=FLOOR,
    feature="random ops recomputed inside fastckpt.compile graphs (CPU dropout in a checkpointed segment)",
    without="Without it their saved RNG states keep the partitioner's names, which AOTAutograd's hook "
    "inlining cannot pair with the backward's inputs.",
)
def run_and_save_rng_state() -> Any:
    """torch._prims.rng_prims.run_and_save_rng_state: the op a recomputed random op's RNG state comes from."""


# From 2.5.1; not in 2.4.1.
@_probe(
    "torch._functorch.config.enable_autograd_cache",
    since=FLOOR,
    live=True,
    feature="turning AOTAutograd's cache off inside fastckpt.compile regions",
    without="Without it a region compiled under one policy may be served another's cached graph "
    "(its key does not see the policy annotations).",
)
def autograd_cache_enabled() -> Any:
    """torch._functorch.config.enable_autograd_cache: whether AOTAutograd caches compiled graphs."""


def autograd_cache_off() -> contextlib.AbstractContextManager:
    """A context with AOTAutograd's cache off: torch._functorch.config.patch(enable_autograd_cache=False)."""
    if not available("autograd_cache_enabled"):
        raise RuntimeError(message("autograd_cache_enabled"))
    return importlib.import_module("torch._functorch.config").patch(enable_autograd_cache=False)
