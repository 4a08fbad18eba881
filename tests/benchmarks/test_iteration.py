"""benchmarks/iteration.py: every row of the whole-iteration benchmark runs on a tiny Llama (--smoke), its ratios
are against the HF GC row with the same clipping, and its bytes are extrapolated to the depth on a line."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("transformers")

from benchmarks import iteration  # noqa: E402
from benchmarks.__main__ import main as bench_main  # noqa: E402


def test_smoke_run_measures_every_row(capsys, tmp_path):
    rows = bench_main(["iteration", "--smoke", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert [row["config"] for row in rows] == [config.name for config in iteration.CONFIGS]
    by_name = {row["config"]: row for row in rows}
    for config in iteration.CONFIGS:
        row = by_name[config.name]
        assert math.isfinite(row["total_MiB"]) and row["total_MiB"] > row["resident_MiB"] > 0
        reference = by_name[config.reference]
        assert row["total_x_hf_gc"] == pytest.approx(row["total_MiB"] / reference["total_MiB"])
    # stepped in the backward, the gradients are not all live at once: below the same policy stepped after it
    stepped = by_name[iteration.CONFIGS[4].name]
    assert by_name[iteration.CONFIGS[5].name]["resident_MiB"] < stepped["resident_MiB"]  # 8-bit state
    after = by_name[iteration.CONFIGS[2].name]
    assert stepped["above_MiB"] < after["above_MiB"]
    assert "CPU flags:" in out and (tmp_path / "iteration.csv").stat().st_size > 0


def test_the_extrapolation_to_the_models_depth_is_linear():
    """Each phase on its own line, the peak the highest at the depth: here the step's overtakes the forward's."""
    at = {1: iteration.Measured(10, {"forward": 100, "step": 40}, 1.0),
          2: iteration.Measured(14, {"forward": 110, "step": 70}, 1.5)}  # fmt: skip
    deep = iteration.extrapolated(at, 16)
    assert deep == iteration.Measured(70, {"forward": 250, "step": 490}, 1.5)  # seconds: the deeper depth's
    assert deep.peak == 490 and at[2].peak == 110
    assert iteration.extrapolated(at, 2) is at[2]
