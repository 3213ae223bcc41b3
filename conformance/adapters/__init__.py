"""Adapters: public kernel libraries as external backends (conformance.external.Backend).

Each module exposes `make_backend(...)` and is listed under the entry-point group `k3conf.backends`, so
`k3conf list backends` shows it with its availability and `k3conf run --backend <name>` runs it. Importing
an adapter never imports its library; the library is imported when the backend's cores are first built.
- `fla`: flash-linear-attention's KDA kernels (chunk_kda, fused_recurrent_kda) as kda_prefill / kda_decode.
"""
