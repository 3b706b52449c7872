"""Static checks of the real GPU code, without a GPU: every Triton kernel compiles ahead of time
for sm_80/sm_90 with 128-bit loads in the streaming kernels and no local memory, and the CUDA
sources compile for both with zero spills and every required instantiation (read from the built
extension when it is current, compiled otherwise; tools/gpu_static_check.py)."""

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


_RES_USAGE = """
Fatbin elf code:
================
arch = sm_90
identifier = /build/csrc/cuda/noise.cu

Resource usage:
 Common:
  GLOBAL:0
 Function _ZN9dpkernels12noise_kernelEv:
  REG:40 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:1024 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function _ZN9dpkernels12spill_kernelEv:
  REG:255 STACK:16 SHARED:0 LOCAL:24 CONSTANT[0]:1024 TEXTURE:0 SURFACE:0 SAMPLER:0
"""


def test_built_extension_resources_flag_local_memory():
    """The built extension's resource table (cuobjdump -res-usage) is read per source and arch, and a
    kernel with local memory (spills, a stack frame) fails; no nvcc needed."""
    tool = _tool()
    usage = tool.parse_res_usage(_RES_USAGE)
    fns = usage["/build/csrc/cuda/noise.cu"]
    assert fns[("_ZN9dpkernels12noise_kernelEv", "sm_90")] == {"registers": 40, "stack": 0, "local": 0}
    assert fns[("_ZN9dpkernels12spill_kernelEv", "sm_90")] == {"registers": 255, "stack": 16, "local": 24}
    report = tool._kernel_report("csrc/cuda/noise.cu", fns, None, (90,))
    assert not report["ok"] and len(report["problems"]) == 2
    assert all("spill_kernel" in p for p in report["problems"]), report["problems"]
    clean = {k: v for k, v in fns.items() if "noise" in k[0]}
    assert tool._kernel_report("csrc/cuda/noise.cu", clean, None, (90,))["ok"]


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


# The address chain of one row load, x_ptr + i·n + idx with n an i32 argument, as Triton 3.6 writes it
# for sm_90: i = tl.program_id(0) (the product wraps past 2^31) and i = tl.program_id(0).to(tl.int64).
_ROW_LOAD_I32 = """
    ld.param.b64    %rd3, [row_sum_param_0];
    mov.u32     %r8, %ctaid.x;
    ld.param.b32    %r9, [row_sum_param_2];
    mov.u32     %r10, %tid.x;
    shl.b32     %r11, %r10, 2;
    and.b32     %r12, %r11, 252;
    mul.lo.s32  %r13, %r9, %r8;
    mad.wide.s32    %rd5, %r13, 4, %rd3;
    mad.wide.u32    %rd1, %r12, 4, %rd5;
    @%p1 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
"""
_ROW_LOAD_I64 = """
    ld.param.b64    %rd3, [row_sum_param_0];
    mov.u32     %r8, %ctaid.x;
    cvt.u64.u32     %rd5, %r8;
    ld.param.b32    %r9, [row_sum_param_2];
    mov.u32     %r10, %tid.x;
    shl.b32     %r11, %r10, 2;
    and.b32     %r12, %r11, 252;
    cvt.s64.s32     %rd6, %r9;
    mul.lo.s64  %rd7, %rd6, %rd5;
    shl.b64     %rd8, %rd7, 2;
    add.s64     %rd9, %rd3, %rd8;
    mad.wide.u32    %rd1, %r12, 4, %rd9;
    @%p1 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
"""


def test_offset64_check_flags_32_bit_sample_offsets():
    """The PTX check of the B×D kernels (OFFSET64_KERNELS, run on every compiled variant by
    test_triton_kernels_compile_for_sm80_sm90): a 32-bit i·n fails, a 64-bit one passes, and a
    kernel whose wide loads have no run-time product at all (no sample offset) fails; no Triton
    needed."""
    tool = _tool()
    assert tool.offset64_problems(_ROW_LOAD_I64) == []
    [load] = tool.ptx_address_products(_ROW_LOAD_I64)
    assert load["wide"] and load["products"] == [("mul.lo.s64", 64)]
    problems = tool.offset64_problems(_ROW_LOAD_I32)
    assert len(problems) == 2 and "32-bit arithmetic (mul.lo.s32)" in problems[0], problems
    # A product by an immediate (the element size) is no sample offset.
    no_product = _ROW_LOAD_I64.replace("mul.lo.s64  %rd7, %rd6, %rd5", "mul.lo.s64  %rd7, %rd6, 4")
    assert tool.offset64_problems(no_product) == [
        "no 128-bit load's address comes from a 64-bit product (the sample offset i·n)"
    ]
    # A product formed in 32 bits and widened afterwards ((i·n).to(tl.int64)) has already wrapped.
    widened_late = _ROW_LOAD_I64.replace("mov.u32     %r8, %ctaid.x;", "mul.lo.s32  %r8, %r9, %r10;")
    assert "32-bit arithmetic (mul.lo.s32)" in tool.offset64_problems(widened_late)[0]
    # A 64-bit product narrowed to 32 bits ((i·n).to(tl.int32)) wraps as well.
    narrowed = _ROW_LOAD_I64.replace(
        "    shl.b64     %rd8, %rd7, 2;\n",
        "    cvt.u32.u64     %r14, %rd7;\n    cvt.s64.s32     %rd10, %r14;\n    shl.b64     %rd8, %rd10, 2;\n",
    )
    assert "32-bit arithmetic (cvt.u32.u64)" in tool.offset64_problems(narrowed)[0]


def test_cuda_grid_products_are_64_bit():
    """Every blockIdx/blockDim/gridDim product in csrc/cuda is widened first (source level, no nvcc);
    an unwidened one is reported with its line, a widened one or a comment is not."""
    tool = _tool()
    sources = [tool.ROOT / s for s in tool.BUILD.sources(cuda=True, root=tool.ROOT) if s.endswith(".cu")]
    texts = tool._cuda_texts(sources)
    assert "csrc/cuda/clip_sum.cu" in texts and "csrc/cuda/multi_tensor.cuh" in texts
    assert tool.grid_index_problems(texts) == []
    bad = "// blockIdx.x * n\nconst int64_t a = int64_t{blockIdx.x} * n;\nconst int64_t e = blockIdx.x * blockDim.x;\n"
    problems = tool.grid_index_problems({"k.cu": bad})
    assert [p.split(" in ")[0] for p in problems] == ["k.cu:3: blockIdx.x", "k.cu:3: blockDim.x"]
