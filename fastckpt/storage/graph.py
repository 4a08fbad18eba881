"""The saved-tensor hooks `fastckpt.compile` installs: what compiled graphs save for backward, stored by fastckpt.

AOTAutograd inlines saved-tensor hooks given as torch.fx.GraphModules around a compiled call: it calls the
pack hook with the fake value of each tensor the forward graph saves for backward, traces it, and appends
the traced ops to the forward graph (the unpack hook's to the backward graph). The pack hook here runs
fastckpt's codec ops (`codecs.encode_tensor`, as eager storage does), so the compiled graph stores the
activations encoded, and moves the inlined ops to where they free memory (`GraphStorage._place`).

Which policy a saved tensor gets comes from annotations: fastckpt.compiled annotates the ops of a segment
whose policy stores tensors with that policy (torch.fx.traceback.annotate; the annotation survives into the
partitioned forward graph), and the pack hook reads the saved node's annotation (`GraphStorage._claim`).
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fastckpt import _compat
from fastckpt.policies import Policy
from fastckpt.storage import codecs
from fastckpt.storage.accounting import nbytes
from fastckpt.storage.packer import SegmentStorage, _Stored, value_keep_plain_reason

ANNOTATION = "fastckpt_policy"  # the key of a storing segment's policy in its ops' node.meta["custom"]


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
        # Which graph and node a pack or unpack is being inlined for (None: an eager op between graphs).
        self._context = _compat.require("saved_tensor_hook_context")

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        self._eager = None  # one storage per call, made when an eager op first saves (a track() record then)
        return torch.autograd.graph.saved_tensors_hooks(self.pack_hook, self.unpack_hook)

    def _pack(self, t: torch.Tensor) -> Any:
        context = self._context()
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
            self._note(context, node, t, policy, f"plain ({reason})", nbytes(t))
            return t
        encoded = codecs.encode_tensor(t, codec, None, False, exact_two=False)  # no data-dependent choice in a graph
        stored_bytes = sum(nbytes(x) for x in encoded.payload)
        self._note(context, node, t, policy, codec, stored_bytes)
        # Tensors, then constants (AOTAutograd inlines non-tensor leaves into the unpack graph).
        return (*encoded.payload, codec, encoded.group_size, t.dtype, list(encoded.shape), encoded.layout or ())

    def _unpack(self, packed: Any) -> torch.Tensor:
        context = self._context()
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
        if own is not None:
            return own
        for user in node.users:
            reader = _annotation(user)
            if reader is not None:
                return reader
        return self.policy

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
    save_rng = _compat.run_and_save_rng_state()
    if save_rng is None:
        _compat.warn_missing("run_and_save_rng_state")
        return
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


def _annotation(node: torch.fx.Node) -> Policy | None:
    spec = node.meta.get("custom", {}).get(ANNOTATION)
    return None if spec is None else Policy.parse(spec)
