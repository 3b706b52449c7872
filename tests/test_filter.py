"""linear_filter_ against its reference on every backend, and the correlated-noise mechanisms built on
it (BLTNoise, BandedNoise) against dense float64 matrix products over the same Philox stream."""

import math

import pytest
import torch

import dpkernels
from dpkernels.correlated import BandedNoise, BLTNoise
from dpkernels.filter import linear_filter_
from dpkernels.reference.filter import linear_filter as ref_filter

FP32_MAX = torch.finfo(torch.float32).max

# Coefficient configs: (name, a, g, c, d, e, f).
CONFIGS = [
    ("k0-scale", 1.5, 0.5, [], [], [], []),
    ("blt3", 1.0, 1.0, [-0.3, -0.2, -0.05], [0.9, 0.5, 0.1], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]),
    # buffers 0 and 3 are read-only (1, 0, 0), buffer 1 write-only (c = d = 0), buffer 2 uses every term.
    ("skipped", 0.7, -2.0, [0.3, 0.0, -0.7, 0.2], [1.0, 0.0, 0.5, 1.0], [0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.25, 0.0]),
    # a = 0: y from the buffers only; one buffer stores x (f = 1), IIR past-input style.
    ("iir", 0.0, 1.0, [0.4, -0.6], [0.0, 0.0], [1.0, 0.0], [0.0, 1.0]),
]
SHAPES = {1: [(37, 5)], 20: [(i * 13 + 1,) if i % 3 else (3, i + 2, 2) for i in range(20)]}
# (atol, rtol) of the output by storage dtype; state is fp32 always.
TOL = {torch.float32: (2e-6, 2e-6), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 1e-2)}
STATE_TOL = (1e-5, 1e-5)


def _random(shapes, dtype, device, scale=1.0):
    return [(scale * torch.randn(s)).to(dtype).to(device) for s in shapes]


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c[0] for c in CONFIGS])
@pytest.mark.parametrize("L", [1, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("mode", ["given", "fresh", "given+noise"])
@pytest.mark.parametrize("out_mode", ["write", "accumulate", "none"])
def test_matches_reference(backend_device, cfg, L, dtype, mode, out_mode):
    backend, device = backend_device
    if out_mode == "none" and not cfg[3]:
        pytest.skip("K = 0 without an output has no effect")
    _, a, g, c, d, e, f = cfg
    shapes = SHAPES[L]
    K = len(c)
    inputs = _random(shapes, dtype, device) if mode != "fresh" else None
    state = [_random(shapes, torch.float32, device) for _ in range(K)]
    out = None
    if out_mode == "write":
        out = [torch.full(s, float("nan"), dtype=dtype, device=device) for s in shapes]
    elif out_mode == "accumulate":
        out = _random(shapes, dtype, device)
    std = 0.0 if mode == "given" else 0.8
    want_state = [[b.clone() for b in lst] for lst in state]
    want_out = None if out is None else [o.clone() for o in out]
    kw = dict(a=a, g=g, c=c, d=d, e=e, f=f, noise_std=std, seed=123, step=7, stream=2, offset=3)
    ref_filter(want_state, inputs=inputs, out=want_out, accumulate=out_mode == "accumulate", shapes=shapes, **kw)
    linear_filter_(state, inputs=inputs, out=out, accumulate=out_mode == "accumulate", backend=backend, **kw)
    for k in range(K):
        for got, want in zip(state[k], want_state[k], strict=True):
            torch.testing.assert_close(got, want, atol=STATE_TOL[0], rtol=STATE_TOL[1])
    if out is not None:
        atol, rtol = TOL[dtype]
        for got, want in zip(out, want_out, strict=True):
            assert not got.isnan().any()
            torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


def test_switched_off_terms_are_not_evaluated(backend_device):
    """A write-only buffer (c = d = 0) holding NaN/inf, and an inf input with a = 0, leave no trace."""
    backend, device = backend_device
    x = [torch.full((10,), float("inf"), device=device)]
    ring = [torch.full((10,), float("nan"), device=device)]
    keep = [torch.randn(10, device=device)]
    out = [torch.empty(10, device=device)]
    linear_filter_([ring, keep], a=0.0, c=[0.0, 2.0], d=[0.0, 1.0], e=[1.0, 0.0], f=[0.0, 0.0], inputs=x, out=out,
                   backend=backend)  # fmt: skip
    torch.testing.assert_close(out[0], 2.0 * keep[0], atol=0, rtol=0)
    torch.testing.assert_close(ring[0], 2.0 * keep[0], atol=0, rtol=0)


def test_noise_only_equals_gaussian_noise(backend_device):
    """x = std·z is the add_gaussian_noise_ stream: global index across the list, offset included."""
    backend, device = backend_device
    shapes = [(5, 3), (1,), (130,)]
    out = [torch.zeros(s, device=device) for s in shapes]
    linear_filter_([], a=1.0, c=[], d=[], e=[], f=[], out=out, accumulate=True, noise_std=0.5, seed=9, step=4,
                   stream=1, offset=6, backend=backend)  # fmt: skip
    want = [torch.zeros(s, device=device) for s in shapes]
    dpkernels.add_gaussian_noise_(want, 0.5, seed=9, step=4, stream=1, offset=6, backend=backend)
    for got, w in zip(out, want, strict=True):
        torch.testing.assert_close(got, w, atol=0, rtol=0)


def _loop_check(backend, device, a, c, ref_step):
    shapes = [(33,), (4, 5)]
    buf = [torch.zeros(s, device=device) for s in shapes]
    want = [torch.zeros(s, device=device) for s in shapes]
    exact = device == "cpu"
    for _ in range(6):
        grads = _random(shapes, torch.float32, device)
        linear_filter_([buf], a=a, c=[c], d=[0.0], e=[1.0], f=[0.0], inputs=grads, backend=backend)
        want = [ref_step(w, gr) for w, gr in zip(want, grads, strict=True)]
        for got, w in zip(buf, want, strict=True):
            torch.testing.assert_close(got, w, atol=0 if exact else 1e-6, rtol=0 if exact else 1e-6)


def test_heavy_ball_momentum(backend_device):
    backend, device = backend_device
    mu = 0.9
    _loop_check(backend, device, 1.0, mu, lambda s, gr: mu * s + gr)


def test_ema(backend_device):
    backend, device = backend_device
    beta = 0.95
    _loop_check(backend, device, 1.0 - beta, beta, lambda m, gr: beta * m + (1.0 - beta) * gr)


def test_validation():
    x = [torch.randn(4), torch.randn(3)]
    s = [[torch.zeros(4), torch.zeros(3)]]
    co = dict(a=1.0, c=[0.5], d=[0.0], e=[1.0], f=[0.0])
    with pytest.raises(ValueError, match="one coefficient per state buffer"):
        linear_filter_(s, a=1.0, c=[0.5, 1.0], d=[0.0], e=[1.0], f=[0.0], inputs=x)
    with pytest.raises(ValueError, match="finite"):
        linear_filter_(s, a=float("nan"), c=[0.5], d=[0.0], e=[1.0], f=[0.0], inputs=x)
    with pytest.raises(ValueError, match="finite"):
        linear_filter_(s, a=1.0, c=[float("inf")], d=[0.0], e=[1.0], f=[0.0], inputs=x)
    with pytest.raises(ValueError, match="elements"):
        linear_filter_([[torch.zeros(4), torch.zeros(5)]], **co, inputs=x)
    with pytest.raises(ValueError, match="tensors"):
        linear_filter_([[torch.zeros(4)]], **co, inputs=x)
    with pytest.raises(TypeError, match="float32"):
        linear_filter_([[torch.zeros(4, dtype=torch.float16), torch.zeros(3)]], **co, inputs=x)
    with pytest.raises(TypeError, match="dtype"):
        linear_filter_(s, **co, inputs=[torch.zeros(4, dtype=torch.int32), torch.zeros(3)])
    with pytest.raises(TypeError, match="must match"):
        linear_filter_(s, **co, inputs=x, out=[torch.zeros(4, dtype=torch.bfloat16), torch.zeros(3)])
    with pytest.raises(ValueError, match="contiguous"):
        linear_filter_([[torch.zeros(2, 2).t(), torch.zeros(3)]], **co, inputs=[torch.randn(2, 2), x[1]])
    with pytest.raises(ValueError, match="at least one tensor"):
        linear_filter_([], a=1.0, c=[], d=[], e=[], f=[])
    with pytest.raises(ValueError, match="share memory"):
        linear_filter_(s, **co, inputs=x, out=x)
    with pytest.raises(ValueError, match="step is required"):
        linear_filter_(s, **co, inputs=x, noise_std=1.0)
    with pytest.raises(ValueError, match="noise_std"):
        linear_filter_(s, **co, inputs=x, noise_std=-1.0)
    with pytest.raises(ValueError, match="at most 32"):
        linear_filter_([[torch.zeros(4)]] * 33, a=1.0, c=[0.0] * 33, d=[1.0] * 33, e=[0.0] * 33, f=[0.0] * 33,
                       inputs=[x[0]])  # fmt: skip
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="is on"):
            linear_filter_([[torch.zeros(4), torch.zeros(3, device="cuda")]], **co, inputs=x)


@pytest.mark.parametrize("name", ["a", "g", "c", "d", "e", "f"])
def test_coefficient_beyond_fp32_is_refused(backend_device, name):
    """A coefficient above the fp32 maximum in magnitude (inf in the fp32 kernels) is refused,
    naming it, on every backend; the maximum itself is a valid coefficient."""
    backend, device = backend_device
    x = [torch.ones(4, device=device)]
    co = dict(a=1.0, g=1.0, c=[0.0, 0.0], d=[1.0, 0.0], e=[0.0, 1.0], f=[0.0, 0.0])
    for bad in (1e39, -1e39):
        kw = dict(co, **({name: bad} if name in "ag" else {name: [co[name][0], bad]}))
        s = [[torch.zeros(4, device=device)], [torch.zeros(4, device=device)]]
        label = name if name in "ag" else f"{name}\\[1\\]"
        with pytest.raises(ValueError, match=rf"^{label} must be a finite number in \[-3.40\d*e\+38, 3.40\d*e\+38\]"):
            linear_filter_(s, **kw, inputs=x, backend=backend)
        assert s[1][0].tolist() == [0.0] * 4  # refused before any kernel ran
    # a = -FP32_MAX with x = 1: y = -FP32_MAX, written to buffer 1 (e_1 = 1).
    s = [[torch.zeros(4, device=device)], [torch.zeros(4, device=device)]]
    linear_filter_(s, **dict(co, a=-FP32_MAX), inputs=x, backend=backend)
    assert s[1][0].cpu().tolist() == [-FP32_MAX] * 4


@pytest.mark.parametrize("backend", dpkernels.BACKENDS)
def test_explicit_backend_on_meta_tensors(backend):
    """An explicit backend refuses meta tensors with one message; backend="auto" runs the fake
    kernel (nothing to compute, nothing raised)."""
    s = [[torch.empty(4, device="meta")]]
    kw = dict(c=[0.5], d=[1.0], e=[1.0], f=[0.0], inputs=[torch.empty(4, device="meta")])
    with pytest.raises(RuntimeError, match=f"backend '{backend}' cannot run on meta tensors"):
        linear_filter_(s, **kw, backend=backend)
    linear_filter_(s, **kw, backend="auto")


def test_native_op_validates():
    if "cpu" not in dpkernels.available_backends("cpu"):
        pytest.skip("C++ extension not built")
    op = torch.ops.dpkernels_C.linear_filter_
    x = [torch.randn(4)]
    with pytest.raises(RuntimeError, match="coeffs must hold"):
        op(x, [torch.zeros(4)], [], [1.0, 1.0, 0.5], False, 0.0, 0, 0, 0, 0)
    with pytest.raises(RuntimeError, match="not finite"):
        op(x, [torch.zeros(4)], [], [1.0, 1.0, float("nan"), 0.0, 1.0, 0.0], False, 0.0, 0, 0, 0, 0)
    with pytest.raises(RuntimeError, match="float32"):
        op(x, [torch.zeros(4, dtype=torch.float64)], [], [1.0, 1.0, 0.5, 0.0, 1.0, 0.0], False, 0.0, 0, 0, 0, 0)


def test_opcheck(backend_device):
    backend, device = backend_device
    inputs = [torch.randn(5, 3, device=device), torch.randn(7, device=device)]
    state = [torch.randn(5, 3, device=device), torch.randn(7, device=device)]
    out = [torch.randn(5, 3, device=device), torch.randn(7, device=device)]
    args = (inputs, state, out, [1.0, 0.5, 0.3, 0.9, 1.0, 0.0], True, 0.5, 11, 2, 0, 0, backend)
    results = torch.library.opcheck(
        torch.ops.dpkernels.linear_filter_.default, args,
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"),
    )  # fmt: skip
    assert all(v == "SUCCESS" for v in results.values()), results


# ---------------------------------------------------------------------------------------------
# Correlated noise
# ---------------------------------------------------------------------------------------------

T = 12
MECH_SHAPES = [(7, 3), (5,), (1,)]
THETA, OMEGA = [0.9, 0.5, 0.1], [0.3, 0.2, 0.05]


def _mechanisms(std, seed, backend):
    gen = torch.Generator().manual_seed(3)
    band = torch.tril(torch.triu(torch.rand(T, T, generator=gen, dtype=torch.float64) + 0.2, diagonal=-2))
    return {
        "blt": BLTNoise(THETA, OMEGA, std=std, seed=seed, start_step=5, backend=backend),
        "banded-coefs": BandedNoise(
            [1.0, 0.6, 0.3, 0.1], num_steps=T, std=std, seed=seed, start_step=5, backend=backend
        ),  # fmt: skip
        "banded-toeplitz": BandedNoise([1.0, 0.5], std=std, seed=seed, start_step=5, backend=backend),
        "banded-matrix": BandedNoise(matrix=band, std=std, seed=seed, start_step=5, backend=backend),
        "banded-b1": BandedNoise([2.0], num_steps=T, std=std, seed=seed, start_step=5, backend=backend),
    }


@pytest.mark.parametrize("name", ["blt", "banded-coefs", "banded-toeplitz", "banded-matrix", "banded-b1"])
def test_streaming_equals_dense(backend_device, name):
    """noise_t = std · Σ_j C⁻¹[t, j] z_j, with C⁻¹ built densely in float64 and the same z_j."""
    backend, device = backend_device
    std, seed = 0.9, 2024
    mech = _mechanisms(std, seed, backend)[name]
    total = sum(math.prod(s) for s in MECH_SHAPES)
    got = []
    for t in range(T):
        parts = mech.noise(MECH_SHAPES, 5 + t, device=device)
        got.append(torch.cat([p.reshape(-1) for p in parts]).double().cpu())
    z = torch.stack(
        [
            dpkernels.gaussian_noise(total, std=1.0, seed=seed, step=5 + t, backend="reference").double()
            for t in range(T)
        ]
    )
    want = std * (mech.noising_matrix(T) @ z)
    torch.testing.assert_close(torch.stack(got), want, atol=2e-5, rtol=2e-5)


def test_dense_matrices():
    blt = BLTNoise([0.8, 0.3], [0.2, 0.1], std=1.0, seed=0)
    C = blt.strategy_matrix(5)
    t = blt.toeplitz_coefs(5)
    torch.testing.assert_close(t[:3], torch.tensor([1.0, 0.3, 0.2 * 0.8 + 0.1 * 0.3], dtype=torch.float64))
    assert torch.equal(torch.diagonal(C, -2), torch.full((3,), t[2].item(), dtype=torch.float64))
    assert blt.sensitivity(5) == pytest.approx(float(torch.linalg.vector_norm(C[:, 0])))
    u = torch.tensor([1.0, 0, 1, 0, 1], dtype=torch.float64)
    assert blt.sensitivity(5, min_sep=2, max_participations=3) == pytest.approx(float(torch.linalg.vector_norm(C @ u)))
    band = BandedNoise([3.0, 1.0, 1.0], num_steps=6, std=1.0, seed=0)
    C = band.strategy_matrix()
    torch.testing.assert_close(torch.linalg.vector_norm(C, dim=0), torch.ones(6, dtype=torch.float64))
    assert C[5, 2] == 0 and C[5, 3] != 0  # bandwidth 3
    assert band.sensitivity() == 1.0
    assert band.sensitivity(min_sep=3, max_participations=2) == pytest.approx(math.sqrt(2))
    with pytest.raises(ValueError, match="min_sep"):
        band.sensitivity(min_sep=2, max_participations=2)
    # From the materialised matrix: the same mechanism.
    again = BandedNoise(matrix=C, std=1.0, seed=0)
    torch.testing.assert_close(again.strategy_matrix(), C)


def test_first_step_is_fresh_philox(backend_device):
    backend, device = backend_device
    std, seed = 0.7, 77
    blt = BLTNoise(THETA, OMEGA, std=std, seed=seed, stream=3, start_step=10, backend=backend)
    got = blt.noise([(40,), (3, 3)], 10, device=device)
    want = dpkernels.gaussian_noise(49, std=std, seed=seed, step=10, stream=3, device=device, backend=backend)
    torch.testing.assert_close(torch.cat([g.reshape(-1) for g in got]), want, atol=0, rtol=0)
    band = BandedNoise([1.0, 1.0], std=std, seed=seed, start_step=10, backend=backend)
    got = torch.cat([g.reshape(-1) for g in band.noise([(49,)], 10, device=device)])
    z = dpkernels.gaussian_noise(49, std=std, seed=seed, step=10, device=device, backend=backend)
    # C = Toeplitz([1, 1] / √2): x_0 = z_0 / row_0 = √2 z_0, column scale 1.
    torch.testing.assert_close(got, math.sqrt(2) * z, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", ["blt", "banded-coefs", "banded-toeplitz", "banded-matrix", "banded-b1"])
def test_add_noise_determinism_and_resume(backend_device, name):
    backend, device = backend_device
    shapes = [(9, 4), (17,)]
    base = [torch.randn(s, device=device).to(torch.bfloat16) for s in shapes]

    def run(mech, steps, start, tensors):
        outs = []
        for t in range(start, start + steps):
            x = [b.clone() for b in tensors]
            mech.add_noise_(x, t)
            outs.append(x)
        return outs

    a = _mechanisms(0.6, 99, backend)[name]
    b = _mechanisms(0.6, 99, backend)[name]
    full_a = run(a, 8, 5, base)
    full_b = run(b, 8, 5, base)
    for xa, xb in zip(full_a, full_b, strict=True):
        for ta, tb in zip(xa, xb, strict=True):
            assert torch.equal(ta, tb)
    # add_noise_ adds the noise() sequence.
    c = _mechanisms(0.6, 99, backend)[name]
    for t in range(5, 8):
        n = c.noise(shapes, t, device=device)
        for got, x0, nz in zip(full_a[t - 5], base, n, strict=True):
            torch.testing.assert_close(got.float(), (x0.float() + nz).to(torch.bfloat16).float(), atol=0, rtol=0)
    # Resume after 5 steps: bit-identical to the uninterrupted run.
    first = _mechanisms(0.6, 99, backend)[name]
    run(first, 5, 5, base)
    sd = first.state_dict()
    resumed = _mechanisms(0.6, 12345, backend)[name]  # another seed: the state_dict's wins
    resumed.load_state_dict(sd)
    for xa, xr in zip(full_a[5:], run(resumed, 3, 10, base), strict=True):
        for ta, tr in zip(xa, xr, strict=True):
            assert torch.equal(ta, tr)


def test_noise_statistics():
    """Per-element variance of noise_t is std² Σ_j C⁻¹[t, j]² (D = 40000 draws per step)."""
    std = 1.5
    blt = BLTNoise(THETA, OMEGA, std=std, seed=5)
    M = blt.noising_matrix(6)
    prev = None
    for t in range(6):
        (n,) = blt.noise([(40000,)], t)
        want = std * float(M[t].pow(2).sum().sqrt())
        assert abs(n.std().item() - want) < 0.03 * want
        assert abs(n.mean().item()) < 5 * want / 200
        if prev is not None:
            corr = float((n * prev).mean() / (n.std() * prev.std()))
            want_corr = float((M[t] @ M[t - 1]) / (M[t].norm() * M[t - 1].norm()))
            assert abs(corr - want_corr) < 0.03
        prev = n


def test_misuse_raises():
    blt = BLTNoise(THETA, OMEGA, std=1.0, seed=1)
    x = [torch.zeros(4)]
    blt.add_noise_(x, 0)
    with pytest.raises(ValueError, match="repeats a step"):
        blt.add_noise_(x, 0)
    with pytest.raises(ValueError, match="skips steps"):
        blt.add_noise_(x, 2)
    blt.add_noise_(x, 1)  # the failed calls did not advance the state
    with pytest.raises(ValueError, match="shapes"):
        blt.add_noise_([torch.zeros(5)], 2)
    with pytest.raises(ValueError, match=r"\(0, 1\)"):
        BLTNoise([1.0], [0.5], std=1.0)
    with pytest.raises(ValueError, match="same length"):
        BLTNoise([0.5, 0.2], [0.5], std=1.0)
    with pytest.raises(ValueError, match="finite"):
        BLTNoise([0.5], [float("nan")], std=1.0)
    with pytest.raises(ValueError, match="std"):
        BLTNoise([0.5], [0.5], std=-1.0)
    with pytest.raises(ValueError, match="exactly one"):
        BandedNoise([1.0], matrix=torch.eye(3), std=1.0)
    with pytest.raises(ValueError, match="lower-triangular"):
        BandedNoise(matrix=torch.ones(3, 3), std=1.0)
    with pytest.raises(ValueError, match="diagonal"):
        BandedNoise(matrix=torch.tensor([[1.0, 0], [1, 0]]), std=1.0)
    with pytest.raises(ValueError, match="diagonal"):
        BandedNoise([0.0, 1.0], std=1.0)
    with pytest.raises(ValueError, match="at most 32"):
        BandedNoise([1.0] * 33, std=1.0)
    band = BandedNoise([1.0, 0.5], num_steps=2, std=1.0, seed=0)
    band.add_noise_(x, 0)
    band.add_noise_(x, 1)
    with pytest.raises(ValueError, match="covers 2 steps"):
        band.add_noise_(x, 2)
    other = BLTNoise([0.5], [0.5], std=1.0)
    with pytest.raises(ValueError, match="different mechanism parameters"):
        other.load_state_dict(BLTNoise([0.4], [0.5], std=1.0).state_dict())
    with pytest.raises(ValueError, match="BLTNoise"):
        band.load_state_dict(blt.state_dict())
