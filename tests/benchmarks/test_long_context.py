"""benchmarks/long_context.py on the tiny shape: every row runs, HF GC is measured where it fits and predicted
where it would not, the tiled MLP's row holds less than the untiled one's."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from benchmarks import long_context  # noqa: E402


@pytest.fixture(scope="module")
def table():
    return long_context.main(["--shape", "smoke", "--lengths", "6144", "--layers", "2", "--compute", "fp32"])


def test_every_row_is_measured_with_its_breakdown(table):
    by_config = {r["config"]: r for r in table}
    assert set(by_config) == {long_context.HF_GC, long_context.UNTILED, long_context.TILED}
    for r in table:
        parts = sum(r[f"at_peak_{c}_MiB"] for c in long_context.CATEGORIES)
        assert parts == pytest.approx(r["peak_MiB"], rel=0.02) and r["s_per_step"] > 0
    assert by_config[long_context.HF_GC]["peak_x_hf_gc"] == 1 and not by_config[long_context.HF_GC]["hf_gc_predicted"]
    assert by_config[long_context.TILED]["peak_MiB"] < by_config[long_context.UNTILED]["peak_MiB"]


def test_hf_gc_is_predicted_where_it_would_not_fit(monkeypatch, capsys):
    monkeypatch.setattr(long_context, "free_memory", lambda device: 1)
    table = long_context.run("smoke", [6144], 1, "padded", "fp32", long_context.torch.device("cpu"))
    predicted = [r for r in table if r["config"].startswith(f"{long_context.HF_GC} (predicted")]
    assert len(predicted) == 1 and all(r["hf_gc_predicted"] for r in table)
    assert "predicted: more than the memory free here" in capsys.readouterr().out
