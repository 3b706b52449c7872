"""dpkernels.integrations.opacus.accelerate: the same parameters, accountant history and ε as plain Opacus.

Noise is made identical by patching Opacus's ``_generate_noise`` (looked up at call time in each of
its optimizer modules): the plain run records what it adds to ``p.summed_grad``, the accelerated run
gets the same tensors through ``step(noise=...)``; σ = 0 cases use the engine's own (zero) noise.
"""

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("opacus")

from opacus import PrivacyEngine  # noqa: E402
from opacus.optimizers import AdaClipDPOptimizer, DPOptimizer, adaclipoptimizer  # noqa: E402
from opacus.optimizers import optimizer as opt_mod  # noqa: E402
from opacus.optimizers import optimizer_fast_gradient_clipping as ghost_mod  # noqa: E402

import dpkernels  # noqa: E402
from dpkernels.integrations.opacus import AcceleratedDPOptimizer, accelerate  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

BACKENDS = [b for b in ("cpu", "reference") if b in dpkernels.available_backends("cpu")]
SIZES = [16, 9, 16, 1, 13, 16, 7, 16, 0, 12, 16, 5]  # B = 1 and an empty Poisson batch included
N, E = 64, 16  # dataset size and expected batch size given to make_private
TOL = dict(rtol=1e-4, atol=1e-5)

INNER = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3),
    # eps=1e-6: with σ = 0 a near-zero g̃ whose sign depends on the summation order would give an O(lr) step
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, eps=1e-6),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=1e-6, weight_decay=1e-2),
}
ADACLIP = dict(
    target_unclipped_quantile=0.5, clipbound_learning_rate=0.2, max_clipbound=10.0, min_clipbound=0.05,
    unclipped_num_std=2.0,
)  # fmt: skip


class _EmbLN(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.ln = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc(self.ln(self.emb(x)).mean(dim=1))


def _model(kind):
    torch.manual_seed(0)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))
    if kind == "cnn":
        return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.AvgPool2d(2), nn.Flatten(), nn.Linear(36, 3))
    return _EmbLN()


def _batches(kind, n, allow_empty=True, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        b = SIZES[i % len(SIZES)] or (0 if allow_empty else 3)
        if kind == "mlp":
            x = torch.randn(b, 10, generator=g)
        elif kind == "cnn":
            x = torch.randn(b, 1, 8, 8, generator=g)
        else:
            x = torch.randint(0, 20, (b, 5), generator=g)
        out.append((x, torch.randint(0, 3, (b,), generator=g)))
    return out


class _Noise:
    """``_generate_noise`` in Opacus's optimizer modules: records each real step's calls, or replays them."""

    def __init__(self, monkeypatch):
        self.orig = opt_mod._generate_noise
        self.gen = torch.Generator().manual_seed(1234)
        self.steps, self.calls, self.replay = [], [], None
        for mod in (opt_mod, adaclipoptimizer, ghost_mod):
            monkeypatch.setattr(mod, "_generate_noise", self)

    def __call__(self, std, reference, generator=None, secure_mode=False):
        if self.replay is not None:
            return self.replay.pop(0)
        out = self.orig(std, reference, self.gen, secure_mode)
        self.calls.append(out.clone())
        return out

    def end_step(self):
        if self.calls:
            self.steps.append(self.calls)
        self.calls = []


def _run(kind, inner, clipping, sigma, noise, *, accelerated, backend="cpu", steps=10, micro="none",
         inject=True, sched=False, accelerate_at=0, accountant="rdp", ddp=False):  # fmt: skip
    """Train ``steps`` real steps; returns (parameters after each step, max_grad_norm after each, engine)."""
    model = _model(kind)
    if ddp:
        from opacus.distributed import DifferentiallyPrivateDistributedDataParallel

        model = DifferentiallyPrivateDistributedDataParallel(model)
    pe = PrivacyEngine(accountant=accountant)
    n_params = len(list(model.parameters()))
    ghost = clipping == "ghost"
    out = pe.make_private(
        module=model,
        optimizer=INNER[inner](model.parameters()),
        data_loader=DataLoader(TensorDataset(torch.zeros(N, 1)), batch_size=E),
        noise_multiplier=sigma,
        max_grad_norm=[0.3] * n_params if clipping == "per_layer" else 1.0,
        clipping="flat" if ghost else clipping,
        grad_sample_mode="ghost" if ghost else "hooks",
        criterion=nn.CrossEntropyLoss(),
        poisson_sampling=micro != "accum",
        **(ADACLIP if clipping == "adaptive" else {}),
    )
    gsm, opt = out[0], out[1]
    crit = out[2] if ghost else nn.CrossEntropyLoss()
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5) if sched else None
    per_step = {"none": 1, "accum": 3, "skip": 2}[micro]
    # Opacus's AdaClip fails on an empty batch (reshape of 0 elements); accelerate() refuses it (tested below)
    data = iter(_batches(kind, steps * per_step, allow_empty=clipping != "adaptive"))
    params, norms = [], []
    for t in range(steps):
        if accelerated and t == accelerate_at:
            accelerate(opt, backend=backend)
        fast = accelerated and t >= accelerate_at
        opt.zero_grad()
        for j in range(per_step):
            x, y = next(data)
            crit(gsm(x), y).backward()
            if micro == "skip" and j == 0:
                opt.signal_skip_step(True)
                opt.step()
                opt.zero_grad()
        if fast:
            # DDP: only rank 0 draws noise (Opacus and accelerate() alike); the other ranks record none
            rec = noise.steps[t] if not ddp or torch.distributed.get_rank() == 0 else []
            L = len(opt.params)
            noise.replay = list(rec[L:])  # AdaClip's count noise
            opt.step(noise=[r.clone() for r in rec[:L]] if inject and rec else None)
            assert not noise.replay
            noise.replay = None
            assert all(p.grad is None for p in opt.params)
        elif accelerated:  # plain Opacus steps of the accelerated run replay the recorded noise
            noise.replay = list(noise.steps[t]) if t < len(noise.steps) else None
            opt.step()
            noise.replay = None
        else:
            opt.step()
            noise.end_step()
        if scheduler:
            scheduler.step()
        params.append([p.detach().clone() for p in gsm.parameters()])
        norms.append(float(opt.max_grad_norm))
    return params, norms, pe, opt


def _compare(kind, inner, clipping, sigma, monkeypatch, **kw):
    noise = _Noise(monkeypatch)
    ref, ref_norms, ref_pe, _ = _run(kind, inner, clipping, sigma, noise, accelerated=False, **kw)
    got, got_norms, pe, opt = _run(kind, inner, clipping, sigma, noise, accelerated=True, inject=sigma > 0, **kw)
    for t, (a, b) in enumerate(zip(got, ref, strict=True)):
        for i, (pa, pb) in enumerate(zip(a, b, strict=True)):
            torch.testing.assert_close(pa, pb, **TOL, msg=lambda m, t=t, i=i: f"step {t}, parameter {i}: {m}")
    assert got_norms == pytest.approx(ref_norms, rel=1e-5)
    assert pe.accountant.history == ref_pe.accountant.history
    assert len(pe.accountant.history) > 0
    # the run trains (a comparison of two frozen models would pass trivially)
    init = [p.detach() for p in _model(kind).parameters()]
    assert max((a - b).abs().max().item() for a, b in zip(got[-1], init, strict=True)) > 1e-3
    return pe, ref_pe, opt


@pytest.mark.parametrize("clipping", ["flat", "per_layer", "adaptive", "ghost"])
@pytest.mark.parametrize("inner", ["sgd", "adam", "adamw"])
@pytest.mark.parametrize("sigma", [0.0, 1.0])
def test_accelerate_matches_opacus_mlp(inner, clipping, sigma, monkeypatch):
    _compare("mlp", inner, clipping, sigma, monkeypatch)


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
@pytest.mark.parametrize("inner", ["sgd", "adamw"])
@pytest.mark.parametrize("kind", ["cnn", "emb_ln"])
def test_accelerate_matches_opacus_models(kind, inner, clipping, monkeypatch):
    _compare(kind, inner, clipping, 1.0, monkeypatch)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("inner", ["sgd", "adamw"])
def test_accelerate_backends(backend, inner, monkeypatch):
    _compare("mlp", inner, "flat", 1.0, monkeypatch, backend=backend)


@pytest.mark.skipif("triton" not in dpkernels.available_backends("cpu"), reason="triton backend not available")
def test_accelerate_triton(monkeypatch):
    """One small case on the Triton backend (the interpreter on CPU is slow)."""
    _compare("mlp", "sgd", "flat", 1.0, monkeypatch, backend="triton")


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_accelerate_grad_accumulation(clipping, monkeypatch):
    """``poisson_sampling=False`` and 3 backward passes per step: ``p.grad_sample`` is a list; B = 3·E."""
    pe, _, _ = _compare("mlp", "sgd", clipping, 1.0, monkeypatch, micro="accum")
    assert all(h[1] == pytest.approx(3 * E / N) for h in pe.accountant.history)


@pytest.mark.parametrize("clipping", ["flat", "adaptive", "ghost"])
def test_accelerate_skip_steps(clipping, monkeypatch):
    """``signal_skip_step(True)`` on the first of two physical batches (what BatchMemoryManager does)."""
    _compare("mlp", "adamw", clipping, 1.0, monkeypatch, micro="skip")


def test_scheduler_before_accelerate(monkeypatch):
    """A StepLR created before accelerate() wrapped the old step: it is re-wrapped and lr follows it."""
    _, _, opt = _compare("mlp", "sgd", "flat", 1.0, monkeypatch, sched=True, accelerate_at=0)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
    assert opt._opt_called


@pytest.mark.parametrize("inner", ["sgd", "adam"])
def test_accelerate_after_plain_steps(inner, monkeypatch):
    """The wrapped optimizer's momentum buffers / Adam moments and step count are imported."""
    _compare("mlp", inner, "flat", 1.0, monkeypatch, accelerate_at=3)


@pytest.mark.parametrize("clipping", ["flat", "per_layer", "ghost"])
def test_accelerate_ddp_world1(clipping, monkeypatch, tmp_path):
    """DistributedDPOptimizer, SimpleDistributedPerLayerOptimizer and the distributed ghost-clipping optimizer
    in a one-rank gloo group."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        _, _, opt = _compare("mlp", "sgd", clipping, 1.0, monkeypatch, ddp=True)
        name = type(opt).__name__
        assert name.startswith("Accelerated") and "Distributed" in name
        # the engine's own noise (added on rank 0 before the all-reduce) also runs
        opt.zero_grad()
        for p in opt.params:  # ghost clipping reads the clipped sum from p.grad
            p.grad, p.grad_sample = torch.zeros_like(p), torch.zeros(3, *p.shape)
        before = [p.detach().clone() for p in opt.params]
        opt.step()
        assert all(not torch.equal(a, b) for a, b in zip(opt.params, before, strict=True))
    finally:
        dist.destroy_process_group()


@pytest.mark.one_cpu_path
@pytest.mark.parametrize("clipping", ["flat", "per_layer", "ghost"])
def test_accelerate_ddp_two_ranks(clipping, tmp_path):
    """Two gloo ranks, each with its own data: every rank's parameters after 10 accelerated steps equal
    plain Opacus's (noise on rank 0 only, recorded and replayed), so the all-reduce of S + ν is right."""
    worker = Path(__file__).with_name("_ddp_worker.py")
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(rank), "2", str(tmp_path / "pg"), clipping],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for rank in range(2)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0 and f"rank {rank}: equal" in out, f"rank {rank} failed:\n{out[-4000:]}"


@pytest.mark.parametrize("accountant", ["rdp", "gdp"])
def test_accounting_unchanged(accountant, monkeypatch):
    pe, ref_pe, _ = _compare("mlp", "sgd", "flat", 1.0, monkeypatch, accountant=accountant)
    eps = pe.get_epsilon(1e-5)
    assert eps == ref_pe.get_epsilon(1e-5)
    assert 0 < eps < float("inf")


def _set_grad_samples(opt, seed):
    g = torch.Generator().manual_seed(seed)
    for p in opt.params:
        p.grad_sample = torch.randn(5, *p.shape, generator=g)


def test_state_dict_roundtrip():
    """A run resumed from state_dict() continues bit-identically (state, step counter, noise seed)."""
    a = accelerate(_opacus_opt(torch.optim.AdamW), backend="cpu", seed=3)
    _set_grad_samples(a, 0)
    a.step()
    a.zero_grad()
    sd = copy.deepcopy(a.state_dict())
    assert sd["dpkernels_accelerated"] == 1
    b = accelerate(_opacus_opt(torch.optim.AdamW), backend="cpu", seed=99)
    with torch.no_grad():
        for pb, pa in zip(b.params, a.params, strict=True):
            pb.copy_(pa)
    b.load_state_dict(sd)
    for opt in (a, b):
        _set_grad_samples(opt, 1)
        opt.step()
    assert all(torch.equal(pa, pb) for pa, pb in zip(a.params, b.params, strict=True))
    assert torch.equal(a.state[a.params[0]]["exp_avg"], b.state[b.params[0]]["exp_avg"])
    with pytest.raises(ValueError, match="neither"):
        b.load_state_dict({"engine": sd["engine"]})


def test_load_plain_state_dict():
    """A plain Opacus/torch Adam state_dict (PrivacyEngine checkpoints) is imported: moments and step count."""
    plain = _opacus_opt(torch.optim.Adam)
    for seed in (0, 1):
        _set_grad_samples(plain, seed)
        plain.step()
        plain.zero_grad()
    opt = accelerate(_opacus_opt(torch.optim.Adam), backend="cpu")
    opt.load_state_dict(plain.state_dict())
    assert opt.dpkernels_engine.steps_taken == 2
    for p, q in zip(opt.params, plain.params, strict=True):
        assert torch.equal(opt.state[p]["exp_avg_sq"], plain.state[q]["exp_avg_sq"])


def _noise_step(seed, secure=False, backend="cpu"):
    """One SGD step on zero per-sample gradients: Δθ = −lr·σ·C·z/B."""
    torch.manual_seed(0)
    lin = nn.Linear(200, 100)
    before = [p.detach().clone() for p in lin.parameters()]
    opt = DPOptimizer(
        torch.optim.SGD(lin.parameters(), lr=1.0), noise_multiplier=2.0, max_grad_norm=1.0, expected_batch_size=E,
        secure_mode=secure,
    )  # fmt: skip
    accelerate(opt, backend=backend, seed=seed)
    for p in opt.params:
        p.grad_sample = torch.zeros(4, *p.shape)
    opt.step()
    return torch.cat([(p.detach() - b).flatten() for p, b in zip(lin.parameters(), before, strict=True)]), opt


@pytest.mark.parametrize("backend", BACKENDS)
def test_accelerate_noise(backend):
    d1, opt = _noise_step(7, backend=backend)
    assert opt.dpkernels_engine.rng == "philox"
    assert d1.std().item() == pytest.approx(2.0 / E, rel=0.03)
    assert abs(d1.mean().item()) < 4 * 2.0 / E / d1.numel() ** 0.5
    assert torch.equal(d1, _noise_step(7, backend=backend)[0])
    assert not torch.equal(d1, _noise_step(8, backend=backend)[0])


def test_accelerate_secure_mode():
    d, opt = _noise_step(None, secure=True)
    assert opt.dpkernels_engine.rng == "chacha20"
    assert d.std().item() == pytest.approx(2.0 / E, rel=0.03)


def _opacus_opt(inner_cls=torch.optim.SGD, opt_cls=DPOptimizer, dtype=torch.float32, **kw):
    lin = nn.Linear(4, 3).to(dtype)
    return opt_cls(inner_cls(lin.parameters(), lr=0.1, **kw), noise_multiplier=1.0, max_grad_norm=1.0,
                   expected_batch_size=E)  # fmt: skip


class _MyDPOptimizer(DPOptimizer):
    pass


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda: _opacus_opt(momentum=0.9, nesterov=True), ValueError, "nesterov"),
        (lambda: _opacus_opt(momentum=0.9, dampening=0.1), ValueError, "dampening"),
        (lambda: _opacus_opt(maximize=True), ValueError, "maximize"),
        (lambda: _opacus_opt(torch.optim.Adam, amsgrad=True), ValueError, "amsgrad"),
        (lambda: _opacus_opt(torch.optim.Adam, weight_decay=0.01), ValueError, "coupled L2"),
        (lambda: _opacus_opt(torch.optim.RMSprop), TypeError, "SGD, Adam or AdamW"),
        (lambda: _opacus_opt(dtype=torch.float16), TypeError, "float32"),
        (lambda: _opacus_opt(dtype=torch.float64), TypeError, "float32"),
        (lambda: _opacus_opt(opt_cls=_MyDPOptimizer), TypeError, "supports exactly"),
    ],
)
def test_accelerate_errors(make, exc, match):
    opt = make()
    cls = type(opt)
    with pytest.raises(exc, match=match):
        accelerate(opt, backend="cpu")
    assert type(opt) is cls  # a refused optimizer is left as it was


def test_adaclip_empty_batch_raises():
    opt = AdaClipDPOptimizer(
        torch.optim.SGD(nn.Linear(4, 3).parameters(), lr=0.1), noise_multiplier=1.0, max_grad_norm=1.0,
        expected_batch_size=E, **ADACLIP,
    )  # fmt: skip
    accelerate(opt, backend="cpu")
    for p in opt.params:
        p.grad_sample = torch.zeros(0, *p.shape)
    with pytest.raises(ValueError, match="empty batch"):
        opt.step()


def test_accelerate_errors_after():
    opt = accelerate(_opacus_opt(), backend="cpu")
    assert type(opt) is AcceleratedDPOptimizer
    with pytest.raises(ValueError, match="already accelerated"):
        accelerate(opt)
    opt.original_optimizer.param_groups[0]["params"][0].requires_grad_(False)
    for p in opt.params:
        p.grad_sample = torch.randn(2, *p.shape)
    with pytest.raises(ValueError, match="trainable parameters changed"):
        opt.step()
    opt2 = _opacus_opt()
    opt2.step = lambda *a, **k: None
    with pytest.raises(TypeError, match="instance-level step"):
        accelerate(opt2)
    with pytest.raises(RuntimeError, match="not available"):
        accelerate(_opacus_opt(), backend="cuda")


def _twin_opts(inner_cls=torch.optim.SGD, backend="cpu", seed=3, **kw):
    """Two accelerated optimizers over equal parameters and the same noise key."""
    a, b = _opacus_opt(inner_cls, **kw), _opacus_opt(inner_cls, **kw)
    with torch.no_grad():
        for pa, pb in zip(a.params, b.params, strict=True):
            pb.copy_(pa)
    return accelerate(a, backend=backend, seed=seed), accelerate(b, backend=backend, seed=seed)


@pytest.mark.parametrize("backend", BACKENDS)
def test_failed_micro_batch_leaves_accumulator(backend):
    """Gradient accumulation: a NaN in the second micro-batch raises before the first is added to
    p.summed_grad, so a retry without zero_grad() counts every micro-batch once (it used to count the
    first twice: sensitivity 2C)."""
    opt, clean = _twin_opts(backend=backend)
    g = torch.Generator().manual_seed(4)
    micro = [[torch.randn(5, *p.shape, generator=g) for p in opt.params] for _ in range(2)]
    poisoned = [t.clone() for t in micro[1]]
    poisoned[0][2, 0] = float("nan")
    for p, a, b in zip(opt.params, micro[0], poisoned, strict=True):
        p.grad_sample = [a.clone(), b]
    before = [p.detach().clone() for p in opt.params]
    with pytest.raises(ValueError, match="non-finite"):
        opt.step()
    assert all(p.summed_grad is None for p in opt.params)
    assert all(torch.equal(p, b) for p, b in zip(opt.params, before, strict=True))
    for o in (opt, clean):
        for p, a, b in zip(o.params, *micro, strict=True):
            p.grad_sample = [a.clone(), b.clone()]
        o.step()
    assert all(torch.equal(pa, pb) for pa, pb in zip(opt.params, clean.params, strict=True))
    assert opt.dpkernels_engine.steps_taken == clean.dpkernels_engine.steps_taken == 1


def test_plain_sgd_state_dict_with_seeded_key_refused():
    """A torch SGD state_dict carries no step count: resuming a seeded key from it would restart the
    counter and repeat the noise of steps 1, 2, ..., so it is refused; a fresh key is safe."""
    opt, _ = _twin_opts(momentum=0.9)
    for seed in (0, 1):
        _set_grad_samples(opt, seed)
        opt.step()
        opt.zero_grad()
    plain = opt.original_optimizer.state_dict()
    resumed = accelerate(_opacus_opt(momentum=0.9), backend="cpu", seed=3)
    with pytest.raises(ValueError, match="does not record how many steps"):
        resumed.load_state_dict(plain)
    assert resumed.dpkernels_engine.steps_taken == 0 and not resumed.original_optimizer.state
    fresh = accelerate(_opacus_opt(momentum=0.9), backend="cpu")
    fresh.load_state_dict(plain)
    assert fresh.dpkernels_engine.seed != opt.dpkernels_engine.seed


def test_accelerated_state_dict_resumes_counter():
    """The accelerated optimizer's own state_dict carries the counter: the resumed step uses step 3's noise."""
    opt, twin = _twin_opts(momentum=0.9)
    for o in (opt, twin):
        for seed in (0, 1):
            _set_grad_samples(o, seed)
            o.step()
            o.zero_grad()
    resumed = accelerate(_opacus_opt(momentum=0.9), backend="cpu", seed=3)
    with torch.no_grad():
        for p, q in zip(resumed.params, opt.params, strict=True):
            p.copy_(q)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert resumed.dpkernels_engine.steps_taken == 2
    for o in (resumed, twin):
        _set_grad_samples(o, 2)
        o.step()
    assert all(torch.equal(p, q) for p, q in zip(resumed.params, twin.params, strict=True))
