"""Pure-PyTorch reference for the book-keeping (BK) layer ops: per-sample squared gradient norms
and clipped sums of a layer's weight, from the layer's input ``A`` and output gradient ``G``.

It materialises every per-sample gradient in float64 and defines what the ``cpu``, ``cuda`` and
``triton`` backends compute without materialising them (dpkernels/layers.py). Notation, per sample
``i`` (``T`` positions: tokens, pixels of a convolution's output; ``T = 1`` for a plain MLP):

- linear layer ``y = x Wᵀ``: ``A_i`` is ``[T, d_in]``, ``G_i`` is ``[T, d_out]``, the per-sample
  weight gradient is ``g_i = G_iᵀ A_i`` (``[d_out, d_in]``).
- ``n_i² = ‖S ⊙ (g_i − M)‖²`` with an optional coordinate-wise ``scale`` S (dense ``[d_out, d_in]``,
  or rank one ``s_out s_inᵀ`` given as the pair ``(s_out, s_in)``) and ``shift`` M ``[d_out, d_in]``:
  scale-then-privatize's ``‖s ⊙ g_i‖`` ("On Design Principles for Private Adaptive Optimizers",
  arXiv:2507.01129) and DP-MacAdam's ``‖(g_i − m) ⊙ s‖`` (arXiv:2606.05435).
- the clipped sum ``Σ_i w_i g_i = (w ⊙ G)ᵀ A`` over all ``B·T`` rows.
- embedding ``y_it = W[id_it]``: ``g_i[v] = Σ_{t: id_it = v} G_it``, zero at ``padding_idx``.
- Conv2d: per group, the linear layer over the input's im2col patches (``T = H_out·W_out``
  positions, columns in ``weight[o].flatten()`` order); ``g_i`` is shaped like the weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def as_sequence(x: Tensor) -> Tensor:
    """``[B, d]`` → ``[B, 1, d]``; ``[B, T, d]`` unchanged (``T = 1`` is the MLP case)."""
    return x.unsqueeze(1) if x.dim() == 2 else x


def dense_scale(scale, d_out: int, d_in: int) -> Tensor | None:
    """``S`` as a dense float64 ``[d_out, d_in]`` matrix (``None`` stays ``None``)."""
    if scale is None:
        return None
    if isinstance(scale, (tuple, list)):
        s_out, s_in = scale
        return s_out.double()[:, None] * s_in.double()[None, :]
    return scale.double().reshape(d_out, d_in)


def linear_grad_samples(a: Tensor, g: Tensor) -> Tensor:
    """Per-sample weight gradients ``g_i = G_iᵀ A_i``, float64 ``[B, d_out, d_in]``."""
    return torch.einsum("bto,btk->bok", as_sequence(g).double(), as_sequence(a).double())


def masked_sumsq(grads: Tensor, scale: Tensor | None, shift: Tensor | None) -> Tensor:
    """``n_i² = ‖S ⊙ (g_i − M)‖²`` over all but the first dimension of float64 ``grads``."""
    v = grads if shift is None else grads - shift.double()
    if scale is not None:
        v = v * scale
    return v.flatten(1).square().sum(1)


def linear_sumsq(a: Tensor, g: Tensor, scale=None, shift: Tensor | None = None) -> Tensor:
    """``‖S ⊙ (G_iᵀA_i − M)‖²`` per sample, float64 ``[B]``.

    ``a``: ``[B, d_in]`` or ``[B, T, d_in]``; ``g``: ``[B, d_out]`` or ``[B, T, d_out]``; ``scale``:
    ``None``, ``[d_out, d_in]`` or ``(s_out [d_out], s_in [d_in])``; ``shift``: ``None`` or ``[d_out, d_in]``.
    """
    grads = linear_grad_samples(a, g)
    d_out, d_in = grads.shape[1:]
    return masked_sumsq(grads, dense_scale(scale, d_out, d_in), None if shift is None else shift.reshape(d_out, d_in))


def linear_weighted_sum(a: Tensor, g: Tensor, weights: Tensor) -> Tensor:
    """``Σ_i w_i G_iᵀ A_i``, float64 ``[d_out, d_in]``."""
    return torch.einsum("b,bok->ok", weights.double(), linear_grad_samples(a, g))


def embedding_grad_samples(ids: Tensor, g: Tensor, num_embeddings: int, padding_idx: int | None) -> Tensor:
    """Per-sample embedding gradients, float64 ``[B, V, d]``: ``g_i[v] = Σ_{t: id_it = v} G_it``,
    with the ``padding_idx`` row zero (``torch.nn.functional.embedding``'s gradient)."""
    ids, g = ids.reshape(ids.shape[0], -1), g.reshape(g.shape[0], -1, g.shape[-1]).double()
    out = torch.zeros(ids.shape[0], num_embeddings, g.shape[-1], dtype=torch.float64, device=g.device)
    out.scatter_add_(1, ids[..., None].expand(-1, -1, g.shape[-1]), g)
    if padding_idx is not None:
        out[:, padding_idx] = 0
    return out


def embedding_sumsq(ids: Tensor, g: Tensor, num_embeddings: int, padding_idx: int | None = None, scale=None,
                    shift: Tensor | None = None) -> Tensor:  # fmt: skip
    """``‖S ⊙ (g_i − M)‖²`` of the per-sample embedding gradient, float64 ``[B]`` (``ids``: ``[B, T]``
    token ids, ``g``: ``[B, T, d]``; ``scale``/``shift``: ``None`` or ``[V, d]``)."""
    grads = embedding_grad_samples(ids, g, num_embeddings, padding_idx)
    return masked_sumsq(grads, None if scale is None else scale.double(), shift)


def embedding_weighted_sum(ids: Tensor, g: Tensor, weights: Tensor, num_embeddings: int,
                           padding_idx: int | None = None) -> Tensor:  # fmt: skip
    """``Σ_i w_i g_i``, float64 ``[V, d]``."""
    return torch.einsum("b,bvd->vd", weights.double(), embedding_grad_samples(ids, g, num_embeddings, padding_idx))


def conv2d_grad_samples(x: Tensor, g: Tensor, weight_shape, stride, padding, dilation, groups: int) -> Tensor:
    """Per-sample Conv2d weight gradients, float64 ``[B, *weight_shape]``: per group, ``G_iᵀ A_i`` over
    the im2col patches ``A_i`` of ``x`` ``[B, C_in, H, W]`` (``g``: ``[B, C_out, H_out, W_out]``)."""
    B = x.shape[0]
    cols = F.unfold(x.double(), tuple(weight_shape[2:]), dilation=dilation, padding=padding, stride=stride)
    cols = cols.view(B, groups, -1, cols.shape[-1])  # [B, groups, C_in/groups · kh · kw, T]
    gg = g.double().reshape(B, groups, g.shape[1] // groups, -1)  # [B, groups, C_out/groups, T]
    return torch.einsum("bjot,bjkt->bjok", gg, cols).reshape(B, *weight_shape)


def conv2d_sumsq(x: Tensor, g: Tensor, weight_shape, stride, padding, dilation, groups: int,
                 scale: Tensor | None = None, shift: Tensor | None = None) -> Tensor:  # fmt: skip
    """``‖S ⊙ (g_i − M)‖²`` of the per-sample Conv2d weight gradient, float64 ``[B]`` (``scale``/``shift``:
    ``None`` or shaped like the weight)."""
    grads = conv2d_grad_samples(x, g, weight_shape, stride, padding, dilation, groups)
    return masked_sumsq(grads, None if scale is None else scale.double(), shift)


def conv2d_weighted_sum(x: Tensor, g: Tensor, weights: Tensor, weight_shape, stride, padding, dilation,
                        groups: int) -> Tensor:  # fmt: skip
    """``Σ_i w_i g_i`` for a Conv2d weight, float64 ``weight_shape``."""
    grads = conv2d_grad_samples(x, g, weight_shape, stride, padding, dilation, groups)
    return torch.einsum("b,b...->...", weights.double(), grads)
