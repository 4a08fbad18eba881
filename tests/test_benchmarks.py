"""The benchmark harness's own logic: a failing fastckpt configuration is reported and the others still
run; a failing baseline stops the benchmark; the ops timing returns one median per function."""

import pytest
import torch

from benchmarks.checkpoint import STOCK, Config, _runnable, configs
from benchmarks.harness import error_line, finish
from benchmarks.ops import _with_baseline
from benchmarks.workloads import StackShape, gpt2_input, gpt2_stack

TINY = StackShape(layers=1, dim=16, heads=2, batch=2, seq=8)


def tiny_workload():
    """As the checkpoint benchmark builds it (its input requires grad, as reentrant stock needs)."""
    return gpt2_stack(TINY, torch.device("cpu")), gpt2_input(TINY, torch.device("cpu")).requires_grad_(True)


def _planted_failure(block, x):
    raise RuntimeError("planted failure\nwith a second line")


def test_failing_configuration_is_reported_and_the_others_kept():
    blocks, x = tiny_workload()
    candidates = configs(torch.device("cpu"))[:4] + [Config("broken", _planted_failure, STOCK)]
    runnable, failed = _runnable(candidates, blocks, x)
    assert [c.name for c in runnable] == [c.name for c in candidates[:4]]
    assert failed == {"broken": "RuntimeError: planted failure"}


def test_failing_baseline_stops_the_benchmark():
    blocks, x = tiny_workload()
    with pytest.raises(RuntimeError, match="planted failure"):
        _runnable([Config("plain", _planted_failure, uses_fastckpt=False)], blocks, x)


def test_failures_are_printed_rows_written_then_exit(capsys, tmp_path):
    rows = [{"config": "plain", "ms": 1.0}]
    assert finish(rows, {}, 10, str(tmp_path), "ok.csv") is rows
    with pytest.raises(SystemExit, match="1 configuration\\(s\\) failed"):
        finish(rows, {"int4": error_line(ValueError("bad\nmore"))}, 10, str(tmp_path), "partial.csv")
    assert "int4      FAILED: ValueError: bad\n" in capsys.readouterr().out
    assert (tmp_path / "partial.csv").read_text().splitlines() == ["config,ms", "plain,1.0"]


def test_op_and_baseline_are_both_timed():
    calls = {"op": 0, "copy": 0}

    def op():
        calls["op"] += 1

    def copy():
        calls["copy"] += 1

    seconds, copy_seconds = _with_baseline(op, copy, torch.device("cpu"))
    assert seconds > 0 and copy_seconds > 0
    assert calls["op"] == calls["copy"] > 0  # the same number of blocks of each, alternating
