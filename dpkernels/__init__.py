"""dpkernels: fused kernels for differentially private training.

Public ops (each runs on the ``reference``, ``cpu``, ``cuda`` and ``triton`` backends):

- :func:`per_sample_norms`, :func:`clip_factors`, :func:`weighted_sum`
- :func:`clip_and_accumulate`, the fused per-sample clipping pipeline
- :func:`privatize`, the private gradient ``(Σ c_i g_i + σCz)/B`` with in-pass noise
- :func:`philox_uint32`, :func:`chacha20_uint32`, :func:`gaussian_noise`, :func:`add_gaussian_noise_`
  (docs/RNG.md; ``rng="chacha20"`` is the secure mode)
- :func:`available_backends`, :func:`cpu_capability` (the instruction set of the CPU kernels in use)
- :func:`linear_filter_`, the generic fused IIR step; :class:`BLTNoise`, :class:`BandedNoise`
  (correlated noise for DP matrix factorisation, built on it)
- :mod:`optim`: the fused DP optimizers (DPSGD, DPAdam, DPAdamBC, DPAdamSTP, DPMacAdam, DP2, DPPMLF)
- book-keeping clipping without per-sample gradients: the layer ops :func:`linear_sumsq`,
  :func:`linear_weighted_sum`, :func:`conv2d_sumsq`, :func:`conv2d_weighted_sum`,
  :func:`embedding_sumsq`, :func:`embedding_weighted_sum`, and the engine :class:`dpkernels.bk.BKModule`
"""

from ._backend import BACKENDS, available_backends, cpu_capability
from .clip import CLIP_MODES, clip_and_accumulate, clip_factors, per_sample_norms, privatize, weighted_sum
from .noise import RNGS, add_gaussian_noise_, chacha20_uint32, gaussian_noise, philox_uint32

# isort: split
# Correlated noise and the generic filter step.
from .correlated import BandedNoise, BLTNoise
from .filter import linear_filter_
from .layers import (
    conv2d_sumsq,
    conv2d_weighted_sum,
    embedding_sumsq,
    embedding_weighted_sum,
    linear_sumsq,
    linear_weighted_sum,
)

# DP optimizers (dpkernels.optim.DPSGD, DPAdam, ...), fused on every backend but reference, which
# runs the pure-PyTorch step functions of dpkernels.reference.optim.
from . import optim  # noqa: E402  isort: skip

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "CLIP_MODES",
    "RNGS",
    "available_backends",
    "cpu_capability",
    "clip_and_accumulate",
    "clip_factors",
    "per_sample_norms",
    "privatize",
    "weighted_sum",
    "add_gaussian_noise_",
    "chacha20_uint32",
    "gaussian_noise",
    "philox_uint32",
    # Correlated noise and the generic filter step.
    "BLTNoise",
    "BandedNoise",
    "linear_filter_",
    # Book-keeping layer ops.
    "conv2d_sumsq",
    "conv2d_weighted_sum",
    "embedding_sumsq",
    "embedding_weighted_sum",
    "linear_sumsq",
    "linear_weighted_sum",
    "optim",
]
