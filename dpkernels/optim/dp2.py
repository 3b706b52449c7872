"""The dp2 family (op ``dp2_step_``): DP² with delayed preconditioners."""

from __future__ import annotations

from .. import _validate
from .._kernel_args import DP2 as DP2_ARGS
from ..reference.optim import dp2_refreshed_v
from ._base import ClipPlan, DPOptimizer, _check_number

__all__ = ["DP2"]


class DP2(DPOptimizer):
    """DP² (Li et al. 2023, arXiv:2212.00309, Algorithm 1), RMSProp or AdaGrad.

    Cycles of ``s1`` private SGD steps then ``s2`` preconditioned steps. With ``r = (t−1) mod
    (s1+s2)`` for the 1-based step ``t``::

        r <  s1:  g̃ = (Σ_i clip(g_i, C) + σ·C·z_t)/B;                 G ← G + g̃;  θ ← θ − η g̃
        r == s1:  v ← βv + (1−β)(G/s1)²  (RMSProp)   or   v ← v + (G/s1)²  (AdaGrad);   G ← 0
        r >= s1:  g̃ = (Σ_i clip(g_i/D, C2) + σ·C2·z_t)/B,  D = √v + ε;   θ ← θ − η2 g̃

    The refresh at ``r == s1`` happens before that step's clipping, so the first adaptive step
    already uses the new ``v``. The noise is never preconditioned. Adaptive steps do not add to
    ``G`` (the paper adds and then discards it at the next ``r = 0`` reset: equivalent), so ``G``
    is 0 during the adaptive phase. ``clip(g/D)`` is computed as ``(1/D) ⊙ Σ c_i g_i`` with
    ``c_i = f(‖g_i/D‖)``. ``v`` starts at 0, no bias correction (as the paper and its code).
    ``lr2``/``max_grad_norm2`` (η2, C2) default to ``lr``/``max_grad_norm``; the paper tunes them
    separately. Default β = 0.9 (the authors' ``--rmsprop_gamma``), ε = 1e-8. State: ``v``, ``G``
    and ``inv_d = 1/(√v + ε)`` (written at each refresh, read by the adaptive steps).
    """

    _STATE_KEYS = ("G", "inv_d")

    def __init__(self, params, lr, *, s1, s2, lr2=None, max_grad_norm2=None, beta=0.9, eps=1e-8,
                 preconditioner="rmsprop", **privacy):  # fmt: skip
        for name, val in (("s1", s1), ("s2", s2)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{name} must be an int >= 1, got {val!r}")
        if preconditioner not in ("rmsprop", "adagrad"):
            raise ValueError(f"preconditioner must be 'rmsprop' or 'adagrad', got {preconditioner!r}")
        _check_number("beta", beta, low=0.0, high=1.0, high_open=True)
        _check_number("eps", eps, low=0.0, low_open=True)
        lr2 = lr if lr2 is None else lr2
        _check_number("lr2", lr2, low=0.0)
        self.s1, self.s2, self.preconditioner = s1, s2, preconditioner
        C = privacy.get("max_grad_norm")
        self.max_grad_norm2 = _check_number(
            "max_grad_norm2", C if max_grad_norm2 is None else max_grad_norm2, low=0.0, low_open=True
        )
        super().__init__(params, dict(lr=lr, lr2=lr2, beta=beta, eps=eps), privacy)

    def _init_state(self, p):
        z = self._zeros(p)
        # inv_d is first read after a refresh has written it.
        return {"v": z, "G": z.clone(), "inv_d": 1 / (z.sqrt() + self._group_of(p)["eps"])}

    def check_step_params(self, noise_multiplier, max_grad_norm, expected_batch_size):
        checked = super().check_step_params(noise_multiplier, max_grad_norm, expected_batch_size)
        _validate.fp32_scale("noise_multiplier · max_grad_norm2", checked[0] * self.max_grad_norm2)
        return checked

    def phase(self, t: int) -> str:
        """``"sgd"`` or ``"adaptive"`` for the 1-based step ``t``."""
        return "sgd" if (t - 1) % (self.s1 + self.s2) < self.s1 else "adaptive"

    def _plan(self, params, t):
        pos = (t - 1) % (self.s1 + self.s2)
        if pos < self.s1:  # G is 0 at pos 0: the refresh reset it and adaptive steps do not add to it
            return ClipPlan(self.max_grad_norm)
        if pos > self.s1:
            return ClipPlan(self.max_grad_norm2, scale=[self.state[p]["inv_d"] for p in params])
        # The refresh, stored by _apply only once the clipped sum is formed (all or nothing).
        groups = self._groups_of()
        v = [dp2_refreshed_v(self.state[p]["v"], self.state[p]["G"], self.s1, g["beta"], self.preconditioner)
             for p, g in zip(params, groups, strict=True)]  # fmt: skip
        inv_d = [1 / (vv.sqrt() + g["eps"]) for vv, g in zip(v, groups, strict=True)]
        return ClipPlan(self.max_grad_norm2, scale=inv_d, carry=v)

    def _apply(self, params, sums, c_total, t, noise, plan):
        if plan.carry is not None:
            for p, vv, d in zip(params, plan.carry, plan.scale, strict=True):
                self.state[p].update(v=vv, G=self._zeros(p), inv_d=d)
        inv_b = 1.0 / self.expected_batch_size
        phase, lr = (0, "lr") if self.phase(t) == "sgd" else (1, "lr2")
        hyper = lambda g: dict(inv_b=inv_b, lr=g[lr], phase=phase)  # noqa: E731
        self._run(DP2_ARGS, params, sums, hyper, noise, self.noise_multiplier * plan.C, t)
