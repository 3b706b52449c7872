"""Triton kernel of ``linear_filter_`` (semantics: ``dpkernels/reference/filter.py``; the C++ twin of
the element math is ``csrc/include/dpkernels/filter.h``).

Per element, with ``K`` fp32 state buffers and host coefficients::

    x = input | std·z | input + std·z;   y = a·x + Σ c_k S_k;   S_k ← d_k S_k + e_k y + f_k x;   out (+)= g·y

Work split and noise follow ``noise.py``: a program handles one tile of ``BLOCK`` elements of one
tensor, tiles aligned to Philox blocks of the global index (``common.tiles``), the four normals of
each block interleaved into element order; multi-tensor launches group tensors by (dtype,
alignment), one launch per group, with every address, size and coefficient in one int64 metadata
tensor (coefficients as fp32 bit patterns, so the compiled kernel does not specialise on them).

Which terms exist is compile-time: bit ``k`` of ``C_BITS`` / ``D_BITS`` / ``E_BITS`` / ``F_BITS`` says
that ``c_k`` / ``d_k`` / ``e_k`` / ``f_k`` is non-zero, and ``W_BITS`` which buffers are updated (not
``(1, 0, 0)``). A zero term is therefore never evaluated (an only-written buffer is never read), as
in the reference, and a call site with a fixed pattern (BLT, a banded ring passed in rotated order,
momentum) compiles once. A buffer that feeds ``y`` and is updated with ``d_k ≠ 0`` is loaded twice
(for ``y``, then for its update after ``y`` is known); on GPU the second load hits L1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

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

#: Elements per program and warps: one Philox block (4 elements) per GPU thread; 2048 made ptxas spill
#: in the unaligned variant on sm_80 (tools/gpu_static_check.py).
FILTER_BLOCK = 1024
FILTER_NUM_WARPS = 8


@triton.jit
def _bit(bits: tl.constexpr, k: tl.constexpr):
    return ((bits >> k) & 1) != 0


@triton.jit
def filter_step(
    x,
    state_ptrs,
    T,
    t,
    idx,
    mask,
    coeff_bits,
    C0: tl.constexpr,
    K: tl.constexpr,
    C_BITS: tl.constexpr,
    D_BITS: tl.constexpr,
    E_BITS: tl.constexpr,
    F_BITS: tl.constexpr,
    W_BITS: tl.constexpr,
    HAS_A: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    """filter.h's ``filter_step`` on one tile: ``y = a x + Σ c_k S_k``, ``S_k ← d_k S_k + e_k y + f_k x``
    for the updated buffers; returns ``g·y``. Buffer ``k`` of slot ``t`` is the fp32 tensor at
    ``state_ptrs[k·T + t]``; the coefficients ``[a, g, c.., d.., e.., f..]`` are the fp32 bits at
    ``coeff_bits[C0:]``; the ``*_BITS`` masks say which terms exist (see the module docstring)."""
    y = load_coeff(coeff_bits, C0) * x if HAS_A else tl.zeros_like(x)
    for k in tl.static_range(K):
        if _bit(C_BITS, k):
            p = typed_ptr(state_ptrs, k * T + t, tl.float32, ALIGNED)
            y = y + load_coeff(coeff_bits, C0 + 2 + k) * tl.load(p + idx, mask=mask, other=0.0)
    for k in tl.static_range(K):
        if _bit(W_BITS, k):
            p = typed_ptr(state_ptrs, k * T + t, tl.float32, ALIGNED)
            if _bit(D_BITS, k):
                v = load_coeff(coeff_bits, C0 + 2 + K + k) * tl.load(p + idx, mask=mask, other=0.0)
            else:
                v = tl.zeros_like(x)
            if _bit(E_BITS, k):
                v = v + load_coeff(coeff_bits, C0 + 2 + 2 * K + k) * y
            if _bit(F_BITS, k):
                v = v + load_coeff(coeff_bits, C0 + 2 + 3 * K + k) * x
            tl.store(p + idx, v, mask=mask)
    return load_coeff(coeff_bits, C0 + 1) * y


@triton.jit
def _filter_kernel(
    in_ptrs,
    out_ptrs,
    state_ptrs,
    numels,
    bases,
    tile_slot,
    tile_start,
    key,
    coeff_bits,
    std,
    T,
    K: tl.constexpr,
    C_BITS: tl.constexpr,
    D_BITS: tl.constexpr,
    E_BITS: tl.constexpr,
    F_BITS: tl.constexpr,
    W_BITS: tl.constexpr,
    HAS_A: tl.constexpr,
    HAS_IN: tl.constexpr,
    HAS_OUT: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    NOISE: tl.constexpr,
    ELEM: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
    VEC: tl.constexpr,
):
    """One tile of ``BLOCK`` elements of tensor slot ``t`` (grid ``(num_tiles,)``).

    ``in_ptrs``/``out_ptrs``/``numels``/``bases``: int64 ``[T]`` (addresses of ``ELEM`` tensors,
    element counts, global index of element 0); ``state_ptrs``: int64 ``[K·T]``, buffer ``k`` of slot
    ``t`` at ``k·T + t`` (fp32); ``tile_slot``/``tile_start`` as in ``noise._noise_kernel``; ``key``:
    (seed low, seed high, step, stream); ``coeff_bits``: fp32 bits of ``[a, g, c.., d.., e.., f..]``.
    """
    t, start, idx, mask = tile(tile_slot, tile_start, numels, ALIGNED, VEC, BLOCK)
    x = std * tile_normals(bases, t, start, key, BLOCK) if NOISE else tl.zeros([BLOCK], dtype=tl.float32)
    if HAS_IN:
        x_in = tl.load(typed_ptr(in_ptrs, t, ELEM, ALIGNED) + idx, mask=mask, other=0.0).to(tl.float32)
        x = x_in + x if NOISE else x_in
    res = filter_step(x, state_ptrs, T, t, idx, mask, coeff_bits, 0, K, C_BITS, D_BITS, E_BITS, F_BITS, W_BITS, HAS_A,
                      ALIGNED)  # fmt: skip
    if HAS_OUT:
        p_out = typed_ptr(out_ptrs, t, ELEM, ALIGNED)
        if ACCUMULATE:
            res = tl.load(p_out + idx, mask=mask, other=0.0).to(tl.float32) + res
        tl.store(p_out + idx, round_to(res, ELEM), mask=mask)


def term_bits(values: Sequence[float]) -> int:
    """The term mask of ``filter_step``'s coefficients ``values``: bit ``k`` set where ``values[k] != 0``."""
    return sum(1 << k for k, v in enumerate(values) if v != 0)


def linear_filter_(
    inputs: Sequence[torch.Tensor],
    state: Sequence[torch.Tensor],
    out: Sequence[torch.Tensor],
    coeffs: Sequence[float],
    accumulate: bool,
    noise_std: float,
    seed: int,
    step: int,
    stream: int,
    offset: int,
) -> None:
    """In place, the native op's contract (``dpkernels_C::linear_filter_``): ``state[k·L + i]`` is
    buffer ``k`` of tensor ``i``; ``inputs``/``out`` are ``L`` tensors or empty. Validation of counts,
    sizes and dtypes is done by ``dpkernels.filter.linear_filter_``."""
    K = (len(coeffs) - 2) // 4
    L = len(out) if out else (len(inputs) if inputs else len(state) // K)
    ref = list(out) if out else (list(inputs) if inputs else list(state[:L]))
    device = ref[0].device
    check_device(device)
    counter = check_counter(seed, step, stream, offset)
    a = coeffs[0]
    c, d, e, f = (coeffs[2 + i * K : 2 + (i + 1) * K] for i in range(4))
    w = [0.0 if (d[k], e[k], f[k]) == (1.0, 0.0, 0.0) else 1.0 for k in range(K)]
    elem = ref[0].dtype if (out or inputs) else torch.float32
    groups: dict[tuple[torch.dtype, bool], list[tuple[int, int]]] = {}
    base = offset
    for p in range(L):
        n = ref[p].numel()
        if n:
            dtype = ref[p].dtype if (out or inputs) else elem
            tensors = [x[p] for x in (inputs, out) if x] + [state[k * L + p] for k in range(K)]
            key = (dtype, is_aligned(tensors, n, dtype.itemsize, base))
            groups.setdefault(key, []).append((p, base))
        base += n
    if not groups:
        return
    block = tile_block(FILTER_BLOCK)
    meta = MetaTable()
    key_h, coeff_h = meta.add(counter), meta.add(fp32_bits(coeffs))
    launches = []
    for (dtype, aligned), members in groups.items():
        slots = [p for p, _ in members]
        numels = [ref[p].numel() for p in slots]
        tile_slot, tile_start = tiles(numels, [b for _, b in members], block)
        zeros = [0] * len(slots)
        handles = (
            meta.add([inputs[p].data_ptr() for p in slots] if inputs else zeros),
            meta.add([out[p].data_ptr() for p in slots] if out else zeros),
            meta.add([state[k * L + p].data_ptr() for k in range(K) for p in slots] or [0]),
            meta.add(numels),
            meta.add([b for _, b in members]),
            meta.add(tile_slot),
            meta.add(tile_start),
        )
        launches.append((dtype, aligned, len(slots), handles, tile_slot.numel()))
    meta.finish(device)
    with device_guard(device):
        for dtype, aligned, n_slots, h, n_tiles in launches:
            _filter_kernel[(n_tiles,)](
                *(meta[x] for x in h), meta[key_h], meta[coeff_h], float(noise_std), n_slots,
                K=K, C_BITS=term_bits(c), D_BITS=term_bits(d), E_BITS=term_bits(e), F_BITS=term_bits(f),
                W_BITS=term_bits(w), HAS_A=a != 0, HAS_IN=bool(inputs), HAS_OUT=bool(out),
                ACCUMULATE=bool(accumulate), NOISE=noise_std > 0, ELEM=TL_DTYPES[dtype], BLOCK=block, ALIGNED=aligned,
                VEC=VEC_BYTES // dtype.itemsize, num_warps=FILTER_NUM_WARPS,
            )  # fmt: skip
