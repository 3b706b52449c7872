"""Triton kernels for the book-keeping (BK) layer ops: per-sample squared norms of a linear layer's
weight gradient, computed from the layer's input and output gradient without materialising the
per-sample gradients (FlashDP's tiling, plus a coordinate-wise scale and shift).

Semantics: ``dpkernels/reference/layers.py`` (the ground truth). Per sample ``i``, with ``A_i``
``[T, d_in]`` and ``G_i`` ``[T, d_out]`` (``T`` positions; ``T = 1`` for a plain MLP):

    ``out[i] = Σ_{o,k} (S[o,k] · (P_i[o,k] − M[o,k]))²``,  ``P_i = G_iᵀ A_i`` (``[d_out, d_in]``)

Launch structure (:func:`linear_sumsq_tiled`): one program per (``BLOCK_O × BLOCK_K`` tile of
``P``, sample). A program walks its sample's ``T`` positions in chunks of ``BLOCK_T``, accumulating
``G_chunkᵀ A_chunk`` with ``tl.dot`` in fp32, so ``P_i`` exists one tile at a time in registers and
never in memory. The epilogue applies the shift and scale (constexpr switches: without them nothing
is loaded), squares, and reduces the tile to one fp32 partial, stored at ``partial[i, tile]``. The
launcher sums each sample's partials in float64 in a fixed order (deterministic, no atomics) and
returns fp32.

Numerics: products and their sums over ``T`` are fp32 (``tl.dot`` with fp32 accumulation; fp32
inputs use ``input_precision="ieee"``, never TF32, since the norms drive a privacy clip; fp16/bf16
inputs run on tensor cores, whose products of 16-bit values are exact in fp32). Under the
interpreter 16-bit chunks are converted to fp32 before the dot (its dot multiplies bf16 bit patterns
as integers); the conversion is exact, so only the summation order differs from the GPU.

Grid: ``(num_tiles, rows)``: the tiles of one sample are consecutive programs, so a sample's
``A_i``/``G_i`` are read from L2 by all its tiles; the batch is launched in row slices of at most
65535 (CUDA's cap on grid dimension 1), the tile count in dimension 0 has no such cap.

Runs compiled on CUDA tensors, or on CPU tensors under the Triton interpreter
(``TRITON_INTERPRET=1`` set before this module is imported).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .common import TL_DTYPES, VEC_BYTES, check_device, device_guard, interpreting


class LinearBlocks(NamedTuple):
    """Tile shape and launch options of :func:`_linear_sumsq_kernel`."""

    BLOCK_O: int
    BLOCK_K: int
    BLOCK_T: int
    num_warps: int


#: Compiled launch configs (H100; also sm_80), by input dtype. 16-bit inputs: tensor-core dots
#: (wgmma on sm_90, mma.sync on sm_80) on 128×64 tiles, T in chunks of 32 (~190 registers with
#: shift+scale). fp32 inputs: IEEE fp32 dots run on the FMA units; 64×64 tiles with T chunks of 16
#: (chunks of 32 spill on sm_80). Every load of the T loop is a 16-byte cp.async when rows are
#: aligned. tools/gpu_static_check.py checks these configs: no spills, no local memory.
LINEAR_BLOCKS = {
    torch.float32: LinearBlocks(64, 64, 16, 4),
    torch.float16: LinearBlocks(128, 64, 32, 4),
    torch.bfloat16: LinearBlocks(128, 64, 32, 4),
}
#: Compile options of every launch besides ``num_warps``: a 3-stage software pipeline of the ``T``
#: loop's loads (tools/gpu_static_check.py compiles with the same options).
LINEAR_COMPILE_OPTIONS = {"num_stages": 3}
#: Under the interpreter a program costs per interpreted op, not per element: large tiles, so a
#: small layer is one program per sample. (No result depends on the tile shape.)
INTERPRETER_LINEAR_BLOCKS = LinearBlocks(64, 64, 64, 4)

#: Convert 16-bit chunks to fp32 before ``tl.dot`` (the interpreter's dot miscomputes bf16).
_UPCAST_DOT = tl.constexpr(interpreting())

# CUDA caps grid dimension 1 at 65535; larger batches are launched in row slices.
_MAX_GRID_Y = 65535
_INT32_MAX = 2**31 - 1


# =============================================================================================
# Kernel
# =============================================================================================


@triton.jit
def _linear_sumsq_kernel(
    a_ptr,
    g_ptr,
    scale_ptr,
    shift_ptr,
    partial_ptr,
    T,
    d_in,
    d_out,
    tiles_k,
    n_tiles,
    row0,
    HAS_SCALE: tl.constexpr,
    HAS_SHIFT: tl.constexpr,
    BLOCK_O: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    VEC_IN: tl.constexpr,
    VEC_OUT: tl.constexpr,
):
    """``partial[i, tile] = Σ_{(o,k) in tile} (scale[o,k] · (P_i[o,k] − shift[o,k]))²``, fp32.

    Grid ``(n_tiles, rows)``; program ``(tile, r)`` computes the tile ``(tile // tiles_k,
    tile % tiles_k)`` (``BLOCK_O × BLOCK_K``) of ``P_i = G_iᵀ A_i`` for sample ``i = row0 + r``.
    ``a_ptr``: contiguous ``[B, T, d_in]``; ``g_ptr``: contiguous ``[B, T, d_out]`` of the same
    dtype (fp32, fp16 or bf16); ``scale_ptr``/``shift_ptr``: contiguous fp32 ``[d_out, d_in]``
    (read only with ``HAS_SCALE``/``HAS_SHIFT``); ``partial_ptr``: fp32 ``[B, n_tiles]``.
    ``VEC_IN``/``VEC_OUT``: known divisors of ``d_in``/``d_out`` (the elements of one 128-bit
    vector of the input dtype, a multiple of 4, or 1): with 16-byte aligned pointers (which the JIT
    sees itself), every row of ``a``/``scale``/``shift`` (``VEC_IN``) and of ``g`` (``VEC_OUT``)
    then starts on a 16-byte boundary and its loads are vectorised.
    """
    tile = tl.program_id(0)
    i = tl.program_id(1).to(tl.int64) + row0
    # Exact (VEC_IN divides d_in) and visible to Triton's alignment analysis, which a
    # tl.multiple_of hint on a kernel argument is not.
    if VEC_IN > 1:
        d_in = (d_in // VEC_IN) * VEC_IN
    if VEC_OUT > 1:
        d_out = (d_out // VEC_OUT) * VEC_OUT
    offs_o = (tile // tiles_k) * BLOCK_O + tl.arange(0, BLOCK_O)
    offs_k = (tile % tiles_k) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_t = tl.arange(0, BLOCK_T)
    mask_o = offs_o < d_out
    mask_k = offs_k < d_in

    # Sample bases in int64; offsets inside one sample fit in int32 (checked by the launcher).
    a_rows = a_ptr + i * T * d_in + offs_t[:, None] * d_in + offs_k[None, :]
    g_cols = g_ptr + i * T * d_out + offs_o[:, None] + offs_t[None, :] * d_out
    acc = tl.zeros([BLOCK_O, BLOCK_K], dtype=tl.float32)
    for t0 in range(0, T, BLOCK_T):
        in_t = offs_t < T - t0
        g_chunk = tl.load(g_cols, mask=mask_o[:, None] & in_t[None, :], other=0.0)
        a_chunk = tl.load(a_rows, mask=in_t[:, None] & mask_k[None, :], other=0.0)
        if a_chunk.dtype == tl.float32 or _UPCAST_DOT:
            # IEEE fp32 products and sums: no TF32 in a norm that drives a privacy clip.
            acc = tl.dot(g_chunk.to(tl.float32), a_chunk.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(g_chunk, a_chunk, acc)
        a_rows += BLOCK_T * d_in
        g_cols += BLOCK_T * d_out

    # Masked lanes of acc are exactly 0, and so are their shift and scale: they add nothing.
    if HAS_SHIFT or HAS_SCALE:
        mask = mask_o[:, None] & mask_k[None, :]
        offs = offs_o[:, None] * d_in + offs_k[None, :]
        if HAS_SHIFT:
            acc -= tl.load(shift_ptr + offs, mask=mask, other=0.0)
        if HAS_SCALE:
            acc *= tl.load(scale_ptr + offs, mask=mask, other=0.0)
    tl.store(partial_ptr + i * n_tiles + tile, tl.sum(tl.sum(acc * acc, axis=1), axis=0))


# =============================================================================================
# Host side
# =============================================================================================


def _check_matrix(x, name: str, d_out: int, d_in: int, device: torch.device) -> None:
    if x is None:
        return
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"{name} must be None or a float32 tensor [d_out, d_in]; got {type(x).__name__} "
            "(a rank-one (s_out, s_in) scale must be expanded to its dense product first)"
        )
    if x.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {x.dtype}")
    if tuple(x.shape) != (d_out, d_in):
        raise ValueError(f"{name} must be [d_out, d_in] = [{d_out}, {d_in}], got {list(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but a and g are on {device}")
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def linear_sumsq_tiled(
    a: torch.Tensor, g: torch.Tensor, scale: torch.Tensor | None = None, shift: torch.Tensor | None = None
) -> torch.Tensor:
    """``‖S ⊙ (G_iᵀA_i − M)‖²`` per sample, fp32 ``[B]``, without materialising ``G_iᵀA_i``.

    Args:
        a: layer input ``[B, T, d_in]`` (or ``[B, d_in]``, ``T = 1``): fp32, fp16 or bf16, contiguous.
        g: output gradient ``[B, T, d_out]`` (or ``[B, d_out]``), same dtype and device, contiguous.
        scale, shift: ``None`` or contiguous fp32 ``[d_out, d_in]``.

    Tile products in fp32 (IEEE for fp32 inputs), one fp32 partial per (sample, tile), partials
    summed in float64 in a fixed order: deterministic. ``B = 0`` launches nothing.
    """
    for name, x in (("a", a), ("g", g)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
        if x.dim() not in (2, 3):
            raise ValueError(f"{name} must be [B, T, d] or [B, d], got {x.dim()} dims {list(x.shape)}")
        if x.dtype not in TL_DTYPES:
            raise TypeError(f"{name} has dtype {x.dtype}; the triton kernel supports float32, float16, bfloat16")
        if not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if a.dim() != g.dim() or a.shape[:-1] != g.shape[:-1]:
        raise ValueError(f"a {list(a.shape)} and g {list(g.shape)} must agree in [B, T]")
    if a.dtype != g.dtype:
        raise TypeError(f"a ({a.dtype}) and g ({g.dtype}) must have the same dtype")
    if a.device != g.device:
        raise ValueError(f"a is on {a.device} but g is on {g.device}")
    device = a.device
    check_device(device)
    if a.dim() == 2:
        a, g = a.unsqueeze(1), g.unsqueeze(1)
    B, T, d_in = a.shape
    d_out = g.shape[2]
    _check_matrix(scale, "scale", d_out, d_in, device)
    _check_matrix(shift, "shift", d_out, d_in, device)
    if max(T * d_in, T * d_out, d_out * d_in) > _INT32_MAX:
        raise ValueError(f"T·d_in, T·d_out and d_out·d_in must each be below 2^31 (T={T}, d_in={d_in}, d_out={d_out})")
    if B == 0 or d_in == 0 or d_out == 0:
        return torch.zeros(B, dtype=torch.float32, device=device)
    blocks = INTERPRETER_LINEAR_BLOCKS if interpreting() else LINEAR_BLOCKS[a.dtype]
    return _launch(a, g, scale, shift, blocks)


def _launch(a, g, scale, shift, blocks: LinearBlocks) -> torch.Tensor:
    """Runs the kernel with tile config ``blocks`` on validated, non-empty 3-D inputs."""
    B, T, d_in = a.shape
    d_out = g.shape[2]
    tiles_k = triton.cdiv(d_in, blocks.BLOCK_K)
    n_tiles = triton.cdiv(d_out, blocks.BLOCK_O) * tiles_k
    vec = VEC_BYTES // a.dtype.itemsize  # a multiple of 4: fp32 scale/shift rows align with d_in
    vec_in, vec_out = (vec if d_in % vec == 0 else 1), (vec if d_out % vec == 0 else 1)
    partial = torch.empty((B, n_tiles), dtype=torch.float32, device=a.device)
    # A null-free stand-in for an absent scale/shift (never read: HAS_SCALE/HAS_SHIFT are off).
    scale_arg = scale if scale is not None else partial
    shift_arg = shift if shift is not None else partial
    with device_guard(a.device):
        for row0 in range(0, B, _MAX_GRID_Y):
            rows = min(_MAX_GRID_Y, B - row0)
            _linear_sumsq_kernel[(n_tiles, rows)](
                a, g, scale_arg, shift_arg, partial, T, d_in, d_out, tiles_k, n_tiles, row0,
                HAS_SCALE=scale is not None, HAS_SHIFT=shift is not None,
                BLOCK_O=blocks.BLOCK_O, BLOCK_K=blocks.BLOCK_K, BLOCK_T=blocks.BLOCK_T,
                VEC_IN=vec_in, VEC_OUT=vec_out, num_warps=blocks.num_warps, **LINEAR_COMPILE_OPTIONS,
            )  # fmt: skip
    # Fixed-order float64 reduction of each sample's partials (torch reductions use no atomics).
    return partial.sum(dim=1, dtype=torch.float64).to(torch.float32)
