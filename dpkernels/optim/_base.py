"""The base of every DP optimizer: intake, the all-or-nothing step, ``step_from_sums``, the noise
counter, param groups, secure noise, correlated noise and the checkpoint, for every backend.

A step is two stages (docs/ALGORITHMS.md "Optimizers"):

1. **clip**: the per-sample clipping pipeline of :mod:`dpkernels.clip` on the optimizer's backend
   (norms with the algorithm's shift/scale, weights, the clipped sum ``S``);
2. **one family op per param group** (``sgd_step_``, ``dp2_step_``, ``adam_step_``,
   ``macadam_step_``; schemas in csrc/ops.cpp, scalars named in :mod:`dpkernels._kernel_args`):
   it reads ``S``, generates the noise (Philox, or its correlated version through the mechanism's
   buffers), applies the update and writes every state buffer and the parameters.

The op comes from the registry family :data:`OPTIM`: the pure-PyTorch functions of
:mod:`dpkernels.reference.optim` (``backend="reference"``, fp64-capable), the native ops
(``cpu``/``cuda``) or the Triton kernels. Every backend keeps one state layout (:data:`LAYOUT`),
so a checkpoint saved on one backend loads on every other.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from collections.abc import Sequence

import torch
from torch import Tensor

from .. import _backend, _validate
from .._kernel_args import FILTER, HyperSpec
from .._registry import family
from ..bk import BKBatch
from ..clip import _check_mode, _clipped_sums
from ..noise import RNGS, _check_counter, _signed64, fresh_key, fresh_seed, gaussian_noise
from ..reference import optim as ref
from ..reference.noise import standard_normal
from ..reference.optim import state_dtype
from . import _distributed

_NATIVE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Filter coefficients ``[a, g]`` of independent noise: ν = std·z.
INDEPENDENT = FILTER.pack(a=1.0, g=1.0, c=[], d=[], e=[], f=[])
#: The state layout of every backend (rings, reciprocals kept for the next clip pass); "fused" is
#: the same layout as saved by dpkernels 0.1's fused backends.
LAYOUT = "dpkernels-1"
_SAME_LAYOUT = ("fused",)

_check_number = _validate.real


# --------------------------------------------------------------------------------------------
# The optim op family
# --------------------------------------------------------------------------------------------


class _NativeOptim:
    """``torch.ops.dpkernels_C`` (csrc/ops.cpp): CPU and CUDA kernels, one schema."""

    @staticmethod
    def sgd_step_(params, sums, state, dir_coeffs, past, noise, noise_state, noise_coeffs, noise_std, seed, step,
                  stream, offset, hyper):  # fmt: skip
        torch.ops.dpkernels_C.sgd_step_(params, sums, state, dir_coeffs, past, noise, noise_state, noise_coeffs,
                                        noise_std, seed, step, stream, offset, hyper)  # fmt: skip

    @staticmethod
    def dp2_step_(params, sums, state, noise, noise_state, noise_coeffs, noise_std, seed, step, stream, offset, hyper):
        torch.ops.dpkernels_C.dp2_step_(params, sums, state, noise, noise_state, noise_coeffs, noise_std, seed, step,
                                        stream, offset, hyper)  # fmt: skip

    @staticmethod
    def adam_step_(params, sums, state, noise, noise_state, noise_coeffs, noise_std, seed, step, stream, offset,
                   hyper):  # fmt: skip
        torch.ops.dpkernels_C.adam_step_(params, sums, state, noise, noise_state, noise_coeffs, noise_std, seed, step,
                                         stream, offset, hyper)  # fmt: skip

    @staticmethod
    def macadam_step_(params, sums, state, noise, noise_state, noise_coeffs, noise_std, seed, step, stream, offset,
                      hyper):  # fmt: skip
        return torch.ops.dpkernels_C.macadam_step_(params, sums, state, noise, noise_state, noise_coeffs, noise_std,
                                                   seed, step, stream, offset, hyper)  # fmt: skip


def _triton_optim():
    from ..triton_kernels import optim as triton_optim

    return triton_optim


OPTIM = family(
    "optim",
    ("sgd_step_", "dp2_step_", "adam_step_", "macadam_step_"),
    reference=lambda: ref,
    cpu=lambda: _NativeOptim,
    cuda=lambda: _NativeOptim,
    triton=_triton_optim,
)

if _backend.has_native_ops():
    # The other three family ops mutate their arguments and return nothing: torch derives their fake kernels.
    @torch.library.register_fake("dpkernels_C::macadam_step_")
    def _(params, sums, state, noise, noise_state, noise_coeffs, noise_std, seed, step, stream, offset, hyper):
        return params[0].new_empty((), dtype=torch.float64)


# --------------------------------------------------------------------------------------------
# The privacy arguments every optimizer takes
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PrivacyArgs:
    """The keyword arguments shared by every optimizer, declared once.

    Args:
        noise_multiplier: ``σ``; the noise std on the clipped sum is ``σ·C``.
        max_grad_norm: ``C``, the flat clip bound (and the add/remove sensitivity of the sum).
        expected_batch_size: ``B`` of Poisson sampling; the private mean is ``(S + ν)/B``.
        mode: the clip mode of :func:`dpkernels.clip_factors`; ``r`` its parameter.
        seed: the Philox key of the noise (fresh from the OS when None); with ``correlated_noise``,
            pass the seed to the mechanism only.
        correlated_noise: a :class:`dpkernels.BLTNoise`/:class:`dpkernels.BandedNoise` with std 1,
            ``start_step=1`` and stream 0, whose correlated ``z`` replaces the independent one.
        backend: ``"auto"`` or one of ``dpkernels.BACKENDS``.
        rng: ``"philox"`` (in-pass) or ``"chacha20"`` (secure mode, pre-drawn); ``secure_key`` is
            ChaCha20's 256-bit key (fresh from the OS CSPRNG when None).
        distributed: ``False`` (one process), ``True`` (the default ``torch.distributed`` group) or a
            ``ProcessGroup``: data parallel, each rank clipping its own samples, the clipped sums
            all-reduced and the noise (std ``σ·C``) drawn once for the global batch, identically on
            every rank (:mod:`dpkernels.optim._distributed`); ``expected_batch_size`` is then global.
    """

    noise_multiplier: float
    max_grad_norm: float
    expected_batch_size: int
    mode: str = "clip"
    r: float | None = None
    seed: int | None = None
    correlated_noise: object = None
    backend: str = "auto"
    rng: str = "philox"
    secure_key: int | None = None
    distributed: object = False


_PRIVACY_PARAMS = [
    inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY,
                      default=inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default)
    for f in dataclasses.fields(PrivacyArgs)
]  # fmt: skip


@dataclasses.dataclass
class ClipPlan:
    """What one step's clip reads, formed from the state before anything is written: the bound
    ``C`` (the sensitivity: the noise is ``σ·C``), the weights of the gradient sets (DP-PMLF's
    per-sample momentum), the per-coordinate ``shift``/``scale`` lists (one tensor per parameter, or
    None), the norm's ``norm_scale``, and ``carry``: the optimizer's own values from the plan to
    :meth:`DPOptimizer._apply` (DP²'s refreshed preconditioner, stored only once the clip passed)."""

    C: float
    coeffs: tuple = (1.0,)
    shift: list[Tensor] | None = None
    scale: list[Tensor] | None = None
    norm_scale: float = 1.0
    carry: object = None


def _first_device(groups: list) -> torch.device:
    """The device of the first parameter as the constructor receives it (tensors, or param-group
    dicts, some possibly empty); CPU when there is none (the constructor then raises)."""
    for g in groups:
        ps = g["params"] if isinstance(g, dict) else g
        ps = [ps] if isinstance(ps, Tensor) else list(ps)
        if ps and isinstance(ps[0], Tensor):
            return ps[0].device
    return torch.device("cpu")


def check_betas(betas) -> tuple[float, float]:
    if not isinstance(betas, Sequence) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    return (_check_number("betas[0]", betas[0], low=0.0, high=1.0, high_open=True),
            _check_number("betas[1]", betas[1], low=0.0, high=1.0, high_open=True))  # fmt: skip


def bias(beta: float, t: int) -> float:
    """``1 − β^t`` in float64."""
    return 1.0 - beta**t


#: the default ``ρ`` of the relative floor ``γ'_t = ρ·Φ̄_t`` of DP-AdamBC and DP-MacAdamBC (DPAdamBC's docstring)
GAMMA_PRIME_REL = 0.1


def gamma_prime_defaults(gamma_prime, gamma_prime_rel, default_rel: float) -> dict:
    """The group defaults ``gamma_prime`` (absolute ``γ'``, or None) and ``gamma_prime_rel`` (``ρ`` of
    the relative ``γ'_t = ρ·Φ̄_t``, or None): at most one of the two may be given."""
    if gamma_prime is not None and gamma_prime_rel is not None:
        raise ValueError("give gamma_prime (an absolute floor) or gamma_prime_rel (relative to the noise variance), "
                         "not both")  # fmt: skip
    if gamma_prime is not None:
        return dict(gamma_prime=_check_number("gamma_prime", gamma_prime, low=0.0, low_open=True),
                    gamma_prime_rel=None)  # fmt: skip
    rel = default_rel if gamma_prime_rel is None else gamma_prime_rel
    return dict(gamma_prime=None, gamma_prime_rel=_check_number("gamma_prime_rel", rel, low=0.0, low_open=True))


#: the relative floor's value when the noise variance is 0 (σ = 0): only keeps 0/0 out
_TINY = torch.finfo(torch.float32).tiny


def gamma_prime_of(group: dict, phi: float) -> float:
    """``γ'`` of ``group`` for the noise variance ``phi``: its absolute ``gamma_prime``, else
    ``max(gamma_prime_rel·phi, tiny)``."""
    if group["gamma_prime"] is not None:
        return group["gamma_prime"]
    return max(group["gamma_prime_rel"] * phi, _TINY)


class DPOptimizer(torch.optim.Optimizer):
    """Base class: validation, per-sample gradient intake, the clip stage, the family op, noise,
    state (de)serialisation. Subclasses implement :meth:`_apply` (stage 2) and, if their clip
    reads their state, :meth:`_plan`; their constructors take ``params``, their own hyper-parameters
    and ``**privacy``: the keyword arguments of :class:`PrivacyArgs` (their signature shows them).

    A step is all or nothing: every parameter, per-sample gradient, noise tensor and counter is
    checked before the clip runs, and the clip (:meth:`_plan`, then the clipped sum and its
    non-finite check) runs before :meth:`_apply` writes a parameter or a state entry. A
    step that raises leaves the parameters, the state, the noise counter and (through
    ``make_private``) the accountant exactly as they were, so a retry never reuses noise.
    """

    #: number of per-sample gradient sets read from ``p.grad_sample`` (DP-PMLF: ``k``)
    _num_grad_sets: int = 1
    #: ``p.grad_sample`` is a list of ``_num_grad_sets`` tensors (DP-PMLF, even for k = 1)
    _grad_sample_is_list: bool = False
    #: the clip does not depend on optimizer state: :meth:`step_from_sums` is allowed
    _accepts_sums: bool = False
    #: the family op's state buffers, in schema order (csrc/ops.cpp)
    _STATE_KEYS: tuple[str, ...] = ()
    #: defaults of privacy arguments that differ from :class:`PrivacyArgs`' (DP-MacAdam's C = 1)
    _PRIVACY_DEFAULTS: dict = {}
    #: global state fields that checkpoints of earlier versions lack (:meth:`_load_global_state` fills them in)
    _NEWER_GLOBALS: frozenset = frozenset()
    #: why the optimizer refuses ``correlated_noise`` (empty: it takes it)
    _NO_CORRELATED_NOISE: str = ""

    def __init_subclass__(cls, **kwargs):
        """Show the shared privacy arguments in each optimizer's signature (``help``, ``inspect``)."""
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is None:
            return
        sig = inspect.signature(init)
        own = [p for p in sig.parameters.values() if p.kind != inspect.Parameter.VAR_KEYWORD]
        names = {p.name for p in own}
        extra = [p.replace(default=cls._PRIVACY_DEFAULTS.get(p.name, p.default)) for p in _PRIVACY_PARAMS
                 if p.name not in names]  # fmt: skip
        positional = [p for p in own if p.kind != inspect.Parameter.KEYWORD_ONLY]
        keyword = [p for p in own if p.kind == inspect.Parameter.KEYWORD_ONLY]
        init.__signature__ = sig.replace(parameters=positional + extra + keyword)

    def __init__(self, params, defaults: dict, privacy: dict):
        try:
            args = PrivacyArgs(**{**self._PRIVACY_DEFAULTS, **privacy})
        except TypeError as e:
            raise TypeError(f"{type(self).__name__}: {e}".replace("PrivacyArgs.__init__() ", "")) from None
        if args.rng not in RNGS:
            raise ValueError(f"unknown rng {args.rng!r}; expected one of {RNGS}")
        if args.secure_key is not None and args.rng == "philox":
            raise ValueError("secure_key is the ChaCha20 key of rng='chacha20'; the Philox key is seed=")
        # ChaCha20's 256-bit key (docs/RNG.md §6), fresh from the OS CSPRNG unless given.
        self.secure_key = (fresh_key() if args.secure_key is None else args.secure_key) if args.rng == "chacha20" \
            else None  # fmt: skip
        _check_number("lr", defaults.get("lr"), low=0.0)
        groups = list(params)
        # Resolved before the state is created: the parameter checks depend on it.
        self.backend = _backend.resolve(args.backend, _first_device(groups))
        super().__init__(groups, defaults)
        self.set_step_params(args.noise_multiplier, args.max_grad_norm, args.expected_batch_size)
        self.mode = args.mode
        self.r = _check_mode(args.mode, args.r)
        self.correlated_noise = self._check_correlated(args.correlated_noise, args.seed)
        if args.correlated_noise is not None:
            self.seed = args.correlated_noise.seed
        else:
            self.seed = fresh_seed() if args.seed is None else _validate.integer("seed", args.seed, low=0, high=2**64)
        params = self._params()
        if not params:
            raise ValueError(f"{type(self).__name__} got no parameters (every param group is empty)")
        self._check_params(params)
        self.process_group = _distributed.process_group(args.distributed)
        if self.process_group is not None:
            self._agree(args, params)
        #: the global flat index of this optimizer's first parameter element: the noise counter's
        #: ``e`` starts there (a ZeRO-1 shard, :class:`~dpkernels.optim._distributed.ShardedDPOptimizer`)
        self._noise_offset = 0
        self._step = 0
        #: book-keeping steps on the CPU write the Linear and Embedding weights' clipped sums here, one
        #: buffer per parameter reused every step (BKBatch.clipped_sums); scratch, not state
        self._sum_buffers: dict = {}
        for p in params:
            self.state[p] = self._init_state(p)
        self.rng = args.rng
        if self.rng != "philox" and self.correlated_noise is not None:
            raise ValueError("correlated_noise draws Philox noise; rng='chacha20' cannot be combined with it")

    def _agree(self, args: PrivacyArgs, params: list[Tensor]) -> None:
        """Make the ranks use one noise key (rank 0's fresh one unless given) and check that they
        were built alike; every rank raises the same error otherwise."""
        given = dict(
            cls=type(self).__name__, noise_multiplier=self.noise_multiplier, max_grad_norm=self.max_grad_norm,
            expected_batch_size=self.expected_batch_size, mode=self.mode, r=self.r, rng=args.rng,
            shapes=[tuple(p.shape) for p in params], groups=[len(g["params"]) for g in self.param_groups],
        )  # fmt: skip
        drawn = {}
        for name, value, fresh in (("seed", self.seed, args.seed is None and args.correlated_noise is None),
                                   ("secure_key", self.secure_key, args.secure_key is None)):  # fmt: skip
            (drawn if fresh else given)[name] = value
        for name, value in _distributed.agree(self.process_group, given, drawn).items():
            setattr(self, name, value)

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
        """Raise for a parameter the step cannot update: not floating point, on another device than
        the others (the noise is indexed by one flat counter over all of them), and on the fused
        backends not fp32/fp16/bf16 or not contiguous."""
        for idx, p in enumerate(params):
            if not p.is_floating_point():
                raise TypeError(f"parameter {idx} has dtype {p.dtype}; every parameter must be floating point")
            if p.device != params[0].device:
                raise ValueError(
                    f"parameter {idx} is on {p.device} but parameter 0 is on {params[0].device}; all parameters "
                    "of a DP optimizer must be on one device (one flat noise index)"
                )
            if self.backend == "reference":
                continue
            if p.dtype not in _NATIVE_DTYPES:
                raise TypeError(
                    f"parameter {idx} has dtype {p.dtype}; backend {self.backend!r} updates float32, float16 "
                    "and bfloat16 parameters (float64 runs on backend='reference')"
                )
            if not p.is_contiguous():
                raise ValueError(f"parameter {idx} (shape {tuple(p.shape)}) must be contiguous for a fused step")

    # ----------------------------------------------------------------------------------------
    # Hooks for subclasses
    # ----------------------------------------------------------------------------------------

    def _init_state(self, p: Tensor) -> dict:
        return {}

    def _plan(self, params: list[Tensor], t: int) -> ClipPlan:
        """What step ``t``'s clip reads from the state (per-coordinate lists shaped like ``params``).
        Writes nothing: a step that fails in its clip must leave the state as it was."""
        return ClipPlan(self.max_grad_norm)

    def _apply(self, params: list[Tensor], sums: list[Tensor], c_total, t: int, noise, plan: ClipPlan) -> None:
        """Stage 2 from the clipped sums ``S`` of sensitivity ``plan.C`` (``c_total``: ``Σ_i c_i`` as
        a 0-d tensor, or None after :meth:`step_from_sums`): noise, update, state."""
        raise NotImplementedError

    @classmethod
    def _whole_model_defaults(cls, kwargs: dict, numel: int) -> dict:
        """``kwargs`` with the defaults that depend on the model's size resolved for ``numel``
        parameter elements (a ZeRO-1 shard is built over a part of them)."""
        return kwargs

    def _sum_over_shards(self, x: float) -> float:
        """A sum over every parameter element, from this optimizer's part of it (identity unless a
        ZeRO-1 shard, whose wrapper sums over the ranks)."""
        return x

    def _global_state(self) -> dict:
        """Global (not per-parameter) state saved in ``state_dict()["dp"]``, besides step and seed."""
        return {"secure_key": self.secure_key}

    def _load_global_state(self, dp: dict) -> None:
        self.secure_key = dp["secure_key"]

    # ----------------------------------------------------------------------------------------
    # Public API
    # ----------------------------------------------------------------------------------------

    @classmethod
    def _check_correlated(cls, mech, seed):
        """A :class:`dpkernels.BLTNoise`/:class:`dpkernels.BandedNoise` that supplies ``z``'s correlated
        version: unit std (the optimizer scales by ``σ·C``), its first step = the optimizer's step 1,
        and its seed is the optimizer's noise seed; refused by an optimizer with ``_NO_CORRELATED_NOISE``."""
        if mech is None:
            return None
        if cls._NO_CORRELATED_NOISE:
            raise ValueError(f"{cls.__name__} does not support correlated_noise: {cls._NO_CORRELATED_NOISE}")
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
        """Unit noise ``z_t`` of step ``t``: fp32 ``N(0, 1)``, one tensor per parameter.

        Philox (docs/RNG.md) with key ``seed`` and counter ``(e, t, stream=0)``, ``e`` the global
        flat index over the parameters in ``param_groups`` order: the ``z`` that step ``t`` draws in
        its pass, identical to the noise that ``dpkernels.privatize(..., seed=seed, step=t)`` adds.
        With a correlated-noise mechanism, ``(C⁻¹z)_t`` (this advances the mechanism).
        """
        params = self._params()
        if self.correlated_noise is not None:
            return self.correlated_noise.noise([p.shape for p in params], t, device=params[0].device)
        z = standard_normal(sum(p.numel() for p in params), seed=self.seed, step=t, offset=self._noise_offset,
                            device=params[0].device)  # fmt: skip
        return [part.view(p.shape) for part, p in zip(torch.split(z, [p.numel() for p in params]), params, strict=True)]

    @torch.no_grad()
    def step(self, closure=None, *, noise: Sequence[Tensor] | None = None, per_sample: BKBatch | None = None):
        """One private step from ``p.grad_sample``; see the class docstring of each optimizer.

        ``noise``: optional pre-drawn noise on the clipped sum (``σ·Δ·z``, one tensor per
        parameter, shaped like it), used instead of the generator, as ``privatize(noise=...)``.
        ``per_sample``: a :class:`dpkernels.bk.BKBatch` (book-keeping clipping: the layers' inputs
        and output gradients, no per-sample gradients) read instead of ``p.grad_sample``.
        All or nothing: a step that raises changes nothing (class docstring).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = self._params()
        self._check_params(params)
        if per_sample is None:
            grad_sets = self._grad_sets(params)
        elif not isinstance(per_sample, BKBatch) or per_sample.num_sets != self._num_grad_sets:
            raise TypeError(f"per_sample must be a dpkernels.bk.BKBatch of {self._num_grad_sets} gradient set(s)")
        else:
            grad_sets = per_sample
        if noise is not None:
            if self.correlated_noise is not None:
                raise ValueError(
                    "step(noise=...) cannot be combined with correlated_noise (its state would skip a step)"
                )
            noise = self._check_noise(noise, params)
        self._step_with(lambda plan: self._clip_sums(params, grad_sets, plan), noise)
        return loss

    def _step_with(self, clip, noise, plan: ClipPlan | None = None) -> None:
        """The rest of a step, all or nothing: ``clip(plan) -> (S, Σ c_i)`` (which may all-reduce),
        then :meth:`_apply`. ``plan``: the given sensitivity of :meth:`step_from_sums`, else the
        optimizer's :meth:`_plan`."""
        params = self._params()
        t = self._begin_step(params)
        if plan is None:
            plan = self._plan(params, t)
        if noise is None and self.rng != "philox" and self.noise_multiplier > 0:
            noise = self._secure_noise(params, t, plan.C)
        sums, c_total = clip(plan)
        self._apply(params, sums, c_total, t, noise, plan)
        self._step = t

    @torch.no_grad()
    def step_from_sums(
        self, sums: Sequence[Tensor], *, sensitivity: float, noise: Sequence[Tensor] | None = None
    ) -> None:
        """One step from a clipped sum ``S`` formed elsewhere (per-layer clipping, micro-batches, ghost
        clipping, an all-reduce): ``g̃ = (S + ν)·(1/B)`` with ``ν = σ·Δ·z_t`` (or ``noise``), then the
        update of :meth:`step`. Only for algorithms whose clip does not depend on their state.

        Args:
            sums: one tensor per parameter, shaped like it, in the state dtype (fp32; fp64 for fp64
                parameters); with ``distributed``, this rank's part, summed over the ranks here.
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
            if not isinstance(s, Tensor) or s.dtype != state_dtype(p):
                raise TypeError(f"sums[{idx}] must be a {state_dtype(p)} tensor (the state dtype of parameter {idx})")
            if s.shape != p.shape or s.device != p.device:
                raise ValueError(
                    f"sums[{idx}] is {tuple(s.shape)} on {s.device}; expected {tuple(p.shape)} on {p.device}"
                )
        if noise is not None:
            if self.correlated_noise is not None:
                raise ValueError("step_from_sums(noise=...) cannot be combined with correlated_noise")
            noise = self._check_noise(noise, params)

        def clip(plan):
            local = [s.contiguous() for s in sums]
            return (local if self.process_group is None else _distributed.reduce_flat(self.process_group, local)), None

        self._step_with(clip, noise, ClipPlan(delta))

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

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears ``p.grad`` and ``p.grad_sample`` (Opacus's ``zero_grad``)."""
        super().zero_grad(set_to_none)
        for p in self._params():
            if set_to_none or not isinstance(getattr(p, "grad_sample", None), Tensor):
                p.grad_sample = None
            else:
                p.grad_sample.zero_()

    # ----------------------------------------------------------------------------------------
    # Checkpoints: one layout on every backend
    # ----------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["dp"] = {
            "class": type(self).__name__,
            "layout": LAYOUT,
            "step": self._step,
            "seed": self.seed,
            **self._global_state(),
        }
        if self.correlated_noise is not None:
            sd["dp"]["correlated_noise"] = self.correlated_noise.state_dict()
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a :meth:`state_dict`, saved on any backend. Everything is checked first
        (:meth:`check_state_dict`); a state_dict that fails a check raises ``ValueError`` naming the
        field and leaves the optimizer unchanged. The noise counter (``steps_taken``) and the keys
        (``seed``, ``secure_key``) come from the state_dict, so the resumed run draws the noise of
        step ``steps_taken + 1`` next, never an earlier one."""
        step, seed, ids, saved = self._checked(state_dict)
        params = self._params()
        dp = state_dict["dp"]
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "dp"})
        # torch casts floating state to the parameter dtype on load (lossy for bf16 parameters);
        # put back the saved tensors in their own dtype, on the parameter's device.
        for i, p in zip(ids, params, strict=True):
            if i in saved:
                self.state[p] = {
                    key: v.detach().clone().to(p.device) if isinstance(v, Tensor) else v for key, v in saved[i].items()
                }
        self._step, self.seed = step, seed
        self._load_global_state(dp)
        if self.correlated_noise is not None:
            self.correlated_noise.load_state_dict(dp["correlated_noise"])

    def check_state_dict(self, state_dict: dict) -> None:
        """Raise the ``ValueError`` that :meth:`load_state_dict` would raise for ``state_dict``, and
        change nothing: the class, state layout, step, seed, rng, global fields, the correlated-noise
        mechanism, param group sizes, every parameter's state keys, shapes and dtypes. For callers
        that load other objects with it (``PrivacyEngine.load_checkpoint``) and must check first."""
        self._checked(state_dict)

    def _checked(self, state_dict: dict) -> tuple[int, int, list, dict]:
        """:meth:`check_state_dict`; returns ``(step, seed, saved ids in parameter order, saved state)``."""
        name = type(self).__name__
        if not isinstance(state_dict, dict) or not isinstance(state_dict.get("dp"), dict):
            raise ValueError(f"state_dict has no 'dp' entry; it was not saved by a {name}")
        dp = state_dict["dp"]
        if dp.get("class") != name:
            raise ValueError(
                f"state_dict['dp']['class'] is {dp.get('class')!r}: it was saved by another optimizer, not a {name}"
            )
        if dp.get("layout") != LAYOUT and dp.get("layout") not in _SAME_LAYOUT:
            raise ValueError(
                f"state_dict['dp']['layout'] is {dp.get('layout')!r} but every backend keeps the {LAYOUT!r} state "
                "layout (dpkernels 0.1's 'reference' layout, with shifted PMLF histories and MacAdam's b, is "
                "not loaded: resume such a run with dpkernels 0.1)"
            )
        step = _validate.integer("state_dict['dp']['step']", dp.get("step"), low=0, high=2**32)
        seed = _validate.integer("state_dict['dp']['seed']", dp.get("seed"), low=0, high=2**64)
        missing = sorted(self._global_state().keys() - dp.keys() - self._NEWER_GLOBALS)
        if missing:
            raise ValueError(f"state_dict['dp'] lacks the field(s) {missing} of a {name}")
        saved_rng = "philox" if dp["secure_key"] is None else "chacha20"
        if saved_rng != self.rng:
            # A secure-mode run must not continue on Philox, nor a Philox run on a key it never had.
            raise ValueError(f"state_dict was saved with rng={saved_rng!r} but this optimizer draws rng={self.rng!r}")
        if saved_rng == "chacha20":
            _validate.integer("state_dict['dp']['secure_key']", dp["secure_key"], low=0, high=2**256)
        if (self.correlated_noise is None) != ("correlated_noise" not in dp):
            raise ValueError("state_dict and optimizer disagree on whether correlated_noise is used")
        if self.correlated_noise is not None:
            # The mechanism checks its state only while loading it: try a copy, so a mismatch raises
            # before anything of this optimizer changes.
            copy.deepcopy(self.correlated_noise).load_state_dict(dp["correlated_noise"])
        saved = state_dict.get("state")
        groups = state_dict.get("param_groups")
        if not isinstance(saved, dict) or not isinstance(groups, list):
            raise ValueError("state_dict lacks 'state' or 'param_groups'")
        sizes = [len(g["params"]) for g in groups]
        if sizes != [len(g["params"]) for g in self.param_groups]:
            raise ValueError(
                f"state_dict's param groups hold {sizes} parameters, the optimizer's "
                f"{[len(g['params']) for g in self.param_groups]}"
            )
        ids = [i for g in groups for i in g["params"]]
        for idx, (i, p) in enumerate(zip(ids, self._params(), strict=True)):
            if i in saved:
                self._check_saved_state(idx, p, saved[i])
        # The subclasses parse their global fields only while loading them: load, then put back.
        before = self._global_state()
        try:
            self._load_global_state(dp)
        except (TypeError, ValueError) as e:
            raise ValueError(f"state_dict['dp'] has an invalid global field: {e}") from e
        finally:
            self._load_global_state(before)
        return step, seed, ids, saved

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
    # Intake
    # ----------------------------------------------------------------------------------------

    def _params(self) -> list[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _groups_of(self) -> list[dict]:
        """The param group of each parameter, in ``_params()`` order."""
        return [g for g in self.param_groups for _ in g["params"]]

    def _group_of(self, p: Tensor) -> dict:
        return next(g for g in self.param_groups if any(q is p for q in g["params"]))

    def _grad_sets(self, params: list[Tensor]) -> list[list[Tensor]]:
        """``k`` lists of ``L`` per-sample gradients ``[B, *p.shape]`` read from ``p.grad_sample``."""
        k = self._num_grad_sets
        sets: list[list[Tensor]] = [[] for _ in range(k)]
        B = None

        # The messages are formatted only when one is raised: formatting them for every parameter
        # of every step cost 0.1 ms a step at 148 parameters (warm caches).
        def what(idx: int) -> str:
            return f"parameter {idx} (shape {tuple(params[idx].shape)})"

        def name(idx: int, j: int) -> str:
            return f"{what(idx)}: grad_sample" + (f"[{j}]" if self._grad_sample_is_list else "")

        for idx, p in enumerate(params):
            gs = getattr(p, "grad_sample", None)
            if gs is None:
                raise ValueError(
                    f"{what(idx)} has no grad_sample; compute per-sample gradients (Opacus GradSampleModule, "
                    f"torch.func, or dpkernels.pmlf.pmlf_grad_samples) and set p.grad_sample before step()"
                )
            if not self._grad_sample_is_list:
                if not isinstance(gs, Tensor):
                    raise TypeError(
                        f"{what(idx)}: grad_sample must be one tensor [B, *p.shape], got {type(gs).__name__}; "
                        "concatenate micro-batches along dim 0 first"
                    )
                gs = [gs]
            elif isinstance(gs, Tensor) or not isinstance(gs, Sequence) or len(gs) != k:
                raise TypeError(
                    f"{what(idx)}: grad_sample must be a list of k={k} tensors [B, *p.shape] (gradients at "
                    f"x_t, x_(t-1), ..., x_(t-k+1)), got {type(gs).__name__}"
                    + (f" of length {len(gs)}" if isinstance(gs, Sequence) and not isinstance(gs, Tensor) else "")
                )
            for j, g in enumerate(gs):
                if not isinstance(g, Tensor) or not g.is_floating_point():
                    raise TypeError(f"{name(idx, j)} must be a floating-point tensor")
                if g.dim() != p.dim() + 1 or g.shape[1:] != p.shape:
                    raise ValueError(f"{name(idx, j)} has shape {tuple(g.shape)}; expected [B, *{tuple(p.shape)}]")
                if g.device != p.device:
                    raise ValueError(f"{name(idx, j)} is on {g.device} but the parameter is on {p.device}")
                if g.dtype == torch.float64 and p.dtype != torch.float64:
                    raise TypeError(
                        f"{name(idx, j)} is float64 but the parameter is {p.dtype}; per-sample gradients are in the "
                        "parameter's precision (float64 ones only for float64 parameters)"
                    )
                if B is None:
                    B = g.shape[0]
                elif g.shape[0] != B:
                    raise ValueError(f"{name(idx, j)} has batch size {g.shape[0]} but parameter 0 has {B}")
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

    def _secure_noise(self, params, t, delta) -> list[Tensor]:
        """``σ·Δ·z`` from the secure generator, formed in float64 and rounded once to fp32 (docs/RNG.md
        §6.3), pre-drawn (not fused: the secure mode is for when the noise's provenance matters
        more than its speed)."""
        total = sum(p.numel() for p in params)
        nu = gaussian_noise(total, std=self.noise_multiplier * delta, seed=self.secure_key, step=t,
                            offset=self._noise_offset, rng=self.rng, device=params[0].device)  # fmt: skip
        parts = torch.split(nu, [p.numel() for p in params])
        return [part.view(p.shape) for part, p in zip(parts, params, strict=True)]

    # ----------------------------------------------------------------------------------------
    # Stage 1: the clipped sum on the backend
    # ----------------------------------------------------------------------------------------

    def _clip_sums(self, params, grad_sets, plan: ClipPlan):
        """``(S, Σ_i c_i)``: the clipped sums per parameter (state dtype) and the total weight, from
        the per-sample gradient sets or a :class:`~dpkernels.bk.BKBatch`; with ``distributed``,
        summed over the ranks (each rank clips its own samples)."""
        clip = lambda: self._clip_local(params, grad_sets, plan)  # noqa: E731
        if self.process_group is None:
            return clip()
        return _distributed.clip_then_reduce(self.process_group, clip, params[0].device)

    def _clip_local(self, params, grad_sets, plan: ClipPlan):
        """The clip of this process's samples; ``params``, ``plan.shift`` and ``plan.scale`` cover
        every parameter the gradients belong to (a ZeRO-1 shard passes its gathered ones)."""
        C, coeffs, shift, scale = plan.C, plan.coeffs, plan.shift, plan.scale
        if isinstance(grad_sets, BKBatch):
            sums, _, w = grad_sets.clipped_sums(
                params, coeffs, [C], self.mode, self.r, shift, scale, False, "raise", self.backend,
                norm_scale=plan.norm_scale, buffers=self._sum_buffers,
            )  # fmt: skip
        else:
            flat = [g.contiguous() for gs in grad_sets for g in gs]
            sums, w = _clipped_sums(
                flat, coeffs, [C], self.mode, self.r, shift or [], scale or [], False, "raise", self.backend,
                norm_scale=plan.norm_scale,
            )  # fmt: skip
        # The total stays on the device: only DP-MacAdam reads it, so only it waits for it.
        return [s.to(state_dtype(p)) for s, p in zip(sums, params, strict=True)], w[:, 0].sum()

    # ----------------------------------------------------------------------------------------
    # Stage 2: one family op per parameter group
    # ----------------------------------------------------------------------------------------

    def _groups(self, params):
        """``(group, slice, offset)``: each group's parameters and the global index of its first element."""
        start, offset = 0, self._noise_offset
        for group in self.param_groups:
            sl = slice(start, start + len(group["params"]))
            yield group, sl, offset
            offset += sum(p.numel() for p in params[sl])
            start = sl.stop

    def _run(self, spec: HyperSpec, params, sums, hyper_of, noise, std, t, *, state=None, extra=None) -> list:
        """Launch ``spec``'s op once per parameter group; returns the ops' results.

        ``hyper_of(group)``: the family's scalars by name (:mod:`dpkernels._kernel_args`);
        ``state(group, sl)``: its state buffers in schema order (default: the keys of
        :attr:`_STATE_KEYS`); ``noise``: a pre-drawn list, or None for in-pass Philox noise
        (correlated when the optimizer has a mechanism: its buffers and coefficients go to the op);
        ``extra(group, sl)``: arguments between ``state`` and ``noise`` (the sgd family's direction
        filter and past iterates).
        """
        op = getattr(OPTIM.kernels(self.backend), spec.op)
        mech = self.correlated_noise
        bufs, coeffs = [], INDEPENDENT
        if noise is None and mech is not None:
            bufs, co = mech.plan(t, [p.shape for p in params], params[0].device)
            coeffs = FILTER.pack_dict(co)
        out = []
        for group, sl, offset in self._groups(params):
            ps = params[sl]
            if not ps:  # an empty param group (torch allows them): nothing to launch
                continue
            st = state(group, sl) if state else [self.state[p][key] for key in self._STATE_KEYS for p in ps]
            given = [nu.to(state_dtype(p)).contiguous() for nu, p in zip(noise[sl], ps, strict=True)] if noise else []
            noise_state = [b for buf in bufs for b in buf[sl]]
            hyper = spec.pack(**hyper_of(group))
            args = (ps, sums[sl], st, *(extra(group, sl) if extra else ()), given, noise_state, coeffs)
            out.append(op(*args, float(std), _signed64(self.seed), t, 0, offset, hyper))
        if noise is None and mech is not None:
            mech.advance()
        return out

    def _zeros(self, p: Tensor) -> Tensor:
        """A zero state buffer of ``p`` (fp32; fp64 for fp64 parameters)."""
        return torch.zeros_like(p, dtype=state_dtype(p), memory_format=torch.contiguous_format)
