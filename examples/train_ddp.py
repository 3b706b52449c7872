"""Data-parallel DP-SGD with a dpkernels optimizer, one process per rank (README "Multi-process training").

    torchrun --nproc-per-node 2 examples/train_ddp.py [--zero1] [--optimizer dpsgd|stp|macadam|dp2]

Each rank draws its own Poisson sample of a synthetic dataset's shard (rate q, so the global batch
has E = q·N samples on average), computes its per-sample gradients with ``torch.func`` and calls
``step()``: the clipped sums are all-reduced and the noise (std σ·C) is drawn once for the global
batch. ``expected_batch_size`` is the GLOBAL E. ``--zero1`` shards the optimizer state
(``ShardedDPOptimizer``; the optimizers whose clip reads their state gather its per-coordinate
inputs first). Prints the loss on rank 0 and checks that the ranks agree.
"""

import argparse
import datetime

import torch
import torch.distributed as dist
from torch import nn

from dpkernels.optim import DP2, DPSGD, DPAdamSTP, DPMacAdam, ShardedDPOptimizer

#: --optimizer: the class and its own hyper-parameters
OPTIMIZERS = {
    "dpsgd": (DPSGD, dict(lr=0.5, momentum=0.9)),
    "stp": (DPAdamSTP, dict(lr=0.02, eps1=0.1)),
    "macadam": (DPMacAdam, dict(lr=0.02)),
    "dp2": (DP2, dict(lr=0.5, s1=5, s2=5)),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--zero1", action="store_true")
    ap.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="dpsgd")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR/PORT; a dead rank makes the others raise after the timeout.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # the same data and initial model on every rank
    n, q = 1024, 0.05
    x = torch.randn(n, 10)
    y = (x[:, 0] + x[:, 1] > 0).long()
    shard = torch.arange(n).tensor_split(world)[rank]  # each rank samples its shard of the data
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 2))
    params = dict(model.named_parameters())
    privacy = dict(noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=int(q * n), seed=1234)
    cls, hyper = OPTIMIZERS[args.optimizer]
    if args.zero1:
        opt = ShardedDPOptimizer(cls, model.parameters(), **hyper, **privacy)
    else:
        opt = cls(model.parameters(), distributed=True, **hyper, **privacy)

    def loss_one(p, xi, yi):
        return nn.functional.cross_entropy(torch.func.functional_call(model, p, (xi[None],)), yi[None])

    per_sample_grad = torch.func.vmap(torch.func.grad(loss_one), in_dims=(None, 0, 0))
    sampler = torch.Generator().manual_seed(rank)  # each rank's own Poisson draws
    for step in range(args.steps):
        idx = shard[torch.rand(len(shard), generator=sampler) < q]
        grads = per_sample_grad({k: v.detach() for k, v in params.items()}, x[idx], y[idx])
        for name, p in params.items():
            p.grad_sample = grads[name]
        opt.step()
        if rank == 0 and step % 5 == 4:
            with torch.no_grad():
                print(f"step {step + 1}: loss {nn.functional.cross_entropy(model(x), y).item():.4f}", flush=True)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(g, gathered[0]) for g in gathered), "ranks diverged"
    if rank == 0:
        print(f"{world} ranks agree", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
