"""``dpkernels train``: private training of every algorithm, end to end, equally tuned.

What runs. A dataset that ships with the packages: scikit-learn's ``digits`` (1797 images 8×8,
split 60/20/20 within each class) or MNIST-1D (Greydanus 2020, generated offline with the
``mnist1d`` package's ``make_dataset``: 50,000 length-40 signals, split 80/10/10 within each class,
40,000 train). A small model (``mlp``: inputs-32-10 with tanh; ``cnn`` on digits: conv 8×3×3, tanh,
avg-pool 2, linear 128-10). Each algorithm of :data:`dpkernels.integrations._make_private.ALGORITHMS`,
plus Auto-S (``dpsgd_autos``: DP-SGD with ``mode="auto_s"``, the comparison DP-PSAC's paper makes),
runs through :func:`~dpkernels.integrations._make_private.make_private` (Poisson sampling at
``q = B/N``, RDP accountant, book-keeping clipping unless ``grad_sample_mode="hooks"``), with the
noise multiplier from Opacus's ``get_noise_multiplier`` for the target ``(ε, δ)`` over the given
epochs; the non-private baseline is plain ``torch.optim.Adam`` with the same model, batches and
epochs.

Tuning (the same procedure and budget for every algorithm). :data:`SEARCH` lists each algorithm's
own hyper-parameters as geometric (or integer) grids around a centre: the learning rate always, and
the clip C (DP-SGD, DP-Adam, STP), STP's ε₁, MacAdam's h₁ and h₂ (factors on its defaults for the
model's d), DP-AdamBC's relative γ' (``ρ`` of ``γ' = ρ·Φ̄``), DP²'s lr₂ and C₂, PMLF's β and k, and
the r of DP-PSAC and Auto-S. :func:`search` (coordinate search from the centre, each axis swept and
extended outward while that improves) tries ``budget`` configurations per (algorithm, ε), the same
for every algorithm; if its choice then still has an untried neighbour, up to ``extension`` more are
tried, only around the chosen point, until it is interior (their number is reported). A
configuration's score is its mean validation accuracy over the tuning seeds (:data:`TUNING_SEEDS`),
ties broken by the mean validation loss; no training-set statistic enters the choice. The chosen
configuration is then trained on ``seeds`` test seeds shared by every algorithm (model init, Poisson
batches and noise all change with the seed), so comparisons are paired. The tuning runs spend
privacy budget that a deployed model would have to account for (the usual caveat of tuned DP
results); the reported ε is that of one final run.

Reported per algorithm and ε: test accuracy mean ± 95% Student-t interval over the test seeds, the
chosen configuration (with the configurations used beyond the budget, and flagged if it still sits
on an edge of what was tried when the extension ran out), the ε the accountant reports, and the mean
wall time of one training step (indicative only on a shared CPU). For each of the papers' orderings
(:data:`CLAIMS`): the paired difference with its 95% interval and a label, ``holds``, ``reversed``
or ``inconclusive`` (:func:`verdict`). Written: a JSON file with every run, and a plot of accuracy
against ε. The results: docs/RESULTS.md.

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

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

BASELINE = "non-private"
# Variants run through another make_private algorithm: Auto-S ("Automatic Clipping: Differentially
# Private Deep Learning Made Easier and Stronger", arXiv:2206.07136; DP-SGD with the weight
# C/(‖g‖+r)), the comparison that DP-PSAC's paper (arXiv:2212.00328) makes.
VARIANTS = {"dpsgd_autos": ("dpsgd", {"mode": "auto_s"})}
SGD_FAMILY = ("dpsgd", "psac", "dp2", "pmlf", "dpsgd_autos")


@dataclass(frozen=True)
class Axis:
    """One tuned hyper-parameter: the grid ``centre·factor^i`` (``integer``: ``centre + i``), clamped
    to ``[low, high]``; the search starts at ``i = 0``."""

    name: str
    centre: float
    factor: float = 3.0
    low: float = 0.0
    high: float = math.inf
    integer: bool = False

    def value(self, i: int) -> float:
        return self.centre + i if self.integer else self.centre * self.factor**i

    def valid(self, i: int) -> bool:
        return self.low <= self.value(i) <= self.high


_LR_SGD, _LR_ADAM, _CLIP = Axis("lr", 1.0), Axis("lr", 0.003), Axis("max_grad_norm", 1.0)
#: Each algorithm's own hyper-parameters, tuned by the same procedure (:func:`search`) with the same
#: budget of configurations. MacAdam's h1/h2 are factors on its defaults for the model's d
#: (:func:`_resolve`), DP-AdamBC's γ' is relative to its noise variance (``γ' = ρ·Φ̄``), DP²'s lr2 is
#: a factor on lr.
SEARCH: dict[str, tuple[Axis, ...]] = {
    BASELINE: (_LR_ADAM,),
    "dpsgd": (_LR_SGD, _CLIP),
    "dpsgd_autos": (_LR_SGD, Axis("r", 0.01, 10.0)),
    "psac": (_LR_SGD, Axis("r", 0.1, 10.0)),
    "dp2": (_LR_SGD, Axis("lr2_factor", 1.0), Axis("max_grad_norm2", 1.0)),
    "pmlf": (_LR_SGD, Axis("beta", 0.1, 3.0, high=0.9), Axis("k", 2, integer=True, low=1)),
    "dpadam": (_LR_ADAM, _CLIP),
    "dpadam_bc": (_LR_ADAM, Axis("gamma_prime_rel", 0.1, 10.0)),
    "stp": (_LR_ADAM, _CLIP, Axis("eps1", 1e-3, 10.0)),
    "macadam": (_LR_ADAM, Axis("h1_factor", 1.0, 10.0), Axis("h2_factor", 1.0, 10.0)),
}
#: Joint constraints of a configuration: MacAdam's clamp needs h1 <= h2 (strictly below here, so a
#: rounding at equality cannot reach the optimizer's own check).
CONSTRAINTS = {"macadam": lambda hp: hp["h1_factor"] * _H1_OVER_H2 < hp["h2_factor"]}
_H1_OVER_H2 = 1e-3  # macadam_h_defaults(d): (7.9501e-4/d, 0.79501/d), for every d
#: The seeds that select a configuration (validation accuracy, mean over them) and, disjoint from
#: them and shared by every algorithm (paired comparisons), those that measure it.
TUNING_SEEDS = (0, 1)
TEST_SEED_BASE = 100


@dataclass
class TrainConfig:
    algorithms: list[str]
    epsilons: list[float] = field(default_factory=lambda: [1.0, 3.0, 8.0])
    delta: float = 1e-5
    seeds: int = 5
    epochs: int = 15
    batch_size: int = 64
    model: str = "mlp"
    dataset: str = "digits"
    backend: str = "cpu"
    grad_sample_mode: str = "bk"
    budget: int = 9
    extension: int = 9
    tuning_seeds: int = len(TUNING_SEEDS)
    quick: bool = False
    threads: int = 1
    jobs: int = 1


@dataclass
class Split:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def _stratified(x: torch.Tensor, y: torch.Tensor, fractions: tuple[float, float], seed: int) -> Split:
    """Split within each class at the cumulative ``fractions`` (so every split has every class)."""
    g = torch.Generator().manual_seed(seed)
    parts: list[list[torch.Tensor]] = [[], [], []]
    for c in y.unique().tolist():
        idx = (y == c).nonzero().squeeze(1)
        idx = idx[torch.randperm(len(idx), generator=g)]
        a, b = int(fractions[0] * len(idx)), int(fractions[1] * len(idx))
        for part, sl in zip(parts, (idx[:a], idx[a:b], idx[b:]), strict=True):
            part.append(sl)
    tr, va, te = (torch.cat(p) for p in parts)
    return Split(x[tr], y[tr], x[va], y[va], x[te], y[te])


def load_digits_split(seed: int = 0) -> Split:
    """scikit-learn's bundled digits (1797 8×8 images), pixels in [0, 1], split 60/20/20 per class."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    return _stratified(x, torch.tensor(data.target, dtype=torch.long), (0.6, 0.8), seed)


MNIST1D_SAMPLES = 50_000


@functools.cache
def load_mnist1d_split(num_samples: int = MNIST1D_SAMPLES, seed: int = 0) -> Split:
    """MNIST-1D (Greydanus 2020, the ``mnist1d`` package), generated here with its
    ``make_dataset`` and default arguments (length-40 signals, 10 classes, its seed 42) at
    ``num_samples`` samples (no download: the package's loader would fetch a file); split 80/10/10 per
    class, 40,000 train at the default size. Generation takes about 10 s for 50,000 samples."""
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples = num_samples
    data = make_dataset(args)
    x = torch.tensor(np.concatenate([data["x"], data["x_test"]]), dtype=torch.float32)
    y = torch.tensor(np.concatenate([data["y"], data["y_test"]]), dtype=torch.long)
    return _stratified(x, y, (0.8, 0.9), seed)


DATASETS = {"digits": load_digits_split, "mnist1d": load_mnist1d_split}


def load_split(name: str) -> Split:
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; expected one of {sorted(DATASETS)}")
    return DATASETS[name]()


def make_model(kind: str, n_in: int = 64) -> nn.Module:
    """``mlp``: n_in-32-10 with tanh (2410 parameters on digits, 1642 on MNIST-1D); ``cnn``: a 3×3
    conv with 8 channels on the 8×8 digit, tanh, 2×2 average pooling, 128-10 (1370 parameters)."""
    if kind == "mlp":
        return nn.Sequential(nn.Linear(n_in, 32), nn.Tanh(), nn.Linear(32, 10))
    if kind == "cnn":
        if n_in != 64:
            raise ValueError(f"the cnn model takes 8x8 images (64 inputs), got {n_in} inputs")
        return nn.Sequential(
            nn.Unflatten(1, (1, 8, 8)),
            nn.Conv2d(1, 8, 3, padding=1),
            nn.Tanh(),
            nn.AvgPool2d(2),
            nn.Flatten(),
            nn.Linear(128, 10),
        )
    raise ValueError(f"unknown model {kind!r}; expected 'mlp' or 'cnn'")


def _resolve(algorithm: str, hp: dict, model: nn.Module, steps_per_epoch: int) -> tuple[float, dict]:
    """``(lr, make_private keyword arguments)`` of a configuration ``hp`` (names of :data:`SEARCH`)."""
    hp = dict(hp)
    lr = hp.pop("lr")
    kw = dict(VARIANTS[algorithm][1]) if algorithm in VARIANTS else {}
    if algorithm == "dp2":
        kw.update(s1=steps_per_epoch, s2=steps_per_epoch, lr2=lr * hp.pop("lr2_factor"))
    if algorithm == "macadam":  # factors on its defaults for this model's d
        from ..optim.macadam import macadam_h_defaults

        h1, h2 = macadam_h_defaults(sum(p.numel() for p in model.parameters()))
        kw.update(h1=h1 * hp.pop("h1_factor"), h2=h2 * hp.pop("h2_factor"))
    if "k" in hp:
        hp["k"] = int(hp["k"])
    return lr, {**kw, **hp}


def _accuracy_and_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    with torch.no_grad():
        out = model(x)
        return (out.argmax(dim=1) == y).float().mean().item(), nn.functional.cross_entropy(out, y).item()


@dataclass
class RunResult:
    algorithm: str
    target_epsilon: float
    hp: dict
    seed: int
    noise_multiplier: float
    epsilon: float
    val_accuracy: float
    val_loss: float
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


def train_one(algorithm: str, target_epsilon: float, hp: dict, seed: int, split: Split, cfg: TrainConfig) -> RunResult:
    """One training run of configuration ``hp`` (:data:`SEARCH` names); ``algorithm == BASELINE`` trains
    without privacy (``ε = inf``). ``seed`` sets the initialisation, the Poisson batches and the noise."""
    from ..integrations._make_private import PrivacyEngine

    torch.manual_seed(seed)
    model = make_model(cfg.model, split.x_train.shape[1])
    loader = DataLoader(TensorDataset(split.x_train, split.y_train), batch_size=cfg.batch_size, shuffle=True)
    steps_per_epoch = len(loader)
    lr, kw = _resolve(algorithm, hp, model, steps_per_epoch)
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
            max_grad_norm=kw.pop("max_grad_norm", 1.0),
            algorithm=VARIANTS[algorithm][0] if algorithm in VARIANTS else algorithm,
            backend=cfg.backend,
            grad_sample_mode=cfg.grad_sample_mode,
            seed=10_000 + seed,
            **kw,
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
    net = model._module if hasattr(model, "_module") else model
    val_acc, val_loss = _accuracy_and_loss(net, split.x_val, split.y_val)
    n = max(1, steps_per_epoch)
    return RunResult(
        algorithm=algorithm,
        target_epsilon=target_epsilon,
        hp=dict(hp),
        seed=seed,
        noise_multiplier=sigma,
        epsilon=epsilon,
        val_accuracy=val_acc,
        val_loss=val_loss if math.isfinite(val_loss) else math.inf,
        test_accuracy=_accuracy_and_loss(net, split.x_test, split.y_test)[0],
        first_loss=statistics.fmean(losses[:n]) if losses else math.nan,
        last_loss=statistics.fmean(losses[-n:]) if losses else math.nan,
        steps=len(losses),
        step_ms=1e3 * step_s / max(1, len(losses)),
    )


def search(
    axes: tuple[Axis, ...], evaluate, budget: int, allowed=None, extension: int = 0
) -> tuple[tuple[int, ...], dict, bool]:
    """Coordinate search over the grid indices of ``axes``: ``budget`` configurations for every
    algorithm alike, then at most ``extension`` more, spent only on confirming that the chosen point
    is interior (``allowed(index)``: an extra joint constraint; a point outside it, or outside an
    axis's bounds, is never tried nor counted).

    Budget phase: start at the centre; sweep each axis in turn (its two neighbours), move to the
    best, and keep stepping outward along an axis while that improves. Cycles over the axes until a
    whole cycle improves nothing or the budget is spent. Extension phase (only if the budget ran out
    with the best point still on an edge of what was tried): evaluate the best point's untried
    neighbours, move if one is better, and repeat until every neighbour has been tried (the optimum
    is interior, or on an axis's bound) or the extension is spent. ``evaluate(index) -> score``
    (higher is better). Returns the best index, every evaluated ``{index: score}`` (its length past
    ``budget`` is the extension used), and whether the best still sits on an edge."""
    scores: dict[tuple[int, ...], tuple] = {}

    def moved(idx, k, d):  # idx one step d along axis k
        return idx[:k] + (idx[k] + d,) + idx[k + 1 :]

    def valid(idx):
        return all(a.valid(i) for a, i in zip(axes, idx, strict=True)) and (allowed is None or allowed(idx))

    def score(idx, limit=budget):
        if idx not in scores and len(scores) < limit and valid(idx):
            scores[idx] = evaluate(idx)
        return scores.get(idx)

    def untried(best):
        nbs = (moved(best, k, d) for k in range(len(axes)) for d in (1, -1))
        return [nb for nb in nbs if nb not in scores and valid(nb)]

    best = (0,) * len(axes)
    score(best)
    improved = True
    while improved and len(scores) < budget:
        improved = False
        for k in range(len(axes)):
            for step in (1, -1):
                while True:
                    cand = moved(best, k, step)
                    got = score(cand)
                    if got is None or got <= scores[best]:
                        break
                    best, improved = cand, True
    while (todo := untried(best)) and len(scores) < budget + extension:
        for nb in todo:
            score(nb, budget + extension)
        best = max([best, *(nb for nb in todo if nb in scores)], key=scores.__getitem__)  # a tie keeps best
    return best, scores, bool(untried(best))


def _hp(axes: tuple[Axis, ...], idx: tuple[int, ...]) -> dict:
    return {a.name: a.value(i) for a, i in zip(axes, idx, strict=True)}


def study_one(algorithm: str, eps: float, split: Split, cfg: TrainConfig) -> dict:
    """Tune ``algorithm`` at ``eps`` (:func:`search`, scored by the mean validation accuracy over the
    tuning seeds, ties broken by the mean validation loss), then train the chosen configuration on
    the shared test seeds. Returns the record of :func:`run`'s JSON."""
    axes = SEARCH[algorithm]
    tuning: list[RunResult] = []
    failed: list[dict] = []

    def evaluate(idx):
        try:
            runs = [train_one(algorithm, eps, _hp(axes, idx), s, split, cfg) for s in TUNING_SEEDS[: cfg.tuning_seeds]]
        except (ValueError, RuntimeError) as exc:  # e.g. a clipped sum beyond fp32 at an extreme setting
            failed.append({"hp": _hp(axes, idx), "error": str(exc)[:300]})
            return (-math.inf, -math.inf)
        tuning.extend(runs)
        return (statistics.fmean(r.val_accuracy for r in runs), -statistics.fmean(r.val_loss for r in runs))

    constraint = CONSTRAINTS.get(algorithm)
    allowed = constraint and (lambda idx: constraint(_hp(axes, idx)))
    best, scores, edge = search(axes, evaluate, cfg.budget, allowed, cfg.extension)
    hp = _hp(axes, best)
    finals = [train_one(algorithm, eps, hp, TEST_SEED_BASE + i, split, cfg) for i in range(cfg.seeds)]
    accs = [r.test_accuracy for r in finals]
    return {
        "algorithm": algorithm,
        "target_epsilon": eps,
        "hp": hp,
        "configurations_tried": len(scores),
        "beyond_budget": max(0, len(scores) - cfg.budget),
        "chosen_on_edge": edge,
        "failed_configurations": failed,
        "test_accuracy": accs,
        "test_accuracy_mean": statistics.fmean(accs),
        "test_accuracy_ci95": ci95(accs),
        "epsilon": max(r.epsilon for r in finals),
        "noise_multiplier": finals[0].noise_multiplier,
        "step_ms": statistics.fmean(r.step_ms for r in finals),
        "runs": [dataclasses.asdict(r) for r in tuning + finals],
    }


def ci95(values: list[float]) -> float:
    """Half-width of the 95% Student-t interval of the mean (0 for one value)."""
    if len(values) < 2:
        return 0.0
    from scipy.stats import t

    return float(t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values)))


#: The papers' orderings (``a`` better than ``b``; ``at_least``: a matches or beats b), checked on
#: paired test seeds; their sources and numbers are in docs/RESULTS.md.
CLAIMS = (
    ("macadam", "dpadam", False, "DP-MacAdam"),
    ("macadam", "dpsgd", False, "DP-MacAdam"),
    ("stp", "dpadam", False, "design principles (STP)"),
    ("stp", "dpadam_bc", False, "design principles (STP)"),
    ("psac", "dpsgd", True, "DP-PSAC"),
    ("psac", "dpsgd_autos", True, "DP-PSAC"),
    ("pmlf", "dpsgd", False, "DP-PMLF"),
    ("dp2", "dpsgd", False, "DP²"),
)


def verdict(a_accs: list[float], b_accs: list[float]) -> dict:
    """The paired difference ``a − b`` over shared seeds, its 95% interval, and the label: ``holds``
    (the interval is above 0), ``reversed`` (below 0) or ``inconclusive`` (it contains 0: the
    difference is below what these seeds resolve)."""
    diffs = [x - y for x, y in zip(a_accs, b_accs, strict=True)]
    mean, half = statistics.fmean(diffs), ci95(diffs)
    label = "holds" if mean - half > 0 else "reversed" if mean + half < 0 else "inconclusive"
    return {"diff_mean": mean, "diff_ci95": half, "label": label}


def _study_task(args):
    algorithm, eps, cfg = args
    torch.set_num_threads(cfg.threads)
    _quiet_opacus()
    return study_one(algorithm, eps, load_split(cfg.dataset), cfg)


def _quiet_opacus() -> None:
    # Opacus's per-run notices (non-secure RNG, alpha range, the full-backward-hook firing on the
    # first layer, whose input needs no gradient) would scroll the progress bar away.
    for message in ("Secure RNG turned off", "Optimal order is the largest alpha", "Full backward hook is firing"):
        warnings.filterwarnings("ignore", message=message, category=UserWarning)


def run(cfg: TrainConfig, *, json_path: str | None, plot_path: str | None) -> dict:
    """Tune and train every (algorithm, ε), print the tables, write the JSON and the plot. The
    (algorithm, ε) studies are independent and run in ``cfg.jobs`` processes. Returns the JSON."""
    from concurrent.futures import ProcessPoolExecutor

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    torch.set_num_threads(cfg.threads)
    _quiet_opacus()
    console = Console() if sys.stdout.isatty() else Console(width=160)
    split = load_split(cfg.dataset)
    tasks = [(a, e, cfg) for a in [BASELINE, *cfg.algorithms] for e in ([math.inf] if a == BASELINE else cfg.epsilons)]
    started = time.perf_counter()
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    ) as progress:
        bar = progress.add_task(f"{cfg.dataset}: (algorithm, ε) studies", total=len(tasks))
        if cfg.jobs > 1:
            with ProcessPoolExecutor(cfg.jobs) as pool:
                records = []
                for rec in pool.map(_study_task, tasks):
                    records.append(rec)
                    progress.advance(bar)
        else:
            records = []
            for a, e, _ in tasks:
                records.append(study_one(a, e, split, cfg))
                progress.advance(bar)
    elapsed = time.perf_counter() - started
    summary: dict[str, dict[str, dict]] = {}
    for rec in records:
        summary.setdefault(rec["algorithm"], {})[f"{rec['target_epsilon']:g}"] = {
            k: v for k, v in rec.items() if k not in ("runs", "algorithm", "target_epsilon")
        }
    claims = [
        {"a": a, "b": b, "at_least": at_least, "paper": paper, "by_epsilon": {
            f"{e:g}": verdict(summary[a][f"{e:g}"]["test_accuracy"], summary[b][f"{e:g}"]["test_accuracy"])
            for e in cfg.epsilons}}
        for a, b, at_least, paper in CLAIMS if a in summary and b in summary
    ]  # fmt: skip
    console.print(_table(summary, cfg))
    if claims:
        console.print(_claims_table(claims, cfg))
    console.print(f"{sum(len(r['runs']) for r in records)} runs in {elapsed:.0f} s")
    doc = {
        "config": dataclasses.asdict(cfg),
        "dataset": {
            "name": cfg.dataset,
            "train": len(split.y_train),
            "val": len(split.y_val),
            "test": len(split.y_test),
        },  # fmt: skip
        "search": {a: [dataclasses.asdict(x) for x in SEARCH[a]] for a in [BASELINE, *cfg.algorithms]},
        "tuning_seeds": list(TUNING_SEEDS[: cfg.tuning_seeds]),
        "test_seeds": [TEST_SEED_BASE + i for i in range(cfg.seeds)],
        "summary": summary,
        "claims": claims,
        "runs": [r for rec in records for r in rec["runs"]],
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


def _fmt_hp(hp: dict) -> str:
    return ", ".join(f"{k}={v:.3g}" for k, v in hp.items())


def _table(summary: dict, cfg: TrainConfig):
    from rich.table import Table

    table = Table(
        title=f"{cfg.dataset}, {cfg.model}, δ={cfg.delta:g}, {cfg.epochs} epochs: test accuracy (%), mean ± 95% "
        f"interval over {cfg.seeds} seeds; chosen configuration (+n: n configurations beyond the budget, "
        "to move it off an edge; * still on an edge when the extension ran out)"
    )
    table.add_column("algorithm")
    for eps in cfg.epsilons:
        table.add_column(f"ε={eps:g}", justify="right")
        table.add_column("configuration")
    table.add_column("step ms", justify="right")
    for algorithm, by_eps in summary.items():
        cells, step_ms = [], []
        for eps in cfg.epsilons:
            s = by_eps.get(f"{eps:g}", by_eps.get("inf"))
            cells += [f"{100 * s['test_accuracy_mean']:.1f} ± {100 * s['test_accuracy_ci95']:.1f}",
                      _fmt_hp(s["hp"]) + (f" +{s['beyond_budget']}" if s["beyond_budget"] else "")
                      + ("*" if s["chosen_on_edge"] else "")]  # fmt: skip
            step_ms.append(s["step_ms"])
        table.add_row(algorithm, *cells, f"{statistics.fmean(step_ms):.2f}")
    return table


def _claims_table(claims: list[dict], cfg: TrainConfig):
    from rich.table import Table

    table = Table(title="The papers' orderings: paired difference a − b (points), 95% interval, verdict")
    table.add_column("claim")
    for eps in cfg.epsilons:
        table.add_column(f"ε={eps:g}", justify="right")
    for c in claims:
        rel = "≥" if c["at_least"] else ">"
        cells = [f"{100 * v['diff_mean']:+.1f} ± {100 * v['diff_ci95']:.1f} {v['label']}"
                 for v in c["by_epsilon"].values()]  # fmt: skip
        table.add_row(f"{c['a']} {rel} {c['b']}", *cells)
    return table


def write_plot(summary: dict, cfg: TrainConfig, path: str) -> bool:
    """Accuracy against ε with 95% intervals, one line per algorithm (the baseline as a horizontal line)."""
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
        half = [100 * by_eps[f"{e:g}"]["test_accuracy_ci95"] for e in eps]
        ax.errorbar(eps, mean, yerr=half, marker="o", capsize=3, label=algorithm)
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set_xticks(cfg.epsilons, [f"{e:g}" for e in cfg.epsilons])
    ax.set_xlabel(f"ε (δ = {cfg.delta:g})")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"{cfg.dataset}, {cfg.model}, {cfg.epochs} epochs, mean ± 95% interval over {cfg.seeds} seeds")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
