"""Options and shared inputs for the pytest-benchmark versions of ``dpkernels bench``.

These files are not part of the test suite (``testpaths = ["tests"]``); run them explicitly:
``pytest benchmarks/bench_clip.py [--bench-quick] [--bench-rounds N] [--benchmark-json PATH]``.
"""

import gc

import pytest

from dpkernels.bench.shapes import get_shape, make_grad_samples


def pytest_addoption(parser):
    group = parser.getgroup("dpkernels bench")
    group.addoption("--bench-quick", action="store_true", help="the --quick shapes of `dpkernels bench` (smaller B)")
    group.addoption("--bench-rounds", type=int, default=5, help="timed rounds per benchmark (default 5)")


@pytest.fixture(scope="session")
def bench_quick(request) -> bool:
    return request.config.getoption("--bench-quick")


@pytest.fixture(scope="session")
def bench_rounds(request) -> int:
    return request.config.getoption("--bench-rounds")


@pytest.fixture(scope="session")
def grad_inputs(bench_quick):
    """``get(name) -> (shape, grads, max_grad_norm)``, keeping one shape's gradients alive.

    The gradients of a big shape take about 1 GiB; holding every shape at once would not help,
    since the tests run shape by shape.
    """
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            cache.clear()
            gc.collect()
            shape = get_shape(name, bench_quick)
            grads, max_grad_norm = make_grad_samples(shape)
            cache[name] = (shape, grads, max_grad_norm)
        return cache[name]

    yield get
    cache.clear()


@pytest.fixture
def time_provider(benchmark, bench_rounds):
    """``time_provider(p, group, **info)``: time a ``dpkernels bench`` provider with ``benchmark.pedantic``.

    ``bench_rounds`` single calls after 2 warm-up rounds, the provider's untimed ``prepare`` (e.g.
    Opacus's state reset) as ``setup`` before each; skipped with the provider's reason. ``extra_info``
    gets ``info``, the bytes a call must move, what it calls and the GB/s at the median.
    """

    def run(p, group: str, **info) -> None:
        if p.skip is not None:
            pytest.skip(p.skip)
        benchmark.group = group
        benchmark.extra_info.update(**info, bytes_moved=p.bytes_moved, what=p.note)
        benchmark.pedantic(p.call, setup=p.prepare, rounds=bench_rounds, warmup_rounds=2, iterations=1)
        if benchmark.stats is not None:  # None under --benchmark-disable
            benchmark.extra_info["gbps"] = p.bytes_moved / benchmark.stats.stats.median / 1e9

    return run
