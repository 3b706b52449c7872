"""Triton kernels of dpkernels, one file per op family. Host launchers take the reference's
signatures (dpkernels/reference/); nothing here registers torch.library ops."""
