"""The Triton BK linear-layer norm kernel (triton_kernels/layers.py) against the float64
materialising reference (dpkernels/reference/layers.py).

Without a GPU the kernel runs under the Triton interpreter on CPU tensors (tests/conftest.py sets
``TRITON_INTERPRET=1``; about 20 ms per program there), so every case keeps its grid to a few
programs; with a GPU the same cases run compiled on CUDA tensors. Outputs allocated by the package
are NaN-poisoned (conftest), so a tile the kernel forgets to write shows up as NaN.
"""

import pytest
import torch

import dpkernels
from dpkernels.reference.layers import linear_sumsq

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.skipif(
    "triton" not in dpkernels.available_backends(DEVICE), reason=f"triton backend not available on {DEVICE}"
)

if "triton" in dpkernels.available_backends(DEVICE):
    from dpkernels.triton_kernels import layers as tl_layers

# fp32: IEEE fp32 products and sums (TF32 would miss 1e-5 by two orders of magnitude on a GPU).
# 16-bit: the reference runs on the same rounded inputs; products are exact in fp32, so only the
# fp32 accumulation differs.
RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-3}
DTYPES = list(RTOL)
# (B, T, d_in, d_out): one element; odd sizes; T across two chunks of 16; rows 16-byte aligned.
SHAPES = [(1, 1, 3, 5), (3, 5, 7, 13), (2, 33, 20, 17), (2, 9, 16, 24)]


def _inputs(B, T, d_in, d_out, dtype, scale=False, shift=False):
    a = torch.randn(B, T, d_in).to(device=DEVICE, dtype=dtype)
    g = torch.randn(B, T, d_out).to(device=DEVICE, dtype=dtype)
    s = torch.randn(d_out, d_in, device=DEVICE) if scale else None
    # A shift of the order of the per-sample gradient entries (~sqrt(T)), so it matters.
    m = (T**0.5) * torch.randn(d_out, d_in, device=DEVICE) if shift else None
    return a, g, s, m


def _check(out, a, g, s, m, dtype):
    ref = linear_sumsq(a.cpu(), g.cpu(), s if s is None else s.cpu(), m if m is None else m.cpu())
    assert out.dtype == torch.float32 and out.shape == (a.shape[0],) and out.device == a.device
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.cpu().double(), ref, rtol=RTOL[dtype], atol=0)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale,shift", [(False, False), (True, False), (False, True), (True, True)])
def test_matches_reference(shape, dtype, scale, shift):
    a, g, s, m = _inputs(*shape, dtype, scale, shift)
    _check(tl_layers.linear_sumsq_tiled(a, g, s, m), a, g, s, m, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "shape",
    # 2x2 tiles x 2 samples, T over 3 chunks (the last one 1 row); 3x3 tiles with 1-wide edges.
    [(2, 33, 20, 17), (1, 17, 33, 35)],
    ids=lambda s: "x".join(map(str, s)),
)
def test_tile_edges_small_blocks(shape, dtype):
    """16x16x16 tiles: masked edges in d_in, d_out and T inside one sample's several tiles."""
    a, g, s, m = _inputs(*shape, dtype, scale=True, shift=True)
    out = tl_layers._launch(a, g, s, m, tl_layers.LinearBlocks(16, 16, 16, 4))
    _check(out, a, g, s, m, dtype)


def test_two_dim_inputs_are_one_position():
    a, g, s, m = _inputs(3, 1, 6, 5, torch.float32, scale=True, shift=True)
    out = tl_layers.linear_sumsq_tiled(a[:, 0], g[:, 0], s, m)
    _check(out, a, g, s, m, torch.float32)


def test_deterministic():
    a, g, s, m = _inputs(2, 33, 20, 17, torch.bfloat16, scale=True, shift=True)
    first = tl_layers.linear_sumsq_tiled(a, g, s, m)
    assert torch.equal(first, tl_layers.linear_sumsq_tiled(a, g, s, m))


def test_batch_sliced_past_grid_cap(monkeypatch):
    """Batches above CUDA's grid-dimension cap are launched in row slices (cap lowered to 2)."""
    monkeypatch.setattr(tl_layers, "_MAX_GRID_Y", 2)
    a, g, s, m = _inputs(5, 3, 4, 6, torch.float32, scale=True)
    _check(tl_layers.linear_sumsq_tiled(a, g, s, m), a, g, s, m, torch.float32)


def test_empty_inputs(monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("launched a kernel for an empty input")

    monkeypatch.setattr(tl_layers, "_launch", no_launch)
    for shape in [(0, 4, 3, 5), (2, 4, 0, 5), (2, 4, 3, 0)]:
        a, g, _, _ = _inputs(*shape, torch.float32)
        out = tl_layers.linear_sumsq_tiled(a, g)
        assert out.dtype == torch.float32 and out.shape == (shape[0],)
        assert torch.equal(out, torch.zeros_like(out))
    monkeypatch.undo()
    # T = 0: every per-sample gradient is 0, the norm is ‖S ⊙ M‖².
    a, g, s, m = _inputs(2, 0, 3, 5, torch.float32, scale=True, shift=True)
    _check(tl_layers.linear_sumsq_tiled(a, g, s, m), a, g, s, m, torch.float32)


def test_rejects_bad_inputs():
    f = tl_layers.linear_sumsq_tiled
    a, g, s, m = _inputs(2, 3, 4, 5, torch.float32, scale=True, shift=True)
    with pytest.raises(ValueError, match="dims"):
        f(a[0, 0], g[0, 0])
    with pytest.raises(ValueError, match="agree in"):
        f(a, g[:1])
    with pytest.raises(ValueError, match="agree in"):
        f(a, g[:, :2].contiguous())
    with pytest.raises(ValueError, match="agree in"):
        f(a, g[:, 0].contiguous())
    with pytest.raises(TypeError, match="same dtype"):
        f(a, g.half())
    with pytest.raises(TypeError, match="float64"):
        f(a.double(), g.double())
    with pytest.raises(TypeError, match="must be a tensor"):
        f(a.tolist(), g)
    with pytest.raises(ValueError, match="contiguous"):
        f(a.transpose(0, 1), g.transpose(0, 1))
    with pytest.raises(ValueError, match=r"scale must be \[d_out, d_in\] = \[5, 4\]"):
        f(a, g, s.t().contiguous())
    with pytest.raises(ValueError, match="shift must be"):
        f(a, g, s, m[:4])
    with pytest.raises(TypeError, match="scale must be float32"):
        f(a, g, s.double())
    with pytest.raises(ValueError, match="scale must be contiguous"):
        f(a, g, s.t().contiguous().t())
    with pytest.raises(TypeError, match="rank-one"):
        f(a, g, (s[:, 0], s[0]))
    with pytest.raises(ValueError, match="is on"):
        f(a, torch.empty(g.shape, device="meta"))
    with pytest.raises(ValueError, match="is on"):
        f(a, g, torch.empty(s.shape, device="meta"))
