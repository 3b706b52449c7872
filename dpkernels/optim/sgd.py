"""The sgd family (op ``sgd_step_``): DP-SGD with momentum and weight decay, DP-PSAC, DP-PMLF.

The direction is a linear filter of the private gradient (:mod:`dpkernels._kernel_args` FILTER
layout): heavy-ball momentum is one buffer, DP-PMLF's IIR filter runs over rings of past ``m`` and
``v̄`` (the ring position in ``state_dict()["dp"]["ring"]``), plain SGD has none.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from .._kernel_args import FILTER, SGD
from ..reference.optim import PMLF_PRESETS, pmlf_momentum_coeffs, pmlf_next_correction
from ._base import INDEPENDENT, DPOptimizer, _check_number

__all__ = ["DPSGD", "DPPMLF"]

# A filter whose correction needs more steps than this to be certified has a time constant far beyond
# any training run (a pole within ~1e-6 of the unit circle); it is refused rather than checked forever.
_MAX_CORRECTION_STEPS = 1_000_000


class DPSGD(DPOptimizer):
    """DP-SGD (Abadi et al. 2016) with optional heavy-ball momentum and L2 weight decay.

    ``g̃ = (Σ_i c_i g_i + σ·C·z_t)/B``; then, as ``torch.optim.SGD`` (dampening 0, no Nesterov)::

        d = g̃ + λ θ          (weight_decay λ, coupled: added to the private gradient)
        buf = μ buf + d       (momentum μ; buf starts at 0, so buf_1 = d)
        θ ← θ − η buf

    DP-PSAC (arXiv:2212.00328) is ``DPSGD(mode="psac", r=0.1)``: the same algorithm with the weight
    ``C/(n + r/(n + r))``. State: ``momentum_buffer`` (stays 0 when μ = 0).
    """

    _accepts_sums = True

    def __init__(self, params, lr, *, momentum=0.0, weight_decay=0.0, **privacy):
        _check_number("momentum", momentum, low=0.0, high=1.0, high_open=True)
        _check_number("weight_decay", weight_decay, low=0.0)
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay), privacy)

    def _init_state(self, p):
        return {"momentum_buffer": self._zeros(p)}

    def _apply(self, params, sums, c_total, t, noise, plan):
        inv_b = 1.0 / self.expected_batch_size
        # Heavy-ball buf ← μ·buf + d is the filter y = 1·d + μ·S, S ← y.
        self._run(
            SGD, params, sums, lambda g: dict(inv_b=inv_b, lr=g["lr"], weight_decay=g["weight_decay"]), noise,
            self.noise_multiplier * plan.C, t,
            state=lambda g, sl: [self.state[p]["momentum_buffer"] for p in params[sl]] if g["momentum"] else [],
            extra=lambda g, sl: (FILTER.pack(a=1.0, g=1.0, c=[g["momentum"]], d=[0.0], e=[1.0], f=[0.0])
                                 if g["momentum"] else INDEPENDENT, []),
        )  # fmt: skip


class DPPMLF(DPOptimizer):
    """DP-PMLF (Xu et al. 2026, arXiv:2511.08841): per-sample momentum over ``k`` iterates,
    clipping, noise, a low-pass IIR filter with bias correction, then SGD.

    ``p.grad_sample`` is a list of ``k`` tensors ``[B, *p.shape]`` (also for k = 1): entry ``j`` holds the
    per-sample gradients of the current batch at the iterate ``x_{t−j}`` (``j = 0``: the current
    parameters; earlier iterates from :meth:`past_params`; :func:`dpkernels.pmlf.pmlf_grad_samples`
    computes them). Per step (0-based paper index ``t``)::

        v_i  = Σ_{j<k} α_j g_i(x_{t−j}),   α_j = β^j / Σ_{l<k} β^l    (per-sample momentum)
        v̄_t  = (Σ_i clip(v_i, C) + σ·C·z)/B                           (sensitivity C: x_{t−j} public)
        m_t  = −Σ_{τ=1}^{na} a_τ m_{t−τ} + Σ_{τ=0}^{nb} b_τ v̄_{t−τ}      (m, v̄ = 0 before t = 0)
        c_t  = −Σ_{τ=1}^{na} a_τ c_{t−τ} + Σ_{τ=0}^{min(t,nb)} b_τ        (bias correction)
        θ   ← θ − η m_t / c_t

    ``c_t`` is the filter's response to the constant input 1 from the same zero state, so
    ``m_t/c_t`` returns a constant input exactly from the first step (anchors_dp §4.5's
    ``Σ b_τ`` counted over the inputs that exist). The authors' code adds all ``b_τ`` from
    ``t = 0``; that differs for the two-tap presets during the first ~1/(1 − pole) steps.
    ``filter`` is a preset name of :data:`PMLF_PRESETS` or a pair ``(a, b)``; it must satisfy
    ``Σ b − Σ a = 1``, have all poles inside the unit circle and give ``c_t > 0`` at every step
    (``b₀ > 0`` for ``c_1 = b₀``; checked for all ``t``, :func:`_check_correction`), else
    ``ValueError``. Defaults: ``k = 2``, ``β = 0.1``, preset ``a9b1`` (the authors' code defaults).

    State (rings, one layout on every backend): ``m_hist`` ``[na, *shape]``, ``vbar_hist``
    ``[nb, *shape]`` and ``past`` ``[k−1, *shape]`` (parameter dtype; ``x_0`` before there are
    enough iterates, as the authors' code); slot ``(ring − 1 − j) mod n`` holds the value of step
    ``t−1−j``, with ``ring`` (steps taken) and the ``c`` history in ``state_dict()["dp"]``.
    :meth:`history` and :meth:`past_params` return them newest first.
    """

    def __init__(self, params, lr, *, k=2, beta=0.1, filter="a9b1", **privacy):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k (momentum length) must be an int >= 1, got {k!r}")
        _check_number("beta", beta, low=0.0, high=1.0)
        self.k, self.beta = k, float(beta)
        self.filter_a, self.filter_b = self._check_filter(filter)
        self._num_grad_sets = k
        self._grad_sample_is_list = True
        self._c_hist: list[float] = []  # c_{t−1}, c_{t−2}, ... (at most na entries)
        self._ring = 0  # steps taken: ring position of the histories
        super().__init__(params, dict(lr=lr), privacy)

    @staticmethod
    def _check_filter(filt) -> tuple[tuple[float, ...], tuple[float, ...]]:
        if isinstance(filt, str):
            if filt not in PMLF_PRESETS:
                raise ValueError(f"unknown PMLF filter preset {filt!r}; expected one of {sorted(PMLF_PRESETS)}")
            a, b = PMLF_PRESETS[filt]
            _check_correction(a, b, f"preset {filt!r}")
            return a, b
        try:
            a, b = (tuple(float(x) for x in filt[0]), tuple(float(x) for x in filt[1]))
        except (TypeError, ValueError, IndexError):
            raise ValueError(f"filter must be a preset name or a pair (a, b) of coefficient lists, got {filt!r}") \
                from None  # fmt: skip
        if not b or not all(math.isfinite(x) for x in a + b):
            raise ValueError(f"filter coefficients must be finite and b non-empty, got a={a}, b={b}")
        if abs(sum(b) - sum(a) - 1.0) > 1e-6:
            raise ValueError(f"filter must have unit DC gain, sum(b) - sum(a) = 1; got {sum(b) - sum(a)}")
        if a:
            poles = torch.linalg.eigvals(torch.cat([-torch.tensor([a], dtype=torch.float64),
                                                    torch.eye(len(a) - 1, len(a), dtype=torch.float64)]))  # fmt: skip
            if bool((poles.abs() >= 1).any()):
                raise ValueError(f"filter is not stable: poles {poles.abs().tolist()} must lie inside the unit circle")
        _check_correction(a, b, f"(a={list(a)}, b={list(b)})")
        return a, b

    def _init_state(self, p):
        na, nb = len(self.filter_a), len(self.filter_b) - 1
        z = self._zeros(p)
        return {
            "m_hist": z.unsqueeze(0).repeat(na, *([1] * p.dim())),
            "vbar_hist": z.unsqueeze(0).repeat(nb, *([1] * p.dim())),
            "past": p.detach().clone(memory_format=torch.contiguous_format).unsqueeze(0)
            .repeat(self.k - 1, *([1] * p.dim())),
        }  # fmt: skip

    @property
    def momentum_coeffs(self) -> list[float]:
        return pmlf_momentum_coeffs(self.k, self.beta)

    def _slots(self, n: int) -> list[int]:
        """Ring slots of a history of length ``n``, newest first (slot of ``x_{t−1}``, ``x_{t−2}``, ...)."""
        return [(self._ring - 1 - j) % n for j in range(n)]

    def history(self, p: Tensor, key: str) -> Tensor:
        """``m_hist``/``vbar_hist``/``past`` of ``p`` newest first (``m_{t−1}``, ``m_{t−2}``, ...)."""
        hist = self.state[p][key]
        return hist[self._slots(hist.shape[0])] if hist.shape[0] else hist

    def past_params(self) -> list[list[Tensor]]:
        """The ``k−1`` past iterates ``[x_{t−1}, ..., x_{t−k+1}]``, each a list of tensors in
        parameter order: pass them to :func:`dpkernels.pmlf.pmlf_grad_samples`."""
        params = self._params()
        return [[self.state[p]["past"][slot] for p in params] for slot in self._slots(self.k - 1)]

    def _global_state(self):
        return {**super()._global_state(), "c_hist": list(self._c_hist), "ring": self._ring}

    def _load_global_state(self, dp):
        super()._load_global_state(dp)
        self._c_hist = [float(c) for c in dp["c_hist"]]
        self._ring = int(dp["ring"])

    def _direction_coeffs(self, c_t: float) -> list[float]:
        """The direction filter over ``[m_{t−1}, …, m_{t−na}, v̄_{t−1}, …, v̄_{t−nb}]`` (ring slots,
        newest first): ``y = b₀ v̄ − Σ a_τ m + Σ b_τ v̄``, ``out = y/c_t``; the oldest m slot is read,
        then overwritten with ``y``; the oldest v̄ slot with ``x = v̄``."""
        a, b = self.filter_a, self.filter_b
        na, K = len(a), len(a) + len(b) - 1
        d, e, f = [1.0] * K, [0.0] * K, [0.0] * K
        if na:
            d[na - 1], e[na - 1] = 0.0, 1.0
        if na < K:
            d[K - 1], f[K - 1] = 0.0, 1.0
        return FILTER.pack(a=b[0], g=1.0 / c_t, c=[-x for x in a] + list(b[1:]), d=d, e=e, f=f)

    def _plan(self, params, t):
        return dataclasses.replace(super()._plan(params, t), coeffs=self.momentum_coeffs)

    def _apply(self, params, sums, c_total, t, noise, plan):
        a, b = self.filter_a, self.filter_b
        inv_b = 1.0 / self.expected_batch_size
        # t is 1-based here; the paper's index is t − 1, so b_τ exists for τ <= t − 1.
        c_t = pmlf_next_correction(a, b, self._c_hist, t - 1)
        m_slots, v_slots = self._slots(len(a)), self._slots(len(b) - 1)
        coeffs = self._direction_coeffs(c_t)

        def state(group, sl):
            ps = params[sl]
            return [self.state[p]["m_hist"][i] for i in m_slots for p in ps] + [
                self.state[p]["vbar_hist"][i] for i in v_slots for p in ps
            ]

        def extra(group, sl):
            past = [self.state[p]["past"][self._ring % (self.k - 1)] for p in params[sl]] if self.k > 1 else []
            return coeffs, past

        self._run(
            SGD, params, sums, lambda g: dict(inv_b=inv_b, lr=g["lr"], weight_decay=0.0), noise,
            self.noise_multiplier * plan.C, t, state=state, extra=extra,
        )  # fmt: skip
        self._c_hist = ([c_t] + self._c_hist)[: len(a)]
        self._ring += 1


def _check_correction(a: tuple[float, ...], b: tuple[float, ...], label: str) -> None:
    """Raise ``ValueError`` unless DP-PMLF's bias correction ``c_t`` (the filter's response to a
    constant 1 from zero state, :class:`DPPMLF`) is > 0 at every step: ``θ ← θ − η m_t/c_t`` is
    0/0 where ``c_t = 0`` (``b₀ = 0`` gives ``c_1 = 0``) and points uphill where ``c_t < 0``.

    For a stable filter with unit DC gain ``c_t → 1``, and the check is exact over all ``t``: once
    every ``b_τ`` is in the sum (paper index ``t ≥ nb``), ``e_t = c_t − 1`` obeys the homogeneous
    recursion ``e_t = −Σ a_τ e_{t−τ}`` (``e_{<0} = −1``), i.e. ``x_{t+1} = A x_t`` for the companion
    matrix ``A`` of ``a`` and ``x_t = (e_t, …, e_{t−na+1})``. With ``n`` such that ``‖Aⁿ‖∞ < 1`` (it
    exists: the spectral radius is < 1), ``‖x_{t+j}‖∞ ≤ M·‖x_t‖∞`` for every ``j ≥ 0``, where
    ``M = max_{r<n} ‖Aʳ‖∞``; so once ``M·‖x_t‖∞ < 1`` no later ``c_t`` can reach 0. Steps before
    that are computed and checked one by one (the same recursion as the step's ``c_t``)."""
    na, nb = len(a), len(b)
    bound = 0.0  # M: 0 for an FIR filter, whose c_t is exactly 1 once every b_τ is summed
    if na:
        A = torch.zeros(na, na, dtype=torch.float64)
        A[0] = -torch.tensor(a, dtype=torch.float64)
        A[1:, :-1] = torch.eye(na - 1, dtype=torch.float64)
        power, norms = torch.eye(na, dtype=torch.float64), []
        while (norm := float(power.abs().sum(1).max())) >= 1.0:
            norms.append(norm)
            if len(norms) > _MAX_CORRECTION_STEPS:
                raise ValueError(f"PMLF filter {label}: a pole is too close to the unit circle to check c_t")
            power = A @ power
        bound = max(norms)
    c: list[float] = []  # c_{t−1}, c_{t−2}, ... (paper index), newest first
    for t in range(_MAX_CORRECTION_STEPS):
        c_t = pmlf_next_correction(a, b, c, t)
        if not c_t > 0:
            why = " (c_1 = b_0)" if t == 0 else ""
            raise ValueError(
                f"PMLF filter {label}: its bias correction c_t = {c_t:.6g} <= 0 at step t = {t + 1} "
                f"(the first step is t = 1){why}; the update m_t/c_t needs c_t > 0 at every step"
            )
        c = [c_t, *c[: max(na, 1) - 1]]
        if t >= nb - 1 and bound * max((abs(c[j] - 1) if j < len(c) else 1.0) for j in range(max(na, 1))) < 1:
            return
    raise ValueError(f"PMLF filter {label}: c_t has not settled after {_MAX_CORRECTION_STEPS} steps")
