"""What a new user reads from three commands: `k3conf decode` labels its output (and `--ids-only` keeps the bare
ids for scripts), `k3conf admit` refuses a checkpoint of another config in a few lines naming the config it fits,
and `k3conf model info --device-memory GIB` says whether each rank fits a device of that size, by how much."""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from conformance.cli import main as cli_main
from k3ref.config import K3Config
from k3ref.cpu_forward import K3CpuModel
from k3ref.greedy import greedy_decode
from k3ref.tp import TpPlan
from k3ref.weights import synthetic_checkpoint

# ----- k3conf decode -----

PROMPT = [5, 17, 3]
MAX_NEW = 4


@pytest.fixture(scope="module")
def tiny_tokens() -> list[int]:
    """The greedy tokens of the tiny synthetic model (seed 0, float64), which `k3conf decode` defaults to."""
    model = K3CpuModel.synthetic(K3Config.preset("tiny"), 0, np.float64)
    return greedy_decode(model, PROMPT, MAX_NEW).tokens


DECODE = ["decode", "--prompt", ",".join(map(str, PROMPT)), "--max-new", str(MAX_NEW)]


def test_decode_labels_the_prompt_each_step_and_the_generated_ids(tiny_tokens, capsys):
    assert cli_main(DECODE) == 0
    lines = capsys.readouterr().out.splitlines()
    ids = ",".join(map(str, tiny_tokens))
    assert lines == [f"prompt ids (3): {','.join(map(str, PROMPT))}",
                     *(f"step {i + 1} (position {len(PROMPT) + i}): token id {t}" for i, t in enumerate(tiny_tokens)),
                     f"generated ids ({MAX_NEW}): {ids}"]


def test_decode_ids_only_prints_the_generated_ids_alone(tiny_tokens, capsys):
    assert cli_main([*DECODE, "--ids-only"]) == 0
    assert capsys.readouterr().out == ",".join(map(str, tiny_tokens)) + "\n"


# ----- k3conf admit: a checkpoint of another config -----

@pytest.fixture(scope="module")
def synth_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    """`k3conf synth DIR --config NAME --layers L`, once per (config, layers): the folder written."""
    made: dict[tuple[str, str], Path] = {}

    def make(config: str, layers: str) -> Path:
        if (config, layers) not in made:
            out = tmp_path_factory.mktemp(f"synth-{config}") / "ckpt"
            assert cli_main(["synth", str(out), "--config", config, "--layers", layers]) == 0
            made[config, layers] = out
        return made[config, layers]
    return make


# at most this many lines say that a checkpoint is another config's (the listing it replaces ran to 497,082)
REFUSAL_LINES = 4


@pytest.mark.parametrize("written, layers, admitted_as, extra, embedding", [
    pytest.param("tiny", "0-6", "k3", [], "[97, 36] (vocab, hidden), the config has [163840, 7168]", id="tiny-as-k3"),
    pytest.param("tiny", "0-6", "k3geom", [], "[97, 36] (vocab, hidden), the config has [97, 32]",
                 id="tiny-as-k3geom"),
    pytest.param("k3geom", "0-4", "tiny", [], "[97, 32] (vocab, hidden), the config has [97, 36]",
                 id="k3geom-as-tiny"),
    pytest.param("tiny", "1,3", "k3geom", ["--layers", "1"], "[97, 36] (vocab, hidden), the config has [97, 32]",
                 id="tiny-layers-as-k3geom-layers"),
])
def test_admit_refuses_another_configs_checkpoint_naming_the_one_it_fits(synth_dir, written, layers, admitted_as,
                                                                         extra, embedding, capsys):
    ckpt = synth_dir(written, layers)
    capsys.readouterr()   # what synth printed
    assert cli_main(["admit", str(ckpt), "--config", admitted_as, *extra]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == REFUSAL_LINES, lines
    assert lines[0].startswith(f"REJECTED  {ckpt}: not a checkpoint of config {admitted_as}: ")
    assert f"embed_tokens.weight is {embedding}" in lines[1]
    assert re.fullmatch(rf"  it looks like preset '{written}' \(its own config\.json\): (\d+) of \1 tensors match "
                        r"by name and shape", lines[2]), lines[2]
    assert lines[3] == f"  admit it as that: k3conf admit {ckpt}" + "".join(f" {a}" for a in extra)
    assert cli_main(lines[3].split("k3conf ", 1)[1].split()) == 0   # the command it names admits the checkpoint
    assert "ADMITTED" in capsys.readouterr().out


@pytest.mark.parametrize("argv, found", [
    pytest.param([], "missing ", id="other-layers-missing"),
    pytest.param(["--layers", "2"], "missing ", id="asked-layer-not-held"),
])
def test_a_checkpoint_of_the_config_lacking_layers_is_listed_not_called_foreign(synth_dir, argv, found, capsys):
    """tiny's layers 1 and 3 admitted as tiny: the same config, missing tensors: every problem is listed."""
    ckpt = synth_dir("tiny", "1,3")
    assert cli_main(["admit", str(ckpt), "--config", "tiny", *argv]) == 1
    out = capsys.readouterr().out
    assert "not a checkpoint of config" not in out and found in out and "REJECTED" in out


@pytest.fixture(scope="module")
def wide_vocab(tmp_path_factory):
    """A checkpoint of tiny with another vocabulary, its config.json beside it (no preset)."""
    cfg = dataclasses.replace(K3Config.preset("tiny"), vocab_size=131)
    return synthetic_checkpoint(cfg, 1, tmp_path_factory.mktemp("wide-vocab"))


def test_a_few_misshaped_tensors_are_listed_not_called_another_config(wide_vocab, capsys):
    assert cli_main(["admit", str(wide_vocab), "--config", "tiny"]) == 1
    out = capsys.readouterr().out
    assert "not a checkpoint of config" not in out
    assert "embed_tokens.weight: expected [97, 36], found [131, 36]" in out


def test_the_checkpoints_own_config_json_is_named_when_no_preset_fits(wide_vocab, capsys):
    assert cli_main(["admit", str(wide_vocab), "--config", "k3"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].startswith(f"  it looks like its own {wide_vocab / 'config.json'}: ")
    assert lines[3] == f"  admit it as that: k3conf admit {wide_vocab}"


def test_a_checkpoint_that_fits_no_config_says_so(tmp_path, capsys):
    """tiny at another width, without its config.json: every tensor's shape differs from every preset's."""
    bare = synthetic_checkpoint(dataclasses.replace(K3Config.preset("tiny"), hidden_size=40), 1, tmp_path / "bare")
    (bare / "config.json").unlink()
    assert cli_main(["admit", str(bare), "--config", "k3geom"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"REJECTED  {bare}: not a checkpoint of config k3geom: ")
    assert lines[2].startswith("  it fits none of the presets (k3, k3geom, small, tiny) either") and len(lines) == 3


# ----- k3conf model info --device-memory -----

def _device_bytes(plan: TpPlan, rank: int) -> int:
    return plan.rank_bytes(rank)["total"] + plan.binding_bytes(rank)["total"]


def test_model_info_says_which_ranks_fit_a_device_and_by_how_much(capsys):
    """tiny at TP 2: rank 0 holds more than rank 1; a device between the two fits rank 1 only."""
    plan = TpPlan(K3Config.preset("tiny"), 2)
    need = [_device_bytes(plan, r) for r in range(2)]
    assert need[0] > need[1]
    capacity = (need[0] + need[1]) // 2
    gib = capacity / 2**30
    assert cli_main(["model", "info", "--config", "tiny", "--tp", "2", "--device-memory", repr(gib)]) == 0
    out = capsys.readouterr().out
    capacity = round(gib * 2**30)    # what the command reads back from the GiB given
    assert f"  rank 0   needs {need[0]:>18,} B" in out and f"does NOT fit: {need[0] - capacity:,} B (" in out
    assert f"  rank 1   needs {need[1]:>18,} B" in out and f"fits, {capacity - need[1]:,} B (" in out
    assert f"1 of 2 rank(s) do not fit a {gib:g} GiB device (worst: rank 0, {need[0] - capacity:,} B" in out


def test_model_info_every_rank_fits_a_large_device(capsys):
    assert cli_main(["model", "info", "--config", "tiny", "--tp", "2", "--device-memory", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count(": fits, ") == 2 and "every rank fits a 1 GiB device" in out and "does NOT fit" not in out


def test_model_info_without_device_memory_compares_nothing(capsys):
    assert cli_main(["model", "info", "--config", "tiny", "--tp", "2"]) == 0
    assert "device memory" not in capsys.readouterr().out


@pytest.mark.parametrize("value", ["0", "-141", "nan", "inf"])
def test_model_info_refuses_a_device_size_that_is_not_one(value, capsys):
    assert cli_main(["model", "info", "--config", "tiny", "--device-memory", value]) == 2
    assert f"--device-memory: expected a size in GiB > 0 (e.g. 141), found {float(value)}" in capsys.readouterr().err


@pytest.mark.slow
def test_k3_at_tp8_does_not_fit_a_141_gib_device(request, capsys):
    if "slow" not in (request.config.option.markexpr or ""):
        pytest.skip("plans K3's 497,052 tensors on 8 ranks twice (about 40 s): run with -m slow")
    plan = TpPlan(K3Config.preset("k3"), 8)
    over = _device_bytes(plan, 0) - 141 * 2**30
    assert over > 0
    assert cli_main(["model", "info", "--tp", "8", "--device-memory", "141"]) == 0
    out = capsys.readouterr().out
    assert f"8 of 8 rank(s) do not fit a 141 GiB device (worst: rank 0, {over:,} B" in out
