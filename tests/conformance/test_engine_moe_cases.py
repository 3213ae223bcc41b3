"""The moe_experts and add_rmsnorm cases (conformance.cases.engine_moe): the traps their data must hold, the size of
their goldens, K3's real sizes in the k3 sets, and the engine mutants (conformance.backends.mutants_moe) failing
every tiny case of their block by far more than any precision's budget."""
from __future__ import annotations

import numpy as np
import pytest

from conformance.backends.mutants_moe import ENGINE_MUTANTS
from conformance.cases.core import CORE_SPECS, CORE_TABLE
from conformance.cases.engine_moe import NAN_SCALE, SPECS, TABLE
from conformance.cases.protocol import case_seed
from conformance.judge.compare import compare
from k3ref.config import K3Config
from k3ref.cores import reference_cores

BLOCKS = tuple(SPECS)
# Committed tiny goldens of this family, bytes of float64/uint8 arrays (the safetensors headers add ~1 KB a file).
TINY_BUDGET = 700_000
# A k3 golden is generated into the cache on demand; each must stay small enough to make and hold in minutes.
K3_GOLDEN_BUDGET = 150_000_000
# A mutant must fail by far more than the loosest gate of these cases (bf16 relative RMS caps are 5e-2), as the
# host-graph mutants must (tests/conformance/test_mutations.py).
MIN_MUTANT_ERROR = 0.1


def _cases(config: str, block: str | None = None) -> list:
    return [pytest.param(name, params, id=name) for name, params in TABLE[config]
            if block is None or name.startswith(f"{block}/")]


def _build(name: str, params: dict) -> tuple[dict, dict]:
    spec = SPECS[name.split("/")[0]]
    return spec.make(np.random.default_rng(case_seed(name)), **params)


def _run(cores, name: str, inputs: dict, kwargs: dict) -> dict[str, np.ndarray]:
    spec = SPECS[name.split("/")[0]]
    out = getattr(cores, spec.core)(**inputs, **kwargs)
    return dict(zip(spec.outputs, out if isinstance(out, tuple) else (out,), strict=True))


def test_the_family_is_merged_into_the_core_tables():
    for block, spec in SPECS.items():
        assert CORE_SPECS[block] is spec and spec.core == block
    for config, cases in TABLE.items():
        assert all(case in CORE_TABLE[config] for case in cases), config


@pytest.mark.parametrize("name, params", _cases("tiny", "moe_experts"))
def test_moe_experts_cases_hold_their_traps(name, params):
    inputs, _ = _build(name, params)
    idx, E, k = inputs["indices"], params["E"], params["k"]
    T = len(idx)
    assert idx.shape == (T, k) and idx.min() >= 0 and idx.max() < E
    if params.get("repeated"):   # the contract case: the last token chooses its first expert twice
        assert [len(set(row)) for row in idx.tolist()] == [k] * (T - 1) + [k - 1] and idx[-1, -1] == idx[-1, 0]
    else:
        assert all(len(set(row)) == k for row in idx.tolist()), "k distinct experts per token"
    assert E - 1 in idx[0], "token 0 routes to the stack's last expert"
    if T > 1:
        assert np.intersect1d(idx[0], idx[1]).size, "tokens 0 and 1 share an expert"
    unused = sorted(set(range(E)) - set(idx.ravel().tolist()))
    if E > k + 1:
        assert any(np.all(inputs["w13_scale"][e] == NAN_SCALE) and np.all(inputs["w2_scale"][e] == NAN_SCALE)
                   for e in unused), "an expert no token chose holds NaN scales"
    for e in np.unique(idx):
        assert not np.any(inputs["w13_scale"][e] == NAN_SCALE), "a chosen expert is finite"
    (y,) = _run(reference_cores(), name, inputs, {}).values()
    assert np.all(np.isfinite(y))
    assert not np.array_equal(inputs["w13_packed"][:, : params["Di"]], inputs["w13_packed"][:, params["Di"]:])


@pytest.mark.parametrize("name, params", _cases("tiny", "add_rmsnorm"))
def test_add_rmsnorm_cases_have_a_row_where_eps_matters(name, params):
    inputs, kwargs = _build(name, params)
    r = inputs["x"] + inputs["residual"]
    mean_sq = np.mean(r * r, axis=-1)
    assert mean_sq[0] < 100 * kwargs["eps"], "row 0's mean square is within 100x of eps"
    assert np.all(np.abs(inputs["x"]) > 0) and not np.allclose(r, inputs["residual"])


def test_tiny_goldens_fit_the_committed_budget():
    total = 0
    for name, params in TABLE["tiny"]:
        inputs, kwargs = _build(name, params)
        outs = _run(reference_cores(), name, inputs, kwargs)
        total += sum(a.nbytes for a in inputs.values()) + sum(np.asarray(o, np.float64).nbytes for o in outs.values())
    assert total <= TINY_BUDGET, f"the tiny moe_experts / add_rmsnorm goldens hold {total:,} bytes"


def _k3_golden_bytes(params: dict) -> int:
    """Bytes of a moe_experts golden from its params: the MXFP4 stack (1 + 1/16 + 1/2 + 1/32 bytes per W1, W3
    and W2 element pair counted as in k3ref.engine.moe's layout), float64 x, y, weights and int32 indices."""
    T, E, k, Dl, Di = (params[n] for n in ("T", "E", "k", "Dl", "Di"))
    stack = E * (2 * Di * Dl // 2 + 2 * Di * Dl // 32 + Dl * Di // 2 + Dl * Di // 32)
    return stack + 8 * (2 * T * Dl + T * k) + 4 * T * k


@pytest.mark.parametrize("config", ["k3", "k3-tp8"])
def test_k3_sets_run_at_k3s_expert_and_hidden_sizes(config):
    c = K3Config.preset("k3")
    moe = [p for n, p in TABLE[config] if n.startswith("moe_experts/")]
    norm = [p for n, p in TABLE[config] if n.startswith("add_rmsnorm/")]
    assert moe and norm
    for p in moe:
        assert (p["Dl"], p["Di"], p["draw"]) == (c.routed_expert_hidden_size, c.moe_intermediate_size, "k3")
        assert _k3_golden_bytes(p) <= K3_GOLDEN_BUDGET, f"{p}: {_k3_golden_bytes(p):,} bytes"
    assert all(p["D"] == c.hidden_size and p["draw"] == "k3" for p in norm)


def test_k3_draw_builds_at_a_reduced_width():
    """The k3 draw's builder at a small width (the real one is too large for a unit test): K3 magnitudes, finite."""
    inputs, _ = SPECS["moe_experts"].make(np.random.default_rng(0), T=4, E=8, k=6, Dl=128, Di=96, draw="k3")
    (y,) = _run(reference_cores(), "moe_experts/k3", inputs, {}).values()
    assert np.all(np.isfinite(y)) and np.allclose(inputs["weights"].sum(-1), 1.0)


MUTANT_CASES = [pytest.param(m, name, params, id=f"{m}-{name}") for m, (block, *_) in ENGINE_MUTANTS.items()
                for name, params in TABLE["tiny"] if name.startswith(f"{block}/")]


@pytest.mark.parametrize("mutant, name, params", MUTANT_CASES)
def test_engine_mutant_fails_every_tiny_case_of_its_block(mutant, name, params):
    _, _, make, base, shows_on = ENGINE_MUTANTS[mutant]
    assert (base, shows_on) == ("numpy64", "tiny")
    inputs, kwargs = _build(name, params)
    want = _run(reference_cores(), name, inputs, kwargs)
    got = _run(make(reference_cores()), name, {k: np.copy(v) for k, v in inputs.items()}, kwargs)
    worst = max(compare(got[o], want[o]).rel_rms for o in want)
    assert worst > MIN_MUTANT_ERROR, f"{mutant} on {name}: worst relative RMS error only {worst:.3g}"


def test_engine_mutants_leave_the_other_cores_alone():
    base = reference_cores()
    for mutant, (block, _, make, _, _) in ENGINE_MUTANTS.items():
        mutated = make(base)
        changed = {n for n in ("moe_experts", "add_rmsnorm", "mxfp4_gemv", "rmsnorm")
                   if getattr(mutated, n) is not getattr(base, n)}
        assert changed == {block}, mutant
