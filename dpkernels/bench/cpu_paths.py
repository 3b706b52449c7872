"""``dpkernels bench --cpu-paths``: the chosen sections once per CPU kernel path, side by side.

The CPU kernels are built once per instruction set (``avx512``, ``avx2``, ``default``) and a
process loads one of them (dpkernels/_backend.py), so each path this machine runs is benchmarked
in its own process with ``DPKERNELS_CPU_CAPABILITY`` forcing it, in the order best to worst and
then worst to best: each path runs twice, so a drift of the host over the run, or a penalty of
the first process, weighs on every path alike. A path's time is the median over the rounds of
its two runs; the baselines (``torch.normal``, the read and the copy), which do not depend on the
path, are pooled over the rounds of every run (a single run's copy baseline moved by up to 1.5x):

- **noise**: the Philox and ChaCha20 generators' medians, ns per normal per core (median x
  threads / D), Philox's speed-up over ``torch.normal`` and ChaCha20's cost over Philox;
- **clip**: ``clip_and_accumulate``'s share of the read bandwidth, per shape;
- **step**: each fused optimizer pass's share of the copy bandwidth (its bytes over its median).

Each path's share is also given as a fraction of the best path's (the issue's "within 10%").
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .. import _backend


def _providers(record: dict) -> dict[tuple[str, str], dict]:
    """Every timed provider row of one ``dpkernels bench`` record, keyed (section item, name)."""
    rows = {}
    for r in record.get("noise", {}).get("providers", []):
        rows["noise", r["name"]] = r
    for shape in record.get("shapes", []):
        for r in shape["providers"]:
            rows[f"clip {shape['name']}", r["name"]] = r
    for r in record.get("step", {}).get("providers", []):
        rows["step", r["name"]] = r
    return {k: r for k, r in rows.items() if r.get("status", "ok") == "ok"}


def _median(records: list[dict], key: tuple[str, str]) -> float:
    """The median over every round of ``key`` in ``records``."""
    return statistics.median(t for rec in records for t in _providers(rec)[key]["times_s"])


def summarize(path_records: list[dict], all_records: list[dict]) -> dict:
    """One path's figures (see the module docstring) from its runs ``path_records``: its own
    medians over the rounds of all its runs, against baselines (torch.normal, read, copy, which do
    not depend on the path) pooled over the rounds of every run of every path."""
    first = path_records[0]
    threads, out = first["config"]["threads"], {}
    if "noise" in first:
        numel = first["noise"]["numel"]
        philox, chacha = (
            _median(path_records, ("noise", "cpu philox")),
            _median(path_records, ("noise", "cpu chacha20")),
        )
        base = _median(all_records, ("noise", "torch.normal"))
        out["noise"] = {
            "numel": numel,
            "threads": threads,
            "philox_ms": 1e3 * philox,
            "chacha20_ms": 1e3 * chacha,
            "torch_normal_ms": 1e3 * base,
            "philox_ns_per_normal_per_core": 1e9 * philox * threads / numel,
            "chacha20_ns_per_normal_per_core": 1e9 * chacha * threads / numel,
            "philox_vs_torch_normal": base / philox,
            "chacha20_over_philox": chacha / philox,
        }
    rows = _providers(first)
    if first.get("shapes"):
        out["clip_pct_read_bw"] = {}
        for shape in first["shapes"]:
            item = f"clip {shape['name']}"
            read_bw = rows[item, "read"]["bytes_moved"] / _median(all_records, (item, "read"))
            cpu_bw = rows[item, "cpu"]["bytes_moved"] / _median(path_records, (item, "cpu"))
            out["clip_pct_read_bw"][shape["name"]] = 100 * cpu_bw / read_bw
    if "step" in first:
        copy_bw = rows["step", "copy"]["bytes_moved"] / _median(all_records, ("step", "copy"))
        # The passes' floor: the copy of their bytes, or generating their D normals, if longer.
        out["step_generator_ms"] = 1e3 * _median(path_records, ("step", "generator"))
        out["step_copy_ms"] = 1e3 * _median(all_records, ("step", "copy"))
        out["step_pct_copy_bw"] = {
            name: 100 * r["bytes_moved"] / _median(path_records, ("step", name)) / copy_bw
            for (item, name), r in rows.items()
            if item == "step" and r["kind"] == "dpkernels"
        }
    return out


def relative_to_best(summaries: dict[str, dict]) -> dict[str, dict]:
    """Each path's bandwidth shares divided by the best path's (1.0: the same share)."""
    best = next(iter(summaries.values()))
    out = {}
    for cap, s in summaries.items():
        out[cap] = {
            key: {name: s[key][name] / best[key][name] for name in s[key]}
            for key in ("clip_pct_read_bw", "step_pct_copy_bw")
            if key in s
        }
    return out


def _table(summaries: dict[str, dict], relative: dict[str, dict]):
    from rich.table import Table

    caps = list(summaries)
    t = Table(title="CPU paths (each path: the median over its two processes' rounds; baselines pooled over all)",
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
    if "step_generator_ms" in first:
        t.add_row("step: D normals alone ms", *(f"{summaries[c]['step_generator_ms']:.2f}" for c in caps))
        t.add_row("step: D-element copy ms", *(f"{summaries[c]['step_copy_ms']:.2f}" for c in caps))
    for key, label in (
        ("clip_pct_read_bw", "clip % read BW"),
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
    records: dict[str, list[dict]] = {cap: [] for cap in caps}
    with tempfile.TemporaryDirectory() as tmp:
        for i, cap in enumerate([*caps, *reversed(caps)]):
            console.rule(f"{_backend.CPU_CAPABILITY_ENV}={cap}")
            out = Path(tmp) / f"{i}-{cap}.json"
            env = {**os.environ, _backend.CPU_CAPABILITY_ENV: cap}
            subprocess.run([sys.executable, "-m", "dpkernels.cli", *argv, "--json", str(out)], env=env, check=True)
            records[cap].append(json.loads(out.read_text()))
    every = [rec for recs in records.values() for rec in recs]
    summaries = {cap: summarize(recs, every) for cap, recs in records.items()}
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
