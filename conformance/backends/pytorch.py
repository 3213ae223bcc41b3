"""The PyTorch baseline backends: "torch" (eager fp32), "torch-bf16" (the bf16 baseline of the gate table)
and "torch64" (float64, for agreement tests against k3ref).

Each implements the Backend protocol of docs/interfaces.md. Importing this module never needs torch:
`available()` says why not when it is missing. The device is CUDA when torch sees a GPU, else the CPU
(override with `make_backend(name, device=...)` or K3CONF_TORCH_DEVICE).
"""
from __future__ import annotations

import os
import statistics
import time

PRECISIONS = {"torch": "fp32", "torch-bf16": "bf16", "torch64": "fp64"}
_DTYPE_NAMES = {"torch": "float32", "torch-bf16": "bfloat16", "torch64": "float64"}
INSTALL_HINT = "pip install 'k3-conformance[torch]' (or `make setup`, which installs the CPU build)"


class TorchBackend:
    """Cores from k3torch.cores at one dtype on one device.

    name: "torch" | "torch-bf16" | "torch64"; precision: "fp32" | "bf16" | "fp64";
    warmup / repeats: untimed and timed calls of `time_core` (median reported).
    """

    def __init__(self, name: str, device: str | None = None, warmup: int = 2, repeats: int = 7):
        if name not in PRECISIONS:
            raise ValueError(f"backend name: expected one of {sorted(PRECISIONS)}, found {name!r}")
        self.name, self.precision = name, PRECISIONS[name]
        self.warmup, self.repeats = warmup, repeats
        self._device = device or os.environ.get("K3CONF_TORCH_DEVICE")
        self._cores = None
        self._copy_bw: float | None = None

    def __repr__(self) -> str:
        return f"TorchBackend({self.name!r}, device={self.device if self.available()[0] else None!r})"

    def available(self) -> tuple[bool, str]:
        """(True, "torch X on DEVICE") or (False, why): torch missing, or a CUDA device asked for but absent."""
        try:
            import torch
        except ImportError as e:
            return False, f"PyTorch is not installed ({e}); {INSTALL_HINT}"
        try:
            self.device
        except RuntimeError as e:   # torch.device() of a bad string, e.g. K3CONF_TORCH_DEVICE=gpu
            return False, f"device {self._device!r} is not a torch device ({str(e).splitlines()[0]}); use cpu or cuda[:N]"
        if self.device.type == "cuda" and not torch.cuda.is_available():
            return False, f"device {self.device} asked for, but torch {torch.__version__} sees no CUDA GPU"
        return True, f"torch {torch.__version__} {_DTYPE_NAMES[self.name]} on {self.device}"

    @property
    def device(self):
        import torch

        if self._device is None:
            self._device = "cuda" if torch.cuda.is_available() else "cpu"
        return torch.device(self._device)

    @property
    def dtype(self):
        import torch

        return getattr(torch, _DTYPE_NAMES[self.name])

    def cores(self):
        """k3ref.cores.Cores whose math cores are torch (numpy in, numpy out)."""
        ok, why = self.available()
        if not ok:
            raise RuntimeError(f"backend {self.name} is unavailable: {why}")
        if self._cores is None:
            from k3torch.cores import torch_cores

            self._cores = torch_cores(self.dtype, self.device)
        return self._cores

    def time_core(self, core: str, inputs: dict) -> float | None:
        """Median seconds of one call of `core` on device-resident inputs (`inputs`: the core's keyword
        arguments as numpy). Inputs move to the device once, outside the timed region; `warmup` untimed calls
        first; on CUDA each call is bracketed by events and synchronised. None for cores that are not math
        (attnres_hub)."""
        from k3torch.cores import TIMEABLE

        if core not in TIMEABLE:
            return None
        fn = getattr(self.cores(), core)
        prepared = fn.prepare(**inputs)
        return self._median_seconds(lambda: fn.compute(**prepared))

    def copy_bandwidth(self, nbytes: int | None = None) -> float:
        """Bytes/s of a large device copy (read + written both counted), median of `repeats`; cached.
        Default size: 64 MiB on the CPU (well past the caches), 1 GiB on a GPU."""
        if self._copy_bw is None:
            import torch

            nbytes = nbytes or (1 << 30 if self.device.type == "cuda" else 64 << 20)
            src = torch.ones(nbytes, dtype=torch.uint8, device=self.device)
            dst = torch.empty_like(src)
            self._copy_bw = 2 * nbytes / self._median_seconds(lambda: dst.copy_(src))
        return self._copy_bw

    def _median_seconds(self, fn) -> float:
        import torch

        for _ in range(self.warmup):
            fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
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


def make_backend(name: str, device: str | None = None) -> TorchBackend:
    """The torch baseline backend `name` ("torch" fp32, "torch-bf16", "torch64" fp64) on `device`
    (default: CUDA when available, else CPU)."""
    return TorchBackend(name, device=device)


__all__ = ["PRECISIONS", "TorchBackend", "make_backend"]
