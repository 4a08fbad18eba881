"""Padded attention: HF's SDPA attention for padded or packed batches without the [tokens x tokens] mask.

With an attention mask, HF hands SDPA a boolean [batch, 1, tokens, tokens] mask; SDPA turns it into a float
copy per call (saved for its backward, one per layer being recomputed) and its kernels compute every block
of the square, the masked part included. When the mask is exactly causal within consecutive segments of each
row, the same attention is dense calls per segment (`attention`): the segment's real queries causally over
its real keys (`is_causal=True`: the kernel skips the upper triangle), its padding queries after them over
all its real keys (what the mask lets them see) and those before them over none (a query that sees no key:
a tiny masked call gives the kernel's output for it). Two masks are of that form: padding (a row is one
segment, its real tokens one block, padding after it or before it) and packed sequences (HF finds them from
position ids that start again, without an attention mask; each sequence is a segment, all real). The result
is the same up to the kernels' summation order; the attention takes about half the time on padded rows, and
on packed rows only the sequences' own squares are computed.

The mask itself is not kept either (`mask`, registered as the mask function): where the model asks for such
a mask, it gets a `CausalSegmentsMask`, the segments in the mask's shape (padding is read from the 2D
attention mask and packed sequences from HF's mask function a block of queries at a time, so the full mask is
never built; any other mask HF builds that is one of these forms, e.g. a sliding window no shorter than the
rows, is dropped once read). HF's boolean mask is [batch, tokens, tokens] bytes held from the forward to the
end of the backward by every checkpointed layer (16 MiB for one row of 4,096 tokens). Anything but this
attention that uses it gets the full mask computed for that use, so no code sees other values than HF's.

Installed by `fastckpt.integrations.hf.enable(model, padded_attention=True)` as an attention implementation
registered with transformers (`AttentionInterface`, `AttentionMaskInterface`), named `fastckpt_sdpa`, on a
model that uses "sdpa". A sliding-window layer's mask over padded rows or packed sequences is one of these
forms with a window: the attention then runs in blocks of `window` queries, each over the keys its windows
reach with a small mask of its own. Every call whose mask is not recognised (holes in a row, dropout, a KV
cache, position biases, torch.compile) runs HF's own `sdpa_attention_forward` unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from fastckpt import _compat
from fastckpt.integrations.hf import gateway, state
from fastckpt.integrations.hf.patches import Patch, Settings

NAME = "fastckpt_sdpa"
_CHECK_ELEMENTS = 1 << 22  # mask elements compared at a time while recognising (bounds the check's memory)
# Rows of different lengths shorter than this run as one masked call (HF's, on the mask computed for it): on
# CPU (2 cores, bf16, attention forward and backward) 16 rows of 256 took 21 ms so, 35 ms in two calls, 101 ms
# in calls per row; from 1,024 tokens the two calls win (8 x 1,024: 90 ms against 95; 8 x 2,048: 256 against
# 363). GPU unmeasured.
_SHORT_ROWS = 1024


def _hf_sdpa() -> Any:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def register() -> None:
    """Register NAME with transformers' attention and mask interfaces (idempotent)."""
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, mask)


# (start, first real token, end of the real tokens, end): one sequence of a row with its padding on either side
Segment = tuple[int, int, int, int]


class CausalSegmentsMask(torch.Tensor):
    """HF's boolean [batch, 1, tokens, tokens] mask of causal attention within segments of each row, held as
    the segments: `rows[b]` is row b's Segments, `segment_ids` and `real_keys` ([batch, tokens]) the same per
    token. Query q sees key k when both are in one segment, k <= q and k is real: a padded row is one segment
    (padding queries after its real tokens see every real key, those before them none), a row of packed
    sequences one segment per sequence. With a `window` (a sliding-window layer's), q also sees only the keys
    k > q - window. It has no elements of its own: `attention` reads `rows`; any op on it (HF's sdpa
    slicing it, an eager model adding it) runs on the full mask, computed for that op. Detaching it (as
    checkpointing does with its arguments) keeps it a CausalSegmentsMask."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's signature)
        # Tensor's own would turn every result into this class; the ops go on to __torch_dispatch__ as they are.
        with _compat.require("disable_torch_function_subclass")():
            return func(*args, **(kwargs or {}))

    @staticmethod
    def __new__(
        cls, segment_ids: torch.Tensor, real_keys: torch.Tensor, rows: tuple, window: int | None = None
    ) -> CausalSegmentsMask:
        batch, tokens = real_keys.shape
        shape = (batch, 1, tokens, tokens)
        mask = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.bool, device=real_keys.device)
        mask.segment_ids, mask.real_keys, mask.rows, mask.window = segment_ids, real_keys, rows, window
        return mask

    @classmethod
    def of_rows(
        cls, rows: tuple[tuple[Segment, ...], ...], window: int | None = None, *, device: torch.device
    ) -> CausalSegmentsMask:
        tokens = rows[0][-1][-1]
        segment_ids = torch.zeros(len(rows), tokens, dtype=torch.int32)
        real_keys = torch.zeros(len(rows), tokens, dtype=torch.bool)
        for b, segments in enumerate(rows):
            for index, (start, real_start, real_end, end) in enumerate(segments):
                segment_ids[b, start:end] = index
                real_keys[b, real_start:real_end] = True
        return cls(segment_ids.to(device), real_keys.to(device), rows, window)

    def full(self) -> torch.Tensor:
        """The mask HF's sdpa_mask builds."""
        positions = torch.arange(self.shape[-1], device=self.device)
        causal = positions[None, :] <= positions[:, None]
        if self.window is not None:
            causal = causal & (positions[None, :] > positions[:, None] - self.window)
        same_segment = self.segment_ids[:, :, None] == self.segment_ids[:, None, :]
        return (causal & same_segment & self.real_keys[:, None, :])[:, None]

    def __tensor_flatten__(self) -> tuple[list[str], tuple]:
        """The tensors it holds (torch's protocol for wrapper subclasses; the planner follows their memory)."""
        return ["segment_ids", "real_keys"], (self.rows, self.window)

    @staticmethod
    def __tensor_unflatten__(inner: dict, context: tuple, size: Any, stride: Any) -> CausalSegmentsMask:
        return CausalSegmentsMask(inner["segment_ids"], inner["real_keys"], *context)

    def __deepcopy__(self, memo: dict) -> CausalSegmentsMask:
        return CausalSegmentsMask(self.segment_ids.clone(), self.real_keys.clone(), self.rows, self.window)

    def __reduce_ex__(self, protocol: Any) -> Any:  # saved (torch.save, pickle) as the full mask
        return self.full().__reduce_ex__(protocol)

    def __repr__(self) -> str:  # type: ignore[override]
        window = "" if self.window is None else f", window={self.window}"
        return f"CausalSegmentsMask(shape={tuple(self.shape)}, rows={self.rows}{window})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's signature)
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            return cls(args[0].segment_ids, args[0].real_keys, args[0].rows, args[0].window)
        args, kwargs = tree_map_only(cls, cls.full, (args, kwargs or {}))
        return func(*args, **kwargs)


def mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """NAME's mask function: a CausalSegmentsMask where transformers' `sdpa_mask` would build a causal mask
    over padded rows (padding on either side of each row's real tokens) or over packed sequences, from the
    start of the sequence (no cache offset, not traced); `sdpa_mask`'s own result otherwise (None where no
    mask is needed).

    Padding is read from the 2D attention mask (the full mask is never built). Any other mask `sdpa_mask`
    builds is read (element by element, a block of queries at a time) and dropped if it is one of these:
    packed sequences (HF finds them from position ids that start again, without an attention mask), or a
    window or chunk no shorter than the rows (a sliding-window layer's mask is then causal), or a sliding
    window over padded rows (a CausalSegmentsMask with that window)."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    padding = kwargs.get("attention_mask")
    tokens = kwargs.get("q_length")
    plain = not (
        args
        or any(type(kwargs.get(k, 0)) is not int or kwargs.get(k, 0) != 0 for k in ("q_offset", "kv_offset"))
        or kwargs.get("kv_length") != tokens
        or torch.compiler.is_compiling()
        or torch.jit.is_tracing()
    )
    causal = kwargs.get("mask_function", causal_mask_function) is causal_mask_function
    real = _real_blocks(padding, kwargs.get("batch_size"), tokens, kwargs.get("device")) if plain and causal else None
    if real is not None:
        return CausalSegmentsMask.of_rows(_one_segment_each(real, tokens), device=padding.device)
    if plain and not causal and padding is None:  # packed sequences (a mask function from the position ids)
        form = _packed_from_mask_function(kwargs, tokens)
        if form is not None:
            return CausalSegmentsMask.of_rows(*form, device=kwargs.get("device"))
    built = sdpa_mask(*args, **kwargs)
    form = _form_of(built, padding, kwargs.get("local_size"), tokens) if plain else None
    return built if form is None else CausalSegmentsMask.of_rows(*form, device=built.device)


def _packed_from_mask_function(kwargs: dict[str, Any], tokens: int) -> tuple[tuple, int | None] | None:
    """(rows, window) of packed sequences read from the mask sdpa_mask would build, a block of queries at a time
    (its `q_offset`, `q_length`): a whole [tokens x tokens] mask with the temporaries of building it is some 3
    bytes per element (about 3 GiB for one row of 32K tokens), a block a bounded few MiB."""
    from transformers.masking_utils import sdpa_mask

    def rows(start: int, stop: int) -> torch.Tensor | None:
        block = sdpa_mask(**{**kwargs, "q_offset": start, "q_length": stop - start, "allow_is_causal_skip": False})
        return block[:, 0] if isinstance(block, torch.Tensor) and block.dim() == 4 and block.shape[1] == 1 else None

    batch, device, window = kwargs.get("batch_size"), kwargs.get("device"), kwargs.get("local_size")
    if type(batch) is not int:
        return None
    found = _packed_in_blocks(rows, batch, tokens, device)
    if found is None and type(window) is int and 0 < window < tokens:
        found = _packed_in_blocks(rows, batch, tokens, device, window)
        return None if found is None else (found, window)
    return None if found is None else (found, None)


def _one_segment_each(blocks: list[tuple[int, int]] | tuple, tokens: int) -> tuple[tuple[Segment, ...], ...]:
    """Rows of one segment each, from their (first real token, end of the real tokens)."""
    return tuple(((0, first, end, tokens),) for first, end in blocks)


def _form_of(built: Any, padding: Any, window: Any, tokens: int) -> tuple[tuple, int | None] | None:
    """(rows, window) of a CausalSegmentsMask with the values of `built` (a mask sdpa_mask made from the 2D
    `padding` and, for a sliding-window layer, `window`), or None when it is none of those forms."""
    if not isinstance(built, torch.Tensor):
        return None
    rows = packed_sequences(built, tokens) if padding is None else None
    found = padded_rows(built, built.shape[0], tokens) if rows is None else None
    if rows is not None or found is not None:
        return rows or _one_segment_each(found, tokens), None  # causal (a window no shorter than the rows too)
    if type(window) is not int or not 0 < window < tokens:
        return None
    rows = packed_sequences(built, tokens, window) if padding is None else None
    found = windowed_rows(built, padding, window, tokens) if rows is None else None
    if rows is None and found is None:
        return None
    return rows or _one_segment_each(found, tokens), window


def _real_blocks(
    padding: Any, batch: Any, tokens: int, device: Any, padded: bool = True
) -> list[tuple[int, int]] | None:
    """Per row, (first real token, end of the real tokens) when `padding` is a boolean [batch, tokens] attention
    mask whose rows' real tokens are one block each, none empty, padding (before or after it) in at least one
    row unless `padded` is False (as the models hand it: an integer one gives sdpa_mask another dtype); None
    otherwise."""
    if type(padding) is not torch.Tensor or padding.dtype != torch.bool or tuple(padding.shape) != (batch, tokens):
        return None
    if padding.device != torch.device(device if device is not None else padding.device):
        return None
    lengths = padding.sum(-1)
    if (padded and not bool((lengths < tokens).any())) or not bool((lengths > 0).all()):  # no padding: is_causal
        return None
    first = padding.view(torch.uint8).argmax(-1)
    positions = torch.arange(tokens, device=padding.device)
    if not torch.equal(padding, (positions >= first[:, None]) & (positions < (first + lengths)[:, None])):
        return None  # holes
    return [(f, f + n) for f, n in zip(first.tolist(), lengths.tolist(), strict=True)]


def _sees(queries: Any, keys: Any, first: Any, end: Any, window: int | None = None) -> torch.Tensor:
    """Whether each query sees each key of a segment whose real tokens are [first, end) (positions, broadcast:
    queries [..., q, 1], keys [..., 1, k], first and end per row): a real key no later than the query, and
    within `window` of it if one is given."""
    sees = (keys <= queries) & (keys >= first) & (keys < end)
    return sees if window is None else sees & (keys > queries - window)


def _per_row(values: Any, device: torch.device) -> torch.Tensor:
    """One int per batch row (a list or a tensor) as a [batch, 1, 1] tensor, to broadcast against [q, k]."""
    return torch.as_tensor(values, device=device).reshape(-1, 1, 1)


def _square_bool(mask: Any, tokens: int) -> bool:
    """True when `mask` is a boolean [batch, 1, tokens, tokens] tensor."""
    return (
        isinstance(mask, torch.Tensor)
        and mask.dtype == torch.bool
        and mask.dim() == 4
        and mask.shape[1] == 1
        and mask.shape[2:] == (tokens, tokens)
    )


def _equal_by_blocks(mask_rows: torch.Tensor, expected: Any, tokens: int) -> bool:
    """mask_rows ([batch, tokens, tokens]) == expected(queries) for every block of queries (bounded memory)."""
    step = max(1, _CHECK_ELEMENTS // (tokens * mask_rows.shape[0]))
    for start in range(0, tokens, step):
        queries = torch.arange(start, min(start + step, tokens), device=mask_rows.device)
        if not torch.equal(mask_rows[:, start : start + step], expected(queries)):
            return False
    return True


def packed_sequences(
    mask: torch.Tensor, tokens: int, window: int | None = None
) -> tuple[tuple[Segment, ...], ...] | None:
    """Per batch row, the segments of a boolean [batch, 1, tokens, tokens] mask that is exactly causal within
    consecutive segments covering the row (packed sequences, no padding), within a sliding `window` if one
    is given; None otherwise."""
    if not _square_bool(mask, tokens):
        return None
    return _packed_in_blocks(lambda start, stop: mask[:, 0, start:stop], mask.shape[0], tokens, mask.device, window)


def _packed_in_blocks(
    rows: Any, batch: int, tokens: int, device: Any, window: int | None = None
) -> tuple[tuple[Segment, ...], ...] | None:
    """packed_sequences' answer from the mask's rows read a block of queries at a time (`rows(start, stop)`: a
    boolean [batch, stop - start, tokens] tensor, or None), in order: the whole mask is never held."""
    if window is not None and window < 2:
        return None  # a query seeing only itself would not tell a sequence's start
    positions = torch.arange(tokens, device=device)
    keys = positions[None, None, :]
    running = torch.zeros(batch, 1, dtype=torch.long, device=device)  # the sequence running into the block
    firsts = []
    step = max(1, _CHECK_ELEMENTS // (tokens * batch))
    for start in range(0, tokens, step):
        block, queries = rows(start, min(start + step, tokens)), positions[start : start + step]
        if not isinstance(block, torch.Tensor) or tuple(block.shape) != (batch, len(queries), tokens):
            return None
        if not bool(block[:, torch.arange(len(queries), device=device), queries].all()):
            return None  # a query that does not see itself
        # A sequence starts where a query sees no earlier key. The first key each query sees, read through a
        # uint8 view: a copy or a sum of the block would allocate it again, a sum 8 bytes per element.
        first = block.view(torch.uint8).argmax(-1) == queries
        starts = torch.maximum(torch.cummax(torch.where(first, queries, 0), dim=-1).values, running)
        running = starts[:, -1:]
        q = queries[None, :, None]
        sees = (keys >= starts[:, :, None]) & (keys <= q)
        if not torch.equal(block, sees if window is None else sees & (keys > q - window)):
            return None
        firsts.append(first)
    segments = []
    for row in torch.cat(firsts, dim=1).tolist():
        begins = [i for i, is_first in enumerate(row) if is_first]
        segments.append(tuple((b, b, e, e) for b, e in zip(begins, begins[1:] + [tokens], strict=True)))
    return tuple(segments)


def windowed_rows(mask: torch.Tensor, padding: Any, window: int, tokens: int) -> list[tuple[int, int]] | None:
    """Per batch row, (first real token, end of the real tokens) when `mask` (built by sdpa_mask from the 2D
    `padding`, or None) is exactly the sliding-window causal mask of `window` over each row's real tokens;
    None otherwise."""
    if not _square_bool(mask, tokens):
        return None
    batch = mask.shape[0]
    if padding is None:
        blocks = [(0, tokens)] * batch
    else:
        blocks = _real_blocks(padding, batch, tokens, mask.device, padded=False)
        if blocks is None:
            return None
    keys = torch.arange(tokens, device=mask.device)[None, :]
    first, end = (_per_row([block[i] for block in blocks], mask.device) for i in (0, 1))
    found = _equal_by_blocks(mask[:, 0], lambda queries: _sees(queries[:, None], keys, first, end, window), tokens)
    return blocks if found else None


def padded_rows(mask: Any, batch: int, tokens: int) -> tuple[tuple[int, int], ...] | None:
    """Per batch row (one entry when the mask broadcasts over the batch), (first real token, end of the real
    tokens), when `mask` is a boolean [batch or 1, 1, tokens, tokens] mask that is exactly causal over each
    row's real tokens, one block of at least one per row (padding on either side); None otherwise. The
    verdict is kept beside the mask (all layers share it, recomputations pass it again) and recomputed when the
    mask is changed in place."""
    if not _square_bool(mask, tokens) or mask.shape[0] not in (1, batch):
        return None
    cached = state.mask_forms.get(mask)
    if cached is not None and cached[0] == mask._version:
        return cached[1]
    mask_rows = mask[:, 0]
    keys = mask_rows[:, -1]  # the last query sees every real key (it is real, or padding after them)
    lengths = keys.sum(-1)
    first = keys.view(torch.uint8).argmax(-1)
    positions = torch.arange(tokens, device=mask.device)
    block = (positions >= first[:, None]) & (positions < (first + lengths)[:, None])
    found = bool((lengths > 0).all()) and torch.equal(keys, block)
    start, end = _per_row(first, mask.device), _per_row(first + lengths, mask.device)
    found = found and _equal_by_blocks(mask_rows, lambda q: _sees(q[:, None], positions[None, :], start, end), tokens)
    result = tuple(zip(first.tolist(), (first + lengths).tolist(), strict=True)) if found else None
    state.mask_forms[mask] = (mask._version, result)
    return result


def _segments(
    query: torch.Tensor, key: torch.Tensor, attention_mask: Any, dropout: float, kwargs: dict[str, Any]
) -> tuple[tuple[tuple[Segment, ...], ...] | None, int | None]:
    """Per batch row (or one for all) its segments, and a sliding window (None: none), where the call decomposes
    into causal calls per segment; (None, None) where it does not (HF's sdpa then runs it whole)."""
    batch, tokens = query.shape[0], query.shape[2]
    decomposable = (
        dropout == 0.0
        and kwargs.get("position_bias") is None
        and kwargs.get("cache") is None
        and tokens == key.shape[2]
        and not torch.compiler.is_compiling()
        and not torch.jit.is_tracing()
    )
    if decomposable and isinstance(attention_mask, CausalSegmentsMask):
        if attention_mask.shape[0] == batch and attention_mask.shape[-1] == tokens:
            return attention_mask.rows, attention_mask.window
    elif decomposable:
        found = padded_rows(attention_mask, batch, tokens)
        if found is not None:
            return _one_segment_each(found, tokens), None
    return None, None


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF's attention-interface signature; [batch, tokens, heads, head_dim] output as HF's sdpa returns it."""
    sdpa = _hf_sdpa()
    tokens = query.shape[2]
    rows, window = _segments(query, key, attention_mask, dropout, kwargs)
    if rows is None:
        return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                    is_causal=is_causal, **kwargs)  # fmt: skip

    def segment(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, end: int) -> torch.Tensor:
        """One segment, its real tokens [first, end): those queries causally over the real keys, the padding
        queries after them over all real keys, those before them over none (a masked call gives the kernel's
        result for a query that sees no key)."""
        k, v = k[:, :, first:end], v[:, :, first:end]
        parts = []
        if first > 0:
            nothing = torch.zeros(1, 1, first, 1, dtype=torch.bool, device=q.device)
            parts.append(sdpa(module, q[:, :, :first], k[:, :, :1], v[:, :, :1], nothing, scaling=scaling,
                              is_causal=False, **kwargs)[0])  # fmt: skip
        parts.append(sdpa(module, q[:, :, first:end], k, v, None, scaling=scaling, is_causal=True, **kwargs)[0])
        if end < q.shape[2]:
            parts.append(sdpa(module, q[:, :, end:], k, v, None, scaling=scaling, is_causal=False, **kwargs)[0])
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def windowed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: Any, end: Any) -> torch.Tensor:
        """Segments under a sliding window, one per batch row of q (`first`, `end`: ints, or a tensor per row):
        blocks of `window` queries, each over the keys its window can reach (fewer than 2 x window), with
        that block's mask for every row (small, computed here)."""
        positions = torch.arange(q.shape[2], device=q.device)
        first, end = _per_row(first, q.device), _per_row(end, q.device)
        parts = []
        for start in range(0, q.shape[2], window):
            stop, reach = min(start + window, q.shape[2]), max(0, start - window + 1)
            sees = _sees(positions[start:stop, None], positions[None, reach:stop], first, end, window)
            parts.append(sdpa(module, q[:, :, start:stop], k[:, :, reach:stop], v[:, :, reach:stop], sees[:, None],
                              scaling=scaling, is_causal=False, **kwargs)[0])  # fmt: skip
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def padded(firsts: list[int], ends: list[int]) -> torch.Tensor:
        """Rows of one segment each, of different lengths, in two calls for the whole batch (a call per row
        costs more than the mask saves when rows are many and short): the queries before the first that is
        not plainly causal from position 0 in some row (the shortest row's end; 0 if a row is left-padded)
        causally without a mask, the rest with their rows of the mask (computed here, for those queries)."""
        plain = min(end if first == 0 else 0 for first, end in zip(firsts, ends, strict=True))
        parts = []
        if plain > 0:
            parts.append(sdpa(module, query[:, :, :plain], key[:, :, :plain], value[:, :, :plain], None,
                              scaling=scaling, is_causal=True, **kwargs)[0])  # fmt: skip
        positions = torch.arange(tokens, device=query.device)
        sees = _sees(positions[plain:, None], positions[None, :], _per_row(firsts, query.device),
                     _per_row(ends, query.device))  # fmt: skip
        parts.append(sdpa(module, query[:, :, plain:], key, value, sees[:, None], scaling=scaling, is_causal=False,
                          **kwargs)[0])  # fmt: skip
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: tuple[Segment, ...]) -> torch.Tensor:
        one = segment if window is None else windowed
        parts = [one(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], f - s, r - s) for s, f, r, e in segments]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    if len(set(rows)) == 1:
        return row(query, key, value, rows[0]), None
    if all(len(segments) == 1 for segments in rows):  # padded rows of different lengths: the batch at once
        firsts, ends = [segments[0][1] for segments in rows], [segments[0][2] for segments in rows]
        if window is not None:
            return windowed(query, key, value, firsts, ends), None
        if tokens < _SHORT_ROWS:  # the mask is computed for this call only (HF's holds it all step)
            return sdpa(module, query, key, value, attention_mask, scaling=scaling, is_causal=is_causal, **kwargs)
        return padded(firsts, ends), None
    out = [row(query[b : b + 1], key[b : b + 1], value[b : b + 1], segments) for b, segments in enumerate(rows)]
    return torch.cat(out, dim=0), None


class PaddedAttention(Patch):
    """`enable(padded_attention=True)`: the model's "sdpa" attention switched to NAME (`attention` above)."""

    @classmethod
    def wanted(cls, settings: Settings) -> bool:
        return settings.padded_attention

    @classmethod
    def check(cls, model: torch.nn.Module, settings: Settings) -> None:
        """ValueError, naming the fix, unless `model`'s attention implementation is "sdpa" (or already NAME);
        RuntimeError where this torch lacks what the mask form's ops need."""
        _compat.require("disable_torch_function_subclass")
        current = gateway.attention_implementations(model)
        if not current or not current <= {"sdpa", NAME}:
            without_sdpa = sorted(
                {type(m).__name__ for m in model.modules() if getattr(type(m), "_supports_sdpa", None) is False}
            )
            if without_sdpa and current:  # loading it with sdpa is not a fix there
                raise ValueError(
                    f"fastckpt.integrations.hf.enable(padded_attention=True): transformers has no sdpa attention for "
                    f"{', '.join(without_sdpa)} (padded attention replaces sdpa's); enable without padded_attention"
                )
            raise ValueError(
                f"fastckpt.integrations.hf.enable(padded_attention=True): the model's attention implementation is "
                f"{sorted(map(str, current))}, padded attention replaces 'sdpa'; load the model with "
                "attn_implementation='sdpa' or enable without padded_attention"
            )
        # transformers switches only models whose attention goes through its AttentionInterface (others, e.g.
        # Falcon, keep their own sdpa code and only log a warning); refuse those before anything changes.
        fixed = sorted(
            {type(module).__name__ for module in model.modules() if not gateway.attention_switchable(module)}
        )
        if fixed:
            raise ValueError(
                f"fastckpt.integrations.hf.enable(padded_attention=True): the attention implementation of "
                f"{', '.join(fixed)} cannot be switched (the attention does not go through transformers' "
                "AttentionInterface); enable without padded_attention"
            )

    @classmethod
    def install(cls, model: torch.nn.Module, settings: Settings) -> None:
        """Switch `model` (a PreTrainedModel using "sdpa", `check`ed) to NAME."""
        register()
        model.set_attn_implementation(NAME)
        left = gateway.attention_implementations(model) - {NAME}
        if left:
            model.set_attn_implementation("sdpa")
            raise ValueError(
                f"fastckpt.integrations.hf.enable(padded_attention=True): {type(model).__name__} did not switch its "
                f"attention implementation (still {sorted(map(str, left))}); enable without padded_attention"
            )

    @classmethod
    def remove(cls, model: torch.nn.Module) -> None:
        """Give `model` back HF's "sdpa" if NAME is installed."""
        if installed(model):
            model.set_attn_implementation("sdpa")


def installed(model: torch.nn.Module) -> bool:
    return NAME in gateway.attention_implementations(model)
