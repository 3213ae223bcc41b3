"""K3Config validation of the numbers the forward divides or scales by, and misspelled config.json keys."""
from __future__ import annotations

import dataclasses
import json
import re

import pytest

from k3ref.config import K3Config

TINY = K3Config.preset("tiny")


@pytest.mark.parametrize("field", ["situ_beta", "situ_linear_beta", "routed_scaling_factor"])
@pytest.mark.parametrize("value", [0.0, -1.0, -0.0])
def test_non_positive_betas_and_routed_scale_are_refused_naming_field_and_value(field, value):
    with pytest.raises(ValueError, match=rf"config: {field} must be > 0, found {re.escape(str(value))}"):
        dataclasses.replace(TINY, **{field: value})


@pytest.mark.parametrize("field", ["situ_beta", "situ_linear_beta", "routed_scaling_factor"])
def test_positive_betas_and_routed_scale_are_accepted(field):
    assert getattr(dataclasses.replace(TINY, **{field: 2.5}), field) == 2.5


def _published(**extra) -> dict:
    """tiny in the published spelling, plus `extra` top-level keys (`lac_` ones go into linear_attn_config)."""
    text = TINY.to_json()
    for key, value in extra.items():
        if key.startswith("lac_"):
            text["linear_attn_config"][key[4:]] = value
        else:
            text[key] = value
    return text


@pytest.mark.parametrize("extra, message", [
    pytest.param({"rms_norm_esp": 1e-6}, "unknown field 'rms_norm_esp' in config.json; did you mean 'rms_norm_eps'?",
                 id="rms_norm_esp"),
    pytest.param({"routed_scaling_facter": 2.0}, "did you mean 'routed_scaling_factor'?", id="routed-scaling"),
    pytest.param({"num_experts_per_tokn": 2}, "did you mean 'num_experts_per_token'?", id="published-spelling"),
    pytest.param({"lac_num_head": 4}, "unknown field 'linear_attn_config.num_head' in config.json; did you mean "
                                      "'linear_attn_config.num_heads'?", id="nested"),
])
def test_misspelled_field_is_named_with_the_field_it_resembles(extra, message, tmp_path):
    with pytest.raises(ValueError, match=re.escape(message)):
        K3Config.from_json(_published(**extra))
    (tmp_path / "config.json").write_text(json.dumps({"text_config": _published(**extra)}))
    with pytest.raises(ValueError, match=re.escape(message)):
        K3Config.from_json(tmp_path)


def test_unknown_fields_unlike_any_known_one_are_ignored():
    """Published configs carry keys this geometry does not use (some resembling known ones): still accepted."""
    extra = {"rope_theta": 50000.0, "bos_token_id": 1, "torch_dtype": "bfloat16", "qk_head_dim": 192,
             "quantization_config": {"quant_method": "mxfp4"}, "max_position_embeddings": 262144,
             "num_nextn_predict_layers": 0, "lac_head_dim": TINY.kda_head_dim}
    assert K3Config.from_json(_published(**extra)) == TINY
