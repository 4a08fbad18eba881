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
    packed = {row["config"] for row in rows if row["workload"] == "llama-lora-packed"}
    assert packed == {llm.PLAIN, *llm.PACKED_ROWS} and (tmp_path / "llm_packed.csv").stat().st_size > 0
    assert (tmp_path / "llm_scaling.png").stat().st_size > 0
    with open(tmp_path / "llm_scaling.csv") as f:
        points = list(csv.DictReader(f))
    assert {p["axis"] for p in points} == {"tokens", "layers"}
    # --compare against itself: every row present on both sides, each ratio 1.
    lines = compare.compare_files(str(tmp_path / "llm_lora.csv"), str(tmp_path / "llm_lora.csv"))
    assert len(lines) == 1 + len(names) and all("1.000" in line for line in lines[1:])


def test_the_packed_batch_is_sequences_of_the_given_proportions():
    batch = llm.packed_batch(360, torch.device("cpu"))
    positions = batch["position_ids"][0]
    starts = (positions == 0).nonzero().flatten().tolist()
    lengths = [end - start for start, end in zip(starts, [*starts[1:], 360], strict=True)]
    assert lengths == [10 * weight for weight in llm.PACKED_WEIGHTS]  # 360 tokens: 10 per unit of weight
    assert all(torch.equal(positions[s : s + n], torch.arange(n)) for s, n in zip(starts, lengths, strict=True))
    assert torch.equal(batch["labels"][0] == -100, positions == 0) and "attention_mask" not in batch


def test_relative_error_and_slope():
    assert llm.relative_error([torch.ones(4)], [torch.ones(4)]) == 0
    assert llm.relative_error([torch.zeros(4)], [torch.ones(4)]) == pytest.approx(1.0)
    assert llm._slope([1, 2, 3], [10, 20, 30]) == pytest.approx(10.0)


def test_a_cpu_without_native_bf16_is_warned_about():
    assert llm.slow_bf16_warning(1.5) is None
    assert "100x slower than fp32" in llm.slow_bf16_warning(100.0)
    assert llm.bf16_slowdown(size=64) > 0


def test_the_liger_row_runs_only_on_a_gpu_with_liger_installed(monkeypatch):
    assert "GPU" in llm.liger_available(torch.device("cpu"))
    monkeypatch.setattr(llm.importlib.util, "find_spec", lambda name: None)
    assert "not installed" in llm.liger_available(torch.device("cuda"))
    monkeypatch.setattr(llm.importlib.util, "find_spec", lambda name: object() if name == "liger_kernel" else None)
    assert llm.liger_available(torch.device("cuda")) is None
    assert llm.LIGER not in {row.name for row in llm.rows()}
    assert llm.LIGER in {row.name for row in llm.rows(liger=True)}


def test_the_liger_loss_is_hf_loss_given_liger_semantics(monkeypatch):
    """liger_loss hands Liger the shifted hidden states and labels: with a stand-in for Liger's function (its
    documented semantics: mean cross entropy of input @ weight.T over labels not ignore_index), HF's loss."""
    import sys
    import types

    def fused(input, weight, target, ignore_index=-100):  # noqa: A002 (Liger's argument names)
        return torch.nn.functional.cross_entropy(input @ weight.T, target, ignore_index=ignore_index)

    functional = types.ModuleType("liger_kernel.transformers.functional")
    functional.liger_fused_linear_cross_entropy = fused
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", types.ModuleType("liger_kernel.transformers"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", functional)
    model, batch = llm.build(lora=True, layers=1, tokens=32, device=torch.device("cpu"), size="smoke")
    torch.testing.assert_close(llm.liger_loss(model, batch), llm.hf_loss(model, batch))
