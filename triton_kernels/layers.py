"""Triton kernels for the book-keeping (BK) layer ops: per-sample squared norms of a linear layer's
weight gradient, computed from the layer's input and output gradient without materialising the
per-sample gradients (FlashDP's tiling, plus a coordinate-wise scale and shift).

Semantics: ``dpkernels/reference/layers.py`` (the ground truth). Per sample ``i``, with ``A_i``
``[T, d_in]`` and ``G_i`` ``[T, d_out]`` (``T`` positions; ``T = 1`` for a plain MLP):

    ``out[i] = Σ_{o,k} (S[o,k] · (P_i[o,k] − M[o,k]))²``,  ``P_i = G_iᵀ A_i`` (``[d_out, d_in]``)

A Conv2d (:func:`conv2d_sumsq_tiled`, one group) is the same product over its input's im2col
patches, ``T = H_out·W_out`` positions and ``d_in = C·kh·kw`` columns, run by the same kernel
(constexpr ``IS_CONV``) with the patches gathered from the input in place (implicit im2col: each
chunk's elements are loaded straight from ``x``, zero outside the image) and ``G_i`` read from
``g``'s ``[O, H_out·W_out]`` channel planes; neither the patches nor a transposed ``g`` is built.

Launch structure (:func:`linear_sumsq_tiled`, :func:`conv2d_sumsq_tiled`): one program per
(``BLOCK_O × BLOCK_K`` tile of ``P``, sample). A program walks its sample's ``T`` positions in
chunks of ``BLOCK_T``, accumulating ``G_chunkᵀ A_chunk`` with ``tl.dot`` in fp32, so ``P_i`` exists
one tile at a time in registers and never in memory. The epilogue applies the shift and scale
(constexpr switches: without them nothing is loaded), squares, and reduces the tile to one fp32
partial, stored at ``partial[i, tile]``. The launcher sums each sample's partials in float64 in a
fixed order (deterministic, no atomics) and returns fp32.

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
#: Compiled launch configs of the Conv2d case (implicit im2col), by input dtype: the linear tiles.
#: Its A chunks are element-wise gathers (2-byte ones cannot be cp.async copies), so 16-bit inputs
#: run on 8 warps: on 4, a 3x3 conv whose g planes are unaligned needs 254 registers (sm_80/sm_90),
#: on 8 at most 175. fp32: at most 186 on 4 warps. tools/gpu_static_check.py checks these too.
CONV_BLOCKS = {
    torch.float32: LinearBlocks(64, 64, 16, 4),
    torch.float16: LinearBlocks(128, 64, 32, 8),
    torch.bfloat16: LinearBlocks(128, 64, 32, 8),
}

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
    H,
    W,
    W_out,
    KH,
    KW,
    stride_h,
    stride_w,
    pad_h,
    pad_w,
    dil_h,
    dil_w,
    a_stride_b,
    a_stride_c,
    g_stride_b,
    g_stride_c,
    HAS_SCALE: tl.constexpr,
    HAS_SHIFT: tl.constexpr,
    IS_CONV: tl.constexpr,
    BLOCK_O: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    VEC_IN: tl.constexpr,
    VEC_OUT: tl.constexpr,
):
    """``partial[i, tile] = Σ_{(o,k) in tile} (scale[o,k] · (P_i[o,k] − shift[o,k]))²``, fp32.

    Grid ``(n_tiles, rows)``; program ``(tile, r)`` computes the tile ``(tile // tiles_k,
    tile % tiles_k)`` (``BLOCK_O × BLOCK_K``) of ``P_i = G_iᵀ A_i`` for sample ``i = row0 + r``.
    ``scale_ptr``/``shift_ptr``: contiguous fp32 ``[d_out, d_in]`` (read only with
    ``HAS_SCALE``/``HAS_SHIFT``); ``partial_ptr``: fp32 ``[B, n_tiles]``. ``a`` and ``g`` share one
    dtype (fp32, fp16 or bf16). The operands, by ``IS_CONV``:

    - linear (``IS_CONV`` off): ``a_ptr`` contiguous ``[B, T, d_in]``, ``g_ptr`` contiguous
      ``[B, T, d_out]``; the arguments from ``H`` to ``g_stride_c`` are unused (0).
    - Conv2d (``IS_CONV``, implicit im2col): ``A_i`` is the im2col patch matrix of the input
      ``a`` ``[B, C, H, W]`` read in place: position ``t = (oh, ow)`` (``T = H_out·W_out``,
      ``W_out`` columns), column ``k = (c, kh, kw)`` in ``weight[o].flatten()`` order (``d_in =
      C·KH·KW``), value ``a[i, c, oh·stride_h − pad_h + kh·dil_h, ow·stride_w − pad_w + kw·dil_w]``
      or 0 outside the image. ``G_i`` is read transposed from ``g`` ``[B, d_out, H_out, W_out]``
      (``[d_out][T]``). Each channel plane of ``a``/``g`` is contiguous (row stride ``W``/``W_out``);
      sample and channel strides are ``a_stride_b``/``a_stride_c`` and ``g_stride_b``/``g_stride_c``.

    Only the pointers and masks of the ``A`` and ``G`` chunks depend on ``IS_CONV``; the ``T``
    loop, the dots and the epilogue are the same code.

    ``VEC_IN``: a known divisor of ``d_in`` (the elements of one 128-bit vector of the input dtype,
    a multiple of 4, or 1): with 16-byte aligned pointers (which the JIT sees itself) every row of
    ``scale``/``shift`` (and of a linear ``a``) then starts on a 16-byte boundary and its loads are
    vectorised. ``VEC_OUT``: the same for the rows of ``g``: a divisor of ``d_out`` (linear), or of
    ``T``, ``g_stride_b`` and ``g_stride_c`` (conv: each channel plane of ``g`` is then aligned and
    its chunks are whole vectors).
    """
    tile = tl.program_id(0)
    i = tl.program_id(1).to(tl.int64) + row0
    # Exact (VEC_* divides them) and visible to Triton's alignment analysis, which a
    # tl.multiple_of hint on a kernel argument is not.
    if VEC_IN > 1:
        d_in = (d_in // VEC_IN) * VEC_IN
    if VEC_OUT > 1:
        if IS_CONV:
            T = (T // VEC_OUT) * VEC_OUT
            g_stride_b = (g_stride_b // VEC_OUT) * VEC_OUT
            g_stride_c = (g_stride_c // VEC_OUT) * VEC_OUT
        else:
            d_out = (d_out // VEC_OUT) * VEC_OUT
    offs_o = (tile // tiles_k) * BLOCK_O + tl.arange(0, BLOCK_O)
    offs_k = (tile % tiles_k) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_t = tl.arange(0, BLOCK_T)
    mask_o = offs_o < d_out
    mask_k = offs_k < d_in

    if IS_CONV:
        # Column k = (c, kh, kw): its input pixel sits at (oh·stride_h + dy, ow·stride_w + dx).
        c = offs_k // (KH * KW)
        r = offs_k - c * (KH * KW)
        kh = r // KW
        dy = kh * dil_h - pad_h
        dx = (r - kh * KW) * dil_w - pad_w
        # Columns past d_in get a row offset that puts every position below the image: the
        # in-image test below masks them (dy >= -pad_h for real columns, oh·stride_h >= 0).
        dy = tl.where(mask_k, dy, H)
        # Sample and channel bases in int64 (a group's channel slice may sit past 2^31 elements);
        # the in-plane offsets fit in int32 (checked by the launcher).
        a_cols = a_ptr + i * a_stride_b + (c.to(tl.int64) * a_stride_c + dy * W + dx)[None, :]
        g_rows = g_ptr + i * g_stride_b + offs_o.to(tl.int64)[:, None] * g_stride_c
    else:
        # Sample bases in int64; offsets inside one sample fit in int32 (checked by the launcher).
        a_rows = a_ptr + i * T * d_in + offs_t[:, None] * d_in + offs_k[None, :]
        g_cols = g_ptr + i * T * d_out + offs_o[:, None] + offs_t[None, :] * d_out
    acc = tl.zeros([BLOCK_O, BLOCK_K], dtype=tl.float32)
    for t0 in range(0, T, BLOCK_T):
        in_t = offs_t < T - t0
        if IS_CONV:
            t = t0 + offs_t
            oh = t // W_out
            ow = t - oh * W_out
            # Positions past T: a row below the image (ih >= H for every column).
            ih0 = tl.where(in_t, oh * stride_h, H + pad_h)
            iw0 = ow * stride_w
            ih = ih0[:, None] + dy[None, :]
            iw = iw0[:, None] + dx[None, :]
            inside = (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            g_chunk = tl.load(g_rows + t[None, :], mask=mask_o[:, None] & in_t[None, :], other=0.0)
            a_chunk = tl.load(a_cols + (ih0 * W + iw0)[:, None], mask=inside, other=0.0)
        else:
            g_chunk = tl.load(g_cols, mask=mask_o[:, None] & in_t[None, :], other=0.0)
            a_chunk = tl.load(a_rows, mask=in_t[:, None] & mask_k[None, :], other=0.0)
            a_rows += BLOCK_T * d_in
            g_cols += BLOCK_T * d_out
        if a_chunk.dtype == tl.float32 or _UPCAST_DOT:
            # IEEE fp32 products and sums: no TF32 in a norm that drives a privacy clip.
            acc = tl.dot(g_chunk.to(tl.float32), a_chunk.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(g_chunk, a_chunk, acc)

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

#: The kernel's Conv2d arguments (``H`` ... ``g_stride_c``) in a linear launch: unused.
_NO_CONV = (0,) * 15


def _check_operand(name: str, x, dims: tuple[int, ...], shape: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
    if x.dim() not in dims:
        raise ValueError(f"{name} must be {shape}, got {x.dim()} dims {list(x.shape)}")
    if x.dtype not in TL_DTYPES:
        raise TypeError(f"{name} has dtype {x.dtype}; the triton kernel supports float32, float16, bfloat16")


def _check_pair(a, g, names: tuple[str, str]) -> None:
    if a.dtype != g.dtype:
        raise TypeError(f"{names[0]} ({a.dtype}) and {names[1]} ({g.dtype}) must have the same dtype")
    if a.device != g.device:
        raise ValueError(f"{names[0]} is on {a.device} but {names[1]} is on {g.device}")
    check_device(a.device)


def _check_matrix(x, name: str, d_out: int, d_in: int, device: torch.device, dims: str = "[d_out, d_in]",
                  operands: str = "a and g") -> None:  # fmt: skip
    if x is None:
        return
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"{name} must be None or a float32 tensor {dims}; got {type(x).__name__} "
            "(a rank-one (s_out, s_in) scale must be expanded to its dense product first)"
        )
    if x.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {x.dtype}")
    if tuple(x.shape) != (d_out, d_in):
        raise ValueError(f"{name} must be {dims} = [{d_out}, {d_in}], got {list(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but {operands} are on {device}")
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
        _check_operand(name, x, (2, 3), "[B, T, d] or [B, d]")
        if not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if a.dim() != g.dim() or a.shape[:-1] != g.shape[:-1]:
        raise ValueError(f"a {list(a.shape)} and g {list(g.shape)} must agree in [B, T]")
    _check_pair(a, g, ("a", "g"))
    device = a.device
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


class ConvGeometry(NamedTuple):
    """A Conv2d's geometry, every entry a pair ``(rows, columns)``."""

    kernel_size: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]


def _int_pair(name: str, v) -> tuple[int, int]:
    t = (v, v) if isinstance(v, int) and not isinstance(v, bool) else tuple(v) if isinstance(v, (tuple, list)) else ()
    if len(t) != 2 or not all(isinstance(e, int) and not isinstance(e, bool) for e in t):
        raise ValueError(f"{name} must be an int or a pair of ints, got {v!r}")
    return (int(t[0]), int(t[1]))


def _plane_contiguous(x: torch.Tensor) -> bool:
    """Each ``[.., .., rows, cols]`` plane of ``x`` is one contiguous row-major block."""
    return (x.shape[3] <= 1 or x.stride(3) == 1) and (x.shape[2] <= 1 or x.stride(2) == x.shape[3])


def conv2d_sumsq_tiled(
    x: torch.Tensor,
    g: torch.Tensor,
    kernel_size,
    stride=1,
    padding=0,
    dilation=1,
    scale: torch.Tensor | None = None,
    shift: torch.Tensor | None = None,
) -> torch.Tensor:
    """``‖S ⊙ (G_iᵀA_i − M)‖²`` per sample of one Conv2d group, fp32 ``[B]``: the linear case over the
    im2col patches ``A_i`` of ``x``, read in place (implicit im2col; neither the patches nor
    ``G_iᵀA_i`` are materialised).

    Args:
        x: layer input ``[B, C, H, W]``: fp32, fp16 or bf16, each channel's ``H × W`` plane
            contiguous, any batch and channel strides (a group's channel slice of a contiguous
            tensor is read as it is).
        g: output gradient ``[B, O, H_out, W_out]``, same dtype and device, planes contiguous.
        kernel_size, stride, padding, dilation: ints or pairs (kernel, stride, dilation >= 1,
            padding >= 0); ``H_out``/``W_out`` must be the convolution's output size.
        scale, shift: ``None`` or contiguous fp32 ``[O, C·kh·kw]`` (a group's rows of a
            weight-shaped tensor, flattened).

    Position ``t = (oh, ow)``, column ``k = (c, kh, kw)`` in ``weight[o].flatten()`` order, value
    ``x[i, c, oh·sh − ph + kh·dh, ow·sw − pw + kw·dw]`` or 0 outside the image: the semantics of
    ``dpkernels.reference.layers.conv2d_sumsq`` (one group). Numerics as :func:`linear_sumsq_tiled`.
    """
    _check_operand("x", x, (4,), "[B, C, H, W]")
    _check_operand("g", g, (4,), "[B, O, H_out, W_out]")
    if x.shape[0] != g.shape[0]:
        raise ValueError(f"x {list(x.shape)} and g {list(g.shape)} must have the same batch size")
    _check_pair(x, g, ("x", "g"))
    geom = ConvGeometry(*(_int_pair(n, v) for n, v in (("kernel_size", kernel_size), ("stride", stride),
                                                        ("padding", padding), ("dilation", dilation))))  # fmt: skip
    if min(geom.kernel_size) < 1 or min(geom.stride) < 1 or min(geom.dilation) < 1:
        raise ValueError(f"kernel_size, stride and dilation must be positive, got {geom}")
    if min(geom.padding) < 0:
        raise ValueError(f"padding must be non-negative, got {geom.padding}")
    B, C, H, W = x.shape
    C_out = g.shape[1]
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = geom
    span = (H + 2 * ph - dh * (kh - 1) - 1, W + 2 * pw - dw * (kw - 1) - 1)
    if min(span) < 0:
        raise ValueError(f"the kernel {geom.kernel_size} (dilation {geom.dilation}) is larger than the padded "
                         f"input {list(x.shape)} (padding {geom.padding})")  # fmt: skip
    out = [span[0] // sh + 1, span[1] // sw + 1]
    if list(g.shape[2:]) != out:
        raise ValueError(f"g's spatial size {list(g.shape[2:])} is not the convolution's output size {out} "
                         f"for x {list(x.shape)} and {geom}")  # fmt: skip
    if not _plane_contiguous(x):
        raise ValueError(f"each channel of x must be a contiguous H x W plane, got strides {x.stride()}")
    if not _plane_contiguous(g):
        raise ValueError(f"each channel of g must be a contiguous H_out x W_out plane, got strides {g.stride()}")
    device = x.device
    d_in = C * kh * kw
    _check_matrix(scale, "scale", C_out, d_in, device, "[O, C·kh·kw]", "x and g")
    _check_matrix(shift, "shift", C_out, d_in, device, "[O, C·kh·kw]", "x and g")
    # In-plane offsets are int32 in the kernel (rows and columns of the padded plane, past-the-end
    # sentinels included); sample and channel offsets are int64.
    if C_out * d_in > _INT32_MAX or (H + 2 * ph + 1) * (W + 2 * pw + 1) > _INT32_MAX:
        raise ValueError(f"O·C·kh·kw and the padded plane (H + 2·pad + 1)·(W + 2·pad + 1) must each be below 2^31 "
                         f"(x {list(x.shape)}, g {list(g.shape)}, {geom})")  # fmt: skip
    if B == 0 or d_in == 0 or C_out == 0:
        return torch.zeros(B, dtype=torch.float32, device=device)
    blocks = INTERPRETER_LINEAR_BLOCKS if interpreting() else CONV_BLOCKS[x.dtype]
    return _launch_conv(x, g, geom, scale, shift, blocks)


def _launch(a, g, scale, shift, blocks: LinearBlocks) -> torch.Tensor:
    """Runs the kernel with tile config ``blocks`` on validated, non-empty 3-D linear inputs."""
    B, T, d_in = a.shape
    d_out = g.shape[2]
    vec = VEC_BYTES // a.dtype.itemsize  # a multiple of 4: fp32 scale/shift rows align with d_in
    vec_in, vec_out = (vec if d_in % vec == 0 else 1), (vec if d_out % vec == 0 else 1)
    return _run(a, g, scale, shift, blocks, B, T, d_in, d_out, _NO_CONV, False, vec_in, vec_out)


def _launch_conv(x, g, geom: ConvGeometry, scale, shift, blocks: LinearBlocks) -> torch.Tensor:
    """Runs the kernel (``IS_CONV``) with tile config ``blocks`` on validated, non-empty conv inputs."""
    B, C, H, W = x.shape
    C_out, H_out, W_out = g.shape[1:]
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = geom
    T, d_in = H_out * W_out, C * kh * kw
    vec = VEC_BYTES // x.dtype.itemsize
    vec_in = vec if d_in % vec == 0 else 1
    # g's channel planes are whole, aligned vectors when T and both strides are multiples of one.
    vec_out = vec if T % vec == 0 and g.stride(0) % vec == 0 and g.stride(1) % vec == 0 else 1
    conv = (H, W, W_out, kh, kw, sh, sw, ph, pw, dh, dw, x.stride(0), x.stride(1), g.stride(0), g.stride(1))
    return _run(x, g, scale, shift, blocks, B, T, d_in, C_out, conv, True, vec_in, vec_out)


def _run(a, g, scale, shift, blocks: LinearBlocks, B, T, d_in, d_out, conv, is_conv, vec_in, vec_out) -> torch.Tensor:
    """The launches (row slices of at most ``_MAX_GRID_Y`` samples) and the partials' reduction."""
    tiles_k = triton.cdiv(d_in, blocks.BLOCK_K)
    n_tiles = triton.cdiv(d_out, blocks.BLOCK_O) * tiles_k
    partial = torch.empty((B, n_tiles), dtype=torch.float32, device=a.device)
    # A null-free stand-in for an absent scale/shift (never read: HAS_SCALE/HAS_SHIFT are off).
    scale_arg = scale if scale is not None else partial
    shift_arg = shift if shift is not None else partial
    with device_guard(a.device):
        for row0 in range(0, B, _MAX_GRID_Y):
            rows = min(_MAX_GRID_Y, B - row0)
            _linear_sumsq_kernel[(n_tiles, rows)](
                a, g, scale_arg, shift_arg, partial, T, d_in, d_out, tiles_k, n_tiles, row0, *conv,
                HAS_SCALE=scale is not None, HAS_SHIFT=shift is not None, IS_CONV=is_conv,
                BLOCK_O=blocks.BLOCK_O, BLOCK_K=blocks.BLOCK_K, BLOCK_T=blocks.BLOCK_T,
                VEC_IN=vec_in, VEC_OUT=vec_out, num_warps=blocks.num_warps, **LINEAR_COMPILE_OPTIONS,
            )  # fmt: skip
    # Fixed-order float64 reduction of each sample's partials (torch reductions use no atomics).
    return partial.sum(dim=1, dtype=torch.float64).to(torch.float32)
