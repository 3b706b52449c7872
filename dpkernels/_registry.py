"""The op registry: each op family's implementations, one per backend, declared in one place.

An op family (clip, noise, filter, optim) is a small set of kernel functions that every backend
implements with one signature: the family's *interface*. The family module declares it once::

    NOISE = family(
        "noise", ("words", "fill", "add"),
        reference=lambda: _ReferenceNoise, cpu=lambda: _NativeNoise, cuda=lambda: _NativeNoise,
        triton=lambda: _TritonNoise,
    )

and its registered ``torch.library`` ops (schema and fake kernel next to it) call
``NOISE.kernels(backend).fill(...)``. The public function resolves the backend once
(:func:`dpkernels._backend.resolve`: ``"auto"`` by device, or an explicit ``backend=`` checked)
and passes the resolved name to the op, so the op's schema carries it. Loaders run on first use,
so Triton is imported only when the triton backend is.

Adding a backend is one loader per family; adding a family is one :func:`family` call, its
implementations and its ops (README.md, "Development").
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from . import _backend

#: Every family, by name (tests check that each backend implements each family's interface).
FAMILIES: dict[str, Family] = {}


class Family:
    """An op family: ``ops``, the kernel functions each backend in :data:`_backend.BACKENDS`
    provides, and a loader per backend returning a namespace (module or class) holding them."""

    def __init__(self, name: str, ops: tuple[str, ...], loaders: dict[str, Callable[[], object]]):
        missing = set(_backend.BACKENDS) - set(loaders)
        if missing:
            raise ValueError(f"op family {name!r} has no implementation for backend(s) {sorted(missing)}")
        self.name, self.ops, self._loaders = name, ops, loaders
        self._loaded: dict[str, object] = {}

    def kernels(self, backend: str):
        """The implementation of this family on ``backend`` (a resolved backend name)."""
        impl = self._loaded.get(backend)
        if impl is None:
            impl = self._loaders[backend]()
            absent = [op for op in self.ops if not callable(getattr(impl, op, None))]
            if absent:
                raise NotImplementedError(f"backend {backend!r} does not implement {self.name} op(s) {absent}")
            self._loaded[backend] = impl
        return impl

    def signatures(self, backend: str) -> dict[str, inspect.Signature]:
        """Each op's signature on ``backend``: the same on every backend (tests compare them)."""
        impl = self.kernels(backend)
        return {op: inspect.signature(getattr(impl, op)) for op in self.ops}


def family(name: str, ops: tuple[str, ...], **loaders: Callable[[], object]) -> Family:
    """Declare op family ``name`` with its interface ``ops`` and one loader per backend."""
    fam = Family(name, ops, loaders)
    FAMILIES[name] = fam
    return fam


#: Backends whose implementations call registered native ops (``torch.ops.dpkernels_C``, with
#: fake kernels), so torch.compile and ``opcheck`` see a registered op without a wrapper.
NATIVE = ("cpu", "cuda")


def custom_op(name: str, *, mutates_args=()):
    """``torch.library.custom_op(f"dpkernels::{name}")`` around ``fn(..., backend)`` (the resolved
    backend is the last argument), for a public op of a family.

    The one eager fast path: on the :data:`NATIVE` backends an eager call runs ``fn`` directly, since
    the native op it calls is itself registered; the custom-op wrapper's boxing of a list argument
    costs ~0.15 ms per call on a list of 148 tensors (docs/BENCHMARKS.md). Everything else, and any
    call under torch.compile, goes through the registered ``dpkernels::`` op (``.op``; opcheck
    tests both)."""

    def wrap(fn):
        op = torch.library.custom_op(f"dpkernels::{name}", fn, mutates_args=mutates_args)

        def call(*args):
            if args[-1] in NATIVE and not torch.compiler.is_compiling():
                return fn(*args)
            return op(*args)

        call.op = op
        call.register_fake = op.register_fake
        call.__name__, call.__doc__ = fn.__name__, fn.__doc__
        return call

    return wrap
