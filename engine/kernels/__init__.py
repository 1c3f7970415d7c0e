"""Native CPU kernels, compiled from C at first use and loaded with ctypes.

Each kernel has a plain torch reference next to it (engine/quantization.py)
and tests that they agree; when a kernel cannot be built (no C compiler, no
AVX2, KVSERVE_NATIVE_KERNELS=0) the reference runs instead and a warning says why.
"""
