"""The PyCUDA side: a lazy context, cubin loading, launches, device buffers, NaN poisoning and timing.

Nothing here runs at import: PyCUDA is imported and the context made on the first call that needs them.
The context is the device's *primary* context (the one the CUDA runtime, and so PyTorch, uses), so buffers
and events are shared with a torch baseline in the same process. Kernels come from the compile cache
(`k3cuda.build.nvcc_compile`) for the device's arch (compute capability 9.0 -> sm_90) and are loaded with
`module_from_buffer`; entries are `prepare()`d with their EntrySpec.arg_format and launched with
`prepared_call` (explicit grid and block).
"""
from __future__ import annotations

import atexit
import os
import statistics
from collections.abc import Callable

import numpy as np

from .build import nvcc_compile
from .spec import KernelSpec, parse_format

NAN_F32_BITS = 0x7FC00000  # quiet NaN; memset_d32 with it poisons float32 buffers

_ctx = None
_dev = None
_modules: dict[tuple[KernelSpec, str], tuple[object, dict]] = {}


def device_index() -> int:
    """The GPU to use: $K3CUDA_DEVICE (default 0); a value that is not an index raises ValueError."""
    raw = os.environ.get("K3CUDA_DEVICE", "0").strip()
    if not raw.isdigit():
        raise ValueError(f"K3CUDA_DEVICE: expected a device index (0, 1, ...), found {raw!r}")
    return int(raw)


def driver():
    """pycuda.driver, with the context created and current (first call: cuInit + primary context push)."""
    global _ctx, _dev
    import pycuda.driver as cuda  # noqa: PLC0415 -- optional: importing k3cuda never needs a GPU or pycuda

    if _ctx is None:
        cuda.init()
        _dev = cuda.Device(device_index())
        _ctx = _dev.retain_primary_context()
        _ctx.push()
        atexit.register(_release)
    return cuda


def _release() -> None:
    global _ctx
    if _ctx is not None:
        try:
            _ctx.pop()
        except Exception:  # noqa: BLE001 - interpreter shutdown; nothing left to report to
            pass
        _ctx = None


def device():
    """The pycuda.driver.Device in use."""
    driver()
    return _dev


def device_arch() -> str:
    """'sm_XY' of the device (compute capability X.Y), the arch the cubins are built for."""
    major, minor = device().compute_capability()
    return f"sm_{major}{minor}"


def multiprocessor_count() -> int:
    """Number of SMs of the device."""
    cuda = driver()
    return device().get_attribute(cuda.device_attribute.MULTIPROCESSOR_COUNT)


def load(spec: KernelSpec) -> dict:
    """{entry name: prepared pycuda Function} for `spec`, loaded once per process from the cached cubin."""
    cuda = driver()
    arch = device_arch()
    key = (spec, arch)   # the whole spec: a test may load a mutant source under the same block name
    if key not in _modules:
        module = cuda.module_from_buffer(nvcc_compile(spec, arch, "cubin"))
        funcs = {}
        for e in spec.entries:
            f = module.get_function(e.name)
            f.prepare(e.arg_format)
            funcs[e.name] = f
        _modules[key] = (module, funcs)  # the module must outlive its functions
    return _modules[key][1]


def bind(spec: KernelSpec, entry: str, grid: tuple, args: tuple, shared: int = 0) -> Callable[[], None]:
    """Check the arguments once and return a zero-argument launcher of `entry` (default stream).

    Grid (gx, gy, gz), block (EntrySpec.block_threads, 1, 1); `args` are packed with EntrySpec.arg_format,
    device arrays passed as pointers (`ptr(a)`). The launcher does no Python work beyond `prepared_call`, so
    CUDA-event timings of small kernels are not inflated by host overhead. K3CUDA_SYNC=1 synchronises after
    every launch (a failing kernel then raises at its own launch).
    """
    e = spec.entry(entry)
    want = len([c for c, _ in parse_format(e.arg_format) if c != "x"])
    if len(args) != want:
        raise ValueError(f"{spec.block}/{entry}: expected {want} arguments for {e.arg_format!r}, found {len(args)}")
    grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
    if min(grid) < 1:
        raise ValueError(f"{spec.block}/{entry}: grid {grid} has an empty dimension")
    f = load(spec)[entry]
    if shared > 48 * 1024:   # dynamic shared memory past 48 KB must be opted into per function before launch
        f.set_attribute(driver().function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, shared)
    block = (e.block_threads, 1, 1)
    if os.environ.get("K3CUDA_SYNC") == "1":
        sync = driver().Context.synchronize

        def run_sync() -> None:
            f.prepared_call(grid, block, *args, shared_size=shared)
            sync()

        return run_sync
    return lambda: f.prepared_call(grid, block, *args, shared_size=shared)


def launch(spec: KernelSpec, entry: str, grid: tuple, args: tuple, shared: int = 0) -> None:
    """Launch `entry` of `spec` once (see `bind`)."""
    bind(spec, entry, grid, args, shared)()


def ptr(a) -> int:
    """The device address of a pycuda GPUArray (as the 'P' argument of a launch)."""
    return int(a.gpudata)


def to_device(a: np.ndarray, dtype=np.float32):
    """Upload a host array (converted to `dtype`, C-contiguous) as a GPUArray."""
    driver()
    import pycuda.gpuarray as gpuarray  # noqa: PLC0415 -- optional: importing k3cuda never needs a GPU or pycuda

    return gpuarray.to_gpu(np.ascontiguousarray(a, dtype=dtype))


def empty_poisoned(shape, dtype=np.float32):
    """A new device array filled with NaN (float32) so that an element the kernel never writes fails the check."""
    driver()
    import pycuda.gpuarray as gpuarray  # noqa: PLC0415 -- optional: importing k3cuda never needs a GPU or pycuda

    a = gpuarray.empty(tuple(int(s) for s in shape), dtype)
    poison(a)
    return a


def poison(a) -> None:
    """Fill a float32 device array with quiet NaN."""
    if a.dtype != np.float32:
        raise ValueError(f"poison: expected a float32 device array, found {a.dtype}")
    if a.size:
        driver().memset_d32(a.gpudata, NAN_F32_BITS, a.size)


class Launch:
    """A kernel launch with its data resident on the device.

    `launch()` runs it once (no transfers); `launch.outputs()` downloads the named output buffers;
    `launch.buffers` holds every device array by name (a test may `.set()` new inputs between launches).
    """

    def __init__(self, run: Callable[[], None], buffers: dict, outputs: tuple[str, ...]):
        self._run = run
        self.buffers = buffers
        self.output_names = outputs

    def __call__(self) -> None:
        self._run()

    def outputs(self) -> dict[str, np.ndarray]:
        return {name: self.buffers[name].get() for name in self.output_names}


def time_fn(fn: Callable[[], object], warmup: int = 10, iters: int = 50) -> float:
    """Median seconds of `fn()` over `iters` runs after `warmup`, timed with CUDA events on the default stream."""
    cuda = driver()
    for _ in range(warmup):
        fn()
    cuda.Context.synchronize()
    start, end = cuda.Event(), cuda.Event()
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.time_till(end) * 1e-3)
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 1 << 30, warmup: int = 3, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written (2 * nbytes / t)."""
    cuda = driver()
    src, dst = cuda.mem_alloc(nbytes), cuda.mem_alloc(nbytes)
    try:
        # 1.0f, not zeros: a copy of zero pages could be served faster than real data
        cuda.memset_d32(src, 0x3F800000, nbytes // 4)
        t = time_fn(lambda: cuda.memcpy_dtod(dst, src, nbytes), warmup, iters)
    finally:
        src.free()
        dst.free()
    return 2 * nbytes / t
