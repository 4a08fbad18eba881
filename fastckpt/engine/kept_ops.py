"""Keep chosen ops' outputs from the forward and hand them back to the recomputation, watching only the calls
of a few Python-level torch functions (the engine of `fastckpt.hybrid.selective(..., within=...)`).

torch's selective checkpointing sees every op of a segment through a Python dispatch mode, which costs tens of
microseconds per op on CPU, in the forward and again in the recomputation. When the ops worth keeping run
inside known functions (the fused attention kernel inside `F.scaled_dot_product_attention`, dropout's mask draw
inside `F.dropout`), a function mode watches the segment's Python-level torch calls instead (a few per layer)
and the dispatch mode is active only inside the watched calls. Functions of `torch.nn.functional` are entered
too, so a watched call made inside one (nn.MultiheadAttention's attention, inside
`F.multi_head_attention_forward`) is found.

Forward: each kept op runs and its outputs go through a fastckpt storage; an in-place `bernoulli_` fill
(the mask CPU dropout draws) is kept as its 0/1 values, 1 bit per element under a codec, with its generator's
state after the draw. Recomputation: the watched calls take the kept outputs in forward order instead of
running the op (a kept `bernoulli_` fill is written back into its tensor, the same mask without a random
draw, and its generator set to the state the draw left, so random ops after it draw what they drew in the
forward), and each is dropped once taken.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import CheckpointError

from fastckpt import _compat
from fastckpt.engine.replay import _device_module
from fastckpt.storage.packer import SegmentStorage, _Stored

# In-place random fills the recomputation can take back: they only write 0/1 values into their first argument.
RANDOM_FILLS = (torch.ops.aten.bernoulli_,)
_CONSUMED = object()  # an entry the recomputation already took


@dataclass
class _Fill:
    """A kept random fill: its values, and the generator state the draw left."""

    stored: _Stored
    generator: torch.Generator
    state: torch.Tensor


def _generator(t: torch.Tensor, kwargs: dict) -> torch.Generator | None:
    """The generator a random fill of `t` draws from (None: not one fastckpt can find)."""
    if kwargs.get("generator") is not None:
        return kwargs["generator"]
    if t.device.type == "cpu":
        return torch.default_generator
    module = _device_module(t.device.type)
    generators = getattr(module, "default_generators", None)
    if not generators:
        return None
    return generators[t.device.index if t.device.index is not None else module.current_device()]


class KeptOutputs:
    """What one checkpointed call kept, shared by its forward and recompute contexts."""

    def __init__(self, storage: SegmentStorage, label: str) -> None:
        self.storage = storage
        self.label = label
        self.entries: list[tuple[Any, Any]] = []  # (op, stored outputs), in forward order
        self.taken = 0

    def put(self, func: torch._ops.OpOverload, args: tuple, out: Any, generator: torch.Generator | None) -> None:
        """Keep `func`'s outputs (`generator`: the one a random fill drew from)."""
        if func.overloadpacket in RANDOM_FILLS:
            # The fill holds only 0 and 1: kept as a bool tensor (1 bit each under a codec) it is exact.
            stored = self.storage.pack(args[0].detach().bool())
            self.entries.append((func, _Fill(stored, generator, generator.get_state())))
            return
        if any(r.alias_info is not None for r in func._schema.returns):
            raise ValueError(
                f"fastckpt.hybrid.selective ({self.label}): {func} returns a view of or writes into its inputs; "
                "only ops that return new tensors can be kept (and in-place random fills such as bernoulli_)"
            )
        self.entries.append((func, tree_map(self._pack, out)))

    def _pack(self, x: Any) -> Any:
        return self.storage.pack(x) if isinstance(x, torch.Tensor) else x

    def take(self, func: torch._ops.OpOverload, args: tuple) -> Any:
        index = self.taken
        self.taken += 1
        if index >= len(self.entries):
            raise CheckpointError(
                f"fastckpt.hybrid.selective ({self.label}): the recomputation ran {func} more often than the forward "
                "did; the segment must run the same ops in the same order both times"
            )
        kept_func, stored = self.entries[index]
        if stored is _CONSUMED:
            raise CheckpointError(
                f"fastckpt.hybrid.selective ({self.label}): this segment's kept outputs were already used by an "
                "earlier backward; each is kept for one backward (as with torch's selective checkpointing)"
            )
        if kept_func != func:
            raise CheckpointError(
                f"fastckpt.hybrid.selective ({self.label}): the recomputation ran {func} where the forward ran "
                f"{kept_func}; the segment must run the same ops in the same order both times"
            )
        self.entries[index] = (kept_func, _CONSUMED)  # dropped once taken
        if isinstance(stored, _Fill):
            args[0].copy_(self.storage.unpack(stored.stored))
            stored.generator.set_state(stored.state)  # as if drawn: later random ops draw what they drew
            return args[0]
        return tree_map(lambda x: self.storage.unpack(x) if isinstance(x, _Stored) else x, stored)


class _KeepInside(TorchDispatchMode):
    """Active inside the watched calls: keeps (forward) or hands back (recomputation) the chosen ops' outputs."""

    def __init__(self, kept: KeptOutputs, is_kept: Callable[[Any], bool], recompute: bool) -> None:
        super().__init__()
        self.kept = kept
        self.is_kept = is_kept
        self.recompute = recompute

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        fill = func.overloadpacket in RANDOM_FILLS
        generator = _generator(args[0], kwargs) if fill else None
        if not self.is_kept(func) or (fill and generator is None):  # the latter drawn again, as without fastckpt
            return func(*args, **kwargs)
        if self.recompute:
            return self.kept.take(func, args)
        out = func(*args, **kwargs)
        self.kept.put(func, args, out, generator)
        return out


class WatchCalls(TorchFunctionMode):
    """Active over a region: runs each call of the watched Python-level torch functions under `around(func)` (a
    context manager), those made inside other torch.nn.functional code too (F.multi_head_attention_forward
    calls F.scaled_dot_product_attention). A torch that cannot re-enter such code past this mode runs it
    whole under `around(None)`: it may call a watched function."""

    def __init__(self, functions: frozenset, around: Callable[[Any], contextlib.AbstractContextManager]) -> None:
        super().__init__()
        self.functions = functions
        self.around = around

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.functions:
            with self.around(func):
                return func(*args, **kwargs)
        if getattr(func, "__module__", None) == "torch.nn.functional":  # Python code that may call a watched one
            # Re-entered past this mode, so that the calls inside it are seen too.
            redispatch = _compat.torch_function_redispatch()
            if redispatch is None:
                with self.around(None):
                    return func(*args, **kwargs)
            with self:
                return redispatch(func, types, args, kwargs)
        return func(*args, **kwargs)


class _Context:
    """The forward or the recompute context of one checkpointed call."""

    def __init__(self, kept: KeptOutputs, functions: frozenset, is_kept: Callable[[Any], bool], recompute: bool):
        self.kept = kept
        self.recompute = recompute
        inside = _KeepInside(kept, is_kept, recompute)
        # without a re-entry (around(None)) the function runs whole under the dispatch mode: the same ops kept,
        # more cost
        self._mode = WatchCalls(functions, lambda func: inside)

    def __enter__(self) -> _Context:
        if self.recompute:
            self.kept.taken = 0
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._mode.__exit__(*exc)


def contexts(
    storage: SegmentStorage, label: str, functions: frozenset, is_kept: Callable[[Any], bool]
) -> tuple[_Context, _Context]:
    """(forward context, recompute context) for one checkpointed call, as a checkpoint's context_fn returns."""
    kept = KeptOutputs(storage, label)
    return _Context(kept, functions, is_kept, False), _Context(kept, functions, is_kept, True)
