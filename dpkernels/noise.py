"""Counter-based Gaussian noise, bit-identical words on every backend (spec: docs/RNG.md).

Two generators, selected with ``rng=``; both are counter-based, with counter = (element block,
``step``, ``stream``) and the element index running over the **global flat index** of a tensor
list, so the noise of an element does not depend on how tensors are grouped, chunked or
launched, and ``(key, step, stream, index)`` names each draw exactly once.

- ``rng="philox"`` (default): Philox4x32-10 keyed by a 64-bit ``seed``, fp32 Box–Muller. A fast
  statistical generator, **not** a cryptographic one: whoever knows or guesses the seed can
  reproduce the noise, and Philox is not designed against adversaries.
- ``rng="chacha20"`` (secure mode, docs/RNG.md §6): the ChaCha20 stream cipher (RFC 8439, 20
  rounds) keyed by a 256-bit ``seed``, 53-bit uniforms, float64 Box–Muller, the noised value
  formed in float64 and rounded once to the output dtype. A CSPRNG while the key is secret and
  fresh; it narrows but does not close the floating-point attacks of Mironov (CCS 2012), for
  which the snapping mechanism or a discrete Gaussian are the rigorous fixes.

Seeds default to a fresh value of the generator's key size from the OS CSPRNG (``secrets``);
pass a fixed seed only for reproducibility, and keep it as secret as the data.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import torch
from torch import Tensor

from . import _backend
from ._validate import fp32_scale, integer, real
from .reference import noise as ref

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def fresh_seed() -> int:
    """A 64-bit seed from the operating system's CSPRNG."""
    return secrets.randbits(64)


def _signed64(seed: int) -> int:
    """Op schemas carry ints as int64: pass the seed's 64 bits unchanged, as a signed value."""
    return seed - 2**64 if seed >= 2**63 else seed


def _unsigned64(seed: int) -> int:
    return seed % 2**64


def _check_counter(seed, step, stream, offset) -> tuple[int, int, int, int]:
    """``(seed, step, stream, offset)`` as Python ints (any integer type, bools refused), each in its
    counter field's range; callers use the returned values, so NumPy ints never reach the kernels."""
    return tuple(
        integer(name, value, low=0, high=2**bits)
        for name, value, bits in (
            ("seed", seed, 64),
            ("step", step, 32),
            ("stream", stream, 32),
            ("offset", offset, 62),
        )
    )


RNGS = ("philox", "chacha20")


def fresh_key() -> int:
    """A 256-bit ChaCha20 key from the operating system's CSPRNG."""
    return secrets.randbits(256)


def _check_rng(rng) -> str:
    if rng not in RNGS:
        raise ValueError(f"rng must be one of {RNGS}, got {rng!r}")
    return rng


def chacha20_key(seed) -> int:
    """A ChaCha20 key as an int in [0, 2^256): an int in that range, or 32 bytes (little-endian,
    RFC 8439's byte order: key word i is bytes 4i .. 4i + 3)."""
    if isinstance(seed, (bytes, bytearray)):
        if len(seed) != 32:
            raise ValueError(f"a ChaCha20 key given as bytes must be 32 bytes long, got {len(seed)}")
        return int.from_bytes(seed, "little")
    try:
        return integer("seed", seed, low=0, high=2**256)
    except ValueError:
        raise ValueError(
            f"seed must be an integer in [0, 2^256) or 32 bytes for rng='chacha20', got {seed!r}"
        ) from None


def _limbs(key: int) -> list[int]:
    """The 256-bit key as 4 signed int64 limbs (limb j = bits 64j .. 64j + 63), for op schemas."""
    return [_signed64((key >> (64 * j)) % 2**64) for j in range(4)]


def _from_limbs(limbs: list[int]) -> int:
    return sum(_unsigned64(v) << (64 * j) for j, v in enumerate(limbs))


def _counter_key(rng: str, seed, step, stream, offset) -> tuple[list[int], int, int, int]:
    """Validate the counter fields: ``(key, step, stream, offset)``, the schema key (``[seed]`` or 4
    ChaCha20 limbs) and the rest as Python ints. ``seed=None`` draws a fresh key of the generator's
    size from the OS CSPRNG."""
    _check_rng(rng)
    if rng == "chacha20":
        key = fresh_key() if seed is None else chacha20_key(seed)
        _, step, stream, offset = _check_counter(0, step, stream, offset)
        return _limbs(key), step, stream, offset
    seed, step, stream, offset = _check_counter(fresh_seed() if seed is None else seed, step, stream, offset)
    return [_signed64(seed)], step, stream, offset


def _check_std(std, name: str = "std") -> float:
    """A noise standard deviation as a float in [0, NOISE_STD_MAX]: the kernels form ``std·z`` in fp32."""
    return fp32_scale(name, real(name, std, low=0.0))


# --------------------------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------------------------


def _triton():
    from .triton_kernels import noise as triton_noise

    return triton_noise


def _words(out: Tensor, rng: str, key: list[int], step: int, stream: int, offset: int, backend: str) -> None:
    """``key``: ``[seed]`` (Philox, signed 64-bit) or the 4 signed limbs of a ChaCha20 key."""
    if rng == "chacha20":
        if backend == "reference":
            words = ref.chacha20_uint32(
                out.numel(), key=_from_limbs(key), step=step, stream=stream, offset=offset, device=out.device
            )
            out.copy_(words)
        elif backend == "triton":
            _triton().chacha20_uint32_(out, _from_limbs(key), step, stream, offset)
        else:
            torch.ops.dpkernels_C.chacha20_uint32_(out, key, step, stream, offset)
        return
    seed = _unsigned64(key[0])
    if backend == "reference":
        out.copy_(ref.philox_uint32(out.numel(), seed=seed, step=step, stream=stream, offset=offset, device=out.device))
    elif backend == "triton":
        _triton().philox_uint32_(out, seed, step, stream, offset)
    else:
        torch.ops.dpkernels_C.philox_uint32_(out, _signed64(seed), step, stream, offset)


def _reference_normals(numel: int, rng: str, key: list[int], step: int, stream: int, offset: int, device) -> Tensor:
    if rng == "chacha20":
        return ref.chacha20_standard_normal(
            numel, key=_from_limbs(key), step=step, stream=stream, offset=offset, device=device
        )
    return ref.standard_normal(numel, seed=_unsigned64(key[0]), step=step, stream=stream, offset=offset, device=device)


def _chacha20_normals64(numel: int, key: list[int], step: int, stream: int, device, backend: str) -> Tensor:
    """float64 N(0, 1) of elements ``[0, numel)`` of the ChaCha20 stream (docs/RNG.md §6), for callers
    that must add the noise in float64 themselves: the backend's keystream words (the expensive
    part), then the reference's 53-bit uniforms and Box–Muller, so the values are those of
    :func:`dpkernels.reference.noise.chacha20_standard_normal` on every backend."""
    blocks = (numel + 7) // 8  # 8 normals per 16-word block
    words = torch.empty(16 * blocks, dtype=torch.int64, device=device)
    _words(words, "chacha20", key, step, stream, 0, backend)
    return ref.chacha20_block_normals(words.view(blocks, 16))[:numel]


def _add_noise(
    tensors: list[Tensor], std: float, rng: str, key: list[int], step: int, stream: int, offset: int, backend: str
) -> None:
    if backend == "reference":
        total = sum(t.numel() for t in tensors)
        z = _reference_normals(total, rng, key, step, stream, offset, tensors[0].device)
        for t, part in zip(tensors, torch.split(z, [t.numel() for t in tensors]), strict=True):
            if rng == "chacha20":  # float64 sum, one rounding
                t.copy_(ref.round_once(t.double() + std * part.view_as(t), t.dtype))
            else:
                t.copy_((t.float() + std * part.view_as(t)).to(t.dtype))
    elif rng == "chacha20":
        if backend == "triton":
            _triton().chacha20_add_gaussian_noise_(tensors, std, _from_limbs(key), step, stream, offset)
        else:
            torch.ops.dpkernels_C.chacha20_add_gaussian_noise_(tensors, std, key, step, stream, offset)
    elif backend == "triton":
        _triton().add_gaussian_noise_(tensors, std, _unsigned64(key[0]), step, stream, offset)
    else:
        torch.ops.dpkernels_C.add_gaussian_noise_(tensors, std, key[0], step, stream, offset)


def _fill(out: Tensor, std: float, rng: str, key: list[int], step: int, stream: int, offset: int, backend: str) -> None:
    if backend == "reference":
        z = _reference_normals(out.numel(), rng, key, step, stream, offset, out.device)
        out.copy_(ref.round_once(std * z, out.dtype).view_as(out) if rng == "chacha20" else (std * z).view_as(out))
    elif rng == "chacha20":
        if backend == "triton":
            _triton().chacha20_gaussian_fill_(out, std, _from_limbs(key), step, stream, offset)
        else:
            torch.ops.dpkernels_C.chacha20_gaussian_fill_(out, std, key, step, stream, offset)
    elif backend == "triton":
        _triton().gaussian_fill_(out, std, _unsigned64(key[0]), step, stream, offset)
    else:
        torch.ops.dpkernels_C.gaussian_fill_(out, std, key[0], step, stream, offset)


@torch.library.custom_op("dpkernels::random_uint32", mutates_args=())
def _uint32_op(
    numel: int, rng: str, key: list[int], step: int, stream: int, offset: int, device: torch.device, backend: str
) -> Tensor:
    out = torch.empty(numel, dtype=torch.int64, device=device)
    _words(out, rng, key, step, stream, offset, backend)
    return out


@_uint32_op.register_fake
def _(numel, rng, key, step, stream, offset, device, backend):
    return torch.empty(numel, dtype=torch.int64, device=device)


@torch.library.custom_op("dpkernels::gaussian_noise", mutates_args=())
def _gaussian_noise_op(
    shape: list[int], std: float, rng: str, key: list[int], step: int, stream: int, offset: int,
    dtype: torch.dtype, device: torch.device, backend: str,
) -> Tensor:  # fmt: skip
    out = torch.empty(shape, dtype=dtype, device=device)
    _fill(out, std, rng, key, step, stream, offset, backend)
    return out


@_gaussian_noise_op.register_fake
def _(shape, std, rng, key, step, stream, offset, dtype, device, backend):
    return torch.empty(shape, dtype=dtype, device=device)


@torch.library.custom_op("dpkernels::add_gaussian_noise_", mutates_args=("tensors",))
def _add_gaussian_noise_op(
    tensors: list[Tensor], std: float, rng: str, key: list[int], step: int, stream: int, offset: int, backend: str
) -> None:
    _add_noise(tensors, std, rng, key, step, stream, offset, backend)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def philox_uint32(
    numel: int, *, seed: int, step: int, stream: int = 0, offset: int = 0, device="cpu", backend: str = "auto"
) -> Tensor:
    """The raw Philox words of elements ``[offset, offset + numel)``: int64 ``[numel]`` in [0, 2³²).

    For audits and tests: these words are bit-identical on every backend.
    """
    seed, step, stream, offset = _check_counter(seed, step, stream, offset)
    device = torch.device(device)
    return _uint32_op(
        int(numel), "philox", [_signed64(seed)], step, stream, offset, device, _backend.resolve(backend, device)
    )


def chacha20_uint32(
    numel: int, *, seed, step: int, stream: int = 0, offset: int = 0, device="cpu", backend: str = "auto"
) -> Tensor:
    """The raw ChaCha20 keystream words of elements ``[offset, offset + numel)``: int64 ``[numel]``.

    ``seed``: the 256-bit key, an int in [0, 2²⁵⁶) or 32 bytes (RFC 8439 byte order). Element ``e``
    takes word ``e % 16`` of block ``e // 16`` (docs/RNG.md §6); bit-identical on every backend.
    """
    key, step, stream, offset = _counter_key("chacha20", seed, step, stream, offset)
    device = torch.device(device)
    return _uint32_op(int(numel), "chacha20", key, step, stream, offset, device, _backend.resolve(backend, device))


def gaussian_noise(
    numel_or_shape,
    *,
    std: float,
    seed=None,
    step: int,
    stream: int = 0,
    offset: int = 0,
    dtype: torch.dtype = torch.float32,
    device="cpu",
    rng: str = "philox",
    backend: str = "auto",
) -> Tensor:
    """``std · z`` for elements ``[offset, offset + numel)`` of the noise stream, ``z ~ N(0, 1)``.

    ``rng="philox"`` (default, fast, **not cryptographic**): 64-bit ``seed``, computed in fp32 and
    rounded once to ``dtype``. ``rng="chacha20"`` (secure mode, docs/RNG.md §6): ChaCha20 keyed
    by a 256-bit ``seed`` (int or 32 bytes), 53-bit uniforms, float64 Box–Muller, ``std · z``
    formed in float64 and rounded once to ``dtype``. ``seed=None`` draws a fresh key of the
    generator's size from the OS CSPRNG. ``dtype``: fp32, fp16 or bf16.
    """
    shape = [numel_or_shape] if isinstance(numel_or_shape, int) else [int(n) for n in numel_or_shape]
    if any(n < 0 for n in shape):
        raise ValueError(f"shape must be non-negative, got {shape}")
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of {_FLOAT_DTYPES}, got {dtype}")
    std = _check_std(std)
    key, step, stream, offset = _counter_key(rng, seed, step, stream, offset)
    device = torch.device(device)
    backend = _backend.resolve(backend, device)
    return _gaussian_noise_op(shape, std, rng, key, step, stream, offset, dtype, device, backend)


def add_gaussian_noise_(
    tensors: Sequence[Tensor],
    std: float,
    *,
    seed=None,
    step: int,
    stream: int = 0,
    offset: int = 0,
    rng: str = "philox",
    backend: str = "auto",
) -> list[Tensor]:
    """In place: ``tensors[t] += std · z`` with global offsets running across the list.

    Element ``i`` of ``tensors[t]`` takes the draw at ``offset + Σ_{s<t} numel(tensors[s]) + i``,
    so the noise of a list equals the noise of its concatenation. Tensors must be contiguous,
    fp32/fp16/bf16, on one device. ``rng="philox"``: the sum is formed in fp32 and rounded once;
    ``rng="chacha20"`` (secure mode, 256-bit ``seed``): formed in float64 and rounded once.
    """
    if isinstance(tensors, Tensor) or not isinstance(tensors, Sequence) or len(tensors) == 0:
        raise TypeError("tensors must be a non-empty list of tensors")
    std = _check_std(std)
    key, step, stream, offset = _counter_key(rng, seed, step, stream, offset)
    device = tensors[0].device
    for idx, t in enumerate(tensors):
        if not isinstance(t, Tensor) or t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"tensors[{idx}] must be a float32, float16 or bfloat16 tensor")
        if t.device != device:
            raise ValueError(f"tensors[{idx}] is on {t.device} but tensors[0] is on {device}")
        if not t.is_contiguous():
            raise ValueError(f"tensors[{idx}] must be contiguous (noise is written in place)")
    _add_gaussian_noise_op(list(tensors), std, rng, key, step, stream, offset, _backend.resolve(backend, device))
    return list(tensors)
