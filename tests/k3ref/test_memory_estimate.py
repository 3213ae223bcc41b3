"""`decode_memory`: every byte a decode holds, counted before it runs; runs that do not fit are refused by number."""
from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import pytest

from conformance.cli import main
from k3ref import greedy
from k3ref.config import K3Config
from k3ref.cpu_forward import K3CpuModel
from k3ref.greedy import NotEnoughMemory, decode_memory, format_bytes, greedy_decode
from k3ref.weights import synth_checkpoint

GIB = 2**30


@pytest.fixture(scope="module")
def k3():
    return K3Config.preset("k3")


def test_refuses_what_does_not_fit_naming_the_numbers(k3):
    est = decode_memory(k3, prompt_len=16, max_new=2, dtype=np.float64, layers=[1])
    with pytest.raises(NotEnoughMemory) as e:
        est.check(available=est.needed - 1, what="this decode")
    msg = str(e.value)
    needed, have = format_bytes(est.needed), format_bytes(est.needed - 1)
    assert needed.endswith(" GiB")
    assert msg.startswith(f"this decode would hold about {needed}, this machine has {have} available")
    name, size = est.largest(1)[0]
    assert f"the largest items: {name} {format_bytes(size)}" in msg
    est.check(available=est.needed)                     # exactly enough: no refusal
    est.check(available=0)                              # unknown: nothing refused


def test_one_real_layer_converts_one_tensor_at_a_time(k3):
    est = decode_memory(k3, prompt_len=16, max_new=2, dtype=np.float64, layers=[1])
    D, HK = k3.hidden_size, k3.kda_num_heads * k3.kda_head_dim
    assert est.anonymous["float weights (one tensor at a time)"] == 2 * HK * D * 8   # q_proj: the largest
    assert est.anonymous["lm_head block"] <= 64 << 20
    assert est.needed < 4 * GIB
    assert est.mapped["embedding and lm_head"] == 2 * k3.vocab_size * D * 2
    whole = decode_memory(k3, prompt_len=16, max_new=2, dtype=np.float64, layers=[1], keep_casts=True)
    assert whole.anonymous["float weights (cast, kept)"] > 4 * GIB > est.needed


def test_the_estimate_grows_with_what_the_run_holds(k3):
    def needed(**kw):
        base = dict(prompt_len=16, max_new=2, dtype=np.float32, layers=[1, 3])
        return decode_memory(k3, **{**base, **kw})
    small = needed()
    assert needed(dtype=np.float64).needed > small.needed
    assert needed(layers=[1]).needed < small.needed
    assert needed(max_new=5000).anonymous["MLA cache"] > small.anonymous["MLA cache"]
    assert needed(prompt_len=4096).anonymous["activations"] > 100 * small.anonymous["activations"]
    synthetic = decode_memory(k3, prompt_len=16, max_new=2, synthetic=True)
    assert synthetic.anonymous["synthetic weights"] > 500 * GIB     # the whole model in memory: refused anywhere


@pytest.mark.parametrize("preset, layers", [("tiny", None), ("k3geom", [1, 3])])
def test_the_estimate_covers_the_measured_peak(preset, layers, tmp_path, monkeypatch):
    """tracemalloc's peak (every numpy allocation) of a decode from a checkpoint stays under the estimate."""
    cfg = K3Config.preset(preset)
    ckpt = synth_checkpoint(cfg, tmp_path / "ckpt", layers=layers)
    prompt, max_new = list(range(1, 40)), 3
    model = K3CpuModel.from_checkpoint(ckpt, cfg, np.float64, layers=layers, keep_casts=False)
    gc.collect()
    tracemalloc.start()
    try:
        greedy_decode(model, prompt, max_new)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    est = decode_memory(cfg, prompt_len=len(prompt), max_new=max_new, dtype=np.float64, layers=layers,
                        keep_casts=False)
    assert 0 < peak <= est.needed, (peak, est.summary())


def test_decode_cli_refuses_before_allocating(monkeypatch, capsys):
    monkeypatch.setattr(greedy, "available_memory", lambda: 1 << 10)
    assert main(["decode", "--prompt", "1,2", "--max-new", "2"]) == 2
    err = capsys.readouterr().err
    assert "would hold about" in err and "this machine has 1.0 KiB available" in err
    assert "synthetic weights" in err
    monkeypatch.setattr(greedy, "available_memory", lambda: 1 << 30)
    assert main(["decode", "--prompt", "1,2", "--max-new", "2"]) == 0
