"""Test set-up shared by every test file.

- Without a GPU, Triton kernels run under the interpreter; the switch is read when a kernel is
  decorated, so it is set before anything imports dpkernels.triton_kernels. The interpreter gets
  tests/_interpreter_speedup.py (same results, a third less time).
- Outputs are poisoned with NaN before kernels run: the C++ kernels via DPKERNELS_POISON_OUTPUTS,
  Python-side allocations (Triton launchers) by patching torch.empty* for calls made from the
  package, so an element a kernel forgets to write shows up as NaN.
"""

import inspect
import json
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from _interpreter_speedup import install as _install_interpreter_speedup

    _install_interpreter_speedup()
# Tests compare CUDA results with fp32 references: no TF32 in torch's own matmuls and convolutions.
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
os.environ.setdefault("DPKERNELS_POISON_OUTPUTS", "1")

import pytest  # noqa: E402

import dpkernels  # noqa: E402

# Backends testable here: CPU tensors on reference/cpu/triton(interpreter), CUDA tensors when a
# GPU exists. Each entry is (backend, device).
_CASES = [("reference", "cpu"), ("cpu", "cpu"), ("triton", "cpu"), ("cuda", "cuda"), ("triton", "cuda")]


def _backend_param(backend, device):
    usable = backend in dpkernels.available_backends(device) if device == "cpu" or torch.cuda.is_available() else False
    marks = [] if usable else [pytest.mark.skip(reason=f"backend {backend} on {device} not available here")]
    return pytest.param((backend, device), id=f"{backend}-{device}", marks=marks)


BACKEND_PARAMS = [_backend_param(b, d) for b, d in _CASES]


@pytest.fixture(params=BACKEND_PARAMS)
def backend_device(request):
    """(backend, device) for every backend that can run in this install."""
    return request.param


_OTHER_BACKENDS = {"reference", "triton", "cuda"}


def pytest_addoption(parser):
    parser.addoption(
        "--cpu-kernels-only",
        action="store_true",
        help="only the tests that can reach the cpu backend's kernels: to rerun the suite with each "
        "lower CPU path forced (DPKERNELS_CPU_CAPABILITY; Makefile `test`)",
    )
    parser.addoption(
        "--report-lines",
        metavar="PATH",
        help="append one JSON line per test outcome to PATH as it happens (tools/gpu_check.py): a run "
        "stopped early, or whose worker crashed, still says what passed and what failed",
    )


_report_lines = None


def pytest_configure(config):
    global _report_lines
    path = config.getoption("--report-lines")
    # Only where reports are gathered: the xdist controller (workers have ``workerinput``).
    if path and not hasattr(config, "workerinput"):
        _report_lines = open(path, "a", buffering=1)  # noqa: SIM115 (closed in pytest_unconfigure)


def pytest_unconfigure(config):
    if _report_lines is not None:
        _report_lines.close()


def pytest_runtest_logreport(report):
    if _report_lines is None or (report.when != "call" and report.passed):
        return
    line = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome, "s": round(report.duration, 3)}
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)  # absent when a worker crashed: a plain text
        line["error"] = (crash.message if crash else report.longreprtext.strip()[-500:])[:500]
    _report_lines.write(json.dumps(line) + "\n")


def _left_out_of_reruns(item) -> bool:
    """True when the test runs only another backend (a parameter names it), or is marked
    ``no_cpu_kernels`` or ``one_cpu_path``."""
    if item.get_closest_marker("no_cpu_kernels") or item.get_closest_marker("one_cpu_path"):
        return True
    params = getattr(item, "callspec", None)
    params = params.params if params else {}
    backend = params.get("backend_device", (params.get("backend"),))[0]
    return backend in _OTHER_BACKENDS or params.get("device") == "cuda"


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--cpu-kernels-only"):
        return
    dropped = [item for item in items if _left_out_of_reruns(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if not _left_out_of_reruns(item)]


_POISONED = ("empty", "empty_like")


@pytest.fixture(autouse=True)
def poison_package_allocations(monkeypatch):
    originals = {name: getattr(torch, name) for name in _POISONED}

    def wrap(name):
        orig = originals[name]

        def poisoned(*args, **kwargs):
            out = orig(*args, **kwargs)
            caller = inspect.currentframe().f_back.f_globals.get("__name__", "")
            if out.is_floating_point() and caller.startswith(("triton_kernels", "dpkernels")):
                out.fill_(float("nan"))
            return out

        return poisoned

    for name in _POISONED:
        monkeypatch.setattr(torch, name, wrap(name))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """Tiny models train fastest on one thread (2-core machine: no fork/join per small op)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
