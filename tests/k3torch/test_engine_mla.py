"""k3torch's engine-shaped MLA cores against k3ref.engine.mla: float64 agreement on the tiny cases' inputs, the bf16
error against the float64 reference (measured and capped), the e4m3 table, and a wrong mask that must disagree."""
from __future__ import annotations

import numpy as np
import pytest

from tests.support.strict import import_or_skip  # noqa: E402

torch = import_or_skip("torch")

from conformance.cases import engine_mla as cases  # noqa: E402
from conformance.cases.inputs import cast  # noqa: E402
from k3ref import fp8  # noqa: E402
from k3ref.engine import mla as ref  # noqa: E402
from k3torch.cores import TorchCore, precision  # noqa: E402
from k3torch.engine_mla import CORES, e4m3_table  # noqa: E402
from tests.support.tolerances import rel_rms  # noqa: E402

pytestmark = pytest.mark.torch

# name: (relative-RMS tolerance, reason)
AGREE_TOL: dict[str, tuple[float, str]] = {
    "fp64_agreement": (1e-10, "two independent float64 implementations (NumPy k3ref, torch) of one formula: "
                              "sums of a few hundred terms in another order"),
}
# core: (cap on relative RMS vs the float64 reference, measured worst over the tiny cases (seed 0, CPU), reason):
# a cap is ~2.5x the measurement, as k3torch's other cores
BF16_CAP: dict[str, tuple[float, float, str]] = {
    "mla_decode_fp8": (1.1e-2, 4.3e-3, "q_abs, k_pe and the dequantised c rounded to bf16 (the FP8 codes and fp32 "
                                       "scales are exact inputs), probabilities rounded for PV, o_lat rounded"),
    "mla_prefill": (1e-2, 4.0e-3, "q, k, v rounded to bf16, fp32 softmax, probabilities rounded for PV, o "
                                  "rounded (lse, fp32 from bf16 scores: 1.5e-3)"),
}

TINY = [pytest.param(name, params, id=name) for name, params in cases.TABLE["tiny"]
        if name.split("/")[0] in cases.SPECS]


def _core(name: str, dtype, **knobs) -> TorchCore:
    prep, compute = CORES[name]
    return TorchCore(name, prep, compute, precision(dtype, "cpu"), **knobs)


def _case(name: str, params: dict):
    spec = cases.SPECS[name.split("/")[0]]
    inputs, kwargs = spec.make(np.random.default_rng(0), **params)
    return spec, inputs, kwargs


def _outputs(spec, inputs, result) -> dict[str, np.ndarray]:
    vals = result if isinstance(result, tuple) else (result,)
    return spec.normal_form(inputs, dict(zip(spec.outputs, vals, strict=True)))


@pytest.mark.parametrize("name, params", TINY)
def test_float64_agrees_with_k3ref(name, params):
    spec, inputs, kwargs = _case(name, params)
    want = _outputs(spec, inputs, getattr(ref, spec.core)(**inputs, **kwargs))
    got = _outputs(spec, inputs, _core(spec.core, torch.float64)(**inputs, **kwargs))
    for out in spec.outputs:
        assert got[out].dtype == np.float64
        assert rel_rms(got[out], want[out]) <= AGREE_TOL["fp64_agreement"][0], out


@pytest.mark.parametrize("name, params", TINY)
def test_bf16_error_is_within_its_cap(name, params):
    spec, inputs, kwargs = _case(name, params)
    want = _outputs(spec, inputs, getattr(ref, spec.core)(**inputs, **kwargs))
    bf16_inputs = {k: cast(v, "fp32" if k in spec.fp32_inputs else "bf16") for k, v in inputs.items()}
    got = _outputs(spec, inputs, _core(spec.core, torch.bfloat16)(**bf16_inputs, **kwargs))
    cap = BF16_CAP[spec.core][0]
    for out in spec.outputs:
        err = rel_rms(got[out], want[out])
        assert 0 < err <= cap, f"{out}: bf16 relative RMS {err:.3g} (cap {cap})"


def test_e4m3_table_is_torch_float8_e4m3fn():
    codes = torch.arange(256, dtype=torch.uint8)
    want = codes.view(torch.float8_e4m3fn).to(torch.float64)
    assert torch.equal(torch.isnan(e4m3_table()), torch.isnan(want))
    finite = ~torch.isnan(want)
    assert torch.equal(e4m3_table()[finite], want[finite])
    np.testing.assert_array_equal(e4m3_table().numpy()[finite.numpy()], fp8.VALUES[finite.numpy()])


def test_top_left_mask_disagrees_on_a_cached_prefix():
    """The knob that aligns the causal mask top-left: right where q_n == k_n, wrong on the prefixed sequence."""
    name, params = next((n, p) for n, p in cases.TABLE["tiny"] if n.startswith("mla_prefill/1of7"))
    spec, inputs, kwargs = _case(name, params)
    want_o, _ = ref.mla_prefill(**inputs, **kwargs)
    got_o, _ = _core("mla_prefill", torch.float64, _top_left=True)(**inputs, **kwargs)
    assert rel_rms(got_o[:1], want_o[:1]) > 1e-2                  # 1 new token after a 6-token prefix
    assert rel_rms(got_o[1:], want_o[1:]) <= AGREE_TOL["fp64_agreement"][0]     # 4 of 4: no prefix


def test_padded_rows_are_zero_and_their_block_table_is_not_read():
    name, params = next((n, p) for n, p in cases.TABLE["tiny"] if n.startswith("mla_decode_fp8/B4"))
    spec, inputs, kwargs = _case(name, params)
    inputs = dict(inputs, block_table=inputs["block_table"].copy())
    padded = inputs["seq_lens"] == 0
    inputs["block_table"][padded] = -1
    o_lat = _core(spec.core, torch.float64)(**inputs, **kwargs)
    assert padded.any() and np.all(o_lat[padded] == 0) and np.all(np.isfinite(o_lat))


def test_bad_codes_dtype_names_what_was_expected():
    name, params = next((n, p) for n, p in cases.TABLE["tiny"] if n.startswith("mla_decode_fp8/"))
    spec, inputs, kwargs = _case(name, params)
    with pytest.raises(ValueError, match="kv_fp8: expected uint8 e4m3 codes, found dtype float64"):
        _core(spec.core, torch.float64)(**dict(inputs, kv_fp8=inputs["kv_fp8"].astype(np.float64)), **kwargs)
