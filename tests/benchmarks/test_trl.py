"""The TRL benchmark's smoke run: every row runs in TRL's SFT, DPO, GRPO and KTO trainers and is reported against
TRL + HF GC."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")
pytest.importorskip("peft")


@pytest.mark.parametrize("trainer", ["sft", "dpo", "grpo", "kto"])
def test_smoke_run_reports_every_row(capsys, tmp_path, trainer):
    from benchmarks import trl as bench

    rows = bench.main(out=str(tmp_path), smoke=True, trainer=trainer)
    printed = capsys.readouterr().out
    assert [row["row"] for row in rows] == [s.name for s in bench.SETUPS if not (s.config or {})]
    assert rows[0]["row"] == bench.REFERENCE and rows[0]["peak_x_ref"] == 1.0
    assert all(row["peak_bytes"] > 0 and row["seconds"] > 0 for row in rows)
    # learning rate 0: every row steps from the same weights, so the losses agree (the served head: up to rounding)
    assert max(row["loss"] for row in rows) - min(row["loss"] for row in rows) < 1e-2
    assert "not run on CPU: TRL's activation offloading" in printed
    assert (tmp_path / ("trl.csv" if trainer == "sft" else f"trl_{trainer}.csv")).exists()
