"""Tuned CPU forms of reference steps whose readable form lives in the block module (k3ref.kda, k3ref.mxfp4,
k3ref.latent_moe).

Each function here computes exactly what its readable counterpart states, reorganised for speed on a CPU
(blocked chunks, cache-sized row blocks, lookup tables, batched experts). They take arguments the block
module has already validated and never import the block module they speed up, so it may call them without a
cycle.
tests/k3ref/test_fast.py checks each one against the readable form.
"""
