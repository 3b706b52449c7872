"""Build the dpkernels extension.

The CPU part (C++) is always built. The CUDA part is built whenever torch is a CUDA build and
nvcc is found, with or without a GPU. Every flag, architecture and include folder comes from
``tools/build_config.py`` (shared with CMake, the Makefile and the GPU static check). Environment
switches:

- ``DPK_BUILD_CUDA=0|1``  force the CUDA part off or on (``1`` fails loudly if it cannot build).
- ``DPK_SKIP_EXT=1``      pure-Python install: no compiler needed; the ``reference`` and
  ``triton`` backends still work.
- ``DPK_CPU_ARCH``        extra ``-m`` flags for the CPU kernels (default: AVX2+FMA, plus AVX-512F
  for the noise generator, when the build machine has them, since the wheel is built where it
  runs).
"""

import importlib.util
import os
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent


def _build_config():
    """tools/build_config.py, loaded by path (tools/ is no package; pip runs this file from ROOT)."""
    spec = importlib.util.spec_from_file_location("dpk_build_config", ROOT / "tools" / "build_config.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _extensions():
    if os.environ.get("DPK_SKIP_EXT") == "1":
        return [], {}
    import torch
    from torch.utils import cpp_extension

    cfg = _build_config()
    want_cuda = os.environ.get("DPK_BUILD_CUDA", "auto")
    cuda_home = cfg.real_cuda_home()
    build_cuda = want_cuda != "0" and torch.version.cuda is not None and cuda_home is not None
    if want_cuda == "1" and not build_cuda:
        raise RuntimeError(
            "DPK_BUILD_CUDA=1 but the CUDA part cannot be built: "
            f"torch.version.cuda={torch.version.cuda!r}, nvcc toolkit={cuda_home!r}"
        )

    sources = cfg.sources(cuda=build_cuda, root=ROOT)
    include_dirs = cfg.include_dirs(ROOT)
    extra = {"cxx": cfg.cxx_flags()}
    define_macros = []
    if build_cuda:
        # Make torch.utils.cpp_extension agree with the real toolkit before it builds anything.
        os.environ["CUDA_HOME"] = cuda_home
        cpp_extension.CUDA_HOME = cuda_home
        include_dirs += cfg.nvidia_include_dirs()
        extra["nvcc"] = cfg.nvcc_flags()
        define_macros += list(cfg.CUDA_DEFINES)
        ext_cls = cpp_extension.CUDAExtension
    else:
        ext_cls = cpp_extension.CppExtension
    ext = ext_cls(
        "dpkernels._C",
        sources,
        include_dirs=include_dirs,
        extra_compile_args=extra,
        extra_link_args=list(cfg.LINK_FLAGS),
        define_macros=define_macros,
    )
    build_ext = cpp_extension.BuildExtension.with_options(use_ninja=True)
    return [ext], {"build_ext": build_ext}


ext_modules, cmdclass = _extensions()
setup(
    # The Triton kernels keep their top-level source folder but install and import as
    # dpkernels.triton_kernels, so they never shadow the Triton project's own `triton_kernels`.
    packages=[*find_packages(include=["dpkernels", "dpkernels.*"]), "dpkernels.triton_kernels"],
    package_dir={"dpkernels.triton_kernels": "triton_kernels"},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
