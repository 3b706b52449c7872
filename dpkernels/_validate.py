"""Argument checks shared by every public entry point: one rule and one message per mistake.

Real numbers are accepted in any numeric type a user is likely to hold: Python ``int``/``float``,
NumPy scalars, and 0-d real tensors (read with ``.item()``, which synchronises a CUDA tensor once).
``bool`` (Python, NumPy or a bool tensor) is refused everywhere: ``True`` as a noise multiplier
is a mistake, not σ = 1.
"""

from __future__ import annotations

import math
import numbers

import torch

#: Largest finite float32. A clip bound or a coefficient above it becomes inf inside the fp32
#: kernels, so it is refused rather than silently turned into a non-private inf.
FP32_MAX = float(torch.finfo(torch.float32).max)
#: Largest noise std ``σ·Δ``: the generators' normals satisfy ``|z| < 8.6`` (fp32 Box–Muller from
#: 32-bit uniforms: ``√(2 ln 2³²) ≈ 6.7``; ChaCha20's float64 one from 53-bit uniforms: ``≈ 8.6``),
#: so ``σΔ·z`` stays finite in fp32 with a margin of 2 for the sum it is added to.
NOISE_STD_MAX = FP32_MAX / 16


def _scalar(value):
    """``value`` as a Python number, or None when it is not a real, non-bool scalar."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype == torch.bool or value.is_complex():
            return None
        return value.item()
    if isinstance(value, bool):  # a Python bool is an Integral; NumPy's bool is not a numbers.Real
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return None


def _interval(low, high, low_open, high_open) -> str:
    lo = "-inf" if low is None else f"{low}"
    hi = "inf" if high is None else f"{high}"
    return f"{'(' if low_open or low is None else '['}{lo}, {hi}{')' if high_open or high is None else ']'}"


def real(name: str, value, *, low: float | None = None, high: float | None = None, low_open: bool = False,
         high_open: bool = False) -> float:  # fmt: skip
    """``value`` as a finite float in ``[low, high]`` (``low_open``/``high_open`` exclude an end), else
    ``ValueError`` naming ``name`` (also for a non-number, bools included: one exception type for
    every bad scalar, the type users already catch)."""
    x = _scalar(value)
    if x is None:
        raise ValueError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    x = float(x)
    ok = math.isfinite(x)
    if ok and low is not None:
        ok = x > low if low_open else x >= low
    if ok and high is not None:
        ok = x < high if high_open else x <= high
    if not ok:
        raise ValueError(
            f"{name} must be a finite number in {_interval(low, high, low_open, high_open)}, got {value!r}"
        )
    return x


def integer(name: str, value, *, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an int in ``[low, high)`` (an integral float such as ``3.0`` is refused: a seed or a
    step given as a float has usually lost bits), else ``ValueError`` naming ``name``."""
    x = _scalar(value)
    if not isinstance(x, int):  # None, or a float (a float tensor's item() is one too)
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if (low is not None and x < low) or (high is not None and x >= high):
        lo = "-inf" if low is None else str(low)
        hi = (
            "inf"
            if high is None
            else f"2^{high.bit_length() - 1}"
            if high > 2**20 and high & (high - 1) == 0
            else f"{high}"
        )
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}), got {value!r}")
    return x


def fp32_scale(name: str, value: float) -> float:
    """A noise std such as ``σ·C``, formed and multiplied by ``z`` in fp32: refused above
    :data:`NOISE_STD_MAX`, where the noise (or the sum it is added to) would overflow to inf."""
    if not value <= NOISE_STD_MAX:
        raise ValueError(
            f"{name} = {value!r} overflows float32 (a noise std must be at most {NOISE_STD_MAX:.4g}: the noise "
            "would be inf)"
        )
    return value
