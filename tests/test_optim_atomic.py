"""A DP optimizer step is all or nothing, and its checkpoints and scalars are checked.

The privacy promise of a step (each noise draw used once) holds only if a step that raises leaves
nothing behind: had it written some parameters without advancing the noise counter, a retry would
add the same noise again (two updates correlated at ~1). For every optimizer, on every backend,
and every kind of bad input, a failing step must leave the parameters, every state buffer, the
global state and the noise counter bit-identical; the corrected retry must then equal a run that
never failed. The failing step is step 3, where DP² (s1 = 2) refreshes its preconditioner.
"""

import copy
import math

import numpy as np
import pytest
import torch

import dpkernels.optim as fused
from dpkernels import BLTNoise

SHAPES = [(3, 5), (7,), (4, 2)]
B = 3
SEED = 99
# One config per optimizer class; DP² refreshes at step s1 + 1 = 3, the failing step.
CONFIGS = {
    "DPSGD": dict(lr=0.1, momentum=0.9),
    "DPAdam": dict(lr=1e-2, weight_decay=0.1),
    "DPAdamBC": dict(lr=1e-2),
    "DPAdamSTP": dict(lr=1e-2, eps1=1e-2),
    "DPMacAdam": dict(lr=1e-2, h1=1e-8, h2=10.0),
    "DP2": dict(lr=0.1, lr2=0.02, s1=2, s2=2, eps=1e-2),
    "DPPMLF": dict(lr=0.1, k=2),
}
FAILURES = ["nan", "shape", "noncontiguous", "dtype"]


def _make(name, backend, device):
    """The optimizer over three param groups, the middle one empty (torch allows it)."""
    gen = torch.Generator().manual_seed(5)
    params = [torch.randn(s, generator=gen).to(device) for s in SHAPES]
    groups = [{"params": params[:2]}, {"params": []}, {"params": params[2:]}]
    opt = getattr(fused, name)(
        groups, noise_multiplier=0.8, max_grad_norm=1.0, expected_batch_size=B, seed=SEED, backend=backend,
        **CONFIGS[name],
    )  # fmt: skip
    return opt, params


def _attach(opt, params, t, device):
    gen = torch.Generator().manual_seed(1000 + t)
    k = getattr(opt, "k", 1)
    sets = [[torch.randn((B, *p.shape), generator=gen).to(device) for p in params] for _ in range(k)]
    for idx, p in enumerate(params):
        p.grad_sample = [s[idx] for s in sets] if isinstance(opt, fused.DPPMLF) else sets[0][idx]


def _snapshot(opt, params):
    sd = opt.state_dict()
    return [p.detach().clone() for p in params], copy.deepcopy(sd["state"]), copy.deepcopy(sd["dp"])


def _assert_same(a, b):
    pa, sa, da = a
    pb, sb, db = b
    assert all(torch.equal(x, y) for x, y in zip(pa, pb, strict=True))
    assert sa.keys() == sb.keys()
    for i in sa:
        assert sa[i].keys() == sb[i].keys()
        for key in sa[i]:
            x, y = sa[i][key], sb[i][key]
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, (i, key)
    assert da == db


def _break(kind, opt, params, device):
    """Corrupt the input of the next step so that it must raise; returns the repair."""
    p = params[2]  # in the last param group: earlier groups would be written first by a partial step
    gs = p.grad_sample
    one = gs[0] if isinstance(gs, list) else gs
    if kind == "nan":
        bad = one.clone()
        bad[1].view(-1)[3] = float("nan")
    elif kind == "shape":
        bad = one[:, :, :1].contiguous()
    elif kind == "dtype":
        bad = one.double()
    else:  # a parameter whose storage became non-contiguous after the optimizer was built
        data = p.data
        p.data = data.t().contiguous().t()

        def repair():
            p.data = data

        return repair
    p.grad_sample = [bad, *gs[1:]] if isinstance(gs, list) else bad

    def repair():
        p.grad_sample = gs

    return repair


@pytest.mark.parametrize("kind", FAILURES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_failed_step_changes_nothing_and_retry_equals_clean_run(backend_device, name, kind):
    backend, device = backend_device
    if kind == "noncontiguous" and backend == "reference":
        pytest.skip("the reference backend updates non-contiguous parameters: not a failure there")
    opt, params = _make(name, backend, device)
    clean, clean_params = _make(name, backend, device)
    for t in (1, 2):
        for o, ps in ((opt, params), (clean, clean_params)):
            _attach(o, ps, t, device)
            o.step()
    _attach(opt, params, 3, device)
    before = _snapshot(opt, params)
    repair = _break(kind, opt, params, device)
    with pytest.raises((ValueError, TypeError)):
        opt.step()
    repair()
    _assert_same(_snapshot(opt, params), before)
    assert opt.steps_taken == 2
    for t in (3, 4):
        if t == 4:
            _attach(opt, params, t, device)
        opt.step()
        _attach(clean, clean_params, t, device)
        clean.step()
    _assert_same(_snapshot(opt, params), _snapshot(clean, clean_params))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_empty_param_group_steps(backend_device, name):
    """An empty param group is no group: the run equals the same optimizer without it."""
    backend, device = backend_device
    opt, params = _make(name, backend, device)
    plain_params = [p.clone() for p in params]
    plain = getattr(fused, name)(
        plain_params, noise_multiplier=0.8, max_grad_norm=1.0, expected_batch_size=B, seed=SEED, backend=backend,
        **CONFIGS[name],
    )  # fmt: skip
    for t in (1, 2, 3):
        _attach(opt, params, t, device)
        _attach(plain, plain_params, t, device)
        opt.step()
        plain.step()
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params, strict=True))
    assert opt.steps_taken == 3


def test_issue_reproducer_empty_group_noise_reuse(backend_device):
    """The report's reproducer: with an empty group the step used to write w, then fail, and the
    retry added the same noise again."""
    backend, device = backend_device
    w = torch.nn.Parameter(torch.zeros(1000, device=device))
    opt = fused.DPSGD([{"params": [w]}, {"params": []}], lr=1.0, noise_multiplier=1.0, max_grad_norm=1.0,
                      expected_batch_size=1, seed=3, backend=backend)  # fmt: skip
    moves = []
    for _ in range(2):
        before = w.detach().clone()
        w.grad_sample = torch.randn(1, 1000, device=device) * 0.01
        opt.step()
        moves.append(w.detach() - before)
    assert opt.steps_taken == 2
    corr = torch.nn.functional.cosine_similarity(moves[0], moves[1], dim=0)
    assert abs(corr.item()) < 0.2  # independent draws (1000 coordinates: |corr| ~ 0.03)


def test_dp2_failed_refresh_keeps_state(backend_device):
    """The report's DP² reproducer: a NaN at the refresh step left v (and G, inv_d) changed."""
    backend, device = backend_device
    p = torch.nn.Parameter(torch.zeros(5, device=device))
    o = fused.DP2([p], lr=0.1, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=2, s1=2, s2=2,
                  seed=1, backend=backend)  # fmt: skip
    for _ in range(2):
        p.grad_sample = torch.randn(2, 5, device=device)
        o.step()
    saved = copy.deepcopy(o.state[p])
    p.grad_sample = torch.full((2, 5), float("nan"), device=device)
    with pytest.raises(ValueError, match="non-finite"):
        o.step()
    assert saved.keys() == o.state[p].keys()
    assert all(torch.equal(saved[k], o.state[p][k]) for k in saved)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_add_param_group_checks_at_once(backend_device, name):
    """A parameter the step cannot update is refused by add_param_group, which then adds nothing."""
    backend, device = backend_device
    opt, params = _make(name, backend, device)
    bad = [torch.zeros(3, device=device, dtype=torch.int64)]
    if backend != "reference":
        bad.append(torch.zeros(4, 3, device=device).t())  # non-contiguous
        bad.append(torch.zeros(3, device=device, dtype=torch.float64))
    for q in bad:
        with pytest.raises((TypeError, ValueError), match="parameter 3"):
            opt.add_param_group({"params": [q]})
        assert len(opt.param_groups) == 3
    good = torch.zeros(6, device=device)
    opt.add_param_group({"params": [good]})
    assert opt.state[good]  # state created with the group, not by a later step
    _attach(opt, params + [good], 1, device)
    opt.step()
    assert opt.steps_taken == 1


# --------------------------------------------------------------------------------------------
# load_state_dict: checked before anything is loaded
# --------------------------------------------------------------------------------------------


def _trained(name, backend, device, steps=2):
    opt, params = _make(name, backend, device)
    for t in range(1, steps + 1):
        _attach(opt, params, t, device)
        opt.step()
    return opt, params


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda sd: sd["dp"].update(step=-5), r"\['step'\] must be an integer in \[0"),
        (lambda sd: sd["dp"].update(step=2.0), r"\['step'\] must be an integer"),
        (lambda sd: sd["dp"].update(seed=-3), r"\['seed'\] must be an integer in \[0, 2\^64\)"),
        (lambda sd: sd["dp"].update(seed=True), r"\['seed'\] must be an integer"),
        (lambda sd: sd["dp"].update({"class": "DPAdam"}), "saved by another optimizer, not a DPSGD"),
        (lambda sd: sd["dp"].pop("class"), "saved by another optimizer"),
        (lambda sd: sd["dp"].update(layout="elsewhere"), "layout"),
        (lambda sd: sd["dp"].update(layout="dpkernels-2"), r"\['layout'\] is 'dpkernels-2'"),  # a newer format
        (lambda sd: sd["dp"].pop("layout"), r"\['layout'\] is None"),
        (
            lambda sd: sd["dp"].update(secure_key=12345),
            "saved with rng='chacha20' but this optimizer draws rng='philox'",
        ),
        (lambda sd: sd["param_groups"][0]["params"].pop(), r"param groups hold \[1, 0, 1\] parameters"),
        (lambda sd: sd["state"][0].pop("momentum_buffer"), r"parameter 0 has keys \[\]"),
        (lambda sd: sd["state"][1].update(momentum_buffer=torch.zeros(3)), r"'momentum_buffer' is \(3,\)"),
        (lambda sd: sd["state"][2].update(momentum_buffer=torch.zeros(4, 2, dtype=torch.float64)), "float64"),
        (lambda sd: sd.pop("dp"), "no 'dp' entry"),
    ],
)
def test_load_state_dict_refuses_bad_fields(edit, match):
    opt, params = _trained("DPSGD", "cpu", "cpu")
    sd = copy.deepcopy(opt.state_dict())
    edit(sd)
    target, target_params = _trained("DPSGD", "cpu", "cpu", steps=1)
    before = _snapshot(target, target_params)
    with pytest.raises(ValueError, match=match):
        target.load_state_dict(sd)
    _assert_same(_snapshot(target, target_params), before)


def test_load_state_dict_refuses_other_class_and_layout(backend_device):
    backend, device = backend_device
    adam, _ = _trained("DPAdam", backend, device)
    bc, bc_params = _trained("DPAdamBC", backend, device, steps=1)
    with pytest.raises(ValueError, match="saved by another optimizer, not a DPAdamBC"):
        bc.load_state_dict(adam.state_dict())
    # Every backend keeps one layout: a MacAdam checkpoint from another backend loads (the
    # issue's reproducer failed with KeyError: 'b' at the next step) and steps; a checkpoint in
    # dpkernels 0.1's reference layout (MacAdam's b) is refused, naming the layout.
    other = "cpu" if backend == "reference" else "reference"
    mac, _ = _trained("DPMacAdam", other, device)
    target, target_params = _trained("DPMacAdam", backend, device, steps=1)
    target.load_state_dict(mac.state_dict())
    _attach(target, target_params, 3, device)
    target.step()
    assert target.steps_taken == 3
    old = copy.deepcopy(mac.state_dict())
    old["dp"]["layout"] = "reference"
    for st in old["state"].values():
        st["b"] = st.pop("b_unnorm")
    fresh, _ = _trained("DPMacAdam", backend, device, steps=1)
    with pytest.raises(ValueError, match="layout"):
        fresh.load_state_dict(old)


def _mechanism(theta=0.9):
    return BLTNoise([theta, 0.5], [0.3, 0.1], std=1.0, seed=SEED, start_step=1, backend="reference")


def _full_snapshot(opt, params):
    """Everything a load could change, tensors cloned (``_snapshot``'s ``dp`` compare needs no tensors)."""
    return copy.deepcopy(([p.detach() for p in params], opt.state_dict()))


def _assert_all_same(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, (dict, list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a.values(), b.values(), strict=True) if isinstance(a, dict) else zip(a, b, strict=True):
            _assert_all_same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize(
    "saved,target,match",
    [
        # Secure mode (rng="chacha20") must not continue on Philox, nor a Philox run on a fresh key.
        (dict(rng="chacha20"), dict(), "saved with rng='chacha20' but this optimizer draws rng='philox'"),
        (dict(), dict(rng="chacha20"), "saved with rng='philox' but this optimizer draws rng='chacha20'"),
        # The mechanism refused its state only after the optimizer's had been loaded.
        (dict(correlated_noise=0.9), dict(correlated_noise=0.8), "different mechanism parameters"),
        (dict(correlated_noise=0.9), dict(), "disagree on whether correlated_noise is used"),
    ],
    ids=["chacha20-to-philox", "philox-to-chacha20", "other-mechanism", "mechanism-to-none"],
)
def test_load_state_dict_refuses_other_noise_unchanged(saved, target, match):
    """A checkpoint of another noise generator is refused and leaves the optimizer as it was."""

    def make(kw, steps):
        kw = dict(kw)
        if "correlated_noise" in kw:
            kw["correlated_noise"] = _mechanism(kw["correlated_noise"])
        params = [torch.randn(s, generator=torch.Generator().manual_seed(5)) for s in SHAPES]
        opt = fused.DPAdam(params, lr=1e-2, noise_multiplier=0.8, max_grad_norm=1.0, expected_batch_size=B,
                           seed=None if "correlated_noise" in kw else SEED, backend="reference", **kw)  # fmt: skip
        for t in range(1, steps + 1):
            _attach(opt, params, t, "cpu")
            opt.step()
        return opt, params

    src, _ = make(saved, 3)
    dst, dst_params = make(target, 1)
    before = _full_snapshot(dst, dst_params)
    with pytest.raises(ValueError, match=match):
        dst.load_state_dict(copy.deepcopy(src.state_dict()))
    _assert_all_same(_full_snapshot(dst, dst_params), before)
    assert dst.steps_taken == 1


@pytest.mark.parametrize("name,edit", [("DPMacAdam", dict(bscale="x")), ("DPPMLF", dict(ring=None))])
def test_load_state_dict_bad_global_field_unchanged(name, edit):
    """A global field that fails to load is reported as such, and the optimizer's own is restored."""
    opt, params = _trained(name, "reference", "cpu")
    sd = copy.deepcopy(opt.state_dict())
    sd["dp"].update(edit)
    target, target_params = _trained(name, "reference", "cpu", steps=1)
    before = _snapshot(target, target_params)
    with pytest.raises(ValueError, match="invalid global field"):
        target.load_state_dict(sd)
    _assert_same(_snapshot(target, target_params), before)


def test_resumed_counter_continues(backend_device):
    """A loaded state_dict continues the noise counter: no draw of steps 1..3 is used again."""
    backend, device = backend_device
    opt, params = _trained("DPSGD", backend, device, steps=3)
    fresh, fresh_params = _make("DPSGD", backend, device)
    fresh.load_state_dict(opt.state_dict())
    assert fresh.steps_taken == 3 and fresh.seed == opt.seed


# --------------------------------------------------------------------------------------------
# Scalars of any numeric type; mistakes named on every backend
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value", [np.float64(0.8), np.float32(0.8), torch.tensor(0.8, dtype=torch.float64)], ids=["np64", "np32", "0d"]
)
def test_numeric_scalars_accepted(value):
    """σ given as a NumPy scalar or a 0-d tensor is the same σ as the Python float."""
    outs = []
    for sigma in (float(value), value):
        gen = torch.Generator().manual_seed(1)
        p = torch.randn(10, generator=gen)
        opt = fused.DPSGD([p], lr=0.1, noise_multiplier=sigma, max_grad_norm=np.float32(1.0),
                          expected_batch_size=np.int64(B), seed=np.uint64(5), backend="cpu")  # fmt: skip
        p.grad_sample = torch.randn(B, 10, generator=gen)
        opt.step()
        outs.append(p)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(noise_multiplier=True), "noise_multiplier must be a real number"),
        (dict(noise_multiplier=np.bool_(True)), "noise_multiplier must be a real number"),
        (dict(noise_multiplier=torch.tensor(True)), "noise_multiplier must be a real number"),
        (dict(max_grad_norm=float("inf")), "max_grad_norm must be a finite number"),
        (dict(noise_multiplier=1e30, max_grad_norm=1e10), "overflows float32"),
        (dict(expected_batch_size=0), r"expected_batch_size must be an integer in \[1"),
        (dict(expected_batch_size=2.0), "expected_batch_size must be an integer"),
        (dict(seed=-1), r"seed must be an integer in \[0, 2\^64\)"),
        (dict(seed=1.0), "seed must be an integer"),
    ],
)
def test_bad_scalars_refused(backend_device, kwargs, match):
    backend, device = backend_device
    args = dict(lr=0.1, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=B, seed=1, backend=backend)
    with pytest.raises(ValueError, match=match):
        fused.DPSGD([torch.zeros(3, device=device)], **{**args, **kwargs})


def test_dp2_second_bound_overflow_refused():
    with pytest.raises(ValueError, match=r"max_grad_norm2 = .* overflows float32"):
        fused.DP2([torch.zeros(3)], lr=0.1, noise_multiplier=1e30, max_grad_norm=1.0, max_grad_norm2=1e10,
                  expected_batch_size=B, s1=1, s2=1, backend="cpu")  # fmt: skip


@pytest.mark.parametrize("name", ["DPSGD", "DPPMLF"])
def test_float64_grad_sample_names_the_parameter(backend_device, name):
    """fp64 per-sample gradients for fp32 parameters: one message, naming the parameter, everywhere."""
    backend, device = backend_device
    opt, params = _make(name, backend, device)
    _attach(opt, params, 1, device)
    gs = params[1].grad_sample
    params[1].grad_sample = [g.double() for g in gs] if isinstance(gs, list) else gs.double()
    with pytest.raises(TypeError, match=r"parameter 1 \(shape \(7,\)\): grad_sample(\[0\])? is float64"):
        opt.step()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_zero_dim_parameter(backend_device, name):
    """A 0-d parameter (a scalar gain) among others: every backend follows the reference."""
    backend, device = backend_device
    gen = torch.Generator().manual_seed(2)
    init = [torch.randn(s, generator=gen) for s in [(), (4,), (2, 3)]]
    kw = dict(noise_multiplier=0.5, max_grad_norm=1.0, expected_batch_size=B, seed=SEED, **CONFIGS[name])
    p_ref = [x.clone().to(device) for x in init]
    p_bk = [x.clone().to(device) for x in init]
    opt_ref = getattr(fused, name)(p_ref, backend="reference", **kw)
    opt = getattr(fused, name)(p_bk, backend=backend, **kw)
    for t in (1, 2, 3):
        _attach(opt_ref, p_ref, t, device)
        _attach(opt, p_bk, t, device)
        opt_ref.step()
        opt.step()
    for a, b in zip(p_bk, p_ref, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-5)
        assert not math.isnan(a.sum().item())
