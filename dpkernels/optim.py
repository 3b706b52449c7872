"""Fused DP optimizers: the semantics of :mod:`dpkernels.reference.optim`, two passes per step.

Each class here is its reference twin (same constructor, validation, ``state_dict``, noise
counter, decisions; docs/ALGORITHMS.md "Optimizers") plus ``backend=``. A step is:

1. **clip** — the per-sample clipping pipeline of :mod:`dpkernels.clip` on the backend: norms
   (with the algorithm's shift/scale), weights, and the clipped sum ``S`` (fp32, reads the per-sample
   gradients twice);
2. **one fused pass over D** — one op per optimizer family (``sgd_step_``, ``dp2_step_``,
   ``adam_step_``, ``macadam_step_``; schemas in csrc/ops.cpp, element math in
   csrc/include/dpkernels/optim_math.h): it reads ``S``, generates the noise in registers
   (Philox, or its correlated version through the mechanism's buffers), applies the affine
   correction, updates every state buffer and writes the parameters. No noise tensor and no
   private-gradient tensor is materialised.

What the fused pass writes besides the reference's state, so that the next clip pass reads a
ready vector instead of an extra pass over D: STP's clip scale ``1/(√v̂_t + ε₁)`` (``scale``);
MacAdam's ``m̂_t`` (``shift``) and ``1/b_u`` (``inv_b_unnorm``), with ``b = b_u·bscale`` split into
a per-element ``b_u = ŝ^{1/4}`` (``b_unnorm``) and the global ``bscale = √(Σ√ŝ)``, whose sum the
pass accumulates (applied in the next step: no extra pass for the global reduction); DP²'s
``1/(√v + ε)`` (``inv_d``, refreshed once per cycle). DP-PMLF's histories are rings
(``m_hist``, ``vbar_hist``, ``past`` with the position in ``state_dict()["dp"]["ring"]``) instead
of the reference's shifted stacks.

``backend="reference"`` runs the reference update itself. The ``cpu``/``cuda`` backends call the
native ops (``torch.ops.dpkernels_C``), ``triton`` the kernels of :mod:`triton_kernels.optim`;
parameters must be contiguous fp32/fp16/bf16 (state is fp32). ``rng="chacha20"`` secure noise is
drawn by :func:`dpkernels.gaussian_noise` into a pre-drawn noise list (not fused: the secure mode
is for when the noise's provenance matters more than its speed).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import _backend
from .clip import _clipped_sums
from .noise import RNGS, _signed64, fresh_key, gaussian_noise
from .reference import optim as ref

__all__ = ["DPSGD", "DPAdam", "DPAdamBC", "DPAdamSTP", "DPMacAdam", "DP2", "DPPMLF"]

_NATIVE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INDEPENDENT = [1.0, 1.0]  # filter coefficients [a, g] of independent noise: ν = std·z


if _backend.has_cpu_kernels():
    # The other three family ops mutate their arguments and return nothing: torch derives their fake kernels.
    @torch.library.register_fake("dpkernels_C::macadam_step_")
    def _(params, sums, state, noise, noise_state, noise_coeffs, noise_std, seed, step, stream, offset, hyper):
        return params[0].new_empty((), dtype=torch.float64)


def _filter_coeffs(co: dict) -> list[float]:
    return [co["a"], co["g"], *co["c"], *co["d"], *co["e"], *co["f"]]


def _first_device(groups: list) -> torch.device:
    """The device of the first parameter of ``params`` as the constructor receives it (tensors, or
    param-group dicts, some possibly empty); CPU when there is none (the constructor then raises)."""
    for g in groups:
        ps = g["params"] if isinstance(g, dict) else g
        ps = [ps] if isinstance(ps, Tensor) else list(ps)
        if ps and isinstance(ps[0], Tensor):
            return ps[0].device
    return torch.device("cpu")


def _step_op(family: str, backend: str):
    if backend == "triton":
        from .triton_kernels import optim as triton_optim

        return getattr(triton_optim, f"{family}_step_")
    return getattr(torch.ops.dpkernels_C, f"{family}_step_")


class _Fused:
    """The fused step of a reference optimizer: clip on the backend, then one family op per group."""

    #: the family op's state buffers, in schema order (csrc/ops.cpp)
    _STATE_KEYS: tuple[str, ...] = ()

    def __init__(self, *args, backend: str = "auto", rng: str = "philox", secure_key: int | None = None, **kwargs):
        if rng not in RNGS:
            raise ValueError(f"unknown rng {rng!r}; expected one of {RNGS}")
        if secure_key is not None and rng == "philox":
            raise ValueError("secure_key is the ChaCha20 key of rng='chacha20'; the Philox key is seed=")
        # ChaCha20's 256-bit key (docs/RNG.md §6), fresh from the OS CSPRNG unless given.
        self.secure_key = (fresh_key() if secure_key is None else secure_key) if rng == "chacha20" else None
        # Resolved before the base constructor creates the state: its layout depends on it.
        groups = list(args[0])
        self.backend = _backend.resolve(backend, _first_device(groups))
        super().__init__(groups, *args[1:], **kwargs)
        self.rng = rng
        if rng != "philox" and self.correlated_noise is not None:
            raise ValueError("correlated_noise draws Philox noise; rng='chacha20' cannot be combined with it")

    def _check_params(self, params):
        super()._check_params(params)
        if self.backend == "reference":
            return
        for idx, p in enumerate(params):
            if p.dtype not in _NATIVE_DTYPES:
                raise TypeError(
                    f"parameter {idx} has dtype {p.dtype}; backend {self.backend!r} updates float32, float16 "
                    "and bfloat16 parameters (float64 runs on backend='reference')"
                )
            if not p.is_contiguous():
                raise ValueError(f"parameter {idx} (shape {tuple(p.shape)}) must be contiguous for a fused step")

    def _state_layout(self):
        # The fused backends share one layout (rings, reciprocals kept for the next clip pass).
        return "reference" if self.backend == "reference" else "fused"

    # ----------------------------------------------------------------------------------------
    # Dispatch
    # ----------------------------------------------------------------------------------------

    def _global_state(self):
        return {**super()._global_state(), "secure_key": self.secure_key}

    def _load_global_state(self, dp):
        super()._load_global_state(dp)
        self.secure_key = dp["secure_key"]

    def _update(self, params, grad_sets, t, noise):
        if noise is None and self.rng != "philox" and self.noise_multiplier > 0:
            noise = self._secure_noise(params, t, self._noise_clip())
        if self.backend == "reference":
            return super()._update(params, grad_sets, t, noise)
        self._fused_update(params, grad_sets, t, noise)

    def _fused_update(self, params, grad_sets, t, noise) -> None:
        raise NotImplementedError

    def _update_from_sums(self, params, sums, t, noise, delta):
        if noise is None and self.rng != "philox" and self.noise_multiplier > 0:
            noise = self._secure_noise(params, t, delta)
        if self.backend == "reference":
            return super()._update_from_sums(params, sums, t, noise, delta)
        self._fused_from_sums(params, [s.contiguous() for s in sums], t, noise, delta)

    def _fused_from_sums(self, params, sums, t, noise, delta) -> None:
        """The fused pass from fp32 clipped sums of sensitivity ``delta`` (the optimizers whose
        ``_accepts_sums`` is set)."""
        raise NotImplementedError

    def _secure_noise(self, params, t, delta) -> list[Tensor]:
        """``σ·Δ·z`` from the secure generator, pre-drawn (the unit noise; each family scales it)."""
        total = sum(p.numel() for p in params)
        z = gaussian_noise(total, std=1.0, seed=self.secure_key, step=t, rng=self.rng, device=params[0].device)
        std = self.noise_multiplier * delta
        parts = torch.split(z, [p.numel() for p in params])
        return [std * part.view(p.shape) for part, p in zip(parts, params, strict=True)]

    def _noise_clip(self) -> float:
        """The clip norm the noise is scaled by (DP²'s adaptive phase overrides it)."""
        return self.max_grad_norm

    # ----------------------------------------------------------------------------------------
    # Stage 1: the clipped sum on the backend
    # ----------------------------------------------------------------------------------------

    def _clip_sums(self, grad_sets, C, *, coeffs=(1.0,), shift=None, scale=None, norm_scale=1.0):
        """``(S, c)``: fp32 clipped sums per parameter and the per-sample weights ``[B]``."""
        flat = [g.contiguous() for gs in grad_sets for g in gs]
        sums, w = _clipped_sums(
            flat, coeffs, [C], self.mode, self.r, shift or [], scale or [], False, "raise", self.backend,
            norm_scale=norm_scale,
        )  # fmt: skip
        return sums, w[:, 0]

    # ----------------------------------------------------------------------------------------
    # Stage 2: one family op per parameter group
    # ----------------------------------------------------------------------------------------

    def _groups(self, params):
        """``(group, slice, offset)``: each group's parameters and the global index of its first element."""
        start = offset = 0
        for group in self.param_groups:
            sl = slice(start, start + len(group["params"]))
            yield group, sl, offset
            offset += sum(p.numel() for p in params[sl])
            start = sl.stop

    def _run(self, family: str, params, sums, hyper_of, noise, std, t, *, state=None, extra=None):
        """Launch ``family``'s op once per parameter group; returns the ops' results.

        ``hyper_of(group)``: the family's scalars; ``state(group, sl)``: its fp32 state buffers in
        schema order (default: the keys of :attr:`_STATE_KEYS`); ``noise``: a pre-drawn list, or None
        for in-pass Philox noise (correlated when the optimizer has a mechanism: its buffers and
        coefficients go to the op); ``extra(group, sl)``: arguments between ``state`` and ``noise``
        (the sgd family's direction filter and past iterates).
        """
        op = _step_op(family, self.backend)
        mech = self.correlated_noise
        bufs, coeffs = [], _INDEPENDENT
        if noise is None and mech is not None:
            bufs, co = mech.plan(t, [p.shape for p in params], params[0].device)
            coeffs = _filter_coeffs(co)
        out = []
        for group, sl, offset in self._groups(params):
            ps = params[sl]
            if not ps:  # an empty param group (torch allows them): nothing to launch
                continue
            st = state(group, sl) if state else [self.state[p][key] for key in self._STATE_KEYS for p in ps]
            given = [] if noise is None else [nu.float().contiguous() for nu in noise[sl]]
            noise_state = [b for buf in bufs for b in buf[sl]]
            hyper = [float(h) for h in hyper_of(group)]
            args = (ps, sums[sl], st, *(extra(group, sl) if extra else ()), given, noise_state, coeffs)
            out.append(op(*args, float(std), _signed64(self.seed), t, 0, offset, hyper))
        if noise is None and mech is not None:
            mech.advance()
        return out

    def _group_of(self, p: Tensor) -> dict:
        return next(g for g in self.param_groups if any(q is p for q in g["params"]))


def _bias(beta: float, t: int) -> float:
    """``1 − β^t`` in float64."""
    return 1.0 - beta**t


# ============================================================================================
# sgd family: DP-SGD (momentum, weight decay), DP-PSAC, DP-PMLF
# ============================================================================================


class DPSGD(_Fused, ref.DPSGD):
    __doc__ = ref.DPSGD.__doc__

    def _fused_update(self, params, grad_sets, t, noise):
        sums, _ = self._clip_sums(grad_sets, self.max_grad_norm)
        self._fused_from_sums(params, sums, t, noise, self.max_grad_norm)

    def _fused_from_sums(self, params, sums, t, noise, delta):
        inv_b = 1.0 / self.expected_batch_size
        # Heavy-ball buf ← μ·buf + d is linear_filter_'s y = 1·d + μ·S, S ← y.
        self._run(
            "sgd", params, sums, lambda g: (inv_b, g["lr"], g["weight_decay"]), noise, self.noise_multiplier * delta, t,
            state=lambda g, sl: [self.state[p]["momentum_buffer"] for p in params[sl]] if g["momentum"] else [],
            extra=lambda g, sl: ([1.0, 1.0, g["momentum"], 0.0, 1.0, 0.0] if g["momentum"] else _INDEPENDENT, []),
        )  # fmt: skip


class DPPMLF(_Fused, ref.DPPMLF):
    __doc__ = ref.DPPMLF.__doc__

    def __init__(self, *args, **kwargs):
        self._ring = 0  # steps taken: ring position of the histories
        super().__init__(*args, **kwargs)

    def _slots(self, n: int) -> list[int]:
        """Ring slots of a history of length ``n``, newest first (slot of ``x_{t−1}``, ``x_{t−2}``, ...)."""
        return [(self._ring - 1 - j) % n for j in range(n)]

    def _newest_first(self, hist: Tensor) -> Tensor:
        if self.backend == "reference" or not hist.shape[0]:  # the reference shifts its stacks
            return hist
        return hist[self._slots(hist.shape[0])]

    def history(self, p: Tensor, key: str) -> Tensor:
        """``m_hist``/``vbar_hist``/``past`` of ``p`` newest first, the reference's layout."""
        return self._newest_first(self.state[p][key])

    def past_params(self):
        if self.backend == "reference":
            return super().past_params()
        params = self._params()
        return [[self.state[p]["past"][slot] for p in params] for slot in self._slots(self.k - 1)]

    def _global_state(self):
        return {**super()._global_state(), "ring": self._ring}

    def _load_global_state(self, dp):
        super()._load_global_state(dp)
        self._ring = int(dp["ring"])

    def _fused_update(self, params, grad_sets, t, noise):
        a, b = self.filter_a, self.filter_b
        na, nb = len(a), len(b) - 1
        C, inv_b = self.max_grad_norm, 1.0 / self.expected_batch_size
        sums, _ = self._clip_sums(grad_sets, C, coeffs=self.momentum_coeffs)
        c_t = -sum(a_tau * c for a_tau, c in zip(a, self._c_hist, strict=False)) + sum(b[:t])
        m_slots, v_slots = self._slots(na), self._slots(nb)
        # Direction filter over [m_{t−1}, …, m_{t−na}, v̄_{t−1}, …, v̄_{t−nb}]: y = b₀ v̄ − Σ a_τ m + Σ b_τ v̄;
        # the oldest m slot is read, then overwritten with y; the oldest v̄ slot with x = v̄.
        K = na + nb
        c = [-x for x in a] + list(b[1:])
        d = [1.0] * K
        e = [0.0] * K
        f = [0.0] * K
        if na:
            d[na - 1], e[na - 1] = 0.0, 1.0
        if nb:
            d[K - 1], f[K - 1] = 0.0, 1.0
        coeffs = [b[0], 1.0 / c_t, *c, *d, *e, *f]

        def state(group, sl):
            ps = params[sl]
            return [self.state[p]["m_hist"][i] for i in m_slots for p in ps] + [
                self.state[p]["vbar_hist"][i] for i in v_slots for p in ps
            ]

        def extra(group, sl):
            past = [self.state[p]["past"][self._ring % (self.k - 1)] for p in params[sl]] if self.k > 1 else []
            return coeffs, past

        self._run(
            "sgd", params, sums, lambda g: (inv_b, g["lr"], 0.0), noise, self.noise_multiplier * C, t,
            state=state, extra=extra,
        )  # fmt: skip
        self._c_hist = ([c_t] + self._c_hist)[:na]
        self._ring += 1


# ============================================================================================
# dp2 family: DP² (delayed preconditioners)
# ============================================================================================


class DP2(_Fused, ref.DP2):
    __doc__ = ref.DP2.__doc__

    _STATE_KEYS = ("G", "inv_d")

    def _init_state(self, p):
        st = super()._init_state(p)
        if self.backend == "reference":
            return st
        # 1/(√v + ε), written at each refresh (it is first read after one).
        st["inv_d"] = 1 / (st["v"].sqrt() + self._group_of(p)["eps"])
        return st

    def _fused_update(self, params, grad_sets, t, noise):
        pos = (t - 1) % (self.s1 + self.s2)
        inv_b = 1.0 / self.expected_batch_size
        if pos < self.s1:
            C = self.max_grad_norm
            sums, _ = self._clip_sums(grad_sets, C)
            hyper = lambda g: (inv_b, g["lr"], 0)  # noqa: E731
        else:
            C = self.max_grad_norm2
            groups = self._groups_of()
            if pos == self.s1:  # the refresh, stored only once the clipped sum is formed (all or nothing)
                v = self._refreshed_v(params, groups)
                inv_d = [1 / (vv.sqrt() + group["eps"]) for vv, group in zip(v, groups, strict=True)]
            else:
                inv_d = [self.state[p]["inv_d"] for p in params]
            sums, _ = self._clip_sums(grad_sets, C, scale=inv_d)
            if pos == self.s1:
                self._commit_refresh(params, v)
                for p, d in zip(params, inv_d, strict=True):
                    self.state[p]["inv_d"] = d
            hyper = lambda g: (inv_b, g["lr2"], 1)  # noqa: E731
        self._run("dp2", params, sums, hyper, noise, self.noise_multiplier * C, t)

    def _noise_clip(self):
        pos = self._step % (self.s1 + self.s2)  # position of the step being taken
        return self.max_grad_norm if pos < self.s1 else self.max_grad_norm2


# ============================================================================================
# adam family: DP-Adam(W), DP-AdamBC, scale-then-privatize
# ============================================================================================


class _FusedAdam(_Fused):
    _STATE_KEYS = ("exp_avg", "exp_avg_sq")
    _VARIANT = 0  # optim_math.h AdamVariant

    def _clip_scale(self, params):
        return None

    def _hyper(self, group, t, delta) -> tuple:
        b1, b2 = group["betas"]
        return (
            1.0 / self.expected_batch_size, group["lr"], b1, 1 - b1, b2, 1 - b2, _bias(b1, t), _bias(b2, t),
            _bias(b2, t - 1), group.get("eps", group.get("eps2", 0.0)),
            1 - group["lr"] * group["weight_decay"] if group["weight_decay"] else 1.0,
            self._phi(delta) if self._VARIANT == 1 else 0.0, group.get("gamma_prime", 0.0), group.get("eps1", 0.0),
            self._VARIANT,
        )  # fmt: skip

    def _fused_update(self, params, grad_sets, t, noise):
        sums, _ = self._clip_sums(grad_sets, self.max_grad_norm, scale=self._clip_scale(params))
        self._fused_from_sums(params, sums, t, noise, self.max_grad_norm)

    def _fused_from_sums(self, params, sums, t, noise, delta):
        std = self.noise_multiplier * delta
        self._run("adam", params, sums, lambda g: self._hyper(g, t, delta), noise, std, t)


class DPAdam(_FusedAdam, ref.DPAdam):
    __doc__ = ref.DPAdam.__doc__


class DPAdamBC(_FusedAdam, ref.DPAdamBC):
    __doc__ = ref.DPAdamBC.__doc__
    _VARIANT = 1


class DPAdamSTP(_FusedAdam, ref.DPAdamSTP):
    __doc__ = ref.DPAdamSTP.__doc__
    _STATE_KEYS = ("exp_avg", "exp_avg_sq", "scale")
    _VARIANT = 2

    def _init_state(self, p):
        st = super()._init_state(p)
        if self.backend == "reference":
            return st
        # The clip scale s_1 = 1/(√v̂_0 + ε₁) = 1/ε₁; each step writes the next one.
        st["scale"] = 1 / (torch.zeros_like(st["exp_avg_sq"]) + self._group_of(p)["eps1"])
        return st

    def _clip_scale(self, params):
        return [self.state[p]["scale"] for p in params]


# ============================================================================================
# macadam family: DP-MacAdam(-BC)
# ============================================================================================


class DPMacAdam(_Fused, ref.DPMacAdam):
    __doc__ = ref.DPMacAdam.__doc__

    _STATE_KEYS = ("exp_avg", "exp_avg_sq", "s", "b_unnorm", "inv_b_unnorm", "shift")

    def __init__(self, *args, **kwargs):
        self.bscale = 1.0  # b = b_unnorm · bscale; bscale = √(Σ√ŝ) of the last update
        super().__init__(*args, **kwargs)

    def _init_state(self, p):
        st = super()._init_state(p)
        if self.backend == "reference":
            return st
        b0 = st.pop("b")
        st.update(b_unnorm=b0, inv_b_unnorm=1 / b0, shift=torch.zeros_like(b0))
        return st

    def b(self, p: Tensor) -> Tensor:
        """``b_{t}`` of ``p``: the reference's ``state["b"]``."""
        if self.backend == "reference":
            return self.state[p]["b"]
        return self.state[p]["b_unnorm"] * self.bscale

    def _global_state(self):
        return {**super()._global_state(), "bscale": self.bscale}

    def _load_global_state(self, dp):
        super()._load_global_state(dp)
        self.bscale = float(dp["bscale"])

    def _fused_update(self, params, grad_sets, t, noise):
        C, B, sigma = self.max_grad_norm, self.expected_batch_size, self.noise_multiplier
        sums, c = self._clip_sums(
            grad_sets, C, shift=[self.state[p]["shift"] for p in params],
            scale=[self.state[p]["inv_b_unnorm"] for p in params], norm_scale=1.0 / self.bscale,
        )  # fmt: skip
        c_total = c.sum().item()
        bc = 0 if not self.bias_correction else (1 if self.bc_scale == "paper" else 2)
        kappas = {id(g): ref.macadam_kappa(t, g["betas"][0]) for g in self.param_groups}

        def hyper(g):
            b1, b2 = g["betas"]
            return (
                1.0 / B, g["lr"], b1, 1 - b1, b2, 1 - b2, _bias(b1, t), _bias(b2, t), g["eps"], (sigma * C / B) ** 2,
                g["gamma_prime"], g["h1"], g["h2"], kappas[id(g)], c_total, self.bscale, bc,
            )  # fmt: skip

        sums_sqrt = self._run("macadam", params, sums, hyper, noise, sigma * C, t)
        if any(kappas.values()):
            self.bscale = math.sqrt(sum(float(x) for x in sums_sqrt))
