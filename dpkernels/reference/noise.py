"""Pure-PyTorch reference for dpkernels' counter-based Gaussian noise (spec: docs/RNG.md).

Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11):

- key ``(k0, k1)`` = the 64-bit ``seed`` (low word, high word);
- counter ``(c0, c1, c2, c3)`` = (block low word, block high word, ``step``, ``stream``), where
  ``block = e // 4`` for the global flat element index ``e = offset + i``;
- element ``e`` takes word ``e % 4`` of its block's output.

Gaussians (Box–Muller, all four words used, four normals per Philox call):
``u = float32(x)·2⁻³² + 2⁻³³`` ∈ (0, 1]; for the pairs (w0, w1) and (w2, w3) of a block,
``r = sqrt(−2 ln u_first)``, ``θ = 2π u_second``, ``z_first = r cos θ``, ``z_second = r sin θ``.
All arithmetic is fp32. The largest ``|z|`` is ``sqrt(66 ln 2) ≈ 6.7637``.

Integers are held in int64 tensors (values in [0, 2³²)); 32×32-bit products are split into
16-bit halves so that nothing overflows int64.
"""

from __future__ import annotations

import math

import torch

PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
PHILOX_ROUNDS = 10
MASK32 = 0xFFFFFFFF

TWO_POW_M32 = 2.0**-32
TWO_POW_M33 = 2.0**-33
TWO_PI = 2.0 * math.pi
# |z| <= sqrt(-2 ln(2^-33)): the smallest uniform is 2^-33 (word 0).
MAX_ABS_NORMAL = math.sqrt(66.0 * math.log(2.0))


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of the 64-bit product of the constant ``a`` and uint32 values ``b``."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    p_lo = a_lo * b  # < 2^48
    p_hi = a_hi * b  # < 2^48
    lo = (((p_hi & 0xFFFF) << 16) + p_lo) & MASK32
    hi = (p_hi + (p_lo >> 16)) >> 16
    return hi & MASK32, lo


def philox4x32(counter: tuple[torch.Tensor, ...], key: tuple[int, int], rounds: int = PHILOX_ROUNDS):
    """Philox4x32-``rounds`` on int64 tensors of uint32 values; returns the four output words."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + PHILOX_W0) & MASK32, (k1 + PHILOX_W1) & MASK32
        hi0, lo0 = _mulhilo(PHILOX_M0, c0)
        hi1, lo1 = _mulhilo(PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def _check_u32(name: str, value: int, bits: int = 32) -> int:
    if not isinstance(value, int) or not 0 <= value < 2**bits:
        raise ValueError(f"{name} must be an integer in [0, 2^{bits}), got {value!r}")
    return value


def _blocks(numel: int, offset: int, seed: int, step: int, stream: int, device) -> tuple:
    """Philox output words for every block touched by elements [offset, offset + numel)."""
    first, last = offset // 4, (offset + numel + 3) // 4
    block = torch.arange(first, last, dtype=torch.int64, device=device)
    zeros = torch.zeros_like(block)
    counter = (block & MASK32, block >> 32, zeros + step, zeros + stream)
    return philox4x32(counter, (seed & MASK32, seed >> 32))


def philox_uint32(numel: int, *, seed: int, step: int, stream: int = 0, offset: int = 0, device=None) -> torch.Tensor:
    """The raw uint32 words for elements ``[offset, offset + numel)``, as int64 ``[numel]``."""
    _check_u32("seed", seed, 64), _check_u32("step", step), _check_u32("stream", stream)
    _check_u32("offset", offset, 62)
    words = torch.stack(_blocks(numel, offset, seed, step, stream, device), dim=1).flatten()
    start = offset % 4
    return words[start : start + numel]


def uniform(x: torch.Tensor) -> torch.Tensor:
    """``float32(x)·2⁻³² + 2⁻³³`` in (0, 1]: never 0, so ``log`` is finite."""
    return x.to(torch.float32) * TWO_POW_M32 + TWO_POW_M33


def box_muller(x0, x1, x2, x3) -> tuple[torch.Tensor, ...]:
    """Four standard normals (fp32) from the four words of one Philox block."""
    out = []
    for a, b in ((x0, x1), (x2, x3)):
        r = torch.sqrt(-2.0 * torch.log(uniform(a)))
        theta = TWO_PI * uniform(b)
        out += [r * torch.cos(theta), r * torch.sin(theta)]
    return tuple(out)


def standard_normal(numel: int, *, seed: int, step: int, stream: int = 0, offset: int = 0, device=None) -> torch.Tensor:
    """fp32 N(0, 1) draws for elements ``[offset, offset + numel)``."""
    _check_u32("seed", seed, 64), _check_u32("step", step), _check_u32("stream", stream)
    _check_u32("offset", offset, 62)
    z = torch.stack(box_muller(*_blocks(numel, offset, seed, step, stream, device)), dim=1).flatten()
    start = offset % 4
    return z[start : start + numel]
