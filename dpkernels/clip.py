"""Per-sample clipping: norms, clip weights and the clipped sum, on every backend.

The three stages of the clipping pipeline (docs/ALGORITHMS.md, "Per-sample clipping"), each a
registered ``torch.library`` op in the ``dpkernels`` namespace, plus the fused pipeline
``clip_and_accumulate``:

1. ``per_sample_norms``: ``n_i = ‖(Σ_j α_j g_i^(j) − shift) ⊙ scale‖₂``, flat or per layer.
2. ``clip_factors``:     ``c_i = f(n_i)``; clip, auto_s, auto_v or psac.
3. ``weighted_sum``:     ``S = Σ_i c_i Σ_j α_j g_i^(j)``, over the raw gradients.

Each backend's implementation is declared once in the op registry (``CLIP`` below). On the
``cpu`` and ``cuda`` backends the fused ops (``clip_and_accumulate``, ``privatize`` and the
optimizers' clipped sums) are one native op, ``dpkernels_C::clip_pipeline``: norms pass, per-sample
weights, and the sum pass with its noise epilogue in a single call, so a list of hundreds of
tensors crosses the Python/dispatcher boundary once.

Inputs are Opacus-style per-sample gradients: a list of ``[B, *param_shape]`` tensors (fp32, fp16
or bf16; fp64 on the reference backend), or, for DP-PMLF per-sample momentum ("Enhancing DPSGD
via Per-Sample Momentum and Low-Pass Filtering", arXiv:2511.08841), a list of ``k`` such lists
with ``coeffs=[α_1..α_k]``. Non-contiguous tensors are copied to contiguous
memory before the kernels run (one extra copy of that tensor).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from . import _backend
from ._registry import custom_op, family
from ._validate import FP32_MAX, _scalar, fp32_scale, integer, real
from .noise import NOISE, NoiseKey, _chacha20_normals64
from .reference import clip as ref
from .reference.noise import round_once

CLIP_MODES = ref.CLIP_MODES
# Defaults for r: DP-PSAC recommends r = 0.1 ("Differentially Private Learning with Per-Sample Adaptive
# Clipping", arXiv:2212.00328); Auto-S uses 0.01 as fastDP does.
DEFAULT_R = {"auto_s": 0.01, "psac": 0.1}
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------------------------
# The clip family. Every backend provides the three stages with the reference's signatures
# (grad_sets: k lists of L tensors) and ``pipeline``: the stages and the private epilogue,
#
#   pipeline(grads, coeffs, C, mode, r, shift, scale, per_layer, nonfinite, *, norm_scale, noise_std,
#            key, out_scale, noise) -> (sums, norms, weights [B, L])
#
# with ``grads`` flat (set-major), ``C`` one bound or one per tensor (per_layer), ``key`` a
# NoiseKey (None: no generated noise) and ``noise`` a pre-drawn list (or empty): sums are
# ``(Σ_i w_il v_il + ν_l) · out_scale``. On cpu/cuda it is one native op; the staged backends
# compose it from their stages exactly as dpkernels.reference.clip.clip_weights does.
# --------------------------------------------------------------------------------------------


def _flat(grad_sets):
    return [g for gs in grad_sets for g in gs]


class _NativeClip:
    """``torch.ops.dpkernels_C`` (csrc/ops.cpp): one schema, CPU and CUDA kernels."""

    @staticmethod
    def per_sample_sumsq(grad_sets, coeffs, shift=None, scale=None):
        return torch.ops.dpkernels_C.per_sample_sumsq(
            _flat(grad_sets), list(coeffs), list(shift or []), list(scale or [])
        )

    @staticmethod
    def clip_factors(norms, max_grad_norm, mode="clip", r=0.0):
        return torch.ops.dpkernels_C.clip_factors(norms, _as_list(max_grad_norm), mode, float(r))

    @staticmethod
    def weighted_sum(grad_sets, weights, coeffs=(1.0,)):
        return torch.ops.dpkernels_C.weighted_sum(_flat(grad_sets), list(coeffs), weights)

    @staticmethod
    def pipeline(grads, coeffs, C, mode, r, shift, scale, per_layer, nonfinite, *, norm_scale=1.0, noise_std=0.0,
                 key=None, out_scale=1.0, noise=()):  # fmt: skip
        rng, limbs, step, stream, _ = ("none", [], 0, 0, 0) if key is None else key.schema()
        sums, norms, weights = torch.ops.dpkernels_C.clip_pipeline(
            grads, list(coeffs), list(C), mode, float(r), list(shift), list(scale), bool(per_layer),
            nonfinite == "drop", float(norm_scale), rng, float(noise_std), limbs, step, stream, float(out_scale),
            list(noise),
        )  # fmt: skip
        return list(sums), norms, weights


class _StagedClip:
    """The pipeline composed from a backend's three stages (reference, triton): norms, weights, and
    the sum pass with its noise epilogue (``privatized_sum``, or ``privatized_sum_chacha20`` for
    generated ChaCha20 noise, which is added in float64 and rounded once)."""

    def __init__(self, stages):
        self.stages = stages
        self.per_sample_sumsq = stages.per_sample_sumsq
        self.clip_factors = stages.clip_factors
        self.weighted_sum = stages.weighted_sum

    def pipeline(self, grads, coeffs, C, mode, r, shift, scale, per_layer, nonfinite, *, norm_scale=1.0,
                 noise_std=0.0, key=None, out_scale=1.0, noise=()):  # fmt: skip
        st, sets = self.stages, _unflatten(grads, len(coeffs))
        sumsq = st.per_sample_sumsq(sets, list(coeffs), shift or None, scale or None)
        norms, bad = ref.norms_of_sumsq(sumsq, per_layer, nonfinite, norm_scale)
        dtype = _out_dtype(grads)
        factors = st.clip_factors(norms, C if per_layer else C[0], mode, r)
        w = ref.weights_of_factors(factors, bad, sumsq.shape[1], dtype)
        norms = norms.to(dtype)
        if key is None and not noise:
            return st.weighted_sum(sets, w, list(coeffs)), norms, w
        if not noise and key.rng == "chacha20" and noise_std > 0:
            sums = st.privatized_sum_chacha20(sets, w, coeffs, noise_std, key.key, key.step, key.stream, out_scale)
        else:  # pre-drawn, Philox or no noise (the chacha20 key is unused then)
            seed = key.key if key is not None and key.rng == "philox" else 0
            step, stream = (0, 0) if key is None else (key.step, key.stream)
            sums = st.privatized_sum(sets, w, coeffs, noise_std, seed, step, stream, out_scale, list(noise) or None)
        return sums, norms, w


def _triton_clip():
    from .triton_kernels import clip as triton_clip

    return _StagedClip(triton_clip)


CLIP = family(
    "clip",
    ("per_sample_sumsq", "clip_factors", "weighted_sum", "pipeline"),
    reference=lambda: _StagedClip(ref),
    cpu=lambda: _NativeClip,
    cuda=lambda: _NativeClip,
    triton=_triton_clip,
)


if _backend.has_native_ops():

    @torch.library.register_fake("dpkernels_C::per_sample_sumsq")
    def _(grads, coeffs, shift, scale):
        return grads[0].new_empty((grads[0].shape[0], len(grads) // len(coeffs)), dtype=torch.float64)

    @torch.library.register_fake("dpkernels_C::clip_factors")
    def _(norms, max_grad_norm, mode, r):
        return torch.empty_like(norms)

    @torch.library.register_fake("dpkernels_C::weighted_sum")
    def _(grads, coeffs, weights):
        return [g.new_empty(g.shape[1:], dtype=torch.float32) for g in grads[: len(grads) // len(coeffs)]]

    @torch.library.register_fake("dpkernels_C::clip_pipeline")
    def _(grads, coeffs, max_grad_norm, mode, r, shift, scale, per_layer, drop_nonfinite, *epilogue):
        # A list that mixes meta with real tensors is dispatched here rather than to a kernel.
        if len({g.device for g in grads}) > 1:
            raise RuntimeError("dpkernels: clip_pipeline got tensors on more than one device")
        L, B = len(grads) // len(coeffs), grads[0].shape[0]
        sums = [g.new_empty(g.shape[1:], dtype=torch.float32) for g in grads[:L]]
        norms = grads[0].new_empty((B, L) if per_layer else (B,), dtype=torch.float32)
        return sums, norms, grads[0].new_empty((B, L), dtype=torch.float32)


def _as_list(x) -> list[float]:
    return [float(v) for v in x] if isinstance(x, Sequence) else [float(x)]


def _unflatten(grads: list[Tensor], k: int) -> list[list[Tensor]]:
    L = len(grads) // k
    return [grads[j * L : (j + 1) * L] for j in range(k)]


def _out_dtype(grads: Sequence[Tensor]) -> torch.dtype:
    return torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32


# --------------------------------------------------------------------------------------------
# Registered ops. Arguments are already validated and normalised by the public wrappers below;
# an empty list stands for "no shift/scale".
# --------------------------------------------------------------------------------------------


@custom_op("per_sample_norms", mutates_args=())
def _per_sample_norms_op(
    grads: list[Tensor],
    coeffs: list[float],
    shift: list[Tensor],
    scale: list[Tensor],
    per_layer: bool,
    backend: str,
) -> Tensor:
    sumsq = CLIP.kernels(backend).per_sample_sumsq(_unflatten(grads, len(coeffs)), coeffs, shift or None, scale or None)
    return (sumsq if per_layer else sumsq.sum(dim=1)).sqrt().to(_out_dtype(grads))


@_per_sample_norms_op.register_fake
def _(grads, coeffs, shift, scale, per_layer, backend):
    B, L = grads[0].shape[0], len(grads) // len(coeffs)
    return grads[0].new_empty((B, L) if per_layer else (B,), dtype=_out_dtype(grads))


@custom_op("clip_factors", mutates_args=())
def _clip_factors_op(norms: Tensor, max_grad_norm: list[float], mode: str, r: float, backend: str) -> Tensor:
    # A NaN/Inf norm would give a NaN weight and, in weighted_sum, a NaN sum: refused here as the
    # fused pipeline refuses the sample (its nonfinite="drop" is the way to weight such samples 0).
    bad = ~torch.isfinite(norms)
    bad = bad if bad.dim() == 1 else bad.any(dim=1)
    ref.check_nonfinite(
        bad, "raise", "norm", "give those samples weight 0 yourself, or use clip_and_accumulate(..., nonfinite='drop')"
    )
    return CLIP.kernels(backend).clip_factors(norms, max_grad_norm, mode, r)


@_clip_factors_op.register_fake
def _(norms, max_grad_norm, mode, r, backend):
    return torch.empty_like(norms)


@custom_op("weighted_sum", mutates_args=())
def _weighted_sum_op(grads: list[Tensor], coeffs: list[float], weights: Tensor, backend: str) -> list[Tensor]:
    sets = _unflatten(grads, len(coeffs))
    dtype = _out_dtype(grads)
    # fp64 weights for fp32 sums are rounded toward zero, as every clip weight is (never up).
    w = ref.round_weights(weights) if weights.dtype == torch.float64 and dtype == torch.float32 else weights.to(dtype)
    sums = CLIP.kernels(backend).weighted_sum(sets, w.contiguous(), coeffs)
    _check_weighted_sum(sets, weights, coeffs, sums)
    return sums


def _check_weighted_sum(sets, weights: Tensor, coeffs: list[float], sums: list[Tensor]) -> None:
    """Raise ``ValueError`` when a sum is NaN/Inf or a weight is beyond the sums' range, naming the
    cause: the weights, the samples with a nonzero weight and a non-finite gradient, or else the
    sum's own overflow. The finite case costs a max-abs pass over the sums and the weights (not
    over the ``B×D`` gradients) and one sync; the samples are located only after it fails."""
    if _in_range([*sums, weights]):
        return
    big = ~(weights.abs() <= torch.finfo(sums[0].dtype).max).all(dim=1)
    what = f"weight (NaN, Inf or beyond the {sums[0].dtype} range)"
    ref.check_nonfinite(big, "raise", what, "weights must be finite")
    bad = torch.zeros(weights.shape[0], dtype=torch.bool, device=weights.device)
    for l, v in enumerate(ref.combine(sets, coeffs)):  # noqa: E741
        bad |= (weights[:, l] != 0) & ~torch.isfinite(v).all(dim=1)
    ref.check_nonfinite(
        bad, "raise", "per-sample gradient with a nonzero weight", "give those samples weight 0 (they are skipped)"
    )
    raise _overflow_error(sums, "weighted sum", "every weighted sample is finite", "scale the weights down")


def _in_range(tensors: list[Tensor]) -> bool:
    """Every element finite and within the first tensor's dtype range: one ``aminmax`` pass per
    tensor (NaN propagates into both extremes), one sync; ``stack`` promotes the extremes to the
    widest dtype exactly. An inf-norm (``_foreach_norm``) takes 20x as long on the CPU: 5.7 ms
    against 0.29 ms for 4.2 M fp32 elements."""
    parts = [t for t in tensors if t.numel()]
    if not parts:
        return True
    extremes = torch.stack([v for t in parts for v in t.aminmax()])
    return bool((extremes.abs() <= torch.finfo(parts[0].dtype).max).all())


def _overflow_error(sums: list[Tensor], what: str, why: str, fix: str) -> ValueError:
    over = [l for l, s in enumerate(sums) if not bool(torch.isfinite(s).all())]  # noqa: E741
    return ValueError(f"the {what} overflows {sums[0].dtype} in tensor(s) {over}: {why}, their sum is not; {fix}")


def _pipeline(backend: str, *args, **kwargs) -> tuple[list[Tensor], Tensor, Tensor]:
    """``(sums, norms, weights)`` of the backend's fused pipeline, refusing sums beyond their dtype.

    Every clipped sample is finite and bounded, but ``B`` of them (``B·C`` above fp32's maximum), or
    with ``scale`` the unscaled weighted gradients, can sum past it; the kernels then write Inf,
    which would also hide the noise added in the same pass. The check costs a max-abs pass over the
    ``D`` sums (not the ``B×D`` gradients) and one sync."""
    sums, norms, w = CLIP.kernels(backend).pipeline(*args, **kwargs)
    if not _in_range(sums):
        raise _overflow_error(
            sums, "clipped sum", "every clipped sample is finite", "lower max_grad_norm (or the batch size)"
        )
    return sums, norms, w


@_weighted_sum_op.register_fake
def _(grads, coeffs, weights, backend):
    L = len(grads) // len(coeffs)
    return [g.new_empty(g.shape[1:], dtype=_out_dtype(grads)) for g in grads[:L]]


@custom_op("clip_and_accumulate", mutates_args=())
def _clip_and_accumulate_op(
    grads: list[Tensor],
    coeffs: list[float],
    max_grad_norm: list[float],
    mode: str,
    r: float,
    shift: list[Tensor],
    scale: list[Tensor],
    per_layer: bool,
    nonfinite: str,
    backend: str,
) -> tuple[list[Tensor], Tensor]:
    sums, norms, _ = _pipeline(backend, grads, coeffs, max_grad_norm, mode, r, shift, scale, per_layer, nonfinite)
    return sums, norms


@_clip_and_accumulate_op.register_fake
def _(grads, coeffs, max_grad_norm, mode, r, shift, scale, per_layer, nonfinite, backend):
    L = len(grads) // len(coeffs)
    dtype = _out_dtype(grads)
    B = grads[0].shape[0]
    sums = [g.new_empty(g.shape[1:], dtype=dtype) for g in grads[:L]]
    return sums, grads[0].new_empty((B, L) if per_layer else (B,), dtype=dtype)


@custom_op("privatize", mutates_args=())
def _privatize_op(
    grads: list[Tensor],
    coeffs: list[float],
    max_grad_norm: list[float],
    noise_std: float,
    rng: str,
    key: list[int],
    step: int,
    stream: int,
    out_scale: float,
    mode: str,
    r: float,
    shift: list[Tensor],
    scale: list[Tensor],
    per_layer: bool,
    noise: list[Tensor],
    nonfinite: str,
    backend: str,
) -> list[Tensor]:
    k = NoiseKey.from_schema(rng, key, step, stream, 0)
    if shift or scale:
        return _privatize_affine(
            grads, coeffs, max_grad_norm, noise_std, k, out_scale, mode, r, shift, scale, per_layer, noise, nonfinite,
            backend,
        )  # fmt: skip
    return _pipeline(
        backend, grads, coeffs, max_grad_norm, mode, r, shift, scale, per_layer, nonfinite, noise_std=noise_std,
        key=k, out_scale=out_scale, noise=noise,
    )[0]  # fmt: skip


def _clipped_sums(grads, coeffs, C, mode, r, shift, scale, per_layer, nonfinite, backend, *, norm_scale=1.0):
    """``(sums, weights)``: the noise-free pipeline on any backend, with the per-sample weights
    ``[B, L]`` that :func:`clip_and_accumulate` does not return (``grads`` flat, ``C`` a list)."""
    sums, _, w = _pipeline(
        backend, grads, coeffs, C, mode, r, shift, scale, per_layer, nonfinite, norm_scale=norm_scale
    )
    return sums, w


def _privatize_affine(grads, coeffs, max_grad_norm, noise_std, key, out_scale, mode, r, shift, scale, per_layer,
                      noise, nonfinite, backend):  # fmt: skip
    """``privatize`` with ``shift``/``scale``: the noise goes where the clip bounds each sample.

    The clip bounds ``‖c_i (v_i − shift) ⊙ scale‖ ≤ C``, not ``‖c_i v_i‖``, so the private release is
    ``T = Σ_i c_i (v_i − shift) ⊙ scale + noise_std·z`` (sensitivity Δ, ``noise_std = σΔ``), and the
    result is its post-processing back to gradient coordinates, the public ``shift`` added back::

        out = (S − (Σ_i c_i)·shift + noise_std·z / scale) · out_scale + shift,    S = Σ_i c_i v_i

    per tensor (``Σ_i c_i`` over that tensor's weights; no shift is 0, no scale is 1). The native
    epilogue only knows ``(S + ν)·out_scale``, so this is composed on every backend: the noise-free
    pipeline gives ``S`` and the weights, the noise comes from the fused path's stream (same key
    and counters, element index global over the list; Philox ``noise_std·z`` in fp32 as there,
    ChaCha20 in float64), the rest is float64, rounded once: one extra pass over the ``D`` outputs.
    A pre-drawn ``noise`` replaces ``noise_std·z``, in the scaled space.
    """
    _check_affine(shift, scale, noise_std)
    sums, w = _clipped_sums(grads, coeffs, max_grad_norm, mode, r, shift, scale, per_layer, nonfinite, backend)
    c_total = w.double().sum(dim=0)  # [L]
    sizes = [s.numel() for s in sums]
    nus = [n.double() for n in noise] if noise else [None] * len(sums)
    if not noise and noise_std > 0:
        device = sums[0].device
        if key.rng == "chacha20":
            z = noise_std * _chacha20_normals64(sum(sizes), key, device, backend)
        else:
            z = torch.empty(sum(sizes), dtype=torch.float32, device=device)
            NOISE.kernels(backend).fill(z, noise_std, key)
        nus = [part.view_as(s).double() for part, s in zip(torch.split(z, sizes), sums, strict=True)]
    out = []
    for idx, (s, nu) in enumerate(zip(sums, nus, strict=True)):
        x = s.double()
        if shift:
            x = x - c_total[idx] * shift[idx].double()
        if nu is not None:
            x = x + (nu / scale[idx].double() if scale else nu)
        x = x * out_scale
        if shift:
            x = x + shift[idx].double()
        out.append(round_once(x, s.dtype))
    return out


def _check_affine(shift: list[Tensor], scale: list[Tensor], noise_std: float) -> None:
    """Refuse a shift/scale the release cannot be mapped back through (one device sync): a
    non-finite entry; a zero scale (that coordinate is not bounded by the clip at all, so it cannot
    be released); a scale so small that ``1/scale`` or ``noise_std/scale`` overflows fp32."""
    for name, vecs in (("shift", shift), ("scale", scale)):
        nonempty = [(idx, v) for idx, v in enumerate(vecs) if v.numel()]
        if not nonempty:
            continue
        ranges = torch.stack([torch.stack([v.abs().amin(), v.abs().amax()]) for _, v in nonempty]).double().tolist()
        for (idx, _), (lo, hi) in zip(nonempty, ranges, strict=True):
            if not math.isfinite(hi):
                raise ValueError(f"{name}[{idx}] has a non-finite entry; {name} must be finite")
            if name != "scale":
                continue
            if lo == 0:
                raise ValueError(
                    f"scale[{idx}] has a zero entry: that coordinate is not bounded by the clip, so it cannot "
                    "be released privately (the noise noise_multiplier·C/scale would be infinite)"
                )
            if not lo * FP32_MAX >= max(1.0, noise_std):
                raise ValueError(
                    f"scale[{idx}] has an entry of magnitude {lo:.4g}: 1/scale or the noise "
                    f"{noise_std:.4g}/scale in gradient coordinates overflows float32 (max {FP32_MAX:.4g})"
                )


@_privatize_op.register_fake
def _(grads, coeffs, max_grad_norm, noise_std, rng, key, step, stream, out_scale, mode, r, shift, scale, *rest):
    L = len(grads) // len(coeffs)
    return [g.new_empty(g.shape[1:], dtype=_out_dtype(grads)) for g in grads[:L]]


# --------------------------------------------------------------------------------------------
# Validation: every problem gets a message that names it; nothing is silently reinterpreted.
# --------------------------------------------------------------------------------------------


class _Batch(NamedTuple):
    """Validated inputs: ``grads`` flat (set-major, contiguous), ``k`` sets of ``L`` tensors."""

    grads: list[Tensor]
    k: int
    L: int
    B: int
    device: torch.device
    coeffs: list[float]

    @property
    def param_shapes(self) -> list[torch.Size]:
        return [g.shape[1:] for g in self.grads[: self.L]]


def _prepare(grad_samples, coeffs, backend: str, what: str = "grad_samples") -> _Batch:
    if isinstance(grad_samples, Tensor) or not isinstance(grad_samples, Sequence):
        raise TypeError(
            f"{what} must be a list of per-sample gradient tensors [B, *param_shape], got {type(grad_samples).__name__}"
        )
    if len(grad_samples) == 0:
        raise ValueError(f"{what} is an empty list; pass at least one per-sample gradient tensor")
    nested = not isinstance(grad_samples[0], Tensor)
    sets = [list(s) for s in grad_samples] if nested else [list(grad_samples)]
    k, L = len(sets), len(sets[0])
    if coeffs is None:
        if k != 1:
            raise ValueError(f"{what} holds {k} gradient sets; pass coeffs=[α_1..α_{k}] to combine them")
        coeffs = [1.0]
    # The kernels combine the sets in fp32 (α_j as an fp32 value): a larger |α_j| would be inf.
    coeffs = [real(f"coeffs[{j}]", a, low=-FP32_MAX, high=FP32_MAX) for j, a in enumerate(coeffs)]
    if len(coeffs) != k:
        raise ValueError(f"coeffs has {len(coeffs)} entries but {what} holds {k} gradient set(s)")
    if L == 0:
        raise ValueError(f"{what} contains an empty gradient set")
    first = sets[0][0]
    if not isinstance(first, Tensor):
        raise TypeError(f"{what} must contain tensors, got {type(first).__name__}")
    B, device = first.shape[0] if first.dim() else -1, first.device
    allowed = _FLOAT_DTYPES + ((torch.float64,) if backend == "reference" else ())
    flat = []
    for j, gs in enumerate(sets):
        if len(gs) != L:
            raise ValueError(f"gradient set {j} has {len(gs)} tensors but set 0 has {L}")
        for idx, g in enumerate(gs):
            # One cheap combined test per tensor (lists hold hundreds); the message is built only
            # when it fails.
            if (
                not isinstance(g, Tensor)
                or g.dtype not in allowed
                or g.dim() == 0
                or g.shape[0] != B
                or g.device != device
                or (j and (g.shape != sets[0][idx].shape or g.dtype != sets[0][idx].dtype))
            ):
                name = f"{what}[{j}][{idx}]" if nested else f"{what}[{idx}]"
                _raise_bad_tensor(name, g, sets[0][idx], j, B, device, allowed, what)
            flat.append(g if g.is_contiguous() else g.contiguous())
    return _Batch(grads=flat, k=k, L=L, B=B, device=device, coeffs=coeffs)


def _raise_bad_tensor(name, g, g0, j, B, device, allowed, what):
    if not isinstance(g, Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(g).__name__}")
    if g.dtype not in allowed:
        hint = " (float64 runs on backend='reference' only)" if g.dtype == torch.float64 else ""
        raise TypeError(f"{name} has dtype {g.dtype}; supported: {', '.join(map(str, allowed))}{hint}")
    if g.dim() == 0:
        raise ValueError(f"{name} is a scalar; per-sample gradients are [B, *param_shape]")
    if g.device != device:
        raise ValueError(f"{name} is on {g.device} but {what}[0] is on {device}; all tensors must share one device")
    if g.shape[0] != B:
        raise ValueError(f"{name} has batch size {g.shape[0]} but {what}[0] has {B}; all tensors must share B")
    raise ValueError(
        f"{name} is {tuple(g.shape)} {g.dtype} but set 0 has {tuple(g0.shape)} {g0.dtype}; "
        "every set must match set 0 tensor by tensor"
    )


def _prepare_vectors(vecs, batch: _Batch, name: str) -> list[Tensor]:
    """shift/scale/noise of a clip over ``batch``: ``[]`` for None, else checked, in the sums' dtype."""
    if vecs is None:
        return []
    return _check_vectors(name, vecs, batch.param_shapes, batch.device, _out_dtype(batch.grads))


def _check_vectors(name: str, vecs, shapes, device, dtype: torch.dtype | None = None) -> list[Tensor]:
    """Per-parameter vectors (shift, scale, noise): one floating-point tensor per parameter, shaped
    like it (no batch dimension) and on ``device``; returned contiguous (and as ``dtype``)."""
    if isinstance(vecs, Tensor) or len(vecs) != len(shapes):
        raise ValueError(
            f"{name} must be a list of {len(shapes)} tensors, one tensor per trainable parameter shaped like it; "
            f"got {'a tensor' if isinstance(vecs, Tensor) else len(vecs)}"
        )
    out = []
    for idx, (v, shape) in enumerate(zip(vecs, shapes, strict=True)):
        if not isinstance(v, Tensor) or not v.is_floating_point():
            got = getattr(v, "dtype", type(v).__name__)
            raise TypeError(f"{name}[{idx}] must be a floating-point tensor, got {got}")
        if v.shape != shape:
            what, got = f"{name}[{idx}]", list(v.shape)
            raise ValueError(f"{what} must be shaped like its parameter {list(shape)}; {what} has shape {got}")
        if v.device != device:
            raise ValueError(f"{name}[{idx}] is on {v.device} but the gradients are on {device}")
        out.append((v if dtype is None else v.to(dtype)).contiguous())
    return out


def _check_mode(mode: str, r: float | None) -> float:
    if mode not in CLIP_MODES:
        raise ValueError(f"unknown clip mode {mode!r}; expected one of {CLIP_MODES}")
    if mode not in DEFAULT_R:
        if r is not None:
            raise ValueError(f"r is only used by modes 'auto_s' and 'psac', not {mode!r}; leave it None")
        return 0.0
    x = _scalar(DEFAULT_R[mode] if r is None else r)  # any real type; None for a bool or a non-number
    if x is None or not (math.isfinite(x) and x > 0):
        raise ValueError(f"r must be a finite number > 0 for mode {mode!r}, got {r!r}")
    return float(x)


def _check_max_grad_norm(max_grad_norm, per_layer: bool, L: int) -> list[float]:
    """``[C]``, or the ``L`` per-layer bounds, as floats in ``(0, FP32_MAX]`` (the kernels hold ``C``
    in fp32). Any real type: Python, NumPy, 0-d tensors; a 1-d tensor or array is a list."""
    if type(max_grad_norm) is float and 0.0 < max_grad_norm <= FP32_MAX:
        return [max_grad_norm]  # the common case, without the probes below
    if isinstance(max_grad_norm, Tensor) or type(max_grad_norm).__name__ == "ndarray":
        # tolist() keeps bools as bools, so a bool tensor is refused below like True.
        max_grad_norm = max_grad_norm.tolist() if max_grad_norm.ndim == 1 else max_grad_norm
    is_list = isinstance(max_grad_norm, Sequence) and not isinstance(max_grad_norm, str)
    if is_list:
        if not per_layer:
            raise ValueError("a list of max_grad_norm values needs per_layer=True; flat clipping takes one float")
        if len(max_grad_norm) != L:
            raise ValueError(f"max_grad_norm has {len(max_grad_norm)} entries for {L} parameter tensors")
    values = []
    for idx, v in enumerate(max_grad_norm if is_list else [max_grad_norm]):
        name = f"max_grad_norm[{idx}]" if is_list else "max_grad_norm"
        x = _scalar(v)
        if x is None and not (isinstance(v, Tensor) or type(v).__name__ in ("bool", "bool_")):  # NumPy 2, 1
            raise TypeError(
                f"max_grad_norm must be a float (or a list of floats with per_layer=True), got {max_grad_norm!r}"
            )
        if x is None:  # a bool, or a tensor that is not a 0-d real number
            raise ValueError(f"{name} must be a real number, got {v!r} ({type(v).__name__})")
        if not (math.isfinite(x) and 0 < x <= FP32_MAX):
            raise ValueError(f"{name} must be finite and > 0 (at most the float32 maximum {FP32_MAX:.4g}), got {v!r}")
        values.append(float(x))
    return values


def _pipeline_args(grad_samples, max_grad_norm, mode, r, per_layer, coeffs, nonfinite, backend):
    """Validated ``(batch, backend, r, C)`` shared by the clipping pipelines; ``C`` has one bound
    per tensor with ``per_layer=True``."""
    if nonfinite not in ("raise", "drop"):
        raise ValueError(f"nonfinite must be 'raise' or 'drop', got {nonfinite!r}")
    batch = _prepare(grad_samples, coeffs, backend)
    backend = _backend.resolve(backend, batch.device)
    r = _check_mode(mode, r)
    C = _check_max_grad_norm(max_grad_norm, per_layer, batch.L)
    if per_layer and len(C) == 1:
        C = C * batch.L
    return batch, backend, r, C


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def per_sample_norms(grad_samples, *, shift=None, scale=None, per_layer=False, coeffs=None, backend="auto") -> Tensor:
    """Per-sample L2 norms of ``(Σ_j α_j g_i^(j) − shift) ⊙ scale``.

    Args:
        grad_samples: list of ``[B, *param_shape]`` tensors, or a list of ``k`` such lists.
        shift, scale: ``None`` or one tensor per parameter, shaped like it (DP-MacAdam's
            ``m̂``, ``1/b``; scale-then-privatize's ``s``).
        per_layer: one norm per tensor (``[B, L]``) instead of one over all tensors (``[B]``).
        coeffs: ``[α_1..α_k]`` when ``grad_samples`` holds ``k`` sets.
        backend: ``"auto"``, ``"reference"``, ``"cpu"``, ``"cuda"`` or ``"triton"``.

    Returns: fp32 ``[B]`` or ``[B, L]`` (fp64 for fp64 input on the reference backend). Squares
    are accumulated in fp64, so the norm of any finite gradient is exact to fp32 rounding.
    """
    batch = _prepare(grad_samples, coeffs, backend)
    backend = _backend.resolve(backend, batch.device)
    shift_v = _prepare_vectors(shift, batch, "shift")
    scale_v = _prepare_vectors(scale, batch, "scale")
    return _per_sample_norms_op(batch.grads, batch.coeffs, shift_v, scale_v, bool(per_layer), backend)


def clip_factors(norms: Tensor, max_grad_norm, *, mode: str = "clip", r: float | None = None, backend="auto") -> Tensor:
    """Per-sample weights ``c_i = f(n_i)``, same shape and dtype as ``norms``.

    Modes (``C`` = ``max_grad_norm``; a list of ``L`` values for ``[B, L]`` per-layer norms):

    - ``clip``:   ``min(1, C/(n + 1e-6))``  DP-SGD; the guard is Opacus's.
    - ``auto_s``: ``C/(n + r)``              Auto-S / NSGD; default ``r = 0.01``.
    - ``auto_v``: ``C/max(n, 1e-12)``        Auto-V; the floor keeps zero norms finite.
    - ``psac``:   ``C/(n + r/(n + r))``      DP-PSAC (Xia et al., AAAI-23); default ``r = 0.1``.

    Every mode satisfies ``c·n ≤ C`` (``auto_s`` and ``psac`` strictly), so the sum of the
    weighted gradients has sensitivity ``C`` under add/remove adjacency. ``f`` is evaluated in fp64
    on every backend and an fp32 weight is rounded toward zero, so in fp32 one sample's contribution
    ``c·g`` (``D`` elements) has ``‖c·g‖ ≤ C·(1 + 2^-21) + √D·2^-150``
    (:func:`dpkernels.reference.clip.clip_factors` derives it).

    Raises ``ValueError`` naming the samples whose norm is NaN or Inf (a non-finite gradient).
    """
    if not isinstance(norms, Tensor) or norms.dtype not in (torch.float32, torch.float64):
        raise TypeError("norms must be a float32 or float64 tensor [B] or [B, L]")
    if norms.dim() not in (1, 2):
        raise ValueError(f"norms must be [B] or [B, L], got shape {tuple(norms.shape)}")
    r = _check_mode(mode, r)
    per_layer = norms.dim() == 2
    C = _check_max_grad_norm(max_grad_norm, per_layer, norms.shape[-1] if per_layer else 1)
    if per_layer and len(C) == 1:
        C = C * norms.shape[1]
    backend = _backend.resolve(backend, norms.device)
    return _clip_factors_op(norms.contiguous(), C, mode, r, backend)


def weighted_sum(grad_samples, weights: Tensor, *, coeffs=None, backend="auto") -> list[Tensor]:
    """``S^(l) = Σ_i w_i Σ_j α_j g_i^(j,l)`` for each parameter ``l``, accumulated and returned in fp32.

    ``weights`` is ``[B]`` or ``[B, L]`` (one weight per sample and tensor), any float dtype; fp64
    weights are rounded toward zero to fp32, as clip weights are. A sample whose weight is exactly
    0 is skipped, so a dropped non-finite sample cannot poison the sum.

    Raises ``ValueError`` instead of returning a NaN/Inf sum: naming the samples with a non-finite
    weight (or one beyond fp32), or with a nonzero weight and a NaN/Inf gradient, or else saying
    that the sum overflows.
    """
    batch = _prepare(grad_samples, coeffs, backend)
    backend = _backend.resolve(backend, batch.device)
    if not isinstance(weights, Tensor) or not weights.is_floating_point():
        raise TypeError("weights must be a floating-point tensor [B] or [B, L]")
    if weights.device != batch.device:
        raise ValueError(f"weights are on {weights.device} but the gradients are on {batch.device}")
    if weights.shape not in ((batch.B,), (batch.B, batch.L)):
        raise ValueError(
            f"weights must have shape [B]={batch.B} or [B, L]=[{batch.B}, {batch.L}], got {tuple(weights.shape)}"
        )
    if weights.dim() == 1:
        weights = weights[:, None].expand(-1, batch.L)
    return _weighted_sum_op(batch.grads, batch.coeffs, weights, backend)


def privatize(
    grad_samples,
    max_grad_norm,
    noise_multiplier: float,
    *,
    seed: int | None = None,
    step: int,
    stream: int = 0,
    mode: str = "clip",
    r: float | None = None,
    shift=None,
    scale=None,
    per_layer: bool = False,
    coeffs=None,
    expected_batch_size: int | None = None,
    noise=None,
    nonfinite: str = "raise",
    rng: str = "philox",
    backend: str = "auto",
) -> list[Tensor]:
    """The private gradient per parameter: ``(Σ_i c_i v_i + σ·Δ·z) / B``, fused (with shift/scale:
    the noise is added in the scaled space, below).

    The clipped sum is formed exactly as :func:`clip_and_accumulate`; the Gaussian noise ``σ·Δ·z``
    is generated inside the pass that writes the result (Philox, docs/RNG.md: key ``seed``, counter
    ``(element, step, stream)``, element index global over the parameter list), so no noise tensor
    is materialised. This is Opacus's ``clip_and_accumulate`` → ``add_noise`` → ``scale_grad``.

    Sensitivity (add/remove adjacency) of what is noised, for every clip mode (each has
    ``c_i·n_i ≤ C``), and what is returned (docs/ALGORITHMS.md, "Sensitivity of every private output"):

    - plain: ``Δ = C`` (``max_grad_norm``); returns ``(S + σ·C·z) / B``, ``S = Σ_i c_i v_i``.
    - ``per_layer=True``: ``Δ = ‖(C_1..C_L)‖₂`` (Opacus's convention); the same formula.
    - ``shift``/``scale`` (flat or per layer, same ``Δ``): the clip bounds ``‖c_i (v_i − shift) ⊙
      scale‖``, so the private quantity is ``T = Σ_i c_i (v_i − shift) ⊙ scale + σ·Δ·z``; returned is
      its post-processing to gradient coordinates with the public ``shift`` added back (the private
      mean gradient, DP-MacAdam's map-back)::

          out = (S − (Σ_i c_i)·shift + σ·Δ·z / scale) / B + shift

      i.e. per-coordinate noise std ``σΔ/(B·|scale|)``. Not fused: the noise-free pipeline, then the
      same noise stream, composed in float64 and rounded once (one extra pass over ``D``).
      ``scale`` must be finite and non-zero (a zero-scale coordinate is unbounded by the clip and
      cannot be released), with ``1/scale`` and ``σΔ/scale`` within fp32; ``shift`` finite.

    Args:
        noise_multiplier: ``σ`` (any real type; ``σ·Δ`` must fit in fp32).
        seed: the generator's key: 64-bit for Philox, 256-bit (int or 32 bytes) for ChaCha20;
            ``None`` draws a fresh one from the OS CSPRNG (reproducible runs must pass and store
            it). ``step`` must differ between steps, or the noise repeats.
        expected_batch_size: ``B`` for the mean (Opacus: the expected batch size under Poisson
            sampling). ``None`` divides by the realised batch size, which is not private under
            Poisson sampling: pass it for DP training.
        noise: a pre-drawn list of noise tensors (already scaled: ``σ·Δ·z``; with ``scale``, in the
            scaled space, so divided by ``scale`` before it is added) shaped like the parameters,
            added instead of generating; for exact tests and other samplers.
        rng: ``"philox"`` (default; fast, fused into the sum's epilogue, **not cryptographic**) or
            ``"chacha20"`` (secure mode, docs/RNG.md §6: ChaCha20 keystream, float64 Box–Muller,
            ``S + σΔz`` formed in float64 and rounded once to fp32, then scaled by ``1/B``; fused
            into the sum's epilogue as well, on every backend; with shift/scale the whole map-back
            is formed in float64 and rounded once).

    Returns: one fp32 tensor per parameter, shaped like it.
    """
    batch, backend, r, C = _pipeline_args(grad_samples, max_grad_norm, mode, r, per_layer, coeffs, nonfinite, backend)
    sigma = real("noise_multiplier", noise_multiplier, low=0.0)
    if expected_batch_size is not None:
        B = integer("expected_batch_size", expected_batch_size, low=1)
    elif batch.B == 0:
        raise ValueError("the batch is empty: pass expected_batch_size, the mean divides by it")
    else:
        B = batch.B
    key = NoiseKey.of(rng, seed, step, stream)
    noise_v = []
    if noise is not None:
        noise_v = _prepare_vectors(noise, batch, "noise")
    sensitivity = math.sqrt(sum(c * c for c in C)) if per_layer else C[0]
    noise_std = fp32_scale("noise_multiplier·sensitivity", sigma * sensitivity)
    shift_v, scale_v = _prepare_vectors(shift, batch, "shift"), _prepare_vectors(scale, batch, "scale")
    rng, limbs, step, stream, _ = key.schema()
    return _privatize_op(
        batch.grads, batch.coeffs, C, noise_std, rng, limbs, step, stream, 1.0 / B, mode, r, shift_v, scale_v,
        bool(per_layer), noise_v, nonfinite, backend,
    )  # fmt: skip


def clip_and_accumulate(
    grad_samples,
    max_grad_norm,
    *,
    mode: str = "clip",
    r: float | None = None,
    shift=None,
    scale=None,
    per_layer: bool = False,
    coeffs=None,
    nonfinite: str = "raise",
    backend: str = "auto",
) -> tuple[list[Tensor], Tensor]:
    """The fused clipping pipeline: ``(sums, norms)`` without any ``B×D`` intermediate.

    ``norms = per_sample_norms(...)``, ``c = clip_factors(norms, ...)`` and
    ``sums[l] = Σ_i c_i Σ_j α_j g_i^(j,l)`` over the raw gradients (shift/scale only enter the
    norm; docs/ALGORITHMS.md). Reads the per-sample gradients twice and writes ``D`` fp32 values.

    Args: as :func:`per_sample_norms` and :func:`clip_factors`, plus
        nonfinite: ``"raise"`` (default) raises ``ValueError`` naming the samples whose gradient
            has a NaN or Inf; ``"drop"`` gives those samples weight 0 (all tensors, even with
            ``per_layer=True``). ``"raise"`` synchronises with the device once per call.

    Returns: ``sums``, one fp32 tensor per parameter shaped like it; ``norms``, fp32 ``[B]`` or
    ``[B, L]``. ``B = 0`` is valid and gives zero sums.
    """
    batch, backend, r, C = _pipeline_args(grad_samples, max_grad_norm, mode, r, per_layer, coeffs, nonfinite, backend)
    args = (
        batch.grads, batch.coeffs, C, mode, r, _prepare_vectors(shift, batch, "shift"),
        _prepare_vectors(scale, batch, "scale"), bool(per_layer), nonfinite,
    )  # fmt: skip
    return _clip_and_accumulate_op(*args, backend)
