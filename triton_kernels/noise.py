"""Triton kernels for dpkernels' counter-based Gaussian noise (spec: docs/RNG.md).

Same words and the same Gaussians as ``dpkernels/reference/noise.py`` (the ground truth) and
``csrc/include/dpkernels/philox.h``:

- Philox4x32-10, key = the 64-bit ``seed``, counter = (block low, block high, ``step``,
  ``stream``) with ``block = e // 4`` for the global flat element index ``e``; element ``e`` takes
  word ``e % 4``. The words are bit-identical to the reference (``tl.uint32`` state; each
  32×32-bit product is one zero-extended 64-bit multiply split into its halves, which is
  ``mul.wide.u32`` on GPU and fewer SASS instructions than ``tl.umulhi`` plus a low multiply).
- Box–Muller on the word pairs (w0, w1) and (w2, w3) of a block, fp32: ``u = float32(x)·2⁻³² +
  2⁻³³``, ``r = sqrt(−2 ln u_first)``, ``θ = 2π u_second``, ``z = (r cos θ, r sin θ)``.

Work split: a program handles one *tile* of ``NOISE_BLOCK`` consecutive elements of one tensor,
and tiles are aligned to Philox blocks in the **global** index (a tensor's first tile starts at
its first element rounded down to a multiple of 4, masked below it). A tile therefore needs
exactly ``NOISE_BLOCK / 4`` Philox calls and uses all four words of each; a block straddling two
tensors is computed by a tile of each, and each element still gets its own word. The four words
(or normals) of a block are interleaved into element order with ``tl.join`` + ``tl.reshape``, so
each GPU thread owns whole blocks: 4 consecutive elements, one 128-bit load/store for fp32
when the tensor is *aligned* (16-byte aligned storage, first element on a Philox block
boundary, numel a multiple of the vector width). For 16-bit dtypes (8 elements per 128-bit
vector) and the int64 words, Triton re-lays the values out through shared memory before the
128-bit stores. Tensors that are not aligned take the same kernel with narrow accesses (and a
shared-memory re-layout); the noise is the same, only slower.

Multi-tensor launches use the machinery of ``common.py`` (shared with the other families, which
draw the same normals from the same tiles): tensors are grouped by (dtype, alignment), each group
is one launch over a tile table (tensor slot, first local element) with the tensors' addresses,
numels and global base indices in int64 tables; the key and counter fields travel in the same
int64 metadata tensor, so one host-to-device copy carries everything and the compiled kernel
does not specialise on seed/step/stream values.

Numerics:

- ``log`` is ``tl.log`` (on GPU, Triton 3.8 lowers it to libdevice's ``__nv_logf``, ≤ 1 ulp,
  not ``lg2.approx``) and ``sqrt`` is
  ``tl.sqrt_rn`` (IEEE ``sqrt.rn.f32``, as torch; ``tl.sqrt`` would be ``sqrt.approx``).
- ``sin``/``cos`` are evaluated here rather than with ``tl.sin``/``tl.cos``: on GPU those lower to
  libdevice ``__nv_sinf``/``__nv_cosf`` (accurate, but each carries a Payne–Hanek slow path with a
  local-memory array and its own range reduction). ``θ`` is formed exactly as in the reference,
  ``fl(2π_f · u)`` with ``2π_f = float32(2π)``, then reduced once for both by ``j·π/2`` (``j =
  round(θ·2/π) ∈ 0..4``; three-part Cody–Waite constant whose first two parts make ``j·C`` exact
  without FMA, so the interpreter and the GPU agree) and fed to Cephes' ``sinf``/``cosf``
  polynomials on [−π/4, π/4]. Checked exhaustively over every possible ``u`` (all 5·2²⁴ distinct
  fp32 values of ``float32(x)``), with and without FMA contraction: |error| ≤ 7.8e-8 against
  fp64 ``cos``/``sin`` of the fp32 ``θ`` and ≤ 6.0e-8 against torch's fp32 ``cos``/``sin``,
  i.e. ≤ 4.1e-7 on ``z`` at the largest ``r = 6.7637``. Over 2²² draws the interpreted kernel is
  within 9.6e-7 of the reference (68 % bit-identical) and 5.8e-7 of an fp64 Box–Muller on the
  same words (the reference: 6.0e-7).
- ``std · z`` is fp32 and rounded once to the output dtype. On GPU, ptxas may contract
  ``x + std·z`` of ``add_gaussian_noise_`` into one FMA (as nvcc does for the CUDA kernel), which
  can differ from the reference's two roundings by 1 ulp of the fp32 sum.
- bf16 outputs: the interpreter converts fp32→bf16 by truncation, so under the interpreter the
  kernel rounds to nearest-even with integer ops itself; compiled kernels use ``cvt.rn.bf16``.

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
    PHILOX_ELEMS,
    TL_DTYPES,
    VEC_BYTES,
    Group,
    MetaTable,
    check_counter,
    check_device,
    device_guard,
    group_tensors,
    interpreting,
    philox_normals,
    philox_words,
    round_to,
    tile,
    tile_block,
    tiles,
    typed_ptr,
)

# ---------------------------------------------------------------------------------------------
# Launch constants
# ---------------------------------------------------------------------------------------------

#: Elements per program (NOISE_BLOCK / 4 Philox calls), a multiple of 8 so that an aligned tile
#: splits into whole 128-bit vectors for every dtype. 4096 over 8 warps: each GPU thread works
#: on 4 independent Philox blocks (16 elements).
NOISE_BLOCK = 4096
NOISE_NUM_WARPS = 8

#: ChaCha20 blocks per program of ``_chacha_kernel`` (one per GPU thread at 4 warps): a tile is
#: ``16 ·`` that many words or ``8 ·`` that many normals.
CHACHA_BLOCKS = 128
CHACHA_NUM_WARPS = 4
#: Under the interpreter (see ``common.INTERPRETER_TILE_BLOCK``).
INTERPRETER_CHACHA_BLOCKS = 1 << 12

#: Kernel modes: raw words to int64, ``out = std·z``, ``x += std·z``.
MODE_WORDS, MODE_FILL, MODE_ADD = 0, 1, 2

_WORDS_DTYPE = torch.int64
_ALL_DTYPES = {**TL_DTYPES, _WORDS_DTYPE: tl.int64}


# =============================================================================================
# Kernels
# =============================================================================================


@triton.jit
def _noise_kernel(
    ptrs,
    numels,
    bases,
    tile_slot,
    tile_start,
    key,
    std,
    MODE: tl.constexpr,
    ELEM: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
    VEC: tl.constexpr,
):
    """One tile of ``BLOCK`` elements of tensor ``t``: words, ``std·z``, or ``x += std·z``.

    Grid ``(num_tiles,)``. ``ptrs``/``numels``/``bases``: int64 ``[T]``, the address (``ELEM``
    elements), element count and global index of element 0 of each tensor; ``tile_slot`` /
    ``tile_start``: int64 ``[num_tiles]``, the tensor and the local index of the tile's first
    element (negative for a first tile that starts inside the previous tensor's last block;
    ``bases[t] + tile_start`` is a multiple of 4); ``key``: int64 ``[4]`` = (seed low, seed
    high, step, stream). ``MODE``: ``MODE_WORDS`` stores the uint32 words as int64 (``ELEM`` =
    int64), ``MODE_FILL`` stores ``std·z``, ``MODE_ADD`` adds it to the fp32 value of each element.
    ``ALIGNED``: the address is 16-byte aligned, ``numels[t]`` a multiple of ``VEC`` (elements
    per 128-bit vector) and ``bases[t]`` of 4, so tiles start at local multiples of ``BLOCK``.
    """
    t, start, idx, mask = tile(tile_slot, tile_start, numels, ALIGNED, VEC, BLOCK)
    w0, w1, w2, w3 = philox_words(bases, t, start, key, BLOCK)
    p = typed_ptr(ptrs, t, ELEM, ALIGNED)
    if MODE == 0:
        # join(join(w0, w2), join(w1, w3))[b, i, j] = w_{2i+j}: element order, each thread
        # keeps the 4 words of its blocks.
        words = tl.join(tl.join(w0, w2), tl.join(w1, w3))
        tl.store(p + idx, tl.reshape(words, [BLOCK]).to(tl.int64), mask=mask)
    else:
        v = std * philox_normals(w0, w1, w2, w3, BLOCK)
        if MODE == 2:
            v += tl.load(p + idx, mask=mask, other=0.0).to(tl.float32)
        tl.store(p + idx, round_to(v, ELEM), mask=mask)


@triton.jit
def _round_once(v, dtype: tl.constexpr):
    """float64 ``v`` rounded once to ``dtype``: directly to fp32; to fp16/bf16 through fp32 with
    round-to-odd (truncate, set the last bit when inexact), which then rounds like one rounding
    of ``v`` (fp32 has >= 13 more significand bits; Boldo & Melquiond 2008)."""
    f = v.to(tl.float32)
    if dtype == tl.float32:
        return f
    else:
        bits = f.to(tl.uint32, bitcast=True)
        bits = tl.where(tl.abs(f.to(tl.float64)) > tl.abs(v), bits - 1, bits)  # toward zero
        bits = tl.where(bits.to(tl.float32, bitcast=True).to(tl.float64) != v, bits | 1, bits)
        return round_to(bits.to(tl.float32, bitcast=True), dtype)


@triton.jit
def _interleave8(z0, z1, z2, z3, z4, z5, z6, z7):
    """``[N, 2, 2, 2]`` with ``[b, i, j, k] = z_{4i+2j+k}``: row-major order is element order."""
    return tl.join(tl.join(tl.join(z0, z4), tl.join(z2, z6)), tl.join(tl.join(z1, z5), tl.join(z3, z7)))


@triton.jit
def _chacha_kernel(
    ptrs,
    numels,
    bases,
    tile_slot,
    tile_start,
    key,
    MODE: tl.constexpr,
    ELEM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Secure mode (docs/RNG.md §6): one tile of ``BLOCK`` elements of tensor ``t``.

    Same tile table as ``_noise_kernel`` with tiles aligned to whole ChaCha20 groups in the
    global index: 16 elements per block for ``MODE_WORDS`` (element ``e`` takes word ``e % 16`` of
    block ``e // 16``), 8 for the normals (normal ``e % 8`` of block ``e // 8``). ``key``: int64
    ``[11]`` = the eight key words, step, stream, and the bits of the float64 ``std``.
    ``MODE_FILL`` stores ``std·z`` and ``MODE_ADD`` adds it to the element, in float64, rounded
    once to ``ELEM``.
    """
    pid = tl.program_id(0).to(tl.int64)
    t = tl.load(tile_slot + pid)
    start = tl.load(tile_start + pid)
    n = tl.load(numels + t)
    base = tl.load(bases + t)
    idx = start + tl.arange(0, BLOCK)
    mask = (idx >= 0) & (idx < n)
    p = tl.load(ptrs + t).to(tl.pointer_type(ELEM))
    if MODE == 0:
        blocks = ((base + start) >> 4) + tl.arange(0, BLOCK // 16)
        x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = chacha20_block(blocks, key)
        # [b, i, j, k, l] = x_{8i+4j+2k+l}: element order.
        words = tl.join(
            _interleave8(x0, x2, x4, x6, x8, x10, x12, x14), _interleave8(x1, x3, x5, x7, x9, x11, x13, x15)
        )
        tl.store(p + idx, tl.reshape(words, [BLOCK]).to(tl.int64), mask=mask)
    else:
        blocks = ((base + start) >> 3) + tl.arange(0, BLOCK // 8)
        x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = chacha20_block(blocks, key)
        z0, z1 = box_muller64(x0, x1, x2, x3)
        z2, z3 = box_muller64(x4, x5, x6, x7)
        z4, z5 = box_muller64(x8, x9, x10, x11)
        z6, z7 = box_muller64(x12, x13, x14, x15)
        std = tl.load(key + 10).to(tl.float64, bitcast=True)
        v = std * tl.reshape(_interleave8(z0, z1, z2, z3, z4, z5, z6, z7), [BLOCK])
        if MODE == 2:
            v += tl.load(p + idx, mask=mask, other=0.0).to(tl.float64)
        tl.store(p + idx, _round_once(v, ELEM), mask=mask)


# =============================================================================================
# Host side
# =============================================================================================


def _check(tensors: Sequence[torch.Tensor], dtypes, what: str) -> torch.device:
    device = tensors[0].device
    check_device(device)
    for i, x in enumerate(tensors):
        if x.dtype not in dtypes:
            raise TypeError(f"{what}[{i}] has dtype {x.dtype}; expected one of {tuple(dtypes)}")
        if x.device != device:
            raise ValueError(f"{what}[{i}] is on {x.device} but {what}[0] is on {device}")
        if not x.is_contiguous():
            raise ValueError(f"{what}[{i}] must be contiguous (written in place)")
    return device


def _groups(tensors: Sequence[torch.Tensor], offset: int) -> list[Group]:
    """Non-empty tensors grouped by (dtype, alignment), with each tensor's global base index
    (element 0 of ``tensors[0]`` is ``offset``); slots index ``tensors``."""
    return group_tensors([x.numel() for x in tensors], [[x] for x in tensors], offset)


def _add_tile_table(meta: MetaTable, tensors, bases, block: int, rng_block: int = PHILOX_ELEMS) -> tuple[tuple, int]:
    """Adds one launch's tables to ``meta`` (data pointers, numels, global bases, tile slots and
    starts, the noise kernels' argument order); returns their handles and the tile count."""
    numels = [x.numel() for x in tensors]
    slots, starts = tiles(numels, bases, block, rng_block)
    tables = ([x.data_ptr() for x in tensors], numels, bases, slots, starts)
    return tuple(meta.add(x) for x in tables), slots.numel()


def _launch(tensors: Sequence[torch.Tensor], std: float, counter: list[int], offset: int, mode: int) -> None:
    groups = _groups(tensors, offset)
    if not groups:
        return
    block = tile_block(NOISE_BLOCK)
    meta = MetaTable()
    key_h = meta.add(counter)
    launches = []
    for grp in groups:
        launches.append((grp, *_add_tile_table(meta, [tensors[s] for s in grp.slots], grp.bases, block)))
    device = tensors[0].device
    meta.finish(device)
    with device_guard(device):
        for grp, h, n_tiles in launches:
            _noise_kernel[(n_tiles,)](
                *(meta[x] for x in h), meta[key_h], float(std),
                MODE=mode, ELEM=_ALL_DTYPES[grp.dtype], BLOCK=block, ALIGNED=grp.aligned,
                VEC=VEC_BYTES // grp.dtype.itemsize, num_warps=NOISE_NUM_WARPS,
            )  # fmt: skip


# =============================================================================================
# Host functions (called by dpkernels/noise.py)
# =============================================================================================


def philox_uint32_(out: torch.Tensor, seed: int, step: int, stream: int = 0, offset: int = 0) -> torch.Tensor:
    """``out[i]`` = the Philox word of element ``offset + i``, in [0, 2³²); ``out``: contiguous int64."""
    _check([out], (_WORDS_DTYPE,), "out")
    _launch([out], 0.0, check_counter(seed, step, stream, offset), offset, MODE_WORDS)
    return out


def gaussian_fill_(
    out: torch.Tensor, std: float, seed: int, step: int, stream: int = 0, offset: int = 0
) -> torch.Tensor:
    """``out[i] = std · z(offset + i)``, computed in fp32 and rounded once to ``out``'s dtype."""
    _check([out], TL_DTYPES, "out")
    _launch([out], std, check_counter(seed, step, stream, offset), offset, MODE_FILL)
    return out


def add_gaussian_noise_(
    tensors: Sequence[torch.Tensor], std: float, seed: int, step: int, stream: int = 0, offset: int = 0
) -> list[torch.Tensor]:
    """In place: ``tensors[t][i] += std · z(offset + Σ_{s<t} numel(tensors[s]) + i)``.

    The sum is formed in fp32 and rounded once. One launch per (dtype, alignment) group.
    """
    tensors = list(tensors)
    if not tensors:
        return tensors
    _check(tensors, TL_DTYPES, "tensors")
    _launch(tensors, std, check_counter(seed, step, stream, offset), offset, MODE_ADD)
    return tensors


def _chacha_launch(
    tensors: Sequence[torch.Tensor], std: float, key: int, step: int, stream: int, offset: int, mode: int
):
    check_counter(0, step, stream, offset)
    if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < 2**256:
        raise ValueError(f"key must be an integer in [0, 2^256), got {key!r}")
    groups = _groups(tensors, offset)
    if not groups:
        return
    per_block = 16 if mode == MODE_WORDS else 8
    block = per_block * (INTERPRETER_CHACHA_BLOCKS if interpreting() else CHACHA_BLOCKS)
    meta = MetaTable()
    std_bits = struct.unpack("<q", struct.pack("<d", float(std)))[0]
    key_h = meta.add([(key >> (32 * i)) & 0xFFFFFFFF for i in range(8)] + [step, stream, std_bits])
    launches = []
    by_dtype: dict[torch.dtype, tuple[list, list]] = {}
    for grp in groups:  # alignment does not matter here: one launch per dtype
        ts, bs = by_dtype.setdefault(grp.dtype, ([], []))
        ts += [tensors[s] for s in grp.slots]
        bs += grp.bases
    for dtype, (ts, bs) in by_dtype.items():
        launches.append((dtype, *_add_tile_table(meta, ts, bs, block, per_block)))
    device = tensors[0].device
    meta.finish(device)
    with device_guard(device):
        for dtype, h, n_tiles in launches:
            _chacha_kernel[(n_tiles,)](
                *(meta[x] for x in h), meta[key_h], MODE=mode, ELEM=_ALL_DTYPES[dtype], BLOCK=block,
                num_warps=CHACHA_NUM_WARPS,
            )  # fmt: skip


def chacha20_uint32_(out: torch.Tensor, key: int, step: int, stream: int = 0, offset: int = 0) -> torch.Tensor:
    """``out[i]`` = the ChaCha20 word of element ``offset + i``; ``key``: 256-bit int; ``out``: int64."""
    _check([out], (_WORDS_DTYPE,), "out")
    _chacha_launch([out], 0.0, key, step, stream, offset, MODE_WORDS)
    return out


def chacha20_gaussian_fill_(
    out: torch.Tensor, std: float, key: int, step: int, stream: int = 0, offset: int = 0
) -> torch.Tensor:
    """``out[i] = std · z(offset + i)``, ChaCha20 normals, float64, rounded once to ``out``'s dtype."""
    _check([out], TL_DTYPES, "out")
    _chacha_launch([out], std, key, step, stream, offset, MODE_FILL)
    return out


def chacha20_add_gaussian_noise_(
    tensors: Sequence[torch.Tensor], std: float, key: int, step: int, stream: int = 0, offset: int = 0
) -> list[torch.Tensor]:
    """In place, secure mode: ``tensors[t][i] += std · z(global index)``, float64, rounded once."""
    tensors = list(tensors)
    if not tensors:
        return tensors
    _check(tensors, TL_DTYPES, "tensors")
    _chacha_launch(tensors, std, key, step, stream, offset, MODE_ADD)
    return tensors
