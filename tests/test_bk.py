"""dpkernels.bk: book-keeping clipping against dpkernels.clip_and_accumulate on the per-sample
gradients Opacus materialises, on every backend.

Models: an MLP, a CNN with GroupNorm, Embedding + LayerNorm with expanded position ids, a small
transformer (T = 32, attention from Linear layers), a model with a layer that has no BK rule and no
Opacus grad sampler (functorch fallback), a Linear and a grouped Conv2d called several times per
forward, and every layer fed a non-contiguous input (against per-sample autograd). Also
shift/scale, per-layer clipping, gradient accumulation, an empty batch, non-finite samples, tied
parameters, frozen weights with trainable biases, that wrapped layers get no weight gradient,
make_private(grad_sample_mode="bk") following the per-sample mode for every algorithm (an MLP, and
a CNN for the scaled and multi-set ones), and accelerate(criterion=...) with micro-batches.
"""

import copy

import pytest
import torch
from opacus import GradSampleModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpkernels
from dpkernels.bk import BKModule
from dpkernels.integrations._make_private import PrivacyEngine

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.usefixtures("one_thread")]


class Affine(nn.Module):
    """A layer with parameters, no BK rule and no Opacus grad sampler (functorch fallback)."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))
        self.bias = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return torch.tanh(x * self.weight + self.bias)


class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        B, T, d = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, d // self.heads).unbind(2)
        att = torch.softmax(torch.einsum("bthd,bshd->bhts", q, k) / (d // self.heads) ** 0.5, -1)
        return self.out(torch.einsum("bhts,bshd->bthd", att, v).reshape(B, T, d))


class Transformer(nn.Module):
    def __init__(self, vocab=23, d=16, T=32, classes=3):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d, padding_idx=0), nn.Embedding(T, d)
        self.ln1, self.att, self.ln2 = nn.LayerNorm(d), Attention(d, 2), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.head = nn.Linear(d, classes)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device)[None].expand_as(ids)  # non-contiguous position ids
        x = self.tok(ids) + self.pos(pos)
        x = x + self.att(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return self.head(x.mean(1))


class EmbedNorm(nn.Module):
    def __init__(self, vocab=17, d=8, classes=3):
        super().__init__()
        self.tok, self.ln, self.head = nn.Embedding(vocab, d, padding_idx=1), nn.LayerNorm(d), nn.Linear(d, classes)

    def forward(self, ids):
        return self.head(self.ln(self.tok(ids)).mean(1))


class Reused(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.cell, self.head = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for _ in range(3):  # one Linear, three calls: per-sample gradient is the sum over calls
            h = torch.tanh(self.cell(h))
        return self.head(h)


class ReusedConv(nn.Module):
    """A grouped Conv2d called twice per forward: its calls' patches are concatenated along T."""

    def __init__(self):
        super().__init__()
        self.inp, self.cell = nn.Conv2d(2, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1, groups=2)
        self.head = nn.Linear(4 * 5 * 5, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for _ in range(2):
            h = torch.tanh(self.cell(h))
        return self.head(h.flatten(1))


def _mlp():
    return nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))


def _cnn():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(), nn.Conv2d(8, 6, 3, stride=2, groups=2,
                                                                              padding="valid"),
        nn.Flatten(), nn.Linear(6 * 3 * 3, 3),
    )  # fmt: skip


def _fallback():
    return nn.Sequential(nn.Linear(5, 7), Affine(7), nn.RMSNorm(7), nn.Linear(7, 3))


# model factory, input factory (batch size B)
MODELS = {
    "mlp": (_mlp, lambda B: torch.randn(B, 10)),
    "cnn": (_cnn, lambda B: torch.randn(B, 3, 8, 8)),
    "embed-ln": (EmbedNorm, lambda B: torch.randint(0, 17, (B, 7))),
    "transformer": (Transformer, lambda B: torch.randint(0, 23, (B, 32))),
    "fallback": (_fallback, lambda B: torch.randn(B, 5)),
    "reused": (Reused, lambda B: torch.randn(B, 6)),
    "reused-conv": (ReusedConv, lambda B: torch.randn(B, 2, 5, 5)),
}


def _build(name, seed=0, device="cpu"):
    torch.manual_seed(seed)
    return MODELS[name][0]().to(device)


def _batch(name, B, device):
    """Inputs and labels of model ``name``, batch size ``B``, on ``device``."""
    return MODELS[name][1](B).to(device), torch.randint(0, 3, (B,), device=device)


def _loss(out, y, reduction="mean"):
    return nn.functional.cross_entropy(out, y, reduction=reduction)


def _opacus_grad_samples(model, x, y, reduction="mean"):
    gsm = GradSampleModule(copy.deepcopy(model), loss_reduction=reduction)
    _loss(gsm(x), y, reduction).backward()
    for m in gsm._module.modules():
        # Opacus's Embedding sampler ignores padding_idx; autograd's gradient is zero on that row.
        if isinstance(m, nn.Embedding) and m.padding_idx is not None:
            m.weight.grad_sample[:, m.padding_idx] = 0
    return [p.grad_sample for p in gsm._module.parameters() if p.requires_grad]


def _bk_run(model, batches, reduction="mean"):
    bk = BKModule(model, loss_reduction=reduction)
    for x, y in batches:
        _loss(bk(x), y, reduction).backward()
    return bk


def _close_sums(got, want, rtol=1e-4):
    for s, t in zip(got, want, strict=True):
        assert s.dtype == torch.float32 and s.shape == t.shape
        torch.testing.assert_close(s, t, rtol=rtol, atol=rtol * float(t.abs().max()) + 1e-7)


@pytest.mark.parametrize("name", list(MODELS))
def test_matches_clip_and_accumulate_on_opacus_grad_samples(backend_device, name):
    backend, dev = backend_device
    if backend == "triton" and dev == "cpu" and name == "transformer":
        pytest.skip("interpreter: the tiled kernel over B x tiles x T-chunks is covered by the layer tests")
    model = _build(name, device=dev)
    x, y = _batch(name, 6, dev)
    gs = _opacus_grad_samples(model, x, y)
    want_s, want_n = dpkernels.clip_and_accumulate(gs, 0.5, backend="reference")
    bk = _bk_run(model, [(x, y)])
    assert all(p.grad is None for m in model.modules() if type(m) in (nn.Linear, nn.Conv2d, nn.Embedding)
               for p in m.parameters(recurse=False))  # fmt: skip
    sums, norms = bk.clip_and_accumulate(0.5, backend=backend)
    torch.testing.assert_close(norms, want_n.float(), rtol=1e-4, atol=1e-6)
    _close_sums(sums, [s.float() for s in want_s])


@pytest.mark.parametrize("name", ["mlp", "cnn", "embed-ln", "fallback"])
@pytest.mark.parametrize("mode", ["clip", "psac"])
def test_shift_scale_and_per_layer(backend_device, name, mode):
    backend, dev = backend_device
    model = _build(name, device=dev)
    x, y = _batch(name, 5, dev)
    gs = _opacus_grad_samples(model, x, y)
    params = list(model.parameters())
    shift = [0.05 * torch.randn_like(p) for p in params]
    scale = [torch.rand_like(p) + 0.5 for p in params]
    for kw in (dict(shift=shift, scale=scale), dict(per_layer=True), dict(scale=scale, per_layer=True)):
        want_s, want_n = dpkernels.clip_and_accumulate(gs, 0.3, mode=mode, backend="reference", **kw)
        bk = _bk_run(model, [(x, y)])
        sums, norms = bk.clip_and_accumulate(0.3, mode=mode, backend=backend, **kw)
        torch.testing.assert_close(norms, want_n.float(), rtol=1e-4, atol=1e-6)
        _close_sums(sums, [s.float() for s in want_s])
        bk.unwrap()


class Strided(nn.Module):
    """Every layer fed a non-contiguous input: a channels_last conv input, a transposed Linear input,
    a strided LayerNorm input, expanded position ids."""

    def __init__(self):
        super().__init__()
        self.conv, self.gn = nn.Conv2d(3, 4, 3, padding=1), nn.GroupNorm(2, 4)
        self.lin, self.ln, self.rms = nn.Linear(5, 6), nn.LayerNorm(6), nn.RMSNorm(6)
        self.pos, self.head = nn.Embedding(3, 6), nn.Linear(6, 3)

    def forward(self, x):
        h = self.gn(self.conv(x.contiguous(memory_format=torch.channels_last))).mean(1)  # [B, 5, 5]
        h = self.ln(self.lin(h.transpose(1, 2))[:, ::2])  # [B, 3, 6]
        pos = torch.arange(3, device=x.device)[None].expand(x.shape[0], 3)
        return self.head(self.rms(h + self.pos(pos)).mean(1))


def _loop_grad_samples(model, x, y):
    """Per-sample gradients of the per-sample loss, one backward per sample: the reference for layouts
    Opacus's grad samplers mishandle (a channels_last conv input)."""
    params = list(model.parameters())
    rows = [torch.autograd.grad(_loss(model(x[i : i + 1]), y[i : i + 1]), params) for i in range(x.shape[0])]
    return [torch.stack(col) for col in zip(*rows, strict=True)]


def test_non_contiguous_inputs_against_per_sample_autograd(backend_device):
    backend, dev = backend_device
    torch.manual_seed(0)
    model = Strided().to(dev)
    x, y = torch.randn(4, 3, 5, 5, device=dev), torch.randint(0, 3, (4,), device=dev)
    want_s, want_n = dpkernels.clip_and_accumulate(_loop_grad_samples(model, x, y), 0.5, backend="reference")
    sums, norms = _bk_run(model, [(x, y)]).clip_and_accumulate(0.5, backend=backend)
    torch.testing.assert_close(norms, want_n.float(), rtol=1e-4, atol=1e-6)
    _close_sums(sums, [s.float() for s in want_s])


def test_gradient_accumulation_and_sum_reduction(backend_device):
    """Two forward/backward passes before one clip: distinct samples, as Opacus's grad_sample list."""
    backend, dev = backend_device
    for reduction in ("mean", "sum"):
        model = _build("cnn", device=dev)
        batches = [_batch("cnn", 4, dev), _batch("cnn", 3, dev)]
        per_batch = [_opacus_grad_samples(model, x, y, reduction) for x, y in batches]
        gs = [torch.cat(parts) for parts in zip(*per_batch, strict=True)]
        want_s, want_n = dpkernels.clip_and_accumulate(gs, 1.0, backend="reference")
        bk = _bk_run(model, batches, reduction)
        assert bk.pending() == 2
        sums, norms = bk.clip_and_accumulate(1.0, backend=backend)
        assert norms.shape == (7,)
        torch.testing.assert_close(norms, want_n.float(), rtol=1e-4, atol=1e-6)
        _close_sums(sums, [s.float() for s in want_s])
        bk.unwrap()


def test_sum_buffers_are_reused_across_steps(backend_device):
    """An optimizer's sum buffers (``BKBatch.clipped_sums(buffers=...)``), poisoned with NaN before
    each step: two steps of two micro-batches give the sums computed without buffers, and on the
    CPU every Linear and Embedding weight's sum is its buffer, the same one in both steps (on a GPU
    none is kept: the caching allocator reuses the memory)."""
    backend, dev = backend_device
    model = _build("transformer", device=dev)
    bk = BKModule(model)
    params = list(bk.trainable_parameters())
    n_buffered = sum(isinstance(m, (nn.Linear, nn.Embedding)) for m in model.modules()) if dev == "cpu" else 0
    buffers, owned = {}, None
    for _ in range(2):
        for x, y in (_batch("transformer", 3, dev), _batch("transformer", 2, dev)):
            _loss(bk(x), y).backward()
        batch = bk.batch()
        args = (params, [1.0], [0.5], "clip", 0.0, None, None, False, "raise", backend)
        want, want_n, _ = batch.clipped_sums(*args)
        for buf in buffers.values():
            buf.fill_(float("nan"))
        got, norms, _ = batch.clipped_sums(*args, buffers=buffers)
        torch.testing.assert_close(norms, want_n)
        _close_sums(got, want, rtol=1e-6)
        ptrs = {b.data_ptr() for b in buffers.values()}
        assert len(ptrs) == n_buffered and sum(s.data_ptr() in ptrs for s in got) == n_buffered
        assert owned is None or ptrs == owned
        owned = ptrs
        bk.clear()


def test_empty_batch_gives_zero_sums(backend_device):
    backend, dev = backend_device
    model = _build("mlp", device=dev)
    bk = _bk_run(model, [_batch("mlp", 0, dev)], "sum")
    sums, norms = bk.clip_and_accumulate(1.0, backend=backend)
    assert norms.shape == (0,)
    assert all(s.shape == p.shape and not s.any() for s, p in zip(sums, model.parameters(), strict=True))


@pytest.mark.parametrize("name", ["mlp", "cnn"])  # cnn: a conv's kept per-sample gradients hold the NaN
def test_nonfinite_sample_raises_or_is_dropped(backend_device, name):
    backend, dev = backend_device
    model = _build(name, device=dev)
    x, y = _batch(name, 5, dev)
    x[2, 0] = float("nan")
    bk = _bk_run(model, [(x, y)])
    with pytest.raises(ValueError, match=r"non-finite.*\[2\]"):
        bk.clip_and_accumulate(1.0, backend=backend)
    bk = _bk_run(model, [(x, y)])
    sums, norms = bk.clip_and_accumulate(1.0, nonfinite="drop", backend=backend)
    keep = torch.tensor([0, 1, 3, 4], device=dev)
    want_s, _ = dpkernels.clip_and_accumulate(_opacus_grad_samples(model, x[keep], y[keep], "sum"), 1.0,
                                              backend="reference")  # fmt: skip
    assert norms[keep].isfinite().all() and not norms[2].isfinite()
    # the mean loss of 5 samples scales each G by 5 (Opacus's rule): the per-sample gradients are those of the sum
    _close_sums(sums, [s.float() for s in want_s])


@pytest.mark.parametrize("hw, kept", [(16, True), (2, False)])
def test_conv_keeps_per_sample_gradients_within_the_memory_rule(hw, kept):
    """On the CPU a conv's norms keep its per-sample gradients (B·|W| fp32) only where they take no
    more memory than the recorded input and output gradient: 16x16 images (4·8·9 weights against
    (4 + 8)·256 activations a sample) keep them, 2x2 do not; the clipped sums agree either way."""
    from dpkernels import bk as bk_mod

    conv = nn.Conv2d(4, 8, 3, padding=1)
    sums = []
    for keeps in (bk_mod._keeps, lambda *args: False):
        bk = BKModule(copy.deepcopy(conv), loss_reduction="sum")
        bk(torch.randn(5, 4, hw, hw, generator=torch.Generator().manual_seed(0))).square().sum().backward()
        batch = bk.batch()
        ((mb, _),) = batch.sets[0]
        ((rule, (call,)),) = mb.items()
        original, bk_mod._keeps = bk_mod._keeps, keeps
        try:
            sums.append(batch.clipped_sums(bk.trainable_parameters(), (1.0,), [1.0], "clip", 0.0, None, None,
                                           False, "raise", "cpu")[0])  # fmt: skip
            rule.norms([call], bk_mod._Aux(bk.trainable_parameters(), None, None), "cpu")
        finally:
            bk_mod._keeps = original
        assert (call.kept is not None) == (kept and keeps is bk_mod._keeps)
    _close_sums(sums[0], sums[1], rtol=1e-5)


def test_overflowing_clipped_sum_raises(backend_device):
    """Four samples, each clipped within C = 3e38, sum past the float32 range: refused, naming the
    parameter, as the fused pipeline does."""
    backend, dev = backend_device
    model = nn.Sequential(nn.Linear(2, 1, bias=False)).to(dev)
    bk = BKModule(model, loss_reduction="sum")
    # the per-sample weight gradient is x·G with G = 1: entries 1e38, norm 1.4e38 < C
    bk(torch.full((4, 2), 1e38, device=dev)).sum().backward()
    with pytest.raises(ValueError, match=r"clipped sum overflows torch.float32 in tensor\(s\) \[0\]"):
        bk.clip_and_accumulate(3e38, backend=backend)


def test_frozen_weight_trainable_bias(backend_device):
    """A Linear/Conv2d/GroupNorm whose weight is frozen still clips its bias (its G is recorded)."""
    backend, dev = backend_device
    model = _build("cnn", device=dev)
    model[0].weight.requires_grad_(False)
    model[1].weight.requires_grad_(False)
    model[5].weight.requires_grad_(False)
    x, y = _batch("cnn", 4, dev)
    want_s, want_n = dpkernels.clip_and_accumulate(_opacus_grad_samples(model, x, y), 0.5, backend="reference")
    sums, norms = _bk_run(model, [(x, y)]).clip_and_accumulate(0.5, backend=backend)
    torch.testing.assert_close(norms, want_n.float(), rtol=1e-4, atol=1e-6)
    _close_sums(sums, [s.float() for s in want_s])
    assert all(s.abs().sum() > 0 for s in sums)


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda ps: [torch.ones(p.numel()) for p in ps], r"scale\[0\] must be shaped like its parameter"),
        (lambda ps: [torch.ones_like(p) for p in ps[:-1]], "one tensor per trainable parameter"),
        (lambda ps: [torch.ones_like(p, dtype=torch.int64) for p in ps], r"scale\[0\] must be a floating-point"),
        (lambda ps: [torch.ones_like(p, device="meta") for p in ps], r"scale\[0\] is on meta"),
    ],
)
def test_bad_shift_scale_raise(bad, match):
    """The engine checks the per-parameter scale and shift once (its layer ops take them unchecked)."""
    model = _build("cnn")
    x, y = _batch("cnn", 3, "cpu")
    bk = _bk_run(model, [(x, y)])
    ps = bk.trainable_parameters()
    with pytest.raises((ValueError, TypeError), match=match):
        bk.clip_and_accumulate(1.0, scale=bad(ps))
    with pytest.raises((ValueError, TypeError), match=match.replace("scale", "shift")):
        bk.clip_and_accumulate(1.0, shift=bad(ps))


def test_tied_parameters_raise():
    model = _mlp()
    model.append(nn.Linear(3, 16))
    model[3].weight = model[0].weight
    with pytest.raises(NotImplementedError, match="shared"):
        BKModule(model)


def test_unwrap_restores_the_model():
    model = _build("transformer")
    x = torch.randint(0, 23, (2, 32))
    want = model(x)
    bk = BKModule(model)
    torch.testing.assert_close(bk(x), want)
    assert bk.unwrap() is model and "forward" not in model.head.__dict__
    torch.testing.assert_close(model(x), want)


# ---------------------------------------------------------------------------------------------
# make_private(grad_sample_mode="bk") follows the per-sample mode for every algorithm
# ---------------------------------------------------------------------------------------------

SETUPS = {
    "dpsgd": (lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.5), {}),
    "dpsgd-auto_s": (lambda ps: torch.optim.SGD(ps, lr=0.5), {"mode": "auto_s"}),
    "dpsgd-auto_v": (lambda ps: torch.optim.SGD(ps, lr=0.5), {"mode": "auto_v"}),
    "psac": (lambda ps: torch.optim.SGD(ps, lr=0.5), {"r": 0.1}),
    "dp2": (lambda ps: torch.optim.SGD(ps, lr=0.5), {"s1": 2, "s2": 2, "lr2": 0.05}),
    "pmlf": (lambda ps: torch.optim.SGD(ps, lr=0.5), {"k": 3}),
    "dpadam": (lambda ps: torch.optim.Adam(ps, lr=0.02), {}),
    "dpadam_bc": (lambda ps: torch.optim.AdamW(ps, lr=0.002, weight_decay=0.0), {}),
    "stp": (lambda ps: torch.optim.Adam(ps, lr=0.02), {"eps1": 1e-3}),
    "macadam": (lambda ps: torch.optim.Adam(ps, lr=0.004), {}),
}


def _train(setup, mode, steps=10, arch="mlp"):
    """10 steps of ``make_private(algorithm=...)`` in ``grad_sample_mode=mode``: the final parameters and ε.
    ``arch``: an MLP with LayerNorm (T = 1), or a CNN with GroupNorm whose convs take every norm
    method (dense scale and shift through the tiled product, Gram otherwise)."""
    algorithm = setup.split("-")[0]
    make_opt, kw = SETUPS[setup]
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if arch == "mlp":
        model = nn.Sequential(nn.Linear(10, 12), nn.LayerNorm(12), nn.Tanh(), nn.Linear(12, 3))
        x = torch.randn(8 * steps, 10, generator=g)
    else:
        model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.Tanh(), nn.Conv2d(4, 4, 3),
                              nn.Flatten(), nn.Linear(4 * 3 * 3, 3))  # fmt: skip
        x = torch.randn(8 * steps, 2, 5, 5, generator=g)
    y = torch.randint(0, 3, (8 * steps,), generator=g)
    pe = PrivacyEngine(accountant="rdp")
    module, opt, loader = pe.make_private(
        module=model, optimizer=make_opt(model.parameters()), data_loader=DataLoader(TensorDataset(x, y), batch_size=8),
        noise_multiplier=0.7, max_grad_norm=0.5, poisson_sampling=False, algorithm=algorithm, backend="cpu", seed=11,
        grad_sample_mode=mode, **kw,
    )  # fmt: skip
    for xb, yb in loader:
        opt.zero_grad()
        _loss(module(xb), yb).backward()
        opt.step(batch=(xb, yb)) if algorithm == "pmlf" else opt.step()
    return [p.detach().clone() for p in model.parameters()], pe.get_epsilon(1e-5)


@pytest.mark.parametrize("setup", list(SETUPS))
def test_make_private_bk_follows_per_sample_mode(setup):
    want, eps_hooks = _train(setup, "hooks")
    got, eps_bk = _train(setup, "bk")
    assert eps_bk == eps_hooks
    for p, q in zip(got, want, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("setup", ["stp", "macadam", "pmlf"])
def test_make_private_bk_cnn_follows_per_sample_mode(setup):
    """The scale (stp, macadam) and shift (macadam) reach the conv norms, and pmlf's k sets the convs."""
    want, eps_hooks = _train(setup, "hooks", arch="cnn")
    got, eps_bk = _train(setup, "bk", arch="cnn")
    assert eps_bk == eps_hooks
    for p, q in zip(got, want, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def _ghost_setup(sigma: float, steps: int):
    """Opacus ghost clipping (``make_private(grad_sample_mode="ghost")``) on a small MLP with
    LayerNorm: ``(model, module, optimizer, criterion, x, y)``, batches of 8."""
    from opacus import PrivacyEngine as OpacusPrivacyEngine

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 12), nn.LayerNorm(12), nn.Tanh(), nn.Linear(12, 3))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8 * steps, 10, generator=g), torch.randint(0, 3, (8 * steps,), generator=g)
    module, opt, crit, _ = OpacusPrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), criterion=nn.CrossEntropyLoss(),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=8), noise_multiplier=sigma, max_grad_norm=0.3,
        poisson_sampling=False, grad_sample_mode="ghost",
    )  # fmt: skip
    return model, module, opt, crit, x, y


def _ghost_run(accelerated: bool, steps=3):
    """Opacus ghost clipping (σ = 0), plain or with accelerate(criterion=...): final parameters and the
    number of backward passes through the model's output per step."""
    from dpkernels.integrations.opacus import accelerate

    model, module, opt, crit, x, y = _ghost_setup(0.0, steps)
    if accelerated:
        accelerate(opt, backend="cpu", seed=3, criterion=crit)
    passes = 0
    for xb, yb in zip(x.split(8), y.split(8), strict=True):
        opt.zero_grad()
        out = module(xb)

        def count(grad):
            nonlocal passes
            passes += 1

        out.register_hook(count)
        crit(out, yb).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], passes / steps


def test_accelerate_ghost_runs_one_backward():
    want, passes_opacus = _ghost_run(False)
    got, passes = _ghost_run(True)
    assert passes_opacus == 2 and passes == 1
    for p, q in zip(got, want, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def _ghost_accelerated_params(micro: int, sigma: float, steps=3):
    """accelerate(ghost optimizer, criterion=...) with each step's batch of 8 split into ``micro``
    micro-batches (one backward each, clipped sums added into p.grad): the final parameters."""
    from dpkernels.integrations.opacus import accelerate

    model, module, opt, crit, x, y = _ghost_setup(sigma, steps)
    accelerate(opt, backend="cpu", seed=5, criterion=crit)
    for xb, yb in zip(x.split(8), y.split(8), strict=True):
        opt.zero_grad()
        for xm, ym in zip(xb.chunk(micro), yb.chunk(micro), strict=True):
            crit(module(xm), ym).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_accelerate_ghost_accumulates_micro_batches_with_the_same_noise():
    """Two micro-batches per step (which Opacus's ghost mode cannot run) give the one-batch step, with
    σ = 1: per-sample norms never cross samples, and the step's noise is the same stream."""
    want = _ghost_accelerated_params(1, 1.0)
    got = _ghost_accelerated_params(2, 1.0)
    for p, q in zip(got, want, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert not all(torch.equal(p, q) for p, q in zip(want, _ghost_accelerated_params(1, 0.0), strict=True))
