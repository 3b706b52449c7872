"""Options and shared inputs for the pytest-benchmark versions of ``dpkernels bench``.

These files are not part of the test suite (``testpaths = ["tests"]``); run them explicitly:
``pytest benchmarks/bench_clip.py [--bench-quick] [--bench-rounds N] [--benchmark-json PATH]``.
"""

import gc

import pytest

from dpkernels import bench


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
            shape = bench.get_shape(name, bench_quick)
            grads, max_grad_norm = bench.make_grad_samples(shape)
            cache[name] = (shape, grads, max_grad_norm)
        return cache[name]

    yield get
    cache.clear()
