"""One rank of ``test_distributed.py``: the dpkernels optimizers under ``torch.distributed`` (gloo, CPU).

Usage: ``python _dist_worker.py RANK WORLD INIT_FILE OUT_DIR SCENARIO``.

``run``: every optimizer of :data:`CONFIGS` with ``distributed=True`` for :data:`STEPS` steps, rank ``r``
holding rows :func:`rows` of each step's global batch (:func:`batch`); the ZeRO-1
``ShardedDPOptimizer`` against the unsharded data-parallel run; a sharded ``step_from_sums`` whose
all-reduced sum is exact (rank 0 holds the global ``S``, the others 0); a clip that raises on the
last rank. Saves ``OUT_DIR/rank{r}.pt`` and prints ``rank R: done``.

``nccl``: :data:`NCCL_CONFIGS` data parallel and ZeRO-1 on ``cuda:RANK`` over NCCL.

``exit`` / ``stall``: rank 1 dies (``os._exit``) or sleeps before its second step; rank 0 must raise
from the step within the group's 3 s timeout and print ``rank 0: raised ...``.
"""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

from dpkernels import BLTNoise
from dpkernels.bk import BKModule
from dpkernels.optim import DP2, DPPMLF, DPSGD, DPAdam, DPAdamBC, DPAdamSTP, DPMacAdam, ShardedDPOptimizer
from dpkernels.optim._base import ClipPlan

SHAPES = [(3, 5), (5,), (2, 3)]  # 26 elements: the 4-rank shard bounds 6, 13, 19 cut inside tensors 0 and 1
B = 7  # the global batch; 4 ranks hold 2, 2, 2, 1 rows
STEPS = 3
PRIVACY = dict(noise_multiplier=1.0, max_grad_norm=0.5, expected_batch_size=B)
KEY = 3**100  # a ChaCha20 key

#: name → (class, keyword arguments, number of gradient sets); a callable argument is called per optimizer
CONFIGS = {
    "sgd": (DPSGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01, seed=11), 1),
    "psac": (DPSGD, dict(lr=0.1, mode="psac", r=0.1, seed=12), 1),
    "adam": (DPAdam, dict(lr=0.01, weight_decay=0.1, seed=13), 1),
    "adam_bc": (DPAdamBC, dict(lr=0.01, seed=14), 1),
    "stp": (DPAdamSTP, dict(lr=0.01, eps1=1e-2, seed=15), 1),
    "macadam": (DPMacAdam, dict(lr=0.01, seed=16), 1),
    "dp2": (DP2, dict(lr=0.1, s1=1, s2=1, seed=17), 1),
    "pmlf": (DPPMLF, dict(lr=0.1, k=2, seed=18), 2),
    "secure": (DPSGD, dict(lr=0.1, rng="chacha20", secure_key=KEY), 1),
    "blt": (
        DPSGD,
        dict(lr=0.1, correlated_noise=lambda: BLTNoise([0.9, 0.5], [0.3, 0.1], std=1.0, seed=19, start_step=1)),
        1,
    ),
    "fresh_seed": (DPSGD, dict(lr=0.1), 1),  # no seed: every rank must use rank 0's fresh one
}
#: every configuration but the fresh seed's (its own test); secure: ChaCha20 noise drawn at the range's
#: offset; blt: correlated noise whose buffers are the range's
SHARDED = tuple(n for n in CONFIGS if n != "fresh_seed")


def make(name: str, params, distributed=False, sharded: bool = False):
    cls, kwargs, _ = CONFIGS[name]
    kwargs = {k: v() if callable(v) else v for k, v in kwargs.items()}
    if sharded:
        return ShardedDPOptimizer(cls, params, distributed=distributed, **PRIVACY, **kwargs)
    return cls(params, distributed=distributed, **PRIVACY, **kwargs)


def initial_params(device: str = "cpu") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g).to(device) for s in SHAPES]


def groups(params):
    """Two param groups with their own lr: the second group's noise offset is the first's numel."""
    return [{"params": params[:1]}, {"params": params[1:], "lr": 0.05}]


def batch(t: int, k: int = 1) -> list[list[torch.Tensor]]:
    """Step ``t``'s global per-sample gradients: ``k`` sets of ``[B, *shape]`` per parameter."""
    g = torch.Generator().manual_seed(100 + t)
    return [[torch.randn(k, B, *s, generator=g)[j] for j in range(k)] for s in SHAPES]


def rows(rank: int, world: int) -> slice:
    """Rank ``rank``'s rows of the global batch (``tensor_split``: uneven when ``world ∤ B``)."""
    sizes = [len(c) for c in torch.arange(B).tensor_split(world)]
    return slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))


def set_grads(params, t: int, k: int, sl: slice = slice(None)) -> None:
    for p, sets in zip(params, batch(t, k), strict=True):
        p.grad_sample = [s[sl].to(p.device) for s in sets] if k > 1 else sets[0][sl].to(p.device)


def train(name: str, distributed=False, sl: slice = slice(None), sharded: bool = False, *, opt_out=None,
          device: str = "cpu"):  # fmt: skip
    """``STEPS`` steps of config ``name`` on rows ``sl`` of each global batch; the final parameters
    (``opt_out``: a list the optimizer is appended to)."""
    k = CONFIGS[name][2]
    params = initial_params(device)
    opt = make(name, groups(params), distributed, sharded)
    for t in range(STEPS):
        set_grads(params, t, k, sl)
        opt.step()
    if opt_out is not None:
        opt_out.append(opt)
    return params


def bk_model() -> torch.nn.Module:
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def bk_train(name: str, sl: slice, sharded: bool) -> list[torch.Tensor]:
    """``STEPS`` book-keeping steps (``step(per_sample=BKModule.batch())``, no per-sample gradients)
    of config ``name`` on an MLP, rank rows ``sl`` of each global batch."""
    model = bk_model()
    bk = BKModule(model, loss_reduction="sum")
    opt = make(name, list(model.parameters()), True, sharded)
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(STEPS, B, 4, generator=g), torch.randint(0, 2, (STEPS, B), generator=g)
    for t in range(STEPS):
        torch.nn.functional.cross_entropy(bk(x[t, sl]), y[t, sl], reduction="sum").backward()
        opt.step(per_sample=bk.batch())
    return [p.detach().clone() for p in model.parameters()]


def clipped_sums(opt, params, t: int, sl: slice = slice(None)) -> list[torch.Tensor]:
    """The clipped sum ``S`` of rows ``sl`` of step ``t``'s batch by a single-process ``opt``."""
    set_grads(params, t, 1, sl)
    return opt._clip_sums(params, opt._grad_sets(params), ClipPlan(opt.max_grad_norm))[0]


def global_sums(name: str) -> list[torch.Tensor]:
    params = initial_params()
    return clipped_sums(make(name, params), params, 0)


def train_from_rank_sums(name: str, world: int) -> list[torch.Tensor]:
    """:func:`train` in one process from ``Σ_r S_r`` added in rank order (``step_from_sums``): the
    data-parallel run up to the order of the all-reduce's additions."""
    params = initial_params()
    opt = make(name, groups(params))
    for t in range(STEPS):
        parts = [clipped_sums(opt, params, t, rows(r, world)) for r in range(world)]
        opt.step_from_sums([sum(ps[1:], ps[0]) for ps in zip(*parts, strict=True)], sensitivity=opt.max_grad_norm)
    return params


def from_sums(name: str, sums, distributed=False, sharded: bool = False) -> list[torch.Tensor]:
    params = initial_params()
    opt = make(name, groups(params), distributed, sharded)
    opt.step_from_sums(sums, sensitivity=0.75)
    return params


def run(rank: int, world: int, out_dir: str) -> None:
    sl = rows(rank, world)
    opts = {}
    out = {name: train(name, True, sl, opt_out=opts.setdefault(name, [])) for name in CONFIGS}
    for name in SHARDED:
        out[f"zero1/{name}"] = train(name, True, sl, sharded=True, opt_out=opts.setdefault(f"zero1/{name}", []))
    out["past/pmlf"], out["zero1_past/pmlf"] = (opts[key][0].past_params() for key in ("pmlf", "zero1/pmlf"))
    for name in ("stp", "macadam"):
        out[f"bk/{name}"], out[f"zero1_bk/{name}"] = (bk_train(name, sl, sharded) for sharded in (False, True))
    sums = global_sums("sgd")
    mine = sums if rank == 0 else [torch.zeros_like(s) for s in sums]  # Σ_r is then exactly S
    out["zero1_sums/sgd"] = from_sums("sgd", mine, True, sharded=True)
    # A non-finite gradient on the last rank: every rank raises, no rank steps.
    params = initial_params()
    opt = DPSGD(params, lr=0.1, distributed=True, **PRIVACY, seed=1)
    set_grads(params, 0, 1, sl)
    if rank == world - 1:
        params[1].grad_sample[0, 0] = float("nan")
    try:
        opt.step()
        out["nonfinite"] = "stepped"
    except (ValueError, RuntimeError) as e:
        out["nonfinite"] = f"{type(e).__name__}: {e}"
    out["nonfinite_unchanged"] = all(torch.equal(a, b) for a, b in zip(params, initial_params(), strict=True))
    out["nonfinite_steps"] = opt.steps_taken
    # Ranks built with different keys: every rank raises (a secret key is compared by its hash only).
    for name, kw in (("seed", dict(seed=rank)), ("secure_key", dict(rng="chacha20", secure_key=KEY + rank))):
        try:
            DPSGD(initial_params(), lr=0.1, distributed=True, **PRIVACY, **kw)
            out[f"mismatch/{name}"] = "built"
        except ValueError as e:
            out[f"mismatch/{name}"] = str(e)
    params = initial_params()
    opt = make("adam", groups(params), True)
    for t in range(2):
        set_grads(params, t, 1, sl)
        opt.step()
    out["state_dict/adam"] = opt.state_dict()
    # Each rank's sum within fp32, their sum (2e38·world) not for world > 1: every rank raises.
    opt = DPSGD(initial_params(), lr=0.1, distributed=True, **PRIVACY, seed=1)
    try:
        opt.step_from_sums([torch.full(s, 2e38) for s in SHAPES], sensitivity=0.5)
        out["overflow"] = f"stepped {opt.steps_taken}"
    except ValueError as e:
        out["overflow"] = f"{e} (steps {opt.steps_taken})"
    if world == 2:
        out["opacus"] = opacus_run()
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))


OPACUS_SEED, OPACUS_N, OPACUS_LOADER_BATCH = 7, 32, 8  # q = 1/4, global E = 8


def opacus_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


def opacus_data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(
        torch.randn(OPACUS_N, 4, generator=g), torch.randint(0, 3, (OPACUS_N,), generator=g)
    )


def opacus_run() -> dict:
    """``make_private(algorithm="dpsgd")`` on Opacus's DPDDP module: 3 steps; each rank's batches, the
    final parameters, the engine's ``B`` and ε."""
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP

    from dpkernels.integrations.opacus import PrivacyEngine

    model = opacus_model()
    loader = torch.utils.data.DataLoader(opacus_data(), batch_size=OPACUS_LOADER_BATCH)
    pe = PrivacyEngine(accountant="rdp")
    torch.manual_seed(100 + dist.get_rank())  # each rank's Poisson draws
    module, opt, loader = pe.make_private(
        module=DPDDP(model), optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), data_loader=loader,
        noise_multiplier=1.0, max_grad_norm=1.0, algorithm="dpsgd", seed=OPACUS_SEED,
    )  # fmt: skip
    batches = []
    for step, (x, y) in enumerate(loader):
        if step == 3:
            break
        batches.append((x, y))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(module(x), y).backward()
        opt.step()
    return dict(params=[p.detach().clone() for p in model.parameters()], batches=batches,
                B=opt.engine.expected_batch_size, eps=pe.get_epsilon(1e-5))  # fmt: skip


def failure(rank: int, mode: str) -> None:
    group = dist.new_group(timeout=datetime.timedelta(seconds=3))
    params = initial_params()
    opt = DPSGD(params, lr=0.1, distributed=group, **PRIVACY, seed=1)
    set_grads(params, 0, 1, rows(rank, 2))
    opt.step()
    before = [p.clone() for p in params]
    if rank == 1:
        if mode == "exit":
            os._exit(17)
        time.sleep(600)
    set_grads(params, 1, 1, rows(rank, 2))
    start = time.monotonic()
    try:
        opt.step()
    except RuntimeError as e:
        unchanged = all(torch.equal(a, b) for a, b in zip(params, before, strict=True))
        print(f"rank 0: raised after {time.monotonic() - start:.1f} s, unchanged={unchanged}: {e}", flush=True)
        os._exit(0)  # no destroy_process_group: its peer is gone
    print("rank 0: stepped without its peer", flush=True)
    os._exit(1)


#: the configurations of the NCCL scenario: one per optimizer family and state-dependent clip
NCCL_CONFIGS = ("sgd", "adam_bc", "stp", "macadam", "dp2", "pmlf", "blt")


def nccl_run(rank: int, world: int, out_dir: str) -> None:
    """Data parallel and ZeRO-1 on ``cuda:rank`` over NCCL (its collectives take GPU tensors only)."""
    sl, dev = rows(rank, world), f"cuda:{rank}"
    out = {}
    for name in NCCL_CONFIGS:
        out[name] = [p.cpu() for p in train(name, True, sl, device=dev)]
        out[f"zero1/{name}"] = [p.cpu() for p in train(name, True, sl, sharded=True, device=dev)]
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))


def main(rank: int, world: int, init_file: str, out_dir: str, scenario: str) -> None:
    torch.set_num_threads(1)
    if scenario == "nccl":
        torch.cuda.set_device(rank)
    backend = "nccl" if scenario == "nccl" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    if scenario == "run":
        run(rank, world, out_dir)
    elif scenario == "nccl":
        nccl_run(rank, world, out_dir)
    else:
        failure(rank, scenario)
    dist.destroy_process_group()
    print(f"rank {rank}: done", flush=True)
    # Skip the interpreter's teardown: once in CI a rank aborted there, after its results were saved and
    # the group destroyed ("terminate called without an active exception", from threads torch leaves
    # behind; dpkernels starts none), which failed the test for nothing the test checks.
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
