"""``dpkernels bench`` sections for the noise issue: the Gaussian generator and fused ``privatize``.

Same method as :mod:`dpkernels.bench` (round-robin rounds, medians, same-run baselines, the cores
other processes kept busy), on two kinds of work:

- **Generator.** ``D`` fp32 standard normals (default ``D = 4.5 M``, the issue's size): the
  ``cpu`` backend's :func:`dpkernels.gaussian_noise` for every generator (``rng``) it offers,
  against ``torch.normal`` (what Opacus's ``add_noise`` calls) and ``Tensor.normal_``, plus a
  same-run ``D``-element copy for scale. Reported as ms, Gnormals/s and the speed-up over
  ``torch.normal``. Target: >= 4x ``torch.normal`` for the Philox generator.
- **Private gradient.** Per model shape of :mod:`dpkernels.bench`: :func:`dpkernels.privatize`
  (clip, sum, in-pass Philox noise, ``/B``) on the ``cpu`` backend against Opacus's
  ``DPOptimizer.clip_and_accumulate`` → ``add_noise`` → ``scale_grad`` on identical tensors, with
  ``σ = 1``. GB/s counts the op's minimum traffic, 2 reads of the per-sample gradients plus one
  fp32 write of ``D``. The error column compares the cpu backend with the reference backend on the
  same seed (Opacus's noise comes from another generator, so it has none). Targets: >= 1.5x
  Opacus on the large MLP, >= 3x on the transformer-shaped lists.
"""

from __future__ import annotations

import gc

import torch

import dpkernels

from . import _backend
from .bench import BenchConfig, Provider, Shape, _stats, bandwidth_providers, make_grad_samples, time_round_robin
from .noise import RNGS

NOISE_NUMEL = 4_500_000
NOISE_TARGET = 4.0  # Philox vs torch.normal, D >= 4 M (issue text)
PRIVATIZE_TARGETS = {"mlp": 1.5, "transformer": 3.0, "small-b8": 3.0, "small-b32": 3.0}
SIGMA = 1.0
SEED = 20261123


def generator_providers(numel: int) -> list[Provider]:
    """``numel`` standard normals from every generator, and a same-size copy for scale."""
    out = []
    for rng in RNGS:
        if "cpu" in _backend.available_backends("cpu"):
            out.append(
                Provider(
                    f"cpu {rng}",
                    "dpkernels",
                    call=lambda r=rng: dpkernels.gaussian_noise(
                        numel, std=1.0, seed=SEED, step=1, rng=r, backend="cpu"
                    ),
                    bytes_moved=4 * numel,
                    note=f"dpkernels.gaussian_noise(rng={rng!r})",
                )
            )
    out.append(
        Provider(
            "torch.normal",
            "baseline",
            call=lambda: torch.normal(0.0, 1.0, size=(numel,)),
            bytes_moved=4 * numel,
            note="what Opacus's add_noise calls",
        )
    )
    buf = torch.empty(numel)
    out.append(Provider("normal_", "baseline", call=buf.normal_, bytes_moved=4 * numel, note="Tensor.normal_"))
    src, dst = torch.ones(numel), torch.zeros(numel)
    out.append(Provider("copy", "bandwidth", call=lambda: dst.copy_(src), bytes_moved=8 * numel, note="D-element copy"))
    return out


def bench_generator(cfg: BenchConfig, numel: int = NOISE_NUMEL, on_call=lambda p, phase: None) -> dict:
    providers = generator_providers(numel)
    res = time_round_robin(providers, cfg.repeats, cfg.warmup, cfg.budget_s, on_call=on_call)
    other = res.pop("_other_cpu_cores")
    rows = []
    base = _stats(res["torch.normal"]["times_s"])["median_s"]
    for p in providers:
        st = _stats(res[p.name]["times_s"])
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
    philox = next((r for r in rows if r["name"] == "cpu philox"), None)
    return {
        "numel": numel,
        "providers": rows,
        "other_cpu_cores_during_timing": other,
        "target": {
            "what": f"cpu philox >= {NOISE_TARGET:g}x torch.normal",
            "speedup": None if philox is None else philox["speedup_vs_torch_normal"],
            "met": None if philox is None else philox["speedup_vs_torch_normal"] >= NOISE_TARGET,
        },
    }


def _opacus_private_provider(shape: Shape, grads: list, C: float, nbytes: int) -> Provider:
    try:
        from opacus.optimizers import DPOptimizer
    except ImportError as exc:
        return Provider("opacus", "baseline", skip=f"opacus not importable: {exc}")
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shape.param_shapes]
    opt = DPOptimizer(
        torch.optim.SGD(params, lr=0.1),
        noise_multiplier=SIGMA,
        max_grad_norm=C,
        expected_batch_size=shape.batch_size,
    )

    def prepare() -> None:
        for p, g in zip(params, grads, strict=True):
            p.grad_sample = g.detach()  # a fresh alias: Opacus tags used grad samples
            p.summed_grad = None
            p.grad = None

    def call() -> None:
        opt.clip_and_accumulate()
        opt.add_noise()
        opt.scale_grad()

    return Provider(
        "opacus",
        "baseline",
        call=call,
        prepare=prepare,
        bytes_moved=nbytes,
        note="DPOptimizer clip_and_accumulate + add_noise + scale_grad",
    )


def _privatize(shape: Shape, grads: list, C: float, backend: str):
    return dpkernels.privatize(
        grads, C, SIGMA, seed=SEED, step=1, expected_batch_size=shape.batch_size, backend=backend
    )


def privatize_providers(shape: Shape, grads: list, C: float) -> list[Provider]:
    def ours(backend: str):
        return _privatize(shape, grads, C, backend)

    nbytes = 2 * shape.grad_bytes + 4 * shape.n_params

    out = []
    if "cpu" in _backend.available_backends("cpu"):
        out.append(
            Provider("cpu", "dpkernels", call=lambda: ours("cpu"), bytes_moved=nbytes, note="dpkernels.privatize")
        )
    out.append(
        Provider("reference", "baseline", call=lambda: ours("reference"), bytes_moved=nbytes, note="reference backend")
    )
    out.append(_opacus_private_provider(shape, grads, C, nbytes))
    return out


def bench_privatize(shape: Shape, cfg: BenchConfig, on_call=lambda p, phase: None) -> dict:
    grads, C = make_grad_samples(shape)
    providers = privatize_providers(shape, grads, C)
    bw = bandwidth_providers(shape.grad_bytes)
    res = time_round_robin(providers + bw, cfg.repeats, cfg.warmup, cfg.budget_s, on_call=on_call)
    other = res.pop("_other_cpu_cores")
    rows = {}
    for p in providers + bw:
        if p.skip is not None:
            rows[p.name] = {"name": p.name, "kind": p.kind, "status": "skipped", "reason": p.skip}
            continue
        st = _stats(res[p.name]["times_s"])
        rows[p.name] = {"name": p.name, "kind": p.kind, "what": p.note, "status": "ok", **st}
        rows[p.name].update(times_s=res[p.name]["times_s"], gbps=p.bytes_moved / st["median_s"] / 1e9)
    del bw
    opacus_t = rows["opacus"].get("median_s")
    for row in rows.values():
        if row["status"] == "ok":
            row["pct_read_bw"] = 100 * row["gbps"] / rows["read"]["gbps"]
            row["pct_copy_bw"] = 100 * row["gbps"] / rows["copy"]["gbps"]
            if opacus_t is not None and row["kind"] != "bandwidth":
                row["speedup_vs_opacus"] = opacus_t / row["median_s"]
    if "cpu" in rows and rows["cpu"]["status"] == "ok":
        got, want = _privatize(shape, grads, C, "cpu"), _privatize(shape, grads, C, "reference")
        rows["cpu"]["max_abs_err_vs_reference"] = max(
            float((a - b).abs().max()) for a, b in zip(got, want, strict=True)
        )
    del providers, grads
    gc.collect()
    cpu = rows.get("cpu", {})
    target = PRIVATIZE_TARGETS.get(shape.name)
    return {
        "name": shape.name,
        "batch_size": shape.batch_size,
        "n_tensors": shape.n_tensors,
        "n_params": shape.n_params,
        "sigma": SIGMA,
        "bytes_counted": "2 reads of the per-sample gradients + 1 fp32 write of D",
        "providers": list(rows.values()),
        "other_cpu_cores_during_timing": other,
        "target": {
            "what": f"cpu >= {target:g}x Opacus",
            "speedup": cpu.get("speedup_vs_opacus"),
            "met": None if "speedup_vs_opacus" not in cpu else cpu["speedup_vs_opacus"] >= target,
        },
    }


def caption(rec: dict) -> str:
    """A result table's caption: its target (if any) and whether other processes shared the cores."""
    lines = []
    tgt = rec.get("target")
    if tgt and tgt["speedup"] is not None:
        lines.append(f"target {tgt['what']}: {tgt['speedup']:.2f}× → {'met' if tgt['met'] else 'NOT met'}")
    other = rec["other_cpu_cores_during_timing"]
    if other > 0.1:
        lines.append(f"[yellow]other processes kept {other:.2f} cores busy during the timed rounds[/]")
    return "\n".join(lines)


def speedup_vs_opacus(r: dict) -> str:
    return f"{r['speedup_vs_opacus']:.2f}×" if "speedup_vs_opacus" in r else "—"


def provider_table(title: str, rec: dict, extra: dict):
    """One row per provider of ``rec["providers"]``: median and IQR, then the ``extra`` columns
    (header → the cell text of a row). dpkernels rows bold green, bandwidth baselines and skipped
    providers dimmed; the caption from :func:`caption`."""
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for col in ("provider", "median ms", "IQR ms", *extra):
        t.add_column(col, justify="left" if col == "provider" else "right")
    for r in rec["providers"]:
        if r.get("status", "ok") != "ok":
            t.add_row(r["name"], "[dim]skipped[/]", style="dim")
            continue
        style = {"dpkernels": "bold green", "bandwidth": "dim"}.get(r["kind"])
        cells = (f(r) for f in extra.values())
        t.add_row(r["name"], f"{1e3 * r['median_s']:.2f}", f"{1e3 * r['iqr_s']:.2f}", *cells, style=style)
    t.caption = caption(rec)
    return t


def generator_table(rec: dict):
    return provider_table(
        f"Gaussian generator: {rec['numel'] / 1e6:.1f} M fp32 normals (cpu, side by side)", rec,
        {"Gnormals/s": lambda r: f"{r['gnormals_per_s']:.2f}",
         "× torch.normal": lambda r: f"{r['speedup_vs_torch_normal']:.2f}×"},
    )  # fmt: skip


def privatize_table(rec: dict):
    title = (
        f"privatize, {rec['name']}: B={rec['batch_size']}, {rec['n_tensors']} tensors, "
        f"D={rec['n_params'] / 1e6:.2f} M, σ={rec['sigma']:g}"
    )
    err = lambda r: "—" if r.get("max_abs_err_vs_reference") is None else f"{r['max_abs_err_vs_reference']:.1e}"  # noqa: E731
    return provider_table(title, rec, {
        "GB/s": lambda r: f"{r['gbps']:.1f}",
        "% read BW": lambda r: f"{r['pct_read_bw']:.0f}%",
        "× Opacus": speedup_vs_opacus,
        "max err vs ref": err,
    })  # fmt: skip
