"""Per-sample clipping ops on every backend, against the float64 reference.

Tolerances: kernels upcast every storage dtype exactly to fp32 and accumulate squares in fp64,
so the error does not depend on the input dtype. Norms are exact to a few fp32 roundings; a sum
of ``m = B·k`` weighted terms accumulated in fp32 is bounded by ``(m + 4)·2⁻²⁴·Σ|c_i α_j g|``
(sequential summation), which is the bound checked below, elementwise.
"""

import math
import os

import pytest
import torch

import dpkernels
from dpkernels.reference import clip as ref

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# input dtype -> (norm rtol, sum error in units of 2^-24 * Σ|terms|, plus the term count)
TOLERANCES = {
    torch.float32: (2e-6, 4),
    torch.bfloat16: (2e-6, 4),
    torch.float16: (2e-6, 4),
}

SHAPE_LISTS = {
    "one-odd": [(37,)],
    "mixed": [(7,), (33, 5), (1000,), (4097,), (3, 3, 3), (1,)],
    "many": [(i % 7 + 1, 2 * i + 1) for i in range(53)],
}


def make_grads(shapes, B, dtype, device="cpu", scales=None):
    """Random per-sample gradients; ``scales[i]`` multiplies sample i (huge/tiny norms)."""
    out = []
    for s in shapes:
        g = torch.randn(B, *s, dtype=torch.float64)
        if scales is not None:
            g = g * torch.as_tensor(scales, dtype=torch.float64).view(-1, *[1] * len(s))
        out.append(g.to(dtype).to(device))
    return out


def to64(xs):
    return [x.detach().cpu().double() for x in xs]


def assert_sums_close(sums, grad_sets, coeffs, weights, dtype):
    """Elementwise check against the fp64 reference with the summation bound above."""
    sets64 = [to64(gs) for gs in grad_sets]
    w64 = weights.detach().cpu().double()
    want = ref.weighted_sum(sets64, w64, coeffs)
    abs_sets = [[g.abs() for g in gs] for gs in sets64]
    scale = ref.weighted_sum(abs_sets, w64.abs(), [abs(a) for a in coeffs])
    terms = w64.shape[0] * len(coeffs)
    ulps = TOLERANCES[dtype][1]
    for idx, (got, exp, sc) in enumerate(zip(sums, want, scale, strict=True)):
        assert got.dtype == torch.float32
        assert got.shape == exp.shape, (idx, got.shape, exp.shape)
        assert torch.isfinite(got).all(), f"tensor {idx}: non-finite output (unwritten element?)"
        err = (got.cpu().double() - exp).abs()
        bound = (terms + ulps) * 2.0**-24 * sc + 1e-30
        worst = (err / bound).max().item() if err.numel() else 0.0
        assert worst <= 1.0, f"tensor {idx}: error {err.max().item():.3e} exceeds bound by {worst:.2f}x"


def assert_norms_close(got, want, dtype):
    rtol = TOLERANCES[dtype][0]
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.cpu().double(), want, rtol=rtol, atol=1e-30)


# ---------------------------------------------------------------------------------------------
# Agreement with the reference
# ---------------------------------------------------------------------------------------------

CASES = [
    # (shape list, B, options)
    ("one-odd", 1, {}),
    ("mixed", 7, {}),
    ("mixed", 5, {"per_layer": True}),
    ("mixed", 4, {"mode": "psac", "r": 0.1}),
    ("mixed", 3, {"mode": "auto_s", "r": 0.01}),
    ("mixed", 3, {"mode": "auto_v"}),
    ("mixed", 6, {"shift": True, "scale": True}),
    ("mixed", 5, {"scale": True, "per_layer": True}),
    ("mixed", 4, {"coeffs": [0.75, -0.25]}),
    ("mixed", 3, {"coeffs": [0.5, 0.3, 0.2], "shift": True}),
    ("many", 3, {}),
    ("many", 2, {"per_layer": True, "mode": "psac", "r": 0.1}),
]


def _build_case(shapes_name, B, opts, dtype, device):
    shapes = SHAPE_LISTS[shapes_name]
    opts = dict(opts)
    coeffs = opts.pop("coeffs", None)
    k = 1 if coeffs is None else len(coeffs)
    sets = [make_grads(shapes, B, dtype, device) for _ in range(k)]
    kw = dict(opts)
    if opts.get("shift"):
        kw["shift"] = [torch.randn(s, device=device) for s in shapes]
    if opts.get("scale"):
        kw["scale"] = [torch.rand(s, device=device) + 0.5 for s in shapes]
    grad_samples = sets[0] if coeffs is None else sets
    return sets, grad_samples, coeffs or [1.0], kw


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shapes_name,B,opts", CASES, ids=[f"{c[0]}-B{c[1]}-{'-'.join(c[2]) or 'flat'}" for c in CASES])
def test_clip_and_accumulate_matches_reference(backend_device, dtype, shapes_name, B, opts):
    backend, device = backend_device
    sets, grad_samples, coeffs, kw = _build_case(shapes_name, B, opts, dtype, device)
    C = 0.7
    sums, norms = dpkernels.clip_and_accumulate(
        grad_samples, C, coeffs=None if len(coeffs) == 1 else coeffs, backend=backend, **kw
    )
    vec64 = {k: to64(v) for k, v in kw.items() if k in ("shift", "scale")}
    want_norms = ref.per_sample_norms([to64(gs) for gs in sets], coeffs, per_layer=kw.get("per_layer", False), **vec64)
    assert_norms_close(norms, want_norms, dtype)
    mode, r = kw.get("mode", "clip"), kw.get("r", 0.0)
    weights = ref.clip_factors(want_norms, C, mode, r)
    if weights.dim() == 1:
        weights = weights[:, None].expand(-1, len(sets[0]))
    assert_sums_close(sums, sets, coeffs, weights, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_per_sample_norms_and_weighted_sum(backend_device, dtype):
    backend, device = backend_device
    shapes = SHAPE_LISTS["mixed"]
    g = make_grads(shapes, 9, dtype, device)
    norms = dpkernels.per_sample_norms(g, backend=backend)
    assert_norms_close(norms, ref.per_sample_norms([to64(g)]), dtype)
    layer_norms = dpkernels.per_sample_norms(g, per_layer=True, backend=backend)
    assert_norms_close(layer_norms, ref.per_sample_norms([to64(g)], per_layer=True), dtype)
    w = torch.randn(9, device=device)
    w[3] = 0.0
    assert_sums_close(dpkernels.weighted_sum(g, w, backend=backend), [g], [1.0], w[:, None].expand(-1, len(g)), dtype)
    w2 = torch.randn(9, len(shapes), device=device)
    assert_sums_close(dpkernels.weighted_sum(g, w2, backend=backend), [g], [1.0], w2, dtype)


@pytest.mark.parametrize("norm_dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("mode,r", [("clip", None), ("auto_s", 0.05), ("auto_v", None), ("psac", 0.1), ("psac", 1.0)])
def test_clip_factors_matches_reference(backend_device, mode, r, norm_dtype):
    backend, device = backend_device
    n = torch.cat([torch.tensor([0.0, 1e-30, 1e-12, 1e-7, 1.0, 1e30]), torch.rand(37) * 10]).to(norm_dtype)
    got = dpkernels.clip_factors(n.to(device), 1.3, mode=mode, r=r, backend=backend)
    want = ref.clip_factors(n.double(), 1.3, mode, r or 0.0)
    assert got.dtype == norm_dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got.cpu().double(), want, rtol=2e-7 if norm_dtype == torch.float32 else 1e-15, atol=0)
    per_layer = n.view(-1, 1).expand(-1, 3).contiguous()
    got2 = dpkernels.clip_factors(per_layer.to(device), [1.0, 2.0, 3.0], mode=mode, r=r, backend=backend)
    want2 = ref.clip_factors(per_layer.double(), [1.0, 2.0, 3.0], mode, r or 0.0)
    torch.testing.assert_close(got2.cpu().double(), want2, rtol=2e-7 if norm_dtype == torch.float32 else 1e-15, atol=0)


# DP-PSAC worked values (reference/seeds_pmlf_psac.md §B.3): weight per unit C.
PSAC_TABLE = [
    # n, psac w r=0.1, auto_s w r=0.1, psac w r=0.01, auto_s w r=0.01
    (0.0, 1.000000, 10.000000, 1.000000, 100.000000),
    (0.001, 1.008981, 9.900990, 1.098791, 90.909091),
    (0.01, 1.088032, 9.090909, 1.960784, 50.000000),
    (0.1, 1.666667, 5.000000, 5.238095, 9.090909),
    (0.5, 1.500000, 1.666667, 1.924528, 1.960784),
    (1.0, 0.916667, 0.909091, 0.990196, 0.990099),
    (10.0, 0.099901, 0.099010, 0.099990, 0.099900),
    (100.0, 0.010000, 0.009990, 0.010000, 0.009999),
]


def test_psac_worked_values(backend_device):
    backend, device = backend_device
    n = torch.tensor([row[0] for row in PSAC_TABLE], device=device)
    for col, (mode, r) in enumerate([("psac", 0.1), ("auto_s", 0.1), ("psac", 0.01), ("auto_s", 0.01)], start=1):
        want = torch.tensor([row[col] for row in PSAC_TABLE])
        got = dpkernels.clip_factors(n, 1.0, mode=mode, r=r, backend=backend).cpu()
        # The table is rounded to 6 decimals; an fp32 weight is rounded toward zero (< 1 ulp).
        torch.testing.assert_close(got, want, rtol=2.0**-23, atol=6e-7, msg=f"{mode} r={r}")
    # Peak of the PSAC weight at n = sqrt(r) - r is 1 / (2 sqrt(r) - r).
    for r in (0.1, 0.01):
        peak = torch.tensor([math.sqrt(r) - r], device=device)
        w = dpkernels.clip_factors(peak, 1.0, mode="psac", r=r, backend=backend).item()
        assert w == pytest.approx(1 / (2 * math.sqrt(r) - r), rel=1e-6)


# ---------------------------------------------------------------------------------------------
# Edge values: huge and tiny norms, zero rows, B = 0, non-finite samples, non-contiguous input
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_huge_tiny_and_zero_rows(backend_device, dtype):
    backend, device = backend_device
    big = 1e30 if dtype != torch.float16 else 1e3
    tiny = 1e-30 if dtype != torch.float16 else 1e-3
    scales = [big, tiny, 0.0, 1.0, 1e-6 if dtype != torch.float16 else 1e-2, 0.0]
    g = make_grads(SHAPE_LISTS["mixed"], len(scales), dtype, device, scales=scales)
    for mode in ("clip", "auto_s", "auto_v", "psac"):
        sums, norms = dpkernels.clip_and_accumulate(g, 1.0, mode=mode, backend=backend)
        want_norms = ref.per_sample_norms([to64(g)])
        assert_norms_close(norms, want_norms, dtype)
        assert norms[2].item() == 0.0 and norms[5].item() == 0.0
        weights = ref.clip_factors(want_norms, 1.0, mode, dict(auto_s=0.01, psac=0.1).get(mode, 0.0))
        assert_sums_close(sums, [g], [1.0], weights[:, None].expand(-1, len(g)), dtype)


def test_batch_of_zero_samples(backend_device):
    backend, device = backend_device
    g = [torch.empty(0, *s, device=device) for s in SHAPE_LISTS["mixed"]]
    sums, norms = dpkernels.clip_and_accumulate(g, 1.0, backend=backend)
    assert norms.shape == (0,)
    for s, shape in zip(sums, SHAPE_LISTS["mixed"], strict=True):
        assert s.shape == shape and s.dtype == torch.float32 and (s == 0).all()


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_raise_and_drop(backend_device, bad_value):
    backend, device = backend_device
    g = make_grads(SHAPE_LISTS["mixed"], 6, torch.float32, device)
    g[1][4, 0] = bad_value
    g[3][2, 17] = bad_value
    with pytest.raises(ValueError, match=r"non-finite per-sample gradient for 2 sample\(s\) at batch indices \[2, 4\]"):
        dpkernels.clip_and_accumulate(g, 1.0, backend=backend)
    for per_layer in (False, True):
        sums, norms = dpkernels.clip_and_accumulate(g, 1.0, nonfinite="drop", per_layer=per_layer, backend=backend)
        keep = [0, 1, 3, 5]
        kept = [x[keep] for x in g]
        want_norms = ref.per_sample_norms([to64(kept)], per_layer=per_layer)
        C = 1.0
        w = ref.clip_factors(want_norms, C)
        w = w[:, None].expand(-1, len(g)) if w.dim() == 1 else w
        assert_sums_close(sums, [kept], [1.0], w, torch.float32)
        assert torch.isfinite(norms[keep]).all() and not torch.isfinite(norms[[2, 4]].reshape(2, -1).sum(1)).any()


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")])
def test_stages_refuse_nonfinite_samples(backend_device, bad_value):
    """The three stages called one by one raise as the fused pipeline does, naming the samples,
    instead of returning a NaN sum: clip_factors on a NaN/Inf norm, weighted_sum on a NaN/Inf
    gradient with a nonzero weight or on a non-finite weight, or a sum that overflows fp32."""
    backend, device = backend_device
    g = make_grads(SHAPE_LISTS["mixed"], 6, torch.float32, device)
    g[1][4, 0] = bad_value
    g[3][2, 17] = bad_value
    norms = dpkernels.per_sample_norms(g, backend=backend)
    assert torch.isfinite(norms).tolist() == [True, True, False, True, False, True]
    for n in (norms, dpkernels.per_sample_norms(g, per_layer=True, backend=backend)):
        with pytest.raises(ValueError, match=r"non-finite norm for 2 sample\(s\) at batch indices \[2, 4\]"):
            dpkernels.clip_factors(n, 1.0, backend=backend)
    w = torch.rand(6, device=device) + 0.5
    with pytest.raises(ValueError, match=r"gradient with a nonzero weight for 2 sample\(s\) at batch indices \[2, 4\]"):
        dpkernels.weighted_sum(g, w, backend=backend)
    # Per tensor: sample 4 is non-finite only in tensor 1, where its weight is 0.
    w2 = torch.rand(6, len(g), device=device) + 0.5
    w2[4, 1] = 0.0
    with pytest.raises(ValueError, match=r"gradient with a nonzero weight for 1 sample\(s\) at batch indices \[2\]"):
        dpkernels.weighted_sum(g, w2, backend=backend)
    # Weight 0 skips a non-finite sample: the sum is that of the others.
    w[[2, 4]] = 0.0
    assert_sums_close(dpkernels.weighted_sum(g, w, backend=backend), [g], [1.0], w[:, None].expand(-1, len(g)),
                      torch.float32)  # fmt: skip
    finite = make_grads(SHAPE_LISTS["mixed"], 6, torch.float32, device)
    for bad_w in (float("nan"), float("inf"), 1e39):
        w = torch.ones(6, dtype=torch.float64, device=device)
        w[1] = bad_w
        with pytest.raises(ValueError, match=r"non-finite weight \(NaN, Inf or beyond the torch.float32 range\) "
                                             r"for 1 sample\(s\) at batch indices \[1\]"):  # fmt: skip
            dpkernels.weighted_sum(finite, w, backend=backend)
    with pytest.raises(ValueError, match=r"overflows torch.float32 in tensor\(s\) \[0\]"):
        dpkernels.weighted_sum([torch.full((2, 3), 3e38, device=device)], torch.ones(2, device=device), backend=backend)


def test_zero_dim_parameters(backend_device):
    """A 0-d parameter's per-sample gradient is ``[B]``: every op treats it as one element, on every
    backend, and equals the reference on the same data given as ``[B, 1]`` (reshaped back)."""
    backend, device = backend_device
    B, shapes = 5, [(), (4,), (), (2, 3)]
    g = make_grads(shapes, B, torch.float32, device)
    g2 = make_grads(shapes, B, torch.float32, device)
    rows = [x.reshape(B, 1) if x.dim() == 1 else x for x in g]
    rows2 = [x.reshape(B, 1) if x.dim() == 1 else x for x in g2]

    def close(got, want):
        for a, b, shape in zip(got, want, shapes, strict=True):
            assert a.shape == shape and torch.isfinite(a).all()
            torch.testing.assert_close(a.cpu(), b.cpu().reshape(shape), rtol=1e-5, atol=1e-6)
        assert any(a.abs().sum() > 0 for a in got)

    for per_layer in (False, True):
        got = dpkernels.per_sample_norms(g, per_layer=per_layer, backend=backend)
        want = dpkernels.per_sample_norms(rows, per_layer=per_layer, backend="reference")
        torch.testing.assert_close(got.cpu(), want.cpu(), rtol=2e-6, atol=0)
        C = [0.5, 1.0, 2.0, 0.7] if per_layer else 0.9
        sums, norms = dpkernels.clip_and_accumulate(g, C, per_layer=per_layer, backend=backend)
        want_sums, want_norms = dpkernels.clip_and_accumulate(rows, C, per_layer=per_layer, backend="reference")
        close(sums, want_sums)
        torch.testing.assert_close(norms.cpu(), want_norms.cpu(), rtol=2e-6, atol=0)
    sums, _ = dpkernels.clip_and_accumulate([g, g2], 0.9, coeffs=[0.7, 0.3], backend=backend)
    close(sums, dpkernels.clip_and_accumulate([rows, rows2], 0.9, coeffs=[0.7, 0.3], backend="reference")[0])
    w = torch.rand(B, device=device)
    close(dpkernels.weighted_sum(g, w, backend=backend), dpkernels.weighted_sum(rows, w, backend="reference"))
    kw = dict(seed=3, step=1, expected_batch_size=B)
    want = dpkernels.privatize(rows, 0.9, 0.5, backend="reference", **kw)
    close(dpkernels.privatize(g, 0.9, 0.5, backend=backend, **kw), want)


def test_noncontiguous_inputs(backend_device):
    backend, device = backend_device
    base = [torch.randn(5, 9, 4, device=device), torch.randn(11, 5, device=device)]
    g = [base[0].transpose(1, 2), base[1].t()]  # [5, 4, 9] and [5, 11], both non-contiguous
    assert not any(x.is_contiguous() for x in g)
    sums, norms = dpkernels.clip_and_accumulate(g, 0.5, backend=backend)
    sums_c, norms_c = dpkernels.clip_and_accumulate([x.contiguous() for x in g], 0.5, backend=backend)
    torch.testing.assert_close(norms, norms_c, rtol=0, atol=0)
    for a, b in zip(sums, sums_c, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_mixed_dtypes_in_one_list(backend_device):
    backend, device = backend_device
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float32]
    g = [torch.randn(4, 2 * i + 3, device=device).to(dt) for i, dt in enumerate(dtypes)]
    sums, norms = dpkernels.clip_and_accumulate(g, 1.0, backend=backend)
    want_norms = ref.per_sample_norms([to64(g)])
    assert_norms_close(norms, want_norms, torch.float32)
    w = ref.clip_factors(want_norms, 1.0)
    assert_sums_close(sums, [g], [1.0], w[:, None].expand(-1, len(g)), torch.float32)


def test_deterministic(backend_device):
    backend, device = backend_device
    g = make_grads(SHAPE_LISTS["mixed"], 7, torch.float32, device)
    a = dpkernels.clip_and_accumulate(g, 1.0, backend=backend)
    b = dpkernels.clip_and_accumulate(g, 1.0, backend=backend)
    assert torch.equal(a[1], b[1]) and all(torch.equal(x, y) for x, y in zip(a[0], b[0], strict=True))


def test_sums_are_independent_tensors(backend_device):
    """The cpu backend carves all sums from one allocation (clip_layout.h new_outputs): each must
    still be its own tensor, with its own storage and version counter, and outlive the others."""
    backend, device = backend_device
    g = make_grads(SHAPE_LISTS["mixed"], 5, torch.float32, device)
    sums, _ = dpkernels.clip_and_accumulate(g, 1.0, backend=backend)
    before = [s.clone() for s in sums]
    ptrs = {s.untyped_storage().data_ptr() for s in sums}
    assert len(ptrs) == len(sums)
    versions = [s._version for s in sums]
    sums[0].add_(1.0)
    assert torch.equal(sums[0], before[0] + 1.0)
    for s, b, v in zip(sums[1:], before[1:], versions[1:], strict=True):
        assert torch.equal(s, b) and s._version == v
    last = sums[-1]
    del sums
    assert torch.equal(last, before[-1])  # still valid once its siblings are gone


def test_cpu_streaming_stores_match_plain_stores():
    """A cpu sum pass that streams more than the private caches hold writes its sums with
    non-temporal stores (stream_cpu.h OutputStore), a smaller one with plain stores. With
    per-layer clipping each tensor's sum depends on that tensor alone, so one large call must give
    bitwise what one small call per tensor gives; the large call's privatize (whose noise epilogue
    ends in the same stores) must match the reference's, Philox stream included."""
    if "cpu" not in dpkernels.available_backends("cpu"):
        pytest.skip("cpu backend not built")
    B = 8
    l2 = os.sysconf("SC_LEVEL2_CACHE_SIZE") if "SC_LEVEL2_CACHE_SIZE" in os.sysconf_names else 0
    threshold = (l2 if l2 > 0 else 1 << 20) * torch.get_num_threads()
    # Odd sizes (vector tails), tensors below one task, and enough bytes to cross the threshold.
    shapes = [(3, 5), (4097,), (7,)] + [(1001, 33)] * (2 * threshold // (B * 4 * 1001 * 33) + 1)
    if B * 4 * sum(math.prod(s) for s in shapes) > 1 << 28:
        pytest.skip("the private caches here are too large for a quick test")
    g = make_grads(shapes, B, torch.float32, scales=torch.linspace(0.1, 3.0, B).tolist())
    C = [float(math.sqrt(math.prod(s))) for s in shapes]
    big, _ = dpkernels.clip_and_accumulate(g, C, per_layer=True, backend="cpu")
    for t in range(len(shapes)):
        small, _ = dpkernels.clip_and_accumulate([g[t]], [C[t]], per_layer=True, backend="cpu")
        assert torch.equal(big[t], small[0]), t
    noisy = {
        b: dpkernels.privatize(g, C, 0.5, per_layer=True, seed=11, step=2, backend=b) for b in ("cpu", "reference")
    }
    for a, b in zip(noisy["cpu"], noisy["reference"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("opts", [{}, {"per_layer": True, "mode": "psac"}, {"coeffs": [0.7, 0.3], "shift": True}])
def test_native_pipeline_equals_its_stages(backend_device, opts):
    """cpu/cuda run clip_and_accumulate as one native op; it must give what the reference's
    composition of the same backend's three stage kernels gives (weights formed in float64 from
    the same sums of squares, so at most one rounding apart)."""
    backend, device = backend_device
    if backend not in ("cpu", "cuda"):
        pytest.skip("one native op on the cpu and cuda backends only")

    opts = dict(opts)
    coeffs = opts.pop("coeffs", [1.0])
    sets = [make_grads(SHAPE_LISTS["mixed"], 6, torch.float32, device) for _ in coeffs]
    sets[0][2][3] *= 1e4  # one sample far above the bound, so that its weight is < 1
    shift = [torch.randn(s, device=device) for s in SHAPE_LISTS["mixed"]] if opts.pop("shift", False) else None
    mode = opts.pop("mode", "clip")
    r = dpkernels.clip.DEFAULT_R.get(mode, 0.0)
    per_layer = opts.pop("per_layer", False)
    grad_samples = sets[0] if len(sets) == 1 else sets
    sums, norms = dpkernels.clip_and_accumulate(
        grad_samples, 0.8, mode=mode, shift=shift, per_layer=per_layer, coeffs=coeffs, backend=backend
    )
    C = [0.8] * len(sets[0]) if per_layer else 0.8
    native = dpkernels.clip.CLIP.kernels(backend)
    staged = dpkernels.clip._StagedClip(native)  # the reference's composition of the native stages
    flat = [g for gs in sets for g in gs]
    Cs = C if per_layer else [C]
    want_sums, want_norms, _ = staged.pipeline(flat, coeffs, Cs, mode, r, shift or [], [], per_layer, "raise")
    torch.testing.assert_close(norms, want_norms, rtol=2**-23, atol=0)
    for a, b in zip(sums, want_sums, strict=True):
        torch.testing.assert_close(a, b, rtol=2**-22, atol=1e-7)


def _pipeline_args(grads, **overrides):
    """The positional arguments of dpkernels_C::clip_pipeline (csrc/ops.cpp), plain clipping at C=0.8."""
    args = {"coeffs": [1.0], "C": [0.8], "mode": "clip", "r": 0.0, "shift": [], "scale": [], "per_layer": False,
            "drop_nonfinite": False, "norm_scale": 1.0, "rng": "none", "noise_std": 0.0, "key": [], "step": 0,
            "stream": 0, "out_scale": 1.0, "noise": []}  # fmt: skip
    args.update(overrides)
    return (grads, *args.values())


def _native_only(backend):
    if backend not in ("cpu", "cuda"):
        pytest.skip("the native op: cpu and cuda backends only")


def test_native_op_raises(backend_device):
    backend, device = backend_device
    _native_only(backend)
    g = make_grads(SHAPE_LISTS["mixed"], 5, torch.float32, device)
    g[0][3, 0] = float("nan")
    call = torch.ops.dpkernels_C.clip_pipeline
    with pytest.raises(ValueError, match=r"non-finite per-sample gradient for 1 sample\(s\) at batch indices \[3\]"):
        call(*_pipeline_args(g))
    with pytest.raises(RuntimeError, match=r"grads\[1\] must be \[B=5"):
        call(*_pipeline_args([g[0], g[1][:4]]))


class _Tagged(torch.Tensor):
    """A tensor subclass with the default __torch_function__: the fast path must not bypass it."""


def _recording_mode(base, hook):
    """An instance of a torch-function or torch-dispatch mode (``base``, whose ``hook`` method sees
    every op) that records the ops in ``.calls`` and runs them."""

    def record(self, func, types, args=(), kwargs=None):
        self.calls.append(func)
        return func(*args, **(kwargs or {}))

    mode = type("Recording", (base,), {hook: record})()
    mode.calls = []
    return mode


def test_fast_path_keeps_torch_function(backend_device):
    """For a tensor subclass, or under a torch-function mode, clip_and_accumulate's call of the
    native op goes through torch.ops, where __torch_function__ sees it."""
    backend, device = backend_device
    _native_only(backend)
    g = make_grads(SHAPE_LISTS["mixed"], 4, torch.float32, device)
    want_sums, want_norms = dpkernels.clip_and_accumulate(g, 0.8, backend=backend)
    tagged = g[:-1] + [g[-1].as_subclass(_Tagged)]
    sums, norms = dpkernels.clip_and_accumulate(tagged, 0.8, backend=backend)
    assert torch.equal(norms, want_norms) and all(torch.equal(a, b) for a, b in zip(sums, want_sums, strict=True))
    mode = _recording_mode(torch.overrides.TorchFunctionMode, "__torch_function__")
    with mode:
        sums, norms = dpkernels.clip_and_accumulate(g, 0.8, backend=backend)
    assert (
        torch.ops.dpkernels_C.clip_pipeline.default in mode.calls or torch.ops.dpkernels_C.clip_pipeline in mode.calls
    )
    assert torch.equal(norms, want_norms) and all(torch.equal(a, b) for a, b in zip(sums, want_sums, strict=True))


def test_fast_path_goes_through_the_dispatcher(backend_device):
    """The eager fast path skips only the dpkernels:: wrapper: a torch-dispatch mode and the
    profiler still see dpkernels_C::clip_pipeline."""
    from torch.utils._python_dispatch import TorchDispatchMode

    backend, device = backend_device
    _native_only(backend)

    g = make_grads(SHAPE_LISTS["mixed"], 4, torch.float32, device)
    want = dpkernels.clip_and_accumulate(g, 0.8, backend=backend)
    with _recording_mode(TorchDispatchMode, "__torch_dispatch__") as rec:
        got = dpkernels.clip_and_accumulate(g, 0.8, backend=backend)
    assert torch.ops.dpkernels_C.clip_pipeline.default in rec.calls
    assert torch.equal(got[1], want[1])
    with torch.profiler.profile() as prof:
        dpkernels.clip_and_accumulate(g, 0.8, backend=backend)
    assert "dpkernels_C::clip_pipeline" in {e.name for e in prof.events()}


def test_cpu_result_independent_of_thread_count():
    if "cpu" not in dpkernels.available_backends("cpu"):
        pytest.skip("cpu backend not built")
    g = make_grads([(70_000,), (300, 301), (5,)], 9, torch.float32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = dpkernels.clip_and_accumulate(g, 1.0, backend="cpu")
        torch.set_num_threads(max(2, threads))
        many = dpkernels.clip_and_accumulate(g, 1.0, backend="cpu")
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[1], many[1]) and all(torch.equal(x, y) for x, y in zip(one[0], many[0], strict=True))


# ---------------------------------------------------------------------------------------------
# Errors: every bad input is named, nothing is silently reinterpreted
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make_args,exc,match",
    [
        (lambda: ([],), ValueError, "empty list"),
        (lambda: (torch.randn(3, 4),), TypeError, "must be a list"),
        (
            lambda: ([torch.randn(3, 4), torch.randn(4, 4)],),
            ValueError,
            "batch size 4 but grad_samples\\[0\\] has 3",
        ),
        (lambda: ([torch.randint(0, 3, (3, 4))],), TypeError, "dtype torch.int64"),
        (
            lambda: ([torch.randn(3, 4), torch.randn(3, 4, device="meta")],),
            ValueError,
            "all tensors must share one device",
        ),
        (lambda: ([torch.randn(3, 4)], 0.0), ValueError, "max_grad_norm must be finite and > 0"),
        (lambda: ([torch.randn(3, 4)], -1.0), ValueError, "max_grad_norm must be finite and > 0"),
        (lambda: ([torch.randn(3, 4)], float("inf")), ValueError, "max_grad_norm must be finite and > 0"),
        (lambda: ([torch.randn(3, 4)], [1.0]), ValueError, "needs per_layer=True"),
        (lambda: ([torch.randn(3, 4)], 1.0, {"mode": "clamp"}), ValueError, "unknown clip mode 'clamp'"),
        (
            lambda: ([torch.randn(3, 4)], 1.0, {"mode": "psac", "r": 0.0}),
            ValueError,
            "r must be a finite number > 0",
        ),
        (
            lambda: ([torch.randn(3, 4)], 1.0, {"mode": "auto_s", "r": -1}),
            ValueError,
            "r must be a finite number > 0",
        ),
        (lambda: ([torch.randn(3, 4)], 1.0, {"mode": "clip", "r": 0.1}), ValueError, "r is only used by"),
        (lambda: ([torch.randn(3, 4)], 1.0, {"nonfinite": "skip"}), ValueError, "nonfinite must be"),
        (
            lambda: ([torch.randn(3, 4)], 1.0, {"shift": [torch.randn(5)]}),
            ValueError,
            "shift\\[0\\] has shape",
        ),
        (
            lambda: ([torch.randn(3, 4)], 1.0, {"scale": [torch.randn(4)] * 2}),
            ValueError,
            "list of 1 tensors",
        ),
        (lambda: ([[torch.randn(3, 4)], [torch.randn(3, 4)]], 1.0), ValueError, "pass coeffs"),
        (
            lambda: ([[torch.randn(3, 4)], [torch.randn(3, 4)]], 1.0, {"coeffs": [1.0]}),
            ValueError,
            "coeffs has 1",
        ),
        (
            lambda: ([torch.randn(3, 4)], 1.0, {"coeffs": [float("nan")]}),
            ValueError,
            "coeffs\\[0\\] must be a finite number",
        ),
        (
            lambda: ([torch.randn(3, 4).double()], 1.0, {"backend": "cpu"}),
            TypeError,
            "float64 runs on backend='reference'",
        ),
        (lambda: ([torch.randn(3, 4)], 1.0, {"backend": "gpu"}), ValueError, "unknown backend 'gpu'"),
        (
            lambda: ([torch.randn(3, 4)], 1.0, {"backend": "cuda"}),
            RuntimeError,
            "cuda backend runs on CUDA tensors",
        ),
        (
            lambda: ([torch.randn(3, 4)], 1.0, {"per_layer": True, "max_grad_norm": None}),
            TypeError,
            "max_grad_norm must be a float",
        ),
    ],
)
def test_bad_input_raises_clear_error(make_args, exc, match):
    args = make_args()
    kwargs = dict(args[2]) if len(args) > 2 else {}
    max_grad_norm = kwargs.pop("max_grad_norm", args[1] if len(args) > 1 else 1.0)
    with pytest.raises(exc, match=match):
        dpkernels.clip_and_accumulate(args[0], max_grad_norm, **kwargs)


def test_weighted_sum_and_clip_factors_errors():
    g = [torch.randn(3, 4)]
    with pytest.raises(ValueError, match="weights must have shape"):
        dpkernels.weighted_sum(g, torch.ones(4))
    with pytest.raises(TypeError, match="weights must be a floating-point"):
        dpkernels.weighted_sum(g, torch.ones(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="norms must be"):
        dpkernels.clip_factors(torch.ones(2, 2, 2), 1.0)
    with pytest.raises(ValueError, match="max_grad_norm has 2 entries for 3"):
        dpkernels.clip_factors(torch.ones(4, 3), [1.0, 2.0])


FP32_MAX = torch.finfo(torch.float32).max


def _stage_calls(g, coeffs, backend):
    """Each public op on the ``k`` gradient sets ``g`` with ``coeffs``."""
    kw = dict(coeffs=coeffs, backend=backend)
    B = g[0][0].shape[0]
    return {
        "clip_and_accumulate": lambda: dpkernels.clip_and_accumulate(g, 1.0, **kw)[0],
        "privatize": lambda: dpkernels.privatize(g, 1.0, 0.5, seed=1, step=0, expected_batch_size=B, **kw),
        "per_sample_norms": lambda: [dpkernels.per_sample_norms(g, **kw)],
        "weighted_sum": lambda: dpkernels.weighted_sum(g, torch.full((B,), 0.5, device=g[0][0].device), **kw),
    }


@pytest.mark.parametrize("op", ["clip_and_accumulate", "privatize", "per_sample_norms", "weighted_sum"])
def test_coefficient_beyond_fp32_is_refused(backend_device, op):
    """A coefficient α_j above the fp32 maximum in magnitude (inf in the fp32 kernels) gets one
    ValueError naming it, on every backend, before any kernel runs; the maximum itself works."""
    backend, device = backend_device
    g = [[torch.randn(3, 4, device=device)], [torch.randn(3, 4, device=device) * 1e-38]]
    for bad in (1e39, -1e39, float("inf")):
        with pytest.raises(ValueError, match=r"coeffs\[1\] must be a finite number in \[-3.40\d*e\+38, 3.40\d*e\+38\]"):
            _stage_calls(g, [0.5, bad], backend)[op]()
    got = _stage_calls(g, [0.5, -FP32_MAX], backend)[op]()
    want = _stage_calls([[x.cpu() for x in gs] for gs in g], [0.5, -FP32_MAX], "reference")[op]()
    for a, b in zip(got, want, strict=True):
        assert torch.isfinite(a).all() and (a != 0).any()
        torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", dpkernels.BACKENDS)
def test_explicit_backend_on_meta_tensors(backend):
    """Every explicit backend refuses meta tensors with one message; backend="auto" gives the output
    shapes from the ops' fake kernels (reference's registered ops, dispatched by device)."""
    g = [torch.empty(3, 4, device="meta"), torch.empty(3, device="meta")]
    calls = {
        "clip_and_accumulate": lambda b: dpkernels.clip_and_accumulate(g, 1.0, backend=b)[0],
        "privatize": lambda b: dpkernels.privatize(g, 1.0, 0.5, seed=1, step=0, expected_batch_size=3, backend=b),
        "per_sample_norms": lambda b: [dpkernels.per_sample_norms(g, backend=b)],
        "weighted_sum": lambda b: dpkernels.weighted_sum(g, torch.empty(3, device="meta"), backend=b),
        "clip_factors": lambda b: [dpkernels.clip_factors(torch.empty(3, device="meta"), 1.0, backend=b)],
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=f"backend '{backend}' cannot run on meta tensors.*backend='auto'"):
            call(backend)
        out = call("auto")
        assert all(t.is_meta for t in out), name
        assert [tuple(t.shape) for t in out] == ([(4,), ()] if len(out) == 2 else [(3,)]), name


def test_native_ops_reject_bad_layouts():
    if "cpu" not in dpkernels.available_backends("cpu"):
        pytest.skip("cpu backend not built")
    ops = torch.ops.dpkernels_C
    with pytest.raises(RuntimeError, match="must be contiguous"):
        ops.per_sample_sumsq([torch.randn(4, 3).t()], [1.0], [], [])
    with pytest.raises(RuntimeError, match="weights must be a contiguous float32"):
        ops.weighted_sum([torch.randn(3, 4)], [1.0], torch.ones(3))
    with pytest.raises(RuntimeError, match="unknown clip mode"):
        ops.clip_factors(torch.ones(3), [1.0], "nope", 0.0)
    g = [torch.randn(3, 4), torch.randn(3, 2)]
    plain = (1.0, "none", 0.0, [], 0, 0, 1.0, [])
    with pytest.raises(RuntimeError, match="max_grad_norm must hold 1 values, got 2"):
        ops.clip_pipeline(g, [1.0], [1.0, 1.0], "clip", 0.0, [], [], False, False, *plain)
    with pytest.raises(RuntimeError, match="max_grad_norm must hold 1 or L=2 values, got 3"):
        ops.clip_pipeline(g, [1.0], [1.0, 1.0, 1.0], "clip", 0.0, [], [], True, False, *plain)
    with pytest.raises(ValueError, match="max_grad_norm must be finite and > 0"):
        ops.clip_pipeline(g, [1.0], [float("nan")], "clip", 0.0, [], [], False, False, *plain)
    with pytest.raises(RuntimeError, match="rng must be 'none', 'philox' or 'chacha20'"):
        ops.clip_pipeline(g, [1.0], [1.0], "clip", 0.0, [], [], False, False, 1.0, "mt", 1.0, [1], 0, 0, 1.0, [])
    with pytest.raises(RuntimeError, match="noise\\[1\\] must be a contiguous float32 tensor"):
        noise = [torch.zeros(4), torch.zeros(3)]
        ops.clip_pipeline(g, [1.0], [1.0], "clip", 0.0, [], [], False, False, 1.0, "none", 0.0, [], 0, 0, 1.0, noise)


def test_available_backends():
    found = dpkernels.available_backends()
    assert found[0] == "reference" and set(found) <= set(dpkernels.BACKENDS)
    assert "cuda" not in dpkernels.available_backends("cpu")


def test_pure_python_install_falls_back(tmp_path):
    """Without the compiled extension the package still imports and runs on reference."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['dpkernels._C'] = None\n"
        "import torch, dpkernels\n"
        "assert 'cpu' not in dpkernels.available_backends(), dpkernels.available_backends()\n"
        "sums, norms = dpkernels.clip_and_accumulate([torch.randn(3, 4)], 1.0)\n"
        "assert norms.shape == (3,)\n"
        "try:\n"
        "    dpkernels.clip_and_accumulate([torch.randn(3, 4)], 1.0, backend='cpu')\n"
        "except RuntimeError as e:\n"
        "    assert 'without its C++ extension' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('cpu backend must be unavailable')\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
