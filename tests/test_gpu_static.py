"""Static checks of the real GPU code, without a GPU: every Triton kernel compiles ahead of time
for sm_80/sm_90 with 128-bit loads in the streaming kernels and no local memory, and the CUDA
sources compile for both with zero spills and every required instantiation
(tools/gpu_static_check.py)."""

import importlib.util
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.no_cpu_kernels

TOOL = Path(__file__).resolve().parents[1] / "tools" / "gpu_static_check.py"


def _tool():
    spec = importlib.util.spec_from_file_location("gpu_static_check", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_triton_kernels_compile_for_sm80_sm90():
    pytest.importorskip("triton")
    tool = _tool()
    res = tool.check_triton()
    assert res["status"] == "ok", tool.format_report(
        {"triton": res, "cuda": {"status": "skipped"}, "ok": False, "elapsed_s": 0}
    )
    assert res["results"], "no Triton kernel was compiled"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_cuda_sources_compile_without_spills():
    tool = _tool()
    res = tool.check_cuda()
    assert res["status"] == "ok", res
    assert res["sources"], "no CUDA source was compiled"


def test_required_cuda_kernels_are_counted():
    """A source that compiles fewer instantiations than REQUIRED_CUDA_KERNELS lists (a launcher that
    stopped instantiating the Conv2d layout, say) fails the check; no nvcc needed."""
    tool = _tool()
    required = tool.REQUIRED_CUDA_KERNELS["csrc/cuda/layers.cu"]
    kernels = []
    for prefix, n in required.items():
        for arch in ("sm_80", "sm_90"):
            kernels += [{"kernel": f"{prefix}{j}>", "arch": arch, "entry": True} for j in range(n)]
    assert tool.required_kernel_problems("csrc/cuda/layers.cu", kernels, (80, 90)) == []
    conv = "tiled_sumsq_kernel<dpkernels::ConvLayout<"
    fewer = [k for k in kernels if not (k["arch"] == "sm_90" and k["kernel"] == f"{conv}0>")]
    problems = tool.required_kernel_problems("csrc/cuda/layers.cu", fewer, (80, 90))
    assert len(problems) == 1 and conv in problems[0] and "sm_90" in problems[0]
    assert tool.required_kernel_problems("csrc/cuda/other.cu", [], (80, 90)) == []


def test_wide_load_requirement_fails_without_128_bit_loads():
    """An aligned LinearLayout instantiation whose SASS has no LDG.128 fails the check; no nvcc needed."""
    tool = _tool()
    vec = "tiled_sumsq_kernel<dpkernels::LinearLayout<float, true>, false, false>"
    scalar = "tiled_sumsq_kernel<dpkernels::LinearLayout<float, false>, false, false>"
    kernels = [{"kernel": vec, "arch": "sm_90", "entry": True, "ldg_128": 4},
               {"kernel": scalar, "arch": "sm_90", "entry": True, "ldg_128": 0}]  # fmt: skip
    assert tool.wide_load_problems("csrc/cuda/layers.cu", kernels) == []
    kernels[0]["ldg_128"] = 0
    problems = tool.wide_load_problems("csrc/cuda/layers.cu", kernels)
    assert len(problems) == 1 and "LinearLayout<float, true>" in problems[0]
    assert tool.wide_load_problems("csrc/cuda/layers.cu", kernels[1:]) != []  # nothing matched
    assert tool.wide_load_problems("csrc/cuda/other.cu", []) == []
