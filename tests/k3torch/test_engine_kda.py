"""The torch engine-shaped KDA cores (k3torch.engine_kda) against the float64 references (k3ref.engine.kda).

On every tiny case of the three cores (conformance.cases.engine_kda: shuffled slots, padded rows, junk in the
unused slots, both layouts, varlen sequences around a chunk of 64): in float64 the two implementations agree to
rounding; in bf16 the error stays bf16-sized and the unused slots come back exactly as received (the state pool
in fp32, the conv history rounded to bf16).
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.support.strict import import_or_skip

torch = import_or_skip("torch")

from conformance.cases.engine_kda import SPECS, TABLE  # noqa: E402
from conformance.cases.inputs import cast  # noqa: E402
from k3ref.cores import reference_cores  # noqa: E402
from k3torch.cores import Precision, TorchCore  # noqa: E402
from k3torch.engine_kda import CORES  # noqa: E402
from tests.support.tolerances import rel_rms  # noqa: E402

pytestmark = pytest.mark.torch

# name: (relative-RMS tolerance, reason)
FP64_TOL = (1e-10, "two float64 implementations (NumPy, torch) of one recurrence; at most 129 tokens")
# core: (cap on the relative RMS error of the activation output vs the float64 reference, reason)
BF16_CAP: dict[str, tuple[float, str]] = {
    "kda_decode_pool": (1e-2, "q, k, v, g_raw, beta_raw rounded to bf16, state and gate fp32, o rounded "
                              "(the host kda_decode measures 2.6e-3)"),
    "kda_conv_pool": (1e-2, "x and the history rounded to bf16, fp32 weight and sum, y rounded (~2e-3)"),
    "kda_prefill_varlen": (1.5e-2, "as kda_decode_pool along up to 65 tokens per sequence (the host kda_prefill "
                                   "measures 3.6e-3)"),
}

TINY = [pytest.param(name, params, id=name) for name, params in TABLE["tiny"]]


def _run(name: str, params: dict, dtype):
    block = name.split("/")[0]
    spec = SPECS[block]
    inputs, kwargs = spec.make(np.random.default_rng(len(name)), **params)
    want = dict(zip(spec.outputs, getattr(reference_cores(), block)(**inputs, **kwargs), strict=True))
    prep, compute = CORES[block]
    core = TorchCore(block, prep, compute, Precision(dtype, torch.device("cpu")))
    got = dict(zip(spec.outputs, core(**inputs, **kwargs), strict=True))
    return spec, inputs, spec.normal_form(inputs, got), spec.normal_form(inputs, want)


@pytest.mark.parametrize("name, params", TINY)
def test_float64_agrees_with_the_reference(name, params):
    spec, _, got, want = _run(name, params, torch.float64)
    for out in spec.outputs:
        assert got[out].dtype == np.float64
        err = rel_rms(got[out], want[out])
        assert err <= FP64_TOL[0], f"{name} {out}: relative RMS {err:.3g} > {FP64_TOL[0]}"


@pytest.mark.parametrize("name, params", TINY)
def test_bf16_error_is_bf16_sized_and_the_pool_is_kept(name, params):
    spec, inputs, got, want = _run(name, params, torch.bfloat16)
    act, pool_name = spec.outputs
    cap, _ = BF16_CAP[spec.core]
    err = rel_rms(got[act], want[act])
    assert err <= cap, f"{name} {act}: relative RMS {err:.3g} > bf16 cap {cap}"
    assert err > 0, f"{name}: bf16 rounding left {act} exact (inputs not rounded?)"
    slots = np.asarray(inputs["slots"])
    pool_in = np.asarray(inputs[pool_name])
    unused = np.setdiff1d(np.arange(pool_in.shape[0]), slots[slots >= 0])
    kept = cast(pool_in[unused], "fp32" if pool_name in spec.fp32_inputs else "bf16")   # as the core received it
    np.testing.assert_array_equal(got[pool_name][unused], kept)
    live = slots[slots >= 0]
    err = rel_rms(got[pool_name][live], want[pool_name][live])
    assert err <= cap, f"{name} {pool_name}: live slots' relative RMS {err:.3g} > {cap}"


def test_bad_slots_are_named():
    name, params = TABLE["tiny"][0]
    inputs, kwargs = SPECS["kda_decode_pool"].make(np.random.default_rng(0), **params)
    prep, compute = CORES["kda_decode_pool"]
    core = TorchCore("kda_decode_pool", prep, compute, Precision(torch.float64, torch.device("cpu")))
    slots = np.array(inputs["slots"])
    slots[slots >= 0] = slots[slots >= 0][0]
    with pytest.raises(ValueError, match="slots: expected each slot at most once"):
        core(**{**inputs, "slots": slots}, **kwargs)
