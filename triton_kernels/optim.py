"""Triton kernels of the fused DP optimizer steps ``sgd_step_``, ``dp2_step_``, ``adam_step_`` and
``macadam_step_`` (schemas and argument meaning: ``csrc/ops.cpp``; semantics: the reference
optimizers of ``dpkernels/reference/optim.py``; element math: ``csrc/include/dpkernels/optim_math.h``,
spelled here with the same operation order, in fp32).

One kernel serves the four families: ``linear_filter_``'s streaming skeleton (``filter.py``: one
tile of one tensor per program, tiles aligned to Philox blocks of the global index, multi-tensor
pointer tables, one launch per (parameter dtype, alignment) group) with a compile-time ``FAMILY``
epilogue. Per element:

- ``ν`` = the pre-drawn ``noise[l][i]`` (``NOISE_GIVEN``), or ``noise_std · g·y`` with ``y`` the
  noise filter (``filter.filter_step``, ``NK`` fp32 buffers) of the fresh Philox normal ``z`` of global
  element ``offset + index`` (``NOISE_FILTER``; independent noise is the filter ``[a, g] = [1, 1]``),
  or 0 when there are no noise buffers and ``noise_std = 0`` (``NOISE_NONE``: nothing is drawn);
- the family's step on the clipped sum ``S``, ``ν``, the parameter ``θ`` (loaded in its storage
  dtype, math in fp32, rounded once to nearest-even on store) and the fp32 state: ``sgd`` runs the
  direction filter (``DK`` buffers, same ``filter_step``) on ``g̃ + λθ``; ``macadam`` also writes, per
  program, the float64 sum of ``√ŝ`` over its elements, which the host sums in a fixed order.

Which scalar branches exist is compile-time (``HAS_WD``: sgd's λ ≠ 0, ``HAS_DECAY``: Adam's
1 − ηλ ≠ 1, ``UPDATE_B``: MacAdam's κ ≠ 0), as are the
family variant (Adam/BC/STP, DP² phase, MacAdam's bias correction) and the filters' term masks
(``filter.py``). Filter coefficients and hyper-parameters travel as fp32 bit patterns in the
int64 metadata tensor (exactly the fp32 values the C++ kernels use), so compiled kernels do not
specialise on their values. Divisions
and square roots are IEEE (``tl.div_rn``, ``tl.sqrt_rn``, as torch) and the kernels are compiled
without FMA contraction (``enable_fp_fusion=False``, as the CPU kernels), so each operation rounds
like the reference's.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .._kernel_args import ADAM as _ADAM
from .._kernel_args import DP2 as _DP2
from .._kernel_args import FAMILIES as _FAMILIES
from .._kernel_args import FILTER as _FILTER
from .._kernel_args import MACADAM as _MACADAM
from .._kernel_args import SGD as _SGD
from .common import (
    TL_DTYPES,
    VEC_BYTES,
    MetaTable,
    check_counter,
    check_device,
    device_guard,
    fp32_bits,
    is_aligned,
    load_coeff,
    round_to,
    tile,
    tile_block,
    tile_normals,
    tiles,
    typed_ptr,
)
from .filter import FILTER_BLOCK, FILTER_NUM_WARPS, filter_step, term_bits

__all__ = ["sgd_step_", "dp2_step_", "adam_step_", "macadam_step_"]

#: Elements per program and warps: those of linear_filter_ (one Philox block per GPU thread).
STEP_BLOCK = FILTER_BLOCK
STEP_NUM_WARPS = FILTER_NUM_WARPS
#: Compile options of every launch: no FMA contraction, so each product and sum rounds as in the
#: reference (tools/gpu_static_check.py compiles with the same options).
STEP_COMPILE_OPTIONS = {"enable_fp_fusion": False}

# Compile-time selectors (``tl.constexpr`` so the kernels can read them; the host passes ``.value``).
#: ``FAMILY`` values.
SGD, DP2, ADAM, MACADAM = (tl.constexpr(i) for i in range(4))
#: ``NOISE`` values: no noise, pre-drawn ``ν``, in-pass Philox noise through the noise filter.
NOISE_NONE, NOISE_GIVEN, NOISE_FILTER = (tl.constexpr(i) for i in range(3))
#: optim_math.h ``Dp2Phase::kAdaptive``, ``AdamVariant::kBC``/``kSTP``, ``MacAdamBC::kOff``/``kPaper``.
DP2_ADAPTIVE = tl.constexpr(1)
ADAM_BC, ADAM_STP = tl.constexpr(1), tl.constexpr(2)
MACADAM_BC_OFF, MACADAM_BC_PAPER = tl.constexpr(0), tl.constexpr(1)

#: The kernel's scalar-branch switches, all off (each family's launcher turns its own on).
SWITCHES_OFF = {"HAS_WD": False, "HAS_DECAY": False, "UPDATE_B": False}

#: The named hyper-parameter list of each ``FAMILY`` (dpkernels/_kernel_args.py).
_SPECS = {SGD.value: _SGD, DP2.value: _DP2, ADAM.value: _ADAM, MACADAM.value: _MACADAM}
assert list(_FAMILIES.values()) == list(_SPECS.values())
#: Slots the kernel receives as reciprocals (0 stays 0), formed in float64 on the host as the C++
#: kernels do (the spec's ``recip``/``recip0`` members): the bias corrections and MacAdam's κ_t,
#: so the element math multiplies instead of dividing (the kernel reads 1/κ in the ``kappa`` slot).
_RECIPROCAL_SLOTS = {
    fam: tuple(i for i, f in enumerate(spec.fields) if any(how.startswith("recip") for _, how in f.targets()))
    for fam, spec in _SPECS.items()
}


def _slot(spec, name: str) -> tl.constexpr:
    return tl.constexpr(spec.index(name))


# Slots of the hyper lists, from the spec (constexpr globals the kernels read).
S_INV_B, S_LR, S_WD = (_slot(_SGD, n) for n in ("inv_b", "lr", "weight_decay"))
D_INV_B, D_LR = _slot(_DP2, "inv_b"), _slot(_DP2, "lr")
# Adam and MacAdam share the moment slots (checked here).
assert all(_ADAM.index(n) == _MACADAM.index(n) for n in _ADAM.names[:8])
H_INV_B, H_LR, H_BETA1, H_OMB1, H_BETA2, H_OMB2, H_INV_BC1, H_INV_BC2 = (_slot(_ADAM, n) for n in _ADAM.names[:8])
A_INV_BC2_PREV, A_EPS, A_DECAY, A_PHI, A_GAMMA, A_EPS1 = (
    _slot(_ADAM, n) for n in ("bias2_prev", "eps", "decay", "phi", "gamma", "eps1")
)
#: The filter coefficient layout [a, g, c[K], d[K], e[K], f[K]]: the direction filter's list follows
#: the noise filter's (NK buffers) in ``coeff_bits``.
F_SCALARS, F_GROUPS = tl.constexpr(len(_FILTER.SCALARS)), tl.constexpr(len(_FILTER.GROUPS))
M_EPS, M_NOISE_VAR, M_GAMMA, M_H1, M_H2, M_INV_KAPPA, M_C_TOTAL, M_BSCALE = (
    _slot(_MACADAM, n) for n in ("eps", "noise_var", "gamma", "h1", "h2", "kappa", "c_total", "bscale")
)


# =============================================================================================
# Element math (optim_math.h): fp32 tiles in, fp32 tiles out
# =============================================================================================


@triton.jit
def _h(hyper, j):
    return load_coeff(hyper, j)


@triton.jit
def _sgd_input(hyper, S, nu, theta, HAS_WD: tl.constexpr):
    """``sgd_input``: ``x = (S + ν)·(1/B) (+ λθ)``, the direction filter's input."""
    g = (S + nu) * _h(hyper, S_INV_B)
    if HAS_WD:
        g = g + _h(hyper, S_WD) * theta
    return g


@triton.jit
def _dp2_math(hyper, S, nu, theta, G, inv_d, PHASE: tl.constexpr):
    """``dp2_step``: ``(θ', G')`` (``G`` unchanged in the adaptive phase)."""
    if PHASE == DP2_ADAPTIVE:
        g = (S * inv_d + nu) * _h(hyper, D_INV_B)
    else:
        g = (S + nu) * _h(hyper, D_INV_B)
        G = G + g
    return theta - _h(hyper, D_LR) * g, G


@triton.jit
def _moments(hyper, g, m, v):
    """``m ← β₁m + (1−β₁)g``, ``v ← β₂v + (1−β₂)g·g``; returns ``(m, v, m̂, v̂)``. Adam and MacAdam
    share the moment slots (``H_*``): β₁, 1−β₁, β₂, 1−β₂, 1/(1−β₁^t), 1/(1−β₂^t)."""
    m = _h(hyper, H_BETA1) * m + _h(hyper, H_OMB1) * g
    v = _h(hyper, H_BETA2) * v + _h(hyper, H_OMB2) * g * g
    return m, v, m * _h(hyper, H_INV_BC1), v * _h(hyper, H_INV_BC2)


@triton.jit
def _floor_sqrt(r, gamma):
    """``√clamp(r, min=γ')``; a NaN stays NaN, as in torch.clamp."""
    return tl.sqrt_rn(tl.where(r < gamma, gamma, r))


@triton.jit
def _recip(x):
    return tl.div_rn(tl.full(x.shape, 1.0, tl.float32), x)


@triton.jit
def _adam_math(hyper, S, nu, theta, m, v, VARIANT: tl.constexpr, HAS_DECAY: tl.constexpr):
    """``adam_step``: ``(θ', m', v', scale')`` (``scale'`` is STP's next clip scale; other variants
    return ``v'`` in its place, unused).

    hyper: the ``ADAM`` fields of dpkernels/_kernel_args.py, bias corrections as reciprocals."""
    if VARIANT == ADAM_STP:
        # Noise in the scaled space, un-scaled by √v̂_{t−1} + ε₁ (v̂_0 = 0: 1/(1−β₂^0) is sent as 0).
        nu = (tl.sqrt_rn(v * _h(hyper, A_INV_BC2_PREV)) + _h(hyper, A_EPS1)) * nu
    m, v, m_hat, v_hat = _moments(hyper, (S + nu) * _h(hyper, H_INV_B), m, v)
    if VARIANT == ADAM_BC:
        denom = _floor_sqrt(v_hat - _h(hyper, A_PHI), _h(hyper, A_GAMMA))
    else:
        denom = tl.sqrt_rn(v_hat) + _h(hyper, A_EPS)
    scale = v
    if VARIANT == ADAM_STP:
        scale = _recip(tl.sqrt_rn(v_hat) + _h(hyper, A_EPS1))
    if HAS_DECAY:
        theta = theta * _h(hyper, A_DECAY)
    return theta - tl.div_rn(_h(hyper, H_LR) * m_hat, denom), m, v, scale


@triton.jit
def _macadam_math(hyper, S, nu, theta, m, v, s, b_u, inv_bu, shift, BC: tl.constexpr, UPDATE_B: tl.constexpr):
    """``macadam_step``: ``(θ', m', v', s', b_u', inv_bu', shift', √ŝ)`` (``√ŝ`` = 0, ``b_u`` and
    ``inv_bu`` unchanged without the ``b`` update, κ = 0).

    hyper: the ``MACADAM`` fields of dpkernels/_kernel_args.py, bias corrections and κ as reciprocals."""
    b = b_u * _h(hyper, M_BSCALE)  # b_{t−1}
    mh = shift  # m̂_{t−1}
    g = ((S - _h(hyper, M_C_TOTAL) * mh) + b * nu) * _h(hyper, H_INV_B) + mh
    m, v, m_hat, v_hat = _moments(hyper, g, m, v)
    if BC == MACADAM_BC_OFF:
        denom = tl.sqrt_rn(v_hat) + _h(hyper, M_EPS)
    else:
        var = _h(hyper, M_NOISE_VAR)
        phi = tl.zeros_like(b) + var if BC == MACADAM_BC_PAPER else b * b * var
        denom = _floor_sqrt(v_hat - phi, _h(hyper, M_GAMMA))
    theta = theta - tl.div_rn(_h(hyper, H_LR) * m_hat, denom)
    dev = g - m_hat
    s = _h(hyper, H_BETA1) * s + _h(hyper, H_OMB1) * (dev * dev)
    sqrt_s_hat = tl.zeros_like(s)
    if UPDATE_B:
        s_hat = s * _h(hyper, M_INV_KAPPA) - b * b * _h(hyper, M_NOISE_VAR)
        s_hat = tl.where(s_hat < _h(hyper, M_H1), _h(hyper, M_H1), s_hat)  # torch.clamp: a NaN stays NaN
        s_hat = tl.where(s_hat > _h(hyper, M_H2), _h(hyper, M_H2), s_hat)
        sqrt_s_hat = tl.sqrt_rn(s_hat)
        b_u = tl.sqrt_rn(sqrt_s_hat)
        inv_bu = _recip(b_u)
    return theta, m, v, s, b_u, inv_bu, m_hat, sqrt_s_hat


# =============================================================================================
# Kernel
# =============================================================================================


@triton.jit
def _state(state_ptrs, k, T, t, idx, mask, ALIGNED: tl.constexpr):
    """Pointer to and value of fp32 state buffer ``k`` of slot ``t`` (buffer-major table)."""
    p = typed_ptr(state_ptrs, k * T + t, tl.float32, ALIGNED) + idx
    return p, tl.load(p, mask=mask, other=0.0)


@triton.jit
def _step_kernel(
    param_ptrs,
    sum_ptrs,
    state_ptrs,
    past_ptrs,
    noise_ptrs,
    noise_state_ptrs,
    numels,
    bases,
    tile_slot,
    tile_start,
    key,
    coeff_bits,
    hyper,
    partial_ptr,
    std,
    T,
    FAMILY: tl.constexpr,
    VARIANT: tl.constexpr,
    HAS_WD: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    UPDATE_B: tl.constexpr,
    NOISE: tl.constexpr,
    NK: tl.constexpr,
    NC_BITS: tl.constexpr,
    ND_BITS: tl.constexpr,
    NE_BITS: tl.constexpr,
    NF_BITS: tl.constexpr,
    NW_BITS: tl.constexpr,
    N_HAS_A: tl.constexpr,
    DK: tl.constexpr,
    DC_BITS: tl.constexpr,
    DD_BITS: tl.constexpr,
    DE_BITS: tl.constexpr,
    DF_BITS: tl.constexpr,
    DW_BITS: tl.constexpr,
    D_HAS_A: tl.constexpr,
    HAS_PAST: tl.constexpr,
    ELEM: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
    VEC: tl.constexpr,
):
    """One tile of ``BLOCK`` elements of parameter slot ``t`` (grid ``(num_tiles,)``).

    Tables (int64, as ``filter._filter_kernel``): ``param_ptrs``/``sum_ptrs``/``past_ptrs``/``noise_ptrs``
    ``[T]`` (``ELEM`` parameters and past iterates, fp32 sums and pre-drawn noise), ``state_ptrs``
    (the family's fp32 buffers, sgd: the ``DK`` direction buffers) and ``noise_state_ptrs`` (``NK``
    buffers), buffer ``k`` of slot ``t`` at ``k·T + t``; ``numels``/``bases``/``tile_slot``/``tile_start``/
    ``key`` as in ``filter._filter_kernel``. ``coeff_bits``: fp32 bits of the noise filter's
    ``[a, g, c.., d.., e.., f..]`` then (sgd) the direction filter's; ``hyper``: fp32 bits of the
    family's hyper-parameters (optim_math.h struct order). ``partial_ptr`` (macadam with ``b``
    update): float64 ``[num_tiles]``, this tile's ``Σ√ŝ``. ``N*``/``D*`` constexprs: the noise and
    direction filters' buffer counts and term masks (``filter.filter_step``).
    """
    t, start, idx, mask = tile(tile_slot, tile_start, numels, ALIGNED, VEC, BLOCK)
    if NOISE == NOISE_GIVEN:
        nu = tl.load(typed_ptr(noise_ptrs, t, tl.float32, ALIGNED) + idx, mask=mask, other=0.0)
    elif NOISE == NOISE_FILTER:
        z = tile_normals(bases, t, start, key, BLOCK)
        nu = std * filter_step(z, noise_state_ptrs, T, t, idx, mask, coeff_bits, 0, NK, NC_BITS, ND_BITS, NE_BITS,
                               NF_BITS, NW_BITS, N_HAS_A, ALIGNED)  # fmt: skip
    else:
        nu = tl.zeros([BLOCK], dtype=tl.float32)
    S = tl.load(typed_ptr(sum_ptrs, t, tl.float32, ALIGNED) + idx, mask=mask, other=0.0)
    p_theta = typed_ptr(param_ptrs, t, ELEM, ALIGNED) + idx
    theta_stored = tl.load(p_theta, mask=mask, other=0.0)
    theta = theta_stored.to(tl.float32)

    if FAMILY == SGD:
        if HAS_PAST:
            tl.store(typed_ptr(past_ptrs, t, ELEM, ALIGNED) + idx, theta_stored, mask=mask)
        x = _sgd_input(hyper, S, nu, theta, HAS_WD)
        d = filter_step(x, state_ptrs, T, t, idx, mask, coeff_bits, F_SCALARS + F_GROUPS * NK, DK, DC_BITS, DD_BITS,
                        DE_BITS, DF_BITS, DW_BITS, D_HAS_A, ALIGNED)  # fmt: skip
        theta = theta - _h(hyper, S_LR) * d
    elif FAMILY == DP2:
        p_G, G = _state(state_ptrs, 0, T, t, idx, mask, ALIGNED)
        if VARIANT == DP2_ADAPTIVE:
            inv_d = tl.load(typed_ptr(state_ptrs, T + t, tl.float32, ALIGNED) + idx, mask=mask, other=0.0)
        else:
            inv_d = G  # not read in the SGD phase
        theta, G = _dp2_math(hyper, S, nu, theta, G, inv_d, VARIANT)
        if VARIANT != DP2_ADAPTIVE:
            tl.store(p_G, G, mask=mask)
    elif FAMILY == ADAM:
        p_m, m = _state(state_ptrs, 0, T, t, idx, mask, ALIGNED)
        p_v, v = _state(state_ptrs, 1, T, t, idx, mask, ALIGNED)
        theta, m, v, scale = _adam_math(hyper, S, nu, theta, m, v, VARIANT, HAS_DECAY)
        tl.store(p_m, m, mask=mask)
        tl.store(p_v, v, mask=mask)
        if VARIANT == ADAM_STP:
            tl.store(typed_ptr(state_ptrs, 2 * T + t, tl.float32, ALIGNED) + idx, scale, mask=mask)
    else:
        p_m, m = _state(state_ptrs, 0, T, t, idx, mask, ALIGNED)
        p_v, v = _state(state_ptrs, 1, T, t, idx, mask, ALIGNED)
        p_s, s = _state(state_ptrs, 2, T, t, idx, mask, ALIGNED)
        p_b, b_u = _state(state_ptrs, 3, T, t, idx, mask, ALIGNED)
        p_shift, shift = _state(state_ptrs, 5, T, t, idx, mask, ALIGNED)
        # inv_bu is only written (with the b update).
        theta, m, v, s, b_u, inv_bu, shift, sqrt_s_hat = _macadam_math(
            hyper, S, nu, theta, m, v, s, b_u, b_u, shift, VARIANT, UPDATE_B
        )
        tl.store(p_m, m, mask=mask)
        tl.store(p_v, v, mask=mask)
        tl.store(p_s, s, mask=mask)
        tl.store(p_shift, shift, mask=mask)
        if UPDATE_B:
            tl.store(p_b, b_u, mask=mask)
            tl.store(typed_ptr(state_ptrs, 4 * T + t, tl.float32, ALIGNED) + idx, inv_bu, mask=mask)
            partial = tl.sum(tl.where(mask, sqrt_s_hat, 0.0).to(tl.float64), axis=0)
            tl.store(partial_ptr + tl.program_id(0), partial)
    tl.store(p_theta, round_to(theta, ELEM), mask=mask)


# =============================================================================================
# Host side
# =============================================================================================


def _f32(x: float) -> float:
    """``x`` rounded to fp32, the value the kernel sees (flags test it as the C++ kernels do)."""
    return struct.unpack("<f", struct.pack("<f", float(x)))[0]


def _filter_consts(coeffs: Sequence[float], prefix: str) -> dict:
    """The term masks of filter coefficients ``[a, g, c.., d.., e.., f..]`` (``filter.filter_step``)."""
    co = _FILTER.split(list(coeffs))
    K, c, d, e, f = len(co["c"]), co["c"], co["d"], co["e"], co["f"]
    w = [0.0 if (d[k], e[k], f[k]) == (1.0, 0.0, 0.0) else 1.0 for k in range(K)]
    bits = {"C": c, "D": d, "E": e, "F": f, "W": w}
    masks = {f"{prefix}{n}_BITS": term_bits(v) for n, v in bits.items()}
    return {f"{prefix}K": K, f"{prefix}_HAS_A": coeffs[0] != 0, **masks}


def _check_filter_coeffs(coeffs: Sequence[float], what: str) -> int:
    coeffs = [float(c) for c in coeffs]
    if len(coeffs) < 2 or (len(coeffs) - 2) % 4:
        raise ValueError(f"{what} must hold 2 + 4K values [a, g, c.., d.., e.., f..], got {len(coeffs)}")
    for i, c in enumerate(coeffs):
        if not math.isfinite(c):
            raise ValueError(f"{what}[{i}] is not finite: {c}")
    return _FILTER.buffers(len(coeffs))


def _check_list(tensors, what: str, count: int, numels: Sequence[int], fp32: bool, device, L: int) -> None:
    if len(tensors) != count:
        raise ValueError(f"{what} must hold {count} tensors" + (" (buffer-major)" if count > L else "") +
                         f", got {len(tensors)}")  # fmt: skip
    for i, x in enumerate(tensors):
        if x.device != device:
            raise ValueError(f"{what}[{i}] is on {x.device}, expected {device}")
        if not x.is_contiguous():
            raise ValueError(f"{what}[{i}] must be contiguous")
        if x.numel() != numels[i % L]:
            raise ValueError(f"{what}[{i}] has {x.numel()} elements, expected {numels[i % L]}")
        if fp32 and x.dtype != torch.float32:
            raise TypeError(f"{what}[{i}] has dtype {x.dtype}; expected float32")
        if not fp32 and x.dtype not in TL_DTYPES:
            raise TypeError(f"{what}[{i}] has dtype {x.dtype}; supported: float32, float16, bfloat16")


def _step(
    family: int,
    params: Sequence[torch.Tensor],
    sums: Sequence[torch.Tensor],
    state: Sequence[torch.Tensor],
    n_state: int,
    noise: Sequence[torch.Tensor],
    noise_state: Sequence[torch.Tensor],
    noise_coeffs: Sequence[float],
    noise_std: float,
    seed: int,
    step: int,
    stream: int,
    offset: int,
    hyper: Sequence[float],
    *,
    variant: int = 0,
    flags: dict | None = None,
    dir_coeffs: Sequence[float] = (),
    past: Sequence[torch.Tensor] = (),
) -> torch.Tensor | None:
    """Validate (as ``optim_layout.h``'s ``check_step_inputs``), group and launch; ``flags``: the
    kernel's ``HAS_*``/``UPDATE_B`` switches that are on. Returns the float64 ``Σ√ŝ`` for macadam
    with ``UPDATE_B``, else None."""
    params, sums, state, noise, noise_state, past = map(list, (params, sums, state, noise, noise_state, past))
    L = len(params)
    if not L:
        raise ValueError("params must not be empty")
    device = params[0].device
    check_device(device)
    noise_std = float(noise_std)
    if not math.isfinite(noise_std) or noise_std < 0:
        raise ValueError(f"noise_std must be finite and >= 0, got {noise_std}")
    numels = [p.numel() for p in params]
    NK = _check_filter_coeffs(noise_coeffs, "noise_coeffs")
    if noise and NK:
        raise ValueError("pre-drawn noise cannot be combined with noise buffers")
    _check_list(params, "params", L, numels, False, device, L)
    _check_list(sums, "sums", L, numels, True, device, L)
    _check_list(state, "state", n_state * L, numels, True, device, L)
    if noise:
        _check_list(noise, "noise", L, numels, True, device, L)
    _check_list(noise_state, "noise_state", NK * L, numels, True, device, L)
    if past:
        _check_list(past, "past", L, numels, False, device, L)
        for i, (q, p) in enumerate(zip(past, params, strict=True)):
            if q.dtype != p.dtype:
                raise TypeError(f"past[{i}] has dtype {q.dtype}; expected the parameter's {p.dtype}")
    hyper = [float(h) for h in hyper]
    for i, h in enumerate(hyper):
        if not math.isfinite(h):
            raise ValueError(f"hyper[{i}] is not finite")
    for j in _RECIPROCAL_SLOTS.get(family, ()):
        hyper[j] = 1.0 / hyper[j] if hyper[j] else 0.0
    counter = check_counter(int(seed) & (2**64 - 1), step, stream, offset)  # the seed's 64 bits, unsigned
    mode = NOISE_GIVEN.value if noise else NOISE_FILTER.value if (noise_std > 0 or NK) else NOISE_NONE.value

    groups: dict[tuple[torch.dtype, bool], list[tuple[int, int]]] = {}
    base = offset
    for p in range(L):
        n = numels[p]
        if n:
            lists = [params, sums, past, noise]
            tensors = [x[p] for x in lists if x] + state[p::L] + noise_state[p::L]
            key = (params[p].dtype, is_aligned(tensors, n, params[p].element_size(), base))
            groups.setdefault(key, []).append((p, base))
        base += n
    flags = {**SWITCHES_OFF, **(flags or {})}
    update_b = flags["UPDATE_B"]
    if not groups:
        return torch.zeros((), dtype=torch.float64, device=device) if update_b else None
    block = tile_block(STEP_BLOCK)
    meta = MetaTable()
    key_h = meta.add(counter)
    coeff_h = meta.add(fp32_bits([*noise_coeffs, *dir_coeffs]))
    hyper_h = meta.add(fp32_bits(hyper))
    launches, total_tiles = [], 0
    for (dtype, aligned), members in groups.items():
        slots = [p for p, _ in members]
        tile_slot, tile_start = tiles([numels[p] for p in slots], [b for _, b in members], block)
        zeros = [0] * len(slots)

        def table(tensors, k_count=1, slots=slots, zeros=zeros):
            if not tensors:
                return meta.add(zeros)
            return meta.add([tensors[k * L + p].data_ptr() for k in range(k_count) for p in slots] or [0])

        handles = (
            table(params),
            table(sums),
            table(state, n_state) if n_state else meta.add([0]),
            table(past),
            table(noise),
            table(noise_state, NK) if NK else meta.add([0]),
            meta.add([numels[p] for p in slots]),
            meta.add([b for _, b in members]),
            meta.add(tile_slot),
            meta.add(tile_start),
        )
        launches.append((dtype, aligned, len(slots), handles, total_tiles, tile_slot.numel()))
        total_tiles += tile_slot.numel()
    meta.finish(device)
    partial = torch.empty(total_tiles if update_b else 1, dtype=torch.float64, device=device)
    consts = dict(
        FAMILY=family, VARIANT=variant, **flags, NOISE=mode, **_filter_consts(noise_coeffs, "N"),
        **_filter_consts(dir_coeffs if dir_coeffs else [1.0, 1.0], "D"), HAS_PAST=bool(past),
    )  # fmt: skip
    with device_guard(device):
        for dtype, aligned, n_slots, h, first_tile, n_tiles in launches:
            _step_kernel[(n_tiles,)](
                *(meta[x] for x in h), meta[key_h], meta[coeff_h], meta[hyper_h],
                partial[first_tile:] if update_b else partial, noise_std, n_slots, **consts,
                ELEM=TL_DTYPES[dtype], BLOCK=block, ALIGNED=aligned, VEC=VEC_BYTES // dtype.itemsize,
                num_warps=STEP_NUM_WARPS, **STEP_COMPILE_OPTIONS,
            )  # fmt: skip
    # Fixed order (tile order of the launches), whatever the thread count: deterministic.
    return partial.sum() if update_b else None


# =============================================================================================
# Host functions (called by dpkernels/optim.py; positional signatures of csrc/ops.cpp)
# =============================================================================================


def _check_hyper(hyper: Sequence[float], family: int) -> dict:
    """The named fields of ``hyper`` (count, finiteness and integer fields checked by the spec)."""
    return _SPECS[family].unpack(hyper)


def sgd_step_(params, sums, state, dir_coeffs, past, noise, noise_state, noise_coeffs, noise_std, seed, step, stream,
              offset, hyper) -> None:  # fmt: skip
    """DP-SGD / PSAC / PMLF step: ``d = g·filter(g̃ + λθ)`` over the ``K_d`` direction buffers
    ``state`` (``dir_coeffs``), ``past[l] ← θ`` (old value) when given, ``θ ← θ − η d``.
    hyper: the ``SGD`` fields of dpkernels/_kernel_args.py."""
    h = _check_hyper(hyper, SGD.value)
    K_d = _check_filter_coeffs(dir_coeffs, "dir_coeffs")
    noise_args = (noise, noise_state, noise_coeffs, noise_std, seed, step, stream, offset, hyper)
    flags = {"HAS_WD": _f32(h["weight_decay"]) != 0}
    _step(SGD.value, params, sums, state, K_d, *noise_args, flags=flags, dir_coeffs=list(dir_coeffs), past=past)


def dp2_step_(params, sums, state, noise, noise_state, noise_coeffs, noise_std, seed, step, stream, offset,
              hyper) -> None:  # fmt: skip
    """DP² step; ``state = [G, inv_d]``; hyper: the ``DP2`` fields (phase 0: SGD, 1: adaptive)."""
    phase = _check_hyper(hyper, DP2.value)["phase"]
    _step(DP2.value, params, sums, state, 2, noise, noise_state, noise_coeffs, noise_std, seed, step, stream, offset,
          hyper, variant=phase)  # fmt: skip


def adam_step_(params, sums, state, noise, noise_state, noise_coeffs, noise_std, seed, step, stream, offset,
               hyper) -> None:  # fmt: skip
    """DP-Adam(W) / AdamBC / STP step; ``state = [m, v]`` (+ ``scale`` for STP); hyper: the ``ADAM``
    fields of dpkernels/_kernel_args.py (``variant`` 0/1/2)."""
    h = _check_hyper(hyper, ADAM.value)
    variant = h["variant"]
    flags = {"HAS_DECAY": _f32(h["decay"]) != 1}
    noise_args = (noise, noise_state, noise_coeffs, noise_std, seed, step, stream, offset, hyper)
    n_state = 3 if variant == ADAM_STP.value else 2
    _step(ADAM.value, params, sums, state, n_state, *noise_args, variant=variant, flags=flags)


def macadam_step_(params, sums, state, noise, noise_state, noise_coeffs, noise_std, seed, step, stream, offset,
                  hyper) -> torch.Tensor:  # fmt: skip
    """DP-MacAdam(-BC) step; ``state = [m, v, s, b_u, inv_bu, shift]``; hyper: the
    ``MACADAM`` fields of dpkernels/_kernel_args.py (``bc`` 0/1/2). Returns ``Σ√ŝ`` over every element
    as a float64 scalar tensor (0 when κ = 0)."""
    h = _check_hyper(hyper, MACADAM.value)
    bc = h["bc"]
    update_b = _f32(h["kappa"]) != 0
    noise_args = (noise, noise_state, noise_coeffs, noise_std, seed, step, stream, offset, hyper)
    total = _step(MACADAM.value, params, sums, state, 6, *noise_args, variant=bc, flags={"UPDATE_B": update_b})
    return total if update_b else torch.zeros((), dtype=torch.float64, device=params[0].device)
