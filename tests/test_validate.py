"""Scalar arguments: any real type (Python, NumPy, 0-d tensors) gives bit-identical results to the
Python number; bools are refused naming the argument; a noise std or clip bound beyond fp32 is
refused instead of becoming a silent inf."""

import numpy as np
import pytest
import torch

import dpkernels
from dpkernels.correlated import BandedNoise, BLTNoise

SHAPES = [(7,), (33, 5)]


def _grads(B, device):
    return [torch.randn(B, *s, dtype=torch.float64).float().to(device) * 2 for s in SHAPES]


def _as(kind, value):
    """``value`` as another real type; a float32 kind changes a non-representable float, so the
    Python reference value is ``float(_as(kind, value))``."""
    if kind == "np64":
        return np.float64(value) if isinstance(value, float) else np.int64(value)
    if kind == "np32":
        return np.float32(value) if isinstance(value, float) else np.uint32(value)
    if kind == "tensor":
        return torch.tensor(value, dtype=torch.float64 if isinstance(value, float) else torch.int64)
    return torch.tensor(value, dtype=torch.float32 if isinstance(value, float) else torch.int32)


def _py(x):
    return x.item() if isinstance(x, torch.Tensor) else x.item() if isinstance(x, np.generic) else x


KINDS = ["np64", "np32", "tensor", "tensor32"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rng", ["philox", "chacha20"])
def test_privatize_accepts_any_real_type(backend_device, kind, rng):
    backend, device = backend_device
    g = _grads(5, device)
    scalars = dict(max_grad_norm=0.9, noise_multiplier=1.1, seed=2**30 + 5, step=41, stream=3, expected_batch_size=8)
    typed = {k: _as(kind, v) for k, v in scalars.items()}
    plain = {k: _py(v) for k, v in typed.items()}

    def run(a, r):
        return dpkernels.privatize(
            g, a["max_grad_norm"], a["noise_multiplier"], seed=a["seed"], step=a["step"], stream=a["stream"],
            expected_batch_size=a["expected_batch_size"], mode="psac", r=r, rng=rng, backend=backend,
        )  # fmt: skip

    r = _as(kind, 0.2)
    for a, b in zip(run(typed, r), run(plain, _py(r)), strict=True):
        assert torch.isfinite(a).all() and a.abs().sum() > 0
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", KINDS)
def test_clip_and_noise_functions_accept_any_real_type(backend_device, kind):
    backend, device = backend_device
    g = _grads(4, device)
    C = [0.5, 1.5]
    typed = [_as(kind, c) for c in C]
    cases = [(typed, [_py(c) for c in typed]), (np.array(C), C), (torch.tensor(C, dtype=torch.float64), C)]
    cases.append((_as(kind, 0.5), _py(_as(kind, 0.5))))  # one bound for every layer
    for arg, plain in cases:
        got, _ = dpkernels.clip_and_accumulate(g, arg, per_layer=True, backend=backend)
        want, _ = dpkernels.clip_and_accumulate(g, plain, per_layer=True, backend=backend)
        assert all(torch.equal(a, b) and a.abs().sum() > 0 for a, b in zip(got, want, strict=True))
    std, seed, step = _as(kind, 0.7), _as(kind, 12345), _as(kind, 9)
    kw = dict(device=device, backend=backend)
    a = dpkernels.gaussian_noise(100, std=std, seed=seed, step=step, stream=_as(kind, 1), offset=_as(kind, 3), **kw)
    b = dpkernels.gaussian_noise(100, std=_py(std), seed=_py(seed), step=_py(step), stream=1, offset=3, **kw)
    assert a.abs().sum() > 0 and torch.equal(a, b)
    t1, t2 = [torch.ones(50, device=device)], [torch.ones(50, device=device)]
    dpkernels.add_gaussian_noise_(t1, std, seed=seed, step=step, rng="chacha20", backend=backend)
    dpkernels.add_gaussian_noise_(t2, _py(std), seed=_py(seed), step=_py(step), rng="chacha20", backend=backend)
    assert torch.equal(t1[0], t2[0]) and (t1[0] != 1).all()
    words = dpkernels.philox_uint32(8, seed=np.uint64(2**64 - 1), step=_as(kind, 2), **kw)
    assert torch.equal(words, dpkernels.philox_uint32(8, seed=2**64 - 1, step=2, **kw))


@pytest.mark.parametrize("kind", KINDS)
def test_correlated_noise_accepts_any_real_type(backend_device, kind):
    backend, device = backend_device
    shapes = [(6,), (2, 3)]
    typed = BLTNoise(
        np.array([0.8, 0.3]), [_as(kind, 0.2), _as(kind, 0.1)], std=_as(kind, 0.9), seed=_as(kind, 77),
        stream=_as(kind, 1), start_step=_as(kind, 4), backend=backend,
    )  # fmt: skip
    plain = BLTNoise(
        [0.8, 0.3], [_py(_as(kind, 0.2)), _py(_as(kind, 0.1))], std=_py(_as(kind, 0.9)), seed=77, stream=1,
        start_step=4, backend=backend,
    )  # fmt: skip
    for t in range(4, 7):
        a = typed.noise(shapes, _as(kind, t), device=device)
        b = plain.noise(shapes, t, device=device)
        assert all(torch.equal(x, y) and x.abs().sum() > 0 for x, y in zip(a, b, strict=True))
    band = BandedNoise([_as(kind, 1.0), 0.5], num_steps=_as(kind, 5), std=_as(kind, 2.0), seed=np.int64(3))
    assert band.num_steps == 5 and band.sensitivity(_as(kind, 5), min_sep=_as(kind, 2), max_participations=2) > 0
    assert typed.sensitivity(_as(kind, 6), min_sep=np.int64(3), max_participations=np.int32(2)) > 0


BOOLS = [True, np.bool_(True), torch.tensor(True)]


@pytest.mark.parametrize("flag", BOOLS, ids=["bool", "np.bool_", "bool-tensor"])
def test_bools_are_refused_naming_the_argument(backend_device, flag):
    """``True`` is not σ = 1 (nor C = 1, seed 1, step 1, B = 1): a ValueError names the argument."""
    backend, device = backend_device
    g = _grads(3, device)
    kw = dict(seed=1, step=0, backend=backend)
    cases = [
        ("noise_multiplier", lambda: dpkernels.privatize(g, 1.0, flag, **kw)),
        ("max_grad_norm", lambda: dpkernels.privatize(g, flag, 1.0, **kw)),
        (r"max_grad_norm\[1\]", lambda: dpkernels.privatize(g, [1.0, flag], 1.0, per_layer=True, **kw)),
        ("seed", lambda: dpkernels.privatize(g, 1.0, 1.0, seed=flag, step=0, backend=backend)),
        ("seed", lambda: dpkernels.privatize(g, 1.0, 1.0, seed=flag, step=0, rng="chacha20", backend=backend)),
        ("step", lambda: dpkernels.privatize(g, 1.0, 1.0, seed=1, step=flag, backend=backend)),
        ("stream", lambda: dpkernels.privatize(g, 1.0, 1.0, stream=flag, **kw)),
        ("expected_batch_size", lambda: dpkernels.privatize(g, 1.0, 1.0, expected_batch_size=flag, **kw)),
        ("r must be", lambda: dpkernels.privatize(g, 1.0, 1.0, mode="auto_s", r=flag, **kw)),
        ("max_grad_norm", lambda: dpkernels.clip_and_accumulate(g, flag, backend=backend)),
        ("std", lambda: dpkernels.gaussian_noise(4, std=flag, seed=1, step=0, device=device, backend=backend)),
        ("offset", lambda: dpkernels.gaussian_noise(4, std=1.0, seed=1, step=0, offset=flag, device=device)),
        ("std", lambda: dpkernels.add_gaussian_noise_([torch.zeros(4, device=device)], flag, seed=1, step=0)),
        ("std", lambda: BLTNoise([0.5], [0.5], std=flag)),
        ("seed", lambda: BLTNoise([0.5], [0.5], std=1.0, seed=flag)),
        ("start_step", lambda: BandedNoise([1.0, 0.5], std=1.0, start_step=flag)),
        ("omega", lambda: BLTNoise([0.5], [flag], std=1.0)),
        ("num_steps", lambda: BandedNoise([1.0, 0.5], num_steps=flag, std=1.0)),
        ("step", lambda: BLTNoise([0.5], [0.5], std=1.0, start_step=1).noise([(3,)], flag)),
    ]
    for name, call in cases:
        with pytest.raises(ValueError, match=name):
            call()
    with pytest.raises(ValueError, match="omega must hold real numbers"):
        BLTNoise([0.5], torch.tensor([True]), std=1.0)


def test_fp32_overflow_is_refused(backend_device):
    """σ·C, a clip bound or a noise std above the largest fp32 became inf noise (or an inf bound)."""
    backend, device = backend_device
    g = _grads(3, device)
    kw = dict(seed=1, step=0, backend=backend)
    with pytest.raises(ValueError, match=r"noise_multiplier·sensitivity = \S+e\+39 overflows float32"):
        dpkernels.privatize(g, 1e30, 1e9, **kw)
    with pytest.raises(ValueError, match=r"noise_multiplier·sensitivity = .* overflows float32"):
        dpkernels.privatize(g, [3e38, 3e38], 1.0, per_layer=True, **kw)  # ‖(C_1, C_2)‖ = 4.2e38
    with pytest.raises(ValueError, match="max_grad_norm must be finite and > 0"):
        dpkernels.privatize(g, 1e39, 0.0, **kw)
    with pytest.raises(ValueError, match="std = 1e\\+39 overflows float32"):
        dpkernels.gaussian_noise(4, std=1e39, seed=1, step=0, device=device, backend=backend)
    with pytest.raises(ValueError, match="std = 1e\\+39 overflows float32"):
        dpkernels.add_gaussian_noise_([torch.zeros(4, device=device)], 1e39, seed=1, step=0, backend=backend)
    state = [[torch.zeros(4, device=device)]]
    out = [torch.zeros(4, device=device)]
    with pytest.raises(ValueError, match="noise_std = 1e\\+39 overflows float32"):
        dpkernels.linear_filter_(state, c=[0.5], d=[0.5], e=[1.0], f=[0.0], out=out, noise_std=1e39, seed=1, step=0)
    with pytest.raises(ValueError, match="std = 1e\\+39 overflows float32"):
        BLTNoise([0.5], [0.5], std=1e39, backend=backend)
    with pytest.raises(ValueError, match="std = 1e\\+39 overflows float32"):
        BandedNoise([1.0, 0.5], std=1e39, backend=backend)
    with pytest.raises(ValueError, match="omega must be within the float32 range"):
        BLTNoise([0.5], [1e39], std=1.0, backend=backend)
