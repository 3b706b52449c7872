"""Per-sample gradients at several parameter states, for DP-PMLF's per-sample momentum ("Enhancing DPSGD
via Per-Sample Momentum and Low-Pass Filtering", arXiv:2511.08841).

DP-PMLF combines, for every sample of the current batch, its gradients at the last ``k`` iterates
``x_t, x_{t−1}, ..., x_{t−k+1}``. The batch was generally not drawn at the earlier steps, so those
gradients are recomputed at the saved parameter states (the authors' code does the same). This
module does it with ``torch.func`` (``functional_call`` + ``vmap(grad)``): one vectorised
per-sample backward per state, no per-layer code, any model ``torch.func`` supports (no
batch-statistics layers such as BatchNorm in training mode, as for any DP model).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

__all__ = ["pmlf_grad_samples"]


def pmlf_grad_samples(
    model: nn.Module,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    inputs: Tensor,
    targets: Tensor,
    saved_states: Sequence[Sequence[Tensor] | Mapping[str, Tensor]] = (),
    *,
    include_current: bool = True,
) -> list[list[Tensor]]:
    """Per-sample gradients of ``loss_fn(model(x_i), y_i)`` at the current and at saved parameters.

    Args:
        model: the module; its trainable parameters (``requires_grad``, in ``named_parameters``
            order) are the differentiated ones, its buffers are used as they are.
        loss_fn: ``loss_fn(output, target)`` for ONE sample, called with a batch dimension of 1
            (e.g. ``nn.functional.cross_entropy``): the per-sample loss ``ℓ(θ; x_i, y_i)``.
        inputs, targets: the batch, ``[B, ...]`` each.
        saved_states: earlier parameter states ``x_{t−1}, ..., x_{t−k+1}``, each a list of tensors
            in trainable-parameter order (``DPPMLF.past_params()``) or a ``{name: tensor}``
            mapping of the trainable parameters.
        include_current: also differentiate at the current parameters (index 0). ``False`` returns
            only the ``len(saved_states)`` past sets, for a caller that already has the current
            per-sample gradients (Opacus's GradSampleModule), saving one vectorised backward.

    Returns: one entry per trainable parameter, each a list of ``k = 1 + len(saved_states)``
    tensors ``[B, *param.shape]``: index 0 at the current parameters, index ``j`` at
    ``saved_states[j − 1]`` (``include_current=False``: index ``j − 1``). Assign entry ``l`` to
    ``p_l.grad_sample`` for ``DPPMLF``.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("model has no trainable parameters")
    if not isinstance(inputs, Tensor) or not isinstance(targets, Tensor):
        raise TypeError("inputs and targets must be tensors with the batch on dim 0")
    if inputs.dim() == 0 or targets.dim() == 0 or inputs.shape[0] != targets.shape[0]:
        raise ValueError(f"inputs {tuple(inputs.shape)} and targets {tuple(targets.shape)} must share the batch dim 0")
    names = [n for n, _ in named]
    buffers = dict(model.named_buffers())

    def sample_loss(params: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        out = functional_call(model, (params, buffers), (x.unsqueeze(0),))
        return loss_fn(out, y.unsqueeze(0))

    per_sample_grad = vmap(grad(sample_loss), in_dims=(None, 0, 0))
    states = [{n: p.detach() for n, p in named}] if include_current else []
    for j, state in enumerate(saved_states):
        states.append(_as_named(state, named, j))
    out: list[list[Tensor]] = [[] for _ in named]
    for state in states:
        grads = per_sample_grad(state, inputs, targets)
        for idx, n in enumerate(names):
            out[idx].append(grads[n])
    return out


def _as_named(state, named, j: int) -> dict[str, Tensor]:
    if isinstance(state, Mapping):
        missing = [n for n, _ in named if n not in state]
        if missing:
            raise ValueError(f"saved_states[{j}] lacks trainable parameter(s) {missing}")
        tensors = [state[n] for n, _ in named]
    else:
        tensors = list(state)
        if len(tensors) != len(named):
            raise ValueError(f"saved_states[{j}] has {len(tensors)} tensors; the model has {len(named)} trainable")
    result = {}
    for (n, p), v in zip(named, tensors, strict=True):
        if not isinstance(v, Tensor) or v.shape != p.shape:
            got = tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__
            raise ValueError(f"saved_states[{j}] entry for {n!r} is {got}; expected shape {tuple(p.shape)}")
        result[n] = v.detach().to(device=p.device, dtype=p.dtype)
    return result
