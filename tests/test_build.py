"""The extension build's guard against a private copy of libstdc++ (tools/build_config.py).

On the GPU machine, a compiler that links part of its C++ runtime in statically put libstdc++ code
into the modules, and the first error message any of them formatted died with SIGSEGV. The build
names the process's own libstdc++ as a link input (:func:`runtime_libstdcxx`) and refuses a module
that still defines libstdc++'s runtime symbols (:func:`check_no_private_libstdcxx`). The same
failure is made here with ``-static-libstdc++``.
"""

import importlib.util
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
