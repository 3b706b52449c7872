"""Multi-process training (``torch.distributed``) for the DP optimizers: data parallel and ZeRO-1.

**Data parallel** (``distributed=True`` on any optimizer): every rank clips its own samples, the
clipped sums ``S_r`` (and the weight totals ``Σ c_i`` DP-MacAdam needs) are summed over the ranks by
one all-reduce, and every rank then runs the same noise-and-update pass on the same ``S = Σ_r S_r``
with the same key: the noise is drawn once for the global batch, std exactly ``σ·C`` (not per rank,
not ``√world`` times), and the ranks' parameters stay identical. ``expected_batch_size`` is the
GLOBAL ``B``. The constructor makes the ranks agree on the noise key (rank 0's fresh seed when none
is given; a given seed, ChaCha20 key or correlated-noise seed must be equal on every rank) and on
``σ``, ``C``, ``B`` and the parameter shapes, or raises the same error on every rank.

**ZeRO-1** (:class:`ShardedDPOptimizer`): the flat parameter vector (``param_groups`` order) is split
into ``world`` contiguous ranges, cut anywhere, even inside a tensor; each rank keeps the optimizer
state of its range only, steps it with the noise of its global flat indices (the ``offset`` of the
family ops) and all-gathers the parameters. The parameters are bit-identical to the unsharded run
for every number of ranks.

**Failures.** A rank that fails its clip (a non-finite gradient, ...) tells the others through the
all-reduce: every rank raises, none steps. A rank that dies or stalls makes the others' collective
fail: gloo raises when the peer's connection closes, or after the process group's ``timeout``
(``init_process_group(timeout=...)``), never a hang; the error is re-raised as a
``RuntimeError`` naming the step. Both happen before any state is written (ZeRO-1: before the
all-gather, which can still fail after the shard was updated; restart such a run from a checkpoint).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math

import torch
import torch.distributed as dist
from torch import Tensor

from ..clip import _in_range, _overflow_error
from ..reference.optim import state_dtype

__all__ = ["ShardedDPOptimizer"]


def process_group(distributed):
    """The process group of the ``distributed`` argument: None (single process) for False, the
    default group for True, or the given ``ProcessGroup``."""
    if distributed is False or distributed is None:
        return None
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("distributed=... needs torch.distributed initialised first (init_process_group)")
    if distributed is True:
        return dist.group.WORLD
    if not isinstance(distributed, dist.ProcessGroup):
        raise TypeError(f"distributed must be False, True or a torch.distributed ProcessGroup, got {distributed!r}")
    return distributed


#: compared across ranks by their SHA-256 only: a given ChaCha20 key never leaves its rank
_SECRET = ("secure_key",)


def agree(group, given: dict, drawn: dict) -> dict:
    """Rank 0's ``drawn`` values (fresh per rank, e.g. a seed nobody passed), after checking that the
    ``given`` ones are equal on every rank; raises the same ``ValueError`` on every rank otherwise.
    A drawn ChaCha20 key is sent from rank 0 over the group's transport (gloo: plain TCP); pass the
    same ``secure_key`` on every rank to keep it off the network."""
    given = {k: hashlib.sha256(str(v).encode()).hexdigest() if k in _SECRET else v for k, v in given.items()}
    values = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, (given, drawn), group=group)
    for name in given:
        seen = [v[0].get(name) for v in values]
        if any(s != seen[0] for s in seen):
            shown = "values not shown" if name in _SECRET else seen
            raise ValueError(
                f"distributed optimizer: {name} differs across ranks ({shown}); every rank must pass the same "
                "value (pass no seed to use rank 0's fresh one)"
            )
    return values[0][1]


_UNCHANGED = "This step changed no parameter or state"


def _collective(what: str, fn, consequence: str = _UNCHANGED):
    try:
        return fn()
    except RuntimeError as err:  # gloo: a peer closed its connection, or the group's timeout passed
        rank = dist.get_rank()
        raise RuntimeError(
            f"dpkernels rank {rank}: the {what} failed ({err}); another rank died, stalled or raised "
            f"outside the step. {consequence}"
        ) from err


def reduce_flat(group, tensors: list[Tensor]) -> list[Tensor]:
    """The all-reduced (summed) ``tensors``, one collective per dtype. Each rank's sum is within its
    dtype (:func:`dpkernels.clip._pipeline` checks it) but their sum can overflow: every rank sees
    the same reduced values, so every rank raises the same ``ValueError``."""
    out = list(tensors)
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        idx = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        flat = torch.cat([tensors[i].reshape(-1) for i in idx])
        _collective("all-reduce of the clipped sums", lambda flat=flat: dist.all_reduce(flat, group=group))
        for i, part in zip(idx, flat.split([tensors[i].numel() for i in idx]), strict=True):
            out[i] = part.view(tensors[i].shape)
    if not _in_range(out):
        raise _overflow_error(out, "clipped sum over the ranks", "each rank's sum is within range", "lower C or B")
    return out


def _exchange_status(group, c_total, failed: bool, device) -> float:
    """``Σ_r c_r`` over the ranks; raises on a rank whose clip passed when another rank's raised.
    ``device``: the parameters' (NCCL reduces GPU tensors only)."""
    meta = torch.tensor([float(c_total), float(failed)], dtype=torch.float64, device=device)
    _collective("all-reduce of the clip status", lambda: dist.all_reduce(meta, group=group))
    if meta[1] > 0 and not failed:
        raise RuntimeError(
            f"dpkernels rank {dist.get_rank()}: the clip raised on {int(meta[1])} other rank(s) (see their "
            "error); no rank steps"
        )
    return float(meta[0])


def clip_then_reduce(group, clip, device) -> tuple[list[Tensor], float]:
    """``clip()`` → ``(sums, c_total)`` on this rank's samples, then summed over the ranks. A rank
    whose clip raises still joins the status all-reduce (so no rank waits for it), then re-raises;
    the others raise too."""
    try:
        sums, c_total = clip()
    except Exception:
        _exchange_status(group, 0.0, True, device)
        raise
    c_total = _exchange_status(group, c_total, False, device)
    return reduce_flat(group, sums), c_total


class ShardedDPOptimizer:
    """ZeRO-1 for any DP optimizer: each rank keeps the optimizer state of one range of the flat
    parameter vector, and the parameters equal the unsharded run's bit for bit.

    ``ShardedDPOptimizer(DPAdamSTP, params, lr=..., eps1=..., noise_multiplier=..., max_grad_norm=...,
    expected_batch_size=B_global, seed=..., distributed=True)``: the keyword arguments are the
    optimizer's. With ``N`` parameter elements (``param_groups`` order, one flat index ``e``) and
    ``W`` ranks, rank ``r`` owns ``e ∈ [⌊rN/W⌋, ⌊(r+1)N/W⌋)``; its :attr:`engine` is the optimizer over
    1-D views of that range (the state of the range only) whose noise index starts at the range's
    first ``e``. A :meth:`step`:

    1. forms the clip's per-coordinate inputs from the range's state (STP's scale, DP²'s
       preconditioner, MacAdam's shift and scale; :meth:`DPOptimizer._plan`) and all-gathers them
       (one transient ``N``-vector each, like the parameters);
    2. clips this rank's ``p.grad_sample`` ``[B_r, *p.shape]`` (or a ``per_sample``
       :class:`~dpkernels.bk.BKBatch`) over ALL parameters (the norms are over the whole gradient)
       → ``S_r``, and all-reduces ``S = Σ_r S_r`` (gloo has no reduce-scatter; each rank keeps its
       range);
    3. steps its range: noise ``σ·C·z_e`` for the range's ``e`` (Philox counter ``(e, t, 0)``, or
       its correlated version through the range's mechanism buffers: the unsharded run's noise);
       a sum over every coordinate (MacAdam's ``Σ√ŝ``) is all-reduced;
    4. all-gathers the ranges into every rank's parameters.

    Every parameter must have one dtype (the all-gather moves one flat buffer) and ``N ≥ W``.
    DP-PMLF's :meth:`past_params` all-gathers the past iterates. :meth:`state_dict` and
    :meth:`load_state_dict` are the engine's: per rank, for the same ``W``. DP-MacAdam's ``Σ√ŝ`` is
    summed in float64 in another order than one process's, so its ``b`` scale, and through it the
    parameters, can differ from the unsharded run in the last bit.
    """

    def __init__(self, optimizer_cls, params, *, distributed=True, **kwargs):
        from ._base import DPOptimizer

        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, DPOptimizer)):
            raise TypeError(f"optimizer_cls must be a dpkernels DP optimizer class, got {optimizer_cls!r}")
        self.group = process_group(distributed)
        if self.group is None:
            raise ValueError("ShardedDPOptimizer needs distributed=True or a ProcessGroup")
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        groups = [{**g, "params": [g["params"]] if isinstance(g["params"], Tensor) else list(g["params"])}
                  for g in groups]  # fmt: skip
        self.params = [p for g in groups for p in g["params"]]
        if not self.params:
            raise ValueError("ShardedDPOptimizer got no parameters")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise TypeError(f"ShardedDPOptimizer needs one parameter dtype (one flat all-gather), got {dtypes}")
        for idx, p in enumerate(self.params):
            if not p.is_contiguous():
                raise ValueError(f"parameter {idx} (shape {tuple(p.shape)}) must be contiguous")
        self.world, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        numel = sum(p.numel() for p in self.params)
        if numel < self.world:
            raise ValueError(f"{numel} parameter elements cannot be split over {self.world} ranks")
        self.numel = numel
        self.bounds = [r * numel // self.world for r in range(self.world + 1)]
        lo, hi = self.bounds[self.rank], self.bounds[self.rank + 1]
        # The engine's parameters: 1-D views of this rank's range of each tensor, in flat order,
        # so its in-place update writes the real parameters.
        shard_groups, start = [], 0
        for g in groups:
            pieces = []
            for p in g["params"]:
                a, b = max(lo, start) - start, min(hi, start + p.numel()) - start
                if a < b:
                    pieces.append(p.detach().view(-1)[a:b])
                start += p.numel()
            shard_groups.append({**g, "params": pieces})
        kwargs = optimizer_cls._whole_model_defaults(kwargs, numel)
        engine = optimizer_cls(shard_groups, distributed=False, **{**kwargs, **self._agreed(optimizer_cls, kwargs)})
        engine._noise_offset = lo
        engine._sum_over_shards = self._sum_over_ranks
        self.engine = engine

    def _agreed(self, cls, kwargs) -> dict:
        from ..noise import fresh_key, fresh_seed

        given = {k: kwargs[k] for k in ("seed", "secure_key", "noise_multiplier", "max_grad_norm",
                                        "expected_batch_size", "mode", "r") if kwargs.get(k) is not None}  # fmt: skip
        given["cls"] = cls.__name__
        given["shapes"] = [tuple(p.shape) for p in self.params]
        drawn = {}
        mech = kwargs.get("correlated_noise")
        if mech is not None:
            given["seed"] = mech.seed
        elif "seed" not in given:
            drawn["seed"] = fresh_seed()
        if kwargs.get("rng") == "chacha20" and "secure_key" not in given:
            drawn["secure_key"] = fresh_key()
        return agree(self.group, given, drawn)

    @property
    def param_groups(self) -> list[dict]:
        """The engine's param groups (this rank's pieces; set ``lr`` etc. on every rank alike)."""
        return self.engine.param_groups

    @property
    def steps_taken(self) -> int:
        return self.engine.steps_taken

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None if set_to_none else (p.grad.zero_() if p.grad is not None else None)
            p.grad_sample = None

    def state_dict(self) -> dict:
        return {**self.engine.state_dict(), "zero1": {"world": self.world, "rank": self.rank}}

    def load_state_dict(self, state_dict: dict) -> None:
        z = state_dict.get("zero1") if isinstance(state_dict, dict) else None
        if z != {"world": self.world, "rank": self.rank}:
            raise ValueError(f"state_dict holds the ZeRO-1 shard {z}; this is rank {self.rank} of {self.world}")
        self.engine.load_state_dict({k: v for k, v in state_dict.items() if k != "zero1"})

    def past_params(self) -> list[list[Tensor]]:
        """DP-PMLF's ``k−1`` past iterates (:meth:`DPPMLF.past_params`), gathered whole on every rank."""
        return [self._gather(pieces, "all-gather of the past iterates") for pieces in self.engine.past_params()]

    @torch.no_grad()
    def step(self, *, per_sample=None) -> None:
        """Steps 1–4 of the class docstring, all or nothing up to the final all-gather."""
        from ..bk import BKBatch

        eng = self.engine
        eng._check_params(eng._params())
        if per_sample is None:
            grad_sets = eng._grad_sets(self.params)
        elif not isinstance(per_sample, BKBatch) or per_sample.num_sets != eng._num_grad_sets:
            raise TypeError(f"per_sample must be a dpkernels.bk.BKBatch of {eng._num_grad_sets} gradient set(s)")
        else:
            grad_sets = per_sample

        def clip(plan):
            whole = dataclasses.replace(
                plan,
                shift=plan.shift and self._gather(plan.shift, "all-gather of the clip's shift"),
                scale=plan.scale and self._gather(plan.scale, "all-gather of the clip's scale"),
            )
            local = lambda: eng._clip_local(self.params, grad_sets, whole)  # noqa: E731
            sums, c_total = clip_then_reduce(self.group, local, self.params[0].device)
            return self._own_range(sums), c_total

        eng._step_with(clip, None)
        self._gather_params()

    @torch.no_grad()
    def step_from_sums(self, sums: list[Tensor], *, sensitivity: float) -> None:
        """:meth:`DPOptimizer.step_from_sums` with this rank's ``S_r`` (full shapes): summed over the
        ranks, then steps 3–4 of :meth:`step`."""
        if len(sums) != len(self.params):
            raise ValueError(f"sums must be a list of {len(self.params)} tensors shaped like the parameters")
        for idx, (s, p) in enumerate(zip(sums, self.params, strict=True)):
            if not isinstance(s, Tensor) or s.shape != p.shape or s.dtype != state_dtype(p):
                raise ValueError(f"sums[{idx}] must be a {state_dtype(p)} tensor of shape {tuple(p.shape)}")
        self.engine.step_from_sums(self._own_range(reduce_flat(self.group, list(sums))), sensitivity=sensitivity)
        self._gather_params()

    def _own_range(self, whole: list[Tensor]) -> list[Tensor]:
        """This rank's range of tensors shaped like the parameters, as the engine's pieces."""
        lo, hi = self.bounds[self.rank], self.bounds[self.rank + 1]
        flat = torch.cat([s.reshape(-1) for s in whole])[lo:hi]
        return list(flat.split([p.numel() for p in self.engine._params()]))

    def _gather(self, pieces: list[Tensor], what: str, consequence: str = _UNCHANGED) -> list[Tensor]:
        """Every rank's ``pieces`` (the engine's parameter order) as whole tensors shaped like the parameters."""
        mine = torch.cat([x.reshape(-1) for x in pieces])
        own = torch.zeros(math.ceil(self.numel / self.world), dtype=mine.dtype, device=mine.device)
        own[: mine.numel()] = mine
        parts = [torch.empty_like(own) for _ in range(self.world)]
        _collective(what, lambda: dist.all_gather(parts, own, group=self.group), consequence)
        flat = torch.cat([parts[r][: self.bounds[r + 1] - self.bounds[r]] for r in range(self.world)])
        return [x.view(p.shape) for x, p in zip(flat.split([p.numel() for p in self.params]), self.params, strict=True)]

    def _gather_params(self) -> None:
        whole = self._gather(
            self.engine._params(),
            "all-gather of the parameter shards",
            "This rank's range of the parameters and its state were updated but the others' were not "
            "gathered: restart from a checkpoint",
        )
        for p, x in zip(self.params, whole, strict=True):
            p.data.copy_(x)

    def _sum_over_ranks(self, x: float) -> float:
        total = torch.tensor([x], dtype=torch.float64, device=self.params[0].device)
        _collective(
            "all-reduce of a sum over the coordinates",
            lambda: dist.all_reduce(total, group=self.group),
            "This rank's range of the parameters and its state were updated: restart from a checkpoint",
        )
        return float(total)
