"""What a benchmark run prints and writes: the environment header, tables with blanks for what does not
apply, the Pareto front of step time vs peak memory, and its plot (matplotlib, Agg backend)."""

from __future__ import annotations

import datetime
import importlib.metadata
import math
import os
import platform
import subprocess
import textwrap

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Table columns: (CSV key, header, format). A missing value (None or NaN) prints blank.
COLUMNS = [
    ("ms_per_step", "ms/step", ".1f"),
    ("x_plain", "x plain", ".3f"),
    ("x_stock", "x stock", ".3f"),
    ("peak_MiB", "peak MiB", ".1f"),
    ("peak_x_plain", "peak x plain", ".3f"),
    ("peak_x_stock", "peak x stock", ".3f"),
    ("bits_per_element", "bits/elem", ".2f"),
    ("grad_rel_l2", "grad relL2", ".1e"),
]
FAMILY_COLORS = {"plain": "#555555", "torch": "#1f77b4", "deepspeed": "#9467bd", "fastckpt": "#d62728"}
OTHER_COLOR = "#2ca02c"  # rows of any other family (e.g. a planner's)
# A row whose largest relative L2 parameter-gradient error vs plain exceeds this is left off the Pareto front
# (and drawn hollow): `python -m benchmarks train` trains to within 1% of plain at int4's ~0.09, not at
# int2's ~0.5.
GRAD_ERROR_LIMIT = 0.1


def missing(value: object) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def fmt(value: object, spec: str) -> str:
    if missing(value):
        return ""
    if spec.endswith("e") and value == 0:
        return "0"
    return format(value, spec)


def _git(*args: str) -> str | None:
    try:
        result = subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def commit() -> str:
    """The checkout's short commit, with '+changes' when tracked files differ from it; 'unknown' outside git."""
    head = _git("rev-parse", "--short", "HEAD")
    if head is None:
        return "unknown (not a git checkout)"
    return head + ("+changes" if _git("status", "--porcelain", "--untracked-files=no") else "")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def environment(device: torch.device) -> dict[str, str]:
    """What the numbers depend on, as printed at the top of a run and of results.md."""
    import fastckpt

    if device.type == "cuda":
        where = f"cuda ({torch.cuda.get_device_name(device)})"
    else:
        where = f"cpu ({_cpu_model()}, {os.cpu_count()} cores)"
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    cuda = torch.version.cuda or "none"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": where,
        "torch": f"{torch.__version__} (CUDA build {cuda}, GPU visible: {torch.cuda.is_available()})",
        "CPU threads": str(torch.get_num_threads()),
        "fastckpt": f"{fastckpt.__version__}, commit {commit()}",
        "peers": f"transformers {_version('transformers')}, deepspeed {_version('deepspeed')}",
        "load average": " ".join(f"{x:.2f}" for x in load) if load else "unknown",
    }


def too_lossy(row: dict) -> bool:
    return not missing(row.get("grad_rel_l2")) and row["grad_rel_l2"] > GRAD_ERROR_LIMIT


def pareto(rows: list[dict]) -> set[str]:
    """Names of the measured rows that no other row beats on both step time and peak memory (rows whose
    gradient error exceeds GRAD_ERROR_LIMIT neither belong to it nor push others off it)."""
    measured = [
        r for r in rows if not missing(r.get("ms_per_step")) and not missing(r.get("peak_MiB")) and not too_lossy(r)
    ]
    front = set()
    for r in measured:
        dominated = any(
            o["ms_per_step"] <= r["ms_per_step"]
            and o["peak_MiB"] <= r["peak_MiB"]
            and (o["ms_per_step"] < r["ms_per_step"] or o["peak_MiB"] < r["peak_MiB"])
            for o in measured
        )
        if not dominated:
            front.add(r["config"])
    return front


def text_table(rows: list[dict]) -> str:
    """The rows as an aligned text table; FAILED rows carry their error instead of numbers."""
    width = max(len("config"), *(len(r["config"]) + 2 for r in rows))
    header = f"{'config':<{width}}" + "".join(f"{title:>{max(len(title), 7) + 2}}" for _, title, _ in COLUMNS)
    lines = [header]
    front = pareto(rows)
    for r in rows:
        name = r["config"] + (" *" if r["config"] in front else "")
        if r.get("error"):
            lines.append(f"{name:<{width}}  FAILED: {r['error']}")
            continue
        lines.append(
            f"{name:<{width}}"
            + "".join(f"{fmt(r.get(key), spec):>{max(len(title), 7) + 2}}" for key, title, spec in COLUMNS)
        )
    return "\n".join(lines)


def markdown_table(rows: list[dict]) -> str:
    """The rows as a Markdown table (Pareto-front rows in bold)."""
    front = pareto(rows)
    lines = ["| config | " + " | ".join(title for _, title, _ in COLUMNS) + " |"]
    lines.append("|---|" + "---:|" * len(COLUMNS))
    for r in rows:
        name = f"**{r['config']}**" if r["config"] in front else r["config"]
        if r.get("error"):
            lines.append(f"| {name} | FAILED: {r['error']} |" + " |" * (len(COLUMNS) - 1))
            continue
        lines.append(f"| {name} | " + " | ".join(fmt(r.get(key), spec) for key, _, spec in COLUMNS) + " |")
    return "\n".join(lines)


def _label(row: dict) -> str:
    name = row["config"]
    return name.removeprefix("fastckpt ") if row.get("family") == "fastckpt" else name


def plot(rows: list[dict], title: str, subtitle: str, path: str) -> str:
    """Peak memory vs step time, one labelled point per measured configuration, the Pareto front drawn;
    saved as a PNG at `path`."""
    try:
        import matplotlib
    except ImportError:  # e.g. the GPU machine's image: the tables and CSVs still come out
        return "no PNG (matplotlib is not installed)"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in rows if not r.get("error") and not missing(r.get("ms_per_step"))]
    front = pareto(measured)
    fig, ax = plt.subplots(figsize=(9, 5.2), dpi=100)
    families = []
    for r in measured:
        color = FAMILY_COLORS.get(r.get("family"), OTHER_COLOR)
        on_front = r["config"] in front
        ax.scatter(
            r["ms_per_step"],
            r["peak_MiB"],
            s=46 if on_front else 30,
            facecolors="white" if too_lossy(r) else color,
            zorder=3,
            edgecolors="black" if on_front else color,
            linewidths=0.8 if on_front or too_lossy(r) else 0,
        )
        if r.get("family") not in families:
            families.append(r.get("family"))
    points = sorted((r["ms_per_step"], r["peak_MiB"]) for r in measured if r["config"] in front)
    if points:
        xs, ys = [], []
        for x, y in points:  # a staircase: each front point is the best memory up to the next one's time
            if xs:
                xs.append(x)
                ys.append(ys[-1])
            xs.append(x)
            ys.append(y)
        ax.plot(xs, ys, color="black", linewidth=1, linestyle="--", zorder=2, label="Pareto front")
    for family in families:
        ax.scatter([], [], color=FAMILY_COLORS.get(family, OTHER_COLOR), s=30, label=family)
    if any(too_lossy(r) for r in measured):
        ax.scatter([], [], facecolors="white", edgecolors="#555555", s=30, label=f"grad error > {GRAD_ERROR_LIMIT:g}")
    ax.set_xlabel("step time, ms (median of interleaved rounds)")
    ax.set_ylabel("peak memory of a step, MiB")
    ax.set_title("\n".join([*textwrap.wrap(title, 100), *textwrap.wrap(subtitle, 110)]), fontsize=8)
    ax.grid(True, linewidth=0.4, alpha=0.5)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)  # outside: no point hidden
    _pad_limits(ax, measured)
    _place_labels(fig, ax, measured)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _pad_limits(ax, rows: list[dict]) -> None:
    xs = [r["ms_per_step"] for r in rows]
    ys = [r["peak_MiB"] for r in rows]
    if not xs:
        return
    dx = (max(xs) - min(xs)) or max(xs) * 0.1 or 1
    ax.set_xlim(min(xs) - 0.08 * dx, max(xs) + 0.35 * dx)
    ax.set_ylim(0, max(ys) * 1.12)  # from zero: heights compare as ratios at a glance


def _place_labels(fig, ax, rows: list[dict]) -> None:
    """Label each point, trying offsets around it until the label overlaps no earlier label, no point
    and stays inside the axes (greedy; the last candidate is used if none is free)."""
    renderer = fig.canvas.get_renderer()
    taken = []  # display-space boxes of placed labels and of the points
    for r in rows:
        x, y = ax.transData.transform((r["ms_per_step"], r["peak_MiB"]))
        taken.append((x - 4, y - 4, x + 4, y + 4))
    axes_box = ax.get_window_extent(renderer)
    offsets = [
        (6, 3),
        (6, -11),
        (-6, 3),
        (-6, -11),
        (6, 12),
        (-6, 12),
        (6, -20),
        (-6, -20),
        (6, 21),
        (-6, 21),
        (6, -29),
        (-6, -29),
        (6, 30),
        (-6, 30),
        (6, -38),
        (-6, -38),
    ]
    for r in sorted(rows, key=lambda r: (r["ms_per_step"], r["peak_MiB"])):
        text = ax.annotate(
            _label(r),
            (r["ms_per_step"], r["peak_MiB"]),
            textcoords="offset points",
            xytext=offsets[0],
            fontsize=7,
            color=FAMILY_COLORS.get(r.get("family"), OTHER_COLOR),
        )
        for dx, dy in offsets:
            text.set_position((dx, dy))
            text.set_horizontalalignment("left" if dx > 0 else "right")
            box = text.get_window_extent(renderer)
            bounds = (box.x0, box.y0, box.x1, box.y1)
            inside = axes_box.x0 <= box.x0 and box.x1 <= axes_box.x1 and axes_box.y0 <= box.y0 and box.y1 <= axes_box.y1
            if inside and not any(_overlap(bounds, other) for other in taken):
                break
        if (dx, dy) != offsets[0]:  # moved away: a thin line back to the point
            ax.annotate(
                "",
                (r["ms_per_step"], r["peak_MiB"]),
                xytext=(dx, dy + 3),
                textcoords="offset points",
                arrowprops=dict(arrowstyle="-", color="#999999", linewidth=0.5),
            )
        taken.append(bounds)


def _overlap(a: tuple, b: tuple) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


MATRIX_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")  # what decides matmul speed in fp32 and bf16 on x86


def cpu_flags() -> list[str]:
    """The host's CPU flags of MATRIX_FLAGS (from /proc/cpuinfo; none where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []
    return [flag for flag in MATRIX_FLAGS if flag in flags]
