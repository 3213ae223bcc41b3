"""CPU-side gates on the CUDA kernels: they compile, spill nothing, fit their register budget, and the PTX
parameter list of every entry matches the wrapper's argument packing. No GPU needed; nvcc is (the tests that
compile skip with the reason when nvcc is not on PATH).

The second half proves the gates can fail: the same checkers run on deliberately wrong EntrySpecs and on small
probe kernels that spill, use local memory or exceed a register budget, and must report each problem.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import k3cuda
from k3cuda import build
from k3cuda.spec import ARCHS, EntrySpec, KernelSpec, parse_format, register_budget

needs_nvcc = [pytest.mark.nvcc]   # skipped without nvcc, failed under K3_STRICT=1 (tests/conftest.py)

KERNEL_ARCH = [pytest.param(block, arch, id=f"{block}-{arch}", marks=needs_nvcc)
               for block in k3cuda.KERNEL_MODULES for arch in ARCHS]


# ---- the gates on every kernel x arch ---------------------------------------------------------------------

@pytest.mark.parametrize("block, arch", KERNEL_ARCH)
def test_kernel_resources(block, arch):
    """Compiles; 0 spill bytes; 0 stack frame; registers <= EntrySpec.max_registers."""
    spec = k3cuda.kernel_module(block).KERNEL
    fails = build.check_resources(spec, arch)
    assert not fails, "\n".join(fails)


@pytest.mark.parametrize("block, arch", KERNEL_ARCH)
def test_kernel_abi(block, arch):
    """Every entry's PTX parameters (count, offset, size, float vs integer) == the wrapper's packing, and
    __launch_bounds__ agrees with EntrySpec."""
    spec = k3cuda.kernel_module(block).KERNEL
    fails = build.check_abi(spec, arch)
    assert not fails, "\n".join(fails)
    in_ptx = build.ptx_entries(build.nvcc_compile(spec, arch, "ptx").decode())
    assert sorted(in_ptx) == sorted(e.name for e in spec.entries), (
        f"{block} ({arch}): the .cu defines entries {in_ptx}, KERNEL declares {[e.name for e in spec.entries]}")


@pytest.mark.parametrize("block", [pytest.param(b, id=b) for b in k3cuda.KERNEL_MODULES])
def test_wrapper_conventions(block):
    """The wrapper names its spec after the block, has the host function named like the core, and the
    functions the GPU tests and the bench script call (importing it must not need a GPU)."""
    mod = k3cuda.kernel_module(block)
    assert mod.KERNEL.block == block and mod.KERNEL.source == f"{block}.cu"
    assert mod.KERNEL.path.is_file(), f"{mod.KERNEL.path} missing"
    for name in (block, "device_launch", "traffic", "bench_cases", "check_cases"):
        assert callable(getattr(mod, name, None)), f"k3cuda.{block} has no function {name}()"
    assert mod.bench_cases() and mod.check_cases(), f"k3cuda.{block}: empty bench_cases() or check_cases()"
    # what k3cuda.force_entry may pick: entries of this kernel only (empty when it has one entry to launch)
    entries = {e.name for e in mod.KERNEL.entries}
    assert set(mod.CHOOSABLE_ENTRIES) <= entries, (
        f"k3cuda.{block}.CHOOSABLE_ENTRIES: expected entries of {sorted(entries)}, found {mod.CHOOSABLE_ENTRIES}")


def test_import_touches_no_gpu():
    """Importing k3cuda and every wrapper (what collection and kernel_specs() do) never imports PyCUDA."""
    code = ("import sys, k3cuda; k3cuda.kernel_specs(); "
            "assert not [m for m in sys.modules if m.startswith('pycuda')], 'pycuda imported'")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


# ---- the checkers can fail --------------------------------------------------------------------------------

PROBE_SRC = textwrap.dedent("""
    #include "probe.cuh"
    struct __align__(8) Pair { long long a; int b; };   // 16 bytes, 8-aligned: after an int it sits at 16
    extern "C" __global__ void __launch_bounds__(128, 4) probe(const float* x, int n, Pair p, float* y) {
        const int i = blockIdx.x * 128 + threadIdx.x;
        if (i < n) y[i] = x[i] * (float)p.a + (float)p.b + PROBE_OFFSET;
    }
    // 64 live accumulators under a 32-register cap (__launch_bounds__(1024, 2)): ptxas must spill.
    extern "C" __global__ void __launch_bounds__(1024, 2) spill(const float* __restrict__ x, float* y) {
        float acc[64];
    #pragma unroll
        for (int i = 0; i < 64; ++i) acc[i] = x[threadIdx.x + i * 1024];
    #pragma unroll
        for (int r = 0; r < 4; ++r)
    #pragma unroll
            for (int i = 0; i < 64; ++i) acc[i] = acc[i] * acc[(i + 7) % 64] + x[r * 64 + i];
        float s = 0.0f;
    #pragma unroll
        for (int i = 0; i < 64; ++i) s += acc[i] * (i + 1);
        y[threadIdx.x] = s;
    }
    // A big array indexed at run time lives in local memory (a stack frame), however many registers.
    extern "C" __global__ void __launch_bounds__(128, 1) stack(const float* __restrict__ x, const int* idx, float* y) {
        float buf[256];
        for (int i = 0; i < 256; ++i) buf[i] = x[threadIdx.x * 256 + i];
        y[threadIdx.x] = buf[idx[threadIdx.x] & 255] + buf[idx[threadIdx.x + 128] & 255];
    }
""")
PROBE_FORMAT = "Pi4x16sP"   # x, n, pad to 8, the 16-byte struct, y: the correct packing
PROBE_BUDGET = register_budget(128, 4)


def _probe_spec(folder, *entries: EntrySpec, offset="0.0f") -> KernelSpec:
    (folder / "probe.cu").write_text(PROBE_SRC)
    (folder / "probe.cuh").write_text(f"#define PROBE_OFFSET {offset}\n")
    return KernelSpec(block="probe", source=str(folder / "probe.cu"), entries=entries)


@pytest.fixture(scope="module")
def probe_dir(tmp_path_factory):
    """A folder for probe sources and a private compile cache shared by this module's probe tests (the
    probe compiles once; the real cache is left alone)."""
    folder = tmp_path_factory.mktemp("probe")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("K3CUDA_CACHE", str(folder / "cache"))
        yield folder


@pytest.fixture
def fresh_probe_dir(tmp_path, monkeypatch):
    """Like probe_dir, but empty for each test (the cache test counts files and edits the header)."""
    monkeypatch.setenv("K3CUDA_CACHE", str(tmp_path / "cache"))
    return tmp_path


# (wrong EntrySpec for the probe kernel, words the failure must contain)
ABI_MUTANTS = [
    pytest.param(EntrySpec("probe", "ii4x16sP", 128, PROBE_BUDGET), "parameter 0", id="int-for-pointer"),
    pytest.param(EntrySpec("probe", "Pi4x16s", 128, PROBE_BUDGET), "kernel takes 4 parameters, wrapper packs 3",
                 id="missing-arg"),
    pytest.param(EntrySpec("probe", "Pi16sP", 128, PROBE_BUDGET), "parameter 2", id="struct-unpadded-16s"),
    pytest.param(EntrySpec("probe", "PfiP", 128, PROBE_BUDGET), "parameter 2", id="struct-as-scalars"),
    pytest.param(EntrySpec("probe", PROBE_FORMAT, 256, PROBE_BUDGET), "max threads 128, EntrySpec.block_threads 256",
                 id="wrong-block-threads"),
    pytest.param(EntrySpec("probe", PROBE_FORMAT, 128, 200), f"leaves {PROBE_BUDGET} registers",
                 id="budget-beyond-launch-bounds"),
    pytest.param(EntrySpec("probe_v2", PROBE_FORMAT, 128, PROBE_BUDGET), "no .entry 'probe_v2'", id="no-such-entry"),
]


@pytest.mark.parametrize("entry, words", ABI_MUTANTS)
@pytest.mark.nvcc
def test_abi_gate_catches(probe_dir, entry, words):
    good = _probe_spec(probe_dir, EntrySpec("probe", PROBE_FORMAT, 128, PROBE_BUDGET))
    assert build.check_abi(good) == [], "the correct packing must pass, or the mutants prove nothing"
    bad = KernelSpec(block="probe", source=good.source, entries=(entry,))
    fails = build.check_abi(bad)
    assert any(words in f and "probe" in f and "sm_90" in f for f in fails), fails


# (entry, extra nvcc flags, the failure words; None: that entry must pass)
RESOURCE_CASES = [
    pytest.param("spill", "spills", id="spill-under-register-cap"),
    pytest.param("stack", "stack frame 1024 bytes", id="dynamic-local-array"),
    pytest.param("probe", None, id="clean-kernel-passes"),
]


@pytest.mark.parametrize("name, words", RESOURCE_CASES)
@pytest.mark.nvcc
def test_resource_gate_catches(probe_dir, name, words):
    threads = {"spill": 1024, "stack": 128, "probe": 128}[name]
    spec = _probe_spec(probe_dir, EntrySpec(name, "PPP" if name == "stack" else "PP", threads, 255))
    fails = build.check_resources(spec, "sm_90")
    if words is None:
        assert fails == []
    else:
        assert any(words in f and f"probe/{name} (sm_90)" in f for f in fails), fails
        r = build.ptxas_resources(spec, "sm_90")[name]
        assert (r.spill_stores > 0) if name == "spill" else (r.stack == 1024)


@pytest.mark.nvcc
def test_register_gate_catches(probe_dir):
    """A budget below what ptxas used is reported with both numbers."""
    spec = _probe_spec(probe_dir, EntrySpec("stack", "PPP", 128, 16))
    used = build.ptxas_resources(spec, "sm_90")["stack"].registers
    assert used > 16
    assert f"probe/stack (sm_90): uses {used} registers, limit max_registers=16" in build.check_resources(spec, "sm_90")


@pytest.mark.nvcc
def test_cache_key_covers_headers_and_flags(fresh_probe_dir):
    """Changing an included header or a flag rebuilds; an unchanged rebuild comes from the cache."""
    probe_dir = fresh_probe_dir
    spec = _probe_spec(probe_dir, EntrySpec("probe", PROBE_FORMAT, 128, PROBE_BUDGET))
    first = build.nvcc_compile(spec, "sm_90", "ptx")
    cache = probe_dir / "cache"
    assert len(list(cache.glob("*.ptx"))) == 1
    assert build.nvcc_compile(spec, "sm_90", "ptx") == first and len(list(cache.glob("*.ptx"))) == 1
    spec = _probe_spec(probe_dir, *spec.entries, offset="1.5f")     # only the header changes
    second = build.nvcc_compile(spec, "sm_90", "ptx")
    assert second != first and b"0f3FC00000" in second              # 1.5f appears as an immediate
    build.nvcc_compile(spec, "sm_90", "ptx", extra=("-DUNUSED_FLAG=1",))
    assert len(list(cache.glob("*.ptx"))) == 3


@pytest.mark.nvcc
def test_nvcc_error_names_file_and_arch(probe_dir):
    (probe_dir / "broken.cu").write_text('extern "C" __global__ void broken(float* y) { y[0] = undefined_name; }\n')
    spec = KernelSpec(block="broken", source=str(probe_dir / "broken.cu"), entries=())
    with pytest.raises(build.BuildError, match=r"(?s)broken\.cu \(sm_90, cubin\).*undefined_name"):
        build.nvcc_compile(spec, "sm_90")


# ---- the parsers, on text (no nvcc needed) ----------------------------------------------------------------

PTX_SAMPLE = """
.visible .entry k(
\t.param .u64 .ptr .align 1 k_param_0,
\t.param .u32 k_param_1,
\t.param .f32 k_param_2,
\t.param .align 8 .b8 k_param_3[24],
\t.param .u16 k_param_4,
\t.param .f64 k_param_5
)
.maxntid 256, 1, 1
.minnctapersm 2
{
\tret;
}
"""


def test_ptx_entry_params_parses_every_form():
    assert build.ptx_entry_params(PTX_SAMPLE, "k") == [(8, 8), (4, 4), (4, 4), (24, 8), (2, 2), (8, 8)]
    assert [p["ptr"] for p in build.ptx_entry_param_info(PTX_SAMPLE, "k")] == [True] + [False] * 5
    # offsets: 0, 8, 12, 16 (8-aligned struct), 40, 48 (8-aligned double after the u16 at 40)
    assert build.ptx_layout(build.ptx_entry_params(PTX_SAMPLE, "k")) == [
        (0, 8), (8, 4), (12, 4), (16, 24), (40, 2), (48, 8)]
    assert build.ptx_entry_bounds(PTX_SAMPLE, "k") == (256, 2)
    with pytest.raises(ValueError, match="no .entry 'nope'; entries found: \\['k'\\]"):
        build.ptx_entry_params(PTX_SAMPLE, "nope")


# (arg_format for PTX_SAMPLE's entry k, the failures check_abi must report; [] = the correct packing)
ABI_TYPE_CASES = [
    pytest.param("Pif24sHd", [], id="correct"),
    pytest.param("Pfi24sHd", ["parameter 1 (k_param_1) is an integer or pointer in the kernel, wrapper packs 'f'",
                              "parameter 2 (k_param_2) is a float in the kernel, wrapper packs 'i'"],
                 id="int-and-float-swapped"),
    pytest.param("Pif24sHq", ["parameter 5 (k_param_5) is a float in the kernel, wrapper packs 'q'"],
                 id="int64-for-double"),
    pytest.param("qif24sHd", ["parameter 0 (k_param_0) is a pointer in the kernel, wrapper packs 'q'"],
                 id="int64-for-marked-pointer"),
]


@pytest.mark.parametrize("fmt, words", ABI_TYPE_CASES)
def test_abi_gate_checks_float_vs_integer(fmt, words):
    """Same-size parameters of another type (an int where the kernel reads a float) are caught from the PTX types."""
    spec = KernelSpec(block="k", source="k.cu", entries=(EntrySpec("k", fmt, 256, register_budget(256, 2)),))
    fails = build.check_abi(spec, ptx_text=PTX_SAMPLE)
    assert len(fails) == len(words) and all(w in f for w, f in zip(words, fails, strict=True)), fails


PTXAS_SAMPLE = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'a' for 'sm_90'
ptxas info    : Function properties for a
    400 bytes stack frame, 508 bytes spill stores, 500 bytes spill loads
ptxas info    : Used 32 registers, used 0 barriers, 400 bytes cumulative stack size
ptxas info    : Compiling entry function 'b' for 'sm_90'
ptxas info    : Function properties for b
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers, 5664 bytes smem
"""


def test_parse_ptxas_report():
    r = build.parse_ptxas_report(PTXAS_SAMPLE)
    assert r["a"] == build.Resources(registers=32, spill_stores=508, spill_loads=500, stack=400, smem=0)
    assert r["b"] == build.Resources(registers=128, spill_stores=0, spill_loads=0, stack=0, smem=5664)


@pytest.mark.parametrize("fmt, layout", [
    pytest.param("PPi", [(0, 8), (8, 8), (16, 4)], id="PPi"),
    pytest.param("iP", [(0, 4), (8, 8)], id="int-then-pointer-pads"),
    pytest.param("i16s", [(0, 4), (4, 16)], id="blob-is-1-aligned"),
    pytest.param("i4x16s", [(0, 4), (8, 16)], id="explicit-pad"),
    pytest.param("2fd", [(0, 4), (4, 4), (8, 8)], id="count-and-double"),
])
def test_packed_layout(fmt, layout):
    assert EntrySpec("e", fmt, 32, 255).packed_layout() == layout


def test_bad_format_and_budget():
    with pytest.raises(ValueError, match="unknown character 'z'"):
        parse_format("Pz")
    with pytest.raises(ValueError, match="trailing count"):
        parse_format("P4")
    assert (register_budget(256, 2), register_budget(128, 1), register_budget(1024, 2)) == (128, 255, 32)
