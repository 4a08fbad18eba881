// The Python module fastckpt._reentrant (this file is all of it): the reentrant checkpoint, a C++
// autograd Function whose node stores the segment's tensor inputs (as SavedVariables, so version
// counters and any active saved-tensor hooks apply) and, in backward, re-runs the Python segment
// with grad enabled and runs a nested backward through it.
//
// The Python side (fastckpt/engine/reentrant.py) passes a `segment` object with two methods,
// each taking and returning a flat list of tensors:
//   forward(inputs)    run the function (grad is off here), capturing RNG/autocast state first
//   recompute(inputs)  replay that state and run the function again with grad on
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/extension.h>

namespace py = pybind11;

namespace fastckpt {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Owns the Python segment object. The autograd engine may drop the node, and with it this holder,
// on a thread that does not hold the GIL.
struct PythonSegment : torch::CustomClassHolder {
  explicit PythonSegment(py::object segment) : segment_(std::move(segment)) {}
  ~PythonSegment() override {
    if (!Py_IsInitialized()) {
      segment_.release();  // interpreter already gone: leak rather than touch it
      return;
    }
    py::gil_scoped_acquire gil;
    segment_ = py::object();
  }

  variable_list call(const char* method, const variable_list& tensors) {
    py::gil_scoped_acquire gil;
    return segment_.attr(method)(tensors).cast<variable_list>();
  }

 private:
  py::object segment_;
};

struct ReentrantCheckpoint : public torch::autograd::Function<ReentrantCheckpoint> {
  static variable_list forward(AutogradContext* ctx, const c10::intrusive_ptr<PythonSegment>& segment,
                               at::TensorList inputs) {
    ctx->saved_data["segment"] = c10::IValue::make_capsule(segment);
    ctx->save_for_backward(inputs.vec());
    variable_list outputs = segment->call("forward", inputs.vec());
    variable_list non_differentiable;
    for (const auto& out : outputs) {
      if (out.defined() && !at::isFloatingType(out.scalar_type()) && !at::isComplexType(out.scalar_type())) {
        non_differentiable.push_back(out);
      }
    }
    ctx->mark_non_differentiable(non_differentiable);
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    TORCH_CHECK(torch::autograd::Engine::get_default_engine().is_checkpoint_valid(),
                "When use_reentrant=True, torch.utils.checkpoint is incompatible with .grad() or passing an `inputs` "
                "parameter to .backward(). To resolve this error, you can either set use_reentrant=False, or call "
                ".backward() without passing the `inputs` argument.");
    auto segment = c10::static_intrusive_pointer_cast<PythonSegment>(ctx->saved_data["segment"].toCapsule());
    variable_list detached;
    for (const auto& saved : ctx->get_saved_variables()) {
      auto leaf = saved.detach();
      leaf.set_requires_grad(saved.requires_grad());
      detached.push_back(std::move(leaf));
    }

    variable_list outputs;
    try {
      outputs = segment->call("recompute", detached);
    } catch (py::error_already_set& err) {
      // Hand the Python exception to the autograd engine intact, so the caller sees its own type.
      py::gil_scoped_acquire gil;
      err.restore();
      python_error carried;
      carried.persist();
      throw carried;
    }
    TORCH_CHECK(outputs.size() == grad_outputs.size(), "checkpoint: the recomputation returned ", outputs.size(),
                " tensors but the forward returned ", grad_outputs.size());

    variable_list roots, grads;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].defined() && outputs[i].requires_grad()) {
        roots.push_back(outputs[i]);
        grads.push_back(grad_outputs[i]);
      }
    }
    TORCH_CHECK(!roots.empty(), "none of output has requires_grad=True, this checkpoint() is not necessary");
    torch::autograd::backward(roots, grads);

    variable_list input_grads{at::Tensor()};  // the segment argument has no gradient
    for (const auto& leaf : detached) input_grads.push_back(leaf.grad());
    return input_grads;
  }
};

}  // namespace
}  // namespace fastckpt

// pybind11 and torch's autograd headers tie this module to the exact torch build (and CPython) it was
// compiled for; the loader (fastckpt/_extension.py) checks built_with_torch before using it.
PYBIND11_MODULE(_reentrant, m) {
  m.doc() = "fastckpt's reentrant checkpoint (the autograd Function behind use_reentrant=True)";
  m.attr("built_with_torch") = FASTCKPT_TORCH_VERSION;
  m.def(
      "reentrant_checkpoint",
      [](py::object segment, const torch::autograd::variable_list& inputs) {
        auto holder = c10::make_intrusive<fastckpt::PythonSegment>(std::move(segment));
        return fastckpt::ReentrantCheckpoint::apply(holder, at::TensorList(inputs));
      },
      py::arg("segment"), py::arg("inputs"),
      "Run segment.forward(inputs) as one autograd node that re-runs segment.recompute in backward.");
}
