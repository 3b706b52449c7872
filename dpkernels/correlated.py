"""Correlated noise for DP matrix-factorisation training: BLT and banded MF as streaming filters.

DP-MF (DP-FTRL with a factorisation ``A = B·C`` of the workload) privatises ``C·G`` with Gaussian
noise and trains on ``G + C⁻¹·Z``: the noise added at step ``t`` is row ``t`` of ``std·C⁻¹·Z`` with
``Z = [z_0; z_1; …]``, ``z_t ~ N(0, I_D)``. The classes here produce that row with one fused
:func:`dpkernels.linear_filter_` call per step, from the fresh ``z_t`` and a few D-sized fp32
buffers (no per-step history):

- :class:`BLTNoise`: buffered linear Toeplitz ``C`` (Dvijotham et al. 2024, arXiv 2404.16706;
  McMahan et al. 2024, arXiv 2408.08868). ``d`` buffers.
- :class:`BandedNoise`: column-normalised banded ``C`` (BandMF, Choquette-Choo et al. 2023,
  arXiv 2306.08153, Alg. 9). A ring of ``b − 1`` buffers (``b`` = bands).

The fresh noise ``z_t`` is Philox ``(seed, step=t, stream)`` over the global flat index of the
tensor list (docs/RNG.md), so the first step's noise equals ``gaussian_noise(std=..., step=t)``
(times the first column scale for banded). Steps must come in order, one call per step: a repeated
step would reuse ``z_t``, a skipped one would break the recurrence; both raise.

**Privacy.** The noise is only private at the sensitivity of ``C``: with per-example clip norm
``R``, the released ``C·G + std·Z`` is one Gaussian mechanism of noise multiplier
``std / (R · sens(C))``, where ``sens(C)`` depends on the participation pattern (``sensitivity()``
below: single participation = the largest column norm of ``C``; several participations need the
pattern, e.g. ``min_sep``). The Opacus accountants (RDP, PRV, GDP) do **not** cover these
mechanisms: they assume independent noise per step. ``dp_accounting`` (0.6) has no
matrix-factorisation accountant either; without amplification, account the whole run as a single
``dp_accounting.GaussianDpEvent(noise_multiplier=std / (R * sens))``. For amplification by
sampling (banded MF with ``min_sep ≥ b``, Choquette-Choo et al. 2023; BLT, McMahan et al. 2024),
use jax_privacy's accounting (``jax_privacy.accounting``) and its sensitivity tools
(``jax_privacy.matrix_factorization.sensitivity``, ``toeplitz.minsep_sensitivity_squared``,
``banded.minsep_sensitivity_squared``, ``buffered_toeplitz.sensitivity_squared``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ._validate import FP32_MAX, integer, real
from .filter import MAX_FILTER_BUFFERS, linear_filter_
from .noise import _FLOAT_DTYPES, _check_counter, _check_std, fresh_seed


def _float64(name: str, values) -> Tensor:
    """``values`` (nested lists of real numbers of any type, an array or a tensor) as a float64 CPU
    tensor. Bools are refused, as for every scalar: ``True`` is not a coefficient."""
    if isinstance(values, Sequence) and not isinstance(values, str):
        rows = [_float64(name, v) for v in values]
        return torch.stack(rows) if rows else torch.zeros(0, dtype=torch.float64)
    if isinstance(values, Tensor) or getattr(values, "ndim", 0) > 0:
        if str(values.dtype) in ("bool", "torch.bool"):
            raise ValueError(f"{name} must hold real numbers, got a bool {type(values).__name__}")
        return torch.as_tensor(values, dtype=torch.float64).detach().cpu()
    return torch.tensor(real(f"{name} entry", values), dtype=torch.float64)


def _vector(name: str, values) -> Tensor:
    v = _float64(name, values)
    if v.dim() != 1 or v.numel() == 0:
        raise ValueError(f"{name} must be a non-empty 1-D sequence, got shape {tuple(v.shape)}")
    if not torch.isfinite(v).all():
        raise ValueError(f"{name} must be finite, got {v.tolist()}")
    if (v.abs() > FP32_MAX).any():
        raise ValueError(f"{name} must be within the float32 range (|x| <= {FP32_MAX:.4g}), got {v.tolist()}")
    return v


def _lower_toeplitz(coefs: Tensor) -> Tensor:
    n = coefs.numel()
    i = torch.arange(n)
    diff = i[:, None] - i[None, :]
    return torch.where(diff >= 0, coefs[diff.clamp(min=0)], torch.zeros((), dtype=coefs.dtype))


def _inverse_lower(C: Tensor) -> Tensor:
    eye = torch.eye(C.shape[0], dtype=C.dtype)
    return torch.linalg.solve_triangular(C, eye, upper=False)


def _max_participations(n: int, min_sep: int, max_participations: int) -> tuple[int, int, int]:
    """``(num_steps, min_sep, k)`` as ints, ``k`` the number of participations that fit."""
    n, min_sep, max_participations = (
        integer(name, v, low=1)
        for name, v in (("num_steps", n), ("min_sep", min_sep), ("max_participations", max_participations))
    )
    return n, min_sep, min(max_participations, (n - 1) // min_sep + 1)


class _StreamingNoise:
    """Shared machinery: lazily created fp32 buffers, step order, state_dict, the filter call."""

    _kind = ""

    def __init__(self, num_buffers: int, std: float, seed: int | None, stream: int, start_step: int, backend: str):
        self.std = _check_std(std)
        self.seed, _, self.stream, _ = _check_counter(fresh_seed() if seed is None else seed, 0, stream, 0)
        self.start_step = integer("start_step", start_step, low=0, high=2**32)
        self.backend = backend
        self._num_buffers = num_buffers
        self._buffers: list[list[Tensor]] | None = None
        self._index = 0  # steps done
        # noise_variance's cache: the Gram matrix of the buffers (as functions of z) after
        # _gram_index steps. It depends on the mechanism's parameters only, not on its random state.
        self._gram_index = 0
        self._gram = torch.zeros(num_buffers, num_buffers, dtype=torch.float64)

    # -- subclass interface -------------------------------------------------------------------
    def _params(self) -> dict[str, Tensor]:
        raise NotImplementedError

    def _call(self, index: int) -> tuple[list[int], dict]:
        """Buffer order and coefficients (a, g, c, d, e, f) of step ``index`` (0-based)."""
        raise NotImplementedError

    # -- public -------------------------------------------------------------------------------
    @property
    def next_step(self) -> int:
        """The step the next call must use."""
        return self.start_step + self._index

    def _check_step(self, step) -> int:
        """``step`` as an int, which must be :attr:`next_step`."""
        step = integer("step", step)
        if step != self.next_step:
            what = "repeats a step (it would reuse noise)" if step < self.next_step else "skips steps"
            raise ValueError(
                f"{self._kind}: steps must be consecutive; expected step {self.next_step}, got {step}, which {what}"
            )
        return step

    def _ensure_buffers(self, shapes: list[torch.Size], device: torch.device) -> None:
        if device.type == "cuda" and device.index is None:  # "cuda" names the current GPU: compare indices
            device = torch.device("cuda", torch.cuda.current_device())
        if self._buffers is None:
            self._buffers = [
                [torch.zeros(s, dtype=torch.float32, device=device) for s in shapes] for _ in range(self._num_buffers)
            ]
            self._shapes, self._device = shapes, device
            return
        if shapes != self._shapes:
            raise ValueError(f"{self._kind}: tensor shapes {shapes} differ from the first call's {self._shapes}")
        if device != self._device:
            raise ValueError(f"{self._kind}: tensors are on {device} but the state is on {self._device}")

    def plan(self, step: int, shapes: Sequence[Sequence[int]], device) -> tuple[list[list[Tensor]], dict]:
        """The buffers (in coefficient order) and filter coefficients ``(a, g, c, d, e, f)`` of step
        ``step``, for a kernel that runs the filter itself (the fused optimizer steps); call
        :meth:`advance` once it has. Checks the step order and creates the buffers on first use."""
        self._check_step(step)
        self._ensure_buffers([torch.Size(s) for s in shapes], torch.device(device))
        order, co = self._call(self._index)
        return [self._buffers[j] for j in order], co

    def noise_variance(self, step) -> float:
        """The variance ``std²·‖row_t(C⁻¹)‖²`` of every element of the noise of step ``step`` (row
        ``t = step − start_step`` of :meth:`noising_matrix`, 0-based), in float64.

        Computed by streaming the filter of :meth:`plan` on second moments instead of samples: each
        buffer ``S_k`` is a linear function ``w_k·Z`` of the past unit draws, and with ``G`` the Gram
        matrix ``⟨w_k, w_l⟩`` (zero at the start) a step ``y = a·z_t + Σ_j c_j S_j``, ``out = g·y``,
        ``S_j ← d_j S_j + e_j y + f_j z_t`` has ``‖row_t‖² = g²(a² + cᵀGc)`` (``z_t`` is orthogonal to the
        past) and ``G ← M G Mᵀ + h hᵀ`` with ``M = diag(d) + e cᵀ``, ``h = a·e + f`` (buffers in the
        step's order). So it is exact for any steps' coefficients (BLT: ``Σ_{k≤t} (C⁻¹)_{k0}²``; banded:
        the row norms of ``P⁻¹`` times the column norm ``n_t``) and costs ``O(K³)`` per step for ``K``
        buffers, with no ``O(t)`` work per step: the Gram matrix is cached, so consecutive calls
        (``step``, ``step + 1``, …) each advance it once; an earlier step restarts it from step 0.
        Pure arithmetic on the parameters, the same on every resume: it reads no random state.
        """
        index = integer("step", step, low=self.start_step) - self.start_step
        if index < self._gram_index:
            self._gram_index, self._gram = 0, torch.zeros_like(self._gram)
        while True:
            order, co = self._call(self._gram_index)
            c, e = torch.tensor(co["c"], dtype=torch.float64), torch.tensor(co["e"], dtype=torch.float64)
            G = self._gram[order][:, order]
            if self._gram_index == index:
                return self.std**2 * co["g"] ** 2 * (co["a"] ** 2 + float(c @ G @ c))
            M = torch.diag(torch.tensor(co["d"], dtype=torch.float64)) + torch.outer(e, c)
            h = co["a"] * e + torch.tensor(co["f"], dtype=torch.float64)
            idx = torch.tensor(order, dtype=torch.long)
            new = torch.empty_like(self._gram)
            new[idx[:, None], idx[None, :]] = M @ G @ M.T + torch.outer(h, h)
            self._gram, self._gram_index = new, self._gram_index + 1

    def advance(self) -> None:
        """Mark the planned step as done (its buffers were updated in place)."""
        self._index += 1

    def _step(self, out: list[Tensor], step: int, accumulate: bool) -> None:
        state, co = self.plan(step, [t.shape for t in out], out[0].device)
        linear_filter_(
            state, out=out, accumulate=accumulate, noise_std=self.std, seed=self.seed, step=step,
            stream=self.stream, backend=self.backend, **co,
        )  # fmt: skip
        self.advance()

    def add_noise_(self, tensors: Sequence[Tensor], step: int) -> list[Tensor]:
        """In place: ``tensors += noise_t`` (this step's correlated noise), summed in fp32, rounded once.

        ``tensors``: the same list of contiguous fp32/fp16/bf16 tensors (shapes, device) every step;
        the global element index runs across the list.
        """
        if isinstance(tensors, Tensor) or not isinstance(tensors, Sequence) or len(tensors) == 0:
            raise TypeError("tensors must be a non-empty list of tensors")
        tensors = list(tensors)
        for i, t in enumerate(tensors):
            if not isinstance(t, Tensor) or t.dtype not in _FLOAT_DTYPES:
                raise TypeError(f"tensors[{i}] must be a float32, float16 or bfloat16 tensor")
        step = self._check_step(step)
        self._ensure_buffers([t.shape for t in tensors], tensors[0].device)
        self._step(tensors, step, accumulate=True)
        return tensors

    def noise(
        self, shapes: Sequence[Sequence[int]], step: int, *, dtype: torch.dtype = torch.float32, device=None
    ) -> list[Tensor]:
        """This step's correlated noise as new tensors of the given shapes (advances the state)."""
        if dtype not in _FLOAT_DTYPES:
            raise TypeError(f"dtype must be one of {_FLOAT_DTYPES}, got {dtype}")
        shapes = [torch.Size(s) for s in shapes]
        if not shapes:
            raise ValueError("shapes must not be empty")
        device = torch.device(device) if device is not None else getattr(self, "_device", torch.device("cpu"))
        step = self._check_step(step)
        self._ensure_buffers(shapes, device)
        out = [torch.empty(s, dtype=dtype, device=device) for s in shapes]
        self._step(out, step, accumulate=False)
        return out

    def state_dict(self) -> dict:
        """Everything needed to continue bit-identically: parameters, seed, stream, step, buffers.

        Holds the noise seed: keep it as secret as the data.
        """
        return {
            "mechanism": self._kind,
            "params": {k: v.clone() for k, v in self._params().items()},
            "std": self.std,
            "seed": self.seed,
            "stream": self.stream,
            "start_step": self.start_step,
            "index": self._index,
            "buffers": None if self._buffers is None else [[b.clone() for b in lst] for lst in self._buffers],
        }

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("mechanism") != self._kind:
            raise ValueError(f"state_dict is for {sd.get('mechanism')!r}, not {self._kind!r}")
        mine = self._params()
        theirs = sd["params"]
        if set(mine) != set(theirs) or not all(torch.equal(mine[k], theirs[k].to(mine[k])) for k in mine):
            raise ValueError(f"{self._kind}: state_dict was made with different mechanism parameters")
        self.std = _check_std(sd["std"])
        self.seed, _, self.stream, _ = _check_counter(sd["seed"], 0, sd["stream"], 0)
        self.start_step = integer("start_step", sd["start_step"], low=0, high=2**32)
        self._index = integer("index", sd["index"], low=0)
        bufs = sd["buffers"]
        if bufs is None or self._num_buffers == 0:
            self._buffers = None  # nothing to restore; shapes are taken from the next call
            return
        if len(bufs) != self._num_buffers:
            raise ValueError(f"{self._kind}: state_dict has {len(bufs)} buffers, expected {self._num_buffers}")
        self._buffers = [[b.detach().to(torch.float32).clone().contiguous() for b in lst] for lst in bufs]
        if self._num_buffers:
            self._shapes = [b.shape for b in self._buffers[0]]
            self._device = self._buffers[0][0].device


class BLTNoise(_StreamingNoise):
    r"""BLT correlated noise: ``noise_t = std·(C⁻¹ Z)_t`` for a buffered linear Toeplitz ``C``.

    ``C`` is lower-triangular Toeplitz with ``t_0 = 1``, ``t_k = Σ_j ω_j θ_j^(k−1)`` (k ≥ 1), given by
    ``theta`` (buffer decays θ, ``buf_decay`` in jax_privacy) and ``omega`` (output scales ω,
    ``output_scale``). ``C⁻¹`` in streaming form (McMahan et al. 2024, Alg. 3), ``d`` fp32 buffers
    ``S_j`` shaped like the tensors, zero at the start::

        z_t = std·N(0, I) from Philox (seed, step=t, stream)
        u_t = z_t − Σ_j ω_j S_j
        S_j ← θ_j S_j + u_t

    and ``u_t`` is the noise of step ``t``: one :func:`linear_filter_` call with ``a = 1, c = −ω,
    d = θ, e = 1``. Per step it reads and writes the ``d`` buffers once (plus the target).

    **Sensitivity** (:meth:`sensitivity`): single participation, ``n`` steps: ``‖C e_0‖ =
    sqrt(1 + Σ_{k=1}^{n−1} t_k²)``, the largest column norm. Multiple participations at least
    ``min_sep`` apart: ``‖Σ_i C e_{i·min_sep}‖`` when the ``t_k`` are non-negative and non-increasing
    (McMahan et al. 2024; jax_privacy ``toeplitz.minsep_sensitivity_squared``). The Opacus
    accountants do **not** cover this mechanism; see the module docstring for what to use.

    Args:
        theta, omega: ``d`` values each (``1 ≤ d ≤ 32``), ``0 < θ_j < 1``, ``ω_j`` finite. Kept in
            float64; the kernels use them rounded to fp32.
        std: noise standard deviation (``σ·R`` for noise multiplier σ and clip norm R).
        seed: Philox key; ``None`` draws one from the OS CSPRNG.
        stream: Philox stream (default 0: this noise *is* the step's gradient noise).
        start_step: the step of the first call; call ``t`` must be ``start_step + t``.
        backend: ``"auto"`` or one of ``dpkernels.BACKENDS``.
    """

    _kind = "BLTNoise"

    def __init__(self, theta, omega, *, std: float, seed: int | None = None, stream: int = 0, start_step: int = 0,
                 backend: str = "auto"):  # fmt: skip
        self.theta, self.omega = _vector("theta", theta), _vector("omega", omega)
        if self.theta.numel() != self.omega.numel():
            raise ValueError(
                f"theta and omega must have the same length, got {self.theta.numel()} and {self.omega.numel()}"
            )
        if self.theta.numel() > MAX_FILTER_BUFFERS:
            raise ValueError(f"at most {MAX_FILTER_BUFFERS} buffers, got {self.theta.numel()}")
        if not ((self.theta > 0) & (self.theta < 1)).all():
            raise ValueError(f"theta (buffer decays) must lie in (0, 1), got {self.theta.tolist()}")
        super().__init__(self.theta.numel(), std, seed, stream, start_step, backend)

    def _params(self):
        return {"theta": self.theta, "omega": self.omega}

    def _call(self, index):
        d = self.theta.numel()
        co = dict(a=1.0, g=1.0, c=(-self.omega).tolist(), d=self.theta.tolist(), e=[1.0] * d, f=[0.0] * d)
        return list(range(d)), co

    def toeplitz_coefs(self, n: int) -> Tensor:
        """``[t_0, …, t_{n−1}]`` of ``C``, float64."""
        k = torch.arange(max(n - 1, 0), dtype=torch.float64)
        rest = (self.omega[None, :] * self.theta[None, :] ** k[:, None]).sum(1)
        return torch.cat([torch.ones(1, dtype=torch.float64), rest])[:n]

    def strategy_matrix(self, n: int) -> Tensor:
        """``C`` (``n × n``, float64)."""
        return _lower_toeplitz(self.toeplitz_coefs(n))

    def noising_matrix(self, n: int) -> Tensor:
        """``C⁻¹`` (``n × n``, float64): ``noise_t = std · Σ_j C⁻¹[t, j] z_j``."""
        return _inverse_lower(self.strategy_matrix(n))

    def sensitivity(self, num_steps: int, *, min_sep: int = 1, max_participations: int = 1) -> float:
        """L2 sensitivity of ``C`` per unit of clip norm (see the class docstring)."""
        num_steps, min_sep, k = _max_participations(num_steps, min_sep, max_participations)
        coefs = self.toeplitz_coefs(num_steps)
        if k > 1 and ((coefs < 0).any() or (coefs[1:] > coefs[:-1]).any()):
            raise ValueError(
                "multi-participation sensitivity needs non-negative, non-increasing Toeplitz coefficients; "
                "use jax_privacy.matrix_factorization.sensitivity for this C"
            )
        u = torch.zeros(num_steps, dtype=torch.float64)
        u[torch.arange(k) * min_sep] = 1.0
        return float(torch.linalg.vector_norm(self.strategy_matrix(num_steps) @ u))


class BandedNoise(_StreamingNoise):
    r"""Banded MF correlated noise: ``noise_t = std·(C⁻¹ Z)_t`` for a column-normalised banded ``C``.

    ``C`` is lower-triangular with ``b`` bands; column ``j`` holds ``params[j, r]`` at row ``j + r``
    (``r < b``; jax_privacy's ``ColumnNormalizedBanded`` layout) and is divided by its norm
    ``n_j = ‖params[j]‖``, so every column has norm 1. Streaming ``C⁻¹`` (Choquette-Choo et al. 2023,
    Alg. 9) with a ring of ``b − 1`` past values ``x`` (fp32, shaped like the tensors)::

        row_r = params[t − r, r]                        (r = 0 … b−1; terms with t − r < 0 are 0)
        x_t   = (std·z_t − Σ_{r≥1} row_r x_{t−r}) / row_0
        noise_t = n_t · x_t

    One :func:`linear_filter_` call per step: ``a = 1/row_0``, ``c_r = −row_r/row_0``, ``g = n_t``; the
    slot of the oldest value ``x_{t−b+1}`` is read for ``x_t`` and then overwritten with it in the same
    pass, the ring rotates on the host. Memory: ``b − 1`` buffers (jax_privacy keeps ``b``; none for
    ``b = 1``, plain Gaussian noise); per step ``b − 1`` buffer reads and one write. Build it from one
    of:

    - ``coefs``: ``b`` banded-Toeplitz coefficients (normalised to norm 1). With ``num_steps`` the
      columns near the end are truncated and re-normalised, as jax_privacy's
      ``ColumnNormalizedBanded.from_banded_toeplitz``; without it the mechanism runs for any number of
      steps.
    - ``matrix``: the strategy matrix ``C`` (``n × n`` lower-triangular, bandwidth ``b``); its columns
      are normalised.
    - ``params``: the ``n × b`` parameters above.

    **Sensitivity** (:meth:`sensitivity`): single participation, 1 (columns have norm 1). ``k``
    participations at least ``min_sep ≥ b`` apart touch disjoint rows, so ``sqrt(k)``
    (Choquette-Choo et al. 2023). ``min_sep < b`` needs a search over patterns (jax_privacy
    ``sensitivity.get_sensitivity_banded``). The Opacus accountants do **not** cover this mechanism;
    see the module docstring.

    Other arguments as :class:`BLTNoise`.
    """

    _kind = "BandedNoise"

    def __init__(self, coefs=None, *, matrix=None, params=None, num_steps: int | None = None, std: float,
                 seed: int | None = None, stream: int = 0, start_step: int = 0, backend: str = "auto"):  # fmt: skip
        given = [n for n, v in (("coefs", coefs), ("matrix", matrix), ("params", params)) if v is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of coefs, matrix, params; got {given or 'none'}")
        if num_steps is not None:
            num_steps = integer("num_steps", num_steps, low=1)
        self._toeplitz = None
        if coefs is not None:
            v = _vector("coefs", coefs)
            if v[0] == 0:
                raise ValueError("coefs[0] (the diagonal of C) must be non-zero")
            v = v / torch.linalg.vector_norm(v)
            if num_steps is None:
                self._toeplitz = v
                p = v[None, :]
            else:
                if v.numel() > num_steps:
                    raise ValueError(f"{v.numel()} bands do not fit in num_steps={num_steps}")
                j, r = torch.arange(num_steps)[:, None], torch.arange(v.numel())[None, :]
                p = torch.where(j + r < num_steps, v[None, :].expand(num_steps, -1), 0.0)
        elif matrix is not None:
            p = self._params_from_matrix(_float64("matrix", matrix))
        else:
            p = _float64("params", params)
            if p.dim() != 2 or p.numel() == 0:
                raise ValueError(f"params must be a non-empty n × b matrix, got shape {tuple(p.shape)}")
            if p.shape[1] > p.shape[0]:
                raise ValueError(f"params has {p.shape[1]} bands for {p.shape[0]} steps")
            j, r = torch.arange(p.shape[0])[:, None], torch.arange(p.shape[1])[None, :]
            if (p[j + r >= p.shape[0]] != 0).any():
                raise ValueError("params[j, r] must be 0 where j + r >= n (entries below C's last row)")
        if not torch.isfinite(p).all():
            raise ValueError("the strategy must be finite")
        if (p[:, 0] == 0).any():
            raise ValueError("every diagonal entry of C (row[0] = params[:, 0]) must be non-zero")
        if p.shape[1] > MAX_FILTER_BUFFERS:
            raise ValueError(f"at most {MAX_FILTER_BUFFERS} bands, got {p.shape[1]}")
        self.params = p.contiguous()
        if num_steps is not None and self._toeplitz is None and num_steps > p.shape[0]:
            raise ValueError(f"num_steps={num_steps} exceeds the strategy's {p.shape[0]} steps")
        self.num_steps = None if self._toeplitz is not None else self.params.shape[0]
        self.bands = self.params.shape[1]
        self.col_norms = torch.linalg.vector_norm(self.params, dim=1)
        super().__init__(self.bands - 1, std, seed, stream, start_step, backend)

    @staticmethod
    def _params_from_matrix(C: Tensor) -> Tensor:
        if C.dim() != 2 or C.shape[0] != C.shape[1] or C.numel() == 0:
            raise ValueError(f"matrix must be a non-empty square n × n matrix, got shape {tuple(C.shape)}")
        if torch.triu(C, diagonal=1).any():
            raise ValueError("matrix must be lower-triangular")
        n = C.shape[0]
        rows, cols = torch.nonzero(C, as_tuple=True)
        b = int((rows - cols).max()) + 1 if rows.numel() else 1
        j, r = torch.arange(n)[:, None], torch.arange(b)[None, :]
        inside = j + r < n
        return torch.where(inside, C[(j + r).clamp(max=n - 1), j.expand(n, b)], 0.0)

    def _params(self):
        return {"params": self.params}

    def _row(self, i: int) -> tuple[list[float], float]:
        if self._toeplitz is not None:
            row = [float(self._toeplitz[r]) if i - r >= 0 else 0.0 for r in range(self.bands)]
            return row, 1.0
        if i >= self.params.shape[0]:
            raise ValueError(
                f"BandedNoise: the strategy covers {self.params.shape[0]} steps; step index {i} is past it"
            )
        row = [float(self.params[i - r, r]) if i - r >= 0 else 0.0 for r in range(self.bands)]
        return row, float(self.col_norms[i])

    def _call(self, index):
        row, norm = self._row(index)
        b = self.bands
        if b == 1:
            return [], dict(a=1.0 / row[0], g=norm, c=[], d=[], e=[], f=[])
        # b - 1 slots: x_{t-r} (r = 1 .. b-1) sits in slot (index - r) % (b - 1). The oldest, x_{t-b+1},
        # is read for y and then overwritten with x_t in the same element-wise pass (load before
        # store per element on every backend), so jax_privacy's b-th buffer is not needed.
        m = b - 1
        order = [(index - r) % m for r in range(1, b)]
        c = [-row[r] / row[0] for r in range(1, b)]
        co = dict(a=1.0 / row[0], g=norm, c=c, d=[1.0] * (m - 1) + [0.0], e=[0.0] * (m - 1) + [1.0], f=[0.0] * m)
        return order, co

    def strategy_matrix(self, n: int | None = None) -> Tensor:
        """The leading ``n × n`` block of the column-normalised ``C`` (float64)."""
        n = n or self.num_steps
        if n is None:
            raise ValueError("n is required for a banded Toeplitz strategy without num_steps")
        C = torch.zeros(n, n, dtype=torch.float64)
        for j in range(n):
            if self._toeplitz is not None:
                p, norm = self._toeplitz, 1.0
            else:
                if j >= self.params.shape[0]:
                    raise ValueError(f"n={n} exceeds the strategy's {self.params.shape[0]} steps")
                p, norm = self.params[j], self.col_norms[j]
            for r in range(self.bands):
                if j + r < n:
                    C[j + r, j] = p[r] / norm
        return C

    def noising_matrix(self, n: int | None = None) -> Tensor:
        """``C⁻¹`` of the column-normalised ``C``: ``noise_t = std · Σ_j C⁻¹[t, j] z_j``."""
        return _inverse_lower(self.strategy_matrix(n))

    def sensitivity(self, num_steps: int | None = None, *, min_sep: int = 1, max_participations: int = 1) -> float:
        """L2 sensitivity of ``C`` per unit of clip norm (see the class docstring)."""
        n = num_steps or self.num_steps
        if n is None:
            raise ValueError("num_steps is required for a banded Toeplitz strategy without num_steps")
        n, min_sep, k = _max_participations(n, min_sep, max_participations)
        if k > 1 and min_sep < self.bands:
            raise ValueError(
                f"min_sep={min_sep} < bands={self.bands}: participations overlap in C's rows; use "
                "jax_privacy.matrix_factorization.sensitivity.get_sensitivity_banded"
            )
        return math.sqrt(k)
