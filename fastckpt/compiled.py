"""fastckpt under torch.compile: checkpointed segments inside the graph, and `fastckpt.compile`.

Two mechanisms of torch carry it:

- dynamo traces torch.utils.checkpoint.checkpoint as a higher-order op: the segment's ops are tagged for
  recomputation and the compiler recomputes them in the backward graph. A recompute segment goes there.
- AOTAutograd inlines saved-tensor hooks given as torch.fx.GraphModules around a compiled call: it calls the
  pack hook with the fake value of each tensor the forward graph saves for backward, traces it, and appends
  the traced ops to the forward graph (the unpack hook's to the backward graph). `compile` installs such
  hooks; their pack hook runs fastckpt's codec ops, so the compiled graph stores the activations encoded.

Which policy a saved tensor gets comes from annotations: under compile, `fastckpt.checkpoint(fn, x,
policy=...)` annotates the ops it traces with its policy (torch.fx.traceback.annotate; the annotation
survives into the partitioned forward graph), and the pack hook reads the saved node's annotation. A storage
segment stores what its ops save through its codec; a recompute segment that stores its inputs through a
codec ('recompute+int8') has the tensors its ops read from outside stored through that codec; tensors no
segment claims follow `compile`'s `policy` (None: plain). Parameters, graph inputs, small and non-float
tensors stay plain, as in eager.

Pieces that need eager execution fall back to it (a graph break, one warning each): storage policies outside
`fastckpt.compile` (no hooks to inline), offload, a recomputation's own codec ('recompute:int8'), and policies
with tuning the graph annotations cannot carry (group_size, rule, stochastic rounding, min_tensor_bytes).
"""

from __future__ import annotations

import functools
import operator
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

from fastckpt.engine.options import CheckpointOptions
from fastckpt.policies import Policy, resolve
from fastckpt.storage import codecs
from fastckpt.storage.packer import SegmentStorage, _Stored, value_keep_plain_reason

ANNOTATION = "fastckpt_policy"  # the key of a segment's policy in its ops' node.meta["custom"]
TORCH_NEEDED = "2.14"  # the release in which the pieces below were checked

try:  # the two pieces of torch that in-graph storage needs
    from torch._functorch._aot_autograd.graph_compile import _get_saved_tensor_hook_context
    from torch.fx.traceback import annotate as _annotate

    # Both are private enough to change between releases: only the release checked is trusted.
    IN_GRAPH_STORAGE = torch.torch_version.TorchVersion(torch.__version__) >= TORCH_NEEDED
except ImportError:
    IN_GRAPH_STORAGE = False

# Inside a `compile` call (read while dynamo traces, so it is guarded: the same compiled function traced
# inside and outside `compile` gets two graphs).
_region_depth = 0
_TUNING = ("group_size", "rule", "stochastic_rounding", "min_tensor_bytes")
_DEFAULTS = Policy()
_DEFAULT_OPTIONS = CheckpointOptions()
_TORCH_OPTIONS = (
    "preserve_rng_state",
    "context_fn",
    "determinism_check",
    "debug",
    "early_stop",
    "respect_saved_tensors_hooks",
)
_warned: set[str] = set()


def checkpoint_in_graph(
    function: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    options: CheckpointOptions,
    policy: str | Policy | None,
    run_eagerly: Callable[..., Any],
) -> Any:
    """fastckpt.checkpoint while dynamo traces: in the graph when the policy allows, else `run_eagerly`."""
    resolved = resolve(policy)
    if options.has_recompute_only_options and not resolved.recompute:
        return run_eagerly(function, args, kwargs, options, policy)  # (not traced) raises the eager message
    reason = _eager_reason(resolved)
    if reason is not None:
        return _eager_with_warning(reason, run_eagerly, function, args, kwargs, options, policy)
    if resolved.is_stock:
        return _torch_checkpoint(function, args, kwargs, options)
    with _annotate({ANNOTATION: str(resolved)}):
        if resolved.recompute:
            return _torch_checkpoint(function, args, kwargs, options)
        return function(*args, **kwargs)


def _torch_checkpoint(function: Callable[..., Any], args: tuple, kwargs: dict, options: CheckpointOptions) -> Any:
    # Only the options that differ from torch's defaults: dynamo's checkpoint op takes a context_fn only when
    # it is the user's, and torch releases before 2.14 have no respect_saved_tensors_hooks.
    given = {
        name: getattr(options, name)
        for name in _TORCH_OPTIONS
        if getattr(options, name) is not getattr(_DEFAULT_OPTIONS, name)
    }
    return torch_checkpoint.checkpoint(function, *args, use_reentrant=bool(options.use_reentrant), **given, **kwargs)


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
def _eager_with_warning(reason: str, run_eagerly: Callable[..., Any], *call: Any) -> Any:
    # Eager (dynamo skips this frame): a graph break, with one warning per reason.
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"fastckpt.checkpoint runs eagerly under torch.compile (a graph break): {reason}", stacklevel=3)
    return run_eagerly(*call)


@dataclass(frozen=True)
class SavedTensor:
    """One tensor a compiled forward graph saves for backward, and how fastckpt's hooks keep it."""

    graph: int  # which compiled forward graph (numbered in compilation order)
    node: str
    shape: tuple  # ints; a dynamic dimension is its symbol's name (e.g. 's0')
    dtype: torch.dtype
    policy: str  # the policy that claimed it ('' when none did)
    stored_as: str  # a codec, or 'plain (<reason>)'
    raw_bytes: int  # at the sizes the graph was compiled with (its example inputs)
    stored_bytes: int


class _Hook(torch.fx.GraphModule):
    """A saved-tensors hook AOTAutograd inlines: it accepts GraphModules only, and traces each with a saved
    tensor's fake value, so `fn` (plain Python, free to branch on shape and dtype) runs at compile time."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        super().__init__(torch.nn.Module(), torch.fx.Graph())
        type(self).forward = lambda _self, packed: fn(packed)  # GraphModule made this class for this instance


class _EagerPacked:
    """A tensor packed outside a compiled graph (a graph break inside the region): the region policy's storage."""

    __slots__ = ("storage", "stored")

    def __init__(self, storage: SegmentStorage, stored: _Stored) -> None:
        self.storage, self.stored = storage, stored


class GraphStorage:
    """The pack/unpack hooks `compile` installs around its compiled call, and what they decided."""

    def __init__(self, policy: Policy | None) -> None:
        self.policy = policy
        self.saved: list[SavedTensor] = []
        # Keyed by the graphs themselves (weakly): an id() could be reused by a later graph once one is freed.
        self._graphs: weakref.WeakKeyDictionary[torch.fx.Graph, int] = weakref.WeakKeyDictionary()  # forward -> number
        self._count = 0
        self._seen: set[tuple[int, str]] = set()
        self._eager: SegmentStorage | None = None
        # The graphs' nodes before AOTAutograd inlined a pack (per saved node) or an unpack (per backward graph).
        self._before_pack: dict[torch.fx.Node, set[torch.fx.Node]] = {}
        self._before_unpack: weakref.WeakKeyDictionary[torch.fx.Graph, set[torch.fx.Node]] = weakref.WeakKeyDictionary()
        self.pack_hook, self.unpack_hook = _Hook(self._pack), _Hook(self._unpack)

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        self._eager = None  # one storage per call, made when an eager op first saves (a track() record then)
        return torch.autograd.graph.saved_tensors_hooks(self.pack_hook, self.unpack_hook)

    def _pack(self, t: torch.Tensor) -> Any:
        context = _get_saved_tensor_hook_context()
        if context is None:  # eager: an op between graphs
            if self.policy is None:
                return t
            if self._eager is None:
                self._eager = SegmentStorage(self.policy, label=f"{self.policy} (compiled region, eager)")
            return _EagerPacked(self._eager, self._eager.pack(t))
        node = context["_node"]
        if context["_fw_graph"] not in self._graphs:
            _name_rng_states_as_backward_does(context["_fw_graph"], context["_bw_graph"])
        self._before_pack.setdefault(node, set(context["_fw_graph"].nodes))
        policy = self._claim(node)
        codec, reason = None, "no policy"
        if policy is not None:
            reason = value_keep_plain_reason(t, policy, "graph input" if node.op == "placeholder" else None)
            if reason is None and not t.is_contiguous() and codecs.dense_permutation(t) is None:
                reason = "not dense"
            if reason is None:
                codec = "mask" if t.dtype == torch.bool else policy.codec
        if codec is None:
            self._note(context, node, t, policy, f"plain ({reason})", t.numel() * t.element_size())
            return t
        encoded = codecs.encode_tensor(t, codec, None, False, exact_two=False)  # no data-dependent choice in a graph
        stored_bytes = sum(x.numel() * x.element_size() for x in encoded.payload)
        self._note(context, node, t, policy, codec, stored_bytes)
        # Tensors, then constants (AOTAutograd inlines non-tensor leaves into the unpack graph).
        return (*encoded.payload, codec, encoded.group_size, t.dtype, list(encoded.shape), encoded.layout or ())

    def _unpack(self, packed: Any) -> torch.Tensor:
        context = _get_saved_tensor_hook_context()
        if context is not None:
            self._place(context)
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, _EagerPacked):
            return packed.storage.unpack(packed.stored)
        *payload, codec, group_size, dtype, shape, layout = packed
        return codecs.decode(codecs.Encoded(codec, tuple(payload), group_size, dtype, shape, tuple(layout) or None))

    def _place(self, context: dict) -> None:
        """Put the inlined pack and unpack ops where they free memory. AOTAutograd appends each saved tensor's
        pack ops to the end of the forward graph and its unpack ops to the start of the backward graph, so
        every activation would stay in full precision until the forward ends and be decoded all at once when
        the backward starts: the peak would not drop. It inlines one saved tensor at a time, pack ops first,
        and traces the unpack hook in between; so here the pack ops of this tensor are in the forward graph
        (moved to just after the tensor's producer: it then dies at its last forward use) and the unpack ops
        of the previous one are in the backward graph (moved to just before their first use). The last
        saved tensor's decode stays at the start of the backward, which uses it first."""
        saved, forward, backward = context["_node"], context["_fw_graph"], context["_bw_graph"]
        before = self._before_pack.pop(saved, None)
        if before is not None:
            cursor = saved
            for node in [n for n in forward.nodes if n not in before and n.op == "call_function"]:
                cursor.append(node)
                cursor = node
        previous = self._before_unpack.get(backward)
        if previous is not None:
            group = [n for n in backward.nodes if n not in previous and n.op == "call_function"]
            position = {n: i for i, n in enumerate(backward.nodes)}
            members = set(group)
            users = [u for n in group for u in n.users if u not in members]
            if users:
                first = min(users, key=position.__getitem__)
                for node in group:
                    first.prepend(node)
        self._before_unpack[backward] = set(backward.nodes)

    def _claim(self, node: torch.fx.Node) -> Policy | None:
        """The policy that decides how `node` is kept: its own segment's when that segment stores what it saves
        (a storage policy, or 'recompute+<codec>' whose saved tensors are its inputs), else that of a segment
        that stores and reads it (its input, saved by the segment's ops), else the region's when no segment
        claims the node."""
        own = _annotation(node)
        if _stores(own):
            return own
        for user in node.users:
            reader = _annotation(user)
            if _stores(reader):
                return reader
        return self.policy if own is None else None

    def _note(
        self,
        context: dict,
        node: torch.fx.Node,
        t: torch.Tensor,
        policy: Policy | None,
        stored_as: str,
        stored_bytes: int,
    ) -> None:
        forward = context["_fw_graph"]
        if forward not in self._graphs:
            self._graphs[forward] = self._count
            self._count += 1
        graph = self._graphs[forward]
        if (graph, node.name) in self._seen:  # AOTAutograd calls the pack hook twice per tensor
            return
        self._seen.add((graph, node.name))
        shape = tuple(d if isinstance(d, int) else str(d) for d in t.shape)
        raw = _example_value(t.numel()) * t.element_size()
        policy_name = str(policy) if policy else ""
        self.saved.append(
            SavedTensor(graph, node.name, shape, t.dtype, policy_name, stored_as, raw, _example_value(stored_bytes))
        )

    def table(self) -> str:
        """What the compiled forward graphs save and how each is kept, with totals."""
        rows = [
            f"{'graph':>5}  {'node':<24} {'shape':<20} {'dtype':<9} {'policy':<16} {'stored as':<18} "
            f"{'raw KiB':>9} {'kept KiB':>9}"
        ]
        for s in self.saved:
            rows.append(
                f"{s.graph:>5}  {s.node:<24} {str(list(s.shape)):<20} {str(s.dtype)[6:]:<9} "
                f"{s.policy or '-':<16} {s.stored_as:<18} {s.raw_bytes / 1024:>9.1f} "
                f"{s.stored_bytes / 1024:>9.1f}"
            )
        raw = sum(s.raw_bytes for s in self.saved)
        kept = sum(s.stored_bytes for s in self.saved)
        rows.append(
            f"total: {len(self.saved)} saved tensors, {raw / 2**20:.2f} MiB as saved, {kept / 2**20:.2f} MiB kept"
        )
        return "\n".join(rows)


def _example_value(size: int | torch.SymInt) -> int:
    """A size, or a dynamic one's value in the example inputs the graph was compiled with."""
    return size if isinstance(size, int) else int(size.node.hint or 0)


def _name_rng_states_as_backward_does(forward: torch.fx.Graph, backward: torch.fx.Graph) -> None:
    """Give the forward graph's saved RNG states the names of their backward placeholders. A random op
    recomputed on CPU (dropout in a checkpointed segment) saves the RNG state it ran with; torch's partitioner
    names the backward's input 'rng_state_output_<k>' but leaves the forward's output named 'getitem_<n>', and
    AOTAutograd's hook inlining, which pairs saved tensors with backward inputs by name, then fails with
    "could not find saved tensor getitem_<n> in bw_g_inputs" (torch 2.14; in order, both lists follow the
    random ops' order)."""
    save_rng = torch._prims.rng_prims.run_and_save_rng_state
    states = [
        n
        for n in forward.output_node().args[0]
        if isinstance(n, torch.fx.Node)
        and n.target is operator.getitem
        and n.args[0].target is save_rng
        and n.args[1] == 0
    ]
    inputs = [n for n in backward.find_nodes(op="placeholder") if n.name.startswith("rng_state_output_")]
    if len(states) != len(inputs):
        return
    for state, placeholder in zip(states, inputs, strict=True):
        state._rename(placeholder.name)


def _stores(policy: Policy | None) -> bool:
    return policy is not None and (not policy.recompute or policy.stores_inputs)


def _annotation(node: torch.fx.Node) -> Policy | None:
    spec = node.meta.get("custom", {}).get(ANNOTATION)
    return None if spec is None else Policy.parse(spec)


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
            with torch._functorch.config.patch(enable_autograd_cache=False), storage.hooks():
                return call(*args, **kwargs)
        finally:
            _region_depth -= 1

    return run
