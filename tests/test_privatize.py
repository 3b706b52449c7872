"""The fused private gradient ``(Σ c_i g_i + σCz)/B`` on every backend: exact against the reference
with the same Philox stream or injected noise, and equal to Opacus's clip → add_noise → scale_grad.
With shift/scale: noise of std σC in the scaled space where the clip holds, mapped back."""

import math

import pytest
import torch

import dpkernels
from dpkernels.reference import clip as ref
from dpkernels.reference import noise as ref_noise

SHAPES = [(7,), (33, 5), (1000,), (4097,), (3, 3, 3)]


def _grads(B, device, dtype=torch.float32):
    return [torch.randn(B, *s, dtype=torch.float64).to(dtype).to(device) for s in SHAPES]


def _expected(g, C, sigma, B_div, seed, step, stream=0, mode="clip", r=0.0, per_layer=False, noise=None):
    sets = [[x.cpu().double() for x in g]]
    w, _ = ref.clip_weights(sets, C, [1.0], mode, r, None, None, per_layer, "raise")
    sens = math.sqrt(sum(c * c for c in C)) if per_layer else C
    return ref.privatized_sum(sets, w, [1.0], sigma * sens, seed, step, stream, 1.0 / B_div, noise)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("per_layer", [False, True], ids=["flat", "per-layer"])
def test_matches_reference_philox(backend_device, dtype, per_layer):
    backend, device = backend_device
    g = _grads(6, device, dtype)
    C = [0.5, 1.0, 2.0, 0.7, 0.3] if per_layer else 0.9
    got = dpkernels.privatize(
        g,
        C,
        1.1,
        seed=2**63 + 17,
        step=41,
        stream=3,
        expected_batch_size=8,
        per_layer=per_layer,
        backend=backend,
    )
    want = _expected(g, C, 1.1, 8, 2**63 + 17, 41, 3, per_layer=per_layer)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == torch.float32 and torch.isfinite(a).all()
        torch.testing.assert_close(a.cpu().double(), b, rtol=1e-5, atol=1e-6)


CHACHA_KEY = 0x0123456789ABCDEF_FEDCBA9876543210_0F1E2D3C4B5A6978_8796A5B4C3D2E1F0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("per_layer", [False, True], ids=["flat", "per-layer"])
def test_matches_reference_chacha20(backend_device, dtype, per_layer):
    """Secure mode: same key, same result as the reference backend within fp32 rounding."""
    backend, device = backend_device
    g = _grads(6, device, dtype)
    C = [0.5, 1.0, 2.0, 0.7, 0.3] if per_layer else 0.9
    kw = dict(seed=CHACHA_KEY, step=41, stream=3, expected_batch_size=8, per_layer=per_layer, rng="chacha20")
    got = dpkernels.privatize(g, C, 1.1, backend=backend, **kw)
    want = dpkernels.privatize([x.cpu() for x in g], C, 1.1, backend="reference", **kw)
    philox = dpkernels.privatize(g, C, 1.1, backend=backend, **{**kw, "rng": "philox", "seed": 5})
    for a, b, c in zip(got, want, philox, strict=True):
        assert a.dtype == torch.float32 and torch.isfinite(a).all()
        torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-6)
        assert (a.cpu() != c.cpu()).all()


def test_chacha20_noise_is_the_secure_stream(backend_device):
    """Zero gradients: the output is fp32(σCz) / B with z the ChaCha20 normals of the concatenated
    parameters (float64 Box-Muller, one rounding), fresh each step."""
    backend, device = backend_device
    B, sigma, C = 4, 1.3, 0.5
    g = [torch.zeros(B, *s, device=device) for s in SHAPES]
    out_t = dpkernels.privatize(g, C, sigma, seed=CHACHA_KEY, step=5, rng="chacha20", backend=backend)
    out_t1 = dpkernels.privatize(g, C, sigma, seed=CHACHA_KEY, step=6, rng="chacha20", backend=backend)
    flat_t = torch.cat([o.flatten() for o in out_t]).cpu()
    flat_t1 = torch.cat([o.flatten() for o in out_t1]).cpu()
    z = ref_noise.chacha20_standard_normal(flat_t.numel(), key=CHACHA_KEY, step=5)
    torch.testing.assert_close(flat_t, (sigma * C * z).float() * (1.0 / B), rtol=2**-22, atol=0)
    assert (flat_t != flat_t1).all()


def test_chacha20_fused_equals_sum_then_add_noise(backend_device):
    """The fused secure epilogue is weighted_sum, then add_gaussian_noise_(rng="chacha20") on the
    sums (float64 sum, one rounding), then the 1/B scale: the same key gives the same noise."""
    backend, device = backend_device
    B, C, sigma = 6, 0.9, 1.1
    g = _grads(B, device)
    fused = dpkernels.privatize(g, C, sigma, seed=CHACHA_KEY, step=3, rng="chacha20", backend=backend)
    weights = dpkernels.clip_factors(dpkernels.per_sample_norms(g, backend=backend), C, backend=backend)
    sums = dpkernels.weighted_sum(g, weights, backend=backend)
    dpkernels.add_gaussian_noise_(sums, sigma * C, seed=CHACHA_KEY, step=3, rng="chacha20", backend=backend)
    for a, s in zip(fused, sums, strict=True):
        torch.testing.assert_close(a, s * (1.0 / B), rtol=2**-22, atol=1e-7)


def test_injected_noise_is_exact(backend_device):
    backend, device = backend_device
    g = _grads(5, device)
    noise = [torch.randn(s, device=device) for s in SHAPES]
    got = dpkernels.privatize(g, 1.0, 0.0, seed=1, step=0, noise=noise, backend=backend)
    want = _expected(g, 1.0, 0.0, 5, 1, 0, noise=[n.cpu().double() for n in noise])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.cpu().double(), b, rtol=1e-5, atol=1e-6)


def test_noise_is_independent_of_batch_and_fresh_each_step(backend_device):
    """With zero gradients the output is exactly the noise: check its scale and that step t and
    t+1 differ; the noise equals gaussian_noise over the concatenated parameters."""
    backend, device = backend_device
    B = 4
    g = [torch.zeros(B, *s, device=device) for s in SHAPES]
    sigma, C = 1.3, 0.5
    out_t = dpkernels.privatize(g, C, sigma, seed=9, step=5, backend=backend)
    out_t1 = dpkernels.privatize(g, C, sigma, seed=9, step=6, backend=backend)
    flat_t = torch.cat([o.flatten() for o in out_t]).cpu()
    flat_t1 = torch.cat([o.flatten() for o in out_t1]).cpu()
    z = ref_noise.standard_normal(flat_t.numel(), seed=9, step=5)
    torch.testing.assert_close(flat_t, sigma * C * z / B, rtol=0, atol=1e-6)
    assert (flat_t != flat_t1).all()


def test_matches_opacus_with_same_noise(backend_device):
    opacus = pytest.importorskip("opacus")
    backend, device = backend_device
    if device != "cpu":
        pytest.skip("Opacus comparison runs on CPU tensors")
    B, C, sigma = 10, 0.8, 1.2
    params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
    for p in params:
        p.grad_sample = torch.randn(B, *p.shape) * 3
    opt = opacus.optimizers.DPOptimizer(
        torch.optim.SGD(params, lr=0.1), noise_multiplier=sigma, max_grad_norm=C, expected_batch_size=B
    )
    gen = torch.Generator().manual_seed(0)
    opt.generator = gen
    opt.clip_and_accumulate()
    state = gen.get_state()
    opt.add_noise()
    opt.scale_grad()
    # Replay Opacus's noise draws.
    gen.set_state(state)
    noise = [torch.normal(0, sigma * C, p.shape, generator=gen) for p in params]
    got = dpkernels.privatize(
        [p.grad_sample for p in params],
        C,
        sigma,
        seed=0,
        step=0,
        noise=noise,
        expected_batch_size=B,
        backend=backend,
    )
    for p, a in zip(params, got, strict=True):
        torch.testing.assert_close(a, p.grad, rtol=1e-5, atol=1e-6)


def test_bad_arguments():
    g = _grads(3, "cpu")
    with pytest.raises(ValueError, match="noise_multiplier must be"):
        dpkernels.privatize(g, 1.0, -1.0, seed=1, step=0)
    with pytest.raises(ValueError, match=r"expected_batch_size must be an integer in \[1, inf\)"):
        dpkernels.privatize(g, 1.0, 1.0, seed=1, step=0, expected_batch_size=0)
    with pytest.raises(ValueError, match="the batch is empty: pass expected_batch_size"):
        dpkernels.privatize([torch.zeros(0, 3)], 1.0, 1.0, seed=1, step=0)
    with pytest.raises(ValueError, match="step must be an integer"):
        dpkernels.privatize(g, 1.0, 1.0, seed=1, step=-1)
    with pytest.raises(ValueError, match="rng must be one of"):
        dpkernels.privatize(g, 1.0, 1.0, seed=1, step=0, rng="mt19937")
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\^256\)"):
        dpkernels.privatize(g, 1.0, 1.0, seed=2**256, step=0, rng="chacha20")
    with pytest.raises(ValueError, match="noise must be a list of 5 tensors"):
        dpkernels.privatize(g, 1.0, 1.0, seed=1, step=0, noise=[torch.zeros(7)])


# --------------------------------------------------------------------------------------------
# shift/scale: the clip bounds ‖c_i (g_i − shift) ⊙ scale‖, so the noise σΔz is added there and
# the result mapped back: out = (S − (Σ c_i)·shift + σΔz/scale)/B + shift.
# --------------------------------------------------------------------------------------------


def _affine_vectors(device, lo=0.05, hi=0.5):
    """shift ~ N(0, 1) and a scale with entries of both signs and magnitudes spread over [lo, hi]."""
    shift = [torch.randn(s, dtype=torch.float64).float().to(device) for s in SHAPES]
    scale = []
    for s in SHAPES:
        mag = lo + (hi - lo) * torch.rand(s, dtype=torch.float64)
        sign = torch.where(torch.rand(s) < 0.2, -1.0, 1.0).double()
        scale.append((mag * sign).float().to(device))
    return shift, scale


def test_scale_reproducer_noise_has_sensitivity_c(backend_device):
    """The issue's reproducer: ‖g ⊙ scale‖ = 0.1 ≤ C, so g is not clipped and the sum is g (norm
    100 = 100·C in gradient coordinates). Its noise must be σC in the scaled space (σC/scale =
    1000σC per coordinate here), not σC in gradient coordinates (the old output: 1000× too little)."""
    backend, device = backend_device
    g = [torch.full((1, 100), 10.0, device=device)]
    scale = [torch.full((100,), 1e-3, device=device)]
    kw = dict(seed=1, step=1, expected_batch_size=1, scale=scale, backend=backend)
    clean = dpkernels.privatize(g, 1.0, 0.0, **kw)[0]
    assert torch.equal(clean, g[0][0])  # noise-free: the clipped value itself
    assert (clean * scale[0]).norm() <= 1.0  # bounded by C where the clip holds
    sigma = 2.0
    noisy = dpkernels.privatize(g, 1.0, sigma, **kw)[0]
    scaled_noise = ((noisy - g[0][0]) * scale[0]).double()
    assert 0.75 * sigma < scaled_noise.std() < 1.25 * sigma  # 100 draws: ±7% standard error
    z = ref_noise.standard_normal(100, seed=1, step=1)
    torch.testing.assert_close(scaled_noise.cpu(), (sigma * z).double(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("per_layer", [False, True], ids=["flat", "per-layer"])
@pytest.mark.parametrize("use_shift", [False, True], ids=["scale", "shift-scale"])
def test_affine_unclipped_equals_hand_composition_exactly(backend_device, per_layer, use_shift):
    """Every sample inside the bound (c_i = 1 exactly, Σ c_i = B): the result is bit-identical to
    the composition from the same backend's clipped sum and the injected (scaled-space) noise."""
    backend, device = backend_device
    B = 6
    g = _grads(B, device)
    shift, scale = _affine_vectors(device)
    shift = shift if use_shift else None
    noise = [torch.randn(s, device=device) for s in SHAPES]
    C = [1e4] * len(SHAPES) if per_layer else 1e4
    kw = dict(shift=shift, scale=scale, per_layer=per_layer, backend=backend)
    got = dpkernels.privatize(g, C, 1.3, seed=4, step=2, expected_batch_size=8, noise=noise, **kw)
    sums, norms = dpkernels.clip_and_accumulate(g, C, **kw)
    assert (norms < 1e3).all()
    for idx, (a, s) in enumerate(zip(got, sums, strict=True)):
        x = s.double() + noise[idx].double() / scale[idx].double()
        if use_shift:
            x = x - B * shift[idx].double()
        x = x * (1.0 / 8)
        if use_shift:
            x = x + shift[idx].double()
        assert a.dtype == torch.float32
        assert torch.equal(a, x.float())


def _affine_reference(g, C, shift, scale, noise, B_div, mode="clip", r=0.0, per_layer=False):
    """float64: (S − (Σ c_i)·shift + noise/scale)/B + shift, weights from the float64 reference."""
    sets = [[x.cpu().double() for x in g]]
    shift = [v.cpu().double() for v in shift]
    scale = [v.cpu().double() for v in scale]
    w, _ = ref.clip_weights(sets, C, [1.0], mode, r, shift, scale, per_layer, "raise")
    sums = ref.weighted_sum(sets, w, [1.0])
    c_total = w.sum(dim=0)
    return [
        (s - c_total[idx] * shift[idx] + nu.cpu().double() / scale[idx]) / B_div + shift[idx]
        for idx, (s, nu) in enumerate(zip(sums, noise, strict=True))
    ]


@pytest.mark.parametrize(
    "mode,r,per_layer",
    [("clip", 0.0, False), ("psac", 0.1, False), ("clip", 0.0, True)],
    ids=["clip-flat", "psac-flat", "clip-per-layer"],
)
def test_affine_clipped_matches_float64_reference(backend_device, mode, r, per_layer):
    """Clipping active (most samples scaled down, weights differ per sample): the float64 composition."""
    backend, device = backend_device
    g = [x * 5 for x in _grads(6, device)]
    shift, scale = _affine_vectors(device)
    noise = [torch.randn(s, device=device) for s in SHAPES]
    C = [0.5, 1.0, 2.0, 0.7, 0.3] if per_layer else 0.9
    got = dpkernels.privatize(
        g, C, 1.1, seed=4, step=2, expected_batch_size=8, mode=mode, r=None if mode == "clip" else r, shift=shift,
        scale=scale, per_layer=per_layer, noise=noise, backend=backend,
    )  # fmt: skip
    want = _affine_reference(g, C, shift, scale, noise, 8, mode, r, per_layer)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.cpu().double(), b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rng", ["philox", "chacha20"])
@pytest.mark.parametrize("per_layer", [False, True], ids=["flat", "per-layer"])
def test_affine_noise_is_sigma_sensitivity_in_scaled_space(backend_device, rng, per_layer):
    """The noise recovered in the scaled space, ((out − shift)·B − (S − (Σ c_i)·shift))·scale, is the
    generator's stream σΔz (key, step, stream, global element index of the fused path), so its std
    is σΔ, Δ = C or ‖(C_1..C_L)‖, whatever the scale (entries spread over two decades)."""
    backend, device = backend_device
    shapes = [(3000,), (40, 50)]
    B, sigma, seed, step, stream = 3, 1.7, CHACHA_KEY if rng == "chacha20" else 11, 7, 2
    g = [torch.randn(B, *s, dtype=torch.float64).float().to(device) * 3 for s in shapes]
    shift = [torch.randn(s, device=device) for s in shapes]
    scale = [(0.01 + 0.99 * torch.rand(s)).to(device) for s in shapes]
    C = [0.5, 1.2] if per_layer else 0.8
    delta = math.hypot(*C) if per_layer else C
    out = dpkernels.privatize(
        g, C, sigma, seed=seed, step=step, stream=stream, expected_batch_size=B, shift=shift, scale=scale,
        per_layer=per_layer, rng=rng, backend=backend,
    )  # fmt: skip
    zero = [torch.zeros(s) for s in shapes]
    clean = _affine_reference(g, C, shift, scale, zero, B, per_layer=per_layer)  # noise-free
    recovered = torch.cat(
        [((o.cpu().double() - c) * B * sc.cpu().double()).flatten() for o, c, sc in zip(out, clean, scale, strict=True)]
    )
    total = recovered.numel()
    if rng == "chacha20":
        z = ref_noise.chacha20_standard_normal(total, key=seed, step=step, stream=stream)
    else:
        z = ref_noise.standard_normal(total, seed=seed, step=step, stream=stream).double()
    torch.testing.assert_close(recovered, sigma * delta * z, rtol=1e-4, atol=1e-4)
    assert abs(recovered.std().item() / (sigma * delta) - 1) < 0.03  # 5000 draws: 1% standard error
    assert abs(recovered.mean().item()) < 0.06 * sigma * delta


def test_affine_refuses_unreleasable_scale(backend_device):
    backend, device = backend_device
    g = _grads(3, device)
    shift, scale = _affine_vectors(device)

    def call(scale=scale, shift=None, sigma=1.0):
        return dpkernels.privatize(g, 1.0, sigma, seed=1, step=0, shift=shift, scale=scale, backend=backend)

    for bad, match in [
        (0.0, r"scale\[1\] has a zero entry"),
        (float("nan"), r"scale\[1\] has a non-finite entry"),
        (float("inf"), r"scale\[1\] has a non-finite entry"),
        (1e-39, r"scale\[1\] has an entry of magnitude .*overflows float32"),  # 1/scale > FP32_MAX
    ]:
        bad_scale = [v.clone() for v in scale]
        bad_scale[1][3, 2] = bad
        with pytest.raises(ValueError, match=match):
            call(bad_scale)
    with pytest.raises(ValueError, match=r"scale\[0\] has an entry of magnitude .*overflows float32"):
        call([v.abs() * 1e-30 + 1e-30 for v in scale], sigma=1e10)  # σC/scale ≈ 1e40
    bad_shift = [v.clone() for v in shift]
    bad_shift[4][0, 0, 1] = float("inf")
    with pytest.raises(ValueError, match=r"shift\[4\] has a non-finite entry"):
        call(shift=bad_shift)
