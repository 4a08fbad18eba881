"""Build fastckpt's two native modules (csrc/README.md):
  fastckpt._C          the operators (csrc/ but csrc/autograd/): C++ kernels always, CUDA kernels when torch is
                       a CUDA build and nvcc exists; ATen-level headers, and Python's limited C API for the module
  fastckpt._reentrant  the reentrant checkpoint's autograd Function (csrc/autograd/): pybind11, torch/extension.h
                       and libtorch_python, so also tied to this CPython and torch's Python bindings

Environment switches:
  FASTCKPT_CUDA=1   force CUDA kernels (fail loudly if they cannot be built)
  FASTCKPT_CUDA=0   skip CUDA kernels
  TORCH_CUDA_ARCH_LIST   GPU architectures (default "8.0;8.6;8.9;9.0+PTX": A100, A10/RTX 30, L4/RTX 40, H100/H200,
                         and PTX that newer GPUs compile at load)
  MAX_JOBS          parallel compile jobs (read by torch's ninja builder)
"""

import glob
import os
import shutil
import sys

from setuptools import find_packages, setup

# torch guesses CUDA_HOME from the nvcc on PATH; a wrapper script there makes it guess wrong.
if "CUDA_HOME" not in os.environ and os.path.exists("/usr/local/cuda/bin/nvcc"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"
DEFAULT_CUDA_ARCHS = "8.0;8.6;8.9;9.0+PTX"
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)

import torch  # noqa: E402
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402


def use_cuda() -> bool:
    """Decide from torch.version.cuda and nvcc, never from the presence of a GPU."""
    switch = os.environ.get("FASTCKPT_CUDA", "")
    nvcc = CUDA_HOME and os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc"))
    available = torch.version.cuda is not None and bool(nvcc or shutil.which("nvcc"))
    if switch == "0":
        return False
    if switch == "1" and not available:
        sys.exit(
            f"FASTCKPT_CUDA=1 but CUDA kernels cannot be built: torch.version.cuda={torch.version.cuda}, "
            f"CUDA_HOME={CUDA_HOME}. Install a CUDA build of torch and the CUDA toolkit, or set FASTCKPT_CUDA=0."
        )
    return available


def cuda_wheel_includes() -> list[str]:
    """Headers shipped in nvidia-* wheels (torch's CUDA headers need cusparse.h from there)."""
    try:
        import nvidia
    except ImportError:
        return []
    return sorted(d for p in nvidia.__path__ for d in glob.glob(os.path.join(p, "*", "include")))


class BuildExt(BuildExtension.with_options(use_ninja=True)):
    def copy_extensions_to_source(self):
        """In-place builds: drop copies of a module built under another suffix. A pre-split
        fastckpt/_C.cpython-*.so would shadow the new _C.abi3.so (Python tries that suffix first)."""
        for ext in self.extensions:
            keep = self.get_ext_filename(ext.name)  # e.g. fastckpt/_C.abi3.so
            for old in glob.glob(ext.name.replace(".", os.sep) + ".*"):
                if old != keep and old.endswith((".so", ".pyd")):
                    os.remove(old)
        super().copy_extensions_to_source()


with_cuda = use_cuda()
torch_version = ("FASTCKPT_TORCH_VERSION", f'"{torch.__version__}"')
ops_sources = sorted(set(glob.glob("csrc/**/*.cpp", recursive=True)) - set(glob.glob("csrc/autograd/*.cpp")))
cuda_archs = os.environ["TORCH_CUDA_ARCH_LIST"] if with_cuda else ""
ops_options = dict(
    include_dirs=[os.path.abspath("csrc")],
    define_macros=[torch_version, ("FASTCKPT_CUDA_ARCHS", f'"{cuda_archs}"')],
    # at::parallel_for is OpenMP code inlined from torch's headers: without -fopenmp it runs on one thread.
    extra_compile_args={"cxx": ["-O3", "-fopenmp"]},
    extra_link_args=["-fopenmp"],
    py_limited_api=True,  # Py_LIMITED_API, no libtorch_python: the module init is plain C API (python_module.cpp)
)
if with_cuda:
    ops_options["include_dirs"] += cuda_wheel_includes()
    ops_options["define_macros"].append(("FASTCKPT_WITH_CUDA", "1"))
    ops_options["extra_compile_args"]["nvcc"] = ["-O3", "-lineinfo"]
    ops = CUDAExtension("fastckpt._C", ops_sources + sorted(glob.glob("csrc/**/*.cu", recursive=True)), **ops_options)
else:
    ops = CppExtension("fastckpt._C", ops_sources, **ops_options)
reentrant = CppExtension(
    "fastckpt._reentrant",
    sorted(glob.glob("csrc/autograd/*.cpp")),
    define_macros=[torch_version],
    extra_compile_args={"cxx": ["-O3"]},
)

setup(
    name="fastckpt",
    packages=find_packages(include=["fastckpt", "fastckpt.*"]),
    ext_modules=[ops, reentrant],
    cmdclass={"build_ext": BuildExt},
)
