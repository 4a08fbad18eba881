"""fastckpt.optimizer_in_backward: the parameters after each iteration are the plain loop's (bit for bit where the
optimizer allows), under clipping, accumulation, schedulers, checkpoint policies and a resumed run; what it
cannot do is refused by name; and the gradients never all exist at once."""

from __future__ import annotations

import functools

import pytest
import torch

import fastckpt
from fastckpt.memory import peak_bytes

WIDTH = 32


def mlp(layers: int = 4, width: int = WIDTH) -> torch.nn.Sequential:
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU()) for _ in range(layers)]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(width, 1))


def batches(n: int, rows: int = 8, width: int = WIDTH) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, width, generator=g), torch.randn(rows, 1, generator=g)) for _ in range(n)]


def loss_of(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor], policy: str | None = None,
            reentrant: bool = False) -> torch.Tensor:  # fmt: skip
    x, y = batch
    h = x.detach().requires_grad_(reentrant)  # a reentrant checkpoint's first block needs an input that requires grad
    for block in model[:-1]:
        h = block(h) if policy is None else fastckpt.checkpoint(block, h, policy=policy, use_reentrant=reentrant)
    return torch.nn.functional.mse_loss(model[-1](h), y) * 10  # large enough that clipping at 1.0 clips


OPTIMIZERS = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw-for-loop": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
}


def plain_run(make, data, *, clip=None, accumulation=1, policy=None, reentrant=False, scheduled=False):
    model = mlp()
    optimizer = make(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1 / (1 + i)) if scheduled else None
    for i, batch in enumerate(data):
        loss_of(model, batch, policy, reentrant).backward()
        if (i + 1) % accumulation == 0:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            optimizer.zero_grad()
    return model


def in_backward_run(make, data, *, clip=None, accumulation=1, policy=None, reentrant=False, scheduled=False):
    model = mlp()
    optimizer = fastckpt.optimizer_in_backward(
        make(model.parameters()), max_grad_norm=clip, accumulation_steps=accumulation
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1 / (1 + i)) if scheduled else None
    for i, batch in enumerate(data):
        optimizer.backward(loss_of(model, batch, policy, reentrant))
        if (i + 1) % accumulation == 0:
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            optimizer.zero_grad()
    return model


def assert_same_parameters(a: torch.nn.Module, b: torch.nn.Module, rtol: float = 0.0) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        if rtol == 0:
            assert torch.equal(p, q), name
        else:
            assert ((p - q).norm() / q.norm()).item() <= rtol, name


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_three_iterations_equal_the_plain_loops_bit_for_bit(name):
    data = batches(3)
    assert_same_parameters(in_backward_run(OPTIMIZERS[name], data), plain_run(OPTIMIZERS[name], data))


@pytest.mark.parametrize("name", ["sgd-momentum", "adamw-foreach"])
def test_clipping_by_the_global_norm_is_exact(name):
    data = batches(3)
    reference = plain_run(OPTIMIZERS[name], data, clip=1.0)
    assert_same_parameters(in_backward_run(OPTIMIZERS[name], data, clip=1.0), reference, rtol=1e-6)
    unclipped = plain_run(OPTIMIZERS[name], data)
    assert not all(torch.equal(p, q) for p, q in zip(reference.parameters(), unclipped.parameters(), strict=True))


@pytest.mark.parametrize("clip", [None, 1.0])
def test_gradient_accumulation_steps_at_the_boundary_only(clip):
    data = batches(4)
    make = OPTIMIZERS["adamw-for-loop"]
    reference = plain_run(make, data, clip=clip, accumulation=2)
    assert_same_parameters(in_backward_run(make, data, clip=clip, accumulation=2), reference, rtol=1e-6)


def test_a_scheduler_drives_the_wrapped_optimizer():
    data = batches(3)
    make = OPTIMIZERS["adam"]
    assert_same_parameters(in_backward_run(make, data, scheduled=True), plain_run(make, data, scheduled=True))


@pytest.mark.parametrize(
    "policy, reentrant",
    [("recompute", False), ("recompute", True), ("int8", False), ("recompute+int8", False),
     ("recompute:int8+int8", False), ("offload", False), ("int4+offload", False), ("recompute+offload", False)],
)  # fmt: skip
def test_every_checkpoint_policy_composes_with_clipping(policy, reentrant):
    """The norm pass and the step pass run the same backward twice (retain_graph): recomputation and stored
    codecs give both the same gradients, so the result is the plain loop's under the same policy."""
    data = batches(2)
    make = OPTIMIZERS["adamw-foreach"]
    reference = plain_run(make, data, clip=1.0, policy=policy, reentrant=reentrant)
    result = in_backward_run(make, data, clip=1.0, policy=policy, reentrant=reentrant)
    assert_same_parameters(result, reference, rtol=1e-6)


def test_a_resumed_run_continues_as_the_uninterrupted_one(tmp_path):
    data = batches(4)
    make = OPTIMIZERS["adamw-foreach"]
    uninterrupted = in_backward_run(make, data, clip=1.0)
    model = mlp()  # two iterations, then saved
    optimizer = fastckpt.optimizer_in_backward(make(model.parameters()), max_grad_norm=1.0)
    for batch in data[:2]:
        optimizer.backward(loss_of(model, batch))
        optimizer.step()
        optimizer.zero_grad()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "ckpt.pt")
    saved = torch.load(tmp_path / "ckpt.pt")
    resumed = mlp()
    resumed.load_state_dict(saved["model"])
    optimizer = fastckpt.optimizer_in_backward(make(resumed.parameters()), max_grad_norm=1.0)
    optimizer.load_state_dict(saved["optimizer"])
    for batch in data[2:]:
        optimizer.backward(loss_of(resumed, batch))
        optimizer.step()
        optimizer.zero_grad()
    assert_same_parameters(resumed, uninterrupted)


def test_the_state_dict_is_the_wrapped_optimizers():
    model = mlp()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    optimizer = fastckpt.optimizer_in_backward(inner)
    optimizer.backward(loss_of(model, batches(1)[0]))
    optimizer.step()
    state = optimizer.state_dict()
    assert state["param_groups"] == inner.state_dict()["param_groups"]
    assert sorted(state["state"]) == list(range(len(list(model.parameters()))))
    assert optimizer.param_groups is inner.param_groups and optimizer.state is inner.state


def test_the_gradients_never_all_exist_at_once():
    """Wide layers, a small batch: the plain iteration's peak holds every gradient (and foreach's temporaries);
    stepped in the backward, one layer's gradient and its step's temporaries are live besides the activations."""
    width, layers = 256, 6
    model = mlp(layers, width)
    x, y = torch.randn(2, width), torch.randn(2, 1)
    layer_bytes = (width * width + width) * 4
    all_gradients = layers * layer_bytes

    def plain() -> None:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    plain()  # the state exists before the measured iterations
    plain_peak = peak_bytes(plain)
    wrapped = fastckpt.optimizer_in_backward(optimizer, max_grad_norm=1.0)

    def stepped() -> None:
        wrapped.backward(torch.nn.functional.mse_loss(model(x), y))
        wrapped.step()
        wrapped.zero_grad()

    in_backward_peak = peak_bytes(stepped)
    assert plain_peak >= all_gradients
    # one gradient, and the optimizer's temporaries of one parameter
    assert in_backward_peak <= 3 * layer_bytes < plain_peak / 2, (in_backward_peak, plain_peak, layer_bytes)


def test_what_cannot_step_in_the_backward_is_refused_by_name():
    model = mlp()
    with pytest.raises(TypeError, match="`optimizer` must be a torch.optim.Optimizer"):
        fastckpt.optimizer_in_backward(model)
    with pytest.raises(ValueError, match="LBFGS cannot be stepped in the backward"):
        fastckpt.optimizer_in_backward(torch.optim.LBFGS(model.parameters()))
    with pytest.raises(ValueError, match="`max_grad_norm` must be a positive finite number"):
        fastckpt.optimizer_in_backward(torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=0)
    with pytest.raises(ValueError, match="`accumulation_steps` must be an int >= 1"):
        fastckpt.optimizer_in_backward(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=0)
    optimizer = fastckpt.optimizer_in_backward(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="not already stepped in the backward"):
        fastckpt.optimizer_in_backward(optimizer)
    with pytest.raises(ValueError, match="step\\(\\) takes no closure"):
        optimizer.step(lambda: 0)
    optimizer.backward(loss_of(model, batches(1)[0]))
    with pytest.raises(RuntimeError, match="a second backward ran before optimizer.step\\(\\).*accumulation_steps=N"):
        loss_of(model, batches(1)[0]).backward()


def test_fp16_loss_scaling_is_refused():
    model = mlp()
    optimizer = fastckpt.optimizer_in_backward(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(loss_of(model, batches(1)[0])).backward()
    with pytest.raises(RuntimeError, match="fp16 loss scaling \\(torch.amp.GradScaler\\) is not supported"):
        scaler.step(optimizer)


def test_a_plain_backward_with_clipping_keeps_the_gradients_and_says_so():
    data = batches(2)
    make = OPTIMIZERS["sgd-momentum"]
    model = mlp()
    optimizer = fastckpt.optimizer_in_backward(make(model.parameters()), max_grad_norm=1.0)
    with pytest.warns(UserWarning, match="call optimizer.backward\\(loss\\) instead"):
        for batch in data:
            loss_of(model, batch).backward()
            assert all(p.grad is not None for p in model.parameters())
            optimizer.step()
            optimizer.zero_grad()
    assert_same_parameters(model, plain_run(make, data, clip=1.0))


def test_bitsandbytes_8bit_adamw_composes_and_its_state_is_counted():
    """A library's low-bit optimizer state (bitsandbytes' AdamW8bit: two bytes per parameter) steps in the
    backward as it would after it, and the planner's device totals count that state exactly."""
    bnb = pytest.importorskip("bitsandbytes")
    from fastckpt.planner.budgets import Resident

    make = functools.partial(bnb.optim.AdamW8bit, lr=1e-2, min_8bit_size=0)
    data = batches(3)
    reference = plain_run(make, data, clip=1.0)
    assert_same_parameters(in_backward_run(make, data, clip=1.0), reference, rtol=1e-6)
    model = mlp()
    optimizer = fastckpt.optimizer_in_backward(make(model.parameters()))
    optimizer.backward(loss_of(model, data[0]))
    optimizer.step()
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    counted = Resident.measure(model, torch.device("cpu"), optimizer).optimizer
    assert counted == sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in state}.values())
    assert counted < sum(p.numel() for p in model.parameters()) * 3  # about 2 bytes per parameter, not 8


def test_several_ranks_are_refused_with_the_reason(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    with pytest.raises(ValueError, match="reduce a gradient across ranks after its accumulation hook fires"):
        fastckpt.optimizer_in_backward(torch.optim.SGD(mlp().parameters(), lr=0.1))


def test_a_gradient_arriving_in_two_parts_is_refused():
    """A block used twice, each use its own reentrant checkpoint: its weights' gradient accumulates in two nested
    backwards, so the first part would be stepped alone; the second part's arrival is an error."""
    model = mlp()
    block = model[0]
    fastckpt.optimizer_in_backward(torch.optim.SGD(model.parameters(), lr=0.1))
    x = batches(1)[0][0].requires_grad_()
    h = fastckpt.checkpoint(block, x, use_reentrant=True)
    h = fastckpt.checkpoint(block, h, use_reentrant=True)
    with pytest.raises(RuntimeError, match="arrives in parts within one backward .*use use_reentrant=False"):
        model[-1](h).sum().backward()
