"""`fastckpt.track()`: per-segment bytes and times of what the storage engine kept for backward."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch


def nbytes(t: torch.Tensor) -> int:
    """Bytes of `t`'s elements. Not t.nbytes: that refuses the symbolic sizes of a compiled graph's fake values."""
    return t.numel() * t.element_size()


@dataclass
class SegmentRecord:
    """What one checkpointed call stored: bytes as autograd would have kept them, and as kept instead."""

    policy: str
    tensors: int = 0
    raw_bytes: int = 0  # bytes the saved tensors would occupy stored plainly
    raw_elements: int = 0
    device_bytes: int = 0  # bytes kept on the accelerator (or in CPU memory for CPU tensors)
    host_bytes: int = 0  # bytes offloaded to host memory
    pack_seconds: float = 0.0
    unpack_seconds: float = 0.0
    forward_seconds: float = 0.0  # wall time of the checkpointed forward, when a caller profiles it
    recompute_seconds: float = 0.0  # wall time of its recomputations in backward, likewise
    codecs: set[str] = field(default_factory=set)
    # Tensors kept as autograd would keep them, counted by reason ("small", "parameter", "float64", ...).
    kept_plain: dict[str, int] = field(default_factory=dict)

    @property
    def stored_bytes(self) -> int:
        return self.device_bytes + self.host_bytes

    # The one accounting path of every storage (eager segments, DeepSpeed's partitions):

    def count_plain(self, reason: str) -> None:
        """A saved tensor kept as autograd keeps it (Rule 3), for `reason`: no bytes of its own."""
        self.kept_plain[reason] = self.kept_plain.get(reason, 0) + 1

    def count_raw(self, t: torch.Tensor, elements: int | None = None) -> None:
        """`t` (or `elements` of its elements) as plain autograd would have kept it."""
        elements = t.numel() if elements is None else elements
        self.raw_bytes += elements * t.element_size()
        self.raw_elements += elements

    def count_kept(self, tensors: tuple[torch.Tensor, ...], on_host: bool = False) -> None:
        """What the storage keeps for one saved tensor instead: `tensors` on the device or on the host."""
        kept = sum(nbytes(x) for x in tensors)
        if on_host:
            self.host_bytes += kept
        else:
            self.device_bytes += kept

    @property
    def bits_per_element(self) -> float:
        """Stored bits per saved element (codec payloads, scales and offsets included)."""
        return 8 * self.stored_bytes / self.raw_elements if self.raw_elements else float("nan")


@dataclass
class Report:
    """All segments recorded inside one `track()` block, in call order."""

    segments: list[SegmentRecord] = field(default_factory=list)

    def add(self, record: SegmentRecord) -> None:
        """Include `record` (once), whether the block saw its forward or only its backward."""
        if all(s is not record for s in self.segments):
            self.segments.append(record)

    @property
    def raw_bytes(self) -> int:
        return sum(s.raw_bytes for s in self.segments)

    @property
    def device_bytes(self) -> int:
        return sum(s.device_bytes for s in self.segments)

    @property
    def host_bytes(self) -> int:
        return sum(s.host_bytes for s in self.segments)

    @property
    def bits_per_element(self) -> float:
        """Stored bits per saved element over all segments."""
        elements = sum(s.raw_elements for s in self.segments)
        stored = sum(s.stored_bytes for s in self.segments)
        return 8 * stored / elements if elements else float("nan")

    def table(self) -> str:
        """A text table, one line per segment."""
        lines = [
            f"{'seg':>4} {'policy':<22}{'tensors':>8}{'raw MiB':>10}{'device MiB':>12}{'host MiB':>10}"
            f"{'pack ms':>9}{'unpack ms':>10}{'fwd ms':>9}{'recomp ms':>10}  kept plain"
        ]
        for index, s in enumerate(self.segments):
            lines.append(
                f"{index:>4} {s.policy:<22}{s.tensors:>8}{s.raw_bytes / 2**20:>10.2f}{s.device_bytes / 2**20:>12.2f}"
                f"{s.host_bytes / 2**20:>10.2f}{s.pack_seconds * 1e3:>9.2f}{s.unpack_seconds * 1e3:>10.2f}"
                f"{s.forward_seconds * 1e3:>9.2f}{s.recompute_seconds * 1e3:>10.2f}  "
                + " ".join(f"{reason}:{count}" for reason, count in sorted(s.kept_plain.items()))
            )
        return "\n".join(lines)


_current: contextvars.ContextVar[Report | None] = contextvars.ContextVar("fastckpt_track_report", default=None)


def register(record: SegmentRecord) -> None:
    """Add `record` to the innermost active `track()` report (once), if there is one. A storage calls it when
    it is made and again when backward first reads it: a track() block around the backward only sees that."""
    report = _current.get()
    if report is not None:
        report.add(record)


@contextlib.contextmanager
def track() -> Iterator[Report]:
    """Record, per checkpointed segment, raw/stored/host bytes and pack/unpack times."""
    report = Report()
    token = _current.set(report)
    try:
        yield report
    finally:
        _current.reset(token)
