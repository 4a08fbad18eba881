#pragma once
#include <pybind11/pybind11.h>

namespace fastckpt {
// Adds `reentrant_checkpoint(segment, tensors)` to the Python module (see the .cpp).
void bind_reentrant_checkpoint(pybind11::module_& m);
}  // namespace fastckpt
