"""Integrations with training frameworks.

:mod:`dpkernels.integrations.opacus` (needs the ``opacus`` extra) runs Opacus's DP optimizers on
dpkernels. Nothing is imported here, so ``import dpkernels.integrations`` works without opacus.
"""
