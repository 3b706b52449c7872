"""Training smoke test: on scikit-learn's digits, every algorithm, on every CPU backend that runs
the optimizers natively (reference and cpu; Triton's interpreter is far too slow for training),
lowers the training loss and beats chance (10%) on the test split."""

import pytest

pytest.importorskip("sklearn")

from dpkernels.bench.train import BASELINE, SGD_FAMILY, VARIANTS, TrainConfig, load_digits_split, train_one  # noqa: E402
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
    lr = LR["sgd" if algorithm in SGD_FAMILY else "adam"]
    r = train_one(algorithm, 8.0, lr, 0, split, cfg)
    assert r.last_loss < 0.8 * r.first_loss, r
    assert r.test_accuracy > 0.3, r  # chance is 0.1
    if algorithm == BASELINE:
        assert r.epsilon == float("inf")
    else:
        assert 0 < r.epsilon <= 8.0 * 1.01 and r.noise_multiplier > 0


def test_train_cli_writes_json_and_plot(tmp_path):
    import json

    from dpkernels.cli import main

    out, plot = tmp_path / "train.json", tmp_path / "acc.png"
    argv = ["train", "--quick", "--algorithms", "dpsgd,pmlf", "--epsilons", "3", "--seeds", "1", "--epochs", "1"]
    assert main([*argv, "--json", str(out), "--plot", str(plot)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["summary"]) == {BASELINE, "dpsgd", "pmlf"}
    # 2 learning rates tuned + 1 seed per (algorithm, epsilon); the baseline once
    assert len(doc["runs"]) == 3 * 3
    for algorithm in ("dpsgd", "pmlf"):
        s = doc["summary"][algorithm]["3"]
        assert 0 < s["epsilon"] <= 3.0 * 1.01 and s["lr"] in doc["lr_grids"][algorithm]
    pytest.importorskip("matplotlib")
    assert plot.stat().st_size > 1000
