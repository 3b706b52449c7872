"""``dpkernels bench --cpu-paths``: the chosen sections once per CPU kernel path, side by side.

The CPU kernels are built once per instruction set (``avx512``, ``avx2``, ``default``) and a
process loads one of them (dpkernels/_backend.py), so each path this machine runs is benchmarked
in its own process, one after the other, with ``DPKERNELS_CPU_CAPABILITY`` forcing it. Every
ratio below is taken inside one path's run against that run's own baselines (``torch.normal``,
the same-run read and copy), so host drift between the processes cancels out of the comparison:

- **noise**: the Philox and ChaCha20 generators' medians, ns per normal per core (median x
  threads / D), Philox's speed-up over ``torch.normal`` and ChaCha20's cost over Philox;
- **clip**: ``clip_and_accumulate``'s share of the same-run read bandwidth, per shape;
- **privatize**: the fused private sum's share of the same-run read bandwidth, per shape;
- **step**: each fused optimizer pass's share of the same-run copy bandwidth (its bytes over
  its median, against a D-element copy) and its time over its floor.

Each path's share is also given as a fraction of the best path's (the issue's "within 10%").
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .. import _backend


def _cpu(rows: list[dict], name: str = "cpu") -> dict | None:
    return next((r for r in rows if r["name"] == name and r.get("status", "ok") == "ok"), None)


def summarize(record: dict) -> dict:
    """The per-path figures of one ``dpkernels bench`` record (see the module docstring)."""
    out: dict = {}
    threads = record["config"]["threads"]
    if "noise" in record:
        rows = record["noise"]["providers"]
        philox, chacha, base = _cpu(rows, "cpu philox"), _cpu(rows, "cpu chacha20"), _cpu(rows, "torch.normal")
        numel = record["noise"]["numel"]
        out["noise"] = {
            "numel": numel,
            "threads": threads,
            "philox_ms": 1e3 * philox["median_s"],
            "chacha20_ms": 1e3 * chacha["median_s"],
            "torch_normal_ms": 1e3 * base["median_s"],
            "philox_ns_per_normal_per_core": 1e9 * philox["median_s"] * threads / numel,
            "chacha20_ns_per_normal_per_core": 1e9 * chacha["median_s"] * threads / numel,
            "philox_vs_torch_normal": base["median_s"] / philox["median_s"],
            "chacha20_over_philox": chacha["median_s"] / philox["median_s"],
        }
    if record.get("shapes"):
        out["clip_pct_read_bw"] = {s["name"]: _cpu(s["providers"])["pct_read_bw"] for s in record["shapes"]}
    if "privatize" in record:
        out["privatize_pct_read_bw"] = {s["name"]: _cpu(s["providers"])["pct_read_bw"] for s in record["privatize"]}
    if "step" in record:
        out["step_pct_copy_bw"] = {
            r["name"]: r["pct_copy_bw"] for r in record["step"]["providers"] if r["kind"] == "dpkernels"
        }
        out["step_over_floor"] = {
            r["name"]: r["over_floor"] for r in record["step"]["providers"] if r["kind"] == "dpkernels"
        }
    return out


def relative_to_best(summaries: dict[str, dict]) -> dict[str, dict]:
    """Each path's bandwidth shares divided by the best path's (1.0: the same share)."""
    best = next(iter(summaries.values()))
    out = {}
    for cap, s in summaries.items():
        out[cap] = {
            key: {name: s[key][name] / best[key][name] for name in s[key]}
            for key in ("clip_pct_read_bw", "privatize_pct_read_bw", "step_pct_copy_bw")
            if key in s
        }
    return out


def _table(summaries: dict[str, dict], relative: dict[str, dict]):
    from rich.table import Table

    caps = list(summaries)
    t = Table(title="CPU paths (each measured in its own process; ratios against its own baselines)",
              title_justify="left")  # fmt: skip
    t.add_column("figure")
    for cap in caps:
        t.add_column(cap, justify="right")
    first = summaries[caps[0]]
    if "noise" in first:
        for key, label, spec in (
            ("philox_ms", "Philox ms", ".2f"),
            ("philox_ns_per_normal_per_core", "Philox ns/normal/core", ".2f"),
            ("philox_vs_torch_normal", "Philox vs torch.normal", ".2f"),
            ("chacha20_ms", "ChaCha20 ms", ".2f"),
            ("chacha20_over_philox", "ChaCha20 / Philox", ".2f"),
            ("torch_normal_ms", "torch.normal ms", ".2f"),
        ):
            t.add_row(label, *(format(summaries[c]["noise"][key], spec) for c in caps))
    for key, label in (
        ("clip_pct_read_bw", "clip % read BW"),
        ("privatize_pct_read_bw", "privatize % read BW"),
        ("step_pct_copy_bw", "step % copy BW"),
    ):
        for name in first.get(key, {}):
            t.add_row(
                f"{label}: {name}",
                *(f"{summaries[c][key][name]:.0f}% ({relative[c][key][name]:.2f})" for c in caps),
            )
    t.caption = "in brackets: the share over the first path's share"
    return t


def run(argv: list[str], json_path: str | os.PathLike, console=None) -> dict:
    """``dpkernels bench argv`` once per runnable CPU path, then one JSON and one comparison table."""
    from rich.console import Console

    console = console or (Console() if sys.stdout.isatty() else Console(width=200))
    caps = _backend.runnable_cpu_capabilities()
    if not caps:
        raise RuntimeError("no CPU kernel module is built: --cpu-paths has nothing to compare")
    t_start = time.perf_counter()
    records = {}
    with tempfile.TemporaryDirectory() as tmp:
        for cap in caps:
            console.rule(f"{_backend.CPU_CAPABILITY_ENV}={cap}")
            out = Path(tmp) / f"{cap}.json"
            env = {**os.environ, _backend.CPU_CAPABILITY_ENV: cap}
            subprocess.run([sys.executable, "-m", "dpkernels.cli", *argv, "--json", str(out)], env=env, check=True)
            records[cap] = json.loads(out.read_text())
    summaries = {cap: summarize(rec) for cap, rec in records.items()}
    relative = relative_to_best(summaries)
    combined = {
        "schema": 1,
        "command": sys.argv,
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "method": __doc__,
        "cpu_paths": caps,
        "summary": summaries,
        "relative_to_best": relative,
        "runs": records,
        "wall_s": time.perf_counter() - t_start,
    }
    console.print(_table(summaries, relative))
    path = Path(json_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(combined, indent=1) + "\n")
    console.print(f"wrote {path} (wall {combined['wall_s']:.0f} s)")
    return combined
