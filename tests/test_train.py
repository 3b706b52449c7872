"""``dpkernels train``: the training smoke test (on scikit-learn's digits, every algorithm, on every
CPU backend that runs the optimizers natively: reference and cpu; Triton's interpreter is far too
slow for training), the study's tuning search, its statistics, MNIST-1D and the CLI."""

import json
import math

import pytest

pytest.importorskip("sklearn")

from dpkernels.bench.train import (  # noqa: E402
    BASELINE,
    CONSTRAINTS,
    SEARCH,
    SGD_FAMILY,
    VARIANTS,
    Axis,
    TrainConfig,
    ci95,
    load_digits_split,
    load_mnist1d_split,
    search,
    train_one,
    verdict,
)
from dpkernels.integrations._make_private import ALGORITHMS  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.usefixtures("one_thread")]

LR = {"sgd": 1.0, "adam": 0.01}


@pytest.fixture(scope="module")
def split():
    return load_digits_split()


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("algorithm", [*ALGORITHMS, *VARIANTS, BASELINE])
def test_training_smoke(algorithm, backend, split):
    if algorithm == BASELINE and backend == "reference":
        pytest.skip("the baseline uses no dpkernels backend")
    cfg = TrainConfig(algorithms=[algorithm], epochs=3, backend=backend)
    # the centre of the algorithm's search space, at the smoke test's learning rate
    hp = {a.name: a.centre for a in SEARCH[algorithm]} | {"lr": LR["sgd" if algorithm in SGD_FAMILY else "adam"]}
    r = train_one(algorithm, 8.0, hp, 0, split, cfg)
    assert r.last_loss < 0.8 * r.first_loss, r
    assert r.test_accuracy > 0.3 and r.val_accuracy > 0.3 and math.isfinite(r.val_loss), r  # chance is 0.1
    if algorithm == BASELINE:
        assert r.epsilon == float("inf")
    else:
        assert 0 < r.epsilon <= 8.0 * 1.01 and r.noise_multiplier > 0


def _quadratic(optimum):
    calls = []

    def evaluate(idx):
        calls.append(idx)
        return -sum((i - o) ** 2 for i, o in zip(idx, optimum, strict=True))

    return evaluate, calls


def test_search_extends_past_the_grid_until_the_optimum_is_interior():
    axes = (Axis("a", 1.0), Axis("b", 1.0))
    evaluate, calls = _quadratic((3, -2))  # beyond the initial 3 x 3 neighbourhood on both axes
    best, scores, edge = search(axes, evaluate, budget=40)
    assert best == (3, -2) and not edge
    assert len(calls) == len(set(calls)) == len(scores)  # no configuration trained twice
    # interior: both neighbours along each axis were tried and are worse
    for k in range(2):
        for d in (1, -1):
            nb = best[:k] + (best[k] + d,) + best[k + 1 :]
            assert scores[nb] < scores[best]


def test_search_respects_the_budget_and_bounds_and_flags_an_unconfirmed_edge():
    axes = (Axis("lr", 1.0), Axis("k", 2, integer=True, low=1))
    evaluate, calls = _quadratic((5, -9))  # k's optimum is below its bound k >= 1, i.e. index -1
    best, scores, edge = search(axes, evaluate, budget=4)
    assert len(calls) == 4 and edge
    best, scores, edge = search(axes, evaluate, budget=50)
    assert best == (5, -1) and not edge  # k = 1: the bound, not a missing evaluation
    assert all(axes[1].valid(i[1]) for i in scores)


def test_search_extension_moves_an_edge_choice_inside_and_only_spends_what_it_needs():
    axes = (Axis("lr", 1.0), Axis("c", 1.0), Axis("e", 1.0))
    evaluate, calls = _quadratic((4, 3, 0))
    best, scores, edge = search(axes, evaluate, budget=6)
    assert len(scores) == 6 and edge  # the budget alone stops on an edge
    evaluate, calls = _quadratic((4, 3, 0))
    best, scores, edge = search(axes, evaluate, budget=6, extension=40)
    assert best == (4, 3, 0) and not edge and 6 < len(scores) < 6 + 40
    assert len(calls) == len(set(calls)) == len(scores)
    best, scores, edge = search(axes, evaluate, budget=6, extension=2)
    assert len(scores) == 8 and edge  # the extension is a cap too
    interior, _ = _quadratic((0, 0, 0))
    best, scores, edge = search(axes, interior, budget=30, extension=40)
    assert best == (0, 0, 0) and not edge and len(scores) == 7  # centre and its 6 neighbours: no extension


def test_search_never_tries_a_point_outside_a_joint_constraint():
    axes = (Axis("h1_factor", 1.0, 10.0), Axis("h2_factor", 1.0, 10.0))
    evaluate, calls = _quadratic((4, -4))  # beyond h1 <= h2
    best, scores, edge = search(axes, evaluate, budget=30, allowed=lambda idx: idx[0] <= idx[1])
    assert best == (0, 0) and not edge and all(i <= j for i, j in calls)
    assert CONSTRAINTS["macadam"]({"h1_factor": 10.0, "h2_factor": 0.1})  # h1/h2 = 1e-1 of the defaults' 1e-3
    assert not CONSTRAINTS["macadam"]({"h1_factor": 1e4, "h2_factor": 10.0})


def test_ci95_and_verdicts():
    assert ci95([0.5]) == 0.0
    # t(0.975, 4) = 2.7764451; stdev of 1..5 = 1.5811388
    assert ci95([1, 2, 3, 4, 5]) == pytest.approx(2.7764451 * 1.5811388 / math.sqrt(5), rel=1e-6)
    b = [0.80, 0.82, 0.79, 0.85, 0.81]
    assert verdict([x + 0.02 for x in b], b)["label"] == "holds"  # the same gain on every seed
    assert verdict([x - 0.02 + 0.001 * i for i, x in enumerate(b)], b)["label"] == "reversed"
    v = verdict([0.81, 0.80, 0.80, 0.86, 0.80], b)
    assert v["label"] == "inconclusive" and v["diff_mean"] - v["diff_ci95"] < 0 < v["diff_mean"] + v["diff_ci95"]


def test_mnist1d_is_generated_offline_and_split_per_class():
    pytest.importorskip("mnist1d")
    s = load_mnist1d_split(2000)
    assert (len(s.y_train), len(s.y_val), len(s.y_test)) == (1600, 200, 200)
    assert s.x_train.shape[1] == 40 and s.x_train.dtype.is_floating_point
    for y in (s.y_train, s.y_val, s.y_test):
        assert set(y.tolist()) == set(range(10))
    assert load_mnist1d_split(2000) is s  # generated once per process


def test_train_cli_writes_json_and_plot(tmp_path):
    from dpkernels.cli import main

    out, plot = tmp_path / "train.json", tmp_path / "acc.png"
    argv = ["train", "--quick", "--algorithms", "dpsgd,pmlf", "--epsilons", "3", "--seeds", "2", "--epochs", "1",
            "--budget", "2"]  # fmt: skip
    assert main([*argv, "--json", str(out), "--plot", str(plot)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["summary"]) == {BASELINE, "dpsgd", "pmlf"}
    # 2 configurations x 1 tuning seed + 2 test seeds per (algorithm, epsilon); the baseline once
    assert len(doc["runs"]) == 3 * 4
    assert doc["test_seeds"] == [100, 101] and doc["tuning_seeds"] == [0]
    for algorithm in ("dpsgd", "pmlf"):
        s = doc["summary"][algorithm]["3"]
        assert 0 < s["epsilon"] <= 3.0 * 1.01 and s["configurations_tried"] == 2 and len(s["test_accuracy"]) == 2
        assert set(s["hp"]) == {a["name"] for a in doc["search"][algorithm]}
    (claim,) = doc["claims"]  # pmlf > dpsgd, on the shared test seeds
    assert (claim["a"], claim["b"]) == ("pmlf", "dpsgd") and claim["by_epsilon"]["3"]["label"] in (
        "holds", "reversed", "inconclusive")  # fmt: skip
    pytest.importorskip("matplotlib")
    assert plot.stat().st_size > 1000
