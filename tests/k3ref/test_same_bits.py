"""Same inputs, same bits: the references give identical float32 and float64 outputs on 1, 2 and 4 threads
(OpenBLAS, numba and K3_THREADS together) and on every OpenBLAS core type this CPU can run.

Each configuration runs `probe` in a fresh interpreter (thread pools are sized when the libraries load, so a
thread count cannot be changed for a library that is already loaded and threading), with the environment set only
in that child: the parent's OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE, which CI sets, are left as they are for the
thread sweep. The child writes every output to an .npz and prints one sha256 per output; the parent compares.

Across thread counts every output must be identical, for every core type. Across core types the BLAS kernels
differ (Sandybridge has no FMA: a GEMM there rounds each product before the add), so outputs computed through
BLAS may differ in their last bits; the test asserts identity for the BLAS-free outputs and lists, for the others,
which outputs differ, in how many elements and by how many units in the last place.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from k3ref import threads

ROOT = Path(__file__).resolve().parents[2]
THREADS = (1, 2, 4)
# OpenBLAS kernels to try, newest instruction sets first; one the CPU cannot run dies with SIGILL and is skipped.
CORE_TYPES = ("Haswell", "Zen", "SkylakeX", "Sandybridge", "Nehalem", "Prescott")
# Outputs that no BLAS call computes: they must be identical on every core type too. The compiled kernels (GEMV,
# MXFP4 experts, MLA decode), the KDA decode core and the float64 chunked prefill (k3ref.fast.kda_jit) call no
# BLAS; the float32 chunked prefill (the NumPy WY form) and the host graph's logits (float32: MLA, AttnRes and
# the KDA prefill; float64: every projection too) still go through BLAS, so they are listed, not asserted. An
# output moves in here when its path stops calling BLAS.
BLAS_FREE = frozenset({"kda_chunked.o.float64", "kda_chunked.S.float64", "gemv.float32_weight.float32"}
                      | {f"{out}.{dt}" for dt in ("float32", "float64")
                         for out in ("kda_decode_core.o", "kda_decode_core.S", "gemv.bf16_weight.one_row",
                                     "gemv.bf16_weight.five_rows", "mxfp4_experts", "mla_decode_compiled")})
NO_FMA_CORE = "Sandybridge"   # AVX without FMA: its GEMMs round every product, unlike this CPU's own kernel
PROBE_TIMEOUT_S = 240
# glibc picks FMA variants of exp, log, pow... at run time (ifuncs); these hide FMA and AVX2 from it, as on an older
# CPU. NumPy's float64 exp calls glibc's on CPUs without AVX-512, so float64 results can move with the CPU.
GLIBC_WITHOUT_FMA = {"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2_Usable,-FMA_Usable,-AVX2,-FMA"}


def _kda_inputs(dt, T=512, H=4, K=128, V=128, seed=0):
    from k3ref.kda import kda_gate  # noqa: PLC0415 -- runs in the child only, after its environment is set

    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, 1, T, H, K))
    v = rng.standard_normal((1, T, H, V))
    g = kda_gate(rng.standard_normal((1, T, H, K)), np.log(rng.uniform(1, 16, H)), rng.uniform(-1, 1, H * K))
    beta = rng.uniform(0, 1, (1, T, H))
    return tuple(a.astype(dt) for a in (q, k, v, g, beta))


def _decode_inputs(dt, B=2, H=8, K=128, V=128, seed=1):
    rng = np.random.default_rng(seed)
    q, k, g_raw = rng.standard_normal((3, B, H, K))
    v = rng.standard_normal((B, H, V))
    beta_raw = rng.standard_normal((B, H))
    A_log, dt_bias = np.log(rng.uniform(1, 16, H)), rng.uniform(-1, 1, H * K)
    state = rng.standard_normal((B, H, K, V)) * 0.1
    return tuple(a.astype(dt) for a in (q, k, v, g_raw, beta_raw, A_log, dt_bias, state))


def _compiled_kernels(dt, outputs: dict[str, np.ndarray]) -> None:
    """The compiled kernels called directly, each large enough to run on numba's threads: the GEMV (one row of x,
    weight row by weight row; five rows, in tiles), the MXFP4 experts and the compiled MLA decode."""
    from k3ref.fast import gemv_jit, mla_jit, mxfp4_jit  # noqa: PLC0415 -- see probe

    name = np.dtype(dt).name
    rng = np.random.default_rng(2)
    w32 = rng.standard_normal((1024, 1024)).astype(np.float32)                          # 4 MB: threaded
    bf16 = (w32.view(np.uint32) >> 16).astype(np.uint16)                                 # 2 MB of bf16 bits
    x = rng.standard_normal((5, 1024)).astype(dt)
    outputs[f"gemv.bf16_weight.one_row.{name}"] = gemv_jit.linear_jit(x[:1], bf16)
    outputs[f"gemv.bf16_weight.five_rows.{name}"] = gemv_jit.linear_jit(x, bf16)
    if dt == np.float32:
        outputs["gemv.float32_weight.float32"] = gemv_jit.linear_jit(x[:1], w32)
    packed = [rng.integers(0, 256, (256, 512), dtype=np.uint8) for _ in range(4)]         # 4 experts, 0.56 MB
    scale = [rng.integers(118, 126, (256, 32), dtype=np.uint8) for _ in range(4)]
    starts, rows_of = np.array([0, 2, 4, 6, 8]), np.array([0, 1, 1, 2, 0, 2, 1, 0])
    outputs[f"mxfp4_experts.{name}"] = mxfp4_jit.experts_gemv(packed, scale, x[:3], starts, rows_of,
                                                              np.empty((8, 256), dt))
    kv = rng.standard_normal((8, 64, 576)).astype(dt)                                    # 8 pages of 64 rows
    table, lens = np.array([[3, 0, 6, 1, 5], [7, 2, 4, 4, 4]]), np.array([300, 70])
    q = rng.standard_normal((2, 32, 576)).astype(dt)                                     # 2 head blocks each
    outputs[f"mla_decode_compiled.{name}"] = mla_jit.mla_decode(q, kv, table, lens, 0.04, 512)[0]


def probe(out: str) -> None:
    """Run in the child: every output into `out` (.npz), one JSON line {name: sha256} on stdout."""
    # the references are imported here, after the child's environment has sized the thread pools
    from k3ref.config import K3Config  # noqa: PLC0415 -- see above
    from k3ref.cpu_forward import K3CpuModel, forward_prefill, forward_token  # noqa: PLC0415 -- see above
    from k3ref.kda import kda_chunked, kda_decode_core  # noqa: PLC0415 -- see above

    outputs: dict[str, np.ndarray] = {}
    for dt in (np.float32, np.float64):
        name = np.dtype(dt).name
        _compiled_kernels(dt, outputs)
        q, k, v, g, beta = _kda_inputs(dt)
        o, S = kda_chunked(q, k, v, g, beta, use_qk_l2norm=True)
        outputs[f"kda_chunked.o.{name}"], outputs[f"kda_chunked.S.{name}"] = o, S
        o, S = kda_decode_core(*_decode_inputs(dt))
        outputs[f"kda_decode_core.o.{name}"], outputs[f"kda_decode_core.S.{name}"] = o, S
        model = K3CpuModel.synthetic(K3Config.preset("tiny"), seed=3, dtype=dt)
        cache = model.new_cache()
        seq = cache.add_sequence()
        prompt = [5, 17, 3, 42, 8, 1, 60, 11]
        outputs[f"forward_prefill.logits.{name}"] = forward_prefill(model, prompt, cache, seq=seq)
        for i, token in enumerate((4, 29)):
            outputs[f"forward_token{i}.logits.{name}"] = forward_token(model, token, len(prompt) + i, cache, seq=seq)
    np.savez(out, **outputs)  # type: ignore[arg-type]  # numpy's stub reads ** as its allow_pickle flag
    print(json.dumps({n: hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest() for n, a in outputs.items()}))


def _run(tmp_path: Path, threads: int, core_type: str | None,
         extra_env: dict[str, str] | None = None) -> tuple[dict[str, str] | None, str]:
    """(hashes, why): hashes None when the child died of SIGILL (a core type this CPU cannot run). The outputs
    go to tmp_path / "{core_type or 'default'}-{threads}.npz"; extra_env, if given, names a variant instead."""
    env = {k: v for k, v in os.environ.items() if k != "K3_FAST"}    # the default paths, as users get them
    env.update(extra_env or {})
    n = str(threads)
    env.update(OPENBLAS_NUM_THREADS=n, NUMBA_NUM_THREADS=n, K3_THREADS=n, OMP_NUM_THREADS=n)
    if core_type is not None:
        env["OPENBLAS_CORETYPE"] = core_type
    out = tmp_path / f"{core_type or 'default'}-{threads}.npz"
    if extra_env:
        out = tmp_path / f"{'+'.join(sorted(extra_env))}-{threads}.npz"
    done = subprocess.run([sys.executable, "-c", f"from tests.k3ref.test_same_bits import probe; probe({str(out)!r})"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    if done.returncode == -4:                                         # SIGILL: an instruction this CPU lacks
        return None, f"{core_type}: SIGILL (instructions this CPU lacks), skipped"
    assert done.returncode == 0, f"probe ({core_type or 'default'} core type, {threads} threads) failed:\n" \
                                 f"{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1]), ""


def _differing(a: dict[str, str], b: dict[str, str]) -> list[str]:
    assert a.keys() == b.keys()
    return sorted(name for name in a if a[name] != b[name])


def ulp_diff(x: np.ndarray, y: np.ndarray) -> tuple[int, int]:
    """(elements whose bits differ, largest difference in units in the last place) of two same-dtype float
    arrays; -0 and +0 differ in bits but are 0 ulp apart."""
    assert x.shape == y.shape and x.dtype == y.dtype
    ints = np.int32 if x.dtype.itemsize == 4 else np.int64
    lowest = -(1 << (8 * x.dtype.itemsize - 1))                       # the sign bit alone, as an integer
    bx, by = (np.asarray(a).view(ints).astype(np.int64) for a in (x, y))
    # IEEE floats ordered as integers: flip the negative ones so consecutive floats are consecutive integers
    xi, yi = (np.where(b < 0, lowest - b, b) for b in (bx, by))
    # max - min as unsigned 64-bit: exact even when the two are of opposite signs and far apart
    ulps = np.maximum(xi, yi).astype(np.uint64) - np.minimum(xi, yi).astype(np.uint64)
    return int(np.count_nonzero(bx != by)), int(ulps.max(initial=0))


def test_blas_threads_limits_and_restores_and_fixed_blas_nests():
    before = [lib["num_threads"] for lib in threads.blas_info()]
    assert before, "expected NumPy's BLAS to be found loaded"
    with threads.blas_threads(1):
        assert [lib["num_threads"] for lib in threads.blas_info()] == [1] * len(before)
        with threads.blas_threads(2):
            assert [lib["num_threads"] for lib in threads.blas_info()] == [2] * len(before)
        assert [lib["num_threads"] for lib in threads.blas_info()] == [1] * len(before)
    assert [lib["num_threads"] for lib in threads.blas_info()] == before

    seen = []

    @threads.fixed_blas
    def inner():
        seen.append(threads.blas_info()[0]["num_threads"])
        return len(seen)

    outer = threads.fixed_blas(lambda: inner() + inner())
    with threads.blas_threads(2):
        assert outer() == 3 and seen == [1, 1]                        # one thread inside, also when nested
        assert threads.blas_info()[0]["num_threads"] == 2             # and the caller's limit restored after
    with pytest.raises(ValueError, match="blas_threads: expected a thread count >= 1, found 0"):
        with threads.blas_threads(0):
            pass


def test_one_thread_pins_of_two_python_threads_overlap():
    """OpenBLAS has one thread count per process: a thread leaving its pin must not restore the old count while
    another thread still computes under its own pin; the last one out restores it."""
    before = threads.blas_info()[0]["num_threads"]
    entered, leave = threading.Event(), threading.Event()

    def other():
        with threads.blas_threads(1):
            entered.set()
            leave.wait(timeout=30)

    worker = threading.Thread(target=other)
    with threads.blas_threads(1):
        worker.start()
        assert entered.wait(timeout=30)
    try:
        assert threads.blas_info()[0]["num_threads"] == 1             # the worker's pin still holds
    finally:
        leave.set()
        worker.join(timeout=30)
    assert threads.blas_info()[0]["num_threads"] == before


def test_describe_blas_names_library_kernel_and_threads():
    with threads.blas_threads(1):
        line = threads.describe_blas()
    info = threads.blas_info()[0]
    assert f" {info['version']} " in line, line
    assert line.endswith(", 1 thread") and (f"({info['architecture']} kernel)" in line) == bool(info["architecture"])


def test_compute_threads_reads_k3_threads(monkeypatch):
    monkeypatch.setenv("K3_THREADS", "3")
    assert threads.compute_threads() == 3
    monkeypatch.setenv("K3_THREADS", "none")
    with pytest.raises(ValueError, match="K3_THREADS: expected a thread count >= 1, found 'none'"):
        threads.compute_threads()
    monkeypatch.delenv("K3_THREADS")
    assert threads.compute_threads() >= 1


def test_ulp_diff_counts_units_in_the_last_place():
    x = np.array([1.0, -2.0, 0.0, 3.0], np.float32)
    y = x.copy()
    y[0] = np.nextafter(y[0], np.float32(2))
    y[1] = np.nextafter(np.nextafter(y[1], np.float32(0)), np.float32(0))
    y[2] = -0.0                                                      # other bits, the same number: 0 ulp
    assert ulp_diff(x, y) == (3, 2)
    assert ulp_diff(x, x) == (0, 0)


@pytest.fixture(scope="module")
def default_runs(tmp_path_factory) -> tuple[Path, dict[int, dict[str, str]]]:
    """The probe on this machine's own BLAS kernel (as users run it) at 1, 2 and 4 threads."""
    where = tmp_path_factory.mktemp("same_bits")
    runs = {t: _run(where, t, None)[0] for t in THREADS}
    assert all(r is not None for r in runs.values()), "the default BLAS kernel died of SIGILL"
    return where, {t: r for t, r in runs.items() if r is not None}


def test_same_bits_across_thread_counts(default_runs):
    """1, 2 and 4 threads (OpenBLAS, numba, K3_THREADS) give identical bits, float32 and float64."""
    where, runs = default_runs
    diffs = {t: _differing(runs[1], r) for t, r in runs.items() if t != 1}
    assert not any(diffs.values()), ("outputs that depend on the thread count (vs 1 thread):\n"
                                     + _element_report(where, "default", diffs))


def test_blas_free_outputs_same_on_a_core_without_fma(default_runs):
    """OpenBLAS's Sandybridge kernel (no FMA) at 1 and 4 threads: identical across its thread counts, and the
    BLAS-free outputs identical to this machine's own kernel; the others are listed in the test's output."""
    where, runs = default_runs
    other = {t: _run(where, t, NO_FMA_CORE) for t in (1, 4)}
    if any(h is None for h, _ in other.values()):
        pytest.skip(next(why for h, why in other.values() if h is None))
    hashes = {t: h for t, (h, _) in other.items() if h is not None}
    assert _differing(hashes[1], hashes[4]) == [], f"{NO_FMA_CORE}: outputs depend on the thread count"
    across = {NO_FMA_CORE: _differing(runs[1], hashes[1])}
    print(f"\n{NO_FMA_CORE} against this machine's kernel, 1 thread:")
    print(_element_report(where, "default", across) or "  every output identical")
    assert not set(across[NO_FMA_CORE]) & BLAS_FREE, f"BLAS-free outputs that differ: {across}"


def _element_report(tmp_path: Path, base_name: str, diffs: dict, base_key=1) -> str:
    lines = []
    with np.load(tmp_path / f"{base_name}-{base_key}.npz", allow_pickle=False) as base:
        for key, names in diffs.items():
            other_file = tmp_path / (f"{base_name}-{key}.npz" if isinstance(key, int) else f"{key}-1.npz")
            with np.load(other_file, allow_pickle=False) as other:
                for name in names:
                    n, ulps = ulp_diff(base[name], other[name])
                    lines.append(f"  {key}: {name}: {n} of {base[name].size} elements differ, max {ulps} ulp")
    return "\n".join(lines)


@pytest.mark.slow
def test_same_bits_across_core_types(tmp_path, request):
    """Every OpenBLAS core type this CPU runs: identical across thread counts for each; across core types the
    BLAS-free outputs identical and the others listed (outputs, elements, max ulp) in the test's output."""
    if "slow" not in (request.config.option.markexpr or ""):
        pytest.skip("15 fresh interpreters (5 core types x 3 thread counts, 1-4 min): run with -m slow")
    ran: dict[str, dict[str, str]] = {}
    for core in CORE_TYPES:
        first, why = _run(tmp_path, THREADS[0], core)
        if first is None:
            print(why)
            continue
        hashes = {THREADS[0]: first}
        for t in THREADS[1:]:
            h, why = _run(tmp_path, t, core)
            assert h is not None, why
            hashes[t] = h
        bad = {t: _differing(hashes[1], h) for t, h in hashes.items() if t != 1}
        assert not any(bad.values()), (f"{core}: outputs that depend on the thread count (vs 1 thread):\n"
                                       + _element_report(tmp_path, core, bad))
        ran[core] = hashes[1]
    assert len(ran) >= 2, f"expected at least two runnable core types, found {sorted(ran)}"
    first = next(iter(ran))
    across = {core: _differing(ran[first], h) for core, h in ran.items() if core != first}
    print(f"core types run: {sorted(ran)}; against {first}, 1 thread:")
    print(_element_report(tmp_path, first, across) or "  every output identical")
    # recorded, not asserted: what a CPU without FMA changes outside BLAS (glibc's libm), on this machine's kernel
    libm, _ = _run(tmp_path, 1, None, GLIBC_WITHOUT_FMA)
    base, _ = _run(tmp_path, 1, None)
    assert libm is not None and base is not None
    print(f"glibc without FMA/AVX2 ({GLIBC_WITHOUT_FMA['GLIBC_TUNABLES']}), against the default, 1 thread:")
    print(_element_report(tmp_path, "default", {"GLIBC_TUNABLES": _differing(base, libm)})
          or "  every output identical")
    blas_free_diffs = {core: sorted(set(names) & BLAS_FREE) for core, names in across.items()}
    assert not any(blas_free_diffs.values()), f"BLAS-free outputs that depend on the core type: {blas_free_diffs}"
