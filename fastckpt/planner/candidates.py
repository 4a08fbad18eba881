"""The planner's candidate grammar: what a candidate string means, parsed once into a Candidate.

'none'                        the segment left as it is (plain autograd)
'<policy>'                    fastckpt.wrap(segment, policy): 'recompute', 'int8', 'recompute:int8+int8', ...
'selective:<spec>'            fastckpt.hybrid.selective(store=...): matmul/attention outputs kept, the rest
                              recomputed; <spec> a storage policy ('int8': kept outputs and inputs int8, the
                              segment under 'recompute+int8') or a recompute policy with a codec
                              ('recompute:int8+int8': the segment under it, the outputs through its codec)
'selective-attention:<spec>'  the same keeping only the fused attention and dropout's masks
                              (fastckpt.hybrid.keep_attention)
'batch<N>:<inner>'            fastckpt.tiled(segment, N, dim=0, ...): the batch in N >= 2 slices, each run
                              as <inner> (a policy or a selective candidate)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field

from torch import nn

from fastckpt import hybrid, tiling
from fastckpt.api import wrap
from fastckpt.policies import Policy, error_reason

NONE = "none"  # the candidate that leaves a segment as it is (plain autograd, no checkpoint)
REFERENCE = "recompute"  # stock checkpointing: what "N%" budgets are relative to
# Whole-segment policies: the segment left as it is, recomputed, stored through a codec, or both.
POLICY_CANDIDATES = (NONE, "recompute", "recompute+int8", "int8", "int4", "recompute:int8+int8", "recompute:int4+int4")
BATCH_PREFIX = "batch"
# Selective candidates are named as hybrid labels their kept outputs: 'selective:int8', 'selective-attention:int8'.
SELECTIVE_PREFIXES = (hybrid.PREFIX, hybrid.ATTENTION_PREFIX)

# The fused attention (and dropout's masks) kept int8, and the forms a batch slice runs (those too).
ATTENTION_CANDIDATES = ("selective-attention:int8", "selective-attention:recompute:int8+int8")
_SLICED = ("int8", "recompute", "recompute+int8", "recompute:int8+int8")
DEFAULT_BATCH_SLICES = (2,)
# The segment's inputs kept in host memory (pinned, prefetched a segment ahead in the backward on CUDA), as they
# are or int8. Not among the defaults: they spend host memory, which no budget counts (plan(offload=True)).
OFFLOAD_CANDIDATES = ("recompute+offload", "recompute+int8+offload")


@dataclass(frozen=True)
class Candidate:
    """One parsed candidate: how a segment runs. Equal candidates have equal (canonical) names.

    policy: the checkpoint policy of the segment (of each batch slice); None for 'none'.
    selective: the context_fn of a selective candidate (fastckpt.hybrid), else None.
    batch_slices: how many slices of its batch the segment runs on (1: the whole batch).
    """

    name: str
    policy: Policy | None = field(default=None, compare=False)
    selective: hybrid.Selective | None = field(default=None, compare=False)
    batch_slices: int = field(default=1, compare=False)

    def __str__(self) -> str:
        return self.name

    def wrap(self, module: nn.Module) -> nn.Module:
        """`module` as this candidate runs it: itself ('none'), or wrapped by fastckpt."""
        if self.policy is None:
            return module
        if self.batch_slices > 1:
            return tiling.tiled(module, self.batch_slices, dim=0, policy=self.policy, context_fn=self.selective)
        if self.selective is not None:
            return hybrid.wrap(module, self.selective, self.policy)
        return wrap(module, self.policy)


def parse_candidate(candidate: str | Policy | Candidate | None) -> Candidate:
    """A candidate string (see the module's grammar), a Policy or None ('none') as a Candidate; ValueError or
    TypeError naming what is wrong."""
    if isinstance(candidate, Candidate):
        return candidate
    if candidate is None or candidate == NONE:
        return Candidate(NONE)
    if isinstance(candidate, str):
        special = _selective(candidate) or _batch(candidate)
        if special is not None:
            return special
    policy = Policy.parse(candidate)
    if not isinstance(candidate, str):
        policy = Policy.parse(str(policy))  # planned by its name: a Policy's tuning beyond its string is dropped
    return Candidate(str(policy), policy)


def parse_candidates(candidates: Iterable[str | Policy | None] | None, offload: bool = False) -> list[Candidate]:
    """plan()'s `candidates` parsed, each once (default: DEFAULT_CANDIDATES), with errors naming the bad one;
    `offload` adds the OFFLOAD_CANDIDATES not among them."""
    if not isinstance(offload, bool):
        raise TypeError(f"fastckpt.plan: `offload` must be True or False, got {offload!r}")
    parsed = [parse_candidate(name) for name in DEFAULT_CANDIDATES] if candidates is None else _named(candidates)
    return parsed + [c for c in map(parse_candidate, OFFLOAD_CANDIDATES if offload else ()) if c not in parsed]


def _named(candidates: Iterable[str | Policy | None]) -> list[Candidate]:
    """The candidates a user named, parsed."""
    if isinstance(candidates, (str, Policy)):
        raise TypeError("fastckpt.plan: `candidates` must be a list of policies, e.g. ['none', 'recompute', 'int8']")
    parsed: list[Candidate] = []
    for candidate in candidates:
        try:
            one = parse_candidate(candidate)
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"fastckpt.plan: candidate {candidate!r}: {error_reason(error)} (or '{NONE}' for no checkpoint, "
                f"'{hybrid.PREFIX}<codec>' or '{hybrid.ATTENTION_PREFIX}<codec>' for selective checkpointing, "
                f"'{BATCH_PREFIX}<N>:<policy>' for batch slices)"
            ) from None
        if isinstance(candidate, Policy) and candidate.rule is not None:
            raise ValueError(
                f"fastckpt.plan: candidate {candidate!r} has a per-tensor rule; the planner takes policy strings"
            )
        if one in parsed:
            raise ValueError(f"fastckpt.plan: candidate {candidate!r} is listed twice (as {one.name!r})")
        parsed.append(one)
    if not parsed:
        raise ValueError("fastckpt.plan: `candidates` is empty")
    return parsed


def extended_candidates(batch_slices: Iterable[int] = (), offload: bool = False) -> list[str]:
    """POLICY_CANDIDATES, the fused attention (and dropout's masks) kept instead of recomputed
    ('selective-attention:...', hybrid.keep_attention), for each N in `batch_slices` the segment on its
    batch in N slices ('batch<N>:...': only for segments that treat every sample alone) and, with `offload`,
    OFFLOAD_CANDIDATES. DEFAULT_CANDIDATES is extended_candidates(DEFAULT_BATCH_SLICES)."""
    if not isinstance(offload, bool):
        raise TypeError(f"fastckpt.extended_candidates: `offload` must be True or False, got {offload!r}")
    names = [*POLICY_CANDIDATES, *ATTENTION_CANDIDATES, *(OFFLOAD_CANDIDATES if offload else ())]
    for count in batch_slices:
        if not (isinstance(count, int) and not isinstance(count, bool) and count >= 2):
            raise ValueError(
                f"fastckpt.extended_candidates: each batch slice count must be an integer >= 2, got {count!r}"
            )
        names += [f"{BATCH_PREFIX}{count}:{form}" for form in (*_SLICED, *ATTENTION_CANDIDATES)]
    return names


# What plan() measures by default: every form above with batches in two slices. measure() leaves out, without a
# warning, those that are the same as another on the model or that its checks refuse (checks.probe).
DEFAULT_CANDIDATES = tuple(extended_candidates(DEFAULT_BATCH_SLICES))


def _selective(name: str) -> Candidate | None:
    """'selective:<spec>' or 'selective-attention:<spec>' as a Candidate; None for any other string."""
    text = name.strip()
    for prefix, build in ((hybrid.PREFIX, lambda store: hybrid.Selective(store=store)),
                          (hybrid.ATTENTION_PREFIX, hybrid.keep_attention)):  # fmt: skip
        if not text.startswith(prefix):
            continue
        spec_text = text[len(prefix) :].strip()
        if not spec_text:
            raise ValueError(f"{name!r}: name a storage policy after {prefix!r}, e.g. '{prefix}int8'")
        spec = Policy.parse(spec_text)
        if not spec.recompute:
            # The short form: 'selective:int8' keeps its outputs int8 and runs under 'recompute+int8'.
            selective = build(spec)
            return Candidate(str(selective), dataclasses.replace(spec, recompute=True), selective)
        if spec.codec is None:
            raise ValueError(
                f"{name!r}: a recompute policy after {prefix!r} needs a codec for the kept outputs, e.g. "
                f"'{prefix}recompute:int8+int8'"
            )
        selective = build(dataclasses.replace(spec, recompute=False, recompute_codec=None))
        return Candidate(_selective_name(selective, spec), spec, selective)
    return None


def _selective_name(selective: hybrid.Selective, policy: Policy) -> str:
    if policy == dataclasses.replace(selective.store, recompute=True):
        return str(selective)  # the short form names it
    return f"{selective.prefix}{policy}"


def _batch(name: str) -> Candidate | None:
    """'batch<N>:<policy or selective candidate>' as a Candidate; None for any other string."""
    head, colon, inner = name.strip().partition(":")
    if not (colon and head.startswith(BATCH_PREFIX)):
        return None
    count = head[len(BATCH_PREFIX) :].strip()
    if not (count.isdigit() and int(count) >= 2):
        raise ValueError(
            f"{name!r}: write the number of batch slices (>= 2) after {BATCH_PREFIX!r}, e.g. 'batch2:recompute'"
        )
    slices = int(count)
    selective = _selective(inner)
    if selective is not None:
        return Candidate(f"{BATCH_PREFIX}{slices}:{selective.name}", selective.policy, selective.selective, slices)
    policy = Policy.parse(inner.strip())
    return Candidate(f"{BATCH_PREFIX}{slices}:{policy}", policy, batch_slices=slices)
