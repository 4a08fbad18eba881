"""The two native modules load, each on its own; the ops register per device; import stays CUDA-free."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt import _extension, info

NATIVE = (_extension.OPS, _extension.REENTRANT)


@pytest.mark.parametrize("name", NATIVE)
def test_native_modules_loaded_for_this_torch(name):
    assert _extension.load_error(name) is None
    assert _extension.extension(name).built_with_torch == torch.__version__


def test_each_module_holds_its_part_only():
    ops, reentrant = (_extension.extension(name) for name in NATIVE)
    assert hasattr(reentrant, "reentrant_checkpoint") and not hasattr(ops, "reentrant_checkpoint")
    assert isinstance(ops.with_cuda, bool) and isinstance(ops.cuda_archs, str)
    assert bool(ops.cuda_archs) == ops.with_cuda


def test_ops_library_does_not_link_torch_python():
    """The operator library is plain C API and ATen: only fastckpt._reentrant needs torch's Python bindings."""
    readelf = shutil.which("readelf")
    if readelf is None or sys.platform != "linux":
        pytest.skip("needs readelf on Linux")

    def needed(name):
        path = _extension.extension(name).__file__
        return subprocess.run([readelf, "-d", path], capture_output=True, text=True, check=True).stdout

    assert "libtorch_python" not in needed(_extension.OPS)
    assert "libtorch_python" in needed(_extension.REENTRANT)


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


def test_info_reports_versions_modules_and_kernels():
    text = info.report()
    assert fastckpt.__version__ in text and torch.__version__ in text
    for name in NATIVE:
        assert f"{name:<22}loaded, built for torch {torch.__version__}" in text
    assert "fastckpt::pack_bits" in text
    versions = info.integration_versions()
    assert set(versions) == set(info.INTEGRATION_PACKAGES)
    assert all(f"{name} {version or 'not installed'}" in text for name, version in versions.items())


@pytest.mark.parametrize("stale", NATIVE)
def test_mismatched_build_disables_that_module_only(monkeypatch, stale):
    class StaleBuild:
        built_with_torch = "1.0.0"

    real_import = _extension.importlib.import_module
    monkeypatch.setattr(_extension.importlib, "import_module", lambda n: StaleBuild if n == stale else real_import(n))
    try:
        for name in NATIVE:
            _extension._load(name)
        message = _extension.load_error(stale)
        assert message.startswith(f"{stale} was built for torch 1.0.0") and "make build" in message
        assert _extension.NEEDED_FOR[stale] in message
        with pytest.raises(ImportError, match="pip install --no-build-isolation") as raised:
            _extension.extension(stale)
        assert raised.value.name == stale
        (other,) = set(NATIVE) - {stale}
        assert _extension.load_error(other) is None
        assert f"{stale:<22}NOT LOADED: {message}" in info.report()
    finally:
        monkeypatch.undo()
        for name in NATIVE:
            _extension._load(name)
    assert all(_extension.load_error(name) is None for name in NATIVE)


# Each runs in a fresh interpreter where one module cannot be imported (None in sys.modules makes
# `import fastckpt._X` fail, as a missing or unloadable file does) and checks what still works.
_BIG = "x = torch.randn(64, 256, requires_grad=True); w = torch.randn(256, 256)\nf = lambda t: (t @ w).relu().sin()\n"
_WITHOUT = {
    _extension.REENTRANT: (
        "import fastckpt.ops\n"
        "with fastckpt.track() as report:\n"  # codecs run (fastckpt._C)
        "    fastckpt.checkpoint(f, x, policy='int8').sum().backward()\n"
        "assert 'int8' in report.segments[0].codecs, report\n"
        "fastckpt.checkpoint(f, x, policy='recompute:int4').sum().backward()\n"
        "fastckpt.checkpoint(f, x).sum().backward()\n"
        "try:\n"
        "    fastckpt.checkpoint(f, x, use_reentrant=True)\n"
        "except ImportError as err:\n"
        "    assert err.name == 'fastckpt._reentrant' and 'use_reentrant=True' in str(err), err\n"
        "    assert 'make build' in str(err), err\n"
        "else:\n"
        "    raise AssertionError('reentrant mode ran without fastckpt._reentrant')\n"
    ),
    _extension.OPS: (
        "fastckpt.checkpoint(f, x).sum().backward()\n"  # recomputation needs no operator
        "fastckpt.checkpoint(f, x, use_reentrant=True).sum().backward()\n"
        "fastckpt.checkpoint(f, x, policy='save').sum().backward()\n"
        "for call in (lambda: fastckpt.checkpoint(f, x, policy='int8'), lambda: __import__('fastckpt.ops')):\n"
        "    try:\n"
        "        call()\n"
        "    except ImportError as err:\n"
        "        assert err.name == 'fastckpt._C' and 'codec policies' in str(err) and 'make build' in str(err)\n"
        "    else:\n"
        "        raise AssertionError('a codec ran without fastckpt._C')\n"
    ),
}


@pytest.mark.parametrize("missing", NATIVE)
def test_a_missing_module_disables_only_what_needs_it(missing):
    (other,) = set(NATIVE) - {missing}
    code = (
        f"import sys; sys.modules[{missing!r}] = None\n"
        "import torch, fastckpt, fastckpt.info\n"
        "text = fastckpt.info.report()\n"
        f"assert {missing!r} + ' ' * {22 - len(missing)} + 'NOT LOADED' in text and 'make build' in text, text\n"
        f"assert {other!r} + ' ' * {22 - len(other)} + 'loaded' in text, text\n" + _BIG + _WITHOUT[missing]
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
