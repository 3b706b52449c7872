"""The Gaussian generator and fused ``privatize`` as pytest-benchmark tests.

Same providers and inputs as the ``noise`` and ``privatize`` sections of ``dpkernels bench``
(built by :mod:`dpkernels.bench.noise`): the cpu backend's generators against ``torch.normal``
and ``Tensor.normal_`` on 4.5 M normals, and ``dpkernels.privatize`` against Opacus's
``clip_and_accumulate`` + ``add_noise`` + ``scale_grad`` per model shape. Run explicitly:
``pytest benchmarks/bench_noise.py [--bench-quick] [--bench-rounds N] [--benchmark-json PATH]``.
"""

import pytest

from dpkernels.bench.noise import NOISE_NUMEL, generator_providers, privatize_providers
from dpkernels.bench.shapes import SHAPES

GENERATORS = [p.name for p in generator_providers(0)]
PRIVATE = ("cpu", "reference", "opacus")
PRIVATE_CASES = [(s, p) for s in SHAPES for p in PRIVATE]


@pytest.mark.parametrize("provider", GENERATORS)
def test_gaussian_generator(time_provider, provider):
    p = next(c for c in generator_providers(NOISE_NUMEL) if c.name == provider)
    time_provider(p, f"{NOISE_NUMEL / 1e6:.1f} M normals", numel=NOISE_NUMEL)


@pytest.mark.parametrize(("shape_name", "provider"), PRIVATE_CASES, ids=[f"{s}-{p}" for s, p in PRIVATE_CASES])
def test_privatize(time_provider, grad_inputs, shape_name, provider):
    shape, grads, max_grad_norm = grad_inputs(shape_name)
    p = next(c for c in privatize_providers(shape, grads, max_grad_norm) if c.name == provider)
    time_provider(p, f"privatize {shape.name} (B={shape.batch_size})", shape=shape.name, n_params=shape.n_params)
