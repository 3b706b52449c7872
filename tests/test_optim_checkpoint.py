"""A checkpoint saved on one backend loads on every other, and the run continues.

Every optimizer keeps one state layout on every backend (dpkernels/optim/_base.py ``LAYOUT``), so
the issue's reproducer (a DP-MacAdam checkpoint saved on ``cpu`` loaded on ``reference`` and failed
at the next step with ``KeyError: 'b'``) cannot recur. For each optimizer (with correlated noise,
PMLF's ring histories, DP² across a refresh, MacAdam with κ > 0) and each pair of backends
(A, B): steps 1–3 on A, save model and optimizer, load into a fresh optimizer on B whose
parameters and state were poisoned with NaN, steps 4–7 on B; compare with an uninterrupted run on
B: bit-identical for A = B, within test_optim.py's reference-vs-fused tolerance otherwise.
"""

import copy
import math

import pytest
import torch

import dpkernels
import dpkernels.optim as optim
from dpkernels import BLTNoise

SHAPES = [(3, 5), (7,)]
B = 3
SEED = 4321
SAVE_AFTER, STEPS = 3, 7
TOL = dict(rtol=2e-4, atol=2e-5)  # tests/test_optim.py, fp32
BACKENDS = [b for b in ("reference", "cpu", "triton") if b in dpkernels.available_backends("cpu")]

CONFIGS = {
    "sgd-momentum": ("DPSGD", dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
    "psac": ("DPSGD", dict(lr=0.1, mode="psac", r=0.1)),
    "adam-blt": ("DPAdam", dict(lr=1e-2, weight_decay=0.1)),
    # DP-AdamBC with BLT noise: Φ̄ from the mechanism, saved in "dp" (independent noise: test_optim.py)
    "adam-bc-blt": ("DPAdamBC", dict(lr=1e-2, weight_decay=0.1)),
    "stp": ("DPAdamSTP", dict(lr=1e-2, eps1=1e-2)),
    "macadam": ("DPMacAdam", dict(lr=1e-2, h1=1e-8, h2=10.0)),
    "dp2": ("DP2", dict(lr=0.1, lr2=0.02, s1=2, s2=2, eps=1e-2)),  # refreshes at steps 3 and 7
    "pmlf": ("DPPMLF", dict(lr=0.1, k=2, filter="a72b0505")),  # rings of 2 m's and 1 v̄, 1 past iterate
}


def _make(config, backend, params, seed=SEED, **extra):
    """``config``'s optimizer on ``backend``; ``extra``: more constructor arguments (``rng=``)."""
    name, kw = CONFIGS[config]
    kw = dict(kw, noise_multiplier=0.7, max_grad_norm=1.0, expected_batch_size=B, backend=backend, **extra)
    if config.endswith("-blt"):
        kw["correlated_noise"] = BLTNoise([0.9, 0.5], [0.3, 0.1], std=1.0, seed=seed, start_step=1,
                                          backend="reference")  # fmt: skip
    else:
        kw["seed"] = seed
    return getattr(optim, name)(params, **kw)


def _params():
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def _grad_sets(params, t, k=1):
    """Step ``t``'s ``k`` per-sample gradient sets: norms from 0.3 to 3 (some clipped at C = 1)."""
    gen = torch.Generator().manual_seed(50 + t)
    scale = torch.linspace(0.3, 3.0, B) / math.sqrt(sum(p.numel() for p in params))
    return [[torch.randn((B, *p.shape), generator=gen) * scale.view(B, *[1] * p.dim()) for p in params]
            for _ in range(k)]  # fmt: skip


def _steps(opt, params, t0, t1):
    for t in range(t0, t1 + 1):
        sets = _grad_sets(params, t, getattr(opt, "k", 1))
        for idx, p in enumerate(params):
            p.grad_sample = [s[idx] for s in sets] if isinstance(opt, optim.DPPMLF) else sets[0][idx]
        opt.step()


def _poison(opt, params):
    """NaN in every parameter and state tensor, and in the global state: what loading must overwrite."""
    with torch.no_grad():
        for p in params:
            p.fill_(float("nan"))
        for st in opt.state.values():
            for v in st.values():
                v.fill_(float("nan"))
    if isinstance(opt, optim.DPMacAdam):
        opt.bscale = float("nan")
    if isinstance(opt, optim.DPPMLF):
        opt._c_hist, opt._ring = [float("nan")] * len(opt.filter_a), 12345


@pytest.mark.parametrize("dst", BACKENDS)
@pytest.mark.parametrize("src", BACKENDS)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_checkpoint_moves_between_backends(config, src, dst):
    p_full = _params()
    full = _make(config, dst, p_full)
    _steps(full, p_full, 1, STEPS)

    p_src = _params()
    opt_src = _make(config, src, p_src)
    _steps(opt_src, p_src, 1, SAVE_AFTER)
    ckpt = copy.deepcopy({"model": [p.detach().clone() for p in p_src], "optim": opt_src.state_dict()})
    assert ckpt["optim"]["dp"]["layout"] == optim.LAYOUT

    p_dst = _params()
    opt_dst = _make(config, dst, p_dst)
    _poison(opt_dst, p_dst)
    with torch.no_grad():
        for p, saved in zip(p_dst, ckpt["model"], strict=True):
            p.copy_(saved)
    opt_dst.load_state_dict(ckpt["optim"])
    assert opt_dst.steps_taken == SAVE_AFTER and opt_dst.seed == opt_src.seed
    for p in p_dst:
        assert all(not v.isnan().any() for v in opt_dst.state[p].values())
    plain = lambda dp: {k: v for k, v in dp.items() if k != "correlated_noise"}  # noqa: E731  (tensors)
    assert plain(opt_dst.state_dict()["dp"]) == plain(ckpt["optim"]["dp"])
    _steps(opt_dst, p_dst, SAVE_AFTER + 1, STEPS)

    assert opt_dst.steps_taken == full.steps_taken == STEPS
    for idx, (a, b) in enumerate(zip(p_dst, p_full, strict=True)):
        if src == dst:
            assert torch.equal(a, b), idx
        else:
            torch.testing.assert_close(a, b, **TOL, msg=f"param {idx}")
        sa, sb = opt_dst.state[a], full.state[b]
        assert sa.keys() == sb.keys()
        for key in sa:
            if src == dst:
                assert torch.equal(sa[key], sb[key]), key
            else:
                torch.testing.assert_close(sa[key], sb[key], **TOL, msg=f"param {idx} state {key}")


def test_issue_reproducer_macadam_cpu_to_reference():
    """The issue's report: a DPMacAdam checkpoint saved on cpu loads on reference and steps."""
    if "cpu" not in BACKENDS:
        pytest.skip("needs the cpu backend")
    p_cpu, p_ref = _params(), _params()
    cpu = _make("macadam", "cpu", p_cpu)
    _steps(cpu, p_cpu, 1, 3)
    ref = _make("macadam", "reference", p_ref)
    with torch.no_grad():
        for p, q in zip(p_ref, p_cpu, strict=True):
            p.copy_(q)
    ref.load_state_dict(cpu.state_dict())
    _steps(ref, p_ref, 4, 5)
    _steps(cpu, p_cpu, 4, 5)
    for a, b in zip(p_ref, p_cpu, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    for p, q in zip(p_ref, p_cpu, strict=True):
        torch.testing.assert_close(ref.b(p), cpu.b(q), **TOL)
