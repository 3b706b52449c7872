"""The native ops ``dpkernels_C::linear_sumsq_tiled``, ``dpkernels_C::linear_sumsq_gram``,
``dpkernels_C::linear_sumsq_t1``,
``dpkernels_C::conv2d_sumsq_tiled``, ``dpkernels_C::conv2d_weighted_sum`` and
``dpkernels_C::conv2d_sumsq_grad_sample`` (csrc/cpu/layers.cpp,
csrc/cuda/layers.cu) against the float64 references ``dpkernels.reference.layers.linear_sumsq``,
``conv2d_sumsq``, ``conv2d_weighted_sum`` and ``conv2d_grad_samples``:
odd shapes (block, tile and chunk edges included), every dtype, with and without scale and shift,
strided channel views, determinism, bad input, and opcheck with the fake kernels registered in
``dpkernels/layers.py``."""

import pytest
import torch

import dpkernels  # noqa: F401  (loads dpkernels._C)
from dpkernels import _backend
from dpkernels.reference.layers import conv2d_grad_samples, conv2d_sumsq, conv2d_weighted_sum, linear_sumsq

pytestmark = pytest.mark.skipif(
    not _backend.has_cpu_kernels() or not hasattr(torch.ops.dpkernels_C, "linear_sumsq_tiled"),
    reason="C++ extension without linear_sumsq_tiled",
)


def _devices(op="linear_sumsq_tiled"):
    cuda_ok = torch.cuda.is_available() and torch._C._dispatch_has_kernel_for_dispatch_key(f"dpkernels_C::{op}", "CUDA")
    return ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not cuda_ok, reason="no CUDA kernel or GPU"))]


def _op(a, g, scale=None, shift=None):
    return torch.ops.dpkernels_C.linear_sumsq_tiled(a, g, scale, shift)


# (B, T, d_in, d_out): single elements, odd sizes, more than one CPU block (96 x 128) and CUDA tile
# (64 x 64) per sample, T = 0, and T past the CPU's 256-position chunk.
SHAPES = [
    (1, 1, 1, 1),
    (1, 4, 16, 16),
    (3, 5, 7, 13),
    (2, 33, 65, 70),
    (4, 16, 128, 96),
    (2, 3, 131, 197),
    (3, 0, 5, 9),
    (2, 300, 40, 20),
]
# Relative tolerance against the reference on the same (rounded) inputs: fp32 products and tile
# sums; 16-bit inputs are exact in fp32, so the same bound would do, with margin.
RTOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-3}


def _inputs(B, T, d_in, d_out, dtype, device, scale, shift, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(B, T, d_in, generator=gen).to(dtype)
    g = torch.randn(B, T, d_out, generator=gen).to(dtype)
    sc = torch.rand(d_out, d_in, generator=gen) + 0.5 if scale else None
    sh = 0.3 * torch.randn(d_out, d_in, generator=gen) if shift else None
    return _to(a, device), _to(g, device), _to(sc, device), _to(sh, device)


def _to(t, device):
    return None if t is None else t.to(device)


def _reference(a, g, sc, sh):
    """The float64 reference on the (rounded) inputs, upcast."""
    return linear_sumsq(a.float().cpu(), g.float().cpu(), _to(sc, "cpu"), _to(sh, "cpu"))


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", list(RTOL), ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_reference(shape, dtype, device):
    for scale in (False, True):
        for shift in (False, True):
            a, g, sc, sh = _inputs(*shape, dtype, device, scale, shift)
            out = _op(a, g, sc, sh)
            assert out.dtype == torch.float32 and out.shape == (shape[0],) and out.device == a.device
            assert not out.isnan().any()
            torch.testing.assert_close(
                out.cpu().double(),
                _reference(a, g, sc, sh),
                rtol=RTOL[dtype],
                atol=1e-30,
                msg=lambda m, s=scale, h=shift: f"scale={s} shift={h}: {m}",
            )


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_unaligned_views(dtype, device):
    """Contiguous views that start one element into their storage (the CUDA kernel's scalar path)."""
    B, T, d_in, d_out = 2, 9, 24, 40

    def shifted(*shape, dt=dtype):
        n = torch.Size(shape).numel()
        return torch.randn(n + 1, generator=gen).to(device=device, dtype=dt)[1:].view(shape)

    gen = torch.Generator().manual_seed(2)
    a, g = shifted(B, T, d_in), shifted(B, T, d_out)
    sc, sh = shifted(d_out, d_in, dt=torch.float32), shifted(d_out, d_in, dt=torch.float32)
    assert a.is_contiguous() and a.storage_offset() == 1
    torch.testing.assert_close(_op(a, g, sc, sh).cpu().double(), _reference(a, g, sc, sh), rtol=RTOL[dtype], atol=0)


@pytest.mark.parametrize("device", _devices())
def test_deterministic(device):
    a, g, sc, sh = _inputs(5, 40, 200, 150, torch.float32, device, True, True, seed=1)
    first = _op(a, g, sc, sh)
    assert torch.equal(first, _op(a, g, sc, sh))
    if device == "cpu":
        # Per-(sample, block) partials summed in block order: the thread count does not matter.
        assert torch.equal(first, _on_one_thread(lambda: _op(a, g, sc, sh)))


def _on_one_thread(fn):
    """``fn()`` with the CPU ops limited to one thread."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        return fn()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("device", _devices())
def test_zero_sized(device):
    a, g, _, sh = _inputs(0, 3, 4, 5, torch.float32, device, False, True)
    assert _op(a, g, None, sh).shape == (0,)
    a, g, _, _ = _inputs(2, 3, 0, 5, torch.float32, device, False, False)
    assert torch.equal(_op(a, g), torch.zeros(2, device=device))


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: (torch.randn(2, 3), torch.randn(2, 3, 4), None, None), "a must be 3-D"),
        (lambda: (torch.randn(2, 3, 4), torch.randn(2, 4), None, None), "g must be 3-D"),
        (lambda: (torch.randn(2, 3, 4), torch.randn(3, 3, 5), None, None), "same batch size"),
        (lambda: (torch.randn(2, 3, 4), torch.randn(2, 2, 5), None, None), "same sequence length"),
        (lambda: (torch.randn(2, 3, 4), torch.randn(2, 3, 5).half(), None, None), "same dtype"),
        (lambda: (torch.randn(2, 3, 4).double(), torch.randn(2, 3, 5).double(), None, None), "supported"),
        (lambda: (torch.randn(2, 3, 4), torch.randn(2, 3, 5), torch.rand(4, 5), None), r"scale must be \[d_out"),
        (lambda: (torch.randn(2, 3, 4), torch.randn(2, 3, 5), None, torch.rand(5 * 4)), r"shift must be \[d_out"),
        (lambda: (torch.randn(2, 3, 4), torch.randn(2, 3, 5), torch.rand(5, 4).double(), None), "must be float32"),
        (lambda: (torch.randn(2, 3, 4), torch.randn(2, 3, 5), None, torch.rand(4, 5).T), "must be contiguous"),
        (lambda: (torch.randn(2, 4, 3).transpose(1, 2), torch.randn(2, 3, 5), None, None), "a must be contiguous"),
    ],
)
def test_bad_input(make, match):
    with pytest.raises(RuntimeError, match=match):
        _op(*make())


def test_opcheck():

    a, g, sc, sh = _inputs(3, 5, 7, 13, torch.float32, "cpu", True, True)
    op = torch.ops.dpkernels_C.linear_sumsq_tiled.default
    for args in ((a, g, sc, sh), (a, g, None, None), (a.bfloat16(), g.bfloat16(), None, sh)):
        # test_aot_dispatch_dynamic needs a backward; the op is not differentiable.
        results = torch.library.opcheck(
            op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static")
        )
        assert all(v == "SUCCESS" for v in results.values()), results


# linear_sumsq_gram (CPU only: CUDA's Gram form is cuBLAS's batched GEMMs). The linear shapes, and
# T = 64 (four whole position panels) with d not a multiple of the 4 x 4 transposes.
GRAM_SHAPES = [*SHAPES, (3, 64, 190, 33), (2, 17, 4, 3)]


def _gram_reference(a, g):
    """The float64 norms and the bound of the Gram form's rounding, ⟨|A||A|ᵀ, |G||G|ᵀ⟩ (the same sum
    of absolute values): its terms cancel, so the bound is not the result."""
    a, g = a.double(), g.double()
    return linear_sumsq(a, g), linear_sumsq(a.abs(), g.abs())


@pytest.mark.parametrize("dtype", list(RTOL), ids=str)
@pytest.mark.parametrize("shape", GRAM_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gram_matches_reference(shape, dtype):
    a, g, _, _ = _inputs(*shape, dtype, "cpu", False, False)
    out = torch.ops.dpkernels_C.linear_sumsq_gram(a, g)
    ref, bound = _gram_reference(a, g)
    assert out.dtype == torch.float32 and out.shape == (shape[0],)
    assert bool((out.double() - ref).abs().le(1e-5 * bound + 1e-30).all()), (out.double() - ref).abs().max()


def test_gram_deterministic_and_zero_sized():
    """Per-(sample, position panel) partials summed in panel order: the same bits on any thread count."""
    a, g, _, _ = _inputs(3, 70, 50, 30, torch.float32, "cpu", False, False, seed=4)
    first = torch.ops.dpkernels_C.linear_sumsq_gram(a, g)
    assert torch.equal(first, torch.ops.dpkernels_C.linear_sumsq_gram(a, g))
    assert torch.equal(first, _on_one_thread(lambda: torch.ops.dpkernels_C.linear_sumsq_gram(a, g)))
    assert torch.ops.dpkernels_C.linear_sumsq_gram(a[:0], g[:0]).shape == (0,)
    for a0, g0 in ((a[:, :0], g[:, :0]), (a[..., :0], g)):
        assert torch.equal(torch.ops.dpkernels_C.linear_sumsq_gram(a0, g0), torch.zeros(3))


@pytest.mark.parametrize(
    "a, g, match",
    [
        (torch.randn(2, 3), torch.randn(2, 3, 4), "a must be 3-D"),
        (torch.randn(2, 3, 4), torch.randn(2, 2, 5), "same sequence length"),
        (torch.randn(2, 3, 4).double(), torch.randn(2, 3, 5).double(), "supported"),
        (torch.randn(2, 4, 3).transpose(1, 2), torch.randn(2, 3, 5), "a must be contiguous"),
    ],
)
def test_gram_bad_input(a, g, match):
    with pytest.raises(RuntimeError, match="linear_sumsq_gram: .*" + match):
        torch.ops.dpkernels_C.linear_sumsq_gram(a, g)


def test_gram_opcheck():
    a, g, _, _ = _inputs(3, 5, 7, 13, torch.float32, "cpu", False, False)
    op = torch.ops.dpkernels_C.linear_sumsq_gram.default
    for args in ((a, g), (a.half(), g.half())):
        results = torch.library.opcheck(
            op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static")
        )
        assert all(v == "SUCCESS" for v in results.values()), results


# linear_sumsq_t1 (CPU only: CUDA's T = 1 norms are cuBLAS GEMMs). (B, d_in, d_out): single elements;
# B not a multiple of either tile's samples (6, or 2 and 4 with a shift); d_in past one 128-column
# block and not a multiple of a 16- or 8-column panel; d_out past one 256-row block; B past the
# 6-sample tile with d_out < 256.
T1_SHAPES = [(1, 1, 1), (3, 7, 13), (7, 300, 260), (13, 17, 600), (6, 129, 257), (64, 40, 10)]
T1_FORMS = [(True, False), (True, True), (False, True)]  # (scale, shift): the GEMM form, then the elementwise one


def _t1_op(a, g, scale=None, shift=None):
    return torch.ops.dpkernels_C.linear_sumsq_t1(a, g, scale, shift)


@pytest.mark.parametrize("dtype", list(RTOL), ids=str)
@pytest.mark.parametrize("shape", T1_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_t1_matches_reference(shape, dtype):
    """Scale only: Σ S²g²a², non-negative terms; with a shift every element formed and squared. Both
    meet the tiled kernel's tolerance, and agree with it."""
    B, d_in, d_out = shape
    for scale, shift in T1_FORMS:
        a, g, sc, sh = _inputs(B, 1, d_in, d_out, dtype, "cpu", scale, shift, seed=5)
        out = _t1_op(a[:, 0], g[:, 0], sc, sh)
        assert out.dtype == torch.float32 and out.shape == (B,)
        msg = lambda m, sc=scale, sh=shift: f"scale={sc} shift={sh}: {m}"  # noqa: E731
        torch.testing.assert_close(out.double(), _reference(a, g, sc, sh), rtol=RTOL[dtype], atol=1e-30, msg=msg)
        torch.testing.assert_close(out, _op(a, g, sc, sh), rtol=2 * RTOL[dtype], atol=1e-30, msg=msg)


def test_t1_shift_does_not_cancel():
    """A sample whose gradient g aᵀ is within 0.1% of the shift, element by element: the norm is 1e-6
    of ‖S⊙g aᵀ‖², which the expansion ‖S⊙g aᵀ‖² − 2⟨S²⊙M, g aᵀ⟩ + ‖S⊙M‖² in fp32 cannot resolve
    (its error here is ~4e-3 of the norm); the elementwise form keeps the fp32 rounding of each
    element."""
    gen = torch.Generator().manual_seed(8)
    a, g = 30 * torch.randn(4, 256, generator=gen), 30 * torch.randn(4, 256, generator=gen)
    sc = torch.rand(256, 256, generator=gen) + 0.5
    sh = torch.outer(g[0], a[0]) * (1 + 1e-3 * torch.randn(256, 256, generator=gen))
    want = linear_sumsq(a[:, None], g[:, None], sc, sh)
    assert want[0] < 1e-5 * linear_sumsq(a[:1, None], g[:1, None], sc)[0]
    torch.testing.assert_close(_t1_op(a, g, sc, sh).double(), want, rtol=1e-5, atol=0)


def test_t1_nonfinite_sample_stays_its_own():
    """A non-finite input row makes that sample's norm non-finite (the engine then raises or drops
    it) and leaves every other sample's bits unchanged: tiles share the scale, never samples' rows."""
    for scale, shift in T1_FORMS:
        a, g, sc, sh = _inputs(9, 1, 70, 300, torch.float32, "cpu", scale, shift, seed=9)
        a, g = a[:, 0].clone(), g[:, 0].clone()
        clean = _t1_op(a, g, sc, sh)
        a[4, 3], g[7, 11] = float("inf"), float("nan")
        out = _t1_op(a, g, sc, sh)
        bad = torch.zeros(9, dtype=torch.bool)
        bad[[4, 7]] = True
        assert not out[bad].isfinite().any()
        assert torch.equal(out[~bad], clean[~bad])


def test_t1_deterministic_and_zero_sized():
    """Per-(block, sample) partials summed in block order: the same bits on any thread count."""
    for scale, shift in T1_FORMS:
        a, g, sc, sh = _inputs(9, 1, 300, 520, torch.float32, "cpu", scale, shift, seed=6)
        a, g = a[:, 0], g[:, 0]
        first = _t1_op(a, g, sc, sh)
        assert torch.equal(first, _t1_op(a, g, sc, sh))
        assert torch.equal(first, _on_one_thread(lambda a=a, g=g, sc=sc, sh=sh: _t1_op(a, g, sc, sh)))
        assert _t1_op(a[:0], g[:0], sc, sh).shape == (0,)
        cols = lambda t: None if t is None else t[:, :0].contiguous()  # noqa: E731
        rows = lambda t: None if t is None else t[:0]  # noqa: E731
        assert torch.equal(_t1_op(a[:, :0], g, cols(sc), cols(sh)), torch.zeros(9))
        assert torch.equal(_t1_op(a, g[:, :0], rows(sc), rows(sh)), torch.zeros(9))


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: (torch.randn(2, 1, 3), torch.randn(2, 4), torch.rand(4, 3), None), "a must be 2-D"),
        (lambda: (torch.randn(2, 3), torch.randn(2, 1, 4), torch.rand(4, 3), None), "g must be 2-D"),
        (lambda: (torch.randn(2, 3), torch.randn(2, 4), None, None), "a dense scale, a shift or both"),
        (lambda: (torch.randn(2, 3), torch.randn(3, 4), torch.rand(4, 3), None), "same batch size"),
        (lambda: (torch.randn(2, 3), torch.randn(2, 4).half(), torch.rand(4, 3), None), "same dtype"),
        (lambda: (torch.randn(2, 3), torch.randn(2, 4), torch.rand(3, 4), None), r"scale must be \[d_out"),
        (lambda: (torch.randn(2, 3), torch.randn(2, 4), None, torch.rand(3, 4)), r"shift must be \[d_out"),
        (lambda: (torch.randn(2, 3), torch.randn(2, 4), torch.rand(4, 3).double(), None), "must be float32"),
        (lambda: (torch.randn(2, 3), torch.randn(2, 4), None, torch.rand(3, 4).T), "must be contiguous"),
        (lambda: (torch.randn(3, 2).T, torch.randn(2, 4), torch.rand(4, 3), None), "a must be contiguous"),
    ],
)
def test_t1_bad_input(make, match):
    with pytest.raises(RuntimeError, match="linear_sumsq_t1: .*" + match):
        _t1_op(*make())


def test_t1_opcheck():
    a, g, sc, sh = _inputs(3, 1, 7, 13, torch.float32, "cpu", True, True)
    a, g = a[:, 0], g[:, 0]
    op = torch.ops.dpkernels_C.linear_sumsq_t1.default
    for args in ((a, g, sc, None), (a, g, sc, sh), (a.bfloat16(), g.bfloat16(), None, sh)):
        results = torch.library.opcheck(
            op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static")
        )
        assert all(v == "SUCCESS" for v in results.values()), results


# conv2d_sumsq_tiled. (B, C, H, W, O, kernel, stride, padding, dilation): a 3x3 "same" conv; more than
# one CUDA tile along d_in = C kh kw (81) and d_out (70), T = 90 ending inside a 16-position chunk;
# stride and dilation on both axes, asymmetric kernel and padding; a 1x1 conv; padding past the
# kernel's reach (output positions whose patch lies wholly outside the image); for the CPU's direct
# kernel more than one block along O (150 channels: 5 panels of 32, 10 of 16) and along the columns
# (three 120-column kernel rows), and several chunks of whole output rows (T = 380 > 256), one of
# them a 300-position row.
CONV_SHAPES = [
    (2, 3, 7, 6, 5, (3, 3), (1, 1), (1, 1), (1, 1)),
    (2, 9, 10, 9, 70, (3, 3), (1, 1), (1, 1), (1, 1)),
    (1, 8, 9, 11, 6, (2, 3), (2, 1), (0, 2), (1, 1)),
    (3, 4, 8, 8, 7, (3, 3), (2, 2), (2, 2), (2, 2)),
    (2, 5, 4, 6, 3, (1, 1), (1, 1), (0, 0), (1, 1)),
    (1, 2, 3, 3, 4, (2, 2), (1, 1), (3, 3), (1, 1)),
    (2, 40, 20, 19, 150, (3, 3), (1, 1), (1, 1), (1, 1)),
    (1, 3, 3, 600, 5, (3, 3), (1, 2), (1, 1), (1, 1)),
]


def _conv_out(size, k, s, p, d):
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


def _conv_inputs(shape, dtype, device, scale, shift, seed=0, extra_channels=0):
    """x and g; with extra_channels, channel slices of larger tensors (batch stride != C H W)."""
    B, C, H, W, C_out, ks, st, pd, dl = shape
    gen = torch.Generator().manual_seed(seed)
    Ho, Wo = _conv_out(H, ks[0], st[0], pd[0], dl[0]), _conv_out(W, ks[1], st[1], pd[1], dl[1])
    e = extra_channels
    # moved before slicing: .to(device) of a slice copies it into a contiguous tensor
    x = _to(torch.randn(B, C + 2 * e, H, W, generator=gen).to(dtype), device)[:, e : e + C]
    g = _to(torch.randn(B, C_out + 2 * e, Ho, Wo, generator=gen).to(dtype), device)[:, e : e + C_out]
    sc = torch.rand(C_out, C * ks[0] * ks[1], generator=gen) + 0.5 if scale else None
    sh = 0.3 * torch.randn(C_out, C * ks[0] * ks[1], generator=gen) if shift else None
    return x, g, _to(sc, device), _to(sh, device)


def _conv_op(x, g, shape, sc=None, sh=None):
    ks, st, pd, dl = shape[5:]
    return torch.ops.dpkernels_C.conv2d_sumsq_tiled(x, g, ks, st, pd, dl, sc, sh)


def _conv_reference(x, g, shape, sc, sh):
    C_out, ks, st, pd, dl = shape[4:]
    w = (C_out, x.shape[1], *ks)
    sc, sh = (None if t is None else t.cpu().reshape(w) for t in (sc, sh))
    return conv2d_sumsq(x.float().cpu(), g.float().cpu(), w, st, pd, dl, 1, sc, sh)


@pytest.mark.parametrize("device", _devices("conv2d_sumsq_tiled"))
@pytest.mark.parametrize("dtype", list(RTOL), ids=str)
@pytest.mark.parametrize("shape", CONV_SHAPES, ids=lambda s: "x".join(map(str, s[:5])) + f"-k{s[5][0]}{s[5][1]}")
def test_conv_matches_reference(shape, dtype, device):
    for scale in (False, True):
        for shift in (False, True):
            x, g, sc, sh = _conv_inputs(shape, dtype, device, scale, shift)
            out = _conv_op(x, g, shape, sc, sh)
            assert out.dtype == torch.float32 and out.shape == (shape[0],) and out.device == x.device
            torch.testing.assert_close(
                out.cpu().double(),
                _conv_reference(x, g, shape, sc, sh),
                rtol=RTOL[dtype],
                atol=1e-30,
                msg=lambda m, s=scale, h=shift: f"scale={s} shift={h}: {m}",
            )


@pytest.mark.parametrize("device", _devices("conv2d_sumsq_tiled"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_conv_channel_slices(dtype, device):
    """x and g read in place as channel slices (a group's view): batch and channel strides are free."""
    shape = CONV_SHAPES[1]
    x, g, sc, sh = _conv_inputs(shape, dtype, device, True, True, seed=3, extra_channels=2)
    assert not x.is_contiguous() and not g.is_contiguous()
    out = _conv_op(x, g, shape, sc, sh)
    torch.testing.assert_close(out.cpu().double(), _conv_reference(x, g, shape, sc, sh), rtol=RTOL[dtype], atol=0)
    assert torch.equal(out, _conv_op(x.contiguous(), g.contiguous(), shape, sc, sh))
    assert torch.equal(out, _conv_op(x, g, shape, sc, sh))  # deterministic


@pytest.mark.parametrize("device", _devices("conv2d_sumsq_tiled"))
def test_conv_rejects_strided_planes(device):
    x, g, _, _ = _conv_inputs(CONV_SHAPES[0], torch.float32, device, False, False)
    with pytest.raises(RuntimeError, match="contiguous H x W plane"):
        _conv_op(x.contiguous(memory_format=torch.channels_last), g, CONV_SHAPES[0])


def test_conv_opcheck():
    shape = CONV_SHAPES[2]
    x, g, sc, sh = _conv_inputs(shape, torch.float32, "cpu", True, True, extra_channels=1)
    geometry = [list(v) for v in shape[5:]]
    op = torch.ops.dpkernels_C.conv2d_sumsq_tiled.default
    for args in ((x, g, *geometry, sc, sh), (x.bfloat16(), g.bfloat16(), *geometry, None, sh)):
        results = torch.library.opcheck(
            op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static")
        )
        assert all(v == "SUCCESS" for v in results.values()), results


# conv2d_weighted_sum (CPU only: CUDA's clipped sum of a conv is cuDNN's weight gradient). The same
# shapes, batch sizes that leave the last sample group short (5, 9 over four groups) and B = 1.
WSUM_SHAPES = [
    *CONV_SHAPES,
    (5, 6, 9, 7, 8, (2, 3), (1, 1), (0, 1), (1, 2)),
    (9, 3, 5, 5, 4, (3, 3), (1, 1), (1, 1), (1, 1)),
]


def _wsum_op(x, g, w, shape):
    return torch.ops.dpkernels_C.conv2d_weighted_sum(x, g, w, *shape[5:])


def _wsum_reference(x, g, w, shape):
    """The float64 reference and the bound of its rounding: Σ_i |w_i| |g_i|ᵀ|x_i| (the same sum of
    absolute values), so that the tolerance holds for the entries that cancel."""
    C_out, ks, st, pd, dl = shape[4:]
    ws = (C_out, x.shape[1], *ks)
    x, g = x.double().cpu(), g.double().cpu()
    ref = conv2d_weighted_sum(x, g, w.cpu(), ws, st, pd, dl, 1)
    return ref, conv2d_weighted_sum(x.abs(), g.abs(), w.cpu().abs(), ws, st, pd, dl, 1)


@pytest.mark.parametrize("dtype", list(RTOL), ids=str)
@pytest.mark.parametrize("shape", WSUM_SHAPES, ids=lambda s: "x".join(map(str, s[:5])) + f"-k{s[5][0]}{s[5][1]}")
def test_conv_weighted_sum_matches_reference(shape, dtype):
    x, g, _, _ = _conv_inputs(shape, dtype, "cpu", False, False)
    # weights of both signs, one of them 0 (a dropped sample)
    w = torch.randn(shape[0], generator=torch.Generator().manual_seed(1))
    w[0] = 0.0
    out = _wsum_op(x, g, w, shape)
    ref, bound = _wsum_reference(x, g, w, shape)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert bool((out.double() - ref).abs().le(1e-5 * bound + 1e-30).all()), (out.double() - ref).abs().max()


def test_conv_weighted_sum_channel_slices_and_determinism():
    """x and g read in place as channel slices; partial sums over fixed sample groups, added in
    group order: the same bits for any thread count and memory layout."""
    shape = (9, 40, 20, 19, 150, (3, 3), (1, 1), (1, 1), (1, 1))
    x, g, _, _ = _conv_inputs(shape, torch.float32, "cpu", False, False, seed=3, extra_channels=2)
    assert not x.is_contiguous() and not g.is_contiguous()
    w = torch.rand(9, generator=torch.Generator().manual_seed(2))
    out = _wsum_op(x, g, w, shape)
    ref, bound = _wsum_reference(x, g, w, shape)
    assert bool((out.double() - ref).abs().le(1e-5 * bound).all())
    assert torch.equal(out, _wsum_op(x.contiguous(), g.contiguous(), w, shape))
    assert torch.equal(out, _on_one_thread(lambda: _wsum_op(x, g, w, shape)))


def test_conv_weighted_sum_zero_sized():
    x, g, _, _ = _conv_inputs(CONV_SHAPES[0], torch.float32, "cpu", False, False)
    out = _wsum_op(x[:0], g[:0], torch.zeros(0), CONV_SHAPES[0])
    assert out.shape == (5, 3, 3, 3) and not out.any()


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(w=torch.rand(3)), r"weights must be \[B\] = \[2\]"),
        (dict(w=torch.rand(2).double()), "weights must be float32"),
        (dict(w=torch.rand(4)[::2]), "weights must be contiguous"),
        (dict(x=torch.randn(2, 3, 7, 6).double()), "supported"),
        (dict(g=torch.randn(2, 5, 6, 6)), "not the convolution's output size"),
    ],
)
def test_conv_weighted_sum_bad_input(change, match):
    x, g, _, _ = _conv_inputs(CONV_SHAPES[0], torch.float32, "cpu", False, False)
    args = dict(x=x, g=g, w=torch.rand(2)) | change
    if args["x"].dtype != torch.float32:
        args["g"] = args["g"].to(args["x"].dtype)
    with pytest.raises(RuntimeError, match=match):
        _wsum_op(args["x"], args["g"], args["w"], CONV_SHAPES[0])


def test_conv_weighted_sum_opcheck():
    shape = CONV_SHAPES[2]
    x, g, _, _ = _conv_inputs(shape, torch.float32, "cpu", False, False, extra_channels=1)
    op = torch.ops.dpkernels_C.conv2d_weighted_sum.default
    w = torch.rand(shape[0])
    for args in ((x, g, w, *[list(v) for v in shape[5:]]), (x.half(), g.half(), w, *[list(v) for v in shape[5:]])):
        results = torch.library.opcheck(
            op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static")
        )
        assert all(v == "SUCCESS" for v in results.values()), results


# conv2d_sumsq_grad_sample (CPU only): conv2d_sumsq_tiled's norms and the per-sample gradients they
# square. The same shapes: O = 5, 70, 150 leave the last 16-channel panel part full.
def _grad_sample_op(x, g, shape, sc=None, sh=None):
    return torch.ops.dpkernels_C.conv2d_sumsq_grad_sample(x, g, *shape[5:], sc, sh)


def _grad_sample_reference(x, g, shape):
    """The float64 per-sample gradients and the bound of their rounding, |g_i|ᵀ|x_i|."""
    C_out, ks, st, pd, dl = shape[4:]
    ws = (C_out, x.shape[1], *ks)
    x, g = x.double().cpu(), g.double().cpu()
    return conv2d_grad_samples(x, g, ws, st, pd, dl, 1), conv2d_grad_samples(x.abs(), g.abs(), ws, st, pd, dl, 1)


@pytest.mark.parametrize("dtype", list(RTOL), ids=str)
@pytest.mark.parametrize("shape", WSUM_SHAPES, ids=lambda s: "x".join(map(str, s[:5])) + f"-k{s[5][0]}{s[5][1]}")
def test_conv_grad_sample_matches_reference(shape, dtype):
    """The norms are conv2d_sumsq_tiled's, bit for bit (the same kernel), with and without scale and
    shift; the per-sample gradients, unscaled and unshifted, match the reference, in the weight's
    shape, stored [B, kh, kw, C, O]."""
    ref, bound = None, None
    for scale, shift in ((False, False), (True, False), (True, True)):
        x, g, sc, sh = _conv_inputs(shape, dtype, "cpu", scale, shift)
        sq, gs = _grad_sample_op(x, g, shape, sc, sh)
        assert sq.dtype == torch.float32 and torch.equal(sq, _conv_op(x, g, shape, sc, sh))
        if ref is None:
            ref, bound = _grad_sample_reference(x, g, shape)
        assert gs.dtype == torch.float32 and gs.shape == ref.shape
        assert gs.permute(0, 3, 4, 2, 1).is_contiguous()
        err = (gs.double() - ref).abs()
        assert bool(err.le(1e-5 * bound + 1e-30).all()), (scale, shift, err.max())


def test_conv_grad_sample_channel_slices_and_determinism():
    """x and g read in place as channel slices; every sample's gradient written by its own tasks:
    the same bits for any thread count and memory layout."""
    shape = (3, 40, 20, 19, 150, (3, 3), (1, 1), (1, 1), (1, 1))
    x, g, sc, _ = _conv_inputs(shape, torch.float32, "cpu", True, False, seed=3, extra_channels=2)
    assert not x.is_contiguous() and not g.is_contiguous()
    sq, gs = _grad_sample_op(x, g, shape, sc)
    ref, bound = _grad_sample_reference(x, g, shape)
    assert bool((gs.double() - ref).abs().le(1e-5 * bound).all())
    for other in (_grad_sample_op(x.contiguous(), g.contiguous(), shape, sc),
                  _on_one_thread(lambda: _grad_sample_op(x, g, shape, sc))):  # fmt: skip
        assert torch.equal(sq, other[0]) and torch.equal(gs, other[1])


def test_conv_grad_sample_zero_sized():
    x, g, _, _ = _conv_inputs(CONV_SHAPES[0], torch.float32, "cpu", False, False)
    sq, gs = _grad_sample_op(x[:0], g[:0], CONV_SHAPES[0])
    assert sq.shape == (0,) and gs.shape == (0, 5, 3, 3, 3)
    sq, gs = _grad_sample_op(x[:, :0], g, CONV_SHAPES[0])
    assert sq.shape == (2,) and not sq.any() and gs.shape == (2, 5, 0, 3, 3)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(x=torch.randn(2, 3, 7, 6).double()), "supported"),
        (dict(g=torch.randn(2, 5, 6, 6)), "not the convolution's output size"),
        (dict(sc=torch.rand(5, 26)), r"scale must be \[d_out, d_in\] = \[5, 27\]"),
    ],
)
def test_conv_grad_sample_bad_input(change, match):
    x, g, _, _ = _conv_inputs(CONV_SHAPES[0], torch.float32, "cpu", False, False)
    args = dict(x=x, g=g, sc=None) | change
    if args["x"].dtype != torch.float32:
        args["g"] = args["g"].to(args["x"].dtype)
    with pytest.raises(RuntimeError, match=r"conv2d_sumsq_grad_sample: .*" + match):
        _grad_sample_op(args["x"], args["g"], CONV_SHAPES[0], args["sc"])


def test_conv_grad_sample_opcheck():
    shape = CONV_SHAPES[2]
    x, g, sc, sh = _conv_inputs(shape, torch.float32, "cpu", True, True, extra_channels=1)
    op = torch.ops.dpkernels_C.conv2d_sumsq_grad_sample.default
    geometry = [list(v) for v in shape[5:]]
    for args in ((x, g, *geometry, sc, sh), (x.bfloat16(), g.bfloat16(), *geometry, None, None)):
        results = torch.library.opcheck(
            op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static")
        )
        assert all(v == "SUCCESS" for v in results.values()), results
