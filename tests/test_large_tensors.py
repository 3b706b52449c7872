"""Index arithmetic past 2^31 on the cpu backend (issue 17, "Large tensors").

One per-sample gradient list of about 2.7·10^9 bf16 elements (5.4 GB): a small parameter, then a
``[B, D]`` one whose sample offsets ``i·D`` pass 2^31 elements (and 2^32 bytes) for the last fifth of
the batch. clip_and_accumulate, privatize and one DPAdam step run on it; the float64 reference is
formed only where it is cheap: every per-sample norm by chunked float64 accumulation, and the
clipped sum, the private gradient and Adam's first moment and update at sampled coordinates. A
kernel that wraps an offset reads another sample's row, or another place in it: the rows are
independent draws of different scales, so the norms and sums come out wrong.

Slow: about 25 s on 2 cores, peak RSS 7 GB (README, "Development").
"""

import math

import pytest
import torch

import dpkernels
import dpkernels.optim as dpo
from dpkernels.reference import noise as ref_noise

B = 40
D = 2**26 + 1237  # B·D = 2.68e9 > 2^31: samples 32 .. 39 start past element 2^31
SMALL = (3, 5, 7)  # the big tensor's global noise offset is 105, not a multiple of 4
SEED, STEP = 2**61 + 11, 1
SIGMA = 1e-3  # σC·z comparable to the clipped sum's coordinates (~1/√D · √B), so both are checked
CHUNK = 2**24  # elements per float64 reference chunk (128 MiB)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def big():
    """The gradient list, per-sample norms in float64, the bound C, and sampled coordinates.

    Row i of the large tensor is a base row of N(0, 1/D) bf16 draws, cyclically shifted by a random
    k_i and multiplied by 2^e_i, e_i in {-2, -1, 1, 2}: exact in bf16, so ‖row_i‖² = 4^e_i ‖base‖²
    exactly, and one float64 pass over the base gives every norm (drawing and summing 40 independent
    rows took 68 s of this test's 81 s). The shifts make the rows differ at every coordinate, so a
    read from the wrong row or the wrong place in a row changes the sampled sums.
    """
    if "cpu" not in dpkernels.available_backends("cpu"):
        pytest.skip("the cpu backend is not built")
    gen = torch.Generator().manual_seed(1234)
    base = (torch.randn(D, generator=gen) / math.sqrt(D)).to(torch.bfloat16)
    base_sumsq = _sumsq64(base)
    small = (torch.randn(B, *SMALL, generator=gen) * 0.01).to(torch.bfloat16)
    large = torch.empty(B, D, dtype=torch.bfloat16)
    shifts = torch.randint(0, D, (B,), generator=gen).tolist()
    exps = torch.tensor([-2, -1, 1, 2])[torch.randint(0, 4, (B,), generator=gen)].tolist()
    for i, (k, e) in enumerate(zip(shifts, exps, strict=True)):
        torch.mul(base[k:], 2.0**e, out=large[i, : D - k])
        torch.mul(base[:k], 2.0**e, out=large[i, D - k :])
    sumsq = (
        small.double().square().reshape(B, -1).sum(1)
        + torch.tensor([4.0**e for e in exps], dtype=torch.float64) * base_sumsq
    )
    # The construction, checked directly on rows before and past element 2^31.
    for i in (3, 33, B - 1):
        assert math.isclose(_sumsq64(large[i]) + float(small[i].double().square().sum()), sumsq[i], rel_tol=1e-12)
    norms = sumsq.sqrt()
    C = 1.0
    assert 5 < int((norms > C).sum()) < B - 5 and bool((norms[32:] > C).any()) and bool((norms[32:] < C).any())
    # Coordinates of the large tensor: both ends, the middle, and random ones.
    coords = torch.cat(
        [torch.tensor([0, 1, 2, 3, D // 2, D - 4, D - 3, D - 2, D - 1]), torch.randint(0, D, (48,), generator=gen)]
    )
    return [small, large], norms, C, coords


def _sumsq64(x):
    """Σ x² of a 1-D tensor, accumulated in float64 over chunks of CHUNK elements."""
    # Not linalg.vector_norm(dtype=float64): its result was 6e-13 off the exact float64 sum here.
    return sum(float(torch.dot(v, v)) for v in (x[c : c + CHUNK].double() for c in range(0, x.numel(), CHUNK)))


def _clip_weights(norms, C):
    """float64 weights of mode "clip": min(1, C / (n + 1e-6))."""
    return torch.clamp(C / (norms + 1e-6), max=1.0)


def _sum_at(large, coords, w):
    """float64 Σ_i w_i g_i[e] at the sampled coordinates, and Σ_i |w_i g_i[e]| (the error scale)."""
    cols = large[:, coords].double()  # [B, E]
    terms = w[:, None] * cols
    return terms.sum(0), terms.abs().sum(0)


def _normals_at(coords, offset):
    """float64 standard normals z(offset + e) of the reference Philox stream (docs/RNG.md)."""
    return torch.cat(
        [ref_noise.standard_normal(1, seed=SEED, step=STEP, offset=offset + int(e)).double() for e in coords]
    )


def _assert_within(got, want, tol, coords, what):
    """|got - want| <= tol at every sampled coordinate; the message names the worst one."""
    err = (got.double() - want).abs() / tol
    worst = int(err.argmax())
    assert float(err[worst]) <= 1, (
        f"{what}: {int((err > 1).sum())} of {len(coords)} sampled coordinates off, worst e={int(coords[worst])}: "
        f"got {float(got[worst]):.9g}, want {float(want[worst]):.9g} (tolerance {float(tol[worst]):.3g})"
    )


def test_clip_and_accumulate_past_2_31(big):
    grads, norms, C, coords = big
    sums, got_norms = dpkernels.clip_and_accumulate(grads, C, backend="cpu")
    torch.testing.assert_close(got_norms.double(), norms, rtol=2e-6, atol=0)
    w = _clip_weights(norms, C)
    want, scale = _sum_at(grads[1], coords, w)
    _assert_within(sums[1][coords], want, 1e-5 * scale, coords, "clipped sum")
    want_small = (w[:, None] * grads[0].double().reshape(B, -1)).sum(0).reshape(SMALL)
    torch.testing.assert_close(sums[0].double(), want_small, rtol=1e-5, atol=1e-7)


def test_privatize_past_2_31(big):
    grads, norms, C, coords = big
    out = dpkernels.privatize(grads, C, SIGMA, seed=SEED, step=STEP, expected_batch_size=B, backend="cpu")
    S, scale = _sum_at(grads[1], coords, _clip_weights(norms, C))
    z = _normals_at(coords, math.prod(SMALL))
    want = (S + SIGMA * C * z) / B
    _assert_within(out[1][coords], want, (1e-5 * scale + 1e-5 * SIGMA * C) / B, coords, "private gradient")


def test_dpadam_step_past_2_31(big):
    grads, norms, C, coords = big
    gen = torch.Generator().manual_seed(99)
    params = [torch.randn(*SMALL, generator=gen), torch.randn(D, generator=gen)]
    theta0 = params[1][coords].double()
    lr, beta1, eps = 1e-2, 0.9, 2e-5  # eps near |g̃|, so the update depends on g̃'s value, not its sign
    opt = dpo.DPAdam(params, lr=lr, betas=(beta1, 0.999), eps=eps, noise_multiplier=SIGMA, max_grad_norm=C,
                     expected_batch_size=B, seed=SEED, backend="cpu")  # fmt: skip
    for p, g in zip(params, grads, strict=True):
        p.grad_sample = g
    opt.step()
    S, scale = _sum_at(grads[1], coords, _clip_weights(norms, C))
    g_tilde = (S + SIGMA * C * _normals_at(coords, math.prod(SMALL))) / B
    err = (1e-5 * scale + 1e-5 * SIGMA * C) / B
    m = opt.state[params[1]]["exp_avg"][coords].double()
    _assert_within(m, (1 - beta1) * g_tilde, (1 - beta1) * err, coords, "exp_avg")
    # Step 1: m̂ = g̃ and v̂ = g̃², so θ ← θ − lr·g̃/(|g̃| + eps).
    want = theta0 - lr * g_tilde / (g_tilde.abs() + eps)
    torch.testing.assert_close(params[1][coords].double(), want, rtol=0, atol=2e-6)
