"""fastckpt._compat, the one door to torch's private symbols: every probe resolves on this torch (or is one
expected missing on it), importing fastckpt resolves none, and a probe made to fail (its symbol renamed)
disables only its feature, with a message naming the feature, the symbol and the release.

Expected missing on the releases from the floor (2.9) on (each probe's `since`; the test skips them there):
  2.9       graph_exec_group, saved_tensor_hook_context, fx_annotate
  2.9-2.12  redispatch_function, skip_one_hop_torch_function
  2.9-2.13  current_user_saved_tensors_hooks (so on the GPU image's 2.11 too)
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import subprocess
import sys
import warnings

import pytest
import torch

import fastckpt
from fastckpt import _compat, hybrid, info
from fastckpt.memory import peak_bytes
from tests.helpers import grads_of
from tests.models import MLP, seeded

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROBES = sorted(_compat.PROBES)
NOT_YET_READ = {"saved_tensor_hook_context", "fx_annotate", "run_and_save_rng_state", "autograd_cache_enabled"}


def test_since_is_a_release_between_the_floor_and_now():
    floor = torch.torch_version.TorchVersion(_compat.FLOOR)
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"torch>={_compat.FLOOR}"' in pyproject
    for probe in _compat.PROBES.values():
        assert probe.path.startswith("torch.") and probe.feature and probe.without, probe
        assert floor <= probe.since and torch.torch_version.TorchVersion(probe.since) <= "2.14", probe


@pytest.mark.parametrize("name", PROBES)
def test_every_probe_resolves(name):
    probe = _compat.PROBES[name]
    if not _compat.expected(name) and not _compat.available(name):
        pytest.skip(f"{probe.path} is expected from torch {probe.since} on (this is {torch.__version__})")
    assert _compat.available(name), _compat.message(name)
    if not probe.live:
        assert getattr(_compat, name)() is _compat.require(name) is not None


def test_importing_fastckpt_resolves_no_probe():
    code = "import fastckpt, fastckpt._compat as c\nassert not c._cache, sorted(c._cache)\n"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_fastckpt_reaches_private_torch_symbols_only_through_compat():
    private = re.compile(
        r"torch\._C\b|torch\._functorch|torch\._prims|_python_dispatch import _|torch\.utils\._device"
        r"|_get_current_function_mode_stack|checkpoint\._[a-z]|\"_initialized\""
    )
    allowed = {"fastckpt/_compat.py"}
    offenders = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in sorted((ROOT / "fastckpt").rglob("*.py"))
        if str(path.relative_to(ROOT)) not in allowed
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if private.search(line) and not line.lstrip().startswith(("#", '"', 'f"'))
    ]
    assert not offenders, "\n".join(offenders)


# ---- each probe made to fail ------------------------------------------------------------------------------


@pytest.fixture
def rename(monkeypatch):
    """rename(*names): those probes' symbols look renamed in torch (path + '_renamed') until the test ends."""

    def rename(*names: str) -> None:
        for name in names:
            probe = _compat.PROBES[name]
            monkeypatch.setitem(_compat.PROBES, name, dataclasses.replace(probe, path=probe.path + "_renamed"))
        _compat.forget()

    yield rename
    _compat.forget()


def fallback_warnings(run, *names: str) -> list[str]:
    """Run `run()` and return the fallback warnings it raised (one per feature, where this torch is expected to
    have the symbol); check their number."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
        run()  # warned once only
    found = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning) and "fastckpt:" in str(w.message)]
    expected = [name for name in names if _compat.expected(name)]
    assert len(found) == min(len(expected), 1), found
    for message in found:
        assert "_renamed" in message and "renamed or removed after torch" in message, message
    return found


def checkpoint_matches_plain(**kwargs) -> None:
    model, x = seeded(MLP)
    x.requires_grad_(True)
    plain = grads_of(model, lambda: model(x))
    ours = grads_of(model, lambda: fastckpt.checkpoint(model, x, **kwargs))
    for a, b in zip(ours, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("name", PROBES)
def test_require_names_feature_symbol_and_release(rename, name):
    probe = _compat.PROBES[name]
    rename(name)
    assert not _compat.available(name) and name in _compat.missing()
    with pytest.raises(RuntimeError) as raised:
        _compat.require(name)
    message = str(raised.value)
    assert probe.feature in message and f"{probe.path}_renamed" in message and probe.since in message
    assert probe.without in message and torch.__version__ in message
    assert all(_compat.available(other) for other in PROBES if other != name and _compat.expected(other))


def test_without_graph_task_id_only_reentrant_checkpointing_runs(rename):
    rename("current_graph_task_id")
    model, x = seeded(MLP)
    with pytest.raises(RuntimeError, match=r"non-reentrant checkpointing .*_current_graph_task_id_renamed"):
        fastckpt.checkpoint(model, x)
    checkpoint_matches_plain(use_reentrant=True)


@pytest.mark.parametrize(
    "names",
    [
        ("graph_exec_group",),
        ("top_saved_tensors_default_hooks",),
        ("checkpoint_debug_enabled",),
        ("checkpoint_early_stop",),
        ("function_mode_stack",),
        ("device_context",),
    ],
)
def test_engine_falls_back_with_one_warning(rename, names):
    rename(*names)
    fallback_warnings(checkpoint_matches_plain, *names)


def test_without_cuda_initialized_cuda_counts_as_not_initialised(rename):
    rename("cuda_initialized")

    def run():
        assert _compat.device_initialized(torch.cuda) is False  # (on CPU inputs the engine reads torch.cpu's)
        checkpoint_matches_plain()

    fallback_warnings(run, "cuda_initialized")


def test_without_disable_current_modes_only_compressed_recomputation_raises(rename):
    rename("disable_current_modes")
    model, x = seeded(MLP)
    with pytest.raises(RuntimeError, match=r"compressed recomputation .*'recompute', 'recompute\+<codec>'"):
        fastckpt.checkpoint(model, x, policy="recompute:int8")
    fastckpt.checkpoint(model, x, policy="recompute+int8").sum().backward()
    checkpoint_matches_plain()


BOTH_REDISPATCHES = ("redispatch_function", "skip_one_hop_torch_function")


@pytest.mark.parametrize("names", [("redispatch_function",), ("skip_one_hop_torch_function",), BOTH_REDISPATCHES])
def test_keep_attention_falls_back_to_running_functions_whole(rename, names):
    block = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    x = torch.randn(2, 64, 32, requires_grad=True)
    segment = lambda h: block(h, h, h, need_weights=False)[0]  # noqa: E731
    reference = grads_of(block, lambda: segment(x))
    rename(*names)
    both = len(names) == 2

    def run():
        ours = grads_of(block, lambda: fastckpt.checkpoint(segment, x, context_fn=hybrid.keep_attention("save")))
        for a, b in zip(ours, reference, strict=True):
            torch.testing.assert_close(a, b)

    if both:
        fallback_warnings(run, *names)
    else:  # the other spelling serves
        fallback_warnings(run)


@pytest.mark.parametrize("name", ["current_user_saved_tensors_hooks", "top_saved_tensors_default_hooks"])
def test_without_sac_hooks_only_a_codec_store_raises(rename, name):
    rename(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(RuntimeError, match=r"store=.int8. needs selective checkpointing .*torch 2.14 or later"):
            hybrid.selective(store="int8")
    model, x = seeded(MLP)
    fastckpt.checkpoint(model, x, context_fn=hybrid.selective(store="save")).sum().backward()
    linear_ops = [torch.ops.aten.mm, torch.ops.aten.addmm]
    within = hybrid.selective(linear_ops, store="int8", within=[torch.nn.functional.linear])
    fastckpt.checkpoint(model, x, context_fn=within).sum().backward()


@pytest.mark.parametrize("name", ["profiler_allocation_fields", "profiler_event_tree"])
def test_without_profiler_records_cpu_memory_is_not_measured(rename, name):
    rename(name)
    ran = []
    with pytest.raises(RuntimeError, match=r"measuring CPU memory .*CUDA memory still can"):
        peak_bytes(lambda: ran.append(1), "cpu")
    assert not ran  # refused before the step ran
    checkpoint_matches_plain()


@pytest.mark.parametrize("name", ["dispatch_get_all_op_names", "dispatch_has_kernel_for_dispatch_key"])
def test_without_dispatcher_queries_info_leaves_out_the_op_table(rename, name):
    rename(name)
    with pytest.raises(RuntimeError, match="table of kernels per op"):
        info.kernels_by_op()
    text = info.report()
    assert text.startswith(f"{'fastckpt':<22}{fastckpt.__version__}") and "table of kernels per op" in text


def test_without_disable_torch_function_subclass_padded_attention_is_refused(rename):
    pytest.importorskip("transformers")
    from fastckpt.integrations import hf
    from tests.integrations.test_hf import tiny_llama

    model = tiny_llama()
    rename("disable_torch_function_subclass")
    with pytest.raises(RuntimeError, match=r"padded attention's mask form .*enable without padded_attention"):
        hf.enable(model, padded_attention=True)
    assert not hf.is_enabled(model) and model.config._attn_implementation == "sdpa"  # refused before any change
    assert hf.is_enabled(hf.enable(model))


def test_without_autograd_cache_switch_the_patch_is_refused(rename):
    with _compat.autograd_cache_off():
        assert _compat.autograd_cache_enabled() is False
    rename("autograd_cache_enabled")
    with pytest.raises(RuntimeError, match="AOTAutograd's cache off"):
        _compat.autograd_cache_off()


def test_compile_probes_are_there_for_compiled_py():
    # fastckpt.compiled does not read these yet (it imports them itself, gated by its own version check).
    assert NOT_YET_READ <= set(PROBES)
    if fastckpt.compiled.IN_GRAPH_STORAGE:
        assert all(_compat.available(name) for name in NOT_YET_READ)
