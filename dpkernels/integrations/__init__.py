"""Integrations with other DP training libraries.

- :mod:`dpkernels.integrations.opacus`: ``accelerate()`` for an Opacus ``DPOptimizer``.
- :mod:`dpkernels.integrations._make_private`: ``make_private(privacy_engine, ..., algorithm=...)``,
  the dpkernels optimizers inside Opacus's GradSampleModule, Poisson loader and accountant.

Nothing is imported here, so ``import dpkernels`` never requires Opacus (an optional extra).
"""
