"""Baselines: independent second implementations of the k3ref cores, used as agreement checks and as
the same-precision baselines of the low-precision gates.

`torch_cores` (PyTorch, any device) and `torch_backend.make_backend` ("torch", "torch-bf16", "torch64").
Nothing here imports torch at package import time; see docs/torch_baseline.md.
"""
