"""`--compare DIR`: each row of this run's tables against the same row of an earlier results folder.

Every CSV this run wrote is matched by file name with one in DIR; rows are matched by their key columns
(workload, config or policy, and the shape columns when present); for each measured column (peak memory,
step time, gradient error) the table prints new / old. A row or file found on one side only is listed, so a
renamed configuration is seen, not silently dropped.
"""

from __future__ import annotations

import csv
import math
import os

KEY_COLUMNS = ("workload", "config", "policy", "axis", "layers", "tokens", "op", "size_MB", "mode")
# The measured columns worth a ratio, in print order (those a file has).
MEASURED = ("peak_MiB", "ms_per_step", "ms", "seconds", "grad_rel_l2", "final_train_loss", "gbps", "eta")


def _read(path: str) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _number(text: str | None) -> float | None:
    try:
        value = float(text) if text not in (None, "") else None
    except ValueError:
        return None
    return None if value is None or math.isnan(value) else value


def _key(row: dict[str, str], columns: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(row[c] for c in columns)


def compare_files(new_path: str, old_path: str) -> list[str]:
    """Lines comparing one CSV with its earlier version."""
    new, old = _read(new_path), _read(old_path)
    if not new:
        return []
    columns = tuple(c for c in KEY_COLUMNS if c in new[0])
    measured = [c for c in MEASURED if c in new[0] and (not old or c in old[0])]
    if not columns or not measured:
        return []
    earlier = {_key(row, columns): row for row in old if all(c in row for c in columns)}
    lines = [f"{'/'.join(columns):<56}" + "".join(f"{c + ' new/old':>22}" for c in measured)]
    for row in new:
        key = _key(row, columns)
        before = earlier.pop(key, None)
        name = " / ".join(key)
        if before is None:
            lines.append(f"{name:<56}(new row)")
            continue
        cells = []
        for column in measured:
            a, b = _number(row.get(column)), _number(before.get(column))
            cells.append(f"{a / b:>22.3f}" if a is not None and b else f"{'':>22}")
        lines.append(f"{name:<56}" + "".join(cells))
    lines += [f"{' / '.join(key):<56}(only in the earlier run)" for key in earlier]
    return lines


def compare(out: str, earlier: str) -> None:
    """Print, per CSV of `out` that `earlier` also has, each row's measured columns as new / old."""
    if not os.path.isdir(earlier):
        raise SystemExit(f"--compare {earlier!r}: not a results folder")
    names = sorted(n for n in os.listdir(out) if n.endswith(".csv"))
    missing = [n for n in names if not os.path.exists(os.path.join(earlier, n))]
    print(f"\n== compared with {earlier}")
    for name in names:
        if name in missing:
            continue
        lines = compare_files(os.path.join(out, name), os.path.join(earlier, name))
        if lines:
            print(f"\n{name}")
            print("\n".join(lines))
    if missing:
        print(f"\nnot in {earlier}: {', '.join(missing)}")
