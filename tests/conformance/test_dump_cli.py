"""`k3conf compare`: exit codes, the terminal text, and the report files, on dumps of the tiny model.

The "engine" is k3ref's float32 host graph (conformance.dumps.recorder_ref): once over the checkpoint's own
weights (a clean dump), once with one weight of layer 4's LatentMoE scaled by 1.05 (a planted bug that layer 4's
mlp adds and layers 5 and 6 carry), compared against the unchanged checkpoint.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from conformance.cli import main as cli_main
from conformance.cli.compare import layer_list
from conformance.dumps import Dump, DumpWriter
from conformance.dumps.recorder_ref import record_ref
from conformance.dumps.report_text import ranges, sci
from conformance.dumps.verdict import DumpReport
from k3ref.config import K3Config
from k3ref.cpu_forward import K3CpuModel
from k3ref.cpu_weights import CheckpointWeights
from k3ref.expert_backend import MmapExpertStore
from k3ref.weights import CheckpointReader, synth_checkpoint

PROMPT = np.arange(5) + 3
DECODE = 2                      # decode steps after the prefill
PLANT_LAYER = 4                 # a KDA + MoE layer of tiny, with MLA layers 5 and 6 after it
PLANT = f"language_model.model.layers.{PLANT_LAYER}.block_sparse_moe.routed_expert_up_proj.weight"


def make_checkpoint(root: Path) -> Path:
    return synth_checkpoint(K3Config.preset("tiny"), root / "ckpt")


def record(ckpt: Path, out: Path, *, scale: dict[str, float] | None = None) -> Path:
    """A float32 dump of PROMPT + DECODE steps by k3ref's host graph over the checkpoint's weights, with the
    named weights scaled (the planted bug of an engine that loaded them wrongly)."""
    reader = CheckpointReader(ckpt)
    weights = dict(CheckpointWeights(reader, MmapExpertStore(reader)))
    for name, factor in (scale or {}).items():
        weights[name] = np.asarray(weights[name]) * np.float32(factor)
    model = K3CpuModel(K3Config.from_json(ckpt / "config.json"), weights, np.float32)
    record_ref(model, PROMPT, DECODE, out)
    return out


def rewrite(src: Path, out: Path, edit) -> Path:
    """A copy of the dump at `src` with edit(step, name, array) -> array applied to every tensor."""
    dump = Dump.open(src)
    w = DumpWriter(out, engine=dump.engine, dtype=dump.dtype, config=dump.raw_config, fp32=dump.fp32)
    for i, step in enumerate(dump.steps):
        w.begin_step(step.kind, step.tokens, step.start)
        for name in dump.names(step.index):
            w.put(name, edit(step.index, name, np.array(dump.raw(step.index, name))))
        w.end_step(None if dump.chosen is None else dump.chosen[i])
    w.close()
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(checkpoint, clean dump, planted dump)."""
    root = tmp_path_factory.mktemp("compare")
    ckpt = make_checkpoint(root)
    return ckpt, record(ckpt, root / "clean"), record(ckpt, root / "planted", scale={PLANT: 1.05})


def compare(capsys, *args: str) -> tuple[int, str, str]:
    rc = cli_main(["compare", *map(str, args)])
    out, err = capsys.readouterr()
    return rc, out, err


def layer_lines(out: str) -> dict[int, str]:
    return {int(m[1]): m[0] for m in re.finditer(r"^ +(\d+)  (?:KDA|MLA) .*$", out, re.M)}


def test_a_clean_dump_passes_with_one_line_per_layer(tiny, capsys, tmp_path):
    ckpt, clean, _ = tiny
    rc, out, err = compare(capsys, clean, "--checkpoint", ckpt, "--report", tmp_path)
    assert rc == 0, out + err
    lines = out.splitlines()
    assert lines[0].startswith("source: none"), lines[:3]   # the source line first
    assert lines[1].startswith(f"compared: {clean} ")
    cfg = K3Config.preset("tiny")
    rows = layer_lines(out)
    assert sorted(rows) == list(range(cfg.num_hidden_layers))
    for layer, line in rows.items():
        kinds = line.split()[1:3]
        assert kinds == ["MLA" if cfg.is_mla(layer) else "KDA", "dense" if cfg.mlp_is_dense(layer) else "MoE"]
        assert line.endswith("ok") and " !" not in line
    assert f"tokens: {DECODE + 1} of {DECODE + 1} steps agree" in out
    assert lines[-2].startswith("exit 0")


def test_the_report_files_say_what_the_terminal_says(tiny, capsys, tmp_path):
    ckpt, clean, _ = tiny
    rc, out, _ = compare(capsys, clean, "--checkpoint", ckpt, "--report", tmp_path)
    doc = json.loads((tmp_path / "report.json").read_text())
    report = DumpReport.from_json(doc)
    assert report.exit_code == rc == doc["exit_code"] == 0
    assert doc["run"]["workers"] == 1 and doc["metadata"]["metadata_version"] >= 1
    assert [s.layer for s in report.layers] == sorted(layer_lines(out))
    page = (tmp_path / "report.html").read_text()
    n = len(report.layers)
    assert page.count("<circle class=added ") == n and page.count("<circle class=carried ") == n
    assert page.count("class=budget data-series=added") == 1
    assert "<g class=source>" not in page and "data-series=carried x1" not in page   # no source: no carried line
    assert page.count("<text class=kind ") == 2 * n
    md = (tmp_path / "report.md").read_text()
    assert "source: none" in md and md.count("| ok |") == n


def test_a_planted_bug_is_named_at_its_layer_and_sublayer_with_its_carriers(tiny, capsys, tmp_path):
    ckpt, _, planted = tiny
    rc, out, _ = compare(capsys, planted, "--checkpoint", ckpt, "--report", tmp_path)
    assert rc == 1
    line = out.splitlines()[0]
    m = re.fullmatch(rf"source: layer {PLANT_LAYER} mlp \(rel RMS (\S+) > budget (\S+)(?:; [^()]+)? at step (\d+)"
                     r"(?:, first over at step \d+)?\); carried by layers (.+)", line)
    assert m, line
    assert float(m[1]) > float(m[2])
    assert m[4] == ranges(range(PLANT_LAYER + 1, K3Config.preset("tiny").num_hidden_layers))
    rows = layer_lines(out)
    assert rows[PLANT_LAYER].endswith("source") and all(rows[i].endswith("ok") for i in range(PLANT_LAYER))
    assert all(rows[i].endswith("carrier") for i in range(PLANT_LAYER + 1, len(rows)))
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["source"][:2] == [PLANT_LAYER, "mlp"] and doc["carriers"] == [5, 6]
    page = (tmp_path / "report.html").read_text()
    ring = re.search(r"<g class=source><circle cx=(\S+) cy=(\S+) ", page)
    point = re.search(rf"<circle class=added cx=(\S+) cy=(\S+) r=3 fill='[^']*'><title>layer {PLANT_LAYER} mlp:",
                      page)
    assert ring and point and ring.groups() == point.groups(), "the ring is not on the source layer's point"
    assert page.count("class=budget data-series=carried") == 1   # the source's input: what carriers exceed
    assert f"source: layer {PLANT_LAYER} mlp" in (tmp_path / "report.md").read_text()


def test_nan_in_the_engine_output_is_a_finding_and_the_source(tiny, capsys, tmp_path):
    ckpt, clean, _ = tiny

    def poison(step, name, a):
        if step == 1 and name == "layers.3.f":
            a[0, :4] = np.nan
        return a

    nan = rewrite(clean, tmp_path / "nan", poison)
    rc, out, err = compare(capsys, nan, "--checkpoint", ckpt, "--no-free-run")
    assert rc == 1 and "Traceback" not in err
    assert out.splitlines()[0].startswith("source: layer 3 mlp (4 non-finite engine values at step 1")
    assert re.search(r"^finding: .*step 1 layer 3", out, re.M), out


def test_a_truncated_dump_is_a_named_error_not_a_traceback(tiny, capsys, tmp_path):
    ckpt, clean, _ = tiny
    bad = Path(shutil.copytree(clean, tmp_path / "bad"))
    f = bad / "rank0" / "step0001.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    rc, out, err = compare(capsys, bad, "--checkpoint", ckpt)
    assert rc == 2 and out == ""
    assert err.startswith("k3conf compare: ") and "step0001" in err and "Traceback" not in err


def test_usage_errors_exit_2_naming_what_was_expected(tiny, capsys, tmp_path):
    ckpt, clean, _ = tiny
    rc, _, err = compare(capsys, clean, "--checkpoint", ckpt, "--layers", "2,9")
    assert rc == 2 and "dumped layers [0, 1, 2, 3, 4, 5, 6], found [9]" in err
    rc, _, err = compare(capsys, clean, "--checkpoint", tmp_path)
    assert rc == 2 and "config.json" in err
    rc, _, err = compare(capsys, clean, "--checkpoint", ckpt, "--distributed")
    assert rc == 2 and "RANK and WORLD_SIZE" in err


def test_layers_and_no_free_run_judge_only_what_was_asked(tiny, capsys):
    ckpt, clean, _ = tiny
    rc, out, _ = compare(capsys, clean, "--checkpoint", ckpt, "--layers", "1,3", "--no-free-run")
    assert rc == 0 and sorted(layer_lines(out)) == [1, 3]
    assert "tokens: not checked (no free run)" in out
    assert all(line.split()[-2] == "-" for line in layer_lines(out).values())   # no carried number


def test_json_prints_the_report_json(tiny, capsys):
    ckpt, _, planted = tiny
    rc, out, _ = compare(capsys, planted, "--checkpoint", ckpt, "--json", "--layers", "3-5", "--no-free-run")
    doc = json.loads(out)
    assert rc == doc["exit_code"] == 1 and doc["source"][:2] == [PLANT_LAYER, "mlp"]
    assert [s["layer"] for s in doc["layers"]] == [3, 4, 5]


@pytest.mark.parametrize("x, want", [(3.14e-2, "3.1e-2"), (1e-5, "1.0e-5"), (0.0, "0"), (float("nan"), "nan"),
                                     (None, "-"), (250.0, "2.5e2")])
def test_numbers_are_short(x, want):
    assert sci(x) == want


def test_ranges_and_layer_lists():
    assert ranges([9, 0, 1, 2, 3, 7, 10]) == "0..3, 7, 9..10"
    assert layer_list("0-3,7") == [0, 1, 2, 3, 7]
    with pytest.raises(Exception, match="expected layer numbers"):
        layer_list("1,x")
