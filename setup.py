"""Build the dpkernels extension.

The CPU part (C++) is always built. The CUDA part is built whenever torch is a CUDA build and
nvcc is found, with or without a GPU. Environment switches:

- ``DPK_BUILD_CUDA=0|1``  force the CUDA part off or on (``1`` fails loudly if it cannot build).
- ``DPK_SKIP_EXT=1``      pure-Python install: no compiler needed; the ``reference`` and
  ``triton`` backends still work.
- ``DPK_CPU_ARCH``        extra ``-m`` flags for the CPU kernels (default: AVX2+FMA, plus AVX-512F
  for the noise generator, when the build machine has them, since the wheel is built where it
  runs).
"""

import os
import re
import shutil
import subprocess
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent


def _real_cuda_home() -> str | None:
    """The toolkit root of the nvcc that will actually run.

    ``nvcc`` may be a wrapper script outside the toolkit, so ask the driver where it lives
    (``_HERE_`` in its dry-run trace) instead of guessing from the wrapper's path.
    """
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    try:
        trace = subprocess.run(
            [nvcc, "-dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
            capture_output=True,
            text=True,
            timeout=60,
        ).stderr
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"_HERE_=(\S+)", trace)
    return str(Path(match.group(1)).parent) if match else str(Path(nvcc).resolve().parent.parent)


def _cpu_arch_flags() -> list[str]:
    if "DPK_CPU_ARCH" in os.environ:
        return os.environ["DPK_CPU_ARCH"].split()
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    if " avx2" not in flags or " fma" not in flags:
        return []
    # at::vec picks its AVX2 specialisations from CPU_CAPABILITY_AVX2 (the streaming kernels are
    # memory-bound; 256-bit vectors saturate them).
    arch = ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"]
    if " avx512f" in flags:
        # The noise generator is compute-bound: it takes 16-lane Philox and Box-Muller paths.
        arch.append("-mavx512f")
    return arch


def _extensions():
    if os.environ.get("DPK_SKIP_EXT") == "1":
        return [], {}
    import torch
    from torch.utils import cpp_extension

    want_cuda = os.environ.get("DPK_BUILD_CUDA", "auto")
    cuda_home = _real_cuda_home()
    build_cuda = want_cuda != "0" and torch.version.cuda is not None and cuda_home is not None
    if want_cuda == "1" and not build_cuda:
        raise RuntimeError(
            "DPK_BUILD_CUDA=1 but the CUDA part cannot be built: "
            f"torch.version.cuda={torch.version.cuda!r}, nvcc toolkit={cuda_home!r}"
        )

    sources = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "csrc").glob("*.cpp"))]
    sources += [str(p.relative_to(ROOT)) for p in sorted((ROOT / "csrc/cpu").glob("*.cpp"))]
    include_dirs = [str(ROOT / "csrc/include")]
    # -ffp-contract=off: no FMA contraction, so the element math rounds as written (and as the
    # reference), the same in every translation unit whatever it inlines; SIMD kernels ask for FMAs
    # explicitly. -fno-math-errno: sqrt need not set errno, so loops calling it vectorise (same
    # results); both must be command-line flags (GCC fixes the builtins' attributes per translation
    # unit, before any #pragma GCC optimize).
    cxx = ["-O3", "-std=c++20", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", *_cpu_arch_flags()]
    extra = {"cxx": cxx}
    define_macros = []
    if build_cuda:
        # Make torch.utils.cpp_extension agree with the real toolkit before it builds anything.
        os.environ["CUDA_HOME"] = cuda_home
        cpp_extension.CUDA_HOME = cuda_home
        sources += [str(p.relative_to(ROOT)) for p in sorted((ROOT / "csrc/cuda").glob("*.cu"))]
        # PyTorch's CUDA headers include cusparse.h/cublas.h, shipped by the nvidia wheels.
        for spec in ("nvidia/cu13/include", "nvidia/cuda_runtime/include", "nvidia/cusparse/include"):
            for site in map(Path, __import__("site").getsitepackages()):
                if (site / spec).is_dir():
                    include_dirs.append(str(site / spec))
        extra["nvcc"] = [
            "-O3",
            "-std=c++20",
            "--expt-relaxed-constexpr",
            "-lineinfo",
            "-gencode=arch=compute_80,code=sm_80",
            "-gencode=arch=compute_90,code=sm_90",
            "-gencode=arch=compute_90,code=compute_90",
        ]
        define_macros.append(("DPK_WITH_CUDA", "1"))
        ext_cls = cpp_extension.CUDAExtension
    else:
        ext_cls = cpp_extension.CppExtension
    ext = ext_cls(
        "dpkernels._C",
        sources,
        include_dirs=include_dirs,
        extra_compile_args=extra,
        extra_link_args=["-fopenmp"],
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
