"""``dpkernels bench``: runs the chosen sections with progress bars, prints their tables, writes one JSON file.

The sections are :mod:`dpkernels.bench.clip` (``clip``), :mod:`dpkernels.bench.noise` (``noise``,
``privatize``), :mod:`dpkernels.bench.step` (``step``) and :mod:`dpkernels.bench.train_step`
(``train``) and :mod:`dpkernels.bench.layers` (``layers``); this module imports them, and none of
them imports it.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import re
import resource
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

import dpkernels

from .. import _backend
from . import clip, layers, noise, step, train_step
from ._timing import BenchConfig, timed_backends
from .shapes import Shape, get_shape


def _version(dist: str) -> str | None:
    """The installed version of distribution ``dist``, or None."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info(device: str = "cpu") -> dict:
    """What the numbers depend on: CPU, threads, memory, library versions, relevant env; on
    ``cuda`` also the GPU, the CUDA version torch was built with and Triton's version."""

    def read(path: str) -> str:
        try:
            return Path(path).read_text()
        except OSError:
            return ""

    cpuinfo = read("/proc/cpuinfo")
    model = re.search(r"^model name\s*:\s*(.*)$", cpuinfo, re.M)
    mem = re.search(r"^MemTotal:\s*(\d+) kB", read("/proc/meminfo"), re.M)
    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "dpkernels": dpkernels.__version__,
    }
    for mod in ("opacus", "rich"):
        versions[mod] = _version(mod)
    info = {
        "cpu_model": model.group(1).strip() if model else platform.processor(),
        "cpu_count": os.cpu_count(),
        "l3_cache": read("/sys/devices/system/cpu/cpu0/cache/index3/size").strip() or None,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "dpkernels_cpu_capability": dpkernels.cpu_capability(),
        "mem_total_gib": int(mem.group(1)) / 2**20 if mem else None,
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "versions": versions,
        "backends_available": _backend.available_backends(device),
        "env": {
            k: os.environ[k]
            for k in ("DPKERNELS_POISON_OUTPUTS", _backend.CPU_CAPABILITY_ENV, "TRITON_INTERPRET", "OMP_NUM_THREADS")
            if k in os.environ
        },
    }
    if device == "cuda":
        versions.update(cuda=torch.version.cuda, triton=_version("triton"))
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info["gpu"] = {
            "name": torch.cuda.get_device_name(),
            "capability": f"{props.major}.{props.minor}",
            "memory_gib": props.total_memory / 2**30,
            "l2_cache_mib": props.L2_cache_size / 2**20,
            "multiprocessors": props.multi_processor_count,
        }
    return info


def _run_other_sections(cfg: BenchConfig, shapes: Sequence[Shape], record: dict, progress) -> None:
    """The generator, ``privatize``, optimizer-step, training-step and BK layer sections, one progress bar each."""

    def ticker(task, label):
        return lambda p, phase: progress.update(task, advance=1, description=f"[bold]{label}[/] {p.name} {phase}")

    if "noise" in cfg.sections:
        n = len(noise.generator_providers(0, cfg.device)) * (cfg.warmup + cfg.repeats)
        task = progress.add_task("generator", total=n)
        record["noise"] = noise.bench_generator(cfg, on_call=ticker(task, "generator"))
        progress.update(task, description="generator: done", completed=n)
        progress.console.print(noise.generator_table(record["noise"], cfg.device))

    def per_item(key: str, label: str, items, calls_per_item: int, bench, table) -> None:
        """One bench call and table per shape (or model), under one progress bar."""
        n = len(items) * calls_per_item * (cfg.warmup + cfg.repeats)
        task = progress.add_task(label, total=n)
        record[key] = []
        for item in items:
            rec = bench(item, cfg, on_call=ticker(task, f"{label} {item.name}"))
            record[key].append(rec)
            progress.console.print(table(rec))
        progress.update(task, description=f"{label}: done", completed=n)

    n_native = len(timed_backends(cfg.device))
    if "privatize" in cfg.sections:  # the native backends, reference, Opacus, copy and read
        per_item("privatize", "privatize", shapes, n_native + 4, noise.bench_privatize, noise.privatize_table)
    if "step" in cfg.sections:
        n = step.expected_providers(cfg.device, len(shapes)) * (cfg.warmup + cfg.repeats)
        task = progress.add_task("step", total=n)
        record["step"] = step.bench_steps(cfg, on_call=ticker(task, "step"))
        progress.console.print(step.steps_table(record["step"], cfg.device))
        record["full_step"] = []
        for shape in shapes:
            rec = step.bench_full_step(shape, cfg, on_call=ticker(task, f"full step {shape.name}"))
            record["full_step"].append(rec)
            progress.console.print(step.full_step_table(rec))
        progress.update(task, description="step: done", completed=n)
    if "train" in cfg.sections:
        models = train_step.models(cfg.quick)
        # non-private, Opacus, and Opacus accelerated on each native backend
        per_item(
            "train_step",
            "train",
            models,
            train_step.n_providers(cfg.device),
            train_step.bench_train_step,
            train_step.train_step_table,
        )
    if "layers" in cfg.sections:
        per_item("layers", "layers", layers.layer_shapes(cfg.quick), layers.providers_per_shape(cfg.device),
                 layers.bench_layer_shape, layers.layer_table)  # fmt: skip
        record["layers_targets"] = layers.target_rows(record["layers"], cfg.device)
        progress.console.print(layers.targets_table(record["layers_targets"]))


def run(cfg: BenchConfig, json_path: str | os.PathLike | None = None, console=None) -> dict:
    """Run the benchmark with a progress bar, print one table per shape, write the JSON."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if console is None:
        # Off a terminal rich assumes 80 columns, which would fold the tables.
        console = Console() if sys.stdout.isatty() else Console(width=200)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if "TORCH_LOGS" not in os.environ:
        # Dynamo warns about every graph break of the reference (by design: it syncs and uses
        # boolean masks) and Inductor's C++ builder notes the missing CUDA runtime; neither is
        # news here, and both would scroll the tables away.
        import logging

        torch._logging.set_logs(dynamo=logging.ERROR, inductor=logging.ERROR)
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    if os.environ.get("DPKERNELS_POISON_OUTPUTS") == "1":
        console.print("[yellow]DPKERNELS_POISON_OUTPUTS=1 adds an output write to every native call[/]")
    t_start = time.perf_counter()
    shapes = [get_shape(n, cfg.quick) for n in cfg.shapes]
    record = {
        "schema": 1,
        "command": sys.argv,
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
        "machine": machine_info(cfg.device),
        "method": clip.__doc__,
        "shapes": [],
    }
    if cfg.device == "cuda":
        gpu = record["machine"]["gpu"]
        console.print(f"CUDA tensors on {gpu['name']} (sm_{gpu['capability'].replace('.', '')}), "
                      f"backends {', '.join(timed_backends('cuda')) or 'none'}")  # fmt: skip
    per_shape = clip.expected_steps(cfg)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as progress:
        if "clip" in cfg.sections:
            task = progress.add_task("starting", total=per_shape * len(shapes))
            for shape in shapes:
                rec = clip.bench_shape(shape, cfg, progress, task)
                record["shapes"].append(rec)
                progress.console.print(clip.shape_table(rec))
            progress.update(task, description="clip: done", completed=progress.tasks[task].total)
        _run_other_sections(cfg, shapes, record, progress)
    if "clip" in cfg.sections:
        record["targets"] = clip.target_rows(record["shapes"], cfg.device)
        console.print(clip.targets_table(record["targets"], cfg.device))
    record["wall_s"] = time.perf_counter() - t_start
    record["max_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if json_path is not None:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1) + "\n")
        console.print(f"wrote {path} (wall {record['wall_s']:.0f} s, peak RSS {record['max_rss_gib']:.1f} GiB)")
    return record
