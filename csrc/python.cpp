// The Python module dpkernels._C. Importing it loads this library, which runs the op registrations
// (csrc/ops.cpp, and csrc/cuda/register.cpp when the CUDA part is built); Python reaches every op
// through torch.ops.dpkernels_C, so the module defines no functions (plain Python C API: pybind11,
// through torch/extension.h, would cost ~30 s of compile time for nothing).
#include <Python.h>

static PyModuleDef dpk_module = {
    PyModuleDef_HEAD_INIT,
    "_C",
    "dpkernels native ops; call them through torch.ops.dpkernels_C (csrc/ops.cpp)",
    -1,
    nullptr,
};

PyMODINIT_FUNC PyInit__C() { return PyModule_Create(&dpk_module); }
