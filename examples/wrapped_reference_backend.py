"""An external backend as a kernel author writes one: here the "kernels" are the reference cores, wrapped.

    k3conf run --backend examples/wrapped_reference_backend.py:make --cases 'kda_decode*'
    pytest --k3conf-backend examples/wrapped_reference_backend.py:make -k kda_decode

Set K3CONF_EXAMPLE_PERTURB to a core name (e.g. kda_decode) to scale that core's first output by
(1 + 1e-3): a relative error 1e-3, far above any fp32 gate, so the run fails and its first failure names
that block. Unset, every case passes. CI runs both through the CLI and the pytest plugin.
"""
from __future__ import annotations

import os

from conformance import Backend

PERTURB_ENV = "K3CONF_EXAMPLE_PERTURB"
RELATIVE_ERROR = 1e-3
# every core with its own cases; attnres_hub (a factory of per-token state) stays the reference's
WRAPPED = ("rmsnorm", "situ_glu", "kda_decode", "kda_prefill", "mla_decode", "mxfp4_gemv", "moe_route",
           "attnres_mix")


def _wrap(fn, perturb: bool):
    """A new callable around `fn` (so the runner sees an author's core), optionally scaling its first output."""
    def core(*args, **kwargs):
        out = fn(*args, **kwargs)
        if not perturb:
            return out
        if isinstance(out, tuple):
            return (out[0] * (1 + RELATIVE_ERROR), *out[1:])
        return out * (1 + RELATIVE_ERROR)
    return core


def make() -> Backend:
    perturbed = os.environ.get(PERTURB_ENV, "")
    if perturbed and perturbed not in WRAPPED:
        raise ValueError(f"{PERTURB_ENV}: expected one of {WRAPPED}, found {perturbed!r}")

    def make_cores(base):
        return base.replace(**{name: _wrap(getattr(base, name), name == perturbed) for name in WRAPPED})

    return Backend.from_cores("example-wrapped", "fp32", make_cores)
