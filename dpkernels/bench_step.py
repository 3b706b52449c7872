"""``dpkernels bench`` section for the fused optimizer steps (dpkernels.optim).

Same method as :mod:`dpkernels.bench` (round-robin rounds, medians, same-run baselines, the cores
other processes kept busy):

- **The fused pass alone.** Per optimizer, ``D`` fp32 parameters (default 4.5 M, the issue's
  size, in four tensors) and a ready clipped sum ``S``: one ``step()`` whose clip stage is replaced by
  returning ``S``, i.e. the one fused pass over D (noise in registers, affine correction, state,
  parameters) plus its Python launch. Bytes counted: the D-sized fp32 tensors the pass must read and
  write (``S``, ``θ`` and each state buffer it reads or writes). Its **floor** is the larger of the
  same-run copy time for those bytes and the same-run time of the standalone generator writing ``D``
  normals into a buffer (cpu); target: every fused step within 2x of its floor.
- **DP-Adam against Opacus.** Opacus's ``add_noise`` + ``scale_grad`` + ``torch.optim.Adam(fused=True)
  .step()`` on the same ``D`` with ``p.summed_grad`` ready; target: the fused DPAdam pass >= 5x faster.
- **The full DP step.** On the model shapes of :mod:`dpkernels.bench`: ``DPAdam.step()`` (clip on the
  cpu backend + the fused pass) against Opacus's ``DPOptimizer.step()`` over ``Adam(fused=True)``
  (clip_and_accumulate, add_noise, scale_grad, step) on identical per-sample gradients.
"""

from __future__ import annotations

import gc

import torch

import dpkernels.optim as fused

from . import _backend
from .bench import BenchConfig, Provider, Shape, _stats, make_grad_samples, time_round_robin
from .bench_noise import provider_table, speedup_vs_opacus

STEP_NUMEL = 4_500_000
_ONE_MICROBATCH = torch.empty(0)
SIGMA = 1.0
SEED = 20261123
STEP_TARGET_FLOOR = 2.0  # every fused step within 2x of its floor
ADAM_TARGET = 5.0  # fused DPAdam vs Opacus add_noise + scale_grad + Adam(fused=True).step()

#: (label, class, kwargs, D-sized fp32 tensors the pass reads + writes: S and θ included)
STEP_CONFIGS = [
    ("DPSGD", "DPSGD", dict(lr=0.1), 3),
    ("DPSGD momentum", "DPSGD", dict(lr=0.1, momentum=0.9), 5),
    ("DPAdam", "DPAdam", dict(lr=1e-3), 7),
    ("DPAdamBC", "DPAdamBC", dict(lr=1e-3), 7),
    ("DPAdamSTP", "DPAdamSTP", dict(lr=1e-3), 8),
    ("DPMacAdam", "DPMacAdam", dict(lr=1e-3), 14),
    ("DP2 (sgd phase)", "DP2", dict(lr=0.1, s1=1000, s2=1), 5),
    ("DPPMLF", "DPPMLF", dict(lr=0.1, k=1), 5),
]


def _split(numel: int) -> list[tuple[int, ...]]:
    """Four parameter tensors totalling ``numel`` (a large and three smaller ones)."""
    q = numel // 8
    return [(numel - 3 * q,), (q,), (q,), (q,)]


def _fused_pass_provider(label: str, cls_name: str, kwargs: dict, n_tensors: int, numel: int) -> Provider:
    shapes = _split(numel)
    params = [torch.zeros(s) for s in shapes]
    opt = getattr(fused, cls_name)(
        params, noise_multiplier=SIGMA, max_grad_norm=1.0, expected_batch_size=64, seed=SEED, backend="cpu",
        **kwargs,
    )  # fmt: skip
    sums = [torch.randn(s) for s in shapes]
    weights = torch.ones(64)
    opt._clip_sums = lambda *a, **k: (sums, weights)  # time the fused pass only
    k = getattr(opt, "k", 1)
    grad = [torch.empty((1, *s)) for s in shapes]  # shape checks only; never read

    def prepare() -> None:
        for p, g in zip(params, grad, strict=True):
            p.grad_sample = [g] * k if cls_name == "DPPMLF" else g

    return Provider(label, "dpkernels", call=opt.step, prepare=prepare, bytes_moved=4 * n_tensors * numel,
                    note=f"dpkernels.optim.{cls_name} fused pass")  # fmt: skip


def _opacus_adam_provider(numel: int) -> Provider:
    try:
        from opacus.optimizers import DPOptimizer
    except ImportError as exc:
        return Provider("opacus Adam", "baseline", skip=f"opacus not importable: {exc}")
    shapes = _split(numel)
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    opt = DPOptimizer(torch.optim.Adam(params, lr=1e-3, fused=True), noise_multiplier=SIGMA, max_grad_norm=1.0,
                      expected_batch_size=64)  # fmt: skip
    sums = [torch.randn(s) for s in shapes]

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


def bench_steps(cfg: BenchConfig, numel: int = STEP_NUMEL, on_call=lambda p, phase: None) -> dict:
    providers = [_fused_pass_provider(*c, numel) for c in STEP_CONFIGS]
    providers.append(_opacus_adam_provider(numel))
    src, dst = torch.ones(numel), torch.zeros(numel)
    providers.append(Provider("copy", "bandwidth", call=lambda: dst.copy_(src), bytes_moved=8 * numel,
                              note="D-element copy"))  # fmt: skip
    # Into a buffer allocated once, as the fused passes write theirs: a fresh 18 MB tensor per call
    # would add its page faults (which made this baseline bimodal, 3.6 or 7 ms, across runs).
    noise_buf = torch.empty(numel)
    providers.append(
        Provider(
            "generator",
            "bandwidth",
            call=lambda: torch.ops.dpkernels_C.gaussian_fill_(noise_buf, 1.0, SEED, 1, 0, 0),
            bytes_moved=4 * numel,
            note="Philox normals of D elements into a buffer, cpu",
        )
    )
    res = time_round_robin(providers, cfg.repeats, cfg.warmup, cfg.budget_s, on_call=on_call)
    other = res.pop("_other_cpu_cores")
    med = {p.name: _stats(res[p.name]["times_s"])["median_s"] for p in providers if p.skip is None}
    copy_bw = 8 * numel / med["copy"]
    rows = []
    for p in providers:
        if p.skip is not None:
            rows.append({"name": p.name, "kind": p.kind, "status": "skipped", "reason": p.skip})
            continue
        st = _stats(res[p.name]["times_s"])
        row = {"name": p.name, "kind": p.kind, "what": p.note, "status": "ok", **st, "times_s": res[p.name]["times_s"],
               "bytes_moved": p.bytes_moved, "gbps": p.bytes_moved / st["median_s"] / 1e9}  # fmt: skip
        row["pct_copy_bw"] = 100 * p.bytes_moved / st["median_s"] / copy_bw
        if p.kind == "dpkernels":
            floor = max(p.bytes_moved / copy_bw, med["generator"])
            row.update(floor_s=floor, over_floor=st["median_s"] / floor)
            row["within_target"] = row["over_floor"] <= STEP_TARGET_FLOOR
        rows.append(row)
    adam = med.get("DPAdam")
    opacus = med.get("opacus Adam")
    speedup = None if adam is None or opacus is None else opacus / adam
    return {
        "numel": numel,
        "providers": rows,
        "other_cpu_cores_during_timing": other,
        "target": {
            "what": f"fused DPAdam >= {ADAM_TARGET:g}x Opacus add_noise + scale_grad + Adam(fused=True).step(); "
            f"every fused step <= {STEP_TARGET_FLOOR:g}x its floor",
            "speedup": speedup,
            "met": None
            if speedup is None
            else speedup >= ADAM_TARGET and all(r.get("within_target", True) for r in rows),
        },
    }


def _full_step_providers(shape: Shape, grads: list, C: float) -> list[Provider]:
    out = []
    params = [torch.zeros(s) for s in shape.param_shapes]
    if "cpu" in _backend.available_backends("cpu"):
        opt = fused.DPAdam(params, lr=1e-3, noise_multiplier=SIGMA, max_grad_norm=C,
                           expected_batch_size=shape.batch_size, seed=SEED, backend="cpu")  # fmt: skip

        def prepare() -> None:
            for p, g in zip(params, grads, strict=True):
                p.grad_sample = g

        out.append(Provider("cpu DPAdam", "dpkernels", call=opt.step, prepare=prepare, note="dpkernels.optim.DPAdam"))
    try:
        from opacus.optimizers import DPOptimizer
    except ImportError as exc:
        out.append(Provider("opacus", "baseline", skip=f"opacus not importable: {exc}"))
        return out
    o_params = [torch.nn.Parameter(torch.zeros(s)) for s in shape.param_shapes]
    o_opt = DPOptimizer(torch.optim.Adam(o_params, lr=1e-3, fused=True), noise_multiplier=SIGMA, max_grad_norm=C,
                        expected_batch_size=shape.batch_size)  # fmt: skip

    def o_prepare() -> None:
        for p, g in zip(o_params, grads, strict=True):
            p.grad_sample = g.detach()
            p.summed_grad = None
            p.grad = None

    out.append(Provider("opacus", "baseline", call=o_opt.step, prepare=o_prepare,
                        note="DPOptimizer(Adam(fused=True)).step()"))  # fmt: skip
    return out


def bench_full_step(shape: Shape, cfg: BenchConfig, on_call=lambda p, phase: None) -> dict:
    grads, C = make_grad_samples(shape)
    providers = _full_step_providers(shape, grads, C)
    res = time_round_robin(providers, cfg.repeats, cfg.warmup, cfg.budget_s, on_call=on_call)
    other = res.pop("_other_cpu_cores")
    rows = {}
    for p in providers:
        if p.skip is not None:
            rows[p.name] = {"name": p.name, "kind": p.kind, "status": "skipped", "reason": p.skip}
            continue
        rows[p.name] = {"name": p.name, "kind": p.kind, "what": p.note, "status": "ok",
                        **_stats(res[p.name]["times_s"]), "times_s": res[p.name]["times_s"]}  # fmt: skip
    opacus_t = rows.get("opacus", {}).get("median_s")
    for row in rows.values():
        if row["status"] == "ok" and opacus_t is not None:
            row["speedup_vs_opacus"] = opacus_t / row["median_s"]
    del providers, grads
    gc.collect()
    return {
        "name": shape.name,
        "batch_size": shape.batch_size,
        "n_tensors": shape.n_tensors,
        "n_params": shape.n_params,
        "providers": list(rows.values()),
        "other_cpu_cores_during_timing": other,
    }


def steps_table(rec: dict):
    return provider_table(f"Fused optimizer pass, D = {rec['numel'] / 1e6:.1f} M fp32 (cpu)", rec, {
        "GB/s": lambda r: f"{r['gbps']:.1f}",
        "% copy BW": lambda r: f"{r['pct_copy_bw']:.0f}%",
        "floor ms": lambda r: "—" if "floor_s" not in r else f"{1e3 * r['floor_s']:.2f}",
        "× floor": lambda r: "—" if "over_floor" not in r else f"{r['over_floor']:.2f}",
    })  # fmt: skip


def full_step_table(rec: dict):
    title = (
        f"Full DP step, {rec['name']}: B={rec['batch_size']}, {rec['n_tensors']} tensors, "
        f"D={rec['n_params'] / 1e6:.2f} M"
    )
    return provider_table(title, rec, {"× Opacus": speedup_vs_opacus})
