// The Python module fastckpt._C. Operators register through TORCH_LIBRARY when the library
// loads; this file adds the build facts that fastckpt.info and the loader check, and the
// reentrant checkpoint Function.
#include <pybind11/pybind11.h>

#include "autograd/reentrant_checkpoint.h"

#ifdef FASTCKPT_WITH_CUDA
constexpr bool kWithCuda = true;
#else
constexpr bool kWithCuda = false;
#endif

PYBIND11_MODULE(_C, m) {
  m.doc() = "fastckpt compiled kernels";
  m.attr("built_with_torch") = FASTCKPT_TORCH_VERSION;
  m.attr("with_cuda") = kWithCuda;
  m.attr("cuda_archs") = FASTCKPT_CUDA_ARCHS;
  fastckpt::bind_reentrant_checkpoint(m);
}
