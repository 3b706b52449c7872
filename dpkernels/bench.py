"""``dpkernels bench``: time ``clip_and_accumulate`` against eager, compiled and Opacus baselines.

(The ``noise`` and ``privatize`` sections live in :mod:`dpkernels.bench_noise`; this docstring
describes the ``clip`` section, whose measurement machinery they share.)

What is measured, per named model shape (a list of ``[B, *param_shape]`` fp32 per-sample
gradients, built once with ``randn`` and shared by every provider):

- **Providers.** Each dpkernels backend usable for CPU tensors through the public
  :func:`dpkernels.clip_and_accumulate` (``triton`` is listed but skipped: the interpreter's
  timing means nothing); the pure-PyTorch reference called directly, eager
  (``dpkernels.reference.clip.clip_and_accumulate``; the public ``reference`` backend runs the
  same code, plus argument checks); ``torch.compile`` of that reference (default options, from
  a reset Dynamo state per shape; the first call, which compiles, is excluded and reported; off
  under ``--quick``, since cold compilation of a 150-tensor list takes minutes); and Opacus's
  ``DPOptimizer.clip_and_accumulate`` on the same tensors.
  All use flat clipping, ``c_i = min(1, C / (n_i + 1e-6))``.
- **Time.** ``time.perf_counter`` around one call. Warm-up calls first (one only for a call that
  takes seconds, two for the compiled reference), then ``repeats`` rounds;
  each round runs every provider once, in an order shuffled per round (seeded), so machine
  drift hits all providers alike and no provider always follows the same one. Before every
  timed call (untimed) a buffer of twice the last-level cache is read, so every call, the
  bandwidth baselines included, starts with its data out of cache: without it, a shape that
  fits in cache (small-b8 is 48 MiB) hands whichever provider follows one that touched the
  same bytes (*read* after *copy* of the same buffer) a warm cache and the rest a cold one.
  The Python garbage collector is off inside a timed call. A provider whose
  calls would take more than a per-shape budget gets fewer rounds (never fewer than 3), spread
  evenly over the run. Reported: median, min, interquartile range, and how many cores other
  processes kept busy meanwhile (from ``/proc/stat`` minus this process's own CPU time), since
  on a shared machine that is what makes a run untrustworthy.
- **Bandwidth.** Two same-run baselines on a fresh buffer of the same size as the per-sample
  gradients: *copy* (``dst.copy_(src)``, counting bytes read + written) and *read*
  (``torch.sum(src)``, counting bytes read). A provider's GB/s counts the minimum traffic of
  the fused op, **2 reads** of the per-sample gradients (norms pass, then weighted-sum pass);
  it is reported as a percentage of both baselines. The cpu backend's target is >= 80% of read.
- **Error.** Max abs (and, in the JSON, relative) error of the sums and of the norms against
  the **float64** reference (``dpkernels.reference.clip.clip_and_accumulate`` on ``.double()``
  copies). Opacus returns no norms.
- **Peak extra memory.** One extra call per provider under ``torch.profiler`` with
  ``profile_memory=True``: c10's CPU allocator reports every allocation and free, including
  those made inside C++ ops, extensions and Inductor-generated code, so the running sum of
  those events gives the peak of memory allocated during the call on top of what existed
  before it (outputs included; ``malloc`` calls that bypass the allocator, e.g. small
  ``std::vector`` scratch, are not seen). Shown in MiB and relative to ``B·D·4`` and
  ``(B+D)·4`` bytes: an O(B + D) op keeps the first ratio far below 1.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import math
import os
import platform
import random
import re
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

import dpkernels

from . import _backend
from .reference import clip as ref

TRITON_SKIP = "interpreter timing is meaningless on CPU (no GPU here)"
ERROR_REFERENCE = "float64 dpkernels.reference.clip.clip_and_accumulate on .double() copies"
READ_TARGET = 0.80  # the cpu backend must reach 80% of same-run read bandwidth (issue text)

# ----------------------------------------------------------------------------------------------
# Shapes
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """A model-shaped list of parameter tensors and a batch size ``B``."""

    name: str
    description: str
    batch_size: int
    param_shapes: tuple[tuple[int, ...], ...]

    @property
    def n_tensors(self) -> int:
        return len(self.param_shapes)

    @property
    def n_params(self) -> int:
        return sum(math.prod(s) for s in self.param_shapes)

    @property
    def grad_bytes(self) -> int:
        """Bytes of the fp32 per-sample gradients, ``B·D·4``."""
        return self.batch_size * self.n_params * 4


def _linear(n_in: int, n_out: int) -> list[tuple[int, ...]]:
    return [(n_out, n_in), (n_out,)]


def mlp_shape(quick: bool = False) -> Shape:
    """Large MLP: 4 Linear layers 1024→1024→1024→1024→1000 (8 tensors, 4.2 M params)."""
    dims = [1024, 1024, 1024, 1024, 1000]
    shapes = [s for a, b in zip(dims[:-1], dims[1:], strict=True) for s in _linear(a, b)]
    B = 16 if quick else 64
    return Shape("mlp", "large MLP, 4 Linear layers of 1024", B, tuple(shapes))


def transformer_shape(quick: bool = False) -> Shape:
    """Small GPT-style transformer: d=192, 4 blocks, vocab 5000, context 256 (52 tensors, 2.8 M)."""
    d, n_blocks, vocab, ctx = 192, 4, 5000, 256
    shapes: list[tuple[int, ...]] = [(vocab, d), (ctx, d)]
    for _ in range(n_blocks):
        shapes += [(d,), (d,)]  # LayerNorm 1
        shapes += _linear(d, 3 * d) + _linear(d, d)  # qkv, attention projection
        shapes += [(d,), (d,)]  # LayerNorm 2
        shapes += _linear(d, 4 * d) + _linear(4 * d, d)  # MLP
    shapes += [(d,), (d,)]  # final LayerNorm; the head is tied to the embedding
    B = 16 if quick else 64
    return Shape("transformer", f"small transformer, d={d}, {n_blocks} blocks", B, tuple(shapes))


def small_tensors_shape(batch_size: int) -> Shape:
    """Many small tensors: a 37-conv net, channels 32/64/96, GroupNorm (148 tensors, 1.55 M)."""
    shapes: list[tuple[int, ...]] = [(32, 3, 3, 3), (32,)]
    c_in = 32
    for c in (32, 64, 96):
        for _ in range(12):
            shapes += [(c, c_in, 3, 3), (c,), (c,), (c,)]  # conv weight, bias; GroupNorm w, b
            c_in = c
    shapes += _linear(96, 10)
    return Shape(f"small-b{batch_size}", "many small tensors, 37 convs + GroupNorm", batch_size, tuple(shapes))


# Quick variants shrink B for the two big shapes (the eager reference dominates the run time);
# the small-tensor shapes are already cheap and keep their B, which is part of their name.
SHAPES: dict[str, Callable[[bool], Shape]] = {
    "mlp": mlp_shape,
    "transformer": transformer_shape,
    "small-b8": lambda quick=False: small_tensors_shape(8),
    "small-b32": lambda quick=False: small_tensors_shape(32),
}


#: What ``dpkernels bench`` can run: the clipping pipeline (this module), the Gaussian generator
#: and the fused private gradient (:mod:`dpkernels.bench_noise`), the fused optimizer steps and the
#: full DP step (:mod:`dpkernels.bench_step`), a whole training step with Opacus, accelerated or
#: not, and without privacy (:mod:`dpkernels.bench_train`).
SECTIONS = ("clip", "noise", "privatize", "step", "train")


def get_shape(name: str, quick: bool = False) -> Shape:
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; expected one of {', '.join(SHAPES)}")
    return SHAPES[name](quick)


def make_grad_samples(shape: Shape, seed: int = 0) -> tuple[list[Tensor], float]:
    """Per-sample gradients ``[B, *param_shape]`` (fp32, randn) and a ``max_grad_norm``.

    Sample ``i`` is scaled by a factor spread over [0.5, 1.5], so its norm is about
    ``factor · sqrt(D)``; with ``C = sqrt(D)`` about half the samples are clipped and half are
    not, which exercises both branches of ``min(1, C / n)``.
    """
    gen = torch.Generator().manual_seed(seed)
    B = shape.batch_size
    factor = torch.linspace(0.5, 1.5, B)[torch.randperm(B, generator=gen)]
    grads = []
    for s in shape.param_shapes:
        g = torch.randn((B, *s), generator=gen)
        grads.append(g.mul_(factor.view(B, *([1] * len(s)))))
    return grads, math.sqrt(shape.n_params)


def float64_reference(grads: Sequence[Tensor], max_grad_norm: float) -> tuple[list[Tensor], Tensor]:
    """The reference pipeline in float64: the yardstick for every provider's error."""
    g64 = [g.double() for g in grads]
    sums, norms = ref.clip_and_accumulate([g64], max_grad_norm)
    return sums, norms


# ----------------------------------------------------------------------------------------------
# Providers
# ----------------------------------------------------------------------------------------------


def _noop() -> None:
    pass


@dataclass
class Provider:
    """One timed thing: ``prepare()`` (untimed) then ``call()`` (timed).

    ``outputs(result)`` maps ``call()``'s result to ``(sums, norms or None)`` for the error
    check; bandwidth baselines have none. ``skip`` holds the reason a provider is not run.
    """

    name: str
    kind: str  # "dpkernels", "baseline" or "bandwidth"
    call: Callable[[], object] | None = None
    prepare: Callable[[], None] = _noop
    outputs: Callable[[object], tuple[list[Tensor], Tensor | None]] | None = None
    bytes_moved: int = 0
    skip: str | None = None
    note: str = ""
    min_warmup: int = 1  # warm-up calls made even when they are slow (compilation needs 2)


def _reference_eager(grads: list[Tensor], max_grad_norm: float):
    return ref.clip_and_accumulate([grads], max_grad_norm)


def _opacus_provider(shape: Shape, grads: list[Tensor], max_grad_norm: float, nbytes: int) -> Provider:
    try:
        from opacus.optimizers import DPOptimizer
    except ImportError as exc:  # opacus is an optional (bench) dependency
        return Provider("opacus", "baseline", skip=f"opacus not importable: {exc}")
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shape.param_shapes]
    opt = DPOptimizer(
        torch.optim.SGD(params, lr=0.1),
        noise_multiplier=0.0,
        max_grad_norm=max_grad_norm,
        expected_batch_size=shape.batch_size,
    )

    def prepare() -> None:
        # Opacus tags p.grad_sample with `_processed` after use and refuses to reuse it, and
        # accumulates into p.summed_grad if set: give it a fresh alias (a new tensor object on
        # the same storage, so our shared gradients never carry the tag) and clear the sum.
        for p, g in zip(params, grads, strict=True):
            p.grad_sample = g.detach()
            p.summed_grad = None

    return Provider(
        "opacus",
        "baseline",
        call=opt.clip_and_accumulate,
        prepare=prepare,
        outputs=lambda _: ([p.summed_grad for p in params], None),
        bytes_moved=nbytes,
        note="DPOptimizer.clip_and_accumulate",
    )


def clip_providers(
    shape: Shape, grads: list[Tensor], max_grad_norm: float, *, compile_skip: str | None = None
) -> list[Provider]:
    """The providers of the fused op, in table order: dpkernels backends, then baselines.

    ``compile_skip``: leave out ``torch.compile`` of the reference, with this reason.
    """
    nbytes = 2 * shape.grad_bytes  # the fused op reads the per-sample gradients twice
    usable = _backend.available_backends("cpu")
    out = []
    for backend in ("cpu", "triton"):
        if backend == "triton":
            out.append(Provider("triton", "dpkernels", skip=TRITON_SKIP))
        elif backend not in usable:
            out.append(Provider(backend, "dpkernels", skip=_backend._why_unavailable(backend, "cpu")))
        else:
            out.append(
                Provider(
                    backend,
                    "dpkernels",
                    call=lambda b=backend: dpkernels.clip_and_accumulate(grads, max_grad_norm, backend=b),
                    outputs=lambda r: r,
                    bytes_moved=nbytes,
                    note="dpkernels.clip_and_accumulate",
                )
            )
    out.append(
        Provider(
            "reference",
            "baseline",
            call=lambda: _reference_eager(grads, max_grad_norm),
            outputs=lambda r: r,
            bytes_moved=nbytes,
            note="eager PyTorch reference",
        )
    )
    if compile_skip is not None:
        out.append(Provider("reference+compile", "baseline", skip=compile_skip))
    else:
        compiled = torch.compile(_reference_eager)
        out.append(
            Provider(
                "reference+compile",
                "baseline",
                call=lambda: compiled(grads, max_grad_norm),
                outputs=lambda r: r,
                bytes_moved=nbytes,
                note="torch.compile(reference), default options",
                min_warmup=2,  # the first call compiles; the second shows whether it recompiles
            )
        )
    out.append(_opacus_provider(shape, grads, max_grad_norm, nbytes))
    return out


def bandwidth_providers(nbytes: int) -> list[Provider]:
    """Same-run copy and read baselines on fresh ``nbytes`` buffers.

    The buffers are filled first so their pages are faulted in before anything is timed.
    """
    src = torch.ones(nbytes // 4)
    dst = torch.zeros_like(src)
    return [
        Provider("copy", "bandwidth", call=lambda: dst.copy_(src), bytes_moved=2 * nbytes, note="dst.copy_(src)"),
        Provider("read", "bandwidth", call=lambda: torch.sum(src), bytes_moved=nbytes, note="torch.sum(src)"),
    ]


# ----------------------------------------------------------------------------------------------
# Measurement
# ----------------------------------------------------------------------------------------------


def last_level_cache_bytes() -> int:
    """The largest CPU cache on this machine, from sysfs (32 MiB where sysfs does not say)."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        m = re.fullmatch(r"(\d+)([KMG]?)", f.read_text().strip())
        if m:
            sizes.append(int(m[1]) << {"": 0, "K": 10, "M": 20, "G": 30}[m[2]])
    return max(sizes, default=32 << 20)


class CacheFlush:
    """Evicts this process's data from the CPU caches by reading a buffer twice their size.

    Reading (not writing) leaves the caches full of clean lines, so the next call's evictions
    cost no write-backs; the previous call's dirty lines are written back here, untimed.
    """

    def __init__(self, nbytes: int | None = None):
        self.buf = torch.ones((nbytes or 2 * last_level_cache_bytes()) // 4)

    def __call__(self) -> None:
        self.buf.sum()


_flush_caches: CacheFlush | None = None


def timed_call(p: Provider) -> float:
    """Seconds for one ``p.call()``, after an untimed ``p.prepare()`` and cache flush; garbage
    collector off."""
    global _flush_caches
    p.prepare()
    if _flush_caches is None:
        _flush_caches = CacheFlush()
    _flush_caches()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        t0 = time.perf_counter()
        p.call()
        return time.perf_counter() - t0
    finally:
        if gc_was_enabled:
            gc.enable()


def cpu_snapshot() -> tuple[float, float, float]:
    """``(wall, machine-wide busy CPU seconds, this process's CPU seconds incl. children)``."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
        busy = (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # minus idle, iowait
    except (OSError, ValueError, IndexError):
        busy = math.nan
    own = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        own += usage.ru_utime + usage.ru_stime
    return time.perf_counter(), busy, own


def other_cpu_cores(before: tuple[float, float, float], after: tuple[float, float, float]) -> float:
    """Average number of cores other processes kept busy between two :func:`cpu_snapshot` calls.

    On a shared machine this says whether the timed calls had the cores to themselves; well
    above 0 means the times are inflated and the ratios less trustworthy.
    """
    wall = after[0] - before[0]
    if wall <= 0:
        return math.nan
    return max(0.0, ((after[1] - before[1]) - (after[2] - before[2])) / wall)


def round_schedule(repeats: int, n: int) -> set[int]:
    """``n`` of the ``repeats`` rounds, spread evenly (a slow provider runs in fewer rounds)."""
    return {(i * repeats) // n for i in range(n)}


def time_round_robin(
    providers: Sequence[Provider],
    repeats: int,
    warmup: int,
    budget_s: float,
    min_repeats: int = 3,
    on_call: Callable[[Provider, str], None] = lambda p, phase: None,
) -> dict[str, dict]:
    """Warm up every provider, then run ``repeats`` rounds, each in a shuffled order.

    Returns, per provider name, ``times_s`` (the timed calls), ``warmup_s`` and the number of
    rounds it ran. Warm-up stops early (after ``p.min_warmup`` calls) once it took
    ``budget_s / 4``. A provider whose steady call time × ``repeats`` exceeds ``budget_s`` runs
    in ``max(min_repeats, budget_s / call time)`` rounds instead. Under the ``"_other_cpu_cores"``
    key: the cores other processes kept busy during the rounds (:func:`other_cpu_cores`).
    """
    res = {}
    for p in providers:
        if p.skip is not None:
            continue
        res[p.name] = {"times_s": [], "warmup_s": []}
        try:
            for i in range(max(warmup, p.min_warmup)):
                # A call that takes seconds is warm after one run; more would only cost time.
                if i >= p.min_warmup and sum(res[p.name]["warmup_s"]) > budget_s / 4:
                    break
                res[p.name]["warmup_s"].append(timed_call(p))
                on_call(p, "warm-up")
        except Exception as exc:  # e.g. no C++ compiler for torch.compile: report it, time the rest
            first_line = str(exc).splitlines()[0][:200] if str(exc) else ""
            p.skip = f"failed: {type(exc).__name__}: {first_line}"
            del res[p.name]
    live = [p for p in providers if p.skip is None]
    plan = {}
    for p in live:
        w = res[p.name]["warmup_s"]
        est = min(w[1:] or w) if w else 0.0  # the first warm-up call may include compilation
        n = repeats if est * repeats <= budget_s else max(min_repeats, int(budget_s / max(est, 1e-9)))
        plan[p.name] = round_schedule(repeats, min(n, repeats))
        res[p.name]["rounds"] = len(plan[p.name])
    before = cpu_snapshot()
    order = random.Random(0)
    for r in range(repeats):
        gc.collect()
        for p in order.sample(live, len(live)):
            if r in plan[p.name]:
                res[p.name]["times_s"].append(timed_call(p))
                on_call(p, f"round {r + 1}/{repeats}")
    res["_other_cpu_cores"] = other_cpu_cores(before, cpu_snapshot())
    return res


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


def peak_extra_memory(fn: Callable[[], object]) -> tuple[int | None, int | None, object]:
    """``(peak, retained, result)`` of ``fn()``: bytes allocated on top of what existed before.

    Runs ``fn`` under ``torch.profiler`` with ``profile_memory=True`` and replays its
    allocation events (c10 CPU allocator: every ``at::empty``, in Python, C++ ops and compiled
    code) in time order. ``peak`` is the maximum of the running sum, ``retained`` its final
    value (the outputs). ``None`` when the profiler's event tree is unavailable.
    """
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


def _stats(times: Sequence[float]) -> dict[str, float]:
    if len(times) >= 2:
        q = statistics.quantiles(times, n=4, method="inclusive")
        iqr = q[2] - q[0]
    else:
        iqr = 0.0
    return {"median_s": statistics.median(times), "min_s": min(times), "iqr_s": iqr}


# ----------------------------------------------------------------------------------------------
# One shape
# ----------------------------------------------------------------------------------------------


@dataclass
class BenchConfig:
    shapes: list[str] = field(default_factory=lambda: list(SHAPES))
    quick: bool = False
    repeats: int = 9
    warmup: int = 2
    threads: int = 0  # 0: leave torch's setting alone
    budget_s: float = 20.0  # per provider and shape; slower providers get fewer rounds
    compile_skip: str | None = None  # a reason to leave out torch.compile of the reference
    sections: list[str] = field(default_factory=lambda: list(SECTIONS))


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
    grads, C = make_grad_samples(shape)
    advance("float64 reference")
    ref_sums, ref_norms = float64_reference(grads, C)
    gc.collect()
    advance("timing")

    providers = clip_providers(shape, grads, C, compile_skip=cfg.compile_skip)
    bw = bandwidth_providers(shape.grad_bytes)
    res = time_round_robin(
        providers + bw,
        cfg.repeats,
        cfg.warmup,
        cfg.budget_s,
        on_call=lambda p, phase: advance(f"{p.name} {phase}"),
    )
    other_cores = res.pop("_other_cpu_cores")
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
        st = _stats(r["times_s"])
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
            peak, retained, result = peak_extra_memory(p.call)
            sums, norms = p.outputs(result)
        except Exception as exc:  # keep its timing; say why memory and error are missing
            row["memory_error_failed"] = f"{type(exc).__name__}: {exc}"
            continue
        row.update(max_errors(sums, norms, ref_sums, ref_norms))
        row.update(peak_extra_bytes=peak, retained_bytes=retained)
        if peak is not None:
            row.update(peak_over_BD4=peak / bd4, peak_over_BplusD4=peak / bpd4)
        del result, sums, norms

    copy_bw = rows["copy"]["gbps"]
    read_bw = rows["read"]["gbps"]
    opacus_t = rows["opacus"].get("median_s")
    for row in rows.values():
        if row["status"] != "ok":
            continue
        row["pct_copy_bw"] = 100 * row["gbps"] / copy_bw
        row["pct_read_bw"] = 100 * row["gbps"] / read_bw
        if opacus_t is not None and row["kind"] != "bandwidth":
            row["speedup_vs_opacus"] = opacus_t / row["median_s"]
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
        "copy_gbps": copy_bw,
        "read_gbps": read_bw,
        "providers": list(rows.values()),
        "other_cpu_cores_during_timing": other_cores,
        "loadavg_1min": [load_before, os.getloadavg()[0]],
    }


# ----------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------


def _fmt(x, spec: str, suffix: str = "") -> str:
    return "—" if x is None else f"{x:{spec}}{suffix}"


def shape_table(rec: dict):
    """A rich table of one shape's results."""
    from rich.table import Table

    title = (
        f"{rec['name']}: {rec['description']}; B={rec['batch_size']}, {rec['n_tensors']} tensors, "
        f"D={rec['n_params'] / 1e6:.2f} M, B·D·4 = {rec['grad_bytes'] / 2**20:.0f} MiB, "
        f"(B+D)·4 = {rec['B_plus_D_bytes'] / 2**20:.1f} MiB"
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
            _fmt(row.get("speedup_vs_opacus"), ".2f", "×"),
            _fmt(row.get("max_abs_err_sums"), ".1e"),
            _fmt(row.get("max_abs_err_norms"), ".1e"),
            _fmt(None if peak is None else peak / 2**20, ".1f"),
            _fmt(row.get("peak_over_BD4"), ".4f"),
            _fmt(row.get("peak_over_BplusD4"), ".2f"),
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


def target_rows(shapes: Sequence[dict]) -> list[dict]:
    """The issue's CPU target per shape: cpu backend >= 80% of read bandwidth, and its speedup."""
    out = []
    for rec in shapes:
        row = next((r for r in rec["providers"] if r["name"] == "cpu"), None)
        if row is None or row["status"] != "ok":
            out.append({"shape": rec["name"], "status": "cpu backend not run"})
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


def targets_table(rows: Sequence[dict]):
    from rich.table import Table

    t = Table(
        title=f"Target: cpu backend >= {100 * READ_TARGET:.0f}% of same-run read bandwidth",
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
            _fmt(r["speedup_vs_opacus"], ".2f", "×"),
            _fmt(r["peak_over_BD4"], ".4f"),
            _fmt(r["peak_over_BplusD4"], ".2f"),
        )
    return t


def machine_info() -> dict:
    """What the numbers depend on: CPU, threads, memory, library versions, relevant env."""

    def read(path: str) -> str:
        try:
            return Path(path).read_text()
        except OSError:
            return ""

    cpuinfo = read("/proc/cpuinfo")
    model = re.search(r"^model name\s*:\s*(.*)$", cpuinfo, re.M)
    mem = re.search(r"^MemTotal:\s*(\d+) kB", read("/proc/meminfo"), re.M)
    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "dpkernels": dpkernels.__version__,
    }
    for mod in ("opacus", "rich"):
        try:
            from importlib.metadata import version

            versions[mod] = version(mod)
        except Exception:
            versions[mod] = None
    return {
        "cpu_model": model.group(1).strip() if model else platform.processor(),
        "cpu_count": os.cpu_count(),
        "l3_cache": read("/sys/devices/system/cpu/cpu0/cache/index3/size").strip() or None,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mem_total_gib": int(mem.group(1)) / 2**20 if mem else None,
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "versions": versions,
        "backends_available": _backend.available_backends("cpu"),
        "env": {
            k: os.environ[k]
            for k in ("DPKERNELS_POISON_OUTPUTS", "TRITON_INTERPRET", "OMP_NUM_THREADS")
            if k in os.environ
        },
    }


def expected_steps(cfg: BenchConfig) -> int:
    """Progress steps of one shape: 2 set-up steps, every timed call, one memory call each."""
    import importlib.util

    n_clip = 1 + int(cfg.compile_skip is None)  # the eager and the compiled reference
    n_clip += int("cpu" in _backend.available_backends("cpu"))
    n_clip += int(importlib.util.find_spec("opacus") is not None)
    return 2 + (n_clip + 2) * (cfg.warmup + cfg.repeats) + n_clip


def _run_other_sections(cfg: BenchConfig, shapes: Sequence[Shape], record: dict, progress) -> None:
    """The generator, ``privatize``, optimizer-step and training-step sections, one progress bar each."""
    from . import bench_noise, bench_step, bench_train

    def ticker(task, label):
        return lambda p, phase: progress.update(task, advance=1, description=f"[bold]{label}[/] {p.name} {phase}")

    if "noise" in cfg.sections:
        n = len(bench_noise.generator_providers(0)) * (cfg.warmup + cfg.repeats)
        task = progress.add_task("generator", total=n)
        record["noise"] = bench_noise.bench_generator(cfg, on_call=ticker(task, "generator"))
        progress.update(task, description="generator: done", completed=n)
        progress.console.print(bench_noise.generator_table(record["noise"]))

    def per_item(key: str, label: str, items, calls_per_item: int, bench, table) -> None:
        """One bench call and table per shape (or model), under one progress bar."""
        n = len(items) * calls_per_item * (cfg.warmup + cfg.repeats)
        task = progress.add_task(label, total=n)
        record[key] = []
        for item in items:
            rec = bench(item, cfg, on_call=ticker(task, f"{label} {item.name}"))
            record[key].append(rec)
            progress.console.print(table(rec))
        progress.update(task, description=f"{label}: done", completed=n)

    if "privatize" in cfg.sections:
        per_item("privatize", "privatize", shapes, 5, bench_noise.bench_privatize, bench_noise.privatize_table)
    if "step" in cfg.sections:
        n = (len(bench_step.STEP_CONFIGS) + 3 + 2 * len(shapes)) * (cfg.warmup + cfg.repeats)
        task = progress.add_task("step", total=n)
        record["step"] = bench_step.bench_steps(cfg, on_call=ticker(task, "step"))
        progress.console.print(bench_step.steps_table(record["step"]))
        record["full_step"] = []
        for shape in shapes:
            rec = bench_step.bench_full_step(shape, cfg, on_call=ticker(task, f"full step {shape.name}"))
            record["full_step"].append(rec)
            progress.console.print(bench_step.full_step_table(rec))
        progress.update(task, description="step: done", completed=n)
    if "train" in cfg.sections:
        models = bench_train.models(cfg.quick)
        per_item("train_step", "train", models, 3, bench_train.bench_train_step, bench_train.train_step_table)


def run(cfg: BenchConfig, json_path: str | os.PathLike | None = None, console=None) -> dict:
    """Run the benchmark with a progress bar, print one table per shape, write the JSON."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if console is None:
        # Off a terminal rich assumes 80 columns, which would fold the tables.
        console = Console() if sys.stdout.isatty() else Console(width=200)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if "TORCH_LOGS" not in os.environ:
        # Dynamo warns about every graph break of the reference (by design: it syncs and uses
        # boolean masks) and Inductor's C++ builder notes the missing CUDA runtime; neither is
        # news here, and both would scroll the tables away.
        import logging

        torch._logging.set_logs(dynamo=logging.ERROR, inductor=logging.ERROR)
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    if os.environ.get("DPKERNELS_POISON_OUTPUTS") == "1":
        console.print("[yellow]DPKERNELS_POISON_OUTPUTS=1 adds an output write to every native call[/]")
    t_start = time.perf_counter()
    shapes = [get_shape(n, cfg.quick) for n in cfg.shapes]
    record = {
        "schema": 1,
        "command": sys.argv,
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
        "machine": machine_info(),
        "method": __doc__,
        "shapes": [],
    }
    per_shape = expected_steps(cfg)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as progress:
        if "clip" in cfg.sections:
            task = progress.add_task("starting", total=per_shape * len(shapes))
            for shape in shapes:
                rec = bench_shape(shape, cfg, progress, task)
                record["shapes"].append(rec)
                progress.console.print(shape_table(rec))
            progress.update(task, description="clip: done", completed=progress.tasks[task].total)
        _run_other_sections(cfg, shapes, record, progress)
    if "clip" in cfg.sections:
        record["targets"] = target_rows(record["shapes"])
        console.print(targets_table(record["targets"]))
    record["wall_s"] = time.perf_counter() - t_start
    record["max_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if json_path is not None:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1) + "\n")
        console.print(f"wrote {path} (wall {record['wall_s']:.0f} s, peak RSS {record['max_rss_gib']:.1f} GiB)")
    return record
