"""The HF integration keeps its state on a model in one attribute (integrations/hf/state.py): enable adds it (and
the patches it installs), disable takes everything off; no other module sets a `_fastckpt_*` attribute."""

from __future__ import annotations

import ast
import pathlib
import sys
import types

import pytest

pytest.importorskip("transformers")

from fastckpt.integrations import hf  # noqa: E402
from fastckpt.integrations.hf import gateway, state, trl_head  # noqa: E402
from tests.integrations.test_hf import batch, tiny_llama  # noqa: E402

PACKAGE = pathlib.Path(hf.__file__).parents[2]  # fastckpt/
SOURCES = sorted(PACKAGE.rglob("*.py"))


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
    assert len(SOURCES) > 40 and any(path.name == "loss_head.py" for path in SOURCES)
    found = [
        f"{path.relative_to(PACKAGE)}:{number}"
        for path in SOURCES
        if path.name != "state.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "_fastckpt_" in line
    ]
    assert not found, found


# What gateway.py alone may name: other libraries' private attributes and code the integration reaches (and a
# frame read, which none needs: TRL's scored positions come from the labels the model is called with).
INTERNAL_NAMES = {
    "_getframe", "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_set_gradient_checkpointing", "_gradient_checkpointing_func", "_attn_implementation",
    "_can_set_attn_implementation", "_loss_function", "_hf_hook", "_old_forward", "cast_input_dtype_enabled",
    "_ChunkedLogProbFunction", "_fused_forward",
}  # fmt: skip


def _names_used(tree: ast.AST) -> set[str]:
    """Attribute names and string constants in code (docstrings aside)."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
    }  # fmt: skip
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            used.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            used.add(node.value)
    return used


def test_other_libraries_internals_are_reached_through_the_gateway_only():
    found = {
        str(path.relative_to(PACKAGE)): sorted(_names_used(ast.parse(path.read_text())) & INTERNAL_NAMES)
        for path in SOURCES
        if path.name != "gateway.py"
    }
    assert not {path: names for path, names in found.items() if names}
    gateway_names = _names_used(ast.parse((PACKAGE / "integrations/hf/gateway.py").read_text()))
    assert INTERNAL_NAMES - {"_getframe"} <= gateway_names
    assert all(entry.without and entry.feature for entry in gateway.INTERNALS.values())


def test_trl_kernel_is_given_back_when_the_last_served_model_stops(monkeypatch):
    class Kernel:  # stands in for TRL's
        pass

    utils = types.ModuleType(gateway.TRL_UTILS)
    setattr(utils, gateway.TRL_KERNEL, Kernel)
    monkeypatch.setitem(sys.modules, gateway.TRL_UTILS, utils)
    model = tiny_llama()
    hf.enable(model, loss_head=True)
    trl_head._served.add(model)  # as its backbone's pre-hook does under TRL's fused forward
    trl_head._ServedKernel.trl_kernel = Kernel
    gateway.set_trl_kernel(trl_head._ServedKernel)
    hf.disable(model)
    assert gateway.trl_kernel() is Kernel


def test_every_patch_has_the_interface_and_a_patch_without_it_is_refused_when_defined():
    from fastckpt.integrations.hf.checkpointing import PATCHES
    from fastckpt.integrations.hf.patches import Patch

    assert all(issubclass(patch, Patch) for patch in PATCHES)
    with pytest.raises(TypeError, match="Half is a Patch without install, remove"):

        class Half(Patch):
            @classmethod
            def wanted(cls, settings):
                return True
