"""The HF integration keeps its state on a model in one attribute (integrations/hf/state.py): enable adds it (and
the patches it installs), disable takes everything off; no other module sets a `_fastckpt_*` attribute."""

from __future__ import annotations

import pathlib

import pytest

pytest.importorskip("transformers")

from fastckpt.integrations import hf  # noqa: E402
from fastckpt.integrations.hf import state  # noqa: E402
from tests.integrations.test_hf import batch, tiny_llama  # noqa: E402

PACKAGE = pathlib.Path(hf.__file__).parents[2]


def test_enable_keeps_one_state_attribute_and_disable_restores_the_model():
    model = tiny_llama()
    before = dict(model.__dict__)
    hf.enable(model, "recompute+int8", loss_head=True, padded_attention=True, budget=None)
    model.train()
    model(input_ids=batch(), labels=batch()).loss.backward()
    added = set(model.__dict__) - set(before)
    # and transformers' own: its input-embedding hook that makes the checkpointed layers' inputs require grad
    assert added == {state.ATTRIBUTE, "activation_checkpointing_enable", "forward", "_require_grads_hooks"}, added
    kept = state.read(model)
    assert kept.settings is not None and kept.loss_head
    hf.disable(model)
    left = set(model.__dict__) - set(before)
    assert left <= {"_require_grads_hooks"} and not getattr(model, "_require_grads_hooks", []), left  # no live hook
    assert all(model.__dict__[name] is value for name, value in before.items() if name != "_modules")


def test_no_module_but_the_state_module_names_a_fastckpt_attribute():
    found = [
        f"{path.relative_to(PACKAGE)}:{number}"
        for path in sorted((PACKAGE / "fastckpt").rglob("*.py"))
        if path.name != "state.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "_fastckpt_" in line
    ]
    assert not found, found
