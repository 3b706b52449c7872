// The Python module dpkernels._C. Importing it loads this library, which runs the op registrations
// (csrc/ops.cpp and the device kernels); its one function is the eager entry of clip_pipeline.
//
// Why an entry besides torch.ops.dpkernels_C.clip_pipeline: the boxed torch.ops path converts each
// argument to an IValue, matches it against the schema and boxes the results back, ~0.4 µs per
// tensor with cold caches, ~0.06 ms on a list of 148 tensors (measured against this entry). This
// entry unpacks the list once and calls the same registered op unboxed through the dispatcher, so
// the dispatch keys (CPU/CUDA, Python dispatch modes, autograd fallback, profiler) behave as for
// torch.ops. What the dispatcher does not see is __torch_function__: for a tensor that is not a
// plain torch.Tensor, or with a torch-function mode active, the entry returns None and the caller
// goes through torch.ops.
#include <ATen/ATen.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace py = pybind11;

namespace dpkernels {
namespace {

using PipelineResult = std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor>;
using PipelineFn = PipelineResult(at::TensorList, at::ArrayRef<double>, at::ArrayRef<double>,
                                  c10::string_view, double, at::TensorList, at::TensorList, bool, bool,
                                  double, c10::string_view, double, at::IntArrayRef, int64_t, int64_t, double,
                                  at::TensorList);

// The tensors of a Python list, or nothing when one of them is not a plain torch.Tensor.
std::optional<std::vector<at::Tensor>> plain_tensors(const py::list& list) {
  std::vector<at::Tensor> out;
  out.reserve(list.size());
  for (const py::handle item : list) {
    if (!THPVariable_CheckExact(item.ptr())) return std::nullopt;
    out.push_back(THPVariable_Unpack(item.ptr()));
  }
  return out;
}

py::object clip_pipeline(const py::list& grads, const std::vector<double>& coeffs,
                         const std::vector<double>& max_grad_norm, const std::string& mode, double r,
                         const py::list& shift, const py::list& scale, bool per_layer, bool drop_nonfinite,
                         double norm_scale, const std::string& rng, double noise_std,
                         const std::vector<int64_t>& key, int64_t step, int64_t stream, double out_scale,
                         const py::list& noise) {
  HANDLE_TH_ERRORS
  if (at::impl::torch_function_mode_enabled()) return py::none();
  auto g = plain_tensors(grads), sh = plain_tensors(shift), sc = plain_tensors(scale),
       z = plain_tensors(noise);
  if (!g || !sh || !sc || !z) return py::none();
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("dpkernels_C::clip_pipeline", "").typed<PipelineFn>();
  PipelineResult out;
  {
    py::gil_scoped_release no_gil;  // as torch.ops does while the op runs
    out = op.call(*g, coeffs, max_grad_norm, mode, r, *sh, *sc, per_layer, drop_nonfinite, norm_scale, rng,
                  noise_std, key, step, stream, out_scale, *z);
  }
  return py::cast(std::move(out));
  END_HANDLE_TH_ERRORS_PYBIND
}

}  // namespace
}  // namespace dpkernels

PYBIND11_MODULE(_C, m) {
  m.def(
      "clip_pipeline", &dpkernels::clip_pipeline,
      "dpkernels_C::clip_pipeline (csrc/ops.cpp) for plain tensors, or None: the caller then uses torch.ops");
}
