"""fastckpt.integrations.deepspeed against the real DeepSpeed package (CPU accelerator), in one process:
deepspeed.checkpointing.checkpoint's losses and gradients (its RNG tracker replayed), configure and its
precedence and errors, checkpoint_in_cpu and storage policies, and profile. Partitioned activations and DeepSpeed
engines in 2 gloo processes: test_deepspeed_distributed.py."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

os.environ.setdefault("DS_ACCELERATOR", "cpu")
deepspeed = pytest.importorskip("deepspeed")
from deepspeed import checkpointing as ds_checkpointing  # noqa: E402  (`import deepspeed.checkpointing` fails)

import fastckpt  # noqa: E402
import fastckpt.integrations.deepspeed as ckpt  # noqa: E402
from tests.helpers import every_size, max_rel_l2  # noqa: E402
from tests.models import TransformerBlock  # noqa: E402

TRACKER = "model-parallel-rng"  # DeepSpeed's default tracker name, the one fork() uses
GRAD_TOLERANCE = 1e-2  # the int8 target (BENCHMARKS.md): relative L2 per parameter gradient vs plain


@pytest.fixture(autouse=True)
def clean_state():
    """Each test starts unconfigured with an empty DeepSpeed RNG tracker, and leaves it so."""
    ckpt.reset(configuration=True)
    ds_checkpointing.get_cuda_rng_tracker().reset()
    yield
    ckpt.reset(configuration=True)
    ds_checkpointing.get_cuda_rng_tracker().reset()


class Block(nn.Module):
    """A transformer block (attention and residual dropout) plus Megatron-style dropout under the tracker,
    taking a non-tensor argument and keyword arguments."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.inner = TransformerBlock(dim, heads=4, dropout=0.2)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, scale: float, *, bias: torch.Tensor | None = None) -> torch.Tensor:
        h = self.inner(x)
        with ds_checkpointing.get_cuda_rng_tracker().fork():  # model-parallel region: the tracker's stream
            h = nn.functional.dropout(h, 0.3, training=True)
        h = x + scale * self.out(h)
        return h if bias is None else h + bias


def forward_stack(checkpoint, seed: int = 0, blocks: int = 3) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Loss of a stack of Blocks, each through `checkpoint` (None: plain), and the tensors to differentiate."""
    torch.manual_seed(seed)
    model = nn.ModuleList(Block() for _ in range(blocks))
    ds_checkpointing.get_cuda_rng_tracker().reset()
    ds_checkpointing.get_cuda_rng_tracker().add(TRACKER, seed + 1000)
    x = torch.randn(4, 16, 32, requires_grad=True)
    bias = torch.randn(32, requires_grad=True)
    h = x
    for block in model:
        h = block(h, 0.5, bias=bias) if checkpoint is None else checkpoint(block, h, 0.5, bias=bias)
    return h.pow(2).mean(), [*model.parameters(), x, bias]


def run_stack(checkpoint, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Loss and gradients (parameters, input, bias) of the Block stack through `checkpoint` (None: plain)."""
    loss, leaves = forward_stack(checkpoint, seed)
    loss.backward()
    return loss.detach(), [t.grad for t in leaves]


def assert_identical(got, expected) -> None:
    """Losses and every gradient bit-identical."""
    assert torch.equal(got[0], expected[0]), (got[0], expected[0])
    assert len(got[1]) == len(expected[1])
    for index, (a, b) in enumerate(zip(got[1], expected[1], strict=True)):
        assert torch.equal(a, b), f"gradient {index} differs: max |diff| {(a - b).abs().max()}"


# 1. Default settings: the same losses and gradients as deepspeed.checkpointing.checkpoint.


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_default_matches_deepspeed(use_reentrant):
    if use_reentrant:
        ckpt.configure(None, use_reentrant=True)
    expected = run_stack(ds_checkpointing.checkpoint)
    assert_identical(run_stack(ckpt.checkpoint), expected)
    assert_identical(run_stack(None), expected)  # and DeepSpeed's equals no checkpointing at all


def test_rng_tracker_replay_is_what_makes_it_match():
    # fastckpt.checkpoint alone replays the global RNG but not DeepSpeed's tracker: the fork()ed dropout
    # draws new masks in the recompute, so the gradients differ; our checkpoint replays the tracker.
    expected = run_stack(None)
    _, grads = run_stack(fastckpt.checkpoint)
    assert any(not torch.equal(a, b) for a, b in zip(grads, expected[1], strict=True))
    assert_identical(run_stack(ckpt.checkpoint), expected)
    # The tracker is left as the plain run leaves it (restored after the recompute).
    run_stack(None)
    plain_state = ds_checkpointing.get_cuda_rng_tracker().get_states()[TRACKER]
    run_stack(ckpt.checkpoint)
    assert torch.equal(ds_checkpointing.get_cuda_rng_tracker().get_states()[TRACKER], plain_state)


def test_return_values_like_deepspeed():
    x = torch.randn(3, 4, requires_grad=True)
    functions = {
        "tensor": lambda t: t * 2,
        "one-tuple": lambda t: (t * 2,),
        "pair": lambda t: (t * 2, t.sum()),
        "with non-tensor": lambda t: (t * 2, "tag", t.argmax()),
        "list": lambda t: [t * 2, t * 3],
    }
    for name, function in functions.items():
        ours, theirs = ckpt.checkpoint(function, x), ds_checkpointing.checkpoint(function, x)
        assert type(ours) is type(theirs), name
        if isinstance(theirs, tuple):
            assert len(ours) == len(theirs), name
            for a, b in zip(ours, theirs, strict=True):
                assert torch.equal(a, b) if isinstance(b, torch.Tensor) else a == b, name
        else:
            assert torch.equal(ours, theirs), name


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_outer_hooks_see_exactly_the_segment_inputs(use_reentrant):
    # The design relies on it: the engines save the inputs under the hooks around the call, nothing else.
    seen = []

    def pack(t):
        seen.append(t)
        return t

    layer = nn.Linear(8, 8)
    a = torch.randn(4, 8, requires_grad=True) * 2
    b = torch.randn(8)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fastckpt.checkpoint(
            lambda u, v: torch.tanh(layer(u) * v).sum(), a, b, use_reentrant=use_reentrant, policy="recompute"
        )
    assert len(seen) == 2 and seen[0] is a and seen[1] is b
    y.backward()  # the recompute happens outside the hooks and saves nothing through them
    assert len(seen) == 2


def test_works_without_deepspeed_imported():
    # In a fresh interpreter: the module, configure and checkpoint never import DeepSpeed; the re-exported
    # DeepSpeed functions say how to get it when it is missing.
    code = (
        "import sys, torch\n"
        "import fastckpt.integrations.deepspeed as ckpt\n"
        "ckpt.configure(None, {'activation_checkpointing': {'profile': True}}, checkpoint_in_cpu=True)\n"
        "x = torch.randn(4, 4, requires_grad=True)\n"
        "ckpt.checkpoint(torch.nn.functional.dropout, x, 0.5).sum().backward()\n"
        "assert x.grad is not None\n"
        "assert not any(name.split('.')[0] == 'deepspeed' for name in sys.modules), 'deepspeed was imported'\n"
        "sys.modules['deepspeed'] = None  # as if not installed\n"
        "try:\n    ckpt.get_cuda_rng_tracker()\nexcept ImportError as e:\n    print('ImportError:', e)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "ImportError:" in result.stdout and "pip install deepspeed" in result.stdout, result.stdout


# 2. configure: config dict / JSON file, precedence, validation, is_configured / reset.

SECTION = {
    "partition_activations": False,
    "contiguous_memory_optimization": False,
    "number_checkpoints": 4,
    "cpu_checkpointing": True,
    "synchronize_checkpoint_boundary": True,
    "profile": True,
}


def test_configure_from_dict_and_json_file(tmp_path):
    assert not ckpt.is_configured()
    assert ckpt.settings() == ckpt.Settings()
    ckpt.configure(None, deepspeed_config={"train_batch_size": 8, "activation_checkpointing": SECTION})
    from_dict = ckpt.settings()
    assert ckpt.is_configured()
    assert (from_dict.num_checkpoints, from_dict.checkpoint_in_cpu, from_dict.synchronize, from_dict.profile) == (
        4,
        True,
        True,
        True,
    )
    assert not from_dict.partition_activations and not from_dict.contiguous_checkpointing
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"activation_checkpointing": SECTION}))
    ckpt.reset(configuration=True)
    ckpt.configure(None, deepspeed_config=str(path))
    assert ckpt.settings() == from_dict
    ckpt.configure(None, deepspeed_config=path)  # a pathlib.Path as well
    assert ckpt.settings() == from_dict


def test_configure_precedence_defaults_config_arguments():
    ckpt.configure(None, deepspeed_config={"activation_checkpointing": SECTION}, checkpoint_in_cpu=False, profile=False)
    got = ckpt.settings()
    assert (got.checkpoint_in_cpu, got.profile) == (False, False)  # explicit arguments override the file
    assert (got.synchronize, got.num_checkpoints) == (True, 4)  # the rest comes from the file
    ckpt.configure(None, deepspeed_config={})  # no section: DeepSpeed's defaults, not the previous call's
    assert ckpt.settings() == ckpt.Settings(configured=True)
    ckpt.configure(None, synchronize=True)
    assert ckpt.settings() == ckpt.Settings(configured=True, synchronize=True)


def test_configure_rejects_bad_input():
    with pytest.raises(ValueError, match="'partitioned_activations'.*valid keys.*partition_activations"):
        ckpt.configure(None, {"activation_checkpointing": {"partitioned_activations": True}})
    with pytest.raises(ValueError, match="contiguous_checkpointing.*requires partition_activations"):
        ckpt.configure(None, contiguous_checkpointing=True, num_checkpoints=4)
    with pytest.raises(ValueError, match="requires num_checkpoints"):
        ckpt.configure(None, partition_activations=True, contiguous_checkpointing=True)
    with pytest.raises(TypeError, match="profile must be a bool"):
        ckpt.configure(None, {"activation_checkpointing": {"profile": "yes"}})
    with pytest.raises(TypeError, match="deepspeed_config"):
        ckpt.configure(None, deepspeed_config=42)
    with pytest.raises(ValueError, match="cannot read deepspeed_config file"):
        ckpt.configure(None, deepspeed_config="/nonexistent/ds_config.json")
    with pytest.raises(TypeError, match="mpu_.*get_model_parallel_rank"):
        ckpt.configure(object())
    with pytest.raises(ValueError, match="unknown token"):
        ckpt.configure(None, policy="int9")
    assert not ckpt.is_configured()  # a failed configure changes nothing
    # Contiguous with partition and a layer count is accepted (and changes no layout).
    ckpt.configure(None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=3)
    assert ckpt.settings().contiguous_checkpointing


# What DeepSpeed's configure sets before its asserts; restored after calling it.
DS_CONFIGURE_GLOBALS = (
    "PARTITION_ACTIVATIONS",
    "CONTIGUOUS_CHECKPOINTING",
    "num_layers",
    "CPU_CHECKPOINT",
    "SYNCHRONIZE",
    "PROFILE_TIME",
    "deepspeed_checkpointing_enabled",
    "mpu",
)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (dict(partition_activations=True, contiguous_checkpointing=True), "requires num_checkpoints"),
        (dict(contiguous_checkpointing=True, num_checkpoints=4), "requires partition_activations=True"),
    ],
)
def test_contiguous_checkpointing_errors_are_deepspeeds_type_and_ours(monkeypatch, arguments, message):
    for name in DS_CONFIGURE_GLOBALS:
        monkeypatch.setattr(ds_checkpointing, name, getattr(ds_checkpointing, name))
    with pytest.raises(Exception) as theirs:
        ds_checkpointing.configure(None, **arguments)
    with pytest.raises(ValueError, match=message) as ours:  # fastckpt's type and words stay
        ckpt.configure(None, **arguments)
    assert type(theirs.value) is AssertionError  # DeepSpeed 0.19.8 asserts
    assert isinstance(ours.value, type(theirs.value))  # so `except AssertionError` written for it catches ours
    assert not ckpt.is_configured()


class FakeModelParallel:
    """An mpu with both naming conventions: DeepSpeed prefers the tensor-parallel one."""

    def get_model_parallel_rank(self):
        return 0

    def get_model_parallel_world_size(self):
        return 1

    def get_model_parallel_group(self):
        return "old-group"

    def get_tensor_model_parallel_rank(self):
        return 1

    def get_tensor_model_parallel_world_size(self):
        return 2

    def get_tensor_model_parallel_group(self):
        return "tp-group"


def test_configure_reads_the_model_parallel_unit():
    mpu = FakeModelParallel()
    ckpt.configure(mpu)
    got = ckpt.settings()
    assert (got.mpu, got.mp_rank, got.mp_size, got.mp_group) == (mpu, 1, 2, "tp-group")
    ckpt.configure(None)
    assert (ckpt.settings().mp_size, ckpt.settings().mpu) == (1, None)


def test_is_configured_and_reset():
    assert not ckpt.is_configured()
    ckpt.configure(None, checkpoint_in_cpu=True, policy="recompute+int8")
    configured = ckpt.settings()
    ckpt.set_num_layers(6)
    assert ckpt.settings().num_checkpoints == 6
    # reset() between forwards without backward (evaluation) keeps the settings, as DeepSpeed's does...
    x = torch.randn(64, 32, requires_grad=True)
    ckpt.checkpoint(torch.tanh, x * 1)
    ckpt.reset()
    assert ckpt.is_configured() and ckpt.settings() == dataclasses.replace(configured, num_checkpoints=6)
    with fastckpt.track() as report:
        ckpt.checkpoint(torch.tanh, x * 1).sum().backward()
    assert [s.policy for s in report.segments] == ["recompute+int8+offload"]
    assert max_rel_l2([x.grad], [1 - torch.tanh(x.detach()) ** 2]) <= GRAD_TOLERANCE
    # ...and reset(configuration=True) returns to the unconfigured defaults.
    ckpt.reset(configuration=True)
    assert not ckpt.is_configured() and ckpt.settings() == ckpt.Settings()
    with pytest.raises(ValueError, match="num_checkpoints"):
        ckpt.set_num_layers(0)


# 3. checkpoint_in_cpu and policies.


def test_checkpoint_in_cpu_offloads_the_inputs():
    ckpt.configure(None, checkpoint_in_cpu=True)
    expected = run_stack(None)
    with fastckpt.track() as report:
        got = run_stack(ckpt.checkpoint)
    # On CPU the offload keeps CPU tensors where they are: bit-identical, and the policy is applied.
    assert_identical(got, expected)
    assert [s.policy for s in report.segments] == ["recompute+offload"] * 3


def test_recompute_int8_policy_and_checkpoint_in_cpu():
    expected = run_stack(None)
    for kwargs, policy in [({}, "recompute+int8"), ({"checkpoint_in_cpu": True}, "recompute+int8+offload")]:
        ckpt.configure(None, policy="recompute+int8", **kwargs)
        with fastckpt.track() as report:
            loss, grads = run_stack(ckpt.checkpoint)
        assert torch.equal(loss, expected[0])  # the forward itself is exact
        error = max_rel_l2(grads, expected[1])
        assert 0 < error <= GRAD_TOLERANCE, error  # > 0: the inputs really went through int8
        assert [s.policy for s in report.segments] == [policy] * 3
        # Block 0's input is the leaf x (kept as is); blocks 1 and 2 store theirs 8-bit.
        assert [s.codecs for s in report.segments] == [set(), {"int8"}, {"int8"}]


def test_compressed_recomputation_policy_reaches_the_recomputation():
    expected = run_stack(None)
    ckpt.configure(None, policy=every_size("recompute:int8"))
    with fastckpt.track() as report:
        loss, grads = run_stack(ckpt.checkpoint)
    assert torch.equal(loss, expected[0])
    assert 0 < max_rel_l2(grads, expected[1]) <= GRAD_TOLERANCE  # > 0: the recomputed tensors went through int8
    recomputed = [s for s in report.segments if s.policy.endswith("(recomputed)")]
    assert len(recomputed) == 3 and all("int8" in s.codecs for s in recomputed)


def test_storage_policy():
    expected = run_stack(None)
    ckpt.configure(None, policy="int8")
    with fastckpt.track() as report:
        loss, grads = run_stack(ckpt.checkpoint)
    assert torch.equal(loss, expected[0])
    assert 0 < max_rel_l2(grads, expected[1]) <= GRAD_TOLERANCE
    assert [s.policy for s in report.segments] == ["int8"] * 3
    assert all(s.tensors > 2 and s.bits_per_element < 16 for s in report.segments)  # every activation, 8-bit


def test_partition_with_storage_policy_raises():
    with pytest.raises(ValueError, match="partition_activations=True.*policy='int8'"):
        ckpt.configure(None, partition_activations=True, policy="int8")
    # A default set with fastckpt.policy(...) is checked at the call.
    ckpt.configure(None, partition_activations=True)
    with fastckpt.policy("int4"), pytest.raises(ValueError, match="partition_activations=True.*policy='int4'"):
        ckpt.checkpoint(torch.tanh, torch.randn(4, requires_grad=True))


# 4. profile: forward and recompute times per call in fastckpt.track().


@pytest.mark.parametrize("policy", [None, "recompute+int8"])
def test_profile_records_forward_and_recompute_times(policy):
    ckpt.configure(None, profile=True, policy=policy)
    expected = run_stack(None)
    with fastckpt.track() as report:
        loss, leaves = forward_stack(ckpt.checkpoint)
        assert len(report.segments) == 3  # one record per call
        assert all(s.forward_seconds > 0 and s.recompute_seconds == 0 for s in report.segments)
        loss.backward()
    assert len(report.segments) == 3
    assert all(s.forward_seconds > 0 and s.recompute_seconds > 0 for s in report.segments)
    table = report.table()
    assert "fwd ms" in table and "recomp ms" in table and len(table.splitlines()) == 1 + 3
    if policy is None:  # profiling changes nothing
        assert_identical((loss.detach(), [t.grad for t in leaves]), expected)


def test_synchronize_is_harmless_on_cpu():
    ckpt.configure(None, synchronize=True)
    assert_identical(run_stack(ckpt.checkpoint), run_stack(None))
