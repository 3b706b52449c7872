"""Pure-PyTorch reference implementations: the ground truth for every dpkernels op."""

from . import clip

__all__ = ["clip"]
