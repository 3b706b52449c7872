"""Book-keeping (BK) layer ops: per-sample squared norms and clipped sums of a layer's weight
gradient from the layer's input ``A`` and output gradient ``G``, without per-sample gradients.

For a linear layer (per sample ``i``: ``A_i`` ``[T, d_in]``, ``G_i`` ``[T, d_out]``, weight gradient
``g_i = G_iᵀ A_i``), :func:`linear_sumsq` gives ``‖S ⊙ (g_i − M)‖²`` with an optional coordinate-wise
scale ``S`` (dense, or rank one ``s_out s_inᵀ``) and shift ``M``, by one of three methods:

- ``"t1"`` (``T = 1``): ``‖a‖²‖b‖²``; with a dense scale ``(b∘b)ᵀ(S∘S)(a∘a)``, one ``[B, d_out] ×
  [d_out, d_in]`` GEMM for the batch (on ``cpu`` the native ``dpkernels_C::linear_sumsq_t1``,
  which squares ``S`` block by block as it packs it and never stores the ``[B, d_in]`` product).
- ``"gram"`` (no scale or rank one): ``⟨A_i A_iᵀ, G_i G_iᵀ⟩`` on ``A·diag(s_in)``, ``G·diag(s_out)``,
  ``O(T²(d_in + d_out))`` per sample.
- ``"tiled"`` (any scale): a per-sample product ``G_iᵀA_i`` computed tile by tile whose epilogue
  shifts, scales, squares and accumulates; the per-sample gradient never reaches memory (FlashDP's
  kernel, "FlashDP: Private Training Large Language Models with Efficient DP-SGD",
  arXiv:2507.01154, with the scale and shift added).

A shift adds ``−2⟨S²⊙M, g_i⟩ + ‖S⊙M‖²`` to the first two, the middle term ``Σ_t G_itᵀ(S²⊙M)A_it``
being one GEMM of the forward's size (on ``cpu``, ``"t1"`` with a shift forms and squares every
element of ``S ⊙ (g aᵀ − M)`` instead, in the same native op: no expansion to cancel).
``"auto"`` picks among them from the shapes and the scale (crossover measured in
docs/BENCHMARKS.md, "Book-keeping"). The clipped sum
:func:`linear_weighted_sum` is ``(w ⊙ G)ᵀ A``, one GEMM over all ``B·T`` rows. Conv2d is the linear
case over im2col patches (:func:`conv2d_sumsq`; its clipped sum :func:`conv2d_weighted_sum` is, on
``cpu``, the tiled product's direct kernel with ``w`` folded into ``G`` and the samples summed too,
elsewhere the framework's weight gradient with ``w`` folded in), Embedding a segment sum over
(sample, token id).

Backends (op family ``layers``): ``reference`` materialises per-sample gradients in float64
(dpkernels/reference/layers.py); ``cpu`` and ``cuda`` run the GEMMs through ATen (BLAS, cuBLAS)
and the tiled product as the native ops ``dpkernels_C::linear_sumsq_tiled`` and
``dpkernels_C::conv2d_sumsq_tiled`` (csrc/cpu/layers.cpp, csrc/cuda/layers.cu); ``triton`` runs the
tiled product in Triton (triton_kernels/layers.py). The tiled product of a conv never builds its
patches on any backend but ``reference``: the CPU's is a direct kernel over a channels-last copy
of the input rows, CUDA's and Triton's gather the patches in place (implicit im2col); the CPU's
conv clipped sum is the same direct kernel (``dpkernels_C::conv2d_weighted_sum``). For the BK
engine the CPU's conv norm can also keep the per-sample gradients it squares
(``dpkernels_C::conv2d_sumsq_grad_sample``), whose clipped sum is then a weighted sum over the batch.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _backend
from ._registry import family
from .reference import layers as ref

__all__ = [
    "LINEAR_METHODS",
    "conv2d_sumsq",
    "conv2d_weighted_sum",
    "embedding_sumsq",
    "embedding_weighted_sum",
    "linear_sumsq",
    "linear_weighted_sum",
]

LINEAR_METHODS = ("auto", "t1", "gram", "tiled")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# The Gram form's tiling per device: (rows per row block of T, elements per Gram chunk). On the
# CPU, for T > 64, the upper block rows only (row blocks of 64: about (1 + 64/T)/2 of the flops),
# and Grams over 1 MiB a chunk of samples at a time into two buffers reused: fresh [B, T, T]
# Grams can fault in their pages on every call (10,208 faults and 4x the two GEMMs' time at B = 32,
# T = 256, d = 64 on a 2-core EPYC; docs/BENCHMARKS.md, "Book-keeping"). On a GPU the whole Grams:
# fewest launches.
_GRAM_TILING = {"cpu": (64, 1 << 18)}
_GRAM_TILING_DEFAULT = (None, 1 << 24)
# The CPU's native Gram pass (dpkernels_C::linear_sumsq_gram) packs one sample's A and G whole per
# thread: up to this many elements (T·(d_in + d_out), 16 MiB of fp32), beyond it the tiled GEMMs above.
# Its tiles span 16 positions: below this T the batched GEMMs are faster (d = 1024, B = 32, on a
# 2-core EPYC: T = 4 native ÷ bmm 4.0, T = 8 1.37, T = 12 0.88; docs/BENCHMARKS.md, "Book-keeping").
_GRAM_NATIVE_MAX_ELEMS = 1 << 22
_GRAM_NATIVE_MIN_T = 12
# A conv's explicit im2col patches (Gram form) are built a chunk of samples at a time, at
# most max(this, the input's size) elements per chunk: kh·kw times the input would otherwise double
# a small CNN's peak memory.
_PATCH_CHUNK_ELEMS = 1 << 18
# "auto" takes the Gram form when T·(d_in + d_out) <= GRAM_CROSSOVER[backend] · d_in·d_out, i.e. when
# its flops are at most that fraction of the tiled product's: measured with tools/bk_crossover.py
# (docs/BENCHMARKS.md, "Book-keeping"), least total slowdown over the grid. cpu, its native Gram pass:
# any value in [1.25, 2). The others, ATen's batched GEMMs (measured on the CPU, when it ran them
# too): [0.625, 1).
GRAM_CROSSOVER = {"cpu": 1.5}
GRAM_CROSSOVER_DEFAULT = 0.75
# The same for a conv (conv2d_sumsq): there the tiled product reads the input in place (the CPU's
# direct kernel runs at the framework's weight-gradient speed) and the Gram form builds the patches.
# tools/bk_crossover.py --conv (docs/BENCHMARKS.md): least total slowdown over 16 shapes for any
# value in [0.017, 0.035).
CONV_GRAM_CROSSOVER = 0.025


# --------------------------------------------------------------------------------------------
# The layers family: every backend implements
#   linear_sumsq(a, g, s_out, s_in, scale, shift, method) -> float64 [B]
#   linear_weighted_sum(a, g, weights, out) -> float32 [d_out, d_in] (float64 for float64 input)
#   embedding_sumsq(ids, g, num_embeddings, padding_idx, scale, shift) -> float64 [B]
#   embedding_weighted_sum(ids, g, weights, num_embeddings, padding_idx, out) -> [V, d], as above
#   conv2d_sumsq(x, g, weight_shape, geom, scale, shift, method) -> float64 [B]
#   conv2d_weighted_sum(x, g, weights, weight_shape, geom) -> weight_shape, as above
# on validated input: a, g [B, T, d]; ids [B, T] int64 in range; scale either dense [d_out, d_in]
# (s_out = s_in = None) or rank one (scale = None); x [B, C_in, H, W] and g [B, C_out, H_out,
# W_out] contiguous, scale/shift of a conv None or shaped like its weight; method resolved (not
# "auto"); out None or a checked buffer of the result's dtype and shape, written and returned.
# --------------------------------------------------------------------------------------------


class Conv2dGeometry(NamedTuple):
    """A Conv2d's geometry, every size a pair (as ``torch.nn.Conv2d`` keeps them)."""

    kernel_size: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    groups: int


class _ReferenceLayers:
    """The float64 materialising reference (``method`` is ignored: it defines every method)."""

    @staticmethod
    def linear_sumsq(a, g, s_out, s_in, scale, shift, method):
        return ref.linear_sumsq(a, g, (s_out, s_in) if s_out is not None else scale, shift)

    @staticmethod
    def linear_weighted_sum(a, g, weights, out):
        return _into(out, ref.linear_weighted_sum(a, g, weights))

    @staticmethod
    def embedding_sumsq(ids, g, num_embeddings, padding_idx, scale, shift):
        return ref.embedding_sumsq(ids, g, num_embeddings, padding_idx, scale, shift)

    @staticmethod
    def embedding_weighted_sum(ids, g, weights, num_embeddings, padding_idx, out):
        return _into(out, ref.embedding_weighted_sum(ids, g, weights, num_embeddings, padding_idx))

    @staticmethod
    def conv2d_sumsq(x, g, weight_shape, geom, scale, shift, method):
        return ref.conv2d_sumsq(x, g, weight_shape, *geom[1:], scale, shift)

    @staticmethod
    def conv2d_weighted_sum(x, g, weights, weight_shape, geom):
        return ref.conv2d_weighted_sum(x, g, weights, weight_shape, *geom[1:])


def _into(out: Tensor | None, result: Tensor) -> Tensor:
    return result if out is None else out.copy_(result)


def _acc_dtype(x: Tensor) -> torch.dtype:
    """The GEMM dtype: float32, float64 for float64 input (half inputs are upcast: the norms drive
    a privacy clip and bf16 products would round them to 8 bits)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _f32(t: Tensor | None) -> Tensor | None:
    """A native kernel's scale/shift operand: contiguous float32 (None stays None)."""
    return None if t is None else t.float().contiguous()


def _dense_scale(s_out: Tensor, s_in: Tensor) -> Tensor:
    """The rank-one scale ``s_out s_inᵀ`` as a dense float32 ``[d_out, d_in]``, for the kernels that
    read a dense one."""
    return s_out.float()[:, None] * s_in.float()[None, :]


def _rowdot(x: Tensor, y: Tensor) -> Tensor:
    """``Σ_k x_k y_k`` over the last dimension: products in the inputs' dtype (fp32 products of
    fp32 GEMM outputs), accumulated in float64 (no float64 copies of the operands)."""
    return (x * y).sum(-1, dtype=torch.float64)


class _AtenLayers:
    """cpu and cuda: GEMMs through ATen (BLAS / cuBLAS), the tiled product as a native op."""

    @staticmethod
    def tiled(a, g, scale, shift):
        return torch.ops.dpkernels_C.linear_sumsq_tiled(a, g, scale, shift)

    @classmethod
    def linear_sumsq(cls, a, g, s_out, s_in, scale, shift, method):
        if method == "tiled":
            if s_out is not None:
                scale = _dense_scale(s_out, s_in)
            if a.dtype == torch.float64:
                return ref.linear_sumsq(a, g, scale, shift)
            return cls.tiled(a, g, _f32(scale), _f32(shift)).double()
        if method == "t1" and scale is None and shift is None and a.dtype != torch.float64:
            # ‖a‖²‖g‖² (times the rank-one scale's rows): both row norms in one multi-tensor pass
            sq = cls.rows_sumsq([a[:, 0], g[:, 0]], None if s_out is None else [s_in.float(), s_out.float()])
            return sq[:, 0] * sq[:, 1]
        if method == "t1":
            return cls.t1_sumsq(a[:, 0], g[:, 0], s_out, s_in, scale, shift)
        dt = _acc_dtype(a)
        a, g = a.to(dt), g.to(dt)
        sumsq = cls.gram(a if s_in is None else a * s_in.to(dt), g if s_out is None else g * s_out.to(dt))
        if shift is not None:
            sumsq = sumsq + _shift_terms(a, g, s_out, s_in, scale, shift)
        return sumsq.clamp_min_(0.0)

    @staticmethod
    def gram(a, g):
        """``⟨A_i A_iᵀ, G_i G_iᵀ⟩``, float64 ``[B]`` (:func:`_gram_sumsq`)."""
        return _gram_sumsq(a, g)

    @staticmethod
    def t1_sumsq(a, g, s_out, s_in, scale, shift):
        """``T = 1`` norms of ``[B, d]`` rows, float64 ``[B]``: :func:`_t1_sumsq` and the shift's
        terms (:func:`_shift_terms`)."""
        dt = _acc_dtype(a)
        a, g = a.to(dt), g.to(dt)
        sumsq = _t1_sumsq(a, g, s_out, s_in, scale)
        if shift is not None:
            sumsq = sumsq + _shift_terms(a[:, None], g[:, None], s_out, s_in, scale, shift)
        return sumsq.clamp_min_(0.0)

    @staticmethod
    def rows_sumsq(rows, scales=None):
        """``Σ_k (s_k x_ik)²`` per row of each ``[B, d]`` tensor (fp32/fp16/bf16), float64 ``[B, len(rows)]``:
        the clip family's multi-tensor pass, all rows at once."""
        return torch.ops.dpkernels_C.per_sample_sumsq(list(rows), [1.0], [], list(scales or []))

    @staticmethod
    def linear_weighted_sum(a, g, weights, out):
        """``(w ⊙ G)ᵀ A`` with ``w`` folded into the narrower of ``A`` and ``G`` (``Gᵀ(w ⊙ A)``)."""
        dt = _acc_dtype(a)
        a, g = a.to(dt), g.to(dt)
        w = weights.to(dt)[:, None, None]
        if a.shape[-1] < g.shape[-1]:
            a = a * w
        else:
            g = g * w
        return torch.mm(g.reshape(-1, g.shape[-1]).T, a.reshape(-1, a.shape[-1]), out=out)

    @staticmethod
    def embedding_sumsq(ids, g, num_embeddings, padding_idx, scale, shift):
        B, d = g.shape[0], g.shape[-1]
        dt = _acc_dtype(g)
        keys, rows, tok = _segments(ids, g.reshape(-1, d).to(dt), num_embeddings, padding_idx)
        seg = torch.zeros(keys.numel(), d, dtype=dt, device=g.device).index_add_(0, rows, tok)
        v = keys % num_embeddings
        if shift is not None:
            seg = seg - shift[v].to(dt)
        if scale is not None:
            seg = seg * scale[v].to(dt)
        terms = _rowdot(seg, seg)
        out = torch.zeros(B, dtype=torch.float64, device=g.device)
        if shift is not None:  # rows the sample never touches have g_i[v] = 0: ‖S_v ⊙ M_v‖² each
            sm = shift.double() if scale is None else shift.double() * scale.double()
            row_sq = _rowdot(sm, sm)
            terms = terms - row_sq[v]
            out += row_sq.sum()
        return out.index_add_(0, keys // num_embeddings, terms)

    @staticmethod
    def embedding_weighted_sum(ids, g, weights, num_embeddings, padding_idx, out):
        dt = _acc_dtype(g)
        flat = (g.to(dt) * weights.to(dt)[:, None, None]).reshape(-1, g.shape[-1])
        out = torch.zeros(num_embeddings, g.shape[-1], dtype=dt, device=g.device) if out is None else out.zero_()
        out.index_add_(0, ids.reshape(-1), flat)
        if padding_idx is not None:
            out[padding_idx] = 0
        return out

    @staticmethod
    def conv_tiled(x, g, geom, scale, shift):
        """One group's tiled norms, read from ``x`` and ``g`` in place (implicit im2col)."""
        return torch.ops.dpkernels_C.conv2d_sumsq_tiled(x, g, geom.kernel_size, geom.stride, geom.padding,
                                                         geom.dilation, scale, shift)  # fmt: skip

    @classmethod
    def conv2d_sumsq(cls, x, g, weight_shape, geom, scale, shift, method):
        if x.dtype == torch.float64:
            return ref.conv2d_sumsq(x, g, weight_shape, *geom[1:], scale, shift)
        if method == "tiled":
            return _sum_over_groups(
                x, g, geom, scale, shift, lambda xj, gj, sc, sh: cls.conv_tiled(xj, gj, geom, sc, sh)
            )
        return _sum_over_groups(x, g, geom, scale, shift, lambda xj, gj, sc, sh: _conv_gram_sumsq(xj, gj, geom, sh))

    @staticmethod
    def conv2d_weighted_sum(x, g, weights, weight_shape, geom):
        """``Σ_i w_i g_i`` as the layer's weight gradient with ``w`` folded into the smaller of ``x``
        and ``g`` (``(w ⊙ G)ᵀA = Gᵀ(w ⊙ A)``): the framework's conv weight-gradient kernel, no
        patches."""
        dt = _acc_dtype(x)
        x, g = x.to(dt), g.to(dt)
        w = weights.to(dt).view(-1, 1, 1, 1)
        if x[0].numel() <= g[0].numel():
            x = x * w
        else:
            g = g * w
        # convolution_backward reads only the weight's shape here; a real (uninitialised) tensor, not
        # conv2d_weight's stride-0 stand-in, which costs the backends a slower path.
        weight = torch.empty(weight_shape, dtype=dt, device=x.device)
        return torch.ops.aten.convolution_backward(
            g,
            x,
            weight,
            None,
            geom.stride,
            geom.padding,
            geom.dilation,
            False,
            (0, 0),
            geom.groups,
            (False, True, False),
        )[1]


def _t1_sumsq(a, g, s_out, s_in, scale):
    """``T = 1``: ``‖S ⊙ (g aᵀ)‖²`` for ``a`` ``[B, d_in]``, ``g`` ``[B, d_out]``; with a dense scale
    ``((g∘g)(S∘S)) · (a∘a)``: non-negative terms, so the fp32 GEMM has no cancellation."""
    if scale is not None:
        return _rowdot((g * g) @ (scale.to(a.dtype) ** 2), a * a)
    if s_out is not None:
        a, g = a * s_in.to(a.dtype), g * s_out.to(g.dtype)
    return _rowdot(a, a) * _rowdot(g, g)


def _gram_sumsq(a, g):
    """``⟨A_i A_iᵀ, G_i G_iᵀ⟩`` per sample (float64 ``[B]``) from the Grams' upper block rows.

    With ``T`` split into row blocks ``R_j`` (``_GRAM_TILING``), block ``j`` forms ``P_j = A_i[R_j]
    A_i[R_j:]ᵀ`` (its rows against themselves and every later row) and the same ``Q_j`` of ``G``:
    ``⟨AAᵀ, GGᵀ⟩ = Σ_j 2⟨P_j, Q_j⟩ − ⟨P_j, Q_j⟩`` over the diagonal block, the Grams being symmetric.
    A chunk of samples at a time, into two buffers reused across chunks and blocks; products in the
    Grams' dtype, sums in float64.
    """
    B, T = a.shape[:2]
    rows, chunk = _GRAM_TILING.get(a.device.type, _GRAM_TILING_DEFAULT)
    rows = T if rows is None else min(rows, T)
    if rows == T and chunk >= B * T * T:  # one block, one chunk: the fewest operations (small layers)
        return _rowdot(torch.bmm(a, a.mT).flatten(1), torch.bmm(g, g.mT).flatten(1))
    out = torch.zeros(B, dtype=torch.float64, device=a.device)
    buf_a = buf_g = a.new_empty(0)
    for lo in range(0, T, rows):
        hi = min(T, lo + rows)
        h, w = hi - lo, T - lo
        step = max(1, chunk // (h * w))
        need = min(step, B) * h * w
        if buf_a.numel() < need:
            buf_a, buf_g = a.new_empty(need), a.new_empty(need)
        for s in range(0, B, step):
            e = min(B, s + step)
            shape = (e - s, h, w)
            p = torch.bmm(a[s:e, lo:hi], a[s:e, lo:].mT, out=buf_a[: math.prod(shape)].view(shape))
            q = torch.bmm(g[s:e, lo:hi], g[s:e, lo:].mT, out=buf_g[: math.prod(shape)].view(shape))
            pq = p.mul_(q)
            total = pq.sum((1, 2), dtype=torch.float64)
            if w > h:
                total = 2 * total - pq[..., :h].sum((1, 2), dtype=torch.float64)
            out[s:e] += total
    return out


def _shift_terms(a, g, s_out, s_in, scale, shift):
    """``−2⟨S²⊙M, g_i⟩ + ‖S⊙M‖²`` with ``⟨S²⊙M, g_i⟩ = Σ_t G_itᵀ (S²⊙M) A_it``: one GEMM over ``B·T`` rows."""
    s2 = None
    if scale is not None:
        s2 = scale.to(a.dtype) ** 2
    elif s_out is not None:
        s2 = (s_out.to(a.dtype) ** 2)[:, None] * (s_in.to(a.dtype) ** 2)[None, :]
    m = shift.to(a.dtype)
    q = m if s2 is None else s2 * m
    B, T = a.shape[:2]
    cross = _rowdot((g.reshape(B * T, -1) @ q), a.reshape(B * T, -1)).view(B, T).sum(1)
    return (q.double() * m.double()).sum() - 2.0 * cross


def _segments(ids, tok, num_embeddings, padding_idx):
    """The distinct (sample, token id) pairs as keys ``i·V + v``, each token row's pair index, and
    the token rows (padding tokens dropped: their gradient row is zero)."""
    B, T = ids.shape
    key = ids + num_embeddings * torch.arange(B, device=ids.device)[:, None]
    key, tok = key.reshape(-1), tok
    if padding_idx is not None:
        keep = ids.reshape(-1) != padding_idx
        key, tok = key[keep], tok[keep]
    keys, rows = torch.unique(key, return_inverse=True)
    return keys, rows, tok


def _sum_over_groups(x, g, geom, scale, shift, norms) -> Tensor:
    """``Σ_j norms(x_j, g_j, scale_j, shift_j)`` in float64 over a conv's groups: channel slices of
    ``x`` and ``g``, and the group's rows of ``scale``/``shift`` as contiguous fp32 matrices (or None)."""
    total = None
    for j, (xj, gj) in enumerate(_group_views(x, g, geom.groups)):
        sc, sh = (_f32(_group_rows(t, geom.groups, j)) for t in (scale, shift))
        part = norms(xj, gj, sc, sh).double()
        total = part if total is None else total + part
    return total


def _group_views(x: Tensor, g: Tensor, groups: int):
    """Per group ``(x_j, g_j)``: channel slices of ``x`` and ``g`` (views)."""
    cx, cg = x.shape[1] // groups, g.shape[1] // groups
    return [(x[:, j * cx : (j + 1) * cx], g[:, j * cg : (j + 1) * cg]) for j in range(groups)]


def _patch_chunks(x: Tensor, g: Tensor, geom: Conv2dGeometry):
    """One group's im2col patches ``(A [b, T, d_in], G [b, T, d_out])`` a chunk of samples at a time,
    each chunk's patches about the size of the whole input at most (and at least one sample)."""
    B = x.shape[0]
    per_sample = max(1, math.prod(geom.kernel_size) * x[0].numel())
    step = max(1, min(B, max(x.numel(), _PATCH_CHUNK_ELEMS) // per_sample))
    for lo in range(0, B, step):
        ((a, gg),) = conv2d_patches(x[lo : lo + step], g[lo : lo + step], geom.kernel_size, *geom[1:4], 1)
        yield a, gg


def _conv_gram_sumsq(x, g, geom, shift):
    """One group's Gram-form norms over its patches, chunk by chunk (no scale: "gram" takes none)."""
    parts = []
    for a, gg in _patch_chunks(x, g, geom):
        dt = _acc_dtype(a)
        a, gg = a.to(dt), gg.to(dt)
        sumsq = _gram_sumsq(a, gg)
        if shift is not None:
            sumsq = sumsq + _shift_terms(a, gg, None, None, None, shift)
        parts.append(sumsq.clamp_min_(0.0))
    return torch.cat(parts)


class _CpuLayers(_AtenLayers):
    """cpu: the conv's clipped sum as the direct kernel of its tiled norm (no patches, ``w`` folded into
    the packed ``G``), faster in a training step than the framework's weight gradient (oneDNN)
    with ``w`` folded into a copy of an operand; the Gram form as one native pass over the upper
    triangle (docs/BENCHMARKS.md, "Book-keeping")."""

    @staticmethod
    def gram(a, g):
        T = a.shape[1]
        native = _GRAM_NATIVE_MIN_T <= T and T * (a.shape[2] + g.shape[2]) <= _GRAM_NATIVE_MAX_ELEMS
        if a.dtype == torch.float64 or not native:
            return _gram_sumsq(a, g)
        return torch.ops.dpkernels_C.linear_sumsq_gram(a, g).double()

    @staticmethod
    def t1_sumsq(a, g, s_out, s_in, scale, shift):
        """The native ``T = 1`` pass: with a dense scale one GEMM that squares ``S`` as it packs it
        (ATen's form squares it in a pass of its own first); with a shift every element formed and
        squared, no expansion to cancel."""
        if a.dtype == torch.float64 or (scale is None and shift is None):
            return _AtenLayers.t1_sumsq(a, g, s_out, s_in, scale, shift)
        if s_out is not None:  # rank one, with a shift (without one the rows' norms serve)
            scale = _dense_scale(s_out, s_in)
        return torch.ops.dpkernels_C.linear_sumsq_t1(a, g, _f32(scale), _f32(shift)).double()

    @staticmethod
    def conv2d_weighted_sum(x, g, weights, weight_shape, geom):
        if x.dtype == torch.float64:
            return _AtenLayers.conv2d_weighted_sum(x, g, weights, weight_shape, geom)
        w = weights.float().contiguous()
        parts = [torch.ops.dpkernels_C.conv2d_weighted_sum(xj, gj, w, geom.kernel_size, geom.stride, geom.padding,
                                                           geom.dilation)
                 for xj, gj in _group_views(x, g, geom.groups)]  # fmt: skip
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class _TritonLayers(_AtenLayers):
    """triton: the ATen GEMMs of the native backends, the tiled product in Triton."""

    @staticmethod
    def tiled(a, g, scale, shift):
        from .triton_kernels.layers import linear_sumsq_tiled

        return linear_sumsq_tiled(a, g, scale, shift)

    @staticmethod
    def rows_sumsq(rows, scales=None):
        from .clip import CLIP

        return CLIP.kernels("triton").per_sample_sumsq([list(rows)], [1.0], None, scales)

    @staticmethod
    def conv_tiled(x, g, geom, scale, shift):
        """One group's tiled norms in Triton, read from ``x`` and ``g`` in place (implicit im2col)."""
        from .triton_kernels.layers import conv2d_sumsq_tiled

        return conv2d_sumsq_tiled(x, g, geom.kernel_size, geom.stride, geom.padding, geom.dilation, scale, shift)


if _backend.has_native_ops():

    @torch.library.register_fake("dpkernels_C::linear_sumsq_tiled")
    def _(a, g, scale, shift):
        torch._check(a.dim() == 3 and g.dim() == 3, lambda: "linear_sumsq_tiled takes [B, T, d] a and g")
        return a.new_empty((a.shape[0],), dtype=torch.float32)

    @torch.library.register_fake("dpkernels_C::conv2d_sumsq_tiled")
    def _(x, g, kernel_size, stride, padding, dilation, scale, shift):
        torch._check(x.dim() == 4 and g.dim() == 4, lambda: "conv2d_sumsq_tiled takes [B, C, H, W] x and g")
        return x.new_empty((x.shape[0],), dtype=torch.float32)

    @torch.library.register_fake("dpkernels_C::conv2d_weighted_sum")
    def _(x, g, weights, kernel_size, stride, padding, dilation):
        torch._check(x.dim() == 4 and g.dim() == 4, lambda: "conv2d_weighted_sum takes [B, C, H, W] x and g")
        return x.new_empty((g.shape[1], x.shape[1], *kernel_size), dtype=torch.float32)

    @torch.library.register_fake("dpkernels_C::linear_sumsq_gram")
    def _(a, g):
        torch._check(a.dim() == 3 and g.dim() == 3, lambda: "linear_sumsq_gram takes [B, T, d] a and g")
        return a.new_empty((a.shape[0],), dtype=torch.float32)

    @torch.library.register_fake("dpkernels_C::linear_sumsq_t1")
    def _(a, g, scale, shift):
        torch._check(a.dim() == 2 and g.dim() == 2, lambda: "linear_sumsq_t1 takes [B, d] a and g")
        return a.new_empty((a.shape[0],), dtype=torch.float32)

    @torch.library.register_fake("dpkernels_C::conv2d_sumsq_grad_sample")
    def _(x, g, kernel_size, stride, padding, dilation, scale, shift):
        torch._check(x.dim() == 4 and g.dim() == 4, lambda: "conv2d_sumsq_grad_sample takes [B, C, H, W] x and g")
        kept = x.new_empty((x.shape[0], *kernel_size, x.shape[1], g.shape[1]), dtype=torch.float32)
        return x.new_empty((x.shape[0],), dtype=torch.float32), kept.permute(0, 4, 3, 1, 2)


LAYERS = family(
    "layers",
    (
        "linear_sumsq",
        "linear_weighted_sum",
        "embedding_sumsq",
        "embedding_weighted_sum",
        "conv2d_sumsq",
        "conv2d_weighted_sum",
    ),
    reference=lambda: _ReferenceLayers,
    cpu=lambda: _CpuLayers,
    cuda=lambda: _AtenLayers,
    triton=lambda: _TritonLayers,
)


# --------------------------------------------------------------------------------------------
# Validation and method choice
# --------------------------------------------------------------------------------------------


def _check_tensor(name: str, x, dims: tuple[int, ...], dtypes=_DTYPES) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
    if x.dim() not in dims:
        raise ValueError(f"{name} must have {' or '.join(map(str, dims))} dimensions, got shape {tuple(x.shape)}")
    if x.dtype not in dtypes:
        raise TypeError(f"{name} must be one of {[str(d) for d in dtypes]}, got {x.dtype}")
    return x


def _check_like(name: str, x, shape: tuple[int, ...], device: torch.device) -> Tensor:
    _check_tensor(name, x, (len(shape),))
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but the activations are on {device}")
    return x.contiguous()


def _linear_inputs(a, g, weights=None):
    """``(a, g)`` as contiguous ``[B, T, d]`` tensors of one dtype, checked against each other."""
    _check_tensor("a", a, (2, 3))
    _check_tensor("g", g, (2, 3))
    if a.dim() != g.dim() or a.shape[:-1] != g.shape[:-1]:
        raise ValueError(
            "a and g must share their leading dimensions ([B, d] or [B, T, d]), "
            f"got {tuple(a.shape)} and {tuple(g.shape)}"
        )
    if a.dtype != g.dtype:
        raise TypeError(f"a and g must have one dtype, got {a.dtype} and {g.dtype}")
    if a.device != g.device:
        raise ValueError(f"a is on {a.device} but g is on {g.device}")
    return ref.as_sequence(a).contiguous(), ref.as_sequence(g).contiguous()


def _linear_scale(scale, shift, d_out: int, d_in: int, device):
    """``(s_out, s_in, dense, shift)`` from ``scale`` (None, dense or a pair) and ``shift``."""
    s_out = s_in = dense = None
    if isinstance(scale, (tuple, list)):
        if len(scale) != 2:
            raise ValueError("a rank-one scale is a pair (s_out [d_out], s_in [d_in])")
        s_out = _check_like("scale[0] (s_out)", scale[0], (d_out,), device)
        s_in = _check_like("scale[1] (s_in)", scale[1], (d_in,), device)
    elif scale is not None:
        dense = _check_like("scale", scale, (d_out, d_in), device)
    if shift is not None:
        shift = _check_like("shift", shift, (d_out, d_in), device)
    return s_out, s_in, dense, shift


def _pick_method(method: str, T: int, d_out: int, d_in: int, dense: bool, backend: str, shift: bool = False) -> str:
    if method not in LINEAR_METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {LINEAR_METHODS}")
    if method == "t1" and T != 1:
        raise ValueError(f"method 't1' is for T = 1 (one position per sample), got T = {T}")
    if method == "gram" and dense:
        raise ValueError("method 'gram' takes no dense scale (only None or a rank-one pair); use 'tiled' or 't1'")
    if method != "auto":
        return method
    if shift:
        # A form that squares every element: the shift's expansion subtracts terms as large as
        # ‖S⊙g_i‖², and a norm it underestimates lets the sample exceed the clip bound
        # (docs/ALGORITHMS.md, "Numerics"). On the CPU it is also the faster form ("Book-keeping").
        return "t1" if T == 1 and backend == "cpu" else "tiled"
    if T == 1:
        return "t1"
    if not dense and T * (d_in + d_out) <= GRAM_CROSSOVER.get(backend, GRAM_CROSSOVER_DEFAULT) * d_in * d_out:
        return "gram"
    return "tiled"


# --------------------------------------------------------------------------------------------
# Entry points on checked inputs: the public functions below check, then call these; the BK engine
# (dpkernels/bk.py) calls them directly on what its own layers recorded, whose shapes, dtypes and
# devices the forward and backward already fixed. The checks cost ~25 µs a call on the CPU, a
# tenth of a small conv layer's whole private step (docs/BENCHMARKS.md, "Book-keeping").
# Arguments as the family's kernels take them (the comment above LAYERS' kernels), backend
# resolved; method "auto" or a method name.
# --------------------------------------------------------------------------------------------


def _linear_sumsq(a, g, s_out, s_in, dense, shift, method, backend):
    B, T, d_in = a.shape
    method = _pick_method(method, T, g.shape[-1], d_in, dense is not None, backend, shift is not None)
    if B == 0:
        return torch.zeros(0, dtype=torch.float64, device=a.device)
    return LAYERS.kernels(backend).linear_sumsq(a, g, s_out, s_in, dense, shift, method)


def _linear_weighted_sum(a, g, weights, out, backend):
    return LAYERS.kernels(backend).linear_weighted_sum(a, g, weights, out).to(_acc_dtype(a))


def _embedding_sumsq(ids, g, num_embeddings, padding_idx, scale, shift, backend):
    return LAYERS.kernels(backend).embedding_sumsq(ids, g, num_embeddings, padding_idx, scale, shift)


def _embedding_weighted_sum(ids, g, weights, num_embeddings, padding_idx, out, backend):
    result = LAYERS.kernels(backend).embedding_weighted_sum(ids, g, weights, num_embeddings, padding_idx, out)
    return result.to(_acc_dtype(g))


def _conv2d_sumsq(x, g, weight_shape, geom, scale, shift, method, backend):
    T, d_out, d_in = g.shape[2] * g.shape[3], weight_shape[0] // geom.groups, math.prod(weight_shape[1:])
    method = _pick_conv_method(method, T, d_out, d_in, scale is not None, shift is not None)
    if x.shape[0] == 0:
        return torch.zeros(0, dtype=torch.float64, device=x.device)
    return LAYERS.kernels(backend).conv2d_sumsq(x, g, weight_shape, geom, scale, shift, method)


def _conv2d_sumsq_grad_sample(x, g, weight_shape, geom, scale, shift, backend):
    """``(norms, grad_samples)``: ``conv2d_sumsq``'s float64 ``[B]`` from the CPU's tiled kernel
    together with the per-sample gradients ``g_i`` it squares (unscaled, unshifted), one fp32
    ``[B, O/groups, C/groups, kh, kw]`` per group, stored ``[B, kh, kw, C/groups, O/groups]``, for
    :func:`_grad_sample_weighted_sum`; None where there is no such kernel (other backends, float64)."""
    if backend != "cpu" or x.dtype == torch.float64 or x.shape[0] == 0:
        return None
    kept = []

    def norms(xj, gj, sc, sh):
        sq, gs = torch.ops.dpkernels_C.conv2d_sumsq_grad_sample(xj, gj, geom.kernel_size, geom.stride, geom.padding,
                                                                geom.dilation, sc, sh)  # fmt: skip
        kept.append(gs)
        return sq

    return _sum_over_groups(x, g, geom, scale, shift, norms), kept


def _grad_sample_weighted_sum(grad_samples: list[Tensor], weights: Tensor) -> Tensor:
    """``Σ_i w_i g_i`` of :func:`_conv2d_sumsq_grad_sample`'s per-sample gradients (fp32, the weight's
    shape): per group, the clip family's streaming weighted sum over their storage order."""
    from .clip import CLIP

    stored = [gs.permute(0, 3, 4, 2, 1) for gs in grad_samples]  # [B, kh, kw, C/groups, O/groups], contiguous
    sums = CLIP.kernels("cpu").weighted_sum([stored], weights.float()[:, None].expand(-1, len(stored)).contiguous())
    parts = [s.permute(3, 2, 0, 1) for s in sums]
    return (parts[0] if len(parts) == 1 else torch.cat(parts)).contiguous()


def _conv2d_weighted_sum(x, g, weights, weight_shape, geom, backend):
    if x.shape[0] == 0:
        return torch.zeros(weight_shape, dtype=_acc_dtype(x), device=x.device)
    return LAYERS.kernels(backend).conv2d_weighted_sum(x, g, weights, weight_shape, geom).to(_acc_dtype(x))


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def linear_sumsq(a: Tensor, g: Tensor, *, scale=None, shift: Tensor | None = None, method: str = "auto",
                 backend: str = "auto") -> Tensor:  # fmt: skip
    """Per-sample ``‖S ⊙ (g_i − M)‖²`` of a linear layer's weight gradient ``g_i = G_iᵀ A_i``.

    Args:
        a: the layer's input, ``[B, d_in]`` or ``[B, T, d_in]`` (float32, float16, bfloat16, float64).
        g: the gradient of its output, ``[B, d_out]`` or ``[B, T, d_out]``, same dtype and device.
        scale: ``None``, a dense ``[d_out, d_in]`` tensor, or a pair ``(s_out [d_out], s_in [d_in])``
            for the rank-one ``S = s_out s_inᵀ``.
        shift: ``None`` or ``M``, ``[d_out, d_in]``.
        method: ``"auto"``, ``"t1"``, ``"gram"`` or ``"tiled"`` (module docstring). With a shift
            ``"auto"`` picks a form that squares every element (``cpu``'s ``"t1"`` at ``T = 1``,
            else ``"tiled"``), never the shift's expansion, whose terms cancel.
        backend: ``"auto"``, ``"reference"``, ``"cpu"``, ``"cuda"`` or ``"triton"``.

    Returns: float64 ``[B]``. Products are formed in float32 (float64 for float64 input) and the
    squares accumulated in float64; the Gram and shift forms are clamped at 0.
    """
    a, g = _linear_inputs(a, g)
    s_out, s_in, dense, shift = _linear_scale(scale, shift, g.shape[-1], a.shape[-1], a.device)
    return _linear_sumsq(a, g, s_out, s_in, dense, shift, method, _backend.resolve(backend, a.device))


def _check_weights(weights, B: int, device) -> Tensor:
    if not isinstance(weights, Tensor) or not weights.is_floating_point():
        raise TypeError("weights must be a floating-point tensor [B]")
    if tuple(weights.shape) != (B,):
        raise ValueError(f"weights must have shape [B] = [{B}], got {tuple(weights.shape)}")
    if weights.device != device:
        raise ValueError(f"weights are on {weights.device} but the activations are on {device}")
    return weights.contiguous()


def _check_out(out, shape: tuple[int, ...], dtype: torch.dtype, inputs: tuple[Tensor, ...]) -> None:
    """A weighted sum's ``out``: None, or a contiguous ``dtype`` tensor of ``shape`` on the inputs'
    device that shares no memory with them (a GEMM into its own operand reads what it overwrites)."""
    if out is None:
        return
    _check_like("out", out, shape, inputs[0].device)
    if out.dtype != dtype:
        raise TypeError(f"out must be {dtype} (the result's dtype for these inputs), got {out.dtype}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    if any(out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for x in inputs):
        raise ValueError("out must not share memory with the inputs")


def linear_weighted_sum(a: Tensor, g: Tensor, weights: Tensor, *, out: Tensor | None = None,
                        backend: str = "auto") -> Tensor:  # fmt: skip
    """The clipped sum of a linear layer's weight gradients, ``Σ_i w_i G_iᵀ A_i = (w ⊙ G)ᵀ A``:
    one GEMM over all ``B·T`` rows. ``a``, ``g`` as :func:`linear_sumsq`; ``weights`` ``[B]``.

    ``out``: optional contiguous tensor of the result's dtype and shape on the inputs' device, not
    sharing memory with them, written and returned. A training step that reuses one per layer
    allocates nothing (on the CPU a fresh ``[d_out, d_in]`` result faults in its pages every step).

    Returns: float32 ``[d_out, d_in]`` (float64 for float64 input).
    """
    a, g = _linear_inputs(a, g)
    weights = _check_weights(weights, a.shape[0], a.device)
    _check_out(out, (g.shape[-1], a.shape[-1]), _acc_dtype(a), (a, g, weights))
    return _linear_weighted_sum(a, g, weights, out, _backend.resolve(backend, a.device))


def _embedding_inputs(ids, g, num_embeddings: int, padding_idx):
    _check_tensor("ids", ids, (1, 2), (torch.int64, torch.int32))
    _check_tensor("g", g, (2, 3))
    B = ids.shape[0]
    ids = ids.reshape(B, -1).long()
    g = g.reshape(B, -1, g.shape[-1]) if g.dim() == 3 or ids.shape[1] == 1 else g
    if g.dim() != 3 or tuple(g.shape[:2]) != tuple(ids.shape):
        raise ValueError(f"g must be [B, T, d] for ids [B, T] = {list(ids.shape)}, got {tuple(g.shape)}")
    if g.device != ids.device:
        raise ValueError(f"ids are on {ids.device} but g is on {g.device}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_embeddings):
        raise ValueError(f"token ids must lie in [0, {num_embeddings}), got [{int(ids.min())}, {int(ids.max())}]")
    if padding_idx is not None and not 0 <= padding_idx < num_embeddings:
        raise ValueError(f"padding_idx must lie in [0, {num_embeddings}) (normalised), got {padding_idx}")
    return ids.contiguous(), g.contiguous()


def embedding_sumsq(ids: Tensor, g: Tensor, num_embeddings: int, *, padding_idx: int | None = None, scale=None,
                    shift: Tensor | None = None, backend: str = "auto") -> Tensor:  # fmt: skip
    """Per-sample ``‖S ⊙ (g_i − M)‖²`` of an embedding's weight gradient ``g_i[v] = Σ_{t: id_it = v}
    G_it`` (zero at ``padding_idx``), by a segment sum over the distinct (sample, token id) pairs:
    ``O(B·T·d)``, nothing ``[B, V, d]`` is built.

    Args:
        ids: token ids ``[B, T]`` (or ``[B]``), int64/int32, any strides (``expand``-ed position ids).
        g: the gradient of the embedding's output, ``[B, T, d]``.
        scale, shift: ``None`` or ``[num_embeddings, d]``.

    Returns: float64 ``[B]``.
    """
    ids, g = _embedding_inputs(ids, g, num_embeddings, padding_idx)
    shape = (num_embeddings, g.shape[-1])
    scale = None if scale is None else _check_like("scale", scale, shape, g.device)
    shift = None if shift is None else _check_like("shift", shift, shape, g.device)
    backend = _backend.resolve(backend, g.device)
    return _embedding_sumsq(ids, g, num_embeddings, padding_idx, scale, shift, backend)


def embedding_weighted_sum(ids: Tensor, g: Tensor, weights: Tensor, num_embeddings: int, *,
                           padding_idx: int | None = None, out: Tensor | None = None,
                           backend: str = "auto") -> Tensor:  # fmt: skip
    """``Σ_i w_i g_i`` for an embedding: ``[num_embeddings, d]``, float32 (float64 for float64 ``g``);
    ``out`` as :func:`linear_weighted_sum`'s."""
    ids, g = _embedding_inputs(ids, g, num_embeddings, padding_idx)
    weights = _check_weights(weights, ids.shape[0], g.device)
    _check_out(out, (num_embeddings, g.shape[-1]), _acc_dtype(g), (ids, g, weights))
    backend = _backend.resolve(backend, g.device)
    return _embedding_weighted_sum(ids, g, weights, num_embeddings, padding_idx, out, backend)


def conv2d_patches(x: Tensor, g: Tensor, kernel_size, stride=1, padding=0, dilation=1, groups: int = 1):
    """A Conv2d as ``groups`` linear layers over im2col patches: per group ``(A, G)`` with ``A``
    ``[B, T, C_in/groups · kh · kw]`` and ``G`` ``[B, T, C_out/groups]``, ``T = H_out · W_out``.

    ``x`` is the input ``[B, C_in, H, W]``, ``g`` the output gradient ``[B, C_out, H_out, W_out]``;
    the patch columns are ordered as ``weight[o].flatten()`` (channel, row, column).
    """
    _check_tensor("x", x, (4,))
    _check_tensor("g", g, (4,))
    if isinstance(padding, str):
        raise ValueError("conv2d_patches takes numeric padding (the module's resolved _reversed_padding is not used)")
    B, C_in = x.shape[:2]
    C_out = g.shape[1]
    if g.shape[0] != B or C_in % groups or C_out % groups:
        raise ValueError(f"x {tuple(x.shape)} and g {tuple(g.shape)} do not match a conv with groups={groups}")
    cols = F.unfold(x, kernel_size, dilation=dilation, padding=padding, stride=stride)  # [B, C_in·k, T]
    T = cols.shape[-1]
    if g.shape[2] * g.shape[3] != T:
        raise ValueError(f"g's spatial size {tuple(g.shape[2:])} does not match the unfolded input ({T} positions)")
    a = cols.view(B, groups, -1, T).transpose(2, 3)  # [B, groups, T, C_in/g · k]
    gg = g.reshape(B, groups, C_out // groups, T).transpose(2, 3)  # [B, groups, T, C_out/g]
    return [(a[:, j], gg[:, j]) for j in range(groups)]


def _group_rows(x: Tensor | None, groups: int, j: int):
    """Group ``j``'s rows of a conv weight-shaped ``[C_out, C_in/g, kh, kw]`` tensor as a matrix."""
    if x is None:
        return None
    rows = x.shape[0] // groups
    return x[j * rows : (j + 1) * rows].reshape(rows, -1)


def _pair(name: str, v) -> tuple[int, int]:
    t = (v, v) if isinstance(v, int) else tuple(v)
    if len(t) != 2 or not all(isinstance(e, int) and not isinstance(e, bool) for e in t):
        raise ValueError(f"{name} must be an int or a pair of ints, got {v!r}")
    return t


def _conv_inputs(x, g, weight_shape, stride, padding, dilation, groups):
    """``(x, g, weight_shape, geometry)`` checked against each other; ``x`` and ``g`` contiguous."""
    _check_tensor("x", x, (4,))
    _check_tensor("g", g, (4,))
    if isinstance(padding, str):
        raise ValueError("padding must be numeric (a module's 'same'/'valid' padding resolved to integers)")
    if x.dtype != g.dtype:
        raise TypeError(f"x and g must have one dtype, got {x.dtype} and {g.dtype}")
    if x.device != g.device:
        raise ValueError(f"x is on {x.device} but g is on {g.device}")
    weight_shape = tuple(int(d) for d in weight_shape)
    if not isinstance(groups, int) or groups < 1:
        raise ValueError(f"groups must be a positive int, got {groups!r}")
    if len(weight_shape) != 4 or weight_shape[0] != g.shape[1] or weight_shape[1] * groups != x.shape[1]:
        raise ValueError(
            f"weight_shape {list(weight_shape)} does not match x {tuple(x.shape)}, g {tuple(g.shape)} and "
            f"groups={groups} ([C_out, C_in/groups, kh, kw])"
        )
    if g.shape[0] != x.shape[0] or weight_shape[0] % groups:
        raise ValueError(f"x {tuple(x.shape)} and g {tuple(g.shape)} do not match a conv with groups={groups}")
    geom = Conv2dGeometry(
        weight_shape[2:], _pair("stride", stride), _pair("padding", padding), _pair("dilation", dilation), groups
    )
    if min(geom.stride + geom.dilation + geom.kernel_size) < 1 or min(geom.padding) < 0:
        raise ValueError(f"invalid conv geometry {geom}")
    out = [(x.shape[2 + d] + 2 * geom.padding[d] - geom.dilation[d] * (geom.kernel_size[d] - 1) - 1)
           // geom.stride[d] + 1 for d in range(2)]  # fmt: skip
    if list(g.shape[2:]) != out:
        raise ValueError(f"g's spatial size {list(g.shape[2:])} is not the conv's output size {out}")
    return x.contiguous(), g.contiguous(), weight_shape, geom


def _check_weight_like(name: str, t, weight_shape, device):
    if t is None:
        return None
    _check_tensor(name, t, (4,))
    if tuple(t.shape) != weight_shape:
        raise ValueError(f"{name} must be shaped like the weight {list(weight_shape)}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the activations are on {device}")
    return t.contiguous()


CONV_METHODS = ("auto", "gram", "tiled")


def _pick_conv_method(method: str, T: int, d_out: int, d_in: int, scaled: bool, shift: bool = False) -> str:
    if method not in CONV_METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {CONV_METHODS}")
    if method == "gram" and scaled:
        raise ValueError("method 'gram' takes no scale; use 'tiled'")
    if method != "auto":
        return method
    cheap = T * (d_in + d_out) <= CONV_GRAM_CROSSOVER * d_in * d_out
    return "gram" if cheap and not scaled and not shift else "tiled"  # a shift: as _pick_method


def conv2d_sumsq(x: Tensor, g: Tensor, weight_shape, *, stride=1, padding=0, dilation=1, groups: int = 1,
                 scale: Tensor | None = None, shift: Tensor | None = None, method: str = "auto",
                 backend: str = "auto") -> Tensor:  # fmt: skip
    """Per-sample ``‖S ⊙ (g_i − M)‖²`` of a Conv2d's weight gradient: per group, the linear layer over
    the input's im2col patches (``T = H_out·W_out`` positions, ``d_in = C_in/groups·kh·kw``).

    Args:
        x: the layer's input ``[B, C_in, H, W]`` (float32, float16, bfloat16, float64).
        g: the gradient of its output ``[B, C_out, H_out, W_out]``, same dtype and device.
        weight_shape: ``[C_out, C_in/groups, kh, kw]``.
        stride, padding, dilation, groups: the layer's (ints or pairs; numeric padding).
        scale, shift: ``None`` or shaped like the weight (a dense scale).
        method: ``"tiled"`` (the per-sample product with the scale/shift/square epilogue, the
            patches read in place on ``cpu``, ``cuda`` and ``triton``: implicit im2col), ``"gram"`` (no scale; the
            Gram form over patches built a chunk of samples at a time), or ``"auto"`` (Gram where
            its flops are at most :data:`CONV_GRAM_CROSSOVER` of the tiled product's).

    Returns: float64 ``[B]``, formed as :func:`linear_sumsq`.
    """
    x, g, weight_shape, geom = _conv_inputs(x, g, weight_shape, stride, padding, dilation, groups)
    scale = _check_weight_like("scale", scale, weight_shape, x.device)
    shift = _check_weight_like("shift", shift, weight_shape, x.device)
    return _conv2d_sumsq(x, g, weight_shape, geom, scale, shift, method, _backend.resolve(backend, x.device))


def conv2d_weighted_sum(x: Tensor, g: Tensor, weights: Tensor, weight_shape, *, stride=1, padding=0, dilation=1,
                        groups: int = 1, backend: str = "auto") -> Tensor:  # fmt: skip
    """``Σ_i w_i g_i`` for a Conv2d weight. ``x``, ``g`` as :func:`conv2d_sumsq`; ``weights`` ``[B]``.

    On ``cpu`` the direct kernel of the tiled norm (``dpkernels_C::conv2d_weighted_sum``: no patches,
    ``w_i`` folded into the packed ``G``, fixed sample groups summed in order, so the result does
    not depend on the thread count); on ``cuda`` and ``triton`` the framework's weight gradient
    (cuDNN) with ``w`` folded into the smaller of ``x`` and ``g``; ``reference`` in float64.

    Returns: float32 ``weight_shape`` (float64 for float64 input).
    """
    x, g, weight_shape, geom = _conv_inputs(x, g, weight_shape, stride, padding, dilation, groups)
    weights = _check_weights(weights, x.shape[0], x.device)
    return _conv2d_weighted_sum(x, g, weights, weight_shape, geom, _backend.resolve(backend, x.device))
