"""Sanitizers for the CPU emulation of the kernels: memcheck, racecheck, initcheck and synccheck without a GPU.

`k3cuda.testing.cpu_emulation(sanitize=TOOLS)` runs the kernels through a second build of the emulation, made
here: the .cu source is compiled by g++ with `-fsanitize=kernel-address` in call mode (every load and store of
the kernel becomes a call `__asan_loadN_noabort(addr)`) and `-fsanitize=alignment`, and the shim below defines
those callbacks itself, so no sanitizer runtime is linked and the fibers (one per CUDA thread) need no
runtime hooks. The callbacks check each access against the memory the launch may touch:

- global buffers: every device buffer is its own allocation with REDZONE bytes on each side (`GuardedArray`),
  registered with the launch, so an access in a redzone is an out-of-bounds read or write (memcheck);
- shared memory: each `__shared__` declaration is rewritten into a slot of an arena with redzones between
  slots (`rewrite_shared`); `extern __shared__` becomes the launch's dynamic shared memory, sized by `shared`;
- initcheck: shared memory is poisoned (0xff bytes: NaN floats) and marked unwritten at every block start,
  device buffers made by `empty_poisoned`/`poison` are unwritten until a kernel or the host writes them; a read
  of an unwritten byte is reported;
- racecheck: a shadow word per 4 bytes of shared and global memory holds the last write and the reads of the
  current barrier interval (thread, warp-sync count, site); a write and another thread's access in the same
  interval, not ordered by `__syncthreads` (or `__syncwarp` within a warp), is a hazard, reported with both;
- synccheck: a `__syncthreads` that some threads never reach (they exited or wait at another barrier), a
  warp-synchronous call whose mask names exited lanes or the wrong lanes, lanes of a warp at different calls
  or masks, a shuffle reading a lane outside its mask; the warp keeps 32 lanes (exited lanes are absent, the
  warp does not shrink);
- UBSan's alignment check: a misaligned vector (or scalar) access, a fault on a GPU.

Each finding names the tool, the kernel, the entry, the thread and block, and the source line(s) (addr2line on
the library's debug information), and `SanitizerError` is raised at the launch. What these checks cannot see
compared with compute-sanitizer is in docs/k3cuda.md.
"""
from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import re
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from .build import KERNEL_DIR, BuildError, cache_dir, source_closure
from .spec import parse_format

TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
_TOOL_BITS = {"memcheck": 1, "racecheck": 2, "initcheck": 4, "synccheck": 8}
_BIT_TOOLS = {v: k for k, v in _TOOL_BITS.items()}
REDZONE = 256        # bytes of redzone on each side of a device buffer (cudaMalloc aligns to 256 too)
DYN_SHARED_MAX = 232448   # the largest dynamic shared memory of a block (227 KB, sm_90 / sm_100)

# Stand-in for <cuda_bf16.h>: storage and the bf16 -> float conversions (exact: bf16 is float's top half).
EMU_BF16 = r"""
#pragma once
#include <cstdint>
#include <cstring>
struct __nv_bfloat16 { uint16_t x; };
struct alignas(4) __nv_bfloat162 { __nv_bfloat16 x, y; };
inline float __bfloat162float(__nv_bfloat16 h) {
    uint32_t u = uint32_t(h.x) << 16; float f; std::memcpy(&f, &u, 4); return f;
}
inline float2 __bfloat1622float2(__nv_bfloat162 h) { return {__bfloat162float(h.x), __bfloat162float(h.y)}; }
"""

# The kernel side of the checking shim: included by each checked kernel library.
CHECK_HEADER = r"""
#pragma once
// The checking shim of the CPU emulation (k3cuda.sanitize), kernel side: CUDA's types, macros and intrinsics for
// a kernel translation unit built with -fsanitize=kernel-address (call mode) and -fsanitize=alignment. The
// fibers, the checks and the instrumentation callbacks live in the runtime library (emu_check_rt.cpp, built
// once, not instrumented), which every checked kernel library links.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <algorithm>
using std::isnan; using std::max; using std::min;
struct dim3 { unsigned x, y, z; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(8) int2 { int x, y; };
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline float2 make_float2(float a, float b) { return {a, b}; }
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline int4 make_int4(int a, int b, int c, int d) { return {a, b, c, d}; }
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
inline int2 make_int2(int a, int b) { return {a, b}; }
#define K3_API extern "C" __attribute__((visibility("default")))
#define K3_SHARED_API __attribute__((visibility("default")))
extern K3_SHARED_API dim3 threadIdx, blockIdx, blockDim, gridDim;
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// __shared__ declarations are rewritten by k3cuda.sanitize into emu::shared_slot<T>(...) references
#define __shared__ __shared___was_not_rewritten
#define K3_NOCHECK __attribute__((no_sanitize_address, no_sanitize("alignment"), noinline))
#define K3_SITE __attribute__((noinline))
#define K3_PC reinterpret_cast<uintptr_t>(__builtin_return_address(0))
namespace emu {
extern K3_SHARED_API unsigned cur;
extern K3_SHARED_API int atomic_depth;
K3_SHARED_API void* register_slot(size_t bytes, size_t align, const char* name, const char* file, int line);
K3_SHARED_API void* dyn_arena_base();
K3_SHARED_API int run_grid(unsigned gx, unsigned gy, unsigned gz, unsigned nt, void (*fn)(const char*),
                          const char* buf);
K3_SHARED_API void sync_block(uintptr_t pc);
K3_SHARED_API void sync_warp(unsigned mask, uintptr_t pc);
K3_SHARED_API uint64_t shfl(unsigned mask, uint64_t v, int src, uintptr_t pc, const char* what);
K3_SHARED_API unsigned vote(unsigned mask, int pred, uintptr_t pc, const char* what, unsigned* voters);
K3_SHARED_API unsigned active_mask();
// one slot of the checked shared arena per __shared__ declaration (static reference: registered once)
template <class T> T& shared_slot(const char* name, const char* file, int line, size_t align) {
    return *static_cast<T*>(register_slot(sizeof(T), std::max<size_t>(align, alignof(T)), name, file, line));
}
template <class T> T* dyn_shared() { return static_cast<T*>(dyn_arena_base()); }
template <class T> T take(const char* buf, size_t& off) {
    off = (off + alignof(T) - 1) / alignof(T) * alignof(T);
    T v; std::memcpy(&v, buf + off, sizeof(T)); off += sizeof(T); return v;
}
template <class... A> void invoke(void (*k)(A...), const char* buf) {
    size_t off = 0;
    std::tuple<A...> t{take<A>(buf, off)...};   // braced init: evaluated left to right
    std::apply(k, t);
}
}  // namespace emu
template <class T> T* k3_dyn_shared() { return emu::dyn_shared<T>(); }
K3_SITE inline void __syncthreads() { emu::sync_block(K3_PC); }
K3_SITE inline void __syncwarp(unsigned mask = 0xffffffffu) { emu::sync_warp(mask, K3_PC); }
template <class T> inline uint64_t k3_bits(T v) {
    static_assert(sizeof(T) <= 8, "shuffle of a type wider than 8 bytes");
    uint64_t u = 0; std::memcpy(&u, &v, sizeof(T)); return u;
}
template <class T> inline T k3_from_bits(uint64_t u) { T v; std::memcpy(&v, &u, sizeof(T)); return v; }
template <class T> K3_SITE T __shfl_xor_sync(unsigned mask, T v, int m, int width = 32) {
    const int lane = int(emu::cur % 32), base = lane & ~(width - 1), src = base + ((lane - base) ^ m);
    return k3_from_bits<T>(emu::shfl(mask, k3_bits(v), src >= base + width ? lane : src, K3_PC, "__shfl_xor_sync"));
}
template <class T> K3_SITE T __shfl_sync(unsigned mask, T v, int s, int width = 32) {
    const int lane = int(emu::cur % 32), base = lane & ~(width - 1);
    return k3_from_bits<T>(emu::shfl(mask, k3_bits(v), base + (s & (width - 1)), K3_PC, "__shfl_sync"));
}
template <class T> K3_SITE T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = 32) {
    const int lane = int(emu::cur % 32), base = lane & ~(width - 1), src = lane + int(d);
    return k3_from_bits<T>(emu::shfl(mask, k3_bits(v), src >= base + width ? lane : src, K3_PC, "__shfl_down_sync"));
}
template <class T> K3_SITE T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = 32) {
    const int lane = int(emu::cur % 32), base = lane & ~(width - 1), src = lane - int(d);
    return k3_from_bits<T>(emu::shfl(mask, k3_bits(v), src < base ? lane : src, K3_PC, "__shfl_up_sync"));
}
K3_SITE inline unsigned __ballot_sync(unsigned mask, int pred) {
    unsigned v; return emu::vote(mask, pred, K3_PC, "__ballot_sync", &v);
}
K3_SITE inline int __any_sync(unsigned mask, int pred) {
    unsigned v; return emu::vote(mask, pred, K3_PC, "__any_sync", &v) != 0;
}
K3_SITE inline int __all_sync(unsigned mask, int pred) {
    unsigned v; const unsigned yes = emu::vote(mask, pred, K3_PC, "__all_sync", &v); return yes == v;
}
inline unsigned __activemask() { return emu::active_mask(); }
// the emulated atomics: the fibers never interleave inside one, and racecheck does not log their accesses
template <class T> inline T atomicAdd(T* p, T v) {
    ++emu::atomic_depth; const T old = *p; *p = old + v; --emu::atomic_depth; return old;
}
template <class T> inline T atomicMax(T* p, T v) {
    ++emu::atomic_depth; const T old = *p; *p = old > v ? old : v; --emu::atomic_depth; return old;
}
template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline void __stcg(T* p, T v) { *p = v; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned i; std::memcpy(&i, &f, 4); return i; }
"""

# The runtime side: fibers, barriers, warps, tracked memory, the checks and the instrumentation callbacks;
# built once (not instrumented) and linked by every checked kernel library.
CHECK_RUNTIME = r"""
// The checking shim of the CPU emulation (k3cuda.sanitize), runtime side: the fibers (one per CUDA thread),
// barriers, the warp, the tracked memory and the four checks, plus the callbacks that the instrumented kernel
// libraries call for every load and store (-fsanitize=kernel-address in call mode emits __asan_loadN_noabort,
// ...; they are defined here, so no sanitizer runtime is linked and the fibers need no runtime hooks) and UBSan's
// alignment handler. Built once without instrumentation, so its own accesses cost nothing.
#include "emu_check.h"
#include <dlfcn.h>
#include <setjmp.h>
#include <ucontext.h>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>
K3_SHARED_API dim3 threadIdx{0, 0, 0}, blockIdx{0, 0, 0}, blockDim{1, 1, 1}, gridDim{1, 1, 1};
namespace emu {
enum Tool : unsigned { MEMCHECK = 1, RACECHECK = 2, INITCHECK = 4, SYNCCHECK = 8 };
unsigned tools = 0;
inline bool busy = false;           // inside the checker: its own accesses are not checked
K3_SHARED_API int atomic_depth = 0;        // inside an emulated atomic: no race recorded
constexpr size_t STACK = 64 * 1024;
constexpr unsigned MAX_FINDINGS = 64;

// ---- findings: one line each, "tool|pc|pc2|tid|bx|by|bz|message" (pcs as offsets into this library)
inline std::string findings;
inline unsigned nfindings = 0, dropped = 0;
inline std::vector<std::pair<unsigned, uintptr_t>> seen;   // (tool, pc) reported already
K3_SHARED_API unsigned cur = 0;
K3_NOCHECK inline uintptr_t lib_offset(uintptr_t pc) {
    Dl_info info;
    if (pc && dladdr(reinterpret_cast<void*>(pc), &info) && info.dli_fbase)
        return pc - reinterpret_cast<uintptr_t>(info.dli_fbase);
    return pc;
}
K3_NOCHECK inline void report(unsigned tool, uintptr_t pc, uintptr_t pc2, const char* fmt, ...) {
    for (auto& s : seen) if (s.first == tool && s.second == pc && pc) { ++dropped; return; }
    seen.emplace_back(tool, pc);
    if (nfindings >= MAX_FINDINGS) { ++dropped; return; }
    ++nfindings;
    char msg[600];
    va_list ap; va_start(ap, fmt); vsnprintf(msg, sizeof msg, fmt, ap); va_end(ap);
    for (char* c = msg; *c; ++c) if (*c == '\n' || *c == '|') *c = ' ';
    char head[160];
    snprintf(head, sizeof head, "%u|%lx|%lx|%u|%u|%u|%u|", tool, (unsigned long)lib_offset(pc),
             (unsigned long)lib_offset(pc2), cur, blockIdx.x, blockIdx.y, blockIdx.z);
    findings += head; findings += msg; findings += '\n';
}

// ---- tracked memory: global buffers (registered per launch) and shared-memory slots
struct Acc { uintptr_t pc; uint32_t ep; uint16_t tid; uint16_t wc; };
// Per 4-byte word: the last write; the first read of this barrier interval, whether other threads read too
// (many), whether readers came from more than one warp (warps), and the latest warp-sync count of a read.
struct Shadow { Acc w, r; uint16_t rmaxwc; uint8_t many, warps; };
struct Region {
    uintptr_t beg = 0, end = 0, lo = 0, hi = 0;   // [beg, end) valid; [lo, hi) with its redzones
    bool shared = false;
    std::string name;
    uint8_t* init = nullptr;               // one byte per byte: written since the launch / block began
    std::vector<uint8_t> own_init;
    Shadow* race = nullptr;                // one per 4-byte word
    std::vector<Shadow> own_race;
    std::shared_ptr<void> raw_race;        // calloc'd (untouched pages stay free)
};
inline std::vector<Region> globals, slots;
constexpr size_t SHARED_ARENA = 1 << 20, DYN_MAX = 232448, RZ = 64;
alignas(256) inline unsigned char shared_arena[SHARED_ARENA];
alignas(256) inline unsigned char dyn_arena[DYN_MAX + 256];
inline size_t arena_next = RZ;
inline size_t dyn_bytes = 0;
inline uint32_t epoch = 1;                 // bumped at every block start and every completed __syncthreads
inline std::vector<uint16_t> warp_count;   // completed warp syncs of each warp in this block

// The hot path sees a plain array of the tracked ranges (no STL: its inline code is instrumented too, and
// every call of it would come back through the callbacks); rebuilt whenever a region is added or removed.
struct Range { uintptr_t lo, hi; Region* r; };
constexpr unsigned MAX_RANGES = 512;
inline Range ranges[MAX_RANGES];
inline unsigned nranges = 0;
K3_NOCHECK inline void rebuild_ranges() {
    nranges = 0;
    for (auto* v : {&slots, &globals})
        for (auto& r : *v) if (nranges < MAX_RANGES) ranges[nranges++] = Range{r.lo, r.hi, &r};
}
K3_NOCHECK inline void make_slot(Region& r, uintptr_t beg, size_t bytes, uintptr_t lo, uintptr_t hi) {
    r.beg = beg; r.end = beg + bytes; r.lo = lo; r.hi = hi; r.shared = true;
    r.own_init.assign(bytes, 0); r.init = r.own_init.data();
    r.own_race.assign((bytes + 3) / 4, Shadow{}); r.race = r.own_race.data();
}
K3_SHARED_API void* register_slot(size_t bytes, size_t align, const char* name, const char* file, int line) {
    busy = true;
    align = std::max<size_t>(align, 16);
    size_t off = (arena_next + align - 1) / align * align;
    if (off + bytes + RZ > SHARED_ARENA) { fprintf(stderr, "k3emu: shared arena full\n"); abort(); }
    Region r;
    const uintptr_t base = reinterpret_cast<uintptr_t>(shared_arena);
    make_slot(r, base + off, bytes, base + off - RZ, base + off + bytes + RZ);
    const char* slash = strrchr(file, '/');
    r.name = std::string("__shared__ ") + name + " (" + (slash ? slash + 1 : file) + ":" + std::to_string(line) + ", "
             + std::to_string(bytes) + " bytes)";
    memset(reinterpret_cast<void*>(r.beg), 0xff, bytes);   // poisoned: every float a NaN
    slots.push_back(std::move(r));
    rebuild_ranges();
    arena_next = off + bytes + RZ;
    busy = false;
    return reinterpret_cast<void*>(base + off);
}
K3_SHARED_API void* dyn_arena_base() { return dyn_arena; }

// a -> now is ordered when a barrier of the block lies between (another epoch), it is the same thread, or the
// same warp with a __syncwarp / warp-synchronous call between
K3_NOCHECK inline bool ordered(const Acc& a, unsigned tid, unsigned wc) {
    return a.ep != epoch || a.tid == tid || (a.tid / 32 == tid / 32 && a.wc != wc);
}
K3_NOCHECK inline void check_race(Region& r, uintptr_t a, size_t n, bool write, uintptr_t pc) {
    const char* what = r.shared ? "shared" : "global";
    const unsigned tid = cur, wc = warp_count[tid / 32];
    for (uintptr_t w = (a - r.beg) / 4; w <= (a + n - 1 - r.beg) / 4; ++w) {
        Shadow& s = r.race[w];
        const unsigned off = unsigned(w * 4);
        if (s.w.ep == epoch && !ordered(s.w, tid, wc))
            report(RACECHECK, pc, s.w.pc, "%s hazard on %s memory: thread %u %s %s at +%u, written by thread %u "
                   "in the same barrier interval (no __syncthreads/__syncwarp between the two accesses)",
                   write ? "write-after-write" : "read-after-write", what, tid, write ? "writes" : "reads",
                   r.name.c_str(), off, unsigned(s.w.tid));
        if (write) {
            if (s.r.ep == epoch) {
                bool hazard;
                if (s.warps) hazard = true;                                   // readers in two warps or more
                else if (!s.many) hazard = !ordered(s.r, tid, wc);
                else hazard = s.r.tid / 32 != tid / 32 || s.rmaxwc == wc;     // readers all in one warp
                if (hazard)
                    report(RACECHECK, pc, s.r.pc, "write-after-read hazard on %s memory: thread %u writes %s at +%u, "
                           "read by thread %u%s in the same barrier interval", what, tid, r.name.c_str(), off,
                           unsigned(s.r.tid), s.many ? " and others" : "");
            }
            s.w = Acc{pc, epoch, uint16_t(tid), uint16_t(wc)};
            s.r.ep = 0;
        } else if (s.r.ep != epoch) {
            s.r = Acc{pc, epoch, uint16_t(tid), uint16_t(wc)}; s.rmaxwc = uint16_t(wc); s.many = 0; s.warps = 0;
        } else if (s.r.tid != tid) {
            s.many = 1;
            if (s.r.tid / 32 != tid / 32) s.warps = 1;
            s.rmaxwc = std::max<uint16_t>(s.rmaxwc, uint16_t(wc));
        }
    }
}
K3_NOCHECK inline void check_access(Region* r, uintptr_t a, size_t n, bool write, uintptr_t pc) {
    if (!r) {
        if (tools & MEMCHECK) report(MEMCHECK, pc, 0, "out-of-bounds %s of %zu bytes in shared memory, outside every "
                                     "__shared__ variable (thread %u)", write ? "write" : "read", n, cur);
        return;
    }
    if (a < r->beg || a + n > r->end) {
        if (tools & MEMCHECK) {
            if (a >= r->end)
                report(MEMCHECK, pc, 0, "out-of-bounds %s of %zu bytes by thread %u: %zu bytes past the end of %s",
                       write ? "write" : "read", n, cur, size_t(a - r->end), r->name.c_str());
            else
                report(MEMCHECK, pc, 0, "out-of-bounds %s of %zu bytes by thread %u: %zd bytes from the start of %s "
                       "(%zu bytes)", write ? "write" : "read", n, cur, ssize_t(a - r->beg), r->name.c_str(),
                       size_t(r->end - r->beg));
        }
        return;
    }
    const size_t off = a - r->beg;
    if (r->init) {
        if (write) memset(r->init + off, 1, n);
        else if (tools & INITCHECK) {
            for (size_t i = 0; i < n; ++i) if (!r->init[off + i]) {
                report(INITCHECK, pc, 0, "thread %u reads %zu bytes of %s at +%zu, never written %s", cur, n,
                       r->name.c_str(), off + i, r->shared ? "in this block (shared memory starts poisoned: NaN)"
                       : "since the buffer was allocated (it holds the NaN poison)");
                break;
            }
        }
    }
    if ((tools & RACECHECK) && r->race && !atomic_depth) check_race(*r, a, n, write, pc);
}
// every access of the instrumented code comes here first; the checker's own accesses (its vectors and strings
// are inline code of this translation unit, so instrumented too) return at once
__attribute__((no_sanitize_address, no_sanitize("alignment"), always_inline))
inline void access(uintptr_t a, size_t n, bool write, uintptr_t pc) {
    if (busy || !tools) return;
    Region* hit = nullptr;
    for (unsigned i = 0; i < nranges; ++i)
        if (a >= ranges[i].lo && a < ranges[i].hi) { hit = ranges[i].r; break; }
    const uintptr_t arena = reinterpret_cast<uintptr_t>(shared_arena);
    if (!hit && (a < arena || a >= arena + SHARED_ARENA)) return;
    busy = true;
    check_access(hit, a, n, write, pc);
    busy = false;
}

// ---- fibers, barriers and the warp
struct Jump { jmp_buf b; };
inline ucontext_t start_ctx;
inline std::vector<ucontext_t> ctx;
inline std::vector<Jump> jumps;
inline jmp_buf sched;
inline std::vector<std::unique_ptr<char[]>> stacks;
inline std::vector<char> done, started;
inline unsigned long long events = 0;
inline void (*body)(const char*) = nullptr;
inline const char* body_args = nullptr;
inline unsigned nthreads = 0;
struct Block { unsigned count = 0, size = 0, gen = 0, exited = 0; uintptr_t site = 0; unsigned site_tid = 0; };
inline Block block;
// A group of lanes meeting at a warp-synchronous call with one mask; a warp may have several at once (disjoint
// masks: two half-warps each shuffling within itself).
struct WarpGroup {
    unsigned pending = 0, arrived = 0, gen = 0;     // pending == 0: the slot is free
    uintptr_t site = 0; unsigned first = 0; const char* what = nullptr;
};
constexpr unsigned MAX_GROUPS = 8;
struct Warp {
    unsigned exited = 0, present = 0;
    WarpGroup groups[MAX_GROUPS];
    uint64_t val[32] = {}, res[32] = {};          // each lane's value in, its result out
    int src[32] = {};                              // the lane each lane reads
    unsigned part[32] = {}, ballot[32] = {};       // per lane: who took part in its step, and their predicates
};
inline std::vector<Warp> warps;
K3_NOCHECK inline void yield() { if (!_setjmp(jumps[cur].b)) _longjmp(sched, 1); }

K3_SHARED_API void sync_block(uintptr_t pc) {
    const unsigned my = block.gen;
    ++events;
    if (block.count == 0) { block.site = pc; block.site_tid = cur; }
    else if (pc != block.site && (tools & SYNCCHECK))
        report(SYNCCHECK, pc, block.site, "divergent __syncthreads: thread %u waits at this barrier while thread %u "
               "waits at another one", cur, block.site_tid);
    if (++block.count == block.size) {
        if (block.exited && (tools & SYNCCHECK))
            report(SYNCCHECK, pc, 0, "__syncthreads not reached by every thread of the block: %u of %u threads "
                   "had exited before it", block.exited, nthreads);
        block.count = 0; ++block.gen; ++epoch; return;
    }
    while (block.gen == my) yield();
    ++events;
}
K3_NOCHECK inline void warp_complete(Warp& w, WarpGroup& g) {
    const unsigned who = g.arrived;
    unsigned bits = 0;
    for (unsigned l = 0; l < 32; ++l) if ((who >> l & 1u) && w.val[l]) bits |= 1u << l;
    for (unsigned l = 0; l < 32; ++l) {
        if (!(who >> l & 1u)) continue;
        const unsigned s = unsigned(w.src[l]) % 32;
        w.res[l] = (who >> s & 1u) ? w.val[s] : w.val[l];
        w.part[l] = who; w.ballot[l] = bits;
    }
    g.pending = 0; g.arrived = 0; ++g.gen; ++warp_count[&w - warps.data()];
}
// One warp-synchronous step for the calling lane with `mask`, its value and the lane it reads: when it returns,
// w.res / w.part / w.ballot [lane] hold the result, the lanes that took part and their predicates.
K3_NOCHECK inline void warp_sync(unsigned mask, uintptr_t pc, const char* what, uint64_t value, int src) {
    const unsigned wi = cur / 32, lane = cur % 32;
    Warp& w = warps[wi];
    ++events;
    if (!(mask >> lane & 1u) && (tools & SYNCCHECK))
        report(SYNCCHECK, pc, 0, "%s: mask 0x%08x does not name the calling lane %u (warp %u)", what, mask, lane, wi);
    mask |= 1u << lane;
    if ((mask & ~w.present) && (tools & SYNCCHECK))
        report(SYNCCHECK, pc, 0, "%s: mask 0x%08x names lanes 0x%08x beyond the block's last thread (warp %u)",
               what, mask, mask & ~w.present, wi);
    if ((mask & w.exited) && (tools & SYNCCHECK))
        report(SYNCCHECK, pc, 0, "%s: mask 0x%08x names lanes 0x%08x that have exited (warp %u, lane %u calling; "
               "undefined on a GPU)", what, mask, mask & w.exited, wi, lane);
    mask &= w.present;
    // sm_70 and later let the lanes of a mask meet at different call sites of the same intrinsic (the compiler
    // duplicates calls, too); an overlapping but different mask, or another intrinsic, is an error
    WarpGroup* g = nullptr;
    for (auto& c : w.groups) if (c.pending & mask) { g = &c; break; }
    if (g) {
        if ((g->pending != mask || strcmp(g->what, what) != 0) && (tools & SYNCCHECK))
            report(SYNCCHECK, pc, g->site, "%s: lanes of warp %u diverge: lane %u (mask 0x%08x) and lane %u (%s, "
                   "mask 0x%08x) wait at different warp-synchronous calls or masks", what, wi, lane, mask, g->first,
                   g->what, g->pending);
        g->pending |= mask;
    } else {
        for (auto& c : w.groups) if (!c.pending) { g = &c; break; }
        if (!g) { fprintf(stderr, "k3emu: more than %u lane groups of one warp wait at once\n", MAX_GROUPS); abort(); }
        g->pending = mask; g->arrived = 0; g->site = pc; g->first = lane; g->what = what;
    }
    w.val[lane] = value; w.src[lane] = src;
    g->arrived |= 1u << lane;
    const unsigned my = g->gen;
    if ((g->pending & ~(g->arrived | w.exited)) == 0) { warp_complete(w, *g); }
    else {
        while (g->gen == my) yield();
        ++events;
    }
}
K3_NOCHECK inline void thread_exit() {
    const unsigned wi = cur / 32, lane = cur % 32;
    Warp& w = warps[wi];
    w.exited |= 1u << lane;
    for (auto& g : w.groups) {
        if (!(g.pending >> lane & 1u)) continue;
        if (tools & SYNCCHECK)
            report(SYNCCHECK, g.site, 0, "lane %u of warp %u exited while lanes 0x%08x wait for it at %s", lane, wi,
                   g.arrived, g.what);
        if ((g.pending & ~(g.arrived | w.exited)) == 0) warp_complete(w, g);
    }
    ++block.exited; --block.size;
    if (block.count && block.count == block.size) {
        if (tools & SYNCCHECK)
            report(SYNCCHECK, block.site, 0, "__syncthreads not reached by every thread of the block: thread %u "
                   "exited while %u threads wait at it", cur, block.count);
        block.count = 0; ++block.gen; ++epoch;
    }
}
K3_NOCHECK inline void fiber_main() {
    body(body_args);
    done[cur] = 1; ++events;
    thread_exit();
    _longjmp(sched, 1);
}
K3_NOCHECK inline void block_begin() {
    ++epoch;
    for (auto& s : slots) {
        memset(reinterpret_cast<void*>(s.beg), 0xff, s.end - s.beg);
        std::fill(s.own_init.begin(), s.own_init.end(), 0);
    }
    std::fill(warp_count.begin(), warp_count.end(), 0);
}
// 0 = every block ran to the end; 1 = a block deadlocked
K3_SHARED_API int run_grid(unsigned gx, unsigned gy, unsigned gz, unsigned nt, void (*fn)(const char*),
                          const char* args) {
    blockDim = {nt, 1, 1}; gridDim = {gx, gy, gz}; body = fn; body_args = args; nthreads = nt;
    ctx.assign(nt, ucontext_t{}); jumps.assign(nt, Jump{}); done.assign(nt, 0); started.assign(nt, 0);
    while (stacks.size() < nt) stacks.emplace_back(new char[STACK]);
    warp_count.assign((nt + 31) / 32, 0);
    getcontext(&start_ctx);
    for (unsigned z = 0; z < gz; ++z) for (unsigned y = 0; y < gy; ++y) for (unsigned x = 0; x < gx; ++x) {
        blockIdx = {x, y, z};
        block = Block{0, nt, 0, 0, 0, 0};
        warps.assign((nt + 31) / 32, Warp{});
        for (unsigned w = 0; w < warps.size(); ++w) {
            const unsigned n = std::min(32u, nt - 32 * w);
            warps[w].present = n == 32 ? 0xffffffffu : (1u << n) - 1;
        }
        block_begin();
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
            if (alive && events == before) {
                if (tools & SYNCCHECK)
                    report(SYNCCHECK, block.count ? block.site : 0, 0, "deadlock: %u threads wait at __syncthreads and "
                           "the rest of the block can never reach it", block.count);
                return 1;
            }
        }
    }
    return 0;
}

K3_SHARED_API void sync_warp(unsigned mask, uintptr_t pc) { warp_sync(mask, pc, "__syncwarp", 0, int(cur % 32)); }
K3_SHARED_API uint64_t shfl(unsigned mask, uint64_t v, int src, uintptr_t pc, const char* what) {
    const unsigned lane = cur % 32, wi = cur / 32;
    warp_sync(mask, pc, what, v, src);
    const unsigned s = unsigned(src) % 32;
    Warp& w = warps[wi];
    if (s != lane && !((mask & w.part[lane]) >> s & 1u)) {
        if (tools & SYNCCHECK)
            report(SYNCCHECK, pc, 0, "%s: lane %u of warp %u reads lane %u, which %s (mask 0x%08x): the value is "
                   "undefined on a GPU", what, lane, wi, s, !(mask >> s & 1u) ? "is not in the mask"
                   : (w.exited >> s & 1u) ? "has exited" : "did not take part", mask);
        return v;
    }
    return w.res[lane];
}
// the lanes of `mask` that took part whose predicate is true; *voters: the lanes that took part
K3_SHARED_API unsigned vote(unsigned mask, int pred, uintptr_t pc, const char* what, unsigned* voters) {
    const unsigned lane = cur % 32;
    Warp& w = warps[cur / 32];
    warp_sync(mask, pc, what, pred ? 1 : 0, int(lane));
    *voters = mask & w.part[lane];
    return w.ballot[lane] & *voters;
}
K3_SHARED_API unsigned active_mask() { return warps[cur / 32].present & ~warps[cur / 32].exited; }
}  // namespace emu

// ---- the host side (called through ctypes by k3cuda.sanitize)
// (the checker is `busy` throughout: its vectors move while they change)
K3_API K3_NOCHECK void k3emu_begin(unsigned tools, size_t dyn_bytes) {
    emu::busy = true;
    emu::tools = tools; emu::globals.clear(); emu::rebuild_ranges();
    emu::findings.clear(); emu::nfindings = 0; emu::dropped = 0; emu::seen.clear();
    const uintptr_t base = reinterpret_cast<uintptr_t>(emu::dyn_arena);
    emu::Region* dyn = nullptr;
    for (auto& r : emu::slots) if (r.beg == base) dyn = &r;
    if (!dyn) { emu::slots.emplace_back(); dyn = &emu::slots.back(); }
    emu::make_slot(*dyn, base, dyn_bytes, base, base + emu::DYN_MAX + 256);
    dyn->name = "extern __shared__ (dynamic shared memory, " + std::to_string(dyn_bytes) + " bytes)";
    emu::dyn_bytes = dyn_bytes;
    emu::rebuild_ranges();
    emu::busy = false;
}
// a global buffer [beg, beg + n) with `rz` bytes of redzone on each side; init: one byte per byte (1 = written)
K3_API K3_NOCHECK void k3emu_buffer(uintptr_t beg, size_t n, size_t rz, uint8_t* init, const char* name) {
    emu::busy = true;
    emu::globals.emplace_back();
    emu::Region& r = emu::globals.back();
    r.beg = beg; r.end = beg + n; r.lo = beg - rz; r.hi = beg + n + rz; r.name = name; r.init = init;
    if (emu::tools & emu::RACECHECK) {
        r.raw_race.reset(calloc((n + 3) / 4 + 1, sizeof(emu::Shadow)), free);
        r.race = static_cast<emu::Shadow*>(r.raw_race.get());
    }
    emu::rebuild_ranges();
    emu::busy = false;
}
K3_API K3_NOCHECK const char* k3emu_findings(unsigned* dropped) {
    *dropped = emu::dropped; return emu::findings.c_str();
}
K3_API K3_NOCHECK void k3emu_end() {
    emu::busy = true;
    emu::tools = 0; emu::globals.clear(); emu::globals.shrink_to_fit();
    emu::rebuild_ranges();
    emu::busy = false;
}

// ---- the instrumentation callbacks (no sanitizer runtime is linked)
extern "C" {
#define K3_CB(n) \
    K3_API K3_NOCHECK void __asan_load##n##_noabort(uintptr_t a) { emu::access(a, n, false, K3_PC); } \
    K3_API K3_NOCHECK void __asan_store##n##_noabort(uintptr_t a) { emu::access(a, n, true, K3_PC); }
K3_CB(1) K3_CB(2) K3_CB(4) K3_CB(8) K3_CB(16)
K3_API K3_NOCHECK void __asan_loadN_noabort(uintptr_t a, size_t n) { emu::access(a, n, false, K3_PC); }
K3_API K3_NOCHECK void __asan_storeN_noabort(uintptr_t a, size_t n) { emu::access(a, n, true, K3_PC); }
K3_API K3_NOCHECK void __asan_register_globals(void*, size_t) {}
K3_API K3_NOCHECK void __asan_unregister_globals(void*, size_t) {}
K3_API K3_NOCHECK void __asan_handle_no_return() {}
K3_API K3_NOCHECK void __asan_before_dynamic_init(const char*) {}
K3_API K3_NOCHECK void __asan_after_dynamic_init() {}
struct k3_src { const char* file; unsigned line, col; };
struct k3_type { unsigned short kind, info; char name[1]; };
struct k3_mismatch { k3_src loc; const k3_type* type; unsigned char log_align, check_kind; };
K3_API K3_NOCHECK void __ubsan_handle_type_mismatch_v1(k3_mismatch* d, uintptr_t p) {
    if (!(emu::tools & emu::MEMCHECK) || emu::busy) return;
    const uintptr_t align = uintptr_t(1) << d->log_align;
    if (!p || !d->log_align || (p & (align - 1)) == 0) return;
    emu::busy = true;
    emu::report(emu::MEMCHECK, K3_PC, 0, "misaligned access: thread %u accesses %s at address 0x%lx, which is not "
                "%lu-byte aligned (a misaligned address fault on a GPU)", emu::cur, d->type->name,
                (unsigned long)p, (unsigned long)align);
    emu::busy = false;
}
K3_API K3_NOCHECK void __ubsan_handle_type_mismatch_v1_abort(k3_mismatch* d, uintptr_t p) {
    __ubsan_handle_type_mismatch_v1(d, p);
}
}
"""

# -gdwarf-4: binutils 2.40's addr2line names the wrong file for GCC 12's DWARF 5 line tables;
# -fno-gnu-unique: the plain emulation's libraries define the same C++ names (STB_GNU_UNIQUE would merge them
# across libraries); --as-needed: the alignment handler comes from the runtime, not libubsan.
CHECK_FLAGS = ("-std=c++17", "-O1", "-gdwarf-4", "-fPIC", "-shared", "-Wno-unknown-pragmas", "-Wno-attributes",
               "-fsanitize=kernel-address", "--param", "asan-instrumentation-with-call-threshold=0",
               "--param", "asan-stack=0", "--param", "asan-globals=0", "-fsanitize=alignment",
               "-fno-gnu-unique", "-fvisibility=hidden", "-Wl,-z,defs", "-Wl,--as-needed")
RUNTIME_FLAGS = ("-std=c++17", "-O2", "-g", "-fPIC", "-shared", "-fno-gnu-unique", "-fvisibility=hidden")
_SHIM_FILES = ("emu_check.h", "emu_check_rt.cpp", "cuda_bf16.h", "driver.cpp")


class SanitizerError(RuntimeError):
    """A sanitized launch found errors; `findings` holds them (the message lists them all)."""

    def __init__(self, message: str, findings: list[Finding]):
        super().__init__(message)
        self.findings = findings


@dataclasses.dataclass(frozen=True)
class Finding:
    tool: str          # memcheck, racecheck, initcheck, synccheck
    where: str         # source location of the access or call ("rmsnorm.cu:29 (rmsnorm_f32)")
    other: str         # the other access of a race, the other barrier, ... ("" when none)
    thread: int
    block: tuple[int, int, int]
    message: str

    def __str__(self) -> str:
        also = f"; other access at {self.other}" if self.other else ""
        return (f"[{self.tool}] {self.where}: {self.message} (block {self.block}, thread {self.thread}){also}")


# ---- the __shared__ rewrite ---------------------------------------------------------------------------------
_SHARED = re.compile(r"\b(extern\s+)?__shared__\b")
_ALIGN = re.compile(r"__align__\s*\(\s*(\d+)\s*\)")
_DECL_FIRST = re.compile(r"^(.*?)\b(\w+)\s*((?:\[[^\]]*\]\s*)*)$", re.S)
_DECL_NEXT = re.compile(r"^\s*(\w+)\s*((?:\[[^\]]*\]\s*)*)$", re.S)


def _blank_comments(text: str) -> str:
    """The text with comments and string/char literals replaced by spaces (newlines kept): same offsets."""
    out = list(text)
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
        else:
            i += 1
            continue
        for k in range(i, j):
            if out[k] != "\n":
                out[k] = " "
        i = j
    return "".join(out)


def _split_top(decl: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, c in enumerate(decl):
        if c in "[(<":
            depth += 1
        elif c in "])>":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(decl[start:i])
            start = i + 1
    parts.append(decl[start:])
    return parts


def has_extern_shared(text: str) -> bool:
    """Whether the source declares dynamic shared memory (`extern __shared__`, outside comments)."""
    return any(m.group(1) for m in _SHARED.finditer(_blank_comments(text)))


def rewrite_shared(text: str, name: str = "<source>", extern_only: bool = False) -> str:
    """Each `__shared__ T a[N], b[M];` becomes `static auto& a = emu::shared_slot<T[N]>("a", ...); ...` (a slot of
    the checked shared arena, registered with its name and line) and `extern __shared__ T d[];` becomes
    `static T* const d = k3_dyn_shared<T>();` (the launch's dynamic shared memory). `extern_only`: only the
    latter (the plain emulation, where `__shared__` is `static`). The line count is kept, so g++'s lines are the
    source's. ValueError names a declaration it cannot parse."""
    blank = _blank_comments(text)
    out, pos = [], 0
    for m in _SHARED.finditer(blank):
        if m.start() < pos or (extern_only and not m.group(1)):
            continue
        end = blank.find(";", m.end())
        if end < 0:
            raise ValueError(f"{name}: __shared__ declaration without ';' at offset {m.start()}")
        decl = blank[m.end():end]
        aligns = [int(a) for a in _ALIGN.findall(decl)]
        decl = _ALIGN.sub(" ", decl).replace("static", " ")
        newlines = decl.count("\n")
        decl = " ".join(decl.split())
        parts = _split_top(decl)
        first = _DECL_FIRST.match(parts[0].strip())
        if not first or not first.group(1).strip():
            raise ValueError(f"{name}: cannot parse the __shared__ declaration {decl!r}")
        ctype, names = first.group(1).strip(), [(first.group(2), first.group(3).replace(" ", ""))]
        for p in parts[1:]:
            nxt = _DECL_NEXT.match(p)
            if not nxt:
                raise ValueError(f"{name}: cannot parse the __shared__ declarator {p!r} in {decl!r}")
            names.append((nxt.group(1), nxt.group(2).replace(" ", "")))
        if m.group(1):
            if len(names) != 1 or names[0][1] != "[]":
                raise ValueError(f"{name}: expected `extern __shared__ T name[];`, found {decl!r}")
            repl = f"static {ctype}* const {names[0][0]} = k3_dyn_shared<{ctype}>();"
        else:
            if any("[]" in dims for _, dims in names):
                raise ValueError(f"{name}: a __shared__ array without a size needs `extern`: {decl!r}")
            align = max(aligns, default=0)
            repl = " ".join(f'static auto& {v} = emu::shared_slot<{ctype}{dims}>("{v}", __FILE__, __LINE__, {align});'
                            for v, dims in names)
        out.append(text[pos:m.start()])
        out.append(repl + "\n" * newlines)
        pos = end + 1
    out.append(text[pos:])
    return "".join(out)


# ---- the build ----------------------------------------------------------------------------------------------
def _compile(cmd: list[str], what: str) -> None:
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        raise BuildError(f"{what} does not build:\n  {' '.join(cmd)}\n{run.stderr.strip()[:3000]}")


def _require_tools() -> str:
    gxx = shutil.which("g++")
    if not gxx:
        raise BuildError("g++ not found on PATH (the sanitized CPU emulation of the kernels needs it)")
    if not shutil.which("addr2line"):
        raise BuildError("addr2line not found on PATH (the sanitizers name source lines with it; install binutils)")
    return gxx


def runtime_library() -> Path:
    """Build (or find in the cache) the checking runtime shared by every checked kernel library; its path."""
    gxx = _require_tools()
    key = hashlib.sha256((CHECK_HEADER + CHECK_RUNTIME + " ".join(RUNTIME_FLAGS)).encode()).hexdigest()[:24]
    lib = cache_dir() / "emu-check" / f"libk3emu-check-{key}.so"
    if not lib.is_file():
        lib.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="k3emu-rt-") as tmp:
            folder = Path(tmp)
            (folder / "emu_check.h").write_text(CHECK_HEADER)
            (folder / "emu_check_rt.cpp").write_text(CHECK_RUNTIME)
            out = folder / "rt.so"
            _compile([gxx, *RUNTIME_FLAGS, "-o", str(out), str(folder / "emu_check_rt.cpp"), "-ldl"],
                     "the sanitizers' runtime (k3cuda.sanitize.CHECK_RUNTIME)")
            shutil.move(str(out), lib)
    return lib


def checked_library(spec) -> tuple[ctypes.CDLL, ctypes.CDLL, Path]:
    """Build (or fetch from the cache) the checked emulation of `spec`'s entries: (kernel library, runtime
    library, kernel library's path).

    Raises BuildError (with g++'s output) when g++ or addr2line is missing or the build fails: a sanitizer
    that cannot run is a failure, never a skip."""
    gxx = _require_tools()
    runtime = runtime_library()
    closure = source_closure(spec.path)
    names = [Path(n).name for n, _ in closure]
    if len(set(names)) != len(names):
        raise BuildError(f"{spec.source}: two included files share a name ({names}); the checked build flattens them")
    files = {Path(n).name: rewrite_shared(data.decode(), Path(n).name) for n, data in closure}
    driver = ['#include "emu_check.h"', f'#include "{names[0]}"']
    for e in spec.entries:
        driver.append(f"static void k3call_{e.name}(const char* buf) {{ emu::invoke(&{e.name}, buf); }}")
        driver.append(f"K3_API int emu_{e.name}(unsigned gx, unsigned gy, unsigned gz, unsigned nt, const char* buf) "
                      f"{{ return emu::run_grid(gx, gy, gz, nt, k3call_{e.name}, buf); }}")
    driver_src = "\n".join(driver) + "\n"
    flags = [*CHECK_FLAGS, *(f"-D{d}" for d in spec.defines)]
    h = hashlib.sha256((CHECK_HEADER + EMU_BF16 + driver_src + " ".join(flags) + runtime.name).encode())
    for fname, text in sorted(files.items()):
        h.update(fname.encode() + b"\0" + text.encode())
    lib = cache_dir() / "emu-check" / f"{spec.block}-{h.hexdigest()[:24]}.so"
    if not lib.is_file():
        with tempfile.TemporaryDirectory(prefix="k3emu-check-") as tmp:
            folder = Path(tmp)
            (folder / "emu_check.h").write_text(CHECK_HEADER)
            (folder / "cuda_bf16.h").write_text('#include "emu_check.h"\n' + EMU_BF16)
            (folder / "driver.cpp").write_text(driver_src)
            for fname, text in files.items():
                (folder / fname).write_text(text)
            out = folder / "lib.so"
            _compile([gxx, *flags, f"-I{tmp}", f"-I{KERNEL_DIR}", "-o", str(out), str(folder / "driver.cpp"),
                      str(runtime), f"-Wl,-rpath,{runtime.parent}"],
                     f"the sanitized CPU emulation of {spec.source}")
            shutil.move(str(out), lib)
    rt = ctypes.CDLL(str(runtime))
    rt.k3emu_begin.argtypes = [ctypes.c_uint, ctypes.c_size_t]
    rt.k3emu_buffer.argtypes = [ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_char_p]
    rt.k3emu_findings.argtypes = [ctypes.POINTER(ctypes.c_uint)]
    rt.k3emu_findings.restype = ctypes.c_char_p
    cdll = ctypes.CDLL(str(lib))
    for e in spec.entries:
        fn = getattr(cdll, f"emu_{e.name}")
        fn.argtypes = [ctypes.c_uint] * 4 + [ctypes.c_char_p]
        fn.restype = ctypes.c_int
    return cdll, rt, lib


# ---- device buffers with redzones and an init shadow ----------------------------------------------------------
class GuardedArray:
    """A device buffer of the sanitized emulation: its own allocation with REDZONE bytes each side (filled with
    0xfa) and one init byte per byte (1 = written). Same interface as testing.HostArray."""

    def __init__(self, a: np.ndarray, initialised: bool = True):
        a = np.asarray(a)
        nbytes = a.nbytes
        self._raw = np.full(nbytes + 2 * REDZONE + 256, 0xFA, np.uint8)
        start = (-self._raw.ctypes.data) % 256 + REDZONE
        self.a = np.frombuffer(self._raw.data, dtype=a.dtype, count=a.size, offset=start).reshape(a.shape)
        self.a[...] = a
        self.init = np.full(max(nbytes, 1), 1 if initialised else 0, np.uint8)

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
        self.init[...] = 1

    def poison(self) -> None:
        """NaN everywhere, and unwritten as far as initcheck is concerned."""
        self.a[...] = np.nan
        self.init[...] = 0


def tool_mask(tools) -> int:
    """The bit mask of `tools` (names from TOOLS); ValueError names an unknown one."""
    bad = [t for t in tools if t not in _TOOL_BITS]
    if bad:
        raise ValueError(f"sanitize: unknown tool(s) {bad}; expected a subset of {list(TOOLS)}")
    return sum(_TOOL_BITS[t] for t in set(tools))


def run_checked(libs: tuple[ctypes.CDLL, ctypes.CDLL, Path], spec, entry, grid, args, buffers, tools,
                shared: int = 0) -> None:
    """One checked launch. `buffers`: the live GuardedArrays (those the pointer arguments point into are
    registered). Raises SanitizerError with every finding, RuntimeError on a deadlock."""
    e = spec.entry(entry)
    if shared > DYN_SHARED_MAX:
        raise ValueError(f"{spec.block}/{entry}: {shared} bytes of dynamic shared memory, the most a block can "
                         f"have is {DYN_SHARED_MAX}")
    lib, rt, lib_path = libs
    buf = struct.pack(e.arg_format, *args)
    rt.k3emu_begin(tool_mask(tools), shared)
    keep = []
    try:
        pointers = [a for (c, _), a in zip(_arg_chars(e.arg_format), args, strict=True) if c == "P"]
        for i, p in enumerate(pointers):
            owner = next((b for b in buffers if b.gpudata <= p <= b.gpudata + b.a.nbytes), None)
            if owner is None:
                if p:   # an address no GuardedArray owns: its accesses would go unchecked
                    raise ValueError(f"{spec.block}/{entry}: pointer parameter {i} (0x{p:x}) is not a buffer of this "
                                     "sanitized emulation (allocate with k3cuda.runtime.to_device/empty_poisoned "
                                     "inside cpu_emulation(sanitize=...))")
                continue
            name = f"global buffer of pointer parameter {i} ({owner.a.nbytes} bytes)".encode()
            keep.append(name)
            rt.k3emu_buffer(owner.gpudata, owner.a.nbytes, REDZONE, owner.init.ctypes.data, name)
        rc = getattr(lib, f"emu_{entry}")(*grid, e.block_threads, buf)
        dropped = ctypes.c_uint(0)
        text = rt.k3emu_findings(ctypes.byref(dropped)).decode()
    finally:
        rt.k3emu_end()
    findings = parse_findings(text, lib_path)
    if findings:
        lines = [f"{spec.block}/{entry} (sanitized CPU emulation, grid {tuple(grid)}, {e.block_threads} threads): "
                 f"{len(findings)} finding(s)" + (f", {dropped.value} more at the same sites" if dropped.value else "")]
        lines += [f"  {f}" for f in findings]
        raise SanitizerError("\n".join(lines), findings)
    if rc:
        raise RuntimeError(f"{spec.block}/{entry} (sanitized CPU emulation): a block deadlocked at a barrier")


def _arg_chars(arg_format: str) -> list[tuple[str, int]]:
    return [(c, n) for c, n in parse_format(arg_format) if c != "x"]


def parse_findings(text: str, lib_path: Path) -> list[Finding]:
    """The shim's finding lines, with their program counters resolved to source lines."""
    rows = [line.split("|", 7) for line in text.splitlines() if line]
    pcs = sorted({int(r[i], 16) for r in rows for i in (1, 2) if int(r[i], 16)})
    where = _locate(lib_path, pcs)
    out, sites = [], set()
    for tool, pc, pc2, tid, bx, by, bz, msg in rows:
        f = Finding(_BIT_TOOLS.get(int(tool), tool), where.get(int(pc, 16), "?"),
                    where.get(int(pc2, 16), "") if int(pc2, 16) else "", int(tid), (int(bx), int(by), int(bz)), msg)
        if (f.tool, f.where, f.other) not in sites:   # one per source site (unrolled copies share a line)
            sites.add((f.tool, f.where, f.other))
            out.append(f)
    return out


def _locate(lib_path: Path, pcs: list[int]) -> dict[int, str]:
    """{pc: 'file:line (function) <- caller file:line ...'}: the inline chain without the shim's own frames."""
    if not pcs:
        return {}
    run = subprocess.run(["addr2line", "-e", str(lib_path), "-a", "-i", "-f", "-C",
                          *(hex(max(pc - 1, 0)) for pc in pcs)], capture_output=True, text=True)
    if run.returncode != 0:
        raise BuildError(f"addr2line failed on {lib_path}: {run.stderr.strip()}")
    chains: list[list[tuple[str, str]]] = []
    lines = run.stdout.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("0x"):
            chains.append([])
            i += 1
            continue
        if i + 1 < len(lines) and chains:
            chains[-1].append((lines[i].strip(), lines[i + 1].strip()))
        i += 2
    out = {}
    for pc, chain in zip(pcs, chains, strict=False):
        frames = []
        for func, loc in chain:
            file, _, line = loc.partition(":")
            base = Path(file).name
            if base in _SHIM_FILES or file.startswith("/usr") or base == "??":
                continue
            frames.append(f"{base}:{line.split(' ')[0]} ({func.split('(')[0]})")
        out[pc] = " <- ".join(frames[:3]) if frames else (chain[0][1] if chain else "?")
    return out
