// The Python module dpkernels._cpu_<capability>: the CPU kernels of this folder compiled for one
// instruction set (tools/build_config.py CPU_CAPABILITIES), registered below for the ops
// dpkernels._C defines (csrc/ops.cpp). dpkernels/_backend.py imports exactly one of these modules,
// the best the running CPU supports; importing it loads this library, which runs the registration.
// The module itself is plain Python C API: it defines no functions, and pybind11
// (torch/extension.h) would cost ~30 s of compile time per module for nothing.
#include <Python.h>
#include <torch/library.h>

#include "dpkernels/kernels.h"

TORCH_LIBRARY_IMPL(dpkernels_C, CPU, m) {
#define DPK_REGISTER_CPU(op, kernel, ret, params) m.impl(#op, &dpkernels::kernel##_cpu);
  DPK_FOR_EACH_KERNEL(DPK_REGISTER_CPU)
  DPK_FOR_EACH_CPU_KERNEL(DPK_REGISTER_CPU)
#undef DPK_REGISTER_CPU
}

#define DPK_STRINGIFY_(x) #x
#define DPK_STRINGIFY(x) DPK_STRINGIFY_(x)
#define DPK_CONCAT_(a, b) a##b
#define DPK_CONCAT(a, b) DPK_CONCAT_(a, b)

static PyModuleDef dpk_module = {
    PyModuleDef_HEAD_INIT,
    DPK_STRINGIFY(TORCH_EXTENSION_NAME),
    "dpkernels CPU kernels for one instruction set; call them through torch.ops.dpkernels_C",
    -1,
    nullptr,
};

PyMODINIT_FUNC DPK_CONCAT(PyInit_, TORCH_EXTENSION_NAME)() {
  PyObject* m = PyModule_Create(&dpk_module);
  // ATen's name of the instruction set the kernels were compiled for: AVX512, AVX2 or DEFAULT.
  if (m != nullptr && PyModule_AddStringConstant(m, "capability", DPK_STRINGIFY(CPU_CAPABILITY)) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
