"""torch.library integration: opcheck on every registered op, and torch.compile(fullgraph=True)."""

import pytest
import torch

import dpkernels


def _inputs():
    g = [torch.randn(5, 7, 3), torch.randn(5, 11), torch.randn(5, 1)]
    return (
        g,
        [torch.randn(7, 3), torch.randn(11), torch.randn(1)],
        [torch.rand(7, 3), torch.rand(11), torch.rand(1)],
    )


def _opcheck(op, args):
    # test_aot_dispatch_dynamic needs a backward; these ops are not differentiable.
    results = torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
    assert all(v == "SUCCESS" for v in results.values()), results


def test_opcheck_public_ops(backend_device):
    backend, device = backend_device
    g, shift, scale = _inputs()
    g = [x.to(device) for x in g]
    shift = [x.to(device) for x in shift]
    scale = [x.to(device) for x in scale]
    ops = torch.ops.dpkernels
    _opcheck(ops.per_sample_norms.default, (g, [1.0], shift, scale, False, backend))
    _opcheck(ops.per_sample_norms.default, (g + g, [0.5, 0.5], [], [], True, backend))
    _opcheck(ops.clip_factors.default, (torch.rand(5, device=device), [1.0], "psac", 0.1, backend))
    _opcheck(ops.weighted_sum.default, (g, [1.0], torch.rand(5, 3, device=device), backend))
    _opcheck(
        ops.clip_and_accumulate.default,
        (g, [1.0], [1.0], "clip", 0.0, shift, scale, False, "raise", backend),
    )
    _opcheck(
        ops.clip_and_accumulate.default,
        (g, [1.0], [1.0, 2.0, 3.0], "auto_s", 0.01, [], [], True, "drop", backend),
    )


def test_opcheck_native_ops():
    if "cpu" not in dpkernels.available_backends("cpu"):
        pytest.skip("C++ extension not built")
    g, shift, scale = _inputs()
    ops = torch.ops.dpkernels_C
    _opcheck(ops.per_sample_sumsq.default, (g, [1.0], shift, scale))
    _opcheck(ops.clip_factors.default, (torch.rand(5, 3, dtype=torch.float64), [1.0, 2.0, 0.5], "clip", 0.0))
    _opcheck(ops.weighted_sum.default, (g, [1.0], torch.rand(5, 3)))
    plain = ("none", 0.0, [], 0, 0, 1.0, [])
    _opcheck(ops.clip_pipeline.default, (g, [1.0], [1.0], "clip", 0.0, shift, scale, False, False, 0.5, *plain))
    _opcheck(
        ops.clip_pipeline.default, (g + g, [0.5, 0.5], [1.0, 2.0, 3.0], "psac", 0.1, [], [], True, True, 1.0, *plain)
    )
    noise = [torch.randn(s.shape[1:]) for s in g]
    _opcheck(ops.clip_pipeline.default, (g, [1.0], [1.0], "auto_s", 0.1, [], [], False, False, 1.0, "philox", 0.0,
                                         [3], 2, 0, 0.125, noise))  # fmt: skip


def test_compile_fullgraph(backend_device):
    backend, device = backend_device
    g, _, _ = _inputs()
    g = [x.to(device) for x in g]

    def step(grads):
        sums, norms = dpkernels.clip_and_accumulate(grads, 1.0, mode="psac", backend=backend)
        return [s * 2 for s in sums], norms.mean()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got_sums, got_mean = compiled(g)
    want_sums, want_mean = step(g)
    torch.testing.assert_close(got_mean, want_mean)
    for a, b in zip(got_sums, want_sums, strict=True):
        torch.testing.assert_close(a, b)
