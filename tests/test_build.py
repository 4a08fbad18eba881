"""The compiled extension is present, registers its ops per device, and import stays CUDA-free."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt import _extension, info


def test_extension_loaded_for_this_torch():
    assert _extension.load_error() is None
    assert _extension.extension().built_with_torch == torch.__version__


@pytest.mark.parametrize(
    "op",
    [
        "fastckpt::pack_bits",
        "fastckpt::unpack_bits",
        "fastckpt::quantize_per_group",
        "fastckpt::dequantize_per_group",
        "fastckpt::quantize_fp8_per_group",
        "fastckpt::dequantize_fp8_per_group",
    ],
)
def test_ops_have_cpu_kernels_and_cuda_kernels_when_compiled(op):
    kernels = info.kernels_by_op()
    assert op in kernels
    assert kernels[op]["CPU"]
    assert kernels[op]["CUDA"] == _extension.extension().with_cuda


def test_every_registered_op_has_a_cpu_kernel():
    assert info.registered_ops(), "no fastckpt ops registered"
    assert all(keys["CPU"] for keys in info.kernels_by_op().values())


def test_import_does_not_initialise_cuda():
    code = "import torch, fastckpt, fastckpt.ops; assert not torch.cuda.is_initialized(), 'CUDA initialised'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_info_reports_versions_and_kernels():
    text = info.report()
    assert fastckpt.__version__ in text and torch.__version__ in text
    assert "fastckpt::pack_bits" in text
    versions = info.integration_versions()
    assert set(versions) == set(info.INTEGRATION_PACKAGES)
    assert all(f"{name} {version or 'not installed'}" in text for name, version in versions.items())


def test_mismatched_build_is_reported_with_rebuild_command(monkeypatch):
    class StaleBuild:
        built_with_torch = "1.0.0"

    monkeypatch.setattr(_extension.importlib, "import_module", lambda name: StaleBuild)
    monkeypatch.setattr(_extension, "_module", None)
    _extension._load()
    try:
        message = _extension.load_error()
        assert "built for torch 1.0.0" in message and "make build" in message
        with pytest.raises(ImportError, match="pip install --no-build-isolation"):
            _extension.extension()
    finally:
        monkeypatch.undo()
        _extension._load()
    assert _extension.load_error() is None


def test_package_imports_without_the_compiled_library():
    code = (
        "import sys; sys.modules['fastckpt._C'] = None\n"  # makes `import fastckpt._C` fail
        "import torch, fastckpt, fastckpt.info\n"
        "assert 'NOT LOADED' in fastckpt.info.report() and 'make build' in fastckpt.info.report()\n"
        "x = torch.randn(3, requires_grad=True)\n"
        "fastckpt.checkpoint(torch.sin, x).sum().backward()\n"  # the pure-Python engine still works
        "try:\n"
        "    fastckpt.checkpoint(torch.sin, x, use_reentrant=True)\n"
        "except ImportError as err:\n"
        "    assert 'make build' in str(err)\n"
        "else:\n"
        "    raise AssertionError('reentrant mode ran without fastckpt._C')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


ROOT = Path(__file__).resolve().parents[1]


def test_one_version_source():
    built = subprocess.run(
        [sys.executable, "setup.py", "--version"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()[-1]
    assert built == fastckpt.__version__
    assert fastckpt.__version__ not in (ROOT / "pyproject.toml").read_text()
    assert fastckpt.__version__ not in (ROOT / "setup.py").read_text()


def test_unknown_pytest_markers_are_errors(tmp_path):
    (tmp_path / "test_typo.py").write_text("import pytest\n\n@pytest.mark.cdua\ndef test_x():\n    pass\n")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-c",
            str(ROOT / "pyproject.toml"),
            "--rootdir",
            str(tmp_path),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0 and "'cdua' not found in `markers`" in result.stdout + result.stderr


def test_default_cuda_architectures_cover_ampere_to_hopper_with_ptx():
    """Built for 9.0 only, the kernels would not load on an A100, L4 or RTX card."""
    import ast

    tree = ast.parse((ROOT / "setup.py").read_text())
    (default,) = [
        node.value.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "DEFAULT_CUDA_ARCHS" for t in node.targets)
    ]
    archs = default.replace(" ", ";").split(";")
    assert {"8.0", "8.6", "8.9"} <= {a.removesuffix("+PTX") for a in archs}
    assert archs[-1].endswith("+PTX") and archs[-1].removesuffix("+PTX") == max(a.removesuffix("+PTX") for a in archs)
    assert "TORCH_CUDA_ARCH_LIST" not in (ROOT / "Makefile").read_text()  # the default reaches `make test` users
