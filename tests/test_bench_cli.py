"""Smoke test of ``dpkernels bench``: the sections run end to end and write their JSON records.

Timings here mean nothing (one round, a shared machine); the benchmark itself is `make bench`.
"""

import json

import pytest

import dpkernels
from dpkernels import cli


@pytest.mark.skipif("cpu" not in dpkernels.available_backends("cpu"), reason="needs the C++ extension")
def test_bench_sections_write_json(tmp_path, monkeypatch):
    monkeypatch.delenv("DPKERNELS_POISON_OUTPUTS", raising=False)
    out = tmp_path / "bench.json"
    argv = ["bench", "--quick", "--sections", "noise,privatize,step,train", "--shapes", "small-b8", "--repeats", "1",
            "--warmup", "1", "--json", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    rec = json.loads(out.read_text())
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
