"""Fresh goldens (conformance.cases.fresh): a per-block case drawn with another seed is a golden like a committed
one, every input array and output of every per-block case follows the seed, and the data keeps what the cases
promise (NaN pages, shuffled page tables, saturated gates, router choices far from a tie) for other seeds too."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conformance.cases import fresh
from conformance.cases.catalog import KINDS, all_cases, kind_of
from conformance.cases.core import CORE_SPECS, CoreSpec
from conformance.cases.fresh import PER_BLOCK_KINDS, fresh_case, fresh_golden
from conformance.cases.protocol import Case
from conformance.cases.routes import route_stable
from conformance.golden.drift import diff_tensors, is_rounding_only
from conformance.golden.errors import GoldenError
from conformance.golden.store import COMMITTED_ROOT, MANIFEST, golden_path, read_golden
from conformance.runner import FreshRunner, Runner
from k3ref.latent_moe import sigmoid_topk
from k3ref.ops import sigmoid

PER_BLOCK = [c for c in all_cases("tiny") if c.kind in PER_BLOCK_KINDS]
TRACES = [c for c in all_cases("tiny") if c.kind not in PER_BLOCK_KINDS]
# a handful of seeds: small, large, the largest a committed case can have (conformance.cases.protocol.case_seed)
SEEDS = (1, 2, 3, 987654321, 2 ** 31 - 2)
# inputs a case fixes on purpose; every other inputs.* / weights.* array must be drawn from the seed
NOT_DRAWN = {"inputs.seq_lens": "the MLA sequence lengths are the case's shape (contexts 1, 64, 65, ...), not data",
             "inputs.cu_seqlens": "the packed sequences' lengths are the case's shape (1, 63, 65 tokens), not data",
             "inputs.cu_seqlens_q": "the prefill's new tokens per sequence are the case's shape",
             "inputs.cu_seqlens_k": "the prefill's tokens per sequence (prefix included) are the case's shape"}
# inputs one case fixes because its shape leaves no choice
NOT_DRAWN_IN = {
    "kda_decode_pool/B2-S1-H1-K128-vk-pad1": {"inputs.slots": "one slot, one live row and one padded row"},
    "kda_prefill_varlen/N1-T3-S1-H1-K128-vk": {"inputs.slots": "one sequence in a one-slot pool"},
    "moe_experts/T1-E8-k1-Dl64-I32": {"inputs.indices": "the one token's one expert is the stack's last (a trap)",
                                      "inputs.weights": "one expert per token: its weight is 1"},
    "moe_route/T2-E6-k1-ties": {"outputs.weights": "one expert per token, renormalised: its weight is 1"},
}


def _ids(cases: list[Case]) -> list:
    return [pytest.param(c, id=c.name) for c in cases]


def _content(case: Case, seed: int) -> dict[str, np.ndarray]:
    fresh_one = fresh_case(case, seed)
    assert fresh_one is not None
    return kind_of(fresh_one).generate(fresh_one).tensors


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")


def _not_following_the_seed(case: Case, seeds) -> list[str]:
    """The arrays of `case` that do not change with the seed: a float array equal to the one of the case's own
    seed for any of `seeds`, or an integer array (page tables, MXFP4 bytes, router indices: few possible values
    on a small case) equal for all of them."""
    own = _content(case, case.seed)
    drawn = [_content(case, s) for s in seeds]
    fixed = {**NOT_DRAWN, **NOT_DRAWN_IN.get(case.name, {})}
    names = sorted(n for n in own if n.split(".", 1)[0] in ("inputs", "weights", "outputs") and n not in fixed)
    stuck = []
    for name in names:
        if own[name].dtype.kind == "f":
            stuck += [f"{name} (seed {s})" for s, d in zip(seeds, drawn, strict=True) if _same(d[name], own[name])]
        elif all(_same(d[name], own[name]) for d in drawn):
            stuck.append(f"{name} (every seed)")
    return stuck


# ---------------------------------------------------------------------------------------------- the golden file


@pytest.mark.parametrize("case", _ids(PER_BLOCK))
def test_a_fresh_golden_with_the_case_seed_is_the_committed_golden(case, tmp_path):
    got = fresh_golden(case, case.seed, tmp_path)
    committed = read_golden(COMMITTED_ROOT, case.name)
    assert got is not None and got.path == golden_path(tmp_path, case.name)
    assert got.meta == committed.meta
    for name in (n for n in committed.tensors if n.split(".", 1)[0] in ("inputs", "weights")):
        assert _same(got.tensors[name], committed.tensors[name]), name       # the data itself: bit for bit
    drift = diff_tensors(committed.tensors, got.tensors)                      # computed tensors: another CPU's BLAS
    assert is_rounding_only(drift, committed.meta, got.meta), [d for d in drift if d.status != "same"]


def test_a_fresh_golden_is_listed_read_back_and_replayable(tmp_path):
    rms, route = (next(c for c in PER_BLOCK if c.name == n) for n in ("rmsnorm/T7-D203", "moe_route/T5-E16-k4"))
    first = fresh_golden(rms, 11, tmp_path)
    second = fresh_golden(route, 12, tmp_path)
    assert first is not None and second is not None
    assert (first.meta["seed"], second.meta["seed"]) == ("11", "12")          # the report can print it for replay
    listed = json.loads((tmp_path / MANIFEST).read_text())["files"]
    assert sorted(listed) == ["moe_route/T5-E16-k4.safetensors", "rmsnorm/T7-D203.safetensors"]
    again = read_golden(tmp_path, rms.name, config=rms.config)                # the second write kept the first row
    assert all(_same(again.tensors[n], first.tensors[n]) for n in first.tensors)
    replay = fresh_golden(rms, 11, tmp_path / "replay")
    assert replay is not None and replay.path.read_bytes() == first.path.read_bytes()


def test_a_fresh_golden_goes_through_the_store_checks(tmp_path):
    case = next(c for c in PER_BLOCK if c.name == "rmsnorm/T1-D113")
    got = fresh_golden(case, 5, tmp_path)
    assert got is not None
    got.path.write_bytes(got.path.read_bytes()[:-8])       # what read_golden refuses in a committed golden
    with pytest.raises(GoldenError, match="sha256 mismatch"):
        read_golden(tmp_path, case.name, config=case.config)


def test_a_failure_on_fresh_inputs_does_not_blame_the_fresh_golden(tmp_path):
    """The golden check behind "broken golden" regenerates a case with its own seed: a fresh draw differs from that
    by design, so the fresh runner never reports its own draw as broken (a kernel's fresh failure once read so)."""
    case = next(c for c in PER_BLOCK if c.name == "rmsnorm/T1-D113")
    drawn = fresh_golden(case, 1302569823, tmp_path)
    assert drawn is not None
    parent = Runner(COMMITTED_ROOT, case.config, False)
    assert "metadata seed is '1302569823'" in parent.golden_fault(case, drawn)    # what the check alone would say
    assert FreshRunner(parent, 1302569823).golden_fault(case, drawn) == ""


@pytest.mark.parametrize("name, seed", [("mla_decode/B1-H2-R512-P64-L70", 1091), ("kda_prefill/B2-T63-H2-K16", 7),
                                        ("rmsnorm/T1-D113", 1302569823)])
def test_on_fresh_inputs_the_baseline_error_is_the_larger_of_the_draws_and_the_goldens(name, seed):
    """Each baseline error on fresh inputs (relative RMS, worst element) is the larger of numpy32's on the fresh
    draw and on the committed golden: one draw's error alone is one sample of the rounding noise, and a lucky one
    failed torch (seed 1091: mla_decode o_lat 2.52e-6 against 4 x numpy32's 3.17e-7 + 1e-6; its golden error is
    4.2e-7)."""
    case = next(c for c in PER_BLOCK if c.name == name)
    parent = Runner(COMMITTED_ROOT, case.config, False)
    drawn = FreshRunner(parent, seed)
    _, pooled = drawn.baseline_errors(case, drawn.golden(case), "fp32")
    _, alone = Runner.baseline_errors(drawn, case, drawn.golden(case), "fp32")
    _, committed = parent.baseline_errors(case, parent.golden(case), "fp32")
    assert pooled and alone and committed and set(pooled) == set(alone)
    for t, e in pooled.items():
        assert e.rel_rms == max(alone[t].rel_rms, committed[t].rel_rms), t
        assert e.worst_err == max(alone[t].worst_err, committed[t].worst_err), t
    if name.startswith("mla_decode"):
        assert alone["o_lat"].rel_rms < committed["o_lat"].rel_rms == pooled["o_lat"].rel_rms   # the lucky draw
    drawn.close()


@pytest.mark.parametrize("case", _ids(TRACES))
def test_a_trace_has_no_fresh_golden(case, tmp_path):
    assert fresh_golden(case, 7, tmp_path) is None
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("seed", [-1, 1.5, "3", True, None])
def test_a_seed_must_be_a_non_negative_integer(seed, tmp_path):
    with pytest.raises(ValueError, match=rf"rmsnorm/T1-D113: seed expected a non-negative integer, found {seed!r}"):
        fresh_golden(PER_BLOCK[0], seed, tmp_path)


def test_drawn_seeds_differ_and_fit_the_case_seed_range():
    seeds = {fresh.draw_seed() for _ in range(20)}
    assert len(seeds) > 15 and all(0 <= s < fresh.SEED_RANGE for s in seeds)


# ---------------------------------------------------------------------------------------------- the seed is used


@pytest.mark.parametrize("case", _ids(PER_BLOCK))
def test_every_drawn_input_and_every_output_follows_the_seed(case):
    assert _not_following_the_seed(case, SEEDS) == []


def test_a_generator_that_ignores_the_seed_for_one_input_is_named(monkeypatch):
    spec = CORE_SPECS["rmsnorm"]

    def fixed_weight(rng, **params):
        inputs, kwargs = spec.make(rng, **params)
        inputs["w"] = spec.make(np.random.default_rng(0), **params)[0]["w"]    # the slip: its own seed
        return inputs, kwargs

    monkeypatch.setitem(KINDS["core"].specs, "rmsnorm", CoreSpec("rmsnorm", spec.outputs, fixed_weight))
    case = next(c for c in PER_BLOCK if c.name == "rmsnorm/T7-D203")
    assert _not_following_the_seed(case, SEEDS[:2]) == ["inputs.w (seed 1)", "inputs.w (seed 2)"]


# ---------------------------------------------------------------------------------------------- the data's promises


def _route_kwargs(case: Case, kwargs: dict) -> dict:
    if case.kind == "core":
        return kwargs
    return dict(top_k=kwargs["top_k"], n_group=kwargs.get("n_group", 1), topk_group=kwargs.get("topk_group", 1),
                renormalize=kwargs.get("renormalize", True), scaling=kwargs.get("routed_scaling_factor", 1.0))


def _promises(case: Case, t: dict[str, np.ndarray], kwargs: dict) -> list[str]:
    """What the generator of `case`'s block promises about its data (conformance/cases/core.py, routes.py), as
    the list of broken promises."""
    broken = []
    block = case.block
    if block == "moe_route" and case.params.get("ties"):
        # the contract case: every token's k-th and (k+1)-th selection scores are exactly equal (ties to the lower
        # id), and apart from the rest by far more than bf16's rounding
        kw = _route_kwargs(case, kwargs)
        score = np.sort(sigmoid(t["inputs.logits"]) + t["inputs.bias"], -1)[:, ::-1]
        k = kw["top_k"]
        if not np.array_equal(score[:, k - 1], score[:, k]):
            broken.append("a token's k-th choice is no exact tie")
        if k > 1 and not np.all(score[:, k - 2] - score[:, k - 1] > 0.01):
            broken.append("the tied pair sits near another choice")
    elif block == "moe_route":
        logits, bias, kw = t["inputs.logits"], t["inputs.bias"], _route_kwargs(case, kwargs)
        if not route_stable(logits, bias, kw):
            broken.append("the router choice moves under bf16 rounding or noise")
        if np.array_equal(sigmoid_topk(logits, bias, **kw)[1], sigmoid_topk(logits, 0 * bias, **kw)[1]):
            broken.append("the bias changes no selection")
    elif block == "latent_moe":
        logits = t["inputs.x"] @ t["weights.gate.weight"].T
        if not route_stable(logits, t["weights.gate.e_score_correction_bias"], _route_kwargs(case, kwargs)):
            broken.append("the router choice moves under bf16 rounding or noise")
    elif block == "mla_decode":
        broken += _page_promises(t["inputs.kv_cache"], t["inputs.block_table"], t["inputs.seq_lens"])
    elif block in ("kda_decode", "kda_prefill"):
        K = t["inputs.q"].shape[-1]
        if not np.all(t["inputs.g_raw"][..., 0, : K // 2] == 12.0):
            broken.append("head 0's gates do not sit at the lower bound")
        if not all(np.all(np.sum(t[f"inputs.{x}"][..., -1, :] ** 2, -1) < 1e-6) for x in ("q", "k")):
            broken.append("the last head's q/k are not below the L2 eps")
    elif block == "mxfp4_gemv":
        scale = t["inputs.scale"]
        if t["inputs.packed"][0, 0] != 0x71 or not np.all((scale >= 122) & (scale <= 130)):
            broken.append("the nibble-order byte or the scale range is lost")
    elif block == "situ_glu":
        reach = np.abs(t["inputs.gate"]).max() > kwargs["beta"], np.abs(t["inputs.up"]).max() > kwargs["linear_beta"]
        if not all(reach):
            broken.append("the gate or up values do not reach their softcaps")
    outputs = [v for n, v in t.items() if n.startswith("outputs.") and v.dtype.kind == "f"]
    if not all(np.isfinite(v).all() for v in outputs):
        broken.append("an output is not finite")
    return broken


def _page_promises(cache: np.ndarray, table: np.ndarray, seq_lens: np.ndarray) -> list[str]:
    broken, page = [], cache.shape[1]
    used = set()
    for b, length in enumerate(seq_lens):
        n = -(-int(length) // page)
        pages = [int(p) for p in table[b, :n]]
        used |= set(pages)
        if len(set(pages)) != n:
            broken.append(f"sequence {b} reads one page twice")
        if not np.isnan(cache[pages[-1], int(length) - (n - 1) * page:]).all():
            broken.append(f"sequence {b}'s slots past its length are not NaN")
        if not np.isnan(cache[table[b, n:]]).all():
            broken.append(f"sequence {b}'s spare block-table columns point at a page that is not NaN")
    spare = sorted(set(range(cache.shape[0])) - used)
    if not spare or not np.isnan(cache[spare]).all():
        broken.append("no spare page full of NaN")
    return broken


@pytest.mark.parametrize("case", _ids(PER_BLOCK))
def test_fresh_data_keeps_the_promises_of_its_case(case):
    for seed in SEEDS:
        fresh_one = fresh_case(case, seed)
        assert fresh_one is not None
        content = kind_of(fresh_one).generate(fresh_one)
        assert _promises(case, content.tensors, content.kwargs) == [], seed


def test_the_promise_checks_can_fail():
    case = next(c for c in PER_BLOCK if c.name == "mla_decode/B2-H3-R32-P16-L65-1")
    t = dict(_content(case, 3))
    cache = t["inputs.kv_cache"].copy()
    cache[np.isnan(cache)] = 0.0                             # a cache without NaN pages
    t["inputs.kv_cache"] = cache
    assert "no spare page full of NaN" in _promises(case, t, {})
    route = next(c for c in PER_BLOCK if c.name == "moe_route/T5-E16-k4")
    r = dict(_content(route, 3))
    kw = kind_of(route).generate(route).kwargs
    logits = r["inputs.logits"].copy()
    top = np.sort(logits, -1)
    logits[0, np.argsort(logits[0])[-kw["top_k"] - 1]] = top[0, -kw["top_k"]] - 1e-4   # a near-tie at the k-th
    r["inputs.logits"], r["inputs.bias"] = logits, np.zeros_like(r["inputs.bias"])
    broken = _promises(route, r, kw)
    assert {"the bias changes no selection", "the router choice moves under bf16 rounding or noise"} <= set(broken)
