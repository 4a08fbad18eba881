"""`python -m fastckpt.info`: versions, the native modules' status, and which kernels exist per device."""

from __future__ import annotations

from importlib import metadata

import torch

import fastckpt
from fastckpt import _compat, _extension
from fastckpt.integrations.hf import gateway

DISPATCH_KEYS = ("CPU", "CUDA")
INTEGRATION_PACKAGES = ("transformers", "peft", "accelerate", "deepspeed")  # see fastckpt.integrations


def integration_versions() -> dict[str, str | None]:
    """Installed version of each package an integration works with (None: not installed); imports none."""
    versions: dict[str, str | None] = {}
    for package in INTEGRATION_PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def registered_ops() -> list[str]:
    """Names of all operators in the fastckpt namespace (empty when fastckpt._C was not imported)."""
    all_op_names = _compat.require("dispatch_get_all_op_names")
    return sorted(name for name in all_op_names() if name.startswith("fastckpt::"))


def kernels_by_op() -> dict[str, dict[str, bool]]:
    """For each fastckpt op, whether a kernel is registered per dispatch key."""
    has_kernel = _compat.require("dispatch_has_kernel_for_dispatch_key")
    return {op: {key: has_kernel(op, key) for key in DISPATCH_KEYS} for op in registered_ops()}


def module_status() -> dict[str, str]:
    """Each native module (fastckpt._extension.NEEDED_FOR) and whether it loaded, for which torch, and what it runs."""
    status = {}
    for name, needed_for in _extension.NEEDED_FOR.items():
        error = _extension.load_error(name)
        built = None if error else _extension.extension(name).built_with_torch
        status[name] = f"NOT LOADED: {error}" if error else f"loaded, built for torch {built}: {needed_for}"
    return status


def report() -> str:
    """The text that `python -m fastckpt.info` prints."""
    lines = [
        f"{'fastckpt':<22}{fastckpt.__version__}",
        f"{'torch':<22}{torch.__version__} (CUDA {torch.version.cuda or 'none'})",
        f"{'integrations':<22}"
        + ", ".join(f"{name} {version or 'not installed'}" for name, version in integration_versions().items()),
    ]
    lines += [f"{name:<22}{status}" for name, status in module_status().items()]
    lines += ["", "HF integration: other libraries' internals it reaches (fastckpt/integrations/hf/gateway.py)"]
    lines += [f"  {line}" for line in gateway.report()]
    lines.append("")
    if _extension.load_error(_extension.OPS):
        return "\n".join(lines)
    ext = _extension.extension(_extension.OPS)
    lines += [
        f"{'CUDA kernels':<22}{'compiled for sm ' + ext.cuda_archs if ext.with_cuda else 'not compiled'}",
        # Asking for the GPU count initialises CUDA only here, never at `import fastckpt`.
        f"{'GPUs visible':<22}{torch.cuda.device_count() if torch.cuda.is_available() else 0}",
    ]
    try:
        kernels = kernels_by_op()
    except RuntimeError as error:  # a torch without the dispatcher queries (fastckpt._compat)
        return "\n".join([*lines, "", str(error)])
    width = max([32, *(len(op) + 2 for op in kernels)])
    lines += ["", f"{'op':<{width}}" + "".join(f"{key:>6}" for key in DISPATCH_KEYS)]
    for op, keys in kernels.items():
        lines.append(f"{op:<{width}}" + "".join(f"{'yes' if has else '-':>6}" for has in keys.values()))
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
