"""fastckpt.optimizer_in_backward: the parameters after each iteration are the plain loop's (bit for bit where the
optimizer allows), under clipping, accumulation, schedulers, checkpoint policies and a resumed run; what it
cannot do is refused by name; and the gradients never all exist at once."""

from __future__ import annotations

import functools
import importlib

import pytest
import torch

import fastckpt
from fastckpt.memory import peak_bytes

WIDTH = 32
# the module (the package's attribute of the same name is the function): SLICE_BYTES and _Slices, patched in tests
MODULE = importlib.import_module("fastckpt.optimizer_in_backward")


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


def plain_run(make, data, *, clip=None, accumulation=1, policy=None, reentrant=False, scheduled=False, width=WIDTH):
    model = mlp(width=width)
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


def in_backward_run(make, data, *, clip=None, accumulation=1, policy=None, reentrant=False, scheduled=False,
                    width=WIDTH):  # fmt: skip
    model = mlp(width=width)
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


SLICED = {
    **OPTIMIZERS,
    "sgd-nesterov-dampened": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, weight_decay=0.1),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    "rmsprop-centered": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5, centered=True),
    "bitsandbytes-adamw8bit": "AdamW8bit",
    "bitsandbytes-lion8bit": "Lion8bit",
}


@pytest.mark.parametrize("name", sorted(SLICED))
def test_a_large_parameter_is_stepped_in_slices_bit_for_bit(name, monkeypatch):
    """A parameter over twice SLICE_BYTES is stepped slice by slice, its state made per slice on the first step
    and gathered, then sliced: the weights and the state after three iterations are the plain loop's."""
    make = SLICED[name]
    if isinstance(make, str):
        make = functools.partial(getattr(pytest.importorskip("bitsandbytes").optim, make), lr=1e-3)
    monkeypatch.setattr(MODULE, "SLICE_BYTES", 4096 * 4)  # 128 x 128 weights: four slices of 4,096 elements
    sliced = []
    step = MODULE._Slices.step
    monkeypatch.setattr(MODULE._Slices, "step", lambda self, *a: (sliced.append(self.p), step(self, *a))[1])
    data = batches(3, width=128)
    assert_same_parameters(in_backward_run(make, data, width=128), plain_run(make, data, width=128))
    assert len(sliced) == 3 * 4  # every weight, every iteration (the biases are stepped whole)

    model, reference = mlp(width=128), mlp(width=128)
    optimizer, plain = fastckpt.optimizer_in_backward(make(model.parameters())), make(reference.parameters())
    for batch in data[:2]:
        optimizer.backward(loss_of(model, batch))
        loss_of(reference, batch).backward()
        for stepping in (optimizer, plain):
            stepping.step()
            stepping.zero_grad()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        mine, theirs = optimizer.state[p], plain.state[q]
        assert mine.keys() == theirs.keys()
        for key, value in theirs.items():
            assert torch.equal(torch.as_tensor(mine[key]), torch.as_tensor(value)), key


def test_slicing_keeps_the_step_temporaries_to_a_slice(monkeypatch):
    """AdamW's `foreach` step of a parameter makes a temporary of its size; stepped in slices, of a slice's."""
    width = 512
    model = mlp(2, width)
    x, y = torch.randn(2, width), torch.randn(2, 1)
    optimizer = fastckpt.optimizer_in_backward(torch.optim.AdamW(model.parameters(), foreach=True))

    def iteration() -> None:
        optimizer.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()

    iteration()  # the state exists
    whole = peak_bytes(iteration)
    monkeypatch.setattr(MODULE, "SLICE_BYTES", 64 << 10)
    in_slices = peak_bytes(iteration)
    weight = width * width * 4
    assert whole >= 2 * weight  # its gradient and the step's temporary of its size
    assert in_slices <= weight + weight // 2 < whole, (in_slices, whole, weight)


def test_bitsandbytes_per_parameter_settings_are_kept():
    """Trainer keeps the embeddings' 8-bit AdamW state in 32 bits through bitsandbytes' per-parameter overrides,
    which bitsandbytes finds by a parameter's group and index: each parameter is stepped at its own."""
    bnb = pytest.importorskip("bitsandbytes")
    manager = bnb.optim.GlobalOptimManager.get_instance()
    data = batches(3)
    runs = []
    try:
        for wrap in (False, True):
            manager.initialize()
            model = mlp()
            manager.register_module_override(model[1][0], "weight", {"optim_bits": 32})  # before the first step
            optimizer = bnb.optim.AdamW8bit(model.parameters(), lr=1e-2, min_8bit_size=0)
            optimizer = fastckpt.optimizer_in_backward(optimizer) if wrap else optimizer
            for batch in data:
                loss_of(model, batch).backward()  # stepped in it when wrapped
                optimizer.step()
                optimizer.zero_grad()
            runs.append((model, [optimizer.state[p]["state1"].dtype for p in model.parameters()]))
    finally:
        manager.initialize()
    (plain, plain_dtypes), (wrapped, dtypes) = runs
    assert dtypes == plain_dtypes and dtypes[:3] == [torch.uint8, torch.uint8, torch.float32]
    assert_same_parameters(wrapped, plain)


class HeadLM(torch.nn.Module):
    """An embedding, a block and fastckpt.linear_cross_entropy's head, whose weight is the embedding's when `tied`
    (as in tied LLMs; untied, the embedding is frozen)."""

    def __init__(self, tied: bool, vocab: int = 512, width: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = torch.nn.Embedding(vocab, width)
        self.block = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU())
        self.head = self.embedding.weight if tied else torch.nn.Parameter(torch.randn(vocab, width) / 8)
        self.embedding.weight.requires_grad_(tied)  # untied: the head's is the one [vocab, width] gradient

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.block(self.embedding(tokens[:, :-1]))
        return fastckpt.linear_cross_entropy(hidden, self.head, tokens[:, 1:]) * 10


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_loss_heads_gradient_is_handed_out_once_over_the_two_passes(tied, monkeypatch):
    """Exact clipping runs the backward twice; the loss head computed its weight's gradient in the forward and hands
    it out in the first (the norm pass) without a copy: held for the step, not handed out again (a tied weight's
    other gradient, the lookup's, is in what the first pass held). The weights are the plain loop's, and the
    backward makes no second gradient of the weight (its step in slices, so that its temporaries are small)."""
    g = torch.Generator().manual_seed(2)
    data = [torch.randint(0, 512, (4, 33), generator=g) for _ in range(3)]
    models = [HeadLM(tied), HeadLM(tied)]
    plain = torch.optim.AdamW(models[0].parameters(), lr=1e-2)
    wrapped = fastckpt.optimizer_in_backward(torch.optim.AdamW(models[1].parameters(), lr=1e-2), max_grad_norm=1.0)
    for tokens in data:
        models[0](tokens).backward()
        torch.nn.utils.clip_grad_norm_(models[0].parameters(), 1.0)
        wrapped.backward(models[1](tokens))
        for optimizer in (plain, wrapped):
            optimizer.step()
            optimizer.zero_grad()
    assert_same_parameters(models[1], models[0], rtol=1e-6)
    assert float(wrapped.grad_norm) > 1.0  # clipped
    if not tied:  # (a plain tied lookup's gradient is dense: as large as the weight, in the plain loop too)
        monkeypatch.setattr(MODULE, "SLICE_BYTES", 4096 * 4)
        loss = models[1](data[0])  # the head's gradient of its weight exists from here on
        peak = peak_bytes(lambda: wrapped.backward(loss))
        assert peak < models[1].head.numel() * 4, peak  # less than one more gradient of the weight


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
