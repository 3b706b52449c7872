"""``dpkernels bench`` section ``clip``: time ``clip_and_accumulate`` against eager, compiled and Opacus baselines.

(This docstring describes the ``clip`` section; the other sections, :mod:`dpkernels.bench.noise`,
:mod:`dpkernels.bench.step` and :mod:`dpkernels.bench.train_step`, share its measurement machinery,
:mod:`dpkernels.bench._timing`.)

What is measured, per named model shape (a list of ``[B, *param_shape]`` fp32 per-sample
gradients, built once with ``randn`` on the CPU, moved to the ``--device`` (``cpu`` by default,
or ``cuda``) and shared by every provider):

- **Providers.** Each native dpkernels backend usable for the device's tensors through the
  public :func:`dpkernels.clip_and_accumulate`: ``cpu`` (``triton`` is listed but skipped on CPU
  tensors: the interpreter's timing means nothing), or ``cuda`` and ``triton``; the pure-PyTorch
  reference called directly, eager
  (``dpkernels.reference.clip.clip_and_accumulate``; the public ``reference`` backend runs the
  same code, plus argument checks); ``torch.compile`` of that reference (default options, from
  a reset Dynamo state per shape; the first call, which compiles, is excluded and reported; off
  under ``--quick``, since cold compilation of a 150-tensor list takes minutes); and Opacus's
  ``DPOptimizer.clip_and_accumulate`` on the same tensors.
  All use flat clipping, ``c_i = min(1, C / (n_i + 1e-6))``.
- **Time.** ``time.perf_counter`` around one call; on ``cuda``, CUDA events around it with the
  device synchronized before and after (so a time spans launches and kernels, never an
  asynchronous launch alone). Warm-up calls first (one only for a call that takes seconds, two
  for the compiled reference and for every provider on ``cuda``, whose first call loads
  kernels), then ``repeats`` rounds;
  each round runs every provider once, in an order shuffled per round (seeded), so machine
  drift hits all providers alike and no provider always follows the same one. Before every
  timed call (untimed) a buffer of twice the last-level cache (on ``cuda``, the GPU's L2) is
  read, so every call, the
  bandwidth baselines included, starts with its data out of cache: without it, a shape that
  fits in cache (small-b8 is 48 MiB) hands whichever provider follows one that touched the
  same bytes (*read* after *copy* of the same buffer) a warm cache and the rest a cold one.
  The Python garbage collector is off inside a timed call. A provider whose
  calls would take more than a per-shape budget gets fewer rounds (never fewer than 3), spread
  evenly over the run. Reported: median, min, interquartile range, and how many cores other
  processes kept busy meanwhile (from ``/proc/stat`` minus this process's own CPU time), since
  on a shared machine that is what makes a run untrustworthy.
- **Bandwidth.** Two same-run baselines on a fresh buffer of the same size as the per-sample
  gradients, on the same device: *copy* (``dst.copy_(src)``, counting bytes read + written) and
  *read* (``torch.sum(src)``, counting bytes read). A provider's GB/s counts the minimum traffic of
  the fused op, **2 reads** of the per-sample gradients (norms pass, then weighted-sum pass);
  it is reported as a percentage of both baselines. The cpu backend's target is >= 80% of read
  (on ``cuda`` the same yardstick is applied to the cuda backend).
- **Error.** Max abs (and, in the JSON, relative) error of the sums and of the norms against
  the **float64** reference (``dpkernels.reference.clip.clip_and_accumulate`` on ``.double()``
  copies). Opacus returns no norms.
- **Peak extra memory.** One extra call per provider under ``torch.profiler`` with
  ``profile_memory=True``: c10's CPU allocator reports every allocation and free, including
  those made inside C++ ops, extensions and Inductor-generated code, so the running sum of
  those events gives the peak of memory allocated during the call on top of what existed
  before it (outputs included; ``malloc`` calls that bypass the allocator, e.g. small
  ``std::vector`` scratch, are not seen). Shown in MiB and relative to ``B·D·4`` and
  ``(B+D)·4`` bytes: an O(B + D) op keeps the first ratio far below 1. On ``cuda``: the CUDA
  caching allocator's ``max_memory_allocated`` during the call, less what was allocated before.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

import dpkernels

from .. import _backend
from ..reference import clip as ref
from . import _report as report
from ._timing import (
    NATIVE_BACKENDS,
    BenchConfig,
    Provider,
    bandwidth_providers,
    opacus_missing,
    opacus_optimizer,
    reset_opacus_grads,
    summary_stats,
    time_providers,
)
from .shapes import Shape, make_grad_samples

TRITON_SKIP = "interpreter timing is meaningless on CPU (no GPU here)"
ERROR_REFERENCE = "float64 dpkernels.reference.clip.clip_and_accumulate on .double() copies"
READ_TARGET = 0.80  # the cpu backend must reach 80% of same-run read bandwidth (issue text)


def float64_reference(grads: Sequence[Tensor], max_grad_norm: float) -> tuple[list[Tensor], Tensor]:
    """The reference pipeline in float64 (on the gradients' device): the yardstick for every provider's error."""
    g64 = [g.double() for g in grads]
    sums, norms = ref.clip_and_accumulate([g64], max_grad_norm)
    return sums, norms


# ----------------------------------------------------------------------------------------------
# Providers
# ----------------------------------------------------------------------------------------------


def _reference_eager(grads: list[Tensor], max_grad_norm: float):
    return ref.clip_and_accumulate([grads], max_grad_norm)


def _opacus_provider(shape: Shape, grads: list[Tensor], max_grad_norm: float, nbytes: int) -> Provider:
    if (why := opacus_missing()) is not None:
        return Provider("opacus", "baseline", skip=why)
    params, opt = opacus_optimizer(
        shape.param_shapes,
        lambda ps: torch.optim.SGD(ps, lr=0.1),
        noise_multiplier=0.0,
        max_grad_norm=max_grad_norm,
        expected_batch_size=shape.batch_size,
        device=grads[0].device.type,
    )
    return Provider(
        "opacus",
        "baseline",
        call=opt.clip_and_accumulate,
        prepare=lambda: reset_opacus_grads(params, grads),
        outputs=lambda _: ([p.summed_grad for p in params], None),
        bytes_moved=nbytes,
        note="DPOptimizer.clip_and_accumulate",
    )


def clip_backends(device: str) -> list[tuple[str, str | None]]:
    """``(backend, why it is skipped, or None)`` per dpkernels backend the clip table lists for
    ``device``'s tensors: the native ones, and on CPU tensors triton too, always skipped."""
    usable = _backend.available_backends(device)
    listed = [(b, None if b in usable else _backend._why_unavailable(b, device)) for b in NATIVE_BACKENDS[device]]
    return listed + [("triton", TRITON_SKIP)] if device == "cpu" else listed


def clip_providers(
    shape: Shape, grads: list[Tensor], max_grad_norm: float, *, compile_skip: str | None = None
) -> list[Provider]:
    """The providers of the fused op on ``grads``' device, in table order: dpkernels backends, then baselines.

    ``compile_skip``: leave out ``torch.compile`` of the reference, with this reason.
    """
    nbytes = 2 * shape.grad_bytes  # the fused op reads the per-sample gradients twice

    def timed(name: str, kind: str, call: Callable[[], object], note: str, min_warmup: int = 1) -> Provider:
        return Provider(name, kind, call=call, outputs=lambda r: r, bytes_moved=nbytes, note=note,
                        min_warmup=min_warmup)  # fmt: skip

    out = []
    for backend, skip in clip_backends(grads[0].device.type):
        if skip is not None:
            out.append(Provider(backend, "dpkernels", skip=skip))
        else:
            call = lambda b=backend: dpkernels.clip_and_accumulate(grads, max_grad_norm, backend=b)
            out.append(timed(backend, "dpkernels", call, "dpkernels.clip_and_accumulate"))
    eager = lambda: _reference_eager(grads, max_grad_norm)
    out.append(timed("reference", "baseline", eager, "eager PyTorch reference"))
    if compile_skip is not None:
        out.append(Provider("reference+compile", "baseline", skip=compile_skip))
    else:
        compiled = torch.compile(_reference_eager)
        # min_warmup=2: the first call compiles; the second shows whether it recompiles
        out.append(timed("reference+compile", "baseline", lambda: compiled(grads, max_grad_norm),
                         "torch.compile(reference), default options", min_warmup=2))  # fmt: skip
    out.append(_opacus_provider(shape, grads, max_grad_norm, nbytes))
    return out


@contextlib.contextmanager
def _quiet_kineto() -> Iterator[None]:
    """Drop the profiler backend's start/stop chatter, which it writes to fd 2 directly."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            noise = re.compile(rb"USDT:|profiler_(start|stop)|gpuGetDeviceCount")
            for line in tmp.read().splitlines():
                if line.strip() and not noise.search(line):
                    sys.stderr.write(line.decode(errors="replace") + "\n")


def _walk(nodes) -> Iterator:
    for n in nodes:
        yield n
        yield from _walk(n.children)


def peak_extra_memory(fn: Callable[[], object], device: str = "cpu") -> tuple[int | None, int | None, object]:
    """``(peak, retained, result)`` of ``fn()``: bytes allocated on ``device`` on top of what existed before.

    On CPU, runs ``fn`` under ``torch.profiler`` with ``profile_memory=True`` and replays its
    allocation events (c10 CPU allocator: every ``at::empty``, in Python, C++ ops and compiled
    code) in time order. ``peak`` is the maximum of the running sum, ``retained`` its final
    value (the outputs). ``None`` when the profiler's event tree is unavailable. On ``cuda``,
    the caching allocator's own counters (every tensor allocation on the device) say the same.
    """
    if device == "cuda":
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        result = fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before, torch.cuda.memory_allocated() - before, result

    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    with _quiet_kineto(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    try:
        tree = prof.profiler.kineto_results.experimental_event_tree()
        allocs = sorted((n for n in _walk(tree) if n.tag == _EventType.Allocation), key=lambda n: n.start_time_ns)
    except Exception:  # a private API: degrade to "not measured" rather than fail the run
        return None, None, result
    cur = peak = 0
    for n in allocs:
        cur += n.extra_fields.alloc_size
        peak = max(peak, cur)
    return peak, cur, result


def max_errors(
    sums: Sequence[Tensor], norms: Tensor | None, ref_sums: Sequence[Tensor], ref_norms: Tensor
) -> dict[str, float | None]:
    """Max abs and relative (to the largest reference magnitude) errors of sums and norms."""
    err_s = max(float((s.double() - r).abs().max()) for s, r in zip(sums, ref_sums, strict=True))
    mag_s = max(float(r.abs().max()) for r in ref_sums)
    out: dict[str, float | None] = {
        "max_abs_err_sums": err_s,
        "max_rel_err_sums": err_s / mag_s if mag_s else None,
        "max_abs_err_norms": None,
        "max_rel_err_norms": None,
    }
    if norms is not None:
        err_n = float((norms.double() - ref_norms).abs().max())
        out["max_abs_err_norms"] = err_n
        out["max_rel_err_norms"] = err_n / float(ref_norms.abs().max())
    return out


def bench_shape(shape: Shape, cfg: BenchConfig, progress=None, task=None) -> dict:
    """Time, check and memory-profile every provider on one shape; return its JSON record."""

    def advance(desc: str, n: int = 1) -> None:
        if progress is not None:
            progress.update(task, advance=n, description=f"[bold]{shape.name}[/] {desc}")

    load_before = os.getloadavg()[0]
    if cfg.compile_skip is None:
        # Compile each shape from a clean Dynamo state: otherwise a shape that differs from the
        # previous one only in B recompiles everything with a symbolic B, and its numbers would
        # depend on which shapes ran before it. (Inductor's on-disk cache still applies.)
        torch._dynamo.reset()
    grads, C = make_grad_samples(shape, device=cfg.device)
    advance("float64 reference")
    ref_sums, ref_norms = float64_reference(grads, C)
    gc.collect()
    advance("timing")

    providers = clip_providers(shape, grads, C, compile_skip=cfg.compile_skip)
    bw = bandwidth_providers(shape.grad_bytes, cfg.device)
    res, other_cores = time_providers(providers + bw, cfg, on_call=lambda p, phase: advance(f"{p.name} {phase}"))
    timed = [p for p in providers + bw if p.skip is None]
    moved = {p.name: p.bytes_moved for p in timed}
    if progress is not None:
        # Correct the up-front estimate: rounds a slow provider skips will never be made.
        steps = 2 + sum(len(res[p.name]["warmup_s"]) + res[p.name]["rounds"] for p in timed)
        steps += len(timed) - len(bw)
        progress.update(task, total=progress.tasks[task].total - expected_steps(cfg) + steps)
    del bw, timed  # frees the bandwidth buffers

    bd4, bpd4 = shape.grad_bytes, (shape.batch_size + shape.n_params) * 4
    rows = {}
    for p in providers + [Provider("copy", "bandwidth"), Provider("read", "bandwidth")]:
        row: dict = {"name": p.name, "kind": p.kind, "what": p.note}
        if p.skip is not None:
            rows[p.name] = {**row, "status": "skipped", "reason": p.skip}
            continue
        r = res[p.name]
        st = summary_stats(r["times_s"])
        row.update(status="ok", **st, times_s=r["times_s"], warmup_s=r["warmup_s"], rounds=r["rounds"])
        bytes_moved = moved[p.name]
        row.update(bytes_moved=bytes_moved, gbps=bytes_moved / st["median_s"] / 1e9)
        if p.name == "reference+compile" and r["warmup_s"]:
            row["first_call_s"] = r["warmup_s"][0]  # includes Dynamo/Inductor compilation
        rows[p.name] = row

    # Memory and error: one more call per provider, under the profiler.
    for p in providers:
        if p.skip is not None:
            continue
        advance(f"{p.name} memory + error")
        row = rows[p.name]
        p.prepare()
        try:
            peak, retained, result = peak_extra_memory(p.call, cfg.device)
            sums, norms = p.outputs(result)
        except Exception as exc:  # keep its timing; say why memory and error are missing
            row["memory_error_failed"] = f"{type(exc).__name__}: {exc}"
            continue
        row.update(max_errors(sums, norms, ref_sums, ref_norms))
        row.update(peak_extra_bytes=peak, retained_bytes=retained)
        if peak is not None:
            row.update(peak_over_BD4=peak / bd4, peak_over_BplusD4=peak / bpd4)
        del result, sums, norms

    report.add_pct_of_bandwidth(rows, ("copy", "read"))
    report.add_speedup_vs_opacus(rows.values())
    del providers, grads, ref_sums, ref_norms
    gc.collect()
    return {
        "name": shape.name,
        "description": shape.description,
        "batch_size": shape.batch_size,
        "n_tensors": shape.n_tensors,
        "n_params": shape.n_params,
        "param_shapes": [list(s) for s in shape.param_shapes],
        "dtype": "float32",
        "grad_bytes": bd4,
        "B_plus_D_bytes": bpd4,
        "max_grad_norm": C,
        "bytes_counted": "2 reads of the per-sample gradients (2·B·D·4)",
        "error_reference": ERROR_REFERENCE,
        "copy_gbps": rows["copy"]["gbps"],
        "read_gbps": rows["read"]["gbps"],
        "providers": list(rows.values()),
        "other_cpu_cores_during_timing": other_cores,
        "loadavg_1min": [load_before, os.getloadavg()[0]],
    }


# ----------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------


def shape_table(rec: dict):
    """A rich table of one shape's results."""
    from rich.table import Table

    title = (
        f"{rec['name']}: {rec['description']}; {report.shape_title(rec)}, "
        f"B·D·4 = {rec['grad_bytes'] / 2**20:.0f} MiB, (B+D)·4 = {rec['B_plus_D_bytes'] / 2**20:.1f} MiB"
    )
    caption = (
        f"GB/s counts 2 reads of the per-sample gradients (copy/read rows: their own bytes). "
        f"Errors: max abs vs the {ERROR_REFERENCE}. Peak extra: allocator peak during one call."
    )
    t = Table(title=title, title_justify="left", caption_justify="left")
    notes: list[str] = []
    t.add_column("provider")
    for col in ("median ms", "IQR ms", "GB/s", "% copy BW", "% read BW", "× Opacus"):
        t.add_column(col, justify="right")
    for col in ("max err Σ", "max err ‖g‖", "peak extra MiB", "÷ B·D·4", "÷ (B+D)·4"):
        t.add_column(col, justify="right")
    for row in rec["providers"]:
        if row["status"] != "ok":
            notes.append(f"{row['name']}: skipped, {row['reason']}")
            t.add_row(row["name"], "[dim]skipped[/]", style="dim")
            continue
        if row.get("first_call_s") is not None:
            notes.append(f"{row['name']}: first call (compilation) took {row['first_call_s']:.1f} s, not counted")
        peak = row.get("peak_extra_bytes")
        style = "bold green" if row["kind"] == "dpkernels" else ("dim" if row["kind"] == "bandwidth" else None)
        t.add_row(
            row["name"],
            f"{1e3 * row['median_s']:.2f}",
            f"{1e3 * row['iqr_s']:.2f}",
            f"{row['gbps']:.1f}",
            f"{row['pct_copy_bw']:.0f}%",
            f"{row['pct_read_bw']:.0f}%",
            report.speedup_vs_opacus(row),
            report.fmt(row.get("max_abs_err_sums"), ".1e"),
            report.fmt(row.get("max_abs_err_norms"), ".1e"),
            report.fmt(None if peak is None else peak / 2**20, ".1f"),
            report.fmt(row.get("peak_over_BD4"), ".4f"),
            report.fmt(row.get("peak_over_BplusD4"), ".2f"),
            style=style,
        )
    other = rec.get("other_cpu_cores_during_timing")
    if other is not None and other > 0.1:  # the timed calls shared the cores: times are inflated
        notes.append(
            f"[yellow]other processes kept {other:.2f} cores busy on average during the timed rounds; "
            "times are inflated and noisier[/]"
        )
    t.caption = "\n".join([caption, *notes])
    return t


def target_rows(shapes: Sequence[dict], device: str = "cpu") -> list[dict]:
    """The issue's CPU target per shape: the device's first native backend (cpu, or cuda) >= 80%
    of read bandwidth, and its speedup."""
    backend = NATIVE_BACKENDS[device][0]
    out = []
    for rec in shapes:
        row = next((r for r in rec["providers"] if r["name"] == backend), None)
        if row is None or row["status"] != "ok":
            out.append({"shape": rec["name"], "status": f"{backend} backend not run"})
            continue
        out.append(
            {
                "shape": rec["name"],
                "batch_size": rec["batch_size"],
                "pct_read_bw": row["pct_read_bw"],
                "meets_read_bw_target": row["pct_read_bw"] >= 100 * READ_TARGET,
                "speedup_vs_opacus": row.get("speedup_vs_opacus"),
                "peak_over_BD4": row.get("peak_over_BD4"),
                "peak_over_BplusD4": row.get("peak_over_BplusD4"),
            }
        )
    return out


def targets_table(rows: Sequence[dict], device: str = "cpu"):
    from rich.table import Table

    t = Table(
        title=f"Target: {NATIVE_BACKENDS[device][0]} backend >= {100 * READ_TARGET:.0f}% of same-run read bandwidth",
        title_justify="left",
    )
    for col in ("shape", "B", "% read BW", "met", "× Opacus", "peak ÷ B·D·4", "peak ÷ (B+D)·4"):
        t.add_column(col, justify="left" if col == "shape" else "right")
    for r in rows:
        if "pct_read_bw" not in r:
            t.add_row(r["shape"], "", f"[dim]{r['status']}[/]")
            continue
        t.add_row(
            r["shape"],
            str(r["batch_size"]),
            f"{r['pct_read_bw']:.0f}%",
            "[green]yes[/]" if r["meets_read_bw_target"] else "[red]no[/]",
            report.speedup_vs_opacus(r),
            report.fmt(r["peak_over_BD4"], ".4f"),
            report.fmt(r["peak_over_BplusD4"], ".2f"),
        )
    return t


def expected_steps(cfg: BenchConfig) -> int:
    """Progress steps of one shape: 2 set-up steps, every timed call, one memory call each."""
    import importlib.util

    n_clip = 1 + int(cfg.compile_skip is None)  # the eager and the compiled reference
    n_clip += sum(skip is None for _, skip in clip_backends(cfg.device))
    n_clip += int(importlib.util.find_spec("opacus") is not None)
    return 2 + (n_clip + 2) * (cfg.warmup + cfg.repeats) + n_clip
