"""The host graph at real size: embedding gathered by rows, lm_head in blocks, float casts not kept, layer subsets."""
from __future__ import annotations

import numpy as np
import pytest

from conformance.cli import main
from k3ref import cpu_forward as cf
from k3ref.config import K3Config
from k3ref.cpu_forward import EMBED, K3CpuModel, forward_prefill, forward_token
from k3ref.greedy import greedy_decode, greedy_recompute
from k3ref.weights import admit_checkpoint, inventory, synth_checkpoint, synthetic_checkpoint
from tests.support.tolerances import rel_rms, tol

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.fixture(scope="module")
def tiny():
    return K3Config.preset("tiny")


@pytest.fixture(scope="module")
def full_ckpt(tiny, tmp_path_factory):
    return synthetic_checkpoint(tiny, 7, tmp_path_factory.mktemp("full"), shard_bytes=50_000)


@pytest.fixture(scope="module")
def sub_ckpt(tiny, tmp_path_factory):
    return synth_checkpoint(tiny, tmp_path_factory.mktemp("sub") / "ckpt", layers=[0, 2, 5], seed=7)


def _run(model: K3CpuModel) -> tuple[np.ndarray, np.ndarray]:
    """Prefill logits [T, V] and one decode step's logits [V]."""
    cache = model.new_cache(num_pages=2)
    seq = cache.add_sequence()
    pre = forward_prefill(model, PROMPT, cache, seq=seq)
    step = forward_token(model, int(np.argmax(pre[-1])), len(PROMPT), cache, seq=seq)
    return pre, step


def _whole_table_path(model: K3CpuModel, monkeypatch) -> None:
    """The forward as it was: the embedding table and lm_head cast whole, one matmul."""
    monkeypatch.setattr(model, "apply_lm_head", lambda x: x @ model.lm_head().T)
    whole = model.table_rows
    monkeypatch.setattr(model, "table_rows", lambda name, rows: whole(name, slice(None))[rows])


@pytest.mark.parametrize("block_bytes", [1, 7 * 36 * 8, 1 << 30])   # 1 row, 7 rows (97 = 13 * 7 + 6), whole
def test_blocked_lm_head_and_row_embedding_match_the_whole_table(tiny, monkeypatch, block_bytes):
    model = K3CpuModel.synthetic(tiny, 3, np.float64)
    monkeypatch.setattr(cf, "LM_HEAD_BLOCK_BYTES", block_bytes)
    pre, step = _run(model)
    _whole_table_path(model, monkeypatch)
    ref_pre, ref_step = _run(model)
    assert pre.shape == (len(PROMPT), tiny.vocab_size)
    np.testing.assert_allclose(pre, ref_pre, rtol=0, atol=1e-12)
    np.testing.assert_allclose(step, ref_step, rtol=0, atol=1e-12)


def test_lm_head_blocks_cover_every_vocab_row_once(tiny, monkeypatch):
    model = K3CpuModel.synthetic(tiny, 3, np.float64)
    monkeypatch.setattr(cf, "LM_HEAD_BLOCK_BYTES", 5 * 36 * 8)
    x = np.eye(tiny.hidden_size)[:3]
    np.testing.assert_array_equal(model.apply_lm_head(x), model.lm_head()[:, :3].T)
    assert model.lm_head_block_rows() == 5


def test_embedding_rows_are_the_table_rows(tiny, full_ckpt):
    model = K3CpuModel.from_checkpoint(full_ckpt, tiny, np.float64)
    ids = np.array([96, 0, 5, 5])
    table = model.weights.reader[EMBED].astype(np.float64)
    np.testing.assert_array_equal(model.table_rows(EMBED, ids), table[ids])


@pytest.mark.parametrize("fast", ["numpy", "jit"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_checkpoint_without_kept_casts_equals_the_in_memory_model(tiny, full_ckpt, dtype, fast, monkeypatch):
    """Memory-mapped tensors converted per use, lm_head in blocks == synthetic weights in memory: bit for bit with
    the NumPy forms; with the compiled default the bf16 lm_head goes through the bf16 GEMV (fixed-order sums, not
    BLAS's), so the logits agree to rounding."""
    monkeypatch.setenv("K3_FAST", fast)
    ref = _run(K3CpuModel.synthetic(tiny, 7, dtype))
    model = K3CpuModel.from_checkpoint(full_ckpt, tiny, dtype, keep_casts=False)
    got = _run(model)
    assert model._cast is None
    for a, b in zip(got, ref, strict=True):
        assert a.dtype == np.dtype(dtype)
        if fast == "numpy":
            np.testing.assert_array_equal(a, b)
        else:
            assert rel_rms(a, b) <= tol("fp64_same_math" if dtype == np.float64 else "fp32_vs_fp64")


def test_casts_are_kept_only_when_asked(tiny, full_ckpt, monkeypatch):
    kept = K3CpuModel.from_checkpoint(full_ckpt, tiny, np.float64)
    assert kept.keep_casts                                  # tiny: far under KEEP_CASTS_BYTES
    w = kept.layer(1).sub("self_attn.")
    assert w["q_proj.weight"] is w["q_proj.weight"]
    monkeypatch.setattr(cf, "KEEP_CASTS_BYTES", 0)
    fresh = K3CpuModel.from_checkpoint(full_ckpt, tiny, np.float64)
    assert not fresh.keep_casts
    w = fresh.layer(1).sub("self_attn.")
    a, b = w["q_proj.weight"], w["q_proj.weight"]
    assert a is not b and np.array_equal(a, b) and a.dtype == np.float64
    _run(fresh)
    assert fresh._cast is None                              # nothing kept after a forward either


def test_layer_subset_runs_and_decode_equals_recompute(tiny, sub_ckpt):
    model = K3CpuModel.from_checkpoint(sub_ckpt, tiny, np.float64, layers=[0, 2, 5])
    assert model.layers == (0, 2, 5)
    cache = model.new_cache()
    assert set(cache.mla) == {2, 5} and cache.kda_layers == (0,)
    got = greedy_decode(model, PROMPT, 5)
    assert got.tokens == greedy_recompute(model, PROMPT, 5).tokens
    with pytest.raises(ValueError, match=r"layer: expected one of the layers this model runs \(0,2,5\), found 1"):
        model.layer(1)


def test_a_subset_is_not_the_whole_model(tiny, full_ckpt):
    whole = K3CpuModel.from_checkpoint(full_ckpt, tiny, np.float64)
    part = K3CpuModel.from_checkpoint(full_ckpt, tiny, np.float64, layers=[0, 2, 5])
    assert not np.allclose(_run(whole)[0], _run(part)[0])


def test_missing_layers_are_named(tiny, sub_ckpt):
    with pytest.raises(ValueError, match=r"no tensor of layer\(s\) 1,3,4,6 \(it holds layer\(s\) 0,2,5\).*--layers "
                                         r"0,2,5"):
        K3CpuModel.from_checkpoint(sub_ckpt, tiny)
    with pytest.raises(ValueError, match=r"no tensor of layer\(s\) 3 "):
        K3CpuModel.from_checkpoint(sub_ckpt, tiny, layers=[0, 3])


def test_a_subset_of_the_layers_held_is_admitted_and_runs(tiny, sub_ckpt, capsys):
    verdict = admit_checkpoint(sub_ckpt, tiny, layers=[2])
    assert verdict.ok and verdict.n_ignored == sum(1 for s in inventory(tiny, [0, 5]) if ".layers." in s.name)
    argv = ["decode", "--checkpoint", str(sub_ckpt), "--prompt", "1,2", "--max-new", "2", "--layers", "2",
            "--ids-only"]
    assert main(argv) == 0
    assert capsys.readouterr().out.strip().count(",") == 1


def test_decode_cli_runs_the_asked_layers(tiny, sub_ckpt, capsys):
    argv = ["decode", "--checkpoint", str(sub_ckpt), "--prompt", ",".join(map(str, PROMPT)), "--max-new", "4"]
    assert main([*argv, "--layers", "0,2,5", "--dtype", "float32", "--ids-only"]) == 0
    tokens = [int(t) for t in capsys.readouterr().out.strip().split(",")]
    model = K3CpuModel.from_checkpoint(sub_ckpt, tiny, np.float32, layers=[0, 2, 5])
    assert tokens == greedy_recompute(model, PROMPT, 4).tokens
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "no tensor of layer(s) 1,3,4,6" in err and "--layers 0,2,5" in err
    assert main([*argv, "--layers", "0,3"]) == 2
    assert "layer(s) 3 " in capsys.readouterr().err
    assert main(["decode", "--prompt", "1", "--layers", "0"]) == 2
    assert "give --checkpoint" in capsys.readouterr().err
