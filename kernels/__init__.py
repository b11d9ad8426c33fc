"""Low-bit and swap-buffer kernels (Triton, CuPy), each beside its plain-torch reference.

Submodules are imported on use (``from ooc.kernels.quant import quantize``): Triton's import and
kernel decoration cost time, and ``import ooc`` must not pay it.
"""
