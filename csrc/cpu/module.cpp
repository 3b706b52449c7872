// The Python module dpkernels._cpu_<capability>: the CPU kernels of this folder compiled for one
// instruction set (tools/build_config.py CPU_CAPABILITIES). Importing it loads this library, whose
// TORCH_LIBRARY_IMPL blocks register the kernels for the ops dpkernels._C defines (csrc/ops.cpp);
// dpkernels/_backend.py imports exactly one of them, the best the running CPU supports.
#include <torch/extension.h>

#define DPK_STRINGIFY_(x) #x
#define DPK_STRINGIFY(x) DPK_STRINGIFY_(x)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "dpkernels CPU kernels for one instruction set; call them through torch.ops.dpkernels_C";
  // ATen's name of the instruction set the kernels were compiled for: AVX512, AVX2 or DEFAULT.
  m.attr("capability") = DPK_STRINGIFY(CPU_CAPABILITY);
}
