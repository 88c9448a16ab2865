"""The engine's attention kernels.

- Triton, for the engine on a GPU: storing new K/V into the daemon's paged
  cache and paged attention over it (``kv_store``, ``paged_attention``).
  Importing one imports Triton; the CPU engine never does. On a machine
  without CUDA they run in Triton's interpreter (``TRITON_INTERPRET=1``
  before Triton is imported, on CPU tensors): slow, but the same code the GPU
  compiles, which is how CI tests them.
- C, for the engine on the CPU (``cpu``): decode attention reading the blocks
  in place, and linear layers of small batches; compiled on the machine that
  runs them.
"""
