"""Pure-PyTorch reference for the per-sample clipping pipeline.

This file defines what the ``cpu``, ``cuda`` and ``triton`` backends must compute. It is written
to be read, not to be fast: it materialises the combined per-sample gradients ``[B, D]``.

Notation (shapes per parameter tensor ``l`` of ``L``):

- ``g_i^(j,l)``: per-sample gradient of sample ``i`` in gradient set ``j`` (``k`` sets), stored
  as a tensor ``[B, *param_shape]`` (Opacus's ``p.grad_sample`` layout).
- ``v_i^(l) = Σ_j α_j g_i^(j,l)``: the combined per-sample gradient (DP-PMLF per-sample momentum,
  "Enhancing DPSGD via Per-Sample Momentum and Low-Pass Filtering", arXiv:2511.08841; ``k = 1``
  and ``α = [1]`` otherwise).
- ``n_i = ‖(v_i − shift) ⊙ scale‖₂`` over all tensors together (flat), or per tensor
  (``per_layer=True``); ``shift``/``scale`` come from DP-MacAdam ("DP-MacAdam: Differentially Private
  Mechanism with Adaptive Clipping and Adaptive Momentum", arXiv:2606.05435) and scale-then-privatize
  ("On Design Principles for Private Adaptive Optimizers", arXiv:2507.01129).

Numerics, shared by every backend: the combination and the shift/scale are computed in fp32
(fp64 when the input is fp64, reference only); squares are accumulated in fp64, so a norm is
exact to fp32 rounding and cannot overflow for any finite gradient.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .noise import chacha20_standard_normal, round_once, standard_normal

CLIP_MODES = ("clip", "auto_s", "auto_v", "psac")

# Opacus's flat clipping uses min(1, C / (n + 1e-6)); keeping the same guard keeps us bit-close
# to Opacus and gives a finite weight at n = 0.
CLIP_EPS = 1e-6
# Auto-V's C / n has no regulariser; below this norm the sample is treated as zero (its weight
# stops growing), so weights stay finite in fp32 and the contribution stays below C.
AUTO_V_MIN_NORM = 1e-12


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def combine(grad_sets: Sequence[Sequence[torch.Tensor]], coeffs: Sequence[float]) -> list[torch.Tensor]:
    """``v^(l) = Σ_j α_j g^(j,l)`` for each tensor ``l``, as ``[B, n_l]`` in the compute dtype."""
    dtype = _compute_dtype(*(g for gs in grad_sets for g in gs))
    out = []
    for per_set in zip(*grad_sets, strict=True):
        acc = torch.zeros(_rows(per_set[0]), dtype=dtype, device=per_set[0].device)
        for alpha, g in zip(coeffs, per_set, strict=True):
            acc = acc + alpha * g.to(dtype).reshape(acc.shape)
        out.append(acc)
    return out


def _rows(g: torch.Tensor) -> tuple[int, int]:
    """``[B, n]`` for a per-sample gradient ``[B, *param_shape]``: ``n = 1`` for a 0-d parameter
    (``g`` is ``[B]``, where ``flatten(1)`` fails), and explicit for ``B = 0`` (where ``-1`` is
    ambiguous)."""
    return g.shape[0], math.prod(g.shape[1:])


def per_sample_sumsq(
    grad_sets: Sequence[Sequence[torch.Tensor]],
    coeffs: Sequence[float],
    shift: Sequence[torch.Tensor] | None = None,
    scale: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """``s_il = Σ_e ((v_i^(l) − shift^(l)) ⊙ scale^(l))_e²``, fp64 ``[B, L]``."""
    cols = []
    for idx, v in enumerate(combine(grad_sets, coeffs)):
        if shift is not None:
            v = v - shift[idx].to(v.dtype).flatten()
        if scale is not None:
            v = v * scale[idx].to(v.dtype).flatten()
        cols.append(v.double().square().sum(dim=1))
    return torch.stack(cols, dim=1)


def per_sample_norms(
    grad_sets: Sequence[Sequence[torch.Tensor]],
    coeffs: Sequence[float] = (1.0,),
    shift: Sequence[torch.Tensor] | None = None,
    scale: Sequence[torch.Tensor] | None = None,
    per_layer: bool = False,
) -> torch.Tensor:
    """Per-sample L2 norms: ``[B]`` (flat) or ``[B, L]`` (per layer); fp32, fp64 for fp64 input."""
    sumsq = per_sample_sumsq(grad_sets, coeffs, shift, scale)
    out_dtype = _compute_dtype(*(g for gs in grad_sets for g in gs))
    sumsq = sumsq if per_layer else sumsq.sum(dim=1)
    return sumsq.sqrt().to(out_dtype)


def clip_factors(
    norms: torch.Tensor, max_grad_norm: float | Sequence[float], mode: str = "clip", r: float = 0.0
) -> torch.Tensor:
    """Per-sample weights ``c = f(n)``: fp64 for fp64 ``norms``, fp32 for fp32 ``norms``.

    - ``clip``:   ``min(1, C / (n + 1e-6))``           DP-SGD (Abadi et al.), Opacus's guard
    - ``auto_s``: ``C / (n + r)``                      Auto-S / NSGD (Bu et al.; Yang et al.)
    - ``auto_v``: ``C / max(n, 1e-12)``                Auto-V, pure normalisation
    - ``psac``:   ``C / (n + r / (n + r))``            DP-PSAC (arXiv:2212.00328), nested form: the
      denominator is ≥ 2√r − r > 0, so no guard is needed even at n = 0

    ``max_grad_norm`` broadcasts against ``norms`` (a scalar, or ``[L]`` for per-layer norms).
    Every mode has ``c · n ≤ C`` in exact arithmetic. ``f`` is evaluated in fp64 (``C`` and ``r``
    as given, not rounded to fp32), where it keeps ``ĉ · n ≤ C · (1 + 2^-50)`` (at most four
    roundings, psac); an fp32 result is then rounded toward zero (:func:`round_weights`), so it
    never exceeds the fp64 value.

    The privacy bound this gives, for a sample whose norm ``n̂`` is computed from its gradient
    ``g`` (one set with coefficient 1, no shift/scale; ``D`` elements, per tensor with
    ``per_layer``) and whose contribution ``c · g`` is formed in fp32 (each element rounded to
    nearest: relative error ≤ 2^-24, or absolute ≤ 2^-150 where the product is subnormal), on
    every backend::

        ‖fl(c · g)‖₂ ≤ C · (1 + 2^-21) + √D · 2^-150        for D ≤ 2^30

    from ``(1 + 2^-24)`` for the products, ``‖g‖ / n̂ ≤ 1 + 4·2^-24 + D·2^-54`` (the cpu kernel
    sums squares in fp32 lanes of 8 terms before widening to fp64; the other backends sum in fp64),
    one more ``2^-24`` for a norm rounded to fp32 (the three-stage path) and ``2^-50`` for ``f``.
    The absolute term matters only for ``C`` near the fp32 subnormal range (``√D · 7e-46``).
    """
    n = norms.double()
    C = torch.as_tensor(max_grad_norm, dtype=torch.float64, device=n.device)
    if C.numel() == 1:
        C = C.reshape(())
    if mode == "clip":
        w = torch.clamp(C / (n + CLIP_EPS), max=1.0)
    elif mode == "auto_s":
        w = C / (n + r)
    elif mode == "auto_v":
        w = C / torch.clamp(n, min=AUTO_V_MIN_NORM)
    elif mode == "psac":
        w = C / (n + r / (n + r))
    else:
        raise ValueError(f"unknown clip mode {mode!r}; expected one of {CLIP_MODES}")
    return w if norms.dtype == torch.float64 else round_weights(w)


def round_weights(w: torch.Tensor) -> torch.Tensor:
    """fp64 weights as fp32, rounded toward zero (``|result| ≤ |w|``) and saturating at the fp32
    maximum; NaN stays NaN.

    Why not to nearest: a weight in the fp32 subnormal range has few significant bits, so rounding
    up can nearly double it (``0.54 · 2^-149`` becomes ``2^-149``) and break ``c · n ≤ C``. An
    infinite weight (``C / r`` overflowing fp64 for a tiny ``r``) stands for a finite value beyond
    the fp32 range. The C++ twin is ``round_weight`` in csrc/include/dpkernels/clip_math.h.
    """
    f = w.float()
    up = (f.double().abs() > w.abs()) | w.isinf()
    return torch.where(up, torch.nextafter(f, torch.zeros_like(f)), f)


def weighted_sum(
    grad_sets: Sequence[Sequence[torch.Tensor]], weights: torch.Tensor, coeffs: Sequence[float] = (1.0,)
) -> list[torch.Tensor]:
    """``S^(l) = Σ_i w_il v_i^(l)``, each shaped like its parameter, fp32 (fp64 for fp64 input).

    ``weights`` is ``[B]`` or ``[B, L]``. A sample whose weight is exactly zero is skipped, not
    multiplied, so a dropped non-finite sample cannot turn the sum into NaN.
    """
    sums = []
    for idx, v in enumerate(combine(grad_sets, coeffs)):
        w = (weights if weights.dim() == 1 else weights[:, idx]).to(v.dtype)
        keep = w != 0
        s = (w[keep, None] * v[keep]).sum(dim=0)
        sums.append(s.reshape(grad_sets[0][idx].shape[1:]))
    return sums


def norms_of_sumsq(
    sumsq: torch.Tensor, per_layer: bool = False, nonfinite: str = "raise", norm_scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(n, bad)``: fp64 norms ``[B]`` (or ``[B, L]`` per layer) from the sums of squares ``[B, L]``,
    and the bool ``[B]`` of samples with a non-finite gradient (which raise under
    ``nonfinite="raise"``).

    ``norm_scale`` multiplies the norms: a scale vector known only up to a global factor
    (DP-MacAdam's ``1/b = (1/b_u)/bscale``) is applied as its per-element part, the factor here.
    """
    bad = ~torch.isfinite(sumsq).all(dim=1)
    check_nonfinite(bad, nonfinite)
    norms = (sumsq if per_layer else sumsq.sum(dim=1)).sqrt()
    return (norms * norm_scale if norm_scale != 1.0 else norms), bad


def weights_of_factors(w: torch.Tensor, bad: torch.Tensor, L: int, dtype: torch.dtype) -> torch.Tensor:
    """Per-sample, per-tensor weights ``[B, L]`` in ``dtype`` from the clip factors ``w`` (``[B]``,
    broadcast over tensors, or ``[B, L]``): 0 for a ``bad`` sample, fp32 rounded toward zero."""
    w = torch.where(bad if w.dim() == 1 else bad[:, None], 0.0, w)
    if w.dim() == 1:
        w = w[:, None].expand(-1, L)
    return (w if dtype == torch.float64 else round_weights(w)).contiguous()


def clip_weights(
    grad_sets: Sequence[Sequence[torch.Tensor]],
    max_grad_norm: float | Sequence[float],
    coeffs: Sequence[float] = (1.0,),
    mode: str = "clip",
    r: float = 0.0,
    shift: Sequence[torch.Tensor] | None = None,
    scale: Sequence[torch.Tensor] | None = None,
    per_layer: bool = False,
    nonfinite: str = "raise",
    norm_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stages 1–2: ``(w, n)`` with per-sample, per-tensor weights ``w`` ``[B, L]`` and norms ``n``:
    :func:`per_sample_sumsq`, :func:`norms_of_sumsq`, :func:`clip_factors` (broadcast over tensors
    for flat clipping), :func:`weights_of_factors`. The staged backends (triton) run this same
    composition with their own stages (``dpkernels.clip``)."""
    sumsq = per_sample_sumsq(grad_sets, coeffs, shift, scale)
    norms, bad = norms_of_sumsq(sumsq, per_layer, nonfinite, norm_scale)
    dtype = _compute_dtype(*(g for gs in grad_sets for g in gs))
    w = weights_of_factors(clip_factors(norms, max_grad_norm, mode, r), bad, sumsq.shape[1], dtype)
    return w, norms.to(dtype)


def clip_and_accumulate(grad_sets, max_grad_norm, coeffs=(1.0,), mode="clip", r=0.0, shift=None, scale=None,
                        per_layer=False, nonfinite="raise"):  # fmt: skip
    """``(S, n)``: ``S^(l) = Σ_i c_i v_i^(l)`` over the raw gradients, ``c`` from :func:`clip_weights`."""
    w, norms = clip_weights(grad_sets, max_grad_norm, coeffs, mode, r, shift, scale, per_layer, nonfinite)
    return weighted_sum(grad_sets, w, coeffs), norms


def privatized_sum(
    grad_sets: Sequence[Sequence[torch.Tensor]],
    weights: torch.Tensor,
    coeffs: Sequence[float],
    noise_std: float,
    seed: int,
    step: int,
    stream: int,
    out_scale: float,
    noise: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """``(S^(l) + ν^(l)) · out_scale`` with ``ν = noise_std · z`` (Philox, docs/RNG.md, element index
    global over the parameter list) or the pre-drawn ``noise`` list when given."""
    sums = weighted_sum(grad_sets, weights, coeffs)
    if noise is None:
        total = sum(s.numel() for s in sums)
        z = standard_normal(total, seed=seed, step=step, stream=stream, device=sums[0].device)
        noise = [
            noise_std * part.view_as(s) for part, s in zip(torch.split(z, [s.numel() for s in sums]), sums, strict=True)
        ]
    return [(s + nu.to(s.dtype)) * out_scale for s, nu in zip(sums, noise, strict=True)]


def privatized_sum_chacha20(
    grad_sets: Sequence[Sequence[torch.Tensor]],
    weights: torch.Tensor,
    coeffs: Sequence[float],
    noise_std: float,
    key: int,
    step: int,
    stream: int,
    out_scale: float,
) -> list[torch.Tensor]:
    """Secure mode (docs/RNG.md §6): ``round(S^(l) + noise_std · z) · out_scale``, the sum with the
    float64 ChaCha20 normal formed in float64 and rounded once to ``S``'s dtype, then scaled (a
    post-processing of the noised value) in that dtype. Element index global over the list."""
    sums = weighted_sum(grad_sets, weights, coeffs)
    total = sum(s.numel() for s in sums)
    z = chacha20_standard_normal(total, key=key, step=step, stream=stream, device=sums[0].device)
    parts = torch.split(z, [s.numel() for s in sums])
    return [
        round_once(s.double() + noise_std * part.view_as(s), s.dtype) * out_scale
        for s, part in zip(sums, parts, strict=True)
    ]


def check_nonfinite(
    bad: torch.Tensor,
    policy: str,
    what: str = "per-sample gradient",
    remedy: str = "pass nonfinite='drop' to give those samples weight 0 instead",
) -> None:
    """Raise (policy ``raise``) if any sample is non-finite, naming the sample indices: ``bad`` is
    a bool ``[B]``, ``what`` the non-finite quantity and ``remedy`` what the caller can do."""
    if policy == "raise" and bool(bad.any()):
        idx = torch.nonzero(bad).flatten().tolist()
        shown = ", ".join(map(str, idx[:20])) + (", ..." if len(idx) > 20 else "")
        raise ValueError(f"non-finite {what} for {len(idx)} sample(s) at batch indices [{shown}]; {remedy}")
