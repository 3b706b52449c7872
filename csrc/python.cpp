// The Python module dpkernels._C. Importing it loads this library, which runs the op registrations
// (csrc/ops.cpp and the device kernels); Python reaches every op through torch.ops.dpkernels_C, so
// the module itself defines no functions.
#include <torch/extension.h>

PYBIND11_MODULE(_C, m) {
  m.doc() = "dpkernels native ops; call them through torch.ops.dpkernels_C (csrc/ops.cpp)";
}
