"""Which backends exist in this install, and which one an op call runs on."""

from __future__ import annotations

import importlib
import importlib.util
import os

import torch

BACKENDS = ("reference", "cpu", "cuda", "triton")

_REBUILD = "reinstall with `make install` (or `pip install --no-build-isolation -e .`) on a machine with a C++ compiler"


#: The instruction sets the CPU kernels are compiled for, best first, each its own module
#: ``dpkernels._cpu_<capability>`` (tools/build_config.py ``CPU_CAPABILITIES``; ATen's names).
CPU_CAPABILITIES = ("avx512", "avx2", "default")
#: Forces a lower CPU path than the best the machine supports, as ``ATEN_CPU_CAPABILITY`` does for ATen.
CPU_CAPABILITY_ENV = "DPKERNELS_CPU_CAPABILITY"


def _load_extension():
    """The compiled extension, or None for a pure-Python install (``DPK_SKIP_EXT=1``)."""
    try:
        return importlib.import_module("dpkernels._C")
    except ImportError:
        return None


def _supported_cpu_capability() -> str:
    """The best of :data:`CPU_CAPABILITIES` this CPU and OS run, as ATen decides it."""
    name = torch.backends.cpu.get_cpu_capability().lower()
    return name if name in CPU_CAPABILITIES else "default"


def _load_cpu_kernels() -> tuple[str | None, object]:
    """``(capability, module)``: the CPU kernel module loaded (which registers the kernels), the best
    one built that this CPU runs, or no higher than :data:`CPU_CAPABILITY_ENV` asks."""
    supported = _supported_cpu_capability()
    forced = os.environ.get(CPU_CAPABILITY_ENV, "").strip().lower()
    if forced and forced not in CPU_CAPABILITIES:
        raise RuntimeError(f"{CPU_CAPABILITY_ENV}={forced!r}: expected one of {', '.join(CPU_CAPABILITIES)}")
    if forced and CPU_CAPABILITIES.index(forced) < CPU_CAPABILITIES.index(supported):
        raise RuntimeError(
            f"{CPU_CAPABILITY_ENV}={forced!r} asks for more than this CPU runs ({supported!r}); it can "
            "only force a lower path"
        )
    start = CPU_CAPABILITIES.index(forced or supported)
    for capability in CPU_CAPABILITIES[start:]:
        try:
            return capability, importlib.import_module(f"dpkernels._cpu_{capability}")
        except ImportError:
            continue
    return None, None


# Probed once at import: what is installed does not change while the process runs, and plain
# constants keep backend selection traceable by torch.compile.
_EXTENSION = _load_extension()
_CPU_CAPABILITY, _CPU_KERNELS = _load_cpu_kernels() if _EXTENSION is not None else (None, None)
_HAS_CUDA_KERNELS = _EXTENSION is not None and torch._C._dispatch_has_kernel_for_dispatch_key(
    "dpkernels_C::weighted_sum", "CUDA"
)
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def has_native_ops() -> bool:
    """True when the native ops ``torch.ops.dpkernels_C`` are defined (dpkernels._C loaded)."""
    return _EXTENSION is not None


def has_cpu_kernels() -> bool:
    """True when a CPU kernel module is loaded (:func:`cpu_capability`)."""
    return _CPU_KERNELS is not None


def runnable_cpu_capabilities() -> list[str]:
    """The CPU kernel paths that are built and that this CPU runs, best first: the values
    :data:`CPU_CAPABILITY_ENV` may take here."""
    supported = CPU_CAPABILITIES.index(_supported_cpu_capability())
    return [c for c in CPU_CAPABILITIES[supported:] if importlib.util.find_spec(f"dpkernels._cpu_{c}") is not None]


def cpu_capability() -> str | None:
    """The instruction set of the CPU kernels in use: ``"avx512"``, ``"avx2"`` or ``"default"``
    (portable), or None without CPU kernels (a pure-Python install). The best this CPU runs, unless
    ``DPKERNELS_CPU_CAPABILITY`` (set before importing dpkernels) forces a lower one."""
    return _CPU_CAPABILITY


def extension():
    """The module ``dpkernels._C`` (csrc/python.cpp), or None for a pure-Python install."""
    return _EXTENSION


def has_cuda_kernels() -> bool:
    """True when the extension was built with its CUDA part (whether or not a GPU is present)."""
    return _HAS_CUDA_KERNELS


def has_triton() -> bool:
    return _HAS_TRITON


def triton_interpreting() -> bool:
    """True under the Triton interpreter: ``TRITON_INTERPRET`` set as Triton itself reads it."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def available_backends(device: torch.device | str | None = None) -> list[str]:
    """The backends usable in this install, on this machine, for tensors on ``device``.

    ``device=None`` lists every backend usable for some device here.
    """
    dev = None if device is None else torch.device(device).type
    cuda_ok = torch.cuda.is_available()
    found = ["reference"]
    if has_cpu_kernels() and dev in (None, "cpu"):
        found.append("cpu")
    if has_cuda_kernels() and cuda_ok and dev in (None, "cuda"):
        found.append("cuda")
    # The interpreter runs Triton kernels on CPU tensors; compiled Triton needs a GPU.
    if has_triton() and ((dev in (None, "cpu") and triton_interpreting()) or (dev in (None, "cuda") and cuda_ok)):
        found.append("triton")
    return found


def _why_unavailable(backend: str, dev: str) -> str:
    if backend == "cpu":
        if dev != "cpu":
            return f"the cpu backend runs on CPU tensors, got {dev} tensors"
        return f"dpkernels was installed without its C++ extension; {_REBUILD}"
    if backend == "cuda":
        if dev != "cuda":
            return f"the cuda backend runs on CUDA tensors, got {dev} tensors"
        if not has_cuda_kernels():
            return (
                "dpkernels was built without its CUDA part; install a CUDA build of torch, put nvcc on "
                "PATH and reinstall with DPK_BUILD_CUDA=1"
            )
        return "no CUDA device is available"
    if not has_triton():
        return "triton is not installed; `pip install triton`"
    if dev not in ("cpu", "cuda"):
        return f"the triton backend runs on CUDA tensors (CPU tensors under TRITON_INTERPRET=1), got {dev} tensors"
    return "Triton needs a CUDA device, or TRITON_INTERPRET=1 (set before importing dpkernels) to run on CPU"


def resolve(backend: str, device: torch.device) -> str:
    """Map ``backend`` (``"auto"`` or a name in :data:`BACKENDS`) to a usable backend for ``device``.

    ``auto`` picks cuda, then triton for CUDA tensors, and cpu, then reference for CPU tensors;
    on meta tensors it gives reference, whose registered ops dispatch to their fake kernels (output
    shapes only). An explicit backend that cannot run raises and says how to fix it, also on meta
    tensors.
    """
    dev = device.type
    if dev == "cpu" and backend in ("auto", "cpu") and _CPU_KERNELS is not None:
        # The common case, answered without probing CUDA and Triton (~0.1 ms with cold caches).
        return "cpu"
    usable = available_backends(device)
    if backend == "auto":
        order = ("cuda", "triton", "reference") if dev == "cuda" else ("cpu", "reference")
        return next(b for b in order if b in usable)
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected 'auto' or one of {BACKENDS}")
    if dev == "meta":
        # Meta tensors have shapes but no data: only the ops' fake kernels apply, which dispatch
        # by device whatever the backend, so backend="auto" is the one request that means that.
        raise RuntimeError(
            f"backend {backend!r} cannot run on meta tensors (they hold no data); pass backend='auto' "
            "to get the output shapes and dtypes from the ops' fake kernels"
        )
    if backend not in usable:
        raise RuntimeError(f"backend {backend!r} is not available: {_why_unavailable(backend, dev)}")
    return backend
