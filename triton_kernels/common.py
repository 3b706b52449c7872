"""Launch machinery shared by the Triton op families (``clip.py``, ``noise.py``, ``filter.py``,
``optim.py``): the host tables, the kernels' view of them, and the tile work split.

Every family launches the same way (multi-tensor apply):

- Tensors are grouped by storage dtype and by whether vector (128-bit) accesses are legal for
  them (:func:`group_tensors`, :func:`is_aligned`); each group is one launch.
- A launch walks a *tile table* (:func:`tiles`): one entry per tile of ``BLOCK`` elements of one
  tensor, carrying the tensor's slot and the tile's first local element. Kernels that draw
  counter-based noise align their tiles to the generator's blocks in the **global** element index
  (a tensor's first tile starts at its first element rounded down to a multiple of 4 for Philox,
  masked below it), so a tile makes whole generator calls and each element still gets its own
  word; a block straddling two tensors is computed by a tile of each.
- Every int64 table of one host call (data addresses, sizes, global indices, tiles, the counter,
  fp32 bit patterns of coefficients) is packed into one int64 tensor (:class:`MetaTable`), so one
  host-to-device copy carries them and compiled kernels do not specialise on their values. Kernels
  turn an address back into a typed pointer (:func:`typed_ptr`) and a bit pattern back into its
  fp32 value (:func:`load_coeff`).

These pieces live here once, so that a table one family builds is read the same way by every
kernel, the filter and optimizer steps draw exactly the noise of ``noise.py`` (:func:`tile_normals`),
and no family imports another's private names. Spec of the noise: docs/RNG.md.

Contents (users in brackets):

- run mode: :func:`interpreting` [all, chacha's libdevice switch], :func:`check_device` (the one
  "needs CUDA or TRITON_INTERPRET=1" error) [all], :func:`device_guard` [all], :func:`tile_block`
  [noise, filter, optim];
- host tables: ``TL_DTYPES``, ``VEC_BYTES`` [all], :class:`MetaTable` [all], :func:`fp32_bits`
  [clip, filter, optim], :func:`check_counter` [noise, filter, optim];
- launch groups and tiles: :func:`is_aligned` [all], :class:`Group` / :func:`group_tensors` [clip,
  noise], :func:`tiles` [all; clip's chunk tables are tiles with ``rng_block=1``];
- device functions: :func:`typed_ptr` [all], :func:`load_coeff` [clip, filter, optim],
  :func:`tile_span` [clip's chunk kernels] / :func:`tile` [noise, filter, optim],
  :func:`philox_words`, :func:`philox_normals` [noise], :func:`tile_normals` [filter, optim],
  :func:`round_to` [noise, filter, optim].

Runs compiled on CUDA tensors, or on CPU tensors under the Triton interpreter
(``TRITON_INTERPRET=1`` set before this module is imported).
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .._backend import triton_interpreting
from .philox import MASK32, box_muller, philox4x32_10

#: Bytes of one vector access (``ld/st.global.v4.b32``); ``VEC_BYTES // itemsize`` elements.
VEC_BYTES = 16
#: Storage dtypes of the float tensors the kernels read and write, as Triton element types.
TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
#: Elements per generator call of Philox4x32-10 (4 words, 4 normals): tile kernels start their
#: tiles on multiples of it in the global element index.
PHILOX_ELEMS = 4
#: Elements per tile of the tile kernels under the interpreter. A program costs ~300 interpreted
#: tensor ops (~50 ms) whatever its size, so tiles are much larger there than compiled; no result
#: depends on the tile size.
INTERPRETER_TILE_BLOCK = 1 << 16


# =============================================================================================
# Run mode
# =============================================================================================


def interpreting() -> bool:
    """True under the Triton interpreter (one rule with backend selection: ``dpkernels._backend``)."""
    return triton_interpreting()


def check_device(device: torch.device) -> None:
    """Raises unless kernels can run on ``device`` tensors: CUDA, or any device under the
    interpreter."""
    if device.type != "cuda" and not interpreting():
        raise RuntimeError(
            f"the triton backend runs on CUDA tensors, got {device} tensors; for CPU tensors set "
            "TRITON_INTERPRET=1 before importing dpkernels (Triton interpreter)"
        )


def device_guard(device: torch.device):
    """Context in which launches go to ``device`` (its CUDA device; nothing to select on CPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def tile_block(block: int) -> int:
    """Elements per tile of a tile kernel's launch: ``block`` compiled, INTERPRETER_TILE_BLOCK
    under the interpreter."""
    return INTERPRETER_TILE_BLOCK if interpreting() else block


# =============================================================================================
# Host tables
# =============================================================================================


class MetaTable:
    """Collects every int64 table of one host call; ``finish`` copies them to the device at once.

    ``add`` returns a handle; after ``finish``, ``meta[handle]`` is that table's slice of the
    device tensor (at least one element, so an empty table is still a valid pointer).
    """

    def __init__(self) -> None:
        self._parts: list[torch.Tensor] = []
        self._spans: list[tuple[int, int]] = []
        self._size = 0
        self.tensor: torch.Tensor | None = None

    def add(self, values: Sequence[int] | torch.Tensor) -> int:
        part = torch.as_tensor(values, dtype=torch.int64).reshape(-1)
        # Start each table on a 16-byte boundary so Triton sees the same pointer alignment for
        # every slice (one compiled variant instead of two).
        if self._size % 2:
            self._parts.append(torch.zeros(1, dtype=torch.int64))
            self._size += 1
        self._spans.append((self._size, part.numel()))
        self._parts.append(part)
        self._size += part.numel()
        return len(self._spans) - 1

    def finish(self, device: torch.device) -> None:
        host = torch.cat([*self._parts, torch.zeros(1, dtype=torch.int64)])
        if device.type == "cuda":
            # Pinned + non_blocking keeps the host from waiting on the copy; the caching host
            # allocator holds the buffer until the copy has run.
            host = host.pin_memory()
        self.tensor = host.to(device, non_blocking=True)

    def __getitem__(self, handle: int) -> torch.Tensor:
        begin, count = self._spans[handle]
        return self.tensor[begin : begin + max(count, 1)]


def fp32_bits(values: Sequence[float]) -> list[int]:
    """The fp32 bit patterns of ``values`` as int32 integers, for a :class:`MetaTable`: the
    kernels read back exactly the fp32 values (:func:`load_coeff`) without specialising on them."""
    return [struct.unpack("<i", struct.pack("<f", float(a)))[0] for a in values]


def check_counter(seed: int, step: int, stream: int, offset: int) -> list[int]:
    """Checks a Philox counter's fields (docs/RNG.md §1); returns the kernels' ``key`` table
    ``[seed low, seed high, step, stream]``."""
    fields = (("seed", seed, 64), ("step", step, 32), ("stream", stream, 32), ("offset", offset, 62))
    for name, value, bits in fields:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**bits:
            raise ValueError(f"{name} must be an integer in [0, 2^{bits}), got {value!r}")
    return [seed & 0xFFFFFFFF, seed >> 32, step, stream]


# =============================================================================================
# Launch groups and tiles
# =============================================================================================


def is_aligned(
    tensors: Sequence[torch.Tensor], numel: int, elem_size: int, base: int = 0, rng_block: int = PHILOX_ELEMS
) -> bool:
    """Vector accesses are legal on ``tensors`` (each ``numel`` elements, or rows of that many):
    16-byte-aligned storage, whole 128-bit vectors per row, and ``base`` (global index of element
    0) a multiple of ``rng_block``, so that tiles start at local multiples of ``BLOCK``."""
    vec = VEC_BYTES // elem_size
    return numel % vec == 0 and base % rng_block == 0 and all(x.data_ptr() % VEC_BYTES == 0 for x in tensors)


class Group(NamedTuple):
    """One launch: the slots (indices into the caller's tensor lists) whose tensors share a storage
    dtype and alignment, in list order, and the global index of element 0 of each."""

    dtype: torch.dtype
    aligned: bool
    slots: list[int]
    bases: list[int]


def group_tensors(
    numels: Sequence[int], members: Sequence[Sequence[torch.Tensor]], offset: int = 0, rng_block: int = PHILOX_ELEMS
) -> list[Group]:
    """Slots ``p`` with ``numels[p] > 0`` grouped by the dtype of ``members[p][0]`` and by
    :func:`is_aligned` of all of ``members[p]`` (the tensors one slot's program touches). Slot
    ``p``'s base is ``offset`` plus the numels of the slots before it; ``rng_block`` as in
    :func:`tiles` (1: tiles start at each tensor's element 0, as clip's chunks)."""
    by_key: dict[tuple[torch.dtype, bool], Group] = {}
    base = offset
    for p, (n, tensors) in enumerate(zip(numels, members, strict=True)):
        if n:
            dtype = tensors[0].dtype
            key = (dtype, is_aligned(tensors, n, dtype.itemsize, base, rng_block))
            grp = by_key.setdefault(key, Group(*key, [], []))
            grp.slots.append(p)
            grp.bases.append(base)
        base += n
    return list(by_key.values())


def tiles(
    numels: Sequence[int], bases: Sequence[int], block: int, rng_block: int = PHILOX_ELEMS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tile table: for each tile, its tensor slot and local first element (see :func:`tile`).

    Tensor ``t`` covers global elements ``[bases[t], bases[t] + numels[t])``; its tiles start at
    ``bases[t]`` rounded down to a multiple of ``rng_block`` (the elements of one generator call),
    so the first one may start below element 0. Built with tensor ops (a large model has ~10^6
    tiles); a tensor's tiles are consecutive entries.
    """
    n = torch.tensor(numels, dtype=torch.int64)
    head = torch.tensor(bases, dtype=torch.int64) % rng_block
    counts = (n + head + block - 1) // block
    slots = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int64), counts)
    first = torch.cumsum(counts, 0) - counts
    starts = (torch.arange(slots.numel(), dtype=torch.int64) - first[slots]) * block - head[slots]
    return slots, starts


# =============================================================================================
# Device functions
# =============================================================================================

#: Round fp32 -> bf16 with integer ops (the interpreter's own conversion truncates).
_EMULATE_BF16_RNE = tl.constexpr(interpreting())


@triton.jit
def typed_ptr(addr_table, slot, ELEM: tl.constexpr, ALIGNED: tl.constexpr):
    """The address at ``addr_table[slot]`` as an ``ELEM*``; with ``ALIGNED``, hinted 16-byte aligned."""
    p = tl.load(addr_table + slot).to(tl.pointer_type(ELEM))
    if ALIGNED:
        # Must sit on the typed pointer: a hint on the int64 address is lost by the int->ptr cast.
        p = tl.multiple_of(p, 16)
    return p


@triton.jit
def load_coeff(coeff_bits, j):
    """The fp32 value whose bits (:func:`fp32_bits`) are at ``coeff_bits[j]``."""
    # Values travel as their fp32 bit patterns inside the int64 metadata tensor (one H2D copy
    # for every table); reinterpreting the low 32 bits recovers the exact fp32 value.
    return tl.load(coeff_bits + j).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def tile_span(tile_slot, tile_start, numels, ALIGNED: tl.constexpr, VEC: tl.constexpr, BLOCK: tl.constexpr):
    """``(t, start, n, idx)`` of this program's tile: tensor slot, first local element, the
    tensor's numel and the ``BLOCK`` local indices. ``ALIGNED``: ``start`` and ``n`` are
    multiples of ``VEC`` (elements per 128-bit vector)."""
    pid = tl.program_id(0).to(tl.int64)
    t = tl.load(tile_slot + pid)
    start = tl.load(tile_start + pid)
    n = tl.load(numels + t)
    if ALIGNED:
        # The mask idx < n is only constant over whole vectors if n is a multiple of VEC.
        start = tl.multiple_of(start, VEC)
        n = tl.multiple_of(n, VEC)
    return t, start, n, start + tl.arange(0, BLOCK)


@triton.jit
def tile(tile_slot, tile_start, numels, ALIGNED: tl.constexpr, VEC: tl.constexpr, BLOCK: tl.constexpr):
    """``(t, start, idx, mask)`` of this program's tile (see :func:`tiles`): tensor slot, first local
    element, the ``BLOCK`` local indices and which of them exist. ``ALIGNED``: ``start`` and the
    tensor's numel are multiples of ``VEC`` (and ``start >= 0``)."""
    t, start, n, idx = tile_span(tile_slot, tile_start, numels, ALIGNED, VEC, BLOCK)
    mask = idx < n
    if not ALIGNED:
        mask = mask & (idx >= 0)
    return t, start, idx, mask


@triton.jit
def philox_words(bases, t, start, key, BLOCK: tl.constexpr):
    """The four Philox words ``[BLOCK/4]`` each of the tile's blocks: global elements
    ``bases[t] + start + [0, BLOCK)`` (a multiple of 4 first), 4 per block; ``key`` = (seed low,
    seed high, step, stream)."""
    blocks = ((tl.load(bases + t) + start) >> 2) + tl.arange(0, BLOCK // 4)
    c0 = (blocks & MASK32).to(tl.uint32)
    c1 = (blocks >> 32).to(tl.uint32)
    c2 = tl.zeros_like(c0) + tl.load(key + 2).to(tl.uint32)
    c3 = tl.zeros_like(c0) + tl.load(key + 3).to(tl.uint32)
    return philox4x32_10(c0, c1, c2, c3, tl.load(key), tl.load(key + 1))


@triton.jit
def philox_normals(w0, w1, w2, w3, BLOCK: tl.constexpr):
    """The tile's ``BLOCK`` normals in element order from its Philox words (:func:`philox_words`)."""
    # Both Box-Muller pairs at once on [BLOCK/4, 2]: (w0, w1) in column 0, (w2, w3) in 1;
    # join(z_first, z_second)[b, i, j] = z_{2i+j}, so each GPU thread owns whole blocks.
    z_first, z_second = box_muller(tl.join(w0, w2), tl.join(w1, w3))
    return tl.reshape(tl.join(z_first, z_second), [BLOCK])


@triton.jit
def tile_normals(bases, t, start, key, BLOCK: tl.constexpr):
    """The Philox normals ``z`` of the tile's ``BLOCK`` global elements, in element order."""
    w0, w1, w2, w3 = philox_words(bases, t, start, key, BLOCK)
    return philox_normals(w0, w1, w2, w3, BLOCK)


@triton.jit
def round_to(v, dtype: tl.constexpr):
    """fp32 ``v`` rounded to nearest-even in ``dtype`` (the store of every fp32 result)."""
    if dtype == tl.bfloat16 and _EMULATE_BF16_RNE:
        bits = v.to(tl.uint32, bitcast=True)
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        rounded = tl.where(v != v, 0x7FC0, rounded)  # NaN stays NaN
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(dtype)
