"""The op registry: every family is implemented on every backend, with one signature per op."""

import pytest
import torch

import dpkernels
from dpkernels import _backend, _registry


def _params(sig):
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


def _loadable(backend: str) -> bool:
    # Loading an implementation imports its kernels (not runs them): the native ops need the
    # extension, the triton launchers need triton installed.
    return {"cpu": _backend.has_cpu_kernels(), "cuda": _backend.has_cpu_kernels(), "triton": _backend.has_triton()}.get(
        backend, True
    )


@pytest.mark.parametrize("name", sorted(_registry.FAMILIES))
def test_every_backend_implements_the_family_with_one_signature(name):
    fam = _registry.FAMILIES[name]
    assert set(fam.ops), name
    backends = [b for b in _backend.BACKENDS if _loadable(b)]
    want = {op: _params(sig) for op, sig in fam.signatures("reference").items()}
    for backend in backends:
        got = {op: _params(sig) for op, sig in fam.signatures(backend).items()}
        assert got == want, f"{name} on {backend}"


def test_families_cover_the_op_families():
    assert {"clip", "noise", "filter", "optim"} <= set(_registry.FAMILIES)


def test_a_family_needs_every_backend():
    with pytest.raises(ValueError, match=r"no implementation for backend\(s\) \['triton'\]"):
        _registry.Family("x", ("f",), {"reference": object, "cpu": object, "cuda": object})


def test_a_backend_missing_an_op_is_named():
    fam = _registry.Family(
        "x", ("f", "g"), {b: (lambda: type("Impl", (), {"f": staticmethod(len)})) for b in _backend.BACKENDS}
    )
    with pytest.raises(NotImplementedError, match=r"backend 'cpu' does not implement x op\(s\) \['g'\]"):
        fam.kernels("cpu")


def test_public_ops_are_registered():
    """Every public op goes through a registered dpkernels:: op (torch.compile and opcheck see it)."""
    for name in ("per_sample_norms", "clip_factors", "weighted_sum", "clip_and_accumulate", "privatize",
                 "random_uint32", "gaussian_noise", "add_gaussian_noise_", "linear_filter_"):  # fmt: skip
        assert hasattr(torch.ops.dpkernels, name), name
    assert dpkernels.available_backends()[0] == "reference"
