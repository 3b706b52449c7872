"""The extension build: its guard against a private copy of libstdc++ (tools/build_config.py), and
the registration of every native op's kernels from the one list in csrc/include/dpkernels/kernels.h.

On the GPU machine, a compiler that links part of its C++ runtime in statically put libstdc++ code
into the modules, and the first error message any of them formatted died with SIGSEGV. The build
names the process's own libstdc++ as a link input (:func:`runtime_libstdcxx`) and refuses a module
that still defines libstdc++'s runtime symbols (:func:`check_no_private_libstdcxx`). The same
failure is made here with ``-static-libstdc++``.
"""

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import dpkernels

pytestmark = pytest.mark.one_cpu_path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("dpk_build_config", ROOT / "tools" / "build_config.py")
cfg = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cfg)

# Formats an unsigned long through an ostringstream, as TORCH_CHECK's message does.
SOURCE = """#include <sstream>
#include <string>
std::string f(unsigned long x) { std::ostringstream s; s << x; return s.str(); }
"""


def _link(tmp_path, name, *inputs):
    """A shared object of SOURCE linked with ``-static-libstdc++`` and ``inputs`` (skip if this
    machine's g++ cannot)."""
    gxx = shutil.which("g++")
    if gxx is None or shutil.which("nm") is None:
        pytest.skip("needs g++ and nm")
    src, out = tmp_path / "f.cpp", tmp_path / name
    src.write_text(SOURCE)
    res = subprocess.run([gxx, "-O2", "-fPIC", "-shared", str(src), "-o", str(out), *inputs, "-static-libstdc++"],
                         capture_output=True, text=True)  # fmt: skip
    if res.returncode != 0:
        pytest.skip(f"g++ cannot link libstdc++ statically here: {res.stderr[-300:]}")
    return str(out)


def test_a_private_libstdcxx_is_refused(tmp_path):
    path = _link(tmp_path, "static.so")
    with pytest.raises(RuntimeError, match=r"static.so defines \d+ libstdc\+\+ runtime symbols"):
        cfg.check_no_private_libstdcxx(path)


def test_the_loaded_libstdcxx_as_link_input_keeps_it_out(tmp_path):
    assert torch.__version__  # torch (imported) has loaded libstdc++
    runtime = cfg.runtime_libstdcxx()
    assert len(runtime) == 1 and "libstdc++.so" in Path(runtime[0]).name, runtime
    cfg.check_no_private_libstdcxx(_link(tmp_path, "fixed.so", *runtime))


def test_built_modules_carry_no_libstdcxx():
    modules = sorted(Path(dpkernels.__file__).parent.glob("_*.so"))
    if not modules:
        pytest.skip("pure-Python install")
    for path in modules:
        cfg.check_no_private_libstdcxx(str(path))


def _native_op_tables():
    if "cpu" not in dpkernels.available_backends("cpu"):
        pytest.skip("C++ extension not built")
    names = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("dpkernels_C::"))
    return {n: torch._C._dispatch_dump(n) for n in names}


def test_every_native_op_has_its_kernels():
    """Each schema of csrc/ops.cpp is in kernels.h's lists and has a CPU kernel (csrc/cpu/module.cpp);
    when the CUDA part is built, every op but those of the CPU-only list has a CUDA kernel too
    (csrc/cuda/register.cpp)."""
    schemas = re.findall(r'm\.def\(\s*"(\w+)\(', (ROOT / "csrc" / "ops.cpp").read_text())
    header = (ROOT / "csrc" / "include" / "dpkernels" / "kernels.h").read_text()
    listed = re.findall(r"^\s+X\((\w+), ", header, re.M)
    cpu_only = re.findall(r"^\s+X\((\w+), ", header.split("#define DPK_FOR_EACH_CPU_KERNEL")[1].split("\n//")[0], re.M)
    assert len(schemas) == 21 and sorted(listed) == sorted(schemas)
    assert cpu_only == [
        "conv2d_weighted_sum",
        "linear_sumsq_gram",
        "linear_sumsq_t1",
        "conv2d_sumsq_grad_sample",
    ]
    tables = _native_op_tables()
    assert sorted(tables) == sorted(f"dpkernels_C::{s}" for s in schemas)
    assert [n for n, t in tables.items() if not re.search(r"^CPU: registered at .*module\.cpp", t, re.M)] == []
    with_cuda = [n for n, t in tables.items() if re.search(r"^CUDA: registered at .*register\.cpp", t, re.M)]
    want = sorted(n for n in tables if n.split("::")[1] not in cpu_only)
    assert with_cuda in ([], want), f"CUDA kernels for only some ops: {with_cuda}"


def test_cpu_modules_export_only_their_init():
    """The per-instruction-set modules define the same kernels and helpers: hidden visibility keeps
    each module's own (none of dpkernels' symbols is exported)."""
    if shutil.which("nm") is None:
        pytest.skip("needs nm")
    modules = sorted(Path(dpkernels.__file__).parent.glob("_cpu_*.so"))
    if not modules:
        pytest.skip("pure-Python install")
    for path in modules:
        out = subprocess.run(["nm", "-DC", "--defined-only", str(path)], capture_output=True, text=True, check=True)
        symbols = [line.split(None, 2)[-1] for line in out.stdout.splitlines()]
        assert f"PyInit_{path.name.split('.')[0]}" in symbols
        assert [s for s in symbols if "dpkernels" in s] == [], path.name
