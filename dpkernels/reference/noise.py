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


# --------------------------------------------------------------------------------------------
# ChaCha20 (secure mode, docs/RNG.md §6)
# --------------------------------------------------------------------------------------------
#
# RFC 8439 §2.3 block function, 20 rounds, keyed by a 256-bit key: state words 0..3 are the
# constants, 4..11 the key (little-endian uint32 words: word 4 + i = bits 32i .. 32i + 31 of the
# integer key), 12/13 the block index (low, high), 14 the step and 15 the stream. Raw words:
# element e takes word e % 16 of block e // 16. Normals (float64): block b gives 8 normals from
# its 8 uint64 values v_i = w[2i+1]·2³² + w[2i], u_i = (v_i >> 11)·2⁻⁵³ + 2⁻⁵⁴ rounded to
# nearest-even in float64, Box–Muller on (u_{2k}, u_{2k+1}); element e takes normal e % 8 of
# block e // 8.

CHACHA_CONSTANTS = (0x61707865, 0x3320646E, 0x79622D32, 0x6B206574)
CHACHA_DOUBLE_ROUNDS = 10
TWO_POW_M53 = 2.0**-53
TWO_POW_M54 = 2.0**-54
# |z| <= sqrt(-2 ln(2^-54)): the smallest uniform is 2^-54 (v < 2^11).
CHACHA_MAX_ABS_NORMAL = math.sqrt(108.0 * math.log(2.0))


def chacha20_key_words(key: int) -> tuple[int, ...]:
    """The eight little-endian uint32 key words of a 256-bit integer key (state words 4..11)."""
    _check_u32("key", key, 256)
    return tuple((key >> (32 * i)) & MASK32 for i in range(8))


def _rotl(x: torch.Tensor, n: int) -> torch.Tensor:
    return ((x << n) | (x >> (32 - n))) & MASK32


def _quarter_round(s: list, a: int, b: int, c: int, d: int) -> None:
    s[a] = (s[a] + s[b]) & MASK32
    s[d] = _rotl(s[d] ^ s[a], 16)
    s[c] = (s[c] + s[d]) & MASK32
    s[b] = _rotl(s[b] ^ s[c], 12)
    s[a] = (s[a] + s[b]) & MASK32
    s[d] = _rotl(s[d] ^ s[a], 8)
    s[c] = (s[c] + s[d]) & MASK32
    s[b] = _rotl(s[b] ^ s[c], 7)


def chacha20_block(state: tuple) -> tuple[torch.Tensor, ...]:
    """RFC 8439 §2.3 ChaCha20 block function on 16 int64 tensors of uint32 values (same shape)."""
    x = list(state)
    for _ in range(CHACHA_DOUBLE_ROUNDS):
        _quarter_round(x, 0, 4, 8, 12)  # columns
        _quarter_round(x, 1, 5, 9, 13)
        _quarter_round(x, 2, 6, 10, 14)
        _quarter_round(x, 3, 7, 11, 15)
        _quarter_round(x, 0, 5, 10, 15)  # diagonals
        _quarter_round(x, 1, 6, 11, 12)
        _quarter_round(x, 2, 7, 8, 13)
        _quarter_round(x, 3, 4, 9, 14)
    return tuple((a + b) & MASK32 for a, b in zip(x, state, strict=True))


def _chacha_blocks(first: int, last: int, key: int, step: int, stream: int, device) -> torch.Tensor:
    """Output words of blocks [first, last): int64 ``[last - first, 16]``."""
    block = torch.arange(first, last, dtype=torch.int64, device=device)
    zeros = torch.zeros_like(block)
    consts = [zeros + c for c in (*CHACHA_CONSTANTS, *chacha20_key_words(key))]
    state = (*consts, block & MASK32, block >> 32, zeros + step, zeros + stream)
    return torch.stack(chacha20_block(state), dim=1)


def _check_chacha(key, step, stream, offset) -> None:
    _check_u32("key", key, 256), _check_u32("step", step), _check_u32("stream", stream)
    _check_u32("offset", offset, 62)


def chacha20_uint32(numel: int, *, key: int, step: int, stream: int = 0, offset: int = 0, device=None) -> torch.Tensor:
    """ChaCha20 keystream words for elements ``[offset, offset + numel)``, as int64 ``[numel]``."""
    _check_chacha(key, step, stream, offset)
    words = _chacha_blocks(offset // 16, (offset + numel + 15) // 16, key, step, stream, device).flatten()
    return words[offset % 16 : offset % 16 + numel]


def chacha20_uniform53(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """float64 ``(v >> 11)·2⁻⁵³ + 2⁻⁵⁴`` for ``v = hi·2³² + lo``: in [2⁻⁵⁴, 1], never 0."""
    m = (hi << 21) | (lo >> 11)  # the top 53 bits of v, < 2^53: exact in int64 and float64
    return m.to(torch.float64) * TWO_POW_M53 + TWO_POW_M54


def chacha20_standard_normal(
    numel: int, *, key: int, step: int, stream: int = 0, offset: int = 0, device=None
) -> torch.Tensor:
    """float64 N(0, 1) draws for elements ``[offset, offset + numel)`` (8 normals per block)."""
    _check_chacha(key, step, stream, offset)
    w = _chacha_blocks(offset // 8, (offset + numel + 7) // 8, key, step, stream, device)
    return chacha20_block_normals(w)[offset % 8 : offset % 8 + numel]


def chacha20_block_normals(w: torch.Tensor) -> torch.Tensor:
    """The 8 float64 normals of each ChaCha20 block, flat: ``w`` is ``[blocks, 16]`` keystream words
    (int64 holding uint32); word pairs give 53-bit uniforms, uniform pairs a Box–Muller pair."""
    u = chacha20_uniform53(w[:, 0::2], w[:, 1::2])  # [blocks, 8]
    r = torch.sqrt(-2.0 * torch.log(u[:, 0::2]))
    theta = (2.0 * math.pi) * u[:, 1::2]
    return torch.stack([r * torch.cos(theta), r * torch.sin(theta)], dim=2).flatten()  # z_{2k}, z_{2k+1}


def round_once(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 ``x`` rounded once (to nearest-even) to ``dtype``.

    fp32/fp64 directly. fp16/bf16 via fp32 with round-to-odd (truncate toward zero, set the last
    bit when inexact): fp32 has at least 13 more significand bits than either, so the second
    rounding then equals a single rounding of the float64 value (Boldo & Melquiond 2008), which a
    plain ``x.to(float32).to(float16)`` (two roundings) does not guarantee.
    """
    if dtype in (torch.float32, torch.float64):
        return x.to(dtype)
    f = x.to(torch.float32)
    inexact = f.double() != x
    f = torch.where(f.double().abs() > x.abs(), torch.nextafter(f, torch.zeros_like(f)), f)
    bits = f.view(torch.int32)
    f = torch.where(inexact, bits | 1, bits).view(torch.float32)
    return f.to(dtype)
