"""Agreement with Opacus: the same per-sample gradients give Opacus's ``summed_grad``."""

import pytest
import torch

import dpkernels

opacus = pytest.importorskip("opacus")
from opacus.optimizers import DPOptimizer, DPPerLayerOptimizer  # noqa: E402


def _params_with_grad_samples(shapes, B, scales):
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.zeros(s))
        p.grad_sample = torch.randn(B, *s) * scales.view(-1, *[1] * len(s))
        params.append(p)
    return params


@pytest.mark.parametrize("per_layer", [False, True], ids=["flat", "per-layer"])
def test_matches_opacus_summed_grad(backend_device, per_layer):
    backend, device = backend_device
    if device != "cpu":
        pytest.skip("Opacus comparison runs on CPU tensors")
    shapes = [(16, 9), (16,), (4, 3, 3, 3), (4,), (10, 16), (10,)]
    B = 12
    scales = torch.logspace(-4, 3, B)
    params = _params_with_grad_samples(shapes, B, scales)
    if per_layer:
        C = [0.5, 0.1, 1.0, 0.2, 0.7, 0.05]
        opt = DPPerLayerOptimizer(
            torch.optim.SGD(params, lr=0.1), noise_multiplier=0.0, max_grad_norm=C, expected_batch_size=B
        )
    else:
        C = 1.3
        opt = DPOptimizer(torch.optim.SGD(params, lr=0.1), noise_multiplier=0.0, max_grad_norm=C, expected_batch_size=B)
    opt.clip_and_accumulate()
    sums, _ = dpkernels.clip_and_accumulate([p.grad_sample for p in params], C, per_layer=per_layer, backend=backend)
    for p, s in zip(params, sums, strict=True):
        torch.testing.assert_close(s, p.summed_grad, rtol=1e-5, atol=1e-6)
