"""`python -m fastckpt.info`: versions, build facts and which kernels exist per device."""

from __future__ import annotations

from importlib import metadata

import torch

import fastckpt
from fastckpt import _extension

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
    """Names of all operators in the fastckpt namespace (empty when _C did not load)."""
    return sorted(name for name in torch._C._dispatch_get_all_op_names() if name.startswith("fastckpt::"))


def kernels_by_op() -> dict[str, dict[str, bool]]:
    """For each fastckpt op, whether a kernel is registered per dispatch key."""
    return {
        op: {key: torch._C._dispatch_has_kernel_for_dispatch_key(op, key) for key in DISPATCH_KEYS}
        for op in registered_ops()
    }


def report() -> str:
    """The text that `python -m fastckpt.info` prints."""
    lines = [
        f"fastckpt        {fastckpt.__version__}",
        f"torch           {torch.__version__} (CUDA {torch.version.cuda or 'none'})",
        "integrations    "
        + ", ".join(f"{name} {version or 'not installed'}" for name, version in integration_versions().items()),
    ]
    error = _extension.load_error()
    if error:
        lines.append(f"fastckpt._C     NOT LOADED: {error}")
        return "\n".join(lines)
    ext = _extension.extension()
    lines += [
        f"fastckpt._C     loaded, built for torch {ext.built_with_torch}",
        f"CUDA kernels    {'compiled for sm ' + ext.cuda_archs if ext.with_cuda else 'not compiled'}",
        # Asking for the GPU count initialises CUDA only here, never at `import fastckpt`.
        f"GPUs visible    {torch.cuda.device_count() if torch.cuda.is_available() else 0}",
        "",
        f"{'op':<32}" + "".join(f"{key:>6}" for key in DISPATCH_KEYS),
    ]
    for op, keys in kernels_by_op().items():
        lines.append(f"{op:<32}" + "".join(f"{'yes' if has else '-':>6}" for has in keys.values()))
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
