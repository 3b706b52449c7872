"""``clip_and_accumulate`` per provider and shape, as pytest-benchmark tests.

The same shapes, gradients and providers as ``dpkernels bench`` (all built by
:mod:`dpkernels.bench.clip`): each dpkernels backend usable on CPU (triton is skipped, its
interpreter's timing means nothing), the eager reference, ``torch.compile`` of it (compilation
happens in the untimed warm-up rounds; left out with ``--bench-quick``), Opacus's
``DPOptimizer.clip_and_accumulate``, and the copy/read bandwidth baselines on a buffer of the
same size as the per-sample gradients.

Each test times ``rounds`` single calls with ``benchmark.pedantic`` (the provider's untimed
``prepare``, e.g. Opacus's state reset, runs as ``setup`` before each). ``extra_info`` holds the
shape, the bytes a call must move (2 reads of the per-sample gradients for the clip providers)
and the GB/s at the median. Tests are grouped by shape, so pytest-benchmark's table compares
providers side by side. The one-process CLI adds what pytest-benchmark cannot: round-robin
interleaving, percentages of same-run bandwidth, errors and peak memory.
"""

import pytest

from dpkernels.bench._timing import bandwidth_providers
from dpkernels.bench.clip import clip_providers
from dpkernels.bench.shapes import SHAPES

PROVIDERS = ("cpu", "triton", "reference", "reference+compile", "opacus", "copy", "read")
# Shape-major order, so each shape's gradients are built once (see grad_inputs in conftest.py).
CASES = [(s, p) for s in SHAPES for p in PROVIDERS]


@pytest.mark.parametrize(("shape_name", "provider"), CASES, ids=[f"{s}-{p}" for s, p in CASES])
def test_clip_and_accumulate(time_provider, grad_inputs, bench_quick, shape_name, provider):
    shape, grads, max_grad_norm = grad_inputs(shape_name)
    if provider in ("copy", "read"):
        candidates = bandwidth_providers(shape.grad_bytes)
    else:
        skip = "--bench-quick leaves out torch.compile (cold compilation takes minutes)"
        skip = skip if bench_quick else None
        candidates = clip_providers(shape, grads, max_grad_norm, compile_skip=skip)
    p = next(c for c in candidates if c.name == provider)
    time_provider(
        p,
        f"{shape.name} (B={shape.batch_size}, {shape.n_tensors} tensors)",
        shape=shape.name,
        batch_size=shape.batch_size,
        n_tensors=shape.n_tensors,
        n_params=shape.n_params,
    )
