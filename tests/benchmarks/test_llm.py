"""benchmarks/llm.py: the whole-step LLM section runs every row on tiny shapes and writes its tables and figure."""

from __future__ import annotations

import csv
import math

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from benchmarks import compare, llm  # noqa: E402


@pytest.mark.slow
def test_smoke_run_writes_every_row_and_the_scaling_figure(tmp_path):
    rows = llm.main(out=str(tmp_path), smoke=True)
    names = {row["config"] for row in rows if row["workload"] == "llama-lora"}
    assert {llm.PLAIN, llm.HF_GC, llm.PLAN, llm.BEST, "fastckpt recompute:int8+int8 + loss head"} <= names
    for row in rows:
        assert math.isfinite(row["peak_MiB"]) and row["peak_MiB"] > 0 and math.isfinite(row["grad_rel_l2"])
        if row["config"] == llm.HF_GC:
            assert row["peak_x_hf_gc"] == 1.0 and row["time_x_hf_gc"] == 1.0
    full = [row for row in rows if row["workload"] == "llama-full"]
    assert full and all("peak_less_grads_MiB" in row for row in full)
    assert llm.PLAN in {row["config"] for row in full}
    assert (tmp_path / "llm_scaling.png").stat().st_size > 0
    with open(tmp_path / "llm_scaling.csv") as f:
        points = list(csv.DictReader(f))
    assert {p["axis"] for p in points} == {"tokens", "layers"}
    # --compare against itself: every row present on both sides, each ratio 1.
    lines = compare.compare_files(str(tmp_path / "llm_lora.csv"), str(tmp_path / "llm_lora.csv"))
    assert len(lines) == 1 + len(names) and all("1.000" in line for line in lines[1:])


def test_relative_error_and_slope():
    assert llm.relative_error([torch.ones(4)], [torch.ones(4)]) == 0
    assert llm.relative_error([torch.zeros(4)], [torch.ones(4)]) == pytest.approx(1.0)
    assert llm._slope([1, 2, 3], [10, 20, 30]) == pytest.approx(10.0)


def test_a_cpu_without_native_bf16_is_warned_about():
    assert llm.slow_bf16_warning(1.5) is None
    assert "100x slower than fp32" in llm.slow_bf16_warning(100.0)
    assert llm.bf16_slowdown(size=64) > 0
