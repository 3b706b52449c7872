"""The measurement every ``dpkernels bench`` section shares.

A timed thing is a :class:`Provider`; :func:`time_round_robin` times a list of them in rounds, each
round in a freshly shuffled order, every call preceded (untimed) by the provider's ``prepare`` and
a read of a buffer twice the last-level cache (the GPU's L2 on ``cuda``), the garbage collector
off inside the call, and reports how many cores other processes kept busy meanwhile. On ``cuda``
a call is timed with CUDA events between two ``torch.cuda.synchronize()`` (never an asynchronous
launch alone). Also here: the run's configuration, the device's timed backends, the same-run
bandwidth baselines and the Opacus baselines' set-up. The method in full is the docstring of
:mod:`dpkernels.bench.clip` and docs/BENCHMARKS.md.

Imports nothing from the section modules (which all import it).
"""

from __future__ import annotations

import gc
import math
import os
import random
import re
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from .. import _backend
from .shapes import SHAPES

SEED = 20261123  # the noise seed of every timed dpkernels call
SIGMA = 1.0  # the noise multiplier of the private providers (noise, privatize, step sections)

#: What ``dpkernels bench`` can run: the clipping pipeline (:mod:`dpkernels.bench.clip`), the
#: Gaussian generator and the fused private gradient (:mod:`dpkernels.bench.noise`), the fused
#: optimizer steps and the full DP step (:mod:`dpkernels.bench.step`), a whole training step with
#: Opacus, accelerated or not, and without privacy (:mod:`dpkernels.bench.train_step`), and what
#: book-keeping clipping pays per linear layer against its weight-grad GEMM (:mod:`dpkernels.bench.layers`).
SECTIONS = ("clip", "noise", "privatize", "step", "train", "layers")

#: Where ``dpkernels bench --device`` builds its inputs and times: CPU tensors, or CUDA tensors.
DEVICES = ("cpu", "cuda")
#: The dpkernels backends the sections time per device, in the order ``backend="auto"`` prefers
#: them; a section's target is measured on the first. (On CPU tensors Triton only interprets.)
NATIVE_BACKENDS = {"cpu": ("cpu",), "cuda": ("cuda", "triton")}


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
    device: str = "cpu"  # one of DEVICES


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


def timed_backends(device: str) -> list[str]:
    """The backends of :data:`NATIVE_BACKENDS` usable here for ``device``'s tensors."""
    usable = _backend.available_backends(device)
    return [b for b in NATIVE_BACKENDS[device] if b in usable]


def per_backend_name(label: str, backend: str) -> str:
    """A provider's name for a ``label`` timed on several backends: ``label`` itself on the cpu
    backend (the name the CPU results have always had), ``label [backend]`` on the others."""
    return label if backend == "cpu" else f"{label} [{backend}]"


def copy_provider(src: Tensor, note: str) -> Provider:
    """``dst.copy_(src)`` into a buffer filled once (so its pages are faulted in before any timing);
    bytes counted: read + written."""
    dst = torch.zeros_like(src)
    return Provider("copy", "bandwidth", call=lambda: dst.copy_(src), bytes_moved=8 * src.numel(), note=note)


def bandwidth_providers(nbytes: int, device: str = "cpu") -> list[Provider]:
    """Same-run copy and read baselines on fresh ``nbytes`` buffers on ``device``.

    The buffers are filled first so their pages are faulted in before anything is timed.
    """
    src = torch.ones(nbytes // 4, device=device)
    return [
        copy_provider(src, "dst.copy_(src)"),
        Provider("read", "bandwidth", call=lambda: torch.sum(src), bytes_moved=nbytes, note="torch.sum(src)"),
    ]


def opacus_missing() -> str | None:
    """Why the Opacus baselines cannot run (opacus is an optional ``bench`` dependency), or None."""
    try:
        from opacus.optimizers import DPOptimizer  # noqa: F401
    except ImportError as exc:
        return f"opacus not importable: {exc}"
    return None


def opacus_optimizer(
    param_shapes: Sequence[tuple[int, ...]],
    inner: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    *,
    noise_multiplier: float,
    max_grad_norm: float,
    expected_batch_size: int,
    device: str = "cpu",
):
    """``(params, DPOptimizer(inner(params)))`` on fresh zero parameters of ``param_shapes`` on ``device``.

    Call only where :func:`opacus_missing` returned None.
    """
    from opacus.optimizers import DPOptimizer

    params = [torch.nn.Parameter(torch.zeros(s, device=device)) for s in param_shapes]
    opt = DPOptimizer(
        inner(params),
        noise_multiplier=noise_multiplier,
        max_grad_norm=max_grad_norm,
        expected_batch_size=expected_batch_size,
    )
    return params, opt


def reset_opacus_grads(params: Sequence[torch.nn.Parameter], grads: Sequence[Tensor]) -> None:
    """Hand Opacus ``grads`` as fresh per-sample gradients and clear what its last step left.

    Opacus tags ``p.grad_sample`` with ``_processed`` after use and refuses to reuse it, and
    accumulates into ``p.summed_grad`` if set: give it a fresh alias (a new tensor object on the
    same storage, so the shared gradients never carry the tag) and clear the sum and ``p.grad``.
    """
    for p, g in zip(params, grads, strict=True):
        p.grad_sample = g.detach()
        p.summed_grad = None
        p.grad = None


# ----------------------------------------------------------------------------------------------
# Measurement
# ----------------------------------------------------------------------------------------------


def last_level_cache_bytes(device: str = "cpu") -> int:
    """The largest cache in front of ``device``'s memory: the CPU's from sysfs (32 MiB where sysfs
    does not say), the current GPU's L2 on ``cuda``."""
    if device == "cuda":
        return torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        m = re.fullmatch(r"(\d+)([KMG]?)", f.read_text().strip())
        if m:
            sizes.append(int(m[1]) << {"": 0, "K": 10, "M": 20, "G": 30}[m[2]])
    return max(sizes, default=32 << 20)


class CacheFlush:
    """Evicts this process's data from ``device``'s caches by reading a buffer twice their size.

    Reading (not writing) leaves the caches full of clean lines, so the next call's evictions
    cost no write-backs; the previous call's dirty lines are written back here, untimed.
    """

    def __init__(self, nbytes: int | None = None, device: str = "cpu"):
        self.buf = torch.ones((nbytes or 2 * last_level_cache_bytes(device)) // 4, device=device)

    def __call__(self) -> None:
        self.buf.sum()


_cache_flushes: dict[str, CacheFlush] = {}


def flush_caches(device: str) -> None:
    """Run ``device``'s :class:`CacheFlush`, made on first use (on ``cuda`` it only queues the read:
    the timer's ``synchronize`` waits for it before the clock starts)."""
    if device not in _cache_flushes:
        _cache_flushes[device] = CacheFlush(device=device)
    _cache_flushes[device]()


def _elapsed_cpu(call: Callable[[], object]) -> float:
    """Seconds of ``call()`` by ``time.perf_counter``."""
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0


def _elapsed_cuda(call: Callable[[], object]) -> float:
    """Seconds of ``call()`` on the GPU: CUDA events on the current stream, the device idle before
    (``synchronize``) and waited for after, so the time spans the host's launches (the GPU idles
    while they lag) through the end of the last kernel, never an asynchronous launch alone."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3  # elapsed_time is in ms


_CLOCKS = {"cpu": _elapsed_cpu, "cuda": _elapsed_cuda}


def timed_call(p: Provider, device: str = "cpu") -> float:
    """Seconds for one ``p.call()`` on ``device``, after an untimed ``p.prepare()`` and cache flush;
    garbage collector off."""
    p.prepare()
    flush_caches(device)
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _CLOCKS[device](p.call)
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
    device: str = "cpu",
) -> dict[str, dict]:
    """Warm up every provider, then run ``repeats`` rounds, each in a shuffled order, on ``device``.

    Returns, per provider name, ``times_s`` (the timed calls), ``warmup_s`` and the number of
    rounds it ran. Warm-up stops early (after ``p.min_warmup`` calls, at least 2 on ``cuda``)
    once it took ``budget_s / 4``. A provider whose steady call time × ``repeats`` exceeds ``budget_s`` runs
    in ``max(min_repeats, budget_s / call time)`` rounds instead. Under the ``"_other_cpu_cores"``
    key: the cores other processes kept busy during the rounds (:func:`other_cpu_cores`).
    """
    res = {}
    for p in providers:
        if p.skip is not None:
            continue
        res[p.name] = {"times_s": [], "warmup_s": []}
        # On a GPU the first call also loads kernels (Triton's JIT, CUDA's lazy module loading,
        # cuBLAS handles): the second shows the steady time the round plan is made from.
        min_warmup = p.min_warmup if device == "cpu" else max(p.min_warmup, 2)
        try:
            for i in range(max(warmup, min_warmup)):
                # A call that takes seconds is warm after one run; more would only cost time.
                if i >= min_warmup and sum(res[p.name]["warmup_s"]) > budget_s / 4:
                    break
                res[p.name]["warmup_s"].append(timed_call(p, device))
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
                res[p.name]["times_s"].append(timed_call(p, device))
                on_call(p, f"round {r + 1}/{repeats}")
    res["_other_cpu_cores"] = other_cpu_cores(before, cpu_snapshot())
    return res


def time_providers(
    providers: Sequence[Provider], cfg: BenchConfig, on_call: Callable[[Provider, str], None]
) -> tuple[dict[str, dict], float]:
    """:func:`time_round_robin` with ``cfg``'s repeats, warm-up, budget and device: ``(results, other cores)``."""
    res = time_round_robin(providers, cfg.repeats, cfg.warmup, cfg.budget_s, on_call=on_call, device=cfg.device)
    return res, res.pop("_other_cpu_cores")


def summary_stats(times: Sequence[float]) -> dict[str, float]:
    """``median_s``, ``min_s`` and ``iqr_s`` (interquartile range, 0 for a single time)."""
    if len(times) >= 2:
        q = statistics.quantiles(times, n=4, method="inclusive")
        iqr = q[2] - q[0]
    else:
        iqr = 0.0
    return {"median_s": statistics.median(times), "min_s": min(times), "iqr_s": iqr}
