"""Property tests (hypothesis) of the privacy guarantee, for every public op that clips or adds noise.

Random batches for ``clip_and_accumulate``, ``privatize``, the three stages (``per_sample_norms``,
``clip_factors``, ``weighted_sum``), ``gaussian_noise``/``add_gaussian_noise_`` and one step of each
optimizer of :mod:`dpkernels.optim`: lists of one larger tensor next to tiny ones, ``B`` from 0 up,
every supported dtype, sample magnitudes from exact zeros and subnormals up to 3e38 (whose squares
overflow fp32; fp16 up to 6e4, whose squares overflow fp16), NaN/±Inf in chosen samples, strided,
transposed and batch-expanded views, every clip mode, per-layer bounds, shift and scale. Asserted:

- each sample's contribution ``c_i·(v_i − shift)⊙scale``, formed in float64 from the per-sample
  weights the pipeline used, has norm at most the documented bound (:func:`dpkernels.clip_factors`:
  ``C·(1 + 2^-21) + √D·2^-150``), and the returned sum is ``Σ_i c_i v_i`` up to fp32 accumulation;
- the noise is exactly the documented stream: ``privatize`` returns ``(S + σΔz)/B`` bit for bit
  with ``S`` from ``clip_and_accumulate`` and ``σΔz`` from ``gaussian_noise`` with the same key,
  whatever the input (dropped, zero or huge samples); ``add_gaussian_noise_`` adds that stream;
  an optimizer step moves the parameters by ``lr·privatize(...)``;
- a rejected input raises a ``ValueError``/``TypeError`` naming the problem and leaves inputs,
  parameters, optimizer state and the step counter bit-identical;
- ``nonfinite="drop"`` gives exactly the named samples weight 0 and the others the weights, norms
  and sums they get when the dropped samples are left out.

Each property runs ``@examples(n)`` derandomized examples (the same on every backend; the tensors
stay tiny because Triton runs in the interpreter here), so CI is reproducible. Known failures are
strict xfail: the Triton interpreter flushes bf16 subnormals (left out of the Triton examples).
"""

import math
import os
import re

import pytest
import torch
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st
from test_clip_privacy import MODES, bound, bounds, magnitudes

import dpkernels
import dpkernels.optim as optim
from dpkernels.clip import CLIP
from dpkernels.reference.noise import chacha20_standard_normal, round_once

# Derandomized (CI reproducible), no deadline, and no shrinking: shrinking a failure on the
# interpreted Triton backend took minutes; the failing example is reported as drawn.
settings.register_profile(
    "dpkernels-fuzz",
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
    phases=[Phase.explicit, Phase.generate],
)
PROFILE = settings.get_profile("dpkernels-fuzz")


def examples(n):
    """The profile with ``n`` examples per backend (CI budget: Triton runs in the interpreter)."""
    return settings(PROFILE, max_examples=n)


NAN, INF = float("nan"), float("inf")
FP32_MAX = torch.finfo(torch.float32).max
TINY_SHAPES = [(), (1,), (2,), (3, 1), (2, 2)]
LARGE_SHAPES = [(37, 29), (1031,), (5, 13)]
LAYOUTS = ("contiguous", "strided", "transposed", "expanded")
BF16_TINY = torch.finfo(torch.bfloat16).tiny
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _dtypes(backend):
    return [torch.float32, torch.float16, torch.bfloat16] + ([torch.float64] if backend == "reference" else [])


def _view(x, layout):
    """The same values as ``x`` in another memory layout."""
    if layout == "expanded" and x.shape[0]:  # every sample equals sample 0 (batch stride 0)
        return x[:1].expand_as(x)
    if layout == "transposed" and x.dim() >= 2:
        return x.transpose(0, -1).contiguous().transpose(0, -1)
    if layout in ("strided", "transposed"):
        base = torch.zeros(*x.shape, 2, dtype=x.dtype)
        base[..., 1] = x
        return base[..., 1]
    return x


@st.composite
def gradients(draw, backend, B=None, dtype=None, shapes=None, nonfinite=True):
    """``(grads, bad)``: per-sample gradients ``[B, *shape]`` (one dtype) and the sorted indices of the
    samples with a NaN/Inf. Sample ``i`` has elements ``m_i·u`` (``u`` uniform in [−1, 1], or 1)."""
    dtype = draw(st.sampled_from(_dtypes(backend))) if dtype is None else dtype
    B = draw(st.sampled_from([0, 1, 1, 2, 3, 5])) if B is None else B
    if shapes is None:
        L = draw(st.integers(1, 5))
        large_at = draw(st.integers(0, L))  # L: only tiny tensors
        shapes = [draw(st.sampled_from(LARGE_SHAPES if j == large_at else TINY_SHAPES)) for j in range(L)]
    mags = [draw(magnitudes) for _ in range(B)]
    if dtype == torch.float16:  # fp16 tops out at 65504; 6e4 still overflows when squared
        mags = [min(m, 6e4) for m in mags]
    if dtype == torch.bfloat16 and backend == "triton" and INTERPRETED:  # test_triton_bf16_subnormals
        mags = [0.0 if m < BF16_TINY else m for m in mags]
    const = draw(st.booleans())
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    m = torch.tensor(mags, dtype=torch.float64)
    grads = []
    for s in shapes:
        u = (
            torch.ones(B, *s, dtype=torch.float64)
            if const
            else 2 * torch.rand(B, *s, generator=gen, dtype=torch.float64) - 1
        )
        grads.append((m.view(B, *[1] * len(s)) * u).to(dtype))
    if nonfinite and B and draw(st.integers(0, 2)) == 0:  # a third of the batches
        for i in draw(st.sets(st.integers(0, B - 1), max_size=2)):
            j = draw(st.integers(0, len(shapes) - 1))
            rows(grads[j])[i, draw(st.integers(0, grads[j][0].numel() - 1))] = draw(st.sampled_from([NAN, INF, -INF]))
    grads = [_view(g, draw(st.sampled_from(LAYOUTS))) for g in grads]
    return grads, nonfinite_samples(grads)


def to_device(ts, device):
    """``ts`` on ``device`` with their strides kept (``.to`` copies a view into a contiguous tensor,
    which would leave the strided layouts untested on the GPU)."""
    out = []
    for t in ts:
        storage = t.untyped_storage()
        flat = t.new_empty(0).set_(storage, 0, (storage.nbytes() // t.element_size(),))
        out.append(flat.to(device).as_strided(t.shape, t.stride(), t.storage_offset()))
    return out


def rows(v):
    """``[B, D]`` (explicit D: ``-1`` is ambiguous for ``B = 0``)."""
    return v.reshape(v.shape[0], math.prod(v.shape[1:]))


def nonfinite_samples(vecs):
    """Sorted indices of the samples with a NaN/Inf in any of ``vecs`` (``[B, ...]`` each)."""
    bad = torch.zeros(vecs[0].shape[0], dtype=torch.bool, device=vecs[0].device)
    for v in vecs:
        bad |= ~torch.isfinite(rows(v)).all(dim=1)
    return torch.nonzero(bad).flatten().tolist()


def nonfinite_message(what, idx):
    """The documented error naming the samples (dpkernels.reference.clip.check_nonfinite)."""
    return re.escape(f"non-finite {what} for {len(idx)} sample(s) at batch indices [{', '.join(map(str, idx))}]")


@st.composite
def clip_args(draw, L, affine=True):
    """``(C, mode, r, per_layer, shift_scale)``; ``shift_scale`` draws the vectors for given shapes."""
    mode, r = draw(st.sampled_from(MODES))
    if r is not None:
        r = draw(st.sampled_from([1e-4, 0.01, 0.1, 1.0]))
    per_layer = draw(st.booleans())
    C = [draw(bounds) for _ in range(L)] if per_layer and draw(st.booleans()) else draw(bounds)
    which = draw(st.sampled_from(["none", "shift", "scale", "both"])) if affine else "none"
    vec_seed = draw(st.integers(0, 2**32 - 1))
    shift_mag = draw(st.sampled_from([0.0, 1e-3, 1.0, 1e30]))
    scale_mag = draw(st.sampled_from([1e-20, 1e-3, 1.0, 1e3, 1e20]))

    def shift_scale(shapes, device):
        gen = torch.Generator().manual_seed(vec_seed)
        shift = [(shift_mag * (2 * torch.rand(s, generator=gen) - 1)).to(device) for s in shapes]
        scale = [(scale_mag * (0.5 + torch.rand(s, generator=gen))).to(device) for s in shapes]
        return (shift if which in ("shift", "both") else None), (scale if which in ("scale", "both") else None)

    return C, mode, r, per_layer, shift_scale


def combined(grads, shift, scale):
    """``[B, D_l]`` per tensor: the vector whose norm is clipped, ``(v − shift)⊙scale``, as the kernels
    form it (fp32 ops, fp64 for fp64 input), then widened to float64."""
    out = []
    for idx, g in enumerate(grads):
        v = rows(g).to(torch.float64 if g.dtype == torch.float64 else torch.float32)
        if shift is not None:
            v = v - shift[idx].to(v.dtype).flatten()
        if scale is not None:
            v = v * scale[idx].to(v.dtype).flatten()
        out.append(v.double())
    return out


def snapshot(tensors):
    return [t.clone() for t in tensors]


def _bits(t):
    # A fresh copy: size-1 and empty tensors count as contiguous whatever their strides.
    return t.reshape(-1).clone(memory_format=torch.contiguous_format).view(torch.uint8)


def assert_unchanged(before, after):
    """Bit-identical (NaN payloads and the sign of zero included)."""
    for a, b in zip(before, after, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b)), (a, b)


def assert_same_values(got, want):
    """Equal bit for bit (the sign of zero included) where not NaN, and NaN at the same places."""
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
        nan = a.isnan()
        assert torch.equal(nan, b.isnan()), (a, b)
        assert torch.equal(_bits(torch.where(nan, 0, a)), _bits(torch.where(nan, 0, b))), (a, b)


def pipeline(grads, C, mode, r, per_layer, shift, scale, nonfinite, backend):
    """``(sums, norms, weights [B, L])`` of the clip pipeline that ``clip_and_accumulate`` runs (the
    weights are not returned by the public op; its sums are checked to be these, bit for bit)."""
    L = len(grads)
    Cs = [float(c) for c in C] if isinstance(C, list) else [float(C)] * (L if per_layer else 1)
    r = float(r if r is not None else dpkernels.clip.DEFAULT_R.get(mode, 0.0))
    flat = [g.contiguous() for g in grads]
    vecs = lambda vs: (
        [v.to(flat[0].dtype if flat[0].dtype == torch.float64 else torch.float32) for v in vs] if vs else []
    )  # noqa: E731
    return CLIP.kernels(backend).pipeline(flat, [1.0], Cs, mode, r, vecs(shift), vecs(scale), per_layer, nonfinite)


def check_contributions(grads, w, C, per_layer, shift, scale, bad):
    """Every sample's weighted contribution, in float64, is within the documented bound; dropped
    samples have weight exactly 0 in every tensor."""
    B, L = w.shape
    Cs = C if isinstance(C, list) else [C] * L
    w64 = w.double()
    assert bool((w64[bad] == 0).all()), w64[bad]
    vecs = combined(grads, shift, scale)
    for i in range(B):
        if i in bad:
            continue
        parts = [(w64[i, j] * vecs[j][i]).square().sum().item() for j in range(L)]
        sizes = [max(v.shape[1], 1) for v in vecs]
        if per_layer:
            for j in range(L):
                got = math.sqrt(parts[j])
                assert got <= bound(Cs[j], sizes[j]), (i, j, got / Cs[j])
        else:
            got = math.sqrt(sum(parts))
            assert got <= bound(Cs[0], sum(sizes)), (i, got / Cs[0])


def overflows(grads, w):
    """Whether a weighted sample ``w_il·v_il`` or the sum ``Σ_i w_il v_il`` (float64) is beyond fp32:
    the clipped sum is then not representable (with shift/scale the clip bounds the scaled vector,
    not ``v``; without, ``B·C`` can exceed the fp32 range)."""
    if grads[0].dtype == torch.float64:
        return False
    top = FP32_MAX * (1 + 2.0**-25)  # what rounds to inf
    for j, g in enumerate(grads):
        terms = w[:, j].double()[:, None] * rows(g).double()
        terms = terms[w[:, j] != 0]
        if bool((terms.abs() >= top).any() or (terms.sum(0).abs() >= top).any()):
            return True
    return False


def check_sums(sums, grads, w):
    """``sums[l] = Σ_i w_il v_il`` up to the rounding of an fp32 accumulation over ``B`` terms."""
    B = w.shape[0]
    for j, (s, g) in enumerate(zip(sums, grads, strict=True)):
        assert s.shape == g.shape[1:] and s.dtype == (torch.float64 if g.dtype == torch.float64 else torch.float32)
        keep = w[:, j] != 0
        terms = w[keep, j].double()[:, None] * rows(g)[keep].double()
        want, mag = terms.sum(0), terms.abs().sum(0)
        err = (s.double().flatten() - want).abs()
        assert bool((err <= 2.0**-22 * (B + 1) * mag + (B + 1) * 2.0**-149).all()), (j, err.max())


@given(data=st.data())
@examples(25)
def test_clip_and_accumulate(backend_device, data):
    """Contribution bound, error naming the samples, ``nonfinite="drop"``, on the fused pipeline."""
    backend, device = backend_device
    grads, bad = data.draw(gradients(backend))
    C, mode, r, per_layer, shift_scale = data.draw(clip_args(len(grads)))
    shift, scale = shift_scale([g.shape[1:] for g in grads], device)
    policy = data.draw(st.sampled_from(["raise", "drop"]))
    grads = to_device(grads, device)
    before = snapshot(grads)
    # A finite gradient whose scaled vector overflows fp32 is refused (or dropped) too.
    bad = sorted(set(bad) | set(nonfinite_samples(combined(grads, shift, scale))))
    kw = dict(mode=mode, r=r, per_layer=per_layer, shift=shift, scale=scale, nonfinite=policy, backend=backend)
    event(f"B={grads[0].shape[0]}, {grads[0].dtype}, bad samples: {policy if bad else 'none'}")
    if bad and policy == "raise":
        with pytest.raises(ValueError, match=nonfinite_message("per-sample gradient", bad)):
            dpkernels.clip_and_accumulate(grads, C, **kw)
        assert_unchanged(before, grads)
        return
    p_sums, p_norms, w = pipeline(grads, C, mode, r, per_layer, shift, scale, policy, backend)
    assert w.shape == (grads[0].shape[0], len(grads))
    check_contributions(grads, w, C, per_layer, shift, scale, bad)
    if overflows(grads, w):
        event("clipped sum beyond fp32")
        with pytest.raises(ValueError, match="the clipped sum overflows"):
            dpkernels.clip_and_accumulate(grads, C, **kw)
        assert_unchanged(before, grads)
        return
    sums, norms = dpkernels.clip_and_accumulate(grads, C, **kw)
    assert_unchanged(before, grads)
    assert_unchanged(sums, p_sums)
    assert_unchanged([norms], [p_norms])
    check_sums(sums, grads, w)
    if bad:  # the others are as if the dropped samples were not there
        keep = [i for i in range(grads[0].shape[0]) if i not in bad]
        k_sums, k_norms, k_w = pipeline([g[keep] for g in grads], C, mode, r, per_layer, shift, scale, policy,
                                        backend)  # fmt: skip
        assert_unchanged([w[keep], norms[keep]], [k_w, k_norms])
        assert_unchanged(sums, k_sums)


# Each sample's contribution is bounded, their sum is beyond fp32: B·C > FP32_MAX, or (scale) the
# clip bounds the scaled vector and the raw one, weighted, overflows.
OVERFLOWING = [
    ([torch.full((4, 1), 3e38)], 3e38, {}),
    ([torch.full((1, 2), 6e4)], 1e30, dict(mode="auto_v", scale=[torch.full((2,), 1e-30)])),
]


@pytest.mark.parametrize("case", range(len(OVERFLOWING)))
@pytest.mark.parametrize("op", ["weighted_sum", "clip_and_accumulate", "privatize"])
def test_overflowing_clipped_sum_is_refused(backend_device, case, op):
    """A sum beyond fp32 raises, naming the tensors, rather than returning Inf (which would also
    hide the noise of ``privatize``)."""
    backend, device = backend_device
    g, C, kw = OVERFLOWING[case]
    g = [x.to(device) for x in g]
    kw = {k: [x.to(device) for x in v] if k == "scale" else v for k, v in kw.items()}
    with pytest.raises(ValueError, match="overflows"):
        if op == "weighted_sum":
            norms = dpkernels.per_sample_norms(g, scale=kw.get("scale"), backend=backend)
            w = dpkernels.clip_factors(norms, C, mode=kw.get("mode", "clip"), backend=backend)
            dpkernels.weighted_sum(g, w, backend=backend)
        elif op == "privatize":
            dpkernels.privatize(g, C, 0.0, seed=1, step=1, expected_batch_size=1, backend=backend, **kw)
        else:
            dpkernels.clip_and_accumulate(g, C, backend=backend, **kw)


@given(data=st.data())
@examples(30)
def test_three_stages(backend_device, data):
    """per_sample_norms → clip_factors → weighted_sum: the same bound; a NaN/Inf norm, or a nonzero
    weight on a NaN/Inf gradient, raises naming the samples; weight 0 drops a sample exactly."""
    backend, device = backend_device
    grads, bad = data.draw(gradients(backend))
    C, mode, r, per_layer, shift_scale = data.draw(clip_args(len(grads)))
    shift, scale = shift_scale([g.shape[1:] for g in grads], device)
    grads = to_device(grads, device)
    before = snapshot(grads)
    bad = sorted(set(bad) | set(nonfinite_samples(combined(grads, shift, scale))))
    event(f"B={grads[0].shape[0]}, {grads[0].dtype}, bad samples: {bool(bad)}")
    norms = dpkernels.per_sample_norms(grads, shift=shift, scale=scale, per_layer=per_layer, backend=backend)
    B, L = grads[0].shape[0], len(grads)
    assert norms.shape == ((B, L) if per_layer else (B,))
    # A finite sample whose norm is beyond fp32 has norm inf: the stages refuse it as a NaN/Inf one.
    vecs = combined(grads, shift, scale)
    sumsq = torch.stack([v.square().sum(1) for v in vecs], 1) if B else vecs[0].new_zeros(0, L)
    exact = (sumsq if per_layer else sumsq.sum(1)).sqrt().to(norms.dtype)
    big = sorted(set(bad) | set(nonfinite_samples([exact])))
    assert nonfinite_samples([norms]) == big
    if big:
        with pytest.raises(ValueError, match=nonfinite_message("norm", big)):
            dpkernels.clip_factors(norms, C, mode=mode, r=r, backend=backend)
        norms = norms.clone()
        norms[big] = 0.0
        bad = big
    w = dpkernels.clip_factors(norms, C, mode=mode, r=r, backend=backend)
    assert w.shape == norms.shape and w.dtype == norms.dtype
    w = w if per_layer else w[:, None].expand(-1, L)
    if bad:
        named = [i for i in nonfinite_samples(grads) if bool((w[i] != 0).any())]
        if named:
            with pytest.raises(ValueError, match=nonfinite_message("per-sample gradient with a nonzero weight", named)):
                dpkernels.weighted_sum(grads, w, backend=backend)
        w = w.clone()
        w[bad] = 0.0
    check_contributions(grads, w, C, per_layer, shift, scale, bad)
    if overflows(grads, w):
        with pytest.raises(ValueError, match="the weighted sum overflows"):
            dpkernels.weighted_sum(grads, w, backend=backend)
        return
    sums = dpkernels.weighted_sum(grads, w, backend=backend)
    assert_unchanged(before, grads)
    check_sums(sums, grads, w)
    if bad:
        keep = [i for i in range(B) if i not in bad]
        assert_unchanged(sums, dpkernels.weighted_sum([g[keep] for g in grads], w[keep], backend=backend))


def _sensitivity(C, per_layer, L):
    """Δ of privatize's docstring: C, or ‖(C_1..C_L)‖₂ with per-layer bounds."""
    Cs = C if isinstance(C, list) else [C] * (L if per_layer else 1)
    return math.sqrt(sum(c * c for c in Cs)) if per_layer else Cs[0]


@given(data=st.data())
@examples(24)
def test_privatize_adds_exactly_the_documented_noise(backend_device, data):
    """``privatize`` = ``(S + σΔz)·(1/B)`` bit for bit, ``S`` from ``clip_and_accumulate`` and ``σΔz``
    from ``gaussian_noise`` (Philox, same key) or the float64 ChaCha20 stream (secure mode: ``S + σΔz``
    rounded once); with scale, ``(S + σΔz/scale)·(1/B)`` in float64, rounded once. Whatever the
    samples (dropped, zero, huge), the noise is that stream."""
    backend, device = backend_device
    grads, bad = data.draw(gradients(backend))
    C, mode, r, per_layer, shift_scale = data.draw(clip_args(len(grads)))
    _, scale = shift_scale([g.shape[1:] for g in grads], device)  # (a shift needs Σ c_i, not returned)
    sigma = data.draw(st.sampled_from([0.0, 1e-3, 0.7, 5.0, 1e36]))
    ebs = data.draw(st.sampled_from([None, 1, 3, 1000]))
    rng = data.draw(st.sampled_from(dpkernels.RNGS))
    seed = data.draw(st.integers(0, 2 ** (256 if rng == "chacha20" else 64) - 1))
    step, stream = data.draw(st.integers(0, 2**32 - 1)), data.draw(st.integers(0, 3))
    policy = data.draw(st.sampled_from(["raise", "drop"]))
    grads = to_device(grads, device)
    before = snapshot(grads)
    B, L = grads[0].shape[0], len(grads)
    bad = sorted(set(bad) | set(nonfinite_samples(combined(grads, None, scale))))
    std = sigma * _sensitivity(C, per_layer, L)
    kw = dict(mode=mode, r=r, per_layer=per_layer, scale=scale, backend=backend)
    call = lambda: dpkernels.privatize(grads, C, sigma, seed=seed, step=step, stream=stream, rng=rng,  # noqa: E731
                                       expected_batch_size=ebs, nonfinite=policy, **kw)  # fmt: skip
    smallest_scale = min(float(s.min()) for s in scale) if scale else 1.0
    if B == 0 and ebs is None:
        error = "the batch is empty: pass expected_batch_size"
    elif std > FP32_MAX / 16:
        error = re.escape("noise_multiplier·sensitivity")
    elif smallest_scale * FP32_MAX < max(1.0, std):
        error = r"scale\[\d+\] has an entry of magnitude .* overflows float32"
    elif bad and policy == "raise":
        error = nonfinite_message("per-sample gradient", bad)
    elif overflows(grads, pipeline(grads, C, mode, r, per_layer, None, scale, policy, backend)[2]):
        error = "the clipped sum overflows"
    else:
        error = None
    event(f"B={B}, {rng}, rejected: {error is not None}")
    if error is not None:
        with pytest.raises(ValueError, match=error):
            call()
        assert_unchanged(before, grads)
        return
    out = call()
    assert_unchanged(before, grads)
    sums, _ = dpkernels.clip_and_accumulate(grads, C, nonfinite=policy, **kw)
    sizes = [s.numel() for s in sums]
    out_scale = 1.0 / (B if ebs is None else ebs)
    if rng == "philox":  # σΔz in fp32, as gaussian_noise draws it
        nu = dpkernels.gaussian_noise(sum(sizes), std=std, seed=seed, step=step, stream=stream, backend=backend,
                                      device=device)  # fmt: skip
    else:  # secure mode: σΔz in float64
        nu = std * chacha20_standard_normal(sum(sizes), key=seed, step=step, stream=stream, device=device)
    nu = [n.view_as(s) for n, s in zip(nu.split(sizes), sums, strict=True)]
    if scale:  # the map-back, in float64 and rounded once
        want = [round_once((s.double() + n.double() / c.double()) * out_scale, s.dtype)
                for s, n, c in zip(sums, nu, scale, strict=True)]  # fmt: skip
    elif rng == "philox":
        want = [(s + n.to(s.dtype)) * out_scale for s, n in zip(sums, nu, strict=True)]
    else:  # S + σΔz in float64, rounded once, then scaled
        want = [round_once(s.double() + n, s.dtype) * out_scale for s, n in zip(sums, nu, strict=True)]
    assert_same_values(out, want)


@given(data=st.data())
@examples(20)
def test_gaussian_noise_is_the_documented_stream(backend_device, data):
    """``add_gaussian_noise_`` adds ``gaussian_noise``'s draws of one global index over the list
    (Philox: ``t + std·z`` in fp32, rounded once; ChaCha20: in float64, rounded once), whatever the
    values (NaN, Inf, huge, subnormal); a bad tensor or std raises and leaves every tensor as it was."""
    backend, device = backend_device
    rng = data.draw(st.sampled_from(dpkernels.RNGS))
    n = data.draw(st.integers(1, 4))
    dtypes = [data.draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16])) for _ in range(n)]
    shapes = [data.draw(st.sampled_from(TINY_SHAPES + LARGE_SHAPES)) for _ in range(n)]
    # One "sample" per tensor: gradients() draws its magnitude, NaN/Inf and layout.
    ts = [
        data.draw(gradients(backend, B=1, dtype=d, shapes=[s]))[0][0][0].contiguous()
        for d, s in zip(dtypes, shapes, strict=True)
    ]
    std = data.draw(st.sampled_from([0.0, 1e-30, 1.0, 1e30, FP32_MAX / 16, -1.0, NAN, INF, FP32_MAX]))
    seed = data.draw(st.integers(0, 2 ** (256 if rng == "chacha20" else 64) - 1))
    step, stream = data.draw(st.integers(0, 2**32 - 1)), data.draw(st.integers(0, 2**32 - 1))
    offset = data.draw(st.sampled_from([0, 5, 2**40 + 3]))
    flaw = data.draw(st.sampled_from([None] * 4 + ["strided", "float64", "int"]))
    ts = to_device(ts, device)
    if flaw is not None:
        at = data.draw(st.integers(0, n))
        bad = {"strided": torch.zeros(4, 2, device=device)[:, 0], "float64": torch.zeros(3, dtype=torch.float64),
               "int": torch.zeros(3, dtype=torch.int32)}[flaw]  # fmt: skip
        ts.insert(at, bad.to(device))
    before = snapshot(ts)
    kw = dict(seed=seed, step=step, stream=stream, offset=offset, rng=rng, backend=backend)
    event(f"{rng}, rejected: {flaw is not None or not 0 <= std <= FP32_MAX / 16}")
    if not 0 <= std <= FP32_MAX / 16:
        with pytest.raises(ValueError, match="std"):
            dpkernels.add_gaussian_noise_(ts, std, **kw)
        assert_unchanged(before, ts)
        return
    if flaw is not None:
        error = (ValueError, "must be contiguous") if flaw == "strided" else (TypeError, "float32, float16 or bfloat16")
        with pytest.raises(error[0], match=error[1]):
            dpkernels.add_gaussian_noise_(ts, std, **kw)
        assert_unchanged(before, ts)
        return
    dpkernels.add_gaussian_noise_(ts, std, **kw)
    sizes = [t.numel() for t in ts]
    total = sum(sizes)
    if rng == "philox":
        nu = dpkernels.gaussian_noise(total, std=std, device=device, **kw)
        want = [(t.float() + z.view_as(t)).to(t.dtype) for t, z in zip(before, nu.split(sizes), strict=True)]
        want_fill = [nu.to(d) for d in dtypes]
    else:
        z = chacha20_standard_normal(total, key=seed, step=step, stream=stream, offset=offset, device=device)
        want = [
            round_once(t.double() + std * z.view_as(t), t.dtype) for t, z in zip(before, z.split(sizes), strict=True)
        ]
        want_fill = [round_once(std * z, d) for d in dtypes]
    assert_same_values(ts, want)
    fill = [dpkernels.gaussian_noise(total, std=std, dtype=d, device=device, **kw) for d in dtypes]
    assert_same_values(fill, want_fill)


@pytest.mark.xfail(
    INTERPRETED, strict=True, raises=AssertionError, reason="the Triton interpreter flushes bf16 subnormals to zero"
)
def test_triton_bf16_subnormals():
    """A bf16 subnormal sample counts in the norm and the sum as on the other backends (the
    generators above leave bf16 subnormals out on the interpreted Triton backend)."""
    g = [torch.full((1, 3), 9.1835e-41, dtype=torch.bfloat16)]
    want, _ = dpkernels.clip_and_accumulate(g, 1e38, mode="auto_v", backend="reference")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    got, _ = dpkernels.clip_and_accumulate([x.to(device) for x in g], 1e38, mode="auto_v", backend="triton")
    assert want[0].tolist() == got[0].cpu().tolist() != [0.0] * 3


OPTIMIZERS = [
    pytest.param("DPSGD", dict(lr=0.5), id="sgd"),
    pytest.param("DPSGD", dict(lr=0.5, momentum=0.9, weight_decay=0.01, mode="psac", r=0.1), id="psac-momentum"),
    pytest.param("DPAdam", dict(lr=1e-2, mode="auto_s"), id="adam-auto_s"),
    pytest.param("DPAdamBC", dict(lr=1e-2), id="adam-bc"),
    pytest.param("DPAdamSTP", dict(lr=1e-2, eps1=1e-2, mode="auto_v"), id="stp-auto_v"),
    pytest.param("DPMacAdam", dict(lr=1e-2, h1=1e-8, h2=10.0), id="macadam"),
    pytest.param("DP2", dict(lr=0.1, s1=1, s2=1, eps=1e-2), id="dp2"),
    pytest.param("DPPMLF", dict(lr=0.1, k=2), id="pmlf"),
]


def optimizer_state(opt):
    """Every state tensor, the global state (``state_dict()["dp"]``: step, seed, ...) and the counter."""
    sd = opt.state_dict()
    tensors = [v.clone() for st_ in sd["state"].values() for v in st_.values() if isinstance(v, torch.Tensor)]
    return tensors, repr(sd["dp"]), opt.steps_taken


@pytest.mark.parametrize("name,kw", OPTIMIZERS)
@given(data=st.data())
@examples(8)
def test_optimizer_step(backend_device, name, kw, data):
    """One step of each optimizer: a bad ``grad_sample``/``noise`` or a NaN/Inf sample raises naming
    it and leaves parameters, state and counter bit-identical; a good step of plain DP-SGD moves the
    parameters by ``lr·privatize(...)`` (noise std σC on the sum, the same Philox stream)."""
    backend, device = backend_device
    grads, bad = data.draw(gradients(backend))
    B, L, dtype = grads[0].shape[0], len(grads), grads[0].dtype
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**32 - 1)))
    params = [torch.randn(g.shape[1:], generator=gen).to(device=device, dtype=dtype) for g in grads]
    C = 1.0 if name == "DPMacAdam" else data.draw(st.sampled_from([1e-3, 1.0, 1e3]))
    sigma, ebs = data.draw(st.sampled_from([0.0, 0.7, 3.0])), data.draw(st.sampled_from([1, 4]))
    seed = data.draw(st.integers(0, 2**64 - 1))

    def make(ps, backend):
        return getattr(optim, name)(ps, seed=seed, noise_multiplier=sigma, max_grad_norm=C, expected_batch_size=ebs,
                                    backend=backend, **kw)  # fmt: skip

    opt = make(params, backend)
    grads = to_device(grads, device)
    sample = (lambda g: [g, 0.5 * g]) if name == "DPPMLF" else (lambda g: g)  # noqa: E731  (PMLF: k = 2 sets)
    for p, g in zip(params, grads, strict=True):
        p.grad_sample = sample(g)
    # The clip's own shift/scale (state before this step): a finite sample whose scaled vector
    # overflows fp32 is refused like a NaN/Inf one.
    shift = [opt.state[p]["shift"] for p in params] if name == "DPMacAdam" else None
    key = {"DPMacAdam": "inv_b_unnorm", "DPAdamSTP": "scale"}.get(name)
    scale = [opt.state[p][key] for p in params] if key else None
    bad = sorted(set(bad) | set(nonfinite_samples(combined(grads, shift, scale))))
    flaw = data.draw(st.sampled_from([None, None, None, "shape", "batch", "missing", "noise"]))
    at = data.draw(st.integers(0, L - 1))
    noise = None
    if flaw == "shape":
        params[at].grad_sample = sample(grads[at][..., None])
        error = rf"parameter {at} .* has shape .*; expected \[B, \*"
    elif flaw == "batch":
        extra = grads[at][:1] if B else grads[at].new_zeros(1, *grads[at].shape[1:])
        params[at].grad_sample = sample(torch.cat([grads[at], extra]))
        error = "has batch size" if L > 1 else None  # one tensor: any B is consistent
    elif flaw == "missing":
        params[at].grad_sample = None
        error = rf"parameter {at} .* has no grad_sample"
    elif flaw == "noise":
        noise = [torch.zeros(p.shape, device=device) for p in params]
        noise[at] = torch.zeros(3, 2, device=device)
        error = rf"noise\[{at}\] is \(3, 2\)"
    else:
        error = None
    if error is None and bad and flaw != "batch":
        error = nonfinite_message("per-sample gradient", bad)
    if flaw == "batch" and error is None:  # B + 1 samples, the copy of sample 0 as bad as it
        error = nonfinite_message("per-sample gradient", bad + ([B] if 0 in bad else [])) if bad else None
    before, state = snapshot(params), optimizer_state(opt)
    event(f"B={B}, {dtype}, rejected: {error is not None}")
    if error is not None:
        with pytest.raises((ValueError, TypeError), match=error):
            opt.step(noise=noise)
        assert_unchanged(before, params)
        after = optimizer_state(opt)
        assert_unchanged(state[0], after[0])
        assert state[1:] == after[1:]
        return
    opt.step(noise=noise)
    assert opt.steps_taken == 1
    if not all(bool(torch.isfinite(p).all()) for p in params):
        # Only where the update itself is beyond a 16-bit parameter's range, as the reference's is
        # (DP-AdamBC's η·m̂/√γ' is up to 10⁴·η·|m̂|).
        twin = [p0.clone() for p0 in before]
        for p, g in zip(twin, grads, strict=True):
            p.grad_sample = sample(g)
        make(twin, "reference").step(noise=noise)
        event("a 16-bit parameter overflowed, as in the reference")
        for p, q in zip(params, twin, strict=True):
            assert dtype in (torch.float16, torch.bfloat16) and torch.equal(p.isfinite(), q.isfinite()), (p, q)
    if kw == dict(lr=0.5):  # plain DP-SGD: θ − lr·(S + σCz)/B
        private = dpkernels.privatize(grads, C, sigma, seed=seed, step=1,
                                      expected_batch_size=ebs, backend=backend)  # fmt: skip
        eps = torch.finfo(dtype).eps
        for p, p0, g in zip(params, before, private, strict=True):
            want = p0.double() - 0.5 * g.double()
            tol = 4 * eps * want.abs() + 4 * 2.0**-24 * 0.5 * g.double().abs() + 2.0**-140
            assert bool(((p.double() - want).abs() <= tol).all()), (p, want)
