"""The engine-shaped MLA cases (conformance.cases.engine_mla) and their mutants (conformance.backends.mutants_mla).

The tiny cases must hold the traps they are there for (padded rows, NaN in every slot not to be read, shuffled
pages, page sizes 1/16/64, a cached prefix), stay small enough to commit, and catch each mutant: a mutant whose
outputs pass the loosest gate on every case of its block would mean the data cannot see that mistake.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from conformance.backends.mutants_mla import ENGINE_MUTANTS
from conformance.cases import engine_mla
from conformance.cases.core import CORE_SPECS, CORE_TABLE
from conformance.cases.protocol import case_seed
from conformance.judge.compare import compare
from conformance.judge.gates import gate_for
from k3ref.cores import reference_cores

TINY = engine_mla.TABLE["tiny"]
COMMITTED_BUDGET = 600_000     # bytes: the family's committed float64 goldens (inputs + outputs) together


def _build(name: str, params: dict) -> tuple[dict, dict]:
    return CORE_SPECS[name.split("/")[0]].make(np.random.default_rng(case_seed(name)), **params)


def _run(cores, name: str, inputs: dict, kwargs: dict) -> dict[str, np.ndarray]:
    spec = CORE_SPECS[name.split("/")[0]]
    result = getattr(cores, spec.core)(**inputs, **kwargs)
    vals = result if isinstance(result, tuple) else (result,)
    return spec.normal_form(inputs, dict(zip(spec.outputs, vals, strict=True)))


@pytest.fixture(scope="module")
def built() -> dict[str, tuple[dict, dict, dict]]:
    """case name -> (inputs, kwargs, reference outputs) for every tiny case of this family."""
    out = {}
    for name, params in TINY:
        inputs, kwargs = _build(name, params)
        out[name] = (inputs, kwargs, _run(reference_cores(), name, inputs, kwargs))
    return out


def test_the_family_is_in_the_core_table():
    names = [n for n, _ in CORE_TABLE["tiny"]]
    assert all(n in names for n, _ in TINY)
    assert {n.split("/")[0] for n, _ in TINY} == {"mla_decode_fp8", "mla_prefill", "mla_decode"}
    for config in ("k3", "k3-tp8"):
        assert {n.split("/")[0] for n, _ in engine_mla.TABLE[config]} == {"mla_decode_fp8", "mla_prefill"}


def test_committed_goldens_stay_small(built):
    total = sum(sum(a.nbytes for a in (*ins.values(), *outs.values())) for ins, _, outs in built.values())
    assert total <= COMMITTED_BUDGET, f"the tiny MLA engine goldens hold {total} bytes (budget {COMMITTED_BUDGET})"


def test_fp8_decode_cases_hold_their_traps(built):
    pages, padded_at, shuffled = set(), set(), False
    for name, (ins, _, outs) in built.items():
        if not name.startswith("mla_decode_fp8/"):
            continue
        lens, table = ins["seq_lens"], ins["block_table"]
        pages.add(ins["kv_fp8"].shape[1])
        padded = np.flatnonzero(lens == 0)
        padded_at |= {"first" if b == 0 else "last" if b == len(lens) - 1 else "middle" for b in padded}
        assert (ins["kv_fp8"] == 0x7F).any() and np.isnan(ins["kv_scale"]).any() and np.isnan(ins["k_pe"]).any()
        assert ins["kv_fp8"].dtype == np.uint8
        finite = np.isfinite(ins["kv_scale"])
        np.testing.assert_array_equal(ins["kv_scale"][finite].astype(np.float32), ins["kv_scale"][finite])
        pe = ins["k_pe"][np.isfinite(ins["k_pe"])]
        np.testing.assert_array_equal(pe.astype(ml_dtypes.bfloat16).astype(np.float64), pe)
        used = np.concatenate([table[b, : -(-int(L) // ins["kv_fp8"].shape[1])] for b, L in enumerate(lens)])
        shuffled |= not np.array_equal(used, np.sort(used))
        assert np.all(outs["o_lat"][padded] == 0) and np.all(np.isfinite(outs["o_lat"]))
    assert pages == {1, 16, 64} and padded_at == {"first", "middle", "last"} and shuffled


def test_unjudged_padded_rows_accept_anything(built):
    name = next(n for n in built if n.startswith("mla_decode_fp8/"))
    ins, _, outs = built[name]
    garbage = np.where((ins["seq_lens"] == 0)[:, None, None], np.nan, outs["o_lat"])
    spec = CORE_SPECS["mla_decode_fp8"]
    np.testing.assert_array_equal(spec.normal_form(ins, {"o_lat": garbage})["o_lat"], outs["o_lat"])


def test_prefill_cases_hold_a_cached_prefix(built):
    for name, (ins, _, _) in built.items():
        if name.startswith("mla_prefill/"):
            assert np.any(np.diff(ins["cu_seqlens_k"]) > np.diff(ins["cu_seqlens_q"])), name
            assert ins["q"].dtype == np.float64 and ins["cu_seqlens_q"].dtype.kind == "i"


def test_k3_sets_are_at_k3_size():
    for config, H in (("k3", 96), ("k3-tp8", 12)):
        params = dict(engine_mla.TABLE[config])
        decode = next(p for n, p in params.items() if n.startswith("mla_decode_fp8/"))
        assert decode["H"] == H and decode["R"] == 512 and decode["P"] == 64 and decode["page"] == 64
        lens = decode["seq_lens"]
        assert len(lens) == 16 and max(lens) == 4096 and sum(L == 0 for L in lens) == 2
        prefill = next(p for n, p in params.items() if n.startswith("mla_prefill/"))
        assert prefill["Dqk"] == 192 and prefill["Dv"] == 128 and prefill["seqs"][0] == (512, 1536)


@pytest.mark.parametrize("mutant", [pytest.param(m, id=m) for m in ENGINE_MUTANTS])
def test_each_mutant_fails_its_tiny_cases(built, mutant):
    block, description, make, base, shows_on = ENGINE_MUTANTS[mutant]
    assert base == "numpy64" and shows_on == "tiny" and block in engine_mla.SPECS
    cores = make(reference_cores())
    caught = []
    for name, (ins, kwargs, want) in built.items():
        if name.split("/")[0] != block:
            continue
        got = _run(cores, name, ins, kwargs)
        for tensor in want:
            cmp = compare(got[tensor], want[tensor])
            loosest = gate_for(block, tensor, "bf16")[1].cap
            if not cmp.nonfinite_ok or cmp.rel_rms > loosest:
                caught.append(name)
    assert caught, f"{mutant} ({description}) passed every tiny case of {block}"
