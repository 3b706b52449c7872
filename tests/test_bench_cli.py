"""Smoke test of ``dpkernels bench``: the sections run end to end and write their JSON records.

Timings here mean nothing (one round, a shared machine); the benchmark itself is `make bench`.
"""

import json
import math
import sys
from types import SimpleNamespace

import pytest
import torch

import dpkernels
from dpkernels import cli
from dpkernels.bench import _timing, train_step
from dpkernels.bench._timing import BenchConfig, Provider

# Processes, checkpoints or the CLI above the kernels: the best CPU path is enough (conftest.py).
pytestmark = pytest.mark.one_cpu_path


def _fake_peak_memory(m, names, device="cpu", threads=0, timeout=0.0):
    """Stands in for the per-provider processes of the train section (tested on their own below)."""
    return {n: {"skip": "memory process exited 1: boom"} if n == "opacus ghost" else {"peak_mem_mib": 2.0}
            for n in names}  # fmt: skip


@pytest.mark.skipif("cpu" not in dpkernels.available_backends("cpu"), reason="needs the C++ extension")
def test_bench_sections_write_json(tmp_path, monkeypatch):
    monkeypatch.delenv("DPKERNELS_POISON_OUTPUTS", raising=False)
    monkeypatch.setitem(train_step.MODELS, "cnn", TINY["cnn"])  # --quick times the cnn only
    monkeypatch.setattr(train_step, "peak_memory", _fake_peak_memory)
    out = tmp_path / "bench.json"
    argv = ["bench", "--quick", "--sections", "noise,privatize,step,train", "--shapes", "small-b8", "--repeats", "1",
            "--warmup", "1", "--json", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    rec = json.loads(out.read_text())
    assert rec["config"]["device"] == "cpu"
    assert {r["name"] for r in rec["noise"]["providers"]} >= {"cpu philox", "cpu chacha20", "torch.normal"}
    assert all(r["median_s"] > 0 for r in rec["noise"]["providers"])
    (priv,) = rec["privatize"]
    cpu = next(r for r in priv["providers"] if r["name"] == "cpu")
    assert cpu["max_abs_err_vs_reference"] < 1e-3  # same seed: the cpu backend agrees with the reference
    names = {r["name"] for r in rec["step"]["providers"] if r["status"] == "ok"}
    assert {"DPSGD", "DPAdam", "DPMacAdam", "DP2 (sgd phase)", "DPPMLF", "copy", "generator"} <= names
    (full,) = rec["full_step"]
    assert {r["name"] for r in full["providers"] if r["status"] == "ok"} >= {"cpu DPAdam"}
    (train,) = rec["train_step"]  # --quick: the small CNN only
    rows = {r["name"]: r for r in train["providers"]}
    bk_ok = _all_timed(rows)
    assert rows["opacus + dpkernels"]["peak_over_non_private"] == 1.0
    assert rows["opacus ghost"]["peak_mem_skipped"] == "memory process exited 1: boom"
    assert "peak_mem_mib" not in rows["opacus ghost"]
    assert [t["met"] is None for t in train["targets"]] == [not bk_ok] * 4


# ----------------------------------------------------------------------------------------------
# The train section on tiny models: every provider, and the peak-memory processes
# ----------------------------------------------------------------------------------------------

MEMORY_KEYS = ("peak_mem_mib", "setup_mib", "first_step_peak_mib", "held_between_steps_mib")
TRAIN_PROVIDERS = ["non-private", "opacus hooks", "opacus ghost", "opacus + dpkernels", "dpkernels bk",
                   "dpkernels bk + STP scale"]  # fmt: skip
TINY = {
    "mlp": train_step.TrainModel("mlp", "tiny", 4, "mlp", (8,), kwargs=dict(width=16, depth=3, d_in=8)),
    "cnn": train_step.TrainModel("cnn", "tiny", 4, "cnn", (3, 8, 8), kwargs=dict(widths=(8,) * 5, groups=4)),
    "transformer": train_step.TrainModel("transformer", "tiny", 4, "transformer", (8,), vocab=50,
                                         kwargs=dict(vocab=50, d=16, heads=2, layers=1, seq_len=8)),
}  # fmt: skip


def _all_timed(rows: dict) -> bool:
    """Every train provider timed, in table order; the BK rows may be skipped with the reason while
    the native tiled kernel is not built (the cnn's and transformer's layers need it). Whether they ran."""
    from dpkernels.bench.layers import tiled_missing

    assert list(rows) == TRAIN_PROVIDERS
    waiting = tiled_missing("cpu") is not None
    failed = {n: r["reason"] for n, r in rows.items() if r["status"] != "ok"}
    assert {n: why for n, why in failed.items()
            if not (waiting and n.startswith("dpkernels bk") and "linear_sumsq_tiled" in why)} == {}  # fmt: skip
    assert all(r["median_s"] > 0 for r in rows.values() if r["status"] == "ok")
    return rows["dpkernels bk"]["status"] == "ok" and rows["dpkernels bk + STP scale"]["status"] == "ok"


@pytest.fixture
def one_thread(monkeypatch):
    """Tiny models on one thread (on a loaded machine two OpenMP threads wait for each other at
    every op, which costs far more than these ops take), no cache flush (timings mean nothing here)."""
    monkeypatch.delenv("DPKERNELS_POISON_OUTPUTS", raising=False)
    monkeypatch.setattr(_timing, "flush_caches", lambda device: None)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_train_models_as_specified():
    assert train_step.MODELS["transformer"].n_params == 2_922_058  # about 3 M, stated in `what`
    assert "2,922,058 parameters" in train_step.MODELS["transformer"].what
    assert [m.name for m in train_step.models(quick=True)] == ["cnn"]
    assert train_step.provider_names("cpu") == TRAIN_PROVIDERS and train_step.n_providers("cpu") == 6
    assert train_step.provider_names("cuda")[3:5] == ["opacus + dpkernels [cuda]", "opacus + dpkernels [triton]"]
    m = TINY["transformer"]
    assert train_step.TrainModel.from_json(m.to_json()) == m  # what the memory process receives


@pytest.mark.skipif("cpu" not in dpkernels.available_backends("cpu"), reason="needs the C++ extension")
@pytest.mark.parametrize("arch", list(TINY))
def test_train_providers_on_tiny_models(arch, one_thread):
    m = TINY[arch]
    rec = train_step.bench_train_step(m, BenchConfig(repeats=1, warmup=1, budget_s=1.0), memory=False)
    rows = {r["name"]: r for r in rec["providers"]}
    bk_ok = _all_timed(rows)
    assert rows["non-private"]["over_non_private"] == 1.0 and rows["opacus hooks"]["speedup_vs_opacus"] == 1.0
    assert [t["met"] is None for t in rec["targets"]] == [not bk_ok] * 3 + [True]  # memory not measured
    # The memory measurement itself, in this process (the bench runs it in a fresh one per provider).
    mem = train_step.measure_peak(m, "dpkernels bk" if bk_ok else "opacus ghost")
    assert mem["meter"] == "VmHWM" and all(math.isfinite(mem[k]) for k in MEMORY_KEYS)


@pytest.mark.skipif("cpu" not in dpkernels.available_backends("cpu"), reason="needs the C++ extension")
def test_train_peak_memory_processes(one_thread, monkeypatch):
    # 256-wide layers: each tensor is above glibc's mmap threshold set there, so a step's memory shows
    m = train_step.TrainModel("mlp", "small", 8, "mlp", (256,), kwargs=dict(width=256, depth=3, d_in=256))
    (bk,) = train_step.peak_memory(m, ["dpkernels bk"], threads=1).values()
    # at least its model copy and DPAdam's two state buffers, 3 x 0.5 MiB
    assert set(bk) == {*MEMORY_KEYS, "meter"} and bk["peak_mem_mib"] > 1.5, bk
    # a process that fails or hangs leaves the memory skipped, with the reason
    with pytest.raises(KeyError, match="no provider 'no such provider'"):
        train_step.measure_peak(m, "no such provider")
    (late,) = train_step.peak_memory(m, ["non-private"], timeout=0.01).values()
    assert late == {"skip": "memory process ran past 0.01 s"}
    monkeypatch.setattr(sys, "executable", "false")
    (failed,) = train_step.peak_memory(m, ["non-private"]).values()
    assert failed == {"skip": "memory process exited 1: no output"}


# ----------------------------------------------------------------------------------------------
# --device: the option, its error without CUDA, and the device plumbing (no GPU needed)
# ----------------------------------------------------------------------------------------------


def test_device_option_parses():
    parser = cli.build_parser()
    assert parser.parse_args(["bench"]).device == "cpu"
    assert parser.parse_args(["bench", "--device", "cuda"]).device == "cuda"
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--device", "tpu"])


def test_device_cuda_without_cuda_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--device", "cuda", "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--device cuda" in err and "torch.cuda.is_available() is False" in err
    assert "Traceback" not in err
    assert not out.exists()


class _Log(list):
    """The calls the timing path makes, in order."""

    def provider(self) -> Provider:
        return Provider("p", "dpkernels", call=lambda: self.append("call"), prepare=lambda: self.append("prepare"))


@pytest.fixture
def log(monkeypatch) -> _Log:
    """Records cache flushes and ``torch.cuda.synchronize`` instead of running them."""
    calls = _Log()
    monkeypatch.setattr(_timing, "flush_caches", lambda device: calls.append(f"flush {device}"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("synchronize"))
    return calls


def test_timed_call_cpu_is_perf_counter(log, monkeypatch):
    clock = iter([10.0, 10.25])
    monkeypatch.setattr(_timing, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    assert _timing.timed_call(log.provider(), "cpu") == 0.25
    assert log == ["prepare", "flush cpu", "call"]  # no synchronize on CPU


def test_timed_call_cuda_synchronizes_around_events(log, monkeypatch):
    class Event:
        names = iter(["start", "end"])

        def __init__(self, enable_timing: bool):
            assert enable_timing
            self.name = next(Event.names)

        def record(self) -> None:
            log.append(f"record {self.name}")

        def elapsed_time(self, end: "Event") -> float:
            log.append(f"elapsed {self.name}..{end.name}")
            return 1.5  # ms

    monkeypatch.setattr(torch.cuda, "Event", Event)
    assert _timing.timed_call(log.provider(), "cuda") == pytest.approx(1.5e-3)
    assert log == ["prepare", "flush cuda", "synchronize", "record start", "call", "record end", "synchronize",
                   "elapsed start..end"]  # fmt: skip


@pytest.mark.parametrize(("device", "warmup_calls"), [("cpu", 1), ("cuda", 2)])
def test_round_robin_times_on_the_device(monkeypatch, device, warmup_calls):
    seen = []
    monkeypatch.setattr(_timing, "timed_call", lambda p, dev: seen.append(dev) or 1e-3)
    cfg = BenchConfig(repeats=3, warmup=1, budget_s=10.0, device=device)
    res, _ = _timing.time_providers([Provider("p", "dpkernels", call=lambda: None)], cfg, lambda p, phase: None)
    # On a GPU the first call loads kernels: two warm-up calls at least.
    assert len(res["p"]["warmup_s"]) == warmup_calls and len(res["p"]["times_s"]) == 3
    assert seen == [device] * (warmup_calls + 3)


def test_backends_per_device():
    from dpkernels.bench.clip import TRITON_SKIP, clip_backends

    assert _timing.NATIVE_BACKENDS == {"cpu": ("cpu",), "cuda": ("cuda", "triton")}
    cpu_ok = "cpu" in dpkernels.available_backends("cpu")
    assert _timing.timed_backends("cpu") == (["cpu"] if cpu_ok else [])
    # the CPU clip table as always: cpu, then triton skipped
    assert [b for b, _ in clip_backends("cpu")] == ["cpu", "triton"]
    assert clip_backends("cpu")[1] == ("triton", TRITON_SKIP)
    assert _timing.per_backend_name("DPAdam", "cpu") == "DPAdam"
    assert _timing.per_backend_name("DPAdam", "triton") == "DPAdam [triton]"
    if not torch.cuda.is_available():
        assert _timing.timed_backends("cuda") == []
        assert all(skip for _, skip in clip_backends("cuda"))  # listed, each with its reason


def test_machine_info_records_the_gpu(monkeypatch):
    from dpkernels.bench.runner import machine_info

    assert "gpu" not in machine_info("cpu")
    props = SimpleNamespace(major=9, minor=0, total_memory=80 << 30, L2_cache_size=50 << 20, multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    info = machine_info("cuda")
    assert info["gpu"]["name"] == "NVIDIA H100 80GB HBM3" and info["gpu"]["capability"] == "9.0"
    assert info["versions"]["cuda"] == torch.version.cuda
    assert "triton" in info["versions"]


@pytest.mark.skipif("cpu" not in dpkernels.available_backends("cpu"), reason="needs the C++ extension")
def test_bench_layers_section(tmp_path, monkeypatch):
    from dpkernels.bench import layers, runner
    from dpkernels.layers import _pick_method

    # --quick leaves the section out unless named; a plain run and --sections include it
    seen = []
    monkeypatch.setattr(runner, "run", lambda cfg, json_path: seen.append(cfg.sections))
    for argv in (["--quick"], [], ["--quick", "--sections", "layers"]):
        assert cli.main(["bench", *argv]) == 0
    assert "layers" not in seen[0] and "layers" in seen[1] and seen[2] == ["layers"]
    monkeypatch.undo()

    monkeypatch.delenv("DPKERNELS_POISON_OUTPUTS", raising=False)
    shapes = (layers.LayerShape(4, 1, 16, 16), layers.LayerShape(4, 2, 32, 32), layers.LayerShape(4, 16, 16, 24))
    monkeypatch.setattr(layers, "LAYER_SHAPES", shapes)  # tiny: t1, gram and tiled picked by auto
    out = tmp_path / "bench.json"
    argv = ["bench", "--sections", "layers", "--repeats", "1", "--warmup", "1", "--json", str(out)]
    assert cli.main(argv) == 0
    rec = json.loads(out.read_text())
    assert [r["name"] for r in rec["layers"]] == ["T1-d16", "T2-d32", "T16-d16x24"]
    assert [r["auto_picks"] for r in rec["layers"]] == ["t1", "gram", "tiled"]
    tiled_why = layers.tiled_missing("cpu")
    for shape, r in zip(shapes, rec["layers"], strict=True):
        rows = {p["name"]: p for p in r["providers"]}
        assert ("bk t1" in rows) == (shape.T == 1)
        assert rows["weight-grad GEMM"]["status"] == "ok" and rows["bk gram"]["status"] == "ok"
        assert (
            rows["bk auto"]["method"]
            == f"auto → {_pick_method('auto', shape.T, shape.d_out, shape.d_in, False, 'cpu')}"
        )
        needs_tiled = {"bk tiled", *(n for n in ("bk auto", "bk auto + dense scale") if "tiled" in rows[n]["method"])}
        for name, p in rows.items():
            if tiled_why is not None and name in needs_tiled:  # not built yet: skipped with the reason, no crash
                assert p["status"] == "skipped" and "linear_sumsq_tiled" in p["reason"]
            else:
                assert p["status"] == "ok", p
                assert p["over_gemm"] > 0
                if p["kind"] == "dpkernels":
                    assert p["max_rel_err_sumsq"] < 1e-5 and p["max_rel_err_sum"] < 1e-5
    targets = rec["layers_targets"]
    assert [t["shape"] for t in targets] == ["T1-d16", "T2-d32", "T16-d16x24"]
    for t in targets:
        measured = t["auto_s"] is not None
        assert (t["auto_within_1_3x_gemm"] is None) == (not measured)
        if measured:
            assert t["auto_within_1_3x_gemm"] == (t["auto_over_gemm"] <= 1.3)
            assert t["auto_within_10pct_of_best"] == (t["auto_over_best_fixed"] <= 1.1)


def _fake_record(philox_s: float, read_s: float, copy_s: float) -> dict:
    """A ``dpkernels bench`` record of the noise, clip and step sections with constant rounds."""

    def row(name, kind, t, nbytes=0):
        return {"name": name, "kind": kind, "status": "ok", "times_s": [t] * 3, "bytes_moved": nbytes}

    return {
        "config": {"threads": 2},
        "noise": {
            "numel": 1000,
            "providers": [
                row("cpu philox", "dpkernels", philox_s),
                row("cpu chacha20", "dpkernels", 3 * philox_s),
                row("torch.normal", "baseline", 4e-3),
            ],  # fmt: skip
        },
        "shapes": [
            {
                "name": "mlp",
                "grad_bytes": 100,
                "providers": [row("cpu", "dpkernels", 4e-3, 200), row("read", "bandwidth", read_s, 100)],
            }
        ],  # fmt: skip
        "step": {
            "providers": [
                row("DPSGD", "dpkernels", 2e-3, 50),
                row("copy", "bandwidth", copy_s, 100),
                row("generator", "bandwidth", 1e-3, 40),
            ]
        },  # fmt: skip
    }


def test_cpu_paths_summary_pools_the_baselines():
    """Each path's own medians against baselines pooled over every run: a slow copy or read in one
    run moves every path's share alike."""
    from dpkernels.bench import cpu_paths

    runs = {"avx2": [_fake_record(1e-3, 2e-3, 1e-3), _fake_record(1e-3, 2e-3, 1e-3)],
            "default": [_fake_record(2e-3, 2e-3, 1e-3), _fake_record(2e-3, 2e-3, 3e-3)]}  # fmt: skip
    every = [r for recs in runs.values() for r in recs]
    summ = {cap: cpu_paths.summarize(recs, every) for cap, recs in runs.items()}
    assert summ["avx2"]["noise"]["philox_vs_torch_normal"] == pytest.approx(4.0)
    assert summ["avx2"]["noise"]["chacha20_over_philox"] == pytest.approx(3.0)
    assert summ["default"]["noise"]["philox_ns_per_normal_per_core"] == pytest.approx(2e-3 * 2 / 1000 * 1e9)
    # clip moves 200 bytes in 4 ms against a read of 100 bytes in 2 ms: the same bandwidth
    assert summ["avx2"]["clip_pct_read_bw"]["mlp"] == pytest.approx(100.0)
    # pooled copy: median of (1, 1, 1, 3) ms over 12 rounds = 1 ms; the pass moves 50 B in 2 ms
    assert summ["default"]["step_pct_copy_bw"]["DPSGD"] == pytest.approx(100 * (50 / 2e-3) / (100 / 1e-3))
    assert summ["default"]["step_generator_ms"] == pytest.approx(1.0)
    rel = cpu_paths.relative_to_best(summ)
    assert rel["avx2"]["step_pct_copy_bw"]["DPSGD"] == 1.0 and rel["default"]["clip_pct_read_bw"]["mlp"] == 1.0


def test_cpu_paths_needs_cpu_tensors_and_keeps_the_options(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cli.main(["bench", "--cpu-paths", "--device", "cuda"]) == 2
    assert "--cpu-paths compares the CPU kernel paths" in capsys.readouterr().err
    seen = {}
    monkeypatch.setattr("dpkernels.bench.cpu_paths.run", lambda argv, json_path: seen.update(argv=argv, json=json_path))
    args = ["bench", "--cpu-paths", "--quick", "--sections", "noise,step", "--repeats", "3", "--no-compile"]
    assert cli.main([*args, "--json", "x.json"]) == 0
    assert seen["json"] == "x.json" and "--cpu-paths" not in seen["argv"] and "--json" not in seen["argv"]
    again = cli.build_parser().parse_args(seen["argv"])
    assert (again.quick, again.sections, again.repeats, again.compile) == (True, ["noise", "step"], 3, False)
