"""The benchmark harness's own logic: what `make bench` prints and writes (CSV, PNG, results.md, blanks
rather than nan, no profiler noise), a failing configuration reported while the others are measured,
clear errors for bad options, a history-independent CPU peak, and the ops timing."""

import csv
import math
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest
import torch

from benchmarks import checkpoint, report
from benchmarks import offload as offload_bench
from benchmarks.__main__ import main as bench_main
from benchmarks.__main__ import parse_args
from benchmarks.checkpoint import STOCK, Config, Skipped, configs, measure_workload, rows_of
from benchmarks.harness import (
    OtherProcesses,
    error_line,
    finish,
    is_profiler_noise,
    median_times,
    peak_bytes,
    quiet_profiler_logs,
)
from benchmarks.ops import _with_baseline
from benchmarks.workloads import WORKLOAD_NAMES, workloads
from tests.helpers import needs_in_graph_storage

CPU = torch.device("cpu")
ROOT = pathlib.Path(__file__).resolve().parents[2]
PROFILER_NOISE = ("USDT", "profiler_start", "profiler_stop", "gpuGetDeviceCount", "Memory block of unknown size")


@pytest.fixture(autouse=True)
def _leave_malloc_alone(monkeypatch):
    """The benchmark tunes glibc malloc for its own process; not for the test process."""
    monkeypatch.setattr(checkpoint, "_reuse_freed_host_memory", lambda: False)


def _planted_failure(function, *args):
    raise RuntimeError("planted failure\nwith a second line")


def _smoke(name: str = "gpt2"):
    return workloads(CPU, "smoke")[name]


def test_without_matplotlib_the_plot_is_skipped_not_fatal(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    note = report.plot([], "t", "s", str(tmp_path / "x.png"))
    assert "matplotlib is not installed" in note and not (tmp_path / "x.png").exists()


def _by_config(rows):
    return {r["config"]: r for r in rows}


# 1. A smoke run end to end: files written, a table with blanks, nothing from the profiler.


def test_smoke_run_writes_csv_png_and_markdown_without_profiler_noise(capfd, tmp_path):
    pytest.importorskip("matplotlib")  # the PNGs (the GPU image has none; CI does)
    rows = bench_main(["--smoke", "--workloads", "gpt2", "--out", str(tmp_path)])
    out, err = capfd.readouterr()
    for noise in PROFILER_NOISE:
        assert noise not in out + err, f"profiler noise {noise!r} in the output"
    assert "nan" not in out.lower()
    # The environment header, then the table of every configuration.
    assert f"torch: {torch.__version__}" in out and "fastckpt: " in out and "commit " in out
    assert "CPU threads: " in out
    names = [c.name for c in configs(CPU) if isinstance(c, Config)]
    assert [r["config"] for r in rows] == names
    table_lines = {line.split("  ")[0].rstrip(" *") for line in out.splitlines()}
    assert set(names) <= table_lines
    # The files: CSV (blanks, never nan), PNG, results.md.
    with open(tmp_path / "gpt2.csv") as f:
        written = list(csv.DictReader(f))
    assert [r["config"] for r in written] == names
    assert all("nan" not in value.lower() for r in written for value in r.values())
    plain = _by_config(written)["plain"]
    assert plain["x_plain"] == "" and plain["x_stock"] == "" and plain["bits_per_element"] == ""
    assert float(plain["ms_per_step"]) > 0 and float(plain["peak_MiB"]) > 0
    # int8 codes with their parameters (8.5 bits) and the dropout masks exact at 1 bit (two-valued) pull it lower
    assert 4 < float(_by_config(written)["fastckpt int8"]["bits_per_element"]) <= 8.75
    if "fastckpt selective:int8" in names:  # torch's SAC routes its saved outputs through the codec (2.14+)
        assert 4 < float(_by_config(written)["fastckpt selective:int8"]["bits_per_element"]) <= 8.75
    assert (tmp_path / "gpt2.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "gpt2.png").stat().st_size < 200_000
    markdown = (tmp_path / "results.md").read_text()
    assert "| fastckpt int4 |" in markdown or "| **fastckpt int4** |" in markdown
    assert "nan" not in markdown.lower()


def test_default_results_folder_is_timestamped_under_bench_results(monkeypatch, tmp_path):
    pytest.importorskip("matplotlib")  # the PNGs (the GPU image has none; CI does)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(checkpoint, "configs", lambda device, workload=None: [Config("plain", None, None, "plain")])
    bench_main(["--smoke", "--workloads", "seed-cnn"])
    (folder,) = (tmp_path / "bench-results").iterdir()
    assert sorted(os.listdir(folder)) == ["results.md", "seed-cnn.csv", "seed-cnn.png"]


# 2. Failures: a failing configuration is a FAILED row, every other one is still measured.


def test_failing_configuration_is_reported_and_the_others_kept():
    candidates = [c for c in configs(CPU) if isinstance(c, Config)][:4]
    candidates.append(Config("broken", _planted_failure, STOCK))
    results = measure_workload(_smoke(), CPU, candidates, warmup=0, rounds=2)
    by_name = {r.config.name: r for r in results}
    assert by_name["broken"].error == "RuntimeError: planted failure"
    for c in candidates[:4]:
        r = by_name[c.name]
        assert r.error is None and r.seconds > 0 and r.peak > 0 and r.grads, c.name
    rows = _by_config(rows_of(_smoke(), results))
    assert rows["broken"]["ms_per_step"] is None and rows["broken"]["pareto"] is None
    assert rows["torch selective"]["x_stock"] > 0


def test_failure_after_the_trial_step_is_isolated_too():
    calls = {"n": 0}

    def flaky(function, *args):
        calls["n"] += 1
        if calls["n"] > 1:  # the trial step passes, a timed round fails
            raise ValueError("failed in round 2")
        return function(*args)

    candidates = [Config("plain", None, None, "plain"), Config("flaky", flaky, STOCK)]
    results = {r.config.name: r for r in measure_workload(_smoke(), CPU, candidates, warmup=0, rounds=3)}
    assert results["flaky"].error == "ValueError: failed in round 2"
    assert results["plain"].error is None and results["plain"].seconds > 0


def test_failed_row_in_table_csv_and_exit_status(monkeypatch, tmp_path, capsys):
    pytest.importorskip("matplotlib")  # the PNGs (the GPU image has none; CI does)
    monkeypatch.setattr(checkpoint, "EXTRA_ROWS", [lambda workload, device: [Config("broken", _planted_failure)]])
    with pytest.raises(SystemExit, match="1 configuration\\(s\\) failed"):
        bench_main(["--smoke", "--workloads", "gpt2", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert re.search(r"^broken +FAILED: RuntimeError: planted failure$", out, re.M)
    with open(tmp_path / "gpt2.csv") as f:
        rows = _by_config(csv.DictReader(f))
    assert rows["broken"]["error"] == "RuntimeError: planted failure" and rows["broken"]["ms_per_step"] == ""
    assert float(rows["fastckpt int8"]["ms_per_step"]) > 0  # the others were measured and written
    assert (tmp_path / "gpt2.png").exists()


def test_median_times_drops_a_failing_step_and_keeps_the_others():
    state = {"n": 0}

    def fails_second_time():
        state["n"] += 1
        if state["n"] == 2:
            raise KeyError("second")

    ticks = []
    times, failed = median_times({"ok": lambda: None, "bad": fails_second_time}, CPU, 1, 3, lambda: ticks.append(1))
    assert set(times) == {"ok"} and failed == {"bad": "KeyError: 'second'"}
    assert len(ticks) == 2 * (1 + 3)  # one tick per planned call, failed or not: the bar ends full


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="Linux: /proc/stat")
def test_median_times_says_when_another_process_took_the_cpu(capsys, monkeypatch):
    """Another busy process during the timed rounds: a line says the times are noisy (what made this 2-core
    machine's time ratios wander by 2-30x)."""
    monkeypatch.setattr(OtherProcesses, "NOISY", 0.1)
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass"])
    try:
        median_times({"sleep": lambda: time.sleep(0.4)}, CPU, 0, 3)
    finally:
        busy.wait()
    assert "other processes used" in capsys.readouterr().out


def test_failures_are_printed_rows_written_then_exit(capsys, tmp_path):
    rows = [{"config": "plain", "ms": 1.0}]
    assert finish(rows, {}, 10, str(tmp_path), "ok.csv") is rows
    with pytest.raises(SystemExit, match="1 configuration\\(s\\) failed"):
        finish(rows, {"int4": error_line(ValueError("bad\nmore"))}, 10, str(tmp_path), "partial.csv")
    assert "int4      FAILED: ValueError: bad\n" in capsys.readouterr().out
    assert (tmp_path / "partial.csv").read_text().splitlines() == ["config,ms", "plain,1.0"]


# 3. Rows that cannot run here are skipped with a reason.


def test_deepspeed_missing_is_a_skipped_row(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # `from deepspeed import ...` raises ImportError
    rows = configs(CPU)
    (skipped,) = [r for r in rows if isinstance(r, Skipped) and r.name == "deepspeed"]  # (older torch skips more)
    assert "not importable" in skipped.reason
    assert "deepspeed" not in [r.name for r in rows if isinstance(r, Config)]


def test_llama_without_transformers_is_skipped_with_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(checkpoint, "transformers_missing", lambda: "transformers is not installed")
    assert bench_main(["--smoke", "--workloads", "llama", "--out", str(tmp_path)]) == []
    assert "skipped: transformers is not installed" in capsys.readouterr().out


def test_extra_rows_are_measured_after_fastckpt():
    def provider(workload, device):
        return [Config("planner plan", None, family="planner")]

    checkpoint.EXTRA_ROWS.append(provider)
    try:
        assert configs(CPU)[-1].name == "planner plan"
    finally:
        checkpoint.EXTRA_ROWS.remove(provider)


# 4. Options: bad ones fail with a message that says what is valid.


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--workloads", "gpt3"], "unknown workload 'gpt3'; valid: " + ", ".join(WORKLOAD_NAMES)),
        (["--workloads", "gpt2,bert"], "unknown workload 'bert'; valid: seed-cnn"),
        (["--workloads", ","], "no workload named; valid: seed-cnn"),
        (["ops", "--workloads", "gpt2"], "--workloads and --smoke apply to the checkpoint benchmark, not to 'ops'"),
        (["--quick", "--smoke"], "--quick and --smoke exclude each other"),
        (["nonsense"], "invalid choice: 'nonsense'"),
    ],
)
def test_bad_options_say_what_is_valid(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_out_that_is_a_file_is_rejected(tmp_path, capsys):
    path = tmp_path / "results.csv"
    path.write_text("")
    with pytest.raises(SystemExit):
        parse_args(["--out", str(path)])
    assert "exists and is not a folder" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_cuda_without_gpu_is_rejected(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--device", "cuda"])
    assert "no CUDA GPU is visible" in capsys.readouterr().err


def test_workloads_accepts_commas_and_repeats_once_each():
    args = parse_args(["--workloads", "gpt2,llama", "--workloads", "gpt2", "--workloads", "seed-cnn"])
    assert args.workloads == ["gpt2", "llama", "seed-cnn"]
    assert parse_args([]).workloads is None  # all of them


def test_unknown_workload_through_the_python_api():
    with pytest.raises(ValueError, match="unknown workload\\(s\\) vit; valid: seed-cnn, gpt2, gpt2-long, llama"):
        checkpoint.main(selected=["vit"], smoke=True)


# 5. Output formatting: blanks, not nan; the Pareto front.


def test_tables_and_csv_show_blanks_not_nan(tmp_path):
    rows = [
        {"config": "plain", "family": "plain", "ms_per_step": 10.0, "x_plain": None, "peak_MiB": 5.0,
         "bits_per_element": float("nan"), "grad_rel_l2": 0.0, "error": None},
        {"config": "fastckpt int8", "family": "fastckpt", "ms_per_step": 11.0, "x_plain": 1.1, "peak_MiB": 2.0,
         "bits_per_element": 8.25, "grad_rel_l2": 6e-3, "error": None},
        {"config": "broken", "family": "fastckpt", "ms_per_step": None, "x_plain": None, "peak_MiB": None,
         "bits_per_element": None, "grad_rel_l2": None, "error": "RuntimeError: x"},
    ]  # fmt: skip
    text, markdown = report.text_table(rows), report.markdown_table(rows)
    for rendered in (text, markdown):
        assert "nan" not in rendered.lower() and "None" not in rendered
    assert re.search(r"^broken +FAILED: RuntimeError: x$", text, re.M)
    assert text.splitlines()[1].split() == ["plain", "*", "10.0", "5.0", "0"]
    from benchmarks.harness import write_csv

    write_csv(rows, str(tmp_path), "t.csv", quiet=True)
    lines = (tmp_path / "t.csv").read_text().splitlines()
    assert lines[1] == "plain,plain,10.0,,5.0,,0.0,"


def test_pareto_front_is_the_rows_nothing_beats_on_both():
    rows = [
        {"config": "plain", "ms_per_step": 10.0, "peak_MiB": 100.0},
        {"config": "stock", "ms_per_step": 14.0, "peak_MiB": 30.0},
        {"config": "slower and bigger", "ms_per_step": 15.0, "peak_MiB": 31.0},
        {"config": "int4", "ms_per_step": 11.0, "peak_MiB": 25.0},
        {"config": "failed", "ms_per_step": None, "peak_MiB": None},
        {"config": "int2", "ms_per_step": 10.5, "peak_MiB": 20.0, "grad_rel_l2": 0.5},  # too lossy to count
    ]
    assert report.pareto(rows) == {"plain", "int4"}


# 6. The CPU peak: independent of earlier profiled calls; the profiler's lines kept out of the output.


def test_cpu_peak_does_not_depend_on_earlier_profiled_calls():
    held = {"a": torch.empty(2**20)}

    def step():
        held["a"] = None
        held["a"] = torch.empty(2**20)

    first, second = peak_bytes(step, CPU), peak_bytes(step, CPU)
    assert first == second == 4 * 2**20  # what the step allocated; the free of the older block not credited


def test_cpu_peak_counts_what_is_freed_inside_the_step():
    def step():
        a = torch.empty(2**20)
        del a
        b = torch.empty(2**19)
        c = torch.empty(2**19)
        del b, c

    assert peak_bytes(step, CPU) == 4 * 2**20


def test_quiet_profiler_logs_drops_only_the_profilers_lines(capfd):
    with quiet_profiler_logs():
        os.write(2, b"USDT:2026-12-01 10:40:17 14873:14873 SyncActivityProfilerHandler.cpp:39] profiler_start\n")
        os.write(2, b"[W1201 10:42:07.776555260 CPUAllocator.cpp:245] Memory block of unknown size was allocated\n")
        os.write(2, b"ERROR:2026-12-01 10:42:07 15198:15198 DeviceProperties.cpp:56] gpuGetDeviceCount failed\n")
        os.write(2, b"Traceback (most recent call last): a real error\n")
        print("to stdout", flush=True)
    out, err = capfd.readouterr()
    assert out == "to stdout\n"
    assert err == "Traceback (most recent call last): a real error\n"
    assert not is_profiler_noise("UserWarning: profiler results may be inaccurate")  # not a C++ log line


def test_peak_bytes_passes_errors_and_stderr_through(capfd):
    def step():
        print("a line the step writes to stderr", file=sys.stderr)
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        peak_bytes(step, CPU)
    err = capfd.readouterr().err
    assert "a line the step writes to stderr" in err and "USDT" not in err


def test_python_m_benchmarks_prints_no_profiler_or_device_probe_lines(tmp_path):
    """The planner section of `python -m benchmarks` (its verifying plans run the profiler outside the harness's
    measurements), at the smoke size, in a process of its own, as `make bench` runs it: no trace point of
    kineto's (USDT ... profiler_start) and no ERROR line (gpuGetDeviceCount on a CUDA build without a GPU)."""
    environment = {name: value for name, value in os.environ.items() if name != "KINETO_LOG_LEVEL"}
    command = [sys.executable, "-m", "benchmarks", "--smoke", "--workloads", "planner", "--out", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "== planner" in result.stdout
    noise = [line for line in output.splitlines() if "USDT" in line or line.startswith("ERROR")]
    assert not noise, "\n".join(noise)


def test_grad_error_is_zero_for_exact_and_one_for_missing():
    g = [torch.ones(3), torch.ones(2)]
    assert checkpoint.max_rel_l2(g, g) == 0
    assert checkpoint.max_rel_l2([torch.ones(3), None], g) == 1
    assert math.isclose(checkpoint.max_rel_l2([torch.ones(3) * 1.1, torch.ones(2)], g), 0.1, rel_tol=1e-5)


# 7. The ops benchmark's timing.


def test_op_and_baseline_are_both_timed():
    calls = {"op": 0, "copy": 0}

    def op():
        calls["op"] += 1

    def copy():
        calls["copy"] += 1

    seconds, copy_seconds = _with_baseline(op, copy, torch.device("cpu"))
    assert seconds > 0 and copy_seconds > 0
    assert calls["op"] == calls["copy"] > 0  # the same number of blocks of each, alternating


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="reads /proc/stat")
def test_other_processes_cpu_share_is_a_fraction():
    busy = checkpoint._cpu_busy(0.05)
    assert busy is not None and 0.0 <= busy <= 1.0


@needs_in_graph_storage
def test_compile_section_runs_every_row_and_reports_the_targets(tmp_path, capsys):
    rows = bench_main(["--smoke", "--workloads", "compile", "--out", str(tmp_path)])
    names = [r["config"] for r in rows]
    assert names[:4] == ["plain", "compiled plain", "compiled torch non-reentrant", "compiled fastckpt recompute"]
    assert {"compiled fastckpt int8", "compiled fastckpt int4"} <= set(names)
    assert all(r["error"] is None for r in rows)
    by_name = {r["config"]: r for r in rows}
    # recompute under compile is torch's own checkpoint op: the same gradients as torch's row
    recompute, stock = by_name["compiled fastckpt recompute"], by_name["compiled torch non-reentrant"]
    assert recompute["grad_rel_l2"] == stock["grad_rel_l2"]
    assert 0 < by_name["compiled fastckpt int8"]["grad_rel_l2"] <= 1e-2
    out = capsys.readouterr().out
    assert "target compiled fastckpt recompute" in out
    assert (tmp_path / "compile.csv").exists()
    assert "## compile: torch.compile on the GPT-2 stack" in (tmp_path / "results.md").read_text()


def test_offload_benchmark_needs_a_gpu_and_says_so(capsys):
    assert offload_bench.main("cpu") == []
    assert "needs a CUDA GPU" in capsys.readouterr().out
    assert offload_bench.hidden_fraction(0.0, 2.0) == 1.0  # nothing exposed: every copy overlapped
    assert offload_bench.hidden_fraction(0.5, 2.0) == 0.75
    assert offload_bench.hidden_fraction(3.0, 2.0) == -0.5  # slower than the copies alone
    assert math.isnan(offload_bench.hidden_fraction(1.0, 0.0))
