// What makes the operator library importable as fastckpt._C: `import fastckpt._C` loads this shared
// object, and loading it runs the TORCH_LIBRARY blocks (registration.cpp, the kernels' files) that
// register the ops. The module init uses the Python C API alone, limited to the stable ABI
// (Py_LIMITED_API, set by setup.py), as extension-cpp does, rather than torch.ops.load_library on the
// file: the import system finds the file wherever it is installed, and the module carries the build
// facts that fastckpt/_extension.py checks and fastckpt.info prints. No pybind11, no torch/extension.h
// in this library; the autograd Function that needs them is fastckpt._reentrant (csrc/autograd/).
#include <Python.h>

#ifdef FASTCKPT_WITH_CUDA
constexpr long kWithCuda = 1;
#else
constexpr long kWithCuda = 0;
#endif

PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "fastckpt operators (torch.ops.fastckpt.*)", -1};
  PyObject* m = PyModule_Create(&module_def);
  if (m == nullptr) return nullptr;
  // Calls of the oldest limited API (torch sets Py_LIMITED_API to its oldest supported CPython).
  PyObject* with_cuda = PyBool_FromLong(kWithCuda);
  if (PyModule_AddStringConstant(m, "built_with_torch", FASTCKPT_TORCH_VERSION) < 0 ||
      PyModule_AddStringConstant(m, "cuda_archs", FASTCKPT_CUDA_ARCHS) < 0 ||
      PyModule_AddObject(m, "with_cuda", with_cuda) < 0) {  // steals with_cuda only on success
    Py_XDECREF(with_cuda);
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
