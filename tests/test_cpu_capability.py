"""Runtime CPU-capability dispatch: the CPU kernels are built once per instruction set
(``dpkernels._cpu_avx512``, ``_cpu_avx2``, ``_cpu_default``) and the package loads the best one the
CPU runs, or a lower one that ``DPKERNELS_CPU_CAPABILITY`` forces.

- the loaded module is the one :func:`dpkernels.cpu_capability` reports, and it registered the ops;
- a bad or too-high ``DPKERNELS_CPU_CAPABILITY`` fails with a message naming the problem;
- every path this CPU runs gives bit-identical noise (Philox and ChaCha20 words, normals, noise
  added in place, the fused optimizer step's in-pass noise), checked in one subprocess per path;
- the CPU kernels widen fp16 and bf16 to fp32 exactly, for every bit pattern (F16C through ATen
  on AVX2/AVX-512, integer operations on the portable path: ``csrc/cpu/vec_cpu.h``);
- the portable path's fused multiply-add, computed in double where the target has none, rounds as
  fmaf does (``tests/portable_fma_check.cpp``, with FMA visible to glibc and hidden from it);
- ChaCha20's float64 transform is within its error bounds on every path (``tools/noise_loop.cpp``);
- no AVX-512 instruction outside ``_cpu_avx512`` and no AVX instruction outside ``_cpu_avx2`` and
  ``_cpu_avx512``, and the streaming passes' prefetches are in every module (objdump of the built
  modules).

The whole suite also runs with each lower path forced (Makefile ``test``).
"""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dpkernels
from dpkernels import _backend

pytestmark = pytest.mark.skipif(not _backend.has_cpu_kernels(), reason="no CPU kernel module (pure-Python install)")

PKG = Path(dpkernels.__file__).parent
ROOT = Path(__file__).resolve().parent.parent


def test_the_loaded_module_is_the_one_reported():
    cap = dpkernels.cpu_capability()
    forced = os.environ.get(_backend.CPU_CAPABILITY_ENV)
    assert cap == (forced or _backend.runnable_cpu_capabilities()[0])
    module = sys.modules[f"dpkernels._cpu_{cap}"]
    assert module.capability == cap.upper()
    assert not any(f"dpkernels._cpu_{c}" in sys.modules for c in _backend.CPU_CAPABILITIES if c != cap)
    assert torch._C._dispatch_has_kernel_for_dispatch_key("dpkernels_C::philox_uint32_", "CPU")


@pytest.mark.parametrize(
    "env, supported, match",
    [("avx3", "avx512", "expected one of avx512, avx2, default"), ("avx512", "avx2", "only force a lower path")],
)
def test_bad_capability_requests_fail_clearly(monkeypatch, env, supported, match):
    monkeypatch.setenv(_backend.CPU_CAPABILITY_ENV, env)
    monkeypatch.setattr(_backend, "_supported_cpu_capability", lambda: supported)
    with pytest.raises(RuntimeError, match=match):
        _backend._load_cpu_kernels()


_PROBE = r"""
import hashlib, json, torch, dpkernels
from dpkernels import optim

def digest(*tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()

out = {"capability": dpkernels.cpu_capability()}
for n, offset in ((1, 0), (37, 5), (1000, 3), (4099, 0)):
    words = dpkernels.philox_uint32(n, seed=11, step=3, offset=offset, backend="cpu")
    normals = dpkernels.gaussian_noise(n, std=0.7, seed=11, step=3, offset=offset, backend="cpu")
    secure = dpkernels.gaussian_noise(n, std=0.7, seed=11, step=3, offset=offset, rng="chacha20", backend="cpu")
    chacha = dpkernels.chacha20_uint32(n, seed=2**200 + 7, step=3, offset=offset, backend="cpu")
    added = [torch.linspace(-1, 1, n), torch.linspace(0, 1, 3).bfloat16()]
    dpkernels.add_gaussian_noise_(added, 0.3, seed=11, step=3, offset=offset, backend="cpu")
    added = [added[0], added[1].float()]
    out[f"noise {n} {offset}"] = digest(words, normals, secure, chacha, *added)
p = torch.nn.Parameter(torch.linspace(-1, 1, 1001))
opt = optim.DPSGD([p], lr=0.1, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4, seed=5, backend="cpu")
p.grad_sample = torch.zeros(4, 1001)
opt.step()
out["dpsgd in-pass noise"] = digest(p.detach())
print(json.dumps(out))
"""


def _probe(capability: str) -> dict:
    env = {**os.environ, _backend.CPU_CAPABILITY_ENV: capability}
    res = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.one_cpu_path
def test_noise_bits_identical_on_every_path():
    runs = {cap: _probe(cap) for cap in _backend.runnable_cpu_capabilities()}
    assert all(r.pop("capability") == cap for cap, r in runs.items())
    best, *others = runs
    for cap in others:
        assert runs[cap] == runs[best], f"{cap} differs from {best}"
    assert len(runs) >= 2 or _backend.runnable_cpu_capabilities() == ["default"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_values_widen_exactly(dtype):
    """One sample of weight 1: the sum pass's fp32 result is 0 + 1 * widen(g), so it is the widened
    value itself, for all 65,536 patterns (subnormals, ±Inf, NaN; -0 comes out as +0)."""
    g = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype).reshape(1, -1)
    want = g[0].float()
    (out,) = torch.ops.dpkernels_C.weighted_sum([g], [1.0], torch.ones(1, 1))
    assert out.shape == want.shape and out.dtype == torch.float32
    nan = want.isnan()
    assert int(nan.sum()) > 0 and torch.equal(out.isnan(), nan)
    assert torch.equal(out[~nan], want[~nan])
    assert (want[~nan].abs() < 2.0**-14).sum() > 1000  # the subnormals (fp16) and tiny values are in


def _objdump(path: Path, *flags: str) -> str:
    cmd = ["objdump", "-d", "--no-show-raw-insn", *flags, str(path)]
    return subprocess.run(cmd, capture_output=True, text=True).stdout


def _functions(path: Path) -> dict[str, list[str]]:
    """The instruction lines of each function of ``path``'s machine code, by demangled name."""
    functions: dict[str, list[str]] = {}
    lines = None
    for line in _objdump(path, "-C").splitlines():
        if line.endswith(">:"):
            lines = functions.setdefault(line[line.index("<") + 1 : -2], [])
        elif lines is not None:
            lines.append(line)
    return functions


# The fused optimizer families' chunk functions (csrc/cpu/optim.cpp).
_OPTIM_FAMILIES = ("SgdChunk", "Dp2Chunk", "AdamChunk", "MacAdamChunk")


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) not installed")
@pytest.mark.skipif(not list(PKG.glob("_cpu_default.*.so")), reason="x86-64 build only")
def test_no_wider_instructions_outside_their_module():
    """AVX-512 (zmm or mask registers) only in _cpu_avx512; AVX (ymm) only there and in _cpu_avx2."""
    avx512 = re.compile(r"%zmm\d|%k[1-7]\b")
    avx = re.compile(r"%ymm\d")
    for name, allowed in (
        ("_C", ()),
        ("_cpu_default", ()),
        ("_cpu_avx2", ("avx",)),
        ("_cpu_avx512", ("avx", "avx512")),
    ):
        (path,) = PKG.glob(f"{name}.*.so")
        text = _objdump(path)
        assert text, f"objdump gave nothing for {path}"
        if "avx512" not in allowed:
            hits = avx512.findall(text)
            assert not hits, f"{path.name}: {len(hits)} AVX-512 operands"
        if "avx" not in allowed:
            hits = avx.findall(text)
            assert not hits, f"{path.name}: {len(hits)} AVX operands"
    assert avx512.search(_objdump(next(PKG.glob("_cpu_avx512.*.so"))))  # the check can see them


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) not installed")
@pytest.mark.skipif(not list(PKG.glob("_cpu_default.*.so")), reason="x86-64 build only")
@pytest.mark.parametrize("name", ["_cpu_default", "_cpu_avx2", "_cpu_avx512"])
def test_streaming_passes_keep_their_prefetches(name):
    """Every fused optimizer family, linear_filter_ and the Gaussian fill issue prefetches.

    GCC 12 treats a function whose only effect is a prefetch as const and deletes the calls to it:
    that silently removed the passes' state-buffer prefetch, and would remove the paced prefetch
    that the Adam, MacAdam and filter passes depend on (docs/BENCHMARKS.md, thirteenth session).
    cpu::prefetch_line guards against it; this reads the result in the machine code (a build from
    before the guard has no prefetch in its Adam, MacAdam, linear_filter_ and fill functions). A
    function counts if it prefetches or calls one that does (GCC inlines cpu::ChunkLines::request
    into some passes and not into others)."""
    (path,) = PKG.glob(f"{name}.*.so")
    functions = _functions(path)
    prefetches = {f for f, lines in functions.items() if any("prefetch" in line for line in lines)}
    calls = {f: {c.group(1) for line in lines if (c := re.search(r"\bcall\s+\w+ <(.+)>$", line))}
             for f, lines in functions.items()}  # fmt: skip
    with_prefetch = {f for f, callees in calls.items() if f in prefetches or callees & prefetches}
    for family in (*_OPTIM_FAMILIES, "linear_filter_cpu", "gaussian_cpu"):
        word = re.compile(rf"\b{family}\b")  # AdamChunk must not match MacAdamChunk
        assert any(word.search(f) for f in with_prefetch), f"{path.name}: no prefetch in any {family} function"


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) not installed")
@pytest.mark.skipif(not list(PKG.glob("_cpu_default.*.so")), reason="x86-64 build only")
@pytest.mark.parametrize("name", ["_cpu_default", "_cpu_avx2", "_cpu_avx512"])
def test_optimizer_passes_take_fp32_square_roots(name):
    """The fused optimizer passes take their square roots in fp32, as the reference does.

    An unqualified sqrt of a float on the host is C's sqrt(double): the Adam denominators were
    computed in float64 (√v̂ + ε rounded once, not the reference's fp32 sum) and the Adam, STP and
    MacAdam loops ran in float64 lanes (docs/BENCHMARKS.md, seventeenth session). A build from
    before the fix has sqrtpd or sqrtsd in its AdamChunk and MacAdamChunk functions."""
    (path,) = PKG.glob(f"{name}.*.so")
    family_re, checked = re.compile(rf"\b({'|'.join(_OPTIM_FAMILIES)})\b"), set()
    for function, lines in _functions(path).items():
        if (family := family_re.search(function)) is None:
            continue
        checked.add(family.group(1))
        for line in lines:
            assert re.search(r"\bv?sqrt[ps]d\b", line) is None, f"{path.name}: float64 square root in {family.group(1)}"
    assert checked == set(_OPTIM_FAMILIES), f"{path.name}: found {checked}"


_spec = importlib.util.spec_from_file_location("dpk_build_config", ROOT / "tools" / "build_config.py")
build_config = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build_config)


@pytest.mark.one_cpu_path
@pytest.mark.parametrize("capability", _backend.runnable_cpu_capabilities())
def test_chacha20_transform_accuracy(tmp_path, capability):
    """ChaCha20's float64 Box-Muller transform (csrc/cpu/noise_cpu.h) as each path this CPU runs
    builds it, against long double on 2^24 random uniforms and every edge (tools/noise_loop.cpp
    --errors): ln u within 0.85 ulp, cos and sin within 1.6e-16 (with FMA 0.81 ulp and 1.45e-16; the
    portable path on baseline x86-64 has none: 0.83 ulp and 1.5e-16), and -2 ln 1 = -0, as the
    reference's -2.0 * log(1.0). Checked to fail (AVX2 and portable builds): the log's first
    coefficient 1e-15 off (0.92 and 0.89 ulp), the sine's leading one 1e-15 off (6.5e-16), and the
    last subtraction as ((f² - ...) - 2f) - 2k ln 2, the same value but +0 at u = 1.
    """
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    exe = tmp_path / f"noise_loop_{capability}"
    res = subprocess.run(build_config.program_command(ROOT / "tools" / "noise_loop.cpp", exe, capability),
                         capture_output=True, text=True)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    out = subprocess.run([str(exe), "--errors"], capture_output=True, text=True, check=True).stdout
    m = re.search(
        r"on (\d+) uniforms: ln u within ([\d.]+) ulp, cos ([\d.e+-]+), sin ([\d.e+-]+), -2 ln 1 = ([-+])0", out
    )
    assert m, out
    points, log_ulps, cos_err, sin_err = int(m[1]), float(m[2]), float(m[3]), float(m[4])
    assert points > 16_000_000 and log_ulps <= 0.85 and cos_err <= 1.6e-16 and sin_err <= 1.6e-16, out
    assert m[5] == "-", out


@pytest.fixture(scope="module")
def portable_fma_check(tmp_path_factory) -> Path:
    """tests/portable_fma_check.cpp built with the portable module's flags (tools/build_config.py)."""
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    exe = tmp_path_factory.mktemp("fma") / "portable_fma_check"
    build = build_config.program_command(ROOT / "tests" / "portable_fma_check.cpp", exe, "default")
    res = subprocess.run(build, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    return exe


@pytest.mark.one_cpu_path
@pytest.mark.parametrize("tunables", ["", build_config.GLIBC_HIDE_FMA], ids=["as-is", "fma-hidden"])
def test_portable_fma_rounds_once(portable_fma_check, tunables):
    """The portable path's vfma, which computes fmaf in double where the target has no FMA
    instruction (csrc/cpu/noise_cpu.h), equals the C library's fmaf bit for bit on 333,184 cases
    (tests/portable_fma_check.cpp): inexact sums that rounding to double puts exactly on a midpoint
    between two floats in every binade, random bit patterns, overflow, underflow and cancellation.
    For 26,588 of them float(double(a) b + c) is wrong. Checked to fail: 24,649 mismatches without
    the midpoints' correction, 24,192 with it always one ulp up, 96 with the normal range's lower
    bound moved from 2^-125 to 2^-127."""
    env = {**os.environ, "GLIBC_TUNABLES": tunables}
    res = subprocess.run([str(portable_fma_check)], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    cases, mismatches, double_rounding_wrong = map(int, res.stdout.splitlines()[-1].split())
    assert mismatches == 0, res.stdout
    assert cases > 300_000 and double_rounding_wrong > 20_000, res.stdout
