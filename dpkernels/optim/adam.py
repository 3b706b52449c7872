"""The adam family (op ``adam_step_``): DP-Adam(W), DP-AdamBC, scale-then-privatize Adam."""

from __future__ import annotations

import torch

from .._kernel_args import ADAM
from ._base import DPOptimizer, _check_number, bias, check_betas

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

    def _hyper(self, group: dict, t: int, delta: float) -> dict:
        b1, b2 = group["betas"]
        return dict(
            inv_b=1.0 / self.expected_batch_size, lr=group["lr"], beta1=b1, one_minus_beta1=1 - b1, beta2=b2,
            one_minus_beta2=1 - b2, bias1=bias(b1, t), bias2=bias(b2, t), bias2_prev=bias(b2, t - 1),
            eps=group.get("eps", group.get("eps2", 0.0)),
            decay=1 - group["lr"] * group["weight_decay"] if group["weight_decay"] else 1.0,
            phi=self._phi(delta) if self._VARIANT == 1 else 0.0, gamma=group.get("gamma_prime", 0.0),
            eps1=group.get("eps1", 0.0), variant=self._VARIANT,
        )  # fmt: skip

    def _clip_scale(self, params):
        return None

    def _update(self, params, grad_sets, t, noise):
        sums, _ = self._clip_sums(grad_sets, self.max_grad_norm, scale=self._clip_scale(params))
        self._update_from_sums(params, sums, t, noise, self.max_grad_norm)

    def _update_from_sums(self, params, sums, t, noise, delta):
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

        θ ← θ(1 − ηλ) − η m̂ / sqrt(max(v̂ − Φ, γ')),     Φ = (σC/B)²

    ``gamma_prime`` (γ') defaults to **1e-8**: the papers leave it open; Ganesh et al. tune the
    equivalent ``max(·, ε²)`` and report ε = 1e-4 best in all their settings, i.e. γ' = 1e-8.
    State as DPAdam.
    """

    _VARIANT = 1

    def __init__(self, params, lr=1e-3, *, betas=(0.9, 0.999), gamma_prime=1e-8, weight_decay=0.0, **privacy):
        _check_number("gamma_prime", gamma_prime, low=0.0, low_open=True)
        super().__init__(params, dict(lr=lr, gamma_prime=gamma_prime), privacy, betas=betas,
                         weight_decay=weight_decay)  # fmt: skip

    @property
    def phi(self) -> float:
        """``Φ = (σ·C/B)²``, the variance of the noise in each coordinate of ``g̃`` of :meth:`step`."""
        return self._phi(self.max_grad_norm)


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

    def _clip_scale(self, params):
        return [self.state[p]["scale"] for p in params]
