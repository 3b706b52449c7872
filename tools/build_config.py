"""Build configuration of the dpkernels extension: the one place for its flags.

setup.py, CMakeLists.txt, the Makefile and tools/gpu_static_check.py all read what is here; none
of them spells a flag, an architecture or an include folder of its own. Standard library only, so
setup.py can load it (by path: ``tools/`` is not a package) before torch is imported, and the
Makefile and CMake can run it with any Python 3.10+.

As a script::

    python tools/build_config.py --cmake             # set(DPK_...) lines for CMake's execute_process
    python tools/build_config.py --print cuda_home   # one value (lists: space-separated), e.g. for make
    python tools/build_config.py --json              # everything, as JSON

Environment switches (read by the functions below, so by every build):

- ``CUDA_HOME``     the toolkit root; found from the nvcc on PATH when unset (:func:`real_cuda_home`).
- ``DPK_BUILD_CUDA=0|1`` and ``DPK_SKIP_EXT=1`` are read by setup.py (CMake has its own
  ``-DDPK_BUILD_CUDA=ON`` option).

No flag depends on the machine that builds. The CPU kernels (:data:`CPU_KERNEL_SOURCE_GLOBS`) are
compiled once per instruction set of :data:`CPU_CAPABILITIES` into their own extension module,
``dpkernels._cpu_<capability>``; the package loads the best one the running CPU supports
(dpkernels/_backend.py), as ATen's DispatchStub picks its kernels. Everything else
(:data:`CORE_SOURCE_GLOBS`: the op schemas, the module, the CUDA kernels) goes into ``dpkernels._C``,
compiled for the baseline x86-64.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import site
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Include folder of the C++/CUDA sources (relative to ROOT).
INCLUDE_DIRS = ("csrc/include",)

# Source globs (relative to ROOT). dpkernels._C: the core C++ always, CUDA when the CUDA part is
# built. dpkernels._cpu_<capability>: the CPU kernels, once per CPU_CAPABILITIES entry.
CORE_SOURCE_GLOBS = ("csrc/*.cpp",)
CUDA_SOURCE_GLOBS = ("csrc/cuda/*.cu", "csrc/cuda/*.cpp")
CPU_KERNEL_SOURCE_GLOBS = ("csrc/cpu/*.cpp",)

# Each CPU capability's flags, best first (the names match torch.backends.cpu.get_cpu_capability()).
# The -m flags give the instruction set the generators (csrc/cpu/noise_cpu.h, which tests
# __AVX512F__/__AVX2__) use; the CPU_CAPABILITY_* define picks the streaming kernels' vectors
# (csrc/cpu/vec_cpu.h: ATen's at::vec for AVX2, the portable module's own 16-byte GCC vectors for
# DEFAULT). The AVX-512 module keeps at::vec at 256 bits, as every earlier build of
# dpkernels did (docs/BENCHMARKS.md): those kernels are memory-bound, and one run each with 512-bit
# and 256-bit at::vec this session showed no difference that outlived the run-to-run spread, while
# the generator gains 1.5x from its 16 lanes. Off x86-64 only
# the portable one is built.
_X86 = platform.machine().lower() in ("x86_64", "amd64")
CPU_CAPABILITIES = {
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c",
               "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX512"),
    "avx2": ("-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"),
    "default": ("-DCPU_CAPABILITY_DEFAULT", "-DCPU_CAPABILITY=DEFAULT"),
}  # fmt: skip
if not _X86:
    CPU_CAPABILITIES = {"default": CPU_CAPABILITIES["default"]}
# And for every CPU kernel module: hidden symbols. Each module defines the same kernels and inline
# helpers, compiled for its own instruction set; only its PyInit_ is exported, so no module's
# function can ever bind to another's, whatever loads them.
CPU_MODULE_FLAGS = ("-fvisibility=hidden",)

# C++ flags of every translation unit (the CPU arch flags below come after them).
# -ffp-contract=off: no FMA contraction, so the element math rounds as written (and as the
# reference), the same in every translation unit whatever it inlines; SIMD kernels ask for FMAs
# explicitly. -fno-math-errno: sqrt need not set errno, so loops calling it vectorise (same
# results); both must be command-line flags (GCC fixes the builtins' attributes per translation
# unit, before any #pragma GCC optimize). -g0: no debug info (Python's own CFLAGS ask for -g), which
# halves the compile time of the template-heavy kernels (28 s to 15 s for csrc/cpu/clip.cpp).
# TORCH_ASSERT_ONLY_METHOD_OPERATORS: ATen's guard against its all-operator headers (ATen/ATen.h,
# ATen/Functions.h). A file includes ATen/core/Tensor.h and the per-operator ATen/ops/<op>.h it calls:
# ATen/ATen.h costs ~10 s of g++ and ~40 s of nvcc per file (docs/BENCHMARKS.md, "Build time").
CXX_FLAGS = ("-O3", "-std=c++20", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-g0",
             "-DTORCH_ASSERT_ONLY_METHOD_OPERATORS")  # fmt: skip
LINK_FLAGS = ("-fopenmp",)

# nvcc flags of every .cu file (the -gencode list comes after them).
NVCC_FLAGS = ("-O3", "-std=c++20", "--expt-relaxed-constexpr", "-lineinfo", "-DTORCH_ASSERT_ONLY_METHOD_OPERATORS")
# Machine code (SASS) for each of these; PTX for the last one too, so newer GPUs JIT it.
# DPK_CUDA_ARCHS (comma-separated SM numbers, e.g. "90") builds for those instead: a GPU machine
# checking its own build (tools/gpu_check.py) skips the others' nvcc passes.
_ARCHS_ENV = os.environ.get("DPK_CUDA_ARCHS", "80,90")
if not re.fullmatch(r"\d{2,3}(,\d{2,3})*", _ARCHS_ENV):
    raise ValueError(f"DPK_CUDA_ARCHS must be comma-separated SM numbers such as 80,90; got {_ARCHS_ENV!r}")
CUDA_ARCHS = tuple(int(a) for a in _ARCHS_ENV.split(","))
PTX_ARCH = CUDA_ARCHS[-1]
# Defined in every translation unit when the CUDA part is built.
CUDA_DEFINES = (("DPK_WITH_CUDA", "1"),)

# PyTorch's CUDA headers include cusparse.h/cublas.h, shipped by the nvidia wheels (relative to a
# site-packages folder); the toolkit may not have them.
NVIDIA_INCLUDE_SPECS = ("nvidia/cu13/include", "nvidia/cuda_runtime/include", "nvidia/cusparse/include")


def real_cuda_home() -> str | None:
    """The toolkit root of the nvcc that will actually run (``CUDA_HOME`` when set).

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


def cxx_flags(capability: str | None = None) -> list[str]:
    """Every C++ compile flag: :data:`CXX_FLAGS`, then for a CPU kernel module its capability's
    (``None``: the core module, baseline x86-64)."""
    return [*CXX_FLAGS, *((*CPU_CAPABILITIES[capability], *CPU_MODULE_FLAGS) if capability else ())]


def program_command(source, out, capability: str) -> list[str]:
    """The g++ command that builds a standalone C++ program including the CPU kernels' headers
    (tools/noise_loop.cpp, tests/portable_fma_check.cpp) into ``out``, with ``capability``'s flags,
    against the installed torch (imported here, not when this module loads)."""
    import torch.utils.cpp_extension as ext

    lib = ext.library_paths()[0]
    includes = [f"-I{d}" for d in [*include_dirs(), *ext.include_paths()]]
    return ["g++", *cxx_flags(capability), *includes, str(source), "-o", str(out),
            f"-L{lib}", f"-Wl,-rpath,{lib}", "-ltorch_cpu", "-lc10"]  # fmt: skip


# GLIBC_TUNABLES for running such a program as on a CPU without FMA: glibc's function selection no
# longer sees FMA (nor AVX2, which its FMA variants also require), so its fmaf is the software routine.
GLIBC_HIDE_FMA = "glibc.cpu.hwcaps=-FMA,-AVX2"


def gencode_flags(archs=CUDA_ARCHS, ptx_arch: int | None = PTX_ARCH) -> list[str]:
    """``-gencode`` flags: SASS for each of ``archs``, and PTX for ``ptx_arch`` (None: no PTX)."""
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    if ptx_arch is not None:
        flags.append(f"-gencode=arch=compute_{ptx_arch},code=compute_{ptx_arch}")
    return flags


def nvcc_flags() -> list[str]:
    """Every nvcc flag of the extension build: :data:`NVCC_FLAGS` then :func:`gencode_flags`."""
    return [*NVCC_FLAGS, *gencode_flags()]


def cuda_define_flags() -> list[str]:
    """:data:`CUDA_DEFINES` as ``-DNAME=VALUE`` flags."""
    return [f"-D{name}={value}" for name, value in CUDA_DEFINES]


def include_dirs(root: Path = ROOT) -> list[str]:
    """The sources' include folders, absolute (under ``root``, the repository by default)."""
    return [str(root / d) for d in INCLUDE_DIRS]


def nvidia_include_dirs(site_dirs=None) -> list[str]:
    """The nvidia wheels' include folders that exist, in :data:`NVIDIA_INCLUDE_SPECS` order.

    ``site_dirs``: the site-packages folders to look in (default: this interpreter's, then any
    other site-packages folder on ``sys.path``, e.g. a base virtual environment's that a ``.pth``
    file adds, as tools/gpu_check.py does).
    """
    if site_dirs is None:
        site_dirs = site.getsitepackages()
        site_dirs += [p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and p not in site_dirs]
    sites = list(map(Path, site_dirs))
    return [str(sp / spec) for spec in NVIDIA_INCLUDE_SPECS for sp in sites if (sp / spec).is_dir()]


def _glob(globs, root: Path) -> list[str]:
    return [str(p.relative_to(root)) for g in globs for p in sorted(root.glob(g))]


def sources(cuda: bool, root: Path = ROOT) -> list[str]:
    """dpkernels._C's source files relative to ``root``, sorted within each glob."""
    return _glob([*CORE_SOURCE_GLOBS, *(CUDA_SOURCE_GLOBS if cuda else ())], root)


def cpu_kernel_sources(root: Path = ROOT) -> list[str]:
    """The source files of each dpkernels._cpu_<capability> module, relative to ``root``."""
    return _glob(CPU_KERNEL_SOURCE_GLOBS, root)


def torch_cuda_arch_list() -> list[str]:
    """:data:`CUDA_ARCHS` as TORCH_CUDA_ARCH_LIST entries (``["8.0", "9.0"]``)."""
    return [f"{a // 10}.{a % 10}" for a in CUDA_ARCHS]


def runtime_libstdcxx() -> list[str]:
    """The libstdc++ this process has loaded (import torch first), as a link input ahead of the
    compiler's own: ``[path]``, or ``[]`` off Linux or when none is loaded.

    A compiler whose C++ runtime is linked in statically, in part or whole (the GPU machine's
    /opt/gcc GCC 13 does; RHEL's gcc-toolset does with libstdc++_nonshared.a), puts a private copy
    of libstdc++ code into the module. That copy met the process's libstdc++ data there: the first
    error message the module formatted (``TORCH_CHECK`` streams into an ostringstream) called the
    wrong locale facet and died with SIGSEGV. Named first, the loaded library resolves every symbol
    it has, so nothing is copied (docs/BENCHMARKS.md, "Second GPU run").
    """
    if not sys.platform.startswith("linux"):
        return []
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    paths = {line.split()[-1] for line in maps if "/libstdc++.so" in line}
    return sorted(paths)[:1]


# Symbols of libstdc++'s compiled part (std::locale's members, the codecvt facets): no header
# instantiates them, so a module that defines one carries a private copy of the C++ runtime.
_LIBSTDCXX_PRIVATE = re.compile(r" [TtWw] (_ZNSt6locale|_ZNKSt7codecvt)")


def check_no_private_libstdcxx(path: str) -> None:
    """Refuse a module that carries its own libstdc++ code (see :func:`runtime_libstdcxx`)."""
    nm = shutil.which("nm")
    if nm is None or not Path(path).exists():
        return
    symbols = subprocess.run([nm, "--defined-only", path], capture_output=True, text=True).stdout
    found = _LIBSTDCXX_PRIVATE.findall(symbols)
    if found:
        raise RuntimeError(
            f"{path} defines {len(found)} libstdc++ runtime symbols (such as std::locale members): the "
            "compiler linked part of its C++ runtime in statically, and the module would crash on its "
            "first error message. Build with a compiler that links libstdc++ as a shared library "
            "(set CXX/CC), or one matching the libstdc++ torch loads."
        )


def values() -> dict:
    """Every value, as plain lists and strings (the ``--json`` and ``--cmake`` output)."""
    return {
        "cuda_home": real_cuda_home() or "",
        "include_dirs": include_dirs(),
        "nvidia_include_dirs": nvidia_include_dirs(),
        "core_source_globs": list(CORE_SOURCE_GLOBS),
        "cuda_source_globs": list(CUDA_SOURCE_GLOBS),
        "cpu_kernel_source_globs": list(CPU_KERNEL_SOURCE_GLOBS),
        "cpu_capabilities": list(CPU_CAPABILITIES),
        "cxx_flags": cxx_flags(),
        **{f"cxx_flags_{cap}": cxx_flags(cap) for cap in CPU_CAPABILITIES},
        "link_flags": list(LINK_FLAGS),
        "nvcc_flags": nvcc_flags(),
        "cuda_defines": [f"{name}={value}" for name, value in CUDA_DEFINES],
        "cuda_archs": [str(a) for a in CUDA_ARCHS],
        "ptx_arch": str(PTX_ARCH),
        "torch_cuda_arch_list": torch_cuda_arch_list(),
    }


def _cmake_quote(value: str) -> str:
    return '"' + re.sub(r'([\\"$;])', r"\\\1", value) + '"'


def cmake_lines(vals: dict) -> str:
    """``set(DPK_<NAME> ...)`` per value: lists become CMake lists, strings quoted strings."""
    lines = []
    for key, val in vals.items():
        items = val if isinstance(val, list) else [val]
        lines.append(f"set(DPK_{key.upper()} {' '.join(map(_cmake_quote, items))})")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--cmake", action="store_true", help="set(DPK_...) lines for CMake")
    group.add_argument("--json", action="store_true", help="every value as JSON")
    group.add_argument("--print", metavar="NAME", help="one value (a list: space-separated)")
    args = ap.parse_args(argv)
    if args.print:
        # Only what is asked for, so `--print cuda_home` does not scan site-packages.
        getters = {"cuda_home": lambda: real_cuda_home() or ""}
        val = getters[args.print]() if args.print in getters else values().get(args.print)
        if val is None:
            ap.error(f"unknown value {args.print!r}; choose from {', '.join(values())}")
        print(" ".join(val) if isinstance(val, list) else val)
    elif args.cmake:
        print(cmake_lines(values()))
    else:
        print(json.dumps(values(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
