"""benchmarks/planner.py on a tiny long-context stack: every row is produced and the plans fit their budgets."""

from __future__ import annotations

import math

import torch

from benchmarks import planner as bench
from benchmarks.__main__ import main as bench_main
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
    assert [s.name for s in measurements.segments] == [f"blocks.{i}" for i in range(3)]
    assert any(line.startswith("100%: time") for line in bench._targets(rows))
    assert bench._summary(["int8", "int8", "recompute", "int8"]) == "3 x int8, recompute"


def test_sublayer_segments_are_each_blocks_attention_and_mlp():
    workload = bench.long_context(StackShape(layers=2, dim=32, heads=2, batch=1, seq=256), sublayers=True)
    rows, measurements = bench.run_workload(
        workload, torch.device("cpu"), ["recompute", "int8"], repeats=1, rounds=1, check_fn=bench.is_sublayer
    )
    assert [s.name for s in measurements.segments] == [f"sublayers.{i}" for i in range(4)]
    assert [s.module.part for s in measurements.segments] == ["attention", "mlp"] * 2
    by_name = {r["config"]: r for r in rows}
    assert by_name["stock checkpoint"]["grad_rel_l2_max"] == 0  # the halves compute what the blocks do
    assert by_name["plan 100%"]["peak_x_budget"] <= 1.01


def test_planner_section_of_python_m_benchmarks(tmp_path, capsys):
    rows = bench_main(["--smoke", "--workloads", "planner-all", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert [(r["workload"], r["config"]) for r in rows] == [
        (workload, config)
        for workload in ("long-context", "long-context sublayers", "long-context tiled", "gpt2")
        for config in ("plain", "stock checkpoint", "plan 100%", "plan 70%", "plan 50%", "plan 30%")
    ]
    assert "== planner: fastckpt.plan" in out and "target 100%: time" in out and "nan" not in out.lower()
    for r in rows:  # every budget either measured or said infeasible, with the smallest feasible one
        assert (r["ms"] > 0) != r["policies"].startswith("infeasible: smallest feasible"), r
    markdown = (tmp_path / "results.md").read_text()
    assert markdown.startswith("# fastckpt benchmark") and "## planner: fastckpt.plan" in markdown
    assert "| long-context | plan 50% |" in markdown and "- gpt2: target 100%: time" in markdown
    assert "nan" not in markdown.lower()
    assert (tmp_path / "planner_cpu.csv").exists()


def test_planner_section_follows_the_workloads_in_results_md(tmp_path, monkeypatch):
    from benchmarks import checkpoint
    from benchmarks.checkpoint import Config

    monkeypatch.setattr(checkpoint, "_reuse_freed_host_memory", lambda: False)
    monkeypatch.setattr(checkpoint, "configs", lambda device, workload=None: [Config("plain", None, None, "plain")])
    monkeypatch.setattr(bench, "main", lambda *args, **kwargs: calls.append((args, kwargs)) or [])
    calls: list = []
    bench_main(["--smoke", "--workloads", "gpt2,planner", "--out", str(tmp_path)])
    ((args, kwargs),) = calls
    assert kwargs == {"quick": False, "smoke": True, "results_md": str(tmp_path / "results.md"), "variants": False}
    assert (tmp_path / "results.md").read_text().startswith("# fastckpt benchmark")  # written before the planner
    calls.clear()
    bench_main(["--smoke", "--workloads", "planner-all", "--out", str(tmp_path / "all")])
    ((args, kwargs),) = calls
    assert kwargs["variants"] is True  # the sublayer and tiled stacks only when asked for


def test_the_default_planner_section_plans_the_long_context_stack(monkeypatch):
    ran = []
    monkeypatch.setattr(bench, "_print", lambda *args: None)
    monkeypatch.setattr(bench, "_targets", lambda rows: [])
    monkeypatch.setattr(bench, "run_workload", _recording(ran))
    bench.main(smoke=True)
    assert ran == ["long-context"]
    ran.clear()
    bench.main(smoke=True, variants=True)
    assert ran == ["long-context", "long-context sublayers", "long-context tiled", "gpt2"]


def _recording(ran: list) -> object:
    def run_workload(workload, *args, **kwargs):
        ran.append(workload.name)
        return [{"measure_s": 0.0}], None

    return run_workload
