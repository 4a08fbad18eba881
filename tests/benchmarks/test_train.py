"""benchmarks/train.py: the planned row measures, plans, applies and trains (a few steps, real corpus)."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks import train as bench
from fastckpt import CheckpointWrapper


def test_planned_row_applies_a_plan_and_trains(monkeypatch):
    monkeypatch.setattr(bench, "PLAN_CANDIDATES", ["none", "recompute", "int8"])  # fewer to measure: faster
    cpu = torch.device("cpu")
    text = bench.corpus(cpu)
    val = bench.batches(text[-100_000:], 1, 4, 64, seed=2)
    row = bench.train(bench.Planned(0.5), text[:-100_000], val, steps=2, device=cpu)
    assert row["policy"] == "plan 50%" and math.isfinite(row["final_train_loss"]) and math.isfinite(row["val_loss"])
    assert row["note"].startswith("plan 50%: budget ") and "blocks: " in row["note"]
    assert "of stock's peak" in row["note"]


def test_apply_plan_wraps_the_blocks_or_says_the_budget_was_infeasible():
    torch.manual_seed(0)
    model = bench.CharGPT(dim=64, layers=3, heads=2, seq=32)
    tokens = torch.randint(0, 256, (4, 33))
    budget, chosen = bench.apply_plan(model, tokens, 0.3)  # far below what recomputation alone reaches
    assert "(30% is infeasible)" in budget
    policies = chosen.split(", ")
    assert len(policies) == 3
    assert [isinstance(b, CheckpointWrapper) for b in model.blocks] == [p != "none" for p in policies]


def test_lora_job_trains_on_padded_batches():
    tokens = torch.randint(0, 256, (8, 33))
    batch = bench.padded(tokens, torch.Generator().manual_seed(0))
    lengths = batch["attention_mask"].sum(1)
    assert ((lengths >= 16) & (lengths <= 33)).all() and (lengths < 33).any()
    assert torch.equal(batch["labels"] == -100, batch["attention_mask"] == 0)
    cpu = torch.device("cpu")
    text = bench.corpus(cpu)
    val = bench.batches(text[-100_000:], 1, 4, 64, seed=2)
    name = "fastckpt recompute:int8+int8 + loss head + padded attention"
    row = bench.train_lora(name, text[:-100_000], val, steps=2, device=cpu)
    assert row["policy"] == name and math.isfinite(row["final_train_loss"]) and math.isfinite(row["val_loss"])


def test_the_optimizer_stepped_in_the_backward_trains_as_the_plain_loop():
    """Two steps with clipping at 1.0: stepped in the backward, the losses are the plain loop's."""
    cpu = torch.device("cpu")
    text = bench.corpus(cpu)
    val = bench.batches(text[-100_000:], 1, 2, 64, seed=2)
    rows = [bench.train(policy, text[:-100_000], val, 3, cpu, 1.0, in_backward, name)
            for name, (policy, in_backward) in list(bench.CLIPPED.items())[:2]]  # fmt: skip
    assert [row["policy"] for row in rows] == list(bench.CLIPPED)[:2]
    assert rows[1]["final_train_loss"] == pytest.approx(rows[0]["final_train_loss"], rel=1e-5)
    assert rows[1]["val_loss"] == pytest.approx(rows[0]["val_loss"], rel=1e-5)
