"""The optimizers (dpkernels.optim) on every backend against the same class on backend="reference"
(the family ops of dpkernels.reference.optim).

Every optimizer, on every backend, follows the reference backend's trajectory for 20+ steps on
the same seed: random per-sample gradients (some samples clipped, some not), several tensors of
odd sizes, fp32 and bf16 parameters; parameters **and** every state buffer are compared after
every step. The noise is generated in the fused pass (Philox, independent or correlated through
BLT / banded buffers), so the two runs agree to the few-ulp differences of the Gaussians
(docs/RNG.md) and of the summation order, propagated through the steps: hence the tolerances.
"""

import math

import pytest
import torch
from torch import Tensor

import dpkernels
import dpkernels.optim as fused
import dpkernels.reference.optim as ref_optim
from dpkernels import BandedNoise, BLTNoise

SHAPES = [(3, 5), (7,), (33,), (2, 3, 4)]
B = 5
STEPS = 21
SEED = 1234

CONFIGS = {
    "sgd": ("DPSGD", dict(lr=0.1)),
    "sgd-momentum-wd": ("DPSGD", dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
    "psac": ("DPSGD", dict(lr=0.1, mode="psac", r=0.1, momentum=0.5)),
    "adam": ("DPAdam", dict(lr=1e-2)),
    "adamw-auto_s": ("DPAdam", dict(lr=1e-2, weight_decay=0.1, mode="auto_s")),
    "adam-bc": ("DPAdamBC", dict(lr=1e-2)),
    "stp": ("DPAdamSTP", dict(lr=1e-2, eps1=1e-2)),
    "macadam": ("DPMacAdam", dict(lr=1e-2, h1=1e-8, h2=10.0)),
    "macadam-bc-b2": (
        "DPMacAdam",
        dict(lr=1e-2, h1=1e-8, h2=10.0, bias_correction=True, bc_scale="b2", gamma_prime=1e-8),
    ),
    "dp2-rmsprop": ("DP2", dict(lr=0.1, lr2=0.02, s1=2, s2=3, eps=1e-2, max_grad_norm2=3.0)),
    "dp2-adagrad": ("DP2", dict(lr=0.1, lr2=0.02, s1=3, s2=2, eps=1e-2, preconditioner="adagrad")),
    "pmlf": ("DPPMLF", dict(lr=0.1)),
    "pmlf-k3-2tap": ("DPPMLF", dict(lr=0.1, k=3, beta=0.5, filter="a72b0505")),
}
NEEDS_MAX_GRAD_NORM = {"DPMacAdam": 1.0}

# (rtol, atol) on parameters and state, per parameter dtype.
TOL = {torch.float32: (2e-4, 2e-5), torch.bfloat16: (3e-2, 3e-2)}


def _mechanism(kind: str, seed: int):
    if kind == "blt":
        return BLTNoise([0.9, 0.5], [0.3, 0.1], std=1.0, seed=seed, start_step=1, backend="reference")
    if kind == "banded":
        return BandedNoise([1.0, 0.5, 0.25], std=1.0, seed=seed, start_step=1, backend="reference")
    return None


def _params(dtype, device):
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(s, generator=gen).to(device=device, dtype=dtype) for s in SHAPES]


def _grad_samples(name: str, t: int, k: int, device):
    """Per-sample gradients of step t: norms spread over [0.3, 3] so both clip branches run."""
    gen = torch.Generator().manual_seed(100 + t)
    scale = torch.linspace(0.3, 3.0, B)[torch.randperm(B, generator=gen)]
    D = sum(math.prod(s) for s in SHAPES)
    sets = []
    for _ in range(k):
        gs = [torch.randn((B, *s), generator=gen) for s in SHAPES]
        gs = [g * (scale.view(B, *[1] * len(s)) / math.sqrt(D)) for g, s in zip(gs, SHAPES, strict=True)]
        sets.append([g.to(device) for g in gs])
    return sets


def _attach(params, sets, is_list: bool):
    for idx, p in enumerate(params):
        p.grad_sample = [s[idx] for s in sets] if is_list else sets[0][idx]


def _state_views(opt, p, name: str) -> dict:
    """Every state buffer (one layout on every backend), plus MacAdam's b and PMLF's histories
    newest first."""
    views = dict(opt.state[p])
    if name == "DPMacAdam":
        views["b"] = opt.b(p)
    if name == "DPPMLF":
        views.update({key: opt.history(p, key) for key in ("m_hist", "vbar_hist", "past")})
    return views


def _run_pair(config: str, backend: str, device: str, dtype, noise_kind: str = "independent", steps: int = STEPS):
    name, kwargs = CONFIGS[config]
    kwargs = dict(kwargs)
    kwargs.setdefault("max_grad_norm", NEEDS_MAX_GRAD_NORM.get(name, 1.0))
    common = dict(noise_multiplier=0.7, expected_batch_size=B, **kwargs)
    p_ref, p_fused = _params(dtype, device), _params(dtype, device)
    mech_ref, mech_fused = _mechanism(noise_kind, SEED), _mechanism(noise_kind, SEED)
    seed_kw = {} if mech_ref is not None else {"seed": SEED}
    opt_ref = getattr(fused, name)(p_ref, correlated_noise=mech_ref, backend="reference", **seed_kw, **common)
    opt = getattr(fused, name)(p_fused, correlated_noise=mech_fused, backend=backend, **seed_kw, **common)
    k = getattr(opt_ref, "k", 1)
    is_list = name == "DPPMLF"
    rtol, atol = TOL[dtype]
    for t in range(1, steps + 1):
        for ps, opt_ in ((p_ref, opt_ref), (p_fused, opt)):
            sets = _grad_samples(name, t, k, device)
            if is_list:  # gradients at the past iterates differ from those at x_t only by the data
                sets = [[g * (1 + 0.1 * j) for g in s] for j, s in enumerate(sets)]
            _attach(ps, sets, is_list)
            opt_.step()
        for idx, (a, b) in enumerate(zip(p_fused, p_ref, strict=True)):
            torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol, msg=f"step {t} param {idx}")
            want = _state_views(opt_ref, b, name)
            got = _state_views(opt, a, name)
            for key in want:
                torch.testing.assert_close(got[key].float(), want[key].float(), rtol=rtol, atol=atol,
                                           msg=f"step {t} param {idx} state {key}")  # fmt: skip
    return opt_ref, opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_follows_reference(backend_device, config, dtype):
    backend, device = backend_device
    # The Triton interpreter takes ~0.7 ms per program instance: 11 steps there still cover two DP²
    # cycles (s1 + s2 = 5) and PMLF's k = 3 history.
    _run_pair(config, backend, device, dtype, steps=11 if (backend, device) == ("triton", "cpu") else STEPS)


@pytest.mark.parametrize("noise_kind", ["blt", "banded"])
@pytest.mark.parametrize("config", ["sgd-momentum-wd", "adam", "adam-bc", "stp", "dp2-rmsprop", "pmlf"])
def test_correlated_noise_follows_reference(backend_device, config, noise_kind):
    backend, device = backend_device
    _run_pair(config, backend, device, torch.float32, noise_kind=noise_kind, steps=8)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_resume_is_bit_identical(backend_device, config):
    """A run saved after 3 steps and resumed reproduces the uninterrupted run bit for bit."""
    backend, device = backend_device
    name, kwargs = CONFIGS[config]
    kwargs = dict(kwargs)
    kwargs.setdefault("max_grad_norm", NEEDS_MAX_GRAD_NORM.get(name, 1.0))
    common = dict(noise_multiplier=0.7, expected_batch_size=B, seed=SEED, backend=backend, **kwargs)
    cls = getattr(fused, name)
    is_list = name == "DPPMLF"

    def steps(opt, params, t0, t1):
        k = getattr(opt, "k", 1)
        for t in range(t0, t1):
            _attach(params, _grad_samples(name, t, k, device), is_list)
            opt.step()

    p_full = _params(torch.float32, device)
    full = cls(p_full, **common)
    steps(full, p_full, 1, 7)
    p_a = _params(torch.float32, device)
    a = cls(p_a, **common)
    steps(a, p_a, 1, 4)
    sd = a.state_dict()
    p_b = [p.detach().clone() for p in p_a]
    b = cls(p_b, **{**common, "seed": SEED + 1})
    b.load_state_dict(sd)
    steps(b, p_b, 4, 7)
    for x, y in zip(p_b, p_full, strict=True):
        assert torch.equal(x, y)


def test_fused_rejects_float64_and_bad_rng():
    p = [torch.zeros(3, dtype=torch.float64)]
    with pytest.raises(TypeError, match="float64 runs on backend='reference'"):
        fused.DPSGD(p, lr=0.1, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4, backend="cpu")
    with pytest.raises(ValueError, match="unknown rng"):
        fused.DPSGD([torch.zeros(3)], lr=0.1, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4,
                    rng="mt19937")  # fmt: skip


def test_chacha20_noise_matches_reference(backend_device):
    """Secure mode: the same pre-drawn ChaCha20 noise on the reference and the fused path."""
    backend, device = backend_device
    common = dict(lr=1e-2, noise_multiplier=0.7, max_grad_norm=1.0, expected_batch_size=B, seed=SEED,
                  rng="chacha20", secure_key=2**200 + 17)  # fmt: skip
    p_ref, p_fused = _params(torch.float32, device), _params(torch.float32, device)
    o_ref = fused.DPAdam(p_ref, backend="reference", **common)
    o = fused.DPAdam(p_fused, backend=backend, **common)
    for t in range(1, 4):
        for ps, opt in ((p_ref, o_ref), (p_fused, o)):
            _attach(ps, _grad_samples("DPAdam", t, 1, device), False)
            opt.step()
    for a, b in zip(p_fused, p_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_chacha20_noise_is_rounded_once(backend_device):
    """Secure mode: the noise a step adds is ``σ·C·z`` formed in float64 and rounded once to fp32,
    ``gaussian_noise(std=σ·C, rng="chacha20")`` bit for bit (read off a zero-gradient DP-SGD step
    from zero parameters, lr = 1, B = 1: ``p = 0 − (0 + ν)``, exact)."""
    backend, device = backend_device
    key, sigma = 2**255 + 99, 0.7
    params = [torch.zeros(s, device=device) for s in SHAPES]
    opt = fused.DPSGD(params, lr=1.0, noise_multiplier=sigma, max_grad_norm=1.3, expected_batch_size=1,
                      rng="chacha20", secure_key=key, backend=backend)  # fmt: skip
    for p in params:
        p.grad_sample = torch.zeros((1, *p.shape), device=device)
    opt.step()
    got = torch.cat([-p.flatten() for p in params])
    want = dpkernels.gaussian_noise(got.numel(), std=sigma * 1.3, seed=key, step=1, rng="chacha20", device=device)
    assert torch.equal(got, want)


# --------------------------------------------------------------------------------------------
# The native family ops themselves (cpu/cuda backends)
# --------------------------------------------------------------------------------------------

# hyper lists in optim_math.h struct order (csrc/ops.cpp), step t = 3 where it matters.
_SGD_HYPER = [0.2, 0.1, 0.01]
_DP2_HYPER = [0.2, 0.1, 0.0]
_ADAM_HYPER = [0.2, 1e-2, 0.9, 0.1, 0.999, 1e-3, 1 - 0.9**3, 1 - 0.999**3, 1 - 0.999**2, 1e-8, 1.0, 0.0, 0.0, 0.0, 0]
_MACADAM_HYPER = [0.2, 1e-2, 0.9, 0.1, 0.999, 1e-3, 1 - 0.9**3, 1 - 0.999**3, 1e-8, 0.01, 1e-6, 1e-8, 10.0, 0.5, 3.0,
                  1.0, 0]  # fmt: skip
# One correlated-noise buffer: y = z + 0.5 N, N <- y.
_NOISE_COEFFS = [1.0, 1.0, 0.5, 0.0, 1.0, 0.0]


def _native_only(backend):
    if backend not in ("cpu", "cuda"):
        pytest.skip("the dpkernels_C family ops are the cpu/cuda backends' kernels")


def _tensors(x) -> bool:
    """Whether an op argument is a (non-empty) tensor list."""
    return isinstance(x, list) and bool(x) and isinstance(x[0], Tensor)


def _positive(shapes, device):
    return [torch.rand(s, device=device) + 0.1 for s in shapes]


def _family_args(family: str, device: str, shapes=((5, 3), (7,)), dtypes=(torch.float32, torch.bfloat16)):
    """Positional arguments of ``family``'s op: in-pass correlated noise, every state buffer random."""
    params = [torch.randn(s, device=device).to(dt) for s, dt in zip(shapes, dtypes, strict=True)]
    sums = [torch.randn(s, device=device) for s in shapes]
    noise_state = [torch.randn(s, device=device) for s in shapes]
    tail = ([], noise_state, _NOISE_COEFFS, 0.7, 11, 3, 2, 5)
    if family == "sgd":
        momentum = [torch.randn(s, device=device) for s in shapes]
        past = [torch.empty_like(p) for p in params]
        return (params, sums, momentum, [1.0, 1.0, 0.9, 0.0, 1.0, 0.0], past, *tail, _SGD_HYPER)
    if family == "dp2":
        return (params, sums, [torch.randn(s, device=device) for s in shapes] + _positive(shapes, device), *tail,
                _DP2_HYPER)  # fmt: skip
    if family == "adam":
        return (params, sums, [torch.randn(s, device=device) for s in shapes] + _positive(shapes, device), *tail,
                _ADAM_HYPER)  # fmt: skip
    b_u = _positive(shapes, device)
    state = [torch.randn(s, device=device) for s in shapes] + _positive(shapes, device) + _positive(shapes, device)
    state += b_u + [1 / b for b in b_u] + [torch.randn(s, device=device) for s in shapes]
    return (params, sums, state, *tail, _MACADAM_HYPER)


@pytest.mark.parametrize("family", ["sgd", "dp2", "adam", "macadam"])
def test_family_op_opcheck(backend_device, family):
    """Each family op passes torch.library.opcheck (schema mutation annotations, fake kernel, AOT dispatch)."""
    backend, device = backend_device
    _native_only(backend)
    op = getattr(torch.ops.dpkernels_C, f"{family}_step_").default
    results = torch.library.opcheck(
        op, _family_args(family, device), test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static")
    )
    assert all(v == "SUCCESS" for v in results.values()), results


# Direction filters [a, g, c_k..., d_k..., e_k..., f_k...]: heavy-ball shapes (y = a x + c S, S <- e y,
# which the CPU kernel runs in one loop with the update) and others (run term by term).
_DIR_FILTERS = {
    "momentum": [1.0, 1.0, 0.9, 0.0, 1.0, 0.0],
    "heavy-ball-scaled": [0.3, 1.7, 0.9, 0.0, 0.5, 0.0],
    "one-buffer-every-term": [0.3, 1.7, 0.9, 0.2, 0.5, 0.7],
    "pmlf-two-tap": [0.5, 0.8, 0.72, 0.05, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0],
    "a0-unread-buffer": [0.0, 1.0, 0.6, 0.0, 0.9, 1.0, 0.4, 0.0, 0.0, 0.0],
}


@pytest.mark.parametrize("coeffs", _DIR_FILTERS.values(), ids=_DIR_FILTERS.keys())
def test_sgd_step_filters_match_reference_bit_for_bit(backend_device, coeffs):
    """With given sums and noise, sgd_step_ is the reference's fp32 operations bit for bit, θ and
    every buffer, whichever path the kernel takes for the direction filter. A term whose
    coefficient is 0 is not evaluated: the NaN in the buffer that no term reads stays there and
    reaches nothing."""
    backend, device = backend_device
    _native_only(backend)
    K, shapes = (len(coeffs) - 2) // 4, ((517,), (33, 7))
    g = torch.Generator().manual_seed(5)
    params, sums, noise = ([torch.randn(s, generator=g).to(device) for s in shapes] for _ in range(3))
    state = [torch.randn(s, generator=g).to(device) for _ in range(K) for s in shapes]
    if coeffs[3] == 0.0 and K == 2:  # c_1 = 0 and (d, e, f)_1 = (1, 0, 0): buffer 1 is never read
        state[len(shapes)][3] = float("nan")
    runs = []
    for step in (ref_optim.sgd_step_, torch.ops.dpkernels_C.sgd_step_):
        p, st = [t.clone() for t in params], [t.clone() for t in state]
        for _ in range(2):
            step(p, sums, st, coeffs, [], noise, [], [1.0, 1.0], 0.0, SEED, 1, 0, 0, _SGD_HYPER)
        runs.append(p + st)
    for got, want in zip(runs[1], runs[0], strict=True):
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    assert not any(t.isnan().any() for t in runs[1][: len(shapes)])


def test_macadam_sum_is_deterministic_across_threads(backend_device):
    """The Σ√ŝ reduction of the CPU macadam_step_ is bitwise the same with 1 and 2 threads (and so is the state)."""
    backend, device = backend_device
    if backend != "cpu":
        pytest.skip("thread counts are a CPU-kernel property")
    shapes = ((40000,), (123, 257), (7,))  # several tasks (16384 elements each) and an odd tail
    args = _family_args("macadam", device, shapes, (torch.float32, torch.bfloat16, torch.float32))
    threads = torch.get_num_threads()
    runs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            a = [[t.clone() for t in x] if _tensors(x) else x for x in args]
            total = torch.ops.dpkernels_C.macadam_step_(*a)
            runs.append((total, a))
    finally:
        torch.set_num_threads(threads)
    (t1, a1), (t2, a2) = runs
    assert t1.dtype == torch.float64 and t1.dim() == 0
    assert torch.equal(t1, t2)
    for x1, x2 in zip(a1, a2, strict=True):
        if _tensors(x1):
            for u, v in zip(x1, x2, strict=True):
                assert torch.equal(u, v)
    # The sum is Σ√ŝ = Σ b_u² over every updated element (b_u = ŝ^{1/4}, state slot 3).
    L = len(shapes)
    b_u = a1[2][3 * L : 4 * L]
    want = sum((b.double() ** 2).sum() for b in b_u)
    assert float(t1) > 0
    torch.testing.assert_close(t1, want, rtol=1e-5, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("family", ["sgd", "dp2", "adam", "macadam"])
def test_family_op_rounds_16bit_params_once(backend_device, family, dtype):
    """16-bit parameters: the fp32 update of the widened values, rounded once on store; the state is the fp32 run's."""
    backend, device = backend_device
    _native_only(backend)
    shapes = ((37, 5), (1000,), (3,))  # partial SIMD vectors and several chunks
    args = _family_args(family, device, shapes, (dtype,) * len(shapes))
    args32 = [[t.float() if t.dtype == dtype else t.clone() for t in x] if _tensors(x) else x for x in args]
    op = getattr(torch.ops.dpkernels_C, f"{family}_step_")
    op(*args)
    op(*args32)
    for x16, x32 in zip(args, args32, strict=True):
        if _tensors(x16):
            for u, v in zip(x16, x32, strict=True):
                assert torch.equal(u, v.to(u.dtype))


@pytest.mark.skipif("triton" not in dpkernels.available_backends("cpu"), reason="triton backend not available")
def test_triton_step_ops_reject_bad_inputs():
    """The Triton launchers validate like optim_layout.h's check_step_inputs, with a clear message."""
    from dpkernels.triton_kernels import optim as tk

    p, s = [torch.zeros(8)], [torch.zeros(8)]
    adam = [0.2, 0.01, 0.9, 0.1, 0.999, 0.001, 0.1, 0.001, 0.0, 1e-8, 1.0, 0.0, 0.0, 0.0, 0.0]
    st = [torch.zeros(8), torch.zeros(8)]
    noise = ([], [], [1.0, 1.0], 0.5, -5, 1, 0, 0)  # seed -5: a signed int64 is accepted
    with pytest.raises(ValueError, match="state must hold 2 tensors"):
        tk.adam_step_(p, s, st[:1], *noise, adam)
    with pytest.raises(TypeError, match=r"sums\[0\] has dtype torch.float16"):
        tk.adam_step_(p, [s[0].half()], st, *noise, adam)
    with pytest.raises(ValueError, match=r"params\[0\] must be contiguous"):
        tk.adam_step_([torch.zeros(4, 4).t()], [torch.zeros(16)], [torch.zeros(16)] * 2, *noise, adam)
    with pytest.raises(ValueError, match=r"sums\[0\] has 7 elements, expected 8"):
        tk.adam_step_(p, [torch.zeros(7)], st, *noise, adam)
    with pytest.raises(ValueError, match="takes 15 hyper-parameters"):
        tk.adam_step_(p, s, st, *noise, adam[:-1])
    with pytest.raises(ValueError, match=r"hyper\[14\] must be one of"):
        tk.adam_step_(p, s, st, *noise, [*adam[:-1], 3.0])
    with pytest.raises(ValueError, match="noise_std must be finite"):
        tk.adam_step_(p, s, st, [], [], [1.0, 1.0], float("nan"), 1, 1, 0, 0, adam)
    with pytest.raises(ValueError, match="pre-drawn noise cannot be combined"):
        tk.dp2_step_(p, s, st, [torch.zeros(8)], [torch.zeros(8)], [1.0, 1.0, 0.5, 1.0, 0.0, 0.0], 0.0, 1, 1, 0, 0,
                     [0.2, 0.1, 0.0])  # fmt: skip
    with pytest.raises(ValueError, match=r"dir_coeffs must hold 2 \+ 4K values"):
        tk.sgd_step_(p, s, [], [1.0], [], *noise, [0.2, 0.1, 0.0])
    with pytest.raises(TypeError, match=r"past\[0\] has dtype torch.bfloat16"):
        tk.sgd_step_(p, s, [], [1.0, 1.0], [torch.zeros(8, dtype=torch.bfloat16)], *noise, [0.2, 0.1, 0.0])
    # Valid calls run: nothing drawn with no noise (θ = −η·S/B exactly); κ = 0 returns a zero sum.
    S = torch.arange(8.0)
    theta = torch.zeros(8)
    tk.sgd_step_([theta], [S], [], [1.0, 1.0], [], [], [], [1.0, 1.0], 0.0, 1, 1, 0, 0, [0.5, 0.1, 0.0])
    assert torch.equal(theta, -(0.1 * (S * 0.5)))
    mac = [0.2, 0.01, 0.9, 0.1, 0.999, 0.001, 0.1, 0.001, 1e-8, 0.0, 1e-8, 1e-8, 10.0, 0.0, 0.0, 1.0, 0.0]
    total = tk.macadam_step_(p, s, [torch.ones(8) for _ in range(6)], *noise, mac)
    assert total.dtype == torch.float64 and total.item() == 0.0


@pytest.mark.parametrize("config", ["sgd-momentum-wd", "adamw-auto_s", "adam-bc"])
def test_step_from_sums_equals_step(backend_device, config):
    """step_from_sums(S) with S from the clip pipeline = step() on the per-sample gradients, bit for bit
    on the same backend, and it follows the reference's step_from_sums; σ, C, B are read at each call."""
    backend, device = backend_device
    name, kwargs = CONFIGS[config]
    common = dict(noise_multiplier=0.7, max_grad_norm=1.0, expected_batch_size=B, seed=SEED, **kwargs)
    mode = common.pop("mode", "clip")
    p_step, p_sums, p_ref = (_params(torch.float32, device) for _ in range(3))
    opt = getattr(fused, name)(p_step, backend=backend, mode=mode, **common)
    opt_sums = getattr(fused, name)(p_sums, backend=backend, mode=mode, **common)
    opt_ref = getattr(fused, name)(p_ref, backend="reference", mode=mode, **common)
    for t in range(1, 5):
        sets = _grad_samples(name, t, 1, device)
        _attach(p_step, sets, False)
        opt.step()
        sums, _ = dpkernels.clip_and_accumulate(
            sets[0], 1.0, mode=mode, r=None if mode == "clip" else opt.r, backend=backend
        )
        opt_sums.step_from_sums(sums, sensitivity=1.0)
        opt_ref.step_from_sums([s.cpu().to(device) for s in sums], sensitivity=1.0)
        for a, b, c in zip(p_sums, p_step, p_ref, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(a, c, rtol=2e-4, atol=2e-5)
    assert opt_sums.steps_taken == 4
    # the step parameters are attributes: a new σ·C and B take effect at the next call
    opt_sums.set_step_params(0.0, 2.0, 3)
    before = [p.clone() for p in p_sums]
    opt_sums.step_from_sums([torch.zeros_like(p) for p in p_sums], sensitivity=2.0)
    assert all(not torch.equal(a, b) for a, b in zip(p_sums, before, strict=True))  # momentum/Adam state moves


def test_step_from_sums_rejects():
    params = _params(torch.float32, "cpu")
    opt = fused.DPSGD(params, lr=0.1, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=B, backend="cpu")
    with pytest.raises(ValueError, match="list of 4 tensors"):
        opt.step_from_sums([torch.zeros(3, 5)], sensitivity=1.0)
    with pytest.raises(TypeError, match="float32"):
        opt.step_from_sums([torch.zeros_like(p, dtype=torch.float64) for p in params], sensitivity=1.0)
    with pytest.raises(ValueError, match="expected"):
        opt.step_from_sums([torch.zeros(2) for _ in params], sensitivity=1.0)
    with pytest.raises(TypeError, match="sensitivity"):  # the noise scale is never guessed
        opt.step_from_sums([torch.zeros_like(p) for p in params])
    for bad in (0.0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="sensitivity"):
            opt.step_from_sums([torch.zeros_like(p) for p in params], sensitivity=bad)
    with pytest.raises(ValueError, match="overflows float32"):
        opt.step_from_sums([torch.zeros_like(p) for p in params], sensitivity=1e39)
    with pytest.raises(ValueError, match="expected_batch_size"):
        opt.set_step_params(1.0, 1.0, 0)
    with pytest.raises(ValueError, match="max_grad_norm"):
        opt.set_step_params(1.0, 0.0, 4)
    stp = fused.DPAdamSTP(params, lr=0.1, eps1=1e-2, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=B)
    with pytest.raises(NotImplementedError, match="no step_from_sums"):
        stp.step_from_sums([torch.zeros_like(p) for p in params], sensitivity=1.0)
