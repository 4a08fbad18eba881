"""Loads fastckpt's two native modules, each on its own, and explains, with the fix, why one did not load.

fastckpt._C          the operators (torch.ops.fastckpt.*: quantize, bitpack) behind the codec policies and
                     fastckpt.ops; ATen-level kernels and a Python C API module init (csrc/python_module.cpp)
fastckpt._reentrant  the autograd Function behind use_reentrant=True; pybind11 and torch's C++ autograd API

Each is imported on first use (_C at `import fastckpt`, which registers the ops' fake kernels when it loaded).
One that is missing, fails to import or was built for another torch disables only what needs it: asking for
it raises ImportError (`name` is the module) with the reason and the rebuild command. Non-reentrant
checkpointing with policies that store no codec (recompute, save, offload) needs neither module.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

OPS = "fastckpt._C"
REENTRANT = "fastckpt._reentrant"
NEEDED_FOR = {
    OPS: "the codec policies (int8, fp8, int4, int2, masks) and fastckpt.ops",
    REENTRANT: "use_reentrant=True",
}
REBUILD_HINT = "Rebuild against the torch you have: `make build`, or `pip install --no-build-isolation -e .`"

_modules: dict[str, ModuleType] = {}
_errors: dict[str, str] = {}


def _load(name: str) -> None:
    """(Re)try importing `name` and checking the torch it was built for."""
    _modules.pop(name, None)
    _errors.pop(name, None)
    needs = f"Without it {NEEDED_FOR[name]} cannot run; the rest of fastckpt works. {REBUILD_HINT}"
    try:
        module = importlib.import_module(name)
    except ImportError as err:
        _errors[name] = (
            f"{name} could not be loaded ({err}). It is missing, or was built against another torch than the "
            f"installed {torch.__version__}. {needs}"
        )
        return
    built = getattr(module, "built_with_torch", "an unknown version")
    if built != torch.__version__:
        # Both modules use libtorch's C++ API (at::Tensor, the dispatcher), which is not ABI-stable across releases.
        _errors[name] = f"{name} was built for torch {built}, you have torch {torch.__version__}. {needs}"
        return
    _modules[name] = module


def load_error(name: str = OPS) -> str | None:
    """Why the native module `name` is unavailable, or None when it loaded."""
    if name not in _modules and name not in _errors:
        _load(name)
    return _errors.get(name)


def extension(name: str = OPS) -> ModuleType:
    """The loaded native module `name`; raises ImportError with the rebuild command when it is unavailable."""
    error = load_error(name)
    if error is not None:
        raise ImportError(error, name=name)
    return _modules[name]
