"""Helpers shared by the GPU tests (tests/k3cuda/test_k3cuda_gpu.py) and tools/gpu_bench.py, and the kernels' CPU
emulation. No GPU needed to import.

A kernel is checked against its k3ref core run in float64 on the same inputs (`reference_core`, `to_float64`);
the comparison itself is conformance.judge.compare's (`check_outputs`), the one engine that `k3conf run` uses too.
"""
from __future__ import annotations

import collections
import ctypes
import hashlib
import shutil
import struct
import subprocess
import tempfile
import zlib
from pathlib import Path

import numpy as np

from k3ref.cores import reference_cores

from . import runtime
from . import sanitize as emu_sanitize
from .build import KERNEL_DIR, BuildError, cache_dir, source_closure
from .sanitize import EMU_BF16, TOOLS, GuardedArray, SanitizerError
from .spec import KernelSpec

__all__ = ["EMULATED_LAUNCHES", "EMU_BF16", "EMU_SHIM", "TOOLS", "HostArray", "SanitizerError", "case_seed",
           "cpu_emulation", "emulator_library", "reference_core", "to_float64"]


def reference_core(block: str):
    """The k3ref core of the same name (k3ref.cores.reference_cores())."""
    return getattr(reference_cores(), block)


def to_float64(inputs: dict) -> dict:
    """The same inputs with every floating array (bf16 too) promoted to float64 (integer/uint8 arrays and scalars
    kept), so the reference computes in float64."""
    out = {}
    for name, value in inputs.items():
        if isinstance(value, np.ndarray) and (value.dtype.kind == "f" or value.dtype.name == "bfloat16"):
            value = value.astype(np.float64)
        out[name] = value
    return out


def case_seed(label: str) -> int:
    """A fixed seed per case label (stable across runs and machines)."""
    return zlib.crc32(label.encode())


# ---- CPU emulation of the kernels (for machines without a GPU) --------------------------------------------
#
# The .cu file is compiled as C++17 with a small shim (each CUDA thread a fiber, run round-robin
# up to its next barrier: __syncthreads waits for the block, __syncwarp and __shfl_xor_sync for the warp; one
# block at a time, so __shared__ becomes `static`), and each entry is called with the argument buffer packed
# exactly as PyCUDA packs it (struct, native alignment, EntrySpec.arg_format). Inside `cpu_emulation()` the
# runtime's device buffers are host arrays and `runtime.bind` launches the emulated entry, so the wrappers, their
# argument packing and the kernels' indexing and reductions run unchanged on the CPU. It checks logic, not speed or the
# GPU's rounding (x86 float, no FMA contraction). <cuda_bf16.h> is replaced by a stand-in with the bf16 -> float
# conversions; a kernel that uses other CUDA headers or intrinsics does not build (BuildError names them).

EMU_SHIM = r"""
#pragma once
#include <setjmp.h>
#include <ucontext.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <tuple>
#include <vector>
using std::isnan; using std::max; using std::min;
struct dim3 { unsigned x, y, z; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline float2 make_float2(float a, float b) { return {a, b}; }
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline int4 make_int4(int a, int b, int c, int d) { return {a, b, c, d}; }
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
inline dim3 threadIdx{0, 0, 0}, blockIdx{0, 0, 0}, blockDim{1, 1, 1}, gridDim{1, 1, 1};
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
// Each CUDA thread is a fiber (ucontext) on one OS thread; a block's fibers run round-robin, each until it
// waits at a barrier (block-wide for __syncthreads, its warp's for __syncwarp / shuffles) or returns.
namespace emu {
// Fibers start through makecontext/swapcontext; after that every switch is _setjmp/_longjmp (no signal-mask
// system call), which keeps a block of 256 fibers with a dozen barriers in the tens of microseconds.
constexpr size_t STACK = 64 * 1024;
struct Group { unsigned count = 0, size = 0, gen = 0; };
struct Jump { jmp_buf b; };
inline ucontext_t start_ctx;
inline std::vector<ucontext_t> ctx;
inline std::vector<Jump> jumps;
inline jmp_buf sched;
inline std::vector<std::unique_ptr<char[]>> stacks;
inline std::vector<char> done, started;
inline unsigned cur = 0;
inline unsigned long long events = 0;
inline std::function<void()> body;
inline Group block_group;
inline std::vector<Group> warp_groups;
inline float xchg[32][32];
inline void yield() { if (!_setjmp(jumps[cur].b)) _longjmp(sched, 1); }
inline void wait(Group& g) {
    const unsigned my = g.gen;
    ++events;
    if (++g.count == g.size) { g.count = 0; ++g.gen; return; }
    while (g.gen == my) { yield(); }
    ++events;
}
// An exited thread no longer counts at barriers (as on the hardware): its block and warp groups shrink.
inline void leave(Group& g) { --g.size; if (g.count && g.count == g.size) { g.count = 0; ++g.gen; } }
inline void fiber_main() {
    body();
    done[cur] = 1; ++events;
    leave(block_group); leave(warp_groups[cur / 32]);
    _longjmp(sched, 1);
}
template <class T> T take(const char* buf, size_t& off) {
    off = (off + alignof(T) - 1) / alignof(T) * alignof(T);
    T v; std::memcpy(&v, buf + off, sizeof(T)); off += sizeof(T); return v;
}
template <class... A> void invoke(void (*k)(A...), const char* buf) {
    size_t off = 0;
    std::tuple<A...> t{take<A>(buf, off)...};   // braced init: evaluated left to right
    std::apply(k, t);
}
// 0 = every block ran to the end; 1 = a block deadlocked (fibers waiting at barriers nobody else reaches)
inline int run_grid(unsigned gx, unsigned gy, unsigned gz, unsigned nt, std::function<void()> fn) {
    blockDim = {nt, 1, 1}; gridDim = {gx, gy, gz}; body = std::move(fn);
    ctx.assign(nt, ucontext_t{}); jumps.assign(nt, Jump{}); done.assign(nt, 0); started.assign(nt, 0);
    while (stacks.size() < nt) stacks.emplace_back(new char[STACK]);
    getcontext(&start_ctx);
    for (unsigned z = 0; z < gz; ++z) for (unsigned y = 0; y < gy; ++y) for (unsigned x = 0; x < gx; ++x) {
        blockIdx = {x, y, z};
        block_group = Group{0, nt, 0};
        warp_groups.assign((nt + 31) / 32, Group{});
        for (unsigned w = 0; w < warp_groups.size(); ++w) warp_groups[w].size = std::min(32u, nt - 32 * w);
        for (unsigned t = 0; t < nt; ++t) {
            ctx[t] = start_ctx;
            ctx[t].uc_stack.ss_sp = stacks[t].get(); ctx[t].uc_stack.ss_size = STACK; ctx[t].uc_link = nullptr;
            makecontext(&ctx[t], fiber_main, 0);
            done[t] = 0; started[t] = 0;
        }
        unsigned alive = nt;
        while (alive) {
            const unsigned long long before = events;
            for (unsigned t = 0; t < nt; ++t) {
                if (done[t]) continue;
                cur = t; threadIdx = {t, 0, 0};
                if (!_setjmp(sched)) {
                    if (!started[t]) { started[t] = 1; ucontext_t here; swapcontext(&here, &ctx[t]); }
                    else _longjmp(jumps[t].b, 1);
                }
                if (done[t]) --alive;
            }
            if (alive && events == before) return 1;
        }
    }
    return 0;
}
}  // namespace emu
inline void __syncthreads() { emu::wait(emu::block_group); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::wait(emu::warp_groups[threadIdx.x / 32]); }
inline float __shfl_xor_sync(unsigned, float v, int off) {
    const unsigned w = threadIdx.x / 32, l = threadIdx.x % 32;
    emu::xchg[w][l] = v; __syncwarp();
    const float r = emu::xchg[w][l ^ off]; __syncwarp();
    return r;
}
// Integer and 64-bit shuffles, the other shuffles, votes, atomics and dynamic shared memory (the float
// __shfl_xor_sync above stays the one float XOR shuffles take). Masks are not checked here: the sanitized build
// (k3cuda.sanitize) honours and checks them.
namespace emu {
inline uint64_t xchg64[32][32];
alignas(256) inline unsigned char dyn_smem[232448];
template <class T> inline T shfl_from(T v, int src) {
    static_assert(sizeof(T) <= 8, "shuffle of a type wider than 8 bytes");
    const unsigned w = threadIdx.x / 32, l = threadIdx.x % 32;
    uint64_t u = 0; std::memcpy(&u, &v, sizeof(T)); xchg64[w][l] = u; __syncwarp();
    const uint64_t r = xchg64[w][unsigned(src) % 32]; __syncwarp();
    T out; std::memcpy(&out, &r, sizeof(T)); return out;
}
}  // namespace emu
template <class T> inline T* k3_dyn_shared() { return reinterpret_cast<T*>(emu::dyn_smem); }
template <class T> inline T __shfl_xor_sync(unsigned, T v, int m, int width = 32) {
    const int l = threadIdx.x % 32, base = l & ~(width - 1), src = base + ((l - base) ^ m);
    return emu::shfl_from(v, src >= base + width ? l : src);
}
template <class T> inline T __shfl_sync(unsigned, T v, int s, int width = 32) {
    const int l = threadIdx.x % 32;
    return emu::shfl_from(v, (l & ~(width - 1)) + (s & (width - 1)));
}
template <class T> inline T __shfl_down_sync(unsigned, T v, unsigned d, int width = 32) {
    const int l = threadIdx.x % 32, src = l + int(d);
    return emu::shfl_from(v, src >= (l & ~(width - 1)) + width ? l : src);
}
template <class T> inline T __shfl_up_sync(unsigned, T v, unsigned d, int width = 32) {
    const int l = threadIdx.x % 32, src = l - int(d);
    return emu::shfl_from(v, src < (l & ~(width - 1)) ? l : src);
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
    const unsigned w = threadIdx.x / 32, l = threadIdx.x % 32;
    emu::xchg64[w][l] = pred ? 1 : 0; __syncwarp();
    unsigned out = 0;
    for (unsigned k = 0; k < emu::warp_groups[w].size; ++k) if ((mask >> k & 1u) && emu::xchg64[w][k]) out |= 1u << k;
    __syncwarp();
    return out;
}
inline int __any_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) != 0; }
inline int __all_sync(unsigned mask, int pred) {
    const unsigned n = emu::warp_groups[threadIdx.x / 32].size;
    return __ballot_sync(mask, pred) == (mask & (n >= 32 ? 0xffffffffu : (1u << n) - 1));
}
template <class T> inline T atomicAdd(T* p, T v) { const T old = *p; *p = old + v; return old; }
template <class T> inline T atomicMax(T* p, T v) { const T old = *p; *p = old > v ? old : v; return old; }
template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline void __stcg(T* p, T v) { *p = v; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned i; std::memcpy(&i, &f, 4); return i; }
"""

# EMU_BF16 (the stand-in for <cuda_bf16.h>) lives in k3cuda.sanitize, which builds with it too.


def emulator_library(spec):
    """Build (or fetch from the cache) the C++ emulation of `spec`'s entries; returns a ctypes.CDLL.

    Raises k3cuda.build.BuildError (with g++'s output) when the kernel does not build under the shim.
    """
    gxx = shutil.which("g++")
    if not gxx:
        raise BuildError("g++ not found on PATH (the CPU emulation of the kernels needs it)")
    closure = source_closure(spec.path)
    # `extern __shared__` (dynamic shared memory) cannot stay `static`: such sources are built from copies with
    # those declarations pointing at the shim's buffer (the lines unchanged); others are included as they are
    dynamic = {Path(n).name: emu_sanitize.rewrite_shared(d.decode(), Path(n).name, extern_only=True)
               for n, d in closure if emu_sanitize.has_extern_shared(d.decode())}
    driver = ['#include "emu_shim.h"', f'#include "{Path(spec.path).name if dynamic else spec.path}"']
    for e in spec.entries:
        driver.append(f'extern "C" int emu_{e.name}(unsigned gx, unsigned gy, unsigned gz, unsigned nt, '
                      f'const char* buf) {{ return emu::run_grid(gx, gy, gz, nt, '
                      f'[buf] {{ emu::invoke(&{e.name}, buf); }}); }}')
    driver_src = "\n".join(driver) + "\n"
    flags = ["-std=c++17", "-O1", "-fPIC", "-shared", "-Wno-unknown-pragmas", "-Wno-attributes",
             *(f"-D{d}" for d in spec.defines)]
    h = hashlib.sha256((EMU_SHIM + EMU_BF16 + driver_src + " ".join(flags)).encode())
    for name, data in closure:
        h.update(Path(name).name.encode() + b"\0" + data)
    lib = cache_dir() / "emu" / f"{spec.block}-{h.hexdigest()[:24]}.so"
    if not lib.is_file():
        lib.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="k3emu-") as tmp:
            (Path(tmp) / "emu_shim.h").write_text(EMU_SHIM)
            (Path(tmp) / "cuda_bf16.h").write_text('#include "emu_shim.h"\n' + EMU_BF16)
            (Path(tmp) / "driver.cpp").write_text(driver_src)
            if dynamic:   # every file of the closure beside the driver, the rewritten ones rewritten
                for name, data in closure:
                    (Path(tmp) / Path(name).name).write_text(dynamic.get(Path(name).name, data.decode()))
            out = Path(tmp) / "lib.so"
            cmd = [gxx, *flags, f"-I{tmp}", f"-I{KERNEL_DIR}", "-o", str(out), str(Path(tmp) / "driver.cpp")]
            run = subprocess.run(cmd, capture_output=True, text=True)
            if run.returncode != 0:
                raise BuildError(f"the CPU emulation of {spec.source} does not build:\n{run.stderr.strip()[:2000]}")
            shutil.move(str(out), lib)
    return ctypes.CDLL(str(lib))


class HostArray:
    """A host ndarray standing in for a pycuda GPUArray (gpudata = its address; get/set copy)."""

    def __init__(self, a: np.ndarray):
        self.a = np.array(a, order="C", copy=True)

    @property
    def gpudata(self) -> int:
        return self.a.ctypes.data

    dtype = property(lambda self: self.a.dtype)
    shape = property(lambda self: self.a.shape)
    size = property(lambda self: self.a.size)

    def get(self) -> np.ndarray:
        return self.a.copy()

    def set(self, x) -> None:
        x = np.asarray(x)
        if x.shape != self.a.shape or x.dtype != self.a.dtype:
            raise ValueError(f"set: expected {self.a.shape} {self.a.dtype}, found {x.shape} {x.dtype}")
        np.copyto(self.a, x)


def _poisoned(shape: tuple, dtype) -> np.ndarray:
    """NaN for a floating dtype, all bits set (-1) for an integer one."""
    dtype = np.dtype(dtype)
    return np.full(shape, np.nan, dtype) if dtype.kind == "f" else np.full(shape, -1).astype(dtype)


def _full_grid(spec: KernelSpec, entry: str, grid) -> tuple[int, ...]:
    """(gx, gy, gz) from a grid of 1 to 3 dimensions; ValueError for an empty dimension, as on a GPU."""
    full = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
    if min(full) < 1:
        raise ValueError(f"{spec.block}/{entry}: grid {full} has an empty dimension")
    return full


# (block, entry) -> launches run by the emulation in this process: tests read it to prove that a kernel entry
# ran (a core that quietly fell back to its reference would leave no count).
EMULATED_LAUNCHES: collections.Counter = collections.Counter()


class cpu_emulation:
    """Context manager: k3cuda.runtime's buffers become HostArrays and launches run the C++ emulation.

    `sanitize`: None (the plain emulation), True (every tool in k3cuda.sanitize.TOOLS) or a tuple of tool names:
    the launches then run the checked build (k3cuda.sanitize): buffers are GuardedArrays with redzones, and a
    launch with findings raises k3cuda.sanitize.SanitizerError listing them.
    Every emulated launch is counted in EMULATED_LAUNCHES[(block, entry)]."""

    SM_COUNT = 132  # what multiprocessor_count() answers (an H200's)

    def __init__(self, sanitize: bool | tuple[str, ...] | None = None):
        tools = TOOLS if sanitize is True else tuple(sanitize or ())
        emu_sanitize.tool_mask(tools)   # ValueError for an unknown tool name, here rather than at a launch
        self.tools = tools

    def __enter__(self) -> cpu_emulation:
        if self.tools:
            return self._enter_checked()
        libs: dict[KernelSpec, ctypes.CDLL] = {}   # keyed by the whole spec: a test may swap in a mutant source

        def bind(spec, entry, grid, args, shared=0):
            if shared > emu_sanitize.DYN_SHARED_MAX:
                raise ValueError(f"{spec.block}/{entry}: {shared} bytes of dynamic shared memory, the most a block "
                                 f"can have is {emu_sanitize.DYN_SHARED_MAX}")
            e = spec.entry(entry)
            grid = _full_grid(spec, entry, grid)
            if spec not in libs:
                libs[spec] = emulator_library(spec)
            fn = getattr(libs[spec], f"emu_{entry}")
            fn.argtypes = [ctypes.c_uint] * 4 + [ctypes.c_char_p]
            fn.restype = ctypes.c_int
            buf = struct.pack(e.arg_format, *args)   # native alignment, as PyCUDA's prepared_call packs

            def run():
                if fn(*grid, e.block_threads, buf):
                    raise RuntimeError(f"{spec.block}/{entry} (CPU emulation): a block deadlocked at a barrier")
                EMULATED_LAUNCHES[(spec.block, entry)] += 1

            return run

        def empty_poisoned(shape, dtype=np.float32):
            return HostArray(_poisoned(tuple(int(s) for s in shape), dtype))

        def poison(a):
            a.a[...] = np.nan

        return self._install(bind, lambda a, dtype=np.float32: HostArray(np.ascontiguousarray(a, dtype=dtype)),
                             empty_poisoned, poison)

    def _enter_checked(self) -> cpu_emulation:
        libs: dict[KernelSpec, tuple] = {}
        live: list = []        # the buffers made in this context (weakly enough: one test's worth)
        tools = self.tools

        def bind(spec, entry, grid, args, shared=0):
            spec.entry(entry)
            grid = _full_grid(spec, entry, grid)
            if spec not in libs:
                libs[spec] = emu_sanitize.checked_library(spec)
            checked = libs[spec]

            def run():
                emu_sanitize.run_checked(checked, spec, entry, grid, args, live, tools, shared)
                EMULATED_LAUNCHES[(spec.block, entry)] += 1

            return run

        def to_device(a, dtype=np.float32):
            g = GuardedArray(np.ascontiguousarray(a, dtype=dtype))
            live.append(g)
            return g

        def empty_poisoned(shape, dtype=np.float32):
            g = GuardedArray(_poisoned(tuple(int(s) for s in shape), dtype), initialised=False)
            live.append(g)
            return g

        def poison(a):
            if isinstance(a, GuardedArray):
                a.poison()
            else:
                a.a[...] = np.nan

        return self._install(bind, to_device, empty_poisoned, poison)

    def _install(self, bind, to_device, empty_poisoned, poison) -> cpu_emulation:
        """Put one mode's buffer and launch functions in place of k3cuda.runtime's (restored by __exit__)."""
        patches = {
            "bind": bind,
            "launch": lambda spec, entry, grid, args, shared=0: bind(spec, entry, grid, args, shared)(),
            "to_device": to_device,
            "empty_poisoned": empty_poisoned,
            "poison": poison,
            "multiprocessor_count": lambda: self.SM_COUNT,
        }
        self._runtime = runtime
        self._saved = {name: getattr(runtime, name) for name in patches}
        for name, fn in patches.items():
            setattr(runtime, name, fn)
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(self._runtime, name, fn)
        return False
