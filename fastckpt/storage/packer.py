"""The saved-tensor hooks of one segment under a storage policy.

Every tensor autograd saves inside the segment comes through `pack`. Tensors that are alive
anyway or not worth storing differently (parameters, small, integer, sparse, subclasses) are
kept as they are; the rest are stored through the policy's codec (exactly, at 1 bit per element, when a
float tensor holds at most two values) and/or moved to host memory. The same tensor saved by several ops or
segments is stored once. Under autocast, a low-precision copy of a parameter is kept as a reference to the
parameter and cast again in backward (fastckpt.storage.roles).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import weakref
from collections.abc import Callable, Iterator

import torch

from fastckpt.policies import Policy
from fastckpt.storage import codecs, offload, roles
from fastckpt.storage.accounting import SegmentRecord, nbytes, register

_STORABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _is_parameter_like(t: torch.Tensor) -> bool:
    """Parameters (and views of them, e.g. a transposed weight) stay alive anyway: never store a copy."""
    base = t._base if t._base is not None else t
    return isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad)


def _is_cheap_broadcast(t: torch.Tensor, policy: Policy) -> bool:
    """An expanded view (a zero stride, e.g. a [B, 1, T, T] attention mask broadcast over heads) whose memory
    is at most the codec's bits per element of the view: kept plain, it is exact and costs no more."""
    expanded = any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride(), strict=True))
    return expanded and 8 * t.untyped_storage().nbytes() <= t.numel() * codecs.BITS.get(policy.codec, 8)


def keep_plain_reason(t: torch.Tensor, policy: Policy) -> str | None:
    """Why `t` is kept as autograd would keep it, or None when the policy's storage applies."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        return "tensor subclass"
    reason = value_keep_plain_reason(t, policy, "parameter" if _is_parameter_like(t) else None)
    if reason is None and policy.codec is not None and _is_cheap_broadcast(t, policy):
        return "expanded"
    return reason


def value_keep_plain_reason(t: torch.Tensor, policy: Policy, alive_anyway: str | None) -> str | None:
    """keep_plain_reason by `t`'s layout, dtype and size, for a tensor known to be a plain tensor (or a
    compiled graph's fake value of one); `alive_anyway` names why it is alive anyway (e.g. 'parameter'), if it is."""
    if t.layout != torch.strided or t.is_nested:
        return "not a dense tensor"
    masks_allowed = policy.codec is not None and t.dtype == torch.bool  # dropout masks: 1 bit each, exact
    if t.dtype not in _STORABLE_DTYPES and not masks_allowed:
        return str(t.dtype).removeprefix("torch.")
    if alive_anyway is not None:
        return alive_anyway
    if nbytes(t) < policy.min_tensor_bytes:
        return "small"
    return None


class _Stored:
    """One tensor as the policy keeps it: its tensors (plain, or a codec's payload), maybe on host.

    `version` is the saved tensor's version counter at pack when `tensors` alias it (kept or stored
    plainly): an in-place change before backward is then caught at unpack, as autograd does.
    """

    __slots__ = ("encoded", "tensors", "on_host", "version", "__weakref__")

    def __init__(self, encoded: codecs.Encoded | None, tensors: tuple, on_host: bool, version: int | None) -> None:
        self.encoded = encoded
        self.tensors = tensors
        self.on_host = on_host
        self.version = version

    def check_version(self, policy: str) -> None:
        if self.version is None or self.tensors[0]._version == self.version:
            return
        t = self.tensors[0]
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"[{t.type()} [{', '.join(map(str, t.shape))}]] is at version {t._version}; expected version "
            f"{self.version} instead. Hint: fastckpt (policy {policy!r}) kept this tensor for backward; do not "
            "modify it in place before backward, or clone it first."
        )


class _StoredOnce:
    """Stored forms by the key of the tensor they were made from, shared by every storage. The address in the
    key identifies the storage only while the first tensor saved from it is alive (then the allocator may hand
    it to a new tensor): an entry is dropped when that tensor or the stored form dies."""

    def __init__(self) -> None:
        self._entries: dict[tuple, tuple[weakref.ref, weakref.ref]] = {}
        self.observers: list[Callable[[tuple, _Stored, bool], None]] = []

    def get(self, key: tuple) -> _Stored | None:
        first_saved, stored_ref = self._entries.get(key, (None, None))
        if first_saved is None or first_saved() is None:
            return None
        return stored_ref()

    def put(self, key: tuple, t: torch.Tensor, stored: _Stored) -> None:
        def drop(_: weakref.ref) -> None:
            if self._entries.get(key, (None, None))[0] is first_saved:
                del self._entries[key]

        first_saved = weakref.ref(t, drop)
        self._entries[key] = (first_saved, weakref.ref(stored, lambda _: drop(first_saved)))


_SHARED = _StoredOnce()


@contextlib.contextmanager
def observe_shared(callback: Callable[[tuple, _Stored, bool], None]) -> Iterator[None]:
    """Within the context, `callback(key, stored, made)` on every tensor stored through the shared forms (`made`:
    stored now; else an earlier form reused). The key's first field is the source storage's address. The planner
    uses it to see which segments share a stored form."""
    _SHARED.observers.append(callback)
    try:
        yield
    finally:
        _SHARED.observers.remove(callback)


class SegmentStorage:
    """pack/unpack for one checkpointed call; also used for the inputs of a recompute policy."""

    def __init__(self, policy: Policy, label: str | None = None) -> None:
        self.policy = policy
        # `label` names the record in track() when the policy alone would not say what is stored
        # (e.g. the recomputed tensors of a 'recompute:int4' segment are stored with plain 'int4').
        self.record = SegmentRecord(policy=label or str(policy))
        # Weak on both sides: autograd releases each saved tensor right after its node ran, and so must we.
        self._offload_group: offload.OffloadGroup | None = None  # this segment's host copies (prefetched together)
        self._backward_started = False
        self._watch = roles.ParameterWatch()
        register(self.record)

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        """The context that routes the segment's saved tensors through this storage."""
        watch = self._watch if roles.autocast_enabled() else contextlib.nullcontext()  # no autocast: no casts
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack), watch:
            yield

    def watching(self) -> contextlib.AbstractContextManager:
        """The context in which `pack` recognises casts of parameters, for an engine that packs into this
        storage itself: around a recomputation (which turns the forward's autocast back on inside)."""
        return self._watch if roles.casts_recognised() else contextlib.nullcontext()

    def pack(self, t: torch.Tensor) -> _Stored | roles.ParameterCast:
        start = time.perf_counter()
        record = self.record
        record.tensors += 1
        cast = self._watch.cast_of(t)
        if cast is not None:  # what autograd would keep, held by the parameter instead
            record.count_raw(t)
            record.codecs.add("parameter-cast")
            record.pack_seconds += time.perf_counter() - start
            return cast
        policy = self.policy.for_tensor(t)
        reason = keep_plain_reason(t, policy)
        if reason is not None:
            record.count_plain(reason)
            # Detached: t itself would tie an output to its own grad_fn (a reference cycle); the
            # detached tensor shares t's version counter.
            return _Stored(None, (t.detach(),), on_host=False, version=t._version)
        # The same storage, view and version saved twice (by two ops, or by several segments: an attention
        # mask or position embeddings every layer takes) is stored once while its first stored form lives;
        # host copies only within a segment (they are prefetched per segment).
        owner = id(self) if policy.offload else None
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t._version,
               t.device, policy.codec, policy.group_size, policy.stochastic_rounding, owner)  # fmt: skip
        stored = _SHARED.get(key)
        made = stored is None
        if made:
            record.count_raw(t)
            stored = self._store(t, policy)
            _SHARED.put(key, t, stored)
        for observer in _SHARED.observers:
            observer(key, stored, made)
        record.pack_seconds += time.perf_counter() - start
        return stored

    def _store(self, t: torch.Tensor, policy: Policy) -> _Stored:
        t = t.detach()
        codec = "mask" if t.dtype == torch.bool else policy.codec
        encoded = None
        if codec:
            # two_valued looks at a small sample first, so an ordinary activation costs little
            encoded = codecs.encode_tensor(t, codec, policy.group_size, policy.stochastic_rounding, exact_two=True)
            self.record.codecs.add(encoded.codec)
        tensors = encoded.payload if encoded else (t,)
        if policy.offload and (t.device.type != "cpu" or offload.ENGINE.copies_cpu_tensors):
            self.record.count_kept(tensors, on_host=True)
            if self._offload_group is None:
                self._offload_group = offload.ENGINE.group()
            copies = tuple(offload.to_host(x, self._offload_group) for x in tensors)
            # the codec's metadata without its device payload: the host copies are what is kept
            return _Stored(dataclasses.replace(encoded, payload=()) if encoded else None, copies, True, None)
        self.record.count_kept(tensors)
        return _Stored(encoded, tensors, False, None if encoded else t._version)

    def unpack(self, stored: _Stored | roles.ParameterCast) -> torch.Tensor:
        if isinstance(stored, roles.ParameterCast):
            return stored.value()
        stored.check_version(self.record.policy)
        start = time.perf_counter()
        register(self.record)
        if stored.on_host and not self._backward_started:
            self._backward_started = True
            offload.ENGINE.entering(self._offload_group)  # prefetch the segment backward runs next
        tensors = tuple(offload.to_device(x) for x in stored.tensors) if stored.on_host else stored.tensors
        tensor = codecs.decode(dataclasses.replace(stored.encoded, payload=tensors)) if stored.encoded else tensors[0]
        self.record.unpack_seconds += time.perf_counter() - start
        return tensor
