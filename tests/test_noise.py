"""Counter-based noise: bit-identical words, Gaussians within a few ulps, statistics, determinism,
sharding invariance, on every backend (spec: docs/RNG.md)."""

import math

import pytest
import torch

from dpkernels import noise
from dpkernels.reference import noise as ref

SIZES = [1, 3, 4, 5, 1000, 4097]
COUNTERS = [  # seed, step, stream, offset
    (0, 0, 0, 0),
    (12345, 7, 2, 1),
    (2**64 - 1, 2**32 - 1, 2**32 - 1, 6),
    (0xDEADBEEFCAFEF00D, 123456, 1, 2**33 + 3),
]
# fp32 Box-Muller through different log/sin/cos implementations: a few ulps of |z| <= 6.8.
Z_ATOL = 4e-6


def test_philox_known_answers():
    """Random123's known-answer vectors for philox4x32-10."""
    cases = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ]
    for counter, key, want in cases:
        got = ref.philox4x32(tuple(torch.tensor([c]) for c in counter), key)
        assert tuple(int(x) for x in got) == want


@pytest.mark.parametrize("counter", COUNTERS, ids=lambda c: f"seed{c[0]:x}-step{c[1]}-off{c[3]}")
@pytest.mark.parametrize("n", SIZES)
def test_words_bit_identical(backend_device, counter, n):
    backend, device = backend_device
    seed, step, stream, offset = counter
    got = noise.philox_uint32(n, seed=seed, step=step, stream=stream, offset=offset, device=device, backend=backend)
    want = ref.philox_uint32(n, seed=seed, step=step, stream=stream, offset=offset)
    assert got.dtype == torch.int64 and torch.equal(got.cpu(), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_gaussians_match_reference(backend_device, n, dtype):
    backend, device = backend_device
    kw = dict(seed=99, step=5, stream=3, offset=n % 7)
    got = noise.gaussian_noise(n, std=1.5, dtype=dtype, device=device, backend=backend, **kw)
    want = 1.5 * ref.standard_normal(n, **kw)
    assert got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got.cpu(), want, rtol=0, atol=1.5 * Z_ATOL)
    else:  # one rounding of the fp32 value; neighbours of a rounding boundary may go either way
        torch.testing.assert_close(got.cpu().float(), want.to(dtype).float(), rtol=2**-7, atol=1e-6)


def test_add_noise_list_equals_concatenation_and_offsets(backend_device):
    """Sharding invariance: a list, its concatenation and piecewise offsets give the same noise."""
    backend, device = backend_device
    sizes = [5, 1, 1000, 3, 4097]
    kw = dict(seed=7, step=11, stream=0, backend=backend)
    parts = [torch.zeros(s, device=device) for s in sizes]
    noise.add_gaussian_noise_(parts, 2.0, **kw)
    whole = torch.zeros(sum(sizes), device=device)
    noise.add_gaussian_noise_([whole], 2.0, **kw)
    assert torch.equal(torch.cat(parts), whole)
    start = 0
    for s, p in zip(sizes, parts, strict=True):
        piece = torch.zeros(s, device=device)
        noise.add_gaussian_noise_([piece], 2.0, offset=start, **kw)
        assert torch.equal(piece, p)
        start += s


def test_add_noise_accumulates_in_place(backend_device):
    backend, device = backend_device
    x = torch.randn(1001, device=device)
    before = x.clone()
    out = noise.add_gaussian_noise_([x], 0.5, seed=3, step=1, backend=backend)
    assert out[0] is x
    z = ref.standard_normal(1001, seed=3, step=1)
    torch.testing.assert_close(x.cpu(), before.cpu() + 0.5 * z, rtol=0, atol=1e-5)


def test_determinism_and_seed_sensitivity(backend_device):
    backend, device = backend_device
    a = noise.gaussian_noise(4097, std=1.0, seed=5, step=2, device=device, backend=backend)
    b = noise.gaussian_noise(4097, std=1.0, seed=5, step=2, device=device, backend=backend)
    c = noise.gaussian_noise(4097, std=1.0, seed=6, step=2, device=device, backend=backend)
    assert torch.equal(a, b)
    assert (a != c).all(), "a different seed must change every element"


def test_default_seed_is_fresh():
    a = noise.gaussian_noise(64, std=1.0, step=0)
    b = noise.gaussian_noise(64, std=1.0, step=0)
    assert not torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# Statistics on >= 10^6 draws per backend
# ---------------------------------------------------------------------------------------------

N_STAT = {"reference": 1 << 20, "cpu": 1 << 21, "triton": 1 << 20, "cuda": 1 << 22}


def _draw(backend, device, n, **kw):
    return noise.gaussian_noise(n, std=1.0, device=device, backend=backend, **kw).double().cpu()


def test_moments_ks_and_tails(backend_device):
    scipy_stats = pytest.importorskip("scipy.stats")
    backend, device = backend_device
    n = N_STAT[backend]
    z = _draw(backend, device, n, seed=2024, step=0)
    se = 1 / math.sqrt(n)
    assert abs(z.mean().item()) < 5 * se
    assert abs(z.var().item() - 1) < 5 * math.sqrt(2) * se
    ks = scipy_stats.kstest(z.numpy(), "norm")
    assert ks.pvalue > 1e-4, ks
    # Tail beyond 4 sigma: P = 6.334e-5; binomial sd of the count.
    p4 = math.erfc(4 / math.sqrt(2))
    count = (z.abs() > 4).sum().item()
    assert abs(count - n * p4) < 5 * math.sqrt(n * p4 * (1 - p4)), (count, n * p4)
    assert z.abs().max().item() <= ref.MAX_ABS_NORMAL + 1e-5


def test_independence_across_steps_tensors_streams(backend_device):
    backend, device = backend_device
    n = N_STAT[backend] // 2
    bound = 3 / math.sqrt(n)
    base = _draw(backend, device, n, seed=77, step=10)
    others = {
        "step t+1": _draw(backend, device, n, seed=77, step=11),
        "neighbouring tensor (next offsets)": _draw(backend, device, n, seed=77, step=10, offset=n),
        "stream 1": _draw(backend, device, n, seed=77, step=10, stream=1),
        "seed + 1": _draw(backend, device, n, seed=78, step=10),
    }
    for name, other in others.items():
        corr = torch.corrcoef(torch.stack([base, other]))[0, 1].item()
        assert abs(corr) < bound, (name, corr, bound)
    # Within one block, the four words feed two Box-Muller pairs: neighbours must be uncorrelated.
    lag1 = torch.corrcoef(torch.stack([base[:-1], base[1:]]))[0, 1].item()
    assert abs(lag1) < bound, lag1


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(seed=-1, step=0), "seed must be an integer in"),
        (dict(seed=2**64, step=0), "seed must be an integer in"),
        (dict(seed=1, step=-1), "step must be an integer in"),
        (dict(seed=1, step=2**32), "step must be an integer in"),
        (dict(seed=1, step=0, stream=2**32), "stream must be an integer in"),
        (dict(seed=1, step=0, offset=-4), "offset must be an integer in"),
        (dict(seed=1, step=0, std=-1.0), "std must be a finite number"),
        (dict(seed=1, step=0, std=float("nan")), "std must be a finite number"),
    ],
)
def test_bad_arguments(kwargs, match):
    kwargs = {"std": 1.0, **kwargs}
    with pytest.raises(ValueError, match=match):
        noise.gaussian_noise(8, **kwargs)


def test_add_noise_rejects_bad_tensors():
    with pytest.raises(TypeError, match="non-empty list"):
        noise.add_gaussian_noise_([], 1.0, seed=1, step=0)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        noise.add_gaussian_noise_([torch.zeros(3, dtype=torch.int32)], 1.0, seed=1, step=0)
    with pytest.raises(ValueError, match="must be contiguous"):
        noise.add_gaussian_noise_([torch.zeros(3, 4).t()], 1.0, seed=1, step=0)
    with pytest.raises(TypeError, match="dtype must be one of"):
        noise.gaussian_noise(3, std=1.0, seed=1, step=0, dtype=torch.float64)
