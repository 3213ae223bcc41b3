"""The `k3geom` config: K3's per-head geometry at toy counts, so that every CUDA kernel runs inside a model trace.

- the preset has K3's per-head widths and covers what `tiny` covers (dense layer 0, >= 2 KDA and >= 2 MLA layers,
  two MLA in a row at the end, >= 2 AttnRes block boundaries after the first) within every kernel's limits;
- its traces on cuda-emu (the real .cu sources emulated by g++) run every kernel, and no kernel-backed core falls
  back to the reference (the trace's fallback record stays empty); on a GPU, the same holds for the cuda backend;
- the committed per-block cases launch every entry of every kernel on cuda-emu (forced entries included);
- a mistake in a core is named by the k3geom layer-by-layer trace at its block, layer and step;
- k3cuda.force_entry: unknown entries and a forced bf16 entry on a cache bf16 cannot hold are refused by name.
"""
from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

import k3cuda
from conformance.backends.registry import get_backend
from conformance.cases import traces
from conformance.cases.catalog import all_cases, select
from conformance.cases.core import ENTRY_KEY
from conformance.golden.store import COMMITTED_ROOT, read_golden
from conformance.runner import IN_PROCESS, run
from k3cuda import attnres_mix as AR
from k3cuda import kda_decode as KDA
from k3cuda import mla_decode as MLA
from k3cuda.testing import EMULATED_LAUNCHES, cpu_emulation
from k3ref.config import MXFP4_GROUP, K3Config

GEOM = K3Config.preset("k3geom")
TRACES = "trace/k3geom/*"
# These tests read what the emulator and the trace's fallback record saw (module state of this process), so the
# kernel backends run here rather than in a worker process; isolation itself is tested in test_isolation.py.
EMULATOR_WATCHED = IN_PROCESS | {"cuda-emu", "cuda"}


@pytest.fixture
def emu():
    """The cuda-emu backend (skipped with the reason when g++ is missing) and a fresh launch count."""
    backend = get_backend("cuda-emu")
    ok, why = backend.available()
    if not ok:
        pytest.skip(f"backend cuda-emu unavailable: {why}")
    EMULATED_LAUNCHES.clear()
    return EMULATED_LAUNCHES


def _block_starts(cfg: K3Config) -> list[int]:
    """Layers where an AttnRes block closes (l % block_size == 0; layer 0 closes the embedding's)."""
    return [i for i in range(cfg.num_hidden_layers) if i % cfg.attn_res_block_size == 0]


def test_preset_has_k3_per_head_geometry():
    k3 = K3Config.preset("k3")
    for name in ("kda_head_dim", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                 "gate_lower_bound", "short_conv_kernel_size", "situ_beta", "situ_linear_beta"):
        assert getattr(GEOM, name) == getattr(k3, name), name
    assert GEOM.kda_head_dim == KDA.HEAD_DIM
    assert GEOM.kv_lora_rank == MLA.MAX_R and GEOM.qk_rope_head_dim == MLA.MAX_P
    assert GEOM.routed_expert_hidden_size % MXFP4_GROUP == 0 and GEOM.moe_intermediate_size % MXFP4_GROUP == 0


def test_preset_covers_what_tiny_covers():
    kda, mla = GEOM.kda_layers, GEOM.mla_layers
    assert GEOM.mlp_is_dense(0) and not any(GEOM.mlp_is_dense(i) for i in range(1, GEOM.num_hidden_layers))
    assert len(kda) >= 2 and len(mla) >= 2
    last = GEOM.num_hidden_layers - 1
    assert {last - 1, last} <= set(mla), "two MLA layers in a row at the end"
    starts = _block_starts(GEOM)
    assert len(starts) - 1 >= 2, f"AttnRes blocks close at {starts}: fewer than two boundaries after layer 0"
    # the last AttnRes mix sees every completed block plus the prefix: within the kernel's sources
    assert 1 <= len(starts) + 1 <= AR.MAX_SOURCES
    GEOM.validate_tp(2)


def test_default_case_set_holds_the_k3geom_traces():
    cases = select(all_cases("tiny"), [TRACES])
    assert sorted(c.name for c in cases) == ["trace/k3geom/free-P3-D1", "trace/k3geom/layerwise-P3-D1"]
    for c in cases:
        assert read_golden(COMMITTED_ROOT, c.name).kwargs["config"] == "k3geom"


@pytest.fixture
def fallback_records(monkeypatch):
    """Every fallback record a trace makes (traces.guard_kernels' dict: core -> [count, why the reference
    ran]), one per backend run (the runner also runs the precision's baseline, whose record stays empty)."""
    records = []
    original = traces.guard_kernels

    def recording(cores, kernel_names):
        swapped, calls, fell_back = original(cores, kernel_names)
        records.append(fell_back)        # filled while the trace runs
        return swapped, calls, fell_back

    monkeypatch.setattr(traces, "guard_kernels", recording)
    return records


def test_k3geom_traces_run_every_kernel_on_cuda_emu(emu, fallback_records):
    """No kernel-backed core falls back to its reference inside the K3-geometry traces, and every kernel ran."""
    for case in select(all_cases("tiny"), [TRACES]):
        emu.clear()
        fallback_records.clear()
        report = run([case], ["cuda-emu"], COMMITTED_ROOT, timing=False, in_process=EMULATOR_WATCHED)
        assert report.exit_code == 0, report.first_failure_line()
        assert fallback_records and all(r == {} for r in fallback_records), \
            f"{case.name}: reference cores ran: {fallback_records}"
        ran = {block for block, _ in emu}
        assert ran == set(k3cuda.KERNEL_MODULES), \
            f"{case.name}: kernels that never ran: {sorted(set(k3cuda.KERNEL_MODULES) - ran)}"


@pytest.mark.gpu
def test_k3geom_traces_run_without_fallback_on_cuda(fallback_records):
    """The same on the GPU: the real kernels take every call inside the K3-geometry traces."""
    ok, why = get_backend("cuda").available()
    if not ok:
        pytest.skip(f"CUDA backend unavailable: {why}")
    report = run(select(all_cases("tiny"), [TRACES]), ["cuda"], COMMITTED_ROOT, timing=False,
                 in_process=EMULATOR_WATCHED)
    assert report.exit_code == 0, report.first_failure_line()
    assert fallback_records and all(r == {} for r in fallback_records), f"reference cores ran: {fallback_records}"


def test_tiny_traces_record_the_kda_fallback(emu, fallback_records):
    """The record the test above reads is the real one: tiny's head_dim 8 makes kda_decode fall back."""
    run(select(all_cases("tiny"), ["trace/free-P7-D5"]), ["cuda-emu"], COMMITTED_ROOT, timing=False,
        in_process=EMULATOR_WATCHED)
    assert {"kda_decode"} in [set(r) for r in fallback_records]


def test_block_cases_launch_every_kernel_entry(emu):
    """The committed per-block cases, on cuda-emu, launch every entry of every kernel (forced ones included)."""
    cases = [c for c in all_cases("tiny") if c.kind == "core" and c.block in k3cuda.KERNEL_MODULES]
    report = run(cases, ["cuda-emu"], COMMITTED_ROOT, timing=False, in_process=EMULATOR_WATCHED)
    assert report.exit_code == 0, report.first_failure_line()
    every = {(spec.block, e.name) for spec in k3cuda.kernel_specs() for e in spec.entries}
    assert every - set(emu) == set(), f"entries no case launched: {sorted(every - set(emu))}"


@pytest.mark.parametrize("case, block, entry", [
    pytest.param("kda_decode/B1-H2-K128-nolb-full", "kda_decode", KDA.ENTRY_FULL, id="kda-full"),
    pytest.param("mla_decode/B1-H17-R512-P64-L33-bf16", "mla_decode", MLA.ENTRY_BF16, id="mla-bf16"),
])
def test_forced_entry_case_runs_that_entry(emu, case, block, entry):
    assert read_golden(COMMITTED_ROOT, case).kwargs[ENTRY_KEY] == entry
    report = run(select(all_cases("tiny"), [case]), ["cuda-emu"], COMMITTED_ROOT, timing=False,
                 in_process=EMULATOR_WATCHED)
    assert report.exit_code == 0, report.first_failure_line()
    assert {e for b, e in emu if b == block} & set(KDA.CHOOSABLE_ENTRIES + MLA.CHOOSABLE_ENTRIES) == {entry}


def test_softplus_gate_case_at_head_dim_128():
    g = read_golden(COMMITTED_ROOT, "kda_decode/B1-H2-K128-nolb-full")
    assert g.kwargs["lower_bound"] is None and g.tensors["inputs.q"].shape[-1] == 128


@pytest.mark.parametrize("mutant, block, step", [
    pytest.param("kda-no-lower-bound", "kda_prefill", 0, id="kda-no-lower-bound"),
    pytest.param("mla-scale-128", "mla_decode", 1, id="mla-scale-128"),
    pytest.param("attnres-boundary-off-by-one", "attnres_mix", 0, id="attnres-boundary"),
])
def test_k3geom_layerwise_trace_names_the_block(mutant, block, step):
    layer = {"kda_prefill": GEOM.kda_layers[0], "mla_decode": GEOM.mla_layers[0], "attnres_mix": 1}[block]
    report = run(select(all_cases("tiny"), ["trace/k3geom/layerwise-*"]), [f"mutant:{mutant}"], COMMITTED_ROOT,
                 timing=False)
    assert report.exit_code == 1, f"{mutant} passed the k3geom layer-by-layer trace"
    first = report.first_failure.first_failing
    m = re.search(r"step(\d+)\.layer(\d+)", first.tensor)
    assert first.block == block and m and (int(m[1]), int(m[2])) == (step, layer), report.first_failure_line()


def test_force_entry_names_the_choices():
    with pytest.raises(ValueError, match="mla_decode_split_f32"):
        with k3cuda.force_entry("mla_decode", MLA.ENTRY_COMBINE):
            pass
    with pytest.raises(ValueError, match=r"rmsnorm has no choosable entry 'rmsnorm_f32'; expected one of \[\]"):
        with k3cuda.force_entry("rmsnorm", "rmsnorm_f32"):
            pass
    with k3cuda.force_entry("kda_decode", KDA.ENTRY_FULL):
        assert KDA.pick_entry(1, 1) == KDA.ENTRY_FULL
    assert k3cuda.forced_entry("kda_decode") is None


def test_forced_bf16_entry_refuses_a_cache_bf16_cannot_hold(emu, rng):
    d = MLA.make_inputs(rng, [5], 2)
    with cpu_emulation(), k3cuda.force_entry("mla_decode", MLA.ENTRY_BF16):
        d["kv_cache"] = d["kv_cache"].astype(ml_dtypes.bfloat16).astype(np.float32)   # bf16 values: accepted
        MLA.device_launch(d)()
        d["kv_cache"][d["block_table"][0, 0], 0, 0] = np.float32(1.0 + 2.0 ** -20)   # a read row, not bf16
        with pytest.raises(ValueError, match="cannot represent"):
            MLA.device_launch(d)
    assert emu[("mla_decode", MLA.ENTRY_BF16)] == 1
