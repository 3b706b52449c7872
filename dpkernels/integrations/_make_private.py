"""``make_private(..., algorithm=...)``: the dpkernels optimizers inside Opacus's machinery.

:func:`make_private` takes the arguments of ``opacus.PrivacyEngine.make_private`` plus
``algorithm``, ``backend``, ``seed``, ``correlated_noise`` and the algorithm's own keyword
arguments. It lets Opacus build what it always builds (the ``GradSampleModule`` that fills
``p.grad_sample``, the Poisson ``DPDataLoader``, the sample rate ``q = 1/len(loader)`` and the
expected batch size ``E``), then replaces Opacus's optimizer by a :class:`DPKernelsOptimizer`:
an ``opacus.optimizers.DPOptimizer`` whose ``original_optimizer`` is the fused dpkernels engine
(:mod:`dpkernels.optim`) built from the torch optimizer's hyper-parameters:

=============  ==========================  =====================  =====================================
``algorithm``  engine                      torch optimizer        algorithm keyword arguments
=============  ==========================  =====================  =====================================
``dpsgd``      ``DPSGD``                   SGD (lr, momentum, wd) ``mode`` ("clip"; "auto_s" = Auto-S,
                                                                  ...), ``r``
``psac``       ``DPSGD(mode="psac")``      SGD (lr, momentum, wd) ``r`` (0.1)
``dp2``        ``DP2``                     SGD (lr; no momentum)  ``s1, s2`` (required), ``lr2``,
                                                                  ``max_grad_norm2, beta, eps,
                                                                  preconditioner``
``pmlf``       ``DPPMLF``                  SGD (lr; no momentum)  ``k, beta, filter``
``dpadam``     ``DPAdam``                  Adam / AdamW
``dpadam_bc``  ``DPAdamBC``                Adam / AdamW (no eps)  ``gamma_prime``, ``gamma_prime_rel``
``stp``        ``DPAdamSTP``               Adam / AdamW (eps→ε₂)  ``eps1`` (required)
``macadam``    ``DPMacAdam``               Adam (no decay)        ``h1, h2, b0, bias_correction,
                                                                  gamma_prime, gamma_prime_rel,
                                                                  bc_scale`` (no correlated noise)
=============  ==========================  =====================  =====================================

Adam's ``weight_decay`` (an L2 term coupled into the gradient) is refused: the engines decay
decoupled, as ``torch.optim.AdamW``, whose ``weight_decay`` is used. ``max_grad_norm`` is the
algorithm's clip ``C`` (MacAdam: in its transformed space, 1 in the paper; DP²: phase 1).

**Accounting.** Every algorithm here releases, per step, a Poisson-subsampled Gaussian sum of
sensitivity ``C`` with multiplier ``σ`` (DP-SGD's mechanism); the algorithm-specific parts (STP's
scale, MacAdam's shift/scale, DP²'s preconditioner, PMLF's filter) depend only on earlier private
outputs or on public iterates, so they are post-processing. The optimizer therefore calls
Opacus's own accountant hook (``accountant.get_optimizer_hook_fn(q)``) once per step with its
``noise_multiplier``, and ``privacy_engine.get_epsilon(δ)`` is exactly Opacus's ε for the same
``σ``, ``q`` and step count. With ``correlated_noise`` (:class:`dpkernels.BLTNoise` /
:class:`dpkernels.BandedNoise`, matrix-factorisation DP) the per-step Gaussians are dependent and
those accountants do not apply; dp-accounting 0.6.0 (the installed version) has no
matrix-factorisation accountant for Poisson-sampled participation, so the engine installs
:class:`CorrelatedNoiseAccountant`, which records the steps and refuses to report ε.

**Checkpoints.** Opacus's ``privacy_engine.save_checkpoint(path=, module=, optimizer=)`` saves the
module, the engine's ``state_dict`` (through ``DPOptimizer.state_dict``: noise counter, seed, keys,
state) and the accountant's history; in a new process, ``make_private`` as before (any seed), then
``privacy_engine.load_checkpoint(...)``: the run continues the noise stream, and ``get_epsilon``
counts the steps before the checkpoint (tests/test_resume.py). :class:`PrivacyEngine`'s
``load_checkpoint`` checks the engine's and the accountant's states before it loads anything.

**Book-keeping** (``grad_sample_mode="bk"``): the returned module is a :class:`dpkernels.bk.BKModule`
(one backward pass keeps each layer's input and output gradient; no per-sample gradient is built)
and the engine's step clips from it (``step(per_sample=...)``); Opacus still validates the module
and builds the loader. The clipped sums are those of the per-sample modes to fp32 rounding.

**DP-PMLF** needs, for the current batch, per-sample gradients at the last ``k`` iterates. The
current set comes from the GradSampleModule; the ``k − 1`` past sets are recomputed by
:func:`dpkernels.pmlf.pmlf_grad_samples` at ``engine.past_params()``. The optimizer never sees
the data, so its step takes the batch: ``optimizer.step(batch=(inputs, targets))``. The
per-sample loss is make_private's ``criterion`` applied to one sample.

**Data parallel**: with the module wrapped in Opacus's ``DifferentiallyPrivateDistributedDataParallel``,
Opacus builds its distributed Poisson loader (each rank samples its shard at rate ``q``) and the
engine is built with ``distributed=True`` and the GLOBAL expected batch size: each rank clips its
own samples, the clipped sums are all-reduced and the noise is drawn once, identically on every
rank (:mod:`dpkernels.optim._distributed`); each rank's accountant counts the same steps.

Restrictions (each raises ``NotImplementedError`` before Opacus touches the module): flat
clipping, ``grad_sample_mode`` in ``hooks``/``functorch``/``bk``, ``loss_reduction="mean"``,
``wrap_model=True``, no torch DDP or FSDP module, no ``BatchMemoryManager`` (``signal_skip_step``).
``noise_generator`` seeds the engine's Philox key (when ``seed`` is not given); a
``secure_mode`` privacy engine gets ChaCha20 noise (``rng="chacha20"``).
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

try:
    from opacus import PrivacyEngine as _OpacusPrivacyEngine
    from opacus.accountants.accountant import IAccountant
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as _DPDDP
    from opacus.optimizers.optimizer import DPOptimizer as _OpacusDPOptimizer
    from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed
except ImportError as exc:  # opacus is an optional extra
    raise ImportError("dpkernels.integrations needs Opacus: pip install 'dpkernels[opacus]'") from exc

from .. import optim as dpk_optim
from ..bk import BKBatch, BKModule
from ..correlated import _StreamingNoise
from ..pmlf import pmlf_grad_samples
from ._torch_optim import param_group_hypers

__all__ = ["ALGORITHMS", "CorrelatedNoiseAccountant", "DPKernelsOptimizer", "PrivacyEngine", "make_private"]


@dataclass(frozen=True)
class _Spec:
    engine: type
    family: str  # the torch optimizer it takes the hyper-parameters from: "sgd" or "adam"
    kwargs: tuple[str, ...]  # the algorithm's own keyword arguments
    required: tuple[str, ...] = ()
    why: str = ""  # why the required ones have no default, added to the error


_SPECS = {
    "dpsgd": _Spec(dpk_optim.DPSGD, "sgd", ("mode", "r")),
    "psac": _Spec(dpk_optim.DPSGD, "sgd", ("r",)),
    "dp2": _Spec(
        dpk_optim.DP2,
        "sgd",
        ("s1", "s2", "lr2", "max_grad_norm2", "beta", "eps", "preconditioner"),
        ("s1", "s2"),
    ),
    "pmlf": _Spec(dpk_optim.DPPMLF, "sgd", ("k", "beta", "filter")),
    "dpadam": _Spec(dpk_optim.DPAdam, "adam", ()),
    "dpadam_bc": _Spec(dpk_optim.DPAdamBC, "adam", ("gamma_prime", "gamma_prime_rel")),
    "stp": _Spec(
        dpk_optim.DPAdamSTP,
        "adam",
        ("eps1",),
        ("eps1",),
        "eps1 (ε₁) sets STP's clip scale: step 1 clips the per-sample norm at max_grad_norm·eps1, later steps "
        "‖g/(√v̂+eps1)‖ at max_grad_norm; tune it with max_grad_norm (e.g. max_grad_norm·eps1 = the clip DP-Adam "
        "would use). See dpkernels.optim.DPAdamSTP",
    ),
    "macadam": _Spec(
        dpk_optim.DPMacAdam, "adam", ("h1", "h2", "b0", "bias_correction", "gamma_prime", "gamma_prime_rel", "bc_scale")
    ),
}

#: the ``algorithm=`` names :func:`make_private` accepts
ALGORITHMS = tuple(_SPECS)

_GRAD_SAMPLE_MODES = ("hooks", "functorch", "bk")


class CorrelatedNoiseAccountant(IAccountant):
    """Records the steps of a correlated-noise (matrix-factorisation) run and refuses to report ε.

    The Opacus accountants (RDP, GDP, PRV) compose independent Gaussian steps; with correlated
    noise their ε would be wrong. dp-accounting 0.6.0 offers no matrix-factorisation (BLT / banded
    Toeplitz) accountant for Poisson-sampled participation, so there is no correct number to give.
    ``history`` keeps ``(σ, q, steps)`` entries as the RDP accountant does, so a later accountant
    can be run on it.
    """

    def __init__(self, history=None):
        self.history = list(history or [])

    def step(self, *, noise_multiplier: float, sample_rate: float):
        if self.history and self.history[-1][:2] == (noise_multiplier, sample_rate):
            sigma, q, steps = self.history.pop()
            self.history.append((sigma, q, steps + 1))
        else:
            self.history.append((noise_multiplier, sample_rate, 1))

    def get_epsilon(self, delta: float, *args, **kwargs) -> float:
        raise NotImplementedError(
            "no epsilon for correlated noise: the Opacus accountants (rdp/gdp/prv) assume independent noise per "
            "step, and the installed dp-accounting has no matrix-factorisation (BLT/banded) accountant for "
            "Poisson-sampled participation, so any epsilon reported here would be wrong. Account for the run with "
            "an MF accountant (e.g. jax_privacy's) using accountant.history and the noise mechanism."
        )

    def __len__(self) -> int:
        return sum(steps for _, _, steps in self.history)

    @classmethod
    def mechanism(cls) -> str:
        return "dpkernels_correlated"


class DPKernelsOptimizer(_OpacusDPOptimizer):
    """An Opacus ``DPOptimizer`` whose clip, noise and update are one dpkernels engine step.

    ``original_optimizer`` is the engine (:mod:`dpkernels.optim`), so Opacus's ``param_groups``,
    ``state`` and ``state_dict`` forwarding exposes the engine's, and LR schedulers set its
    ``lr``. ``noise_multiplier`` and ``max_grad_norm`` are copied into the engine at every step, so
    Opacus noise/clip schedulers keep working and the accountant hook sees the σ that was used.

    ``step(batch=(inputs, targets))``: DP-PMLF only, the batch whose per-sample gradients at the
    past iterates are recomputed. A list in ``p.grad_sample`` (gradient accumulation without
    Poisson sampling) is concatenated and divided by ``E · accumulated_iterations`` as Opacus does.
    After a step ``p.grad`` is ``None``: the engine never forms a private ``p.grad``, and the
    non-private gradient from ``backward()`` must not be mistaken for one.
    """

    def __init__(
        self,
        engine,
        *,
        algorithm: str,
        noise_multiplier: float,
        max_grad_norm: float,
        expected_batch_size: int,
        generator=None,
        secure_mode: bool = False,
        pmlf_model: nn.Module | None = None,
        pmlf_loss: Callable[[Tensor, Tensor], Tensor] | None = None,
        gsm: nn.Module | None = None,
    ):
        self._acc: int | None = None
        super().__init__(
            engine,
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            expected_batch_size=expected_batch_size,
            loss_reduction="mean",
            generator=generator,
            secure_mode=secure_mode,
        )
        self.algorithm = algorithm
        self._pmlf_model, self._pmlf_loss, self._gsm = pmlf_model, pmlf_loss, gsm

    @property
    def _bk(self) -> BKModule | None:
        return self._gsm if isinstance(self._gsm, BKModule) else None

    @property
    def accumulated_iterations(self) -> int:
        if self._bk is None:
            return super().accumulated_iterations
        return self._acc if self._acc is not None else max(1, self._bk.pending())

    def zero_grad(self, set_to_none: bool = True):
        if self._bk is not None:
            self._bk.clear()
        super().zero_grad(set_to_none)

    @property
    def engine(self):
        """The dpkernels optimizer that runs the step (``original_optimizer``)."""
        return self.original_optimizer

    def signal_skip_step(self, do_skip=True):
        if do_skip:
            raise NotImplementedError(
                f"algorithm {self.algorithm!r} through make_private does not support skipped steps "
                "(BatchMemoryManager / virtual batches): the engine clips and steps in one call"
            )
        super().signal_skip_step(do_skip)

    def clip_and_accumulate(self):
        raise NotImplementedError("DPKernelsOptimizer clips inside the engine step; call step()")

    def add_noise(self):
        raise NotImplementedError("DPKernelsOptimizer adds noise inside the engine step; call step()")

    @torch.no_grad()
    def step(self, closure=None, *, batch: tuple[Tensor, Tensor] | None = None, noise=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._check_skip_next_step():  # pragma: no cover - signal_skip_step(True) already raised
            raise NotImplementedError("skipped steps are not supported")
        params = self.params
        if not params:
            return loss
        is_pmlf = self.algorithm == "pmlf"
        if batch is not None and not is_pmlf:
            raise ValueError(f"step(batch=...) is for algorithm 'pmlf' only, not {self.algorithm!r}")
        if self._bk is not None:
            self._bk_step(batch, noise)
        else:
            self._grad_sample_step(params, batch, noise)
        if self.step_hook:
            self.step_hook(self)
        self._acc = None
        return loss

    def _grad_sample_step(self, params, batch, noise) -> None:
        is_pmlf = self.algorithm == "pmlf"
        saved = [getattr(p, "grad_sample", None) for p in params]
        for idx, gs in enumerate(saved):
            if gs is None:
                raise ValueError(
                    f"parameter {idx} (shape {tuple(params[idx].shape)}) has no grad_sample: run forward and "
                    "backward through the module make_private returned before step()"
                )
            _check_processed_flag(gs)
        acc = self.accumulated_iterations
        engine = self.engine
        # The engine's own checks (a NaN σ or a zero C would reach the accountant otherwise).
        engine.set_step_params(self.noise_multiplier, self.max_grad_norm, self.expected_batch_size * acc)
        try:
            if is_pmlf:
                if acc != 1:
                    raise NotImplementedError(
                        "gradient accumulation (a list in p.grad_sample) is not supported for pmlf"
                    )
                pasts = self._pmlf_past_grad_samples(batch)
                for p, gs, past in zip(params, saved, pasts, strict=True):
                    p.grad_sample = [gs, *past]
            else:
                for p, gs in zip(params, saved, strict=True):
                    p.grad_sample = torch.cat(gs, dim=0) if isinstance(gs, list) else gs
            engine.step(noise=noise)
        finally:
            for p, gs in zip(params, saved, strict=True):
                p.grad_sample = gs
        for p, gs in zip(params, saved, strict=True):
            _mark_as_processed(gs)
            p.grad = None

    def _bk_step(self, batch, noise) -> None:
        """The step from the BK module's captured layers (``grad_sample_mode="bk"``): the
        micro-batches since the last step are accumulated samples; DP-PMLF's past sets are
        recomputed by BK forward/backward passes at the past iterates."""
        bk = self._bk
        current = bk.batch()
        acc = current.num_micro_batches
        if acc == 0:
            raise ValueError("nothing was captured: run forward and backward through the module make_private "
                             "returned before step()")  # fmt: skip
        if self.algorithm == "pmlf":
            if acc != 1:
                raise NotImplementedError("gradient accumulation is not supported for pmlf")
            current = BKBatch(current.sets + self._pmlf_past_bk_sets(batch))
        self._acc = acc
        self.engine.set_step_params(self.noise_multiplier, self.max_grad_norm, self.expected_batch_size * acc)
        self.engine.step(noise=noise, per_sample=current)
        for p in self.params:
            p.grad = None

    def _pmlf_past_bk_sets(self, batch) -> list:
        """DP-PMLF's ``k − 1`` past gradient sets of ``batch`` as BK captures: a forward and backward
        of the mean loss through the BK module with the parameters at each past iterate."""
        inputs, targets = self._check_pmlf_batch(batch)
        bk, engine = self._bk, self.engine
        named = [(n, p) for n, p in bk.named_parameters() if p.requires_grad]
        position = {id(p): i for i, p in enumerate(self.params)}
        sets = []
        for past in engine.past_params():
            state = {n: (past[position[id(p)]] if id(p) in position else p).detach().requires_grad_(True)
                     for n, p in named}  # fmt: skip
            with torch.enable_grad():
                loss = self._pmlf_loss(torch.func.functional_call(bk, state, (inputs,)), targets)
                loss.backward()
            sets.extend(bk.batch().sets)
        return sets

    @staticmethod
    def _check_pmlf_batch(batch):
        if batch is None:
            raise ValueError(
                "algorithm 'pmlf' needs the batch at every step: optimizer.step(batch=(inputs, targets)); "
                "DP-PMLF recomputes this batch's per-sample gradients at the k-1 previous iterates"
            )
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise TypeError("batch must be a pair (inputs, targets)")
        return batch

    def _pmlf_past_grad_samples(self, batch) -> list[list[Tensor]]:
        """Per engine parameter, the ``k − 1`` per-sample gradient sets of ``batch`` at the past iterates."""
        inputs, targets = self._check_pmlf_batch(batch)
        params = self.params
        if self.engine.k == 1:
            return [[] for _ in params]
        model = self._pmlf_model
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        position = {id(p): i for i, p in enumerate(params)}
        states = [
            {n: past[position[id(p)]] if id(p) in position else p.detach() for n, p in named}
            for past in self.engine.past_params()
        ]
        if inputs.shape[0] == 0:
            return [[torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device) for _ in states] for p in params]
        # The capture hooks must not add to p.grad_sample, and torch.func cannot trace through the
        # BackwardHookFunction of a full backward hook even when Opacus disables it: remove, re-add.
        gsm = self._gsm
        gsm.remove_hooks()
        try:
            with torch.enable_grad():
                grads = pmlf_grad_samples(model, self._pmlf_loss, inputs, targets, states, include_current=False)
        finally:
            gsm.add_hooks(
                loss_reduction=gsm.loss_reduction, batch_first=gsm.batch_first, force_functorch=gsm.force_functorch
            )
            gsm.enable_hooks()
        by_param = {id(p): g for (_, p), g in zip(named, grads, strict=True)}
        return [by_param[id(p)] for p in params]


def _check_sgd(algorithm: str, opt: torch.optim.Optimizer) -> list[dict]:
    if type(opt) is not torch.optim.SGD:
        raise TypeError(
            f"algorithm {algorithm!r} takes its hyper-parameters from a torch.optim.SGD, got {type(opt).__name__}"
            + ("; use algorithm='dpadam'" if isinstance(opt, torch.optim.Adam) else "")
        )
    hypers = []
    for i, g in enumerate(opt.param_groups):
        h = param_group_hypers(opt, g, i)
        if algorithm in ("dp2", "pmlf"):
            if h["momentum"] or h["weight_decay"]:
                raise ValueError(
                    f"algorithm {algorithm!r} has no momentum or weight decay; SGD param group {i} has "
                    f"momentum={h['momentum']}, weight_decay={h['weight_decay']}"
                )
            h = {"lr": h["lr"]}
        hypers.append(h)
    return hypers


def _check_adam(algorithm: str, opt: torch.optim.Optimizer) -> list[dict]:
    if type(opt) not in (torch.optim.Adam, torch.optim.AdamW):
        raise TypeError(
            f"algorithm {algorithm!r} takes its hyper-parameters from torch.optim.Adam or AdamW, got "
            f"{type(opt).__name__}" + ("; use algorithm='dpsgd'" if isinstance(opt, torch.optim.SGD) else "")
        )
    hypers = []
    for i, g in enumerate(opt.param_groups):
        h = param_group_hypers(opt, g, i)
        if algorithm == "macadam":
            if h.pop("weight_decay"):
                raise ValueError(
                    f"algorithm 'macadam' has no weight decay; param group {i} has weight_decay={g['weight_decay']}"
                )
        elif algorithm == "dpadam_bc":
            if h.pop("eps") != 1e-8:
                raise ValueError(
                    f"algorithm 'dpadam_bc' has no eps (its floor is gamma_prime=); param group {i} has eps={g['eps']}"
                )
        elif algorithm == "stp":
            h["eps2"] = h.pop("eps")
        hypers.append(h)
    return hypers


def _engine_args(algorithm, optimizer, algo_kwargs, correlated_noise) -> tuple[_Spec, list[dict], dict]:
    """Validate the algorithm, its keyword arguments and the torch optimizer; return
    ``(spec, per-group hyper-parameters, engine keyword arguments)``."""
    if algorithm not in _SPECS:
        raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {', '.join(ALGORITHMS)}")
    spec = _SPECS[algorithm]
    unknown = sorted(set(algo_kwargs) - set(spec.kwargs))
    if unknown:
        allowed = ", ".join(spec.kwargs) or "none"
        raise TypeError(f"algorithm {algorithm!r} got unexpected keyword argument(s) {unknown}; it takes: {allowed}")
    missing = [k for k in spec.required if k not in algo_kwargs]
    if missing:
        raise TypeError(f"algorithm {algorithm!r} needs keyword argument(s) {missing}" + (spec.why and f": {spec.why}"))
    if correlated_noise is not None and not isinstance(correlated_noise, _StreamingNoise):
        raise TypeError(f"correlated_noise must be a BLTNoise or BandedNoise, got {type(correlated_noise).__name__}")
    why_not = spec.engine._NO_CORRELATED_NOISE
    if correlated_noise is not None and why_not:  # refused before Opacus hooks the model
        raise ValueError(f"algorithm {algorithm!r} does not support correlated_noise: {why_not}")
    hypers = (_check_sgd if spec.family == "sgd" else _check_adam)(algorithm, optimizer)
    kwargs = dict(algo_kwargs)
    if algorithm == "psac":
        kwargs = {"mode": "psac", "r": kwargs.get("r", 0.1)}
    if algorithm == "dp2" and "lr2" not in algo_kwargs:
        for h in hypers:  # DP²'s phase-2 rate defaults to each group's own lr
            h["lr2"] = h["lr"]
    return spec, hypers, kwargs


def make_private(
    privacy_engine: _OpacusPrivacyEngine,
    *,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    criterion=None,
    data_loader,
    noise_multiplier: float,
    max_grad_norm: float,
    batch_first: bool = True,
    loss_reduction: str = "mean",
    poisson_sampling: bool = True,
    clipping: str = "flat",
    noise_generator=None,
    grad_sample_mode: str = "hooks",
    wrap_model: bool = True,
    rand_on_empty: bool = False,
    algorithm: str = "dpsgd",
    backend: str = "auto",
    seed: int | None = None,
    correlated_noise=None,
    **algo_kwargs,
):
    """``opacus.PrivacyEngine.make_private`` with a dpkernels optimizer; returns ``(module, optimizer,
    data_loader)`` as Opacus does. See the module docstring for the algorithms, accounting and
    restrictions.

    Args (besides Opacus's): ``algorithm`` (one of :data:`ALGORITHMS`); ``backend`` of the engine
    (``auto``, ``reference``, ``cpu``, ``cuda``, ``triton``); ``seed``: the Philox noise key (default:
    drawn from ``noise_generator`` if given, else fresh from the OS); ``correlated_noise``: a
    :class:`dpkernels.BLTNoise`/:class:`dpkernels.BandedNoise` with ``std=1, start_step=1`` (ε is
    then refused, see :class:`CorrelatedNoiseAccountant`); ``**algo_kwargs``: the algorithm's own
    arguments (``r``, ``s1``, ``k``, ...).
    """
    criterion = nn.CrossEntropyLoss() if criterion is None else criterion
    spec, hypers, engine_kwargs = _engine_args(algorithm, optimizer, algo_kwargs, correlated_noise)
    for name, value, allowed in (
        ("clipping", clipping, ("flat",)),
        ("grad_sample_mode", grad_sample_mode, _GRAD_SAMPLE_MODES),
        ("loss_reduction", loss_reduction, ("mean",)),
        ("wrap_model", wrap_model, (True,)),
    ):
        if value not in allowed:
            raise NotImplementedError(
                f"make_private(algorithm={algorithm!r}) supports {name} in {allowed}, got {value!r} "
                "(the engine clips flat over all parameters from p.grad_sample of a GradSampleModule)"
            )
    if isinstance(module, (nn.parallel.DistributedDataParallel, FSDPModule)):
        raise NotImplementedError(
            f"make_private(algorithm={algorithm!r}) supports one distributed module, Opacus's "
            "DifferentiallyPrivateDistributedDataParallel (torch's DDP all-reduces the non-private gradients, "
            "FSDP shards the parameters)"
        )
    distributed = isinstance(module, _DPDDP)
    if isinstance(max_grad_norm, (list, tuple)):
        raise NotImplementedError("a list of max_grad_norm is per-layer clipping; the engines clip flat")
    rng = "chacha20" if privacy_engine.secure_mode else "philox"
    if seed is None and noise_generator is not None and correlated_noise is None:
        seed = int(torch.randint(0, 2**62, (1,), generator=noise_generator, device=noise_generator.device).item())
    if correlated_noise is not None and seed is None:
        seed = correlated_noise.seed
    params = [p for g in optimizer.param_groups for p in g["params"]]
    device = params[0].device if params else torch.device("cpu")

    def build(groups, batch_size, distributed=False):
        return spec.engine(
            groups,
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            expected_batch_size=batch_size,
            seed=seed,
            correlated_noise=correlated_noise,
            backend=backend,
            rng=rng,
            distributed=distributed,
            **hypers[0],
            **engine_kwargs,
        )

    # Every value check of the engine, on a stand-in parameter, before Opacus hooks the module.
    build([{"params": [torch.zeros(1, device=device)]}], 1)

    out = _OpacusPrivacyEngine.make_private(
        privacy_engine,
        module=module,
        optimizer=optimizer,
        criterion=criterion,
        data_loader=data_loader,
        noise_multiplier=noise_multiplier,
        max_grad_norm=max_grad_norm,
        batch_first=batch_first,
        loss_reduction=loss_reduction,
        poisson_sampling=poisson_sampling,
        clipping=clipping,
        noise_generator=noise_generator,
        grad_sample_mode="hooks" if grad_sample_mode == "bk" else grad_sample_mode,
        wrap_model=wrap_model,
        rand_on_empty=rand_on_empty,
    )
    gsm, opacus_opt, loader = out[0], out[1], out[-1]
    if grad_sample_mode == "bk":  # Opacus validated the module and built the loader; BK replaces its hooks
        gsm._close()
        gsm = BKModule(gsm._module, loss_reduction=loss_reduction)
    sample_rate = 1 / len(loader)  # as Opacus computes it (privacy_engine.py, make_private)
    groups = [{"params": g["params"], **h} for g, h in zip(optimizer.param_groups, hypers, strict=True)]
    # Opacus's E is per rank under DDP (divided by the world size); the engine's B is the global one.
    batch_size = round(opacus_opt.expected_batch_size * (dist.get_world_size() if distributed else 1))
    engine = build(groups, batch_size, distributed)
    dp_opt = DPKernelsOptimizer(
        engine,
        algorithm=algorithm,
        noise_multiplier=noise_multiplier,
        max_grad_norm=max_grad_norm,
        expected_batch_size=batch_size,
        generator=noise_generator,
        secure_mode=privacy_engine.secure_mode,
        pmlf_model=gsm._module if algorithm == "pmlf" else None,
        pmlf_loss=criterion,
        gsm=gsm,
    )
    if correlated_noise is not None:
        privacy_engine.accountant = CorrelatedNoiseAccountant(privacy_engine.accountant.history)
    dp_opt.attach_step_hook(privacy_engine.accountant.get_optimizer_hook_fn(sample_rate=sample_rate))
    return gsm, dp_opt, loader


class PrivacyEngine(_OpacusPrivacyEngine):
    """``opacus.PrivacyEngine`` whose ``make_private`` is :func:`make_private` (``algorithm=`` etc.)."""

    def make_private(self, **kwargs):
        return make_private(self, **kwargs)

    def load_checkpoint(self, *, path, module, optimizer=None, torch_load_kwargs=None, **kwargs):
        """Opacus's ``load_checkpoint``, checked before it loads anything (Opacus loads the module and
        the accountant before the optimizer refuses a state). For a :class:`DPKernelsOptimizer` the
        checkpoint must hold the engine's state and the engine must accept it
        (``check_state_dict``: class, layout, rng, ...): without it the noise counter would restart
        at 1 under the constructor's seed, the saved run's if that was given, and add the noise of
        its first steps again. The accountant's mechanism must match. A refused checkpoint raises
        ``ValueError`` with module, accountant and optimizer unchanged. The file is read once and
        deserialised twice (for the checks, then by Opacus)."""
        data = path.read() if hasattr(path, "read") else Path(path).read_bytes()
        if isinstance(optimizer, DPKernelsOptimizer):
            ckpt = torch.load(io.BytesIO(data), **(torch_load_kwargs or {}), weights_only=False)
            saved = ckpt.get("optimizer_state_dict")
            if not saved:
                raise ValueError(
                    "the checkpoint holds no optimizer state: the engine would restart its noise counter (pass "
                    "optimizer= to save_checkpoint)"
                )
            optimizer.engine.check_state_dict(saved)
            mechanism = ckpt.get("privacy_accountant_state_dict", {}).get("mechanism")
            if mechanism != self.accountant.mechanism():
                raise ValueError(
                    f"the checkpoint's accountant is {mechanism!r}, this engine's {self.accountant.mechanism()!r}"
                )
            del ckpt
        return super().load_checkpoint(
            path=io.BytesIO(data), module=module, optimizer=optimizer, torch_load_kwargs=torch_load_kwargs, **kwargs
        )

    def make_private_with_epsilon(
        self, *, data_loader, target_epsilon: float, target_delta: float, epochs: int, correlated_noise=None, **kwargs
    ):
        """:meth:`make_private` with ``σ`` from Opacus's ``get_noise_multiplier`` for ``(target_epsilon,
        target_delta)`` over ``epochs`` at ``q = 1/len(data_loader)``, with this engine's accountant (as
        Opacus's ``make_private_with_epsilon``; its ``**kwargs`` would reach the accountant, so the
        ``algorithm`` arguments are not forwarded there). Correlated noise raises: no accountant here
        can calibrate it."""
        if correlated_noise is not None:
            raise NotImplementedError(
                "make_private_with_epsilon cannot calibrate correlated noise: the installed accountants have no "
                "matrix-factorisation accounting (see CorrelatedNoiseAccountant); choose noise_multiplier yourself"
            )
        from opacus.accountants.utils import get_noise_multiplier

        sigma = get_noise_multiplier(
            target_epsilon=target_epsilon,
            target_delta=target_delta,
            sample_rate=1 / len(data_loader),
            epochs=epochs,
            accountant=self.accountant.mechanism(),
        )
        return make_private(self, data_loader=data_loader, noise_multiplier=sigma, **kwargs)
