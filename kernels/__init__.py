"""Low-bit and swap-buffer kernels (Triton, CuPy), each beside its plain-torch reference."""
