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
from typing import NamedTuple

import torch
from torch import Tensor

from . import _backend
from ._registry import custom_op, family
from ._validate import fp32_scale, integer, real
from .reference import noise as ref

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def fresh_seed() -> int:
    """A 64-bit seed from the operating system's CSPRNG."""
    return secrets.randbits(64)


def fresh_key() -> int:
    """A 256-bit ChaCha20 key from the operating system's CSPRNG."""
    return secrets.randbits(256)


RNGS = ("philox", "chacha20")
#: Bits of each counter field (docs/RNG.md).
_COUNTER_BITS = {"step": 32, "stream": 32, "offset": 62}


def _check_rng(rng) -> str:
    if rng not in RNGS:
        raise ValueError(f"rng must be one of {RNGS}, got {rng!r}")
    return rng


def _signed64(word: int) -> int:
    """Op schemas carry ints as int64: a 64-bit word's bits unchanged, as a signed value."""
    return word - 2**64 if word >= 2**63 else word


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


class NoiseKey(NamedTuple):
    """Which draws of which generator: the one noise-key type from the public API to the kernels.

    ``key`` is the generator's key as an unsigned int (Philox: 64 bits, ChaCha20: 256 bits); the
    counter is ``(element, step, stream)`` with elements from ``offset`` on (docs/RNG.md). Op
    schemas carry it as ``(rng, limbs, step, stream, offset)``: :meth:`limbs` and
    :meth:`from_schema` are the only encoding between the two.
    """

    rng: str
    key: int
    step: int
    stream: int = 0
    offset: int = 0

    @classmethod
    def of(cls, rng: str, seed, step, stream=0, offset=0) -> NoiseKey:
        """Validated: any integer type for the counter fields (bools refused), each in its field's
        range, so NumPy ints never reach the kernels; ``seed=None`` draws a fresh key of the
        generator's size from the OS CSPRNG."""
        _check_rng(rng)
        if rng == "chacha20":
            key = fresh_key() if seed is None else chacha20_key(seed)
        else:
            key = fresh_seed() if seed is None else integer("seed", seed, low=0, high=2**64)
        fields = {"step": step, "stream": stream, "offset": offset}
        counter = [integer(n, v, low=0, high=2 ** _COUNTER_BITS[n]) for n, v in fields.items()]
        return cls(rng, key, *counter)

    def limbs(self) -> list[int]:
        """The key as signed int64 limbs, limb j = bits 64j .. 64j + 63: one for Philox, four for ChaCha20."""
        return [_signed64((self.key >> (64 * j)) % 2**64) for j in range(4 if self.rng == "chacha20" else 1)]

    def schema(self) -> tuple[str, list[int], int, int, int]:
        """``(rng, limbs, step, stream, offset)``, the arguments of a registered op."""
        return self.rng, self.limbs(), self.step, self.stream, self.offset

    @classmethod
    def from_schema(cls, rng: str, limbs: list[int], step: int, stream: int, offset: int) -> NoiseKey:
        return cls(rng, sum((v % 2**64) << (64 * j) for j, v in enumerate(limbs)), step, stream, offset)

    def at(self, offset: int) -> NoiseKey:
        return self._replace(offset=offset)


def _check_counter(seed, step, stream, offset) -> tuple[int, int, int, int]:
    """``(seed, step, stream, offset)`` of a Philox key, validated as :meth:`NoiseKey.of` does."""
    return NoiseKey.of("philox", seed, step, stream, offset)[1:]


def _check_std(std, name: str = "std") -> float:
    """A noise standard deviation as a float in [0, NOISE_STD_MAX]: the kernels form ``std·z`` in fp32."""
    return fp32_scale(name, real(name, std, low=0.0))


# --------------------------------------------------------------------------------------------
# The noise family: words (raw generator output), fill (std·z) and add (t += std·z) of one
# NoiseKey on every backend. A ChaCha20 normal is float64 and std·z (+ t) is rounded once.
# --------------------------------------------------------------------------------------------


class _ReferenceNoise:
    @staticmethod
    def words(out: Tensor, k: NoiseKey) -> None:
        if k.rng == "chacha20":
            words = ref.chacha20_uint32(out.numel(), key=k.key, step=k.step, stream=k.stream, offset=k.offset)
        else:
            words = ref.philox_uint32(out.numel(), seed=k.key, step=k.step, stream=k.stream, offset=k.offset)
        out.copy_(words)

    @staticmethod
    def normals(numel: int, k: NoiseKey, device) -> Tensor:
        """N(0, 1) of elements ``[offset, offset + numel)``: fp32 (Philox) or float64 (ChaCha20)."""
        counter = dict(step=k.step, stream=k.stream, offset=k.offset, device=device)
        if k.rng == "chacha20":
            return ref.chacha20_standard_normal(numel, key=k.key, **counter)
        return ref.standard_normal(numel, seed=k.key, **counter)

    @classmethod
    def fill(cls, out: Tensor, std: float, k: NoiseKey) -> None:
        out.copy_(cls._noised(None, std * cls.normals(out.numel(), k, out.device).view_as(out), k, out.dtype))

    @classmethod
    def add(cls, tensors: list[Tensor], std: float, k: NoiseKey) -> None:
        z = cls.normals(sum(t.numel() for t in tensors), k, tensors[0].device)
        for t, part in zip(tensors, torch.split(z, [t.numel() for t in tensors]), strict=True):
            t.copy_(cls._noised(t, std * part.view_as(t), k, t.dtype))

    @staticmethod
    def _noised(t: Tensor | None, nu: Tensor, k: NoiseKey, dtype: torch.dtype) -> Tensor:
        if k.rng == "chacha20":  # float64, one rounding
            return ref.round_once(nu if t is None else t.double() + nu, dtype)
        return (nu if t is None else t.float() + nu).to(dtype)


class _NativeNoise:
    """``torch.ops.dpkernels_C`` (csrc/cpu/noise.cpp, csrc/cuda/noise.cu): one op per generator."""

    @staticmethod
    def words(out: Tensor, k: NoiseKey) -> None:
        ops = torch.ops.dpkernels_C
        if k.rng == "chacha20":
            ops.chacha20_uint32_(out, k.limbs(), k.step, k.stream, k.offset)
        else:
            ops.philox_uint32_(out, k.limbs()[0], k.step, k.stream, k.offset)

    @staticmethod
    def fill(out: Tensor, std: float, k: NoiseKey) -> None:
        ops = torch.ops.dpkernels_C
        if k.rng == "chacha20":
            ops.chacha20_gaussian_fill_(out, std, k.limbs(), k.step, k.stream, k.offset)
        else:
            ops.gaussian_fill_(out, std, k.limbs()[0], k.step, k.stream, k.offset)

    @staticmethod
    def add(tensors: list[Tensor], std: float, k: NoiseKey) -> None:
        ops = torch.ops.dpkernels_C
        if k.rng == "chacha20":
            ops.chacha20_add_gaussian_noise_(tensors, std, k.limbs(), k.step, k.stream, k.offset)
        else:
            ops.add_gaussian_noise_(tensors, std, k.limbs()[0], k.step, k.stream, k.offset)


class _TritonNoise:
    """triton_kernels/noise.py: one launcher per generator, keys as unsigned ints."""

    @staticmethod
    def words(out: Tensor, k: NoiseKey) -> None:
        from .triton_kernels import noise as tn

        (tn.chacha20_uint32_ if k.rng == "chacha20" else tn.philox_uint32_)(out, k.key, k.step, k.stream, k.offset)

    @staticmethod
    def fill(out: Tensor, std: float, k: NoiseKey) -> None:
        from .triton_kernels import noise as tn

        fill = tn.chacha20_gaussian_fill_ if k.rng == "chacha20" else tn.gaussian_fill_
        fill(out, std, k.key, k.step, k.stream, k.offset)

    @staticmethod
    def add(tensors: list[Tensor], std: float, k: NoiseKey) -> None:
        from .triton_kernels import noise as tn

        add = tn.chacha20_add_gaussian_noise_ if k.rng == "chacha20" else tn.add_gaussian_noise_
        add(tensors, std, k.key, k.step, k.stream, k.offset)


NOISE = family(
    "noise",
    ("words", "fill", "add"),
    reference=lambda: _ReferenceNoise,
    cpu=lambda: _NativeNoise,
    cuda=lambda: _NativeNoise,
    triton=lambda: _TritonNoise,
)


def _chacha20_normals64(numel: int, k: NoiseKey, device, backend: str) -> Tensor:
    """float64 N(0, 1) of elements ``[0, numel)`` of the ChaCha20 stream (docs/RNG.md §6), for callers
    that must add the noise in float64 themselves: the backend's keystream words (the expensive
    part), then the reference's 53-bit uniforms and Box–Muller, so the values are those of
    :func:`dpkernels.reference.noise.chacha20_standard_normal` on every backend."""
    blocks = (numel + 7) // 8  # 8 normals per 16-word block
    words = torch.empty(16 * blocks, dtype=torch.int64, device=device)
    NOISE.kernels(backend).words(words, k.at(0))
    return ref.chacha20_block_normals(words.view(blocks, 16))[:numel]


@custom_op("random_uint32", mutates_args=())
def _uint32_op(
    numel: int, rng: str, key: list[int], step: int, stream: int, offset: int, device: torch.device, backend: str
) -> Tensor:
    out = torch.empty(numel, dtype=torch.int64, device=device)
    NOISE.kernels(backend).words(out, NoiseKey.from_schema(rng, key, step, stream, offset))
    return out


@_uint32_op.register_fake
def _(numel, rng, key, step, stream, offset, device, backend):
    return torch.empty(numel, dtype=torch.int64, device=device)


@custom_op("gaussian_noise", mutates_args=())
def _gaussian_noise_op(
    shape: list[int], std: float, rng: str, key: list[int], step: int, stream: int, offset: int,
    dtype: torch.dtype, device: torch.device, backend: str,
) -> Tensor:  # fmt: skip
    out = torch.empty(shape, dtype=dtype, device=device)
    NOISE.kernels(backend).fill(out, std, NoiseKey.from_schema(rng, key, step, stream, offset))
    return out


@_gaussian_noise_op.register_fake
def _(shape, std, rng, key, step, stream, offset, dtype, device, backend):
    return torch.empty(shape, dtype=dtype, device=device)


@custom_op("add_gaussian_noise_", mutates_args=("tensors",))
def _add_gaussian_noise_op(
    tensors: list[Tensor], std: float, rng: str, key: list[int], step: int, stream: int, offset: int, backend: str
) -> None:
    NOISE.kernels(backend).add(tensors, std, NoiseKey.from_schema(rng, key, step, stream, offset))


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def philox_uint32(
    numel: int, *, seed: int, step: int, stream: int = 0, offset: int = 0, device="cpu", backend: str = "auto"
) -> Tensor:
    """The raw Philox words of elements ``[offset, offset + numel)``: int64 ``[numel]`` in [0, 2³²).

    For audits and tests: these words are bit-identical on every backend.
    """
    return _words("philox", numel, seed, step, stream, offset, device, backend)


def chacha20_uint32(
    numel: int, *, seed, step: int, stream: int = 0, offset: int = 0, device="cpu", backend: str = "auto"
) -> Tensor:
    """The raw ChaCha20 keystream words of elements ``[offset, offset + numel)``: int64 ``[numel]``.

    ``seed``: the 256-bit key, an int in [0, 2²⁵⁶) or 32 bytes (RFC 8439 byte order). Element ``e``
    takes word ``e % 16`` of block ``e // 16`` (docs/RNG.md §6); bit-identical on every backend.
    """
    return _words("chacha20", numel, seed, step, stream, offset, device, backend)


def _words(rng, numel, seed, step, stream, offset, device, backend) -> Tensor:
    k = NoiseKey.of(rng, seed, step, stream, offset)
    device = torch.device(device)
    return _uint32_op(integer("numel", numel, low=0), *k.schema(), device, _backend.resolve(backend, device))


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
    k = NoiseKey.of(rng, seed, step, stream, offset)
    device = torch.device(device)
    return _gaussian_noise_op(shape, std, *k.schema(), dtype, device, _backend.resolve(backend, device))


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
    k = NoiseKey.of(rng, seed, step, stream, offset)
    device = tensors[0].device
    for idx, t in enumerate(tensors):
        if not isinstance(t, Tensor) or t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"tensors[{idx}] must be a float32, float16 or bfloat16 tensor")
        if t.device != device:
            raise ValueError(f"tensors[{idx}] is on {t.device} but tensors[0] is on {device}")
        if not t.is_contiguous():
            raise ValueError(f"tensors[{idx}] must be contiguous (noise is written in place)")
    _add_gaussian_noise_op(list(tensors), std, *k.schema(), _backend.resolve(backend, device))
    return list(tensors)
