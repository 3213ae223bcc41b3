"""The sanitizers of the CPU emulation (k3cuda.sanitize, marker `sanitize`): memcheck, racecheck, initcheck and
synccheck without a GPU.

- one small kernel per class of bug in tests/k3cuda/sanitize_kernels/, built twice: with `-DK3_BUG=1` the
  planted bug must be reported by its tool at the planted line (the line marked `// planted`), without it every
  tool must stay quiet;
- every entry of every product kernel on its check cases under all four tools at once (a finding fails);
- the barrier mutants of test_k3cuda_kernels_cpu.py, now reported as races at their source lines.

A missing g++ or addr2line, or a build that fails, is a failure here (never a skip): CI must not pass a
sanitizer that did not run.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest

import k3cuda
from k3cuda import runtime, sanitize, testing
from k3cuda.build import BuildError
from k3cuda.sanitize import SanitizerError, rewrite_shared
from k3cuda.spec import EntrySpec, KernelSpec

pytestmark = pytest.mark.sanitize

HERE = Path(__file__).parent / "sanitize_kernels"


def _spec(source: str, entry: str, fmt: str, threads: int, bug: bool) -> KernelSpec:
    return KernelSpec(block=f"sanitize-{Path(source).stem}", source=str(HERE / source),
                      entries=(EntrySpec(entry, fmt, threads, 255),), defines=("K3_BUG=1",) if bug else ())


def _planted(source: str, tag: str = "") -> str:
    """'file.cu:N' of the line marked `// planted` (with `tag` after it when given)."""
    lines = (HERE / source).read_text().splitlines()
    hits = [n for n, line in enumerate(lines, 1) if re.search(r"// planted" + (f": {tag}" if tag else ""), line)]
    assert len(hits) == 1, f"{source}: expected one line marked '// planted{': ' + tag if tag else ''}', found {hits}"
    return f"{source}:{hits[0]}"


def _floats(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0.5, 1.5, n).astype(np.float32)


def _run(spec: KernelSpec, entry: str, tools, arrays: list[np.ndarray], out_shape: int, scalars=(), shared=0,
         out_dtype=np.float32):
    """One launch of a test kernel in the checked emulation: inputs uploaded, one poisoned output; returns it."""
    with testing.cpu_emulation(sanitize=tools):
        ins = [runtime.to_device(a, a.dtype) for a in arrays]
        out = runtime.empty_poisoned((out_shape,), out_dtype)
        runtime.launch(spec, entry, (1,), (*(a.gpudata for a in ins), out.gpudata, *scalars), shared)
        return out.get()


# (source, entry, arg format, threads, tool, planted tag, inputs, output size, scalars, message words)
PLANTED = [
    pytest.param("oob_read.cu", "oob_global", "PPi", 64, "memcheck", "global", [_floats(64, 1)], 64, (64,),
                 "out-of-bounds read of 4 bytes by thread 63: 0 bytes past the end of global buffer", id="oob-global"),
    pytest.param("oob_read.cu", "oob_shared", "PPi", 64, "memcheck", "shared", [_floats(64, 2)], 64, (64,),
                 "out-of-bounds read of 4 bytes by thread 63: 0 bytes past the end of __shared__ s", id="oob-shared"),
    pytest.param("missing_barrier.cu", "swap_halves", "PP", 64, "racecheck", "read", [_floats(64, 3)], 64, (),
                 "read-after-write hazard on shared memory: thread 32 reads __shared__ s", id="missing-barrier"),
    pytest.param("uninit_shared.cu", "half_written", "PP", 64, "initcheck", "", [_floats(64, 4)], 64, (),
                 "reads 4 bytes of __shared__ s", id="uninitialised-shared"),
    pytest.param("barrier_in_branch.cu", "branch_barrier", "PP", 64, "synccheck", "", [_floats(64, 5)], 64, (),
                 "__syncthreads not reached by every thread of the block", id="barrier-in-branch"),
    pytest.param("shuffle_after_exit.cu", "half_warp_sum", "PP", 32, "synccheck", "", [_floats(32, 6)], 1, (),
                 "exited", id="full-mask-shuffle-after-exit"),
    pytest.param("half_warps.cu", "half_warps", "PP", 32, "synccheck", "", [_floats(32, 9)], 32, (),
                 "diverge", id="overlapping-warp-masks"),
    pytest.param("misaligned_load.cu", "load4", "PP", 64, "memcheck", "", [_floats(260, 7)], 64, (),
                 "misaligned access: thread 0 accesses 'const struct float4'", id="misaligned-float4"),
]


@pytest.mark.parametrize("source, entry, fmt, threads, tool, tag, arrays, n_out, scalars, words", PLANTED)
def test_planted_bug_is_caught_with_its_line(source, entry, fmt, threads, tool, tag, arrays, n_out, scalars, words):
    spec = _spec(source, entry, fmt, threads, bug=True)
    with pytest.raises(SanitizerError) as err:
        _run(spec, entry, (tool,), arrays, n_out, scalars)
    found = err.value.findings
    assert {f.tool for f in found} == {tool}, f"expected only {tool} findings, found:\n{err.value}"
    where = _planted(source, tag)
    hits = [f for f in found if f.where.startswith(where) and words in f.message]
    assert hits, f"expected a {tool} finding at {where} saying {words!r}; found:\n{err.value}"


@pytest.mark.parametrize("source, entry, fmt, threads, tool, tag, arrays, n_out, scalars, words", PLANTED)
def test_same_kernel_without_the_bug_passes_every_tool(source, entry, fmt, threads, tool, tag, arrays, n_out,
                                                      scalars, words):
    spec = _spec(source, entry, fmt, threads, bug=False)
    out = _run(spec, entry, sanitize.TOOLS, arrays, n_out, scalars)
    assert not np.isnan(out).any(), f"{entry}: output left unwritten (NaN poison) by the fixed kernel: {out}"


def test_race_names_both_accesses():
    spec = _spec("missing_barrier.cu", "swap_halves", "PP", 64, bug=True)
    with pytest.raises(SanitizerError) as err:
        _run(spec, "swap_halves", ("racecheck",), [_floats(64, 3)], 64)
    raw = [f for f in err.value.findings if "read-after-write" in f.message]
    assert raw, f"no read-after-write hazard reported:\n{err.value}"
    assert raw[0].where.startswith(_planted("missing_barrier.cu", "read")), raw[0]
    assert raw[0].other.startswith(_planted("missing_barrier.cu", "write")), raw[0]


@pytest.mark.parametrize("tools", [pytest.param(True, id="sanitized"), pytest.param(None, id="plain")])
def test_warp_intrinsics_atomics_and_dynamic_shared_memory(tools):
    """__shfl_down/up/_sync on ints, __ballot_sync, atomicAdd and extern __shared__ give NumPy's answers in the
    plain emulation and under every tool; reading one int past the dynamic shared memory is an out-of-bounds
    read for memcheck."""
    x = np.random.default_rng(8).integers(-50, 50, 64).astype(np.int32)
    spec = _spec("warp_ops.cu", "warp_ops", "PPP", 64, bug=False)
    with testing.cpu_emulation(sanitize=tools):
        xin = runtime.to_device(x, np.int32)
        out = runtime.empty_poisoned((256,), np.int32)
        total = runtime.to_device(np.zeros(1, np.float32))
        runtime.launch(spec, "warp_ops", (1,), (xin.gpudata, out.gpudata, total.gpudata), 64 * 4)
        got, tot = out.get().reshape(64, 4), total.get()
    lanes = np.arange(64) % 32
    warp_of = np.arange(64) // 32
    want_sum = np.where(lanes == 0, [x[32 * w:32 * w + 32].sum() for w in warp_of], 0)
    prev = np.where(lanes == 0, x, np.roll(x, 1))
    odd = [sum(1 << k for k in range(32) if x[32 * w + k] & 1) for w in warp_of]
    np.testing.assert_array_equal(got[:, 0], want_sum)
    np.testing.assert_array_equal(got[:, 1], x[32 * warp_of] + prev)
    np.testing.assert_array_equal(got[:, 2].astype(np.uint32), np.array(odd, np.uint64).astype(np.uint32))
    np.testing.assert_array_equal(got[:, 3], x[::-1])
    assert tot[0] == float(x.sum()), f"atomicAdd total: expected {x.sum()}, found {tot[0]}"
    if not tools:
        return
    bad = _spec("warp_ops.cu", "warp_ops", "PPP", 64, bug=True)
    with testing.cpu_emulation(sanitize=("memcheck",)), pytest.raises(SanitizerError) as err:
        xin = runtime.to_device(x, np.int32)
        out = runtime.empty_poisoned((256,), np.int32)
        total = runtime.to_device(np.zeros(1, np.float32))
        runtime.launch(bad, "warp_ops", (1,), (xin.gpudata, out.gpudata, total.gpudata), 64 * 4)
    assert any(f.where.startswith(_planted("warp_ops.cu")) and "dynamic shared memory" in f.message
               for f in err.value.findings), str(err.value)


def test_rewrite_keeps_lines_and_handles_every_form():
    src = ("// __shared__ in a comment; stays\n__shared__ float a[4], b[2][8];\nstatic __shared__ __align__(16) "
           "float c[TK][COLS];\n__shared__ int\n   d;\nextern __shared__ __align__(16) float dyn[];\n")
    out = rewrite_shared(src)
    assert out.count("\n") == src.count("\n")
    assert "// __shared__ in a comment; stays" in out
    assert 'static auto& a = emu::shared_slot<float[4]>("a", __FILE__, __LINE__, 0);' in out
    assert 'static auto& b = emu::shared_slot<float[2][8]>("b", __FILE__, __LINE__, 0);' in out
    assert 'emu::shared_slot<float[TK][COLS]>("c", __FILE__, __LINE__, 16);' in out
    assert 'static auto& d = emu::shared_slot<int>("d", __FILE__, __LINE__, 0);' in out
    assert "static float* const dyn = k3_dyn_shared<float>();" in out
    plain = rewrite_shared(src, extern_only=True)
    assert "__shared__ float a[4], b[2][8];" in plain and "k3_dyn_shared<float>()" in plain
    assert sanitize.has_extern_shared(src) and not sanitize.has_extern_shared("// extern __shared__ x[];\n")
    with pytest.raises(ValueError, match="without a size needs `extern`"):
        rewrite_shared("__shared__ float e[];")


@pytest.mark.parametrize("tool", ["g++", "addr2line"])
def test_missing_tool_is_a_build_error_not_a_skip(monkeypatch, tool):
    real = sanitize.shutil.which
    monkeypatch.setattr(sanitize.shutil, "which", lambda name: None if name == tool else real(name))
    with pytest.raises(BuildError, match=re.escape(f"{tool} not found on PATH")):
        sanitize.checked_library(_spec("oob_read.cu", "oob_global", "PPi", 64, bug=False))


def test_pointer_to_a_foreign_buffer_is_refused():
    """A pointer no sanitized buffer owns would be accessed unchecked: the launch refuses it."""
    spec = _spec("oob_read.cu", "oob_global", "PPi", 64, bug=False)
    stray = np.zeros(64, np.float32)
    with testing.cpu_emulation(sanitize=True), pytest.raises(ValueError, match="pointer parameter 0"):
        out = runtime.empty_poisoned((64,))
        runtime.launch(spec, "oob_global", (1,), (stray.ctypes.data, out.gpudata, 64))


def test_unknown_tool_is_refused():
    with pytest.raises(ValueError, match="unknown tool"):
        testing.cpu_emulation(sanitize=("memchek",))


# ---- the product kernels: every entry, every check case, all four tools at once --------------------------------
def _entry_runs(block: str):
    """[(forced entry or None, check case)]: kda_decode's cases under each of its entries; the others as their
    wrappers pick (mla_decode's bf16 cases take the bf16 entry, every case its combine)."""
    mod = k3cuda.kernel_module(block)
    forced = mod.CHOOSABLE_ENTRIES if block == "kda_decode" else (None,)
    return [(entry, case) for entry in forced for case in mod.check_cases()]


@pytest.mark.parametrize("block", list(k3cuda.KERNEL_MODULES))
def test_product_kernel_passes_every_sanitizer_on_every_entry(block):
    mod = k3cuda.kernel_module(block)
    before = dict(testing.EMULATED_LAUNCHES)
    for entry, case in _entry_runs(block):
        inputs = case.make_inputs(np.random.default_rng(testing.case_seed(f"{block}/{case.label}")))
        with testing.cpu_emulation(sanitize=True):
            if entry:
                with k3cuda.force_entry(block, entry):
                    getattr(mod, block)(**inputs)
            else:
                getattr(mod, block)(**inputs)
    ran = {e.name for e in mod.KERNEL.entries
           if testing.EMULATED_LAUNCHES[(block, e.name)] > before.get((block, e.name), 0)}
    missing = sorted({e.name for e in mod.KERNEL.entries} - ran)
    assert not missing, f"{block}: entries never launched under the sanitizers: {missing}"


# the barrier mutants of test_k3cuda_kernels_cpu.py: (block, the barrier line removed)
MUTANTS = [
    pytest.param("kda_decode", "    __syncthreads();  // everyone has read red before it is reused for o\n",
                 id="kda-red-reused-before-read"),
    pytest.param("mla_decode", "        __syncthreads();  // every warp is done with the previous tile\n",
                 id="mla-tile-overwritten-while-read"),
]


@pytest.mark.parametrize("block, line", MUTANTS)
def test_removed_product_barrier_is_a_race_at_its_lines(tmp_path, monkeypatch, block, line):
    mod = k3cuda.kernel_module(block)
    src = mod.KERNEL.path.read_text()
    assert src.count(line) == 1, f"{mod.KERNEL.source} no longer has the line this mutant removes: {line!r}"
    (tmp_path / mod.KERNEL.source).write_text(src.replace(line, "\n"))
    monkeypatch.setattr(mod, "KERNEL", dataclasses.replace(mod.KERNEL, source=str(tmp_path / mod.KERNEL.source)))
    case = mod.check_cases()[1]
    d = case.make_inputs(np.random.default_rng(17))
    with testing.cpu_emulation(sanitize=("racecheck",)), pytest.raises(SanitizerError) as err:
        getattr(mod, block)(**d)
    assert all(f.tool == "racecheck" for f in err.value.findings), str(err.value)
    name = Path(mod.KERNEL.source).name
    assert any("hazard" in f.message and name in f.where and name in f.other for f in err.value.findings), \
        str(err.value)
