"""The Triton BK layer norm kernel (triton_kernels/layers.py), linear and Conv2d (implicit im2col)
launchers, against the float64 materialising reference (dpkernels/reference/layers.py).

Without a GPU the kernel runs under the Triton interpreter on CPU tensors (tests/conftest.py sets
``TRITON_INTERPRET=1``; about 20 ms per program there), so every case keeps its grid to a few
programs; with a GPU the same cases run compiled on CUDA tensors. Outputs allocated by the package
are NaN-poisoned (conftest), so a tile the kernel forgets to write shows up as NaN.
"""

import math

import pytest
import torch

import dpkernels
from dpkernels.reference.layers import conv2d_sumsq, linear_sumsq

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = [
    pytest.mark.skipif(
        "triton" not in dpkernels.available_backends(DEVICE), reason=f"triton backend not available on {DEVICE}"
    ),
    pytest.mark.no_cpu_kernels,
]

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


# ---------------------------------------------------------------------------------------------
# Conv2d: the same kernel with implicit im2col (IS_CONV), one group per launch
# ---------------------------------------------------------------------------------------------

# (B, C_in, C_out, H, W), kernel_size, stride, padding, dilation, groups. "1x1": T = 16, so g's
# planes are whole vectors (VEC_OUT > 1); "odd": every pair asymmetric, T = 5·13 = 65 (two chunks
# of the interpreter's 64).
CONV_CASES = {
    "3x3-pad1": ((2, 3, 5, 6, 7), (3, 3), 1, 1, 1, 1),
    "2x3-s2-g2": ((2, 4, 6, 7, 6), (2, 3), 2, 0, 1, 2),
    "dil2": ((2, 2, 3, 9, 8), (3, 3), 1, 2, 2, 1),
    "1x1": ((3, 3, 4, 4, 4), (1, 1), 1, 0, 1, 1),
    "odd": ((3, 5, 7, 9, 11), (3, 2), (2, 1), (1, 2), (1, 2), 1),
}


def _conv_inputs(case, dtype, scale=False, shift=False):
    (B, C, C_out, H, W), ks, stride, padding, dilation, groups = case
    weight_shape = (C_out, C // groups, *ks)
    x = torch.randn(B, C, H, W)
    out_hw = torch.nn.functional.conv2d(x, torch.zeros(weight_shape), None, stride, padding, dilation, groups).shape[2:]
    g = torch.randn(B, C_out, *out_hw)
    s = torch.randn(weight_shape, device=DEVICE) if scale else None
    m = math.sqrt(out_hw.numel()) * torch.randn(weight_shape, device=DEVICE) if shift else None
    return x.to(DEVICE, dtype), g.to(DEVICE, dtype), s, m


def _conv_tiled(x, g, case, s, m, launch=None):
    """Σ over groups of the launcher on each group's channel slices (views) and weight rows."""
    _, ks, stride, padding, dilation, groups = case
    cx, cg = x.shape[1] // groups, g.shape[1] // groups
    total = 0
    for j in range(groups):
        rows = slice(j * cg, (j + 1) * cg)
        sj, mj = (None if t is None else t[rows].reshape(cg, -1) for t in (s, m))
        xj, gj = x[:, j * cx : (j + 1) * cx], g[:, rows]
        if launch is None:
            out = tl_layers.conv2d_sumsq_tiled(xj, gj, ks, stride, padding, dilation, sj, mj)
        else:
            geom = tl_layers.ConvGeometry(*(tl_layers._int_pair("", v) for v in (ks, stride, padding, dilation)))
            out = launch(xj, gj, geom, sj, mj)
        assert out.dtype == torch.float32 and out.shape == (x.shape[0],) and out.device == x.device
        assert torch.isfinite(out).all()
        total = total + out.double()
    return total


def _check_conv(out, x, g, case, s, m, dtype):
    _, ks, stride, padding, dilation, groups = case
    cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
    ref = conv2d_sumsq(x.cpu(), g.cpu(), (g.shape[1], x.shape[1] // groups, *ks), stride, padding, dilation, groups,
                       cpu(s), cpu(m))  # fmt: skip
    torch.testing.assert_close(out.cpu(), ref, rtol=RTOL[dtype], atol=0)


@pytest.mark.parametrize("case", list(CONV_CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale,shift", [(False, False), (True, False), (False, True), (True, True)])
def test_conv_matches_reference(case, dtype, scale, shift):
    case = CONV_CASES[case]
    x, g, s, m = _conv_inputs(case, dtype, scale, shift)
    _check_conv(_conv_tiled(x, g, case, s, m), x, g, case, s, m, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "case",
    [
        # 2x2 tiles (d_in = 27, O = 17) x 2 samples, T = 25 over 2 chunks.
        ((2, 3, 17, 5, 5), (3, 3), 1, 1, 1, 1),
        # 1x2 tiles (d_in = 24), T = 5·7 = 35 over 3 chunks (the last 3 wide), asymmetric geometry.
        ((1, 4, 5, 9, 7), (3, 2), (2, 1), (1, 1), (1, 2), 1),
    ],
    ids=["3x3-pad1", "odd"],
)
def test_conv_tile_edges_small_blocks(case, dtype):
    """16x16x16 tiles: columns past d_in, rows past C_out and positions past T inside one sample's
    several tiles (the kernel's out-of-image sentinels must mask them)."""
    x, g, s, m = _conv_inputs(case, dtype, scale=True, shift=True)
    blocks = tl_layers.LinearBlocks(16, 16, 16, 4)
    out = _conv_tiled(x, g, case, s, m, lambda *a: tl_layers._launch_conv(*a, blocks))
    _check_conv(out, x, g, case, s, m, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_conv_reads_views_in_place(dtype):
    """Any batch and channel strides: x is every other sample of a larger tensor and a channel slice,
    g a channel slice of odd samples; the samples and channels around them are NaN, so a read
    outside the views shows up as NaN."""
    case = ((2, 3, 4, 5, 6), (3, 3), 1, 1, 1, 1)
    x, g, s, m = _conv_inputs(case, dtype, scale=True, shift=True)
    big_x = torch.full((4, 5, 5, 6), float("nan"), device=DEVICE, dtype=dtype)
    big_g = torch.full((4, 7, 5, 6), float("nan"), device=DEVICE, dtype=dtype)
    xv, gv = big_x[::2, 1:4], big_g[1::2, 2:6]
    xv.copy_(x)
    gv.copy_(g)
    assert not xv.is_contiguous() and not gv.is_contiguous()
    _check_conv(_conv_tiled(xv, gv, case, s, m), x, g, case, s, m, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_conv_unread_pixels_stay_unread(dtype):
    """A 2x3 kernel at stride 2 on 7 x 6 reads no pixel of row 6 or column 5: they are NaN. A chunk's
    positions past T would reach row 6 (oh = 3) without the kernel's sentinel; 0·NaN is NaN."""
    case = ((2, 2, 3, 7, 6), (2, 3), 2, 0, 1, 1)
    x, g, s, m = _conv_inputs(case, dtype, scale=True, shift=True)
    x[:, :, 6, :] = float("nan")
    x[:, :, :, 5] = float("nan")
    _check_conv(_conv_tiled(x, g, case, s, m), x, g, case, s, m, dtype)


def test_conv_through_the_layers_api(monkeypatch):
    """dpkernels.conv2d_sumsq(method="tiled", backend="triton") runs the kernel on the groups'
    views, building no patches."""

    def no_patches(*args, **kwargs):
        raise AssertionError("built im2col patches for the tiled method")

    monkeypatch.setattr(dpkernels.layers, "conv2d_patches", no_patches)
    case = CONV_CASES["2x3-s2-g2"]
    x, g, s, m = _conv_inputs(case, torch.float32, scale=True, shift=True)
    (_, _, _, _, _), ks, stride, padding, dilation, groups = case
    out = dpkernels.conv2d_sumsq(x, g, s.shape, stride=stride, padding=padding, dilation=dilation, groups=groups,
                                 scale=s, shift=m, method="tiled", backend="triton")  # fmt: skip
    assert out.dtype == torch.float64
    _check_conv(out, x, g, case, s, m, torch.float32)


def test_conv_deterministic():
    case = CONV_CASES["odd"]
    x, g, s, m = _conv_inputs(case, torch.bfloat16, scale=True, shift=True)
    first = _conv_tiled(x, g, case, s, m)
    assert torch.equal(first, _conv_tiled(x, g, case, s, m))


def test_conv_batch_sliced_past_grid_cap(monkeypatch):
    monkeypatch.setattr(tl_layers, "_MAX_GRID_Y", 2)
    case = ((5, 2, 3, 4, 4), (3, 3), 1, 1, 1, 1)
    x, g, s, m = _conv_inputs(case, torch.float32, scale=True)
    _check_conv(_conv_tiled(x, g, case, s, m), x, g, case, s, m, torch.float32)


def test_conv_empty_inputs(monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("launched a kernel for an empty input")

    monkeypatch.setattr(tl_layers, "_launch_conv", no_launch)
    for B, C, C_out in [(0, 3, 4), (2, 0, 4), (2, 3, 0)]:
        x, g = torch.randn(B, C, 5, 5, device=DEVICE), torch.randn(B, C_out, 5, 5, device=DEVICE)
        out = tl_layers.conv2d_sumsq_tiled(x, g, 3, 1, 1, 1)
        assert out.dtype == torch.float32 and out.shape == (B,)
        assert torch.equal(out, torch.zeros_like(out))


def test_conv_rejects_bad_inputs(monkeypatch):
    f = tl_layers.conv2d_sumsq_tiled
    x, g = torch.randn(2, 3, 6, 7, device=DEVICE), torch.randn(2, 5, 6, 7, device=DEVICE)
    s = torch.randn(5, 27, device=DEVICE)
    geo = ((3, 3), 1, 1, 1)
    with pytest.raises(TypeError, match="must be a tensor"):
        f(x.tolist(), g, *geo)
    with pytest.raises(ValueError, match=r"x must be \[B, C, H, W\], got 3 dims"):
        f(x[0], g, *geo)
    with pytest.raises(ValueError, match=r"g must be \[B, O, H_out, W_out\]"):
        f(x, g[0], *geo)
    with pytest.raises(TypeError, match="float64"):
        f(x.double(), g.double(), *geo)
    with pytest.raises(TypeError, match="same dtype"):
        f(x, g.half(), *geo)
    with pytest.raises(ValueError, match="same batch size"):
        f(x, g[:1], *geo)
    with pytest.raises(ValueError, match="is on"):
        f(x, torch.empty(g.shape, device="meta"), *geo)
    with pytest.raises(ValueError, match="output size"):
        f(x, g[..., :6], *geo)
    with pytest.raises(ValueError, match="output size"):
        f(x, g, (3, 3), 2, 1, 1)
    with pytest.raises(ValueError, match="larger than the padded input"):
        f(x, g, (9, 3), 1, 1, 1)
    with pytest.raises(ValueError, match="must be positive"):
        f(x, g, (3, 0), 1, 1, 1)
    with pytest.raises(ValueError, match="must be positive"):
        f(x, g, *geo[:3], (1, 0))
    with pytest.raises(ValueError, match="non-negative"):
        f(x, g, (3, 3), 1, (1, -1), 1)
    with pytest.raises(ValueError, match="stride must be an int or a pair"):
        f(x, g, (3, 3), (1, 1, 1), 1, 1)
    with pytest.raises(ValueError, match="padding must be an int or a pair"):
        f(x, g, (3, 3), 1, "same", 1)
    with pytest.raises(ValueError, match="kernel_size must be an int or a pair"):
        f(x, g, (3.0, 3), 1, 1, 1)
    with pytest.raises(ValueError, match="contiguous H x W plane"):
        f(x.transpose(2, 3).contiguous().transpose(2, 3), g, *geo)
    with pytest.raises(ValueError, match="contiguous H_out x W_out plane"):
        f(x, g.transpose(2, 3).contiguous().transpose(2, 3), *geo)
    with pytest.raises(ValueError, match=r"scale must be \[O, C·kh·kw\] = \[5, 27\]"):
        f(x, g, *geo, s.view(5, 3, 3, 3))
    with pytest.raises(ValueError, match="shift must be"):
        f(x, g, *geo, s, s[:4])
    with pytest.raises(TypeError, match="scale must be float32"):
        f(x, g, *geo, s.double())
    with pytest.raises(ValueError, match="scale must be contiguous"):
        f(x, g, *geo, s.t().contiguous().t())
    with pytest.raises(ValueError, match="scale is on"):
        f(x, g, *geo, torch.empty(s.shape, device="meta"))
    with pytest.raises(TypeError, match="rank-one"):
        f(x, g, *geo, (s[:, 0], s[0]))
    # The int32 guards: O·C·kh·kw = 135 here; a 1x1 kernel's padded plane (6 + 1)·(7 + 1) = 56.
    monkeypatch.setattr(tl_layers, "_INT32_MAX", 134)
    with pytest.raises(ValueError, match="below 2"):
        f(x, g, *geo)
    monkeypatch.setattr(tl_layers, "_INT32_MAX", 55)
    with pytest.raises(ValueError, match="below 2"):
        f(x[:, :1], g, 1, 1, 0, 1)
    monkeypatch.setattr(tl_layers, "_INT32_MAX", 56)
    assert torch.isfinite(f(x[:, :1], g, 1, 1, 0, 1)).all()
