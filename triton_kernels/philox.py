"""Philox4x32-10 and Box–Muller as ``@triton.jit`` functions, shared by the tile normals of
``common.py`` (the noise, filter and optimizer-step kernels) and the private weighted sum
(``clip.py``); the Triton twin of ``csrc/include/dpkernels/philox.h``. Spec and accuracy notes:
docs/RNG.md and ``noise.py``.
"""

import triton
import triton.language as tl

# Philox4x32-10 (Random123); mirrors dpkernels/reference/noise.py.
PHILOX_M0 = tl.constexpr(0xD2511F53)
PHILOX_M1 = tl.constexpr(0xCD9E8D57)
PHILOX_W0 = tl.constexpr(0x9E3779B9)
PHILOX_W1 = tl.constexpr(0xBB67AE85)
PHILOX_ROUNDS = tl.constexpr(10)
MASK32 = tl.constexpr(0xFFFFFFFF)

TWO_POW_M32 = tl.constexpr(2.0**-32)
TWO_POW_M33 = tl.constexpr(2.0**-33)
TWO_PI = tl.constexpr(6.2831853071795865)  # rounded to float32 in the kernel, as in the spec
TWO_OVER_PI = tl.constexpr(0.6366197723675814)
# π/2 = C1 + C2 + C3: C1 has 8 significant bits and C2 11, so j·C1 and j·C2 are exact for
# j <= 4 and θ − j·C1 is exact (Sterbenz); C3 carries the rest (Cephes sinf's DP1..3, doubled).
PIO2_C1 = tl.constexpr(1.5703125)
PIO2_C2 = tl.constexpr(4.837512969970703125e-4)
PIO2_C3 = tl.constexpr(7.54978995489188216e-8)
# Cephes sinf/cosf minimax polynomials on [-π/4, π/4].
SIN_P0 = tl.constexpr(-1.6666654611e-1)
SIN_P1 = tl.constexpr(8.3321608736e-3)
SIN_P2 = tl.constexpr(-1.9515295891e-4)
COS_P0 = tl.constexpr(4.166664568298827e-2)
COS_P1 = tl.constexpr(-1.388731625493765e-3)
COS_P2 = tl.constexpr(2.443315711809948e-5)


@triton.jit
def _mulhilo(a, m):
    """High and low words of the 64-bit product of uint32 ``a`` and the constant ``m``."""
    # One widening multiply (mul.wide.u32 on GPU). A 64-bit product also keeps Triton's
    # overflow sanitizer (debug mode) away from the intended uint32 wraparound.
    p = a.to(tl.uint64) * m
    return (p >> 32).to(tl.uint32), p.to(tl.uint32)


@triton.jit
def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on uint32 counters; ``k0``/``k1``: the key halves as int64 scalars."""
    for r in tl.static_range(PHILOX_ROUNDS):
        # Round keys in int64, reduced mod 2^32 (no uint32 wraparound on scalars; on GPU this
        # folds to 32-bit adds).
        rk0 = ((k0 + r * PHILOX_W0) & MASK32).to(tl.uint32)
        rk1 = ((k1 + r * PHILOX_W1) & MASK32).to(tl.uint32)
        hi0, lo0 = _mulhilo(c0, PHILOX_M0)
        hi1, lo1 = _mulhilo(c2, PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ rk0, lo1, hi0 ^ c3 ^ rk1, lo0
    return c0, c1, c2, c3


@triton.jit
def box_muller(a, b):
    """Normals ``(r cos θ, r sin θ)`` from uint32 word pairs ``(a, b)``, elementwise, fp32.

    ``u = float32(x)·2⁻³² + 2⁻³³`` (round-to-nearest conversion, exact product), ``r =
    sqrt(−2 ln u_a)``, ``θ = fl(2π_f · u_b)``; cos/sin as described at the top of the file.
    """
    u_a = a.to(tl.float32) * TWO_POW_M32 + TWO_POW_M33
    u_b = b.to(tl.float32) * TWO_POW_M32 + TWO_POW_M33
    r = tl.sqrt_rn(-2.0 * tl.log(u_a))
    theta = TWO_PI * u_b
    # θ = j·π/2 + x with j = round(θ·2/π) in 0..4 (truncation rounds: θ >= 0), |x| <= π/4.
    j = (theta * TWO_OVER_PI + 0.5).to(tl.int32)
    jf = j.to(tl.float32)
    x = theta - jf * PIO2_C1
    x = x - jf * PIO2_C2
    x = x - jf * PIO2_C3
    x2 = x * x
    s = x * x2 * ((SIN_P2 * x2 + SIN_P1) * x2 + SIN_P0) + x
    c = ((COS_P2 * x2 + COS_P1) * x2 + COS_P0) * x2 * x2 - 0.5 * x2 + 1.0
    # Rotate by the quadrant q = j mod 4: (cos θ, sin θ) = (c, s), (−s, c), (−c, −s), (s, −c).
    q = j & 3
    swap = (q & 1) != 0
    r_cos = tl.where(((q + 1) & 2) != 0, -r, r)
    r_sin = tl.where((q & 2) != 0, -r, r)
    return r_cos * tl.where(swap, s, c), r_sin * tl.where(swap, c, s)
