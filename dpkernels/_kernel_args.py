"""Named kernel arguments: each fused-step family's ``hyper`` list and the filter coefficient list,
declared once.

The native ops take their scalars as positional ``float[]`` lists (csrc/ops.cpp). The order of
those lists is written here and nowhere else:

- Python builds a list by name (:meth:`HyperSpec.pack`, which raises on a missing or extra name)
  and the reference step functions read it by name (:meth:`HyperSpec.unpack`);
- the Triton kernels read slot :meth:`HyperSpec.index` (``triton_kernels/optim.py``, constants
  formed at import);
- the C++ structs of ``optim_math.h`` and the code that fills them from a list are generated from
  this module by ``tools/gen_kernel_args.py`` into ``csrc/include/dpkernels/kernel_args.h``
  (``tests/test_kernel_args.py`` fails when the committed header differs from a fresh generation).

A field fills one or more members of the C++ struct: ``float`` (rounded to fp32), ``recip``
(``1/x`` formed in float64, then rounded: the kernels multiply instead of dividing), ``recip0``
(the same, 0 stays 0) or ``int`` (an enumerator, checked against ``choices``).

A leaf module: it imports nothing from dpkernels, so :mod:`dpkernels.reference` may use it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["Field", "HyperSpec", "SGD", "DP2", "ADAM", "MACADAM", "FAMILIES", "FILTER", "FilterSpec"]


@dataclass(frozen=True)
class Field:
    """One slot of a ``hyper`` list: its name, the C++ members it fills and how, the enumerator
    values it may take (integer fields), and what it means."""

    name: str
    doc: str
    #: (C++ member, transform) pairs; transform is "float", "recip", "recip0" or "int"
    members: tuple[tuple[str, str], ...] = ()
    #: (value, C++ enumerator) pairs of an integer field
    choices: tuple[tuple[int, str], ...] = ()

    @property
    def is_int(self) -> bool:
        return bool(self.choices)

    def targets(self) -> tuple[tuple[str, str], ...]:
        if self.members:
            return self.members
        return ((self.name, "int" if self.is_int else "float"),)


def _f(name: str, doc: str, *members: tuple[str, str]) -> Field:
    return Field(name, doc, tuple(members))


def _enum(name: str, doc: str, *choices: tuple[int, str]) -> Field:
    return Field(name, doc, (), tuple(choices))


@dataclass(frozen=True)
class HyperSpec:
    """The ``hyper`` list of one family op (``<family>_step_``) and its C++ struct."""

    family: str
    struct: str
    #: the C++ enum of the integer field, if any
    enum: str | None
    fields: tuple[Field, ...]
    _index: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "_index", {f.name: i for i, f in enumerate(self.fields)})
        if len(self._index) != len(self.fields):
            raise ValueError(f"{self.family}: duplicate hyper field names")

    @property
    def op(self) -> str:
        return f"{self.family}_step_"

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    def __len__(self) -> int:
        return len(self.fields)

    def index(self, name: str) -> int:
        """The slot of field ``name``."""
        try:
            return self._index[name]
        except KeyError:
            raise KeyError(f"{self.op} has no hyper field {name!r}; fields: {self.names}") from None

    def pack(self, **values: float) -> list[float]:
        """The ``hyper`` list from every field by name (a missing or unknown name raises)."""
        missing = [n for n in self.names if n not in values]
        extra = sorted(set(values) - set(self.names))
        if missing or extra:
            raise TypeError(f"{self.op} hyper: missing {missing}, unknown {extra}")
        return [float(values[n]) for n in self.names]

    def unpack(self, hyper: Sequence[float]) -> dict[str, float | int]:
        """``{name: value}`` of a ``hyper`` list, checked as the kernels check it (count, finite,
        integer fields among their choices); integer fields as ints."""
        if len(hyper) != len(self.fields):
            raise ValueError(f"{self.op} takes {len(self.fields)} hyper-parameters, got {len(hyper)}")
        out: dict[str, float | int] = {}
        for i, (f, h) in enumerate(zip(self.fields, hyper, strict=True)):
            h = float(h)
            if not math.isfinite(h):
                raise ValueError(f"{self.op} hyper[{i}] is not finite")
            if f.is_int:
                allowed = tuple(v for v, _ in f.choices)
                if h not in allowed:
                    raise ValueError(f"{self.op}: hyper[{i}] must be one of {allowed}, got {h}")
                h = int(h)
            out[f.name] = h
        return out


_MOMENTS = (
    _f("inv_b", "1/B, B the expected batch size"),
    _f("lr", "learning rate η"),
    _f("beta1", "β1"),
    _f("one_minus_beta1", "1 − β1"),
    _f("beta2", "β2"),
    _f("one_minus_beta2", "1 − β2"),
    _f("bias1", "1 − β1^t", ("inv_bc1", "recip")),
    _f("bias2", "1 − β2^t", ("inv_bc2", "recip")),
)

SGD = HyperSpec(
    "sgd", "SgdHyper", None,
    (_f("inv_b", "1/B"), _f("lr", "learning rate η"), _f("weight_decay", "coupled L2 weight decay λ")),
)  # fmt: skip
DP2 = HyperSpec(
    "dp2", "Dp2Hyper", "Dp2Phase",
    (_f("inv_b", "1/B"), _f("lr", "learning rate of the phase (η or η2)"),
     _enum("phase", "the branch of the cycle", (0, "kSgd"), (1, "kAdaptive"))),
)  # fmt: skip
ADAM = HyperSpec(
    "adam", "AdamHyper", "AdamVariant",
    (*_MOMENTS,
     _f("bias2_prev", "1 − β2^(t−1) (STP's v̂_{t−1}; 0 at t = 1, where v̂_0 = 0)", ("inv_bc2_prev", "recip0")),
     _f("eps", "Adam/STP: ε outside the sqrt (STP: ε₂)"),
     _f("decay", "1 − ηλ (decoupled weight decay, AdamW); 1 without decay"),
     _f("phi", "BC: Φ = (σΔ/B)²"),
     _f("gamma", "BC: the floor γ'"),
     _f("eps1", "STP: ε₁"),
     _enum("variant", "the algorithm", (0, "kAdam"), (1, "kBC"), (2, "kSTP"))),
)  # fmt: skip
MACADAM = HyperSpec(
    "macadam", "MacAdamHyper", "MacAdamBC",
    (*_MOMENTS,
     _f("eps", "γ, outside the sqrt"),
     _f("noise_var", "(σC/B)²"),
     _f("gamma", "BC floor γ'"),
     _f("h1", "lower clamp of ŝ"),
     _f("h2", "upper clamp of ŝ"),
     _f("kappa", "κ_t; 0 skips the ŝ/b update (t = 1)", ("kappa", "float"), ("inv_kappa", "recip0")),
     _f("c_total", "Σ_i c_i of this step's clip weights"),
     _f("bscale", "√(Σ√ŝ) of the previous update (1 while b = b_0)"),
     _enum("bc", "bias correction", (0, "kOff"), (1, "kPaper"), (2, "kB2"))),
)  # fmt: skip

#: Every family, in the order of csrc/ops.cpp.
FAMILIES: dict[str, HyperSpec] = {s.family: s for s in (SGD, DP2, ADAM, MACADAM)}


class FilterSpec:
    """The filter coefficient list ``[a, g, c[K], d[K], e[K], f[K]]`` of ``linear_filter_`` and of
    the fused steps' noise and direction filters: ``y = a·x + Σ_k c_k S_k``,
    ``S_k ← d_k S_k + e_k y + f_k x``, ``out = g·y``."""

    #: the scalar slots, in order
    SCALARS = ("a", "g")
    #: the per-buffer groups of K values each, in order
    GROUPS = ("c", "d", "e", "f")

    def scalar_index(self, name: str) -> int:
        return self.SCALARS.index(name)

    def group_start(self, name: str, K: int) -> int:
        """The slot of ``name[0]`` for ``K`` buffers (``name[k]`` is at ``group_start + k``)."""
        return len(self.SCALARS) + self.GROUPS.index(name) * K

    def length(self, K: int) -> int:
        return len(self.SCALARS) + len(self.GROUPS) * K

    def buffers(self, n: int) -> int:
        """``K`` of a list of ``n`` coefficients (raises unless ``n = 2 + 4K``)."""
        K, rem = divmod(n - len(self.SCALARS), len(self.GROUPS))
        if n < len(self.SCALARS) or rem:
            raise ValueError(f"filter coefficients must hold 2 + 4K values [a, g, c.., d.., e.., f..], got {n}")
        return K

    def pack(self, *, a: float, g: float, c: Sequence[float], d: Sequence[float], e: Sequence[float],
             f: Sequence[float]) -> list[float]:  # fmt: skip
        groups = {"c": c, "d": d, "e": e, "f": f}
        K = len(c)
        for name, seq in groups.items():
            if len(seq) != K:
                raise ValueError(f"filter coefficients: {name} holds {len(seq)} values, c holds {K}")
        scalars = {"a": a, "g": g}
        return [float(scalars[n]) for n in self.SCALARS] + [float(x) for n in self.GROUPS for x in groups[n]]

    def pack_dict(self, co: Mapping) -> list[float]:
        """:meth:`pack` of a mapping with the keys a, g, c, d, e, f (a mechanism's ``plan``)."""
        return self.pack(**{n: co[n] for n in (*self.SCALARS, *self.GROUPS)})

    def split(self, coeffs: Sequence[float]) -> dict:
        """``{a, g, c, d, e, f}`` of a coefficient list (lists for the groups)."""
        K = self.buffers(len(coeffs))
        out = {n: coeffs[self.scalar_index(n)] for n in self.SCALARS}
        for n in self.GROUPS:
            s = self.group_start(n, K)
            out[n] = list(coeffs[s : s + K])
        return out


FILTER = FilterSpec()
