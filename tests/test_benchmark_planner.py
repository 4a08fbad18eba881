"""benchmarks/planner.py on a tiny long-context stack: every row is produced and the plans fit their budgets."""

from __future__ import annotations

import math

import torch

from benchmarks import planner as bench
from benchmarks.workloads import StackShape


def test_rows_and_targets_on_a_tiny_stack():
    workload = bench.long_context(StackShape(layers=3, dim=32, heads=2, batch=1, seq=256))
    candidates = ["none", "recompute", "int8", "recompute:int8+int8"]
    rows, measurements = bench.run_workload(workload, torch.device("cpu"), candidates, repeats=1, rounds=1)
    assert [r["config"] for r in rows] == ["plain", "stock checkpoint", "plan 100%", "plan 70%", "plan 50%", "plan 30%"]
    by_name = {r["config"]: r for r in rows}
    assert by_name["plain"]["grad_rel_l2_max"] == 0 and by_name["stock checkpoint"]["grad_rel_l2_max"] == 0
    assert by_name["stock checkpoint"]["peak_x_stock"] == 1 and by_name["plain"]["peak_x_stock"] > 1
    full = by_name["plan 100%"]
    assert full["peak_x_budget"] <= 1.01 and abs(full["prediction_error"]) <= 0.10
    for r in rows[2:]:
        if math.isnan(r["ms"]):  # infeasible: says what is feasible
            assert r["policies"].startswith("infeasible: smallest feasible")
        else:
            assert r["peak_x_budget"] <= 1.01 and r["grad_rel_l2_max"] < 0.05
    assert set(measurements.by_policy) == set(candidates)
    assert any(line.startswith("100%: time") for line in bench._targets(rows))
    assert bench._summary(["int8", "int8", "recompute", "int8"]) == "3 x int8, recompute"
