"""The prediction `fastckpt.fits` makes from its measured steps: each method's peak as a function of the length
(the highest of its phases' lines, carried to the model's depth), the longest length and largest batch each memory
size holds, and the report."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastckpt.planner.budgets import format_bytes

HF_GC = "HF GC"


@dataclass(frozen=True)
class Line:
    """Bytes = base + per_token x tokens (at one depth)."""

    base: float
    per_token: float

    def at(self, tokens: float) -> float:
        return self.base + self.per_token * tokens


@dataclass(frozen=True)
class Peak:
    """The step's peak at one depth as a function of the tokens: at each measured depth the highest of its phases'
    lines (each phase's peak, through its two measured lengths), carried linearly in the layers to `depth`.

    One line through the step's peaks would not do: which phase is highest changes with the length. Llama-3.2-1B
    LoRA (bf16, 3 layers) peaks in the second layer's recomputation at 2,048 and 4,096 tokens, whose one MLP tile
    and loss-head chunk do not grow, and in the last layer's at 16,384, which grows 1.5x faster: the line through
    the step's peaks predicted 16K 7.5% low, the phases' highest line to 0.1%."""

    depths: tuple[int, int]
    phases: tuple[tuple[Line, ...], tuple[Line, ...]]  # per measured depth, a line per phase
    depth: int

    def _carried(self, at: Callable[[tuple[Line, ...]], float]) -> float:
        (l1, l2), (one, two) = self.depths, (at(lines) for lines in self.phases)
        return one + (two - one) / (l2 - l1) * (self.depth - l1)

    def at(self, tokens: float) -> float:
        return self._carried(lambda lines: max(line.at(tokens) for line in lines))

    @property
    def per_token(self) -> float:
        """Bytes per token at long lengths (the steepest phase's)."""
        return self._carried(lambda lines: max(line.per_token for line in lines))

    def solve(self, total: float) -> int | None:
        """The most tokens whose bytes are at most `total` (None: unbounded, the peak does not grow)."""
        if self.per_token <= 0:
            return None if self.at(0) <= total else 0
        if self.at(0) > total:
            return 0
        low, high = 0, 1  # at(low) <= total < at(high): the peak grows with the tokens
        while self.at(high) <= total:
            low, high = high, 2 * high
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if self.at(middle) <= total else (low, middle)
        return low


def _peak(phases: dict[tuple[int, int], dict[str, int]], depth: int) -> Peak:
    """Peak from each phase's peak at (layers, tokens), measured at two depths and two lengths (a phase seen at
    only one of the lengths has no line and is left out)."""
    (l1, l2), (n1, n2) = sorted({k[0] for k in phases}), sorted({k[1] for k in phases})

    def lines(layers: int) -> tuple[Line, ...]:
        short, long = phases[(layers, n1)], phases[(layers, n2)]
        slopes = {key: (long[key] - short[key]) / (n2 - n1) for key in short.keys() & long.keys()}
        return tuple(Line(short[key] - slope * n1, slope) for key, slope in slopes.items())

    return Peak((l1, l2), (lines(l1), lines(l2)), depth)


@dataclass
class Method:
    """One way to train the model: its measured step peaks and what they predict at the model's depth."""

    name: str
    # (layers, tokens) -> the peak of each phase of the step above what was live before it (fits' `_phases`)
    phases: dict[tuple[int, int], dict[str, int]]
    depth: int  # the model's layers
    resident: int  # bytes live before the step at the model's depth (weights, optimizer state)
    optimizer_step: int  # bytes the optimizer's step holds at its peak (gradients and temporaries), 0 for LoRA
    host: dict[tuple[int, int], int] = dataclasses.field(default_factory=dict)  # offloaded bytes in host memory
    policy: str | None = None  # fastckpt's policy; None: HF GC

    @property
    def measured(self) -> dict[tuple[int, int], int]:
        """(layers, tokens) -> the step's peak: its highest phase's."""
        return {key: max(peaks.values()) for key, peaks in self.phases.items()}

    @property
    def lengths(self) -> tuple[int, int]:
        first, second = sorted({k[1] for k in self.phases})
        return first, second

    def peak(self) -> Peak:
        """The step's peak above what is live before it, at the model's depth, as a function of the tokens."""
        return _peak(self.phases, self.depth)

    def host_line(self) -> Peak | None:
        """The host memory the offloaded tensors take (an offload policy), as a function of the tokens; else None."""
        if not any(self.host.values()):
            return None
        return _peak({key: {"host": offloaded} for key, offloaded in self.host.items()}, self.depth)

    def longest(self, memory: int) -> int | None:
        """The most tokens whose device total fits `memory`: what is live before the step plus its peak, and plus
        the optimizer step's (0: none; None: the total does not grow with the tokens)."""
        if self.resident + self.optimizer_step > memory:
            return 0
        return self.peak().solve(memory - self.resident)

    def largest_batch(self, memory: int, length: int) -> int | None:
        """The most rows of `length` tokens that fit `memory` (their tokens counted as one row's)."""
        longest = self.longest(memory)
        return None if longest is None else longest // length


@dataclass
class Report:
    """What `what_fits` measured and predicted."""

    name: str
    description: str
    memories: list[int]
    methods: list[Method]
    batch_at: int | None
    measured_on: str
    compute: str
    layers: tuple[int, int]
    verified: dict[str, tuple[int, int, int]] = dataclasses.field(default_factory=dict)  # method -> (tokens,
    # measured, predicted) at the deeper measured depth
    unverified: dict[str, tuple[int, int, int]] = dataclasses.field(default_factory=dict)  # method -> (tokens,
    # predicted, the memory free here): the check would not fit this machine

    def rows(self) -> list[dict[str, Any]]:
        rows = []
        for method in self.methods:
            row: dict[str, Any] = {"method": method.name, "resident_MiB": method.resident / 2**20,
                                   "MiB_per_1k_tokens": method.peak().per_token * 1024 / 2**20}  # fmt: skip
            for memory in self.memories:
                row[f"longest_{format_bytes(memory)}"] = method.longest(memory)
                if self.batch_at:
                    row[f"batch_at_{self.batch_at}_{format_bytes(memory)}"] = method.largest_batch(
                        memory, self.batch_at
                    )
            rows.append(row)
        return rows

    def table(self) -> str:
        """The report as text: the model, what was measured where, one line per method, their ratio."""
        l1, l2 = self.layers
        measured = "; ".join(f"{m.name} at {m.lengths[0]:,} and {m.lengths[1]:,} tokens" for m in self.methods)
        lines = [f"{self.name}: {self.description}",
                 f"measured on {self.measured_on} in {self.compute} at {l1} and {l2} layers ({measured}), carried "
                 f"to {self.methods[0].depth} layers"]  # fmt: skip
        header = f"{'method':<34}{'live before':>13}{'per 1K tok':>12}"
        for memory in self.memories:
            header += f"{'longest in ' + format_bytes(memory):>24}"
            if self.batch_at:
                header += f"{'batch @' + format(self.batch_at, ',') + ' in ' + format_bytes(memory):>28}"
        lines.append(header)
        longest: dict[str, list[int | None]] = {}  # per method, per memory size
        for method in self.methods:
            line = (f"{method.name:<34}{format_bytes(method.resident):>13}"
                    f"{format_bytes(int(method.peak().per_token * 1024)):>12}")  # fmt: skip
            longest[method.name] = []
            for memory in self.memories:
                tokens = method.longest(memory)
                longest[method.name].append(tokens)
                line += f"{_tokens(tokens):>24}"
                if self.batch_at:
                    line += f"{_tokens(method.largest_batch(memory, self.batch_at), 'rows'):>28}"
            lines.append(line)
        for method in self.methods:
            host = method.host_line()
            if host is not None:
                at = ", ".join(f"{format_bytes(int(host.at(n)))} at {n:,} tokens" for n in longest[method.name] if n)
                lines.append(f"{method.name} offloads to host memory {format_bytes(int(host.per_token * 1024))} per "
                             f"1K tokens: {at or 'nothing fits'} (host memory, not the device's)")  # fmt: skip
        for method in self.methods:
            pairs = zip(self.memories, longest[method.name], longest.get(HF_GC, []), strict=False)
            ratios = [f"{ours / theirs:.1f}x in {format_bytes(memory)}" for memory, ours, theirs in pairs
                      if ours and theirs]  # fmt: skip
            if ratios and method.name != HF_GC:
                lines.append(f"longest sequence, {method.name} / {HF_GC}: {', '.join(ratios)}")
        for name, (tokens, measured, predicted) in self.verified.items():
            lines.append(f"verified: {name} at {self.layers[1]} layers x {tokens:,} tokens: step peak measured "
                         f"{format_bytes(measured)}, predicted {format_bytes(predicted)} "
                         f"({(predicted - measured) / measured:+.1%})")  # fmt: skip
        for name, (tokens, predicted, free) in self.unverified.items():
            lines.append(f"not verified: {name} at {self.layers[1]} layers x {tokens:,} tokens: predicted step peak "
                         f"{format_bytes(predicted)}, more than the {format_bytes(free)} free here")  # fmt: skip
        lines += _differences(self.measured_on, self.compute)
        return "\n".join(lines)


def _tokens(count: int | None, unit: str = "tokens") -> str:
    if count is None:
        return "unbounded"
    return "none fits" if count == 0 else f"{count:,} {unit}"


def _differences(measured_on: str, compute: str) -> list[str]:
    notes = []
    if measured_on.startswith("cpu"):
        notes.append(
            "measured on a CPU: on a GPU add the CUDA context and library workspaces (some hundreds of MiB) and the "
            "caching allocator's reserve; CUDA's flash / memory-efficient attention is linear in the length as "
            "here, an eager or math attention is not"
        )
    if compute == "fp32":
        notes.append("fp32 compute (bf16 is emulated on this CPU): activations are twice bf16 autocast's")
    return notes
