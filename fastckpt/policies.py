"""Policies: how a checkpointed segment keeps what backward needs (recompute, store, compress, offload)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

CODECS = ("int8", "fp8", "int4", "int2")
TOKENS = ("recompute", "save", "offload", *CODECS)
# "recompute:<codec>": recompute, and keep the tensors the recomputation produces through <codec> until
# backward uses them. The codec after the colon binds to the recomputation only; a bare codec token keeps
# binding to what the segment stores (its inputs under recompute), so the two never read alike.
RECOMPUTE_TOKENS = tuple(f"recompute:{codec}" for codec in CODECS)
_INTEGER_CODECS = ("int8", "int4", "int2")
MAX_GROUP_SIZE = 2**31 - 1  # a group never spans more than the tensor; the kernels index groups with int32


def error_reason(error: Exception) -> str:
    """A Policy error's text without its 'fastckpt.Policy: ' prefix, for a caller whose message names the
    argument itself (a plan candidate, a selective store)."""
    return str(error).removeprefix("fastckpt.Policy: ")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# A recomputation's saved tensors live for one segment's backward only, so the small ones barely move the
# peak, while each costs a codec call both ways, and some carry a gradient straight through: a LoRA layer's
# [tokens x rank] activation (16 KiB at 1024 tokens, rank 8) under int8 took a bf16 LoRA step's adapter
# gradient error from 1.27x bf16 autocast's own to 1.44x. Kept plain below this size: same peak (to 0.1 MiB),
# 6% less time and the lower error on that step (benchmarks/llm.py, 16 layers x 1024 tokens).
RECOMPUTED_MIN_BYTES = 64 * 2**10


@dataclass(frozen=True)
class Policy:
    """Per-segment storage policy.

    recompute: re-run the segment in backward (stock checkpoint); then only the segment's inputs
        go through `codec`/`offload`. Without it, every tensor the segment saves for backward does.
    codec: one of CODECS, or None for exact storage.
    recompute_codec: with recompute, one of CODECS through which the tensors the recomputation saves are
        kept until backward uses them (each decoded when its node runs, then freed), so the recomputed
        segment never holds all its activations in full precision; None keeps them plain (stock).
    offload: keep stored tensors in host memory until backward.
    recompute_min_tensor_bytes: the recompute codec's min_tensor_bytes (see RECOMPUTED_MIN_BYTES for why it
        is larger by default).
    group_size (None: the codec's default), stochastic_rounding, min_tensor_bytes, rule (tensor -> Policy,
        policy string or None, a per-tensor override): tuning of the storage engine. `rule` sees every
        tensor the policy stores (the inputs under recompute, the saved tensors without it, and the
        recomputed tensors under a recompute_codec); its answer's codec and offload apply to that tensor.
    """

    recompute: bool = True
    codec: str | None = None
    offload: bool = False
    group_size: int | None = None
    stochastic_rounding: bool = False
    min_tensor_bytes: int = 4096
    rule: Callable[[torch.Tensor], Policy | str | None] | None = None
    recompute_codec: str | None = None
    recompute_min_tensor_bytes: int = RECOMPUTED_MIN_BYTES

    def __post_init__(self) -> None:
        for name in ("recompute", "offload", "stochastic_rounding"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"fastckpt.Policy: {name} must be True or False, got {getattr(self, name)!r}")
        if self.codec is not None and self.codec not in CODECS:
            raise ValueError(
                f"fastckpt.Policy: codec={self.codec!r} is not one of {list(CODECS)} (or None for exact storage)"
            )
        if self.recompute_codec is not None:
            if self.recompute_codec not in CODECS:
                raise ValueError(
                    f"fastckpt.Policy: recompute_codec={self.recompute_codec!r} is not one of {list(CODECS)} (or None "
                    "to keep recomputed tensors plain)"
                )
            if not self.recompute:
                raise ValueError(
                    f"fastckpt.Policy: recompute_codec={self.recompute_codec!r} applies to recomputed tensors; it "
                    "needs recompute=True"
                )
        if (
            self.stochastic_rounding
            and self.codec not in _INTEGER_CODECS
            and self.recompute_codec not in _INTEGER_CODECS
        ):
            raise ValueError(
                "fastckpt.Policy: stochastic_rounding applies to the int8/int4/int2 codecs, not to "
                f"codec={self.codec!r}"
                + (f" / recompute_codec={self.recompute_codec!r}" if self.recompute_codec else "")
            )
        if self.group_size is not None and not (_is_int(self.group_size) and 1 <= self.group_size <= MAX_GROUP_SIZE):
            raise ValueError(
                f"fastckpt.Policy: group_size must be an integer from 1 to {MAX_GROUP_SIZE} (or None for the codec's "
                f"default), got {self.group_size!r}"
            )
        for name in ("min_tensor_bytes", "recompute_min_tensor_bytes"):
            if not (_is_int(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"fastckpt.Policy: {name} must be an integer >= 0, got {getattr(self, name)!r}")
        if self.rule is not None and not callable(self.rule):
            raise TypeError(
                "fastckpt.Policy: rule must be a callable (tensor -> Policy, policy string or None), got "
                f"{type(self.rule)}"
            )

    def for_tensor(self, t: torch.Tensor) -> Policy:
        """The policy for one saved tensor: `rule`'s answer when it gives one, else this policy."""
        if self.rule is None:
            return self
        chosen = self.rule(t)
        if chosen is None:
            return self
        if not isinstance(chosen, (str, Policy)):
            raise TypeError(
                f"fastckpt.Policy: rule returned {type(chosen).__name__} {chosen!r}; it must return a fastckpt.Policy, "
                "a policy string such as 'int8', or None (keep the segment's policy)"
            )
        return Policy.parse(chosen)

    @classmethod
    def parse(cls, spec: str | Policy) -> Policy:
        """Parse a '+'-joined policy string such as 'int4+offload' or 'recompute:int4+int8'; a Policy passes through."""
        if isinstance(spec, Policy):
            return spec
        if not isinstance(spec, str):
            raise TypeError(
                "fastckpt.Policy: policy must be a string such as 'int4+offload' or a fastckpt.Policy, got "
                f"{type(spec)}"
            )
        tokens = [t.strip() for t in spec.split("+")]
        valid = [*TOKENS, *RECOMPUTE_TOKENS]
        for token in tokens:
            if token in valid:
                continue
            head, colon, tail = token.partition(":")
            if colon and head.strip() == "recompute":
                raise ValueError(
                    f"fastckpt.Policy: policy {spec!r}: unknown codec {tail.strip()!r} in token {token!r}; "
                    f"'recompute:' takes one of {list(CODECS)}; valid tokens are {valid}"
                )
            raise ValueError(f"fastckpt.Policy: policy {spec!r}: unknown token {token!r}; valid tokens are {valid}")
        if len(set(tokens)) != len(tokens):
            raise ValueError(f"fastckpt.Policy: policy {spec!r}: a token is repeated")
        recompute_tokens = [t for t in tokens if t == "recompute" or t in RECOMPUTE_TOKENS]
        if len(recompute_tokens) > 1:
            raise ValueError(
                f"fastckpt.Policy: policy {spec!r}: {recompute_tokens} both ask for recompute; use one "
                "('recompute:<codec>' already means recompute)"
            )
        recompute_codec = (recompute_tokens[0].partition(":")[2] or None) if recompute_tokens else None
        codecs = [t for t in tokens if t in CODECS]
        if len(codecs) > 1:
            raise ValueError(f"fastckpt.Policy: policy {spec!r}: at most one codec of {list(CODECS)}, got {codecs}")
        if "save" in tokens and len(tokens) > 1:
            raise ValueError(
                f"fastckpt.Policy: policy {spec!r}: 'save' (plain storage) cannot be combined with other tokens"
            )
        return cls(
            recompute=bool(recompute_tokens),
            codec=codecs[0] if codecs else None,
            offload="offload" in tokens,
            recompute_codec=recompute_codec,
        )

    @property
    def is_stock(self) -> bool:
        """True for plain recompute, the behaviour of torch.utils.checkpoint."""
        return self.recompute and self.codec is None and not self.offload and self.recompute_codec is None

    @property
    def stores_inputs(self) -> bool:
        """True when a recompute policy keeps the segment's inputs through its codec or offload."""
        return self.recompute and (self.codec is not None or self.offload)

    def recomputed_storage(self) -> Policy | None:
        """The storage policy of the tensors a recomputation saves (None: kept plain, as stock does)."""
        if self.recompute_codec is None:
            return None
        return Policy(recompute=False, codec=self.recompute_codec, **self._recompute_codec_tuning())

    def _recompute_codec_tuning(self) -> dict:
        """The tuning that carries over to a policy whose only codec is the recompute codec."""
        return dict(
            group_size=self.group_size,
            stochastic_rounding=self.stochastic_rounding and self.recompute_codec in _INTEGER_CODECS,
            min_tensor_bytes=self.recompute_min_tensor_bytes,
            rule=self.rule,
        )

    def __str__(self) -> str:
        head = f"recompute:{self.recompute_codec}" if self.recompute_codec else "recompute"
        tokens = ([head] if self.recompute else []) + ([self.codec] if self.codec else [])
        tokens += ["offload"] if self.offload else []
        return "+".join(tokens) or "save"


RECOMPUTE = Policy()
_default_policy: contextvars.ContextVar[Policy] = contextvars.ContextVar("fastckpt_default_policy", default=RECOMPUTE)


def current_policy() -> Policy:
    """The policy used by calls that pass policy=None."""
    return _default_policy.get()


def resolve(policy: str | Policy | None) -> Policy:
    """The Policy a call runs with: its own argument, else the current default."""
    return current_policy() if policy is None else Policy.parse(policy)


@contextlib.contextmanager
def policy(spec: str | Policy) -> Iterator[Policy]:
    """Set the default policy for checkpoint calls made inside the block."""
    token = _default_policy.set(Policy.parse(spec))
    try:
        yield _default_policy.get()
    finally:
        _default_policy.reset(token)
