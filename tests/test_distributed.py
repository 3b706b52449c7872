"""The DP optimizers under ``torch.distributed`` (gloo, CPU): data parallel (``distributed=True``),
ZeRO-1 (``ShardedDPOptimizer``) and a rank that dies or stalls mid-step. Each test starts its ranks
as subprocesses (tests/_dist_worker.py) and compares them with single-process runs made here."""

import copy
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import _dist_worker as w  # noqa: E402

from dpkernels.optim import DPSGD, ShardedDPOptimizer  # noqa: E402

# Processes, checkpoints or the CLI above the kernels: the best CPU path is enough (conftest.py).
pytestmark = pytest.mark.one_cpu_path

WORKER = Path(__file__).with_name("_dist_worker.py")


def _launch(world: int, tmp_path, scenario: str) -> list[subprocess.Popen]:
    return [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(rank), str(world), str(tmp_path / "pg"), str(tmp_path), scenario],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]


@pytest.fixture(scope="module", params=[1, 2, 4])
def ranks(request, tmp_path_factory):
    """``(world, [rank r's saved results])`` of the ``run`` scenario."""
    world = request.param
    tmp = tmp_path_factory.mktemp(f"world{world}")
    if world == 1:  # in this process: saves a subprocess start
        dist.init_process_group("gloo", init_method=f"file://{tmp / 'pg'}", rank=0, world_size=1)
        try:
            w.run(0, 1, str(tmp))
        finally:
            dist.destroy_process_group()
        return world, [torch.load(tmp / "rank0.pt")]
    procs = _launch(world, tmp, "run")
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0 and f"rank {rank}: done" in out, f"rank {rank} failed:\n{out[-4000:]}"
    return world, [torch.load(tmp / f"rank{r}.pt") for r in range(world)]


def _equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_data_parallel_fresh_seed_is_rank_0s(ranks):
    """No seed given: each rank draws its own, the constructor makes them use rank 0's (else the
    ranks would add different noise and drift apart)."""
    world, results = ranks
    if world == 1:
        pytest.skip("one rank")
    assert not _equal(results[0]["fresh_seed"], w.initial_params())
    for r in range(1, world):
        assert _equal(results[r]["fresh_seed"], results[0]["fresh_seed"]), f"rank {r} differs from rank 0"


@pytest.mark.parametrize("name", [n for n in w.CONFIGS if n != "fresh_seed"])
def test_data_parallel_equals_one_process(ranks, name):
    """Every rank ends with the same parameters, equal to one process on the global batch to fp32
    rounding of the clipped sum's additions (noise drawn once, std σ·C: a per-rank draw would be
    off by ~σC/B ≈ 0.07 per coordinate and step)."""
    world, results = ranks
    for r in range(1, world):
        assert _equal(results[r][name], results[0][name]), f"rank {r} differs from rank 0"
    single = w.train(name)
    assert not _equal(single, w.initial_params())
    torch.testing.assert_close(results[0][name], single, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("name", ["sgd", "adam", "secure", "blt"])
def test_data_parallel_bit_exact_with_rank_sums(ranks, name):
    """One process stepping from ``Σ_r S_r`` (rank order) gives the data-parallel parameters bit for bit:
    the noise and the update are exact, only the order of the all-reduce's additions may differ
    (none for 1 or 2 ranks; gloo's order for 4)."""
    world, results = ranks
    got = w.train_from_rank_sums(name, world)
    if world <= 2:
        assert _equal(results[0][name], got)
    else:
        torch.testing.assert_close(results[0][name], got, rtol=2e-6, atol=2e-7)


@pytest.mark.parametrize("name", w.SHARDED)
def test_zero1_equals_unsharded(ranks, name):
    """ZeRO-1 (state and noise of each rank's range, shard bounds inside tensors) gives the unsharded
    data-parallel parameters bit for bit, on every rank."""
    world, results = ranks
    for r in range(world):
        assert _equal(results[r][f"zero1/{name}"], results[r][name]), f"rank {r}"


@pytest.mark.parametrize("name", ["stp", "macadam"])
def test_zero1_book_keeping_equals_unsharded(ranks, name):
    """``step(per_sample=BKBatch)``: book-keeping clipping (the norms from the layers' inputs and
    output gradients) of a state-dependent clip, sharded, equals the unsharded data-parallel run."""
    world, results = ranks
    assert not _equal(results[0][f"bk/{name}"], [p.detach() for p in w.bk_model().parameters()])
    for r in range(world):
        assert _equal(results[r][f"zero1_bk/{name}"], results[r][f"bk/{name}"]), f"rank {r}"
        assert _equal(results[r][f"bk/{name}"], results[0][f"bk/{name}"]), f"rank {r} differs from rank 0"


def test_zero1_pmlf_past_iterates_are_gathered_whole(ranks):
    """DP-PMLF's past iterates (the points its next gradients are taken at) are the unsharded run's."""
    world, results = ranks
    for r in range(world):
        for got, want in zip(results[r]["zero1_past/pmlf"], results[r]["past/pmlf"], strict=True):
            assert _equal(got, want), f"rank {r}"


def test_zero1_step_from_sums_is_world_independent(ranks):
    """With an exactly all-reduced sum, ZeRO-1 over 1, 2 or 4 ranks equals the single-process
    step bit for bit: each range's noise is keyed by its global flat index."""
    world, results = ranks
    want = w.from_sums("sgd", w.global_sums("sgd"))
    assert not _equal(want, w.initial_params())
    for r in range(world):
        assert _equal(results[r]["zero1_sums/sgd"], want)


def test_clip_failure_on_one_rank_stops_every_rank(ranks):
    """A non-finite gradient on the last rank: that rank raises its ValueError, the others a
    RuntimeError naming it; no rank writes a parameter or counts a step."""
    world, results = ranks
    for r, res in enumerate(results):
        assert res["nonfinite_unchanged"] and res["nonfinite_steps"] == 0
        if r == world - 1:
            assert res["nonfinite"].startswith("ValueError") and "non-finite" in res["nonfinite"]
        else:
            assert res["nonfinite"].startswith("RuntimeError") and "clip raised on 1 other rank" in res["nonfinite"]


def test_data_parallel_state_dict_is_the_same_on_every_rank(ranks):
    """So a checkpoint saved on rank 0 resumes every rank."""
    world, results = ranks
    sds = [res["state_dict/adam"] for res in results]
    assert sds[0]["dp"]["step"] == 2 and sds[0]["state"]
    for sd in sds[1:]:
        assert sd["dp"] == sds[0]["dp"] and sd["param_groups"] == sds[0]["param_groups"]
        for i, st in sds[0]["state"].items():
            assert st.keys() == sd["state"][i].keys()
            assert all(torch.equal(v, sd["state"][i][k]) for k, v in st.items())


def test_sum_over_ranks_beyond_fp32_raises_on_every_rank(ranks):
    world, results = ranks
    for res in results:
        if world == 1:
            assert res["overflow"] == "stepped 1"
        else:
            assert "clipped sum over the ranks overflows torch.float32" in res["overflow"], res["overflow"]
            assert res["overflow"].endswith("(steps 0)")


def test_ranks_with_different_keys_all_raise(ranks):
    world, results = ranks
    if world == 1:
        pytest.skip("one rank")
    for res in results:
        assert "seed differs across ranks" in res["mismatch/seed"]
        msg = res["mismatch/secure_key"]
        assert "secure_key differs across ranks (values not shown)" in msg and str(w.KEY) not in msg


def test_make_private_data_parallel(ranks):
    """``make_private(algorithm="dpsgd")`` on Opacus's DPDDP module, 2 ranks with their own Poisson
    batches: the engine's B is the global E = 8, both ranks end equal, and equal (fp32 rounding) to one
    DPSGD process on the union of the ranks' batches with the same seed; ε is Opacus's for q, σ, 3 steps."""
    world, results = ranks
    if world != 2:
        pytest.skip("run on 2 ranks")
    runs = [res["opacus"] for res in results]
    assert runs[0]["B"] == runs[1]["B"] == 8
    assert _equal(runs[0]["params"], runs[1]["params"])
    model = w.opacus_model()
    params = list(model.parameters())
    opt = DPSGD(params, lr=0.1, momentum=0.9, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=8,
                seed=w.OPACUS_SEED)  # fmt: skip
    init = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, x, y):
        return torch.nn.functional.cross_entropy(torch.func.functional_call(model, p, (x[None],)), y[None])

    for step in range(3):
        x = torch.cat([r["batches"][step][0] for r in runs])
        y = torch.cat([r["batches"][step][1] for r in runs])
        assert len(x) > 0
        grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(init, x, y)
        for (name, _), p in zip(model.named_parameters(), params, strict=True):
            p.grad_sample = grads[name]
        opt.step()
        init = {k: v.detach() for k, v in model.named_parameters()}
    assert not _equal(runs[0]["params"], list(w.opacus_model().parameters()))
    torch.testing.assert_close(runs[0]["params"], [p.detach() for p in params], rtol=1e-5, atol=1e-6)
    from opacus.accountants import RDPAccountant

    acc = RDPAccountant()
    for _ in range(3):
        acc.step(noise_multiplier=1.0, sample_rate=1 / 4)
    assert runs[0]["eps"] == runs[1]["eps"] == acc.get_epsilon(1e-5)


@pytest.mark.skipif(not (torch.cuda.is_available() and dist.is_nccl_available()), reason="NCCL needs a CUDA device")
def test_nccl_data_parallel_and_zero1_on_cuda(tmp_path):
    """NCCL on the GPUs (one rank per device, at most 2): ZeRO-1 equals data parallel bit for bit, and
    both equal one process on the whole batch (bit for bit with one rank; to the all-reduce's
    rounding with two)."""
    world = min(torch.cuda.device_count(), 2)
    procs = _launch(world, tmp_path, "nccl")
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0 and f"rank {rank}: done" in out, f"rank {rank} failed:\n{out[-4000:]}"
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for name in w.NCCL_CONFIGS:
        single = [p.cpu() for p in w.train(name, device="cuda")]
        assert not _equal(single, w.initial_params())
        for r in range(world):
            assert _equal(results[r][f"zero1/{name}"], results[r][name]), f"{name}, rank {r}"
            if world == 1:
                assert _equal(results[r][name], single), name
            else:
                torch.testing.assert_close(results[r][name], single, rtol=2e-5, atol=2e-6)


def test_dead_rank_raises_not_hangs(tmp_path):
    """Rank 1 exits (one pair of ranks) or stalls (another pair, run at the same time) before its
    second step: rank 0's step raises within 60 s (gloo closes the connection, or the group's 3 s
    timeout passes) and leaves its parameters unchanged."""
    start = time.monotonic()
    runs = {}
    for mode in ("exit", "stall"):
        (tmp_path / mode).mkdir()
        runs[mode] = _launch(2, tmp_path / mode, mode)
    try:
        outs = {mode: procs[0].communicate(timeout=60)[0] for mode, procs in runs.items()}
    finally:
        for p in (p for procs in runs.values() for p in procs):
            if p.poll() is None:
                p.kill()
            p.communicate()
    assert time.monotonic() - start < 60
    for mode, out in outs.items():
        assert runs[mode][0].returncode == 0 and "rank 0: raised" in out, f"{mode}:\n{out[-4000:]}"
        assert "unchanged=True" in out and "another rank died, stalled" in out, f"{mode}:\n{out[-4000:]}"
    assert "Timed out" in outs["stall"]  # the group's timeout; a dead peer's message varies (closed, reset)


def test_argument_errors(tmp_path):
    """Without an initialised group, or with a wrong ``distributed``, the constructors raise."""
    params = w.initial_params()
    with pytest.raises(RuntimeError, match="init_process_group"):
        DPSGD(params, lr=0.1, distributed=True, **w.PRIVACY)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        with pytest.raises(TypeError, match="ProcessGroup"):
            DPSGD(params, lr=0.1, distributed="world", **w.PRIVACY)
        with pytest.raises(TypeError, match="a dpkernels DP optimizer class"):
            ShardedDPOptimizer(torch.optim.SGD, params, lr=0.1, **w.PRIVACY)
        with pytest.raises(ValueError, match="needs distributed"):
            ShardedDPOptimizer(DPSGD, params, lr=0.1, distributed=False, **w.PRIVACY)
        with pytest.raises(TypeError, match="one parameter dtype"):
            ShardedDPOptimizer(DPSGD, [params[0], params[1].double()], lr=0.1, backend="reference", **w.PRIVACY)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ["adam", "dp2", "macadam", "pmlf"])
def test_zero1_state_dict_resumes(tmp_path, name):
    """A ZeRO-1 shard's state_dict resumes the run bit for bit (DP²: across its preconditioner refresh;
    MacAdam: its b scale; PMLF: its rings) and is refused by another shard layout."""
    k = w.CONFIGS[name][2]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        params = w.initial_params()
        opt = w.make(name, w.groups(params), True, sharded=True)
        w.set_grads(params, 0, k)
        opt.step()
        saved, saved_params = copy.deepcopy(opt.state_dict()), [p.clone() for p in params]
        w.set_grads(params, 1, k)
        opt.step()
        resumed = list(saved_params)
        again = w.make(name, w.groups(resumed), True, sharded=True)
        again.load_state_dict(saved)
        w.set_grads(resumed, 1, k)
        again.step()
        assert again.steps_taken == 2 and _equal(resumed, params)
        with pytest.raises(ValueError, match="ZeRO-1 shard"):
            again.load_state_dict({**saved, "zero1": {"world": 2, "rank": 1}})
    finally:
        dist.destroy_process_group()
