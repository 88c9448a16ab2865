"""Triton kernels for the engine on a GPU: storing new K/V into the daemon's
paged cache and paged attention over it.

Importing a kernel module imports Triton; the CPU engine never does. On a
machine without CUDA the kernels run in Triton's interpreter
(``TRITON_INTERPRET=1`` before Triton is imported, on CPU tensors): slow, but
the same code the GPU compiles, which is how CI tests them.
"""
