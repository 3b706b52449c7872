"""Integrations with other DP training libraries.

:mod:`dpkernels.integrations.opacus` (needs the ``opacus`` extra):

- ``accelerate(dp_optimizer)``: an Opacus ``DPOptimizer``'s clip, accumulate, noise, scale and
  step run on dpkernels, in place;
- ``make_private(privacy_engine, ..., algorithm=...)`` and ``PrivacyEngine``: the dpkernels
  optimizers (every algorithm of the papers) inside Opacus's GradSampleModule, Poisson loader and
  accountant.

Nothing is imported here, so ``import dpkernels.integrations`` works without Opacus.
"""
