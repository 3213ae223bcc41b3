"""The routing paths no preset takes, compared between k3ref and the torch model (k3torch).

Every shipped preset routes with routed_scaling_factor 1, one expert group and renormalised weights, so a torch
model that dropped the scaling factor, grouped wrongly or always renormalised would agree with k3ref on all of
them. ROUTING_VARIANT is `tiny` with a scaling factor of 2.5, two expert groups (one kept) and no
renormalisation, and without the latent norm, which would divide any per-token scale of the routing weights
(the scaling factor, a renormalisation) away again. Both implementations run it on the same weights.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: pip install 'k3-conformance[torch]'")

from conformance.backends.torch_model import AGREEMENT_RTOL, first_disagreement  # noqa: E402
from conformance.cases import traces  # noqa: E402
from k3ref.config import K3Config as RefConfig  # noqa: E402
from k3ref.cores import reference_cores  # noqa: E402
from k3ref.cpu_forward import K3CpuModel  # noqa: E402
from k3ref.greedy import greedy_decode  # noqa: E402
from k3ref.weights import synthetic_weights  # noqa: E402
from k3torch import trace as tm_trace  # noqa: E402
from k3torch.configuration_k3 import K3Config  # noqa: E402
from k3torch.modeling_k3 import K3Router  # noqa: E402
from tests.support.tolerances import rel_rms  # noqa: E402

pytestmark = pytest.mark.torch
SEED = 7
ROUTING_VARIANT = dataclasses.replace(RefConfig.preset("tiny"), n_routed_experts=8, n_group=2, topk_group=1,
                                      norm_topk_prob=False, routed_scaling_factor=2.5, latent_moe_use_norm=False)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Toy tensors: a second intra-op thread only adds synchronisation on a loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference():
    """(weights, tokens, k3ref's trace tensors) of ROUTING_VARIANT at float64."""
    weights = synthetic_weights(ROUTING_VARIANT, SEED)
    model = K3CpuModel(ROUTING_VARIANT, weights, np.float64)
    tokens = np.array(list(traces.PROMPT) + greedy_decode(model, list(traces.PROMPT), traces.DECODE_STEPS).tokens,
                      dtype=np.int64)
    return weights, tokens, traces.Stepper(model, reference_cores()).run(tokens)


def _torch_trace(weights, tokens) -> dict[str, np.ndarray]:
    model = tm_trace.build_model(ROUTING_VARIANT.to_json(), weights, "fp64")
    return tm_trace.run_trace(model, tokens, len(traces.PROMPT))


def _worst(ref: dict, got: dict) -> tuple[float, str]:
    return max((rel_rms(got[n], ref[n]), n) for n in ref if np.asarray(ref[n]).dtype.kind == "f")


def test_the_variant_takes_the_paths_no_preset_takes():
    torch_cfg = K3Config.from_dict(ROUTING_VARIANT.to_json())
    for cfg in (ROUTING_VARIANT, torch_cfg):
        assert (cfg.routed_scaling_factor, cfg.n_group, cfg.norm_topk_prob) == (2.5, 2, False)
        assert cfg.topk_group < cfg.n_group   # a group is dropped, so the group rule decides something


def test_every_layer_and_the_logits_agree_on_the_variant(reference):
    weights, tokens, ref = reference
    got = _torch_trace(weights, tokens)
    assert sorted(got) == sorted(ref)
    assert first_disagreement(ref, got) is None
    worst, where = _worst(ref, got)
    assert worst <= AGREEMENT_RTOL, f"{where}: rel RMS {worst:.3g} > {AGREEMENT_RTOL:g}"
    logits = [n for n in ref if n.endswith(".logits")]
    assert len(logits) == traces.DECODE_STEPS + 1
    assert all(rel_rms(got[n], ref[n]) <= AGREEMENT_RTOL for n in logits)


def _dropping_the_scaling_factor(forward):
    def route(self, x):
        w, idx = forward(self, x)
        return w / self.config.routed_scaling_factor, idx
    return route


def test_a_torch_model_that_drops_the_scaling_factor_disagrees(reference, monkeypatch):
    weights, tokens, ref = reference
    monkeypatch.setattr(K3Router, "forward", _dropping_the_scaling_factor(K3Router.forward))
    got = _torch_trace(weights, tokens)
    first = first_disagreement(ref, got)
    assert first is not None, "the torch model without routed_scaling_factor still agrees with k3ref"
    assert ".6_f" in str(first), first   # the first MoE output is where it shows
    assert _worst(ref, got)[0] > 100 * AGREEMENT_RTOL
