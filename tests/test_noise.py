"""Counter-based noise: bit-identical words, Gaussians within a few ulps, statistics, determinism,
sharding invariance, on every backend and for both generators, Philox and ChaCha20 (secure mode)
(spec: docs/RNG.md)."""

import importlib
import math

import pytest
import torch

import dpkernels
from dpkernels import noise
from dpkernels.reference import noise as ref

SIZES = [1, 3, 4, 5, 1000, 4097]
COUNTERS = [  # seed, step, stream, offset
    (0, 0, 0, 0),
    (12345, 7, 2, 1),
    (2**64 - 1, 2**32 - 1, 2**32 - 1, 6),
    (0xDEADBEEFCAFEF00D, 123456, 1, 2**33 + 3),
]
CHACHA_COUNTERS = [  # 256-bit key, step, stream, offset (offsets not multiples of 8 or 16 included)
    (0, 0, 0, 0),
    (int.from_bytes(bytes(range(32)), "little"), 7, 2, 1),
    (2**256 - 1, 2**32 - 1, 2**32 - 1, 13),
    (0x9E3779B97F4A7C15_F39CC0605CEDC834_1082276BF3A27251_F86C6A11D0C18E95, 123456, 1, 2**33 + 3),
]
RNGS = ["philox", "chacha20"]
# A key of the right size per generator, for the tests that need one fixed key.
KEY = {"philox": 0xDEADBEEFCAFEF00D, "chacha20": CHACHA_COUNTERS[3][0]}
# fp32 Box-Muller through different log/sin/cos implementations: a few ulps of |z| <= 6.8.
Z_ATOL = 4e-6


@pytest.fixture(params=RNGS)
def rng(request):
    return request.param


def _ref_words(rng, n, seed, **kw):
    if rng == "chacha20":
        return ref.chacha20_uint32(n, key=seed, **kw)
    return ref.philox_uint32(n, seed=seed, **kw)


def _ref_normals(rng, n, seed, **kw):
    """The reference's standard normals: fp32 (Philox) or float64 (ChaCha20)."""
    if rng == "chacha20":
        return ref.chacha20_standard_normal(n, key=seed, **kw)
    return ref.standard_normal(n, seed=seed, **kw)


def _one_rounding(rng, got: torch.Tensor, want: torch.Tensor) -> None:
    """``got`` (fp32/fp16/bf16) is ``want`` rounded once: exactly for Philox (fp32 ``want``, which
    the kernels compute with few-ulp log/sin/cos: Z_ATOL), within one ulp of the output dtype for
    ChaCha20 (float64 ``want``; implementations of log/sin/cos differ below 1e-15, which moves the
    rounding only for values next to a rounding boundary)."""
    if rng == "philox" or got.dtype != torch.float32:
        ulp = {torch.float32: 0.0, torch.float16: 2**-10, torch.bfloat16: 2**-7}[got.dtype]
        torch.testing.assert_close(got.cpu().float(), want.to(got.dtype).float(), rtol=max(ulp, 2**-23), atol=Z_ATOL)
    else:
        torch.testing.assert_close(got.cpu().double(), want.float().double(), rtol=2**-23, atol=0)


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


def _chacha_state(key: int, counter: tuple[int, int, int, int]) -> tuple:
    words = (*ref.CHACHA_CONSTANTS, *ref.chacha20_key_words(key), *counter)
    return tuple(torch.tensor([w]) for w in words)


def test_chacha20_known_answers():
    """RFC 8439 §2.3.2 (block function) and Appendix A.1 test vectors #1 and #2 (key 0)."""
    rfc_key = int.from_bytes(bytes(range(32)), "little")
    cases = [
        (rfc_key, (1, 0x09000000, 0x4A000000, 0), "e4e7f110 15593bd1 1fdd0f50 c47120a3 c7f4d1c7 0368c033 9aaa2204 "
         "4e6cd4c3 466482d2 09aa9f07 05d7c214 a2028bd9 d19c12b5 b94e16de e883d0cb 4e3c50a2"),
        (0, (0, 0, 0, 0), "ade0b876 903df1a0 e56a5d40 28bd8653 b819d2bd 1aed8da0 ccef36a8 c70d778b 7c5941da "
         "8d485751 3fe02477 374ad8b8 f4b8436a 1ca11815 69b687c3 8665eeb2"),
        (0, (1, 0, 0, 0), "bee7079f 7a385155 7c97ba98 0d082d73 a0290fcb 6965e348 3e53c612 ed7aee32 7621b729 "
         "434ee69c b03371d5 d539d874 281fed31 45fb0a51 1f0ae1ac 6f4d794b"),
    ]  # fmt: skip
    for key, counter, want in cases:
        got = ref.chacha20_block(_chacha_state(key, counter))
        assert " ".join(f"{int(x):08x}" for x in got) == want
    # The same through the stream API: A.1 #1 and #2 are blocks 0 and 1 of key 0, step 0, stream 0.
    words = ref.chacha20_uint32(32, key=0, step=0)
    assert " ".join(f"{int(x):08x}" for x in words) == f"{cases[1][2]} {cases[2][2]}"


def _words(rng, n, seed, **kw):
    fn = noise.chacha20_uint32 if rng == "chacha20" else noise.philox_uint32
    return fn(n, seed=seed, **kw)


@pytest.mark.parametrize("counter", range(4), ids=lambda i: f"counter{i}")
@pytest.mark.parametrize("n", SIZES)
def test_words_bit_identical(backend_device, rng, counter, n):
    backend, device = backend_device
    seed, step, stream, offset = (CHACHA_COUNTERS if rng == "chacha20" else COUNTERS)[counter]
    got = _words(rng, n, seed, step=step, stream=stream, offset=offset, device=device, backend=backend)
    want = _ref_words(rng, n, seed, step=step, stream=stream, offset=offset)
    assert got.dtype == torch.int64 and torch.equal(got.cpu(), want)


def test_chacha20_key_as_bytes_and_offset_slices(backend_device):
    """32 key bytes are RFC 8439's little-endian key; every window of the stream is a slice of it."""
    backend, device = backend_device
    key = bytes(range(32))
    whole = noise.chacha20_uint32(200, seed=key, step=3, device=device, backend=backend).cpu()
    assert torch.equal(whole, ref.chacha20_uint32(200, key=int.from_bytes(key, "little"), step=3))
    for off, n in [(1, 3), (15, 2), (16, 16), (17, 100)]:
        part = noise.chacha20_uint32(n, seed=key, step=3, offset=off, device=device, backend=backend)
        assert torch.equal(part.cpu(), whole[off : off + n])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_gaussians_match_reference(backend_device, rng, n, dtype):
    backend, device = backend_device
    kw = dict(step=5, stream=3, offset=n % 7 + (8 if rng == "chacha20" else 0))
    got = noise.gaussian_noise(n, std=1.5, dtype=dtype, device=device, backend=backend, seed=KEY[rng], rng=rng, **kw)
    want = 1.5 * _ref_normals(rng, n, KEY[rng], **kw)
    assert got.dtype == dtype
    _one_rounding(rng, got, want)


def test_chacha20_single_rounding_to_16_bit():
    """The reference rounds float64 once to fp16/bf16 (round-to-odd through fp32), not twice."""
    # Just above the midpoint 1 + 2^-11 between two fp16 values: one rounding goes up; rounding to
    # fp32 first lands on the midpoint, which then rounds to even (down).
    x = torch.tensor([1 + 2**-11 + 2**-40, -(1 + 2**-8 + 2**-40), 3.0, 0.1], dtype=torch.float64)
    assert ref.round_once(x[:1], torch.float16).item() == 1 + 2**-10
    assert x[:1].float().half().item() == 1.0
    assert ref.round_once(x[1:2], torch.bfloat16).item() == -(1 + 2**-7)
    assert x[1:2].float().bfloat16().item() == -1.0
    assert ref.round_once(x[2:], torch.float16).tolist() == x[2:].half().double().tolist()  # exact, and away from ties


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_chacha20_kernels_round_once(backend_device, dtype):
    """x + std·z in float64, rounded once: equal to the reference on 2^16 elements, among which a
    double rounding (float64 -> fp32 -> dtype) would change some."""
    backend, device = backend_device
    n = 1 << 16
    x = torch.randn(n, dtype=torch.float64).to(dtype)
    got = x.clone().to(device)
    noise.add_gaussian_noise_([got], 1e-2, seed=KEY["chacha20"], step=2, rng="chacha20", backend=backend)
    exact = x.double() + 1e-2 * ref.chacha20_standard_normal(n, key=KEY["chacha20"], step=2)
    want = ref.round_once(exact, dtype)
    assert (exact.float().to(dtype) != want).any(), "no double-rounding case: the test has no power"
    assert torch.equal(got.cpu(), want)


def test_add_noise_list_equals_concatenation_and_offsets(backend_device, rng):
    """Sharding invariance: a list, its concatenation and piecewise offsets give the same noise."""
    backend, device = backend_device
    sizes = [5, 1, 1000, 3, 4097]
    kw = dict(seed=KEY[rng], step=11, stream=0, backend=backend, rng=rng)
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


def test_add_noise_accumulates_in_place(backend_device, rng):
    backend, device = backend_device
    x = torch.randn(1001, device=device)
    before = x.clone()
    out = noise.add_gaussian_noise_([x], 0.5, seed=KEY[rng], step=1, backend=backend, rng=rng)
    assert out[0] is x
    want = before.cpu().to(torch.float64 if rng == "chacha20" else torch.float32) + 0.5 * _ref_normals(
        rng, 1001, KEY[rng], step=1
    )
    _one_rounding(rng, x, want)


@pytest.mark.parametrize("key", [0, 1])
def test_determinism_and_seed_sensitivity(backend_device, rng, key):
    """Same key: bitwise equal. Another key (neighbouring, or differing only in the key's top bit
    for ChaCha20): every element changes."""
    backend, device = backend_device
    seed = KEY[rng] if key else 5
    other = seed ^ (2**255 if rng == "chacha20" else 2**63) if key else seed + 1
    kw = dict(std=1.0, step=2, device=device, backend=backend, rng=rng)
    a = noise.gaussian_noise(4097, seed=seed, **kw)
    b = noise.gaussian_noise(4097, seed=seed, **kw)
    c = noise.gaussian_noise(4097, seed=other, **kw)
    assert torch.equal(a, b)
    assert (a != c).all(), "a different seed must change every element"


def test_default_seed_is_fresh(rng):
    a = noise.gaussian_noise(64, std=1.0, step=0, rng=rng)
    b = noise.gaussian_noise(64, std=1.0, step=0, rng=rng)
    assert not torch.equal(a, b)


def test_default_chacha20_key_is_256_bits(monkeypatch):
    """seed=None in secure mode draws 256 bits from the OS CSPRNG (secrets)."""
    # numpy.random draws secrets.randbits(128) when first imported, which the reference path may
    # do inside the call: import it first, so that only dpkernels' draws are recorded.
    importlib.import_module("numpy.random")
    drawn = []

    def randbits(k):
        drawn.append(k)
        return 2**k - 3

    monkeypatch.setattr(noise.secrets, "randbits", randbits)
    got = noise.gaussian_noise(20, std=1.0, step=4, rng="chacha20", backend="reference")
    assert drawn == [256]
    assert torch.equal(got, ref.chacha20_standard_normal(20, key=2**256 - 3, step=4).float())


# ---------------------------------------------------------------------------------------------
# Statistics on >= 10^6 draws per backend
# ---------------------------------------------------------------------------------------------

N_STAT = {"reference": 1 << 20, "cpu": 1 << 21, "triton": 1 << 20, "cuda": 1 << 22}
MAX_ABS = {"philox": ref.MAX_ABS_NORMAL, "chacha20": ref.CHACHA_MAX_ABS_NORMAL}


def _draw(backend, device, n, rng, seed, **kw):
    seed = seed if rng == "philox" else seed << 192 | seed  # low and high key words
    return noise.gaussian_noise(n, std=1.0, device=device, backend=backend, rng=rng, seed=seed, **kw).double().cpu()


def test_moments_ks_and_tails(backend_device, rng):
    scipy_stats = pytest.importorskip("scipy.stats")
    backend, device = backend_device
    n = N_STAT[backend]
    z = _draw(backend, device, n, rng, seed=2024, step=0)
    se = 1 / math.sqrt(n)
    assert abs(z.mean().item()) < 5 * se
    assert abs(z.var().item() - 1) < 5 * math.sqrt(2) * se
    ks = scipy_stats.kstest(z.numpy(), "norm")
    assert ks.pvalue > 1e-4, ks
    # Tail beyond 4 sigma: P = 6.334e-5; binomial sd of the count.
    p4 = math.erfc(4 / math.sqrt(2))
    count = (z.abs() > 4).sum().item()
    assert abs(count - n * p4) < 5 * math.sqrt(n * p4 * (1 - p4)), (count, n * p4)
    assert z.abs().max().item() <= MAX_ABS[rng] + 1e-5


def test_independence_across_steps_tensors_streams(backend_device, rng):
    backend, device = backend_device
    n = N_STAT[backend] // 2
    bound = 3 / math.sqrt(n)
    base = _draw(backend, device, n, rng, seed=77, step=10)
    others = {
        "step t+1": _draw(backend, device, n, rng, seed=77, step=11),
        "neighbouring tensor (next offsets)": _draw(backend, device, n, rng, seed=77, step=10, offset=n),
        "stream 1": _draw(backend, device, n, rng, seed=77, step=10, stream=1),
        "seed + 1": _draw(backend, device, n, rng, seed=78, step=10),
    }
    for name, other in others.items():
        corr = torch.corrcoef(torch.stack([base, other]))[0, 1].item()
        assert abs(corr) < bound, (name, corr, bound)
    # Within one block the words feed several Box-Muller pairs: neighbours must be uncorrelated,
    # and (ChaCha20: 8 normals per block) so must elements one block apart.
    for lag in (1, 2, 8):
        corr = torch.corrcoef(torch.stack([base[:-lag], base[lag:]]))[0, 1].item()
        assert abs(corr) < bound, (lag, corr)


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
        (dict(seed=1, step=0, rng="mt19937"), "rng must be one of"),
        (dict(seed=-1, step=0, rng="chacha20"), r"seed must be an integer in \[0, 2\^256\) or 32 bytes"),
        (dict(seed=2**256, step=0, rng="chacha20"), r"seed must be an integer in \[0, 2\^256\)"),
        (dict(seed=b"short", step=0, rng="chacha20"), "must be 32 bytes long, got 5"),
        (dict(seed=1, step=2**32, rng="chacha20"), "step must be an integer in"),
        (dict(seed=1, step=0, offset=-1, rng="chacha20"), "offset must be an integer in"),
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
    with pytest.raises(ValueError, match="rng must be one of"):
        noise.add_gaussian_noise_([torch.zeros(3)], 1.0, seed=1, step=0, rng="Philox")


def test_native_ops_validate_the_chacha20_key():
    """The schema's key is 4 int64 limbs; anything else is a clear error, not a silent key."""
    if "cpu" not in dpkernels.available_backends("cpu"):
        pytest.skip("no C++ extension")
    out = torch.empty(4, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="a ChaCha20 key is 4 int64 limbs"):
        torch.ops.dpkernels_C.chacha20_uint32_(out, [1, 2, 3], 0, 0, 0)
    with pytest.raises(RuntimeError, match="step must be in"):
        torch.ops.dpkernels_C.chacha20_uint32_(out, [1, 2, 3, 4], -1, 0, 0)


def _opcheck(op, args):
    # test_aot_dispatch_dynamic needs a backward; these ops are not differentiable.
    results = torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
    assert all(v == "SUCCESS" for v in results.values()), results


def test_opcheck_secure_mode_ops(backend_device):
    """The public ops with rng="chacha20" and the native secure-mode ops pass torch.library.opcheck."""
    backend, device = backend_device
    key = noise.NoiseKey("chacha20", KEY["chacha20"], 0).limbs()
    dev = torch.device(device)
    ops = torch.ops.dpkernels
    _opcheck(ops.random_uint32.default, (37, "chacha20", key, 3, 1, 5, dev, backend))
    _opcheck(ops.gaussian_noise.default, ([5, 7], 1.5, "chacha20", key, 3, 1, 5, torch.bfloat16, dev, backend))
    tensors = [torch.randn(5, device=device), torch.randn(33, device=device, dtype=torch.float16)]
    _opcheck(ops.add_gaussian_noise_.default, (tensors, 0.5, "chacha20", key, 3, 1, 5, backend))
    if backend in ("cpu", "cuda"):
        native = torch.ops.dpkernels_C
        g = [torch.randn(5, 7, 3, device=device), torch.randn(5, 11, device=device)]
        pipeline = (g, [1.0], [1.0], "clip", 0.0, [], [], False, False, 1.0)
        _opcheck(native.clip_pipeline.default, (*pipeline, "chacha20", 1.0, key, 3, 1, 0.25, []))
        _opcheck(native.clip_pipeline.default, (*pipeline, "philox", 1.0, [-7], 3, 1, 0.25, []))
        _opcheck(native.chacha20_add_gaussian_noise_.default, (tensors, 0.5, key, 3, 1, 5))
        _opcheck(native.chacha20_uint32_.default, (torch.empty(9, dtype=torch.int64, device=device), key, 3, 1, 5))
