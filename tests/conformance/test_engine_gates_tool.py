"""tools/engine_gates.py (docs/why.md): the engine gates as it reads them, and its planted bugs doing what they say.
(tools/ is not a package: the script is loaded from its path, as `python tools/engine_gates.py` runs it.)"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from conformance.cases.core_data import BUILDERS
from conformance.cases.inputs import cast
from k3ref.cores import reference_cores
from tests.support.tolerances import rel_rms

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "engine_gates.py"
pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("engine_gates_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("scale, vllm, trtllm", [
    pytest.param(1.02, True, True, id="2pct-passes-both"),
    pytest.param(1.05, False, False, id="5pct-fails-both"),
])
def test_the_attnres_gates_as_read(tool, scale, vllm, trtllm):
    ref = 10 * np.random.default_rng(0).standard_normal((16, 64))     # |ref| > 4: the 3% rtol binds
    out = ref * scale
    assert tool.engine_gate("vllm-attnres", out, ref, ref)[0] is vllm
    assert tool.engine_gate("trtllm-attnres", out, ref, ref)[0] is trtllm


def test_the_kda_gate_as_read(tool):
    ref = np.random.default_rng(1).standard_normal(1000)
    assert tool.engine_gate("vllm-kda", ref * 1.004, ref, ref)[0] is True
    assert tool.engine_gate("vllm-kda", ref * 1.006, ref, ref)[0] is False
    with pytest.raises(ValueError, match="expected one of"):
        tool.engine_gate("gsm8k", ref, ref, ref)


def test_planted_attnres_bugs_do_what_they_say(tool):
    inputs, kwargs = BUILDERS["attnres_mix"](np.random.default_rng(2), S=3, lead=(4,), D=64)
    x = {k: cast(v, "bf16") for k, v in inputs.items()}
    base = tool._torch_bf16()
    right = np.asarray(base.attnres_mix(**x, **kwargs))
    scaled = tool.plant_attnres_scale_2pct(base).attnres_mix(**x, **kwargs)
    assert rel_rms(scaled, right) == pytest.approx(0.02, rel=0.05)
    scores = tool.plant_attnres_bf16_scores(base).attnres_mix(**x, **kwargs)
    ref = reference_cores().attnres_mix(**inputs, **kwargs)
    assert 0 < rel_rms(scores, ref) < 0.05
    assert np.array_equal(tool.plant_attnres_bf16_scores(base).attnres_mix(**x, mix=0.5, eps=kwargs["eps"]),
                          np.asarray(base.attnres_mix(**x, mix=0.5, eps=kwargs["eps"])))


def test_planted_kda_bugs_do_what_they_say(tool):
    inputs, kwargs = BUILDERS["kda_prefill"](np.random.default_rng(3), B=1, T=5, H=2, K=8, V=8)
    base = tool._torch_bf16()
    _, state = tool.plant_kda_bf16_state(base).kda_prefill(**inputs, **kwargs)
    assert np.array_equal(state, tool.bf16(state)), "the state comes back bf16-representable"
    o_right, _ = base.kda_prefill(**inputs, **kwargs)
    o_slip, _ = tool.plant_kda_last_head_gate(base).kda_prefill(**inputs, **kwargs)
    o_right, o_slip = np.asarray(o_right), np.asarray(o_slip)
    assert np.array_equal(o_right[:, :, 0], o_slip[:, :, 0]) and not np.array_equal(o_right[:, :, 1], o_slip[:, :, 1])


def test_each_bug_is_a_backend_the_cli_can_load(tool):
    for name in tool.PLANTED:
        backend = getattr(tool, name.replace("-", "_"))()
        assert backend.name == f"planted-{name}" and backend.precision == "bf16"
