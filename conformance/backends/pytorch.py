"""The PyTorch baseline backends: "torch" (eager fp32), "torch-bf16" (the bf16 baseline of the gate table)
and "torch64" (float64, for agreement tests against k3ref).

Each implements the Backend protocol of docs/interfaces.md with k3torch's cores on device tensors
(`tensors = "torch"`): `make_backend` hands out the TorchBackend behind conformance.backends.tensors'
TorchTensorBackend, which moves the judge's arrays to the device, checks what comes back and times the cores on
device-resident inputs, as for any tensor backend. `torch_cores` bundles k3torch's cores (NumPy in, NumPy out)
with k3ref's AttnRes hub into a `k3ref.cores.Cores`. Importing this module never needs torch: `available()` says
why not when it is missing. The device is CUDA when torch sees a GPU, else the CPU (override with
`make_backend(name, device=...)` or K3CONF_TORCH_DEVICE).
"""
from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from conformance.backends.protocol import ALL_CORES, BackendBase
from conformance.backends.tensors import TorchTensorBackend
from k3ref.cores import Cores, reference_cores

if TYPE_CHECKING:
    import torch

    from k3torch.cores import TorchCore

PRECISIONS = {"torch": "fp32", "torch-bf16": "bf16", "torch64": "fp64"}
_DTYPE_NAMES = {"torch": "float32", "torch-bf16": "bfloat16", "torch64": "float64"}
INSTALL_HINT = "pip install 'k3-conformance[torch]' (or `make setup`, which installs the CPU build)"


def torch_cores(dtype: torch.dtype, device: str | torch.device = "cpu", base: Cores | None = None) -> Cores:
    """Every math core from k3torch at one dtype on one device, as a `Cores` bundle; `attnres_hub` (the
    AttnRes bookkeeping, not math) comes from `base` (default: k3ref's reference cores)."""
    from k3torch.bundle import all_cores  # noqa: PLC0415 -- optional: k3torch needs torch

    return Cores(attnres_hub=(reference_cores() if base is None else base).attnres_hub, **all_cores(dtype, device))


class TensorCore:
    """A k3torch core on device tensors. k3torch validates its inputs as NumPy (shapes, finiteness, page tables),
    so `prepare` reads the tensors on the host, checks them and moves them back (bf16 values travel as float32,
    which holds them exactly); `compute` is the torch math, the part TorchTensorBackend times."""

    def __init__(self, core: TorchCore):
        self.core = core
        self.__doc__ = core.__doc__

    def prepare(self, *args, **kwargs) -> dict:
        return self.core.prepare(*map(_host, args), **{k: _host(v) for k, v in kwargs.items()})

    def compute(self, **prepared) -> Any:
        return self.core.compute(**prepared)

    def __call__(self, *args, **kwargs) -> Any:
        return self.compute(**self.prepare(*args, **kwargs))

    def __repr__(self) -> str:
        return f"TensorCore({self.core!r})"


def _host(value: Any) -> Any:
    """A tensor (or a list / tuple of them) as NumPy on the host; anything else as it is."""
    import torch  # noqa: PLC0415 -- optional: this module imports without torch

    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu")
        return (t.to(torch.float32) if t.dtype == torch.bfloat16 else t).numpy()
    if isinstance(value, list | tuple):
        return type(value)(map(_host, value))
    return value


class TorchBackend(BackendBase):
    """Cores from k3torch.cores at one dtype on one device, taking and returning tensors there.

    name: "torch" | "torch-bf16" | "torch64"; precision: "fp32" | "bf16" | "fp64";
    warmup / repeats: untimed and timed calls of `copy_bandwidth` (median reported).
    `device` is the torch device of the cores ("cpu" when torch is missing: it must answer without torch).
    """

    tensors = "torch"

    def __init__(self, name: str, device: str | None = None, warmup: int = 2, repeats: int = 7):
        if name not in PRECISIONS:
            raise ValueError(f"backend name: expected one of {sorted(PRECISIONS)}, found {name!r}")
        self.name, self.precision = name, PRECISIONS[name]
        self.warmup, self.repeats = warmup, repeats
        self._device = device or os.environ.get("K3CONF_TORCH_DEVICE")
        self._cores: dict[str, TorchCore] | None = None
        self._bundle: Cores | None = None
        self._copy_bw: float | None = None

    def __repr__(self) -> str:
        return f"TorchBackend({self.name!r}, device={self.torch_device if self.available()[0] else None!r})"

    @property
    def device(self) -> str:
        try:
            return str(self.torch_device)
        except (ImportError, RuntimeError):   # no torch, or a bad K3CONF_TORCH_DEVICE: available() says which
            return "cpu"

    def available(self) -> tuple[bool, str]:
        """(True, "torch X on DEVICE") or (False, why): torch missing, or a CUDA device asked for but absent."""
        try:
            import torch  # noqa: PLC0415 -- optional: this module imports without torch
        except ImportError as e:
            return False, f"PyTorch is not installed ({e}); {INSTALL_HINT}"
        try:
            device = self.torch_device
        except RuntimeError as e:   # torch.device() of a bad string, e.g. K3CONF_TORCH_DEVICE=gpu
            first = str(e).splitlines()[0]
            return False, f"device {self._device!r} is not a torch device ({first}); use cpu or cuda[:N]"
        if device.type == "cuda" and not torch.cuda.is_available():
            return False, f"device {device} asked for, but torch {torch.__version__} sees no CUDA GPU"
        return True, f"torch {torch.__version__} {_DTYPE_NAMES[self.name]} on {device}"

    @property
    def torch_device(self) -> torch.device:
        """The torch device of the cores: as asked for, else CUDA when torch sees a GPU, else the CPU."""
        import torch  # noqa: PLC0415 -- optional: this module imports without torch

        if self._device is None:
            self._device = "cuda" if torch.cuda.is_available() else "cpu"
        return torch.device(self._device)

    @property
    def dtype(self) -> torch.dtype:
        import torch  # noqa: PLC0415 -- optional: this module imports without torch

        return getattr(torch, _DTYPE_NAMES[self.name])

    def cores(self) -> Cores:
        """k3ref.cores.Cores whose math cores are k3torch's on device tensors (TensorCore), made once."""
        if self._bundle is None:
            tensor_cores = {name: TensorCore(core) for name, core in self._torch_cores().items()}
            self._bundle = Cores(attnres_hub=reference_cores().attnres_hub, **tensor_cores)
        return self._bundle

    def kernel_cores(self) -> frozenset[str]:
        """The cores k3torch supplies (every core when torch is missing: cores() then says why it cannot run)."""
        if not self.available()[0]:
            return ALL_CORES
        return frozenset(self._torch_cores()) | {"attnres_hub"}

    def _torch_cores(self) -> dict[str, TorchCore]:
        """k3torch's cores at this backend's dtype and device, made once."""
        ok, why = self.available()
        if not ok:
            raise RuntimeError(f"backend {self.name} is unavailable: {why}")
        if self._cores is None:
            from k3torch.bundle import all_cores  # noqa: PLC0415 -- optional: k3torch needs torch

            self._cores = all_cores(self.dtype, self.torch_device)
        return self._cores

    def copy_bandwidth(self, nbytes: int | None = None) -> float:
        """Bytes/s of a large device copy (read + written both counted), median of `repeats`; cached.
        Default size: 64 MiB on the CPU (well past the caches), 1 GiB on a GPU."""
        if self._copy_bw is None:
            import torch  # noqa: PLC0415 -- optional: this module imports without torch

            nbytes = nbytes or (1 << 30 if self.torch_device.type == "cuda" else 64 << 20)
            src = torch.ones(nbytes, dtype=torch.uint8, device=self.torch_device)
            dst = torch.empty_like(src)
            self._copy_bw = 2 * nbytes / self._median_seconds(lambda: dst.copy_(src))
        return self._copy_bw

    def _median_seconds(self, fn: Callable[[], Any]) -> float:
        import torch  # noqa: PLC0415 -- optional: this module imports without torch

        for _ in range(self.warmup):
            fn()
        if self.torch_device.type == "cuda":
            torch.cuda.synchronize(self.torch_device)
            times = []
            for _ in range(self.repeats):
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                stop.record()
                stop.synchronize()
                times.append(start.elapsed_time(stop) / 1e3)
            return statistics.median(times)
        times = []
        for _ in range(self.repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)


def make_backend(name: str, device: str | None = None) -> TorchTensorBackend:
    """The torch baseline backend `name` ("torch" fp32, "torch-bf16", "torch64" fp64) on `device`
    (default: CUDA when available, else CPU), with NumPy cores for the judge (TorchTensorBackend)."""
    return TorchTensorBackend(TorchBackend(name, device=device))


__all__ = ["PRECISIONS", "TensorCore", "TorchBackend", "make_backend", "torch_cores"]
