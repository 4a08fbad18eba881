"""An architecture sweep of fastckpt.integrations.hf over tiny transformers models built from configs.

Every architecture is trained for one step in train mode from fixed seeds, on a padded batch wherever it
takes an attention mask (the second sample is shorter: attention_mask 0 and labels -100 on its padding),
with each attention implementation it supports and with dropout 0 and 0.1. The asserts:

* policy="recompute" gives a loss and gradients `torch.equal` to HF's own gradient checkpointing, for
  use_reentrant False and True (with dropout > 0 too: both replay the RNG state of the forward). Where HF's
  own reentrant checkpointing raises (DeBERTa-v2: its layers take rel_embeddings, a tensor that requires
  grad, as a keyword), fastckpt must raise the same error; where it hangs (WavLM), fastckpt's reentrant run
  is compared with HF's non-reentrant one;
* every storage policy gives a finite loss and finite gradients, on the parameters that get one without
  checkpointing, and really stores the checkpointed layers;
* int8 (dropout 0) is within 1e-2 relative L2 of no checkpointing over all gradients together, and within 3e-2
  for the worst single gradient tensor (leaving out gradients that are zero in exact arithmetic: NOISE_FLOOR).

Every run goes through a thread joined with a timeout, so that a hang fails its test instead of blocking
the session. The fast part (a few representative architectures with sdpa) runs by default; the rest is
marked slow. The architectures (their tiny configs and padded inputs) are registered in hf_zoo_archs.py.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fastckpt  # noqa: E402
from fastckpt.integrations import hf  # noqa: E402
from tests.helpers import num_threads  # noqa: E402
from tests.integrations.hf_zoo_archs import ARCHS, BY_NAME, Arch  # noqa: E402

SEED = 123
TIMEOUT_S = 60.0
INT8_BOUND = 1e-2  # relative L2 of all gradients together
# The worst single gradient tensor: the small ones that are differences of larger terms (q/k norm weights,
# key biases, the LayerNorm after attention) reach 1.2-2.2e-2 in these 2-layer models at init (README, Limits).
INT8_TENSOR_BOUND = 3e-2
STORAGE_POLICIES = ["int8", "fp8", "int4", "recompute+int8", "recompute:int8+int8"]
ATTENTION = ["sdpa", "eager"]
DROPOUTS = [0.0, 0.1]


def _set_dropouts(config: Any, p: float) -> None:
    """Every dropout probability of `config` to `p` (stochastic depth included); layer drop always off."""
    for field in dataclasses.fields(config):
        name = field.name
        value = getattr(config, name, None)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if "layerdrop" in name:
            setattr(config, name, 0.0)
        elif "dropout" in name or "pdrop" in name or name in ("dropout_rate", "drop_path_rate"):
            setattr(config, name, p)


def _supports(arch: Arch, attn: str) -> str | None:
    """None if the architecture supports the attention implementation, else why not."""
    model_class = getattr(transformers, arch.model_class)
    if attn == "sdpa" and not model_class._supports_sdpa:
        return (
            f"{arch.model_class} does not support attn_implementation='sdpa' (transformers {transformers.__version__})"
        )
    return None


@functools.cache
def _base_model(name: str, attn: str, dropout: float) -> torch.nn.Module:
    arch = BY_NAME[name]
    config = arch.config()
    _set_dropouts(config, dropout)
    config.use_cache = False
    torch.manual_seed(0)
    return getattr(transformers, arch.model_class)._from_config(config, attn_implementation=attn)


def model_copy(name: str, attn: str, dropout: float) -> torch.nn.Module:
    return copy.deepcopy(_base_model(name, attn, dropout))


@functools.cache
def _inputs(name: str) -> dict[str, torch.Tensor]:
    arch = BY_NAME[name]
    inputs = arch.inputs(arch.config())
    masks = [v for k, v in inputs.items() if k.endswith("attention_mask")]
    assert arch.masked == bool(masks) and all((m == 0).any() for m in masks), f"{name}: batch not padded"
    assert not arch.masked or (inputs["labels"] == -100).any(), f"{name}: padding not ignored by the loss"
    return inputs


def inputs_of(name: str) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in _inputs(name).items()}


# ---------------------------------------------------------------------------------------------- runs


@dataclasses.dataclass
class Step:
    loss: torch.Tensor
    grads: dict[str, torch.Tensor] = dataclasses.field(repr=False)
    segments: int  # checkpointed forward calls fastckpt.track saw (not the "(recomputed)" records)
    stored_bytes: int


def _guarded(function: Callable[[], Any], what: str) -> Any:
    """Run `function` in a daemon thread; fail (instead of blocking) if it is still running after TIMEOUT_S."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = function()
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller's thread
            outcome["error"] = error

    thread = threading.Thread(target=target, name=f"hf-zoo {what}", daemon=True)
    thread.start()
    thread.join(TIMEOUT_S)
    if thread.is_alive():
        pytest.fail(f"{what}: still running after {TIMEOUT_S:.0f} s (hang)", pytrace=False)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def train_step(model: torch.nn.Module, inputs: dict[str, torch.Tensor], what: str) -> Step:
    """One forward/backward in train mode from a fixed RNG state, in a guarded thread."""

    def run() -> Step:
        model.train()
        model.zero_grad(set_to_none=True)
        torch.manual_seed(SEED)
        with fastckpt.track() as report:  # the report lives in a context variable: enter it in this thread
            loss = model(**inputs).loss
            loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        forwards = sum(not s.policy.endswith("(recomputed)") for s in report.segments)
        return Step(loss.detach(), grads, forwards, sum(s.stored_bytes for s in report.segments))

    return _guarded(run, what)


@functools.cache
def plain_step(name: str, attn: str, dropout: float) -> Step:
    """No checkpointing at all."""
    return train_step(model_copy(name, attn, dropout), inputs_of(name), f"{name} {attn} plain")


@functools.cache
def hf_step(name: str, attn: str, dropout: float, use_reentrant: bool) -> Step:
    """HF's own gradient checkpointing (torch.utils.checkpoint); activation_checkpointing_enable is the
    non-deprecated name of gradient_checkpointing_enable."""
    model = model_copy(name, attn, dropout)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": use_reentrant})
    return train_step(model, inputs_of(name), f"{name} {attn} HF checkpointing use_reentrant={use_reentrant}")


def fastckpt_step(name: str, attn: str, dropout: float, policy: str, **kwargs: Any) -> Step:
    model = hf.enable(model_copy(name, attn, dropout), policy=policy, **kwargs)
    assert hf.is_enabled(model)
    return train_step(model, inputs_of(name), f"{name} {attn} fastckpt {policy} {kwargs}")


@functools.cache
def checkpointed_layers(name: str, attn: str, dropout: float) -> int:
    """How many layers HF checkpoints in this model (each a GradientCheckpointingLayer)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    model = model_copy(name, attn, dropout)
    model.activation_checkpointing_enable()
    return sum(isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing for m in model.modules())


# A reference gradient below this fraction of the norm of all gradients is float32 rounding noise of a
# gradient that is zero in exact arithmetic: the key bias of attention without rotary embeddings (softmax
# cancels a per-query constant; measured 1e-18 to 3e-11 of the total here, while every real gradient of
# these models is above 6e-8). Its relative error is noise over noise, so the per-tensor bound leaves it
# out; its error still counts in the global one.
NOISE_FLOOR = 1e-9


def relative_errors(grads: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> tuple[float, float, str]:
    """Relative L2 error of all gradients together, and the worst per-tensor one with its parameter's name
    (over the parameters whose reference gradient is above NOISE_FLOOR of the total)."""
    assert grads.keys() == expected.keys()
    diff = {k: (grads[k].double() - expected[k].double()).norm().item() for k in expected}
    norm = {k: expected[k].double().norm().item() for k in expected}
    total = math.sqrt(sum(v * v for v in norm.values()))
    total_error = math.sqrt(sum(v * v for v in diff.values())) / total if total > 0 else math.nan
    per_tensor = {k: diff[k] / norm[k] for k in expected if norm[k] > NOISE_FLOOR * total}
    if not per_tensor:
        return total_error, math.nan, "(none)"
    worst = max(per_tensor, key=lambda k: (math.isnan(per_tensor[k]), per_tensor[k]))
    return total_error, per_tensor[worst], worst


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """These models are tiny: a second intra-op thread only adds synchronisation, and on a shared machine with
    few cores it makes each step 10-100x slower (measured 0.03 s vs 0.1-3 s on 2 busy cores)."""
    with num_threads(1):
        yield


# ------------------------------------------------------------------------------------ parametrization


def _cases(dropouts: list[float], extra: list[Any] | None = None) -> list[Any]:
    cases = []
    for arch in ARCHS:
        for attn in ATTENTION:
            for dropout in dropouts:
                for value in extra or [None]:
                    marks = []
                    reason = _supports(arch, attn)
                    if reason:
                        marks.append(pytest.mark.skip(reason=reason))
                    if not (arch.fast and attn == "sdpa"):
                        marks.append(pytest.mark.slow)
                    values = (arch.name, attn, dropout) + (() if extra is None else (value,))
                    ident = f"{arch.name}-{attn}-dropout{dropout:g}" + ("" if extra is None else f"-{value}")
                    cases.append(pytest.param(*values, id=ident, marks=marks))
    return cases


@pytest.mark.parametrize(("name", "attn", "dropout", "reentrant"), _cases(DROPOUTS, ["reentrant", "non-reentrant"]))
def test_recompute_bit_identical_to_hf_checkpointing(name, attn, dropout, reentrant):
    use_reentrant = reentrant == "reentrant"
    if use_reentrant and BY_NAME[name].hf_reentrant_hangs:
        # torch's reentrant checkpoint hangs here. fastckpt's finishes, and raises what torch's raises where a
        # tensor that requires grad reaches a layer outside its arguments (DeBERTa-v2): the layer's nested
        # backward runs through the graph that made it, which the outer backward then runs again.
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            fastckpt_step(name, attn, dropout, "recompute", use_reentrant=True)
        return
    else:
        try:
            expected = hf_step(name, attn, dropout, use_reentrant)
        except Exception as error:  # HF's own checkpointing cannot train this model: as a drop-in, nor can we
            with pytest.raises(type(error)) as ours:
                fastckpt_step(name, attn, dropout, "recompute", use_reentrant=use_reentrant)
            assert str(ours.value) == str(error)
            return
    ours = fastckpt_step(name, attn, dropout, "recompute", use_reentrant=use_reentrant)
    assert torch.equal(ours.loss, expected.loss), (ours.loss.item(), expected.loss.item())
    assert ours.grads.keys() == expected.grads.keys()
    different = [k for k in expected.grads if not torch.equal(ours.grads[k], expected.grads[k])]
    assert not different, f"{len(different)}/{len(expected.grads)} gradients differ, e.g. {different[:3]}"


@pytest.mark.parametrize(("name", "attn", "dropout", "policy"), _cases(DROPOUTS, STORAGE_POLICIES))
def test_storage_policy_finite(name, attn, dropout, policy):
    ours = fastckpt_step(name, attn, dropout, policy)
    plain = plain_step(name, attn, dropout)
    layers = checkpointed_layers(name, attn, dropout)
    assert ours.segments == layers, f"{ours.segments} checkpointed calls recorded, {layers} layers checkpointed"
    assert ours.stored_bytes > 0
    assert torch.isfinite(ours.loss), ours.loss.item()
    assert ours.grads.keys() == plain.grads.keys()
    bad = [k for k, g in ours.grads.items() if not torch.isfinite(g).all()]
    assert not bad, f"{len(bad)}/{len(ours.grads)} gradients not finite, e.g. {bad[:3]}"


@pytest.mark.parametrize(("name", "attn", "dropout"), _cases([0.0]))
def test_int8_gradients_close_to_no_checkpointing(name, attn, dropout):
    ours = fastckpt_step(name, attn, dropout, "int8")
    plain = plain_step(name, attn, dropout)
    assert torch.isfinite(plain.loss) and all(torch.isfinite(g).all() for g in plain.grads.values())
    assert abs(ours.loss.item() - plain.loss.item()) <= INT8_BOUND * abs(plain.loss.item())
    total, worst, worst_name = relative_errors(ours.grads, plain.grads)
    assert total <= INT8_BOUND, f"relative L2 error of all gradients {total:.3g}"
    assert worst <= INT8_TENSOR_BOUND, f"relative L2 error of {worst_name}'s gradient {worst:.3g} (all: {total:.3g})"
