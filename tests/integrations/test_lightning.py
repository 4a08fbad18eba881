"""PyTorch Lightning: a LightningModule that builds its Hugging Face model in `configure_model` and enables
fastckpt with a budget there plans on the first training batch, under Lightning's bf16 autocast, and trains
exactly as the same policies applied by hand."""

from __future__ import annotations

import pytest
import torch

L = pytest.importorskip("lightning")
pytest.importorskip("transformers")

from fastckpt.integrations import hf  # noqa: E402
from tests.integrations.test_hf import LAYERS, tiny_llama  # noqa: E402
from tests.integrations.test_hf_budget import FAST, sample  # noqa: E402


class LitLlama(L.LightningModule):
    """The model made in configure_model (idempotent, as Lightning asks), fastckpt enabled on it there."""

    def __init__(self, **enable) -> None:
        super().__init__()
        self.enable = enable
        self.model = None
        self.losses: list[torch.Tensor] = []

    def configure_model(self) -> None:
        if self.model is not None:
            return
        torch.manual_seed(0)
        self.model = hf.enable(tiny_llama(), **self.enable)

    def training_step(self, batch: dict, index: int) -> torch.Tensor:
        torch.manual_seed(5 + index)  # attention dropout: both runs draw the same masks
        loss = self.model(**batch).loss
        self.losses.append(loss.detach().float())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(module: LitLlama, steps: int = 3) -> LitLlama:
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        precision="bf16-mixed",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = torch.utils.data.DataLoader([sample()] * steps, batch_size=None)
    trainer.fit(module, data)
    return module


def test_a_budget_enabled_in_configure_model_plans_on_the_first_batch():
    planned = fit(LitLlama(budget="100%", plan_options=FAST))
    reference = fit(LitLlama(policy="recompute"))
    plan = hf.planned(planned.model)
    assert plan is not None and plan.applied and plan.policies == ["recompute"] * LAYERS
    assert plan.measured_peak <= plan.budget
    assert len(planned.losses) == 3 and all(torch.isfinite(loss) for loss in planned.losses)
    # planning ran inside the first training forward, then that step went on as the reference's did
    assert all(torch.equal(a, b) for a, b in zip(planned.losses, reference.losses, strict=True))
    for a, b in zip(planned.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)
