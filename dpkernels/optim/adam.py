"""The adam family (op ``adam_step_``): DP-Adam(W), DP-AdamBC, scale-then-privatize Adam."""

from __future__ import annotations

import dataclasses

import torch

from .._kernel_args import ADAM
from ._base import GAMMA_PRIME_REL, DPOptimizer, _check_number, bias, check_betas, gamma_prime_defaults, gamma_prime_of

__all__ = ["DPAdam", "DPAdamBC", "DPAdamSTP"]


class _AdamFamily(DPOptimizer):
    """Adam moments on the private gradient ``g̃ = (S + ν)/B``; the subclasses set the variant
    (``ADAM`` field ``variant``) and their group defaults."""

    _STATE_KEYS = ("exp_avg", "exp_avg_sq")
    _VARIANT = 0  # optim_math.h AdamVariant
    _accepts_sums = True

    def __init__(self, params, defaults: dict, privacy: dict, *, betas, weight_decay):
        defaults["betas"] = check_betas(betas)
        defaults["weight_decay"] = _check_number("weight_decay", weight_decay, low=0.0)
        super().__init__(params, defaults, privacy)

    def _init_state(self, p):
        return {"exp_avg": self._zeros(p), "exp_avg_sq": self._zeros(p)}

    def _phi(self, delta: float) -> float:
        """``(σ·Δ/B)²``: the noise variance per coordinate of ``g̃`` for noise std ``σ·Δ`` on the sum."""
        return (self.noise_multiplier * delta / self.expected_batch_size) ** 2

    def _hyper(self, group: dict, t: int, delta: float, *, phi: float = 0.0, gamma: float = 0.0) -> dict:
        """The ``ADAM`` scalars of ``group`` at step ``t``; ``phi``/``gamma``: DP-AdamBC's ``Φ̄_t`` and ``γ'_t``."""
        b1, b2 = group["betas"]
        return dict(
            inv_b=1.0 / self.expected_batch_size, lr=group["lr"], beta1=b1, one_minus_beta1=1 - b1, beta2=b2,
            one_minus_beta2=1 - b2, bias1=bias(b1, t), bias2=bias(b2, t), bias2_prev=bias(b2, t - 1),
            eps=group.get("eps", group.get("eps2", 0.0)),
            decay=1 - group["lr"] * group["weight_decay"] if group["weight_decay"] else 1.0,
            phi=phi, gamma=gamma,
            eps1=group.get("eps1", 0.0), variant=self._VARIANT,
        )  # fmt: skip

    def _apply(self, params, sums, c_total, t, noise, plan):
        delta = plan.C
        std = self.noise_multiplier * delta
        self._run(ADAM, params, sums, lambda g: self._hyper(g, t, delta), noise, std, t)


class DPAdam(_AdamFamily):
    """DP-Adam by post-processing (arXiv:2606.05435 eq. 4–5; arXiv:2507.01129 Alg. 5), optional AdamW decay.

    ``g̃ = (Σ_i c_i g_i + σ·C·z_t)/B``, then Adam::

        m ← β1 m + (1−β1) g̃,   v ← β2 v + (1−β2) g̃²,   m̂ = m/(1−β1^t),   v̂ = v/(1−β2^t)
        θ ← θ(1 − ηλ) − η m̂ / (√v̂ + γ)            (γ = eps OUTSIDE the sqrt; λ = weight_decay)

    ``weight_decay`` is decoupled (Loshchilov & Hutter, ``torch.optim.AdamW``), applied to θ
    before the Adam step. State: ``exp_avg`` (m), ``exp_avg_sq`` (v).
    """

    def __init__(self, params, lr=1e-3, *, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, **privacy):
        _check_number("eps", eps, low=0.0)
        super().__init__(params, dict(lr=lr, eps=eps), privacy, betas=betas, weight_decay=weight_decay)


class DPAdamBC(_AdamFamily):
    """DP-AdamBC (Tang et al. 2024, arXiv:2312.14334; arXiv:2507.01129 Alg. 7): DP-Adam with the noise
    variance removed from the second moment::

        θ ← θ(1 − ηλ) − η m̂_t / sqrt(max(v̂_t − Φ̄_t, γ'_t))
        Φ_k = (σ_k Δ_k / B_k)² · r_k        the noise variance per coordinate of g̃_k (step k)
        Φ̄_t = Σ_{k≤t} (1−β2) β2^{t−k} Φ_k / (1−β2^t)    the same average of Φ_k as v̂_t takes of g̃_k²

    computed as ``Φ̄_0 = 0``, ``Φ̄_t = Φ̄_{t−1} + (1−β2)/(1−β2^t)·(Φ_t − Φ̄_{t−1})``, i.e. Ganesh et al.'s
    recursion ``b_t = (β2−β2^t)/(1−β2^t)·b_{t−1} + (1−β2)/(1−β2^t)·Φ_t`` (arXiv:2507.01129 App. A, as
    corrected in reference/seeds_design_principles.md §1.5: ``b_i`` → ``b_t``, no extra
    ``β2``, the diagonal of ``C⁻¹C⁻ᵀ``). ``r_k = 1`` for independent noise; with ``correlated_noise``,
    ``r_k = ‖row_k(C⁻¹)‖²`` (:meth:`dpkernels.BLTNoise.noise_variance`): the noise of ``g̃_k`` is
    ``σΔ/B·(C⁻¹Z)_k``, and ``v`` sums squares of single steps, so only each step's own variance
    enters its expectation, not the covariance across steps. ``Δ`` is ``max_grad_norm`` (the
    ``sensitivity`` of :meth:`step_from_sums`); ``σ``, ``Δ``, ``B`` are read at each step.

    With independent noise and constant ``σ, Δ, B`` the recursion gives ``Φ̄_t = Φ`` exactly (bit for
    bit: ``Φ̄_1 = 0 + 1·(Φ − 0)``, then ``Φ̄_{t−1} + w·0``), as the earlier ``Φ = (σC/B)²``. When they
    change (:meth:`set_step_params`, ``step_from_sums`` with another ``sensitivity``), ``Φ̄_t`` moves
    from the old to the new variance at the rate ``v̂_t`` forgets the old noise, instead of
    jumping. ``Φ̄`` is kept per param group (β2 may differ), starts at 0 with the group's state (a
    group added later averages only the steps its ``v`` saw) and is saved in ``state_dict()["dp"]``
    (a checkpoint of an earlier version, without it, loads with ``Φ̄ = Φ``: what that version
    subtracted; with correlated noise it is refused).

    **γ'** (the floor): by default relative, ``γ'_t = ρ·Φ̄_t`` with ``ρ = gamma_prime_rel`` = 0.1:
    the denominator is never below ``√ρ ≈ 0.32`` noise standard deviations, so on a coordinate
    without signal (``v̂ ≈ Φ̄``, where ``v̂ − Φ̄`` is negative about half of the time) the step is at
    most ``1/√ρ ≈ 3.2×`` DP-Adam's there. ``ρ = 0.1`` is also about 3 standard deviations of the
    noise of ``v̂_t − Φ̄_t`` on a zero-gradient coordinate (``Φ·sqrt(2(1−β2)/(1+β2)) ≈ 0.032Φ`` at
    β2 = 0.999, independent noise): a smaller second moment cannot be told from 0 anyway. ``ρ = 1``
    would re-introduce DP-Adam's bias on every coordinate below the noise (Ganesh et al. §4.4.2).
    An absolute floor (the former default, ``gamma_prime=1e-8``, Ganesh et al.'s tuned ``ε² =
    (1e-4)²``) amplified small coordinates by ``sqrt(Φ/1e-8)``, 150–630× at our runs' noise levels.
    ``gamma_prime=`` sets an absolute ``γ'`` instead (then ``gamma_prime_rel`` must not be given).
    With ``σ = 0`` the relative floor is the smallest normal fp32 (there is nothing to remove; it
    only keeps ``0/0`` out). State as DPAdam.
    """

    _VARIANT = 1
    _NEWER_GLOBALS = frozenset({"phi_bar"})

    def __init__(self, params, lr=1e-3, *, betas=(0.9, 0.999), gamma_prime=None, gamma_prime_rel=None,
                 weight_decay=0.0, **privacy):  # fmt: skip
        defaults = dict(lr=lr, **gamma_prime_defaults(gamma_prime, gamma_prime_rel, GAMMA_PRIME_REL))
        self._phi_bar: list[float] = []
        super().__init__(params, defaults, privacy, betas=betas, weight_decay=weight_decay)

    @property
    def phi(self) -> float:
        """``Φ = (σ·C/B)²``, the variance of independent noise in each coordinate of ``g̃`` of :meth:`step`
        (with ``correlated_noise``, step ``t``'s is ``Φ·r_t``)."""
        return self._phi(self.max_grad_norm)

    @property
    def phi_bar(self) -> list[float]:
        """``Φ̄_t`` of each param group after the last step (0 before the first): what it subtracted."""
        return [*self._phi_bar, *[0.0] * (len(self.param_groups) - len(self._phi_bar))]

    def _apply(self, params, sums, c_total, t, noise, plan):
        delta = plan.C
        mech = self.correlated_noise
        # Pre-drawn noise replaces the mechanism's (and does not advance it): σΔz, independent.
        r = mech.noise_variance(t) if mech is not None and noise is None else 1.0
        phi_t = self._phi(delta) * r
        bars = {}
        for group, bar in zip(self.param_groups, self.phi_bar, strict=True):
            b2 = group["betas"][1]
            bars[id(group)] = bar + (1 - b2) / bias(b2, t) * (phi_t - bar)
        gamma = {id(g): gamma_prime_of(g, bars[id(g)]) for g in self.param_groups}
        std = self.noise_multiplier * delta
        hyper = lambda g: self._hyper(g, t, delta, phi=bars[id(g)], gamma=gamma[id(g)])  # noqa: E731
        self._run(ADAM, params, sums, hyper, noise, std, t)
        self._phi_bar = [bars[id(g)] for g in self.param_groups]

    def _global_state(self):
        return {**super()._global_state(), "phi_bar": self.phi_bar}

    def _load_global_state(self, dp):
        super()._load_global_state(dp)
        if "phi_bar" not in dp:  # saved by dpkernels before Φ̄: it subtracted Φ of the current σ, C, B
            if self.correlated_noise is not None:
                raise ValueError(
                    "phi_bar is missing (saved by an earlier dpkernels) and with correlated_noise it cannot "
                    "be reconstructed"
                )
            dp = {"phi_bar": [self.phi] * len(self.param_groups)}
        bars = dp["phi_bar"]
        if not isinstance(bars, list) or len(bars) > len(self.param_groups):
            raise ValueError(f"phi_bar must be a list of at most {len(self.param_groups)} floats, got {bars!r}")
        self._phi_bar = [_check_number(f"phi_bar[{i}]", b, low=0.0) for i, b in enumerate(bars)]


class DPAdamSTP(_AdamFamily):
    """Scale-then-privatize Adam ("On Design Principles for Private Adaptive Optimizers",
    arXiv:2507.01129, Alg. 8).

    With ``s_t = 1/(√v̂_{t−1} + ε₁)`` (``v̂_0 = 0``, so ``s_1 = 1/ε₁``)::

        c_i = f(‖s_t ⊙ g_i‖)                       per-sample weight from the SCALED norm
        g̃  = (Σ_i c_i g_i + (√v̂_{t−1} + ε₁) ⊙ σ·C·z_t) / B
        Adam moments on g̃;   θ ← θ(1 − ηλ) − η m̂ / (√v̂_t + ε₂)

    This is the paper's ``(Σ clip(s⊙g_i, C) + σCz)/(B s)`` rewritten without the division by
    ``s`` (our derived form, docs/ALGORITHMS.md): the clip geometry is the ellipsoid
    ``‖s⊙g‖ ≤ C``, the noise is isotropic in the scaled space (same privacy as DP-Adam), and it is
    un-scaled by ``√v̂_{t−1} + ε₁`` per coordinate. Injected ``noise`` is the scaled-space
    ``σ·C·z``. State: ``exp_avg``, ``exp_avg_sq`` and ``scale`` = ``s_{t+1}``, written by each step
    for the next step's clip pass.

    ``eps1`` (ε₁, > 0) is **required**: the paper tunes it jointly with C and the learning rate
    and gives no value, and no constant suits every gradient scale. C (``max_grad_norm``) is a
    norm in the *scaled* space, so it acts on raw gradients only through ε₁:

    - step 1 (``s_1 = 1/ε₁``) clips ``‖g_i‖ ≤ C·ε₁``, ordinary L2 clipping at ``C·ε₁`` with noise
      std ``σ·C·ε₁`` on the sum;
    - later steps clip ``‖g_i/(√v̂_{t−1} + ε₁)‖ ≤ C``, an ellipsoid of semi-axis
      ``C·(√v̂_{t−1,j} + ε₁)`` along coordinate j.

    If ``C·ε₁`` is far below the per-sample gradient norms, every sample is clipped at step 1 and
    the run stays at that scale: a typical coordinate of ``g̃`` is about ``(C/√d + ρ)(√v̂ + ε₁)``
    (ρ = σC/B; the noise alone has the fixed point ``√v̂ = ρε₁/(1 − ρ)``), so with ε₁ = 1e-8
    ``√v̂`` falls below ε₂ and the updates shrink to about ``η·m̂/ε₂``. If ε₁ is far above ``√v̂``,
    ``s`` is nearly uniform and STP is DP-Adam clipping at ``C·ε₁``. A starting point: ``C·ε₁`` =
    the clip norm DP-Adam would use, then tune C and ε₁ together (docs/ALGORITHMS.md).
    """

    _STATE_KEYS = ("exp_avg", "exp_avg_sq", "scale")
    _VARIANT = 2
    _accepts_sums = False

    def __init__(self, params, lr=1e-3, *, eps1, betas=(0.9, 0.999), eps2=1e-8, weight_decay=0.0, **privacy):
        _check_number("eps1", eps1, low=0.0, low_open=True)
        _check_number("eps2", eps2, low=0.0)
        super().__init__(params, dict(lr=lr, eps1=eps1, eps2=eps2), privacy, betas=betas, weight_decay=weight_decay)

    def _init_state(self, p):
        st = super()._init_state(p)
        # The clip scale s_1 = 1/(√v̂_0 + ε₁) = 1/ε₁; each step writes the next one.
        st["scale"] = 1 / (torch.zeros_like(st["exp_avg_sq"]) + self._group_of(p)["eps1"])
        return st

    def _plan(self, params, t):
        return dataclasses.replace(super()._plan(params, t), scale=[self.state[p]["scale"] for p in params])
