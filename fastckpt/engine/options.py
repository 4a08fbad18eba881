"""The keyword options of one checkpoint call, said once (torch.utils.checkpoint's set)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from torch.utils.checkpoint import noop_context_fn


@dataclass(frozen=True)
class CheckpointOptions:
    """torch.utils.checkpoint.checkpoint's keywords, with its defaults (but use_reentrant=None: non-reentrant)."""

    use_reentrant: bool | None = None
    preserve_rng_state: bool = True
    context_fn: Callable[[], tuple[Any, Any]] = noop_context_fn
    determinism_check: str = "default"
    debug: bool = False
    early_stop: bool = True
    respect_saved_tensors_hooks: bool | None = None

    @property
    def has_recompute_only_options(self) -> bool:
        """True when an option that acts only on the non-reentrant recomputation is set."""
        return (
            self.context_fn is not noop_context_fn
            or self.debug is not False
            or self.respect_saved_tensors_hooks is not None
        )

    def given_torch_keywords(self) -> dict[str, Any]:
        """The options other than use_reentrant that differ from torch's defaults, as keywords."""
        return {name: getattr(self, name) for name in _KEYWORDS if getattr(self, name) is not getattr(_DEFAULT, name)}


_DEFAULT = CheckpointOptions()
_KEYWORDS = tuple(f.name for f in fields(CheckpointOptions) if f.name != "use_reentrant")
