"""dpkernels.integrations._make_private: the dpkernels optimizers inside Opacus's machinery.

Accounting equals Opacus's for every algorithm, correlated noise refuses ε, every algorithm trains,
the glue (batch divisor, σ, C, parameter order, PMLF's recomputed past gradients) matches a
hand-written loop over the reference optimizer, and bad configurations raise before Opacus runs.
"""

import copy
import math

import pytest
import torch
from opacus import PrivacyEngine as OpacusPrivacyEngine
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.data import DataLoader, TensorDataset

from dpkernels import BandedNoise
from dpkernels import optim as dpk_optim
from dpkernels.integrations._make_private import (
    ALGORITHMS,
    CorrelatedNoiseAccountant,
    DPKernelsOptimizer,
    PrivacyEngine,
    make_private,
)
from dpkernels.pmlf import pmlf_grad_samples

pytestmark = [
    pytest.mark.filterwarnings("ignore:Secure RNG turned off"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.usefixtures("one_thread"),
]

SIGMA, C, DELTA = 1.1, 1.0, 1e-5
# Hyper-parameters per algorithm: torch optimizer factory and algorithm keyword arguments.
SETUPS = {
    "dpsgd": (lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.5), {}),
    "psac": (lambda ps: torch.optim.SGD(ps, lr=0.5), {"r": 0.1}),
    "dp2": (lambda ps: torch.optim.SGD(ps, lr=0.5), {"s1": 4, "s2": 4, "lr2": 0.05}),
    "pmlf": (lambda ps: torch.optim.SGD(ps, lr=0.5), {"k": 2}),
    "dpadam": (lambda ps: torch.optim.Adam(ps, lr=0.02), {}),
    "dpadam_bc": (lambda ps: torch.optim.AdamW(ps, lr=0.002, weight_decay=0.0), {}),
    "stp": (lambda ps: torch.optim.Adam(ps, lr=0.02), {"eps1": 1e-3}),
    "macadam": (lambda ps: torch.optim.Adam(ps, lr=0.004), {}),
}


def _data(n=256, d=10, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    teacher = torch.randn(d, classes, generator=g)
    return TensorDataset(x, (x @ teacher).argmax(dim=1))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))


def _private(algorithm, *, steps, engine=None, batch_size=32, sigma=SIGMA, backend="cpu", seed=7, **kw):
    """Train ``steps`` Poisson steps through make_private; returns (module, optimizer, engine, losses)."""
    engine = engine or PrivacyEngine(accountant="rdp")
    model = _model()
    make_opt, algo_kwargs = SETUPS[algorithm]
    ds = _data()
    module, opt, loader = engine.make_private(
        module=model,
        optimizer=make_opt(model.parameters()),
        data_loader=DataLoader(ds, batch_size=batch_size),
        noise_multiplier=sigma,
        max_grad_norm=C,
        algorithm=algorithm,
        backend=backend,
        seed=seed,
        **{**algo_kwargs, **kw},
    )
    losses, done = [], 0
    while done < steps:
        for x, y in loader:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(module(x), y)
            loss.backward()
            opt.step(batch=(x, y)) if algorithm == "pmlf" else opt.step()
            losses.append(loss.item())
            done += 1
            if done == steps:
                break
    return module, opt, engine, losses


def _full_loss(module):
    x, y = _data().tensors
    with torch.no_grad():
        return nn.functional.cross_entropy(module(x), y).item()


@pytest.fixture(scope="module")
def opacus_epsilon():
    """ε and accountant history of plain Opacus DP-SGD: σ, q = 1/8, 5 steps."""
    pe = OpacusPrivacyEngine(accountant="rdp")
    model = _model()
    module, opt, loader = pe.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_data(), batch_size=32),
        noise_multiplier=SIGMA,
        max_grad_norm=C,
    )
    for step, (x, y) in enumerate(loader):
        opt.zero_grad()
        nn.functional.cross_entropy(module(x), y).backward()
        opt.step()
        if step == 4:
            break
    return pe.get_epsilon(DELTA), list(pe.accountant.history)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_accounting_equals_opacus(algorithm, opacus_epsilon):
    eps_opacus, history_opacus = opacus_epsilon
    module, opt, pe, _ = _private(algorithm, steps=5)
    assert isinstance(opt, DPKernelsOptimizer)
    assert history_opacus == [(SIGMA, 1 / 8, 5)]
    assert pe.accountant.history == history_opacus
    eps = pe.get_epsilon(DELTA)
    assert eps == eps_opacus
    assert math.isfinite(eps) and eps > 0
    assert opt.engine.steps_taken == 5


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_training_loss_decreases(algorithm):
    before = _full_loss(_model())
    module, opt, _, losses = _private(algorithm, steps=40, sigma=0.5)
    after = _full_loss(module)
    assert all(math.isfinite(v) for v in losses)
    assert after < 0.9 * before, (algorithm, before, after)
    for p in module.parameters():  # no non-private p.grad is left behind after a step
        assert p.grad is None


def test_correlated_noise_refuses_epsilon():
    pe = PrivacyEngine(accountant="rdp")
    mech = BandedNoise([1.0, 0.5], std=1.0, seed=11, start_step=1, backend="cpu")
    module, opt, _, losses = _private("dpsgd", steps=3, engine=pe, seed=11, correlated_noise=mech)
    assert isinstance(pe.accountant, CorrelatedNoiseAccountant)
    assert len(pe.accountant) == 3
    assert pe.accountant.history == [(SIGMA, 1 / 8, 3)]
    with pytest.raises(NotImplementedError, match="dp-accounting has no matrix-factorisation"):
        pe.get_epsilon(DELTA)
    with pytest.raises(NotImplementedError, match="correlated noise"):
        pe.accountant.get_epsilon(DELTA)
    assert opt.engine.correlated_noise is mech and mech.next_step == 4


def _fixed_batches(n_steps=6, batch=16):
    x, y = _data().tensors
    return [(x[i * batch : (i + 1) * batch], y[i * batch : (i + 1) * batch]) for i in range(n_steps)]


@pytest.mark.parametrize("algorithm", ["dpsgd", "psac", "stp", "macadam", "dp2", "pmlf"])
def test_matches_hand_loop(algorithm):
    """make_private on backend 'reference' against GradSampleModule + the reference optimizer by hand
    (same seed: the same Philox noise): checks E, σ, C, hyper-parameter mapping and, for PMLF, the
    recomputed per-sample gradients at the past iterate with the capture hooks off."""
    make_opt, algo_kwargs = SETUPS[algorithm]
    batches = _fixed_batches()
    model = _model()
    hand = copy.deepcopy(model)
    pe = PrivacyEngine(accountant="rdp")
    module, opt, _ = pe.make_private(
        module=model,
        optimizer=make_opt(model.parameters()),
        data_loader=DataLoader(_data(), batch_size=16),
        noise_multiplier=SIGMA,
        max_grad_norm=C,
        poisson_sampling=False,
        algorithm=algorithm,
        backend="reference",
        seed=5,
        **algo_kwargs,
    )
    assert opt.expected_batch_size == 16
    torch_opt = make_opt(hand.parameters())
    g = torch_opt.param_groups[0]
    common = dict(noise_multiplier=SIGMA, max_grad_norm=C, expected_batch_size=16, seed=5, backend="reference")
    if algorithm in ("dpsgd", "psac"):
        extra = {"mode": "psac", "r": 0.1} if algorithm == "psac" else {}
        ref = dpk_optim.DPSGD(hand.parameters(), g["lr"], momentum=g["momentum"], **common, **extra)
    elif algorithm == "stp":
        ref = dpk_optim.DPAdamSTP(hand.parameters(), g["lr"], betas=g["betas"], eps2=g["eps"], **common, **algo_kwargs)
    elif algorithm == "macadam":
        ref = dpk_optim.DPMacAdam(hand.parameters(), g["lr"], betas=g["betas"], eps=g["eps"], **common)
    elif algorithm == "dp2":
        ref = dpk_optim.DP2(hand.parameters(), g["lr"], **common, **algo_kwargs)
    else:
        ref = dpk_optim.DPPMLF(hand.parameters(), g["lr"], **common, **algo_kwargs)
    for x, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(module(x), y).backward()
        opt.step(batch=(x, y)) if algorithm == "pmlf" else opt.step()

        if algorithm == "pmlf":
            sets = pmlf_grad_samples(hand, nn.functional.cross_entropy, x, y, ref.past_params())
        else:
            sets = pmlf_grad_samples(hand, nn.functional.cross_entropy, x, y)
        for p, s in zip(hand.parameters(), sets, strict=True):
            p.grad_sample = s if algorithm == "pmlf" else s[0]
        ref.step()
    for p, q in zip(module._module.parameters(), hand.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert pe.accountant.history == [(SIGMA, 1 / 16, len(batches))]


def _args(**over):
    model = _model()
    args = dict(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_data(), batch_size=32),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    args.update(over)
    if "optimizer" in over and callable(over["optimizer"]):
        args["optimizer"] = over["optimizer"](model.parameters())
    return args


@pytest.mark.parametrize(
    "over, exc, match",
    [
        (dict(algorithm="adamw"), ValueError, "unknown algorithm 'adamw'"),
        (dict(algorithm="dpsgd", k=2), TypeError, "unexpected keyword argument"),
        (dict(algorithm="dpsgd", mode="bogus"), ValueError, "unknown clip mode"),
        (dict(algorithm="dp2"), TypeError, r"needs keyword argument\(s\) \['s1', 's2'\]"),
        (dict(algorithm="dpsgd", optimizer=lambda ps: torch.optim.Adam(ps)), TypeError, "use algorithm='dpadam'"),
        (dict(algorithm="dpadam"), TypeError, "torch.optim.Adam or AdamW"),
        (dict(algorithm="dpadam", optimizer=lambda ps: torch.optim.Adam(ps, weight_decay=0.1)), ValueError, "AdamW"),
        (dict(algorithm="macadam", optimizer=lambda ps: torch.optim.AdamW(ps)), ValueError, "no weight decay"),
        (
            dict(algorithm="pmlf", optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
            ValueError,
            "momentum",
        ),
        (dict(clipping="per_layer", max_grad_norm=[1.0] * 4), NotImplementedError, "clipping"),
        (dict(grad_sample_mode="ghost"), NotImplementedError, "grad_sample_mode"),
        (dict(algorithm="stp", optimizer=lambda ps: torch.optim.Adam(ps), eps1=-1.0), ValueError, "eps1"),
        (
            dict(algorithm="stp", optimizer=lambda ps: torch.optim.Adam(ps)),
            TypeError,
            "'stp' needs keyword argument\\(s\\) \\['eps1'\\]: .*per-sample norm at max_grad_norm·eps1",
        ),
        (dict(correlated_noise=object()), TypeError, "BLTNoise or BandedNoise"),
        (
            dict(
                algorithm="macadam",
                optimizer=lambda ps: torch.optim.Adam(ps, lr=0.004),
                correlated_noise=BandedNoise([1.0, 0.5], std=1.0, start_step=1),
            ),
            ValueError,
            "'macadam' does not support correlated_noise",
        ),
    ],
)
def test_bad_configuration_raises_before_opacus(over, exc, match):
    args = _args(**over)
    model = args["module"]
    with pytest.raises(exc, match=match):
        make_private(PrivacyEngine(), **args)
    assert not any(m._forward_hooks for m in model.modules())  # Opacus never hooked the module


def test_pmlf_step_needs_the_batch_and_skip_step_refused():
    model = _model()
    pe = PrivacyEngine()
    module, opt, loader = pe.make_private(
        **_args(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)), algorithm="pmlf"
    )
    x, y = next(iter(_fixed_batches()))
    nn.functional.cross_entropy(module(x), y).backward()
    with pytest.raises(ValueError, match=r"step\(batch=\(inputs, targets\)\)"):
        opt.step()
    with pytest.raises(NotImplementedError, match="BatchMemoryManager"):
        opt.signal_skip_step(True)
    assert len(pe.accountant) == 0


def test_seed_determinism_and_lr_scheduler():
    """The same seed gives the same run, another seed a different one; an LR scheduler on the returned
    optimizer drives the engine's lr (Opacus forwards param_groups to it)."""

    def run(seed):
        torch.manual_seed(123)  # the same Poisson batches in every run
        model = _model()
        module, opt, loader = PrivacyEngine().make_private(
            **_args(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5)), seed=seed, backend="cpu"
        )
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(module(x), y).backward()
            opt.step()
            sched.step()
        assert opt.engine.param_groups[0]["lr"] == 0.5 * 0.5 ** len(loader)
        return [p.detach().clone() for p in module.parameters()]

    a, b, c = run(1), run(1), run(2)
    for pa, pb, pc in zip(a, b, c, strict=True):
        assert torch.equal(pa, pb)
        assert not torch.equal(pa, pc)


def test_gradient_accumulation_list():
    """Without Poisson sampling, two backward passes per step make p.grad_sample a list: the engine sees
    the concatenation, divided by 2E as Opacus does, and the accountant records q·2 (Opacus's rule)."""
    batches = _fixed_batches(n_steps=6, batch=16)
    model = _model()
    hand = copy.deepcopy(model)
    pe = PrivacyEngine(accountant="rdp")
    module, opt, _ = pe.make_private(
        **_args(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            data_loader=DataLoader(_data(), batch_size=16),
        ),
        poisson_sampling=False,
        backend="reference",
        seed=3,
    )
    ref = dpk_optim.DPSGD(hand.parameters(), 0.5, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=32,
                          seed=3, backend="reference")  # fmt: skip
    for i in range(0, len(batches), 2):
        opt.zero_grad()
        for x, y in batches[i : i + 2]:
            nn.functional.cross_entropy(module(x), y).backward()
        assert isinstance(next(module.parameters()).grad_sample, list)
        opt.step()
        x = torch.cat([batches[i][0], batches[i + 1][0]])
        y = torch.cat([batches[i][1], batches[i + 1][1]])
        for p, s in zip(hand.parameters(), pmlf_grad_samples(hand, nn.functional.cross_entropy, x, y), strict=True):
            p.grad_sample = s[0]
        ref.step()
    for p, q in zip(module._module.parameters(), hand.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert pe.accountant.history == [(1.0, 2 / 16, 3)]


@pytest.mark.parametrize("algorithm", ["dpsgd", "dpadam", "macadam"])
def test_bk_gradient_accumulation_matches_hooks(algorithm):
    """grad_sample_mode="bk" with two backward passes per step (what Opacus's ghost mode cannot do)
    takes the step that hooks mode takes on the same micro-batches, and is accounted the same."""
    make_opt, algo_kwargs = SETUPS[algorithm]
    batches = _fixed_batches(n_steps=6, batch=16)
    runs = []
    for mode in ("hooks", "bk"):
        model = _model()
        pe = PrivacyEngine(accountant="rdp")
        module, opt, _ = pe.make_private(
            **_args(module=model, optimizer=make_opt(model.parameters()),
                    data_loader=DataLoader(_data(), batch_size=16)),
            poisson_sampling=False, algorithm=algorithm, backend="cpu", seed=3, grad_sample_mode=mode, **algo_kwargs,
        )  # fmt: skip
        for i in range(0, len(batches), 2):
            opt.zero_grad()
            for x, y in batches[i : i + 2]:
                nn.functional.cross_entropy(module(x), y).backward()
            opt.step()
        runs.append(([p.detach().clone() for p in model.parameters()], pe.accountant.history))
    (hooks, hist_hooks), (bk, hist_bk) = runs
    assert hist_bk == hist_hooks == [(1.0, 2 / 16, 3)]
    for p, q in zip(bk, hooks, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("algorithm", ["dpsgd", "macadam"])
def test_make_private_with_epsilon_matches_opacus(algorithm):
    make_opt, algo_kwargs = SETUPS[algorithm]
    args = _args(data_loader=DataLoader(_data(), batch_size=32))
    args.pop("noise_multiplier")
    args["optimizer"] = make_opt(args["module"].parameters())
    pe = PrivacyEngine(accountant="rdp")
    _, opt, _ = pe.make_private_with_epsilon(
        **args, target_epsilon=3.0, target_delta=DELTA, epochs=2, algorithm=algorithm, **algo_kwargs
    )
    model = _model()
    _, opacus_opt, _ = OpacusPrivacyEngine(accountant="rdp").make_private_with_epsilon(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_data(), batch_size=32),
        target_epsilon=3.0,
        target_delta=DELTA,
        epochs=2,
        max_grad_norm=1.0,
    )
    assert opt.noise_multiplier == opacus_opt.noise_multiplier == opt.engine.noise_multiplier
    mech = BandedNoise([1.0, 0.5], std=1.0, seed=1, start_step=1, backend="cpu")
    with pytest.raises(NotImplementedError, match="cannot calibrate correlated noise"):
        pe.make_private_with_epsilon(**_args(), target_epsilon=3.0, target_delta=DELTA, epochs=2, correlated_noise=mech)


@pytest.mark.parametrize("mode", ["hooks", "bk"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_empty_poisson_batch_is_a_noise_only_step(algorithm, mode):
    """Poisson sampling can draw an empty batch: the step still runs (noise only) and is accounted."""
    make_opt, algo_kwargs = SETUPS[algorithm]
    model = _model()
    pe = PrivacyEngine(accountant="rdp")
    module, opt, _ = pe.make_private(
        **_args(module=model, optimizer=make_opt(model.parameters())), algorithm=algorithm, backend="cpu", seed=2,
        grad_sample_mode=mode, **algo_kwargs,
    )  # fmt: skip
    x, y = torch.zeros(0, 10), torch.zeros(0, dtype=torch.long)
    before = [p.detach().clone() for p in module.parameters()]
    nn.functional.cross_entropy(module(x), y, reduction="sum").backward()
    if mode == "hooks":
        assert next(module.parameters()).grad_sample.shape[0] == 0
    opt.step(batch=(x, y)) if algorithm == "pmlf" else opt.step()
    for p, b in zip(module.parameters(), before, strict=True):
        assert torch.isfinite(p).all() and not torch.equal(p, b)
    assert pe.accountant.history == [(1.0, 1 / 8, 1)]


def _one_batch(module, algorithm, nan=False):
    x, y = _data().tensors
    x, y = x[:8].clone(), y[:8]
    if nan:
        x[3, 0] = float("nan")
    nn.functional.cross_entropy(module(x), y).backward()
    return x, y


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize(
    "attr, value, match",
    [
        ("noise_multiplier", float("nan"), "noise_multiplier must be a finite number"),
        ("noise_multiplier", -1.0, "noise_multiplier must be a finite number"),
        ("max_grad_norm", 0.0, "max_grad_norm must be a finite number"),
        ("max_grad_norm", -1.0, "max_grad_norm must be a finite number"),
        ("max_grad_norm", float("inf"), "max_grad_norm must be a finite number"),
        ("expected_batch_size", 0, r"expected_batch_size must be an integer in \[1"),
    ],
)
def test_step_validates_opacus_attributes(backend, attr, value, match):
    """σ, C and E set on the Opacus optimizer after make_private are checked with the constructor's
    messages, on every backend, before anything (parameters, counter, accountant) changes."""
    pe = PrivacyEngine(accountant="rdp")
    module, opt, _ = pe.make_private(**_args(), algorithm="dpsgd", backend=backend, seed=2)
    x, y = _one_batch(module, "dpsgd")
    opt.step()
    opt.zero_grad()
    _one_batch(module, "dpsgd")
    setattr(opt, attr, value)
    before = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(ValueError, match=match):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(module.parameters(), before, strict=True))
    assert opt.engine.steps_taken == 1
    assert pe.accountant.history == [(1.0, 1 / 8, 1)]


@pytest.mark.parametrize("mode", ["hooks", "bk"])
@pytest.mark.parametrize("algorithm", ["dpsgd", "dp2", "macadam"])
def test_failed_step_is_not_accounted(algorithm, mode):
    """A step that raises (a NaN per-sample gradient: a non-finite loss for one sample) changes nothing
    and is not accounted; the retry on a good batch is the step the run would have taken."""
    make_opt, algo_kwargs = SETUPS[algorithm]
    runs = []
    for fail in (False, True):
        model = _model()
        pe = PrivacyEngine(accountant="rdp")
        module, opt, _ = pe.make_private(
            **_args(module=model, optimizer=make_opt(model.parameters())), algorithm=algorithm, backend="cpu",
            seed=2, grad_sample_mode=mode, **algo_kwargs,
        )  # fmt: skip
        if fail:
            _one_batch(module, algorithm, nan=True)
            before = [p.detach().clone() for p in module.parameters()]
            with pytest.raises(ValueError, match="non-finite"):
                opt.step()
            assert all(torch.equal(p, b) for p, b in zip(module.parameters(), before, strict=True))
            assert opt.engine.steps_taken == 0 and len(pe.accountant.history) == 0
            opt.zero_grad()
        _one_batch(module, algorithm)
        opt.step()
        runs.append([p.detach().clone() for p in module.parameters()])
        assert pe.accountant.history == [(1.0, 1 / 8, 1)]
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_empty_param_group_passes_through(backend):
    """torch allows an empty param group and make_private passes it on: the engine steps over it."""
    model = _model()
    optimizer = torch.optim.SGD([{"params": list(model.parameters())}, {"params": []}], lr=0.1)
    pe = PrivacyEngine(accountant="rdp")
    module, opt, _ = pe.make_private(**_args(module=model, optimizer=optimizer), algorithm="dpsgd",
                                     backend=backend, seed=2)  # fmt: skip
    before = [p.detach().clone() for p in module.parameters()]
    _one_batch(module, "dpsgd")
    opt.step()
    assert all(not torch.equal(p, b) for p, b in zip(module.parameters(), before, strict=True))
    assert opt.engine.steps_taken == 1 and pe.accountant.history == [(1.0, 1 / 8, 1)]


def _same_tree(a, b) -> bool:
    (la, sa), (lb, sb) = tree_flatten(a), tree_flatten(b)
    same = (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(la, lb, strict=True))
    return sa == sb and all(same)


@pytest.mark.parametrize(
    "algorithm, accountant, save_optimizer, match",
    [
        ("macadam", "rdp", True, "saved by another optimizer, not a DPMacAdam"),
        # Opacus only warns: the engine would restart its noise counter under the saved run's seed.
        ("dpadam", "rdp", False, "holds no optimizer state"),
        ("dpadam", "gdp", True, "accountant is 'rdp', this engine's 'gdp'"),
    ],
)
def test_load_checkpoint_refused_before_anything_loads(tmp_path, algorithm, accountant, save_optimizer, match):
    """PrivacyEngine.load_checkpoint checks the engine's and the accountant's states first: a refused
    checkpoint leaves module, optimizer and accountant as they were (Opacus's loads the module and the
    accountant before the optimizer refuses)."""
    module, opt, engine, _ = _private("dpadam", steps=2, backend="reference")
    path = tmp_path / "ckpt.pt"
    engine.save_checkpoint(path=path, module=module, optimizer=opt if save_optimizer else None)
    dst_module, dst_opt, dst, _ = _private(
        algorithm, steps=1, engine=PrivacyEngine(accountant=accountant), backend="reference", seed=3
    )
    state = lambda: (dst_module.state_dict(), dst_opt.state_dict(), dst.accountant.state_dict())  # noqa: E731
    before = copy.deepcopy(state())
    with pytest.raises(ValueError, match=match):
        dst.load_checkpoint(path=path, module=dst_module, optimizer=dst_opt)
    assert _same_tree(state(), before)
    assert not _same_tree(module.state_dict(), dst_module.state_dict())  # a load would have changed it
