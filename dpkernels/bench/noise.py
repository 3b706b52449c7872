"""``dpkernels bench`` sections for the noise issue: the Gaussian generator and fused ``privatize``.

Same method as the ``clip`` section, :mod:`dpkernels.bench.clip` (round-robin rounds, medians,
same-run baselines, the cores other processes kept busy), on two kinds of work:

- **Generator.** ``D`` fp32 standard normals (default ``D = 4.5 M``, the issue's size): the
  ``cpu`` backend's :func:`dpkernels.gaussian_noise` for every generator (``rng``) it offers,
  against ``torch.normal`` (what Opacus's ``add_noise`` calls) and ``Tensor.normal_``, plus a
  same-run ``D``-element copy for scale. Reported as ms, Gnormals/s and the speed-up over
  ``torch.normal``. Target: >= 4x ``torch.normal`` for the Philox generator.
- **Private gradient.** Per model shape of :mod:`dpkernels.bench.shapes`: :func:`dpkernels.privatize`
  (clip, sum, in-pass Philox noise, ``/B``) on the ``cpu`` backend against Opacus's
  ``DPOptimizer.clip_and_accumulate`` → ``add_noise`` → ``scale_grad`` on identical tensors, with
  ``σ = 1``. GB/s counts the op's minimum traffic, 2 reads of the per-sample gradients plus one
  fp32 write of ``D``. The error column compares the cpu backend with the reference backend on the
  same seed (Opacus's noise comes from another generator, so it has none). Targets: >= 1.5x
  Opacus on the large MLP, >= 3x on the transformer-shaped lists.

On ``--device cuda`` both run on CUDA tensors, with the ``cuda`` and ``triton`` backends in place
of ``cpu`` (each with its error against the reference; the targets then apply to ``cuda``).
"""

from __future__ import annotations

import gc

import torch

import dpkernels

from ..noise import RNGS
from . import _report as report
from ._timing import (
    NATIVE_BACKENDS,
    SEED,
    SIGMA,
    BenchConfig,
    Provider,
    bandwidth_providers,
    copy_provider,
    opacus_missing,
    opacus_optimizer,
    reset_opacus_grads,
    summary_stats,
    time_providers,
    timed_backends,
)
from .shapes import Shape, make_grad_samples

NOISE_NUMEL = 4_500_000
NOISE_TARGET = 4.0  # Philox vs torch.normal, D >= 4 M (issue text)
PRIVATIZE_TARGETS = {"mlp": 1.5, "transformer": 3.0, "small-b8": 3.0, "small-b32": 3.0}


def generator_providers(numel: int, device: str = "cpu") -> list[Provider]:
    """``numel`` standard normals on ``device`` from every generator of every timed backend, and a
    same-size copy for scale."""
    out = []
    for backend in timed_backends(device):
        for rng in RNGS:
            out.append(
                Provider(
                    f"{backend} {rng}",
                    "dpkernels",
                    call=lambda b=backend, r=rng: dpkernels.gaussian_noise(
                        numel, std=1.0, seed=SEED, step=1, rng=r, device=device, backend=b
                    ),
                    bytes_moved=4 * numel,
                    note=f"dpkernels.gaussian_noise(rng={rng!r})",
                )
            )
    out.append(
        Provider(
            "torch.normal",
            "baseline",
            call=lambda: torch.normal(0.0, 1.0, size=(numel,), device=device),
            bytes_moved=4 * numel,
            note="what Opacus's add_noise calls",
        )
    )
    buf = torch.empty(numel, device=device)
    out.append(Provider("normal_", "baseline", call=buf.normal_, bytes_moved=4 * numel, note="Tensor.normal_"))
    out.append(copy_provider(torch.ones(numel, device=device), "D-element copy"))
    return out


def bench_generator(cfg: BenchConfig, numel: int = NOISE_NUMEL, on_call=lambda p, phase: None) -> dict:
    providers = generator_providers(numel, cfg.device)
    res, other = time_providers(providers, cfg, on_call)
    rows = []
    base = summary_stats(res["torch.normal"]["times_s"])["median_s"]
    for p in providers:
        if p.skip is not None:  # its warm-up failed (time_round_robin says why)
            rows.append({"name": p.name, "kind": p.kind, "status": "skipped", "reason": p.skip})
            continue
        st = summary_stats(res[p.name]["times_s"])
        rows.append(
            {
                "name": p.name,
                "kind": p.kind,
                "what": p.note,
                **st,
                "times_s": res[p.name]["times_s"],
                "gnormals_per_s": numel / st["median_s"] / 1e9,
                "gbps": p.bytes_moved / st["median_s"] / 1e9,
                "speedup_vs_torch_normal": base / st["median_s"],
            }
        )
    target = f"{NATIVE_BACKENDS[cfg.device][0]} philox"
    philox = next((r.get("speedup_vs_torch_normal") for r in rows if r["name"] == target), None)
    return {
        "numel": numel,
        "providers": rows,
        "other_cpu_cores_during_timing": other,
        "target": report.target(f"{target} >= {NOISE_TARGET:g}x torch.normal", philox, NOISE_TARGET),
    }


def _opacus_private_provider(shape: Shape, grads: list, C: float, nbytes: int) -> Provider:
    if (why := opacus_missing()) is not None:
        return Provider("opacus", "baseline", skip=why)
    params, opt = opacus_optimizer(
        shape.param_shapes,
        lambda ps: torch.optim.SGD(ps, lr=0.1),
        noise_multiplier=SIGMA,
        max_grad_norm=C,
        expected_batch_size=shape.batch_size,
        device=grads[0].device.type,
    )

    def call() -> None:
        opt.clip_and_accumulate()
        opt.add_noise()
        opt.scale_grad()

    return Provider(
        "opacus",
        "baseline",
        call=call,
        prepare=lambda: reset_opacus_grads(params, grads),
        bytes_moved=nbytes,
        note="DPOptimizer clip_and_accumulate + add_noise + scale_grad",
    )


def _privatize(shape: Shape, grads: list, C: float, backend: str):
    return dpkernels.privatize(
        grads, C, SIGMA, seed=SEED, step=1, expected_batch_size=shape.batch_size, backend=backend
    )


def privatize_providers(shape: Shape, grads: list, C: float) -> list[Provider]:
    """Every timed backend for ``grads``' device, the reference backend and Opacus."""

    def ours(backend: str):
        return _privatize(shape, grads, C, backend)

    nbytes = 2 * shape.grad_bytes + 4 * shape.n_params

    out = [
        Provider(b, "dpkernels", call=lambda b=b: ours(b), bytes_moved=nbytes, note="dpkernels.privatize")
        for b in timed_backends(grads[0].device.type)
    ]
    out.append(
        Provider("reference", "baseline", call=lambda: ours("reference"), bytes_moved=nbytes, note="reference backend")
    )
    out.append(_opacus_private_provider(shape, grads, C, nbytes))
    return out


def bench_privatize(shape: Shape, cfg: BenchConfig, on_call=lambda p, phase: None) -> dict:
    grads, C = make_grad_samples(shape, device=cfg.device)
    providers = privatize_providers(shape, grads, C)
    bw = bandwidth_providers(shape.grad_bytes, cfg.device)
    res, other = time_providers(providers + bw, cfg, on_call)
    rows = report.result_rows(providers + bw, res)
    for p in providers + bw:
        if p.skip is None:
            rows[p.name]["gbps"] = p.bytes_moved / rows[p.name]["median_s"] / 1e9
    del bw
    report.add_pct_of_bandwidth(rows, ("read", "copy"))
    report.add_speedup_vs_opacus(rows.values())
    checked = [p.name for p in providers if p.kind == "dpkernels" and p.skip is None]
    want = _privatize(shape, grads, C, "reference") if checked else []
    for backend in checked:  # same seed: every backend should give the reference's result
        got = _privatize(shape, grads, C, backend)
        rows[backend]["max_abs_err_vs_reference"] = max(
            float((a - b).abs().max()) for a, b in zip(got, want, strict=True)
        )
    del providers, grads, want
    gc.collect()
    backend = NATIVE_BACKENDS[cfg.device][0]
    threshold = PRIVATIZE_TARGETS.get(shape.name)
    return {
        **report.shape_fields(shape),
        "sigma": SIGMA,
        "bytes_counted": "2 reads of the per-sample gradients + 1 fp32 write of D",
        "providers": list(rows.values()),
        "other_cpu_cores_during_timing": other,
        "target": report.target(
            f"{backend} >= {threshold:g}x Opacus", rows.get(backend, {}).get("speedup_vs_opacus"), threshold
        ),
    }


def generator_table(rec: dict, device: str = "cpu"):
    return report.provider_table(
        f"Gaussian generator: {rec['numel'] / 1e6:.1f} M fp32 normals ({device}, side by side)", rec,
        {"Gnormals/s": lambda r: f"{r['gnormals_per_s']:.2f}",
         "× torch.normal": lambda r: f"{r['speedup_vs_torch_normal']:.2f}×"},
    )  # fmt: skip


def privatize_table(rec: dict):
    title = f"privatize, {rec['name']}: {report.shape_title(rec)}, σ={rec['sigma']:g}"
    return report.provider_table(title, rec, {
        "GB/s": lambda r: f"{r['gbps']:.1f}",
        "% read BW": lambda r: f"{r['pct_read_bw']:.0f}%",
        "× Opacus": report.speedup_vs_opacus,
        "max err vs ref": lambda r: report.fmt(r.get("max_abs_err_vs_reference"), ".1e"),
    })  # fmt: skip
