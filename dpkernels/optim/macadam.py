"""The macadam family (op ``macadam_step_``): DP-MacAdam and DP-MacAdamBC."""

from __future__ import annotations

import dataclasses
import math

from torch import Tensor

from .._kernel_args import MACADAM
from ..reference.optim import macadam_kappa
from ._base import GAMMA_PRIME_REL, DPOptimizer, _check_number, bias, check_betas, gamma_prime_defaults, gamma_prime_of

__all__ = ["DPMacAdam", "macadam_h_defaults"]

#: DP-MacAdam's MNIST setting (arXiv:2606.05435, Sec. IV): ``h1, h2`` for its ``d = 795,010``
#: (784-1000-10 MLP). The defaults keep ``d·h`` at these values (:func:`macadam_h_defaults`).
PAPER_D, PAPER_H1, PAPER_H2 = 795_010, 1e-9, 1e-6


def macadam_h_defaults(d: int) -> tuple[float, float]:
    """The default clamp ``(h1, h2)`` of ``ŝ`` for a model of ``d`` parameters:
    ``h = h_paper · d_paper / d`` (``1e-9``, ``1e-6`` at the paper's ``d = 795,010``).

    Why ``d·h`` is the invariant: ``b_j² = √ŝ_j · Σ_k √ŝ_k``, so with ``ŝ ∈ [h1, h2]`` every semi-axis
    of the clip ellipsoid ``‖(g − m̂)/b‖ ≤ 1`` lies in ``[√(d·h1), √(d·h2)]`` (equality for a uniform
    ``ŝ`` at a bound): the clamp bounds the clip radius in gradient units to
    ``[C√(d·h1), C√(d·h2)] = C·[0.028, 0.89]`` at the paper's values, and per-sample gradient norms,
    the quantity clipped, do not grow with ``d``."""
    if isinstance(d, bool) or not isinstance(d, int) or d < 1:
        raise ValueError(f"d (number of parameters) must be an int >= 1, got {d!r}")
    return PAPER_H1 * PAPER_D / d, PAPER_H2 * PAPER_D / d


class DPMacAdam(DPOptimizer):
    """DP-MacAdam (Tasnim, Sankar, Kosut 2026, arXiv:2606.05435, Algorithm 1);
    ``bias_correction=True`` gives DP-MacAdamBC, its bias-corrected variant.

    Step ``t`` (``m̂_{t−1} = m_{t−1}/(1−β1^{t−1})``, ``m̂_0 = 0``; ``b_0 = b0·1``, default ``1/d``
    with ``d`` the number of parameters of the optimizer)::

        w_i  = (g_i − m̂_{t−1}) / b_{t−1};   c_i = f(‖w_i‖)       (unit clip: C = max_grad_norm = 1)
        g̃   = b_{t−1} ⊙ (Σ_i c_i w_i + σ·C·z_t)/B + m̂_{t−1}
        m, v, m̂_t, v̂_t as Adam;   θ ← θ − η m̂_t/(√v̂_t + γ)            (γ = eps, outside the sqrt)
        BC:  θ ← θ − η m̂_t / sqrt(max(v̂_t − Φ, γ'))
        u_t = (g̃ − m̂_t)²;   s_t = β1 s_{t−1} + (1−β1) u_t;   κ_t = 2(β1 − β1^t)/(1+β1)
        ŝ_t = clamp(s_t/κ_t − b_{t−1}²σ²C²/B², h1, h2)
        b_t = ŝ_t^{1/4} · (Σ_j √ŝ_{t,j})^{1/2}        Σ_j over ALL parameter tensors (global)

    The map-back is computed as ``g̃ = (Σ c_i g_i − (Σ c_i) m̂_{t−1} + b_{t−1} ⊙ ν)/B + m̂_{t−1}``
    (exact algebra: ``Σ c_i w_i = (Σ c_i g_i − (Σ c_i) m̂)/b``).

    Decisions (docs/ALGORITHMS.md): at ``t = 1`` ``κ_1 = 0`` and ``s_1 = 0`` give 0/0, so while
    ``κ_t = 0`` the ``ŝ``/``b`` update is skipped (``s_1`` is still updated, ``b_1 = b_0``).
    ``bc_scale="paper"`` uses ``Φ = (σC/B)²`` as the paper writes it (C = 1: ``(σ/B)²``);
    ``bc_scale="b2"`` uses the per-coordinate noise variance ``Φ = b_{t−1}²σ²C²/B²`` of ``g̃``.
    ``max_grad_norm`` is the clip threshold in the transformed space: 1 in the paper (the default);
    another C scales the clip and noise together (it is equivalent to ``b → C·b``).
    Defaults: β = (0.9, 0.999), γ = 1e-8 and ``h1, h2`` = :func:`macadam_h_defaults` ``(d)`` =
    ``(7.9501e-4/d, 0.79501/d)``: the paper's MNIST values (1e-9, 1e-6 at its ``d = 795,010``)
    scaled so that the clip radius they allow in gradient units, ``C·[√(d·h1), √(d·h2)]``, does not
    change with ``d``. A given ``h1``/``h2`` is used as is (the paper tunes them per dataset: 5e-5,
    1.0 on CIFAR-10, ``d = 582,346``). γ' (BC only) as :class:`DPAdamBC`: by default relative,
    ``γ' = ρ·Φ`` with ``ρ = gamma_prime_rel = 0.1`` (the denominator never below ``√ρ`` noise
    standard deviations); ``gamma_prime=`` sets an absolute one. With ``bc_scale="b2"`` ``Φ`` is per
    coordinate and the kernels' floor is one scalar, so ``gamma_prime=`` is required there.

    **No correlated noise.** ``κ_t`` and the subtraction ``b²σ²C²/B²`` in ``ŝ_t`` are derived for
    noise independent across steps (arXiv:2606.05435 App. A: ``E[s_t]`` sums the variances of
    ``u_k = (g̃_k − m̂_k)²``, with ``m̂_k`` an average of independent past noises). Under DP-MF
    noise ``(C⁻¹Z)_k`` the noise in ``g̃_k − m̂_k`` has cross-step covariance terms that neither
    corrects, so ``correlated_noise=`` is refused (ValueError) rather than run with a wrong ŝ.

    State: ``exp_avg``, ``exp_avg_sq``, ``s``; ``b = b_unnorm·bscale`` split into the per-element
    ``b_unnorm = ŝ^{1/4}`` and the global ``bscale = √(Σ√ŝ)`` (``state_dict()["dp"]``; the step
    accumulates the sum in its pass and applies it in the next step, so no extra pass); and the next
    clip pass's inputs ``inv_b_unnorm = 1/b_unnorm`` and ``shift = m̂_t``. :meth:`b` returns ``b``.
    """

    _STATE_KEYS = ("exp_avg", "exp_avg_sq", "s", "b_unnorm", "inv_b_unnorm", "shift")
    _PRIVACY_DEFAULTS = {"max_grad_norm": 1.0}
    _NO_CORRELATED_NOISE = (
        "its kappa_t and the noise-variance subtraction b^2 sigma^2 C^2 / B^2 in s_hat assume noise independent "
        "across steps, and under correlated (matrix-factorisation) noise the EMA of (g~ - m_hat)^2 has cross-step "
        "covariance terms that neither corrects; use DPAdam, DPAdamBC or DPAdamSTP with correlated noise"
    )

    def __init__(self, params, lr=1e-3, *, betas=(0.9, 0.999), eps=1e-8, h1=None, h2=None, b0=None,
                 bias_correction=False, gamma_prime=None, gamma_prime_rel=None, bc_scale="paper",
                 **privacy):  # fmt: skip
        betas = check_betas(betas)
        if betas[0] == 0.0:
            raise ValueError("DPMacAdam needs betas[0] > 0: with beta1 = 0, kappa_t = 0 for every t")
        _check_number("eps", eps, low=0.0)
        floor = gamma_prime_defaults(gamma_prime, gamma_prime_rel, GAMMA_PRIME_REL)
        if bias_correction and bc_scale == "b2" and gamma_prime is None:
            raise ValueError(
                "bc_scale='b2' subtracts a per-coordinate noise variance b^2 (sigma C / B)^2, which a scalar floor "
                "relative to it cannot follow: pass an absolute gamma_prime="
            )
        if b0 is not None:
            _check_number("b0", b0, low=0.0, low_open=True)
        if bc_scale not in ("paper", "b2"):
            raise ValueError(f"bc_scale must be 'paper' or 'b2', got {bc_scale!r}")
        self.b0 = b0
        self.bias_correction = bool(bias_correction)
        self.bc_scale = bc_scale
        self.bscale = 1.0  # b = b_unnorm · bscale; bscale = √(Σ√ŝ) of the last update
        defaults = dict(lr=lr, betas=betas, eps=eps, h1=h1, h2=h2, **floor)
        super().__init__(params, defaults, privacy)
        # None: the d-scaled default, d = the optimizer's parameters at construction (as b0's 1/d).
        self._d = sum(p.numel() for p in self._params())
        self._default_h = dict(zip(("h1", "h2"), macadam_h_defaults(self._d), strict=True))
        for g in self.param_groups:
            self._resolve_h(g)

    @classmethod
    def _whole_model_defaults(cls, kwargs, numel):
        h1, h2 = macadam_h_defaults(numel)
        given = {k: v for k, v in kwargs.items() if v is not None}
        return {"h1": h1, "h2": h2, "b0": 1.0 / numel, **given}

    def _resolve_h(self, group: dict) -> None:
        """Set a group's ``h1``/``h2`` of ``None`` to the default for ``d``; check ``0 < h1 <= h2``."""
        given = {k: group.get(k) is not None for k in self._default_h}
        for k, default in self._default_h.items():
            group[k] = _check_number(k, group[k], low=0.0, low_open=True) if given[k] else default
        if group["h2"] < group["h1"]:
            note = {k: "" if given[k] else f" (the default for d = {self._d})" for k in given}
            raise ValueError(f"h2 must be >= h1, got h1={group['h1']:g}{note['h1']}, h2={group['h2']:g}{note['h2']}")

    def add_param_group(self, param_group: dict) -> None:
        if hasattr(self, "_default_h"):  # a later group; torch's constructor's are resolved by __init__
            param_group = dict(param_group)
            self._resolve_h(param_group)
        super().add_param_group(param_group)

    def _init_state(self, p):
        b0 = self.b0 if self.b0 is not None else 1.0 / sum(q.numel() for q in self._params())
        z = self._zeros(p)
        return dict(exp_avg=z, exp_avg_sq=z.clone(), s=z.clone(), b_unnorm=z + b0, inv_b_unnorm=1 / (z + b0),
                    shift=z.clone())  # fmt: skip

    def b(self, p: Tensor) -> Tensor:
        """``b_t`` of ``p`` (``b_unnorm · bscale``)."""
        return self.state[p]["b_unnorm"] * self.bscale

    def _global_state(self):
        return {**super()._global_state(), "bscale": self.bscale}

    def _load_global_state(self, dp):
        super()._load_global_state(dp)
        self.bscale = float(dp["bscale"])

    def _plan(self, params, t):
        return dataclasses.replace(
            super()._plan(params, t), shift=[self.state[p]["shift"] for p in params],
            scale=[self.state[p]["inv_b_unnorm"] for p in params], norm_scale=1.0 / self.bscale,
        )  # fmt: skip

    def _apply(self, params, sums, c_total, t, noise, plan):
        C, B, sigma = plan.C, self.expected_batch_size, self.noise_multiplier
        c_total = float(c_total)
        bc = 0 if not self.bias_correction else (1 if self.bc_scale == "paper" else 2)
        kappas = {id(g): macadam_kappa(t, g["betas"][0]) for g in self.param_groups}
        noise_var = (sigma * C / B) ** 2

        def hyper(g):
            b1, b2 = g["betas"]
            return dict(
                inv_b=1.0 / B, lr=g["lr"], beta1=b1, one_minus_beta1=1 - b1, beta2=b2, one_minus_beta2=1 - b2,
                bias1=bias(b1, t), bias2=bias(b2, t), eps=g["eps"], noise_var=noise_var,
                gamma=gamma_prime_of(g, noise_var), h1=g["h1"], h2=g["h2"], kappa=kappas[id(g)], c_total=c_total,
                bscale=self.bscale, bc=bc,
            )  # fmt: skip

        sums_sqrt = self._run(MACADAM, params, sums, hyper, noise, sigma * C, t)
        if any(kappas.values()):
            self.bscale = math.sqrt(self._sum_over_shards(sum(float(x) for x in sums_sqrt)))
