"""``dpkernels train``: private training of every algorithm on scikit-learn's digits, end to end.

What runs. scikit-learn's bundled ``digits`` (1797 images 8×8, 10 classes, no download), split once
(seed 0, stratified by shuffling within each class) into 60% train, 20% validation, 20% test;
pixels scaled to [0, 1]. A small model (``mlp``: 64-32-10 with tanh, or ``cnn``: conv 8×3×3, tanh,
avg-pool 2, linear 128-10). Each algorithm of :data:`dpkernels.integrations._make_private.ALGORITHMS`,
plus Auto-S (``dpsgd_autos``: DP-SGD with ``mode="auto_s", r=0.01``, the comparison DP-PSAC's paper
makes), runs
through :func:`~dpkernels.integrations._make_private.make_private` (Opacus's
GradSampleModule, Poisson sampling at ``q = B/N`` and RDP accountant), with the noise multiplier
from Opacus's ``get_noise_multiplier`` for the target ``(ε, δ)`` over the given epochs; the
non-private baseline is plain ``torch.optim.Adam`` with the same model, batches and epochs.

Tuning (the same for every algorithm). Each algorithm has one learning-rate grid of the same size,
the SGD-family grid for DP-SGD, DP-PSAC, DP² and DP-PMLF and the Adam-family grid for DP-Adam,
DP-AdamBC, STP, MacAdam and the baseline. For every ε the learning rate with the best validation
accuracy at seed 0 is kept, then the test accuracy is measured over ``seeds`` fresh seeds (model
init, Poisson sampling and noise all change with the seed). The validation runs spend privacy
budget that a deployed model would have to account for (the usual caveat of tuned DP results);
the reported ε is that of one final run. Fixed choices: clip ``C = 1``, batch 64, DP² with
``s1 = s2 =`` one epoch of steps and ``lr2 = lr``, DP-PMLF ``k = 2`` (the authors' defaults),
DP-PSAC ``r = 0.1``, STP ``ε₁ = 1e-3`` (:data:`STP_EPS1`), MacAdam at its defaults (h1 = 1e-9,
h2 = 1e-6, b0 = 1/d).

Reported per algorithm and ε: test accuracy mean ± std over the seeds, the ε the accountant
reports after training, the chosen lr, and the mean wall time of one training step (forward,
backward and optimizer step; on a shared 2-core CPU, indicative only). Written: a JSON file with
every run, and a plot of accuracy against ε (matplotlib, when it is installed). The results and
which of the papers' orderings hold at this scale: docs/RESULTS.md.

Papers (the algorithms' formulas and defaults: docs/ALGORITHMS.md):

- DP-PSAC: "Differentially Private Learning with Per-Sample Adaptive Clipping", arXiv:2212.00328;
- Auto-S: "Automatic Clipping: Differentially Private Deep Learning Made Easier and Stronger",
  arXiv:2206.07136;
- DP²: "Differentially Private Adaptive Optimization with Delayed Preconditioners", arXiv:2212.00309;
- DP-PMLF: "Enhancing DPSGD via Per-Sample Momentum and Low-Pass Filtering", arXiv:2511.08841;
- DP-AdamBC: "DP-AdamBC: Your DP-Adam Is Actually DP-SGD (Unless You Apply Bias Correction)",
  arXiv:2312.14334;
- STP (scale-then-privatize): "On Design Principles for Private Adaptive Optimizers", arXiv:2507.01129;
- DP-MacAdam: "DP-MacAdam: Differentially Private Mechanism with Adaptive Clipping and Adaptive
  Momentum", arXiv:2606.05435.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

BASELINE = "non-private"
# Variants run through another make_private algorithm: Auto-S ("Automatic Clipping: Differentially
# Private Deep Learning Made Easier and Stronger", arXiv:2206.07136; DP-SGD with the weight
# C/(‖g‖+r), r = 0.01), the comparison that DP-PSAC's paper (arXiv:2212.00328) makes.
VARIANTS = {"dpsgd_autos": ("dpsgd", {"mode": "auto_s", "r": 0.01})}
SGD_FAMILY = ("dpsgd", "psac", "dp2", "pmlf", "dpsgd_autos")
# Learning-rate grids: the same number of points for every algorithm (see the module docstring).
LR_GRID = {"sgd": (0.1, 0.3, 1.0, 3.0), "adam": (0.001, 0.003, 0.01, 0.03)}
LR_GRID_QUICK = {"sgd": (0.5, 2.0), "adam": (0.002, 0.008)}
# STP's scaling floor ε₁ ("On Design Principles for Private Adaptive Optimizers", arXiv:2507.01129, tunes
# it with the lr; here it is fixed, so that STP is not tuned more than the others). The default 1e-8
# makes step 1 clip at C·1e-8 and the run never leaves that scale.
STP_EPS1 = 1e-3


@dataclass
class TrainConfig:
    algorithms: list[str]
    epsilons: list[float] = field(default_factory=lambda: [1.0, 3.0, 8.0])
    delta: float = 1e-5
    seeds: int = 3
    epochs: int = 15
    batch_size: int = 64
    max_grad_norm: float = 1.0
    model: str = "mlp"
    backend: str = "cpu"
    quick: bool = False
    threads: int = 1


@dataclass
class Split:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def load_digits_split(seed: int = 0) -> Split:
    """The digits data, split 60/20/20 within each class (so every split has every class)."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    parts: list[list[torch.Tensor]] = [[], [], []]
    for c in range(10):
        idx = (y == c).nonzero().squeeze(1)
        idx = idx[torch.randperm(len(idx), generator=g)]
        a, b = int(0.6 * len(idx)), int(0.8 * len(idx))
        for part, sl in zip(parts, (idx[:a], idx[a:b], idx[b:]), strict=True):
            part.append(sl)
    tr, va, te = (torch.cat(p) for p in parts)
    return Split(x[tr], y[tr], x[va], y[va], x[te], y[te])


def make_model(kind: str) -> nn.Module:
    """``mlp``: 64-32-10 (2410 parameters); ``cnn``: conv 1→8 3×3 on the 8×8 image, avg-pool, 128-10."""
    if kind == "mlp":
        return nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))
    if kind == "cnn":
        return nn.Sequential(
            nn.Unflatten(1, (1, 8, 8)),
            nn.Conv2d(1, 8, 3, padding=1),
            nn.Tanh(),
            nn.AvgPool2d(2),
            nn.Flatten(),
            nn.Linear(128, 10),
        )
    raise ValueError(f"unknown model {kind!r}; expected 'mlp' or 'cnn'")


def _algo_kwargs(algorithm: str, steps_per_epoch: int) -> dict:
    if algorithm in VARIANTS:
        return dict(VARIANTS[algorithm][1])
    if algorithm == "dp2":
        return {"s1": steps_per_epoch, "s2": steps_per_epoch}
    if algorithm == "pmlf":
        return {"k": 2}
    if algorithm == "psac":
        return {"r": 0.1}
    if algorithm == "stp":
        return {"eps1": STP_EPS1}
    return {}


def lr_grid(algorithm: str, quick: bool) -> tuple[float, ...]:
    grids = LR_GRID_QUICK if quick else LR_GRID
    return grids["sgd" if algorithm in SGD_FAMILY else "adam"]


def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item()


@dataclass
class RunResult:
    algorithm: str
    target_epsilon: float
    lr: float
    seed: int
    noise_multiplier: float
    epsilon: float
    val_accuracy: float
    test_accuracy: float
    first_loss: float
    last_loss: float
    steps: int
    step_ms: float


@functools.cache
def noise_multiplier(target_epsilon: float, delta: float, sample_rate: float, epochs: int) -> float:
    """Opacus's ``get_noise_multiplier`` (RDP accountant), cached: every run of a configuration shares it."""
    from opacus.accountants.utils import get_noise_multiplier

    return get_noise_multiplier(
        target_epsilon=target_epsilon, target_delta=delta, sample_rate=sample_rate, epochs=epochs, accountant="rdp"
    )


def train_one(algorithm: str, target_epsilon: float, lr: float, seed: int, split: Split, cfg: TrainConfig) -> RunResult:
    """One training run; ``algorithm == BASELINE`` trains without privacy (``ε = inf``)."""
    from ..integrations._make_private import PrivacyEngine

    torch.manual_seed(seed)
    model = make_model(cfg.model)
    ds = TensorDataset(split.x_train, split.y_train)
    loader = DataLoader(ds, batch_size=cfg.batch_size, shuffle=True)
    steps_per_epoch = len(loader)
    family_adam = algorithm not in SGD_FAMILY
    opt = (torch.optim.Adam if family_adam else torch.optim.SGD)(model.parameters(), lr=lr)
    sigma, epsilon, pe = 0.0, math.inf, None
    if algorithm != BASELINE:
        pe = PrivacyEngine(accountant="rdp")
        sigma = noise_multiplier(target_epsilon, cfg.delta, 1 / steps_per_epoch, cfg.epochs)
        model, opt, loader = pe.make_private(
            module=model,
            optimizer=opt,
            data_loader=loader,
            noise_multiplier=sigma,
            max_grad_norm=cfg.max_grad_norm,
            algorithm=VARIANTS[algorithm][0] if algorithm in VARIANTS else algorithm,
            backend=cfg.backend,
            seed=10_000 + seed,
            **_algo_kwargs(algorithm, steps_per_epoch),
        )
    losses, step_s = [], 0.0
    for _ in range(cfg.epochs):
        for x, y in loader:
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            if algorithm == "pmlf":
                opt.step(batch=(x, y))
            else:
                opt.step()
            step_s += time.perf_counter() - t0
            losses.append(loss.item())
    if pe is not None:
        epsilon = pe.get_epsilon(cfg.delta)
    first = statistics.fmean(losses[: max(1, steps_per_epoch)])
    last = statistics.fmean(losses[-max(1, steps_per_epoch) :])
    return RunResult(
        algorithm=algorithm,
        target_epsilon=target_epsilon,
        lr=lr,
        seed=seed,
        noise_multiplier=sigma,
        epsilon=epsilon,
        val_accuracy=_accuracy(model, split.x_val, split.y_val),
        test_accuracy=_accuracy(model, split.x_test, split.y_test),
        first_loss=first,
        last_loss=last,
        steps=len(losses),
        step_ms=1e3 * step_s / max(1, len(losses)),
    )


def _summary(runs: list[RunResult]) -> dict:
    accs = [r.test_accuracy for r in runs]
    return {
        "lr": runs[0].lr,
        "test_accuracy_mean": statistics.fmean(accs),
        "test_accuracy_std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
        "epsilon": max(r.epsilon for r in runs),
        "noise_multiplier": runs[0].noise_multiplier,
        "step_ms": statistics.fmean(r.step_ms for r in runs),
    }


def run(cfg: TrainConfig, *, json_path: str | None, plot_path: str | None) -> dict:
    """Tune, train, print the table; write the JSON and the plot. Returns the JSON document."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    torch.set_num_threads(cfg.threads)
    # Opacus's per-run notices (non-secure RNG, alpha range, the full-backward-hook firing on the
    # first layer, whose input needs no gradient) would scroll the progress bar away.
    for message in ("Secure RNG turned off", "Optimal order is the largest alpha", "Full backward hook is firing"):
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    console = Console() if sys.stdout.isatty() else Console(width=160)
    split = load_digits_split()
    targets = {a: ([math.inf] if a == BASELINE else cfg.epsilons) for a in [BASELINE, *cfg.algorithms]}
    total = sum(len(eps) * (len(lr_grid(a, cfg.quick)) + cfg.seeds) for a, eps in targets.items())
    runs: list[RunResult] = []
    summary: dict[str, dict[str, dict]] = {}
    started = time.perf_counter()
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    ) as progress:
        task = progress.add_task("training", total=total)
        for algorithm, eps_list in targets.items():
            summary[algorithm] = {}
            for eps in eps_list:
                progress.update(task, description=f"{algorithm:>11} ε={eps:g}: tuning lr")
                tuning = []
                for lr in lr_grid(algorithm, cfg.quick):
                    tuning.append(train_one(algorithm, eps, lr, 0, split, cfg))
                    progress.advance(task)
                best = max(tuning, key=lambda r: (r.val_accuracy, -r.last_loss))
                progress.update(task, description=f"{algorithm:>11} ε={eps:g}: seeds (lr={best.lr:g})")
                finals = []
                for seed in range(1, cfg.seeds + 1):
                    finals.append(train_one(algorithm, eps, best.lr, seed, split, cfg))
                    progress.advance(task)
                runs.extend(tuning + finals)
                summary[algorithm][f"{eps:g}"] = _summary(finals)
    elapsed = time.perf_counter() - started
    console.print(_table(summary, cfg))
    console.print(f"{len(runs)} runs in {elapsed:.0f} s")
    doc = {
        "config": dataclasses.asdict(cfg),
        "dataset": {
            "name": "sklearn digits",
            "train": len(split.y_train),
            "val": len(split.y_val),
            "test": len(split.y_test),
        },  # fmt: skip
        "lr_grids": {a: list(lr_grid(a, cfg.quick)) for a in targets},
        "summary": summary,
        "runs": [dataclasses.asdict(r) for r in runs],
        "elapsed_s": elapsed,
    }
    if json_path:
        os.makedirs(os.path.dirname(json_path) or ".", exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        console.print(f"results: {json_path}")
    if plot_path:
        written = write_plot(summary, cfg, plot_path)
        console.print(f"plot: {plot_path}" if written else "plot skipped: matplotlib is not installed")
    return doc


def _table(summary: dict, cfg: TrainConfig):
    from rich.table import Table

    table = Table(
        title=f"digits, {cfg.model}, δ={cfg.delta:g}, {cfg.epochs} epochs, test accuracy (%) over {cfg.seeds} seeds"
    )
    table.add_column("algorithm")
    for eps in cfg.epsilons:
        table.add_column(f"ε={eps:g}: acc", justify="right")
        table.add_column("ε spent", justify="right")
        table.add_column("lr", justify="right")
    table.add_column("step ms", justify="right")
    for algorithm, by_eps in summary.items():
        cells, step_ms = [], []
        for eps in cfg.epsilons:
            s = by_eps.get(f"{eps:g}", by_eps.get("inf"))
            cells += [f"{100 * s['test_accuracy_mean']:.1f} ± {100 * s['test_accuracy_std']:.1f}",
                      f"{s['epsilon']:.2f}", f"{s['lr']:g}"]  # fmt: skip
            step_ms.append(s["step_ms"])
        table.add_row(algorithm, *cells, f"{statistics.fmean(step_ms):.2f}")
    return table


def write_plot(summary: dict, cfg: TrainConfig, path: str) -> bool:
    """Accuracy against ε, one line per algorithm (the baseline as a horizontal line)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for algorithm, by_eps in summary.items():
        if algorithm == BASELINE:
            acc = 100 * by_eps["inf"]["test_accuracy_mean"]
            ax.axhline(acc, color="black", linestyle="--", label=f"{BASELINE} ({acc:.1f}%)")
            continue
        eps = cfg.epsilons
        mean = [100 * by_eps[f"{e:g}"]["test_accuracy_mean"] for e in eps]
        std = [100 * by_eps[f"{e:g}"]["test_accuracy_std"] for e in eps]
        ax.errorbar(eps, mean, yerr=std, marker="o", capsize=3, label=algorithm)
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set_xticks(cfg.epsilons, [f"{e:g}" for e in cfg.epsilons])
    ax.set_xlabel(f"ε (δ = {cfg.delta:g})")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"digits, {cfg.model}, {cfg.epochs} epochs, mean ± std over {cfg.seeds} seeds")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
