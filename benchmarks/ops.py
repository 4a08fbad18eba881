"""Kernel efficiency of fastckpt's ops: eta = compulsory bytes / median time / memcpy bandwidth.

Compulsory bytes are what an op must read plus what it must write (input, codes, scales, output).
memcpy bandwidth is `dst.copy_(src)` on buffers of the same size, on the same device with the same
thread count, counted as read + write, and timed in blocks of calls alternating with the op's.
Sizes are those of the uncompressed tensor (quantize's input, dequantize's output).

    python -m benchmarks ops [--device cpu|cuda] [--out DIR] [--quick]
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from benchmarks.harness import write_csv
from fastckpt.ops import (
    DEFAULT_GROUP_SIZE,
    FP8_DEFAULT_GROUP_SIZE,
    dequantize_fp8_per_group,
    dequantize_per_group,
    pack_bits,
    quantize_fp8_per_group,
    quantize_per_group,
    unpack_bits,
)

SIZES_MB = (1, 8, 32, 64, 256)
QUICK_SIZES_MB = (1, 8, 32)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
WARMUP = 4  # untimed calls per block: steady state takes ~4 on the CPU machine (allocator, caches)
TIMED_PER_BLOCK = 2
MIN_SAMPLES, MAX_SAMPLES, SECONDS_PER_CASE = 6, 40, 0.3
ETA_TARGET = {"cpu": (0.5, 8), "cuda": (0.8, 32)}  # (eta, from this size in MB): the targets in BENCHMARKS.md
COLUMNS = ("op", "dtype", "size_mb", "time_ms", "gb_s", "eta", "memcpy_gb_s", "device", "threads")


@dataclass
class Case:
    op: str
    dtype: str
    run: Callable[[], object]
    bytes_moved: int


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _cases(x: torch.Tensor) -> list[Case]:
    """Every op on x (quantize/pack) or on x's stored form (dequantize/unpack)."""
    dtype = str(x.dtype).removeprefix("torch.")
    cases = []
    for bits, group in DEFAULT_GROUP_SIZE.items():
        stored = quantize_per_group(x, bits, group)
        moved = _nbytes(x, *stored)
        cases.append(Case(f"quantize_int{bits}", dtype, lambda b=bits, g=group: quantize_per_group(x, b, g), moved))
        cases.append(
            Case(
                f"dequantize_int{bits}",
                dtype,
                lambda s=stored, b=bits, g=group: dequantize_per_group(*s, b, g, x.dtype, x.shape),
                moved,
            )
        )
    stored = quantize_fp8_per_group(x, FP8_DEFAULT_GROUP_SIZE)
    moved = _nbytes(x, *stored)
    cases.append(Case("quantize_fp8", dtype, lambda: quantize_fp8_per_group(x, FP8_DEFAULT_GROUP_SIZE), moved))
    cases.append(
        Case(
            "dequantize_fp8",
            dtype,
            lambda: dequantize_fp8_per_group(*stored, FP8_DEFAULT_GROUP_SIZE, x.dtype, x.shape),
            moved,
        )
    )
    packed = pack_bits(x)
    cases.append(Case("pack_bits", dtype, lambda: pack_bits(x), _nbytes(x, packed)))
    if x.dtype == torch.float32:
        # bool masks (dropout's) of the row's size in bytes: unpack_bits always writes bool
        mask = x.new_empty(x.numel() * x.element_size(), dtype=torch.bool).bernoulli_(0.5)
        bits = pack_bits(mask)
        cases.append(Case("pack_bits", "bool", lambda: pack_bits(mask), _nbytes(mask, bits)))
        cases.append(Case("unpack_bits", "bool", lambda: unpack_bits(bits, mask.shape), _nbytes(bits, mask)))
    return cases


def _special_cases(x: torch.Tensor) -> list[Case]:
    """quantize/dequantize int8 and fp8 of x with -inf at every 7th element, so that every group holds
    non-finite values (an additive attention mask's padding): the cost of carrying them, against the same
    ops on finite x, whose groups find none in the min/max pass they run anyway."""
    masked = x.clone()
    masked.view(-1)[::7] = float("-inf")
    label = f"{str(x.dtype).removeprefix('torch.')}-inf"
    group = DEFAULT_GROUP_SIZE[8]
    stored = quantize_per_group(masked, 8, group)
    fp8 = quantize_fp8_per_group(masked, FP8_DEFAULT_GROUP_SIZE)
    return [
        Case("quantize_int8", label, lambda: quantize_per_group(masked, 8, group), _nbytes(masked, *stored)),
        Case(
            "dequantize_int8",
            label,
            lambda: dequantize_per_group(*stored, 8, group, x.dtype, x.shape),
            _nbytes(masked, *stored),
        ),
        Case(
            "quantize_fp8", label, lambda: quantize_fp8_per_group(masked, FP8_DEFAULT_GROUP_SIZE), _nbytes(masked, *fp8)
        ),
        Case(
            "dequantize_fp8",
            label,
            lambda: dequantize_fp8_per_group(*fp8, FP8_DEFAULT_GROUP_SIZE, x.dtype, x.shape),
            _nbytes(masked, *fp8),
        ),
    ]


def _special_summary(rows: list[dict]) -> str:
    """Per op: the extra milliseconds per GB of input when every group holds -inf, at the largest size."""
    size = max(r["size_mb"] for r in rows)
    timed = {(r["op"], r["dtype"]): r["time_ms"] for r in rows if r["size_mb"] == size}
    parts = []
    for (op, dtype), special_ms in sorted(timed.items()):
        if dtype.endswith("-inf") and (op, dtype.removesuffix("-inf")) in timed:
            extra = (special_ms - timed[op, dtype.removesuffix("-inf")]) / (size / 1024)
            parts.append(f"{op} {dtype.removesuffix('-inf')} {extra:+.1f} ms/GB")
    return f"non-finite groups ({size} MB, every group holding -inf vs finite): " + ", ".join(parts)


def _seconds(fn: Callable[[], object], cuda: bool) -> float:
    """Wall time of one call; CUDA calls are timed with events on the current stream."""
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


def _block(fn: Callable[[], object], cuda: bool) -> list[float]:
    """TIMED_PER_BLOCK timed calls of fn after WARMUP untimed ones (steady state: allocator, caches)."""
    for _ in range(WARMUP):
        fn()
    return [_seconds(fn, cuda) for _ in range(TIMED_PER_BLOCK)]


def _with_baseline(
    fn: Callable[[], object], baseline: Callable[[], object], device: torch.device
) -> tuple[float, float]:
    """Median seconds of fn and of baseline, from blocks of calls that alternate between the two.

    This shared machine's memory bandwidth switches between states (47 and 85 GB/s at 256 MB) every
    few seconds; alternating blocks of a few calls keeps both medians in the same states, so their
    ratio (eta) holds still. Single calls are not alternated: each would evict the other's data and
    time both with cold caches.
    """
    cuda = device.type == "cuda"
    ops: list[float] = []
    copies: list[float] = []
    while len(ops) < MIN_SAMPLES or (len(ops) < MAX_SAMPLES and sum(ops) + sum(copies) < SECONDS_PER_CASE):
        copies += _block(baseline, cuda)
        ops += _block(fn, cuda)
    return statistics.median(ops), statistics.median(copies)


def _memcpy(size_bytes: int, device: torch.device) -> Callable[[], object]:
    """dst.copy_(src) on size_bytes buffers: the baseline, moving 2 * size_bytes."""
    src = torch.empty(size_bytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def _reuse_freed_host_memory() -> bool:
    """Make glibc keep freed blocks for reuse instead of unmapping them (True when it applied).

    Every op allocates its outputs; fresh mappings page-fault on first touch at a fraction of memcpy
    speed, which would time the kernel's allocator rather than the kernel. Reusing freed memory is what
    torch's CUDA caching allocator does on the GPU; the memcpy baseline writes into a reused buffer too.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, 1 << 30)) and bool(libc.mallopt(m_trim_threshold, 1 << 30))


def _format_table(rows: list[dict]) -> str:
    header = f"{'op':<16}{'dtype':<14}{'size MB':>8}{'time ms':>10}{'GB/s':>9}{'memcpy':>9}{'eta':>7}"
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['op']:<16}{r['dtype']:<14}{r['size_mb']:>8}{r['time_ms']:>10.3f}{r['gb_s']:>9.1f}"
            f"{r['memcpy_gb_s']:>9.1f}{r['eta']:>7.2f}"
        )
    return "\n".join(lines)


def main(device: str = "cpu", out: str | None = None, quick: bool = False) -> list[dict]:
    """Measure every op at every size and dtype; print the table, write a CSV to `out` when given."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        dev = torch.device("cuda", torch.cuda.current_device())
    tuned = dev.type == "cpu" and _reuse_freed_host_memory()
    threads = torch.get_num_threads()
    print(f"device {dev}, {threads} threads" + (", glibc malloc reusing freed memory" if tuned else ""))
    rows: list[dict] = []
    for size_mb in QUICK_SIZES_MB if quick else SIZES_MB:
        size_bytes = size_mb << 20
        memcpy = _memcpy(size_bytes, dev)
        for dtype in DTYPES:
            x = torch.randn(size_bytes // torch.tensor([], dtype=dtype).element_size(), device=dev).to(dtype)
            cases = _cases(x) + (_special_cases(x) if dtype == torch.bfloat16 else [])
            for case in cases:
                seconds, copy_seconds = _with_baseline(case.run, memcpy, dev)
                rate, copy_rate = case.bytes_moved / seconds, 2 * size_bytes / copy_seconds
                rows.append(
                    dict(
                        op=case.op,
                        dtype=case.dtype,
                        size_mb=size_mb,
                        time_ms=seconds * 1e3,
                        gb_s=rate / 1e9,
                        eta=rate / copy_rate,
                        memcpy_gb_s=copy_rate / 1e9,
                        device=str(dev),
                        threads=threads,
                    )
                )
            del x
        del memcpy
    print(_format_table(rows))
    print(_special_summary(rows))
    eta, from_mb = ETA_TARGET.get(dev.type, ETA_TARGET["cuda"])
    judged = [r for r in rows if r["size_mb"] >= from_mb]
    met = sum(r["eta"] >= eta for r in judged)
    print(f"target eta >= {eta} from {from_mb} MB: met by {met} of {len(judged)} rows")
    if out:
        write_csv(rows, out, f"ops_{dev.type}.csv")
    return rows
