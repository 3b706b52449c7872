"""The Gaussian generator and fused ``privatize`` as pytest-benchmark tests.

Same providers and inputs as the ``noise`` and ``privatize`` sections of ``dpkernels bench``
(built by :mod:`dpkernels.bench_noise`): the cpu backend's generators against ``torch.normal``
and ``Tensor.normal_`` on 4.5 M normals, and ``dpkernels.privatize`` against Opacus's
``clip_and_accumulate`` + ``add_noise`` + ``scale_grad`` per model shape. Run explicitly:
``pytest benchmarks/bench_noise.py [--bench-quick] [--bench-rounds N] [--benchmark-json PATH]``.
"""

import pytest

from dpkernels import bench, bench_noise

GENERATORS = [p.name for p in bench_noise.generator_providers(0)]
PRIVATE = ("cpu", "reference", "opacus")
PRIVATE_CASES = [(s, p) for s in bench.SHAPES for p in PRIVATE]


def _run(benchmark, rounds, p, group, **info):
    if p.skip is not None:
        pytest.skip(p.skip)
    benchmark.group = group
    benchmark.extra_info.update(bytes_moved=p.bytes_moved, what=p.note, **info)
    benchmark.pedantic(p.call, setup=p.prepare, rounds=rounds, warmup_rounds=2, iterations=1)
    if benchmark.stats is not None:  # None under --benchmark-disable
        benchmark.extra_info["gbps"] = p.bytes_moved / benchmark.stats.stats.median / 1e9


@pytest.mark.parametrize("provider", GENERATORS)
def test_gaussian_generator(benchmark, bench_rounds, provider):
    p = next(c for c in bench_noise.generator_providers(bench_noise.NOISE_NUMEL) if c.name == provider)
    _run(benchmark, bench_rounds, p, f"{bench_noise.NOISE_NUMEL / 1e6:.1f} M normals", numel=bench_noise.NOISE_NUMEL)


@pytest.mark.parametrize(("shape_name", "provider"), PRIVATE_CASES, ids=[f"{s}-{p}" for s, p in PRIVATE_CASES])
def test_privatize(benchmark, bench_rounds, grad_inputs, shape_name, provider):
    shape, grads, max_grad_norm = grad_inputs(shape_name)
    p = next(c for c in bench_noise.privatize_providers(shape, grads, max_grad_norm) if c.name == provider)
    _run(
        benchmark,
        bench_rounds,
        p,
        f"privatize {shape.name} (B={shape.batch_size})",
        shape=shape.name,
        n_params=shape.n_params,
    )
