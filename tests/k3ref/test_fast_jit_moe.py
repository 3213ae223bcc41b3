"""The compiled MXFP4 experts and bf16 GEMV (k3ref.fast.mxfp4_jit, k3ref.fast.gemv_jit) against the readable
forms: dequantize + matmul, the NumPy routed-expert path, x @ W.astype(dtype).T; their summation order stated in
NumPy (same bits), and the same bits on 1 and 2 numba threads. K3's expert shapes (latent 3584, intermediate 3072).
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numba
import numpy as np
import pytest

from k3ref import cpu_weights, fast, mxfp4, ops
from k3ref import latent_moe as lm
from k3ref.config import K3Config
from k3ref.cpu_forward import K3CpuModel, forward_prefill, forward_token
from k3ref.cpu_weights import ModuleView, table_matmul, take_rows
from k3ref.fast import gemv_jit, mxfp4_jit
from k3ref.fast import latent_moe as moe_fast
from k3ref.threads import numba_threads
from k3ref.weights import synthetic_weights
from tests.support.tolerances import rel_rms, tol

ROOT = Path(__file__).resolve().parents[2]
DL, DI = 3584, 3072                      # K3's routed expert: latent and intermediate widths
GATE = {np.float64: tol("fp64_same_math"), np.float32: tol("fp32_vs_fp64")}


def _expert_bytes(rng, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Random MXFP4 bytes; scale bytes 118..125 keep products O(1)."""
    return (rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8),
            rng.integers(118, 126, (rows, cols // 32), dtype=np.uint8))


@pytest.fixture(scope="module")
def k3_matrix():
    return _expert_bytes(np.random.default_rng(0), DI, DL)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("T", [1, 16])
def test_mxfp4_gemv_k3_shape_equals_dequantize_then_matmul(k3_matrix, dtype, T):
    packed, scale = k3_matrix
    x = np.random.default_rng(T).standard_normal((T, 2 * DL)).astype(dtype)[:, ::2]   # not contiguous
    want = x.astype(np.float64) @ mxfp4.dequantize(packed, scale).astype(np.float64).T
    got = mxfp4.mxfp4_gemv(packed, scale, x)
    assert got.dtype == dtype and got.shape == (T, DI)
    assert rel_rms(got, want) <= GATE[dtype]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("M", [1, 2, 3, 5, 9])           # rows of x a decoded row serves: 1-4 at once, and tails
def test_mxfp4_kernel_sums_in_the_stated_order_and_keeps_inf_and_nan(dtype, M):
    rng = np.random.default_rng(3)
    packed, scale = _expert_bytes(rng, 25, 96)      # odd: two-row tiles and a one-row tail
    scale[0, 1], scale[1, 0], scale[2, 2], scale[3, 1], scale[4, 0] = 255, 254, 0, 129, 128
    x = rng.standard_normal((M, 96)).astype(dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        W = mxfp4.dequantize(packed, scale)
        got = mxfp4_jit.gemv(packed, scale, x)
        want = mxfp4_jit.lane_order_reference(W, x)
        ref = x @ W.astype(dtype).T
    assert np.array_equal(got, want, equal_nan=True)                  # the same bits as the stated order
    assert np.array_equal(np.isnan(got), np.isnan(ref)) and np.isnan(got[:, 0]).all()  # scale 255 -> NaN rows
    assert np.array_equal(np.isinf(got), np.isinf(ref))
    fin = np.isfinite(ref)
    assert rel_rms(got[fin], ref[fin]) <= GATE[dtype]


def test_group_tables_are_what_dequantize_gives():
    """Every (scale byte, code) the lookup can meet, against the readable decoding: NaN, inf and -0 included."""
    codes = np.arange(16, dtype=np.uint8)
    row = np.tile(codes[0::2] | (codes[1::2] << 4), 2)                  # codes 0..15 twice: one 32-code group
    with np.errstate(over="ignore"):
        want = mxfp4.dequantize(np.tile(row, (256, 1)), np.arange(256, dtype=np.uint8)[:, None])[:, :16]
    tables = mxfp4_jit.GROUP_TABLES
    assert tables.dtype == np.float32 and tables.shape == (256, 16) and not tables.flags.writeable
    assert np.array_equal(tables.view(np.uint32), want.view(np.uint32))   # bit for bit


def _kernel_variant_outputs(out: str) -> None:
    """Run in a child with a fresh numba cache: the kernel's outputs on fixed inputs (every scale byte, float32
    and float64) into `out` (.npz)."""
    rng = np.random.default_rng(12)
    packed = rng.integers(0, 256, (64, 256), dtype=np.uint8)
    scale = rng.integers(0, 256, (64, 16), dtype=np.uint8)
    scale[:, 0] = np.arange(64) + 100                                  # 100 .. 163: both sides of 128
    scale[0, 3], packed[0, 48:64] = 254, 0                              # row 0: one weight 6 x 2^127 = inf
    packed[0, 48] = 7
    scale[1, 5] = 255                                                   # row 1: a NaN group
    x = rng.standard_normal((2, 512))
    with np.errstate(invalid="ignore", over="ignore"):
        np.savez(out, **{np.dtype(dt).name: mxfp4_jit.gemv(packed, scale, x.astype(dt))
                         for dt in (np.float32, np.float64)})


@pytest.mark.parametrize("variant", [
    pytest.param({"NUMBA_CPU_NAME": "generic"}, id="computed-weights"),    # no variable permute: arithmetic
    pytest.param({"K3_TEST_MXFP4_OPAQUE": "0"}, id="lookup-without-asm"),
    pytest.param({"K3_TEST_MXFP4_TABLE64": "0"}, id="float64-through-the-float32-table"),
])
def test_mxfp4_kernel_variants_give_the_same_bits(variant, tmp_path):
    """The decoding is chosen by the CPU numba compiles for (a table lookup where x86 has a variable permute,
    the weights computed elsewhere; an empty asm statement on AVX-512 for speed; float64 x looked up in the
    float64 table on AVX-512). Each variant must give the bits of the one this machine runs."""
    env = {**{k: v for k, v in os.environ.items() if k != "K3_FAST"}, **variant,
           "NUMBA_CACHE_DIR": str(tmp_path / "numba-cache")}
    script = ("import os, sys\n"
              "from k3ref.fast import mxfp4_jit\n"
              "if os.environ.get('K3_TEST_MXFP4_OPAQUE') == '0':\n"
              "    mxfp4_jit._OPAQUE = False\n"
              "if os.environ.get('K3_TEST_MXFP4_TABLE64') == '0':\n"
              "    mxfp4_jit._PERMUTE64 = False\n"
              "from tests.k3ref.test_fast_jit_moe import _kernel_variant_outputs\n"
              "_kernel_variant_outputs(sys.argv[1])\n")
    child = subprocess.run([sys.executable, "-c", script, str(tmp_path / "child.npz")], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-2000:]
    _kernel_variant_outputs(str(tmp_path / "here.npz"))
    here, there = np.load(tmp_path / "here.npz"), np.load(tmp_path / "child.npz")
    for name in ("float32", "float64"):
        assert np.isnan(here[name]).any() and np.isinf(here[name]).any() and np.isfinite(here[name]).any()
        assert np.array_equal(here[name].view(np.uint8), there[name].view(np.uint8)), name


def _k3_moe(n_experts: int, top_k: int):
    cfg = lm.LatentMoeConfig(hidden_size=64, num_experts=n_experts, top_k=top_k, latent_size=DL,
                             moe_intermediate_size=DI, n_shared_experts=0, shared_intermediate_size=0)
    rng = np.random.default_rng(11)
    weights = {}
    for e in range(n_experts):
        for proj, (rows, cols) in (("w1", (DI, DL)), ("w3", (DI, DL)), ("w2", (DL, DI))):
            p, s = _expert_bytes(rng, rows, cols)
            weights[f"experts.{e}.{proj}.weight_packed"], weights[f"experts.{e}.{proj}.weight_scale"] = p, s
    return cfg, weights


@pytest.fixture(scope="module")
def k3_moe():
    return _k3_moe(3, 2)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("T", [1, 16])
def test_routed_experts_compiled_equals_the_numpy_path(k3_moe, dtype, T, monkeypatch):
    cfg, weights = k3_moe
    rng = np.random.default_rng(T)
    z = (0.05 * rng.standard_normal((T, 2 * DL))).astype(dtype)[:, 1::2]        # not contiguous
    idx = np.array([rng.choice(cfg.num_experts, cfg.top_k, replace=False) for _ in range(T)], np.int64)
    w = rng.uniform(0.1, 1.0, (T, cfg.top_k)).astype(dtype)
    got = lm.routed_experts(weights, z, w, idx, cfg)
    monkeypatch.setenv("K3_FAST", "numpy")
    want = lm.routed_experts(weights, z.astype(np.float64), w.astype(np.float64), idx, cfg)
    assert got.dtype == dtype and got.shape == (T, DL)
    assert rel_rms(got, want) <= GATE[dtype]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_experts_read_where_they_lie_give_each_experts_own_bits(dtype):
    """experts_gemv reads each expert's own arrays by address: every pair gets the bits of that expert's matrix
    alone (`gemv`), on one and two threads, with a strided expert (copied first) and an expert with no pairs among
    them; experts of another shape are refused (the kernel would read past them)."""
    rng = np.random.default_rng(21)
    n, R, K = 3, 40, 96
    experts = [_expert_bytes(rng, R, K) for _ in range(n)]
    strided = np.repeat(experts[1][0], 2, axis=1)[:, ::2]                  # expert 1's bytes, every other one
    x = rng.standard_normal((4, K)).astype(dtype)
    starts = np.array([0, 2, 2, 5], np.int64)                              # expert 1 has no pairs
    rows_of = np.array([0, 3, 1, 2, 3], np.int64)
    spans = [(0, 2), (2, 2), (2, 5)]
    want = np.concatenate([mxfp4_jit.gemv(*e, x[rows_of[p:q]]) for (p, q), e in zip(spans, experts, strict=True)])
    readable = np.concatenate([x[rows_of[p:q]].astype(np.float64) @ mxfp4.dequantize(*e).astype(np.float64).T
                               for (p, q), e in zip(spans, experts, strict=True)])
    assert rel_rms(want, readable) <= GATE[dtype]
    for threads in (1, 2):
        with numba_threads(threads):
            got = mxfp4_jit.experts_gemv([experts[0][0], strided, experts[2][0]], [s for _, s in experts], x,
                                         starts, rows_of, np.empty((5, R), dtype))
        assert np.array_equal(got, want)
    with pytest.raises(ValueError, match=r"expected every expert's packed \[40, 48\]"):
        mxfp4_jit.experts_gemv([experts[0][0], experts[1][0][:20]], [s for _, s in experts[:2]], x, starts[:3],
                               rows_of[:2], np.empty((2, R), dtype))


def test_experts_by_address_give_the_bits_of_the_copying_path():
    """The pairs form reads experts by the addresses taken when they were checked (`experts_gemv_at`); without
    them, or with one strided expert (address None), it goes through `experts_gemv`: the same bits each way."""
    cfg = lm.LatentMoeConfig(hidden_size=24, num_experts=6, top_k=2, latent_size=64, moe_intermediate_size=32,
                             n_shared_experts=0, shared_intermediate_size=0)
    rng = np.random.default_rng(9)
    weights = lm.random_moe_weights(cfg, rng, np.float32)
    z = rng.standard_normal((3, cfg.latent_size)).astype(np.float32)
    idx = np.array([[4, 1], [1, 3], [0, 4]], np.int64)
    w = rng.uniform(0.1, 1.0, (3, 2)).astype(np.float32)
    chosen = [0, 1, 3, 4]
    glu = functools.partial(lm.situ_glu, beta=cfg.situ_beta, linear_beta=cfg.linear_beta)
    checked = [lm._check_expert(weights, e, cfg) for e in chosen]
    assert all(t["at"]["w2"] == (t["w2"][0].ctypes.data, t["w2"][1].ctypes.data) for t in checked)
    by_address = moe_fast.routed_pairs_jit(checked, z, w, idx, chosen, glu)
    copied = moe_fast.routed_pairs_jit([{p: t[p] for p in ("w1", "w3", "w2")} for t in checked], z, w, idx,
                                       chosen, glu)
    strided = dict(checked[1], w1=(np.repeat(checked[1]["w1"][0], 2, axis=1)[:, ::2], checked[1]["w1"][1]))
    strided["at"] = dict(strided["at"], w1=moe_fast.addresses(*strided["w1"]))
    assert strided["at"]["w1"] is None
    mixed = moe_fast.routed_pairs_jit([checked[0], strided, *checked[2:]], z, w, idx, chosen, glu)
    assert np.array_equal(by_address, copied) and np.array_equal(mixed, copied)
    assert rel_rms(copied, lm.routed_experts(weights, z, w, idx, cfg, cores=None)) == 0.0


@pytest.mark.parametrize("T,E,k", [(1, 64, 8), (16, 896, 16), (5, 7, 2)])
def test_expert_pairs_group_by_expert_with_tokens_ascending(T, E, k):
    """The pairs of each chosen expert, experts ascending, tokens ascending within one, with the router weight of
    that (token, slot); an expert left out (another rank's) has no pairs."""
    rng = np.random.default_rng(T)
    idx = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
    w = rng.random((T, k)).astype(np.float32)
    present = sorted({int(e) for e in idx.ravel()})
    for chosen in (present, present[::2]):
        starts, toks, ws = moe_fast.expert_pairs(idx, w, chosen)
        assert starts.dtype == toks.dtype == np.int64 and ws.dtype == np.float32
        assert starts[0] == 0 and starts[-1] == len(toks) == sum(int((idx == e).sum()) for e in chosen)
        for j, e in enumerate(chosen):
            tok, slot = np.nonzero(idx == e)
            assert np.array_equal(toks[starts[j]:starts[j + 1]], tok)
            assert np.array_equal(ws[starts[j]:starts[j + 1]], w[tok, slot])


def test_routed_experts_same_bits_on_one_and_two_threads(k3_moe):
    cfg, weights = k3_moe
    rng = np.random.default_rng(5)
    z = (0.05 * rng.standard_normal((4, DL))).astype(np.float32)
    idx = np.array([[0, 1], [2, 0], [1, 2], [0, 2]], np.int64)
    w = rng.uniform(0.1, 1.0, (4, 2)).astype(np.float32)
    outs = []
    for n in (1, 2):
        with numba_threads(n):
            outs.append(lm.routed_experts(weights, z, w, idx, cfg))
    assert np.array_equal(outs[0], outs[1])


def test_routed_experts_compiled_keeps_the_route_checks(k3_moe):
    cfg, weights = k3_moe
    z = np.zeros((1, DL))
    with pytest.raises(ValueError, match="distinct experts"):
        lm.routed_experts(weights, z, np.ones((1, 2)), np.array([[1, 1]]), cfg)


@pytest.fixture(scope="module")
def bf16_weight():
    return np.random.default_rng(2).standard_normal((DL, 7168)).astype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("T", [1, 16])
def test_bf16_linear_equals_the_cast_product(bf16_weight, dtype, T):
    x = np.random.default_rng(T).standard_normal((2 * T, 7168)).astype(dtype)[::2]      # not contiguous
    want = x.astype(np.float64) @ bf16_weight.astype(np.float64).T
    got = ops.linear(x, bf16_weight)
    assert got.dtype == dtype and got.shape == (T, DL)
    assert rel_rms(got, want) <= GATE[dtype]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("wtype", [ml_dtypes.bfloat16, np.float32, np.float64])
@pytest.mark.parametrize(("M", "N", "K"), [(2, 21, 45), (1, 4, 16), (3, 5, 32), (5, 9, 33), (16, 23, 64),
                                           (17, 6, 47), (4, 3, 15), (1, 21, 45), (1, 9, 33)])
@pytest.mark.parametrize("short_row_bytes", [0, 1 << 40], ids=["tiles", "row-by-row"])
def test_gemv_kernel_sums_in_the_stated_order_and_propagates_nan(dtype, wtype, M, N, K, short_row_bytes,
                                                                  monkeypatch):
    """Tiles of 4 (float32) or 3 (float64) weight rows and up to 4 rows of x: every remainder of N and M, K with
    and without a ragged tail (read element by element, never past the row), NaN, and a row of -0 products; bf16,
    float32 and float64 weights (a float64 weight against float32 x is rounded first, as astype does). One row of x
    takes both forms: tiles, and one weight row at a time (`SHORT_ROW_BYTES`)."""
    monkeypatch.setattr(gemv_jit, "SHORT_ROW_BYTES", short_row_bytes)
    rng = np.random.default_rng(4 + M + N + K)
    w = rng.standard_normal((N, K)).astype(wtype)
    w[N - 1, K // 2] = np.nan
    w[0] = -0.0 if N > 1 else w[0]                                      # row 0: every product -0 or +0
    x = rng.standard_normal((M, K)).astype(dtype)
    x[0] = np.abs(x[0])                                                  # token 0 x row 0: all -0 products
    got = gemv_jit.linear_jit(x, w)
    want = gemv_jit.lane_order_reference(w, x)
    assert got.shape == (M, N) and got.dtype == dtype
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))     # bit for bit: NaN payloads and -0 too
    if wtype is ml_dtypes.bfloat16:
        assert np.array_equal(gemv_jit.linear_jit(x, w.view(np.uint16)), got, equal_nan=True)   # uint16 bits too
    assert np.isnan(got[:, N - 1]).all() and np.isfinite(got[:, :N - 1]).all()
    fin = np.isfinite(got)
    assert rel_rms(got[fin], (x @ w.astype(dtype).T)[fin]) <= GATE[dtype]  # and near BLAS's answer


def test_bf16_linear_same_bits_on_one_and_two_threads(bf16_weight):
    x = np.random.default_rng(9).standard_normal((3, 7168))
    outs = []
    for n in (1, 2):
        with numba_threads(n):
            outs.append(ops.linear(x, bf16_weight))
    assert numba.config.NUMBA_NUM_THREADS >= 1 and np.array_equal(outs[0], outs[1])


def test_module_view_hands_out_large_bf16_as_stored_only_with_the_fast_path(bf16_weight, monkeypatch):
    weights = {"m.big.weight": bf16_weight, "m.small.weight": bf16_weight[:4, :8].copy()}
    view = ModuleView(weights, "m.", np.float64)
    big = view["big.weight"]
    assert big.dtype == bf16_weight.dtype and not big.flags.writeable and np.shares_memory(big, bf16_weight)
    assert view["small.weight"].dtype == np.float64
    assert ModuleView(weights, "m.", np.float64, cache={})["big.weight"].dtype == np.float64
    monkeypatch.setenv("K3_FAST", "numpy")
    assert view["big.weight"].dtype == np.float64


def test_take_rows_and_table_matmul(bf16_weight):
    table = np.random.default_rng(6).standard_normal((50, 16)).astype(np.float32)
    rows = take_rows({"t": table}, "t", slice(3, 9), np.float32)
    assert np.shares_memory(rows, table) and not rows.flags.writeable and np.array_equal(rows, table[3:9])
    assert take_rows({"t": table}, "t", slice(0, 2), np.float64).dtype == np.float64
    x = np.random.default_rng(7).standard_normal((2, 16))
    for t in (table, table.astype(ml_dtypes.bfloat16)):
        got = table_matmul({"t": t}, "t", x, np.float64, block_rows=7)
        assert rel_rms(got, x @ t.astype(np.float64).T) <= tol("fp64_same_math")


def test_float32_linear_and_lm_head_sum_in_the_kernels_order(monkeypatch):
    """float32 weights times float32 rows run the compiled GEMV (no BLAS: the same bits on any CPU), lm_head's
    blocks too, and an overflowed hidden state still reaches the logits as inf/NaN instead of raising."""
    rng = np.random.default_rng(11)
    w, x = rng.standard_normal((37, 70)).astype(np.float32), rng.standard_normal((3, 70)).astype(np.float32)
    want = gemv_jit.lane_order_reference(w, x)
    assert np.array_equal(ops.linear(x, w), want)
    assert np.array_equal(table_matmul({"t": w}, "t", x, np.float32, block_rows=8), want)
    x[1, 5] = np.inf
    logits = table_matmul({"t": w}, "t", x, np.float32, block_rows=8)
    assert not np.isfinite(logits[1]).any() and np.array_equal(logits[[0, 2]], want[[0, 2]])
    monkeypatch.setenv("K3_FAST", "numpy")                            # BLAS's sums: the readable statement
    assert rel_rms(ops.linear(x[[0, 2]], w), want[[0, 2]]) <= tol("fp32_vs_fp64")


def test_k3_fast_names_its_values(monkeypatch):
    monkeypatch.setenv("K3_FAST", "NumPy")
    assert not fast.enabled()
    monkeypatch.setenv("K3_FAST", "")
    assert fast.enabled()
    monkeypatch.setenv("K3_FAST", "cuda")
    with pytest.raises(ValueError, match="K3_FAST: expected one of jit, numpy"):
        fast.enabled()


def test_threaded_and_single_kernels_give_the_same_bits(monkeypatch):
    rng = np.random.default_rng(8)
    packed, scale = _expert_bytes(rng, 200, 256)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    w = rng.standard_normal((200, 256)).astype(ml_dtypes.bfloat16)
    outs = []
    for threads_from in (0, 1 << 40):                                # every call threaded, then none
        monkeypatch.setattr(mxfp4_jit, "THREADS_MIN_BYTES", threads_from)
        monkeypatch.setattr(gemv_jit, "THREADS_MIN_BYTES", threads_from)
        outs.append((mxfp4_jit.gemv(packed, scale, x), gemv_jit.linear_jit(x, w),
                     gemv_jit.linear_jit(x[:1], w)))                 # one row of x: weight row by weight row
    assert all(np.array_equal(a, b) for a, b in zip(outs[0], outs[1], strict=True))
    assert np.array_equal(outs[0][2], gemv_jit.lane_order_reference(w, x[:1]))


def test_host_graph_with_bf16_matrices_as_stored_equals_the_cast_path(monkeypatch):
    """The tiny model from bf16 matrices, every 2-D one handed out as stored (the threshold lowered to 1 element):
    every block of the host graph (KDA, MLA, AttnRes, MoE, lm_head) takes them, and prefill + one decode step
    match the path that casts each weight first (K3_FAST=numpy)."""
    cfg = K3Config.preset("tiny")
    weights = {k: (v.astype(ml_dtypes.bfloat16) if v.dtype.kind == "f" and v.ndim == 2 else v)
               for k, v in synthetic_weights(cfg, 3, np.float32).items()}
    monkeypatch.setattr(cpu_weights, "LAZY_BF16_ELEMENTS", 1)

    def run():
        model = K3CpuModel(cfg, weights, np.float64, keep_casts=False)
        cache = model.new_cache()
        seq = cache.add_sequence()
        return forward_prefill(model, [1, 2, 3, 4], cache, seq=seq), forward_token(model, 5, 4, cache, seq=seq)

    got = run()
    monkeypatch.setenv("K3_FAST", "numpy")
    want = run()
    for g, w in zip(got, want, strict=True):
        assert g.dtype == np.float64 and rel_rms(g, w) <= tol("fp64_same_math")


def test_kernels_refuse_strided_arrays_at_compile_time():
    """The IR kernels walk raw pointers, so a strided view must fail to compile rather than read wrong elements
    (the Python entry points make their operands contiguous first)."""
    rng = np.random.default_rng(13)
    packed, scale = _expert_bytes(rng, 8, 128)
    x = rng.standard_normal((1, 128))
    xe, xo = mxfp4_jit.split_inputs(x)
    strided = np.repeat(packed, 2, axis=1)[:, ::2]                         # the same bytes, every other one
    rows_of, got = np.zeros(1, np.int64), np.empty((1, 8))
    dot = numba.njit(lambda w, s, tables, e, o, out: mxfp4_jit._dots1(w, s, tables, e, o, rows_of, 0, out, 0))
    dot(np.ascontiguousarray(strided), scale, mxfp4_jit.GROUP_TABLES, xe, xo, got)
    assert got[0, 0] == mxfp4_jit.gemv(packed, scale, x)[0, 0]            # contiguous: compiles and runs
    with pytest.raises(numba.core.errors.TypingError):
        dot(strided, scale, mxfp4_jit.GROUP_TABLES, xe, xo, got)
    xe32, xo32, got32 = xe.astype(np.float32), xo.astype(np.float32), got.astype(np.float32)
    dot(packed, scale, mxfp4_jit.GROUP_TABLES, xe32, xo32, got32)        # float32 x, float32 table: runs
    with pytest.raises(numba.core.errors.TypingError):                    # the float64 table serves float64 x only
        dot(packed, scale, mxfp4_jit.GROUP_TABLES64, xe32, xo32, got32)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    gemv_jit._gemv_one(np.ascontiguousarray(w[:, ::2]), x[:, :32].copy(), np.empty((1, 8)), 4, 3)
    with pytest.raises(numba.core.errors.TypingError):
        gemv_jit._gemv_one(w[:, ::2], x[:, :32].copy(), np.empty((1, 8)), 4, 3)
