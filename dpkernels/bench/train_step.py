"""``dpkernels bench`` section ``train``: one whole private training step on real models.

Same method as the ``clip`` section, :mod:`dpkernels.bench.clip` (shuffled rounds, cache flushed
before every call, medians, the cores other processes kept busy). Per model, every provider runs
the same step, from the same initial weights on the same batch, with Adam (lr 1e-3), σ = 1,
C = 1; one step = ``zero_grad``, forward, cross-entropy, backward, ``step()``:

- **non-private**: ``torch.optim.Adam(fused=True)`` on the plain module;
- **opacus hooks**: Opacus's ``GradSampleModule`` (hooks: per-sample gradients in backward) with
  ``DPOptimizer(Adam(fused=True))`` (clip_and_accumulate, add_noise, scale_grad, step);
- **opacus ghost**: Opacus's fast gradient clipping (``grad_sample_mode="ghost"``):
  ``GradSampleModuleFastGradientClipping`` (per-sample norms without per-sample gradients for
  Linear and Embedding, from per-sample gradients dropped after use for the other layers),
  ``DPOptimizerFastGradientClipping(Adam(fused=True))`` and the criterion wrapped in
  ``DPLossFastGradientClipping``, whose ``loss.backward()`` runs two backward passes (norms, then
  the clipped sum as the gradient of the reweighted loss);
- **opacus + dpkernels**: the hooks provider's objects after
  :func:`dpkernels.integrations.opacus.accelerate` (the drop-in: same backward, fused step);
- **dpkernels bk**: book-keeping clipping, :class:`dpkernels.bk.BKModule` with
  :class:`dpkernels.optim.DPAdam`, ``step(per_sample=bk.batch())`` (one backward, no weight
  gradient for Linear/Conv2d/Embedding);
- **dpkernels bk + STP scale**: the same with :class:`dpkernels.optim.DPAdamSTP`
  (scale-then-privatize: the clip reads a dense per-coordinate scale from the preconditioner).

The dpkernels providers run on the cpu backend; on ``--device cuda`` (model, batch and optimizers
on the GPU) there is one of each per backend, ``cuda`` and ``triton``.

**Peak memory.** After the timing, each timed provider runs again in a fresh Python process
(``python -m dpkernels.bench.train_step``, :func:`measure_peak`; a few at a time). That process
builds the model and batch, builds the provider and runs one step of it, then throws that away
(what a first use leaves for good, modules imported on first call, library caches, is not the
step's memory) and takes the memory in use as its baseline. It then builds the provider afresh
(its copy of the model, wrappers, optimizer) and runs one warm-up step and two steps.
``peak_mem_mib`` is the peak during those last two steps above the baseline: the provider's whole
footprint beyond the weights and the batch (model copy, optimizer state, activations, gradients,
per-sample quantities), so an optimizer that allocates its state at construction (dpkernels) and
one that allocates it in its first step (``torch.optim.Adam``) count the same. CPU: resident set
size (``VmHWM`` after a reset through ``/proc/self/clear_refs``), with glibc's ``malloc`` told to
give every freed block above 16 KiB back to the system at once
(``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_``), so that the resident set follows live
memory and the dry run's freed memory is not reused unseen; ``cuda``: the caching allocator's
``max_memory_allocated``. The JSON also keeps the set-up, the warm-up step's peak and the memory
held between steps, all above the same baseline. A process that fails or runs past
:data:`MEMORY_TIMEOUT_S` leaves the row's memory skipped, with the reason.

Targets (:func:`target_rows`): dpkernels bk within :data:`BK_OVER_NON_PRIVATE` of non-private,
≥ 1.5× faster than the faster Opacus (hooks or ghost), bk + STP within 1.3× of bk, and bk's peak
memory within 1.3× of non-private's.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from .. import _backend
from . import _report as report
from ._timing import NATIVE_BACKENDS, SEED, BenchConfig, Provider, opacus_missing, per_backend_name, time_providers

# ----------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------


def _mlp(width: int = 1024, depth: int = 5, d_in: int = 1024, n_classes: int = 10) -> nn.Module:
    layers = []
    for i in range(depth - 1):
        layers += [nn.Linear(d_in if i == 0 else width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, n_classes))


def _cnn(widths: tuple[int, ...] = (32, 32, 64, 64, 96), groups: int = 8, n_classes: int = 10) -> nn.Module:
    def block(c_in, c_out):
        return [nn.Conv2d(c_in, c_out, 3, padding=1), nn.GroupNorm(groups, c_out), nn.ReLU()]

    w1, w2, w3, w4, w5 = widths
    return nn.Sequential(
        *block(3, w1), *block(w1, w2), nn.AvgPool2d(2), *block(w2, w3), *block(w3, w4), nn.AvgPool2d(2),
        *block(w4, w5), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(w5, n_classes),
    )  # fmt: skip


class _Block(nn.Module):
    """A pre-LN transformer block: softmax attention from Linear projections, then a GELU MLP."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.fc1, self.act, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

    def forward(self, h):
        B, T, d = h.shape
        hd = d // self.heads
        q, k, v = self.qkv(self.ln1(h)).view(B, T, 3, self.heads, hd).unbind(2)  # each [B, T, heads, hd]
        att = torch.einsum("bthe,bshe->bhts", q, k).mul(hd**-0.5).softmax(-1)
        h = h + self.proj(torch.einsum("bhts,bshe->bthe", att, v).reshape(B, T, d))
        return h + self.fc2(self.act(self.fc1(self.ln2(h))))


class _Transformer(nn.Module):
    """Token and learned position embeddings, pre-LN blocks, a final LayerNorm, a classification
    head on the mean over the sequence."""

    def __init__(self, vocab: int, d: int, heads: int, layers: int, seq_len: int, n_classes: int = 10):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq_len, d)
        self.blocks = nn.Sequential(*(_Block(d, heads) for _ in range(layers)))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, n_classes)

    def forward(self, ids):
        B, T = ids.shape
        # [B, T] position ids: every per-sample layer needs the batch dimension. Contiguous, since
        # Opacus's ghost norm of an Embedding views its ids (a stride-0 expand fails there).
        pos = torch.arange(T, device=ids.device).expand(B, T).contiguous()
        return self.head(self.ln(self.blocks(self.tok(ids) + self.pos(pos))).mean(1))


ARCHS: dict[str, Callable[..., nn.Module]] = {"mlp": _mlp, "cnn": _cnn, "transformer": _Transformer}


@dataclass(frozen=True)
class TrainModel:
    """A timed model: ``ARCHS[arch](**kwargs)`` on a batch of ``batch_size`` inputs of
    ``input_shape`` (token ids below ``vocab`` when ``vocab`` is set, else standard normal)."""

    name: str
    desc: str
    batch_size: int
    arch: str
    input_shape: tuple[int, ...]
    n_classes: int = 10
    vocab: int = 0
    kwargs: dict = field(default_factory=dict, hash=False)

    def build(self) -> nn.Module:
        return ARCHS[self.arch](**self.kwargs)

    @property
    def n_params(self) -> int:
        with torch.device("meta"):
            return sum(p.numel() for p in self.build().parameters())

    @property
    def what(self) -> str:
        return f"{self.desc}, {self.n_params:,} parameters"

    def batch(self, device: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)``, drawn on the CPU from the current generator, then moved to ``device``."""
        if self.vocab:
            x = torch.randint(0, self.vocab, (self.batch_size, *self.input_shape))
        else:
            x = torch.randn(self.batch_size, *self.input_shape)
        y = torch.randint(0, self.n_classes, (self.batch_size,))
        return x.to(device), y.to(device)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> TrainModel:
        d = json.loads(text)
        return cls(**{**d, "input_shape": tuple(d["input_shape"])})


_TRANSFORMER = dict(vocab=8192, d=192, heads=3, layers=3, seq_len=64)
MODELS = {
    "mlp": TrainModel("mlp", "5 Linear layers of 1024", 64, "mlp", (1024,)),
    "cnn": TrainModel("cnn", "5 convs + GroupNorm on 3x16x16", 32, "cnn", (3, 16, 16)),
    "transformer": TrainModel(
        "transformer", "3 pre-LN blocks d=192 (3 heads, MLP 768), vocab 8192, T=64", 32, "transformer", (64,),
        vocab=8192, kwargs=_TRANSFORMER,
    ),
}  # fmt: skip


def models(quick: bool = False) -> list[TrainModel]:
    """The models timed: all, or only the small CNN under ``--quick``."""
    return [MODELS["cnn"]] if quick else list(MODELS.values())


# ----------------------------------------------------------------------------------------------
# Providers
# ----------------------------------------------------------------------------------------------

LR = 1e-3
# STP's ε₁ has no default (it sets the clip scale, dpkernels.optim.DPAdamSTP); its value does not change the timing.
STP_EPS1 = 1e-3
NON_PRIVATE, HOOKS, GHOST, ACCEL, BK, STP = (
    "non-private", "opacus hooks", "opacus ghost", "opacus + dpkernels", "dpkernels bk", "dpkernels bk + STP scale",
)  # fmt: skip
#: Targets: dpkernels bk's time over non-private's at most this, per model.
BK_OVER_NON_PRIVATE = {"mlp": 1.4, "cnn": 2.0, "transformer": 1.3}
BK_OVER_OPACUS = 1.5  # bk at least this much faster than the faster of opacus hooks and ghost
STP_OVER_BK = 1.3
BK_PEAK_OVER_NON_PRIVATE = 1.3
MEMORY_TIMEOUT_S = 600.0  # per provider process


@dataclass
class _Built:
    """A provider's step and what clears what a step leaves behind (gradients, captures)."""

    call: Callable[[], None]
    clear: Callable[[], None]


def _specs(m: TrainModel, device: str) -> list[tuple[str, str, str, Callable[..., _Built] | str]]:
    """``(name, kind, note, build or skip reason)`` per provider, in table order; ``build(base, x, y)``
    makes the provider from its own copy of ``base``."""
    loss_fn = nn.CrossEntropyLoss()

    def plain_step(module, opt, x, y) -> _Built:
        def call() -> None:
            opt.zero_grad(set_to_none=True)
            loss_fn(module(x), y).backward()
            opt.step()

        return _Built(call, lambda: opt.zero_grad(set_to_none=True))

    def non_private(base, x, y):
        plain = copy.deepcopy(base)
        return plain_step(plain, torch.optim.Adam(plain.parameters(), lr=LR, fused=True), x, y)

    def hooks(backend: str | None):
        def build(base, x, y):
            from opacus import GradSampleModule
            from opacus.optimizers import DPOptimizer

            module = GradSampleModule(copy.deepcopy(base))
            opt = DPOptimizer(torch.optim.Adam(module.parameters(), lr=LR, fused=True), noise_multiplier=1.0,
                              max_grad_norm=1.0, expected_batch_size=m.batch_size)  # fmt: skip
            if backend is not None:
                from ..integrations.opacus import accelerate

                accelerate(opt, backend=backend, seed=SEED)
            return plain_step(module, opt, x, y)

        return build

    def ghost(base, x, y):
        from opacus.grad_sample import GradSampleModuleFastGradientClipping
        from opacus.optimizers import DPOptimizerFastGradientClipping
        from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

        module = GradSampleModuleFastGradientClipping(copy.deepcopy(base), batch_first=True, loss_reduction="mean",
                                                      max_grad_norm=1.0, use_ghost_clipping=True)  # fmt: skip
        opt = DPOptimizerFastGradientClipping(torch.optim.Adam(module.parameters(), lr=LR, fused=True),
                                              noise_multiplier=1.0, max_grad_norm=1.0,
                                              expected_batch_size=m.batch_size, loss_reduction="mean")  # fmt: skip
        criterion = DPLossFastGradientClipping(module, opt, nn.CrossEntropyLoss(), loss_reduction="mean")

        def call() -> None:
            opt.zero_grad(set_to_none=True)
            criterion(module(x), y).backward()  # two backward passes
            opt.step()

        return _Built(call, lambda: opt.zero_grad(set_to_none=True))

    def bk(cls_name: str, backend: str, **kw):
        def build(base, x, y):
            from .. import optim
            from ..bk import BKModule

            module = BKModule(copy.deepcopy(base))
            eng = getattr(optim, cls_name)(module.trainable_parameters(), lr=LR, noise_multiplier=1.0,
                                           max_grad_norm=1.0, expected_batch_size=m.batch_size, seed=SEED,
                                           backend=backend, **kw)  # fmt: skip

            def call() -> None:
                eng.zero_grad(set_to_none=True)
                loss_fn(module(x), y).backward()
                eng.step(per_sample=module.batch())

            def clear() -> None:
                eng.zero_grad(set_to_none=True)
                module.clear()

            return _Built(call, clear)

        return build

    no_opacus = opacus_missing()
    out: list = [
        (NON_PRIVATE, "baseline", "Adam(fused=True), no per-sample gradients", non_private),
        (HOOKS, "baseline", "GradSampleModule + DPOptimizer(Adam)", no_opacus or hooks(None)),
        (GHOST, "baseline", "grad_sample_mode='ghost': two backward passes", no_opacus or ghost),
    ]
    usable = _backend.available_backends(device)
    dpk = [(ACCEL, "the hooks provider after accelerate(opt)", hooks),
           (BK, "BKModule + DPAdam, step(per_sample=bk.batch())", lambda b: bk("DPAdam", b)),
           (STP, "BKModule + DPAdamSTP (scale-then-privatize)",
            lambda b: bk("DPAdamSTP", b, eps1=STP_EPS1))]  # fmt: skip
    for label, note, make in dpk:
        for b in NATIVE_BACKENDS[device]:
            name = per_backend_name(label, b)
            if b not in usable:
                out.append((name, "dpkernels", note, _backend._why_unavailable(b, device)))
            else:  # Opacus's grad samplers serve BK's norm layers: it needs Opacus too
                out.append((name, "dpkernels", note, no_opacus or make(b)))
    return out


def provider_names(device: str) -> list[str]:
    """The providers of a model's table on ``device``, in order (:func:`_specs` without building)."""
    per_backend = [per_backend_name(label, b) for label in (ACCEL, BK, STP) for b in NATIVE_BACKENDS[device]]
    return [NON_PRIVATE, HOOKS, GHOST, *per_backend]


def n_providers(device: str) -> int:
    """How many providers a model's table has on ``device`` (for a progress total)."""
    return len(provider_names(device))


def _setup(m: TrainModel, device: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The initial weights and the batch, the same on every device and in every process."""
    torch.manual_seed(SEED)  # drawn on the CPU, then moved
    base = m.build().to(device)
    x, y = m.batch(device)
    return base, x, y


def _failed(exc: BaseException) -> str:
    first_line = str(exc).splitlines()[0][:200] if str(exc) else ""
    return f"failed: {type(exc).__name__}: {first_line}"


def _providers(m: TrainModel, device: str) -> list[Provider]:
    base, x, y = _setup(m, device)
    out = []
    for name, kind, note, build in _specs(m, device):
        if isinstance(build, str):
            out.append(Provider(name, kind, skip=build))
            continue
        try:
            built = build(base, x, y)
        except Exception as exc:  # a provider that cannot be built is reported, the others timed
            out.append(Provider(name, kind, skip=_failed(exc)))
            continue
        out.append(Provider(name, kind, call=built.call, note=note))
    return out


# ----------------------------------------------------------------------------------------------
# Peak memory, one fresh process per provider
# ----------------------------------------------------------------------------------------------

_MARK = "DPK_TRAIN_MEMORY "
_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "16384", "MALLOC_TRIM_THRESHOLD_": "16384"}


def _rss() -> tuple[int, int]:
    """``(VmRSS, VmHWM)`` of this process in bytes."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS", "VmHWM")))
    return tuple(int(fields[k].split()[0]) << 10 for k in ("VmRSS", "VmHWM"))


class _Meter:
    """Memory in use and its peak since :meth:`reset`: the resident set on CPU, the caching
    allocator's allocated bytes on ``cuda``."""

    def __init__(self, device: str):
        self.device = device

    def reset(self) -> None:
        gc.collect()
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := VmRSS

    def now(self) -> int:
        gc.collect()
        if self.device == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.memory_allocated()
        return _rss()[0]

    def peak(self) -> int:
        if self.device == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        return _rss()[1]


def measure_peak(m: TrainModel, provider: str, device: str = "cpu", threads: int = 0) -> dict:
    """In this process (meant to be a fresh one): the memory of ``provider``'s step on ``m``
    (module docstring), in MiB: ``peak_mem_mib`` and the parts the JSON keeps."""
    if provider not in provider_names(device):
        raise KeyError(f"no provider {provider!r} on {device}; expected one of {provider_names(device)}")
    if threads:
        torch.set_num_threads(threads)
    build = {s[0]: s[3] for s in _specs(m, device)}[provider]
    if isinstance(build, str):
        raise RuntimeError(build)
    base, x, y = _setup(m, device)
    meter = _Meter(device)
    mib = 1 / 2**20
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        # A dry run, thrown away: what its first use leaves for good (modules imported on first
        # call, e.g. torch._dynamo by the optimizers; thread pools, BLAS and Opacus caches) is
        # not the step's memory.
        dry = build(base, x, y)
        dry.call()
        del dry
        start = meter.now()
        built = build(base, x, y)
        setup = meter.now()
        meter.reset()
        built.call()  # warm-up
        first = meter.peak()
        built.clear()
        held = meter.now()
        meter.reset()
        built.call()
        built.call()
        peak = meter.peak()
    return {"peak_mem_mib": (peak - start) * mib, "setup_mib": (setup - start) * mib,
            "first_step_peak_mib": (first - start) * mib, "held_between_steps_mib": (held - start) * mib,
            "meter": "cuda max_memory_allocated" if device == "cuda" else "VmHWM"}  # fmt: skip


def _peak_in_subprocess(m: TrainModel, provider: str, device: str, threads: int, timeout: float) -> dict:
    """:func:`measure_peak` in a fresh interpreter: its result, or ``{"skip": reason}``."""
    cmd = [sys.executable, "-m", __name__, "--model", m.to_json(), "--provider", provider, "--device", device,
           "--threads", str(threads)]  # fmt: skip
    env = {**os.environ, **_MALLOC_ENV}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"skip": f"memory process ran past {timeout:g} s"}
    except OSError as exc:
        return {"skip": _failed(exc)}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith(_MARK)]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:200]
        return {"skip": f"memory process exited {done.returncode}: {tail}"}
    return json.loads(lines[-1][len(_MARK) :])


def peak_memory(m: TrainModel, names: list[str], device: str = "cpu", threads: int = 0,
                timeout: float = MEMORY_TIMEOUT_S) -> dict[str, dict]:  # fmt: skip
    """Per provider name, :func:`measure_peak` from its own fresh process (a few at a time: memory
    is per process, and the processes start after the timing is over)."""
    workers = max(1, min(len(names), max(2, (os.cpu_count() or 1) // 2), 4))
    with ThreadPoolExecutor(workers) as pool:
        futures = {n: pool.submit(_peak_in_subprocess, m, n, device, threads, timeout) for n in names}
        return {n: f.result() for n, f in futures.items()}


def main(argv: list[str] | None = None) -> int:
    """``python -m dpkernels.bench.train_step --model JSON --provider NAME``: one provider's peak
    memory, printed as one marked JSON line."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--model", required=True, help="a TrainModel as JSON")
    ap.add_argument("--provider", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)
    res = measure_peak(TrainModel.from_json(args.model), args.provider, args.device, args.threads)
    print(_MARK + json.dumps(res), flush=True)
    return 0


# ----------------------------------------------------------------------------------------------
# The section
# ----------------------------------------------------------------------------------------------


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def target_rows(model: str, rows: dict[str, dict], device: str = "cpu") -> list[dict]:
    """The issue's targets on one model's rows: ``{what, value, threshold, op, met}`` (``met`` None
    where a provider was not measured); the dpkernels rows are those of the device's first
    native backend."""
    b = NATIVE_BACKENDS[device][0]
    get = lambda name, key: rows.get(name, {}).get(key)  # noqa: E731
    bk, stp = per_backend_name(BK, b), per_backend_name(STP, b)
    opacus = [t for t in (get(HOOKS, "median_s"), get(GHOST, "median_s")) if t is not None]
    checks = [
        (f"{bk} time ÷ non-private", get(bk, "over_non_private"), "≤", BK_OVER_NON_PRIVATE.get(model)),
        (f"min(opacus hooks, ghost) time ÷ {bk}", _ratio(min(opacus, default=None), get(bk, "median_s")), "≥",
         BK_OVER_OPACUS),
        (f"{stp} time ÷ {bk}", _ratio(get(stp, "median_s"), get(bk, "median_s")), "≤", STP_OVER_BK),
        (f"{bk} peak memory ÷ non-private", get(bk, "peak_over_non_private"), "≤", BK_PEAK_OVER_NON_PRIVATE),
    ]  # fmt: skip
    out = []
    for what, value, op, thr in checks:
        if thr is None:
            continue
        met = None if value is None else (value <= thr if op == "≤" else value >= thr)
        out.append({"what": what, "value": value, "op": op, "threshold": thr, "met": met})
    return out


def bench_train_step(model: TrainModel, cfg: BenchConfig, on_call=lambda p, phase: None, memory: bool = True) -> dict:
    """Time every provider on ``model``, then (``memory``) measure each timed one's peak memory."""
    providers = _providers(model, cfg.device)
    with warnings.catch_warnings():
        # Opacus's hooks note that the input needs no gradient: true, and nothing to act on.
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        res, other = time_providers(providers, cfg, on_call)
    rows = report.result_rows(providers, res)
    hooks_s = rows[HOOKS].get("median_s")
    base = rows[NON_PRIVATE].get("median_s")
    for r in rows.values():
        if r["status"] == "ok":
            r["over_non_private"] = _ratio(r["median_s"], base)
            if hooks_s is not None:
                r["speedup_vs_opacus"] = hooks_s / r["median_s"]  # Opacus = opacus hooks
    del providers
    gc.collect()
    if cfg.device == "cuda":
        torch.cuda.empty_cache()  # the memory processes share the GPU
    if memory:
        timed = [n for n, r in rows.items() if r["status"] == "ok"]
        for name, mem in peak_memory(model, timed, cfg.device, cfg.threads).items():
            if "skip" in mem:
                rows[name]["peak_mem_skipped"] = mem["skip"]
            else:
                rows[name].update(mem)
        base_mem = rows[NON_PRIVATE].get("peak_mem_mib")
        for r in rows.values():
            if r.get("peak_mem_mib") is not None:
                r["peak_over_non_private"] = _ratio(r["peak_mem_mib"], base_mem)
    return {"name": model.name, "what": model.what, "batch_size": model.batch_size, "n_params": model.n_params,
            "providers": list(rows.values()), "targets": target_rows(model.name, rows, cfg.device),
            "other_cpu_cores_during_timing": other}  # fmt: skip


def _mem_cell(r: dict) -> str:
    if r.get("peak_mem_skipped"):
        return "[dim]skipped[/]"
    return report.fmt(r.get("peak_mem_mib"), ".1f")


def targets_table(rec: dict):
    from rich.table import Table

    t = Table(title=f"Targets, {rec['name']}", title_justify="left")
    for col in ("target", "value", "bound", "met"):
        t.add_column(col, justify="left" if col == "target" else "right")
    for tg in rec["targets"]:
        met = {None: "[dim]not measured[/]", True: "[green]yes[/]", False: "[red]no[/]"}[tg["met"]]
        t.add_row(tg["what"], report.fmt(tg["value"], ".2f", "×"), f"{tg['op']} {tg['threshold']:g}×", met)
    return t


def train_step_table(rec: dict):
    """The provider table (time, ratios, peak memory) and the targets table of one model."""
    from rich.console import Group

    title = f"Full training step, {rec['name']}: {rec['what']}, B={rec['batch_size']}"
    table = report.provider_table(title, rec, {
        "× Opacus hooks": report.speedup_vs_opacus,
        "÷ non-private": lambda r: report.fmt(r.get("over_non_private"), ".2f"),
        "peak MiB": _mem_cell,
        "peak ÷ non-private": lambda r: report.fmt(r.get("peak_over_non_private"), ".2f"),
    })  # fmt: skip
    notes = [f"{r['name']}: peak memory {r['peak_mem_skipped']}" for r in rec["providers"] if r.get("peak_mem_skipped")]
    notes += [f"{r['name']}: {r['reason']}" for r in rec["providers"] if r.get("status") == "skipped"]
    if notes:
        table.caption = "\n".join(filter(None, [table.caption, *notes]))
    return Group(table, targets_table(rec))


if __name__ == "__main__":
    sys.exit(main())
