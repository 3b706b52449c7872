"""Opacus on dpkernels: :func:`accelerate` runs an Opacus ``DPOptimizer``'s clip, accumulate, noise,
scale and step on the fused kernels; :func:`make_private` / :class:`PrivacyEngine` (defined in
``_make_private``) run every dpkernels algorithm inside Opacus's machinery.

``accelerate(opt)`` changes the class of the Opacus optimizer in place (``AcceleratedDPOptimizer``
and its siblings) and returns the same object, so everything that holds it (the accountant hook
of ``PrivacyEngine``, schedulers, ``BatchMemoryManager``, ghost clipping's loss wrapper) keeps
working. Per step:

1. ``S = Σ_i c_i g_i`` into ``p.summed_grad`` with :func:`dpkernels.clip_and_accumulate`, once per
   micro-batch of ``p.grad_sample`` (flat, per-layer or adaptive clipping; Opacus's factor
   ``min(1, C/(‖g_i‖ + 1e-6))``); ghost clipping keeps Opacus's ``accumulate()`` of ``p.grad``;
2. Opacus's skip-step queue (``signal_skip_step``) is honoured exactly as in Opacus;
3. one fused pass (:meth:`dpkernels.optim.DPSGD.step_from_sums` for ``torch.optim.SGD``,
   :class:`dpkernels.optim.DPAdam` for ``Adam``/``AdamW``): ``g̃ = (S + σ·Δ·z)/B`` and the update of
   the wrapped torch optimizer, whose ``param_groups`` (lr, momentum, betas, ...) are read at every
   step;
4. the accountant hook with the Opacus object's own ``noise_multiplier`` and
   ``accumulated_iterations`` (AdaClip: the unadjusted σ), so ``get_epsilon`` is unchanged.

Differences from Opacus, by design: the noise values come from dpkernels's counter-based Philox
stream (ChaCha20 with ``secure_mode``), not ``torch.normal`` (same distribution; pass ``noise=`` to
``step`` for exact replays); ``p.grad`` is set to None after a step (the private gradient is never
materialised and the autograd ``p.grad`` is not private); a NaN/Inf per-sample gradient raises
instead of writing NaN parameters. Anything the fused step cannot reproduce exactly raises.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

try:
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import (
        AdaClipDPOptimizer,
        DistributedDPOptimizer,
        DistributedDPOptimizerFastGradientClipping,
        DPOptimizer,
        DPOptimizerFastGradientClipping,
        DPPerLayerOptimizer,
        SimpleDistributedPerLayerOptimizer,
    )
    from opacus.optimizers import adaclipoptimizer as _adaclip
    from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping, DPTensorFastGradientClipping
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError("dpkernels.integrations.opacus needs opacus: pip install 'dpkernels[opacus]'") from exc

from .. import _backend
from .. import optim as dpk_optim
from ..bk import BKModule
from ..clip import clip_and_accumulate
from ..noise import add_gaussian_noise_
from ._make_private import ALGORITHMS, CorrelatedNoiseAccountant, DPKernelsOptimizer, PrivacyEngine, make_private
from ._torch_optim import param_group_hypers

__all__ = [
    "accelerate",
    "make_private",
    "PrivacyEngine",
    "DPKernelsOptimizer",
    "CorrelatedNoiseAccountant",
    "ALGORITHMS",
    "AcceleratedDPOptimizer",
    "AcceleratedDPPerLayerOptimizer",
    "AcceleratedAdaClipDPOptimizer",
    "AcceleratedDPOptimizerFastGradientClipping",
    "AcceleratedDistributedDPOptimizer",
    "AcceleratedSimpleDistributedPerLayerOptimizer",
    "AcceleratedDistributedDPOptimizerFastGradientClipping",
]

_INNER = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


class _Accelerated:
    """The dpkernels step of an Opacus optimizer; first in the MRO of each ``Accelerated*`` class."""

    #: how ``S`` is formed: "flat", "per_layer", "adaptive" (AdaClip) or "ghost"
    _dpk_clip = "flat"
    #: DistributedDPOptimizer's structure: noise on rank 0 only, then an all-reduce of S + ν
    _dpk_ddp = False

    # ----------------------------------------------------------------------------------------
    # Set-up (called by accelerate())
    # ----------------------------------------------------------------------------------------

    def _dpk_init(self, backend: str, seed) -> None:
        inner = self.original_optimizer
        params = self.params
        if not params:
            raise ValueError("the optimizer has no trainable parameter")
        for idx, p in enumerate(params):
            if p.dtype != torch.float32:
                raise TypeError(
                    f"parameter {idx} has dtype {p.dtype}; accelerate() reproduces torch's step for float32 "
                    "parameters only (torch keeps other dtypes' state in the parameter dtype)"
                )
            if not p.is_contiguous():
                raise ValueError(f"parameter {idx} (shape {tuple(p.shape)}) must be contiguous")
        if len({p.device for p in params}) != 1:
            raise ValueError("all parameters must be on one device (one flat noise index)")
        groups = []
        for idx, g in enumerate(inner.param_groups):
            ps = [p for p in g["params"] if p.requires_grad]
            if ps:
                groups.append({"params": ps, **param_group_hypers(inner, g, idx)})
        self._dpk_group_idx = [i for i, g in enumerate(inner.param_groups) if any(p.requires_grad for p in g["params"])]
        self._dpk_params = list(params)
        kind = dpk_optim.DPSGD if isinstance(inner, torch.optim.SGD) else dpk_optim.DPAdam
        # A seeded key repeats its noise if its counter restarts (load_state_dict refuses that).
        self._dpk_seeded = seed is not None or (self.generator is not None and not self.secure_mode)
        if self.secure_mode:
            key = {"rng": "chacha20", "secure_key": seed}
        else:
            if seed is None and self.generator is not None:
                g = self.generator
                seed = int(torch.randint(2**63 - 1, (1,), generator=g, device=g.device))
            key = {"rng": "philox", "seed": seed}
        self._dpk_engine = kind(
            groups,
            groups[0]["lr"],
            noise_multiplier=0.0,
            max_grad_norm=1.0,
            expected_batch_size=1,
            backend=_backend.resolve(backend, params[0].device),
            **key,
        )
        self._dpk_import_state()

    def _dpk_import_state(self) -> None:
        """Continue from the wrapped torch optimizer's state (accelerate() after plain steps)."""
        inner, eng = self.original_optimizer, self._dpk_engine
        steps = set()
        for p in self._dpk_params:
            st = inner.state.get(p)
            if not st:
                continue
            if isinstance(inner, torch.optim.SGD):
                if st.get("momentum_buffer") is not None:
                    eng.state[p]["momentum_buffer"] = st["momentum_buffer"].detach().float().clone()
            else:
                eng.state[p]["exp_avg"] = st["exp_avg"].detach().float().clone()
                eng.state[p]["exp_avg_sq"] = st["exp_avg_sq"].detach().float().clone()
                steps.add(int(st["step"]))
        if len(steps) > 1:
            raise ValueError(f"the wrapped Adam has different step counts per parameter ({sorted(steps)})")
        if steps:
            if len([p for p in self._dpk_params if inner.state.get(p)]) != len(self._dpk_params):
                raise ValueError("the wrapped Adam has state for only some parameters")
            eng._step = steps.pop()

    # ----------------------------------------------------------------------------------------
    # The step
    # ----------------------------------------------------------------------------------------

    @property
    def state(self):
        """The engine's state (``momentum_buffer``; ``exp_avg``, ``exp_avg_sq``: torch's names)."""
        return self._dpk_engine.state

    @property
    def dpkernels_engine(self) -> dpk_optim.DPSGD | dpk_optim.DPAdam:
        """The :mod:`dpkernels.optim` optimizer that performs the update."""
        return self._dpk_engine

    def _dpk_check_params(self) -> list[Tensor]:
        params = self.params
        if len(params) != len(self._dpk_params) or any(
            p is not q for p, q in zip(params, self._dpk_params, strict=False)
        ):
            raise ValueError(
                "the optimizer's trainable parameters changed after accelerate() (requires_grad toggled or "
                "a param group added); call accelerate() on a fresh Opacus optimizer"
            )
        return params

    def _dpk_accumulate(self, params: list[Tensor]) -> None:
        """``S`` of this (micro-)batch added into ``p.summed_grad``, as Opacus's ``clip_and_accumulate``."""
        if self._dpk_clip == "ghost":
            self.accumulate()
            return
        for p in params:
            _check_processed_flag(p.grad_sample)
        backend = self._dpk_engine.backend
        acc = self.accumulated_iterations
        per_layer = self._dpk_clip == "per_layer"
        C = list(self.max_grad_norms) if per_layer else float(self.max_grad_norm)
        # Every micro-batch is clipped before anything is added to p.summed_grad: one that raises (a
        # NaN sample) leaves the accumulator as it was, so a retry cannot count the others twice.
        total, samples, unclipped = None, 0, 0
        for j in range(acc):
            # Per-sample norms never cross samples: clipping each micro-batch and adding is exact.
            gs = [p.grad_sample[j] if isinstance(p.grad_sample, list) else p.grad_sample for p in params]
            sums, norms = clip_and_accumulate(gs, C, per_layer=per_layer, backend=backend)
            if self._dpk_clip == "adaptive":  # adaclipoptimizer.py's counts, from our norms
                f = (C / (norms + 1e-6)).clamp(max=1.0)
                samples += len(f)
                unclipped = unclipped + (len(f) - (f < 1).sum())
            total = sums if total is None else [a.add_(s) for a, s in zip(total, sums, strict=True)]
        if self._dpk_clip == "adaptive":
            self.sample_size += samples
            self.unclipped_num += unclipped
        for p, s in zip(params, total, strict=True):
            p.summed_grad = s if p.summed_grad is None else p.summed_grad.add_(s)
        for p in params:
            _mark_as_processed(p.grad_sample)

    def pre_step(self, closure=None) -> bool:
        """Clip and accumulate into ``p.summed_grad``; False when the step is skipped (``signal_skip_step``)."""
        self._dpk_accumulate(self._dpk_check_params())
        if self._check_skip_next_step():
            self._is_last_step_skipped = True
            return False
        return True

    def _dpk_sigma_delta(self) -> tuple[float, float]:
        sigma = float(self.noise_multiplier)
        if self._dpk_clip == "adaptive" and sigma > 0:  # adaclipoptimizer.py add_noise, same expression
            sigma = (sigma ** (-2) - (2 * self.unclipped_num_std) ** (-2)) ** (-1 / 2)
        elif self._dpk_clip == "ghost":
            sigma = float(getattr(self, "_adjusted_noise_multiplier", sigma))
        return sigma, float(self.max_grad_norm)

    def _dpk_batch(self) -> int:
        """``B`` of Opacus's ``scale_grad``: ``E·accumulated_iterations`` for mean reduction, 1 for sum."""
        if self.loss_reduction != "mean":
            return 1
        # DDP: PrivacyEngine divides E by the world size, reduce_gradients divides by it again.
        exact = self.expected_batch_size * self.accumulated_iterations * (self.world_size if self._dpk_ddp else 1)
        B = round(exact)
        if B < 1 or abs(B - exact) > 1e-6 * B:
            raise ValueError(f"expected_batch_size·accumulated_iterations = {exact} is not a positive integer")
        return B

    @torch.no_grad()
    def step(self, closure=None, *, noise: list[Tensor] | None = None):
        """Opacus's step on dpkernels. ``noise``: optional pre-drawn ``σ·Δ·z`` per parameter (what Opacus
        adds to ``p.summed_grad``), used instead of the engine's stream. Returns None, as Opacus."""
        if closure is not None:
            with torch.enable_grad():
                closure()
        eng = self._dpk_engine
        inner = self.original_optimizer
        # σ, Δ, B and the torch hyper-parameters are checked before anything is accumulated.
        sigma, delta, B = eng.check_step_params(*self._dpk_sigma_delta(), self._dpk_batch())
        hypers = [param_group_hypers(inner, inner.param_groups[i], i) for i in self._dpk_group_idx]
        if not self.pre_step():
            return None
        params = self._dpk_params
        for p in params:
            _check_processed_flag(p.summed_grad)
        if self._dpk_clip == "adaptive" and self.sample_size == 0:
            # update_max_grad_norm divides by the sample count: a NaN clip norm from then on
            raise ValueError("AdaClip cannot update its clip norm from an empty batch (0 samples since zero_grad)")
        for eg, h in zip(eng.param_groups, hypers, strict=True):
            eg.update(h)
        sums = [p.summed_grad for p in params]
        if self._dpk_ddp:
            sums, sigma, noise = self._dpk_allreduce(sums, sigma * delta, noise)
        eng.set_step_params(sigma, delta, B)
        # Δ is Opacus's max_grad_norm: C flat, ‖(C_1..C_L)‖ per layer (its noise scale).
        eng.step_from_sums(sums, sensitivity=delta, noise=noise)
        for p in params:
            _mark_as_processed(p.summed_grad)
            p.grad = None  # the autograd p.grad is not private; the private gradient is never formed
        if self._dpk_clip == "adaptive":  # adaclipoptimizer.py add_noise: the noisy unclipped count
            count_noise = _adaclip._generate_noise(
                std=self.unclipped_num_std, reference=self.unclipped_num.float(), generator=self.generator
            )
            self.unclipped_num = float(self.unclipped_num) + count_noise
        if self.step_hook:
            self.step_hook(self)
        if self._dpk_clip == "adaptive":
            self.update_max_grad_norm()
        self._is_last_step_skipped = False
        return None

    def _dpk_allreduce(self, sums, std, noise):
        """``Σ_ranks S_r + ν``, ν added on rank 0 only (the engine's key and counter), as Opacus's DDP
        optimizer; the engine then steps without noise."""
        eng = self._dpk_engine
        sums = [s.clone() for s in sums]
        if self.rank == 0:
            if noise is not None:
                for s, nu in zip(sums, noise, strict=True):
                    s.add_(nu)
            elif std > 0:
                key = eng.secure_key if eng.rng == "chacha20" else eng.seed
                add_gaussian_noise_(sums, std, seed=key, step=eng.steps_taken + 1, rng=eng.rng, backend=eng.backend)
        for s in sums:
            torch.distributed.all_reduce(s, op=torch.distributed.ReduceOp.SUM)
        return sums, 0.0, None

    # ----------------------------------------------------------------------------------------
    # Serialisation
    # ----------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {
            "dpkernels_accelerated": 1,
            "original": self.original_optimizer.state_dict(),
            "engine": self._dpk_engine.state_dict(),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Our ``state_dict()``, or a plain torch/Opacus one (its state is imported as by accelerate())."""
        if isinstance(state_dict, dict) and state_dict.get("dpkernels_accelerated") == 1:
            self._dpk_engine.load_state_dict(state_dict["engine"])  # checks everything before it loads
            self.original_optimizer.load_state_dict(state_dict["original"])
        elif isinstance(state_dict, dict) and {"state", "param_groups"} <= state_dict.keys():
            if isinstance(self.original_optimizer, torch.optim.SGD) and self._dpk_seeded:
                raise ValueError(
                    "a torch SGD state_dict does not record how many steps were taken, so the noise counter "
                    "of this seeded generator cannot be restored and the noise of steps 1, 2, ... would repeat; "
                    "save and load the accelerated optimizer's own state_dict(), or accelerate() with no seed "
                    "and no generator (a fresh key)"
                )
            self.original_optimizer.load_state_dict(state_dict)
            self._dpk_import_state()
        else:
            raise ValueError("state_dict is neither an accelerated optimizer's nor a torch optimizer's")

    def __repr__(self) -> str:
        return f"Accelerated({self.original_optimizer!r}, backend={self._dpk_engine.backend!r})"


class AcceleratedDPOptimizer(_Accelerated, DPOptimizer):
    """An Opacus ``DPOptimizer`` (flat clipping) stepping on dpkernels."""


class AcceleratedDPPerLayerOptimizer(_Accelerated, DPPerLayerOptimizer):
    """An Opacus ``DPPerLayerOptimizer``: per-parameter clip norms ``max_grad_norms``, noise scaled by
    their ℓ2 norm ``max_grad_norm`` (Opacus's sensitivity)."""

    _dpk_clip = "per_layer"


class AcceleratedAdaClipDPOptimizer(_Accelerated, AdaClipDPOptimizer):
    """An Opacus ``AdaClipDPOptimizer`` (Andrew et al., adaptive clipping): the gradient noise uses
    ``σ_eff = (σ⁻² − (2σ_u)⁻²)^(−1/2)``, the clip norm follows the noisy unclipped fraction."""

    _dpk_clip = "adaptive"


class AcceleratedDPOptimizerFastGradientClipping(_Accelerated, DPOptimizerFastGradientClipping):
    """An Opacus ghost-clipping optimizer: ``p.grad`` already holds ``S``; only noise, scale and step run here."""

    _dpk_clip = "ghost"


class AcceleratedDistributedDPOptimizer(_Accelerated, DistributedDPOptimizer):
    """An Opacus ``DistributedDPOptimizer``: rank 0 adds the noise to ``S``, ``S + ν`` is summed over ranks,
    divided by ``E·W``. Call accelerate() on every rank; ranks keep equal engine step counters."""

    _dpk_ddp = True


class AcceleratedSimpleDistributedPerLayerOptimizer(_Accelerated, SimpleDistributedPerLayerOptimizer):
    """An Opacus ``SimpleDistributedPerLayerOptimizer``: per-layer clipping, then as the distributed one."""

    _dpk_clip = "per_layer"
    _dpk_ddp = True


class AcceleratedDistributedDPOptimizerFastGradientClipping(_Accelerated, DistributedDPOptimizerFastGradientClipping):
    """An Opacus ``DistributedDPOptimizerFastGradientClipping``: ghost clipping, then as the distributed one."""

    _dpk_clip = "ghost"
    _dpk_ddp = True


_ACCELERATED = {
    DPOptimizer: AcceleratedDPOptimizer,
    DPPerLayerOptimizer: AcceleratedDPPerLayerOptimizer,
    AdaClipDPOptimizer: AcceleratedAdaClipDPOptimizer,
    DPOptimizerFastGradientClipping: AcceleratedDPOptimizerFastGradientClipping,
    DistributedDPOptimizer: AcceleratedDistributedDPOptimizer,
    SimpleDistributedPerLayerOptimizer: AcceleratedSimpleDistributedPerLayerOptimizer,
    DistributedDPOptimizerFastGradientClipping: AcceleratedDistributedDPOptimizerFastGradientClipping,
}


def _rewrap_scheduler_step(opt) -> None:
    """An LR scheduler created before accelerate() captured the old ``step``; wrap the new one the same way."""
    if "step" not in vars(opt):
        return
    if not getattr(opt.step, "_wrapped_by_lr_sched", False):
        raise TypeError("the optimizer has an instance-level step override; accelerate() would bypass it")
    new_step = type(opt).step

    @functools.wraps(new_step)
    def wrapper(*args, **kwargs):
        opt._opt_called = True
        return new_step(opt, *args, **kwargs)

    wrapper._wrapped_by_lr_sched = True
    opt.step = wrapper


class _BKTensor(DPTensorFastGradientClipping):
    """Opacus's ghost-clipping loss whose ``backward()`` is one backward pass (book-keeping) instead
    of two: the :class:`~dpkernels.bk.BKModule` the optimizer carries (``_dpk_bk``) keeps each layer's
    input and output gradient, then ``p.grad`` receives the clipped sum ``Σ_i c_i g_i`` (added to a
    previous micro-batch's: gradient accumulation works), as Opacus's second backward leaves it."""

    def backward(self):
        opt = self.optimizer
        bk = opt._dpk_bk
        params = bk.trainable_parameters()
        # Kept aside during backward: autograd adds the non-private gradient of the layers BK does not
        # wrap (norm layers) into an existing .grad in place, which would leak into the sum.
        before = [p.grad for p in params]
        for p in params:
            p.grad = None
        reduced = self.loss_per_sample.mean(0) if self.loss_reduction == "mean" else self.loss_per_sample.sum(0)
        try:
            reduced.backward()
            sums, _ = bk.clip_and_accumulate(float(opt.max_grad_norm), backend=opt._dpk_engine.backend)
        except Exception:
            for p, g in zip(params, before, strict=True):
                p.grad = g
            bk.clear()
            raise
        for p, g, s in zip(params, before, sums, strict=True):
            p.grad = s.to(p.dtype) if g is None else g + s.to(p.dtype)


def _keep_class(name: str):
    base = getattr(DPTensorFastGradientClipping, name)

    @functools.wraps(base)
    def op(self, *args):
        out = base(self, *args)
        out.__class__ = type(self)
        return out

    return op


# Opacus's loss arithmetic (loss / k, w * loss, loss + other) builds its own class by name.
for _name in ("__truediv__", "__mul__", "__rmul__", "__add__", "__radd__", "__sub__", "__rsub__", "__neg__"):
    setattr(_BKTensor, _name, _keep_class(_name))


class _BKLoss(DPLossFastGradientClipping):
    """Opacus's ghost-clipping criterion returning :class:`_BKTensor`."""

    def __call__(self, *args, **kwargs):
        out = super().__call__(*args, **kwargs)
        out.__class__ = _BKTensor
        return out


def _check_ghost_criterion(dp_optimizer, criterion) -> None:
    if type(criterion) is not DPLossFastGradientClipping:
        raise TypeError(f"criterion must be Opacus's DPLossFastGradientClipping, got {type(criterion).__name__}")
    if type(dp_optimizer) is not DPOptimizerFastGradientClipping or criterion.optimizer is not dp_optimizer:
        raise TypeError("criterion= is for the ghost-clipping DPOptimizerFastGradientClipping that the criterion wraps")
    gsm = criterion.module
    if not isinstance(gsm, GradSampleModuleFastGradientClipping):
        raise TypeError(
            f"the criterion's module must be a GradSampleModuleFastGradientClipping, got {type(gsm).__name__}"
        )
    model_params = {id(p) for p in gsm._module.parameters() if p.requires_grad}
    if model_params != {id(p) for p in dp_optimizer.params}:
        raise ValueError("the optimizer's parameters are not the trainable parameters of the criterion's module")


def _one_backward(dp_optimizer, criterion) -> None:
    """Make ``criterion`` (Opacus's ``DPLossFastGradientClipping`` for ``dp_optimizer``) run one backward
    pass: the GradSampleModule's hooks are removed and a BKModule captures its layers instead."""
    gsm = criterion.module
    bk = BKModule(gsm._module, loss_reduction=criterion.loss_reduction)
    gsm.remove_hooks()
    gsm.register_forward_pre_hook(lambda module, args: bk.begin_forward())
    dp_optimizer._dpk_bk = bk
    criterion.__class__ = _BKLoss


def accelerate(dp_optimizer, *, backend: str = "auto", seed: int | None = None, criterion=None):
    """Run an Opacus DP optimizer's clip, accumulate, noise, scale and step on dpkernels.

    Args:
        dp_optimizer: a ``DPOptimizer``, ``DPPerLayerOptimizer``, ``AdaClipDPOptimizer``,
            ``DPOptimizerFastGradientClipping``, ``DistributedDPOptimizer``,
            ``SimpleDistributedPerLayerOptimizer`` or ``DistributedDPOptimizerFastGradientClipping``
            (exact type, as ``PrivacyEngine.make_private`` builds it; with DDP call it on every rank)
            wrapping ``torch.optim.SGD`` (momentum, weight decay), ``Adam`` or ``AdamW``, with fp32
            parameters on one device.
        backend: dpkernels backend (``"auto"``, ``"reference"``, ``"cpu"``, ``"cuda"``, ``"triton"``).
        seed: the Philox noise key (the 256-bit ChaCha20 key when ``secure_mode``); default: drawn
            from the optimizer's ``generator`` if it has one, else fresh.
        criterion: with a ghost-clipping ``DPOptimizerFastGradientClipping``, its
            ``DPLossFastGradientClipping`` (``make_private(grad_sample_mode="ghost")`` returns both):
            ``loss.backward()`` then runs **one** backward pass instead of Opacus's two (book-keeping,
            :mod:`dpkernels.bk`: the GradSampleModule's hooks are removed, its layers captured), and
            gradient accumulation over several backward passes works.

    Returns: the same object, whose class is now ``Accelerated<Class>``. Its ``step(noise=...)``
    accepts pre-drawn noise; ``state`` is the engine's; ``p.grad`` is None after a step.

    Raises: ``ValueError`` if already accelerated or for an option the fused step does not implement
    (nesterov, dampening, amsgrad, maximize, differentiable, Adam's coupled weight decay,
    non-contiguous parameters); ``TypeError`` for another optimizer class (``DistributedPerLayerOptimizer``,
    FSDP, a subclass), another wrapped optimizer, or non-fp32 parameters.
    """
    if isinstance(dp_optimizer, _Accelerated):
        raise ValueError("the optimizer is already accelerated")
    cls = _ACCELERATED.get(type(dp_optimizer))
    if cls is None:
        names = ", ".join(c.__name__ for c in _ACCELERATED)
        raise TypeError(f"accelerate() supports exactly {names}; got {type(dp_optimizer).__name__}")
    inner = getattr(dp_optimizer, "original_optimizer", None)
    if type(inner) not in _INNER:
        raise TypeError(
            f"accelerate() supports a wrapped torch.optim.SGD, Adam or AdamW; got {type(inner).__name__} "
            "(subclasses are refused: they may change the update)"
        )
    if "step" in vars(dp_optimizer) and not getattr(dp_optimizer.step, "_wrapped_by_lr_sched", False):
        raise TypeError("the optimizer has an instance-level step override; accelerate() would bypass it")
    # Validate everything before the class changes: a failure leaves the Opacus optimizer untouched.
    for idx, g in enumerate(inner.param_groups):
        param_group_hypers(inner, g, idx)
    original_cls = type(dp_optimizer)
    if criterion is not None:
        _check_ghost_criterion(dp_optimizer, criterion)
    dp_optimizer.__class__ = cls
    try:
        dp_optimizer._dpk_init(backend, seed)
    except Exception:
        dp_optimizer.__class__ = original_cls
        raise
    if criterion is not None:
        try:
            _one_backward(dp_optimizer, criterion)
        except Exception:
            dp_optimizer.__class__ = original_cls
            raise
    _rewrap_scheduler_step(dp_optimizer)
    return dp_optimizer
