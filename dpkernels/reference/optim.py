"""Pure-PyTorch reference DP optimizers: the semantics the fused optimizer-step kernels must match.

Every optimizer here is a ``torch.optim.Optimizer`` that reads Opacus-style per-sample gradients
from ``p.grad_sample`` (``[B, *p.shape]``) and runs, in ``step()``::

    clip  (flat over all parameters of the optimizer; dpkernels.reference.clip, any clip mode)
    sum   S = Σ_i c_i v_i                                   (raw gradients, DESIGN.md §2)
    noise ν = σ·Δ·z_t   added to the SUM                     (Δ = C, the add/remove sensitivity)
    mean  (S + ν) / B    B = expected_batch_size             (Opacus, Poisson sampling)
    update                                                   (the algorithm below)

Noise. ``z_t`` is fp32 ``N(0, 1)`` from :func:`dpkernels.reference.noise.standard_normal` with key
``seed`` and counter ``(e, step=t, stream=0)``, where ``t`` is the 1-based step counter and ``e``
the global flat element index over the optimizer's parameters in ``param_groups`` order. It is
produced by one method, :meth:`DPOptimizer.noise`, which a correlated-noise mechanism replaces
(returning ``(C⁻¹z)_t``). The rounding is that of :func:`dpkernels.privatize`: ``ν = (σΔ)·z`` in
fp32, then ``S + ν``, then ``· (1/B)``, so DPSGD's private gradient equals ``privatize`` bit for
bit. ``step(noise=[...])`` replaces ``ν`` by a pre-drawn list (shaped like the parameters, in the
space where the algorithm adds its noise), for exact tests.

State. D-sized state is fp32 for fp32/fp16/bf16 parameters and fp64 for fp64 parameters; the
update is computed in that dtype and rounded once into the parameter. ``state_dict()`` carries the
per-parameter state, the step counter, the seed and any global state (entry ``"dp"``);
``load_state_dict`` restores it without re-casting the state to the parameter dtype, so a resumed
run reproduces the uninterrupted one bit for bit.

Hyper-parameters (``lr``, betas, eps, weight decay, ...) live in ``param_groups`` (so LR schedulers
work); noise, clipping, batch size, seed and the global structure of an algorithm (DP² schedule,
PMLF momentum and filter) are attributes of the optimizer.

Papers: DP-SGD (Abadi et al. 2016); DP-PSAC (Xia et al., AAAI-23; seeds/003); DP-Adam and
DP-AdamBC (Tang et al. 2024; seeds/000 eq. 4–8); scale-then-privatize (Ganesh, McMahan, Thakurta,
Alg. 8; seeds/001); DP-MacAdam (Tasnim, Sankar, Kosut 2026; seeds/000); DP² (Li et al. 2023;
seeds/004); DP-PMLF (Xu et al. 2026; seeds/002). The decisions taken where a paper is silent or
ambiguous are listed in docs/ALGORITHMS.md ("Optimizers").
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .. import _validate
from ..clip import _check_mode
from ..noise import _check_counter, fresh_seed
from . import clip as ref_clip
from .noise import standard_normal

__all__ = [
    "DPOptimizer",
    "DPSGD",
    "DPAdam",
    "DPAdamBC",
    "DPAdamSTP",
    "DPMacAdam",
    "DP2",
    "DPPMLF",
    "PMLF_PRESETS",
    "macadam_kappa",
    "pmlf_momentum_coeffs",
    "pmlf_bias_correction",
]


def _state_dtype(p: Tensor) -> torch.dtype:
    return torch.float64 if p.dtype == torch.float64 else torch.float32


_check_number = _validate.real


def _check_betas(betas) -> tuple[float, float]:
    if not isinstance(betas, Sequence) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    return (_check_number("betas[0]", betas[0], low=0.0, high=1.0, high_open=True),
            _check_number("betas[1]", betas[1], low=0.0, high=1.0, high_open=True))  # fmt: skip


class DPOptimizer(torch.optim.Optimizer):
    """Base class: validation, per-sample gradient intake, clipping, noise, state (de)serialisation.

    Subclasses implement :meth:`_update`, called once per ``step()`` with the 1-based step ``t``.

    A step is all or nothing: every parameter, per-sample gradient, noise tensor and counter is
    checked before :meth:`_update` runs, and :meth:`_update` forms everything that can still fail
    (the clipped sum and its non-finite check) before it writes a parameter or a state entry. A
    step that raises leaves the parameters, the state, the noise counter and (through
    ``make_private``) the accountant exactly as they were, so a retry never reuses noise.
    """

    #: number of per-sample gradient sets read from ``p.grad_sample`` (DP-PMLF: ``k``)
    _num_grad_sets: int = 1
    #: ``p.grad_sample`` is a list of ``_num_grad_sets`` tensors (DP-PMLF, even for k = 1)
    _grad_sample_is_list: bool = False
    #: the clip does not depend on optimizer state: :meth:`step_from_sums` is allowed
    _accepts_sums: bool = False

    def __init__(
        self,
        params,
        defaults,
        *,
        noise_multiplier,
        max_grad_norm,
        expected_batch_size,
        mode,
        r,
        seed,
        correlated_noise=None,
    ):
        _check_number("lr", defaults.get("lr"), low=0.0)
        super().__init__(params, defaults)
        self.set_step_params(noise_multiplier, max_grad_norm, expected_batch_size)
        self.mode = mode
        self.r = _check_mode(mode, r)
        self.correlated_noise = self._check_correlated(correlated_noise, seed)
        if correlated_noise is not None:
            self.seed = correlated_noise.seed
        else:
            self.seed = fresh_seed() if seed is None else _validate.integer("seed", seed, low=0, high=2**64)
        params = self._params()
        if not params:
            raise ValueError(f"{type(self).__name__} got no parameters (every param group is empty)")
        self._check_params(params)
        self._step = 0
        for p in params:
            self.state[p] = self._init_state(p)

    def add_param_group(self, param_group: dict) -> None:
        """``torch.optim.Optimizer.add_param_group``, with the parameters checked (and their state
        created) at once: a group the optimizer cannot step is refused here, not in a later step."""
        n = len(self.param_groups)
        super().add_param_group(param_group)
        if not hasattr(self, "_step"):  # called by torch's constructor: checked once, in __init__
            return
        try:
            self._check_params(self._params())
        except Exception:
            del self.param_groups[n]
            raise
        for p in self.param_groups[n]["params"]:
            self.state[p] = self._init_state(p)

    def _check_params(self, params: list[Tensor]) -> None:
        """Raise for a parameter the step cannot update: not floating point, or on another device
        than the others (the noise is indexed by one flat counter over all of them)."""
        for idx, p in enumerate(params):
            if not p.is_floating_point():
                raise TypeError(f"parameter {idx} has dtype {p.dtype}; every parameter must be floating point")
            if p.device != params[0].device:
                raise ValueError(
                    f"parameter {idx} is on {p.device} but parameter 0 is on {params[0].device}; all parameters "
                    "of a DP optimizer must be on one device (one flat noise index)"
                )

    # ----------------------------------------------------------------------------------------
    # Hooks for subclasses
    # ----------------------------------------------------------------------------------------

    def _init_state(self, p: Tensor) -> dict:
        return {}

    def _update(self, params: list[Tensor], grad_sets: list[list[Tensor]], t: int, noise) -> None:
        raise NotImplementedError

    def _global_state(self) -> dict:
        """Global (not per-parameter) state saved in ``state_dict()["dp"]``, besides step and seed."""
        return {}

    def _load_global_state(self, dp: dict) -> None:
        pass

    # ----------------------------------------------------------------------------------------
    # Public API
    # ----------------------------------------------------------------------------------------

    @staticmethod
    def _check_correlated(mech, seed):
        """A :class:`dpkernels.BLTNoise`/:class:`dpkernels.BandedNoise` that supplies ``z``'s correlated
        version: unit std (the optimizer scales by ``σ·C``), its first step = the optimizer's step 1,
        and its seed is the optimizer's noise seed."""
        if mech is None:
            return None
        from ..correlated import _StreamingNoise

        if not isinstance(mech, _StreamingNoise):
            raise TypeError(f"correlated_noise must be a BLTNoise or BandedNoise, got {type(mech).__name__}")
        if mech.std != 1.0:
            raise ValueError(f"correlated_noise must have std=1 (the optimizer scales it by σ·C), got {mech.std}")
        if mech.next_step != 1:
            raise ValueError(
                f"correlated_noise must start at the optimizer's first step: construct it with start_step=1 "
                f"(its next step is {mech.next_step})"
            )
        if mech.stream != 0:
            raise ValueError(f"correlated_noise must draw from stream 0 (the gradient noise), got {mech.stream}")
        if seed is not None and seed != mech.seed:
            raise ValueError("pass the noise seed to the correlated_noise mechanism only (it differs from seed=)")
        return mech

    @property
    def steps_taken(self) -> int:
        """Number of completed ``step()`` calls; the next step uses noise counter ``steps_taken + 1``."""
        return self._step

    def noise(self, t: int) -> list[Tensor]:
        """Unit noise ``z_t`` for step ``t``: fp32 ``N(0, 1)``, one tensor per parameter.

        Philox (docs/RNG.md) with key ``seed`` and counter ``(e, t, stream=0)``, ``e`` the global
        flat index over the parameters in ``param_groups`` order; identical to the noise that
        ``dpkernels.privatize(..., seed=seed, step=t)`` adds. A correlated-noise mechanism
        overrides this method to return ``(C⁻¹z)_t`` instead.
        """
        params = self._params()
        if self.correlated_noise is not None:
            return self.correlated_noise.noise([p.shape for p in params], t, device=params[0].device)
        z = standard_normal(sum(p.numel() for p in params), seed=self.seed, step=t, device=params[0].device)
        return [part.view(p.shape) for part, p in zip(torch.split(z, [p.numel() for p in params]), params, strict=True)]

    @torch.no_grad()
    def step(self, closure=None, *, noise: Sequence[Tensor] | None = None):
        """One private step from ``p.grad_sample``; see the class docstring of each optimizer.

        ``noise``: optional pre-drawn noise on the clipped sum (``σ·Δ·z``, one tensor per
        parameter, shaped like it), used instead of :meth:`noise`, as ``privatize(noise=...)``.
        All or nothing: a step that raises changes nothing (class docstring).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = self._params()
        self._check_params(params)
        grad_sets = self._grad_sets(params)
        if noise is not None:
            if self.correlated_noise is not None:
                raise ValueError(
                    "step(noise=...) cannot be combined with correlated_noise (its state would skip a step)"
                )
            noise = self._check_noise(noise, params)
        t = self._begin_step(params)
        self._update(params, grad_sets, t, noise)
        self._step = t
        return loss

    @torch.no_grad()
    def step_from_sums(
        self, sums: Sequence[Tensor], *, sensitivity: float, noise: Sequence[Tensor] | None = None
    ) -> None:
        """One step from a clipped sum ``S`` formed elsewhere (per-layer clipping, micro-batches, ghost
        clipping, an all-reduce): ``g̃ = (S + ν)·(1/B)`` with ``ν = σ·Δ·z_t`` (or ``noise``), then the
        update of :meth:`step`. Only for algorithms whose clip does not depend on their state.

        Args:
            sums: one tensor per parameter, shaped like it, in the state dtype (fp32; fp64 for fp64
                parameters).
            sensitivity: ``Δ``, the add/remove ℓ2 sensitivity of ``sums`` (required: the optimizer
                cannot know how ``S`` was clipped): ``C`` for flat clipping at ``C``,
                ``‖(C_1, …, C_L)‖₂`` for per-layer bounds ``C_l``. The noise std is ``σ·Δ``; too small a
                value is a privacy failure no check can see.
            noise: pre-drawn ``σ·Δ·z`` per parameter, used instead of the generator.

        ``noise_multiplier`` and ``expected_batch_size`` are read at each call (see
        :meth:`set_step_params`); ``max_grad_norm`` is not used.
        """
        if not self._accepts_sums:
            raise NotImplementedError(
                f"{type(self).__name__} clips with its own state (or several gradient sets); it has no step_from_sums"
            )
        delta = _check_number("sensitivity", sensitivity, low=0.0, low_open=True)
        _validate.fp32_scale("noise_multiplier · sensitivity", self.noise_multiplier * delta)
        params = self._params()
        self._check_params(params)
        if isinstance(sums, Tensor) or not isinstance(sums, Sequence) or len(sums) != len(params):
            raise ValueError(f"sums must be a list of {len(params)} tensors shaped like the parameters")
        for idx, (s, p) in enumerate(zip(sums, params, strict=True)):
            if not isinstance(s, Tensor) or s.dtype != _state_dtype(p):
                raise TypeError(f"sums[{idx}] must be a {_state_dtype(p)} tensor (the state dtype of parameter {idx})")
            if s.shape != p.shape or s.device != p.device:
                raise ValueError(
                    f"sums[{idx}] is {tuple(s.shape)} on {s.device}; expected {tuple(p.shape)} on {p.device}"
                )
        if noise is not None:
            if self.correlated_noise is not None:
                raise ValueError("step_from_sums(noise=...) cannot be combined with correlated_noise")
            noise = self._check_noise(noise, params)
        t = self._begin_step(params)
        self._update_from_sums(params, list(sums), t, noise, delta)
        self._step = t

    def _begin_step(self, params: list[Tensor]) -> int:
        """The counter ``t`` of the step about to run (checked), with state for every parameter."""
        t = self._step + 1
        _check_counter(self.seed, t, 0, 0)
        for p in params:
            if not self.state[p]:  # a parameter whose state a loaded state_dict did not hold
                self.state[p] = self._init_state(p)
        return t

    def check_step_params(self, noise_multiplier, max_grad_norm, expected_batch_size) -> tuple[float, float, int]:
        """``(σ, C, B)`` as :meth:`set_step_params` would set them, or the constructor's error."""
        sigma = _check_number("noise_multiplier", noise_multiplier, low=0.0)
        C = _check_number("max_grad_norm", max_grad_norm, low=0.0, low_open=True)
        B = _validate.integer("expected_batch_size", expected_batch_size, low=1)
        _validate.fp32_scale("noise_multiplier · max_grad_norm", sigma * C)
        return sigma, C, B

    def set_step_params(self, noise_multiplier: float, max_grad_norm: float, expected_batch_size: int) -> None:
        """Set ``σ``, ``C`` (= ``Δ``, the noise scale of :meth:`step`) and ``B`` for the next step, with
        the constructor's checks; all three are checked before any is set."""
        checked = self.check_step_params(noise_multiplier, max_grad_norm, expected_batch_size)
        self.noise_multiplier, self.max_grad_norm, self.expected_batch_size = checked

    def _update_from_sums(self, params: list[Tensor], sums: list[Tensor], t: int, noise, delta: float) -> None:
        raise NotImplementedError

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears ``p.grad`` and ``p.grad_sample`` (Opacus's ``zero_grad``)."""
        super().zero_grad(set_to_none)
        for p in self._params():
            if set_to_none or not isinstance(getattr(p, "grad_sample", None), Tensor):
                p.grad_sample = None
            else:
                p.grad_sample.zero_()

    def _state_layout(self) -> str:
        """Name of the layout of ``state``: a checkpoint loads only into the same layout."""
        return "reference"

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["dp"] = {
            "class": type(self).__name__,
            "layout": self._state_layout(),
            "step": self._step,
            "seed": self.seed,
            **self._global_state(),
        }
        if self.correlated_noise is not None:
            sd["dp"]["correlated_noise"] = self.correlated_noise.state_dict()
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a :meth:`state_dict`. Everything is checked first (class, state layout, step, seed,
        global fields, every parameter's state keys, shapes and dtypes); a state_dict that fails a
        check raises ``ValueError`` naming the field and leaves the optimizer unchanged."""
        name = type(self).__name__
        if not isinstance(state_dict, dict) or not isinstance(state_dict.get("dp"), dict):
            raise ValueError(f"state_dict has no 'dp' entry; it was not saved by a {name}")
        dp = state_dict["dp"]
        if dp.get("class") != name:
            raise ValueError(
                f"state_dict['dp']['class'] is {dp.get('class')!r}: it was saved by another optimizer, not a {name}"
            )
        if dp.get("layout") != self._state_layout():
            raise ValueError(
                f"state_dict['dp']['layout'] is {dp.get('layout')!r} but this optimizer keeps the "
                f"{self._state_layout()!r} state layout; load it on a backend of that layout"
            )
        step = _validate.integer("state_dict['dp']['step']", dp.get("step"), low=0, high=2**32)
        seed = _validate.integer("state_dict['dp']['seed']", dp.get("seed"), low=0, high=2**64)
        missing = sorted(self._global_state().keys() - dp.keys())
        if missing:
            raise ValueError(f"state_dict['dp'] lacks the field(s) {missing} of a {name}")
        if (self.correlated_noise is None) != ("correlated_noise" not in dp):
            raise ValueError("state_dict and optimizer disagree on whether correlated_noise is used")
        saved = state_dict.get("state")
        groups = state_dict.get("param_groups")
        if not isinstance(saved, dict) or not isinstance(groups, list):
            raise ValueError("state_dict lacks 'state' or 'param_groups'")
        ids = [i for g in groups for i in g["params"]]
        params = self._params()
        if len(ids) != len(params):
            raise ValueError(f"state_dict holds {len(ids)} parameters, the optimizer {len(params)}")
        for idx, (i, p) in enumerate(zip(ids, params, strict=True)):
            if i in saved:
                self._check_saved_state(idx, p, saved[i])
        state_dict = {k: v for k, v in state_dict.items() if k != "dp"}
        super().load_state_dict(state_dict)
        # torch casts floating state to the parameter dtype on load (lossy for bf16 parameters);
        # put back the saved tensors in their own dtype, on the parameter's device.
        for i, p in zip(ids, params, strict=True):
            if i in saved:
                self.state[p] = {
                    key: v.detach().clone().to(p.device) if isinstance(v, Tensor) else v for key, v in saved[i].items()
                }
        self._step, self.seed = step, seed
        if self.correlated_noise is not None:
            self.correlated_noise.load_state_dict(dp["correlated_noise"])
        self._load_global_state(dp)

    def _check_saved_state(self, idx: int, p: Tensor, saved: dict) -> None:
        """The saved state of parameter ``idx`` has this optimizer's keys, shapes and dtypes."""
        want = self._init_state(p)
        if not isinstance(saved, dict) or saved.keys() != want.keys():
            got = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
            raise ValueError(
                f"state_dict['state'] of parameter {idx} has keys {got}; a {type(self).__name__} keeps "
                f"{sorted(want)} (saved by another optimizer class or state layout?)"
            )
        for key, w in want.items():
            v = saved[key]
            if isinstance(w, Tensor) and not (isinstance(v, Tensor) and v.shape == w.shape and v.dtype == w.dtype):
                got = f"{tuple(v.shape)} {v.dtype}" if isinstance(v, Tensor) else type(v).__name__
                raise ValueError(
                    f"state_dict['state'] of parameter {idx}: {key!r} is {got}, expected {tuple(w.shape)} {w.dtype}"
                )

    # ----------------------------------------------------------------------------------------
    # Shared pieces
    # ----------------------------------------------------------------------------------------

    def _params(self) -> list[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _groups_of(self) -> list[dict]:
        """The param group of each parameter, in ``_params()`` order."""
        return [g for g in self.param_groups for _ in g["params"]]

    def _grad_sets(self, params: list[Tensor]) -> list[list[Tensor]]:
        """``k`` lists of ``L`` per-sample gradients ``[B, *p.shape]`` read from ``p.grad_sample``."""
        k = self._num_grad_sets
        sets: list[list[Tensor]] = [[] for _ in range(k)]
        B = None
        for idx, p in enumerate(params):
            gs = getattr(p, "grad_sample", None)
            what = f"parameter {idx} (shape {tuple(p.shape)})"
            if gs is None:
                raise ValueError(
                    f"{what} has no grad_sample; compute per-sample gradients (Opacus GradSampleModule, "
                    f"torch.func, or dpkernels.pmlf.pmlf_grad_samples) and set p.grad_sample before step()"
                )
            if not self._grad_sample_is_list:
                if not isinstance(gs, Tensor):
                    raise TypeError(
                        f"{what}: grad_sample must be one tensor [B, *p.shape], got {type(gs).__name__}; "
                        "concatenate micro-batches along dim 0 first"
                    )
                gs = [gs]
            elif isinstance(gs, Tensor) or not isinstance(gs, Sequence) or len(gs) != k:
                raise TypeError(
                    f"{what}: grad_sample must be a list of k={k} tensors [B, *p.shape] (gradients at "
                    f"x_t, x_(t-1), ..., x_(t-k+1)), got {type(gs).__name__}"
                    + (f" of length {len(gs)}" if isinstance(gs, Sequence) and not isinstance(gs, Tensor) else "")
                )
            for j, g in enumerate(gs):
                name = f"{what}: grad_sample" + (f"[{j}]" if self._grad_sample_is_list else "")
                if not isinstance(g, Tensor) or not g.is_floating_point():
                    raise TypeError(f"{name} must be a floating-point tensor")
                if g.dim() != p.dim() + 1 or g.shape[1:] != p.shape:
                    raise ValueError(f"{name} has shape {tuple(g.shape)}; expected [B, *{tuple(p.shape)}]")
                if g.device != p.device:
                    raise ValueError(f"{name} is on {g.device} but the parameter is on {p.device}")
                if g.dtype == torch.float64 and p.dtype != torch.float64:
                    raise TypeError(
                        f"{name} is float64 but the parameter is {p.dtype}; per-sample gradients are in the "
                        "parameter's precision (float64 ones only for float64 parameters)"
                    )
                if B is None:
                    B = g.shape[0]
                elif g.shape[0] != B:
                    raise ValueError(f"{name} has batch size {g.shape[0]} but parameter 0 has {B}")
                sets[j].append(g)
        return sets

    def _check_noise(self, noise, params: list[Tensor]) -> list[Tensor]:
        if isinstance(noise, Tensor) or not isinstance(noise, Sequence) or len(noise) != len(params):
            raise ValueError(f"noise must be a list of {len(params)} tensors shaped like the parameters")
        for idx, (nu, p) in enumerate(zip(noise, params, strict=True)):
            if not isinstance(nu, Tensor) or not nu.is_floating_point():
                raise TypeError(f"noise[{idx}] must be a floating-point tensor")
            if nu.shape != p.shape or nu.device != p.device:
                raise ValueError(
                    f"noise[{idx}] is {tuple(nu.shape)} on {nu.device}; expected {tuple(p.shape)} on {p.device}"
                )
        return list(noise)

    def _clip(self, grad_sets, C: float, coeffs=(1.0,), shift=None, scale=None) -> tuple[list[Tensor], Tensor]:
        """``(S, c)``: the clipped sum ``S^(l) = Σ_i c_i v_i^(l)`` per parameter (state dtype) and the
        per-sample weights ``c`` ``[B]``, from the reference clip pipeline (flat clipping)."""
        w, _ = ref_clip.clip_weights(grad_sets, C, coeffs, self.mode, self.r, shift, scale)
        sums = ref_clip.weighted_sum(grad_sets, w, coeffs)
        params = self._params()
        return [s.to(_state_dtype(p)) for s, p in zip(sums, params, strict=True)], w[:, 0]

    def _noise_on_sum(self, t: int, C: float, noise) -> list[Tensor]:
        """``ν = σ·C·z_t`` per parameter, or the injected ``noise``. The product is taken in the state
        dtype: fp32 as privatize (bit-identical), fp64 for fp64 parameters."""
        params = self._params()
        if noise is not None:
            return [nu.to(_state_dtype(p)) for nu, p in zip(noise, params, strict=True)]
        if self.noise_multiplier == 0.0 and self.correlated_noise is None:
            return [torch.zeros_like(p, dtype=_state_dtype(p)) for p in params]
        std = self.noise_multiplier * C
        return [std * z.to(_state_dtype(p)) for z, p in zip(self.noise(t), params, strict=True)]

    def _private_mean(self, sums: list[Tensor], nus: list[Tensor]) -> list[Tensor]:
        """``(S + ν) · (1/B)``, the rounding order of privatize."""
        inv_b = 1.0 / self.expected_batch_size
        return [(s + nu) * inv_b for s, nu in zip(sums, nus, strict=True)]

    @staticmethod
    def _write(p: Tensor, new: Tensor) -> None:
        """Round the updated parameter (computed in the state dtype) once into ``p``."""
        p.copy_(new.to(p.dtype))


# ============================================================================================
# DP-SGD (+ heavy-ball momentum, weight decay); DP-PSAC is DPSGD(mode="psac", r=0.1)
# ============================================================================================


class DPSGD(DPOptimizer):
    """DP-SGD (Abadi et al. 2016) with optional heavy-ball momentum and L2 weight decay.

    ``g̃ = (Σ_i c_i g_i + σ·C·z_t)/B``; then, as ``torch.optim.SGD`` (dampening 0, no Nesterov)::

        d = g̃ + λ θ          (weight_decay λ, coupled: added to the private gradient)
        buf = μ buf + d       (momentum μ; buf starts at 0, so buf_1 = d)
        θ ← θ − η buf

    DP-PSAC (seeds/003) is ``DPSGD(mode="psac", r=0.1)``: the same algorithm with the weight
    ``C/(n + r/(n + r))``. State: ``momentum_buffer`` (stays 0 when μ = 0).
    """

    def __init__(
        self,
        params,
        lr,
        *,
        noise_multiplier,
        max_grad_norm,
        expected_batch_size,
        mode="clip",
        r=None,
        seed=None,
        correlated_noise=None,
        momentum=0.0,
        weight_decay=0.0,
    ):
        _check_number("momentum", momentum, low=0.0, high=1.0, high_open=True)
        _check_number("weight_decay", weight_decay, low=0.0)
        super().__init__(
            params,
            dict(lr=lr, momentum=momentum, weight_decay=weight_decay),
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            expected_batch_size=expected_batch_size,
            mode=mode,
            r=r,
            seed=seed,
            correlated_noise=correlated_noise,
        )

    def _init_state(self, p):
        return {"momentum_buffer": torch.zeros_like(p, dtype=_state_dtype(p))}

    _accepts_sums = True

    def _update(self, params, grad_sets, t, noise):
        sums, _ = self._clip(grad_sets, self.max_grad_norm)
        self._update_from_sums(params, sums, t, noise, self.max_grad_norm)

    def _update_from_sums(self, params, sums, t, noise, delta):
        g_priv = self._private_mean(sums, self._noise_on_sum(t, delta, noise))
        for p, g, group in zip(params, g_priv, self._groups_of(), strict=True):
            theta = p.to(g.dtype)
            d = g + group["weight_decay"] * theta if group["weight_decay"] else g
            if group["momentum"]:
                d = group["momentum"] * self.state[p]["momentum_buffer"] + d
                self.state[p]["momentum_buffer"] = d
            self._write(p, theta - group["lr"] * d)


# ============================================================================================
# Adam family
# ============================================================================================


class _AdamBase(DPOptimizer):
    """Adam moments on a private gradient ``g̃``. The default ``_update`` is post-processing
    (``g̃ = (S + ν)/B``); subclasses give the denominator, or their own ``g̃``."""

    def _denominator(self, v_hat: Tensor, group: dict, delta: float) -> Tensor:
        """The Adam denominator for a private gradient whose noise std is ``σ·delta/B``."""
        raise NotImplementedError

    def _update(self, params, grad_sets, t, noise):
        sums, _ = self._clip(grad_sets, self.max_grad_norm)
        self._update_from_sums(params, sums, t, noise, self.max_grad_norm)

    def _update_from_sums(self, params, sums, t, noise, delta):
        g_priv = self._private_mean(sums, self._noise_on_sum(t, delta, noise))
        for p, g, group in zip(params, g_priv, self._groups_of(), strict=True):
            m_hat, v_hat = self._adam_moments(p, g, group, t)
            self._adam_step(p, m_hat, self._denominator(v_hat, group, delta), group)

    def _init_state(self, p):
        dt = _state_dtype(p)
        return {"exp_avg": torch.zeros_like(p, dtype=dt), "exp_avg_sq": torch.zeros_like(p, dtype=dt)}

    def _adam_moments(self, p, g, group, t) -> tuple[Tensor, Tensor]:
        """``m ← β1 m + (1−β1) g̃``, ``v ← β2 v + (1−β2) g̃²``; returns ``(m̂_t, v̂_t)``."""
        b1, b2 = group["betas"]
        st = self.state[p]
        st["exp_avg"] = b1 * st["exp_avg"] + (1 - b1) * g
        st["exp_avg_sq"] = b2 * st["exp_avg_sq"] + (1 - b2) * g * g
        return st["exp_avg"] / (1 - b1**t), st["exp_avg_sq"] / (1 - b2**t)

    def _adam_step(self, p, m_hat, denom, group) -> None:
        """``θ ← θ(1 − ηλ) − η m̂ / denom`` (decoupled weight decay λ, AdamW)."""
        theta = p.to(m_hat.dtype)
        if group.get("weight_decay"):
            theta = theta * (1 - group["lr"] * group["weight_decay"])
        self._write(p, theta - group["lr"] * m_hat / denom)


class DPAdam(_AdamBase):
    """DP-Adam by post-processing (seeds/000 eq. 4–5; seeds/001 Alg. 5), optional AdamW decay.

    ``g̃ = (Σ_i c_i g_i + σ·C·z_t)/B``, then Adam::

        m ← β1 m + (1−β1) g̃,   v ← β2 v + (1−β2) g̃²,   m̂ = m/(1−β1^t),   v̂ = v/(1−β2^t)
        θ ← θ(1 − ηλ) − η m̂ / (√v̂ + γ)            (γ = eps OUTSIDE the sqrt; λ = weight_decay)

    ``weight_decay`` is decoupled (Loshchilov & Hutter, ``torch.optim.AdamW``), applied to θ
    before the Adam step. State: ``exp_avg`` (m), ``exp_avg_sq`` (v).
    """

    def __init__(
        self,
        params,
        lr=1e-3,
        *,
        noise_multiplier,
        max_grad_norm,
        expected_batch_size,
        mode="clip",
        r=None,
        seed=None,
        correlated_noise=None,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
    ):
        betas = _check_betas(betas)
        _check_number("eps", eps, low=0.0)
        _check_number("weight_decay", weight_decay, low=0.0)
        super().__init__(
            params,
            dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay),
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            expected_batch_size=expected_batch_size,
            mode=mode,
            r=r,
            seed=seed,
            correlated_noise=correlated_noise,
        )

    _accepts_sums = True

    def _denominator(self, v_hat, group, delta):
        return v_hat.sqrt() + group["eps"]


class DPAdamBC(_AdamBase):
    """DP-AdamBC (Tang et al. 2024; seeds/000 eq. 8, seeds/001 Alg. 7): DP-Adam with the noise
    variance removed from the second moment::

        θ ← θ(1 − ηλ) − η m̂ / sqrt(max(v̂ − Φ, γ')),     Φ = (σC/B)²

    ``gamma_prime`` (γ') defaults to **1e-8**: the papers leave it open; Ganesh et al. tune the
    equivalent ``max(·, ε²)`` and report ε = 1e-4 best in all their settings, i.e. γ' = 1e-8.
    State as DPAdam.
    """

    _accepts_sums = True

    def __init__(
        self,
        params,
        lr=1e-3,
        *,
        noise_multiplier,
        max_grad_norm,
        expected_batch_size,
        mode="clip",
        r=None,
        seed=None,
        correlated_noise=None,
        betas=(0.9, 0.999),
        gamma_prime=1e-8,
        weight_decay=0.0,
    ):
        betas = _check_betas(betas)
        _check_number("gamma_prime", gamma_prime, low=0.0, low_open=True)
        _check_number("weight_decay", weight_decay, low=0.0)
        super().__init__(
            params,
            dict(lr=lr, betas=betas, gamma_prime=gamma_prime, weight_decay=weight_decay),
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            expected_batch_size=expected_batch_size,
            mode=mode,
            r=r,
            seed=seed,
            correlated_noise=correlated_noise,
        )

    @property
    def phi(self) -> float:
        """``Φ = (σ·C/B)²``, the variance of the noise in each coordinate of ``g̃`` of :meth:`step`."""
        return self._phi(self.max_grad_norm)

    def _phi(self, delta: float) -> float:
        """``(σ·Δ/B)²`` for noise std ``σ·Δ`` on the sum (``Δ``: C, or step_from_sums' sensitivity)."""
        return (self.noise_multiplier * delta / self.expected_batch_size) ** 2

    def _denominator(self, v_hat, group, delta):
        return torch.clamp(v_hat - self._phi(delta), min=group["gamma_prime"]).sqrt()


class DPAdamSTP(_AdamBase):
    """Scale-then-privatize Adam (Ganesh, McMahan, Thakurta, Alg. 8; seeds/001 §1.6).

    With ``s_t = 1/(√v̂_{t−1} + ε₁)`` (``v̂_0 = 0``, so ``s_1 = 1/ε₁``)::

        c_i = f(‖s_t ⊙ g_i‖)                       per-sample weight from the SCALED norm
        g̃  = (Σ_i c_i g_i + (√v̂_{t−1} + ε₁) ⊙ σ·C·z_t) / B
        Adam moments on g̃;   θ ← θ(1 − ηλ) − η m̂ / (√v̂_t + ε₂)

    This is the paper's ``(Σ clip(s⊙g_i, C) + σCz)/(B s)`` rewritten without the division by
    ``s`` (the [DERIVED] form of seeds/001 §1.6): the clip geometry is the ellipsoid
    ``‖s⊙g‖ ≤ C``, the noise is isotropic in the scaled space (same privacy as DP-Adam), and it is
    un-scaled by ``√v̂_{t−1} + ε₁`` per coordinate. ``v̂_{t−1} = v_{t−1}/(1−β2^{t−1})`` is recomputed
    from the state. Injected ``noise`` is the scaled-space ``σ·C·z``. State as DPAdam.
    """

    def __init__(
        self,
        params,
        lr=1e-3,
        *,
        noise_multiplier,
        max_grad_norm,
        expected_batch_size,
        mode="clip",
        r=None,
        seed=None,
        correlated_noise=None,
        betas=(0.9, 0.999),
        eps1=1e-8,
        eps2=1e-8,
        weight_decay=0.0,
    ):
        betas = _check_betas(betas)
        _check_number("eps1", eps1, low=0.0, low_open=True)
        _check_number("eps2", eps2, low=0.0)
        _check_number("weight_decay", weight_decay, low=0.0)
        super().__init__(
            params,
            dict(lr=lr, betas=betas, eps1=eps1, eps2=eps2, weight_decay=weight_decay),
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            expected_batch_size=expected_batch_size,
            mode=mode,
            r=r,
            seed=seed,
            correlated_noise=correlated_noise,
        )

    def _update(self, params, grad_sets, t, noise):
        C = self.max_grad_norm
        groups = self._groups_of()
        unscale = []  # √v̂_{t−1} + ε₁ = 1/s_t
        for p, group in zip(params, groups, strict=True):
            b2 = group["betas"][1]
            v = self.state[p]["exp_avg_sq"]
            v_hat_prev = v / (1 - b2 ** (t - 1)) if t > 1 else torch.zeros_like(v)
            unscale.append(v_hat_prev.sqrt() + group["eps1"])
        sums, _ = self._clip(grad_sets, C, scale=[1 / u for u in unscale])
        nus = [u * nu for u, nu in zip(unscale, self._noise_on_sum(t, C, noise), strict=True)]
        g_priv = self._private_mean(sums, nus)
        for p, g, group in zip(params, g_priv, groups, strict=True):
            m_hat, v_hat = self._adam_moments(p, g, group, t)
            self._adam_step(p, m_hat, self._denominator(v_hat, group, C), group)

    def _denominator(self, v_hat, group, delta):
        return v_hat.sqrt() + group["eps2"]


# ============================================================================================
# DP-MacAdam (and DP-MacAdamBC)
# ============================================================================================


def macadam_kappa(t: int, beta1: float) -> float:
    """``κ_t = 2(β1 − β1^t)/(1 + β1)``, DP-MacAdam's bias correction of ``s_t`` (seeds/000 §A.4);
    ``κ_1 = 0``."""
    return 2.0 * (beta1 - beta1**t) / (1.0 + beta1)


class DPMacAdam(_AdamBase):
    """DP-MacAdam (Tasnim, Sankar, Kosut 2026, Algorithm 1; seeds/000 §A.2); ``bias_correction=True``
    gives DP-MacAdamBC (§A.5).

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
    (exact algebra: ``Σ c_i w_i = (Σ c_i g_i − (Σ c_i) m̂)/b``), the form the fused kernels use.

    Decisions (docs/ALGORITHMS.md): at ``t = 1`` ``κ_1 = 0`` and ``s_1 = 0`` give 0/0, so while
    ``κ_t = 0`` the ``ŝ``/``b`` update is skipped (``s_1`` is still updated, ``b_1 = b_0``).
    ``bc_scale="paper"`` uses ``Φ = (σC/B)²`` as the paper writes it (C = 1: ``(σ/B)²``);
    ``bc_scale="b2"`` uses the per-coordinate noise variance ``Φ = b_{t−1}²σ²C²/B²`` of ``g̃``.
    ``max_grad_norm`` is the clip threshold in the transformed space: 1 in the paper (the default);
    another C scales the clip and noise together (it is equivalent to ``b → C·b``).
    Defaults: β = (0.9, 0.999), γ = 1e-8, h1 = 1e-9, h2 = 1e-6 (the paper's MNIST values and the
    authors' config), γ' = 1e-8 (as DPAdamBC). State: ``exp_avg``, ``exp_avg_sq``, ``s``, ``b``.
    """

    def __init__(
        self,
        params,
        lr=1e-3,
        *,
        noise_multiplier,
        max_grad_norm=1.0,
        expected_batch_size,
        mode="clip",
        r=None,
        seed=None,
        correlated_noise=None,
        betas=(0.9, 0.999),
        eps=1e-8,
        h1=1e-9,
        h2=1e-6,
        b0=None,
        bias_correction=False,
        gamma_prime=1e-8,
        bc_scale="paper",
    ):
        betas = _check_betas(betas)
        if betas[0] == 0.0:
            raise ValueError("DPMacAdam needs betas[0] > 0: with beta1 = 0, kappa_t = 0 for every t")
        _check_number("eps", eps, low=0.0)
        _check_number("h1", h1, low=0.0, low_open=True)
        _check_number("h2", h2, low=h1)
        _check_number("gamma_prime", gamma_prime, low=0.0, low_open=True)
        if b0 is not None:
            _check_number("b0", b0, low=0.0, low_open=True)
        if bc_scale not in ("paper", "b2"):
            raise ValueError(f"bc_scale must be 'paper' or 'b2', got {bc_scale!r}")
        self.b0 = b0
        self.bias_correction = bool(bias_correction)
        self.bc_scale = bc_scale
        super().__init__(
            params,
            dict(lr=lr, betas=betas, eps=eps, h1=h1, h2=h2, gamma_prime=gamma_prime),
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            expected_batch_size=expected_batch_size,
            mode=mode,
            r=r,
            seed=seed,
            correlated_noise=correlated_noise,
        )

    def _init_state(self, p):
        dt = _state_dtype(p)
        st = super()._init_state(p)
        b0 = self.b0 if self.b0 is not None else 1.0 / self._num_params()
        st.update(s=torch.zeros_like(p, dtype=dt), b=torch.full_like(p, b0, dtype=dt))
        return st

    def _num_params(self) -> int:
        return sum(p.numel() for p in self._params())

    def _update(self, params, grad_sets, t, noise):
        C, B, sigma = self.max_grad_norm, self.expected_batch_size, self.noise_multiplier
        groups = self._groups_of()
        m_hat_prev = []
        for p, group in zip(params, groups, strict=True):
            m = self.state[p]["exp_avg"]
            m_hat_prev.append(m / (1 - group["betas"][0] ** (t - 1)) if t > 1 else torch.zeros_like(m))
        b_prev = [self.state[p]["b"] for p in params]
        sums, c = self._clip(grad_sets, C, shift=m_hat_prev, scale=[1 / b for b in b_prev])
        c_total = c.sum().item()
        nus = self._noise_on_sum(t, C, noise)
        noise_var = (sigma * C / B) ** 2  # variance of the w-space noise on the mean
        sqrt_s_hat_total = 0.0
        s_hats = []
        for p, S, mh, b, nu, group in zip(params, sums, m_hat_prev, b_prev, nus, groups, strict=True):
            st = self.state[p]
            g = (S - c_total * mh + b * nu) * (1.0 / B) + mh
            m_hat, v_hat = self._adam_moments(p, g, group, t)
            if self.bias_correction:
                phi = noise_var if self.bc_scale == "paper" else b * b * noise_var
                denom = torch.clamp(v_hat - phi, min=group["gamma_prime"]).sqrt()
            else:
                denom = v_hat.sqrt() + group["eps"]
            self._adam_step(p, m_hat, denom, group)
            b1 = group["betas"][0]
            st["s"] = b1 * st["s"] + (1 - b1) * (g - m_hat) ** 2
            kappa = macadam_kappa(t, b1)
            if kappa == 0.0:
                s_hats.append(None)
                continue
            s_hat = torch.clamp(st["s"] / kappa - b * b * noise_var, min=group["h1"], max=group["h2"])
            s_hats.append(s_hat)
            sqrt_s_hat_total += s_hat.sqrt().sum().item()
        for p, s_hat in zip(params, s_hats, strict=True):
            if s_hat is not None:
                self.state[p]["b"] = s_hat.sqrt().sqrt() * math.sqrt(sqrt_s_hat_total)


# ============================================================================================
# DP² (delayed preconditioners)
# ============================================================================================


class DP2(DPOptimizer):
    """DP² (Li et al. 2023, Algorithm 1; seeds/004, seeds_macadam_dp2.md Part B), RMSProp or AdaGrad.

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
    separately. Default β = 0.9 (the authors' ``--rmsprop_gamma``), ε = 1e-8. State: ``v``, ``G``.
    """

    def __init__(
        self,
        params,
        lr,
        *,
        noise_multiplier,
        max_grad_norm,
        expected_batch_size,
        mode="clip",
        r=None,
        seed=None,
        correlated_noise=None,
        s1,
        s2,
        lr2=None,
        max_grad_norm2=None,
        beta=0.9,
        eps=1e-8,
        preconditioner="rmsprop",
    ):
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
        self.max_grad_norm2 = _check_number(
            "max_grad_norm2", max_grad_norm if max_grad_norm2 is None else max_grad_norm2, low=0.0, low_open=True
        )
        super().__init__(
            params,
            dict(lr=lr, lr2=lr2, beta=beta, eps=eps),
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            expected_batch_size=expected_batch_size,
            mode=mode,
            r=r,
            seed=seed,
            correlated_noise=correlated_noise,
        )

    def _init_state(self, p):
        dt = _state_dtype(p)
        return {"v": torch.zeros_like(p, dtype=dt), "G": torch.zeros_like(p, dtype=dt)}

    def check_step_params(self, noise_multiplier, max_grad_norm, expected_batch_size):
        checked = super().check_step_params(noise_multiplier, max_grad_norm, expected_batch_size)
        _validate.fp32_scale("noise_multiplier · max_grad_norm2", checked[0] * self.max_grad_norm2)
        return checked

    def _refreshed_v(self, params, groups) -> list[Tensor]:
        """``βv + (1−β)(G/s1)²`` (AdaGrad: ``v + (G/s1)²``): the preconditioner of a cycle's adaptive
        phase, from the ``G`` of its SGD phase. Returned, not stored: the step commits it (with
        ``G ← 0``) only once its clipped sum is formed, so a failed step leaves ``v`` and ``G`` as
        they were."""
        out = []
        for p, group in zip(params, groups, strict=True):
            st = self.state[p]
            G2 = (st["G"] / self.s1) ** 2
            out.append(group["beta"] * st["v"] + (1 - group["beta"]) * G2 if self.preconditioner == "rmsprop"
                       else st["v"] + G2)  # fmt: skip
        return out

    def _commit_refresh(self, params, v: list[Tensor]) -> None:
        for p, vv in zip(params, v, strict=True):
            self.state[p].update(v=vv, G=torch.zeros_like(self.state[p]["G"]))

    def phase(self, t: int) -> str:
        """``"sgd"`` or ``"adaptive"`` for the 1-based step ``t``."""
        return "sgd" if (t - 1) % (self.s1 + self.s2) < self.s1 else "adaptive"

    def _update(self, params, grad_sets, t, noise):
        groups = self._groups_of()
        pos = (t - 1) % (self.s1 + self.s2)  # position in the cycle
        if pos < self.s1:  # G is 0 at pos 0: the refresh reset it and adaptive steps do not add to it
            C = self.max_grad_norm
            sums, _ = self._clip(grad_sets, C)
            g_priv = self._private_mean(sums, self._noise_on_sum(t, C, noise))
            for p, g, group in zip(params, g_priv, groups, strict=True):
                self.state[p]["G"] = self.state[p]["G"] + g
                self._write(p, p.to(g.dtype) - group["lr"] * g)
        else:
            C = self.max_grad_norm2
            v = self._refreshed_v(params, groups) if pos == self.s1 else [self.state[p]["v"] for p in params]
            inv_d = [1 / (vv.sqrt() + group["eps"]) for vv, group in zip(v, groups, strict=True)]
            sums, _ = self._clip(grad_sets, C, scale=inv_d)
            if pos == self.s1:
                self._commit_refresh(params, v)
            g_priv = self._private_mean([s * d for s, d in zip(sums, inv_d, strict=True)],
                                        self._noise_on_sum(t, C, noise))  # fmt: skip
            for p, g, group in zip(params, g_priv, groups, strict=True):
                self._write(p, p.to(g.dtype) - group["lr2"] * g)


# ============================================================================================
# DP-PMLF (per-sample momentum + low-pass filter)
# ============================================================================================

#: Filter presets of the authors' code (Philosophy3290/DP-PMLF, ``coefs/*.csv``; seeds/002 §A.6):
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


def pmlf_bias_correction(a: Sequence[float], b: Sequence[float], steps: int) -> list[float]:
    """``c_0..c_{steps−1}``: the filter run on the constant input 1 from zero initial state,
    ``c_t = −Σ_{τ=1}^{na} a_τ c_{t−τ} + Σ_{τ=0}^{min(t, nb)} b_τ`` (``c_{<0} = 0``)."""
    c: list[float] = []
    for t in range(steps):
        c.append(-sum(a_tau * c[t - tau] for tau, a_tau in enumerate(a, 1) if t - tau >= 0)
                 + sum(b_tau for tau, b_tau in enumerate(b) if t - tau >= 0))  # fmt: skip
    return c


class DPPMLF(DPOptimizer):
    """DP-PMLF (Xu et al. 2026; seeds/002 Part A): per-sample momentum over ``k`` iterates,
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
    ``Σ b − Σ a = 1`` and have all poles inside the unit circle. Defaults: ``k = 2``, ``β = 0.1``,
    preset ``a9b1`` (the authors' code defaults). State: ``m_hist`` ``[na, *shape]`` (``m_{t−1}``
    first), ``vbar_hist`` ``[nb, *shape]`` (``v̄_{t−1}`` first), ``past`` ``[k−1, *shape]`` in the
    parameter dtype (``x_{t−1}`` first, filled with ``x_0`` before there are enough iterates, as
    the authors' code); global ``c`` history in ``state_dict()["dp"]``.
    """

    def __init__(
        self,
        params,
        lr,
        *,
        noise_multiplier,
        max_grad_norm,
        expected_batch_size,
        mode="clip",
        r=None,
        seed=None,
        correlated_noise=None,
        k=2,
        beta=0.1,
        filter="a9b1",
    ):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k (momentum length) must be an int >= 1, got {k!r}")
        _check_number("beta", beta, low=0.0, high=1.0)
        self.k, self.beta = k, float(beta)
        self.filter_a, self.filter_b = self._check_filter(filter)
        self._num_grad_sets = k
        self._grad_sample_is_list = True
        self._c_hist: list[float] = []  # c_{t−1}, c_{t−2}, ... (at most na entries)
        super().__init__(
            params,
            dict(lr=lr),
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            expected_batch_size=expected_batch_size,
            mode=mode,
            r=r,
            seed=seed,
            correlated_noise=correlated_noise,
        )

    @staticmethod
    def _check_filter(filt) -> tuple[tuple[float, ...], tuple[float, ...]]:
        if isinstance(filt, str):
            if filt not in PMLF_PRESETS:
                raise ValueError(f"unknown PMLF filter preset {filt!r}; expected one of {sorted(PMLF_PRESETS)}")
            return PMLF_PRESETS[filt]
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
        return a, b

    def _init_state(self, p):
        dt = _state_dtype(p)
        na, nb = len(self.filter_a), len(self.filter_b) - 1
        return {
            "m_hist": torch.zeros((na, *p.shape), dtype=dt, device=p.device),
            "vbar_hist": torch.zeros((nb, *p.shape), dtype=dt, device=p.device),
            "past": p.detach().clone().unsqueeze(0).repeat(self.k - 1, *([1] * p.dim())),
        }

    @property
    def momentum_coeffs(self) -> list[float]:
        return pmlf_momentum_coeffs(self.k, self.beta)

    def past_params(self) -> list[list[Tensor]]:
        """The ``k−1`` past iterates ``[x_{t−1}, ..., x_{t−k+1}]``, each a list of tensors in
        parameter order: pass them to :func:`dpkernels.pmlf.pmlf_grad_samples`."""
        params = self._params()
        return [[self.state[p]["past"][j] for p in params] for j in range(self.k - 1)]

    def _global_state(self):
        return {"c_hist": list(self._c_hist)}

    def _load_global_state(self, dp):
        self._c_hist = [float(c) for c in dp["c_hist"]]

    def _update(self, params, grad_sets, t, noise):
        a, b = self.filter_a, self.filter_b
        C = self.max_grad_norm
        sums, _ = self._clip(grad_sets, C, coeffs=self.momentum_coeffs)
        vbars = self._private_mean(sums, self._noise_on_sum(t, C, noise))
        # t is 1-based here; the paper's index is t − 1, so b_τ exists for τ <= t − 1.
        c_t = -sum(a_tau * c for a_tau, c in zip(a, self._c_hist, strict=False)) + sum(b[:t])
        for p, vbar, group in zip(params, vbars, self._groups_of(), strict=True):
            st = self.state[p]
            m = b[0] * vbar
            for tau, a_tau in enumerate(a):
                m = m - a_tau * st["m_hist"][tau]
            for tau, b_tau in enumerate(b[1:]):
                m = m + b_tau * st["vbar_hist"][tau]
            # Histories of length 0 (no a or no b taps) stay empty.
            if a:
                st["m_hist"] = torch.cat([m.unsqueeze(0), st["m_hist"][:-1]])
            if len(b) > 1:
                st["vbar_hist"] = torch.cat([vbar.unsqueeze(0), st["vbar_hist"][:-1]])
            if self.k > 1:
                st["past"] = torch.cat([p.detach().clone().unsqueeze(0), st["past"][:-1]])
            self._write(p, p.to(m.dtype) - group["lr"] * (m / c_t))
        self._c_hist = ([c_t] + self._c_hist)[: len(a)]
