"""The torch.distributed side of `k3ref.tp.Comm`: numpy arrays in, collectives over gloo (CPU) or NCCL (GPU)."""
from __future__ import annotations

import numpy as np


class CollectiveError(RuntimeError):
    """A collective did not complete (a peer died, raised, or exceeded the timeout)."""


class TorchComm:
    """all_reduce / all_gather of numpy arrays over `group` (None: the default process group).

    `device` is "cpu" for gloo, "cuda:<local rank>" for NCCL. Counts the collectives it ran (`calls`) so a
    failure says which one; `record`, when a list, receives every all_reduce input (this rank's partial sums).
    """

    def __init__(self, rank: int, size: int, device: str = "cpu", group=None):
        self.rank, self.size, self.device, self.group = rank, size, device, group
        self.calls = 0
        self.record: list | None = None

    def _tensor(self, a: np.ndarray):
        import torch  # noqa: PLC0415 -- optional: torch is needed only when ranks run

        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device, copy=True)

    def _run(self, op: str, fn):
        self.calls += 1
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - any transport failure ends this rank with the collective named
            raise CollectiveError(f"collective {op} #{self.calls} failed (a peer died, raised or timed out): "
                                  f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e

    def all_reduce(self, a: np.ndarray) -> np.ndarray:
        import torch.distributed as dist  # noqa: PLC0415 -- optional: torch is needed only when ranks run

        a = np.asarray(a)
        if self.record is not None:
            self.record.append(np.array(a, copy=True))
        t = self._tensor(a)
        self._run("all_reduce", lambda: dist.all_reduce(t, group=self.group))
        return t.cpu().numpy().astype(a.dtype, copy=False)

    def all_gather(self, a: np.ndarray) -> np.ndarray:
        import torch  # noqa: PLC0415 -- optional: torch is needed only when ranks run
        import torch.distributed as dist  # noqa: PLC0415 -- optional: torch is needed only when ranks run

        a = np.asarray(a)
        t = self._tensor(a)
        out = [torch.empty_like(t) for _ in range(self.size)]
        self._run("all_gather", lambda: dist.all_gather(out, t, group=self.group))
        return np.stack([o.cpu().numpy() for o in out]).astype(a.dtype, copy=False)

    def barrier(self) -> None:
        import torch.distributed as dist  # noqa: PLC0415 -- optional: torch is needed only when ranks run

        self._run("barrier", lambda: dist.barrier(group=self.group))
