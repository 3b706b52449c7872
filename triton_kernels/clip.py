"""Triton kernels for per-sample clipping: norms, clip weights and the clipped sum.

The three stages of per-sample clipping (docs/ALGORITHMS.md, "Per-sample clipping"), with the
signatures and semantics of ``dpkernels/reference/clip.py`` (the ground truth):

1. ``per_sample_sumsq``: ``s_il = Σ_e ((Σ_j α_j g_i^(j,l) − shift^(l)) ⊙ scale^(l))_e²``, fp64 ``[B, L]``.
2. ``clip_factors``:     ``c = f(n)`` for the clip, auto_s, auto_v and psac modes.
3. ``weighted_sum``:     ``S^(l) = Σ_i w_il Σ_j α_j g_i^(j,l)``, fp32, one tensor per parameter.

Notation: ``g^(j,l)`` is the per-sample gradient ``[B, *param_shape]`` of parameter tensor ``l``
(``L`` of them) in gradient set ``j`` (``k`` sets; DP-PMLF per-sample momentum combines them
with ``α``; ``k = 1``, ``α = [1]`` otherwise). ``shift``/``scale`` come from DP-MacAdam and
scale-then-privatize; they only enter the norm.

Launch structure (multi-tensor apply, ``common.py``): tensors are grouped by storage dtype and by
whether every row of every tensor in the group starts on a 16-byte boundary. Each group is one
launch over a *chunk table*: the tile table of ``common.py`` with tiles (chunks) that start at
each tensor's element 0, one entry per ``BLOCK`` elements of one tensor, carrying the tensor's
slot and the chunk's first element. Data pointers travel in an int64 table and are cast to typed
pointers inside the kernel, so a model with hundreds of parameter tensors still costs a handful
of launches. All tables of one host call are packed into a single int64 tensor, so one
host-to-device copy carries them.

Numerics: inputs are loaded in their storage dtype and converted to fp32 before any arithmetic
(the interpreter silently miscomputes bf16 arithmetic, and fp32 is the reference's compute
dtype). Squares are formed and summed in fp64, so a norm is exact to fp32 rounding and cannot
overflow. The norm reduction is deterministic: per-(sample, chunk) fp64 partials are reduced in
a fixed order by a second kernel, never with atomics.

Runs compiled on CUDA tensors, or on CPU tensors under the Triton interpreter
(``TRITON_INTERPRET=1`` set before this module is imported).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .chacha import box_muller64, chacha20_block
from .common import (
    TL_DTYPES,
    VEC_BYTES,
    Group,
    MetaTable,
    check_device,
    device_guard,
    fp32_bits,
    group_tensors,
    load_coeff,
    tile_span,
    tiles,
    typed_ptr,
)
from .philox import MASK32, box_muller, philox4x32_10

#: Epilogues of the weighted-sum kernel: S, S·scale, (S + pre-drawn ν)·scale, (S + std·z)·scale.
EPI_NONE, EPI_SCALE, EPI_NOISE, EPI_PHILOX = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2), tl.constexpr(3)
EPI_CHACHA = tl.constexpr(4)

# ---------------------------------------------------------------------------------------------
# Launch constants. Element counts are multiples of 8, so a block splits into whole 128-bit
# vectors for fp32 (4 per vector) and 16-bit dtypes (8 per vector).
# ---------------------------------------------------------------------------------------------

#: Elements of one tensor per program of the norm kernel (one ``[B, num_chunks]`` fp64 partial
#: each). Large enough that the partial buffer is 2/SUMSQ_BLOCK of the gradient bytes and each
#: GPU thread has several 128-bit loads in flight; the interpreter pays per program, not per
#: element, so a big block is cheap there too.
SUMSQ_BLOCK = 4096
SUMSQ_NUM_WARPS = 8
#: Partials reduced per step by the segment kernel (a tensor's chunk count is usually small).
SEGMENT_BLOCK = 128
#: Norms per program of the clip-factor kernel.
CLIP_BLOCK = 1024
#: Columns per program of the weighted-sum kernel; each program walks all B rows.
WSUM_BLOCK = 1024
WSUM_NUM_WARPS = 4
#: Rows of the weighted sum loaded before they are accumulated, to keep more loads in flight.
WSUM_ROWS = 4

# CUDA caps grid dimensions 1 and 2 at 65535; larger batches are launched in row slices.
_MAX_GRID_Y = 65535

_MODE_IDS = {"clip": 0, "auto_s": 1, "auto_v": 2, "psac": 3}

# Mirrors dpkernels/reference/clip.py; the kernel materialises them in fp64 with
# tl.full, because a bare float literal is rounded to fp32 in comparisons and selects.
CLIP_EPS = tl.constexpr(1e-6)
AUTO_V_MIN_NORM = tl.constexpr(1e-12)


# =============================================================================================
# Kernels
# =============================================================================================


@triton.jit
def _per_sample_sumsq_kernel(
    grad_ptrs,
    shift_ptrs,
    scale_ptrs,
    coeff_bits,
    numels,
    chunk_slot,
    chunk_start,
    partial_ptr,
    n_cols,
    col0,
    row0,
    T,
    K: tl.constexpr,
    HAS_SHIFT: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    ELEM: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
    VEC: tl.constexpr,
):
    """``partial[i, col0 + c] = Σ_{e in chunk c} (((Σ_j α_j g_i^(j,t)[e]) − shift_e) · scale_e)²``.

    Grid ``(num_chunks, rows)``; program ``(c, i)`` reads chunk ``c`` of sample ``row0 + i``.
    ``grad_ptrs``: int64 ``[K·T]``, address of tensor ``t`` of set ``j`` at ``j·T + t`` (each a
    contiguous ``[B, numels[t]]`` of dtype ``ELEM``); ``shift_ptrs``/``scale_ptrs``: int64 ``[T]``
    fp32 addresses; ``chunk_slot``/``chunk_start``: int64 ``[num_chunks]``; ``partial_ptr``: fp64
    ``[B, n_cols]``. The combination and shift/scale are fp32; squares and their sum are fp64.
    ``ALIGNED``: every address is 16-byte aligned and every ``numels[t]`` a multiple of ``VEC``
    (elements per 128-bit vector), so rows start aligned and loads can be vectorised.
    """
    c = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1).to(tl.int64) + row0
    t, start, n, idx = tile_span(chunk_slot, chunk_start, numels, ALIGNED, VEC, BLOCK)
    mask = idx < n
    offs = i * n + idx

    v = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(K):
        g = tl.load(typed_ptr(grad_ptrs, j * T + t, ELEM, ALIGNED) + offs, mask=mask, other=0.0)
        g = g.to(tl.float32)
        v += load_coeff(coeff_bits, j) * g
    if HAS_SHIFT:
        v -= tl.load(typed_ptr(shift_ptrs, t, tl.float32, ALIGNED) + idx, mask=mask, other=0.0)
    if HAS_SCALE:
        v *= tl.load(typed_ptr(scale_ptrs, t, tl.float32, ALIGNED) + idx, mask=mask, other=0.0)
    # Masked lanes are exactly 0 here (0 loads, 0 shift, 0 scale), so they add nothing.
    v64 = v.to(tl.float64)
    tl.store(partial_ptr + i * n_cols + col0 + c, tl.sum(v64 * v64, axis=0))


@triton.jit
def _segment_sum_kernel(partial_ptr, n_cols, seg_first, seg_count, out_ptr, L, BLOCK: tl.constexpr):
    """``out[i, l] = Σ_{c < seg_count[l]} partial[i, seg_first[l] + c]``, fp64, fixed order.

    Grid ``(B·L,)`` flattened (no 65535 cap on either dimension); ``partial_ptr``: fp64
    ``[B, n_cols]``; ``seg_first``/``seg_count``: int64 ``[L]``; ``out_ptr``: fp64 ``[B, L]``. A
    tensor's chunks are contiguous columns, so this is a segmented row sum. A tensor with no
    elements has no chunks and gets 0.
    """
    pid = tl.program_id(0).to(tl.int64)
    i = pid // L
    l = pid % L  # noqa: E741
    first = tl.load(seg_first + l)
    count = tl.load(seg_count + l)
    row = partial_ptr + i * n_cols + first
    acc = tl.zeros([BLOCK], dtype=tl.float64)
    c0 = 0
    while c0 < count:  # not range(0, count, BLOCK): see _weighted_sum_kernel
        cols = c0 + tl.arange(0, BLOCK)
        acc += tl.load(row + cols, mask=cols < count, other=0.0)
        c0 += BLOCK
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


@triton.jit
def _round_weights(w):
    """fp64 weights as fp32 rounded toward zero, saturating at the fp32 maximum (NaN stays NaN):
    the rule of ``round_weights`` in dpkernels/reference/clip.py, which says why."""
    f = w.to(tl.float32)
    up = (tl.abs(f.to(tl.float64)) > tl.abs(w)) | (tl.abs(w) == float("inf"))
    # One step toward zero from a nonzero float: its bit pattern minus one (sign-magnitude).
    return tl.where(up, (f.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True), f)


@triton.jit
def _clip_factors_kernel(norms_ptr, params_ptr, out_ptr, N, L_C, MODE: tl.constexpr, BLOCK: tl.constexpr):
    """``out[e] = f(norms[e])`` elementwise, evaluated in fp64 whatever the dtype of ``norms``.

    ``params_ptr``: ``[r, C_0, .., C_{L_C-1}]`` (fp64, so that ``C`` is not rounded to fp32);
    element ``e`` uses ``C_{e mod L_C}`` (``L_C = 1`` for one threshold, ``L`` for per-layer
    thresholds on ``[B, L]`` norms). ``MODE``: 0 clip ``min(1, C/(n + 1e-6))``, 1 auto_s
    ``C/(n + r)``, 2 auto_v ``C/max(n, 1e-12)``, 3 psac ``C/(n + r/(n + r))``. An fp32 ``out`` gets
    the weight rounded toward zero (:func:`_round_weights`). A NaN norm gives a NaN weight in
    every mode (the selects below pass NaN through, like torch.clamp). fp64 ``/`` is IEEE
    division (div.rn.f64), as in torch and the C++ kernels.
    """
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    n = tl.load(norms_ptr + offs, mask=mask, other=1.0).to(tl.float64)
    C = tl.load(params_ptr + 1 + offs % L_C, mask=mask, other=1.0).to(tl.float64)
    r = tl.load(params_ptr).to(tl.float64)
    if MODE == 0:
        w = C / (n + tl.full([], CLIP_EPS, tl.float64))
        w = tl.where(w > 1, tl.full([], 1.0, tl.float64), w)
    elif MODE == 1:
        w = C / (n + r)
    elif MODE == 2:
        floor = tl.full([], AUTO_V_MIN_NORM, tl.float64)
        w = C / tl.where(n < floor, floor, n)
    else:
        w = C / (n + r / (n + r))
    if out_ptr.dtype.element_ty == tl.float32:
        tl.store(out_ptr + offs, _round_weights(w), mask=mask)
    else:
        tl.store(out_ptr + offs, w, mask=mask)


@triton.jit
def _philox_at(blk, c2, c3, key):
    """The four Philox words of the int64 block counters ``blk`` (``c2``/``c3``: the step and stream
    words, already broadcast; ``key``: the int64 key table, seed low and high first)."""
    c0 = (blk & MASK32).to(tl.uint32)
    c1 = (blk >> 32).to(tl.uint32)
    return philox4x32_10(c0, c1, c2, c3, tl.load(key), tl.load(key + 1))


@triton.jit
def _chunk_normals(bases, t, start, key, BLOCK: tl.constexpr, W: tl.constexpr):
    """The Philox normals ``z(g)`` of the chunk's ``BLOCK`` global elements ``g = bases[t] + start +
    [0, BLOCK)``, in element order; ``start`` a multiple of 4, ``key`` = int64 (seed low, seed high,
    step, stream).

    Element ``g`` takes word ``g % 4`` of Philox block ``g // 4`` (docs/RNG.md), and a chunk starts
    at any global offset. ``W``: the run of consecutive elements one GPU thread holds (the vector
    width of an aligned launch: 4 or 8; 1 unaligned). ``W = 1``: one Philox call per element.
    Otherwise the chunk is viewed as ``[BLOCK/W, W]`` rows, which map onto threads as the chunk
    does: row ``r`` starts on a local multiple of 4 and spans the ``W/4 + 1`` blocks
    ``(g_0 >> 2) + r·W/4 + j``, element ``e`` sitting at position ``q = (g_0 & 3) + e`` of their
    words. One Philox call per block of a row instead of one per element: 1/2 of the generator work
    for ``W = 4``, 3/8 for ``W = 8``, and far fewer live registers (no spills on sm_80/sm_90 with
    Triton 3.6 or 3.8). Every element still gets the words, Box-Muller pair and output of the
    per-element stream, bit for bit.
    """
    g0 = tl.load(bases + t) + start
    if W == 1:
        g = g0 + tl.arange(0, BLOCK)
        zero = tl.zeros([BLOCK], dtype=tl.uint32)
        w0, w1, w2, w3 = _philox_at(
            g >> 2, zero + tl.load(key + 2).to(tl.uint32), zero + tl.load(key + 3).to(tl.uint32), key
        )
        q = (g & 3).to(tl.int32)
        low = (q & 2) == 0  # words 0, 1 (the first Box-Muller pair) or 2, 3
        u = tl.where(low, w0, w2)
        v = tl.where(low, w1, w3)
    else:
        R: tl.constexpr = BLOCK // W
        blk = (g0 >> 2) + (W // 4) * tl.arange(0, R)[:, None]  # [R, 1]: the first block of each row
        zero = tl.zeros([R, 1], dtype=tl.uint32)
        c2 = zero + tl.load(key + 2).to(tl.uint32)
        c3 = zero + tl.load(key + 3).to(tl.uint32)
        q = (g0 & 3).to(tl.int32) + tl.arange(0, W)[None, :]  # [1, W]
        low = (q & 2) == 0
        for j in tl.static_range(W // 4 + 1):
            w0, w1, w2, w3 = _philox_at(blk + j, c2, c3, key)
            if j == 0:
                u = tl.where(low, w0, w2)
                v = tl.where(low, w1, w3)
            else:
                here = (q >> 2) == j
                u = tl.where(here, tl.where(low, w0, w2), u)
                v = tl.where(here, tl.where(low, w1, w3), v)
    z_first, z_second = box_muller(u, v)
    return tl.reshape(tl.where((q & 1) == 1, z_second, z_first), [BLOCK])


@triton.jit
def _weighted_sum_kernel(
    grad_ptrs,
    out_ptrs,
    coeff_bits,
    numels,
    layer_ids,
    chunk_slot,
    chunk_start,
    weights_ptr,
    w_stride_b,
    w_stride_l,
    B,
    T,
    K: tl.constexpr,
    ELEM: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    ALIGNED: tl.constexpr,
    VEC: tl.constexpr,
    bases,
    noise_ptrs,
    key,
    std,
    scale,
    EPILOGUE: tl.constexpr,
):
    """``S^(t)[e] = Σ_{i : w_il ≠ 0} w_il · Σ_j α_j g_i^(j,t)[e]`` over one chunk of columns.

    ``EPILOGUE`` (privatized_sum, docs/ALGORITHMS.md "The private gradient": the noise is made in
    the pass that writes the result): ``EPI_NONE`` stores ``S``; ``EPI_SCALE`` stores ``S·scale``;
    ``EPI_NOISE`` stores ``(S + ν)·scale`` with ``ν`` read from ``noise_ptrs[t]`` (fp32, pre-drawn);
    ``EPI_PHILOX`` stores ``(S + std·z(g))·scale`` with ``g = bases[t] + e`` the global element
    index and ``key`` = int64 (seed low, seed high, step, stream); ``EPI_CHACHA`` (secure mode,
    docs/RNG.md §6) stores ``fp32(S + std·z(g))·scale`` with the float64 ChaCha20 normal ``z``, the
    sum formed in float64, ``key`` = int64 (eight key words, step, stream, bits of the float64
    ``std``).

    Grid ``(num_chunks,)``; each program walks all ``B`` rows of its chunk, accumulates in fp32
    and stores once (no atomics, deterministic). ``grad_ptrs``: int64 ``[K·T]`` as in
    ``_per_sample_sumsq_kernel``; ``out_ptrs``: int64 ``[T]`` fp32 outputs of ``numels[t]``
    elements; ``layer_ids``: int64 ``[T]``, the column ``l`` of tensor ``t`` in ``weights``
    (``w_il`` at ``i·w_stride_b + l·w_stride_l``). A zero weight is skipped, not multiplied, so a
    dropped sample with a NaN/Inf gradient cannot poison the sum.
    """
    t, start, n, idx = tile_span(chunk_slot, chunk_start, numels, ALIGNED, VEC, BLOCK)
    l = tl.load(layer_ids + t)  # noqa: E741
    col_mask = idx < n

    # Loop-invariant addresses and coefficients, loaded once rather than once per row.
    ptrs = ()
    alphas = ()
    for j in tl.static_range(K):
        ptrs = ptrs + (typed_ptr(grad_ptrs, j * T + t, ELEM, ALIGNED),)
        alphas = alphas + (load_coeff(coeff_bits, j),)

    acc = tl.zeros([BLOCK], dtype=tl.float32)
    # A while loop, not range(0, B, ROWS): the Triton 3.6 interpreter cannot take a tensor
    # (every kernel scalar) as a range bound under NumPy >= 2.5.
    i0 = 0
    while i0 < B:
        # ROWS rows per trip: their loads are independent, so they are all in flight at once.
        for r in tl.static_range(ROWS):
            i = tl.cast(i0 + r, tl.int64)
            in_batch = i < B
            w = tl.load(weights_ptr + i * w_stride_b + l * w_stride_l, mask=in_batch, other=0.0)
            w = w.to(tl.float32)
            mask = col_mask & in_batch
            v = tl.zeros([BLOCK], dtype=tl.float32)
            for j in tl.static_range(K):
                g = tl.load(ptrs[j] + i * n + idx, mask=mask, other=0.0).to(tl.float32)
                v += alphas[j] * g
            acc += w * tl.where(w != 0, v, 0.0)
        i0 += ROWS

    if EPILOGUE == EPI_NOISE:
        nu = tl.load(typed_ptr(noise_ptrs, t, tl.float32, ALIGNED) + idx, mask=col_mask, other=0.0)
        acc = (acc + nu) * scale
    elif EPILOGUE == EPI_PHILOX:
        # Rows of VEC elements: a thread's run of consecutive elements when aligned, 1 otherwise.
        acc = (acc + std * _chunk_normals(bases, t, start, key, BLOCK, VEC if ALIGNED else 1)) * scale
    elif EPILOGUE == EPI_CHACHA:
        # One ChaCha20 block per element (block g // 8, pair (g % 8) // 2): 8x the block work of
        # the noise kernels, correct for any parameter offset, and it keeps the noise in registers.
        g = tl.load(bases + t) + idx
        x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = chacha20_block(g >> 3, key)
        pair = (g >> 1) & 3
        a_lo = tl.where(pair == 0, x0, tl.where(pair == 1, x4, tl.where(pair == 2, x8, x12)))
        a_hi = tl.where(pair == 0, x1, tl.where(pair == 1, x5, tl.where(pair == 2, x9, x13)))
        b_lo = tl.where(pair == 0, x2, tl.where(pair == 1, x6, tl.where(pair == 2, x10, x14)))
        b_hi = tl.where(pair == 0, x3, tl.where(pair == 1, x7, tl.where(pair == 2, x11, x15)))
        z_first, z_second = box_muller64(a_lo, a_hi, b_lo, b_hi)
        z = tl.where((g & 1) == 1, z_second, z_first)
        std64 = tl.load(key + 10).to(tl.float64, bitcast=True)
        acc = (acc.to(tl.float64) + std64 * z).to(tl.float32) * scale
    elif EPILOGUE == EPI_SCALE:
        acc = acc * scale
    tl.store(typed_ptr(out_ptrs, t, tl.float32, ALIGNED) + idx, acc, mask=col_mask)


# =============================================================================================
# Host side: validation, grouping, chunk tables
# =============================================================================================


def _check_sets(grad_sets, coeffs) -> tuple[list[list[torch.Tensor]], int, int, torch.device]:
    """Contiguous ``[k][L]`` tensors (copies made only where needed), ``B``, ``L`` and the device."""
    sets = [list(gs) for gs in grad_sets]
    if not sets or not sets[0]:
        raise ValueError("grad_sets must hold at least one set of at least one tensor")
    if len(coeffs) != len(sets):
        raise ValueError(f"coeffs has {len(coeffs)} entries for {len(sets)} gradient set(s)")
    L, first = len(sets[0]), sets[0][0]
    B, device = first.shape[0], first.device
    check_device(device)
    for j, gs in enumerate(sets):
        if len(gs) != L:
            raise ValueError(f"gradient set {j} has {len(gs)} tensors but set 0 has {L}")
        for idx, g in enumerate(gs):
            ref = sets[0][idx]
            if g.dtype not in TL_DTYPES:
                raise TypeError(f"grad_sets[{j}][{idx}] has dtype {g.dtype}; triton supports fp32, fp16, bf16")
            if g.dim() == 0 or g.shape[0] != B or g.device != device:
                raise ValueError(f"grad_sets[{j}][{idx}] must be [B={B}, ...] on {device}")
            if g.shape != ref.shape or g.dtype != ref.dtype:
                raise ValueError(f"grad_sets[{j}][{idx}] must match grad_sets[0][{idx}] in shape and dtype")
            if not g.is_contiguous():
                gs[idx] = g.contiguous()
    return sets, B, L, device


def _vectors(vecs, sets, L, device, name) -> list[torch.Tensor] | None:
    if vecs is None or len(vecs) == 0:
        return None
    if len(vecs) != L:
        raise ValueError(f"{name} must hold {L} tensors, one per parameter, got {len(vecs)}")
    out = []
    for idx, (v, g) in enumerate(zip(vecs, sets[0], strict=True)):
        if v.numel() != _row_numel(g) or v.device != device:
            raise ValueError(f"{name}[{idx}] must have {_row_numel(g)} elements on {device}")
        out.append(v.to(torch.float32).contiguous())
    return out


def _groups(sets, extra: Sequence[list[torch.Tensor] | None]) -> list[Group]:
    """Parameters with elements grouped by (dtype, alignment), in parameter order; a parameter is
    aligned when its gradient in every set and its ``extra`` fp32 vectors (whose row starts are
    the chunk starts) are. Chunks start at element 0 of each row (``rng_block=1``); the bases are
    the parameters' global element indices, the private epilogue's noise counter."""
    members = [[gs[idx] for gs in sets] + [vs[idx] for vs in extra if vs is not None] for idx in range(len(sets[0]))]
    return group_tensors([_row_numel(g) for g in sets[0]], members, rng_block=1)


def _row_numel(g: torch.Tensor) -> int:
    n = 1
    for s in g.shape[1:]:
        n *= s
    return n


# =============================================================================================
# Host functions (signatures of dpkernels/reference/clip.py)
# =============================================================================================


def per_sample_sumsq(
    grad_sets: Sequence[Sequence[torch.Tensor]],
    coeffs: Sequence[float],
    shift: Sequence[torch.Tensor] | None = None,
    scale: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """``s_il = Σ_e ((Σ_j α_j g_i^(j,l) − shift^(l)) ⊙ scale^(l))_e²``, fp64 ``[B, L]``.

    Args:
        grad_sets: ``k`` lists of ``L`` tensors ``[B, *param_shape]`` (fp32, fp16 or bf16; tensor
            ``l`` has the same shape and dtype in every set).
        coeffs: ``[α_1..α_k]``.
        shift, scale: ``None`` or ``L`` tensors shaped like the parameters (used in fp32).

    The combination and shift/scale are fp32; squares are summed in fp64 (exact to fp32
    rounding, no overflow for finite gradients). Deterministic: no atomics. Launches one norm
    kernel per (dtype, alignment) group and one segment reduction.
    """
    sets, B, L, device = _check_sets(grad_sets, coeffs)
    shift_v = _vectors(shift, sets, L, device, "shift")
    scale_v = _vectors(scale, sets, L, device, "scale")
    if B == 0:
        return torch.zeros((0, L), dtype=torch.float64, device=device)
    K = len(sets)

    meta = MetaTable()
    coeff_h = meta.add(fp32_bits(coeffs))
    launches = []
    seg_first, seg_count = [0] * L, [0] * L  # an empty tensor has no chunks and gets 0
    col = 0
    for grp in _groups(sets, (shift_v, scale_v)):
        numels = [_row_numel(sets[0][s]) for s in grp.slots]
        slots, starts = tiles(numels, grp.bases, SUMSQ_BLOCK, rng_block=1)
        col0 = col  # this group's chunks are partial columns [col0, col0 + len(slots))
        for s, n in zip(grp.slots, numels, strict=True):
            seg_first[s], seg_count[s] = col, -(-n // SUMSQ_BLOCK)
            col += seg_count[s]
        handles = dict(
            grad_ptrs=meta.add([gs[s].data_ptr() for gs in sets for s in grp.slots]),
            shift_ptrs=meta.add([shift_v[s].data_ptr() for s in grp.slots] if shift_v else []),
            scale_ptrs=meta.add([scale_v[s].data_ptr() for s in grp.slots] if scale_v else []),
            numels=meta.add(numels),
            chunk_slot=meta.add(slots),
            chunk_start=meta.add(starts),
        )
        launches.append((grp, handles, slots.numel(), col0))
    first_h, count_h = meta.add(seg_first), meta.add(seg_count)
    meta.finish(device)

    n_cols = col
    partial = torch.empty((B, max(n_cols, 1)), dtype=torch.float64, device=device)
    out = torch.empty((B, L), dtype=torch.float64, device=device)
    with device_guard(device):
        for grp, h, n_chunks, col0 in launches:
            for row0 in range(0, B, _MAX_GRID_Y):
                rows = min(_MAX_GRID_Y, B - row0)
                _per_sample_sumsq_kernel[(n_chunks, rows)](
                    meta[h["grad_ptrs"]], meta[h["shift_ptrs"]], meta[h["scale_ptrs"]], meta[coeff_h],
                    meta[h["numels"]], meta[h["chunk_slot"]], meta[h["chunk_start"]],
                    partial, partial.shape[1], col0, row0, len(grp.slots),
                    K=K, HAS_SHIFT=shift_v is not None, HAS_SCALE=scale_v is not None,
                    ELEM=TL_DTYPES[grp.dtype], BLOCK=SUMSQ_BLOCK, ALIGNED=grp.aligned,
                    VEC=VEC_BYTES // grp.dtype.itemsize, num_warps=SUMSQ_NUM_WARPS,
                )  # fmt: skip
        _segment_sum_kernel[(B * L,)](
            partial, partial.shape[1], meta[first_h], meta[count_h], out, L, BLOCK=SEGMENT_BLOCK
        )
    return out


def clip_factors(
    norms: torch.Tensor, max_grad_norm: float | Sequence[float], mode: str = "clip", r: float = 0.0
) -> torch.Tensor:
    """Per-sample weights ``c = f(n)``, same shape and dtype (fp32 or fp64) as ``norms``: evaluated
    in fp64, an fp32 result rounded toward zero (the reference's rule).

    - ``clip``:   ``min(1, C / (n + 1e-6))``   DP-SGD (Abadi et al.), Opacus's guard
    - ``auto_s``: ``C / (n + r)``              Auto-S / NSGD (Bu et al.; Yang et al.)
    - ``auto_v``: ``C / max(n, 1e-12)``        Auto-V
    - ``psac``:   ``C / (n + r / (n + r))``    DP-PSAC (Xia et al., AAAI-23)

    ``norms`` is ``[B]`` or ``[B, L]``; ``max_grad_norm`` is one float, or ``L`` floats (one per
    column of ``[B, L]`` norms). NaN norms give NaN weights.
    """
    if mode not in _MODE_IDS:
        raise ValueError(f"unknown clip mode {mode!r}; expected one of {tuple(_MODE_IDS)}")
    if norms.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"norms must be float32 or float64, got {norms.dtype}")
    check_device(norms.device)
    Cs = [float(c) for c in max_grad_norm] if isinstance(max_grad_norm, Sequence) else [float(max_grad_norm)]
    if len(Cs) != 1 and (norms.dim() != 2 or len(Cs) != norms.shape[1]):
        raise ValueError(f"{len(Cs)} max_grad_norm values do not match norms of shape {tuple(norms.shape)}")
    norms = norms.contiguous()
    out = torch.empty_like(norms)
    N = norms.numel()
    if N == 0:
        return out
    params = torch.tensor([float(r), *Cs], dtype=torch.float64, device=norms.device)
    with device_guard(norms.device):
        _clip_factors_kernel[(triton.cdiv(N, CLIP_BLOCK),)](
            norms, params, out, N, len(Cs), MODE=_MODE_IDS[mode], BLOCK=CLIP_BLOCK
        )
    return out


def weighted_sum(
    grad_sets: Sequence[Sequence[torch.Tensor]], weights: torch.Tensor, coeffs: Sequence[float] = (1.0,)
) -> list[torch.Tensor]:
    """``S^(l) = Σ_i w_il Σ_j α_j g_i^(j,l)``, fp32, one tensor per parameter shaped like it.

    Args:
        grad_sets: as :func:`per_sample_sumsq`.
        weights: ``[B, L]`` (or ``[B]``, shared by all tensors), any float dtype; used in fp32.
        coeffs: ``[α_1..α_k]``.

    A sample whose weight is exactly 0 is skipped, so a dropped non-finite sample cannot poison
    the sum. Accumulation is fp32, in sample order, with no atomics (deterministic). One launch
    per (dtype, alignment) group.
    """
    return _weighted_sum(grad_sets, weights, coeffs, EPI_NONE)


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
    """``(S^(l) + ν^(l))·out_scale``: :func:`weighted_sum` with the private epilogue.

    ``ν = noise_std·z`` (Philox, docs/RNG.md; element index global over the parameter list),
    generated in the kernel that writes the result, or the pre-drawn fp32 ``noise`` list.
    """
    if noise is not None:
        return _weighted_sum(grad_sets, weights, coeffs, EPI_NOISE, noise=noise, scale=out_scale)
    if noise_std > 0:
        key = [seed & 0xFFFFFFFF, seed >> 32, step, stream]
        return _weighted_sum(grad_sets, weights, coeffs, EPI_PHILOX, key=key, std=noise_std, scale=out_scale)
    return _weighted_sum(grad_sets, weights, coeffs, EPI_SCALE, scale=out_scale)


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
    """Secure mode: ``fp32(S^(l) + noise_std·z)·out_scale`` with the float64 ChaCha20 normal ``z``
    (docs/RNG.md §6; ``key`` the 256-bit int), generated in the kernel that writes the result."""
    words = [(key >> (32 * i)) & 0xFFFFFFFF for i in range(8)]
    std_bits = struct.unpack("<q", struct.pack("<d", float(noise_std)))[0]
    return _weighted_sum(grad_sets, weights, coeffs, EPI_CHACHA, key=[*words, step, stream, std_bits], scale=out_scale)


def _weighted_sum(grad_sets, weights, coeffs, epilogue, noise=None, key=None, std=0.0, scale=1.0):
    sets, B, L, device = _check_sets(grad_sets, coeffs)
    if weights.dim() not in (1, 2) or weights.shape[0] != B or (weights.dim() == 2 and weights.shape[1] != L):
        raise ValueError(f"weights must be [B]={B} or [B, L]=[{B}, {L}], got {tuple(weights.shape)}")
    if weights.device != device:
        raise ValueError(f"weights are on {weights.device} but the gradients are on {device}")
    shapes = [g.shape[1:] for g in sets[0]]
    if noise is not None:
        noise = [v.to(device=device, dtype=torch.float32).contiguous() for v in noise]
        if len(noise) != L or any(v.shape != s for v, s in zip(noise, shapes, strict=True)):
            raise ValueError("noise must hold one tensor per parameter, shaped like it")
    if B == 0 and epilogue == EPI_NONE:
        return [torch.zeros(s, dtype=torch.float32, device=device) for s in shapes]
    outs = [torch.empty(s, dtype=torch.float32, device=device) for s in shapes]
    w_stride_b = weights.stride(0)
    w_stride_l = weights.stride(1) if weights.dim() == 2 else 0
    K = len(sets)

    meta = MetaTable()
    coeff_h = meta.add(fp32_bits(coeffs))
    key_h = meta.add(key or [0, 0, 0, 0])
    launches = []
    for grp in _groups(sets, (outs,) if noise is None else (outs, noise)):
        numels = [_row_numel(sets[0][s]) for s in grp.slots]
        slots, starts = tiles(numels, grp.bases, WSUM_BLOCK, rng_block=1)
        handles = dict(
            grad_ptrs=meta.add([gs[s].data_ptr() for gs in sets for s in grp.slots]),
            out_ptrs=meta.add([outs[s].data_ptr() for s in grp.slots]),
            numels=meta.add(numels),
            layer_ids=meta.add(grp.slots),
            chunk_slot=meta.add(slots),
            chunk_start=meta.add(starts),
            bases=meta.add(grp.bases),
            noise_ptrs=meta.add([noise[s].data_ptr() if noise is not None else 0 for s in grp.slots]),
        )
        launches.append((grp, handles, slots.numel()))
    meta.finish(device)

    with device_guard(device):
        for grp, h, n_chunks in launches:
            _weighted_sum_kernel[(n_chunks,)](
                meta[h["grad_ptrs"]], meta[h["out_ptrs"]], meta[coeff_h], meta[h["numels"]],
                meta[h["layer_ids"]], meta[h["chunk_slot"]], meta[h["chunk_start"]],
                weights, w_stride_b, w_stride_l, B, len(grp.slots),
                K=K, ELEM=TL_DTYPES[grp.dtype], BLOCK=WSUM_BLOCK, ROWS=WSUM_ROWS,
                ALIGNED=grp.aligned, VEC=VEC_BYTES // grp.dtype.itemsize,
                bases=meta[h["bases"]], noise_ptrs=meta[h["noise_ptrs"]], key=meta[key_h],
                std=float(std), scale=float(scale), EPILOGUE=epilogue.value, num_warps=WSUM_NUM_WARPS,
            )  # fmt: skip
    return outs
