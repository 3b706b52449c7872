"""A run saved mid-training resumes in a new process: the same trajectory, fresh noise, the same ε.

This process trains, saves a checkpoint after step ``SAVE`` with ``torch.save`` and trains on to
step ``END`` (the uninterrupted run). One worker process (``_resume_worker.py``, started once for
every case: each start imports torch) builds fresh optimizers with another seed and other initial
parameters, loads each checkpoint with ``torch.load`` (``weights_only``, torch's default) and runs
steps ``SAVE + 1 .. END``. What only a new process shows: the checkpoint file alone carries the run
(noise counter, Philox seed, ChaCha20 key, correlated-noise buffers, the accountant's history).

- **Trajectories** (configs of ``test_optim_checkpoint.py``: BLT correlated noise, MacAdam's global
  scale, DP-SGD in secure mode), every backend and across backends: parameters and the whole
  ``state_dict`` after the resume are bit-identical to the uninterrupted run's on the same backend,
  within test_optim.py's reference-vs-fused tolerance across backends.
- **Noise** (DP-SGD with lr 1: the noise each step added is read off its update,
  ``ν_t = B·(θ_{t−1} − θ_t) − S_t``): each resumed step's ν equals the uninterrupted run's for that
  step and differs from every ν drawn before the checkpoint (a counter that restarted would add
  ``ν_1`` again).
- **make_private**: ``PrivacyEngine.save_checkpoint``/``load_checkpoint`` (Opacus's) carry module,
  optimizer and the accountant's history; ε after the resume equals the uninterrupted run's.
"""

import copy
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import test_optim_checkpoint as ck
import torch
from filelock import FileLock
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpkernels
import dpkernels.optim as optim

# Processes, checkpoints or the CLI above the kernels: the best CPU path is enough (conftest.py).
pytestmark = pytest.mark.one_cpu_path

SAVE, END = 2, 5
#: the resuming process's constructor seed: the checkpoint's must replace it
OTHER_SEED = 777
BACKENDS = ck.BACKENDS
#: case -> (test_optim_checkpoint config, extra constructor arguments)
TRAJECTORIES = {
    "adam-blt": ("adam-bc-blt", {}),  # DP-AdamBC: also its Φ̄ (state_dict()["dp"]["phi_bar"])
    "macadam": ("macadam", {}),
    "sgd-chacha20": ("sgd-momentum", {"rng": "chacha20", "secure_key": 2**255 + 12345}),
}
# Every backend to itself, and a cycle through the three across backends (each one saves and loads).
_CROSS = [("reference", "cpu"), ("cpu", "triton"), ("triton", "reference")]
PAIRS = [(b, b) for b in BACKENDS] + [(s, d) for s, d in _CROSS if s in BACKENDS and d in BACKENDS]
# Secure mode's noise is drawn before the op and passed to it as step(noise=...)'s is: the Triton op
# it reaches is the other cases' (the interpreter is slow), so it runs on reference and cpu only.
CASES = [(case, s, d) for case in TRAJECTORIES for s, d in PAIRS if case != "sgd-chacha20" or "triton" not in (s, d)]
SIGMA, DELTA = 0.7, 1e-5
MP_BACKEND = "cpu" if "cpu" in BACKENDS else "reference"
NOISE_CASES = [(b, "philox") for b in BACKENDS] + [(MP_BACKEND, "chacha20")]


# --------------------------------------------------------------------------------------------
# Trajectories
# --------------------------------------------------------------------------------------------


def _fresh_params():
    """Parameters unlike the run's: loading the checkpoint must overwrite them."""
    return [torch.randn_like(p) for p in ck._params()]


def _load_model(params, saved) -> None:
    with torch.no_grad():
        for p, s in zip(params, saved, strict=True):
            p.copy_(s)


def _result(params, opt) -> dict:
    return {"params": [p.detach().clone() for p in params], "optim": copy.deepcopy(opt.state_dict())}


def _train_trajectory(case, backend, ckpt) -> dict:
    config, extra = TRAJECTORIES[case]
    params = ck._params()
    opt = ck._make(config, backend, params, **extra)
    ck._steps(opt, params, 1, SAVE)
    torch.save({"model": [p.detach().clone() for p in params], "optim": opt.state_dict()}, ckpt)
    ck._steps(opt, params, SAVE + 1, END)
    return _result(params, opt)


def resume_trajectory(job) -> dict:
    config, extra = TRAJECTORIES[job["case"]]
    ckpt = torch.load(job["ckpt"])
    params = _fresh_params()
    if "secure_key" in extra:  # a fresh ChaCha20 key: the checkpoint's must replace it
        extra = dict(extra, secure_key=None)
    opt = ck._make(config, job["dst"], params, seed=OTHER_SEED, **extra)
    _load_model(params, ckpt["model"])
    opt.load_state_dict(ckpt["optim"])
    ck._steps(opt, params, SAVE + 1, END)
    return _result(params, opt)


def _assert_match(a, b, exact: bool, where: str = "") -> None:
    """``a`` and ``b`` (nested dicts, lists, tensors, numbers) are equal, or close across backends."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        if exact:
            assert torch.equal(a, b), where
        else:
            torch.testing.assert_close(a, b, **ck.TOL, msg=where)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            _assert_match(a[key], b[key], exact, f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_match(x, y, exact, f"{where}[{i}]")
    elif isinstance(a, float) and not exact:
        assert math.isclose(a, b, rel_tol=ck.TOL["rtol"], abs_tol=ck.TOL["atol"]), where
    else:
        assert a == b, where


# --------------------------------------------------------------------------------------------
# Noise read off the updates
# --------------------------------------------------------------------------------------------


def _noise_opt(backend, rng, seed, params):
    return optim.DPSGD(params, lr=1.0, noise_multiplier=SIGMA, max_grad_norm=1.0, expected_batch_size=ck.B,
                       seed=seed, backend=backend, rng=rng)  # fmt: skip


def _noise_steps(opt, params, t0, t1) -> list[torch.Tensor]:
    """Steps ``t0..t1``; the flat noise each added, ``ν_t = B·(θ_{t−1} − θ_t) − S_t`` (lr 1, no
    momentum: ``θ_t = θ_{t−1} − (S_t + ν_t)/B``), ``S_t`` the clipped sum."""
    flat = lambda ts: torch.cat([x.detach().flatten() for x in ts])  # noqa: E731
    out = []
    for t in range(t0, t1 + 1):
        (grads,) = ck._grad_sets(params, t)
        sums, _ = dpkernels.clip_and_accumulate(grads, 1.0, backend="reference")
        before = flat(params)
        for p, g in zip(params, grads, strict=True):
            p.grad_sample = g
        opt.step()
        out.append(ck.B * (before - flat(params)) - flat(sums))
    return out


def _train_noise(backend, rng, ckpt) -> dict:
    params = ck._params()
    opt = _noise_opt(backend, rng, ck.SEED, params)
    noise = _noise_steps(opt, params, 1, SAVE)
    torch.save({"model": [p.detach().clone() for p in params], "optim": opt.state_dict()}, ckpt)
    noise += _noise_steps(opt, params, SAVE + 1, END)
    if rng == "philox":  # the read-off is the generator's noise σ·C·z_t
        for t, nu in enumerate(noise, start=1):
            torch.testing.assert_close(nu, SIGMA * torch.cat([z.flatten() for z in opt.noise(t)]), rtol=0, atol=1e-4)
    return {"noise": noise}


def resume_noise(job) -> dict:
    ckpt = torch.load(job["ckpt"])
    params = _fresh_params()
    opt = _noise_opt(job["backend"], job["rng"], OTHER_SEED, params)
    _load_model(params, ckpt["model"])
    opt.load_state_dict(ckpt["optim"])
    return {"noise": _noise_steps(opt, params, SAVE + 1, END)}


# --------------------------------------------------------------------------------------------
# make_private: module, optimizer and accountant in one checkpoint
# --------------------------------------------------------------------------------------------


def _private(seed, init):
    from dpkernels.integrations.opacus import PrivacyEngine

    torch.manual_seed(init)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    gen = torch.Generator().manual_seed(2)
    data = TensorDataset(torch.randn(32, 5, generator=gen), torch.randint(0, 3, (32,), generator=gen))
    engine = PrivacyEngine(accountant="rdp")
    module, opt, _ = engine.make_private(
        module=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.05), data_loader=DataLoader(data, 8),
        noise_multiplier=SIGMA, max_grad_norm=1.0, algorithm="dpadam", backend=MP_BACKEND, seed=seed,
    )  # fmt: skip
    return engine, module, opt


def _private_steps(module, opt, t0, t1) -> None:
    """Fixed batches (the Poisson loader's draws are not part of the checkpoint)."""
    for t in range(t0, t1 + 1):
        gen = torch.Generator().manual_seed(100 + t)
        x, y = torch.randn(6, 5, generator=gen), torch.randint(0, 3, (6,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(module(x), y).backward()
        opt.step()


def _private_result(engine, module, opt) -> dict:
    return {
        "epsilon": engine.get_epsilon(DELTA),
        "history": list(engine.accountant.history),
        "params": [p.detach().clone() for p in module.parameters()],
        "optim": copy.deepcopy(opt.state_dict()),
    }


def _train_private(ckpt) -> dict:
    engine, module, opt = _private(seed=11, init=0)
    _private_steps(module, opt, 1, SAVE)
    engine.save_checkpoint(path=ckpt, module=module, optimizer=opt)
    at_save = engine.get_epsilon(DELTA)
    _private_steps(module, opt, SAVE + 1, END)
    return {"at_save": at_save, **_private_result(engine, module, opt)}


def resume_private(job) -> dict:
    engine, module, opt = _private(seed=None, init=1)
    engine.load_checkpoint(path=job["ckpt"], module=module, optimizer=opt)
    _private_steps(module, opt, SAVE + 1, END)
    return _private_result(engine, module, opt)


# --------------------------------------------------------------------------------------------
# One worker process for every case
# --------------------------------------------------------------------------------------------


def _selected(session) -> set:
    """The cases of this module's collected tests (``-k``, ``--cpu-kernels-only``): only those run."""
    keys = set()
    for item in session.items:
        params = item.callspec.params if item.module.__name__ == __name__ and hasattr(item, "callspec") else {}
        if "case" in params:
            keys.add((params["case"], params["src"], params["dst"]))
        elif "rng" in params:
            keys.add(("noise", params["backend"], params["rng"]))
        elif item.module.__name__ == __name__:
            keys.add("private")
    return keys


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """``(uninterrupted, resumed)``: this process's runs and the worker's results, by case."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return _run_all(tmp_path_factory.mktemp("resume"), _selected(request.session))
    # pytest-xdist spreads this module's tests over its workers: the first one here runs every case
    # (pytest-xdist's recipe for a fixture run once), the others read its results.
    shared = tmp_path_factory.getbasetemp().parent / "resume"
    with FileLock(f"{shared}.lock"):
        if not (shared / "runs.pt").is_file():
            shared.mkdir()
            torch.save(_run_all(shared, _selected(request.session)), shared / "runs.pt")
    return torch.load(shared / "runs.pt")


def _run_all(d: Path, selected: set):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the worker: the same reductions, the same rounding
    try:
        full, jobs = {}, []
        cases = [c for c in CASES if c in selected]
        for case, b in sorted({(case, b) for case, *pair in cases for b in pair}):
            full[case, b] = _train_trajectory(case, b, d / f"{case}-{b}.pt")
        for case, src, dst in cases:
            path = str(d / f"{case}-{src}.pt")
            jobs.append(dict(kind="trajectory", id=(case, src, dst), case=case, dst=dst, ckpt=path))
        for backend, rng in NOISE_CASES:
            if ("noise", backend, rng) in selected:
                path = d / f"noise-{backend}-{rng}.pt"
                full["noise", backend, rng] = _train_noise(backend, rng, path)
                jobs.append(dict(kind="noise", id=("noise", backend, rng), backend=backend, rng=rng, ckpt=str(path)))
        if "private" in selected:
            full["private"] = _train_private(d / "private.pt")
            jobs.append(dict(kind="private", id="private", ckpt=str(d / "private.pt")))
    finally:
        torch.set_num_threads(threads)
    torch.save(jobs, d / "jobs.pt")
    # The worker imports the dpkernels this process imported, whatever the install.
    root = str(Path(dpkernels.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    worker = Path(__file__).with_name("_resume_worker.py")
    proc = subprocess.run([sys.executable, str(worker), str(d / "jobs.pt"), str(d / "out.pt")],
                          env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, f"resume worker failed:\n{proc.stderr[-6000:]}"
    return full, torch.load(d / "out.pt")


def _resumed(resumed, key) -> dict:
    """The worker's result of one job; its traceback if it raised."""
    got = resumed[key]
    assert isinstance(got, dict), f"resuming {key} raised in the worker:\n{got}"
    return got


@pytest.mark.parametrize(
    "case,src,dst",
    [pytest.param(*c, id="-".join(c), marks=[] if "cpu" in c else [pytest.mark.no_cpu_kernels]) for c in CASES],
)
def test_resumed_trajectory_matches(runs, case, src, dst):
    full, resumed = runs
    got, want = _resumed(resumed, (case, src, dst)), full[case, dst]
    assert got["optim"]["dp"]["step"] == END and got["optim"]["dp"]["seed"] == want["optim"]["dp"]["seed"]
    _assert_match(got["params"], want["params"], src == dst, "params")
    _assert_match(got["optim"], want["optim"], src == dst, "optim")


@pytest.mark.parametrize("backend,rng", NOISE_CASES, ids=[f"{b}-{r}" for b, r in NOISE_CASES])
def test_noise_not_reused_after_resume(runs, backend, rng):
    full, resumed = runs
    before, after = full["noise", backend, rng]["noise"][:SAVE], full["noise", backend, rng]["noise"][SAVE:]
    got = _resumed(resumed, ("noise", backend, rng))["noise"]
    assert len(got) == len(after) == END - SAVE
    for t, (nu, want) in enumerate(zip(got, after, strict=True), start=SAVE + 1):
        for s, old in enumerate(before, start=1):
            # a reused draw differs by the read-off's rounding (~1e-6); fresh N(0, σ²) noise by ~σ
            assert (nu - old).abs().max() > 0.1 * SIGMA, f"step {t} after the resume reused the noise of step {s}"
        assert torch.equal(nu, want), f"step {t}: not the uninterrupted run's noise"


def test_make_private_resume_keeps_epsilon(runs):
    full, resumed = runs
    want, got = full["private"], _resumed(resumed, "private")
    assert got["history"] == want["history"] == [(SIGMA, 1 / 4, END)]
    assert got["epsilon"] == want["epsilon"] > want["at_save"]
    _assert_match(got["params"], want["params"], True, "params")
    _assert_match(got["optim"], want["optim"], True, "optim")
