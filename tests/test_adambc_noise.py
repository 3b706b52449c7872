"""DP-AdamBC's noise variance under every noise mode, its relative floor γ', and DP-MacAdam's refusal
of correlated noise (dpkernels issue 16).

- ``noise_variance`` of the mechanisms equals the squared row norms of the dense ``noising_matrix``;
- DP-AdamBC subtracts ``Φ̄_t = Σ_k (1−β2)β2^{t−k}Φ_k/(1−β2^t)``, ``Φ_k = (σC/B)²‖row_k(C⁻¹)‖²`` (Ganesh et
  al. App. A, corrected), per param group, on every backend; with independent noise ``Φ̄_t = Φ``
  exactly; ``Φ̄`` is saved in the state_dict (the trajectories: test_optim_checkpoint.py ``adam-bc-blt``);
- the default γ' is ``0.1·Φ̄_t``.
"""

import pytest
import torch

import dpkernels
from dpkernels import BandedNoise, BLTNoise
from dpkernels import optim as O

F64 = torch.float64
B, SIGMA, C, LR, STEPS = 4, 0.8, 1.0, 1e-2, 6
SHAPES = [(3,), (2, 2)]
BETAS = [(0.9, 0.999), (0.8, 0.9)]  # one param group each: Φ̄ depends on β2


def _mechanism(kind: str, seed: int = 5, start_step: int = 1, std: float = 1.0):
    if kind == "blt":
        return BLTNoise([0.9, 0.5], [-0.3, -0.1], std=std, seed=seed, start_step=start_step, backend="reference")
    if kind == "banded":
        return BandedNoise([1.0, -0.4, 0.2], std=std, seed=seed, start_step=start_step, backend="reference")
    if kind == "banded-params":  # not Toeplitz: the row norms of P⁻¹ times the column norms
        p = torch.tensor([[1.0, -0.5, 0.1], [2.0, 0.3, 0.2], [1.5, -0.2, 0.3], [1.0, 0.4, 0.0], [0.7, 0.0, 0.0]])
        return BandedNoise(params=p, std=std, seed=seed, start_step=start_step, backend="reference")
    return BandedNoise([3.0], std=std, seed=seed, start_step=start_step, backend="reference")  # b = 1: plain noise


@pytest.mark.parametrize("kind", ["blt", "banded", "banded-params", "banded-1"])
def test_noise_variance_is_the_row_norm_of_the_noising_matrix(kind):
    n = 5
    mech = _mechanism(kind, start_step=2, std=1.5)
    want = 1.5**2 * (mech.noising_matrix(n) ** 2).sum(1)
    got = torch.tensor([mech.noise_variance(2 + i) for i in range(n)], dtype=F64)
    torch.testing.assert_close(got, want, rtol=1e-14, atol=0)
    if kind != "banded-1":
        assert (want - want[0]).abs().max() > 0.05  # correlated: the rows differ
    assert mech.noise_variance(3) == got[1]  # an earlier step restarts the cache
    assert mech.next_step == 2  # pure arithmetic: the random state did not move
    with pytest.raises(ValueError, match="step"):
        mech.noise_variance(1)


def _grads(t: int) -> list[torch.Tensor]:
    """Per-sample gradients of step t, all of norm < C (nothing is clipped: S = Σ g_i)."""
    gen = torch.Generator().manual_seed(40 + t)
    gs = [0.15 * torch.randn((B, *s), generator=gen) for s in SHAPES]
    assert torch.cat([g.flatten(1) for g in gs], 1).norm(dim=1).max() < C
    return gs


def _hand_phi_bar(r: torch.Tensor, beta2: float, t: int) -> float:
    """``Σ_{k≤t} (1−β2)β2^{t−k}Φ_k/(1−β2^t)`` in float64 from the variance ratios ``r``."""
    phi = (SIGMA * C / B) ** 2 * r[:t]
    w = (1 - beta2) * beta2 ** torch.arange(t - 1, -1, -1, dtype=F64)
    return float((w * phi).sum() / (1 - beta2**t))


def _literal(params, zs, r, rho=0.1):
    """DP-AdamBC in float64, literally, with the noise ``σC·z_t`` and the ratios ``r``."""
    theta = [p.detach().to(F64).clone() for p in params]
    m = [torch.zeros_like(x) for x in theta]
    v = [torch.zeros_like(x) for x in theta]
    for t in range(1, STEPS + 1):
        for i, (g, z) in enumerate(zip(_grads(t), zs[t - 1], strict=True)):
            b1, b2 = BETAS[i]
            gt = (g.to(F64).sum(0) + SIGMA * C * z.to(F64)) / B
            m[i] = b1 * m[i] + (1 - b1) * gt
            v[i] = b2 * v[i] + (1 - b2) * gt**2
            m_hat, v_hat = m[i] / (1 - b1**t), v[i] / (1 - b2**t)
            phi = _hand_phi_bar(r, b2, t)
            theta[i] = theta[i] - LR * m_hat / torch.clamp(v_hat - phi, min=rho * phi).sqrt()
    return theta


@pytest.mark.parametrize("kind", ["blt", "banded"])
def test_update_subtracts_the_averaged_correlated_variance(backend_device, kind):
    backend, device = backend_device
    gen = torch.Generator().manual_seed(3)
    init = [torch.randn(s, generator=gen) for s in SHAPES]
    params = [x.clone().to(device) for x in init]
    groups = [dict(params=[p], betas=betas) for p, betas in zip(params, BETAS, strict=True)]
    opt = O.DPAdamBC(groups, lr=LR, noise_multiplier=SIGMA, max_grad_norm=C, expected_batch_size=B,
                     correlated_noise=_mechanism(kind), backend=backend)  # fmt: skip
    twin = _mechanism(kind)  # the same z_t, drawn outside the optimizer
    zs = [twin.noise(SHAPES, t) for t in range(1, STEPS + 1)]
    r = (_mechanism(kind).noising_matrix(STEPS) ** 2).sum(1)
    for t in range(1, STEPS + 1):
        for p, g in zip(params, _grads(t), strict=True):
            p.grad_sample = g.to(device)
        opt.step()
        want = [_hand_phi_bar(r, b2, t) for _, b2 in BETAS]
        torch.testing.assert_close(torch.tensor(opt.phi_bar, dtype=F64), torch.tensor(want, dtype=F64),
                                   rtol=1e-13, atol=0)  # fmt: skip
    want = _literal(init, zs, r)
    for got, w in zip(params, want, strict=True):
        torch.testing.assert_close(got.cpu().to(F64), w, rtol=1e-4, atol=1e-5)
    # The check can fail: the independent-noise correction Φ gives another trajectory.
    wrong = _literal(init, zs, torch.ones(STEPS, dtype=F64))
    assert max((a - b).abs().max() for a, b in zip(wrong, want, strict=True)) > 1e-3


def _plain(sigma=SIGMA, **kw):
    gen = torch.Generator().manual_seed(1)
    params = [torch.randn(s, generator=gen, dtype=F64) for s in SHAPES]
    groups = [dict(params=[p], betas=betas) for p, betas in zip(params, BETAS, strict=True)]
    opt = O.DPAdamBC(groups, lr=LR, noise_multiplier=sigma, max_grad_norm=C, expected_batch_size=B, seed=9,
                     backend="reference", **kw)  # fmt: skip
    return params, opt


def _step(params, opt, t):
    for p, g in zip(params, _grads(t), strict=True):
        p.grad_sample = g.to(F64)
    opt.step()


def test_independent_noise_subtracts_phi_exactly_and_follows_set_step_params():
    params, opt = _plain()
    assert opt.phi_bar == [0.0, 0.0]
    for t in (1, 2, 3):
        _step(params, opt, t)
        assert opt.phi_bar == [opt.phi, opt.phi]  # bit for bit: the correction of dpkernels ≤ 0.2
    old = opt.phi
    opt.set_step_params(2 * SIGMA, C, B)
    _step(params, opt, 4)
    new = opt.phi
    assert new == 4 * old
    for (_, b2), bar in zip(BETAS, opt.phi_bar, strict=True):
        w = (1 - b2) / (1 - b2**4)  # the weight of step 4 in v̂_4
        assert bar == pytest.approx((1 - w) * old + w * new, rel=1e-14)
        assert old < bar < new


def test_phi_bar_is_saved_and_checked():
    params, opt = _plain()
    for t in (1, 2):
        _step(params, opt, t)
    sd = opt.state_dict()
    assert sd["dp"]["phi_bar"] == opt.phi_bar
    other_params, other = _plain(sigma=0.1)  # another noise level: Φ̄ must come from the checkpoint
    other.load_state_dict(sd)
    assert other.phi_bar == opt.phi_bar
    for bad in (["x", 0.1], [0.1, 0.1, 0.1], [-1.0]):
        sd["dp"]["phi_bar"] = bad
        with pytest.raises(ValueError, match="phi_bar"):
            other.load_state_dict(sd)
    assert other.phi_bar == opt.phi_bar  # a refused state_dict changes nothing
    # A checkpoint of an earlier version (no phi_bar) continues as that version did: Φ of the loader.
    del sd["dp"]["phi_bar"]
    other.load_state_dict(sd)
    assert other.phi_bar == [other.phi, other.phi] and other.phi != opt.phi
    blt = O.DPAdamBC([torch.zeros(3)], noise_multiplier=SIGMA, max_grad_norm=C, expected_batch_size=B,
                     correlated_noise=_mechanism("blt"))  # fmt: skip
    old = blt.state_dict()
    del old["dp"]["phi_bar"]
    with pytest.raises(ValueError, match="phi_bar is missing"):
        blt.load_state_dict(old)


def test_default_gamma_prime_is_relative_to_phi():
    p = torch.zeros(4, dtype=F64, requires_grad=True)
    sigma, Bs = 0.5, 2
    opt = O.DPAdamBC([p], lr=LR, noise_multiplier=sigma, max_grad_norm=C, expected_batch_size=Bs, backend="reference")
    g_priv = torch.tensor([1.0, 0.1, -0.2, 0.3], dtype=F64)
    p.grad_sample = torch.zeros(Bs, 4, dtype=F64)
    opt.step(noise=[Bs * g_priv])  # S = 0, so g̃ = ν/B; at t = 1, m̂ = g̃ and v̂ = g̃²
    floor = 0.1 * opt.phi
    floored = g_priv**2 - opt.phi < floor
    assert floored.tolist() == [False, True, True, False]
    want = -LR * g_priv / torch.where(floored, torch.full_like(g_priv, floor), g_priv**2 - opt.phi).sqrt()
    torch.testing.assert_close(p.detach(), want, rtol=1e-14, atol=0)
    # With σ = 0 there is no variance to be relative to: a zero coordinate must not become 0/0.
    q = torch.zeros(2, dtype=F64, requires_grad=True)
    quiet = O.DPAdamBC([q], lr=LR, noise_multiplier=0.0, max_grad_norm=C, expected_batch_size=2, backend="reference")
    q.grad_sample = torch.tensor([[0.0, 0.5], [0.0, 0.5]], dtype=F64)
    quiet.step()
    assert q.detach().tolist() == [0.0, -LR]


def test_macadam_bc_default_floor_is_relative():
    def run(**kw):
        gen = torch.Generator().manual_seed(2)
        p = torch.zeros(6, dtype=F64, requires_grad=True)
        opt = O.DPMacAdam(
            [p], lr=LR, noise_multiplier=SIGMA, expected_batch_size=B, bias_correction=True, backend="reference", **kw
        )
        p.grad_sample = 0.1 * torch.randn(B, 6, generator=gen, dtype=F64)
        opt.step(noise=[SIGMA * torch.randn(6, generator=gen, dtype=F64)])
        return p.detach()

    phi = (SIGMA * 1.0 / B) ** 2  # C = 1 (MacAdam's unit clip), bc_scale="paper"
    default = run()
    assert torch.equal(default, run(gamma_prime=0.1 * phi))
    assert torch.equal(default, run(gamma_prime_rel=0.1))
    assert not torch.allclose(default, run(gamma_prime=1e-8))  # some coordinate is floored


def test_macadam_refuses_correlated_noise():
    p = torch.zeros(3, requires_grad=True)
    with pytest.raises(ValueError, match="DPMacAdam does not support correlated_noise.*independent across steps"):
        O.DPMacAdam([p], noise_multiplier=1.0, expected_batch_size=4, correlated_noise=_mechanism("blt"))
    assert dpkernels.optim.DPAdamBC([p], noise_multiplier=1.0, expected_batch_size=4, max_grad_norm=1.0,
                                    correlated_noise=_mechanism("blt")).correlated_noise is not None  # fmt: skip
