"""ChaCha20 (RFC 8439 §2.3) and the float64 Box–Muller of dpkernels' secure noise mode as
``@triton.jit`` functions; the Triton twin of ``csrc/include/dpkernels/chacha20.h``. Spec:
docs/RNG.md §6; reference: ``dpkernels/reference/noise.py``.

State words are ``tl.uint32`` tensors (additions wrap mod 2³², rotations are two logical shifts
and an or), so the words are bit-identical to the reference. Box–Muller is float64: ``log`` and
``sqrt`` (``sqrt.rn.f64``) of the uniform, then ``cos``/``sin`` of ``θ = 2π u``. Compiled for a GPU, the angle
goes through libdevice's ``__nv_cospi``/``__nv_sinpi`` of ``2u`` (as ``sincospi`` in the CUDA
kernel): their range reduction is exact and has no Payne–Hanek slow path, so no local memory;
the Triton interpreter has no libdevice and uses ``tl.cos``/``tl.sin`` of the float64 ``θ``. The
two differ by the rounding of ``θ``, below 1e-15 on ``z``.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from .common import interpreting

CHACHA_C0 = tl.constexpr(0x61707865)
CHACHA_C1 = tl.constexpr(0x3320646E)
CHACHA_C2 = tl.constexpr(0x79622D32)
CHACHA_C3 = tl.constexpr(0x6B206574)
TWO_POW_M53 = tl.constexpr(2.0**-53)
TWO_POW_M54 = tl.constexpr(2.0**-54)
TWO_PI_F64 = tl.constexpr(6.283185307179586)
# The interpreter has no libdevice.
_USE_LIBDEVICE = tl.constexpr(not interpreting())


@triton.jit
def _rotl(x, n: tl.constexpr):
    return (x << n) | (x >> (32 - n))


@triton.jit
def _quarter_round(a, b, c, d):
    a = a + b
    d = _rotl(d ^ a, 16)
    c = c + d
    b = _rotl(b ^ c, 12)
    a = a + b
    d = _rotl(d ^ a, 8)
    c = c + d
    b = _rotl(b ^ c, 7)
    return a, b, c, d


@triton.jit
def chacha20_block(blocks, key):
    """The 16 uint32 output words of ChaCha20 blocks ``blocks`` (int64 tensor of block indices).

    ``key``: pointer to int64 ``[10]`` = the eight little-endian key words, step, stream (each in
    [0, 2³²)). State = (constants, key, block low, block high, step, stream).
    """
    z = tl.zeros(blocks.shape, tl.uint32)
    i0 = z + CHACHA_C0
    i1 = z + CHACHA_C1
    i2 = z + CHACHA_C2
    i3 = z + CHACHA_C3
    i4 = z + tl.load(key + 0).to(tl.uint32)
    i5 = z + tl.load(key + 1).to(tl.uint32)
    i6 = z + tl.load(key + 2).to(tl.uint32)
    i7 = z + tl.load(key + 3).to(tl.uint32)
    i8 = z + tl.load(key + 4).to(tl.uint32)
    i9 = z + tl.load(key + 5).to(tl.uint32)
    i10 = z + tl.load(key + 6).to(tl.uint32)
    i11 = z + tl.load(key + 7).to(tl.uint32)
    i12 = (blocks & 0xFFFFFFFF).to(tl.uint32)
    i13 = (blocks >> 32).to(tl.uint32)
    i14 = z + tl.load(key + 8).to(tl.uint32)
    i15 = z + tl.load(key + 9).to(tl.uint32)
    x0, x1, x2, x3, x4, x5, x6, x7 = i0, i1, i2, i3, i4, i5, i6, i7
    x8, x9, x10, x11, x12, x13, x14, x15 = i8, i9, i10, i11, i12, i13, i14, i15
    for _ in range(10):  # double rounds: columns, then diagonals
        x0, x4, x8, x12 = _quarter_round(x0, x4, x8, x12)
        x1, x5, x9, x13 = _quarter_round(x1, x5, x9, x13)
        x2, x6, x10, x14 = _quarter_round(x2, x6, x10, x14)
        x3, x7, x11, x15 = _quarter_round(x3, x7, x11, x15)
        x0, x5, x10, x15 = _quarter_round(x0, x5, x10, x15)
        x1, x6, x11, x12 = _quarter_round(x1, x6, x11, x12)
        x2, x7, x8, x13 = _quarter_round(x2, x7, x8, x13)
        x3, x4, x9, x14 = _quarter_round(x3, x4, x9, x14)
    return (
        x0 + i0, x1 + i1, x2 + i2, x3 + i3, x4 + i4, x5 + i5, x6 + i6, x7 + i7,
        x8 + i8, x9 + i9, x10 + i10, x11 + i11, x12 + i12, x13 + i13, x14 + i14, x15 + i15,
    )  # fmt: skip


@triton.jit
def uniform53(lo, hi):
    """float64 ``(v >> 11)·2⁻⁵³ + 2⁻⁵⁴`` for ``v = hi·2³² + lo`` (uint32 tensors): in [2⁻⁵⁴, 1]."""
    m = (hi.to(tl.uint64) << 21) | (lo >> 11).to(tl.uint64)
    return m.to(tl.float64) * TWO_POW_M53 + TWO_POW_M54


@triton.jit
def box_muller64(a_lo, a_hi, b_lo, b_hi):
    """float64 ``(r cos θ, r sin θ)``, ``r = sqrt(−2 ln u_a)``, ``θ = 2π u_b`` (see the module doc)."""
    r = tl.sqrt(-2.0 * tl.log(uniform53(a_lo, a_hi)))
    u_b = uniform53(b_lo, b_hi)
    if _USE_LIBDEVICE:
        c = libdevice.cospi(2.0 * u_b)
        s = libdevice.sinpi(2.0 * u_b)
    else:
        theta = TWO_PI_F64 * u_b
        c = tl.cos(theta)
        s = tl.sin(theta)
    return r * c, r * s
