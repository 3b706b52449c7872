"""torch.optim param groups as the dpkernels engines take them, shared by ``accelerate()`` and
``make_private()``."""

from __future__ import annotations

import torch
from torch import Tensor


def _scalar(group: dict, key: str, idx: int) -> float:
    v = group[key]
    if isinstance(v, Tensor):
        if v.dim() != 0:
            raise ValueError(f"param_groups[{idx}][{key!r}] must be a number or a 0-d tensor")
        v = v.item()
    return float(v)


def param_group_hypers(inner: torch.optim.Optimizer, group: dict, idx: int) -> dict:
    """The dpkernels engine's hyper-parameters of one param group of a torch ``SGD`` (lr,
    momentum, weight_decay) or ``Adam``/``AdamW`` (lr, betas, eps, decoupled weight_decay).

    Raises ``ValueError`` for what the fused steps do not reproduce: nesterov, dampening,
    maximize, differentiable, amsgrad, and Adam's coupled L2 weight decay. Tensor-valued
    hyper-parameters must be 0-d.
    """
    where = f"{type(inner).__name__} param_groups[{idx}]"
    for key in ("maximize", "differentiable", "amsgrad", "nesterov"):
        if group.get(key, False):
            raise ValueError(f"{where}: {key}=True is not supported by the dpkernels step")
    if isinstance(inner, torch.optim.SGD):
        if group.get("dampening", 0):
            raise ValueError(f"{where}: dampening={group['dampening']} is not supported (torch skips it on step 1)")
        return {
            "lr": _scalar(group, "lr", idx),
            "momentum": _scalar(group, "momentum", idx),
            "weight_decay": _scalar(group, "weight_decay", idx),
        }
    wd = _scalar(group, "weight_decay", idx)
    if wd and type(inner) is torch.optim.Adam and not group.get("decoupled_weight_decay", False):
        raise ValueError(
            f"{where}: Adam's coupled L2 weight_decay={wd} is not supported; use AdamW (decoupled weight decay)"
        )
    b1, b2 = group["betas"]
    return {
        "lr": _scalar(group, "lr", idx),
        "betas": (float(b1), float(b2)),
        "eps": _scalar(group, "eps", idx),
        "weight_decay": wd,
    }
