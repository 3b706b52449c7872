"""dpkernels.layers: the book-keeping layer ops on every backend against the float64 reference.

Linear (T = 1 and T > 1; no scale, rank-one and dense scale, each with and without shift; every
method), Conv2d (groups, stride, padding, dilation) against per-sample gradients from
``torch.nn.grad.conv2d_weight``, Embedding (padding_idx, scale, shift, expanded ids), the clipped
sums, dtypes fp32/fp16/bf16, B = 1 and B = 0, and bad input.
"""

import pytest
import torch

import dpkernels.layers as L
from dpkernels.reference import layers as ref

# Linear shapes (B, T, d_in, d_out): odd sizes, T = 1, B = 1, not multiples of any tile.
SHAPES = [(5, 1, 7, 13), (1, 1, 3, 2), (3, 6, 9, 5), (2, 17, 33, 20), (1, 4, 6, 3)]
# Relative tolerance against the float64 reference, by input dtype (half inputs are compared
# against the reference on the rounded inputs: the op upcasts before any product).
RTOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-3}


def _scales(kind, d_out, d_in, device):
    if kind == "none":
        return None
    if kind == "rank1":
        return (torch.rand(d_out, device=device) + 0.5, torch.rand(d_in, device=device) + 0.5)
    return torch.rand(d_out, d_in, device=device) + 0.25


def _methods(T, scale_kind):
    methods = ["auto", "tiled"]
    if T == 1:
        methods.append("t1")
    if scale_kind != "dense":
        methods.append("gram")
    return methods


def _check_sumsq(out, want, rtol):
    assert out.dtype == torch.float64 and out.shape == want.shape
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.cpu(), want.cpu(), rtol=rtol, atol=rtol * float(want.abs().max()) + 1e-30)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("scale_kind", ["none", "rank1", "dense"])
@pytest.mark.parametrize("with_shift", [False, True], ids=["noshift", "shift"])
def test_linear_sumsq_matches_reference(backend_device, shape, scale_kind, with_shift):
    backend, device = backend_device
    B, T, d_in, d_out = shape
    a = torch.randn(B, T, d_in, device=device)
    g = torch.randn(B, T, d_out, device=device)
    scale = _scales(scale_kind, d_out, d_in, device)
    shift = 0.3 * torch.randn(d_out, d_in, device=device) if with_shift else None
    want = ref.linear_sumsq(a, g, scale, shift)
    methods = ["auto"] if backend == "reference" else _methods(T, scale_kind)
    for method in methods:
        out = L.linear_sumsq(a, g, scale=scale, shift=shift, method=method, backend=backend)
        # The shift expansion subtracts terms of size ‖S⊙g‖² + ‖S⊙M‖²: tolerance relative to them.
        _check_sumsq(out, want, 1e-4 if with_shift and method != "tiled" else RTOL[torch.float32])


def _force_gram_tiling(monkeypatch, rows, chunk):
    """The Gram form's row blocks and chunk of samples, on every device."""
    monkeypatch.setattr(L, "_GRAM_TILING", {})
    monkeypatch.setattr(L, "_GRAM_TILING_DEFAULT", (rows, chunk))


# (rows per row block, elements per chunk): one block and one chunk (the whole Grams at once); two
# row blocks in one chunk; blocks that do not divide T, a few samples per chunk; single rows; a
# chunk smaller than one sample's block.
GRAM_TILINGS = [(None, 1 << 24), (32, 1 << 18), (5, 60), (1, 1 << 24), (7, 1)]


@pytest.mark.parametrize("tiling", GRAM_TILINGS, ids=lambda t: f"rows{t[0]}-chunk{t[1]}")
@pytest.mark.parametrize("with_shift", [False, True], ids=["noshift", "shift"])
def test_linear_gram_tilings(backend_device, monkeypatch, tiling, with_shift):
    """The Gram form's upper block rows and chunks of samples: every tiling gives the reference's norms."""
    backend, device = backend_device
    if backend == "reference":
        pytest.skip("the reference materialises the per-sample gradients")
    _force_gram_tiling(monkeypatch, *tiling)
    a, g = torch.randn(5, 37, 9, device=device), torch.randn(5, 37, 6, device=device)
    scale = _scales("rank1", 6, 9, device)
    shift = 0.3 * torch.randn(6, 9, device=device) if with_shift else None
    out = L.linear_sumsq(a, g, scale=scale, shift=shift, method="gram", backend=backend)
    _check_sumsq(out, ref.linear_sumsq(a, g, scale, shift), 1e-4 if with_shift else RTOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_linear_sumsq_half_inputs(backend_device, dtype):
    backend, device = backend_device
    a = torch.randn(3, 5, 11, device=device).to(dtype)
    g = torch.randn(3, 5, 6, device=device).to(dtype)
    dense = torch.rand(6, 11, device=device) + 0.5
    for scale, methods in ((None, ["gram", "tiled"]), (dense, ["tiled"])):
        want = ref.linear_sumsq(a.float(), g.float(), scale)
        for method in methods if backend != "reference" else ["auto"]:
            out = L.linear_sumsq(a, g, scale=scale, method=method, backend=backend)
            _check_sumsq(out, want, RTOL[dtype])


def test_linear_two_dim_input_is_t1(backend_device):
    backend, device = backend_device
    a, g, w = torch.randn(4, 9, device=device), torch.randn(4, 3, device=device), torch.rand(4, device=device)
    _check_sumsq(L.linear_sumsq(a, g, backend=backend), ref.linear_sumsq(a, g), 1e-6)
    out = L.linear_weighted_sum(a, g, w, backend=backend)
    torch.testing.assert_close(out.double().cpu(), ref.linear_weighted_sum(a, g, w).cpu(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_linear_weighted_sum(backend_device, shape, dtype):
    backend, device = backend_device
    B, T, d_in, d_out = shape
    a = torch.randn(B, T, d_in, device=device).to(dtype)
    g = torch.randn(B, T, d_out, device=device).to(dtype)
    w = torch.rand(B, device=device)
    w[0] = 0.0
    out = L.linear_weighted_sum(a, g, w, backend=backend)
    assert out.dtype == torch.float32 and out.shape == (d_out, d_in)
    want = ref.linear_weighted_sum(a, g, w)
    torch.testing.assert_close(out.double().cpu(), want.cpu(), rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_weighted_sums_into_out(backend_device):
    """``out=``: the result written into a NaN-poisoned buffer, which is returned; bad buffers raise."""
    backend, device = backend_device
    a, g, w = torch.randn(3, 5, 7, device=device), torch.randn(3, 5, 4, device=device), torch.rand(3, device=device)
    out = torch.full((4, 7), float("nan"), device=device)
    assert L.linear_weighted_sum(a, g, w, out=out, backend=backend) is out
    torch.testing.assert_close(out, L.linear_weighted_sum(a, g, w, backend=backend), rtol=1e-6, atol=1e-6)
    ids = torch.randint(0, 9, (3, 5), device=device)
    emb = torch.full((9, 4), float("nan"), device=device)
    assert L.embedding_weighted_sum(ids, g, w, 9, padding_idx=2, out=emb, backend=backend) is emb
    torch.testing.assert_close(emb, L.embedding_weighted_sum(ids, g, w, 9, padding_idx=2, backend=backend))
    bad = [
        (torch.zeros(4, 7, dtype=torch.float64, device=device), TypeError, "float32"),
        (torch.zeros(7, 4, device=device), ValueError, "shape"),
        (torch.zeros(7, 4, device=device).T, ValueError, "contiguous"),
        (torch.zeros(4, 7, device="meta"), ValueError, "is on meta"),
        (a.view(-1)[:28].view(4, 7), ValueError, "share memory"),
        ([[0.0] * 7] * 4, TypeError, "must be a tensor"),
    ]
    for buf, exc, match in bad:
        with pytest.raises(exc, match=match):
            L.linear_weighted_sum(a, g, w, out=buf, backend=backend)


def test_empty_batch(backend_device):
    backend, device = backend_device
    a, g = torch.randn(0, 3, 4, device=device), torch.randn(0, 3, 5, device=device)
    assert L.linear_sumsq(a, g, backend=backend).shape == (0,)
    out = L.linear_weighted_sum(a, g, torch.ones(0, device=device), backend=backend)
    assert out.shape == (5, 4) and not out.any()


CONVS = {
    "3x3-pad1": dict(kernel_size=(3, 3), stride=1, padding=1, dilation=1, groups=1),
    "2x3-s2-g2": dict(kernel_size=(2, 3), stride=2, padding=0, dilation=1, groups=2),
    "dil2": dict(kernel_size=(3, 3), stride=1, padding=2, dilation=2, groups=1),
    "5x3-s21-pad21": dict(kernel_size=(5, 3), stride=(2, 1), padding=(2, 1), dilation=1, groups=1),
    "1x1": dict(kernel_size=(1, 1), stride=1, padding=0, dilation=1, groups=1),
}
# (scale, shift, method): every method with and without shift; "gram" takes no scale.
CONV_CASES = [(False, False, "auto"), (False, True, "gram"), (False, False, "gram"), (False, True, "tiled"),
              (True, False, "tiled"), (True, True, "auto")]  # fmt: skip


def _conv_case(device, conv, B=3, C_in=4, C_out=6, H=7, W=6, dtype=torch.float32):
    ks, stride, padding, dilation, groups = conv.values()
    weight = torch.randn(C_out, C_in // groups, *ks, device=device)
    x = torch.randn(B, C_in, H, W, device=device)
    g = torch.randn_like(torch.nn.functional.conv2d(x, weight, None, stride, padding, dilation, groups))
    x, g = x.to(dtype), g.to(dtype)
    per_sample = torch.stack([
        torch.nn.grad.conv2d_weight(x[i : i + 1].double(), weight.shape, g[i : i + 1].double(), stride, padding,
                                    dilation, groups)
        for i in range(B)
    ])  # fmt: skip
    return x, g, weight.shape, per_sample, dict(stride=stride, padding=padding, dilation=dilation, groups=groups)


@pytest.mark.parametrize("conv", list(CONVS.values()), ids=list(CONVS))
@pytest.mark.parametrize("with_scale, with_shift, method", CONV_CASES, ids=lambda v: str(v))
def test_conv2d_against_per_sample_conv_gradients(backend_device, conv, with_scale, with_shift, method):
    backend, device = backend_device
    x, g, wshape, per_sample, geom = _conv_case(device, conv)
    scale = torch.rand(wshape, device=device) + 0.5 if with_scale else None
    shift = 0.1 * torch.randn(wshape, device=device) if with_shift else None
    want = ref.masked_sumsq(per_sample, None if scale is None else scale.double(), shift)
    out = L.conv2d_sumsq(x, g, wshape, scale=scale, shift=shift, method=method, backend=backend, **geom)
    _check_sumsq(out, want, 1e-4)
    torch.testing.assert_close(out, ref.conv2d_sumsq(x, g, wshape, *geom.values(), scale, shift), rtol=1e-4, atol=0)
    w = torch.rand(x.shape[0], device=device)
    s = L.conv2d_weighted_sum(x, g, w, wshape, backend=backend, **geom)
    assert s.dtype == torch.float32 and s.shape == wshape
    want_s = torch.einsum("b,b...->...", w.double(), per_sample)
    torch.testing.assert_close(s.double().cpu(), want_s.cpu(), rtol=1e-5, atol=1e-5 * float(want_s.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("method", ["tiled", "gram"])
def test_conv2d_half_inputs(backend_device, dtype, method):
    backend, device = backend_device
    x, g, wshape, per_sample, geom = _conv_case(device, CONVS["2x3-s2-g2"], dtype=dtype)
    shift = 0.1 * torch.randn(wshape, device=device)
    want = ref.masked_sumsq(per_sample, None, shift)
    out = L.conv2d_sumsq(x, g, wshape, shift=shift, method=method, backend=backend, **geom)
    _check_sumsq(out, want, RTOL[dtype] if method == "tiled" else 1e-3)
    w = torch.rand(x.shape[0], device=device)
    s = L.conv2d_weighted_sum(x, g, w, wshape, backend=backend, **geom)
    want_s = torch.einsum("b,b...->...", w.double(), per_sample)
    assert s.dtype == torch.float32
    torch.testing.assert_close(s.double().cpu(), want_s.cpu(), rtol=1e-5, atol=1e-5 * float(want_s.abs().max()))


def test_conv2d_one_sample_channels_last(backend_device):
    """B = 1 and a channels_last input (not contiguous in NCHW): read as the same convolution."""
    backend, device = backend_device
    x, g, wshape, per_sample, geom = _conv_case(device, CONVS["3x3-pad1"], B=1, C_in=5, C_out=3, H=9, W=8)
    x, g = x.to(memory_format=torch.channels_last), g.to(memory_format=torch.channels_last)
    scale = torch.rand(wshape, device=device) + 0.5
    for method, sc in (("tiled", scale), ("gram", None)):
        want = ref.masked_sumsq(per_sample, None if sc is None else sc.double(), None)
        _check_sumsq(L.conv2d_sumsq(x, g, wshape, scale=sc, method=method, backend=backend, **geom), want, 1e-4)
    w = torch.rand(1, device=device)
    s = L.conv2d_weighted_sum(x, g, w, wshape, backend=backend, **geom)
    torch.testing.assert_close(s.double().cpu(), (w.double() * per_sample[0]).cpu(), rtol=1e-5, atol=1e-6)


def test_conv2d_gram_chunks_samples(backend_device, monkeypatch):
    """The Gram form builds patches a chunk of samples at a time: every chunk size gives the same norms."""
    backend, device = backend_device
    x, g, wshape, per_sample, geom = _conv_case(device, CONVS["3x3-pad1"], B=5)
    want = ref.masked_sumsq(per_sample, None, None)
    monkeypatch.setattr(L, "_PATCH_CHUNK_ELEMS", 1)
    _force_gram_tiling(monkeypatch, 2, 1)
    _check_sumsq(L.conv2d_sumsq(x, g, wshape, method="gram", backend=backend, **geom), want, 1e-4)


@pytest.mark.parametrize("padding_idx", [None, 2])
@pytest.mark.parametrize("with_scale_shift", [False, True], ids=["plain", "scale-shift"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_embedding(backend_device, padding_idx, with_scale_shift, dtype):
    backend, device = backend_device
    V, d, B, T = 11, 5, 4, 9
    ids = torch.randint(0, V, (B, T), device=device)
    ids[0, :3] = 4  # repeated ids within a sample are summed before squaring
    if padding_idx is not None:
        ids[1, 1] = padding_idx
    g = torch.randn(B, T, d, device=device).to(dtype)
    scale = torch.rand(V, d, device=device) + 0.5 if with_scale_shift else None
    shift = 0.2 * torch.randn(V, d, device=device) if with_scale_shift else None
    want = ref.embedding_sumsq(ids, g, V, padding_idx, scale, shift)
    out = L.embedding_sumsq(ids, g, V, padding_idx=padding_idx, scale=scale, shift=shift, backend=backend)
    _check_sumsq(out, want, 1e-5)
    w = torch.rand(B, device=device)
    s = L.embedding_weighted_sum(ids, g, w, V, padding_idx=padding_idx, backend=backend)
    assert s.dtype == torch.float32
    want_s = ref.embedding_weighted_sum(ids, g, w, V, padding_idx)
    torch.testing.assert_close(s.double().cpu(), want_s.cpu(), rtol=1e-5, atol=1e-6)


def test_embedding_expanded_position_ids(backend_device):
    """Position ids built with ``expand`` (stride 0 over the batch): Opacus's ghost norm views them."""
    backend, device = backend_device
    B, T, d = 3, 6, 4
    ids = torch.arange(T, device=device)[None].expand(B, T)
    g = torch.randn(B, T, d, device=device)
    _check_sumsq(L.embedding_sumsq(ids, g, T, backend=backend), ref.embedding_sumsq(ids.contiguous(), g, T), 1e-6)


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: L.linear_sumsq(torch.randn(3, 4), torch.randn(2, 5)), ValueError, "leading dimensions"),
        (lambda: L.linear_sumsq(torch.randn(3, 4), torch.randn(3, 5).double()), TypeError, "one dtype"),
        (lambda: L.linear_sumsq(torch.randn(3, 2, 4), torch.randn(3, 2, 5), method="t1"), ValueError, "T = 1"),
        (lambda: L.linear_sumsq(torch.randn(3, 4), torch.randn(3, 5), scale=torch.ones(4, 5)), ValueError, "shape"),
        (lambda: L.linear_sumsq(torch.randn(3, 2, 4), torch.randn(3, 2, 5), scale=torch.ones(5, 4), method="gram"),
         ValueError, "dense scale"),
        (lambda: L.linear_sumsq(torch.randn(3, 4), torch.randn(3, 5), method="fast"), ValueError, "unknown method"),
        (lambda: L.linear_sumsq(torch.randn(3), torch.randn(3)), ValueError, "dimensions"),
        (lambda: L.linear_sumsq(torch.ones(3, 4, dtype=torch.int32), torch.ones(3, 5, dtype=torch.int32)), TypeError,
         "float"),
        (lambda: L.linear_weighted_sum(torch.randn(3, 4), torch.randn(3, 5), torch.ones(2)), ValueError, r"\[B\]"),
        (lambda: L.embedding_sumsq(torch.tensor([[0, 7]]), torch.randn(1, 2, 3), 5), ValueError, "token ids"),
        (lambda: L.embedding_sumsq(torch.tensor([[0, 1]]), torch.randn(1, 3, 3), 5), ValueError, "g must be"),
        (lambda: L.conv2d_sumsq(torch.randn(2, 4, 5, 5), torch.randn(2, 3, 5, 5), (3, 5, 3, 3), padding=1), ValueError,
         "weight_shape"),
        (lambda: L.conv2d_sumsq(torch.randn(2, 4, 5, 5), torch.randn(2, 3, 4, 5), (3, 4, 3, 3), padding=1), ValueError,
         "output size"),
        (lambda: L.conv2d_sumsq(torch.randn(2, 4, 5, 5), torch.randn(2, 3, 5, 5), (3, 4, 3, 3), padding="same"),
         ValueError, "numeric"),
        (lambda: L.conv2d_sumsq(torch.randn(2, 4, 5, 5), torch.randn(2, 3, 5, 5), (3, 4, 3, 3), padding=1,
                                scale=torch.ones(3, 4, 3, 3), method="gram"), ValueError, "no scale"),
        (lambda: L.conv2d_sumsq(torch.randn(2, 4, 5, 5), torch.randn(2, 3, 5, 5), (3, 4, 3, 3), padding=1,
                                shift=torch.ones(3, 4, 3)), ValueError, "dimensions"),
        (lambda: L.conv2d_weighted_sum(torch.randn(2, 4, 5, 5), torch.randn(2, 3, 5, 5), torch.ones(3), (3, 4, 3, 3),
                                       padding=1), ValueError, r"\[B\]"),
    ],
)  # fmt: skip
def test_bad_input_raises(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_auto_method_choice():
    assert L._pick_method("auto", 1, 64, 64, True, "cpu") == "t1"
    assert L._pick_method("auto", 4, 256, 256, False, "cpu") == "gram"
    assert L._pick_method("auto", 4, 256, 256, True, "cpu") == "tiled"
    assert L._pick_method("auto", 512, 64, 64, False, "cpu") == "tiled"
    # the crossover per backend: the CPU's native Gram pass takes the Gram form further
    assert L._pick_method("auto", 128, 256, 256, False, "cpu") == "gram"
    assert L._pick_method("auto", 128, 256, 256, False, "cuda") == "tiled"
    # A shift: a form without the expansion's cancellation.
    assert L._pick_method("auto", 1, 64, 64, True, "cpu", True) == "t1"
    assert L._pick_method("auto", 1, 64, 64, True, "cuda", True) == "tiled"
    assert L._pick_method("auto", 4, 256, 256, False, "cpu", True) == "tiled"
    # conv (d_in = C_in·kh·kw): Gram at 2x2 with 256 channels, tiled from 4x4 and at 16x16 with 32
    # (CONV_GRAM_CROSSOVER, measured by tools/bk_crossover.py --conv)
    assert L._pick_conv_method("auto", 4, 256, 2304, False) == "gram"
    assert L._pick_conv_method("auto", 16, 256, 2304, False) == "tiled"
    assert L._pick_conv_method("auto", 16, 256, 2304, True) == "tiled"
    assert L._pick_conv_method("auto", 256, 32, 288, False) == "tiled"
    assert L._pick_conv_method("tiled", 16, 256, 2304, False) == "tiled"
    assert L._pick_conv_method("auto", 4, 256, 2304, False, True) == "tiled"
