"""Compiling the kernels with nvcc, the compile cache, and the CPU-side gates (no GPU needed).

- `nvcc_compile(spec, arch, kind)`: cubin or PTX bytes, cached by sha256 of (source + included headers + flags +
  nvcc version) under `$K3CUDA_CACHE` (default `~/.cache/k3cuda`). Every compile passes `-Xptxas -v`; its report
  is cached beside the output, so `ptxas_resources` costs nothing once the cubin is built.
- `ptxas_resources(spec, arch)`: registers, spills, stack frame and shared memory per entry.
- `ptx_entry_params(ptx, entry)`: (size, align) of each `.entry` parameter, read from the PTX.
- `check_abi(spec)`, `check_resources(spec, arch)`: lists of failures (empty = pass) for the gates.

Flags: -O3 -std=c++17 -arch=sm_XX -I k3cuda/kernels. `--use_fast_math` is NOT used: exact expf/tanhf/sqrtf are
part of what the conformance tolerances assume.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from .spec import KERNEL_DIR, KernelSpec, parse_format, register_budget

BASE_FLAGS = ("-O3", "-std=c++17")
KINDS = ("cubin", "ptx")
_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


class BuildError(RuntimeError):
    """nvcc is missing or failed; the message carries the command and nvcc's output."""


@dataclasses.dataclass(frozen=True)
class Resources:
    """ptxas's report for one entry on one arch (bytes, except registers)."""

    registers: int
    spill_stores: int
    spill_loads: int
    stack: int
    smem: int


@dataclasses.dataclass(frozen=True)
class Compiled:
    data: bytes      # the cubin or PTX
    log: str         # nvcc's stderr (the -Xptxas -v report)
    flags: tuple     # the full nvcc command line after the executable


def nvcc_path() -> str | None:
    """The nvcc on PATH (or $K3CUDA_NVCC), None when there is none."""
    return os.environ.get("K3CUDA_NVCC") or shutil.which("nvcc")


@functools.cache
def nvcc_version() -> str:
    """`nvcc --version`'s text (part of every cache key)."""
    nvcc = _require_nvcc()
    return subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout.strip()


def cache_dir() -> Path:
    """$K3CUDA_CACHE, or ~/.cache/k3cuda."""
    return Path(os.environ.get("K3CUDA_CACHE") or Path.home() / ".cache" / "k3cuda")


def source_closure(path: Path) -> list[tuple[str, bytes]]:
    """The source and every `#include "..."` header it pulls in (recursively, from its folder or KERNEL_DIR).

    Returns [(name, bytes)], the source first; the cache key hashes all of them.
    """
    seen: dict[str, bytes] = {}
    todo = [Path(path)]
    while todo:
        p = todo.pop(0)
        if str(p) in seen:
            continue
        if not p.is_file():
            raise BuildError(f"kernel source {p} not found")
        data = p.read_bytes()
        seen[str(p)] = data
        for name in _INCLUDE.findall(data.decode("utf-8", "replace")):
            for folder in (p.parent, KERNEL_DIR):
                if (folder / name).is_file():
                    todo.append(folder / name)
                    break
    return list(seen.items())


def nvcc_flags(spec: KernelSpec, arch: str, kind: str = "cubin", extra=()) -> tuple[str, ...]:
    """The nvcc arguments (without input/output names) for one spec, arch and output kind."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, found {kind!r}")
    if not re.fullmatch(r"sm_\d+a?", arch):
        raise ValueError(f"arch: expected 'sm_XX' (e.g. sm_90), found {arch!r}")
    defines = tuple(f"-D{d}" for d in spec.defines)
    return (*BASE_FLAGS, f"-arch={arch}", f"-I{KERNEL_DIR}", *defines, "-Xptxas", "-v", f"-{kind}", *extra)


def compile_spec(spec: KernelSpec, arch: str, kind: str = "cubin", extra=()) -> Compiled:
    """Compile (or fetch from the cache) one spec for one arch; raises BuildError with nvcc's output."""
    flags = nvcc_flags(spec, arch, kind, tuple(extra))
    h = hashlib.sha256()
    h.update(nvcc_version().encode())
    h.update("\0".join(flags).encode())
    for name, data in source_closure(spec.path):
        h.update(Path(name).name.encode() + b"\0" + data)
    key = h.hexdigest()
    folder = cache_dir()
    out, log = folder / f"{spec.block}-{arch}-{key[:24]}.{kind}", folder / f"{spec.block}-{arch}-{key[:24]}.log"
    if out.is_file() and log.is_file():
        return Compiled(out.read_bytes(), log.read_text(), flags)
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="k3cuda-") as tmp:
        target = Path(tmp) / f"out.{kind}"
        cmd = [_require_nvcc(), *flags, "-o", str(target), str(spec.path)]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            raise BuildError(f"nvcc failed for {spec.source} ({arch}, {kind}), exit {run.returncode}:\n"
                             f"  {' '.join(cmd)}\n{run.stderr.strip()}")
        data = target.read_bytes()
    _atomic_write(out, data)
    _atomic_write(log, run.stderr.encode())
    return Compiled(data, run.stderr, flags)


def nvcc_compile(spec: KernelSpec, arch: str, kind: str = "cubin", extra=()) -> bytes:
    """The cubin or PTX bytes for `spec` on `arch` (e.g. "sm_90"), from the cache when present."""
    return compile_spec(spec, arch, kind, extra).data


def parse_ptxas_report(log: str) -> dict[str, Resources]:
    """Parse `-Xptxas -v` output into {entry: Resources}."""
    out: dict[str, Resources] = {}
    current = None
    props: dict[str, int] = {}
    for line in log.splitlines():
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            current, props = m.group(1), {}
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and current:
            props.update(stack=int(m[1]), spill_stores=int(m[2]), spill_loads=int(m[3]))
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and current:
            smem = re.search(r"(\d+) bytes smem", line)
            out[current] = Resources(registers=int(m[1]), spill_stores=props.get("spill_stores", 0),
                                     spill_loads=props.get("spill_loads", 0), stack=props.get("stack", 0),
                                     smem=int(smem[1]) if smem else 0)
            current = None
    return out


def ptxas_resources(spec: KernelSpec, arch: str, extra=()) -> dict[str, Resources]:
    """{entry name: Resources} for every entry of `spec` compiled for `arch` (a missing entry raises BuildError)."""
    report = parse_ptxas_report(compile_spec(spec, arch, "cubin", extra).log)
    missing = [e.name for e in spec.entries if e.name not in report]
    if missing:
        raise BuildError(f"{spec.source} ({arch}): ptxas reported no entry {missing}; found {sorted(report)} "
                         "(is the entry extern \"C\" __global__?)")
    return report


_TYPE_SIZES = {"8": 1, "16": 2, "32": 4, "64": 8}
_FLOAT_CHARS = "fd"   # prepare() characters of floating-point parameters


def _entry_block(ptx_text: str, entry: str) -> tuple[str, str]:
    """(parameter list text, directives between ')' and '{') of `.entry entry(...)`."""
    m = re.search(r"\.entry\s+" + re.escape(entry) + r"\s*\((.*?)\)(.*?)\{", ptx_text, re.S)
    if not m:
        found = ptx_entries(ptx_text)
        raise ValueError(f"PTX has no .entry {entry!r}; entries found: {found}")
    return m.group(1), m.group(2)


def ptx_entries(ptx_text: str) -> list[str]:
    """Names of every `.entry` in PTX text, in order."""
    return re.findall(r"\.entry\s+(\w+)", ptx_text)


def ptx_entry_param_info(ptx_text: str, entry: str) -> list[dict]:
    """Each parameter of `.entry entry`: {'name', 'size', 'align', 'ptr', 'kind'} (ptr: PTX marked it a pointer;
    kind: 'f' for a .f32/.f64 parameter, 'b' for a by-value blob, else 'u' (.u/.s/.b integers and pointers)).

    Forms: `.param .u64 .ptr .align 1 name` (a pointer; `.align` there is the pointee's, the slot is 8-aligned),
    `.param .u32 name`, `.param .f32 name`, `.param .align 8 .b8 name[16]` (a by-value struct or array).
    nvcc 13 declares kernel pointers as plain `.param .u64` (no `.ptr`), so a pointer and an int64 look alike.
    """
    params, _ = _entry_block(ptx_text, entry)
    out = []
    for decl in filter(None, (d.strip() for d in params.split(","))):
        m = re.fullmatch(r"\.param\s+\.align\s+(\d+)\s+\.b8\s+(\w+)\[(\d+)\]", decl)
        if m:
            out.append({"name": m[2], "size": int(m[3]), "align": int(m[1]), "ptr": False, "kind": "b"})
            continue
        m = re.fullmatch(r"\.param\s+\.([usbf])(8|16|32|64)(\s+\.ptr.*?)?\s+(\w+)", decl)
        if not m:
            raise ValueError(f".entry {entry}: cannot parse parameter declaration {decl!r}")
        size = _TYPE_SIZES[m[2]]
        out.append({"name": m[4], "size": size, "align": size, "ptr": bool(m[3]),
                    "kind": "f" if m[1] == "f" else "u"})
    return out


def ptx_entry_params(ptx_text: str, entry: str) -> list[tuple[int, int]]:
    """[(size, align)] of each parameter of `.entry entry` in PTX text, in order."""
    return [(p["size"], p["align"]) for p in ptx_entry_param_info(ptx_text, entry)]


def ptx_layout(params: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(offset, size) of each parameter in the kernel's parameter buffer (each placed at its alignment)."""
    layout, off = [], 0
    for size, align in params:
        off = (off + align - 1) // align * align
        layout.append((off, size))
        off += size
    return layout


def ptx_entry_bounds(ptx_text: str, entry: str) -> tuple[int | None, int | None]:
    """(max threads per block, min blocks per SM) from `.maxntid` / `.minnctapersm` (None when absent)."""
    _, directives = _entry_block(ptx_text, entry)
    ntid = re.search(r"\.maxntid\s+(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?", directives)
    ncta = re.search(r"\.minnctapersm\s+(\d+)", directives)
    threads = None
    if ntid:
        threads = 1
        for g in ntid.groups():
            threads *= int(g) if g else 1
    return threads, (int(ncta[1]) if ncta else None)


def check_abi(spec: KernelSpec, arch: str = "sm_90", ptx_text: str | None = None) -> list[str]:
    """Compare each entry's PTX parameters with the wrapper's packing (EntrySpec.packed_layout()).

    Checks: the count, each (offset, size), float-vs-integer (PTX .f32/.f64 against 'f'/'d'), pointer-vs-value
    where PTX marks pointers (`.ptr`; nvcc 13 does not, so there a pointer and an int64 'q' look alike), and that
    __launch_bounds__ agrees with EntrySpec (`.maxntid == block_threads`; the register budget it implies
    >= max_registers). Returns failure messages; empty means pass.
    """
    ptx = ptx_text if ptx_text is not None else nvcc_compile(spec, arch, "ptx").decode()
    fails = []
    for e in spec.entries:
        where = f"{spec.block}/{e.name} ({arch})"
        try:
            info = ptx_entry_param_info(ptx, e.name)
        except ValueError as err:
            fails.append(f"{where}: {err}")
            continue
        kernel = ptx_layout([(p["size"], p["align"]) for p in info])
        packed = e.packed_layout()
        if len(kernel) != len(packed):
            fails.append(f"{where}: kernel takes {len(kernel)} parameters, wrapper packs {len(packed)} "
                         f"(arg_format {e.arg_format!r}); kernel (offset, size) {kernel}, wrapper {packed}")
            continue
        chars = [c for c, _ in _param_chars(e.arg_format)]
        for i, (p, k, w, c) in enumerate(zip(info, kernel, packed, chars, strict=True)):   # lengths checked above
            if k != w:
                fails.append(f"{where}: parameter {i} ({p['name']}): kernel (offset, size) {k}, "
                             f"wrapper packs {w} for {c!r} (arg_format {e.arg_format!r})")
            elif p["ptr"] and c != "P":
                fails.append(f"{where}: parameter {i} ({p['name']}) is a pointer in the kernel, "
                             f"wrapper packs {c!r} (arg_format {e.arg_format!r})")
            elif p["kind"] != "b" and (p["kind"] == "f") != (c in _FLOAT_CHARS):
                # same size, other type: an int packed where the kernel reads a float (or back) is garbage
                fails.append(f"{where}: parameter {i} ({p['name']}) is "
                             f"{'a float' if p['kind'] == 'f' else 'an integer or pointer'} in the kernel, "
                             f"wrapper packs {c!r} (arg_format {e.arg_format!r})")
        threads, min_blocks = ptx_entry_bounds(ptx, e.name)
        if threads != e.block_threads:
            fails.append(f"{where}: __launch_bounds__ max threads {threads}, EntrySpec.block_threads "
                         f"{e.block_threads}")
        elif min_blocks and register_budget(threads, min_blocks) < e.max_registers:
            fails.append(f"{where}: __launch_bounds__({threads}, {min_blocks}) leaves "
                         f"{register_budget(threads, min_blocks)} registers, EntrySpec.max_registers says "
                         f"{e.max_registers}")
    return fails


def check_resources(spec: KernelSpec, arch: str, extra=()) -> list[str]:
    """Spills, stack frame and registers of every entry on `arch` against its EntrySpec; failures (empty = pass)."""
    report = ptxas_resources(spec, arch, extra)
    fails = []
    for e in spec.entries:
        r, where = report[e.name], f"{spec.block}/{e.name} ({arch})"
        if r.spill_stores or r.spill_loads:
            fails.append(f"{where}: spills {r.spill_stores} bytes stores / {r.spill_loads} bytes loads, limit 0")
        if r.stack:
            fails.append(f"{where}: stack frame {r.stack} bytes (local memory), limit 0")
        if r.registers > e.max_registers:
            fails.append(f"{where}: uses {r.registers} registers, limit max_registers={e.max_registers}")
    return fails


def _param_chars(arg_format: str) -> list[tuple[str, int]]:
    return [(c, n) for c, n in parse_format(arg_format) if c != "x"]


def _require_nvcc() -> str:
    nvcc = nvcc_path()
    if not nvcc:
        raise BuildError("nvcc not found on PATH (install the CUDA toolkit or set K3CUDA_NVCC)")
    return nvcc


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
