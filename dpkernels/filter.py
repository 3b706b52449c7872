"""``linear_filter_``: one step of an element-wise IIR filter over fp32 state buffers, fused.

The generic building block behind correlated noise (:mod:`dpkernels.correlated`: BLT and banded
matrix factorisation), momentum, EMA and IIR gradient filters (DOPPLER, Zhang et al. 2024). Per
element of a tensor list, with ``K`` fp32 state buffers ``S_k`` and host scalars::

    x   = inputs  |  noise_std·z  |  inputs + noise_std·z    (z: Philox, (seed, step, stream), global
                                                            flat index across the list; docs/RNG.md)
    y   = a·x + Σ_k c_k·S_k
    S_k ← d_k·S_k + e_k·y + f_k·x        buffers with (d_k, e_k, f_k) = (1, 0, 0) are neither updated nor
                                         written (read only if c_k ≠ 0)
    out = g·y  (written),  or  out += g·y  (accumulate=True)

Terms with a zero coefficient are skipped, so a buffer that is only written (``d_k = 0``) is never
read. Math is fp32 whatever the storage dtype (fp32/fp16/bf16 inputs and outputs; state is always
fp32), one pass over memory and one launch per dtype for the whole list. Ring buffers (banded MF,
IIR filters with past inputs/outputs) rotate on the host: pass the buffers in the order their
coefficients apply. The reference is :func:`dpkernels.reference.filter.linear_filter`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from . import _backend
from ._registry import custom_op, family
from ._validate import FP32_MAX, real
from .noise import _FLOAT_DTYPES, NoiseKey, _check_std
from .reference import filter as ref

#: Buffers per call (csrc/include/dpkernels/filter.h kMaxFilterBuffers).
MAX_FILTER_BUFFERS = 32


def _split_coeffs(coeffs: Sequence[float]):
    K = (len(coeffs) - 2) // 4
    return dict(
        a=coeffs[0],
        g=coeffs[1],
        c=coeffs[2 : 2 + K],
        d=coeffs[2 + K : 2 + 2 * K],
        e=coeffs[2 + 2 * K : 2 + 3 * K],
        f=coeffs[2 + 3 * K :],
    )


# --------------------------------------------------------------------------------------------
# The filter family: one op, ``step(inputs, state, out, coeffs, accumulate, noise_std, key)`` with
# the native op's contract (csrc/ops.cpp): state[k·L + l] is buffer k of tensor l.
# --------------------------------------------------------------------------------------------


class _ReferenceFilter:
    @staticmethod
    def step(inputs, state, out, coeffs, accumulate, noise_std, key: NoiseKey) -> None:
        K = (len(coeffs) - 2) // 4
        L = len(out) if out else (len(inputs) if inputs else len(state) // K)
        ref.linear_filter(
            [state[k * L : (k + 1) * L] for k in range(K)], **_split_coeffs(coeffs), inputs=inputs or None,
            out=out or None, accumulate=accumulate, noise_std=noise_std, seed=key.key, step=key.step,
            stream=key.stream, offset=key.offset,
        )  # fmt: skip


class _NativeFilter:
    @staticmethod
    def step(inputs, state, out, coeffs, accumulate, noise_std, key: NoiseKey) -> None:
        torch.ops.dpkernels_C.linear_filter_(
            inputs, state, out, coeffs, accumulate, noise_std, key.limbs()[0], key.step, key.stream, key.offset
        )


class _TritonFilter:
    @staticmethod
    def step(inputs, state, out, coeffs, accumulate, noise_std, key: NoiseKey) -> None:
        from .triton_kernels import filter as tf

        tf.linear_filter_(inputs, state, out, coeffs, accumulate, noise_std, key.key, key.step, key.stream, key.offset)


FILTER = family(
    "filter",
    ("step",),
    reference=lambda: _ReferenceFilter,
    cpu=lambda: _NativeFilter,
    cuda=lambda: _NativeFilter,
    triton=lambda: _TritonFilter,
)


@custom_op("linear_filter_", mutates_args=("state", "out"))
def _linear_filter_op(
    inputs: list[Tensor], state: list[Tensor], out: list[Tensor], coeffs: list[float], accumulate: bool,
    noise_std: float, seed: int, step: int, stream: int, offset: int, backend: str,
) -> None:  # fmt: skip
    key = NoiseKey.from_schema("philox", [seed], step, stream, offset)
    FILTER.kernels(backend).step(inputs, state, out, coeffs, accumulate, noise_std, key)


def _as_list(name: str, value) -> list[Tensor]:
    if value is None:
        return []
    if isinstance(value, Tensor) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a list of tensors")
    for i, t in enumerate(value):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}[{i}] must be a tensor, got {type(t).__name__}")
    return list(value)


def _check_coeffs(K: int, a, c, d, e, f, g) -> list[float]:
    for name, seq in (("c", c), ("d", d), ("e", e), ("f", f)):
        if len(seq) != K:
            raise ValueError(f"{name} must hold one coefficient per state buffer ({K}), got {len(seq)}")
    names = ["a", "g"] + [f"{n}[{k}]" for n in "cdef" for k in range(K)]
    # The kernels hold every coefficient in fp32: a larger magnitude would be inf there.
    return [real(name, v, low=-FP32_MAX, high=FP32_MAX) for name, v in zip(names, [a, g, *c, *d, *e, *f], strict=True)]


def linear_filter_(
    state: Sequence[Sequence[Tensor]],
    *,
    c: Sequence[float],
    d: Sequence[float],
    e: Sequence[float],
    f: Sequence[float],
    a: float = 1.0,
    g: float = 1.0,
    inputs: Sequence[Tensor] | None = None,
    out: Sequence[Tensor] | None = None,
    accumulate: bool = False,
    noise_std: float = 0.0,
    seed: int | None = None,
    step: int | None = None,
    stream: int = 0,
    offset: int = 0,
    backend: str = "auto",
) -> None:
    """One filter step in place (formula in the module docstring).

    Args:
        state: ``K`` lists (one per buffer, ``K <= 32``, may be 0) of ``L`` contiguous float32 tensors;
            ``state[k][l]`` has as many elements as tensor ``l``. Updated in place.
        c, d, e, f: ``K`` coefficients each; ``a``, ``g``: scalars. Every coefficient is a real
            number of magnitude at most the fp32 maximum (the kernels hold them in fp32).
        inputs: ``L`` contiguous fp32/fp16/bf16 tensors ``x``, or ``None`` (then ``x`` is the noise
            alone, or 0).
        out: ``L`` contiguous fp32/fp16/bf16 tensors (the dtype of ``inputs`` if both are given) that
            receive ``g·y`` rounded once (or get it added in fp32 with ``accumulate=True``), or
            ``None`` when only the state matters (momentum).
        noise_std: ``> 0`` adds ``noise_std·z`` to ``x`` with ``z`` from Philox ``(seed, step, stream)``
            at global index ``offset + Σ_{s<l} numel_s + i`` (``seed``/``step`` then required).

    ``out`` must not share memory with ``inputs`` or ``state``. Raises ``ValueError``/``TypeError``
    on mismatched counts, sizes, devices or dtypes, non-contiguous or empty lists, and coefficients
    that are not finite in fp32.
    """
    if isinstance(state, Tensor) or not isinstance(state, Sequence):
        raise TypeError("state must be a list (one entry per buffer) of lists of tensors")
    bufs = [_as_list(f"state[{k}]", s) for k, s in enumerate(state)]
    K = len(bufs)
    if K > MAX_FILTER_BUFFERS:
        raise ValueError(f"at most {MAX_FILTER_BUFFERS} state buffers per call, got {K}")
    coeffs = _check_coeffs(K, a, c, d, e, f, g)
    ins, outs = _as_list("inputs", inputs), _as_list("out", out)
    if not (ins or outs or (bufs and bufs[0])):
        raise ValueError("linear_filter_ needs at least one tensor in inputs, out or state")
    ref_list = outs or ins or bufs[0]
    L = len(ref_list)
    device = ref_list[0].device
    for name, lst in (("inputs", ins), ("out", outs)):
        if lst and len(lst) != L:
            raise ValueError(f"{name} must hold {L} tensors (one per parameter), got {len(lst)}")
        for i, t in enumerate(lst):
            if t.dtype not in _FLOAT_DTYPES:
                raise TypeError(f"{name}[{i}] has dtype {t.dtype}; expected float32, float16 or bfloat16")
    for k, lst in enumerate(bufs):
        if len(lst) != L:
            raise ValueError(f"state[{k}] must hold {L} tensors (one per parameter), got {len(lst)}")
        for i, t in enumerate(lst):
            if t.dtype != torch.float32:
                raise TypeError(f"state[{k}][{i}] must be float32 (state is kept in fp32), got {t.dtype}")
    every = [(f"inputs[{i}]", t) for i, t in enumerate(ins)] + [(f"out[{i}]", t) for i, t in enumerate(outs)]
    every += [(f"state[{k}][{i}]", t) for k, lst in enumerate(bufs) for i, t in enumerate(lst)]
    for name, t in every:
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but the first tensor is on {device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    for i in range(L):
        n = ref_list[i].numel()
        per_tensor = [("inputs", ins), ("out", outs)] + [(f"state[{k}]", lst) for k, lst in enumerate(bufs)]
        for name, lst in per_tensor:
            if lst and lst[i].numel() != n:
                raise ValueError(f"{name}[{i}] has {lst[i].numel()} elements but tensor {i} has {n}")
        if ins and outs and ins[i].dtype != outs[i].dtype:
            raise TypeError(f"inputs[{i}] is {ins[i].dtype} but out[{i}] is {outs[i].dtype}; they must match")
    written = {t.untyped_storage().data_ptr() for t in outs if t.numel()}
    read = {t.untyped_storage().data_ptr() for t in ins + [b for lst in bufs for b in lst] if t.numel()}
    if written & read:
        raise ValueError("out must not share memory with inputs or state")
    noise_std = _check_std(noise_std, "noise_std")
    if noise_std > 0 and step is None:
        raise ValueError("step is required when noise_std > 0 (it keys the Philox counter)")
    if noise_std == 0 and seed is None:
        seed = 0  # no draw: nothing to key
    key = NoiseKey.of("philox", seed, 0 if step is None else step, stream, offset)
    _, limbs, *counter = key.schema()
    _linear_filter_op(
        ins, [t for lst in bufs for t in lst], outs, coeffs, bool(accumulate), float(noise_std), *limbs, *counter,
        _backend.resolve(backend, device),
    )  # fmt: skip
