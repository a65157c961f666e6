"""greenserve's own compiled kernels for the Llama forward pass (numba, no BLAS).

Every reduction here runs in an order fixed by this source: one sequential chain per output element
(vector lanes across *outputs*, never across the terms of one sum), IEEE float32 multiplies and adds
with no fast-math and no contraction into FMA. So an output's bits depend neither on the CPU's vector
width (AVX2 or AVX-512), nor on how many rows share a step, nor on a library's dispatch
(docs/ARCHITECTURE.md §5).

Importing this package imports nothing: :mod:`model.kernels.jit` sets numba's environment and must be
imported before numba itself, and only the Llama family needs these kernels (the bigram never
imports numba).
"""
