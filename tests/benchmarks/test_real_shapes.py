"""benchmarks/real_shapes.py: the real-shape section runs every row on a tiny Llama (--smoke), prints where its peak
is, and its configurations are the real models' shapes."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from benchmarks import real_shapes  # noqa: E402
from benchmarks.__main__ import main as bench_main  # noqa: E402
from benchmarks.__main__ import parse_args  # noqa: E402


def test_smoke_run_prints_every_row_and_the_peak_breakdown(capsys, tmp_path):
    rows = bench_main(["real", "--smoke", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    names = {row["config"] for row in rows}
    assert names == {real_shapes.PLAIN, *(row.name for row in real_shapes.rows())}
    assert {row["workload"] for row in rows} == {workload.name for workload in real_shapes.SMOKE}
    for row in rows:
        assert math.isfinite(row["peak_MiB"]) and row["peak_MiB"] > 0
        # the breakdown accounts for the whole peak
        parts = sum(row[f"at_peak_{name}_MiB"] for name in real_shapes.CATEGORIES)
        assert parts == pytest.approx(row["peak_MiB"])
        if row["config"] == real_shapes.HF_GC:
            assert row["peak_x_hf_gc"] == 1.0 and row["time_x_hf_gc"] == 1.0
    errors = [row for row in rows if row["workload"] == real_shapes.SMOKE[0].name]
    assert all(row["error_x_bf16"] is not None and row["error_x_bf16"] < 2 for row in errors)
    assert "live at the peak, MiB" in out and "floor" in out and (tmp_path / "real_shapes.csv").stat().st_size > 0


def test_the_shapes_are_the_real_models_configurations():
    model = real_shapes.build(real_shapes.SHAPES["smoke"], lora=True, tokens=64)
    lora = {name.split(".")[-4] for name, p in model.named_parameters() if p.requires_grad}
    assert lora == set(real_shapes.LORA_TARGETS)  # LoRA on all seven projections, its B nonzero
    assert all(p.abs().sum() > 0 for name, p in model.named_parameters() if "lora_B" in name)
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}
    llama, gemma = real_shapes.SHAPES["llama-3.2-1b"], real_shapes.SHAPES["gemma-2-2b"]
    assert (llama.hidden, llama.layers, llama.vocab) == (2048, 16, 128256)
    assert gemma.extra["final_logit_softcapping"] == 30.0 and gemma.head_dim == 256
    batch = real_shapes.batch_of(real_shapes.Workload("smoke", 64, True, "padded"), 1024, torch.device("cpu"))
    assert int((batch["attention_mask"] == 0).sum()) == 8 and bool((batch["labels"][0, :8] == -100).all())
    # the floor, at its largest over the backward: here at the first layer's (the other's gradients made)
    shape, gradients = real_shapes.SHAPES["smoke"], [sum(p.numel() * 4 for p in layer.parameters() if p.requires_grad)
                                                    for layer in model.base_model.model.model.layers]  # fmt: skip
    expected = 64 * 64 + 64 * 64 * 2 + 64 * 160 * 3 + gradients[1]
    assert real_shapes.floor_bytes(model, shape, 64) == max(expected, 2 * 64 * 64 + 64 * 64 * 2 + 64 * 160 * 3)


def test_all_is_real_only():
    assert parse_args(["real", "--all"]).all
    with pytest.raises(SystemExit):
        parse_args(["llm", "--all"])
