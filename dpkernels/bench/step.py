"""``dpkernels bench`` section for the fused optimizer steps (dpkernels.optim).

Same method as the ``clip`` section, :mod:`dpkernels.bench.clip` (round-robin rounds, medians,
same-run baselines, the cores other processes kept busy):

- **The fused pass alone.** Per optimizer, ``D`` fp32 parameters (default 4.5 M, the issue's
  size, in four tensors) and a ready clipped sum ``S``: one ``step()`` whose clip stage is replaced by
  returning ``S``, i.e. the one fused pass over D (noise in registers, affine correction, state,
  parameters) plus its Python launch. Bytes counted: the D-sized fp32 tensors the pass must read and
  write (``S``, ``θ`` and each state buffer it reads or writes). Its **floor** is the larger of the
  same-run copy time for those bytes and the same-run time of the standalone generator writing ``D``
  normals into a buffer (cpu); target: every fused step within 2x of its floor.
- **DP-Adam against Opacus.** Opacus's ``add_noise`` + ``scale_grad`` + ``torch.optim.Adam(fused=True)
  .step()`` on the same ``D`` with ``p.summed_grad`` ready; target: the fused DPAdam pass >= 5x faster.
- **The full DP step.** On the model shapes of :mod:`dpkernels.bench.shapes`: ``DPAdam.step()`` (clip on the
  cpu backend + the fused pass) against Opacus's ``DPOptimizer.step()`` over ``Adam(fused=True)``
  (clip_and_accumulate, add_noise, scale_grad, step) on identical per-sample gradients.

On ``--device cuda`` all of it runs on CUDA tensors, on the ``cuda`` and ``triton`` backends (the
DPAdam target on ``cuda``) and, as a baseline, the ``reference`` backend; the floor's generator is
the native one writing into a CUDA buffer.
"""

from __future__ import annotations

import gc

import torch

import dpkernels.optim as fused

from . import _report as report
from ._timing import (
    NATIVE_BACKENDS,
    SEED,
    SIGMA,
    BenchConfig,
    Provider,
    copy_provider,
    opacus_missing,
    opacus_optimizer,
    per_backend_name,
    reset_opacus_grads,
    time_providers,
    timed_backends,
)
from .shapes import Shape, make_grad_samples

STEP_NUMEL = 4_500_000
_ONE_MICROBATCH = torch.empty(0)
STEP_TARGET_FLOOR = 2.0  # every fused step within 2x of its floor
ADAM_TARGET = 5.0  # fused DPAdam vs Opacus add_noise + scale_grad + Adam(fused=True).step()

#: (label, class, kwargs, D-sized fp32 tensors the pass reads + writes: S and θ included)
STEP_CONFIGS = [
    ("DPSGD", "DPSGD", dict(lr=0.1), 3),
    ("DPSGD momentum", "DPSGD", dict(lr=0.1, momentum=0.9), 5),
    ("DPAdam", "DPAdam", dict(lr=1e-3), 7),
    ("DPAdamBC", "DPAdamBC", dict(lr=1e-3), 7),
    ("DPAdamSTP", "DPAdamSTP", dict(lr=1e-3, eps1=1e-3), 8),
    ("DPMacAdam", "DPMacAdam", dict(lr=1e-3), 14),
    ("DP2 (sgd phase)", "DP2", dict(lr=0.1, s1=1000, s2=1), 5),
    ("DPPMLF", "DPPMLF", dict(lr=0.1, k=1), 5),
]


def _split(numel: int) -> list[tuple[int, ...]]:
    """Four parameter tensors totalling ``numel`` (a large and three smaller ones)."""
    q = numel // 8
    return [(numel - 3 * q,), (q,), (q,), (q,)]


def _step_backends(device: str) -> list[tuple[str, str]]:
    """``(backend, provider kind)`` the fused passes and the full step are timed on for ``device``'s
    tensors: the timed native backends and, on CUDA tensors, the reference backend as a baseline
    (the CPU tables keep the providers they have always had)."""
    native = [(b, "dpkernels") for b in timed_backends(device)]
    return native if device == "cpu" else [*native, ("reference", "baseline")]


def _fused_pass_provider(
    label: str, cls_name: str, kwargs: dict, n_tensors: int, numel: int, backend: str, kind: str, device: str
) -> Provider:
    shapes = _split(numel)
    params = [torch.zeros(s, device=device) for s in shapes]
    opt = getattr(fused, cls_name)(
        params, noise_multiplier=SIGMA, max_grad_norm=1.0, expected_batch_size=64, seed=SEED, backend=backend,
        **kwargs,
    )  # fmt: skip
    sums = [torch.randn(s, device=device) for s in shapes]
    weights = torch.ones(64, device=device)
    opt._clip_sums = lambda *a, **k: (sums, weights.sum())  # time the fused pass only
    k = getattr(opt, "k", 1)
    grad = [torch.empty((1, *s), device=device) for s in shapes]  # shape checks only; never read

    def prepare() -> None:
        for p, g in zip(params, grad, strict=True):
            p.grad_sample = [g] * k if cls_name == "DPPMLF" else g

    return Provider(per_backend_name(label, backend), kind, call=opt.step, prepare=prepare,
                    bytes_moved=4 * n_tensors * numel, note=f"dpkernels.optim.{cls_name} fused pass")  # fmt: skip


def _fused_adam(params: list) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3, fused=True)


def _opacus_adam_provider(numel: int, device: str) -> Provider:
    if (why := opacus_missing()) is not None:
        return Provider("opacus Adam", "baseline", skip=why)
    shapes = _split(numel)
    params, opt = opacus_optimizer(shapes, _fused_adam, noise_multiplier=SIGMA, max_grad_norm=1.0,
                                   expected_batch_size=64, device=device)  # fmt: skip
    sums = [torch.randn(s, device=device) for s in shapes]

    def prepare() -> None:
        for p, s in zip(params, sums, strict=True):
            p.summed_grad = s.detach()  # a fresh alias: Opacus tags what it has processed
            p.grad_sample = _ONE_MICROBATCH  # scale_grad counts accumulated micro-batches from it
            p.grad = None

    def call() -> None:
        opt.add_noise()
        opt.scale_grad()
        opt.original_optimizer.step()

    return Provider("opacus Adam", "baseline", call=call, prepare=prepare, bytes_moved=4 * 7 * numel,
                    note="add_noise + scale_grad + Adam(fused=True).step()")  # fmt: skip


def expected_providers(device: str, n_shapes: int) -> int:
    """How many providers the section times on ``device`` (for the progress bar): the fused passes,
    Opacus's Adam, the copy and the generator, then per shape the full steps and Opacus's."""
    n = len(_step_backends(device))
    return len(STEP_CONFIGS) * n + 3 + n_shapes * (n + 1)


def bench_steps(cfg: BenchConfig, numel: int = STEP_NUMEL, on_call=lambda p, phase: None) -> dict:
    device = cfg.device
    providers = [_fused_pass_provider(*c, numel, b, kind, device) for b, kind in _step_backends(device)
                 for c in STEP_CONFIGS]  # fmt: skip
    providers.append(_opacus_adam_provider(numel, device))
    providers.append(copy_provider(torch.ones(numel, device=device), "D-element copy"))
    # Into a buffer allocated once, as the fused passes write theirs: a fresh 18 MB tensor per call
    # would add its page faults (which made this baseline bimodal, 3.6 or 7 ms, across runs).
    noise_buf = torch.empty(numel, device=device)
    providers.append(
        Provider(
            "generator",
            "bandwidth",
            call=lambda: torch.ops.dpkernels_C.gaussian_fill_(noise_buf, 1.0, SEED, 1, 0, 0),
            bytes_moved=4 * numel,
            note=f"Philox normals of D elements into a buffer, {device}",
        )
    )
    res, other = time_providers(providers, cfg, on_call)
    rows = report.result_rows(providers, res)
    for p in providers:
        if p.skip is None:
            rows[p.name].update(bytes_moved=p.bytes_moved, gbps=p.bytes_moved / rows[p.name]["median_s"] / 1e9)
    report.add_pct_of_bandwidth(rows, ("copy",))
    copy_bw = 8 * numel / rows["copy"]["median_s"]
    # The generator fails only where the native op lacks this device's kernel (a build without its
    # CUDA part): the floor is then the copy's alone.
    generator_s = rows["generator"].get("median_s", 0.0)
    for row in rows.values():
        if row["kind"] == "dpkernels" and row["status"] == "ok":
            floor = max(row["bytes_moved"] / copy_bw, generator_s)
            row.update(floor_s=floor, over_floor=row["median_s"] / floor)
            row["within_target"] = row["over_floor"] <= STEP_TARGET_FLOOR
    dp_adam = per_backend_name("DPAdam", NATIVE_BACKENDS[device][0])
    adam, opacus = rows.get(dp_adam, {}).get("median_s"), rows["opacus Adam"].get("median_s")
    speedup = None if adam is None or opacus is None else opacus / adam
    within = all(r.get("within_target", True) for r in rows.values())
    what = (f"fused DPAdam >= {ADAM_TARGET:g}x Opacus add_noise + scale_grad + Adam(fused=True).step(); "
            f"every fused step <= {STEP_TARGET_FLOOR:g}x its floor")  # fmt: skip
    return {
        "numel": numel,
        "providers": list(rows.values()),
        "other_cpu_cores_during_timing": other,
        "target": report.target(what, speedup, ADAM_TARGET, also=within),
    }


def _dp_adam_provider(shape: Shape, grads: list, C: float, backend: str, kind: str) -> Provider:
    params = [torch.zeros(s, device=grads[0].device) for s in shape.param_shapes]
    opt = fused.DPAdam(params, lr=1e-3, noise_multiplier=SIGMA, max_grad_norm=C,
                       expected_batch_size=shape.batch_size, seed=SEED, backend=backend)  # fmt: skip

    def prepare() -> None:
        for p, g in zip(params, grads, strict=True):
            p.grad_sample = g

    return Provider(f"{backend} DPAdam", kind, call=opt.step, prepare=prepare, note="dpkernels.optim.DPAdam")


def _full_step_providers(shape: Shape, grads: list, C: float) -> list[Provider]:
    device = grads[0].device.type
    out = [_dp_adam_provider(shape, grads, C, b, kind) for b, kind in _step_backends(device)]
    if (why := opacus_missing()) is not None:
        out.append(Provider("opacus", "baseline", skip=why))
        return out
    o_params, o_opt = opacus_optimizer(shape.param_shapes, _fused_adam, noise_multiplier=SIGMA, max_grad_norm=C,
                                       expected_batch_size=shape.batch_size, device=device)  # fmt: skip
    out.append(Provider("opacus", "baseline", call=o_opt.step, prepare=lambda: reset_opacus_grads(o_params, grads),
                        note="DPOptimizer(Adam(fused=True)).step()"))  # fmt: skip
    return out


def bench_full_step(shape: Shape, cfg: BenchConfig, on_call=lambda p, phase: None) -> dict:
    grads, C = make_grad_samples(shape, device=cfg.device)
    providers = _full_step_providers(shape, grads, C)
    res, other = time_providers(providers, cfg, on_call)
    rows = report.result_rows(providers, res)
    report.add_speedup_vs_opacus(rows.values())
    del providers, grads
    gc.collect()
    return {**report.shape_fields(shape), "providers": list(rows.values()), "other_cpu_cores_during_timing": other}


def steps_table(rec: dict, device: str = "cpu"):
    return report.provider_table(f"Fused optimizer pass, D = {rec['numel'] / 1e6:.1f} M fp32 ({device})", rec, {
        "GB/s": lambda r: f"{r['gbps']:.1f}",
        "% copy BW": lambda r: f"{r['pct_copy_bw']:.0f}%",
        "floor ms": lambda r: report.fmt(1e3 * r["floor_s"] if "floor_s" in r else None, ".2f"),
        "× floor": lambda r: report.fmt(r.get("over_floor"), ".2f"),
    })  # fmt: skip


def full_step_table(rec: dict):
    title = f"Full DP step, {rec['name']}: {report.shape_title(rec)}"
    return report.provider_table(title, rec, {"× Opacus": report.speedup_vs_opacus})
