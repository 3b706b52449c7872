"""The optimizers on the reference backend (the step functions of dpkernels/reference/optim.py)
checked against the papers, against torch.optim where the algorithms coincide, against literal
per-sample transcriptions of the papers' algorithms, and against dpkernels.privatize."""

import copy
import functools
import math
import types

import pytest
import torch
import torch.nn.functional as F

import dpkernels
from dpkernels import optim as _optim
from dpkernels.pmlf import pmlf_grad_samples
from dpkernels.reference import clip as ref_clip
from dpkernels.reference import optim as _ref

pytestmark = pytest.mark.no_cpu_kernels

# The optimizers on backend="reference" (fp64-capable) and the reference's paper math.
O = types.SimpleNamespace(  # noqa: E741
    **{name: functools.partial(getattr(_optim, name), backend="reference") for name in _optim.__all__},
    **{name: getattr(_ref, name) for name in ("PMLF_PRESETS", "macadam_kappa", "pmlf_momentum_coeffs",
                                              "pmlf_bias_correction")},
)  # fmt: skip

SHAPES = ((3, 5), (7,), (2, 1, 3))
F64 = torch.float64


def make_params(dtype=F64, shapes=SHAPES, seed=0, zero=False):
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.zeros(s, dtype=dtype) if zero else torch.randn(s, generator=gen).to(dtype)).requires_grad_()
        for s in shapes
    ]


def grad_samples(params, B, step, k=1, dtype=None, scale=1.0):
    """Per-sample gradients for ``step``, deterministic, with per-sample norms spread over ~2 decades
    (so some samples are clipped and some are not)."""
    gen = torch.Generator().manual_seed(1000 + step)
    mags = torch.exp(1.5 * torch.randn(B, generator=gen))
    sets = []
    for _ in range(k):
        sets.append(
            [
                (scale * torch.randn(B, *p.shape, generator=gen, dtype=F64) * mags.view(-1, *([1] * p.dim())) / 3).to(
                    dtype or p.dtype
                )
                for p in params
            ]
        )
    return sets


def attach(params, sets, as_list=False):
    for idx, p in enumerate(params):
        p.grad_sample = [s[idx] for s in sets] if as_list or len(sets) > 1 else sets[0][idx]


def clipped_mean(sets, C, B, coeffs=(1.0,)):
    sums, _ = ref_clip.clip_and_accumulate(sets, C, coeffs)
    return [s / B for s in sums]


# --------------------------------------------------------------------------------------------
# Noise: exact against privatize, statistics, the replaceable noise method
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["clip", "auto_s", "auto_v", "psac"])
def test_dpsgd_private_grad_equals_privatize_exactly(mode):
    params = make_params(torch.float32, zero=True)
    B, C, sigma, seed = 6, 0.7, 1.3, 0xDEADBEEF12345678
    opt = O.DPSGD(params, lr=1.0, noise_multiplier=sigma, max_grad_norm=C, expected_batch_size=B, mode=mode,
                  seed=seed)  # fmt: skip
    for t in (1, 2, 3):
        sets = grad_samples(params, 5, t, dtype=torch.float32)  # realised batch 5 != expected 6
        attach(params, sets)
        with torch.no_grad():
            for p in params:
                p.zero_()
        opt.step()  # θ = 0 − 1·g̃ = −g̃ exactly
        want = dpkernels.privatize(sets[0], C, sigma, seed=seed, step=t, mode=mode, expected_batch_size=B,
                                   backend="reference")  # fmt: skip
        for p, w in zip(params, want, strict=True):
            assert torch.equal(-p.detach(), w)


def test_noise_statistics_and_seeds():
    params = [torch.zeros(40000, requires_grad=True), torch.zeros(3, 7, requires_grad=True)]
    B, C, sigma = 4, 0.5, 2.0
    opt = O.DPSGD(params, lr=1.0, noise_multiplier=sigma, max_grad_norm=C, expected_batch_size=B, seed=7)
    draws = []
    for _ in range(2):
        attach(params, [[torch.zeros(B, *p.shape) for p in params]])
        with torch.no_grad():
            for p in params:
                p.zero_()
        opt.step()
        draws.append(-torch.cat([p.detach().flatten() for p in params]))
    std = sigma * C / B
    for d in draws:
        assert abs(d.mean().item()) < 5 * std / math.sqrt(d.numel())
        assert abs(d.std().item() / std - 1) < 0.02
    assert abs(torch.corrcoef(torch.stack(draws))[0, 1].item()) < 0.03  # steps are independent
    a = O.DPSGD(params, lr=1.0, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=B)
    b = O.DPSGD(params, lr=1.0, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=B)
    assert a.seed != b.seed and 0 <= a.seed < 2**64


def test_noise_method_returns_the_steps_noise():
    """``noise(t)`` is the ``z_t`` that step ``t`` draws in its pass (the generator lives in the family
    op since the optimizers became one class per algorithm; ``noise`` is no longer a hook)."""
    params = make_params(torch.float32, zero=True)
    B, C, sigma = 4, 0.5, 1.5
    opt = O.DPSGD(params, lr=1.0, noise_multiplier=sigma, max_grad_norm=C, expected_batch_size=B, seed=3)
    for t in (1, 2):
        attach(params, [[torch.zeros(B, *p.shape) for p in params]])
        with torch.no_grad():
            for p in params:
                p.zero_()
        opt.step()
        for p, z in zip(params, opt.noise(t), strict=True):
            assert torch.equal(-p.detach(), (sigma * C * z) * (1.0 / B))


# --------------------------------------------------------------------------------------------
# Noise-free runs equal torch.optim on the clipped mean gradient
# --------------------------------------------------------------------------------------------


def _compare_with_torch(make_dp, make_torch, steps=6, C=0.8, B=5):
    params = make_params()
    twins = [p.detach().clone().requires_grad_() for p in params]
    dp = make_dp(params, C, B)
    ref = make_torch(twins)
    for t in range(1, steps + 1):
        sets = grad_samples(params, B, t)
        attach(params, sets)
        for q, g in zip(twins, clipped_mean(sets, C, B), strict=True):
            q.grad = g
        dp.step()
        ref.step()
        for p, q in zip(params, twins, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


def test_dpadam_noise_free_equals_torch_adam():
    _compare_with_torch(
        lambda ps, C, B: O.DPAdam([{"params": ps[:1], "lr": 3e-2}, {"params": ps[1:]}], lr=1e-2, noise_multiplier=0.0,
                                  max_grad_norm=C, expected_batch_size=B, betas=(0.8, 0.99), eps=1e-6),
        lambda qs: torch.optim.Adam([{"params": qs[:1], "lr": 3e-2}, {"params": qs[1:]}], lr=1e-2, betas=(0.8, 0.99),
                                    eps=1e-6, foreach=False),
    )  # fmt: skip


def test_dpadam_weight_decay_equals_torch_adamw():
    _compare_with_torch(
        lambda ps, C, B: O.DPAdam(ps, lr=1e-2, noise_multiplier=0.0, max_grad_norm=C, expected_batch_size=B,
                                  weight_decay=0.1),
        lambda qs: torch.optim.AdamW(qs, lr=1e-2, weight_decay=0.1, foreach=False),
    )  # fmt: skip


def test_dpsgd_momentum_noise_free_equals_torch_sgd():
    _compare_with_torch(
        lambda ps, C, B: O.DPSGD(ps, lr=0.1, noise_multiplier=0.0, max_grad_norm=C, expected_batch_size=B,
                                 momentum=0.9, weight_decay=0.01),
        lambda qs: torch.optim.SGD(qs, lr=0.1, momentum=0.9, weight_decay=0.01, foreach=False),
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# DP-AdamBC and scale-then-privatize
# --------------------------------------------------------------------------------------------


def test_adambc_floor():
    p = torch.zeros(4, dtype=F64, requires_grad=True)
    B, C, sigma, lr, gp = 2, 1.0, 0.5, 0.1, 1e-3
    opt = O.DPAdamBC([p], lr=lr, noise_multiplier=sigma, max_grad_norm=C, expected_batch_size=B, gamma_prime=gp)
    assert opt.phi == (sigma * C / B) ** 2 == 0.0625
    g_priv = torch.tensor([1.0, 0.1, -0.2, 0.3], dtype=F64)
    p.grad_sample = torch.zeros(B, 4, dtype=F64)
    opt.step(noise=[B * g_priv])  # S = 0, so g̃ = ν/B
    b1, b2 = 0.9, 0.999
    m_hat = (1 - b1) * g_priv / (1 - b1)
    v_hat = (1 - b2) * g_priv**2 / (1 - b2)
    floored = v_hat - opt.phi < gp
    assert floored.tolist() == [False, True, True, False]
    want = -lr * m_hat / torch.where(floored, torch.full_like(v_hat, gp), v_hat - opt.phi).sqrt()
    torch.testing.assert_close(p.detach(), want, rtol=1e-14, atol=0)
    assert torch.equal(p.detach()[1:3], -lr * m_hat[1:3] / math.sqrt(gp))


@pytest.mark.parametrize("t, u", [(1, 0.0), (3, 0.04)])
def test_stp_with_uniform_vhat_is_dpadam_with_rescaled_clip(t, u):
    """With ``v̂_{t−1} = u·1``, STP's ellipsoid is a ball of radius ``C(√u + ε₁)`` and its noise is
    ``σC(√u + ε₁)z``: DP-Adam with ``C' = C(√u + ε₁)``."""
    B, C, sigma, eps1, b2 = 5, 0.6, 0.9, 0.1, 0.99
    params = make_params()
    twins = [p.detach().clone().requires_grad_() for p in params]
    stp = O.DPAdamSTP(params, lr=1e-2, noise_multiplier=sigma, max_grad_norm=C, expected_batch_size=B,
                      mode="auto_v", seed=11, betas=(0.9, b2), eps1=eps1, eps2=1e-7)  # fmt: skip
    adam = O.DPAdam(twins, lr=1e-2, noise_multiplier=sigma, max_grad_norm=C * (math.sqrt(u) + eps1),
                    expected_batch_size=B, mode="auto_v", seed=11, betas=(0.9, b2), eps=1e-7)  # fmt: skip
    gen = torch.Generator().manual_seed(5)
    for opt, ps in ((stp, params), (adam, twins)):
        opt._step = t - 1
        gen.manual_seed(5)
        for p in ps:
            opt.state[p]["exp_avg"] = 0.1 * torch.randn(p.shape, generator=gen, dtype=F64) if t > 1 else 0 * p.detach()
            opt.state[p]["exp_avg_sq"] = torch.full_like(p, u * (1 - b2 ** (t - 1)), dtype=F64).detach()
            if "scale" in opt.state[p]:  # STP keeps s_t = 1/(√v̂_{t−1} + ε₁), written by step t − 1
                opt.state[p]["scale"] = torch.full_like(p, 1 / (math.sqrt(u) + eps1), dtype=F64)
    sets = grad_samples(params, B, t, scale=3.0)
    attach(params, sets)
    attach(twins, sets)
    stp.step()
    adam.step()
    for p, q in zip(params, twins, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-13)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(stp.state[p][key], adam.state[q][key], rtol=1e-10, atol=1e-15)


def test_stp_tiny_eps1_clips_every_sample_and_damps_the_run():
    """Why ``eps1`` has no default (docs/ALGORITHMS.md): with ε₁ = 1e-8 (the former default) step 1
    clips every sample at ``C·ε₁``, ``√v̂`` stays near ε₁ and below ε₂ = 1e-8, and the updates shrink
    several-fold; with ``C·ε₁`` at the per-sample norms' scale the same run moves at Adam's pace."""
    B, C, lr = 8, 1.0, 1e-2
    norms = torch.stack([g.flatten(1).norm(dim=1) for g in grad_samples(make_params(), B, 1)[0]]).norm(dim=0)
    assert (norms > C * 1e-8).all() and (norms < C * 1.0).float().mean() == 0.5  # ε₁ = 1: half clipped

    def mean_update(eps1):
        params = make_params()
        opt = O.DPAdamSTP(params, lr=lr, eps1=eps1, noise_multiplier=1.0, max_grad_norm=C, expected_batch_size=B,
                          seed=3)  # fmt: skip
        moves = []
        for t in range(1, 13):
            before = [p.detach().clone() for p in params]
            attach(params, grad_samples(params, B, t))
            opt.step()
            moves.append(torch.cat([(p.detach() - q).flatten() for p, q in zip(params, before, strict=True)]))
        return torch.stack(moves).abs().mean(1) / lr  # per step, in units of lr

    tiny, tuned = mean_update(1e-8), mean_update(1.0)
    assert tuned[0] > 0.99 and tiny[0] < 0.2  # Adam's first step moves lr, unless √v̂ is at ε₂'s scale
    assert tuned.mean() > 4 * tiny.mean()


# --------------------------------------------------------------------------------------------
# DP-MacAdam
# --------------------------------------------------------------------------------------------

# seeds_macadam_dp2.md §A.4, β1 = 0.9, printed with the given number of decimals
KAPPA_TABLE = {1: (0.0, 6), 2: (0.094737, 6), 3: (0.18, 6), 5: (0.3258, 4), 10: (0.580338, 6), 20: (0.819393, 6),
               50: (0.941943, 6), 100: (0.947340, 6)}  # fmt: skip


def test_macadam_kappa_table():
    for t, (want, digits) in KAPPA_TABLE.items():
        assert abs(O.macadam_kappa(t, 0.9) - want) <= 0.5 * 10**-digits, t
    assert O.macadam_kappa(1, 0.9) == 0.0
    assert abs(O.macadam_kappa(10**6, 0.9) - 2 * 0.9 / 1.9) < 1e-15
    for beta in (0.5, 0.9, 0.99):  # closed form == the sum definition (1 − β^t)(1 − Σ c_k²)
        for t in range(1, 40):
            c = [(1 - beta) * beta ** (t - i) / (1 - beta**t) for i in range(1, t + 1)]
            assert abs(O.macadam_kappa(t, beta) - (1 - beta**t) * (1 - sum(x * x for x in c))) < 1e-12


def test_macadam_h_defaults_scale_with_d():
    """h1, h2 default to the paper's MNIST values at its d = 795,010 and keep d·h fixed elsewhere;
    explicit values are kept."""
    from dpkernels.optim.macadam import macadam_h_defaults

    h1, h2 = macadam_h_defaults(795_010)
    assert math.isclose(h1, 1e-9, rel_tol=1e-12) and math.isclose(h2, 1e-6, rel_tol=1e-12)
    h1, h2 = macadam_h_defaults(2_410)  # the digits MLP of `dpkernels train`
    assert math.isclose(h1, 3.29879668e-7, rel_tol=1e-8) and math.isclose(h2, 3.29879668e-4, rel_tol=1e-8)
    params = make_params()  # d = 28
    group = O.DPMacAdam(params, **BASE).param_groups[0]
    assert math.isclose(group["h1"], 7.9501e-4 / 28, rel_tol=1e-12) and math.isclose(group["h2"], 0.79501 / 28)
    group = O.DPMacAdam(params, h1=1e-9, h2=1e-6, **BASE).param_groups[0]
    assert (group["h1"], group["h2"]) == (1e-9, 1e-6)
    with pytest.raises(ValueError, match="d \\(number of parameters\\)"):
        macadam_h_defaults(0)


@pytest.mark.parametrize("shapes", [SHAPES, ((40, 25),)], ids=["d28", "d1000"])
def test_macadam_default_clip_radius_does_not_depend_on_d(shapes):
    """The invariant behind the defaults: with ŝ clamped at h1 everywhere, every semi-axis of the clip
    ellipsoid is b_j = √(d·h1) = √(7.9501e-4), whatever d (here ŝ ≈ 0 < h1: noiseless, constant tiny gradients)."""
    params = make_params(shapes=shapes)
    B = 4
    opt = O.DPMacAdam(params, lr=1e-3, noise_multiplier=0.0, expected_batch_size=B)
    sets = [[1e-6 * torch.ones(B, *p.shape, dtype=F64) for p in params]]
    for _ in range(2):  # b changes from b0 at t = 2 (κ_1 = 0)
        attach(params, sets)
        opt.step()
    for p in params:
        torch.testing.assert_close(opt.b(p), torch.full_like(p, math.sqrt(7.9501e-4)), rtol=1e-12, atol=0)


def test_macadam_first_step_keeps_b0_and_no_nan():
    params = make_params(torch.float32)
    d = sum(p.numel() for p in params)
    B, sigma = 8, 1.0
    opt = O.DPMacAdam(params, lr=1e-3, noise_multiplier=sigma, expected_batch_size=B, seed=2, h1=1e-9, h2=1.0)
    attach(params, grad_samples(params, B, 1))
    opt.step()
    for p in params:
        st = opt.state[p]
        assert torch.equal(opt.b(p), torch.full_like(p, 1.0 / d))  # b_1 = b_0
        assert all(torch.isfinite(v).all() for v in st.values()) and torch.isfinite(p).all()
        # s_1 was updated: u_1 = (g̃ − m̂_1)² with m̂_1 = g̃ up to rounding
        assert (st["s"] <= 1e-6 * st["exp_avg_sq"] / (1 - 0.999) + 1e-30).all()
    b1 = {p: opt.b(p).clone() for p in params}
    attach(params, grad_samples(params, B, 2))
    opt.step()
    kappa = O.macadam_kappa(2, 0.9)
    s_hat = {p: torch.clamp(opt.state[p]["s"] / kappa - b1[p] ** 2 * (sigma / B) ** 2, 1e-9, 1.0) for p in params}
    total = sum(s.sqrt().sum().item() for s in s_hat.values())  # global over all tensors
    for p in params:
        torch.testing.assert_close(opt.b(p), s_hat[p] ** 0.25 * math.sqrt(total), rtol=1e-6, atol=0)
        assert not torch.equal(opt.b(p), b1[p])


def _macadam_literal(params, steps, B, sigma, noises, h1, h2, b0, bias_correction, bc_scale, lr=1e-2, gp=1e-8):
    """seeds_macadam_dp2.md §A.2 line by line, materialising w_i (the paper's form)."""
    b1, b2, gamma = 0.9, 0.999, 1e-8
    theta = [p.detach().clone() for p in params]
    z = [torch.zeros_like(x) for x in theta]
    m, v, s, m_hat = list(z), list(z), list(z), list(z)
    b = [torch.full_like(x, b0) for x in theta]
    for t in range(1, steps + 1):
        gs = grad_samples(params, B, t)[0]
        w = [((g - mh) / bb).flatten(1) for g, mh, bb in zip(gs, m_hat, b, strict=True)]
        n = torch.cat(w, dim=1).norm(dim=1)
        c = torch.clamp(1.0 / (n + 1e-6), max=1.0)
        w_tilde = [
            (c[:, None] * wi).sum(0).view(x.shape) / B + nu / B
            for wi, x, nu in zip(w, theta, noises[t - 1], strict=True)
        ]
        g = [bb * wt + mh for bb, wt, mh in zip(b, w_tilde, m_hat, strict=True)]
        m = [b1 * mi + (1 - b1) * gi for mi, gi in zip(m, g, strict=True)]
        v = [b2 * vi + (1 - b2) * gi**2 for vi, gi in zip(v, g, strict=True)]
        m_hat = [mi / (1 - b1**t) for mi in m]
        v_hat = [vi / (1 - b2**t) for vi in v]
        if bias_correction:
            phi = [(sigma / B) ** 2 * (bb**2 if bc_scale == "b2" else 1) for bb in b]
            theta = [
                x - lr * mh / torch.clamp(vh - ph, min=gp).sqrt()
                for x, mh, vh, ph in zip(theta, m_hat, v_hat, phi, strict=True)
            ]
        else:
            theta = [x - lr * mh / (vh.sqrt() + gamma) for x, mh, vh in zip(theta, m_hat, v_hat, strict=True)]
        s = [b1 * si + (1 - b1) * (gi - mh) ** 2 for si, gi, mh in zip(s, g, m_hat, strict=True)]
        kappa = 2 * (b1 - b1**t) / (1 + b1)
        if kappa > 0:
            s_hat = [torch.clamp(si / kappa - bb**2 * sigma**2 / B**2, h1, h2) for si, bb in zip(s, b, strict=True)]
            total = sum(x.sqrt().sum() for x in s_hat)
            b = [x**0.25 * total.sqrt() for x in s_hat]
    return theta, m, v, s, b


@pytest.mark.parametrize("bias_correction, bc_scale", [(False, "paper"), (True, "paper"), (True, "b2")])
def test_macadam_equals_literal_algorithm(bias_correction, bc_scale):
    B, sigma, steps, h1, h2, b0 = 6, 0.8, 5, 1e-12, 1e2, 0.3
    params = make_params()
    gen = torch.Generator().manual_seed(9)
    noises = [[sigma * torch.randn(p.shape, generator=gen, dtype=F64) for p in params] for _ in range(steps)]
    want = _macadam_literal(params, steps, B, sigma, noises, h1, h2, b0, bias_correction, bc_scale)
    opt = O.DPMacAdam(params, lr=1e-2, noise_multiplier=sigma, expected_batch_size=B, h1=h1, h2=h2, b0=b0,
                      bias_correction=bias_correction, bc_scale=bc_scale, gamma_prime=1e-8)  # fmt: skip
    for t in range(1, steps + 1):
        attach(params, grad_samples(params, B, t))
        opt.step(noise=noises[t - 1])
    theta, m, v, s, b = want
    for idx, p in enumerate(params):
        st = {**opt.state[p], "b": opt.b(p)}
        torch.testing.assert_close(p.detach(), theta[idx], rtol=1e-9, atol=1e-12)
        for key, ref in (("exp_avg", m), ("exp_avg_sq", v), ("s", s), ("b", b)):
            torch.testing.assert_close(st[key], ref[idx], rtol=1e-8, atol=1e-14, msg=key)


# --------------------------------------------------------------------------------------------
# DP²
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preconditioner", ["rmsprop", "adagrad"])
def test_dp2_switches_exactly_at_the_boundaries(preconditioner):
    """Against Algorithm 1 of the paper, literally (0-based t, G accumulated on every step)."""
    s1, s2, B, C1, C2, lr1, lr2, beta, eps, sigma = 2, 3, 5, 0.7, 3.0, 0.1, 0.02, 0.9, 1e-3, 0.6
    params = make_params()
    opt = O.DP2(params, lr=lr1, lr2=lr2, noise_multiplier=sigma, max_grad_norm=C1, max_grad_norm2=C2,
                expected_batch_size=B, s1=s1, s2=s2, beta=beta, eps=eps, preconditioner=preconditioner)  # fmt: skip
    gen = torch.Generator().manual_seed(4)
    w = [p.detach().clone() for p in params]
    v = [torch.zeros_like(x) for x in w]
    G = [torch.zeros_like(x) for x in w]
    phases, refreshed = [], []
    for t0 in range(12):
        unit = [torch.randn(p.shape, generator=gen, dtype=F64) for p in params]
        if t0 % (s1 + s2) == 0:
            G = [torch.zeros_like(x) for x in w]
        if t0 % (s1 + s2) == s1:
            v = [beta * vi + (1 - beta) * (g / s1) ** 2 if preconditioner == "rmsprop" else vi + (g / s1) ** 2
                 for vi, g in zip(v, G, strict=True)]  # fmt: skip
            G = [torch.zeros_like(x) for x in w]
        sgd = t0 % (s1 + s2) < s1
        D = [torch.ones_like(x) if sgd else vi.sqrt() + eps for x, vi in zip(w, v, strict=True)]
        C, lr = (C1, lr1) if sgd else (C2, lr2)
        gs = grad_samples(params, B, t0 + 1)[0]
        scaled = [(g / d).flatten(1) for g, d in zip(gs, D, strict=True)]
        c = torch.clamp(C / (torch.cat(scaled, 1).norm(dim=1) + 1e-6), max=1.0)
        g_priv = [
            ((c[:, None] * x).sum(0).view(d.shape) + sigma * C * z) / B for x, d, z in zip(scaled, D, unit, strict=True)
        ]
        G = [g + gp for g, gp in zip(G, g_priv, strict=True)]
        w = [x - lr * gp for x, gp in zip(w, g_priv, strict=True)]

        v_before = [opt.state[p]["v"].clone() for p in params]
        attach(params, [gs])
        phases.append(opt.phase(opt.steps_taken + 1))
        opt.step(noise=[sigma * C * z for z in unit])
        refreshed.append(not all(torch.equal(a, opt.state[p]["v"]) for a, p in zip(v_before, params, strict=True)))
        for idx, p in enumerate(params):
            torch.testing.assert_close(p.detach(), w[idx], rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(opt.state[p]["v"], v[idx], rtol=1e-12, atol=1e-16)
            if sgd:
                torch.testing.assert_close(opt.state[p]["G"], G[idx], rtol=1e-12, atol=1e-16)
            else:
                assert torch.equal(opt.state[p]["G"], torch.zeros_like(G[idx]))  # reset at the refresh
    assert phases == (["sgd"] * 2 + ["adaptive"] * 3) * 2 + ["sgd"] * 2
    assert refreshed == [t0 % 5 == 2 for t0 in range(12)]


# --------------------------------------------------------------------------------------------
# DP-PMLF
# --------------------------------------------------------------------------------------------

# seeds_pmlf_psac.md §A.6, c_t of convention (i) (the filter's step response), t = 0..4
PMLF_C_TABLE = {
    "a9b1": (0.1, 0.19, 0.271, 0.3439, 0.4095),
    "a6b4": (0.4, 0.64, 0.784, 0.8704, 0.9222),
    "a6b0202": (0.2, 0.52, 0.712, 0.8272, 0.8963),
    "a6b0501": (0.5, 0.7, 0.82, 0.892, 0.9352),
    "a9b0505": (0.05, 0.145, 0.2305, 0.3075, 0.3767),
    "a9b1505": (0.15, 0.235, 0.3115, 0.3803, 0.4423),
    "a72b0505": (0.05, 0.135, 0.2045, 0.2702, 0.33),
}


def test_pmlf_presets_and_bias_correction_table():
    assert set(O.PMLF_PRESETS) == set(PMLF_C_TABLE)
    for name, (a, b) in O.PMLF_PRESETS.items():
        assert abs(sum(b) - sum(a) - 1) < 1e-12
        c = O.pmlf_bias_correction(a, b, 200)
        assert all(abs(x - y) < 5e-5 for x, y in zip(c[:5], PMLF_C_TABLE[name], strict=True)), name
        assert abs(c[-1] - 1) < 1e-6  # c_t → 1 (unit DC gain)


@pytest.mark.parametrize("preset", sorted(O.PMLF_PRESETS))
def test_pmlf_filter_returns_a_constant_input(preset):
    params = make_params()
    gen = torch.Generator().manual_seed(1)
    const = [0.01 * torch.randn(p.shape, generator=gen, dtype=F64) for p in params]  # small: never clipped
    opt = O.DPPMLF(params, lr=0.5, noise_multiplier=0.0, max_grad_norm=10.0, expected_batch_size=1, k=2, beta=0.3,
                   filter=preset)  # fmt: skip
    for _ in range(25):
        for p, g in zip(params, const, strict=True):
            p.grad_sample = [g.unsqueeze(0), g.unsqueeze(0)]  # v = (α_0 + α_1) g = g
        before = [p.detach().clone() for p in params]
        opt.step()
        for p, x, g in zip(params, before, const, strict=True):
            torch.testing.assert_close((x - p.detach()) / 0.5, g, rtol=1e-10, atol=1e-15)


@pytest.mark.parametrize("preset", sorted(O.PMLF_PRESETS))
def test_pmlf_filter_equals_the_recurrence(preset):
    """Varying input (injected noise): ``m_t = −Σ a m + Σ b v̄``, ``θ ← θ − η m_t/c_t``."""
    a, b = O.PMLF_PRESETS[preset]
    B, lr = 3, 0.2
    p = torch.zeros(6, dtype=F64, requires_grad=True)
    opt = O.DPPMLF([p], lr=lr, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=B, filter=preset)
    gen = torch.Generator().manual_seed(2)
    ms, vbars, cs = [], [], O.pmlf_bias_correction(a, b, 12)
    theta = torch.zeros(6, dtype=F64)
    for t in range(12):
        nu = torch.randn(6, generator=gen, dtype=F64)
        p.grad_sample = [torch.zeros(B, 6, dtype=F64)] * 2
        opt.step(noise=[nu])
        vbars.append(nu / B)
        m = sum(b[tau] * vbars[t - tau] for tau in range(len(b)) if t - tau >= 0)
        m = m - sum(a[tau - 1] * ms[t - tau] for tau in range(1, len(a) + 1) if t - tau >= 0)
        ms.append(m)
        theta = theta - lr * m / cs[t]
        torch.testing.assert_close(p.detach(), theta, rtol=1e-12, atol=1e-15)


def test_pmlf_per_sample_momentum_equals_privatize_and_history():
    """Identity filter: θ = 0 − 1·v̄ = −(Σ clip(Σ α_j g^(j)) + σCz)/B, which is privatize with
    ``coeffs = α`` (exact); and ``past_params`` holds x_{t−1}, x_{t−2} (x_0 before that)."""
    params = make_params(torch.float32, zero=True)
    k, beta, B, C, sigma, seed = 3, 0.5, 4, 0.5, 1.1, 99
    opt = O.DPPMLF(params, lr=1.0, noise_multiplier=sigma, max_grad_norm=C, expected_batch_size=B, k=k, beta=beta,
                   filter=((), (1.0,)), seed=seed)  # fmt: skip
    alpha = O.pmlf_momentum_coeffs(k, beta)
    assert alpha == pytest.approx([4 / 7, 2 / 7, 1 / 7])
    history = []
    for t in (1, 2, 3):
        sets = grad_samples(params, B, t, k=k, dtype=torch.float32)
        attach(params, sets)
        with torch.no_grad():
            for idx, p in enumerate(params):
                p.fill_(float(t) + idx)
        history.append([p.detach().clone() for p in params])
        past = opt.past_params()
        want_past = [history[-2] if t > 1 else history[0], history[-3] if t > 2 else history[0]]
        if t == 1:  # x_0 fill is taken at construction (zeros here)
            want_past = [[torch.zeros_like(p) for p in params]] * 2
        elif t == 2:
            want_past = [history[0], [torch.zeros_like(p) for p in params]]
        for got, want in zip(past, want_past, strict=True):
            for g, w in zip(got, want, strict=True):
                assert torch.equal(g, w)
        opt.step()
        want = dpkernels.privatize(sets, C, sigma, seed=seed, step=t, coeffs=alpha, expected_batch_size=B,
                                   backend="reference")  # fmt: skip
        for p, x, w in zip(params, history[-1], want, strict=True):
            assert torch.equal(p.detach(), x - w)


def test_pmlf_grad_samples_vs_per_sample_loop():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    names = [n for n, _ in model.named_parameters()]
    s1 = [p.detach() + 0.1 * torch.randn_like(p) for p in model.parameters()]
    s2 = {n: p.detach() - 0.2 * torch.randn_like(p) for n, p in model.named_parameters()}
    got = pmlf_grad_samples(model, F.cross_entropy, x, y, [s1, s2])
    assert len(got) == 4 and all(len(g) == 3 for g in got)
    states = [[p.detach().clone() for p in model.parameters()], s1, [s2[n] for n in names]]
    for j, state in enumerate(states):
        twin = copy.deepcopy(model)
        with torch.no_grad():
            for p, v in zip(twin.parameters(), state, strict=True):
                p.copy_(v)
        for i in range(6):
            loss = F.cross_entropy(twin(x[i : i + 1]), y[i : i + 1])
            grads = torch.autograd.grad(loss, list(twin.parameters()))
            for idx, g in enumerate(grads):
                torch.testing.assert_close(got[idx][j][i], g, rtol=1e-5, atol=1e-6)
    # end to end: the optimizer's saved iterates feed the utility
    params = list(model.parameters())
    opt = O.DPPMLF(params, lr=0.1, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=6, k=3, seed=1)
    for _ in range(3):
        for p, gs in zip(params, pmlf_grad_samples(model, F.cross_entropy, x, y, opt.past_params()), strict=True):
            p.grad_sample = gs
        opt.step()
        opt.zero_grad()
        assert all(p.grad_sample is None for p in params)
    with pytest.raises(ValueError, match="saved_states\\[0\\] has 1 tensors"):
        pmlf_grad_samples(model, F.cross_entropy, x, y, [[s1[0]]])


# --------------------------------------------------------------------------------------------
# State: dtypes, state_dict resume
# --------------------------------------------------------------------------------------------

OPTIMIZERS = {
    "dpsgd": (O.DPSGD, dict(lr=0.1, momentum=0.9, weight_decay=1e-3, mode="psac")),
    "dpadam": (O.DPAdam, dict(lr=1e-2, weight_decay=0.01)),
    "dpadambc": (O.DPAdamBC, dict(lr=1e-3)),
    "dpadamstp": (O.DPAdamSTP, dict(lr=1e-2, eps1=0.1, mode="auto_s")),
    "macadam": (O.DPMacAdam, dict(lr=1e-2, h2=1.0)),
    "macadambc": (O.DPMacAdam, dict(lr=1e-2, bias_correction=True, bc_scale="b2", gamma_prime=1e-8)),
    "dp2": (O.DP2, dict(lr=0.1, lr2=0.01, s1=2, s2=2, preconditioner="adagrad")),
    "pmlf": (O.DPPMLF, dict(lr=0.1, k=2, filter="a72b0505")),
    "pmlf_k1": (O.DPPMLF, dict(lr=0.1, k=1, filter="a6b0501", mode="auto_v")),
}


def _build(name, params, seed):
    cls, kw = OPTIMIZERS[name]
    kw = dict(kw, noise_multiplier=0.9, expected_batch_size=4, seed=seed)
    kw.setdefault("max_grad_norm", 1.0)
    return cls(params, **kw)


def _feed(opt, params, t):
    k = opt._num_grad_sets
    attach(params, grad_samples(params, 4, t, k=k, dtype=torch.float32), as_list=opt._grad_sample_is_list)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_state_dict_resume_is_bit_identical(name, dtype):
    params = make_params(dtype)
    opt = _build(name, params, seed=1234)
    for p in params:
        assert all(v.dtype == (p.dtype if key == "past" else torch.float32) for key, v in opt.state[p].items())
    for t in range(1, 7):
        if t == 4:
            saved_params = [p.detach().clone() for p in params]
            saved = copy.deepcopy(opt.state_dict())
        _feed(opt, params, t)
        opt.step()
    resumed = [x.clone().requires_grad_() for x in saved_params]
    opt2 = _build(name, resumed, seed=None)
    opt2.load_state_dict(saved)
    assert opt2.seed == 1234 and opt2.steps_taken == 3
    for t in range(4, 7):
        _feed(opt2, resumed, t)
        opt2.step()
    for p, q in zip(params, resumed, strict=True):
        assert torch.equal(p, q)
        assert opt.state[p].keys() == opt2.state[q].keys()
        for key in opt.state[p]:
            assert opt2.state[q][key].dtype == opt.state[p][key].dtype
            assert torch.equal(opt.state[p][key], opt2.state[q][key]), key
    assert opt.state_dict()["dp"] == opt2.state_dict()["dp"]


def test_float64_state():
    params = make_params(F64)
    opt = O.DPMacAdam(params, lr=1e-3, noise_multiplier=1.0, expected_batch_size=4, seed=0)
    _feed(opt, params, 1)
    opt.step()
    assert all(v.dtype == F64 for p in params for v in opt.state[p].values())


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------

BASE = dict(noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4)


@pytest.mark.parametrize(
    "cls, kw, err, match",
    [
        (O.DPSGD, dict(lr=-1.0), ValueError, "lr must be"),
        (O.DPSGD, dict(lr=0.1, noise_multiplier=-1.0), ValueError, "noise_multiplier"),
        (O.DPSGD, dict(lr=0.1, max_grad_norm=0.0), ValueError, "max_grad_norm"),
        (O.DPSGD, dict(lr=0.1, expected_batch_size=0), ValueError, "expected_batch_size"),
        (O.DPSGD, dict(lr=0.1, expected_batch_size=4.0), ValueError, "expected_batch_size"),
        (O.DPSGD, dict(lr=0.1, mode="nope"), ValueError, "unknown clip mode"),
        (O.DPSGD, dict(lr=0.1, r=0.1), ValueError, "r is only used"),
        (O.DPSGD, dict(lr=0.1, mode="psac", r=0.0), ValueError, "r must be"),
        (O.DPSGD, dict(lr=0.1, momentum=1.0), ValueError, "momentum"),
        (O.DPSGD, dict(lr=0.1, seed=-1), ValueError, "seed"),
        (O.DPAdam, dict(betas=(0.9, 1.0)), ValueError, "betas\\[1\\]"),
        (O.DPAdam, dict(betas=(0.9,)), ValueError, "betas must be a pair"),
        (O.DPAdamBC, dict(gamma_prime=0.0), ValueError, "gamma_prime"),
        (O.DPAdamBC, dict(gamma_prime_rel=-0.1), ValueError, "gamma_prime_rel"),
        (O.DPAdamBC, dict(gamma_prime=1e-8, gamma_prime_rel=0.1), ValueError, "not both"),
        (O.DPMacAdam, dict(bias_correction=True, bc_scale="b2"), ValueError, "pass an absolute gamma_prime"),
        (O.DPAdamSTP, dict(eps1=0.0), ValueError, "eps1"),
        (O.DPAdamSTP, dict(), TypeError, "eps1"),  # required: no value suits every gradient scale
        (O.DPMacAdam, dict(betas=(0.0, 0.999)), ValueError, "betas\\[0\\] > 0"),
        (O.DPMacAdam, dict(h1=1e-3, h2=1e-6), ValueError, "h2"),
        (
            O.DPMacAdam,
            dict(h1=1.0),
            ValueError,
            "h2 must be >= h1, got h1=1, h2=0.0283932 \\(the default for d = 28\\)",
        ),
        (O.DPMacAdam, dict(h1=0.0), ValueError, "h1 must be"),
        (O.DPMacAdam, dict(bc_scale="b3"), ValueError, "bc_scale"),
        (O.DP2, dict(lr=0.1, s1=0, s2=2), ValueError, "s1 must be"),
        (O.DP2, dict(lr=0.1, s1=2, s2=2, preconditioner="adam"), ValueError, "preconditioner"),
        (O.DPPMLF, dict(lr=0.1, k=0), ValueError, "k \\(momentum length\\)"),
        (O.DPPMLF, dict(lr=0.1, filter="a5b5"), ValueError, "unknown PMLF filter preset"),
        (O.DPPMLF, dict(lr=0.1, filter=((-0.5,), (0.4,))), ValueError, "unit DC gain"),
        (O.DPPMLF, dict(lr=0.1, filter=((-1.5,), (-0.5,))), ValueError, "not stable"),
        # c_t <= 0: b0 = 0 (c_1 = 0, the first update 0/0); an FIR filter whose c_2 < 0; an IIR filter whose
        # c_t = 2, 3, 2.6, 1.32, 0.104, -0.3312 turns negative through its poles after every b_tau is summed
        (
            O.DPPMLF,
            dict(lr=0.1, filter=((-0.9,), (0.0, 0.1))),
            ValueError,
            "filter \\(a=\\[-0.9\\], b=\\[0.0, 0.1\\]\\).* c_t = 0 <= 0 at step t = 1 .*c_1 = b_0",
        ),
        (O.DPPMLF, dict(lr=0.1, filter=((), (0.5, -1.5, 2.0))), ValueError, "c_t = -1 <= 0 at step t = 2 "),
        (
            O.DPPMLF,
            dict(lr=0.1, filter=((-1.2, 0.8), (2.0, -1.4))),
            ValueError,
            "filter \\(a=\\[-1.2, 0.8\\], b=\\[2.0, -1.4\\]\\).* c_t = -0.3312 <= 0 at step t = 6 ",
        ),
    ],
)
def test_bad_hyper_parameters(cls, kw, err, match):
    with pytest.raises(err, match=match):
        cls(make_params(), **{**BASE, **kw})


def test_bad_grad_samples_and_noise():
    params = make_params(torch.float32)
    opt = O.DPAdam(params, lr=1e-3, **BASE)
    with pytest.raises(ValueError, match="parameter 0 \\(shape \\(3, 5\\)\\) has no grad_sample"):
        opt.step()
    attach(params, grad_samples(params, 4, 1))
    params[1].grad_sample = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="parameter 1 .* has shape \\(4, 8\\); expected \\[B, \\*\\(7,\\)\\]"):
        opt.step()
    params[1].grad_sample = torch.zeros(3, 7)
    with pytest.raises(ValueError, match="batch size 3 but parameter 0 has 4"):
        opt.step()
    params[1].grad_sample = [torch.zeros(4, 7)]
    with pytest.raises(TypeError, match="one tensor"):
        opt.step()
    params[1].grad_sample = torch.zeros(4, 7, dtype=torch.int64)
    with pytest.raises(TypeError, match="floating-point"):
        opt.step()
    attach(params, grad_samples(params, 4, 1))
    with pytest.raises(ValueError, match="noise must be a list of 3"):
        opt.step(noise=[torch.zeros(3, 5)])
    with pytest.raises(ValueError, match="noise\\[1\\] is \\(6,\\)"):
        opt.step(noise=[torch.zeros(3, 5), torch.zeros(6), torch.zeros(2, 1, 3)])
    assert opt.steps_taken == 0  # failed steps change nothing
    nan = grad_samples(params, 4, 1)
    nan[0][0][2, 0, 0] = float("nan")
    attach(params, nan)
    with pytest.raises(ValueError, match="non-finite per-sample gradient .* indices \\[2\\]"):
        opt.step()
    pmlf = O.DPPMLF(params, lr=0.1, k=2, **BASE)
    attach(params, grad_samples(params, 4, 1))
    with pytest.raises(TypeError, match="list of k=2 tensors"):
        pmlf.step()
    for p in params:
        p.grad_sample = [p.grad_sample, p.grad_sample[:3]]
    with pytest.raises(ValueError, match="grad_sample\\[1\\] has batch size 3 but parameter 0 has 4"):
        pmlf.step()
    with pytest.raises(ValueError, match="no 'dp' entry"):
        opt.load_state_dict(torch.optim.Adam(params).state_dict())


def test_empty_batch_added_group_and_closure():
    """An empty Poisson batch is a noise-only step; a group added later gets state; the closure's
    loss is returned."""
    p = torch.zeros(5, requires_grad=True)
    opt = O.DPSGD([p], lr=1.0, noise_multiplier=1.0, max_grad_norm=2.0, expected_batch_size=4, seed=8)
    p.grad_sample = torch.zeros(0, 5)
    assert opt.step(closure=lambda: torch.tensor(3.0)).item() == 3.0
    assert torch.equal(-p.detach(), 2.0 * opt.noise(1)[0] * 0.25)
    q = torch.zeros(2, 3, requires_grad=True)
    adam = O.DPAdam([p], lr=1e-2, **BASE)
    adam.add_param_group({"params": [q], "lr": 0.5})
    for x in (p, q):
        x.grad_sample = torch.ones(4, *x.shape)
    adam.step()
    assert adam.state[q]["exp_avg"].shape == q.shape and adam.param_groups[1]["betas"] == (0.9, 0.999)
