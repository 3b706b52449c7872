"""Static check of the GPU code, on a machine without a GPU (DESIGN.md §5).

Compiles the real GPU code ahead of time and inspects what the compilers produced:

1. Every Triton kernel in ``triton_kernels/clip.py``, ``noise.py``, ``filter.py`` and ``optim.py`` goes through
   ``triton.compile`` with an ``ASTSource`` for ``GPUTarget("cuda", 80|90, 32)``. A streaming
   kernel (the two that read the ``B×D`` per-sample gradients) fails the check unless its PTX has
   128-bit global loads (``ld.global*.v4.b32`` / ``.v2.b64``) and no local memory. The noise
   kernel must use no local memory in any variant, and its aligned variants must store with
   128-bit vectors (and load with them when adding in place). The filter kernel (linear_filter_)
   must use no local memory, and its aligned variants must load and store 128 bits wide; so must the fused
   optimizer step kernel (stores: in its fp32-parameter variants), compiled with the options its launcher
   passes (no FMA contraction). The BK layer norm kernel (``triton_kernels/layers.py``, its
   linear and Conv2d launch configs and pipeline depth) must use no local memory, and its variants
   whose rows are 16-byte aligned (linear: rows of ``a``; conv: ``g``'s channel planes) must load
   128 bits wide (its pipelined tile loads are 16-byte ``cp.async`` copies into shared memory,
   counted as 128-bit loads). Registers and spills come from
   running Triton's own ``ptxas -v`` on the PTX (``CompiledKernel.n_regs`` needs a driver).
   The two streaming kernels' 128-bit loads must take their address from a 64-bit register
   product (the sample offset ``i·n``) and from no 32-bit product or narrowing
   (:func:`offset64_problems`): B·D passes 2^31 elements on large models.
2. Every ``csrc/cuda/*.cu`` is compiled with the flags, defines and includes of the extension
   build (``tools/build_config.py``, which ``setup.py`` reads too), all archs in one nvcc
   invocation; ``-Xptxas -v`` gives per-kernel registers and spills. Any spill, any kernel stack
   frame (local memory), or a compile error, fails the check; so does a source that compiles fewer
   (or more) instantiations of a kernel than :data:`REQUIRED_CUDA_KERNELS` lists for it, so that a
   variant a launcher stops instantiating is not silently left unchecked; and so does an
   instantiation matching :data:`REQUIRED_CUDA_WIDE_LOADS` whose SASS (``cuobjdump -sass``, the
   toolkit's or the one Triton ships) has no 128-bit global load. No ``.cu`` files, or no
   ``nvcc``, is reported as skipped. Without nvcc too, a ``blockIdx``/``blockDim``/``gridDim``
   component multiplied in 32 bits anywhere in csrc/cuda fails the check (:func:`grid_index_problems`).
   Device code only (``-fatbin``) by default; ``--host`` compiles the host side too (``-c``,
   about twice as slow, since the torch headers then go through g++ as well). When the built
   extension (``dpkernels/_C*.so``) is newer than every CUDA source and header and holds every
   source for every arch, its machine code is read instead (``cuobjdump -res-usage``: registers,
   stack and local memory, where spills go; ``-sass`` for the wide loads): seconds instead of the
   minutes of compiling again what the build just compiled. ``--compile`` compiles regardless.

Usage::

    python tools/gpu_static_check.py [--json PATH] [--arch 80 90] [--skip-triton] [--skip-cuda] [--host] [--compile]

Exit status 0 when every check passes. Importable: :func:`check_triton`, :func:`check_cuda` and
:func:`run_all` return plain dicts (the JSON written by ``--json``).

The Triton part runs in a subprocess with ``TRITON_INTERPRET`` removed from its environment:
under the interpreter ``@triton.jit`` yields interpreted functions, which cannot be compiled,
and a test session usually has the interpreter on.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _build_config():
    """tools/build_config.py, loaded by path (tools/ is no package; tests load this file by path)."""
    path = Path(__file__).resolve().parent / "build_config.py"
    spec = importlib.util.spec_from_file_location("dpk_build_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BUILD = _build_config()
DEFAULT_ARCHS = BUILD.CUDA_ARCHS
STREAMING_KERNELS = ("_per_sample_sumsq_kernel", "_weighted_sum_kernel")
NOISE_KERNELS = ("_noise_kernel", "_chacha_kernel")
FILTER_KERNELS = ("_filter_kernel", "_step_kernel")
LAYER_KERNELS = ("_linear_sumsq_kernel",)
# Entry kernels that a CUDA source must compile for every arch: short-name prefix (as in the report)
# -> number of instantiations. The BK tile kernel: LinearLayout over 3 dtypes x 128-bit loads or
# not x shift x scale, ConvLayout (implicit im2col) over 3 dtypes x shift x scale.
REQUIRED_CUDA_KERNELS = {
    "csrc/cuda/layers.cu": {
        "tiled_sumsq_kernel<dpkernels::LinearLayout<": 24,
        "tiled_sumsq_kernel<dpkernels::ConvLayout<": 12,
        "tiled_sumsq_reduce_kernel": 1,
    },
}

# CUDA entry kernels whose SASS must load 128 bits wide (``LDG...128``, counted by cuobjdump): a
# regular expression on the short name, per source. The BK tile kernel's LinearLayout<T, true>
# stages its a/g chunks with uint4 loads (the vector path); its scalar and conv layouts may not.
REQUIRED_CUDA_WIDE_LOADS = {
    "csrc/cuda/layers.cu": r"^tiled_sumsq_kernel<dpkernels::LinearLayout<[\w:]+, true>",
}
_SASS_LDG_128_RE = re.compile(r"\bLDG(?:\.[\w]+)*\.128\b")

# A 128-bit global access: four 32-bit or two 64-bit lanes (any cache/eviction qualifiers).
_LD_RE = re.compile(r"\bld\.global[\w.:]*")
_ST_RE = re.compile(r"\bst\.global[\w.:]*")
# A 16-byte asynchronous global-to-shared copy (the software-pipelined loads feeding tl.dot).
_CP_ASYNC_16_RE = re.compile(r"\bcp\.async\.c[ag]\.shared\.global\s*\[[^\]]*\],\s*\[[^\]]*\],\s*(?:0x10|16)\b")
_WIDE = (".v4.b32", ".v4.f32", ".v4.u32", ".v4.s32", ".v2.b64", ".v2.f64", ".v2.u64", ".v2.s64")


def _is_128(op: str) -> bool:
    return any(w in op for w in _WIDE)


def _requirements(kernel: str, consts: dict) -> dict:
    """What the PTX of one variant must show: 128-bit loads / stores, no local memory."""
    if kernel in STREAMING_KERNELS:
        return {"loads_128": True, "stores_128": False, "no_local": True}
    if kernel in NOISE_KERNELS:
        # MODE 2 adds in place (reads the tensor); unaligned variants use narrow accesses.
        aligned = bool(consts.get("ALIGNED"))
        return {"loads_128": aligned and consts["MODE"] == 2, "stores_128": aligned, "no_local": True}
    if kernel in FILTER_KERNELS:
        # Every variant reads and writes fp32 state buffers; aligned ones must do so 128 bits wide
        # (the optimizer steps: stores too when the parameters are fp32; a bf16 DP² adaptive step
        # writes nothing but the 16-bit parameters).
        aligned = bool(consts.get("ALIGNED"))
        fp32 = consts.get("ELEM") is None or consts["ELEM"].primitive_bitwidth == 32
        return {"loads_128": aligned, "stores_128": aligned and (kernel == "_filter_kernel" or fp32), "no_local": True}
    if kernel in LAYER_KERNELS:
        # Linear: rows of a (and of scale/shift) start 16-byte aligned when VEC_IN > 1. Conv: the
        # patches are gathered element by element; g's channel planes are aligned when VEC_OUT > 1.
        aligned = consts["VEC_OUT" if consts["IS_CONV"] else "VEC_IN"] > 1
        return {"loads_128": aligned, "stores_128": False, "no_local": True}
    return {"loads_128": False, "stores_128": False, "no_local": False}


# ---------------------------------------------------------------------------------------------
# 64-bit offsets in the PTX
# ---------------------------------------------------------------------------------------------

# Kernels that index the B×D per-sample gradients: a sample offset i·n passes 2^31 elements once
# B·D does, so it must be formed in 64 bits (an int32 product wraps: issue 17, "Large tensors").
OFFSET64_KERNELS = STREAMING_KERNELS
_PTX_INSTR_RE = re.compile(r"^\s*(?:@!?%\w+\s+)?([a-z][\w.:]*)\s+([^;]*);", re.M)
_PTX_REG_RE = re.compile(r"%\w+")
# Integer multiplies that keep the low part (mul.lo / mad.lo) or the whole product (mul.wide /
# mad.wide: 32 x 32 -> 64 bits, exact). mul.hi (Philox's) is not an offset.
_PTX_MUL_RE = re.compile(r"^(?:mul|mad)\.(lo|wide)\.([su](?:16|32|64))$")
# An integer narrowed from 64 to 32 (or 16) bits: what (i·n).to(tl.int32) compiles to.
_PTX_NARROW_RE = re.compile(r"^cvt\.[su](?:16|32)\.[su]64$")


def ptx_address_products(ptx: str) -> list[dict]:
    """Per ``ld.global``: its index among the instructions, whether it is 128 bits wide, and the
    register × register integer multiplies its address is derived from, as ``(opcode, bits)``
    (a narrowing ``cvt`` from 64 bits counts as a 32-bit one: it wraps the same way).

    A def-use walk back from the address register through every instruction that writes a
    register it reads (all writes of a register count, so loop-carried values are covered); loaded
    values end the walk (a table entry such as a tensor's numel is data, not arithmetic). A product
    by an immediate (the element size, a Philox constant) is left out: only a product of two run-time
    values (sample index times row length) can pass 2^31 unnoticed.
    """
    defs: dict[str, list[tuple[str, list[str]]]] = {}
    loads = []
    for index, m in enumerate(_PTX_INSTR_RE.finditer(ptx)):
        op, args = m.group(1), m.group(2)
        if op.startswith("ld.global"):
            addr = re.search(r"\[\s*(%\w+)", args)
            if addr:
                loads.append((index, _is_128(op), addr.group(1)))
            continue  # a loaded register is a leaf
        if op.startswith(("st.", "bra", "ret", "bar", "@", "cp.async")):
            continue
        regs = _PTX_REG_RE.findall(args)
        if regs and args.lstrip().startswith(regs[0]):
            defs.setdefault(regs[0], []).append((op, [a.strip() for a in args.split(",")[1:]]))
    out = []
    for index, wide, addr in loads:
        seen, todo, products = {addr}, [addr], set()
        while todo:
            for op, srcs in defs.get(todo.pop(), ()):
                mul = _PTX_MUL_RE.match(op)
                if mul and len(srcs) >= 2 and all(_PTX_REG_RE.fullmatch(a) for a in srcs[:2]):
                    bits = 64 if mul.group(1) == "wide" or mul.group(2).endswith("64") else 32
                    products.add((op, bits))
                elif _PTX_NARROW_RE.match(op):
                    products.add((op, 32))
                for reg in _PTX_REG_RE.findall(",".join(srcs)):
                    if reg not in seen:
                        seen.add(reg)
                        todo.append(reg)
        out.append({"instruction": index, "wide": wide, "products": sorted(products)})
    return out


def offset64_problems(ptx: str) -> list[str]:
    """What is wrong with the address arithmetic of a :data:`OFFSET64_KERNELS` kernel's PTX: a
    128-bit load whose address comes from a 32-bit register × register product or narrowing, or no
    128-bit (per-sample gradient) load whose address comes from a 64-bit one (the sample offset i·n)."""
    loads = ptx_address_products(ptx)
    problems = []
    # The 128-bit loads are the B×D streams in the aligned variants this check compiles; narrow ones
    # include libdevice's table lookups (float64 sin/log), indexed in 32 bits by design.
    narrow = sorted({op for ld in loads if ld["wide"] for op, bits in ld["products"] if bits == 32})
    if narrow:
        problems.append(f"a 128-bit load's address comes from 32-bit arithmetic ({', '.join(narrow)}): wraps past 2^31")
    if not any(ld["wide"] and any(bits == 64 for _, bits in ld["products"]) for ld in loads):
        problems.append("no 128-bit load's address comes from a 64-bit product (the sample offset i·n)")
    return problems


# ---------------------------------------------------------------------------------------------
# ptxas -v output
# ---------------------------------------------------------------------------------------------


def parse_ptxas_log(log: str) -> dict[tuple[str, str], dict]:
    """``{(function, arch): {registers, spill_stores, spill_loads, stack}}`` from ``ptxas -v``.

    ptxas prints, per function: ``Compiling entry function 'F' for 'sm_90'``, then
    ``Function properties for F`` followed by ``N bytes stack frame, N bytes spill stores, N bytes
    spill loads`` and ``Used N registers``. Non-entry device functions that were not inlined get
    their own properties block; they are reported too (their spills are spills as well).
    """
    out: dict[tuple[str, str], dict] = {}
    arch = "?"
    current = None
    props_for = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)' for '(\w+)'", line)
        if m:
            current, arch = m.group(1), m.group(2)
            out.setdefault((current, arch), {})
            continue
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            props_for = m.group(1)
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and props_for is not None:
            rec = out.setdefault((props_for, arch), {})
            rec.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
            props_for = None
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and current is not None:
            out[(current, arch)]["registers"] = int(m.group(1))
    return out


# ---------------------------------------------------------------------------------------------
# Triton
# ---------------------------------------------------------------------------------------------


def _triton_specs():
    """``(kernel, variant, signature, constexprs, num_warps)`` for every compiled variant.

    Scalars are ``i32`` and pointers 16-byte aligned, which is what the JIT specialises to for
    torch allocations and for the int64 metadata slices the launchers pass.
    """
    import triton.language as tl
    from dpkernels.triton_kernels import clip as tk
    from dpkernels.triton_kernels import filter as tf
    from dpkernels.triton_kernels import noise as tn

    ptr_tables = (
        "grad_ptrs",
        "shift_ptrs",
        "scale_ptrs",
        "coeff_bits",
        "numels",
        "chunk_slot",
        "chunk_start",
    )
    sumsq_sig = {n: "*i64" for n in ptr_tables}
    sumsq_sig.update(partial_ptr="*fp64", n_cols="i32", col0="i32", row0="i32", T="i32")
    wsum_sig = {n: "*i64" for n in ("grad_ptrs", "out_ptrs", "coeff_bits", "numels", "layer_ids")}
    wsum_sig.update(chunk_slot="*i64", chunk_start="*i64", weights_ptr="*fp32")
    wsum_sig.update(w_stride_b="i32", w_stride_l="i32", B="i32", T="i32")
    wsum_sig.update(bases="*i64", noise_ptrs="*i64", key="*i64", std="fp32", scale="fp32")
    seg_sig = dict(partial_ptr="*fp64", n_cols="i32", seg_first="*i64", seg_count="*i64", out_ptr="*fp64", L="i32")

    specs = []
    for name, elem in (("fp32", tl.float32), ("bf16", tl.bfloat16)):
        vec = 4 if name == "fp32" else 8
        for K, shift in ((1, False), (2, True)):
            variant = f"{name} k={K}" + (" shift+scale" if shift else "")
            consts = dict(K=K, HAS_SHIFT=shift, HAS_SCALE=shift, ELEM=elem, BLOCK=tk.SUMSQ_BLOCK, ALIGNED=True, VEC=vec)
            specs.append((tk._per_sample_sumsq_kernel, variant, sumsq_sig, consts, tk.SUMSQ_NUM_WARPS))
        private = {tk.EPI_PHILOX.value: " private(philox)", tk.EPI_CHACHA.value: " private(chacha20)"}
        for K, epi in ((1, tk.EPI_NONE), (2, tk.EPI_NONE), (1, tk.EPI_PHILOX), (1, tk.EPI_CHACHA)):
            consts = dict(
                K=K, ELEM=elem, BLOCK=tk.WSUM_BLOCK, ROWS=tk.WSUM_ROWS, ALIGNED=True, VEC=vec, EPILOGUE=epi.value
            )
            variant = f"{name} k={K}" + private.get(epi.value, "")
            specs.append((tk._weighted_sum_kernel, variant, wsum_sig, consts, tk.WSUM_NUM_WARPS))
    specs.append((tk._segment_sum_kernel, "fp64", seg_sig, dict(BLOCK=tk.SEGMENT_BLOCK), 4))
    for name in ("fp32", "fp64"):
        # r and the bounds are always fp64 (the weight is evaluated in fp64 for fp32 norms too).
        sig = dict(norms_ptr=f"*{name}", params_ptr="*fp64", out_ptr=f"*{name}", N="i32", L_C="i32")
        for mode, mode_id in tk._MODE_IDS.items():
            consts = dict(MODE=mode_id, BLOCK=tk.CLIP_BLOCK)
            specs.append((tk._clip_factors_kernel, f"{name} {mode}", sig, consts, 4))

    noise_sig = {n: "*i64" for n in ("ptrs", "numels", "bases", "tile_slot", "tile_start", "key")}
    noise_sig["std"] = "fp32"
    noise_variants = [("words int64", tn.MODE_WORDS, tl.int64, True)]
    for name, elem in (("fp32", tl.float32), ("bf16", tl.bfloat16)):
        noise_variants.append((f"fill {name}", tn.MODE_FILL, elem, True))
        noise_variants.append((f"add {name}", tn.MODE_ADD, elem, True))
        noise_variants.append((f"add {name} unaligned", tn.MODE_ADD, elem, False))
    for variant, mode, elem, aligned in noise_variants:
        vec = 128 // elem.primitive_bitwidth  # elements per 128-bit vector
        consts = dict(MODE=mode, ELEM=elem, BLOCK=tn.NOISE_BLOCK, ALIGNED=aligned, VEC=vec)
        specs.append((tn._noise_kernel, variant, noise_sig, consts, tn.NOISE_NUM_WARPS))

    # Secure mode (ChaCha20, float64 Box-Muller): masked accesses only, so no 128-bit requirement;
    # no local memory (libdevice cospi/sinpi have no Payne-Hanek slow path), no spills.
    chacha_sig = {n: "*i64" for n in ("ptrs", "numels", "bases", "tile_slot", "tile_start", "key")}
    chacha_variants = [("chacha20 words int64", tn.MODE_WORDS, tl.int64, 16)]
    for name, elem in (("fp32", tl.float32), ("bf16", tl.bfloat16), ("fp16", tl.float16)):
        chacha_variants.append((f"chacha20 fill {name}", tn.MODE_FILL, elem, 8))
        chacha_variants.append((f"chacha20 add {name}", tn.MODE_ADD, elem, 8))
    for variant, mode, elem, per_block in chacha_variants:
        consts = dict(MODE=mode, ELEM=elem, BLOCK=per_block * tn.CHACHA_BLOCKS)
        specs.append((tn._chacha_kernel, variant, chacha_sig, consts, tn.CHACHA_NUM_WARPS))
    # linear_filter_: BLT noise (3 buffers, fresh noise, accumulate into the target), a banded ring
    # (b = 4: 2 read-only slots, the oldest read and overwritten), momentum on bf16 inputs (no
    # output), unaligned BLT.
    filter_sig = {n: "*i64" for n in ("in_ptrs", "out_ptrs", "state_ptrs", "numels", "bases")}
    filter_sig.update(tile_slot="*i64", tile_start="*i64", key="*i64", coeff_bits="*i64", std="fp32", T="i32")
    filter_variants = [
        ("blt k=3 noise+acc fp32", 3, 0b111, 0b111, 0b111, 0, 0b111, False, True, True, True, tl.float32, True),
        ("banded b=4 noise+acc bf16", 3, 0b111, 0b011, 0b100, 0, 0b100, True, False, True, True, tl.bfloat16, True),
        ("momentum bf16 in, no out", 1, 0b1, 0, 0b1, 0, 0b1, True, True, False, False, tl.bfloat16, True),
        ("blt k=3 noise+acc fp32 unaligned", 3, 0b111, 0b111, 0b111, 0, 0b111, False, True, True, True, tl.float32,
         False),
    ]  # fmt: skip
    for variant, K, cb, db, eb, fb, wb, has_in, acc, has_out, noise, elem, aligned in filter_variants:
        consts = dict(
            K=K, C_BITS=cb, D_BITS=db, E_BITS=eb, F_BITS=fb, W_BITS=wb, HAS_A=True, HAS_IN=has_in,
            HAS_OUT=has_out, ACCUMULATE=acc, NOISE=noise, ELEM=elem, BLOCK=tf.FILTER_BLOCK, ALIGNED=aligned,
            VEC=128 // elem.primitive_bitwidth,
        )  # fmt: skip
        specs.append((tf._filter_kernel, variant, filter_sig, consts, tf.FILTER_NUM_WARPS))
    specs += _step_specs()
    specs += _layer_specs()
    return specs


def _layer_specs():
    """The BK layer norm kernel (triton_kernels/layers.py) with the tile configs its launchers use on
    a GPU: linear inputs in fp32 (IEEE FMA dots) and 16-bit (tensor cores), with neither, either or
    both of shift and scale, and rows that are not 16-byte aligned (``d_out`` of a vocabulary head; ``d_in``
    too); Conv2d inputs (``IS_CONV``, implicit im2col) in fp32 and bf16 with every geometry argument
    a runtime int, and a 3x3 stride-1 padding-1 conv whose ones the JIT specialises to constants
    (``g``'s planes unaligned: ``T = 7·7``)."""
    import torch
    import triton.language as tl
    from dpkernels.triton_kernels import layers as ly

    blocks_of = {"linear": ly.LINEAR_BLOCKS, "conv": ly.CONV_BLOCKS}
    dtypes = {"fp32": (tl.float32, torch.float32), "bf16": (tl.bfloat16, torch.bfloat16),
              "fp16": (tl.float16, torch.float16)}  # fmt: skip
    conv_args = ("H", "W", "W_out", "KH", "KW", "stride_h", "stride_w", "pad_h", "pad_w", "dil_h", "dil_w",
                 "a_stride_b", "a_stride_c", "g_stride_b", "g_stride_c")  # fmt: skip
    # Arguments a 3x3, stride 1, padding 1, dilation 1 conv passes as 1 (constexprs in the JIT).
    s1p1 = ("stride_h", "stride_w", "pad_h", "pad_w", "dil_h", "dil_w")
    # name, dtype, (shift, scale), rows of a (linear) or scale (conv) aligned, rows of g aligned, ones.
    # Scale alone is scale-then-privatize's case, shift alone a shift without preconditioner.
    none, both, shift, scale = (False, False), (True, True), (True, False), (False, True)
    variants = [
        ("fp32", "fp32", none, True, True, None),
        ("fp32 shift+scale", "fp32", both, True, True, None),
        ("fp32 shift", "fp32", shift, True, True, None),
        ("fp32 scale", "fp32", scale, True, True, None),
        ("fp32 shift+scale unaligned", "fp32", both, False, False, None),
        ("bf16", "bf16", none, True, True, None),
        ("bf16 shift+scale", "bf16", both, True, True, None),
        ("bf16 scale", "bf16", scale, True, True, None),
        ("bf16 shift+scale d_out unaligned", "bf16", both, True, False, None),
        ("fp16 shift+scale", "fp16", both, True, True, None),
        ("fp32 conv", "fp32", none, True, True, ()),
        ("fp32 conv shift+scale", "fp32", both, True, True, ()),
        ("fp32 conv scale", "fp32", scale, True, True, ()),
        ("fp32 conv 3x3 s1 p1 shift+scale unaligned", "fp32", both, False, False, s1p1),
        ("bf16 conv", "bf16", none, True, True, ()),
        ("bf16 conv shift+scale", "bf16", both, True, True, ()),
        ("bf16 conv 3x3 s1 p1 shift+scale unaligned", "bf16", both, False, False, s1p1),
    ]
    specs = []
    for variant, name, (has_shift, has_scale), in_aligned, out_aligned, ones in variants:
        is_conv = ones is not None
        elem, dtype = dtypes[name]
        blocks = blocks_of["conv" if is_conv else "linear"][dtype]
        sig = dict(a_ptr=f"*{name}", g_ptr=f"*{name}", scale_ptr="*fp32", shift_ptr="*fp32", partial_ptr="*fp32")
        sig.update(T="i32", d_in="i32", d_out="i32", tiles_k="i32", n_tiles="i32", row0="i32")
        sig.update({n: "i32" for n in conv_args if n not in (ones or ())})
        vec = 128 // elem.primitive_bitwidth
        consts = dict(
            HAS_SCALE=has_scale, HAS_SHIFT=has_shift, IS_CONV=is_conv, BLOCK_O=blocks.BLOCK_O, BLOCK_K=blocks.BLOCK_K,
            BLOCK_T=blocks.BLOCK_T, VEC_IN=vec if in_aligned else 1, VEC_OUT=vec if out_aligned else 1,
        )  # fmt: skip
        consts.update({n: 1 for n in ones or ()})
        specs.append((ly._linear_sumsq_kernel, variant, sig, consts, blocks.num_warps))
    return specs


def _step_specs():
    """The fused optimizer steps (triton_kernels/optim.py): every family and variant, independent
    (Philox), correlated (BLT noise buffers) and pre-drawn noise, fp32 and bf16 parameters."""
    import triton.language as tl
    from dpkernels.triton_kernels import optim as to

    tables = ("param_ptrs", "sum_ptrs", "state_ptrs", "past_ptrs", "noise_ptrs", "noise_state_ptrs", "numels", "bases")
    sig = {n: "*i64" for n in (*tables, "tile_slot", "tile_start", "key", "coeff_bits", "hyper")}
    sig.update(partial_ptr="*fp64", std="fp32", T="i32")
    indep = [1.0, 1.0]
    blt2 = [1.0, 1.0, -0.3, -0.1, 0.9, 0.5, 1.0, 1.0, 0.0, 0.0]  # c, d, e ≠ 0 on 2 buffers (BLTNoise)
    momentum = [1.0, 1.0, 0.9, 0.0, 1.0, 0.0]
    # DP-PMLF with na = 2, nb = 1: m ring (oldest read, then overwritten with y), v̄ slot (= x).
    pmlf = [0.5, 2.0, -0.4, -0.2, 0.3, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    none = {}
    wd, decay, upd = ({"HAS_WD": True}, {"HAS_DECAY": True}, {"UPDATE_B": True})
    fp32, bf16 = tl.float32, tl.bfloat16
    F = to.NOISE_FILTER.value
    sgd, dp2, adam, macadam = to.SGD.value, to.DP2.value, to.ADAM.value, to.MACADAM.value
    variants = [  # name, family, variant, flags, noise, noise coeffs, dir coeffs, past, elem, aligned
        ("sgd", sgd, 0, none, F, indep, indep, False, fp32, True),
        ("sgd momentum+wd bf16", sgd, 0, wd, F, indep, momentum, False, bf16, True),
        ("pmlf blt", sgd, 0, none, F, blt2, pmlf, True, fp32, True),
        ("dp2 sgd-phase", dp2, 0, none, F, indep, indep, False, fp32, True),
        ("dp2 adaptive bf16", dp2, to.DP2_ADAPTIVE.value, none, F, indep, indep, False, bf16, True),
        ("adamw", adam, 0, decay, F, indep, indep, False, fp32, True),
        ("adam-bc bf16", adam, to.ADAM_BC.value, none, F, indep, indep, False, bf16, True),
        ("stp blt", adam, to.ADAM_STP.value, none, F, blt2, indep, False, fp32, True),
        ("adam pre-drawn", adam, 0, none, to.NOISE_GIVEN.value, indep, indep, False, fp32, True),
        ("adam unaligned", adam, 0, none, F, indep, indep, False, fp32, False),
        ("macadam", macadam, 0, upd, F, indep, indep, False, fp32, True),
        ("macadam-bc-b2 blt bf16", macadam, 2, upd, F, blt2, indep, False, bf16, True),
    ]
    specs = []
    for name, family, variant, flags, noise, ncoeffs, dcoeffs, past, elem, aligned in variants:
        switches = {**to.SWITCHES_OFF, **flags}
        consts = dict(
            FAMILY=family, VARIANT=variant, **switches, NOISE=noise, **to._filter_consts(ncoeffs, "N"),
            **to._filter_consts(dcoeffs, "D"), HAS_PAST=past, ELEM=elem, BLOCK=to.STEP_BLOCK, ALIGNED=aligned,
            VEC=128 // elem.primitive_bitwidth,
        )  # fmt: skip
        specs.append((to._step_kernel, name, sig, consts, to.STEP_NUM_WARPS))
    return specs


def _ptxas_resources(ptx: str, ptxas: str, workdir: Path) -> dict:
    target = re.search(r"^\s*\.target\s+(\w+)", ptx, re.M).group(1)
    src = workdir / "k.ptx"
    src.write_text(ptx)
    # Same flags as triton/backends/nvidia/compiler.py make_cubin, so the numbers are the ones
    # the JIT would get.
    cmd = [ptxas, "-lineinfo", "-v", "--regAllocOptLevel=2", f"--gpu-name={target}", str(src)]
    cmd += ["-o", str(workdir / "k.cubin")]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        return {"ptxas_error": (res.stderr or res.stdout)[-2000:]}
    parsed = parse_ptxas_log(res.stderr + res.stdout)
    # One entry per Triton kernel; merge the entry and its properties block.
    merged: dict = {}
    for rec in parsed.values():
        merged.update(rec)
    return merged


def _triton_worker(archs: list[int]) -> list[dict]:
    """Compile every variant for every arch, in this process (which must not be interpreting)."""
    sys.path.insert(0, str(ROOT))
    import triton
    from dpkernels.triton_kernels.layers import LINEAR_COMPILE_OPTIONS
    from dpkernels.triton_kernels.optim import STEP_COMPILE_OPTIONS
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptxas = triton.knobs.nvidia.ptxas.path
    # Launch options besides num_warps, per kernel (the ones its launcher passes).
    extra_options = {"_step_kernel": STEP_COMPILE_OPTIONS, "_linear_sumsq_kernel": LINEAR_COMPILE_OPTIONS}
    results = []
    with tempfile.TemporaryDirectory(prefix="dpk_static_") as tmp:
        for fn, variant, sig, consts, num_warps in _triton_specs():
            names = fn.arg_names
            signature = {n: ("constexpr" if n in consts else sig[n]) for n in names}
            missing = [n for n in names if n not in consts and n not in sig]
            if missing:
                raise RuntimeError(f"{fn.__name__}: no signature entry for {missing}; update _triton_specs")
            attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in sig if sig[n].startswith("*")}
            for arch in archs:
                rec = {
                    "kernel": fn.__name__,
                    "variant": variant,
                    "arch": f"sm_{arch}",
                    "num_warps": num_warps,
                }
                rec["streaming"] = fn.__name__ in STREAMING_KERNELS
                need = _requirements(fn.__name__, consts)
                t0 = time.perf_counter()
                try:
                    src = ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
                    options = {"num_warps": num_warps, **extra_options.get(fn.__name__, {})}
                    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
                except Exception as exc:  # a kernel that does not compile is a failed check
                    rec.update(ok=False, problems=[f"compile error: {type(exc).__name__}: {str(exc)[:1500]}"])
                    results.append(rec)
                    continue
                rec["compile_s"] = round(time.perf_counter() - t0, 2)
                ptx = compiled.asm["ptx"]
                loads = Counter(_LD_RE.findall(ptx))
                stores = Counter(_ST_RE.findall(ptx))
                rec["loads_128"] = sum(c for op, c in loads.items() if _is_128(op)) + len(_CP_ASYNC_16_RE.findall(ptx))
                rec["loads_narrow"] = sum(c for op, c in loads.items() if not _is_128(op))
                rec["stores_128"] = sum(c for op, c in stores.items() if _is_128(op))
                rec["load_ops"] = dict(loads)
                rec["local_memory"] = bool(re.search(r"\.local\b", ptx))
                rec["shared_bytes"] = compiled.metadata.shared
                arch_dir = Path(tmp) / f"{fn.__name__}_{arch}"
                arch_dir.mkdir(exist_ok=True)
                rec.update(_ptxas_resources(ptx, ptxas, arch_dir))
                problems = []
                if "ptxas_error" in rec:
                    problems.append("ptxas failed on the Triton PTX")
                if need["loads_128"] and rec["loads_128"] == 0:
                    problems.append("no 128-bit global loads (ld.global.v4) in a streaming kernel")
                if need["stores_128"] and rec["stores_128"] == 0:
                    problems.append("no 128-bit global stores (st.global.v4 / .v2.b64) in an aligned variant")
                if need["no_local"] and rec["local_memory"]:
                    kind = "a streaming kernel" if rec["streaming"] else f"{fn.__name__}"
                    problems.append(f"uses local memory (.local) in {kind}")
                if fn.__name__ in OFFSET64_KERNELS:
                    problems += offset64_problems(ptx)
                if rec.get("spill_stores", 0) or rec.get("spill_loads", 0):
                    problems.append(f"spills {rec['spill_stores']} B stores / {rec['spill_loads']} B loads")
                rec.update(ok=not problems, problems=problems)
                results.append(rec)
    return results


def check_triton(archs=DEFAULT_ARCHS, timeout: float = 600) -> dict:
    """AOT-compile the Triton kernels for ``archs``; ``{"status", "results", "elapsed_s"}``.

    Runs in a subprocess without ``TRITON_INTERPRET`` (see the module docstring).
    """
    t0 = time.perf_counter()
    try:
        import triton  # noqa: F401
    except ImportError:
        return {"status": "skipped", "reason": "triton is not installed", "results": [], "elapsed_s": 0.0}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--triton-worker", "--arch", *map(str, archs)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    elapsed = round(time.perf_counter() - t0, 1)
    payload = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else ""
    if res.returncode != 0 or not payload.startswith("["):
        tail = (res.stderr or res.stdout)[-3000:]
        return {
            "status": "failed",
            "reason": f"worker exited {res.returncode}: {tail}",
            "results": [],
            "elapsed_s": elapsed,
        }
    results = json.loads(payload)
    status = "ok" if all(r["ok"] for r in results) else "failed"
    return {"status": status, "results": results, "elapsed_s": elapsed}


# ---------------------------------------------------------------------------------------------
# CUDA C++
# ---------------------------------------------------------------------------------------------


def nvcc_command(source: Path, out: Path, archs=DEFAULT_ARCHS, host: bool = False) -> list[str]:
    """The nvcc line: the build's CUDA flags and includes, every arch at once, ``ptxas -v``.

    By default only the device code is compiled (``-fatbin``): registers and spills come from
    ptxas, and the host pass over the torch headers would double the time without telling
    anything about them (the wheel build compiles the host side anyway). ``host=True`` runs the
    full ``-c`` compile instead.
    """
    import torch

    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # CUDA_HOME guess noise
    from torch.utils import cpp_extension

    torch_inc = Path(torch.__file__).parent / "include"
    includes = [*BUILD.include_dirs(ROOT), torch_inc, torch_inc / "torch/csrc/api/include"]
    includes += [*BUILD.nvidia_include_dirs(), sysconfig.get_paths()["include"]]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [shutil.which("nvcc") or "nvcc", "-c" if host else "-fatbin", str(source), "-o", str(out)]
    # The build's nvcc flags and defines plus what CUDAExtension adds.
    cmd += BUILD.NVCC_FLAGS
    cmd += [f for f in cpp_extension.COMMON_NVCC_FLAGS if f not in cmd]
    cmd += [*BUILD.cuda_define_flags(), "-DTORCH_EXTENSION_NAME=_C", "-DTORCH_API_INCLUDE_EXTENSION_H"]
    cmd += [f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-Xptxas", "-v", "--threads", str(len(archs))]
    if host:
        cmd += ["-Xcompiler", "-fPIC"]
    cmd += BUILD.gencode_flags(archs, ptx_arch=None)  # SASS only: ptxas -v reports on it
    cmd += [f"-I{d}" for d in dict.fromkeys(map(str, includes))]
    return cmd


def _short_name(demangled: str) -> str:
    """``per_sample_sumsq_kernel<float, true, false>`` from the full demangled signature."""
    name = demangled.removeprefix("void ").replace("(anonymous namespace)::", "")
    name = name.removeprefix("dpkernels::")
    depth = 0
    for pos, ch in enumerate(name):
        depth += ch == "<"
        depth -= ch == ">"
        if ch == "(" and depth == 0:
            return name[:pos]
    return name


def _demangle(names: list[str]) -> dict[str, str]:
    cxxfilt = shutil.which("c++filt")
    if not cxxfilt or not names:
        return {n: n for n in names}
    res = subprocess.run([cxxfilt], input="\n".join(names), capture_output=True, text=True)
    lines = res.stdout.splitlines()
    return dict(zip(names, lines, strict=False)) if len(lines) == len(names) else {n: n for n in names}


def required_kernel_problems(source: str, kernels: list[dict], archs) -> list[str]:
    """Problems with the instantiations ``source`` must compile (:data:`REQUIRED_CUDA_KERNELS`):
    ``kernels`` are the report's records (``kernel`` short name, ``arch``, ``entry``)."""
    problems = []
    for prefix, want in REQUIRED_CUDA_KERNELS.get(source, {}).items():
        for arch in archs:
            sm = f"sm_{arch}"
            got = sum(1 for k in kernels if k["entry"] and k["arch"] == sm and k["kernel"].startswith(prefix))
            if got != want:
                problems.append(
                    f"{prefix}... ({sm}): {got} instantiations compiled, {want} expected "
                    "(REQUIRED_CUDA_KERNELS in tools/gpu_static_check.py)"
                )
    return problems


def _cuobjdump() -> str | None:
    """cuobjdump from the toolkit, or the one Triton ships (the toolkit here has none)."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton
    except ImportError:
        return None
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(bundled) if bundled.exists() else None


def sass_wide_loads(binary: Path) -> dict[str, dict[tuple[str, str], int]] | None:
    """``{source: {(mangled name, "sm_XX"): number of 128-bit global loads}}`` from the SASS of a
    fatbin or of an extension module (``source`` is each cubin's ``identifier``, the ``.cu`` path it
    was compiled from); None without a cuobjdump."""
    tool = _cuobjdump()
    if tool is None:
        return None
    res = subprocess.run([tool, "-sass", str(binary)], capture_output=True, text=True)
    counts: dict[str, dict[tuple[str, str], int]] = {}
    source, arch, fn = "", "", None
    for line in res.stdout.splitlines():
        if m := re.search(r"identifier = (\S+)", line):
            source, fn = m.group(1), None
        elif m := re.search(r"code for (sm_\d+)", line):
            arch = m.group(1)
        elif m := re.search(r"Function : (\S+)", line):
            fn = m.group(1)
            counts.setdefault(source, {})[(fn, arch)] = 0
        elif fn is not None and _SASS_LDG_128_RE.search(line):
            counts[source][(fn, arch)] += 1
    return counts


def parse_res_usage(text: str) -> dict[str, dict[tuple[str, str], dict]]:
    """``{source: {(mangled name, "sm_XX"): {registers, stack, local}}}`` from ``cuobjdump
    -res-usage`` of an extension module (``source``: each cubin's ``identifier``)."""
    out: dict[str, dict[tuple[str, str], dict]] = {}
    source, arch, fn = "", "", None
    for line in text.splitlines():
        if m := re.search(r"identifier = (\S+)", line):
            source = m.group(1)
        elif m := re.search(r"arch = (sm_\d+)", line):
            arch = m.group(1)
        elif m := re.search(r"Function (\S+):$", line.strip()):
            fn = m.group(1)
        elif fn is not None and (m := re.search(r"REG:(\d+) STACK:(\d+) .*LOCAL:(\d+)", line)):
            res = {"registers": int(m.group(1)), "stack": int(m.group(2)), "local": int(m.group(3))}
            out.setdefault(source, {})[(fn, arch)] = res
            fn = None
    return out


def wide_load_problems(source: str, kernels: list[dict]) -> list[str]:
    """Problems with :data:`REQUIRED_CUDA_WIDE_LOADS` for ``source``: every matching entry kernel
    (records with ``ldg_128`` counted) must load 128 bits wide, and some kernel must match."""
    pattern = REQUIRED_CUDA_WIDE_LOADS.get(source)
    if pattern is None:
        return []
    matching = [k for k in kernels if k["entry"] and re.search(pattern, k["kernel"])]
    if not matching:
        return [f"no entry kernel of {source} matches {pattern!r} (REQUIRED_CUDA_WIDE_LOADS)"]
    return [f"{k['kernel']} ({k['arch']}): no 128-bit global loads (LDG.128) in its SASS"
            for k in matching if k.get("ldg_128") == 0]  # fmt: skip


def _built_extension(sources: list[Path], archs) -> Path | None:
    """``dpkernels/_C*.so`` when it was built from the current ``sources`` (newer than each of them
    and of every header under csrc/) with SASS of every source for every arch; else None."""
    tool = _cuobjdump()
    built = sorted((ROOT / "dpkernels").glob("_C*.so"))
    if tool is None or len(built) != 1:
        return None
    newest = max(f.stat().st_mtime for f in [*sources, *(ROOT / "csrc").rglob("*.h*"), ROOT / "tools/build_config.py"])
    if built[0].stat().st_mtime < newest:
        return None
    listing = subprocess.run([tool, "-lelf", str(built[0])], capture_output=True, text=True).stdout
    have = set(re.findall(r"\.(sm_\d+)\.cubin", listing))
    return built[0] if {f"sm_{a}" for a in archs} <= have else None


def _inspect_built(binary: Path, sources: list[Path], archs) -> list[dict]:
    """:func:`_compile_cu`'s records for ``sources``, from the resource table and SASS of ``binary``."""
    t0 = time.perf_counter()
    usage = parse_res_usage(
        subprocess.run([_cuobjdump(), "-res-usage", str(binary)], capture_output=True, text=True).stdout
    )
    wide = sass_wide_loads(binary) or {}
    by_name = {Path(ident).name: ident for ident in usage}  # identifiers are the build's own paths
    recs = []
    for source in sources:
        rel = str(source.relative_to(ROOT))
        ident = by_name.get(source.name)
        parsed = {k: v for k, v in usage.get(ident, {}).items() if k[1] in {f"sm_{a}" for a in archs}}
        rec = {"source": rel, "compile_s": round(time.perf_counter() - t0, 1), "command": f"cuobjdump {binary.name}"}
        if not parsed:
            rec.update(ok=False, kernels=[], problems=[f"no machine code of {rel} in {binary.name}"])
        else:
            rec.update(
                _kernel_report(rel, parsed, wide.get(ident, {}) if rel in REQUIRED_CUDA_WIDE_LOADS else None, archs)
            )
        recs.append(rec)
    return recs


def _compile_cu(source: Path, archs, workdir: Path, host: bool) -> dict:
    t0 = time.perf_counter()
    out = workdir / (source.stem + (".o" if host else ".fatbin"))
    cmd = nvcc_command(source, out, archs, host)
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    rec = {"source": str(source.relative_to(ROOT)), "compile_s": round(time.perf_counter() - t0, 1)}
    rec["command"] = " ".join(cmd)
    log = res.stderr + res.stdout
    if res.returncode != 0:
        errors = [ln for ln in log.splitlines() if "error" in ln.lower()]
        rec.update(ok=False, kernels=[], problems=["nvcc failed: " + "\n".join(errors[:20] or [log[-3000:]])])
        return rec
    found = sass_wide_loads(out) if rec["source"] in REQUIRED_CUDA_WIDE_LOADS else None
    wide = None if found is None else next(iter(found.values()), {})  # a fatbin of one source
    rec.update(_kernel_report(rec["source"], parse_ptxas_log(log), wide, archs))
    return rec


def _kernel_report(source: str, parsed: dict, wide: dict | None, archs) -> dict:
    """``{"ok", "kernels", "problems"}`` of one source from its per-function resources (``parsed``:
    :func:`parse_ptxas_log`'s, or :func:`parse_res_usage`'s with ``local`` bytes) and its SASS's
    128-bit load counts (``wide``, None without cuobjdump)."""
    names = _demangle(sorted({fn for fn, _ in parsed}))
    kernels, problems = [], []
    for (fn, arch), r in sorted(parsed.items(), key=lambda kv: (names[kv[0][0]], kv[0][1])):
        k = {"kernel": _short_name(names[fn]), "demangled": names[fn], "mangled": fn, "arch": arch, **r}
        k["entry"] = "registers" in r
        if r.get("spill_stores", 0) or r.get("spill_loads", 0):
            problems.append(f"{names[fn]} ({arch}) spills {r['spill_stores']} B stores / {r['spill_loads']} B loads")
        if k["entry"] and r.get("stack", 0):
            # A stack frame is local memory: e.g. sinf/cosf's Payne-Hanek slow path, which the shared
            # sincos_2pi of philox.h avoids.
            problems.append(f"{names[fn]} ({arch}) has a {r['stack']} B stack frame (local memory)")
        if r.get("local", 0):  # the built code's resource table: spills and stack frames live there
            problems.append(f"{names[fn]} ({arch}) uses {r['local']} B of local memory (spills or a stack frame)")
        if wide is not None and (fn, arch) in wide:
            k["ldg_128"] = wide[(fn, arch)]
        kernels.append(k)
    if shutil.which("c++filt"):  # the required names are demangled ones
        problems += required_kernel_problems(source, kernels, archs)
        if wide is not None:
            problems += wide_load_problems(source, kernels)
    return {"ok": not problems, "kernels": kernels, "problems": problems}


# A grid coordinate or size (up to 2^31 - 1 blocks along x) as an operand of a product: in 32 bits
# unless widened first. Source level, so it runs without nvcc; it sees the product written on the
# builtin itself (blockIdx.x * n), not one through a 32-bit variable holding it.
_GRID_BUILTIN_RE = re.compile(r"\b(?:blockIdx|blockDim|gridDim)\.[xyz]\b")
_WIDENED = ("int64_t{", "static_cast<int64_t>(", "uint64_t{", "static_cast<uint64_t>(", "size_t{")


def grid_index_problems(sources: dict[str, str]) -> list[str]:
    """``file:line`` of every ``blockIdx``/``blockDim``/``gridDim`` component multiplied without being
    widened to 64 bits first (``int64_t{blockIdx.x} * n``), in ``{name: CUDA source text}``."""
    problems = []
    for name, text in sources.items():
        code = re.sub(r"//[^\n]*", "", text)  # comments may spell products; line numbers stay
        for m in _GRID_BUILTIN_RE.finditer(code):
            before, after = code[: m.start()].rstrip(), code[m.end() :].lstrip()
            if (after.startswith("*") or before.endswith("*")) and not before.endswith(_WIDENED):
                line = code.count("\n", 0, m.start()) + 1
                problems.append(f"{name}:{line}: {m.group()} in a 32-bit product; widen it (int64_t{{{m.group()}}})")
    return problems


def _cuda_texts(sources: list[Path]) -> dict[str, str]:
    """The .cu sources and every CUDA header beside them (csrc/cuda/*.cuh), by path from ROOT."""
    files = {*sources, *(h for d in {s.parent for s in sources} for h in d.glob("*.cuh"))}
    return {str(f.relative_to(ROOT)): f.read_text() for f in sorted(files)}


def check_cuda(archs=DEFAULT_ARCHS, host: bool = False, compile: bool = False) -> dict:
    """Check ``csrc/cuda/*.cu`` for ``archs``; ``{"status", "mode", "sources", "grid_index", "elapsed_s"}``.

    The machine code of the built extension (``dpkernels/_C*.so``) is read when it is newer than
    every CUDA source and header and holds each source for each of ``archs`` (seconds: the build
    already ran ptxas); otherwise, or with ``compile``, each source is compiled here (minutes).
    ``host``: full ``-c`` compile (host code too) instead of the device-only default. ``grid_index``:
    :func:`grid_index_problems` of the sources and headers, checked with or without nvcc.
    """
    t0 = time.perf_counter()
    sources = [ROOT / src for src in BUILD.sources(cuda=True, root=ROOT) if src.endswith(".cu")]
    if not sources:
        return {"status": "skipped", "reason": "no csrc/cuda/*.cu files", "sources": [], "elapsed_s": 0.0}
    grid = grid_index_problems(_cuda_texts(sources))
    built = None if compile else _built_extension(sources, archs)
    if built is not None:
        recs = _inspect_built(built, sources, archs)
        status = "ok" if all(r["ok"] for r in recs) and not grid else "failed"
        mode = f"the built {built.name}, cuobjdump -res-usage"
        return {"status": status, "mode": mode, "sources": recs, "grid_index": grid,
                "elapsed_s": round(time.perf_counter() - t0, 1)}  # fmt: skip
    if shutil.which("nvcc") is None:
        status = "failed" if grid else "skipped"
        return {"status": status, "reason": "nvcc is not on PATH", "sources": [], "grid_index": grid, "elapsed_s": 0.0}
    with tempfile.TemporaryDirectory(prefix="dpk_nvcc_") as tmp, ThreadPoolExecutor(max_workers=2) as pool:
        recs = list(pool.map(lambda s: _compile_cu(s, archs, Path(tmp), host), sources))
    status = "ok" if all(r["ok"] for r in recs) and not grid else "failed"
    mode = f"{'nvcc -c' if host else 'nvcc -fatbin, device code only'}; ptxas -v"
    elapsed = round(time.perf_counter() - t0, 1)
    return {"status": status, "mode": mode, "sources": recs, "grid_index": grid, "elapsed_s": elapsed}


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def run_all(
    archs=DEFAULT_ARCHS, triton: bool = True, cuda: bool = True, host: bool = False, compile: bool = False
) -> dict:
    """Both checks; ``ok`` is False when either failed (skipped counts as passed)."""
    t0 = time.perf_counter()
    out = {"archs": [f"sm_{a}" for a in archs]}
    # The Triton worker is a separate process, so it overlaps with nvcc.
    with ThreadPoolExecutor(max_workers=2) as pool:
        fut_t = pool.submit(check_triton, archs) if triton else None
        fut_c = pool.submit(check_cuda, archs, host, compile or host) if cuda else None
        out["triton"] = fut_t.result() if fut_t else {"status": "skipped", "reason": "--skip-triton"}
        out["cuda"] = fut_c.result() if fut_c else {"status": "skipped", "reason": "--skip-cuda"}
    out["ok"] = all(out[k]["status"] != "failed" for k in ("triton", "cuda"))
    out["elapsed_s"] = round(time.perf_counter() - t0, 1)
    return out


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*map(str, r)) for r in rows]
    return "\n".join(lines)


def format_report(res: dict) -> str:
    parts = []
    tri = res["triton"]
    parts.append(f"== Triton kernels (triton.compile, AOT) [{tri['status']}, {tri.get('elapsed_s', 0)} s]")
    if tri.get("reason"):
        parts.append(f"   {tri['reason']}")
    rows = []
    for r in tri.get("results", []):
        spill = f"{r.get('spill_stores', '?')}/{r.get('spill_loads', '?')}"
        status = "OK" if r["ok"] else "FAIL: " + "; ".join(r["problems"])
        counts = [r.get(key, "?") for key in ("loads_128", "loads_narrow", "stores_128")]
        rows.append([
            r["kernel"], r["variant"], r["arch"], r.get("num_warps", ""), r.get("registers", "?"), spill,
            r.get("stack", "?"), *counts, "yes" if r.get("local_memory") else "no", status,
        ])  # fmt: skip
    if rows:
        header = ["kernel", "variant", "arch", "warps", "regs", "spill st/ld B", "stack B",
                  "ld.128", "ld.narrow", "st.128", ".local", "status"]  # fmt: skip
        parts.append(_table(rows, header))
    cu = res["cuda"]
    parts.append("")
    mode = cu.get("mode", "nvcc")
    parts.append(f"== CUDA C++ ({mode}) [{cu['status']}, {cu.get('elapsed_s', 0)} s]")
    if cu.get("reason"):
        parts.append(f"   {cu['reason']}")
    for p in cu.get("grid_index", []):
        parts.append(f"   FAIL: {p}")
    for src in cu.get("sources", []):
        parts.append(f"-- {src['source']} ({src['compile_s']} s): {'OK' if src['ok'] else 'FAIL'}")
        rows = []
        for k in src["kernels"]:
            name = k["kernel"] if len(k["kernel"]) <= 70 else k["kernel"][:67] + "..."
            spill = f"{k.get('spill_stores', '?')}/{k.get('spill_loads', '?')}"
            rows.append([name, k["arch"], k.get("registers", "-"), spill, k.get("stack", "?"), k.get("local", "?"),
                         k.get("ldg_128", "")])  # fmt: skip
        if rows:
            parts.append(_table(rows, ["kernel", "arch", "regs", "spill st/ld B", "stack B", "local B", "LDG.128"]))
        for p in src["problems"]:
            parts.append(f"   FAIL: {p}")
    parts.append("")
    parts.append(f"== {'PASS' if res['ok'] else 'FAIL'} ({res['elapsed_s']} s)")
    return "\n".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--arch", type=int, nargs="+", default=list(DEFAULT_ARCHS), help="SM versions (%(default)s)")
    ap.add_argument("--skip-triton", action="store_true")
    ap.add_argument("--skip-cuda", action="store_true")
    ap.add_argument("--host", action="store_true", help="nvcc -c (host code too) instead of device-only -fatbin")
    ap.add_argument(
        "--compile", action="store_true", help="compile the CUDA sources even when the built extension is current"
    )
    ap.add_argument("--triton-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.triton_worker:
        print(json.dumps(_triton_worker(args.arch)))
        return 0
    res = run_all(args.arch, triton=not args.skip_triton, cuda=not args.skip_cuda, host=args.host, compile=args.compile)
    print(format_report(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
