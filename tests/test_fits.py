"""fastckpt.fits: the longest sequence a fine-tune holds in a memory size, predicted from steps measured at two
lengths and two depths, checked against a step run at a longer length; too small a memory is an answer, not a
crash; bad arguments name themselves."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from fastckpt import fits  # noqa: E402

SMALL = {"compute": "fp32", "dtype": "fp32"}  # the lengths: past the loss head's chunk (2,048 and 4,096 tokens here)


@pytest.fixture(scope="module")
def lora_report() -> fits.Report:
    return fits.what_fits("tiny-llama", lora=4, memory=["256MiB", "1GiB"], batch_at=4096, verify=8192, **SMALL)


def test_the_prediction_holds_at_a_longer_length(lora_report):
    for name, (tokens, measured, predicted) in lora_report.verified.items():
        assert tokens == 8192
        assert abs(predicted - measured) <= 0.02 * measured, (name, measured, predicted)
    for method in lora_report.methods:  # the step's phases: each layer's parts, forward and recomputed
        for key, phases in method.phases.items():
            assert min(phases.values()) >= 0 and max(phases.values()) > 0
            assert {"F 0 in", "B 0.self_attn out", f"B {key[0] - 1}.mlp in", "backward", "end"} <= phases.keys()


def test_the_peak_follows_whichever_phase_is_highest_at_the_length():
    # "tile" is highest at the two measured lengths but grows slowly; "last layer" takes over at 10,000 tokens
    def phases(layers: int, tokens: int) -> dict[str, int]:
        return {"tile": 300_000 + 10 * tokens + 1000 * layers, "last layer": 40 * tokens + 1000 * layers}

    measured = {(d, n): phases(d, n) for d in (2, 3) for n in (2048, 4096)}
    method = fits.Method("m", measured, depth=4, resident=4000, optimizer_step=0)
    assert method.peak().at(20_000) == phases(4, 20_000)["last layer"] and method.peak().per_token == 40
    assert method.peak().at(3000) == phases(4, 3000)["tile"]
    assert method.longest(604_000 + 4000) == 15_000  # the one line through the step's peaks would say 30,000
    one_phase = {key: {"step": peak} for key, peak in method.measured.items()}  # the step's peaks as one line
    assert fits.Method("m", one_phase, depth=4, resident=4000, optimizer_step=0).longest(608_000) == 30_000
    assert method.longest(4000) == 0 and method.longest(3999) == 0


def test_fastckpt_holds_longer_sequences_than_hf_gc(lora_report):
    hf_gc, ours = lora_report.methods
    assert hf_gc.name == fits.HF_GC and ours.name == "fastckpt recompute+int8"
    assert 0 < hf_gc.peak().per_token and 0 < ours.peak().per_token < hf_gc.peak().per_token
    for memory in lora_report.memories:
        assert ours.longest(memory) > hf_gc.longest(memory) > 0
        # the total at the longest length fits, one more token's does not
        longest = ours.longest(memory)
        assert ours.resident + ours.peak().at(longest) <= memory < ours.resident + ours.peak().at(longest + 1)
    rows = lora_report.rows()
    assert rows[1]["batch_at_4096_1.00 GiB"] == ours.longest(2**30) // 4096
    text = lora_report.table()
    assert "longest sequence, fastckpt recompute+int8 / HF GC" in text and "measured on a CPU" in text


def test_several_policies_side_by_side_and_an_offload_policys_host_copies_counted_apart():
    policies = ["recompute+int8", "recompute+int8+offload"]
    report = fits.what_fits("tiny-llama", lora=4, memory="1GiB", policy=policies, lengths=(1024, 2048), **SMALL)
    hf_gc, kept, offloaded = report.methods
    assert [m.policy for m in report.methods] == [None, *policies] and hf_gc.name == fits.HF_GC
    host = offloaded.host_line()
    assert kept.host_line() is None and host is not None and host.per_token > 0
    assert report.layers == (2, 3)  # past the layer the backward prefetches
    # a layer more: its int8 input on the host, the device's peak grows by much less (at 2,048 tokens, past the
    # MLP's tile, 0.42x of it: the tiles' peak moment holds a little more per layer); kept, on the device
    for tokens in (1024, 2048):
        on_host = offloaded.host[(3, tokens)] - offloaded.host[(2, tokens)]
        assert offloaded.measured[(3, tokens)] - offloaded.measured[(2, tokens)] <= 0.5 * on_host
        assert kept.measured[(3, tokens)] - kept.measured[(2, tokens)] >= 0.8 * on_host
    text = report.table()
    assert "fastckpt recompute+int8+offload offloads to host memory" in text
    assert all(f"longest sequence, fastckpt {policy} / HF GC" in text for policy in policies)


def test_what_is_live_before_the_step_is_counted_at_the_models_depth():
    config = fits.load_config("tiny-llama")
    resident, trained = fits.live_before_step(config, None, fits.torch.float32)
    model = fits.build(config, None, fits.torch.float32)
    parameters = sum(p.numel() for p in model.parameters())  # the tied embedding once
    assert trained == parameters * 4 and resident == parameters * 4 + parameters * fits.ADAM_STATE_BYTES


def test_a_memory_too_small_for_any_length_is_an_answer(monkeypatch):
    monkeypatch.setattr(fits, "free_memory", lambda device: 2**20)  # and a check this machine could not hold
    short = {"lengths": (256, 512), "layers": (1, 2)}  # no length fits whatever the lengths measured
    report = fits.what_fits("tiny-llama", lora=None, memory="1MiB", verify=8192, **short, **SMALL)
    assert all(method.longest(2**20) == 0 for method in report.methods)
    text = report.table()
    assert text.count("none fits") == 2
    assert not report.verified and set(report.unverified) == {m.name for m in report.methods}
    assert text.count("not verified: ") == 2 and "more than the 1.00 MiB free here" in text


def test_a_config_json_is_read(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**fits.SHAPES["tiny-llama"], "num_hidden_layers": 3}))
    assert fits.load_config(str(tmp_path)).num_hidden_layers == 3
    assert fits.at_depth(fits.load_config(str(path)), 1).num_hidden_layers == 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"memory": "lots"}, "`memory` must be a size such as '24GiB'"),
        ({"lora": 0}, "`lora` must be a rank >= 1 or None"),
        ({"lengths": (2048, 1024)}, "`lengths` must be two increasing positive integers"),
        ({"dtype": "fp16"}, "`dtype` must be 'bf16' or 'fp32'"),
        ({"model": "no-such-model"}, "`model` must be one of llama-3.2-1b"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, match):
    arguments = {"model": "tiny-llama", **kwargs}
    with pytest.raises(ValueError, match=match):
        fits.what_fits(arguments.pop("model"), **arguments)


def test_the_command_line_prints_the_report(capsys):
    fits.main(["tiny-llama", "--lora", "4", "--memory", "256MiB", "--lengths", "256,512", "--layers", "1,2",
               "--compute", "fp32"])  # fmt: skip
    out = capsys.readouterr().out
    assert "longest in 256.00 MiB" in out and "HF GC" in out
