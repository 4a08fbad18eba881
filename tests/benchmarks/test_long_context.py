"""benchmarks/long_context.py on the tiny shape: every row runs, HF GC is measured where it fits and predicted
where it would not, the tiled MLP's row holds less than the untiled one's, and the offloaded row's device less
than the tiled one's."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from benchmarks import long_context  # noqa: E402

CPU = long_context.torch.device("cpu")
SHORT = (512, 1024)  # HF GC's line (tiny shape: cheap anywhere)


@pytest.fixture(scope="module")
def table():
    from fastckpt.integrations.hf import attention

    with pytest.MonkeyPatch.context() as patch:
        # the packed mask is read in blocks of this many elements: at this tiny width a real shape's block would be
        # as large as the layers' activations
        patch.setattr(attention, "_CHECK_ELEMENTS", 1 << 16)
        configs = tuple(long_context.CONFIGS)
        return long_context.run("smoke", [3072], 2, "packed", "fp32", CPU, short=SHORT, configs=configs)  # 3 tiles


def test_every_row_is_measured_with_its_breakdown(table):
    by_config = {r["config"]: r for r in table}
    assert set(by_config) == {long_context.HF_GC, long_context.UNTILED, long_context.TILED, long_context.OFFLOADED}
    for r in table:
        parts = sum(r[f"at_peak_{c}_MiB"] for c in long_context.CATEGORIES)
        assert parts == pytest.approx(r["peak_MiB"], rel=0.02) and r["s_per_step"] > 0
    assert by_config[long_context.HF_GC]["peak_x_hf_gc"] == 1 and not by_config[long_context.HF_GC]["hf_gc_predicted"]
    assert by_config[long_context.TILED]["peak_MiB"] < by_config[long_context.UNTILED]["peak_MiB"]
    # the int8 layer inputs in host memory: less stored on the device
    offloaded, tiled = by_config[long_context.OFFLOADED], by_config[long_context.TILED]
    assert offloaded["at_peak_stored_MiB"] < tiled["at_peak_stored_MiB"] and offloaded["peak_MiB"] < tiled["peak_MiB"]


def test_hf_gc_is_predicted_where_it_would_not_fit(monkeypatch, capsys):
    monkeypatch.setattr(long_context, "free_memory", lambda device: 1)
    table = long_context.run("smoke", [3072], 1, "padded", "fp32", CPU, short=SHORT)
    predicted = [r for r in table if r["config"].startswith(f"{long_context.HF_GC} (predicted")]
    assert len(predicted) == 1 and all(r["hf_gc_predicted"] for r in table)
    assert "predicted: more than the memory free here" in capsys.readouterr().out


@pytest.mark.parametrize("flag", [False, True])
def test_return_freed_memory_leaves_glibc_alone(monkeypatch, capsys, flag):
    tuned = []
    monkeypatch.setattr(long_context, "_reuse_freed_host_memory", lambda: tuned.append(True) or True)
    monkeypatch.setattr(long_context, "run", lambda *args, **kwargs: [])  # the rows are the test above's
    long_context.main(["--shape", "smoke", "--device", "cpu", *(["--return-freed-memory"] if flag else [])])
    assert tuned == ([] if flag else [True])
    assert ("glibc malloc set to reuse freed memory" in capsys.readouterr().out) is not flag
