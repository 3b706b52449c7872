"""One-command check on a GPU machine: build against its torch, run the whole suite, benchmark.

Made for a bare GPU machine with no package registry: its ``python3`` already holds torch (a
CUDA build), Triton, pytest, hypothesis, scipy and rich, and ``nvcc`` is on PATH. Opacus and
dp-accounting (and the few pure-Python or small packages they need that may be missing there)
come as wheel files carried beside the tree (``wheels/``, or ``$DPK_WHEELS``), fetched on a
machine with a registry by ``make gpu-wheels`` (``python3 tools/gpu_check.py download``).

Steps (``make gpu-check``, or ``python3 tools/gpu_check.py``):

1. a virtual environment (``.gpu-check-venv/``) on top of the machine's Python, seeing its
   packages (``--system-site-packages``; when that Python is itself a virtual environment, its
   site-packages too, through a ``.pth`` file), with the carried wheels installed offline;
2. the extension built in place against that torch, CUDA part required
   (``DPK_BUILD_CUDA=1 pip install --no-build-isolation --no-deps -e .``), for the GPU present
   only (``DPK_CUDA_ARCHS``; ``--all-archs`` for every architecture: about 3 min on 16 cores);
3. GPU, driver, CUDA, torch, Triton and package versions;
4. ``python -m pytest -k "cuda or gpu"`` (the cases that need the GPU; ``--all-tests`` for the
   whole suite) in xdist workers, stopped after ``--tests-limit`` seconds (default 300), each
   test's outcome written as it ends (``tests.jsonl``), so a run stopped early or a crashed
   worker still shows what failed;
5. ``dpkernels bench --device cuda`` (then ``$BENCH_ARGS``, default ``--quick``), stopped after
   ``--bench-limit`` seconds (default 240): the cuda and triton backends timed on CUDA tensors
   (``--device cpu`` when rehearsing without a GPU).

A lent GPU machine gives a session about 15 minutes in all, the start included: the defaults fit
one call of ``timeout_s`` 600 (build ~2 min, tests <= 5 min, bench ~2 min).

Everything goes to one folder (``--out``; default ``$DPK_GPU_CHECK_OUT``, else ``$OUT``, else
``gpu-check-out/``): ``gpu-check.log`` (every command and its output), ``gpu-check.json``
(versions, device, build, test counts and failures, the bench results), ``tests.jsonl`` and
``bench.json``. Exit status 0 only when the build, the tests and the bench all passed and a GPU
was used; without a GPU the check fails unless ``--allow-no-gpu`` (or
``DPK_GPU_CHECK_ALLOW_NO_GPU=1``), which is for rehearsing it elsewhere.

Standard library only: it runs before the environment it sets up exists.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# What `download` fetches (`make gpu-wheels`): Opacus and dp-accounting, and what they need beyond
# torch/numpy/scipy (which the GPU machine has), at the versions the suite runs with here. pip
# installs a carried wheel only where the machine lacks a version that satisfies the requirement
# (e.g. dp-accounting wants attrs<24, newer than many images hold).
CARRIED_WHEELS = (
    "opacus==1.6.0",
    "dp-accounting==0.6.0",
    "absl-py==2.5.1",  # dp-accounting
    "attrs==23.2.0",  # dp-accounting: attrs<24
    "dm-tree==0.1.10",  # dp-accounting (compiled: cp312 wheel)
    "mpmath==1.3.0",  # dp-accounting
    "wrapt==2.5.2",  # dm-tree (compiled)
    "opt-einsum==3.4.0",  # opacus
    "ninja==1.13.2",  # parallel extension build (installed only when no ninja is on PATH)
)
# Installed from the wheels folder: pip resolves their requirements against the machine's packages
# first, the carried wheels second, and never a registry.
INSTALL = ("opacus", "dp-accounting")
# The target machine: CPython 3.12 on x86-64 Linux.
TARGET_PYTHON = "3.12"
TARGET_PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)

DEFAULT_BENCH_ARGS = "--quick"


# ---------------------------------------------------------------------------------------------
# Output: one log (everything), one JSON (the summary)
# ---------------------------------------------------------------------------------------------


class Log:
    def __init__(self, path: Path):
        self.path = path
        self.file = path.open("w", encoding="utf-8")

    def write(self, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()
        self.file.write(text)
        self.file.flush()

    def line(self, text: str = "") -> None:
        self.write(text + "\n")

    def section(self, title: str) -> None:
        stamp = datetime.datetime.now().strftime("%H:%M:%S")
        self.line(f"\n===== [{stamp}] {title}")

    def run(
        self, cmd: list[str], *, env=None, cwd=ROOT, capture: bool = False, limit_s: float | None = None
    ) -> tuple[int, str, float]:
        """Run ``cmd``, its output streamed into the log; ``(returncode, output, seconds)``.

        After ``limit_s`` seconds its whole process group gets SIGINT (pytest then still reports),
        and SIGKILL 30 s later: a lent GPU machine's time is short, and the steps after this one
        (the bench) must still run.
        """
        self.line("$ " + shlex.join(map(str, cmd)))
        t0 = time.perf_counter()
        chunks = []
        try:
            proc = subprocess.Popen(
                list(map(str, cmd)),
                cwd=cwd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
                start_new_session=limit_s is not None,
            )
        except OSError as exc:
            self.line(f"(could not start: {exc})")
            return 127, str(exc), 0.0
        timers = []
        if limit_s is not None:

            def stop(sig):
                self.line(f"(time limit {limit_s:.0f} s reached: {sig.name})")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)

            timers = [
                threading.Timer(limit_s, stop, (signal.SIGINT,)),
                threading.Timer(limit_s + 30, stop, (signal.SIGKILL,)),
            ]
            for timer in timers:
                timer.daemon = True
                timer.start()
        for text in proc.stdout:
            chunks.append(text)
            if not capture:
                self.write(text)
        rc = proc.wait()
        for timer in timers:
            timer.cancel()
        out = "".join(chunks)
        if capture:
            self.file.write(out)
            self.file.flush()
        secs = round(time.perf_counter() - t0, 1)
        self.line(f"(exit {rc}, {secs} s)")
        return rc, out, secs

    def close(self) -> None:
        self.file.close()


# ---------------------------------------------------------------------------------------------
# Steps
# ---------------------------------------------------------------------------------------------


def _probe_host(log: Log) -> dict:
    host = {"hostname": platform.node(), "machine": platform.machine(), "kernel": platform.release()}
    if shutil.which("nvidia-smi"):
        rc, out, _ = log.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_cap", "--format=csv,noheader"]
        )
        if rc == 0:
            host["nvidia_smi"] = [ln.strip() for ln in out.splitlines() if ln.strip()]
            first = [f.strip() for f in host["nvidia_smi"][0].split(",")] if host["nvidia_smi"] else []
            if len(first) >= 4:
                host["driver"], host["compute_cap"] = first[1], first[3]
    else:
        log.line("nvidia-smi: not on PATH")
    nvcc = shutil.which("nvcc")
    if nvcc:
        rc, out, _ = log.run([nvcc, "--version"])
        host["nvcc"] = out.strip().splitlines()[-1] if rc == 0 and out.strip() else None
    else:
        host["nvcc"] = None
        log.line("nvcc: not on PATH")
    return host


def _make_venv(log: Log, base_python: str, venv: Path) -> tuple[list[str], Path, dict]:
    """A fresh venv on top of ``base_python``; ``(pip command, venv python, env)``."""
    rc, out, _ = log.run(
        [
            base_python,
            "-c",
            "import json, site, sys; print(json.dumps({'venv': sys.prefix != sys.base_prefix, "
            "'site': site.getsitepackages(), 'version': sys.version.split()[0]}))",
        ],
        capture=True,
    )
    if rc != 0:
        raise RuntimeError(f"{base_python} does not run")
    base = json.loads(out.strip().splitlines()[-1])
    if venv.exists():
        shutil.rmtree(venv)
    pip_from_base = False
    rc, _, _ = log.run([base_python, "-m", "venv", "--system-site-packages", str(venv)])
    if rc != 0:  # no ensurepip there: a venv without pip, driven by the base Python's pip
        shutil.rmtree(venv, ignore_errors=True)
        rc, _, _ = log.run([base_python, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)])
        if rc != 0:
            raise RuntimeError("could not create the virtual environment")
        pip_from_base = True
    vpy = venv / "bin" / "python"
    if base["venv"]:
        # --system-site-packages reaches the base interpreter's site-packages, not those of a venv
        # that python3 may itself be (e.g. torch installed in /opt/torch/.venv): add those.
        rc, out, _ = log.run([str(vpy), "-c", "import site; print(site.getsitepackages()[0])"], capture=True)
        site_dir = Path(out.strip().splitlines()[-1])
        (site_dir / "_dpk_base_venv.pth").write_text("\n".join(base["site"]) + "\n")
        log.line(f"{site_dir / '_dpk_base_venv.pth'}: {', '.join(base['site'])}")
    env = dict(os.environ)
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env.pop("PYTHONHOME", None)
    # No registry, ever: the machine has none, and a rehearsal must not use one either.
    env["PIP_NO_INDEX"] = "1"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    pip = [base_python, "-m", "pip", "--python", str(vpy)] if pip_from_base else [str(vpy), "-m", "pip"]
    return pip, vpy, env


def _install_wheels(log: Log, pip: list[str], vpy: Path, env: dict, wheels: Path) -> dict:
    have = list(wheels.glob("*.whl")) if wheels.is_dir() else []
    res = {"dir": str(wheels), "files": sorted(p.name for p in have)}
    if have:
        targets = list(INSTALL)
        if shutil.which("ninja", path=env["PATH"]) is None and any(p.name.startswith("ninja-") for p in have):
            targets.append("ninja")
        rc, _, secs = log.run([*pip, "install", "--no-index", "--find-links", str(wheels), *targets], env=env)
        res.update(rc=rc, elapsed_s=secs)
    else:
        log.line(f"no wheels in {wheels}: Opacus and dp-accounting must already be installed")
        res["rc"] = 0
    check = "import opacus, dp_accounting; print(opacus.__version__)"
    rc, _, _ = log.run([str(vpy), "-c", check], env=env)
    res["importable"] = rc == 0
    res["ok"] = res["rc"] == 0 and res["importable"]
    if not res["importable"]:
        log.line(f"Opacus/dp-accounting missing: carry their wheels in {wheels} (make gpu-wheels)")
    return res


_PROBE = r"""
import importlib.metadata as md, json, platform, sys
import torch
out = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
       "cuda_available": torch.cuda.is_available()}
for name in ("triton", "numpy", "scipy", "opacus", "dp-accounting", "pytest", "pytest-xdist", "pytest-timeout",
             "pytest-benchmark", "hypothesis", "rich", "ninja", "setuptools", "dpkernels"):
    try:
        out[name] = md.version(name)
    except md.PackageNotFoundError:
        out[name] = None
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    out["device"] = {"name": p.name, "capability": f"{p.major}.{p.minor}", "count": torch.cuda.device_count(),
                     "memory_gib": round(p.total_memory / 2**30, 1), "multiprocessors": p.multi_processor_count}
try:
    import dpkernels
    from dpkernels._backend import has_cpu_kernels, has_cuda_kernels
    out["dpkernels_cpu_kernels"] = has_cpu_kernels()
    out["dpkernels_cuda_kernels"] = has_cuda_kernels()
    out["backends_cpu"] = dpkernels.available_backends("cpu")
    out["backends_cuda"] = dpkernels.available_backends("cuda") if torch.cuda.is_available() else []
except Exception as exc:
    out["dpkernels_error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


def _probe_versions(log: Log, vpy: Path, env: dict) -> dict:
    rc, out, _ = log.run([str(vpy), "-c", _PROBE], env=env)
    try:
        return json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"probe exited {rc}"}


# Each case raises an error on purpose, in a process of its own (``python -c _RAISE_PROBE CASE``). The
# first GPU run (docs/BENCHMARKS.md) saw every dpkernels CUDA op that rejects its input kill the
# process with SIGSEGV, while torch's own errors raised: these cases tell where it happens.
_RAISE_CASES = {
    "torch_cuda": "torch.ones(2, device='cuda').view(3)",
    "dpkernels_cpu_shape": "pipeline([torch.randn(5, 3), torch.randn(4, 2)])",
    "dpkernels_cuda_shape": "pipeline([torch.randn(5, 3, device='cuda'), torch.randn(4, 2, device='cuda')])",
    "dpkernels_cuda_nonfinite": "pipeline([torch.full((5, 3), float('nan'), device='cuda')])",
}
_RAISE_PROBE = r"""
import sys
import torch
import dpkernels

def pipeline(grads):  # dpkernels_C::clip_pipeline (csrc/ops.cpp), plain clipping, nonfinite="raise"
    torch.ops.dpkernels_C.clip_pipeline(grads, [1.0], [0.8], "clip", 0.0, [], [], False, False, 1.0, "none", 0.0,
                                        [], 0, 0, 1.0, [])

try:
    exec(sys.argv[1])
    print("raised nothing")
except Exception as exc:
    print(f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
"""


def _probe_raises(log: Log, vpy: Path, env: dict, gpu: bool) -> dict:
    """Run each :data:`_RAISE_CASES` case; the first that dies is run again under ``cuda-gdb`` (a
    host debugger too) for the native stack of the crash."""
    res = {}
    gdb = shutil.which("cuda-gdb") or shutil.which("gdb")
    for name, code in _RAISE_CASES.items():
        if "cuda" in name and not gpu:
            continue
        cmd = [str(vpy), "-c", _RAISE_PROBE, code]
        rc, out, _ = log.run(cmd, env=env, capture=True)
        res[name] = {"rc": rc, "out": out.strip()[-300:]}
        if rc != 0 and gdb and not any("backtrace" in r for r in res.values()):
            _, trace, _ = log.run([gdb, "-batch", "-ex", "run", "-ex", "bt 40", "--args", *cmd], env=env, limit_s=120)
            res[name]["backtrace"] = [ln for ln in trace.splitlines() if ln.startswith("#")][:40]
    return res


def _line_counts(path: Path) -> dict:
    """Totals from the per-test lines of ``--report-lines`` (tests/conftest.py), written as each test
    ends: they survive a run stopped at its time limit or a worker that crashed. The CUDA cases are
    the parametrizations ``cuda-cuda`` / ``triton-cuda`` (and ``device=cuda``)."""
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    cuda = dict(counts)
    failures = []
    for text in path.read_text().splitlines() if path.exists() else []:
        rec = json.loads(text)
        outcome = rec["outcome"]
        counts[outcome] += 1
        if "cuda" in rec["nodeid"].rsplit("[", 1)[-1]:
            cuda[outcome] += 1
        if outcome == "failed":
            failures.append(f"{rec['nodeid']} ({rec['when']}): {rec.get('error', '')[:300]}")
    return {**counts, "tests": sum(counts.values()), "cuda_cases": cuda, "failures": failures[:300]}


def _run_tests(log: Log, vpy: Path, env: dict, args: argparse.Namespace, out_dir: Path, versions: dict) -> dict:
    pytest_args = args.pytest_args
    if pytest_args is None:
        # The cases that need the GPU (CI runs every other one on every change), in xdist workers
        # when the machine has them; each test at most 120 s when pytest-timeout is there.
        pytest_args = [] if args.all_tests else ["-k", "cuda or gpu"]
        if versions.get("pytest-xdist"):
            pytest_args += ["-n", "auto", "--maxprocesses", "16"]
        if versions.get("pytest-timeout"):
            pytest_args += ["--timeout", "120"]
    lines = out_dir / "tests.jsonl"
    lines.unlink(missing_ok=True)
    cmd = [str(vpy), "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfE", f"--report-lines={lines}", *pytest_args]
    rc, _, secs = log.run(cmd, env=env, limit_s=args.tests_limit)
    res = {"args": pytest_args, "rc": rc, "elapsed_s": secs, "lines": str(lines), **_line_counts(lines)}
    res["stopped_at_limit"] = secs >= args.tests_limit
    # pytest exit codes: 0 all passed, 1 some failed, 5 none collected; anything else is an error.
    res["ok"] = rc == 0 and not res["stopped_at_limit"]
    return res


def _run_bench(log: Log, venv: Path, env: dict, args: argparse.Namespace, out_dir: Path, gpu: bool) -> dict:
    """``dpkernels bench`` on CUDA tensors when a GPU was found (CPU tensors when rehearsing
    without one), then ``bench_args`` (which may name another ``--device``)."""
    exe = str(venv / "bin" / "dpkernels")
    out_json = out_dir / "bench.json"
    device = "cuda" if gpu else "cpu"
    cmd = [exe, "bench", "--json", str(out_json), "--device", device, *args.bench_args]
    rc, _, secs = log.run(cmd, env=env, limit_s=args.bench_limit)
    res: dict = {"device": device, "args": args.bench_args, "rc": rc, "elapsed_s": secs, "ok": rc == 0}
    if out_json.exists():
        try:
            res["results"] = json.loads(out_json.read_text())
        except ValueError as exc:
            res["results_error"] = str(exc)
    return res


def _default_out() -> Path:
    return Path(os.environ.get("DPK_GPU_CHECK_OUT") or os.environ.get("OUT") or ROOT / "gpu-check-out")


def check(args: argparse.Namespace) -> int:
    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    log = Log(out_dir / "gpu-check.log")
    json_path = out_dir / "gpu-check.json"
    t0 = time.perf_counter()
    report: dict = {
        "ok": False,
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "tree": str(ROOT),
        "allow_no_gpu": args.allow_no_gpu,
        "log": str(log.path),
    }
    git = shutil.which("git")
    if git and (ROOT / ".git").exists():
        rc, out, _ = log.run([git, "-C", str(ROOT), "describe", "--always", "--dirty"], capture=True)
        report["commit"] = out.strip() if rc == 0 else None

    def finish(ok: bool, why: str | None = None) -> int:
        report["ok"] = ok
        if why:
            report["failed_at"] = why
        report["elapsed_s"] = round(time.perf_counter() - t0, 1)
        json_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
        log.section(f"{'PASS' if ok else 'FAIL' + (f' ({why})' if why else '')}: {json_path}, {log.path}")
        log.close()
        return 0 if ok else 1

    log.section("machine")
    report["host"] = _probe_host(log)

    log.section(f"virtual environment {args.venv} on {args.python}")
    try:
        pip, vpy, env = _make_venv(log, args.python, Path(args.venv))
    except RuntimeError as exc:
        report["venv"] = {"ok": False, "error": str(exc)}
        return finish(False, "venv")
    report["venv"] = {"ok": True, "path": str(args.venv), "base_python": args.python}

    log.section(f"carried wheels ({args.wheels})")
    report["wheels"] = _install_wheels(log, pip, vpy, env, Path(args.wheels))
    if not report["wheels"]["ok"]:
        return finish(False, "wheels")

    log.section("build (DPK_BUILD_CUDA=1 pip install --no-build-isolation --no-deps -e .)")
    build_env = {**env, "DPK_BUILD_CUDA": "1"}
    sm = report["host"].get("compute_cap", "").replace(".", "")
    if sm and not args.all_archs:  # this GPU's SASS and PTX only: a third less nvcc time
        build_env["DPK_CUDA_ARCHS"] = sm
        log.line(f"DPK_CUDA_ARCHS={sm} (this GPU; --all-archs builds every architecture)")
    cmd = [*pip, "install", "--no-build-isolation", "--no-deps", "-v", "-e", str(ROOT)]
    rc, out, secs = log.run(cmd, env=build_env)
    report["build"] = {"ok": rc == 0, "rc": rc, "elapsed_s": secs}
    if rc != 0:
        errors = [ln.strip() for ln in out.splitlines() if "error" in ln.lower() and "-Werror" not in ln]
        report["build"]["errors"] = errors[:30] or out.splitlines()[-30:]

    log.section("versions")
    versions = _probe_versions(log, vpy, env)
    report["versions"] = versions
    report["device"] = versions.get("device")
    dev = versions.get("device") or {}
    log.line(
        f"GPU: {dev.get('name', 'none')} (sm {dev.get('capability', '-')}), driver "
        f"{report['host'].get('driver', '-')}, {report['host'].get('nvcc') or 'no nvcc'}; "
        f"torch {versions.get('torch')} (CUDA {versions.get('torch_cuda')}), triton {versions.get('triton')}, "
        f"python {versions.get('python')}; dpkernels backends: cpu {versions.get('backends_cpu')}, "
        f"cuda {versions.get('backends_cuda')}"
    )
    if rc != 0:
        return finish(False, "build")
    if not versions.get("dpkernels_cuda_kernels"):
        report["build"]["ok"] = False
        return finish(False, "build (no CUDA kernels in the extension)")
    gpu = bool(versions.get("cuda_available"))
    if not gpu and not args.allow_no_gpu:
        log.line("no GPU visible to torch (torch.cuda.is_available() is False)")
        return finish(False, "no GPU")
    if gpu and "cuda" not in versions.get("backends_cuda", []):
        return finish(False, "cuda backend unavailable")

    log.section("errors raised by the ops (each in a process of its own)")
    report["raises"] = _probe_raises(log, vpy, env, gpu)

    log.section("tests (python -m pytest)")
    report["tests"] = _run_tests(log, vpy, env, args, out_dir, versions)
    t = report["tests"]
    log.line(
        f"tests: {t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped in {t['elapsed_s']} s"
        f"{' (stopped at its time limit)' if t['stopped_at_limit'] else ''}; CUDA cases: {t['cuda_cases']}"
    )
    for failure in t["failures"][:40]:
        log.line(f"  FAILED {failure}")

    if args.no_bench:
        report["bench"] = {"ok": True, "skipped": "--no-bench"}
    else:
        log.section("dpkernels bench")
        report["bench"] = _run_bench(log, Path(args.venv), env, args, out_dir, gpu)

    failed = [k for k in ("tests", "bench") if not report[k]["ok"]]
    return finish(not failed, ", ".join(failed) or None)


def download(args: argparse.Namespace) -> int:
    """Fetch :data:`CARRIED_WHEELS` for the target machine into ``args.dest`` (needs a registry)."""
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest)]
    cmd += ["--python-version", args.python_version, "--implementation", "cp"]
    for plat in TARGET_PLATFORMS:
        cmd += ["--platform", plat]
    cmd += list(CARRIED_WHEELS)
    print("$ " + shlex.join(cmd), flush=True)
    rc = subprocess.call(cmd)
    if rc == 0:
        print(f"{dest}: {', '.join(sorted(p.name for p in dest.glob('*.whl')))}")
    return rc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command")
    dl = sub.add_parser("download", help="fetch the wheels to carry (on a machine with a registry)")
    dl.add_argument("--dest", default=os.environ.get("DPK_WHEELS") or str(ROOT / "wheels"), help="(%(default)s)")
    dl.add_argument("--python-version", default=TARGET_PYTHON, help="the GPU machine's Python (%(default)s)")
    dl.set_defaults(func=download)

    ap.add_argument("--out", default=str(_default_out()), help="output folder (%(default)s)")
    ap.add_argument("--wheels", default=os.environ.get("DPK_WHEELS") or str(ROOT / "wheels"), help="(%(default)s)")
    ap.add_argument("--venv", default=str(ROOT / ".gpu-check-venv"), help="(%(default)s)")
    ap.add_argument(
        "--python",
        default=os.environ.get("DPK_GPU_CHECK_PYTHON") or sys.executable,
        help="the machine's Python with torch (default: this one, %(default)s)",
    )
    ap.add_argument(
        "--allow-no-gpu",
        action="store_true",
        default=os.environ.get("DPK_GPU_CHECK_ALLOW_NO_GPU") == "1",
        help="rehearsal: go on without a GPU (the CUDA cases skip)",
    )
    ap.add_argument(
        "--pytest-args",
        type=shlex.split,
        default=shlex.split(os.environ["PYTEST_ARGS"]) if "PYTEST_ARGS" in os.environ else None,
        help="pytest arguments (default $PYTEST_ARGS, else the whole suite, in xdist workers if installed)",
    )
    ap.add_argument(
        "--bench-args",
        type=shlex.split,
        default=shlex.split(os.environ.get("BENCH_ARGS", DEFAULT_BENCH_ARGS)),
        help=f"dpkernels bench arguments (default $BENCH_ARGS, else {DEFAULT_BENCH_ARGS!r})",
    )
    ap.add_argument("--no-bench", action="store_true", help="skip dpkernels bench")
    ap.add_argument(
        "--all-tests", action="store_true", help="the whole suite (default: the CUDA cases, -k 'cuda or gpu')"
    )
    ap.add_argument("--all-archs", action="store_true", help="build every CUDA architecture (default: the GPU present)")
    ap.add_argument("--tests-limit", type=float, default=300, help="seconds for the tests, then stopped (%(default)s)")
    ap.add_argument("--bench-limit", type=float, default=240, help="seconds for the bench, then stopped (%(default)s)")
    args = ap.parse_args(argv)
    if args.command == "download":
        return args.func(args)
    return check(args)


if __name__ == "__main__":
    sys.exit(main())
