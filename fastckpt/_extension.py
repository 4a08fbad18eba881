"""Loads the compiled library fastckpt._C and explains, with the fix, why it did not load."""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

REBUILD_HINT = "Rebuild it against the torch you have: `make build`, or `pip install --no-build-isolation -e .`"

_module: ModuleType | None = None
_load_error: str | None = None


def _load() -> None:
    global _module, _load_error
    _module, _load_error = None, None
    try:
        module = importlib.import_module("fastckpt._C")
    except ImportError as err:
        _load_error = (
            f"fastckpt._C could not be loaded ({err}). It is missing, or was built against another "
            f"torch than the installed {torch.__version__}. {REBUILD_HINT}"
        )
        return
    if module.built_with_torch != torch.__version__:
        _load_error = (
            f"fastckpt._C was built for torch {module.built_with_torch}, you have torch {torch.__version__}. "
            f"{REBUILD_HINT}"
        )
        return
    _module = module


def load_error() -> str | None:
    """Why _C is unavailable, or None when it loaded."""
    return _load_error


def extension() -> ModuleType:
    """The loaded fastckpt._C module; raises ImportError with the rebuild command when unavailable."""
    if _module is None:
        raise ImportError(_load_error)
    return _module


_load()
