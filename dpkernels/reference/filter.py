"""Pure-PyTorch reference of ``linear_filter_``: one step of an element-wise linear recurrence.

For each element of a list of ``L`` tensors, with ``K`` state buffers ``S_k`` (fp32, one tensor per
buffer and parameter) and host coefficients ``a, g, c_k, d_k, e_k, f_k``::

    x   = input  |  std·z  |  input + std·z          z ~ N(0, 1) from Philox (seed, step, stream),
                                                      global flat index across the list (docs/RNG.md)
    y   = a·x + Σ_k c_k·S_k
    S_k ← d_k·S_k + e_k·y + f_k·x                     (left alone when (d_k, e_k, f_k) = (1, 0, 0))
    out = g·y,  or  target += g·y

A term whose coefficient is exactly 0 is not evaluated (an only-written buffer is never read, and a
switched-off term cannot turn an inf into a NaN). Terms are summed in the order written. Math is
fp32 (or ``math_dtype``, e.g. float64 for tests against dense matrices); ``std·z`` is rounded to
fp32 first, as in ``add_gaussian_noise_``.

What it expresses (see docs/ALGORITHMS.md, "Correlated noise and linear_filter_"):

- BLT noise, C⁻¹ in streaming form: ``x = std·z, a = 1, c = −ω, d = θ, e = 1, f = 0``.
- Banded MF (ring of ``b − 1`` past values, passed newest first): ``a = 1/row₀``, ``c_r = −row_r/row₀``,
  read-only slots ``(d, e, f) = (1, 0, 0)``, the oldest ``(0, 1, 0)`` (read for ``y``, then overwritten with
  it); ``g`` = the column norm.
- Heavy-ball momentum ``S ← μS + g``: ``a = 1, c = μ, d = 0, e = 1``; EMA ``m ← βm + (1−β)g``:
  ``a = 1−β, c = β, d = 0, e = 1``; IIR filters of order (p, q) with ring buffers of past outputs
  (written with ``e = 1``) and past inputs (written with ``f = 1``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import noise as ref_noise


def linear_filter(
    state: Sequence[Sequence[torch.Tensor]],
    *,
    a: float,
    c: Sequence[float],
    d: Sequence[float],
    e: Sequence[float],
    f: Sequence[float],
    g: float = 1.0,
    inputs: Sequence[torch.Tensor] | None = None,
    out: Sequence[torch.Tensor] | None = None,
    accumulate: bool = False,
    noise_std: float = 0.0,
    seed: int = 0,
    step: int = 0,
    stream: int = 0,
    offset: int = 0,
    shapes: Sequence[torch.Size] | None = None,
    math_dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """One filter step; updates ``state[k][l]`` and ``out`` in place and returns ``g·y`` per tensor.

    ``state``: ``K`` lists of ``L`` tensors (buffer-major), each holding as many elements as
    tensor ``l``. ``inputs``: ``L`` tensors, or ``None`` for noise only (then ``shapes`` or ``out``
    or the state gives the sizes). Noise is drawn when ``noise_std > 0``. ``out``: ``L`` tensors
    written with ``g·y`` (rounded once to their dtype), or, with ``accumulate``, that get ``g·y``
    added to their value. The returned tensors are in ``math_dtype``.
    """
    K = len(state)
    if inputs is not None:
        sizes = [t.shape for t in inputs]
    elif out is not None:
        sizes = [t.shape for t in out]
    elif shapes is not None:
        sizes = [torch.Size(s) for s in shapes]
    else:
        sizes = [t.shape for t in state[0]]
    device = (inputs or out or state[0])[0].device
    numels = [s.numel() for s in sizes]
    if noise_std > 0:
        z = ref_noise.standard_normal(sum(numels), seed=seed, step=step, stream=stream, offset=offset, device=device)
        # std·z is an fp32 product (the kernels' rounding) before any wider math.
        noise = [
            (torch.tensor(noise_std, dtype=torch.float32) * part).to(math_dtype) for part in torch.split(z, numels)
        ]
    results = []
    for idx, size in enumerate(sizes):
        if inputs is not None:
            x = inputs[idx].reshape(-1).to(math_dtype)
            if noise_std > 0:
                x = x + noise[idx]
        elif noise_std > 0:
            x = noise[idx]
        else:
            x = torch.zeros(numels[idx], dtype=math_dtype, device=device)
        old = [state[k][idx].reshape(-1).to(math_dtype) for k in range(K)]
        y = a * x if a != 0 else torch.zeros_like(x)
        for k in range(K):
            if c[k] != 0:
                y = y + c[k] * old[k]
        for k in range(K):
            if (d[k], e[k], f[k]) == (1, 0, 0):
                continue
            new = d[k] * old[k] if d[k] != 0 else torch.zeros_like(x)
            if e[k] != 0:
                new = new + e[k] * y
            if f[k] != 0:
                new = new + f[k] * x
            state[k][idx].copy_(new.view(state[k][idx].shape))
        res = g * y
        if out is not None:
            target = out[idx]
            if accumulate:
                target.copy_((target.reshape(-1).to(math_dtype) + res).view(target.shape).to(target.dtype))
            else:
                target.copy_(res.view(target.shape).to(target.dtype))
        results.append(res.view(size))
    return results
