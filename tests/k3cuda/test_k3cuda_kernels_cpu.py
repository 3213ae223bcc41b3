"""CPU-side checks of the mla_decode, mxfp4_gemv and attnres_mix wrappers (no GPU, no nvcc needed).

- the kernel signatures read from the .cu sources == the wrappers' EntrySpecs and packing order;
- device_launch against a recording fake of k3cuda.runtime: every pointer names the right buffer, every scalar
  has the format's type and the expected value, grids are the planned ones;
- traffic() against hand counts; launch-geometry helpers; input validation errors;
- emulate_split_kv (the split-KV + combine algorithm in NumPy) against k3ref.mla.mla_decode_core in float64,
  with splits ending mid-page, chunks that are not a multiple of the tile, and empty splits;
- bench_cases / make_inputs shapes;
- the mla kernel itself on the CPU emulation (k3cuda.testing.cpu_emulation) with forced split plans, and its
  partials against emulate_split_kv;
- each kernel (CPU emulation) swapped into the tiny model's prefill + decode against the float64 run;
- the emulation fails kernels with one block barrier removed (it checks barrier discipline).
Every check case through the kernels (GPU and CPU emulation) and the torch baselines on the CPU are in
tests/k3cuda/test_k3cuda_gpu.py, shared by all kernels.
"""
from __future__ import annotations

import dataclasses
import re
import struct
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance.judge.compare import check_outputs
from k3cuda import attnres_mix as AR
from k3cuda import kernel_module, runtime, testing
from k3cuda import mla_decode as MLA
from k3cuda import mxfp4_gemv as MX
from k3cuda.spec import register_budget
from k3cuda.testing import cpu_emulation
from k3ref.config import K3Config
from k3ref.cores import reference_cores
from k3ref.cpu_forward import K3CpuModel, forward_prefill, forward_token
from k3ref.mla import mla_decode_core
from tests.support.strict import require
from tests.support.tolerances import elem, rel_rms, tol

SM_COUNT = 132  # an H200's SMs, the fake device's

# every entry of the multi-entry kernels (mla_decode, mxfp4_gemv, attnres_mix) and the wrapper's packing order
# (parameter names) for it
ENTRY_ARGS = [
    pytest.param(MLA, MLA.ENTRY_F32, MLA.SPLIT_ARGS, id="mla_decode_split_f32"),
    pytest.param(MLA, MLA.ENTRY_BF16, MLA.SPLIT_ARGS, id="mla_decode_split_bf16"),
    pytest.param(MLA, MLA.ENTRY_COMBINE, MLA.COMBINE_ARGS, id="mla_decode_combine"),
    pytest.param(MX, MX.ENTRY, MX.ARGS, id="mxfp4_gemv_f32"),
    pytest.param(AR, AR.ENTRY, AR.ARGS, id="attnres_mix_f32"),
]
WRAPPERS = [pytest.param(MLA, id="mla_decode"), pytest.param(MX, id="mxfp4_gemv"), pytest.param(AR, id="attnres_mix")]


# ---------------------------------------------------------------------------------------------------------------
# the .cu sources, read as text


def _defines(src: str) -> dict[str, int]:
    """#define NAME <integer expression> of a .cu file, evaluated (C integer division)."""
    raw = dict(re.findall(r"^#define\s+(\w+)\s+(.+?)\s*(?://.*)?$", src, re.M))
    out: dict[str, int] = {}

    def value(name: str) -> int:
        if name not in out:
            expr = re.sub(r"\b[A-Za-z_]\w*\b", lambda m: str(value(m.group(0))), raw[name]).replace("/", "//")
            out[name] = int(eval(expr, {"__builtins__": {}}))  # noqa: S307 - arithmetic on our own #defines
        return out[name]

    return {n: value(n) for n in raw if re.fullmatch(r"[\w\s()*/+-]+", raw[n])}


def cu_entry(module, entry: str) -> SimpleNamespace:
    """The extern "C" entry `entry` of module's .cu: parameter (char, name) list and __launch_bounds__ values."""
    src = module.KERNEL.path.read_text()
    m = re.search(r'extern\s+"C"\s+__global__\s+void\s+__launch_bounds__\((\w+),\s*(\w+)\)\s*' + entry + r"\(([^)]*)\)",
                  src)
    assert m, f"{module.KERNEL.source}: no extern \"C\" __global__ entry {entry} with __launch_bounds__"
    params = []
    for p in m.group(3).split(","):
        name = re.findall(r"\w+", p)[-1]
        base = re.sub(r"\b(const|__restrict__)\b", "", p).replace(name, "").strip()
        char = "P" if "*" in base else {"int": "i", "float": "f"}[base]
        params.append((char, name))
    d = _defines(src)
    return SimpleNamespace(params=params, threads=d[m.group(1)], min_blocks=d[m.group(2)])


@pytest.mark.parametrize("module, entry, names", ENTRY_ARGS)
def test_entry_signature_matches_wrapper(module, entry, names):
    """Format and parameter names of the kernel == EntrySpec.arg_format and the wrapper's packing order."""
    cu = cu_entry(module, entry)
    spec = module.KERNEL.entry(entry)
    assert "".join(c for c, _ in cu.params) == spec.arg_format, f"{entry}: .cu parameters {cu.params}"
    assert tuple(n for _, n in cu.params) == names
    assert len(spec.packed_layout()) == len(cu.params)


@pytest.mark.parametrize("module, entry, names", ENTRY_ARGS)
def test_launch_bounds_match_entry_spec(module, entry, names):
    """__launch_bounds__(THREADS, MIN_BLOCKS) == EntrySpec.block_threads and the register budget it leaves."""
    cu = cu_entry(module, entry)
    spec = module.KERNEL.entry(entry)
    assert (cu.threads, register_budget(cu.threads, cu.min_blocks)) == (spec.block_threads, spec.max_registers)


def test_module_constants_match_cu_defines():
    """The wrappers' geometry constants are the kernels' #defines (a change on one side only fails here)."""
    mla = _defines(MLA.KERNEL.path.read_text())
    mx = _defines(MX.KERNEL.path.read_text())
    ar = _defines(AR.KERNEL.path.read_text())
    assert (mla["MLA_TILE"], mla["MLA_HEADS_PER_BLOCK"], mla["MLA_MAX_R"], mla["MLA_MAX_P"]) == \
        (MLA.TILE, MLA.HEADS_PER_BLOCK, MLA.MAX_R, MLA.MAX_P)
    assert (mx["MX_ROWS_PER_BLOCK"], mx["MX_VECTORS_PER_BLOCK"], mx["MX_GROUP"]) == \
        (MX.ROWS_PER_BLOCK, MX.VECTORS_PER_BLOCK, MX.GROUP)
    assert ar["AR_MAX_S"] == AR.MAX_SOURCES


# ---------------------------------------------------------------------------------------------------------------
# device_launch against a recording fake runtime


class FakeBuf:
    """A 'device array': host data plus a fake address."""

    def __init__(self, data: np.ndarray, addr: int):
        self.data, self.gpudata, self.dtype, self.shape = data, addr, data.dtype, data.shape

    def get(self) -> np.ndarray:
        return self.data.copy()


@pytest.fixture
def fake(monkeypatch):
    """Replace the GPU side of k3cuda.runtime; records uploads and bound launches (entry, grid, args)."""
    rec = SimpleNamespace(binds=[], runs=[], addr=0x7F0000000000)

    def to_device(a, dtype=np.float32):
        rec.addr += 0x10000
        return FakeBuf(np.ascontiguousarray(a, dtype=dtype), rec.addr)

    def bind(spec, entry, grid, args, shared=0):
        rec.binds.append(SimpleNamespace(spec=spec, entry=entry, grid=tuple(grid), args=tuple(args)))
        return lambda: rec.runs.append(entry)

    monkeypatch.setattr(runtime, "to_device", to_device)
    monkeypatch.setattr(runtime, "empty_poisoned",
                        lambda shape, dtype=np.float32: to_device(np.full(shape, np.nan), dtype))
    monkeypatch.setattr(runtime, "bind", bind)
    monkeypatch.setattr(runtime, "multiprocessor_count", lambda: SM_COUNT)
    return rec


def _names(module, entry: str) -> tuple[str, ...]:
    return {MLA.ENTRY_F32: MLA.SPLIT_ARGS, MLA.ENTRY_BF16: MLA.SPLIT_ARGS, MLA.ENTRY_COMBINE: MLA.COMBINE_ARGS,
            MX.ENTRY: MX.ARGS, AR.ENTRY: AR.ARGS}[entry]


def expected_launches(module, d: dict) -> list[tuple[str, tuple, dict]]:
    """(entry, grid, scalar values) each wrapper must bind for the core inputs d, worked out from the inputs."""
    if module is MLA:
        B, H, W = d["q_abs"].shape
        R = d["kv_rank"]
        S, chunk = MLA.plan_splits(d["seq_lens"], H, SM_COUNT)
        entry = MLA.ENTRY_BF16 if d["kv_cache"].dtype.name == "bfloat16" else MLA.ENTRY_F32
        scalars = dict(scale=np.float32(d["scale"]), H=H, R=R, P=W - R, max_pages=d["block_table"].shape[1],
                       page_size=d["kv_cache"].shape[1], chunk=chunk, num_splits=S)
        return [(entry, (-(-H // 16), S, B), scalars), (MLA.ENTRY_COMBINE, (H, B, 1), scalars)]
    if module is MX:
        N, K = d["packed"].shape[0], d["x"].shape[-1]
        T = d["x"].size // K
        return [(MX.ENTRY, (-(-N // 16), -(-T // 4), 1), dict(N=N, K=K, T=T))]
    S, D = d["sources"].shape[0], d["sources"].shape[-1]
    T = d["sources"][0].size // D
    return [(AR.ENTRY, (T, 1, 1), dict(S=S, T=T, D=D, mix=np.float32(d["mix"]), eps=np.float32(d["eps"])))]


def _check_cases():
    return [pytest.param(m, c, id=f"{m.KERNEL.block}-{c.label}") for m in (MLA, MX, AR) for c in m.check_cases()]


@pytest.mark.parametrize("module, case", _check_cases())
def test_device_launch_packs_buffers_and_scalars(fake, module, case):
    """Each bound launch: pointers are the named device buffers, scalars have the format's type and value."""
    d = case.make_inputs(np.random.default_rng(7))
    launch = module.device_launch(d)
    want = expected_launches(module, d)
    assert [(b.entry, b.grid + (1,) * (3 - len(b.grid))) for b in fake.binds] == [(e, g) for e, g, _ in want]
    for b, (_, _, scalars) in zip(fake.binds, want, strict=True):   # same length: asserted above
        fmt = module.KERNEL.entry(b.entry).arg_format
        struct.pack("@" + fmt.replace("P", "Q"), *b.args)   # packable as prepare() packs them
        for ch, name, arg in zip(fmt, _names(module, b.entry), b.args, strict=True):
            if ch == "P":
                assert arg == launch.buffers[name].gpudata, f"{b.entry}: argument {name}"
            else:
                assert isinstance(arg, {"i": np.int32, "f": np.float32}[ch]), f"{b.entry}: {name} is {type(arg)}"
                assert arg == scalars[name], f"{b.entry}: {name} = {arg}, expected {scalars[name]}"
    launch()
    assert fake.runs == [b.entry for b in fake.binds]


def test_mla_uploads_bf16_cache_bits_and_poisons_outputs(fake):
    """A bf16 cache goes up as its 16-bit patterns (no float32 copy); outputs and partials start as NaN."""
    d = MLA.make_inputs(np.random.default_rng(1), [70, 5], 3, cache_dtype="bfloat16")
    launch = MLA.device_launch(d)
    assert launch.buffers["kv"].dtype == np.uint16
    np.testing.assert_array_equal(launch.buffers["kv"].data, d["kv_cache"].view(np.uint16))
    assert launch.buffers["block_table"].dtype == np.int32 and launch.buffers["seq_lens"].dtype == np.int32
    S = fake.binds[0].args[MLA.SPLIT_ARGS.index("num_splits")]
    assert launch.buffers["o_part"].shape == (2, S, 3, 512)
    assert all(np.isnan(launch.buffers[n].data).all() for n in ("o_lat", "o_part", "m_part", "l_part"))


@pytest.mark.parametrize("x_shape, out_dtype", [
    pytest.param((64,), np.float64, id="vec-f64"),
    pytest.param((2, 3, 64), np.float32, id="B2x3-f32"),
])
def test_mxfp4_host_function_shapes_and_dtype(fake, x_shape, out_dtype):
    """y has x's leading shape + (N,); float64 x gives float64 (the fp32 result widened)."""
    rng = np.random.default_rng(2)
    d = MX.make_inputs(rng, 5, 64, 1)
    y = MX.mxfp4_gemv(d["packed"], d["scale"], rng.standard_normal(x_shape).astype(out_dtype))
    assert y.shape == x_shape[:-1] + (5,) and y.dtype == out_dtype


def test_attnres_host_function_keeps_leading_shape(fake):
    d = AR.make_inputs(np.random.default_rng(3), 3, (2, 4), 24)
    assert AR.attnres_mix(**d).shape == (2, 4, 24)


# ---------------------------------------------------------------------------------------------------------------
# traffic and geometry, by hand

TRAFFIC = [
    # cache 64*8192*576*2 = 603,979,776; q 64*96*576*4 = 14,155,776; o 64*96*512*4 = 12,582,912;
    # table 64*128*4 = 32,768; lens 256.  FLOPs 2*64*96*8192*(576 + 512)
    pytest.param(MLA.traffic, dict(B=64, H=96, seq_len=8192), 630_751_488, 109_521_666_048, id="mla-B64-L8192-H96"),
    # cache 64*4096*576*2 = 301,989,888; q 64*12*576*4 = 1,769,472; o 64*12*512*4 = 1,572,864;
    # table 64*64*4 = 16,384; lens 256.  FLOPs 2*64*12*4096*1088
    pytest.param(MLA.traffic, dict(B=64, H=12, seq_len=4096), 305_348_864, 6_845_104_128, id="mla-B64-L4096-H12"),
    # one fp32 row of 65 tokens (2 pages) R=64 P=16: cache 65*80*4 = 20,800; q 3*80*4 = 960; o 3*64*4 = 768;
    # table 2*4 = 8; lens 4.  FLOPs 2*3*65*(80 + 64) = 56,160
    pytest.param(MLA.traffic, dict(B=1, H=3, seq_len=65, R=64, P=16, cache_itemsize=4), 22_540, 56_160,
                 id="mla-B1-L65-H3-fp32"),
    # packed 3072*1792 = 5,505,024; scales 3072*112 = 344,064; x 3584*4 = 14,336; y 3072*4 = 12,288.
    # FLOPs 2*3072*3584 = 22,020,096 + scale multiplies 3072*112 = 344,064
    pytest.param(MX.traffic, dict(N=3072, K=3584, T=1), 5_875_712, 22_364_160, id="mxfp4-w1-T1"),
    # packed 3584*1536 = 5,505,024; scales 3584*96 = 344,064; x 4*3072*4 = 49,152; y 4*3584*4 = 57,344.
    # FLOPs 2*4*3584*3072 = 88,080,384 + 4*3584*96 = 1,376,256
    pytest.param(MX.traffic, dict(N=3584, K=3072, T=4), 5_955_584, 89_456_640, id="mxfp4-w2-T4"),
    # sources 9*64*7168*4 = 16,515,072; weights 2*7168*4 = 57,344; out 64*7168*4 = 1,835,008.
    # FLOPs 64*7168 = 458,752 + 3 * 2*9*64*7168 = 24,772,608
    pytest.param(AR.traffic, dict(S=9, T=64, D=7168), 18_407_424, 25_231_360, id="attnres-S9-T64"),
    # sources 9*7168*4 = 258,048; weights 57,344; out 28,672.  FLOPs 7168 + 6*9*7168 = 394,240
    pytest.param(AR.traffic, dict(S=9, T=1, D=7168), 344_064, 394_240, id="attnres-S9-T1"),
]


@pytest.mark.parametrize("fn, shapes, nbytes, flops", TRAFFIC)
def test_traffic_hand_counts(fn, shapes, nbytes, flops):
    t = fn(**shapes)
    assert (t.bytes, t.flops) == (nbytes, flops)


@pytest.mark.parametrize("lens, H, plan", [
    # 64 x 6 head groups = 384 blocks; 4*132 = 528 wanted -> 2 splits of 4096
    pytest.param([8192] * 64, 96, (2, 4096), id="B64-L8192-H96"),
    # 64 x 1 group; ceil(528/64) = 9 splits; ceil(8192/9) = 911 -> 912 (tile multiple); ceil(8192/912) = 9
    pytest.param([8192] * 64, 12, (9, 912), id="B64-L8192-H12"),
    # 3 blocks; at most ceil(130/32) = 5 splits of 32 rows: split 1..4 empty for the 1-row sequence
    pytest.param([1, 63, 130], 5, (5, 32), id="B3-ragged-H5"),
    # one row: one split of one tile
    pytest.param([1], 1, (1, 16), id="B1-L1"),
    # 200 sequences x 2 groups = 400 blocks < 528: still 2 splits; 100 -> 112 rows (the 2nd split ends mid-page)
    pytest.param([200] * 200, 17, (2, 112), id="B200-L200-H17"),
])
def test_plan_splits(lens, H, plan):
    assert MLA.plan_splits(np.array(lens, np.int32), H, SM_COUNT) == plan


@given(lens=st.lists(st.integers(1, 5000), min_size=1, max_size=40), H=st.integers(1, 130),
       sms=st.integers(1, 200))
def test_plan_splits_covers_every_row(lens, H, sms):
    """num_splits * chunk covers the longest sequence, no split starts past it, chunk is a tile multiple."""
    S, chunk = MLA.plan_splits(np.array(lens), H, sms)
    L = max(lens)
    assert S >= 1 and chunk % MLA.TILE == 0
    assert S * chunk >= L > (S - 1) * chunk
    assert chunk >= min(MLA.MIN_CHUNK, -(-L // MLA.TILE) * MLA.TILE)


@pytest.mark.parametrize("fn, args, match", [
    pytest.param(MLA.split_grid, (65536, 8, 1), r"B <= 65535", id="mla-split-B"),
    pytest.param(MLA.split_grid, (4, 8, 65536), r"num_splits <= 65535", id="mla-split-splits"),
    pytest.param(MLA.combine_grid, (65536, 8), r"B <= 65535", id="mla-combine-B"),
    pytest.param(MX.grid, (16, 262141), r"T <= 262140", id="mxfp4-T"),
])
def test_launch_geometry_limits(fn, args, match):
    with pytest.raises(ValueError, match=match):
        fn(*args)


@pytest.mark.parametrize("fn, args, grid", [
    pytest.param(MLA.split_grid, (64, 96, 2), (6, 2, 64), id="mla-split-H96"),
    pytest.param(MLA.split_grid, (3, 17, 5), (2, 5, 3), id="mla-split-H17"),
    pytest.param(MLA.combine_grid, (64, 96), (96, 64), id="mla-combine"),
    pytest.param(MX.grid, (3072, 1), (192, 1), id="mxfp4-w1-T1"),
    pytest.param(MX.grid, (129, 5), (9, 2), id="mxfp4-N129-T5"),
    pytest.param(MX.grid, (16, 262140), (1, 65535), id="mxfp4-T-at-the-limit"),
    pytest.param(AR.grid, (64,), (64,), id="attnres-T64"),
])
def test_launch_geometry(fn, args, grid):
    assert fn(*args) == grid


# ---------------------------------------------------------------------------------------------------------------
# input validation (the host functions check before touching a GPU)


def _mla(**change):
    d = MLA.make_inputs(np.random.default_rng(4), [70, 3], 2)
    d.update(change)
    return lambda: MLA.mla_decode(**d)


def _mx(**change):
    d = MX.make_inputs(np.random.default_rng(5), 4, 64, 2)
    d.update(change)
    return lambda: MX.mxfp4_gemv(**d)


def _ar(**change):
    d = AR.make_inputs(np.random.default_rng(6), 3, (2,), 16)
    d.update(change)
    return lambda: AR.attnres_mix(**d)


BAD_INPUTS = [
    pytest.param(_mla(kv_rank=510), r"R % 4 == 0.*found R=510", id="mla-R-not-multiple-of-4"),
    pytest.param(_mla(kv_rank=432), r"P = W - R <= 64.*found R=432, P=144", id="mla-P-too-wide"),
    pytest.param(_mla(seq_lens=np.array([70, 0], np.int32)), r"seq_lens\[1\]: expected 1 <= seq_len",
                 id="mla-empty-seq"),
    pytest.param(_mla(seq_lens=np.array([129, 3], np.int32)), r"seq_lens\[0\].*found 129", id="mla-seq-past-table"),
    pytest.param(_mla(block_table=np.array([[0, 99], [2, 0]], np.int32)), r"block_table\[0\]: expected page ids",
                 id="mla-page-out-of-range"),
    pytest.param(_mla(block_table=np.zeros((2, 2), np.float32)), r"block_table: expected an integer array",
                 id="mla-float-table"),
    pytest.param(_mla(q_abs=np.zeros((2, 2, 512), np.float32)), r"kv_cache: expected .*576", id="mla-width-mismatch"),
    pytest.param(_mla(scale=-1.0), r"scale: expected a positive finite float", id="mla-negative-scale"),
    pytest.param(_mx(packed=np.zeros((4, 32), np.int8)), r"packed: expected dtype uint8", id="mxfp4-int8-packed"),
    pytest.param(_mx(x=np.zeros((2, 48), np.float32)), r"multiple of 32, found 48", id="mxfp4-K-not-group"),
    pytest.param(_mx(scale=np.zeros((4, 3), np.uint8)), r"scale: expected \[4, 2\]", id="mxfp4-scale-shape"),
    pytest.param(_mx(x=np.full((1, 64), np.nan, np.float32)), r"x: expected finite values", id="mxfp4-nan-x"),
    pytest.param(_ar(sources=np.ones((10, 2, 16), np.float32)), r"S <= 9.*found S=10", id="attnres-too-many-sources"),
    pytest.param(_ar(proj_w=np.ones((2, 16), np.float32)), r"proj_w: expected shape \[16\] or \[1, 16\]",
                 id="attnres-proj-shape"),
    pytest.param(_ar(eps=0.0), r"eps: expected a positive finite float", id="attnres-zero-eps"),
    pytest.param(_ar(sources=np.ones(16, np.float32)), r"sources: expected shape \[S, \.\.\., D\]", id="attnres-rank1"),
]


@pytest.mark.parametrize("call, match", BAD_INPUTS)
def test_bad_inputs_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_mla_nan_in_a_used_row_is_rejected_but_unused_slots_may_hold_nan():
    d = MLA.make_inputs(np.random.default_rng(8), [70], 2)          # rows 70..127 of page 2 are NaN already
    MLA.check_inputs(**d)
    d["kv_cache"][d["block_table"][0, 1], 69 - 64, 7] = np.nan      # row 69: the last used one
    with pytest.raises(ValueError, match=r"kv_cache: expected finite rows for sequence 0"):
        MLA.check_inputs(**d)


# ---------------------------------------------------------------------------------------------------------------
# the split-KV algorithm in NumPy (emulate_split_kv) against the reference (float64)


def _ref64(d: dict) -> np.ndarray:
    d64 = dict(d, q_abs=d["q_abs"].astype(np.float64), kv_cache=np.asarray(d["kv_cache"]).astype(np.float64))
    return mla_decode_core(**d64)


@pytest.mark.parametrize("lens, H, R, P, num_splits, chunk", [
    pytest.param([1, 63, 130], 5, 512, 64, 1, 130, id="one-split"),
    pytest.param([1, 63, 130], 5, 512, 64, 5, 32, id="S5-chunk32-mid-page-empty-splits"),
    pytest.param([1, 63, 130], 5, 512, 64, 9, 17, id="S9-chunk17-not-tile-multiple"),
    pytest.param([200, 77], 3, 64, 16, 3, 70, id="S3-chunk70-R64P16"),
    pytest.param([64, 128], 2, 512, 64, 4, 64, id="S4-page-aligned-last-split-empty-for-b0"),
    pytest.param([5], 1, 512, 64, 12, 1, id="S12-chunk1-single-rows-7-empty"),
])
def test_numpy_split_kv_matches_reference(lens, H, R, P, num_splits, chunk):
    d = MLA.make_inputs(np.random.default_rng(9), lens, H, R=R, P=P)
    o = MLA.emulate_split_kv(**d, num_splits=num_splits, chunk=chunk)
    assert rel_rms(o, _ref64(d)) < tol("fp64_same_math")


def test_numpy_split_kv_empty_splits_carry_zero_weight():
    """A split past the end of its sequence leaves o = 0, m = -inf, l = 0, and the combine still matches."""
    d = MLA.make_inputs(np.random.default_rng(10), [1, 40], 2)
    o, (o_part, m_part, l_part) = MLA.emulate_split_kv(**d, num_splits=3, chunk=16, return_partials=True)
    assert np.all(m_part[0, 1:] == -np.inf) and np.all(l_part[0, 1:] == 0) and np.all(o_part[0, 1:] == 0)
    assert np.all(np.isfinite(m_part[1])) and np.all(l_part[1] >= 1)   # the max row contributes e^0 = 1
    assert rel_rms(o, _ref64(d)) < tol("fp64_same_math")


@given(lens=st.lists(st.integers(1, 150), min_size=1, max_size=3), H=st.integers(1, 4),
       chunk=st.integers(1, 160), tile=st.sampled_from([1, 16, 64]))
def test_numpy_split_kv_any_plan(lens, H, chunk, tile):
    """Any chunk and tile size covering the rows gives the reference result."""
    d = MLA.make_inputs(np.random.default_rng(len(lens) * 1000 + chunk), lens, H, R=32, P=8)
    S = -(-max(lens) // chunk)
    o = MLA.emulate_split_kv(**d, num_splits=S, chunk=chunk, tile=tile)
    assert rel_rms(o, _ref64(d)) < tol("fp64_same_math")


@pytest.mark.parametrize("case", [pytest.param(c, id=c.label) for c in MLA.check_cases()])
def test_numpy_split_kv_with_the_planned_splits(case):
    """The plan the GPU will use for each check case, emulated, gives the reference result."""
    d = case.make_inputs(np.random.default_rng(11))
    S, chunk = MLA.plan_splits(d["seq_lens"], d["q_abs"].shape[1], SM_COUNT)
    assert rel_rms(MLA.emulate_split_kv(**d, num_splits=S, chunk=chunk), _ref64(d)) < tol("fp64_same_math")


# ---------------------------------------------------------------------------------------------------------------
# bench cases and inputs


@pytest.mark.parametrize("module, labels, targets", [
    pytest.param(MLA, ["B64-L4096-H12-bf16", "B64-L4096-H96-bf16", "B64-L8192-H12-bf16", "B64-L8192-H96-bf16"],
                 [0.6] * 4, id="mla_decode"),
    pytest.param(MX, ["w1-N3072-K3584-T1", "w2-N3584-K3072-T1"], [None, None], id="mxfp4_gemv"),
    pytest.param(AR, ["S9-T1-D7168", "S9-T64-D7168"], [None, None], id="attnres_mix"),
])
def test_bench_case_labels_and_targets(module, labels, targets):
    cases = module.bench_cases()
    assert [c.label for c in cases] == labels and [c.target_bw_ratio for c in cases] == targets


def test_mla_bench_traffic_matches_its_label():
    for c in MLA.bench_cases():
        L, H = (int(v) for v in re.match(r"B64-L(\d+)-H(\d+)-bf16", c.label).groups())
        assert c.traffic == MLA.traffic(64, H, L, cache_itemsize=2)


@pytest.mark.parametrize("module, shapes_of", [
    pytest.param(MX, lambda d: dict(N=d["packed"].shape[0], K=d["x"].shape[-1], T=d["x"].shape[0]), id="mxfp4_gemv"),
    pytest.param(AR, lambda d: dict(S=d["sources"].shape[0], T=d["sources"].shape[1], D=d["sources"].shape[2]),
                 id="attnres_mix"),
])
def test_bench_inputs_have_the_counted_shapes(module, shapes_of):
    for c in module.bench_cases():
        d = c.make_inputs(np.random.default_rng(12))
        assert module.traffic(**shapes_of(d)) == c.traffic, c.label


def test_mla_make_inputs_layout():
    """Distinct pages per sequence, NaN in the unused slots, bf16 when asked, K3 widths by default."""
    d = MLA.make_inputs(np.random.default_rng(13), [65, 3], 4, cache_dtype="bfloat16", spare_pages=2)
    assert d["kv_cache"].dtype.name == "bfloat16" and d["kv_cache"].shape == (2 + 1 + 2, 64, 576)
    used = [d["block_table"][0, 0], d["block_table"][0, 1], d["block_table"][1, 0]]
    assert len(set(used)) == 3
    cache = d["kv_cache"].astype(np.float32)
    assert np.isnan(cache[used[1], 1:]).all() and np.isfinite(cache[used[1], :1]).all()
    assert np.isnan(cache[used[2], 3:]).all() and np.isfinite(cache[used[2], :3]).all()
    spare = sorted(set(range(5)) - set(used))
    assert np.isnan(cache[spare]).all()


# ---------------------------------------------------------------------------------------------------------------
# the kernels themselves, run on the CPU: k3cuda.testing.cpu_emulation compiles the .cu with g++ against a small
# CUDA shim (a block's threads as fibers, barriers and shuffles as scheduler points) and runs the real wrappers
# (device_launch -> bind -> struct-packed arguments) on host arrays. Compared with the k3ref cores in float64 this
# checks indexing, packing, masking, the split/combine and the barrier discipline without a GPU; it says nothing
# about speed, and fp32 results may differ from a GPU's in the last bits (FMA contraction).


@pytest.fixture
def emulated():
    """k3cuda.runtime with launches running the CPU emulation of the kernels (skipped without g++)."""
    require("gxx")
    with cpu_emulation():
        yield


# device_launch with forced split plans (the GPU tests run the planned one for every check case):
# (check case, num_splits, chunk)
FORCED_PLANS = [
    pytest.param("B3-L1,63,130-H5", 9, 17, id="B3-ragged-S9-chunk17-not-tile-multiple"),
    pytest.param("B3-L1,63,130-H5", 130, 1, id="B3-ragged-S130-chunk1-single-rows"),
    pytest.param("B2-L200,77-H17-bf16", 4, 64, id="B2-bf16-S4-chunk64-page-aligned"),
    pytest.param("B2-L97,33-H3-R64P16", 1, 97, id="B2-R64P16-one-split"),
]


@pytest.mark.parametrize("label, num_splits, chunk", FORCED_PLANS)
def test_emulated_mla_forced_split_plans(emulated, label, num_splits, chunk):
    case = {c.label: c for c in MLA.check_cases()}[label]
    d = case.make_inputs(np.random.default_rng(15))
    launch = MLA.device_launch(d, num_splits=num_splits, chunk=chunk)
    launch()
    out = launch.outputs()["o_lat"]
    assert not np.isnan(out).any(), "o_lat has unwritten (NaN-poisoned) elements"
    assert rel_rms(out, _ref64(d)) < tol("fp32_vs_fp64")


def test_emulated_mla_partials_of_empty_splits(emulated):
    """Splits past a sequence's end write o = 0, m = -inf, l = 0 (the combine weighs them 0); the kernel's
    partials are the NumPy emulation's."""
    d = MLA.make_inputs(np.random.default_rng(16), [1, 40], 2)
    launch = MLA.device_launch(d, num_splits=3, chunk=16)
    launch()
    got = {n: launch.buffers[n].get() for n in ("o_part", "m_part", "l_part")}
    assert np.all(got["m_part"][0, 1:] == -np.inf) and np.all(got["l_part"][0, 1:] == 0)
    assert np.all(got["o_part"][0, 1:] == 0)
    _, (o_part, m_part, l_part) = MLA.emulate_split_kv(**d, num_splits=3, chunk=16, return_partials=True)
    np.testing.assert_allclose(got["m_part"], m_part, **elem("fp32_partials"))
    np.testing.assert_allclose(got["l_part"], l_part, **elem("fp32_partials"))
    assert rel_rms(got["o_part"], o_part) < tol("fp32_vs_fp64")


# ---------------------------------------------------------------------------------------------------------------
# each kernel swapped into the tiny model (CPU emulation): the host graph's real calls, shapes and dtypes

TINY_PROMPT, TINY_DECODE = [5, 17, 3, 42, 8, 1, 60], [11, 2, 90]


@pytest.fixture(scope="module")
def tiny_model():
    return K3CpuModel.synthetic(K3Config.preset("tiny"), seed=7)


def _tiny_logits(model, cores) -> np.ndarray:
    """Prefill TINY_PROMPT, then decode TINY_DECODE one token at a time; the decode logits [3, vocab]."""
    cache = model.new_cache()
    seq = cache.add_sequence()
    forward_prefill(model, TINY_PROMPT, cache, seq=seq, cores=cores)
    return np.array([forward_token(model, t, len(TINY_PROMPT) + i, cache, seq=seq, cores=cores)
                     for i, t in enumerate(TINY_DECODE)])


@pytest.mark.parametrize("module", WRAPPERS)
def test_emulated_kernel_in_the_tiny_model(emulated, tiny_model, module):
    """The tiny model (float64) with one core replaced by its emulated kernel (fp32): the decode logits stay
    within the fp32 budget of the float64 run, and the graph really called the kernel."""
    block = module.KERNEL.block
    calls = []
    kernel = getattr(module, block)

    def spy(*args, **kwargs):
        calls.append(block)
        return kernel(*args, **kwargs)

    ref = _tiny_logits(tiny_model, reference_cores())
    out = _tiny_logits(tiny_model, reference_cores().replace(**{block: spy}))
    assert calls, f"the tiny model never called {block}"
    assert rel_rms(out, ref) < tol("fp32_vs_fp64")


# (kernel module, the barrier line removed, what it guards) — the emulation runs each fiber up to its next barrier
# before the next fiber starts, so a missing block barrier reorders a write and another thread's read, every time.
BARRIER_MUTANTS = [
    pytest.param("kda_decode", "    __syncthreads();  // everyone has read red before it is reused for o\n",
                 id="kda-red-reused-before-read"),
    pytest.param("kda_decode", "    const float beta = k3_sigmoidf(beta_raw[bh]);\n    __syncthreads();\n",
                 id="kda-norms-read-before-written"),
    pytest.param("mla_decode", "        __syncthreads();  // every warp is done with the previous tile\n",
                 id="mla-tile-overwritten-while-read"),
]


@pytest.mark.parametrize("block, line", BARRIER_MUTANTS)
def test_emulation_catches_a_missing_barrier(emulated, tmp_path, monkeypatch, block, line):
    """The CPU emulation checks barrier discipline, not only indexing: a kernel with one barrier removed fails."""
    mod = kernel_module(block)
    src = mod.KERNEL.path.read_text()
    assert src.count(line) == 1, f"{mod.KERNEL.source} no longer has the line this mutant removes: {line!r}"
    keep = "    const float beta = k3_sigmoidf(beta_raw[bh]);\n" if "beta" in line else ""
    (tmp_path / mod.KERNEL.source).write_text(src.replace(line, keep))
    monkeypatch.setattr(mod, "KERNEL", dataclasses.replace(mod.KERNEL, source=str(tmp_path / mod.KERNEL.source)))
    case = mod.check_cases()[1]
    d = case.make_inputs(np.random.default_rng(17))
    ref = testing.reference_core(block)(**testing.to_float64(d))
    fails = check_outputs(block, getattr(mod, block)(**d), ref, tol("fp32_vs_fp64"))
    assert fails, f"{block} without {line.strip()!r} still matched the reference on {case.label}"
