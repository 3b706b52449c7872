"""The ``dpkernels`` command line (``dpkernels ...`` or ``python -m dpkernels ...``).

Subcommands:

- ``bench``: time ``clip_and_accumulate``, the Gaussian generator and ``privatize`` on
  model-shaped gradient lists against the eager and compiled reference, Opacus, ``torch.normal``
  and same-run memory bandwidth, and the optimizer and training steps (see :mod:`dpkernels.bench`).
- ``train``: private training of every algorithm on scikit-learn's digits at several ε, through
  Opacus and ``make_private(algorithm=...)``; a table, a JSON file and a plot (see
  :mod:`dpkernels.bench.train`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

# --quick: the two big shapes at B=16, fewer rounds, a tighter per-provider time budget, so the
# whole run (torch.compile included) stays under 2 minutes on a 2-core machine.
QUICK = {"repeats": 5, "budget_s": 4.0}
FULL = {"repeats": 9, "budget_s": 20.0}
# Sections --quick leaves out unless named in --sections: the BK layer microbenchmark (~1 min on 2 cores).
QUICK_OMITS = ("layers",)


def _name_list(what: str, choices):
    """An argparse type: a comma-separated, non-empty subset of ``choices``."""

    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {what}(s) {unknown}; choose from {', '.join(choices)}")
        return names

    return parse


def _subset_option(parser: argparse.ArgumentParser, flag: str, what: str, choices: Sequence[str]) -> None:
    """``flag NAMES``: a comma-separated subset of ``choices``, all of them by default."""
    parser.add_argument(
        flag,
        type=_name_list(what, choices),
        default=list(choices),
        metavar="NAMES",
        help=f"comma-separated subset of: {', '.join(choices)} (default: all)",
    )


def _int_at_least(low: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text}")
        return value

    return parse


_positive_int = _int_at_least(1)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dpkernels", description="Fused kernels for DP training.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    from .bench._timing import DEVICES, SECTIONS
    from .bench.shapes import SHAPES

    bench = sub.add_parser(
        "bench",
        help="benchmark clip_and_accumulate against the reference, torch.compile and Opacus",
        description=(
            "Time dpkernels.clip_and_accumulate per backend on model-shaped per-sample gradient "
            "lists (fp32, on CPU or CUDA tensors), side by side with the eager reference, torch.compile "
            "of it, Opacus's DPOptimizer.clip_and_accumulate and same-run copy/read bandwidth. Prints "
            "one table per shape and writes every raw number to a JSON file."
        ),
    )
    bench.add_argument("--quick", action="store_true", help="smaller B for the big shapes, fewer repeats (< 2 min)")
    bench.add_argument(
        "--json",
        default="bench-results/bench.json",
        metavar="PATH",
        help="where to write the results (%(default)s)",
    )
    _subset_option(bench, "--shapes", "shape", list(SHAPES))
    bench.add_argument(
        "--repeats",
        type=_positive_int,
        default=None,
        metavar="N",
        help=f"timed rounds per provider (default {FULL['repeats']}, --quick {QUICK['repeats']})",
    )
    bench.add_argument(
        "--sections",
        type=_name_list("section", SECTIONS),
        default=None,
        metavar="NAMES",
        help=f"comma-separated subset of: {', '.join(SECTIONS)} (default: all; with --quick all but "
        f"{', '.join(QUICK_OMITS)})",
    )
    bench.add_argument(
        "--device",
        choices=DEVICES,
        default="cpu",
        help="where the inputs live and what is timed: CPU tensors (cpu backend), or CUDA tensors (cuda and "
        "triton backends, synchronized timing) (default %(default)s)",
    )
    bench.add_argument("--warmup", type=_positive_int, default=2, metavar="N", help="untimed calls first (%(default)s)")
    bench.add_argument(
        "--threads",
        type=_positive_int,
        default=torch.get_num_threads(),
        metavar="N",
        help="torch intra-op threads (default: torch.get_num_threads() = %(default)s)",
    )
    bench.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="time torch.compile of the reference (default: on, off with --quick: compiling it cold "
        "takes 1-3 min per shape on 2 cores)",
    )
    bench.add_argument(
        "--cpu-paths",
        action="store_true",
        help="run the sections once per CPU kernel path this machine runs (avx512, avx2, default; each "
        "forced with DPKERNELS_CPU_CAPABILITY in its own process) and compare them in one table and JSON",
    )
    bench.set_defaults(func=_bench)
    _add_train(sub)
    return parser


# --quick: fewer epochs, seeds and configurations, so that all 10 x 3 studies finish in < 3 min.
# --quick: no extension, so its chosen points may sit on an edge.
TRAIN_QUICK = {"epochs": 8, "seeds": 2, "budget": 3, "extension": 0, "tuning_seeds": 1}
TRAIN_FULL = {"epochs": 15, "seeds": 5, "budget": 9, "extension": 9, "tuning_seeds": 2}


def _positive_float_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive numbers, got {text!r}")
    return values


def _add_train(sub) -> None:
    from .bench.train import DATASETS, VARIANTS
    from .integrations._make_private import ALGORITHMS

    train = sub.add_parser(
        "train",
        help="train every DP algorithm on a small dataset at several epsilons, equally tuned",
        description=(
            "Private training (no download: scikit-learn's digits, or MNIST-1D generated offline) with a "
            "small model, every algorithm through dpkernels.integrations._make_private.make_private "
            "(Poisson sampling, RDP accountant; book-keeping clipping by default), the noise multiplier "
            "calibrated by Opacus's get_noise_multiplier. Every algorithm's own hyper-parameters are tuned "
            "by the same coordinate search with the same budget of configurations, on a validation split "
            "over the tuning seeds; test accuracy is then measured on shared seeds, and the papers' "
            "orderings are checked on paired differences. Prints tables, writes a JSON file and a plot."
        ),
    )
    train.add_argument("--quick", action="store_true", help="fewer epochs, seeds and configurations (< 3 min)")
    _subset_option(train, "--algorithms", "algorithm", (*ALGORITHMS, *VARIANTS))
    train.add_argument("--dataset", choices=sorted(DATASETS), default="digits", help="(default %(default)s)")
    train.add_argument(
        "--epsilons", type=_positive_float_list, default=[1.0, 3.0, 8.0], metavar="LIST", help="(default 1,3,8)"
    )
    train.add_argument("--delta", type=float, default=1e-5, help="(default %(default)g)")
    for name, what in (("epochs", "epochs"), ("seeds", "test seeds per configuration"),
                       ("budget", "configurations tried per (algorithm, epsilon)"),
                       ("extension", "extra configurations, only to move a chosen point off an edge"),
                       ("tuning-seeds", "seeds per configuration tried")):  # fmt: skip
        key = name.replace("-", "_")
        train.add_argument(f"--{name}", type=_int_at_least(int(key != "extension")), default=None,
                           help=f"{what} (default {TRAIN_FULL[key]}, --quick {TRAIN_QUICK[key]})")  # fmt: skip
    train.add_argument("--batch-size", type=_positive_int, default=64, help="expected Poisson batch (%(default)s)")
    train.add_argument("--model", choices=("mlp", "cnn"), default="mlp", help="(default %(default)s)")
    train.add_argument("--backend", default="cpu", help="dpkernels backend of the optimizers (%(default)s)")
    train.add_argument("--grad-sample-mode", choices=("bk", "hooks"), default="bk",
                       help="per-sample clipping: book-keeping or Opacus's hooks (%(default)s)")  # fmt: skip
    train.add_argument("--threads", type=_positive_int, default=1, help="torch intra-op threads (%(default)s)")
    train.add_argument("--jobs", type=_positive_int, default=1, help="worker processes (%(default)s)")
    train.add_argument("--json", default="train-results/train.json", metavar="PATH", help="(default %(default)s)")
    train.add_argument("--plot", default="train-results/accuracy_vs_epsilon.png", metavar="PATH",
                       help="(default %(default)s)")  # fmt: skip
    train.set_defaults(func=_train)


def _train(args: argparse.Namespace) -> int:
    from .bench.train import TrainConfig, run

    preset = TRAIN_QUICK if args.quick else TRAIN_FULL
    cfg = TrainConfig(
        algorithms=args.algorithms,
        epsilons=args.epsilons,
        delta=args.delta,
        seeds=args.seeds or preset["seeds"],
        epochs=args.epochs or preset["epochs"],
        budget=args.budget or preset["budget"],
        extension=preset["extension"] if args.extension is None else args.extension,
        tuning_seeds=args.tuning_seeds or preset["tuning_seeds"],
        batch_size=args.batch_size,
        model=args.model,
        dataset=args.dataset,
        backend=args.backend,
        grad_sample_mode=args.grad_sample_mode,
        quick=args.quick,
        threads=args.threads,
        jobs=args.jobs,
    )
    run(cfg, json_path=args.json, plot_path=args.plot)
    return 0


def _compile_skip(args: argparse.Namespace) -> str | None:
    if args.compile is None and args.quick:
        return "--quick leaves it out (cold compilation takes minutes); add --compile"
    return None if args.compile in (None, True) else "--no-compile"


def _bench(args: argparse.Namespace) -> int:
    from .bench._timing import SECTIONS, BenchConfig
    from .bench.runner import run

    if args.device == "cuda" and not torch.cuda.is_available():
        cuda = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        print(
            f"dpkernels bench: error: --device cuda, but torch.cuda.is_available() is False (torch "
            f"{torch.__version__}, {cuda}): no usable CUDA GPU or driver here; run on a GPU machine "
            "or use --device cpu",
            file=sys.stderr,
        )
        return 2
    if args.cpu_paths and args.device != "cpu":
        print(
            "dpkernels bench: error: --cpu-paths compares the CPU kernel paths; it needs --device cpu", file=sys.stderr
        )
        return 2
    preset = QUICK if args.quick else FULL
    cfg = BenchConfig(
        shapes=args.shapes,
        quick=args.quick,
        repeats=args.repeats or preset["repeats"],
        warmup=args.warmup,
        threads=args.threads,
        budget_s=preset["budget_s"],
        compile_skip=_compile_skip(args),
        sections=args.sections or [s for s in SECTIONS if not (args.quick and s in QUICK_OMITS)],
        device=args.device,
    )
    if args.cpu_paths:
        from .bench import cpu_paths

        cpu_paths.run(_bench_argv(args, cfg), json_path=args.json)
    else:
        run(cfg, json_path=args.json)
    return 0


def _bench_argv(args: argparse.Namespace, cfg) -> list[str]:
    """The ``dpkernels bench`` arguments of ``cfg`` for one CPU path's process (no --json, no --cpu-paths)."""
    argv = ["bench", "--sections", ",".join(cfg.sections), "--shapes", ",".join(cfg.shapes)]
    argv += ["--repeats", str(cfg.repeats), "--warmup", str(cfg.warmup), "--threads", str(cfg.threads)]
    if cfg.quick:
        argv.append("--quick")
    if args.compile is not None:
        argv.append("--compile" if args.compile else "--no-compile")
    return argv


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
