"""Result rows, ratios and tables shared by the ``dpkernels bench`` sections.

Imports nothing from the section modules (which all import it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from ._timing import Provider, summary_stats
from .shapes import Shape


def result_rows(providers: Sequence[Provider], res: dict[str, dict]) -> dict[str, dict]:
    """One JSON row per provider, by name: its timings and their summary, or why it was skipped."""
    rows = {}
    for p in providers:
        if p.skip is not None:
            rows[p.name] = {"name": p.name, "kind": p.kind, "status": "skipped", "reason": p.skip}
            continue
        times = res[p.name]["times_s"]
        rows[p.name] = {"name": p.name, "kind": p.kind, "what": p.note, "status": "ok", **summary_stats(times),
                        "times_s": times}  # fmt: skip
    return rows


def add_pct_of_bandwidth(rows: dict[str, dict], baselines: Sequence[str]) -> None:
    """``pct_<b>_bw`` on every timed row: its GB/s as a percentage of same-run baseline ``b``'s."""
    for row in rows.values():
        if row["status"] == "ok":
            for b in baselines:
                row[f"pct_{b}_bw"] = 100 * row["gbps"] / rows[b]["gbps"]


def add_speedup_vs_opacus(rows: Iterable[dict]) -> None:
    """``speedup_vs_opacus`` (Opacus's median time ÷ the row's) on every timed row but the bandwidth
    baselines, when the ``opacus`` row was timed."""
    rows = list(rows)
    opacus = next((r["median_s"] for r in rows if r["name"] == "opacus" and r["status"] == "ok"), None)
    for row in rows:
        if opacus is not None and row["status"] == "ok" and row["kind"] != "bandwidth":
            row["speedup_vs_opacus"] = opacus / row["median_s"]


def target(what: str, speedup: float | None, threshold: float, also: bool = True) -> dict:
    """A section's target: met when ``speedup >= threshold`` and ``also``; None when not measured."""
    return {"what": what, "speedup": speedup, "met": None if speedup is None else speedup >= threshold and also}


def shape_fields(shape: Shape) -> dict:
    """The fields that name a shape in a section's JSON record."""
    return {"name": shape.name, "batch_size": shape.batch_size, "n_tensors": shape.n_tensors,
            "n_params": shape.n_params}  # fmt: skip


def shape_title(rec: dict) -> str:
    """``B=…, N tensors, D=… M`` of a record with :func:`shape_fields`."""
    return f"B={rec['batch_size']}, {rec['n_tensors']} tensors, D={rec['n_params'] / 1e6:.2f} M"


def fmt(x, spec: str, suffix: str = "") -> str:
    """A table cell: ``x`` formatted, or a dash where there is no value."""
    return "—" if x is None else f"{x:{spec}}{suffix}"


def caption(rec: dict) -> str:
    """A result table's caption: its target (if any) and whether other processes shared the cores."""
    lines = []
    tgt = rec.get("target")
    if tgt and tgt["speedup"] is not None:
        lines.append(f"target {tgt['what']}: {tgt['speedup']:.2f}× → {'met' if tgt['met'] else 'NOT met'}")
    other = rec["other_cpu_cores_during_timing"]
    if other > 0.1:
        lines.append(f"[yellow]other processes kept {other:.2f} cores busy during the timed rounds[/]")
    return "\n".join(lines)


def speedup_vs_opacus(r: dict) -> str:
    return fmt(r.get("speedup_vs_opacus"), ".2f", "×")


def provider_table(title: str, rec: dict, extra: dict[str, Callable[[dict], str]]):
    """One row per provider of ``rec["providers"]``: median and IQR, then the ``extra`` columns
    (header → the cell text of a row). dpkernels rows bold green, bandwidth baselines and skipped
    providers dimmed; the caption from :func:`caption`."""
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for col in ("provider", "median ms", "IQR ms", *extra):
        t.add_column(col, justify="left" if col == "provider" else "right")
    for r in rec["providers"]:
        if r.get("status", "ok") != "ok":
            t.add_row(r["name"], "[dim]skipped[/]", style="dim")
            continue
        style = {"dpkernels": "bold green", "bandwidth": "dim"}.get(r["kind"])
        cells = (f(r) for f in extra.values())
        t.add_row(r["name"], f"{1e3 * r['median_s']:.2f}", f"{1e3 * r['iqr_s']:.2f}", *cells, style=style)
    t.caption = caption(rec)
    return t
