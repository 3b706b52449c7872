"""Build the dpkernels extension.

The CPU part (C++) is always built. The CUDA part is built whenever torch is a CUDA build and
nvcc is found, with or without a GPU. Every flag, architecture and include folder comes from
``tools/build_config.py`` (shared with CMake, the Makefile and the GPU static check). Environment
switches:

- ``DPK_BUILD_CUDA=0|1``  force the CUDA part off or on (``1`` fails loudly if it cannot build).
- ``DPK_SKIP_EXT=1``      pure-Python install: no compiler needed; the ``reference`` and
  ``triton`` backends still work.

The CPU kernels are built once per instruction set (``dpkernels._cpu_avx512``, ``_cpu_avx2``,
``_cpu_default``; tools/build_config.py ``CPU_CAPABILITIES``), whatever the building machine has:
the package loads the best one the running CPU supports.
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
    link_args = [*cfg.LINK_FLAGS, *cfg.runtime_libstdcxx()]
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
    core = ext_cls(
        "dpkernels._C",
        sources,
        include_dirs=include_dirs,
        extra_compile_args=extra,
        extra_link_args=link_args,
        define_macros=define_macros,
    )
    cpu = [
        cpp_extension.CppExtension(
            f"dpkernels._cpu_{capability}",
            cfg.cpu_kernel_sources(ROOT),
            include_dirs=cfg.include_dirs(ROOT),
            extra_compile_args={"cxx": cfg.cxx_flags(capability)},
            extra_link_args=link_args,
        )
        for capability in cfg.CPU_CAPABILITIES
    ]
    return [core, *cpu], {"build_ext": _build_ext(cpp_extension, cfg)}


def _build_ext(cpp_extension, cfg):
    """torch's BuildExtension (ninja) with a temporary folder per extension: the CPU kernel modules
    compile the same sources with different flags, whose objects must not share a path."""

    class BuildExtension(cpp_extension.BuildExtension.with_options(use_ninja=True)):
        def build_extension(self, ext):
            shared = self.build_temp
            self.build_temp = os.path.join(shared, ext.name)
            try:
                super().build_extension(ext)
            finally:
                self.build_temp = shared
            cfg.check_no_private_libstdcxx(self.get_ext_fullpath(ext.name))

    return BuildExtension


ext_modules, cmdclass = _extensions()
setup(
    # The Triton kernels keep their top-level source folder but install and import as
    # dpkernels.triton_kernels, so they never shadow the Triton project's own `triton_kernels`.
    packages=[*find_packages(include=["dpkernels", "dpkernels.*"]), "dpkernels.triton_kernels"],
    package_dir={"dpkernels.triton_kernels": "triton_kernels"},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
