"""hf.enable(optimizer_in_backward=True) under transformers' Trainer (and TRL's SFTTrainer): the trained weights,
the losses and the logged gradient norms are the plain Trainer's with its clipping, accumulation and scheduler,
a tied embedding included; the iteration's peak drops by the gradients; fp16 is refused."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fastckpt  # noqa: E402
from fastckpt.integrations import hf  # noqa: E402
from fastckpt.integrations.hf.trainer import innermost  # noqa: E402
from tests.integrations.test_hf import tiny_llama  # noqa: E402
from tests.integrations.test_hf_budget import _IterationTotals, sample  # noqa: E402


def tied_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    model = tiny_llama()
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    return model


class _Logged(transformers.TrainerCallback):
    def __init__(self) -> None:
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def train(tmp_path, model, *, in_backward: bool, steps: int = 3, scaler=None, reentrant=False, **arguments):
    hf.enable(model, loss_head=True, optimizer_in_backward=in_backward, use_reentrant=reentrant)
    data = [{k: v[i] for k, v in sample().items()} for _ in range(steps * 2) for i in range(2)]
    settings = {"max_steps": steps, "per_device_train_batch_size": 2, "use_cpu": True, "report_to": [],
                "save_strategy": "no", "disable_tqdm": True, "logging_steps": 1, "learning_rate": 1e-3,
                "lr_scheduler_type": "linear", "max_grad_norm": 1.0, **arguments}  # fmt: skip
    logged, totals = _Logged(), _IterationTotals()
    trainer = transformers.Trainer(
        model=model,
        args=transformers.TrainingArguments(output_dir=str(tmp_path), **settings),
        train_dataset=data,
        callbacks=[logged, totals],
    )
    if scaler is not None:  # what fp16=True gives on a GPU
        trainer.accelerator.scaler = scaler
    trainer.train()
    trainer.iteration_totals = totals.totals  # the device total of each iteration after the first
    return trainer, [log for log in logged.logs if "loss" in log]


def assert_close_parameters(a: torch.nn.Module, b: torch.nn.Module, rtol: float) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert ((p - q).norm() / q.norm()).item() <= rtol, name


@pytest.mark.parametrize(
    "make, arguments",
    [
        (tiny_llama, {}),
        (tied_llama, {}),
        (tiny_llama, {"gradient_accumulation_steps": 2}),
        (tiny_llama, {"max_grad_norm": 0.0}),
        (tiny_llama, {"reentrant": True}),
    ],
    ids=["clipped", "tied-embedding", "accumulation", "unclipped", "reentrant"],
)
def test_the_trainer_run_is_the_plain_trainers(tmp_path, make, arguments):
    torch.manual_seed(0)
    plain_model = make()
    torch.manual_seed(0)
    model = make()
    plain, plain_logs = train(tmp_path / "plain", plain_model, in_backward=False, **arguments)
    trainer, logs = train(tmp_path / "in_backward", model, in_backward=True, **arguments)
    handle = hf.trainer._StepInBackward.wrapper(model)  # the wrapper Trainer's optimizer steps
    assert isinstance(handle, fastckpt.OptimizerInBackward) and trainer.optimizer.optimizer is handle
    assert handle.accumulation_steps == arguments.get("gradient_accumulation_steps", 1)
    assert_close_parameters(model, plain_model, 1e-5)
    assert len(logs) == len(plain_logs) == 3
    for log, expected in zip(logs, plain_logs, strict=True):
        assert log["learning_rate"] == expected["learning_rate"]
        assert log["loss"] == pytest.approx(expected["loss"], rel=1e-5)
        assert log["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
    # the gradients (as many bytes as the weights) no longer all live at once; with accumulation they are kept
    # between micro-steps, as in the plain loop (no more than its peak)
    gradients = sum(p.numel() * p.element_size() for p in model.parameters())
    saved = 0 if "gradient_accumulation_steps" in arguments else gradients / 3
    assert max(trainer.iteration_totals) <= min(plain.iteration_totals) - saved
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    hf.disable(model)
    assert trainer.optimizer.optimizer is handle.optimizer and "backward" not in trainer.accelerator.__dict__


def test_without_a_trainer_the_keyword_names_the_wrapper():
    model = hf.enable(tiny_llama(), optimizer_in_backward=True).train()
    with pytest.raises(ValueError, match=r"fastckpt.optimizer_in_backward\(optimizer, max_grad_norm="):
        model(**sample())


def test_fp16_is_refused(tmp_path):
    """A GradScaler (Trainer's fp16=True) would be handed gradients already stepped with: refused by name."""
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="fp16 training \\(a GradScaler\\) cannot step in the backward"):
        train(tmp_path, tiny_llama(), in_backward=True, steps=1, scaler=torch.amp.GradScaler("cpu"))


def test_trainers_8bit_adamw_keeps_its_32_bit_embeddings(tmp_path):
    """Trainer's `optim="adamw_bnb_8bit"` keeps the embeddings' state in 32 bits (a bitsandbytes per-parameter
    override, found by the parameter's group and index): stepped in the backward, the same state and weights."""
    bnb = pytest.importorskip("bitsandbytes")
    runs = []
    try:
        for in_backward in (False, True):
            bnb.optim.GlobalOptimManager.get_instance().initialize()  # Trainer registers its overrides anew
            torch.manual_seed(0)
            model = tiny_llama()
            trainer, logs = train(tmp_path / str(in_backward), model, in_backward=in_backward, optim="adamw_bnb_8bit",
                                  learning_rate=1e-2)  # fmt: skip
            optimizer = innermost(trainer.optimizer)  # the bitsandbytes optimizer, under the wrappers
            runs.append((model, {name: optimizer.state[p]["state1"].dtype for name, p in model.named_parameters()},
                         [log["loss"] for log in logs]))  # fmt: skip
    finally:
        bnb.optim.GlobalOptimManager.get_instance().initialize()
    (plain, plain_dtypes, plain_losses), (model, dtypes, losses) = runs
    assert dtypes == plain_dtypes and dtypes["model.embed_tokens.weight"] == torch.float32
    assert torch.uint8 in dtypes.values()
    assert losses == pytest.approx(plain_losses, rel=1e-5)
    assert_close_parameters(model, plain, 1e-5)
