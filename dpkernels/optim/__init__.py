"""DP optimizers: one class per algorithm, every backend (docs/ALGORITHMS.md "Optimizers").

Each optimizer reads Opacus-style per-sample gradients from ``p.grad_sample`` and runs, per
``step()``, the clip pipeline of :mod:`dpkernels.clip` and one fused family op per param group
(:mod:`dpkernels.optim._base`). ``backend=`` picks the implementation of both: ``"reference"``
(pure PyTorch, :mod:`dpkernels.reference.optim`; also fp64), ``"cpu"``, ``"cuda"``, ``"triton"``.
The state layout is the same on every backend, so checkpoints move between them.

Modules: :mod:`._base` (the shared base and privacy arguments), :mod:`.sgd` (DPSGD incl. PSAC,
DPPMLF), :mod:`.adam` (DPAdam, DPAdamBC, DPAdamSTP), :mod:`.macadam`, :mod:`.dp2`,
:mod:`._distributed` (``distributed=True`` data parallel; ZeRO-1 :class:`ShardedDPOptimizer`).
"""

from ._base import LAYOUT, OPTIM, DPOptimizer, PrivacyArgs  # noqa: F401  (importable from here)
from ._distributed import ShardedDPOptimizer  # noqa: F401  (a wrapper, not an algorithm: not in __all__)
from .adam import DPAdam, DPAdamBC, DPAdamSTP
from .dp2 import DP2
from .macadam import DPMacAdam
from .sgd import DPPMLF, DPSGD

__all__ = ["DPSGD", "DPAdam", "DPAdamBC", "DPAdamSTP", "DPMacAdam", "DP2", "DPPMLF"]
