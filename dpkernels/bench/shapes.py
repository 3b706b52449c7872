"""The model shapes ``dpkernels bench`` times: lists of ``[B, *param_shape]`` fp32 per-sample gradients.

Used by the ``clip``, ``privatize`` and ``step`` (full DP step) sections; imports nothing from
:mod:`dpkernels.bench`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Shape:
    """A model-shaped list of parameter tensors and a batch size ``B``."""

    name: str
    description: str
    batch_size: int
    param_shapes: tuple[tuple[int, ...], ...]

    @property
    def n_tensors(self) -> int:
        return len(self.param_shapes)

    @property
    def n_params(self) -> int:
        return sum(math.prod(s) for s in self.param_shapes)

    @property
    def grad_bytes(self) -> int:
        """Bytes of the fp32 per-sample gradients, ``B·D·4``."""
        return self.batch_size * self.n_params * 4


def _linear(n_in: int, n_out: int) -> list[tuple[int, ...]]:
    return [(n_out, n_in), (n_out,)]


def mlp_shape(quick: bool = False) -> Shape:
    """Large MLP: 4 Linear layers 1024→1024→1024→1024→1000 (8 tensors, 4.2 M params)."""
    dims = [1024, 1024, 1024, 1024, 1000]
    shapes = [s for a, b in zip(dims[:-1], dims[1:], strict=True) for s in _linear(a, b)]
    B = 16 if quick else 64
    return Shape("mlp", "large MLP, 4 Linear layers of 1024", B, tuple(shapes))


def transformer_shape(quick: bool = False) -> Shape:
    """Small GPT-style transformer: d=192, 4 blocks, vocab 5000, context 256 (52 tensors, 2.8 M)."""
    d, n_blocks, vocab, ctx = 192, 4, 5000, 256
    shapes: list[tuple[int, ...]] = [(vocab, d), (ctx, d)]
    for _ in range(n_blocks):
        shapes += [(d,), (d,)]  # LayerNorm 1
        shapes += _linear(d, 3 * d) + _linear(d, d)  # qkv, attention projection
        shapes += [(d,), (d,)]  # LayerNorm 2
        shapes += _linear(d, 4 * d) + _linear(4 * d, d)  # MLP
    shapes += [(d,), (d,)]  # final LayerNorm; the head is tied to the embedding
    B = 16 if quick else 64
    return Shape("transformer", f"small transformer, d={d}, {n_blocks} blocks", B, tuple(shapes))


def small_tensors_shape(batch_size: int) -> Shape:
    """Many small tensors: a 37-conv net, channels 32/64/96, GroupNorm (148 tensors, 1.55 M)."""
    shapes: list[tuple[int, ...]] = [(32, 3, 3, 3), (32,)]
    c_in = 32
    for c in (32, 64, 96):
        for _ in range(12):
            shapes += [(c, c_in, 3, 3), (c,), (c,), (c,)]  # conv weight, bias; GroupNorm w, b
            c_in = c
    shapes += _linear(96, 10)
    return Shape(f"small-b{batch_size}", "many small tensors, 37 convs + GroupNorm", batch_size, tuple(shapes))


# Quick variants shrink B for the two big shapes (the eager reference dominates the run time);
# the small-tensor shapes are already cheap and keep their B, which is part of their name.
SHAPES: dict[str, Callable[[bool], Shape]] = {
    "mlp": mlp_shape,
    "transformer": transformer_shape,
    "small-b8": lambda quick=False: small_tensors_shape(8),
    "small-b32": lambda quick=False: small_tensors_shape(32),
}


def get_shape(name: str, quick: bool = False) -> Shape:
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; expected one of {', '.join(SHAPES)}")
    return SHAPES[name](quick)


def make_grad_samples(shape: Shape, seed: int = 0, device: str = "cpu") -> tuple[list[Tensor], float]:
    """Per-sample gradients ``[B, *param_shape]`` (fp32, randn) on ``device`` and a ``max_grad_norm``.

    Sample ``i`` is scaled by a factor spread over [0.5, 1.5], so its norm is about
    ``factor · sqrt(D)``; with ``C = sqrt(D)`` about half the samples are clipped and half are
    not, which exercises both branches of ``min(1, C / n)``. Drawn on the CPU (one tensor at a
    time, then moved), so every device times the same values.
    """
    gen = torch.Generator().manual_seed(seed)
    B = shape.batch_size
    factor = torch.linspace(0.5, 1.5, B)[torch.randperm(B, generator=gen)]
    grads = []
    for s in shape.param_shapes:
        g = torch.randn((B, *s), generator=gen)
        grads.append(g.mul_(factor.view(B, *([1] * len(s)))).to(device))
    return grads, math.sqrt(shape.n_params)
