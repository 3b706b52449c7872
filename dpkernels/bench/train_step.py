"""``dpkernels bench`` section ``train``: one whole private training step on real models.

Same method as the ``clip`` section, :mod:`dpkernels.bench.clip` (shuffled rounds, cache flushed
before every call, medians, the cores other processes kept busy). Per model, three providers run
the same step, from the same initial weights on the same batch, with ``Adam`` (lr 1e-3), σ = 1,
C = 1:

- **non-private**: ``zero_grad``, forward, cross-entropy, backward, ``torch.optim.Adam(fused=True)
  .step()`` on the plain module;
- **opacus**: the same on Opacus's ``GradSampleModule`` (hooks: per-sample gradients in backward)
  with ``DPOptimizer(Adam(fused=True))`` (clip_and_accumulate, add_noise, scale_grad, step);
- **opacus + dpkernels**: the same Opacus objects after
  :func:`dpkernels.integrations.opacus.accelerate` on the cpu backend (the drop-in); on
  ``--device cuda`` (model, batch and optimizers on the GPU) one such provider per backend,
  ``cuda`` and ``triton``.

What differs between the last two is only the optimizer step; forward and backward, including
Opacus's per-sample gradient hooks, are the same code, so the ratio shows what the drop-in buys
in a real loop.
"""

from __future__ import annotations

import copy
import gc
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .. import _backend
from . import _report as report
from ._timing import NATIVE_BACKENDS, SEED, BenchConfig, Provider, opacus_missing, per_backend_name, time_providers


@dataclass(frozen=True)
class TrainModel:
    name: str
    what: str
    batch_size: int
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    n_classes: int


def _mlp() -> nn.Module:
    layers = []
    for _ in range(4):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    return nn.Sequential(*layers[:-1], nn.Linear(1024, 10))


def _cnn() -> nn.Module:
    def block(c_in, c_out):
        return [nn.Conv2d(c_in, c_out, 3, padding=1), nn.GroupNorm(8, c_out), nn.ReLU()]

    return nn.Sequential(
        *block(3, 32), *block(32, 32), nn.AvgPool2d(2), *block(32, 64), *block(64, 64), nn.AvgPool2d(2),
        *block(64, 96), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(96, 10),
    )  # fmt: skip


MODELS = {
    "mlp": TrainModel("mlp", "5 Linear layers of 1024 (4.2 M parameters)", 64, _mlp, (1024,), 10),
    "cnn": TrainModel("cnn", "5 convs + GroupNorm on 3x16x16 (0.15 M parameters)", 32, _cnn, (3, 16, 16), 10),
}


def models(quick: bool = False) -> list[TrainModel]:
    """The models timed: both, or only the small CNN under ``--quick``."""
    return [MODELS["cnn"]] if quick else list(MODELS.values())


def _providers(m: TrainModel, device: str) -> list[Provider]:
    torch.manual_seed(SEED)  # the same weights and batch on every device: drawn on the CPU, then moved
    base = m.build().to(device)
    x = torch.randn(m.batch_size, *m.input_shape).to(device)
    y = torch.randint(0, m.n_classes, (m.batch_size,)).to(device)
    loss_fn = nn.CrossEntropyLoss()

    def step_fn(module, opt):
        def call() -> None:
            opt.zero_grad(set_to_none=True)
            loss_fn(module(x), y).backward()
            opt.step()

        return call

    plain = copy.deepcopy(base)
    out = [Provider("non-private", "baseline", call=step_fn(plain, torch.optim.Adam(plain.parameters(), lr=1e-3,
                                                                                   fused=True)),
                    note="Adam(fused=True), no per-sample gradients")]  # fmt: skip
    if (why := opacus_missing()) is not None:
        return out + [Provider(n, "baseline", skip=why) for n in ("opacus", "+dpkernels")]
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    def private(backend: str | None):
        """The Opacus step, accelerated on ``backend`` unless None."""
        module = GradSampleModule(copy.deepcopy(base))
        opt = DPOptimizer(torch.optim.Adam(module.parameters(), lr=1e-3, fused=True),
                          noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=m.batch_size)  # fmt: skip
        if backend is not None:
            from ..integrations.opacus import accelerate

            accelerate(opt, backend=backend, seed=SEED)
        return step_fn(module, opt)

    out.append(Provider("opacus", "baseline", call=private(None), note="GradSampleModule + DPOptimizer(Adam)"))
    usable = _backend.available_backends(device)
    for b in NATIVE_BACKENDS[device]:
        name = per_backend_name("opacus + dpkernels", b)
        if b in usable:
            out.append(Provider(name, "dpkernels", call=private(b), note="the same, accelerate(opt)"))
        else:
            out.append(Provider(name, "dpkernels", skip=_backend._why_unavailable(b, device)))
    return out


def bench_train_step(model: TrainModel, cfg: BenchConfig, on_call=lambda p, phase: None) -> dict:
    providers = _providers(model, cfg.device)
    with warnings.catch_warnings():
        # Opacus's hooks note that the input needs no gradient: true, and nothing to act on.
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        res, other = time_providers(providers, cfg, on_call)
    rows = report.result_rows(providers, res)
    report.add_speedup_vs_opacus(rows.values())
    base = rows["non-private"].get("median_s")
    for r in rows.values():
        if r["status"] == "ok" and base is not None:
            r["over_non_private"] = r["median_s"] / base
    del providers
    gc.collect()
    return {"name": model.name, "what": model.what, "batch_size": model.batch_size, "providers": list(rows.values()),
            "other_cpu_cores_during_timing": other}  # fmt: skip


def train_step_table(rec: dict):
    title = f"Full training step, {rec['name']}: {rec['what']}, B={rec['batch_size']}"
    return report.provider_table(title, rec, {
        "× Opacus": report.speedup_vs_opacus,
        "÷ non-private": lambda r: report.fmt(r.get("over_non_private"), ".2f"),
    })  # fmt: skip
