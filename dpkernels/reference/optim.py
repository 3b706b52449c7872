"""Pure-PyTorch reference of the fused optimizer-step ops: the semantics the kernels must match.

The optimizers (:mod:`dpkernels.optim`) run one clip pass and then, per parameter group, one
*family op*: ``sgd_step_``, ``dp2_step_``, ``adam_step_`` or ``macadam_step_``. The functions here
are the ``reference`` backend's implementation of those four ops, with the signatures of the
native ops (csrc/ops.cpp) and the state layout every backend shares (docs/ALGORITHMS.md,
"Optimizers"). Shared arguments:

- ``params``: ``L`` parameters, updated in place (the update is computed in the state dtype and
  rounded once into the parameter); ``sums``: the clipped sums ``S``;
- ``state``: the family's buffers, buffer-major (``state[k·L + i]``), updated in place; fp32, or
  fp64 for fp64 parameters;
- ``noise``: ``L`` pre-drawn ``ν`` on the sum, or ``[]``: then ``ν = noise_std · g·y`` with ``y`` the
  noise filter (``noise_coeffs`` = ``[a, g, c.., d.., e.., f..]`` over the fp32 buffers
  ``noise_state``; ``[1, 1]`` is independent noise) of the Philox normal ``z`` of global element
  ``offset + index`` (key ``seed``, counter ``(step, stream)``). Nothing is drawn with no noise
  buffers and ``noise_std = 0``;
- ``hyper``: the family's scalars, named in :mod:`dpkernels._kernel_args` and read here by name.

Every product and sum is written in the order of the kernels' element math
(csrc/include/dpkernels/optim_math.h), in the state dtype: for fp32 state the fused kernels agree
to rounding, and for the private gradient ``(S + ν)·(1/B)`` bit for bit with ``privatize``.

Papers (titles in docs/ALGORITHMS.md, "Papers"): DP-SGD (Abadi et al. 2016, arXiv:1607.00133);
DP-PSAC (arXiv:2212.00328); DP-AdamBC (Tang et al., arXiv:2312.14334); scale-then-privatize ("On
Design Principles for Private Adaptive Optimizers", arXiv:2507.01129); DP-MacAdam
(arXiv:2606.05435); DP² (arXiv:2212.00309); DP-PMLF (arXiv:2511.08841).

Imports: torch, and below it only :mod:`dpkernels.reference` and the leaf spec
:mod:`dpkernels._kernel_args` (which imports nothing from dpkernels).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .._kernel_args import ADAM, DP2, FILTER, MACADAM, SGD
from . import filter as ref_filter
from .noise import standard_normal

__all__ = [
    "sgd_step_",
    "dp2_step_",
    "adam_step_",
    "macadam_step_",
    "dp2_refreshed_v",
    "PMLF_PRESETS",
    "macadam_kappa",
    "pmlf_momentum_coeffs",
    "pmlf_bias_correction",
    "pmlf_next_correction",
]


def state_dtype(p: Tensor) -> torch.dtype:
    """fp64 state for fp64 parameters, fp32 otherwise."""
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def _noise(params, noise, noise_state, noise_coeffs, noise_std, seed, step, stream, offset) -> list[Tensor]:
    """``ν`` per parameter, in its state dtype (the shared noise stage of every family op)."""
    dts = [state_dtype(p) for p in params]
    if noise:
        return [nu.to(dt).view(p.shape) for nu, p, dt in zip(noise, params, dts, strict=True)]
    co = FILTER.split(list(noise_coeffs))
    K, L = len(co["c"]), len(params)
    if noise_std == 0 and K == 0:
        return [torch.zeros_like(p, dtype=dt) for p, dt in zip(params, dts, strict=True)]
    numels = [p.numel() for p in params]
    z = standard_normal(sum(numels), seed=int(seed) & (2**64 - 1), step=step, stream=stream, offset=offset,
                        device=params[0].device)  # fmt: skip
    parts = [part.view(p.shape) for part, p in zip(torch.split(z, numels), params, strict=True)]
    y = ref_filter.linear_filter([noise_state[k * L : (k + 1) * L] for k in range(K)], inputs=parts, **co)
    return [noise_std * yy.to(dt) for yy, dt in zip(y, dts, strict=True)]


def _write(p: Tensor, new: Tensor) -> None:
    """Round the updated parameter (computed in the state dtype) once into ``p``."""
    p.copy_(new.to(p.dtype))


def sgd_step_(params, sums, state, dir_coeffs, past, noise, noise_state, noise_coeffs, noise_std, seed, step, stream,
              offset, hyper) -> None:  # fmt: skip
    """DP-SGD / PSAC / PMLF: ``x = (S + ν)·(1/B) (+ λθ)``, ``d = g·y`` of the direction filter
    (``dir_coeffs`` over the ``K`` buffers ``state``: heavy-ball momentum, PMLF's rings), ``past[i] ←
    θ`` (old value) when given, ``θ ← θ − η d``."""
    h = SGD.unpack(hyper)
    nus = _noise(params, noise, noise_state, noise_coeffs, noise_std, seed, step, stream, offset)
    co = FILTER.split(list(dir_coeffs))
    K, L = len(co["c"]), len(params)
    for i, (p, S, nu) in enumerate(zip(params, sums, nus, strict=True)):
        dt = nu.dtype
        if past:
            past[i].copy_(p)
        theta = p.to(dt)
        x = (S.to(dt) + nu) * h["inv_b"]
        if h["weight_decay"]:
            x = x + h["weight_decay"] * theta
        bufs = [[state[k * L + i]] for k in range(K)]
        d = ref_filter.linear_filter(bufs, inputs=[x], math_dtype=dt, **co)[0]
        _write(p, theta - h["lr"] * d)


def dp2_step_(params, sums, state, noise, noise_state, noise_coeffs, noise_std, seed, step, stream, offset,
              hyper) -> None:  # fmt: skip
    """DP²: ``state = [G, inv_d]``. SGD phase: ``g̃ = (S + ν)/B``, ``G ← G + g̃``; adaptive phase:
    ``g̃ = (S·inv_d + ν)/B``; then ``θ ← θ − η g̃``."""
    h = DP2.unpack(hyper)
    nus = _noise(params, noise, noise_state, noise_coeffs, noise_std, seed, step, stream, offset)
    L = len(params)
    for i, (p, S, nu) in enumerate(zip(params, sums, nus, strict=True)):
        G, inv_d = state[i], state[L + i]
        if h["phase"] == 1:
            g = (S.to(nu.dtype) * inv_d + nu) * h["inv_b"]
        else:
            g = (S.to(nu.dtype) + nu) * h["inv_b"]
            G.copy_(G + g)
        _write(p, p.to(g.dtype) - h["lr"] * g)


def _moments(h: dict, g: Tensor, m: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """``m ← β1 m + (1−β1) g``, ``v ← β2 v + (1−β2) g²`` in place; returns ``(m̂, v̂)``."""
    m.copy_(h["beta1"] * m + h["one_minus_beta1"] * g)
    v.copy_(h["beta2"] * v + h["one_minus_beta2"] * g * g)
    return m / h["bias1"], v / h["bias2"]


def _floor_sqrt(r: Tensor, gamma: float) -> Tensor:
    """``√max(r, γ')`` (a NaN stays NaN, as in the kernels)."""
    return torch.clamp(r, min=gamma).sqrt()


def adam_step_(params, sums, state, noise, noise_state, noise_coeffs, noise_std, seed, step, stream, offset,
               hyper) -> None:  # fmt: skip
    """DP-Adam(W) / AdamBC / scale-then-privatize: ``state = [m, v]`` (+ ``scale`` for STP).

    STP un-scales the noise by ``√v̂_{t−1} + ε₁`` and writes the next step's clip scale
    ``1/(√v̂_t + ε₁)``. ``g̃ = (S + ν)/B``; Adam moments; ``θ ← θ(1 − ηλ) − η m̂/denom`` with denom
    ``√v̂ + ε`` (BC: ``√max(v̂ − Φ, γ')``)."""
    h = ADAM.unpack(hyper)
    nus = _noise(params, noise, noise_state, noise_coeffs, noise_std, seed, step, stream, offset)
    L, stp = len(params), h["variant"] == 2
    for i, (p, S, nu) in enumerate(zip(params, sums, nus, strict=True)):
        m, v = state[i], state[L + i]
        if stp:
            v_hat_prev = v / h["bias2_prev"] if h["bias2_prev"] else torch.zeros_like(v)
            nu = (v_hat_prev.sqrt() + h["eps1"]) * nu
        m_hat, v_hat = _moments(h, (S.to(nu.dtype) + nu) * h["inv_b"], m, v)
        bc = h["variant"] == 1
        denom = _floor_sqrt(v_hat - h["phi"], h["gamma"]) if bc else v_hat.sqrt() + h["eps"]
        if stp:
            state[2 * L + i].copy_(1 / (v_hat.sqrt() + h["eps1"]))
        theta = p.to(m.dtype)
        if h["decay"] != 1:
            theta = theta * h["decay"]
        _write(p, theta - h["lr"] * m_hat / denom)


def macadam_step_(params, sums, state, noise, noise_state, noise_coeffs, noise_std, seed, step, stream, offset,
                  hyper) -> Tensor:  # fmt: skip
    """DP-MacAdam(-BC): ``state = [m, v, s, b_u, inv_bu, shift]`` with ``b_{t−1} = b_u·bscale`` and
    ``shift = m̂_{t−1}``. Returns ``Σ√ŝ`` over the updated elements (float64 scalar tensor; 0 when
    ``κ = 0``), from which the caller forms the next ``bscale = √(Σ√ŝ)``.

    ``g̃ = ((S − Σc·m̂_{t−1}) + b ν)/B + m̂_{t−1}``; Adam moments and update (BC: denom
    ``√max(v̂ − Φ, γ')``, ``Φ = (σC/B)²`` or ``b²(σC/B)²``); ``s ← β1 s + (1−β1)(g̃ − m̂_t)²``; with
    ``κ ≠ 0``: ``ŝ = clamp(s/κ − b²(σC/B)², h1, h2)``, ``b_u = ŝ^{1/4}``, ``inv_bu = 1/b_u``;
    ``shift ← m̂_t``."""
    h = MACADAM.unpack(hyper)
    nus = _noise(params, noise, noise_state, noise_coeffs, noise_std, seed, step, stream, offset)
    L = len(params)
    total = torch.zeros((), dtype=torch.float64, device=params[0].device)
    for i, (p, S, nu) in enumerate(zip(params, sums, nus, strict=True)):
        m, v, s, b_u, inv_bu, shift = (state[k * L + i] for k in range(6))
        b, mh = b_u * h["bscale"], shift.clone()
        g = ((S.to(nu.dtype) - h["c_total"] * mh) + b * nu) * h["inv_b"] + mh
        m_hat, v_hat = _moments(h, g, m, v)
        if h["bc"] == 0:
            denom = v_hat.sqrt() + h["eps"]
        else:
            phi = h["noise_var"] if h["bc"] == 1 else b * b * h["noise_var"]
            denom = _floor_sqrt(v_hat - phi, h["gamma"])
        _write(p, p.to(m.dtype) - h["lr"] * m_hat / denom)
        s.copy_(h["beta1"] * s + h["one_minus_beta1"] * ((g - m_hat) * (g - m_hat)))
        if h["kappa"] != 0:
            s_hat = torch.clamp(s / h["kappa"] - b * b * h["noise_var"], min=h["h1"], max=h["h2"])
            root = s_hat.sqrt()
            b_u.copy_(root.sqrt())
            inv_bu.copy_(1 / b_u)
            total = total + root.double().sum()
        shift.copy_(m_hat)
    return total


# ============================================================================================
# Paper math used by the optimizers outside the element pass
# ============================================================================================


def macadam_kappa(t: int, beta1: float) -> float:
    """``κ_t = 2(β1 − β1^t)/(1 + β1)``, DP-MacAdam's bias correction of ``s_t`` (DP-MacAdam, arXiv:2606.05435);
    ``κ_1 = 0``."""
    return 2.0 * (beta1 - beta1**t) / (1.0 + beta1)


def dp2_refreshed_v(v: Tensor, G: Tensor, s1: int, beta: float, preconditioner: str) -> Tensor:
    """DP²'s preconditioner refresh: ``βv + (1−β)(G/s1)²`` (RMSProp) or ``v + (G/s1)²`` (AdaGrad)."""
    G2 = (G / s1) ** 2
    return beta * v + (1 - beta) * G2 if preconditioner == "rmsprop" else v + G2


#: Filter presets of the authors' code (github.com/Philosophy3290/DP-PMLF, ``coefs/*.csv``):
#: ``(a, b)`` with ``a = [a_1..a_na]`` (``a_0 = 1`` implicit) and ``b = [b_0..b_nb]``, in the
#: convention ``m_t = −Σ a_τ m_{t−τ} + Σ b_τ v̄_{t−τ}``; every preset has ``Σ b − Σ a = 1``.
PMLF_PRESETS: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "a9b1": ((-0.9,), (0.1,)),
    "a6b4": ((-0.6,), (0.4,)),
    "a6b0202": ((-0.6,), (0.2, 0.2)),
    "a6b0501": ((-0.6,), (0.5, -0.1)),
    "a9b0505": ((-0.9,), (0.05, 0.05)),
    "a9b1505": ((-0.9,), (0.15, -0.05)),
    "a72b0505": ((-0.7, -0.2), (0.05, 0.05)),
}


def pmlf_momentum_coeffs(k: int, beta: float) -> list[float]:
    """``α_j = β^j / c_β``, ``c_β = Σ_{j<k} β^j``: the weight of the gradient at ``x_{t−j}``."""
    c_beta = sum(beta**j for j in range(k))
    return [beta**j / c_beta for j in range(k)]


def pmlf_next_correction(a: Sequence[float], b: Sequence[float], c_prev: Sequence[float], t: int) -> float:
    """``c_t = −Σ_{τ=1}^{na} a_τ c_{t−τ} + Σ_{τ=0}^{min(t, nb)} b_τ`` (paper index ``t ≥ 0``) from
    ``c_prev = [c_{t−1}, c_{t−2}, …]``, newest first (``c_{<0} = 0``: fewer entries than ``na``)."""
    return -sum(a_tau * c for a_tau, c in zip(a, c_prev, strict=False)) + sum(b[: t + 1])


def pmlf_bias_correction(a: Sequence[float], b: Sequence[float], steps: int) -> list[float]:
    """``c_0..c_{steps−1}``: the filter run on the constant input 1 from zero initial state
    (:func:`pmlf_next_correction`)."""
    c: list[float] = []
    for t in range(steps):
        c.append(pmlf_next_correction(a, b, c[::-1], t))
    return c
