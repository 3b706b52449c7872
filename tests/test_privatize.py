"""The fused private gradient ``(Σ c_i g_i + σCz)/B`` on every backend: exact against the reference
with the same Philox stream or injected noise, and equal to Opacus's clip → add_noise → scale_grad."""

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
    with pytest.raises(ValueError, match="expected_batch_size must be a positive int"):
        dpkernels.privatize(g, 1.0, 1.0, seed=1, step=0, expected_batch_size=0)
    with pytest.raises(ValueError, match="step must be an integer"):
        dpkernels.privatize(g, 1.0, 1.0, seed=1, step=-1)
    with pytest.raises(ValueError, match="rng must be one of"):
        dpkernels.privatize(g, 1.0, 1.0, seed=1, step=0, rng="mt19937")
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\^256\)"):
        dpkernels.privatize(g, 1.0, 1.0, seed=2**256, step=0, rng="chacha20")
    with pytest.raises(ValueError, match="noise must be a list of 5 tensors"):
        dpkernels.privatize(g, 1.0, 1.0, seed=1, step=0, noise=[torch.zeros(7)])
