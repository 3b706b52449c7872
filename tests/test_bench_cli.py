"""Smoke test of ``dpkernels bench``: the sections run end to end and write their JSON records.

Timings here mean nothing (one round, a shared machine); the benchmark itself is `make bench`.
"""

import json
from types import SimpleNamespace

import pytest
import torch

import dpkernels
from dpkernels import cli
from dpkernels.bench import _timing
from dpkernels.bench._timing import BenchConfig, Provider


@pytest.mark.skipif("cpu" not in dpkernels.available_backends("cpu"), reason="needs the C++ extension")
def test_bench_sections_write_json(tmp_path, monkeypatch):
    monkeypatch.delenv("DPKERNELS_POISON_OUTPUTS", raising=False)
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
    assert {r["name"] for r in train["providers"] if r["status"] == "ok"} == {
        "non-private", "opacus", "opacus + dpkernels"
    }  # fmt: skip
    assert all(r["median_s"] > 0 for r in train["providers"])


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
