"""Triton kernels of dpkernels, one file per op family (clip, noise, filter, optim), plus the
launch machinery they share (common: metadata tables, launch groups, tiles, tile normals) and the
generators (philox, chacha). Host launchers take the reference's signatures
(dpkernels/reference/); nothing here registers torch.library ops."""
