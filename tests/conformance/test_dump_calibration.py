"""The measured side of `k3conf compare`: budget tables (built, read, keyed by geometry), `k3conf calibrate`, the
whole-layer row as amplification, tokens judged against the measured near tie, the KDA state fingerprint, the
control dump's relative verdict, and a small sample of tools/compare_rates.py as a guard of the published rates.

Engines are k3torch's model (float32 unless said: deterministic and fast) and k3ref's host graph at float32."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from conformance.cli import main as cli_main
from conformance.dumps.budgets import (
    ANY,
    CONTROL_RATIO,
    MARGIN,
    ROWS,
    TOKEN_TIE,
    BudgetTable,
    default_table,
    geometry_of,
    round_up,
)
from conformance.dumps.calibrate import DumpStats, read_table, table_json, write_json
from conformance.dumps.control import common_steps, judge_against
from conformance.dumps.format import Dump
from conformance.dumps.free_run import FreeRun, StepTokens
from conformance.dumps.planted import kda_state_bf16, plant
from conformance.dumps.recompute import recompute_layer
from conformance.dumps.verdict import assemble, compare_dump
from k3ref.config import K3Config
from k3ref.weights import synthetic_checkpoint

torch = pytest.importorskip("torch", reason="PyTorch is not installed: pip install 'k3-conformance[torch]'")

from conformance.dumps.recorder import record_torch  # noqa: E402
from k3torch.modeling_k3 import K3ForCausalLM  # noqa: E402

SEED = 7
RATES = Path(__file__).resolve().parents[2] / "tools" / "compare_rates.py"


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return synthetic_checkpoint(K3Config.preset("tiny"), SEED, tmp_path_factory.mktemp("tiny"))


def _record(ckpt, out, *, dtype=torch.float32, seed=3, length=8, new=4, bug=None, state_bf16=False):
    model = K3ForCausalLM.from_pretrained(ckpt, dtype=dtype)
    if bug is not None:
        plant(model, bug[0], bug[1])
    if state_bf16:
        kda_state_bf16(model)
    prompt = np.random.default_rng(seed).integers(0, K3Config.preset("tiny").vocab_size, length)
    return record_torch(model, prompt, new, out, overwrite=True)


# --- tables ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("x", "up"), [pytest.param(1.231e-3, 1.3e-3, id="up"),
                                       pytest.param(2.0e-2, 2.0e-2, id="exact"), pytest.param(9.91, 10.0, id="carry"),
                                       pytest.param(0.0, 0.0, id="zero")])
def test_round_up_keeps_two_digits_and_never_rounds_down(x, up):
    assert round_up(x) == pytest.approx(up) and round_up(x) >= x


def test_a_table_is_margin_times_the_worst_dump_per_row_and_reads_back(tmp_path):
    stats = [DumpStats("a", "tiny", "bfloat16", {"mixer": 1.0e-3, TOKEN_TIE: 0.3, "carried": 0.1}),
             DumpStats("b", "tiny", "bfloat16", {"mixer": 3.1e-3, TOKEN_TIE: 0.2}),
             DumpStats("c", "k3geom", "bfloat16", {"mixer": 9.0e-3})]
    doc = table_json(stats, command="test", engine="test engine")
    write_json(tmp_path / "t.json", doc)
    table = read_table(tmp_path / "t.json")
    assert table.row("tiny", "bfloat16", "mixer").limit == pytest.approx(round_up(MARGIN * 3.1e-3))
    assert table.row("tiny", "bfloat16", "mixer").measured["n"] == 2
    largest = round_up(MARGIN * 9.0e-3)
    assert table.row("k3geom", "bfloat16", "mixer").limit == pytest.approx(largest)
    other = table.row("other", "bfloat16", "mixer")           # an unmeasured geometry: the largest, said so
    assert other.geometry == ANY and other.limit == pytest.approx(largest) and "'other'" in other.reason
    assert table.row("tiny", "float64", "mixer").limit == 1e-10       # float64 rows are not measured
    assert "carried" not in {k for _, _, k in table.rows} and doc["carried_max"] == {"tiny bfloat16": 0.1}
    with pytest.raises(ValueError, match="float16"):
        table.row("tiny", "float16", "mixer")
    with pytest.raises(ValueError, match="k3conf-budgets"):
        BudgetTable.from_json({"format": "other"})


def test_the_committed_table_covers_each_shipped_config_and_dtype_with_its_measurement():
    table = default_table()
    for geometry in ("tiny", "k3geom"):
        for dtype in ("bfloat16", "float32"):
            for key in ROWS:
                row = table.row(geometry, dtype, key)
                assert row.geometry == geometry and row.measured["n"] >= 1, (geometry, dtype, key)
                assert row.limit >= row.measured["max"] * MARGIN * 0.999
        assert table.row(geometry, "float32", CONTROL_RATIO).limit > 1
    assert geometry_of(K3Config.preset("tiny")) == "tiny" and geometry_of(K3Config.preset("k3")) == "k3"


def test_calibrate_writes_a_table_that_compare_judges_by(ckpt, tmp_path, capsys):
    dumps = [_record(ckpt, tmp_path / f"d{s}", seed=s) for s in (11, 12)]
    out = tmp_path / "budgets.json"
    assert cli_main(["calibrate", *map(str, dumps), "--checkpoint", str(ckpt), "--out", str(out)]) == 0
    table = read_table(out)
    assert table.row("tiny", "float32", "mixer").measured["n"] == 2
    capsys.readouterr()
    assert cli_main(["compare", str(dumps[0]), "--checkpoint", str(ckpt), "--budgets", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["budgets"]["mixer"] == table.row("tiny", "float32", "mixer").limit
    assert str(out) in doc["budget_source"]
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert cli_main(["compare", str(dumps[0]), "--checkpoint", str(ckpt), "--budgets", str(bad)]) == 2


# --- the verdict ----------------------------------------------------------------------------------------------------

def _results(ckpt, dump):
    return [recompute_layer(dump, ckpt, la) for la in Dump.open(dump).layers]


def test_a_whole_layer_row_over_with_every_sublayer_within_is_amplification_not_a_source(ckpt, tmp_path):
    dump = _record(ckpt, tmp_path / "d")
    results = _results(ckpt, dump)
    d = Dump.open(dump)
    base = default_table().bound("tiny")

    def layer_tight(dtype, key):
        return 0.0 if key == "layer" else base(dtype, key)
    report = assemble(d, results, None, layer_tight)
    assert report.source is None and report.exit_code == 0
    assert len(report.amplification) == len(results)
    assert report.amplification[0].startswith("layer 0: whole layer rel RMS")
    assert "every sublayer is within its budget" in report.amplification[0]

    def mixer_tight(dtype, key):
        return 0.0 if key in ("layer", "mixer") else base(dtype, key)
    report = assemble(d, results, None, mixer_tight)           # a sublayer over: that is the source
    assert report.source == (0, "mixer", 0) and report.amplification == [] and report.exit_code == 1


@pytest.mark.parametrize(("gap", "fails"), [pytest.param(0.3, False, id="near-tie"),
                                            pytest.param(0.9, True, id="clear-margin")])
def test_a_greedy_flip_fails_only_past_the_measured_near_tie(ckpt, tmp_path, gap, fails):
    dump = _record(ckpt, tmp_path / "d", new=1)
    d = Dump.open(dump)
    free = FreeRun({}, [StepTokens(0, 5, 5, 1.0, 0.0), StepTokens(1, 7, 9, 0.76, gap)])
    base = default_table().bound("tiny")

    def tie(dtype, key):
        return 0.5 if key == TOKEN_TIE else base(dtype, key)
    report = assemble(d, _results(ckpt, dump), free, tie)
    assert report.token_failures == ([1] if fails else [])
    assert report.exit_code == int(fails)


# --- precision ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("state_bf16", "verdict"), [pytest.param(False, "fp32 or wider", id="fp32-state"),
                                                     pytest.param(True, "bf16", id="bf16-state")])
def test_the_kda_state_precision_is_inferred_from_the_dump(ckpt, tmp_path, state_bf16, verdict):
    report = compare_dump(_record(ckpt, tmp_path / "d", state_bf16=state_bf16), ckpt)
    assert report.kda_state is not None and report.kda_state.verdict == verdict, report.kda_state
    assert report.kda_state.layers == [la for la in range(7) if not K3Config.preset("tiny").is_mla(la)]
    assert len(report.kda_state.drift) == 4


# --- control --------------------------------------------------------------------------------------------------------

def test_a_bf16_state_against_an_fp32_state_control_names_the_state_not_a_layer(ckpt, tmp_path):
    cand = compare_dump(_record(ckpt, tmp_path / "c", state_bf16=True), ckpt)
    ctrl = compare_dump(_record(ckpt, tmp_path / "k"), ckpt)
    verdict = judge_against(cand, ctrl, default_table().row("tiny", "float32", CONTROL_RATIO).limit)
    assert verdict.source is None and verdict.exit_code == 1
    assert any(p.startswith("KDA mixer of every KDA layer") for p in verdict.precision), verdict.precision
    assert any(p.startswith("KDA state bf16 in the candidate, fp32 or wider in the control")
               for p in verdict.precision), verdict.precision


def test_two_correct_engines_judged_against_each_other_pass(ckpt, tmp_path, capsys):
    """k3torch's float32 model against k3ref's host graph at float32, the same prompt, through the CLI."""
    from conformance.dumps.recorder_ref import record_ref  # noqa: PLC0415 -- k3ref's recorder, this test only
    from k3ref.cpu_forward import K3CpuModel  # noqa: PLC0415 -- as above

    cand = _record(ckpt, tmp_path / "c", seed=21)
    prompt = np.random.default_rng(21).integers(0, K3Config.preset("tiny").vocab_size, 8)
    ctrl = record_ref(K3CpuModel.from_checkpoint(ckpt, dtype=np.float32), prompt, 4, tmp_path / "k")
    rc = cli_main(["compare", str(cand), "--checkpoint", str(ckpt), "--control", str(ctrl), "--no-free-run"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "relative: every sublayer within the control's error" in out
    other = _record(ckpt, tmp_path / "o", seed=22)
    assert cli_main(["compare", str(cand), "--checkpoint", str(ckpt), "--control", str(other)]) == 2


def test_a_layer_bug_against_a_correct_control_is_the_relative_source(ckpt, tmp_path):
    """Only the steps both ran on the same tokens count: the bug changes the greedy tokens, and the earlier
    layers' later steps then run on other inputs."""
    a, b = _record(ckpt, tmp_path / "c", bug=("mla_gate_silu", 5)), _record(ckpt, tmp_path / "k")
    cand, ctrl = compare_dump(a, ckpt, free=False), compare_dump(b, ckpt, free=False)
    steps = common_steps(Dump.open(a), Dump.open(b))
    assert steps >= 1
    verdict = judge_against(cand, ctrl, default_table().row("tiny", "float32", CONTROL_RATIO).limit, steps)
    assert verdict.source == (5, "mixer") and verdict.precision == [] and verdict.exit_code == 1


# --- the published rates, a small sample ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rates():
    spec = importlib.util.spec_from_file_location("compare_rates_under_test", RATES)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    yield mod
    del sys.modules[spec.name]


def test_clean_engines_over_fresh_prompts_name_no_source(rates, tmp_path):
    result = rates.clean("tiny", "bfloat16", 6, tmp_path)
    assert result["prompts"] == 6
    assert result["false_sources"] == 0 and result["token_failures"] == 0, result


def test_planted_bugs_over_fresh_prompts_are_named_at_their_layer_and_sublayer(rates, tmp_path):
    result = rates.bugs("tiny", "bfloat16", 2, tmp_path, only=["kda_beta_sign", "attnres_mlp_temp",
                                                                "shared_expert_scale", "kda_decay_decode"])
    assert result["runs"] >= 20 and result["correct_layer_blamed"] == 0, result["exceptions"]
    assert result["named_right"] == result["runs"], result["exceptions"]


def test_the_corpus_spans_every_sublayer_and_several_layers_per_kind(rates):
    pairs = rates.corpus("tiny")
    kinds = {b for b, _ in pairs}
    assert len(kinds) >= 13
    assert {"attnres_mixer", "mixer", "attnres_mlp", "mlp"} <= {rates.EXPECTED_SUBLAYER[b] for b in kinds}
    several = [b for b in kinds if len({la for k, la in pairs if k == b}) >= 3]
    assert len(several) >= 11, sorted(kinds - set(several))

