"""Private training on scikit-learn's digits with one dpkernels algorithm, inside Opacus.

    python examples/train_digits.py --algorithm macadam --epsilon 3

The only change to an Opacus training loop is the ``PrivacyEngine`` (dpkernels's subclass) and
the ``algorithm=`` argument of ``make_private``; DP-PMLF's step also takes the batch. The full
comparison of every algorithm at several ε is ``dpkernels train`` (dpkernels/bench/train.py).
"""

import argparse

import torch
from opacus.accountants.utils import get_noise_multiplier
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpkernels.bench.train import load_digits_split, make_model
from dpkernels.integrations._make_private import ALGORITHMS, PrivacyEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithm", choices=ALGORITHMS, default="dpsgd")
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--lr", type=float, default=None, help="default: 1.0 (SGD family) or 0.01 (Adam family)")
    args = parser.parse_args()

    torch.manual_seed(0)
    split = load_digits_split()
    loader = DataLoader(TensorDataset(split.x_train, split.y_train), batch_size=64)
    model = make_model("mlp")
    sgd_family = args.algorithm in ("dpsgd", "psac", "dp2", "pmlf")
    lr = args.lr or (1.0 if sgd_family else 0.01)
    optimizer = (torch.optim.SGD if sgd_family else torch.optim.Adam)(model.parameters(), lr=lr)
    extra = {"dp2": {"s1": len(loader), "s2": len(loader)}}.get(args.algorithm, {})

    sigma = get_noise_multiplier(
        target_epsilon=args.epsilon, target_delta=args.delta, sample_rate=1 / len(loader), epochs=args.epochs
    )
    privacy_engine = PrivacyEngine(accountant="rdp")
    model, optimizer, loader = privacy_engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        noise_multiplier=sigma,
        max_grad_norm=1.0,
        algorithm=args.algorithm,
        **extra,
    )
    for epoch in range(args.epochs):
        for x, y in loader:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            if args.algorithm == "pmlf":
                optimizer.step(batch=(x, y))  # DP-PMLF recomputes this batch's gradients at the past iterate
            else:
                optimizer.step()
        with torch.no_grad():
            acc = (model(split.x_test).argmax(1) == split.y_test).float().mean().item()
        print(f"epoch {epoch + 1:2d}  loss {loss.item():.3f}  test acc {100 * acc:.1f}%  "
              f"ε = {privacy_engine.get_epsilon(args.delta):.2f} (σ = {sigma:.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
