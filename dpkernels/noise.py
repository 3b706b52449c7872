"""Counter-based Gaussian noise, bit-identical words on every backend (spec: docs/RNG.md).

Philox4x32-10 keyed by a 64-bit ``seed``, counter = (element block, ``step``, ``stream``), with
the element index running over the **global flat index** of a tensor list. The noise for an
element therefore does not depend on how tensors are grouped, chunked or launched, and
``(seed, step, stream, index)`` names each draw exactly once.

Philox is a fast statistical generator, **not** a cryptographic one: whoever knows the seed can
reproduce the noise. Seeds default to a fresh 64-bit value from the OS CSPRNG; pass a fixed seed
only for reproducibility.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence

import torch
from torch import Tensor

from . import _backend
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


def _check_counter(seed, step, stream, offset) -> None:
    for name, value, bits in (
        ("seed", seed, 64),
        ("step", step, 32),
        ("stream", stream, 32),
        ("offset", offset, 62),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**bits:
            raise ValueError(f"{name} must be an integer in [0, 2^{bits}), got {value!r}")


def _check_std(std) -> float:
    if not isinstance(std, (int, float)) or isinstance(std, bool) or not math.isfinite(std) or std < 0:
        raise ValueError(f"std must be a finite number >= 0, got {std!r}")
    return float(std)


# --------------------------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------------------------


def _triton():
    from triton_kernels import noise as triton_noise

    return triton_noise


def _words(out: Tensor, seed: int, step: int, stream: int, offset: int, backend: str) -> None:
    seed = _unsigned64(seed)
    if backend == "reference":
        out.copy_(ref.philox_uint32(out.numel(), seed=seed, step=step, stream=stream, offset=offset, device=out.device))
    elif backend == "triton":
        _triton().philox_uint32_(out, seed, step, stream, offset)
    else:
        torch.ops.dpkernels_C.philox_uint32_(out, _signed64(seed), step, stream, offset)


def _add_noise(tensors: list[Tensor], std: float, seed: int, step: int, stream: int, offset: int, backend: str) -> None:
    seed = _unsigned64(seed)
    if backend == "reference":
        total = sum(t.numel() for t in tensors)
        z = ref.standard_normal(total, seed=seed, step=step, stream=stream, offset=offset, device=tensors[0].device)
        for t, part in zip(tensors, torch.split(z, [t.numel() for t in tensors]), strict=True):
            t.copy_((t.float() + std * part.view_as(t)).to(t.dtype))
    elif backend == "triton":
        _triton().add_gaussian_noise_(tensors, std, seed, step, stream, offset)
    else:
        torch.ops.dpkernels_C.add_gaussian_noise_(tensors, std, _signed64(seed), step, stream, offset)


def _fill(out: Tensor, std: float, seed: int, step: int, stream: int, offset: int, backend: str) -> None:
    seed = _unsigned64(seed)
    if backend == "reference":
        z = ref.standard_normal(out.numel(), seed=seed, step=step, stream=stream, offset=offset, device=out.device)
        out.copy_((std * z).view_as(out))
    elif backend == "triton":
        _triton().gaussian_fill_(out, std, seed, step, stream, offset)
    else:
        torch.ops.dpkernels_C.gaussian_fill_(out, std, _signed64(seed), step, stream, offset)


@torch.library.custom_op("dpkernels::philox_uint32", mutates_args=())
def _philox_uint32_op(
    numel: int, seed: int, step: int, stream: int, offset: int, device: torch.device, backend: str
) -> Tensor:
    out = torch.empty(numel, dtype=torch.int64, device=device)
    _words(out, seed, step, stream, offset, backend)
    return out


@_philox_uint32_op.register_fake
def _(numel, seed, step, stream, offset, device, backend):
    return torch.empty(numel, dtype=torch.int64, device=device)


@torch.library.custom_op("dpkernels::gaussian_noise", mutates_args=())
def _gaussian_noise_op(
    shape: list[int], std: float, seed: int, step: int, stream: int, offset: int, dtype: torch.dtype,
    device: torch.device, backend: str,
) -> Tensor:  # fmt: skip
    out = torch.empty(shape, dtype=dtype, device=device)
    _fill(out, std, seed, step, stream, offset, backend)
    return out


@_gaussian_noise_op.register_fake
def _(shape, std, seed, step, stream, offset, dtype, device, backend):
    return torch.empty(shape, dtype=dtype, device=device)


@torch.library.custom_op("dpkernels::add_gaussian_noise_", mutates_args=("tensors",))
def _add_gaussian_noise_op(
    tensors: list[Tensor], std: float, seed: int, step: int, stream: int, offset: int, backend: str
) -> None:
    _add_noise(tensors, std, seed, step, stream, offset, backend)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def philox_uint32(
    numel: int, *, seed: int, step: int, stream: int = 0, offset: int = 0, device="cpu", backend: str = "auto"
) -> Tensor:
    """The raw Philox words of elements ``[offset, offset + numel)``: int64 ``[numel]`` in [0, 2³²).

    For audits and tests: these words are bit-identical on every backend.
    """
    _check_counter(seed, step, stream, offset)
    device = torch.device(device)
    return _philox_uint32_op(
        int(numel), _signed64(seed), step, stream, offset, device, _backend.resolve(backend, device)
    )


def gaussian_noise(
    numel_or_shape,
    *,
    std: float,
    seed: int | None = None,
    step: int,
    stream: int = 0,
    offset: int = 0,
    dtype: torch.dtype = torch.float32,
    device="cpu",
    backend: str = "auto",
) -> Tensor:
    """``std · z`` for elements ``[offset, offset + numel)`` of the noise stream, ``z ~ N(0, 1)``.

    Computed in fp32 and rounded once to ``dtype`` (fp32, fp16 or bf16). ``seed=None`` draws a
    fresh seed from the OS CSPRNG.
    """
    shape = [numel_or_shape] if isinstance(numel_or_shape, int) else [int(n) for n in numel_or_shape]
    if any(n < 0 for n in shape):
        raise ValueError(f"shape must be non-negative, got {shape}")
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of {_FLOAT_DTYPES}, got {dtype}")
    std = _check_std(std)
    seed = fresh_seed() if seed is None else seed
    _check_counter(seed, step, stream, offset)
    device = torch.device(device)
    backend = _backend.resolve(backend, device)
    return _gaussian_noise_op(shape, std, _signed64(seed), step, stream, offset, dtype, device, backend)


def add_gaussian_noise_(
    tensors: Sequence[Tensor],
    std: float,
    *,
    seed: int | None = None,
    step: int,
    stream: int = 0,
    offset: int = 0,
    backend: str = "auto",
) -> list[Tensor]:
    """In place: ``tensors[t] += std · z`` with global offsets running across the list.

    Element ``i`` of ``tensors[t]`` takes the draw at ``offset + Σ_{s<t} numel(tensors[s]) + i``,
    so the noise of a list equals the noise of its concatenation. Tensors must be contiguous,
    fp32/fp16/bf16, on one device; the sum is formed in fp32 and rounded once.
    """
    if isinstance(tensors, Tensor) or not isinstance(tensors, Sequence) or len(tensors) == 0:
        raise TypeError("tensors must be a non-empty list of tensors")
    std = _check_std(std)
    seed = fresh_seed() if seed is None else seed
    _check_counter(seed, step, stream, offset)
    device = tensors[0].device
    for idx, t in enumerate(tensors):
        if not isinstance(t, Tensor) or t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"tensors[{idx}] must be a float32, float16 or bfloat16 tensor")
        if t.device != device:
            raise ValueError(f"tensors[{idx}] is on {t.device} but tensors[0] is on {device}")
        if not t.is_contiguous():
            raise ValueError(f"tensors[{idx}] must be contiguous (noise is written in place)")
    _add_gaussian_noise_op(list(tensors), std, _signed64(seed), step, stream, offset, _backend.resolve(backend, device))
    return list(tensors)
